"""The audio format everything inside the server works in (I/O-free constants)."""

from __future__ import annotations

SAMPLE_RATE = 16000  # Hz: SenseVoice's input rate, the segmenter's and the session's timeline
BYTES_PER_SAMPLE = 2  # PCM s16le, mono
