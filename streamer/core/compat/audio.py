"""Client audio encodings the compatible protocols accept, decoded to s16le (I/O-free).

G.711 μ-law and A-law (telephony, 8 bits per sample) expand through 256-entry tables;
interleaved multi-channel s16le is averaged to mono. Chunks may split a sample or a
channel frame anywhere: the decoders carry the remainder over to the next chunk.
"""

from __future__ import annotations

import numpy as np

ENCODINGS = ("linear16", "mulaw", "alaw")  # names as Deepgram spells them
BYTES_PER_SAMPLE = {"linear16": 2, "mulaw": 1, "alaw": 1}


def _ulaw_table() -> np.ndarray:
    # ITU-T G.711: invert the complement, then sign / 3-bit exponent / 4-bit mantissa
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.int16)


def _alaw_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = np.where(
        exponent == 0,
        (mantissa << 4) + 8,
        ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0),
    )
    return np.where(codes & 0x80, magnitude, -magnitude).astype(np.int16)


ULAW_TO_S16 = _ulaw_table()
ALAW_TO_S16 = _alaw_table()


class AudioDecoder:
    """Client bytes in ``encoding`` with ``channels`` interleaved → mono s16le bytes."""

    def __init__(self, encoding: str = "linear16", channels: int = 1) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}")
        if channels < 1:
            raise ValueError("channels must be at least 1")
        self.encoding = encoding
        self.channels = channels
        self._frame_bytes = BYTES_PER_SAMPLE[encoding] * channels
        self._carry = b""

    def push(self, data: bytes) -> bytes:
        """Decode what ``data`` completes; an incomplete trailing frame waits for more."""
        if self.encoding == "linear16" and self.channels == 1 and not self._carry:
            # the common case: let the session's own decoder carry odd bytes
            return data
        data = self._carry + data
        usable = len(data) - len(data) % self._frame_bytes
        self._carry = data[usable:]
        if not usable:
            return b""
        raw = np.frombuffer(data[:usable], dtype="<i2" if self.encoding == "linear16" else "u1")
        if self.encoding == "mulaw":
            samples = ULAW_TO_S16[raw]
        elif self.encoding == "alaw":
            samples = ALAW_TO_S16[raw]
        else:
            samples = raw.astype(np.int16, copy=False)
        if self.channels > 1:
            frames = samples.reshape(-1, self.channels).astype(np.int32)
            samples = (frames.sum(axis=1) // self.channels).astype(np.int16)
        return samples.astype("<i2", copy=False).tobytes()

    @property
    def bytes_per_sample(self) -> int:
        """Input bytes per mono output sample (a sample of every channel)."""
        return self._frame_bytes
