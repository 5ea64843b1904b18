"""Offline transcription of whole recordings with the server's own segmentation.

A :class:`~streamer.core.session.Session` is driven synchronously: the audio goes in, each
decode job is answered at once by the recognizer, and the finals come out. Files are
therefore cut exactly as the live server would cut them (VAD, 7 s cap).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.protocol import Final, StreamOptions
from streamer.core.session import Session, SessionOptions
from streamer.core.vad import FrameClassifier, webrtc_classifier
from streamer.model.decoding import decode_job
from streamer.model.worker import SpeechRecognizer

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
) -> Iterator[Final]:
    """Yield one :class:`Final` per utterance of 16 kHz int16 ``pcm``, in order.

    ``classifier``: a fresh per-stream VAD (a Silero one, say); None is webrtcvad at
    ``vad_aggressiveness``.
    """
    stream = StreamOptions(language=language, itn=itn, partials=False)
    options = session_options or SessionOptions(model_name=recognizer.name)
    classify = classifier or webrtc_classifier(vad_aggressiveness)
    session = Session("offline", options, stream, classify)
    session.start()
    data = pcm.astype("<i2", copy=False).tobytes()
    step = CHUNK_SAMPLES * 2
    for offset in range(0, len(data), step):
        session.receive_audio(data[offset : offset + step])
        yield from _drain(recognizer, session)
    session.receive_text(b'{"type":"stop"}')
    yield from _drain(recognizer, session)


def _drain(recognizer: SpeechRecognizer, session: Session) -> Iterator[Final]:
    while True:
        jobs = session.jobs_to_submit()
        for job in jobs:
            result = decode_job(recognizer, job)  # a failure is logged there, reported in its final
            session.decode_finished(result)
        for message in session.messages_to_send():
            if isinstance(message, Final):
                yield message
        if not jobs:
            return
