"""Test doubles used next to (never instead of) tests of the real recognizer and VAD."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.jobs import DecodeResult
from streamer.core.transcript import Transcript
from streamer.model.interface import RecognizerBase
from tests.timing import timeout_s

if TYPE_CHECKING:
    from streamer.model.backends.loading import LoadProgress

WORD_FRAMES = 8  # a word every 480 ms (an encoder frame is 60 ms; frames 0-3 are queries)


def loudness_classifier(threshold: float = 500.0):
    """A VAD stand-in for the I/O-free tests: a frame is speech when it is loud."""

    def is_speech(frame: np.ndarray) -> bool:
        return float(np.abs(frame.astype(np.int32)).mean()) > threshold

    return is_speech


def tone(ms: int, amplitude: int = 8000, rate: int = 16000) -> np.ndarray:
    t = np.arange(rate * ms // 1000) / rate
    return (amplitude * np.sin(2 * np.pi * 220 * t)).astype(np.int16)


def silence(ms: int, rate: int = 16000) -> np.ndarray:
    return np.zeros(rate * ms // 1000, dtype=np.int16)


class FakeRecognizer(RecognizerBase):
    """Answers with the audio length; can be slowed down or made to fail."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0, fail_when=None) -> None:
        self.delay_s = delay_s
        self.fail_when = fail_when  # predicate on the pcm array
        self.calls = 0
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def decode(self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True):
        with self.lock:
            self.calls += 1
            self.threads.add(threading.current_thread().name)
        if self.fail_when is not None and self.fail_when(pcm):
            raise RuntimeError("injected decode failure")
        if self.delay_s:
            time.sleep(self.delay_s)
        ms = pcm.size / 16
        raw = f"<|en|><|NEUTRAL|><|Speech|><|woitn|>audio {ms:.0f} ms"
        return Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=ms, decode_ms=0.0)


def load_slow_fake(delay_s: float, progress: LoadProgress) -> FakeRecognizer:
    """A model process's loader (importable by name in the child) that answers slowly."""
    return FakeRecognizer(delay_s=delay_s)


def wordy(pcm: np.ndarray) -> Transcript:
    """A transcript with one timed word per 480 ms of audio (w0 w1 ...)."""
    count = max(1, pcm.size * 1000 // SAMPLE_RATE // (WORD_FRAMES * 60))
    pieces = tuple(f"▁w{i}" for i in range(count))
    raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>" + " ".join(p[1:] for p in pieces)
    frames = tuple(4 + WORD_FRAMES * i for i in range(count))
    return Transcript.from_raw(
        raw,
        rich=raw,
        token_ids=tuple(range(count)),
        audio_ms=pcm.size / 16,
        decode_ms=0.0,
        token_frames=frames,
        token_confidences=(0.9,) * count,
        token_end_frames=tuple(f + WORD_FRAMES - 1 for f in frames),
        token_pieces=pieces,
    )


class WordyRecognizer(RecognizerBase):
    """Answers one timed word per 480 ms of audio (for diarization: words to label)."""

    name = "wordy"

    def decode(self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True):
        return wordy(pcm)


class HangingRecognizer(FakeRecognizer):
    """A decode that hangs (a stuck native call) until :attr:`release` is set, or 60 s (scaled)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def decode(self, pcm, *, language="auto", use_itn=True):
        self.release.wait(timeout_s(60))
        return super().decode(pcm, language=language, use_itn=use_itn)


class Dying(BaseException):
    """Not an Exception: the worker's per-decode handler does not catch it."""


class DyingRecognizer(FakeRecognizer):
    """Every decode kills the worker thread."""

    def decode(self, pcm, *, language="auto", use_itn=True):
        raise Dying("injected: the worker thread dies")


class Answers:
    """A result callback that collects results; :meth:`wait` blocks until ``n`` arrived."""

    def __init__(self, guard_s: float = 30.0) -> None:
        self.results: list[DecodeResult] = []
        self._cond = threading.Condition()
        self._guard_s = timeout_s(guard_s)  # how long to wait for what should arrive at once

    def __call__(self, result: DecodeResult) -> None:
        with self._cond:
            self.results.append(result)
            self._cond.notify_all()

    def wait(self, n: int) -> list[DecodeResult]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.results) >= n, self._guard_s), self.results
            return list(self.results)


class InstantWorker:
    """Answers a session's jobs at once: segment i's final is ``finals[i]``, and its
    partials grow word by word towards it (then run past it, so a partial may also say
    something the final does not)."""

    def __init__(self, session, finals: list[str]) -> None:
        self.session = session
        self.finals = finals
        self.partials: dict[int, int] = {}  # segment id -> partials answered
        self.held: list = []  # final jobs kept back (still "decoding")

    def answer(self, *, hold_finals: bool = False) -> None:
        while jobs := self.session.jobs_to_submit() or (not hold_finals and self.held):
            if jobs is self.held:
                self.held = []
            for job in jobs:
                final = self.finals[job.segment_id] if job.segment_id < len(self.finals) else ""
                if hold_finals and (job.kind == "final" or job.speculative):
                    self.held.append(job)
                    continue
                if job.kind == "final" or job.speculative:
                    text = final  # a speculative decode covers the whole segment
                else:
                    n = self.partials[job.segment_id] = self.partials.get(job.segment_id, 0) + 1
                    words = final.split() + ["extra"]
                    text = " ".join(words[:n])
                raw = f"<|en|><|NEUTRAL|><|Speech|><|woitn|>{text}"
                t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
                self.session.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))


class FakeTransport(asyncio.Transport):
    """A stream transport with no socket: what its protocol writes, whether reading is
    paused, and its close and abort (``protocol.connection_lost`` follows, as asyncio
    calls it, once ``protocol`` is set)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False
        self.aborted = False
        self.reading = True
        self.eof_written = False
        self.protocol: asyncio.Protocol | None = None

    def write(self, data) -> None:  # type: ignore[override]
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self._lost)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def _lost(self) -> None:
        if self.protocol is not None:
            self.protocol.connection_lost(None)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 5555) if name == "peername" else default
