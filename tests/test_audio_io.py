"""Reading audio files as 16 kHz mono int16."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from streamer.audio_io import int16_to_float32, load_audio, resample, to_int16, to_mono
from streamer.errors import ConfigError

FRONT_CENTER = Path("/usr/share/sounds/alsa/Front_Center.wav")


def tone(rate: int, seconds: float, channels: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    mono = 0.5 * np.sin(2 * np.pi * hz * t)
    return np.stack([mono] * channels, axis=1).astype(np.float32)


def dominant_hz(pcm: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64)))
    return float(np.argmax(spectrum) * rate / pcm.size)


@pytest.mark.parametrize(
    ("suffix", "rate", "subtype"),
    [(".wav", 44100, "PCM_16"), (".flac", 48000, "PCM_24"), (".ogg", 44100, "VORBIS")],
)
def test_load_resamples_and_mixes_to_mono(
    tmp_path: Path, suffix: str, rate: int, subtype: str
) -> None:
    path = tmp_path / f"tone{suffix}"
    sf.write(path, tone(rate, 1.5, channels=2), rate, subtype=subtype)
    pcm = load_audio(path)
    assert pcm.dtype == np.int16 and pcm.ndim == 1
    assert abs(pcm.size - 24000) <= 2
    assert dominant_hz(pcm, 16000) == pytest.approx(440, abs=2)
    peak = np.abs(pcm[2000:-2000].astype(np.int32)).max()
    assert 0.45 * 32768 < peak < 0.55 * 32768


def test_stereo_channels_are_averaged(tmp_path: Path) -> None:
    left = np.full(16000, 0.5, dtype=np.float32)
    path = tmp_path / "lr.wav"
    sf.write(path, np.stack([left, -left * 0.5], axis=1), 16000, subtype="PCM_16")
    pcm = load_audio(path)
    assert np.all(np.abs(pcm.astype(np.int32) - 4096) <= 2)  # (0.5 - 0.25) / 2


def test_native_16k_int16_roundtrips_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    original = rng.integers(-32768, 32767, 8000, dtype=np.int16)
    path = tmp_path / "exact.wav"
    sf.write(path, original, 16000, subtype="PCM_16")
    np.testing.assert_array_equal(load_audio(path), original)


def test_raw_pcm_is_read_as_s16le(tmp_path: Path) -> None:
    original = np.arange(-500, 500, dtype=np.int16)
    path = tmp_path / "clip.raw"
    original.astype("<i2").tofile(path)
    np.testing.assert_array_equal(load_audio(path), original)
    assert load_audio(path, 8000).size == 500


@pytest.mark.skipif(not FRONT_CENTER.exists(), reason="alsa-utils sounds not installed")
def test_real_48k_recording() -> None:
    info = sf.info(FRONT_CENTER)
    pcm = load_audio(FRONT_CENTER)
    assert abs(pcm.size - round(info.frames * 16000 / info.samplerate)) <= 2
    assert np.abs(pcm).max() > 3000  # real speech, not silence


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg not installed")
@pytest.mark.parametrize("suffix", [".mp3", ".m4a"])
def test_compressed_formats(tmp_path: Path, suffix: str) -> None:
    wav = tmp_path / "tone.wav"
    sf.write(wav, tone(44100, 2.0, channels=2, hz=1000), 44100, subtype="PCM_16")
    target = tmp_path / f"tone{suffix}"
    subprocess.run(
        ["ffmpeg", "-nostdin", "-loglevel", "error", "-i", str(wav), str(target)], check=True
    )
    pcm = load_audio(target)
    assert pcm.dtype == np.int16
    assert abs(pcm.size - 32000) < 0.1 * 32000  # encoder padding adds a little
    assert dominant_hz(pcm, 16000) == pytest.approx(1000, abs=3)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_audio(tmp_path / "nope.wav")


def test_not_audio(tmp_path: Path) -> None:
    path = tmp_path / "notes.wav"
    path.write_text("this is not audio\n")
    with pytest.raises(ConfigError, match="notes.wav"):
        load_audio(path)


@pytest.mark.parametrize("kind", ["m4a", "webm"])
@pytest.mark.parametrize("rate", [16000, 24000])
def test_m4a_and_webm_without_an_ffmpeg_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, rate: int
) -> None:
    """PyAV (a dependency) reads what libsndfile cannot: no system ffmpeg needed."""
    from tests.audio_files import write_audio

    signal = np.rint(tone(16000, 2.0, channels=1, hz=1000)[:, 0] * 32767).astype(np.int16)
    path = write_audio(signal, 16000, kind, tmp_path / f"tone.{kind}")
    monkeypatch.setattr(shutil, "which", lambda name: None)  # as if ffmpeg were absent
    monkeypatch.setenv("PATH", str(tmp_path))
    pcm = load_audio(path, target_rate=rate)
    assert pcm.dtype == np.int16
    assert abs(pcm.size - 2 * rate) < 0.1 * 2 * rate  # encoder padding adds a little
    assert dominant_hz(pcm, rate) == pytest.approx(1000, abs=3)


def test_not_audio_says_so(tmp_path: Path) -> None:
    path = tmp_path / "talk.m4a"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(ConfigError, match="talk.m4a: not an audio file"):
        load_audio(path)


def test_to_int16_conversions() -> None:
    floats = np.array([0.0, 0.5, -1.0, 1.0, 2.0], dtype=np.float32)
    np.testing.assert_array_equal(to_int16(floats), [0, 16384, -32768, 32767, 32767])
    ints = np.array([-32768, 0, 32767], dtype=np.int16)
    assert to_int16(ints) is ints
    np.testing.assert_array_equal(to_int16(int16_to_float32(ints)), ints)
    np.testing.assert_array_equal(
        to_int16(np.array([1 << 16, -(1 << 31)], dtype=np.int32)), [1, -32768]
    )
    np.testing.assert_array_equal(
        to_int16(np.array([128, 0, 255], dtype=np.uint8)), [0, -32768, 32512]
    )


def test_mono_and_resample_helpers() -> None:
    stereo = np.array([[1.0, 0.0], [0.5, 0.5]], dtype=np.float32)
    np.testing.assert_allclose(to_mono(stereo), [0.5, 0.5])
    signal = np.zeros(48000, dtype=np.float32)
    assert resample(signal, 48000, 16000).size == 16000
    assert resample(signal, 16000, 16000) is signal


def test_a_directory_is_named_as_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory; give an audio file"):
        load_audio(tmp_path)
