"""Decoded frames to int16 mono PCM at one rate: the one conversion every path uses.

An uploaded file (:mod:`streamer.media.files`) and a container streamed live
(:mod:`streamer.media.decoder`) turn FFmpeg's frames into samples here, so the same
bytes give the same samples, and so the same cuts and text, on both (FFmpeg's
libswresample and soxr differ by a few LSB, enough to move a cut and change a word).
Channels are averaged, other rates are resampled with soxr (the filter the core's
:class:`~streamer.core.resample.StreamResampler` and :mod:`streamer.audio_io` use) in
float32 with its state carried from frame to frame (the output does not depend on
FFmpeg's frame sizes) and rounded without dither; mono s16 at the output rate comes
out bit-identical.
"""

from __future__ import annotations

import av
import numpy as np
import soxr

from streamer.errors import UndecodableAudio

__all__ = ["INT16_SCALE", "MonoConverter"]

INT16_SCALE = 32768.0
QUALITY = "HQ"  # soxr's quality, as the core's resampler
# what one sample of each FFmpeg sample format is worth at full scale (u8 is offset)
_FULL_SCALE = {"s16": 32768.0, "s32": 2147483648.0, "u8": 128.0, "flt": 1.0, "dbl": 1.0}


class MonoConverter:
    """Frames of any sample format, layout and rate in; int16 mono at ``out_rate`` out.
    A change of rate mid-stream (a chained Ogg stream) flushes the old filter first.
    Not thread-safe: one per stream."""

    def __init__(self, out_rate: int) -> None:
        self.out_rate = out_rate
        self._stream: soxr.ResampleStream | None = None
        self._in_rate = 0

    def push(self, frame: av.AudioFrame) -> np.ndarray:
        """``frame``'s samples converted; raises :class:`UndecodableAudio` for an
        unknown sample format."""
        rate = frame.sample_rate
        flushed = self.flush() if self._stream is not None and rate != self._in_rate else None
        if rate == self.out_rate:
            exact = _exact_int16(frame)
            out = exact if exact is not None else _to_int16(_mono_float(frame))
        else:
            if self._stream is None:
                self._in_rate = rate
                self._stream = soxr.ResampleStream(
                    rate, self.out_rate, 1, dtype="float32", quality=QUALITY
                )
            out = _to_int16(self._stream.resample_chunk(_mono_float(frame), last=False))
        if flushed is not None and flushed.size:
            return np.concatenate([flushed, out])
        return out

    def flush(self) -> np.ndarray:
        """What the filter still holds (the end of the stream, or of one rate)."""
        if self._stream is None:
            return np.zeros(0, dtype=np.int16)
        stream, self._stream = self._stream, None
        return _to_int16(stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))


def _exact_int16(frame: av.AudioFrame) -> np.ndarray | None:
    """A mono s16 frame's samples as they are; a multi-channel one averaged and
    rounded to int16 exactly; None for other sample formats."""
    if frame.format.name not in ("s16", "s16p"):
        return None
    samples = frame.to_ndarray()
    channels = frame.layout.nb_channels
    if channels == 1:
        return samples.reshape(-1)
    mean = _by_channel(samples, frame).mean(axis=0, dtype=np.float64)
    return np.rint(mean).astype(np.int16)


def _mono_float(frame: av.AudioFrame) -> np.ndarray:
    """A frame of any sample format as float32 mono in [-1, 1]."""
    kind = frame.format.name.rstrip("p")
    if kind not in _FULL_SCALE:
        raise UndecodableAudio(f"the audio's samples are in an unknown format ({kind})")
    samples = _by_channel(frame.to_ndarray(), frame).astype(np.float64)
    if kind == "u8":
        samples -= 128.0
    mono = samples.mean(axis=0) / _FULL_SCALE[kind]
    return mono.astype(np.float32)


def _by_channel(samples: np.ndarray, frame: av.AudioFrame) -> np.ndarray:
    """``(channels, samples)``: a packed frame's interleaved samples split."""
    channels = frame.layout.nb_channels
    if frame.format.is_planar:
        return samples
    return samples.reshape(-1, channels).T


def _to_int16(floats: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(floats * INT16_SCALE), -32768, 32767).astype(np.int16)
