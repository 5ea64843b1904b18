"""Synthesised speech for tests, benchmarks and demos (espeak-ng + sox).

espeak-ng is deterministic, so clips joined by known silences give exact ground truth for
segmentation tests. Generated audio is cached under a folder the caller chooses and never
committed.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.errors import ConfigError

# espeak-ng voice for each SenseVoice language; the ja voice reads kanji as Mandarin,
# so Japanese sentences are written in kana.
VOICES = {"en": "en-us", "zh": "cmn", "yue": "yue", "ja": "ja", "ko": "ko"}

SENTENCES = {
    "en": [
        "the quick brown fox jumps over the lazy dog",
        "hello there",
        "please turn on the lights in the kitchen",
        "streaming speech recognition should feel instant",
    ],
    "zh": ["今天天气很好", "我们一起去吃饭吧", "语音识别非常有用"],
    "yue": ["你今日食咗飯未呀", "呢度好靚"],
    "ja": ["こんにちは、げんきですか", "きょうは いい てんき です"],
    "ko": ["안녕하세요 반갑습니다", "오늘 날씨가 좋네요"],
}


@dataclass(frozen=True)
class Utterance:
    """Where one synthesised sentence sits inside a longer signal."""

    language: str
    text: str
    start_sample: int
    end_sample: int


def tools_available() -> bool:
    return shutil.which("espeak-ng") is not None and shutil.which("sox") is not None


def speak(
    text: str,
    language: str = "en",
    *,
    cache_dir: Path,
    speed_wpm: int = 160,
    voice: str | None = None,
    pitch: int | None = None,
) -> np.ndarray:
    """``text`` spoken by espeak-ng as 16 kHz mono int16, cached by content.

    ``voice`` overrides the language's espeak voice (``en-us+m3``, ``en-us+f2`` for two
    speakers); ``pitch`` is espeak's ``-p`` (0-99).
    """
    if not tools_available():
        raise ConfigError(
            "speech synthesis needs espeak-ng and sox (apt-get install espeak-ng sox)"
        )
    voice = voice or VOICES.get(language, language)
    extra = ["-p", str(pitch)] if pitch is not None else []
    key_text = f"{voice}|{speed_wpm}|{text}" + (f"|p{pitch}" if pitch is not None else "")
    key = hashlib.sha1(key_text.encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"tts-{language}-{key}.s16"
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            raw_wav = Path(tmp) / "raw.wav"
            subprocess.run(
                ["espeak-ng", "-v", voice, "-s", str(speed_wpm), *extra, "-w", str(raw_wav), text],
                check=True,
                capture_output=True,
            )
            out = Path(tmp) / "out.raw"
            subprocess.run(
                [
                    "sox",
                    str(raw_wav),
                    "-r",
                    str(SAMPLE_RATE),
                    "-c",
                    "1",
                    "-b",
                    "16",
                    "-e",
                    "signed-integer",
                    "-t",
                    "raw",
                    str(out),
                ],
                check=True,
                capture_output=True,
            )
            partial = target.with_suffix(".tmp")
            shutil.copyfile(out, partial)
            partial.replace(target)
    return trim_silence(np.fromfile(target, dtype="<i2"))


def trim_silence(pcm: np.ndarray, threshold: int = 64) -> np.ndarray:
    """Drop leading and trailing samples quieter than ``threshold`` (espeak pads both)."""
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > threshold)
    if loud.size == 0:
        return pcm[:0]
    return pcm[loud[0] : loud[-1] + 1]


def join_with_silence(
    clips: list[tuple[str, str, np.ndarray]], gaps_ms: list[int] | int, lead_ms: int = 500
) -> tuple[np.ndarray, list[Utterance]]:
    """Concatenate ``(language, text, pcm)`` clips with silences; returns audio and truth.

    ``gaps_ms`` is the silence after each clip (one value for all). ``lead_ms`` of silence
    comes first.
    """
    if isinstance(gaps_ms, int):
        gaps_ms = [gaps_ms] * len(clips)
    parts = [np.zeros(lead_ms * SAMPLE_RATE // 1000, dtype=np.int16)]
    truth = []
    position = parts[0].size
    for (language, text, pcm), gap_ms in zip(clips, gaps_ms, strict=True):
        parts.append(pcm.astype(np.int16))
        truth.append(Utterance(language, text, position, position + pcm.size))
        position += pcm.size
        gap = np.zeros(gap_ms * SAMPLE_RATE // 1000, dtype=np.int16)
        parts.append(gap)
        position += gap.size
    return np.concatenate(parts), truth


NOISE_KINDS = ("white", "brown", "recorded")
# alsa-utils' speaker-test noise: 1.4 s at 48 kHz, stationary, falling about 5 dB per
# octave (more like a room's rumble than white noise); looped to any length
RECORDED_NOISE = Path("/usr/share/sounds/alsa/Noise.wav")


def add_noise(pcm: np.ndarray, snr_db: float, seed: int = 0, kind: str = "white") -> np.ndarray:
    """Noise of ``kind`` (:data:`NOISE_KINDS`) at ``snr_db`` relative to the speech power
    (computed over loud samples)."""
    signal = pcm.astype(np.float64)
    loud = signal[np.abs(signal) > 64]
    power = float(np.mean(loud**2)) if loud.size else 1.0
    if kind == "white":
        std = np.sqrt(power / 10 ** (snr_db / 10))
        noise = np.random.default_rng(seed).normal(0.0, std, pcm.size)
    else:
        noise = noise_of(kind, pcm.size, seed)
        noise *= np.sqrt(power / 10 ** (snr_db / 10) / np.mean(noise**2))
    return np.clip(signal + noise, -32768, 32767).astype(np.int16)


def noise_of(kind: str, samples: int, seed: int = 0) -> np.ndarray:
    """``samples`` of zero-mean noise of ``kind`` at 16 kHz, float64, any scale."""
    rng = np.random.default_rng(seed)
    if kind == "white":
        return rng.normal(0.0, 1.0, samples)
    if kind == "brown":
        walk = np.cumsum(rng.normal(0.0, 1.0, samples))
        return walk - np.convolve(walk, np.ones(1600) / 1600, mode="same")  # zero-mean
    if kind == "recorded":
        return _looped(_recorded_noise(), samples, int(rng.integers(0, 1 << 30)))
    raise ConfigError(f"noise kind must be one of {NOISE_KINDS}, got {kind!r}")


def _recorded_noise() -> np.ndarray:
    import soundfile as sf
    import soxr

    if not RECORDED_NOISE.is_file():
        raise ConfigError(f"{RECORDED_NOISE} is missing: install alsa-utils")
    data, rate = sf.read(RECORDED_NOISE, dtype="float64", always_2d=True)
    return soxr.resample(data.mean(axis=1), rate, SAMPLE_RATE)


def _looped(loop: np.ndarray, samples: int, offset: int) -> np.ndarray:
    """``loop`` repeated with 10 ms cross-fades (no clicks), starting at ``offset``."""
    fade = SAMPLE_RATE // 100
    ramp = np.linspace(0.0, 1.0, fade)
    out = loop.copy()
    while out.size < samples + loop.size:
        joined = out[-fade:] * (1 - ramp) + loop[:fade] * ramp
        out = np.concatenate([out[:-fade], joined, loop[fade:]])
    start = offset % loop.size
    return out[start : start + samples]
