"""Transcription in your own process: ``from streamer import Transcriber``.

No server and no sockets: the model is loaded here, and audio goes through the same
pieces the server runs, so the cuts and the text are the server's for the same samples
(a core :class:`~streamer.core.session.Session` per stream: resampling, the VAD, the
segmenter, partials and speculative finals; each decode job answered through the model
worker's one decode path, :func:`streamer.model.decode.decoding.decode_job`). The results are
protocol v1's own messages (:class:`~streamer.core.protocol.Final`,
:class:`~streamer.core.protocol.Partial`: text, times in ms, language, emotion, event,
timed words).

Decoding runs in the calling thread, synchronously; one :class:`Transcriber` (one model)
serves several streams and threads, one decode at a time. docs/python-api.md has the
examples, which the test suite runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from streamer.audio_io import load_audio, resample, to_int16
from streamer.core import hotwords as hw
from streamer.core.audio import SAMPLE_RATE
from streamer.core.protocol import (
    SUPPORTED_SAMPLE_RATES,
    Final,
    Partial,
    parse_stream_options,
)
from streamer.core.session import Session
from streamer.core.session_state import SessionOptions
from streamer.core.vad import DEFAULT_AGGRESSIVENESS, webrtc_classifier
from streamer.errors import ConfigError, InvalidHotwords, InvalidOption
from streamer.model.backends.loading import load_recognizer, preflight
from streamer.model.decode.decoding import decode_job
from streamer.model.interface import SpeechRecognizer
from streamer.model.options import RecognizerOptions

__all__ = ["Result", "Transcriber", "TranscriptionStream"]

Result = Partial | Final  # what a stream gives: partials (with partials on) and finals
_STOP = b'{"type":"stop"}'


class Transcriber:
    """A loaded model and the stream options every transcription starts from.

    ``model``: ``"auto"`` (the backend's default: sherpa-onnx's int8 export on ONNX
    Runtime, downloaded once), a local model directory or a hub id, as ``streamer serve
    --model``. ``hotwords``: phrases to favour, ``"phrase"`` or ``"phrase:boost"``
    strings or :class:`~streamer.core.hotwords.Hotword`. ``options`` overrides how the
    model loads (device, threads, quantization, cache directory); ``recognizer`` uses one
    already loaded (then ``model`` and ``options`` are ignored). Raises
    :class:`~streamer.errors.ConfigError` or :class:`~streamer.errors.ModelError` with a
    message for the user when the model cannot be had.
    """

    def __init__(
        self,
        model: str = "auto",
        *,
        language: str = "auto",
        itn: bool = True,
        hotwords: Iterable[str | hw.Hotword] = (),
        endpoint_ms: int | None = None,
        vad_aggressiveness: int = DEFAULT_AGGRESSIVENESS,
        options: RecognizerOptions | None = None,
        recognizer: SpeechRecognizer | None = None,
    ) -> None:
        params: dict[str, object] = {"language": language, "itn": itn}
        if endpoint_ms is not None:
            params["endpoint_ms"] = endpoint_ms
        try:
            self.stream = parse_stream_options(params)
        except InvalidOption as error:
            raise ConfigError(error.message) from None
        self.hotwords = _hotwords(hotwords)
        self.vad_aggressiveness = vad_aggressiveness
        if recognizer is None:
            load = options if options is not None else RecognizerOptions(model=model)
            preflight(load)
            recognizer = load_recognizer(load)
        self.recognizer = recognizer
        self._session_options = SessionOptions(model_name=recognizer.name)
        self._lock = threading.Lock()  # one decode at a time on the one model
        self._streams = 0

    def transcribe(
        self, audio: np.ndarray | str | Path, sample_rate: int = SAMPLE_RATE
    ) -> list[Final]:
        """The finals of a whole recording: an audio file (any format ``streamer
        transcribe`` reads) or mono samples (int16, or float in [-1, 1]) at
        ``sample_rate``. Finals without text (noise the VAD let through) are left out."""
        if isinstance(audio, str | Path):
            audio, sample_rate = load_audio(audio), SAMPLE_RATE
        elif sample_rate not in SUPPORTED_SAMPLE_RATES:  # resampled whole, then streamed
            floats = to_int16(np.asarray(audio).reshape(-1)).astype(np.float32) / 32768.0
            audio, sample_rate = to_int16(resample(floats, sample_rate, SAMPLE_RATE)), SAMPLE_RATE
        stream = self.stream_session(sample_rate, partials=False)
        results = [*stream.feed(audio), *stream.finish()]
        return [r for r in results if isinstance(r, Final) and r.text]

    def stream_session(
        self, sample_rate: int = SAMPLE_RATE, *, partials: bool = True
    ) -> TranscriptionStream:
        """A live stream: :meth:`TranscriptionStream.feed` chunks as they come (any
        size), get partials and finals back in order, then :meth:`~TranscriptionStream.
        finish`. ``sample_rate``: one protocol v1 takes (8000, 16000, 22050, 24000,
        32000, 44100, 48000; resampled to 16 kHz as the server does)."""
        if sample_rate not in SUPPORTED_SAMPLE_RATES:
            raise ConfigError(
                f"a stream's sample rate must be one of {SUPPORTED_SAMPLE_RATES}, not "
                f"{sample_rate} (transcribe() takes any)"
            )
        self._streams += 1
        return TranscriptionStream(self, sample_rate, partials, f"inproc-{self._streams}")

    def _decode(self, session: Session) -> Iterator[Result]:
        """Answer the session's jobs until it has none, yielding its results."""
        while True:
            jobs = session.jobs_to_submit()
            for job in jobs:
                with self._lock:
                    result = decode_job(self.recognizer, job)
                session.decode_finished(result)
            for message in session.messages_to_send():
                if isinstance(message, Partial | Final):
                    yield message
            if not jobs:
                return


class TranscriptionStream:
    """One stream's session; made by :meth:`Transcriber.stream_session`. Not for use
    from two threads at once."""

    def __init__(
        self, transcriber: Transcriber, sample_rate: int, partials: bool, name: str
    ) -> None:
        self._transcriber = transcriber
        self.sample_rate = sample_rate
        stream = replace(
            transcriber.stream,
            sample_rate=sample_rate,  # resampled by the session, as on the server
            partials=partials,
            hotwords=transcriber.hotwords,
        )
        classify = webrtc_classifier(transcriber.vad_aggressiveness)
        self._session = Session(name, transcriber._session_options, stream, classify)
        self._session.start()
        self._session.messages_to_send()  # the ready message: nobody to tell
        self._finished = False

    def feed(self, pcm: np.ndarray | bytes) -> list[Result]:
        """Add audio (mono int16 or float samples, or s16le bytes) at the stream's rate;
        returns the partials and finals it completed, in order."""
        if self._finished:
            raise ConfigError("the stream is finished: start another with stream_session()")
        samples = np.frombuffer(pcm, dtype="<i2") if isinstance(pcm, bytes) else pcm
        samples = to_int16(np.asarray(samples).reshape(-1))
        self._session.receive_audio(samples.astype("<i2", copy=False).tobytes())
        return list(self._transcriber._decode(self._session))

    def finish(self) -> list[Result]:
        """The end of the audio: the open utterance's final and any still owed."""
        if self._finished:
            return []
        self._finished = True
        self._session.receive_text(_STOP)
        return list(self._transcriber._decode(self._session))


def _hotwords(words: Iterable[str | hw.Hotword]) -> hw.Hotwords:
    checked = []
    try:
        for i, word in enumerate(words):
            if isinstance(word, hw.Hotword):
                checked.append(hw.hotword(word.phrase, word.boost, where=f"hotwords[{i}]"))
            else:
                checked.append(hw.phrase_with_boost(word, where=f"hotwords[{i}]"))
    except InvalidHotwords as error:
        raise ConfigError(error.message) from None
    return tuple({w.phrase: w for w in checked}.values())
