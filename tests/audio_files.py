"""Audio files for the upload tests, encoded here with PyAV (nothing committed, no ffmpeg
binary needed): every container and codec the file endpoints take."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np


@dataclass(frozen=True)
class Kind:
    """How one kind of file is written."""

    muxer: str  # FFmpeg's muxer
    codec: str  # FFmpeg's encoder
    suffix: str  # the file name's
    muxer_options: tuple[tuple[str, str], ...] = ()
    codec_options: tuple[tuple[str, str], ...] = ()
    rate: int | None = None  # the codec's own rate (Opus: 48 kHz), else the input's


KINDS = {
    "wav": Kind("wav", "pcm_s16le", ".wav"),
    "flac": Kind("flac", "flac", ".flac"),
    # other sample formats in a WAV: 8-bit, 24-bit (decoded as s32), float
    "wav-u8": Kind("wav", "pcm_u8", ".wav"),
    "wav-s24": Kind("wav", "pcm_s24le", ".wav"),
    "wav-f32": Kind("wav", "pcm_f32le", ".wav"),
    "ogg-opus": Kind("ogg", "libopus", ".ogg", rate=48000),
    "ogg-vorbis": Kind("ogg", "vorbis", ".ogg", codec_options=(("strict", "experimental"),)),
    "mp3": Kind("mp3", "libmp3lame", ".mp3"),
    # the mp4 muxer writes the moov atom after the audio unless told to move it
    "m4a": Kind("ipod", "aac", ".m4a"),
    "m4a-faststart": Kind("ipod", "aac", ".m4a", muxer_options=(("movflags", "+faststart"),)),
    "webm": Kind("webm", "libopus", ".webm", rate=48000),
    # what MediaRecorder writes: no duration in the header
    "webm-live": Kind("webm", "libopus", ".webm", muxer_options=(("live", "1"),), rate=48000),
}
COMPRESSED_KINDS = ("flac", "ogg-opus", "ogg-vorbis", "mp3", "m4a", "webm")


def write_audio(samples: np.ndarray, rate: int, kind: str, path: Path) -> Path:
    """``samples`` (int16, 1-D mono or ``(channels, samples)``) at ``rate`` as a file of
    ``kind`` (one of :data:`KINDS`) at ``path``."""
    spec = KINDS[kind]
    planes = samples.reshape(1, -1) if samples.ndim == 1 else samples
    layout = {1: "mono", 2: "stereo"}[planes.shape[0]]
    codec_rate = spec.rate or rate
    with av.open(str(path), "w", format=spec.muxer, options=dict(spec.muxer_options)) as out:
        stream = out.add_stream(
            spec.codec, rate=codec_rate, layout=layout, options=dict(spec.codec_options)
        )
        context = stream.codec_context
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(planes.T.reshape(1, -1), dtype=np.int16),
            format="s16",
            layout=layout,
        )
        frame.sample_rate = rate
        resampler = av.AudioResampler(
            format=context.format.name,
            layout=layout,
            rate=codec_rate,
            frame_size=context.frame_size or None,
        )
        pts = 0
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            piece.pts = pts  # the muxer's timestamps (Ogg's granules) come from these
            pts += piece.samples
            for packet in stream.encode(piece):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def tone(seconds: float, rate: int, hz: float = 440.0, amplitude: float = 8000.0) -> np.ndarray:
    """A sine (int16) with a slow rise in pitch, so that no two seconds are alike."""
    t = np.arange(int(seconds * rate)) / rate
    return np.rint(amplitude * np.sin(2 * np.pi * (hz + 20 * t) * t)).astype(np.int16)
