"""Speech the recognizer tests decode: synthesised in every language, and recordings."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streamer.testkit.speech import SAMPLE_RATE, speak

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
FRONT_CENTER = Path("/usr/share/sounds/alsa/Front_Center.wav")
OPTION_LANGUAGES = ("auto", "zh", "en", "yue", "ja", "ko")
SYNTH_CLIPS = [
    ("en", "streaming speech recognition should feel instant"),
    ("zh", "今天天气很好"),
    ("yue", "你今日食咗飯未呀"),
    ("ja", "こんにちは、げんきですか"),
    ("ko", "안녕하세요 반갑습니다"),
]


def load_wav(path: Path) -> np.ndarray:
    import soundfile as sf
    import soxr

    data, rate = sf.read(path, dtype="float32", always_2d=True)
    mono = data.mean(axis=1)
    if rate != SAMPLE_RATE:
        mono = soxr.resample(mono, rate, SAMPLE_RATE)
    return np.clip(np.round(mono * 32768), -32768, 32767).astype(np.int16)


def load_clips(speech_cache: Path) -> dict[str, np.ndarray]:
    """Synthesised speech in every language and real recordings, 16 kHz int16."""
    found = {f"tts-{lang}": speak(text, lang, cache_dir=speech_cache) for lang, text in SYNTH_CLIPS}
    for path in sorted(LIBRIVOX.glob("*.wav")):
        found[f"librivox-{path.stem[-4:]}"] = load_wav(path)
    found["front-center"] = load_wav(FRONT_CENTER)
    assert len(found) == len(SYNTH_CLIPS) + 6, "pocketsphinx-testdata and alsa-utils are needed"
    return found


def long_speech(clips: dict[str, np.ndarray]) -> np.ndarray:
    """More than 7 s of mixed real and synthesised speech, cut to length by the tests."""
    signal = np.concatenate([clips["librivox-0870"], clips["tts-zh"], clips["front-center"]])
    assert signal.size > 7 * SAMPLE_RATE
    return signal
