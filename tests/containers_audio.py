"""Compressed audio for the container tests, encoded here with ffmpeg (nothing committed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from streamer.testkit.speech import SAMPLE_RATE
from tests.timing import timeout_s

needs_ffmpeg = pytest.mark.skipif(
    shutil.which("ffmpeg") is None, reason="needs ffmpeg (scripts/test.sh installs it)"
)

# ffmpeg arguments per container; Ogg pages of 100 ms (ffmpeg's default is 1 s), as a
# live Ogg producer writes them
ENCODERS = {
    "webm": ["-c:a", "libopus", "-b:a", "32k", "-f", "webm"],
    "ogg": ["-c:a", "libopus", "-b:a", "32k", "-page_duration", "100000", "-f", "ogg"],
    "mp3": ["-c:a", "libmp3lame", "-b:a", "64k", "-f", "mp3"],
    "flac": ["-c:a", "flac", "-f", "flac"],
    "wav": ["-c:a", "pcm_s16le", "-f", "wav"],
}


def encode(samples: np.ndarray, container: str, folder: Path, rate: int = SAMPLE_RATE) -> bytes:
    """``samples`` (int16 mono) as a ``container`` file's bytes."""
    raw = folder / f"in-{container}.s16"
    raw.write_bytes(samples.astype("<i2").tobytes())
    out = folder / f"out.{container}"
    subprocess.run(
        ["ffmpeg", "-loglevel", "error", "-y", "-f", "s16le", "-ar", str(rate), "-ac", "1"]
        + ["-i", str(raw), *ENCODERS[container], str(out)],
        check=True,
        timeout=timeout_s(60),
    )
    return out.read_bytes()


def slices(data: bytes, duration_s: float, slice_s: float) -> list[bytes]:
    """``data`` cut into as many pieces as ``slice_s`` slices of ``duration_s`` of audio."""
    count = max(1, round(duration_s / slice_s))
    step = -(-len(data) // count)
    return [data[i : i + step] for i in range(0, len(data), step)]
