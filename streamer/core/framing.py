"""Client audio → exact VAD frames (I/O-free).

Clients send PCM in chunks of any length, even an odd number of bytes. :class:`PcmFramer`
carries the odd byte and the incomplete frame over to the next chunk, so the segmenter
always sees frames of exactly ``frame_samples`` samples and no sample is lost.
"""

from __future__ import annotations

import numpy as np

from streamer.core.audio import BYTES_PER_SAMPLE


class S16Decoder:
    """s16le bytes → int16 samples, carrying an odd trailing byte over to the next chunk."""

    def __init__(self) -> None:
        self._odd_byte = b""

    def push(self, data: bytes) -> np.ndarray:
        """The whole samples completed by ``data`` (a read-only view when no byte is carried)."""
        if self._odd_byte:
            data = self._odd_byte + data
        elif not len(data) % BYTES_PER_SAMPLE:  # the usual chunk: nothing to carry or copy
            return np.frombuffer(data, dtype="<i2")
        usable = len(data) - (len(data) % BYTES_PER_SAMPLE)
        self._odd_byte = data[usable:]
        return np.frombuffer(data[:usable], dtype="<i2")


class PcmFramer:
    """Cuts a stream of s16le bytes into int16 frames of ``frame_samples`` samples."""

    def __init__(self, frame_samples: int) -> None:
        if frame_samples <= 0:
            raise ValueError("frame_samples must be positive")
        self.frame_samples = frame_samples
        self._decoder = S16Decoder()
        self._pending = np.zeros(0, dtype=np.int16)

    @property
    def pending_samples(self) -> int:
        """Samples received but not yet part of a complete frame."""
        return int(self._pending.size)

    def pending(self) -> np.ndarray:
        """A copy of the samples not yet part of a complete frame (they stay pending)."""
        return self._pending.copy()

    def push_bytes(self, data: bytes) -> list[np.ndarray]:
        """Add little-endian s16 bytes; returns the frames they completed."""
        return list(self.push_bytes_block(data))

    def push_samples(self, samples: np.ndarray) -> list[np.ndarray]:
        """Add int16 samples; returns the frames they completed."""
        return list(self.push_samples_block(samples))

    def push_bytes_block(self, data: bytes) -> np.ndarray:
        """:meth:`push_bytes`, the frames as the rows of one ``(n, frame_samples)`` array.

        The array may be a read-only view of ``data``: the caller must not write to it.
        """
        return self.push_samples_block(self._decoder.push(data))

    def push_samples_block(self, samples: np.ndarray) -> np.ndarray:
        """:meth:`push_samples`, the frames as the rows of one ``(n, frame_samples)`` array.

        The array may be a view of ``samples``: the caller must not write to either.
        """
        samples = samples.astype(np.int16, copy=False)
        if self._pending.size:
            samples = np.concatenate([self._pending, samples])
        cut = samples.size - samples.size % self.frame_samples
        # a copy of the few leftover samples, so no view keeps the whole chunk alive
        self._pending = samples[cut:].copy()
        return samples[:cut].reshape(-1, self.frame_samples)

    def flush(self) -> np.ndarray:
        """The incomplete last frame (end of stream); the framer is empty afterwards."""
        rest, self._pending = self._pending, np.zeros(0, dtype=np.int16)
        self._decoder = S16Decoder()
        return rest


class AudioBuffer:
    """The recent 16 kHz audio of one stream, addressed by absolute sample index.

    Keeps only what may still be decoded: the owner calls :meth:`discard_before` with
    the segmenter's ``keep_from_sample`` so memory stays bounded however long the stream.
    """

    def __init__(self) -> None:
        self._data = bytearray()
        self._base_sample = 0  # absolute index of the first sample in _data

    @property
    def end_sample(self) -> int:
        """Absolute index one past the last sample received."""
        return self._base_sample + len(self._data) // BYTES_PER_SAMPLE

    @property
    def retained_samples(self) -> int:
        return len(self._data) // BYTES_PER_SAMPLE

    def append(self, samples: np.ndarray) -> None:
        """Add int16 samples (any shape: a block of frames is added row after row)."""
        self._data += np.ascontiguousarray(samples, dtype="<i2").data

    def slice(self, start_sample: int, end_sample: int) -> np.ndarray:
        """A copy of samples ``[start_sample, end_sample)``; raises if already discarded."""
        if start_sample < self._base_sample or end_sample > self.end_sample:
            raise IndexError(
                f"samples [{start_sample}, {end_sample}) not retained "
                f"(have [{self._base_sample}, {self.end_sample}))"
            )
        lo = (start_sample - self._base_sample) * BYTES_PER_SAMPLE
        hi = (end_sample - self._base_sample) * BYTES_PER_SAMPLE
        # one copy (the bytearray slice), which the returned array owns
        return np.frombuffer(self._data[lo:hi], dtype="<i2").astype(np.int16, copy=False)

    def slice_with_tail(
        self, start_sample: int, end_sample: int, tail: np.ndarray | None
    ) -> np.ndarray:
        """:meth:`slice`, where samples past the buffer's end come from ``tail`` (those
        of an incomplete last frame, which the buffer never holds)."""
        if end_sample <= self.end_sample or tail is None:
            return self.slice(start_sample, end_sample)
        head = self.slice(start_sample, self.end_sample)
        return np.concatenate([head, tail[: end_sample - self.end_sample]])

    def discard_before(self, sample: int) -> None:
        drop = min(sample, self.end_sample) - self._base_sample
        if drop > 0:
            del self._data[: drop * BYTES_PER_SAMPLE]
            self._base_sample += drop
