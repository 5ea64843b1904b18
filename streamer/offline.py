"""Offline transcription of whole recordings with the server's own segmentation.

A :class:`~streamer.core.session.Session` is driven synchronously: the audio goes in, each
decode job is answered at once by the recognizer, and the finals come out. Files are
therefore cut exactly as the live server would cut them (VAD, 7 s cap).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.diarization import DiarizationOptions
from streamer.core.protocol import Final, StreamOptions
from streamer.core.session import Session, SessionOptions
from streamer.core.session_speakers import SpeakerAnalyser
from streamer.core.vad import FrameClassifier, webrtc_classifier
from streamer.model.decode.decoding import decode_job
from streamer.model.serving.worker import SpeechRecognizer

logger = logging.getLogger(__name__)

CHUNK_SAMPLES = SAMPLE_RATE  # feed one second at a time


def transcribe_pcm(
    recognizer: SpeechRecognizer,
    pcm: np.ndarray,
    *,
    language: str = "auto",
    itn: bool = True,
    session_options: SessionOptions | None = None,
    vad_aggressiveness: int = 2,
    classifier: FrameClassifier | None = None,
    speakers: SpeakerAnalyser | None = None,
) -> Iterator[Final]:
    """Yield one :class:`Final` per utterance of 16 kHz int16 ``pcm``, in order.

    ``classifier``: a fresh per-stream VAD (a Silero one, say); None is webrtcvad at
    ``vad_aggressiveness``. ``speakers``: the speaker models, which label the finals
    (``diarize``) as a live stream's are labelled.
    """
    stream = StreamOptions(language=language, itn=itn, partials=False, diarize=bool(speakers))
    options = session_options or SessionOptions(model_name=recognizer.name)
    if speakers is not None:  # each utterance analysed once, on the audio it closed with
        diarization = options.diarization or DiarizationOptions()
        options = replace(options, diarization=diarization, speculative_finals=False)
    classify = classifier or webrtc_classifier(vad_aggressiveness)
    session = Session("offline", options, stream, classify)
    session.start()
    data = pcm.astype("<i2", copy=False).tobytes()
    step = CHUNK_SAMPLES * 2
    for offset in range(0, len(data), step):
        session.receive_audio(data[offset : offset + step])
        yield from _drain(recognizer, session, speakers)
    session.receive_text(b'{"type":"stop"}')
    yield from _drain(recognizer, session, speakers)


def _drain(
    recognizer: SpeechRecognizer, session: Session, speakers: SpeakerAnalyser | None
) -> Iterator[Final]:
    while True:
        if session.speakers is not None and speakers is not None:
            for speaker_job in session.speakers.jobs_to_submit():
                analysis = speakers.analyse(speaker_job.segment_id, speaker_job.pcm)
                session.speakers_finished(speaker_job.segment_id, analysis)
        jobs = session.jobs_to_submit()
        for job in jobs:
            result = decode_job(recognizer, job)  # a failure is logged there, reported in its final
            session.decode_finished(result)
        for message in session.messages_to_send():
            if isinstance(message, Final):
                yield message
        if not jobs:
            return
