"""Test doubles used next to (never instead of) tests of the real recognizer and VAD."""

from __future__ import annotations

import threading
import time

import numpy as np

from streamer.core.transcript import Transcript


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


class FakeRecognizer:
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
