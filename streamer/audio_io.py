"""Audio files in, 16 kHz mono int16 PCM out.

:func:`load_audio` reads anything libsndfile reads (wav, flac, ogg, mp3 with libsndfile
>= 1.1, ...) with ``soundfile``; other containers (m4a, aac, opus in webm, video files)
go through FFmpeg's libraries as PyAV ships them (:mod:`streamer.media.files`, the
uploads' reader; no ``ffmpeg`` program needed). Channels are averaged to mono and the
signal is resampled with ``soxr``. Headerless ``.raw``/``.pcm``/``.s16`` files are read
as signed 16-bit little-endian mono at ``raw_sample_rate``.

Used by the client CLI, the offline transcriber and the server alike; it imports no
asyncio, websockets or torch.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import soundfile
import soxr

from streamer.core.audio import SAMPLE_RATE
from streamer.errors import ConfigError, StreamerError

__all__ = [
    "SAMPLE_RATE",
    "RAW_SUFFIXES",
    "load_audio",
    "to_int16",
    "int16_to_float32",
    "to_mono",
    "resample",
]

logger = logging.getLogger(__name__)

RAW_SUFFIXES = frozenset({".raw", ".pcm", ".s16"})  # headerless s16le mono
_INT16_SCALE = 32768.0  # int16 full scale: float 1.0 == 32768


def to_int16(samples: np.ndarray) -> np.ndarray:
    """``samples`` as int16: floats in [-1, 1] are scaled and clipped, ints are rescaled.

    int16 input is returned unchanged (no copy); int32 is taken as full-scale 32-bit,
    uint8 as 8-bit offset binary (the WAV convention).
    """
    samples = np.asarray(samples)
    if samples.dtype == np.int16:
        return samples
    if np.issubdtype(samples.dtype, np.floating):
        scaled = np.rint(samples.astype(np.float64) * _INT16_SCALE)
        return np.clip(scaled, -32768, 32767).astype(np.int16)
    if samples.dtype == np.uint8:
        return ((samples.astype(np.int16) - 128) << 8).astype(np.int16)
    if np.issubdtype(samples.dtype, np.signedinteger):
        shift = samples.dtype.itemsize * 8 - 16
        if shift > 0:
            return (samples.astype(np.int64) >> shift).astype(np.int16)
        return (samples.astype(np.int16) << -shift).astype(np.int16)
    raise TypeError(f"cannot convert {samples.dtype} samples to int16")


def int16_to_float32(samples: np.ndarray) -> np.ndarray:
    """int16 PCM as float32 in [-1, 1) (the inverse of :func:`to_int16` for floats)."""
    return np.asarray(samples, dtype=np.int16).astype(np.float32) / np.float32(_INT16_SCALE)


def to_mono(samples: np.ndarray) -> np.ndarray:
    """Average the channels of a ``(frames, channels)`` array; 1-D input is returned as is."""
    if samples.ndim == 1:
        return samples
    if samples.ndim != 2:
        raise ValueError(f"expected (frames, channels) audio, got shape {samples.shape}")
    if samples.shape[1] == 1:
        return samples[:, 0]
    return samples.mean(axis=1, dtype=np.float64).astype(np.float32)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample mono float audio with soxr (high quality); a no-op when the rates match."""
    if from_rate == to_rate:
        return samples
    if from_rate <= 0 or to_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {from_rate} -> {to_rate}")
    return soxr.resample(np.asarray(samples, dtype=np.float32), from_rate, to_rate, quality="HQ")


def load_audio(
    path: str | Path, target_rate: int = SAMPLE_RATE, *, raw_sample_rate: int = SAMPLE_RATE
) -> np.ndarray:
    """Read an audio file as mono int16 PCM at ``target_rate`` Hz.

    Raises :class:`ConfigError` with a message fit for the user when the file is missing
    or is not audio.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give an audio file (wav, flac, ogg, mp3, ...)")
    if not path.is_file():
        raise ConfigError(f"audio file not found: {path}")
    if path.suffix.lower() in RAW_SUFFIXES:
        return _load_raw(path, raw_sample_rate, target_rate)
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        # libsndfile does not know the container (m4a, webm, mp4, ...): FFmpeg's turn
        logger.debug("soundfile cannot read %s (%s); trying PyAV", path, exc)
        return _load_with_pyav(path, target_rate, soundfile_error=str(exc))
    mono = to_mono(data)
    return to_int16(resample(mono, int(rate), target_rate))


def _load_raw(path: Path, raw_rate: int, target_rate: int) -> np.ndarray:
    data = np.fromfile(path, dtype="<i2")
    if raw_rate == target_rate:
        return data.astype(np.int16)
    return to_int16(resample(int16_to_float32(data), raw_rate, target_rate))


def _load_with_pyav(path: Path, target_rate: int, soundfile_error: str) -> np.ndarray:
    """What libsndfile cannot read (m4a, aac, opus in webm, video files), through FFmpeg's
    libraries as the package ships them (PyAV): no ffmpeg program needed, and the same
    decoding and conversion as an upload to the server."""
    from streamer.media.files import iter_pcm  # PyAV: imported only when needed

    try:
        with path.open("rb") as f:
            pcm = np.frombuffer(b"".join(iter_pcm(f, max_duration_s=None)), dtype="<i2")
    except StreamerError as exc:
        raise ConfigError(
            f"cannot read {path}: not an audio file libsndfile or FFmpeg reads "
            f"({getattr(exc, 'message', exc)}; libsndfile: {soundfile_error})"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    if target_rate == SAMPLE_RATE:
        return pcm.astype(np.int16)
    return to_int16(resample(int16_to_float32(pcm), SAMPLE_RATE, target_rate))
