"""The recognizer: the direct decode path gives generate()'s exact tokens; clear failures."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamer.errors import ConfigError, ModelError
from streamer.model.backends.torch_backend import Recognizer
from streamer.model.options import RecognizerOptions
from streamer.model.sensevoice import LANGUAGES, MIN_DECODE_SAMPLES
from streamer.testkit.models import RANDOM_MODELS
from streamer.testkit.speech import SAMPLE_RATE, speak
from tests import clips as clips_module
from tests.clips import OPTION_LANGUAGES, load_clips
from tests.timing import timeout_s


@pytest.fixture(scope="module")
def clips(speech_cache: Path) -> dict[str, np.ndarray]:
    return load_clips(speech_cache)


@pytest.fixture(scope="module")
def long_speech(clips: dict[str, np.ndarray]) -> np.ndarray:
    return clips_module.long_speech(clips)


def _recognizer(model_dir: Path, **options: object) -> Recognizer:
    return Recognizer(
        RecognizerOptions(model=str(model_dir), device="cpu", threads=2, warmup=False, **options)
    )


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Recognizer:
    return _recognizer(tiny_model_dir)


@pytest.fixture(scope="module")
def tagged(tagged_model_dir: Path) -> Recognizer:
    return _recognizer(tagged_model_dir)


@pytest.fixture(scope="module")
def small(small_model_dir: Path) -> Iterator[Recognizer]:
    recognizer = _recognizer(small_model_dir)
    yield recognizer
    del recognizer


def _assert_parity(recognizer: Recognizer, pcm: np.ndarray, language: str, use_itn: bool) -> None:
    direct = recognizer.decode(pcm, language=language, use_itn=use_itn)
    reference = recognizer.decode_reference(pcm, language=language, use_itn=use_itn)
    assert direct.token_ids == reference.token_ids, (language, use_itn, pcm.size)
    assert direct.raw == reference.raw
    assert direct.rich == reference.rich


# --- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"model": ""},
        {"model": "random:huge", "random_models": RANDOM_MODELS},
        {"model": "random:tiny"},  # nothing passed to build it with
        {"hub": "github"},
        {"device": "gpu"},
        {"device": "cuda:x"},
        {"dtype": "fp8"},
        {"dtype": "fp16", "device": "cpu"},
        {"quantize": "int4"},
        {"quantize": "int8", "device": "cuda"},
        {"quantize": "int8", "dtype": "bf16"},
        {"threads": -1},
        {"backend": "tensorflow"},
        {"backend": "onnx", "dtype": "fp16", "device": "cuda"},
    ],
)
def test_invalid_options(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RecognizerOptions(**options)  # type: ignore[arg-type]


def test_default_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STREAMER_CACHE_DIR", str(tmp_path))
    options = RecognizerOptions()
    assert options.model == "auto"  # the backend's default: loading.resolve_model
    assert options.cache_dir == tmp_path
    monkeypatch.delenv("STREAMER_CACHE_DIR")
    assert RecognizerOptions().cache_dir == Path.home() / ".cache" / "sensevoice-streamer"
    assert RecognizerOptions(cache_dir="~/x").cache_dir == Path.home() / "x"  # type: ignore[arg-type]


def test_importing_does_not_import_torch() -> None:
    code = (
        "import sys, streamer.model.backends.torch_backend, streamer.testkit.models\n"
        "assert 'torch' not in sys.modules and 'funasr' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- parity: the direct path gives generate()'s exact tokens -------------------------------


def test_parity_tiny_every_clip(tiny: Recognizer, clips: dict[str, np.ndarray]) -> None:
    for pcm in clips.values():
        for use_itn in (False, True):
            _assert_parity(tiny, pcm, "auto", use_itn)


@pytest.mark.parametrize("clip", ["tts-zh", "librivox-0890"])
def test_parity_tiny_every_language(
    tiny: Recognizer, clips: dict[str, np.ndarray], clip: str
) -> None:
    for language in OPTION_LANGUAGES:
        for use_itn in (False, True):
            _assert_parity(tiny, clips[clip], language, use_itn)


@pytest.mark.parametrize("seconds", [0.2, 0.5, 1.0, 2.0, 3.0, 4.5, 6.0, 7.0])
def test_parity_tiny_lengths(tiny: Recognizer, long_speech: np.ndarray, seconds: float) -> None:
    pcm = long_speech[: int(seconds * SAMPLE_RATE)]
    for use_itn in (False, True):
        _assert_parity(tiny, pcm, "auto", use_itn)


@pytest.mark.parametrize("samples", [MIN_DECODE_SAMPLES, 401, 500, 1000, 3199])
def test_parity_tiny_very_short(tiny: Recognizer, long_speech: np.ndarray, samples: int) -> None:
    _assert_parity(tiny, long_speech[:samples], "auto", True)


@pytest.mark.parametrize("samples", [0, 1, 100, MIN_DECODE_SAMPLES - 1])
def test_too_short_gives_an_empty_transcript(
    tiny: Recognizer, long_speech: np.ndarray, samples: int
) -> None:
    for transcript in (
        tiny.decode(long_speech[:samples]),
        tiny.decode_reference(long_speech[:samples]),
    ):
        assert transcript.raw == transcript.text == transcript.rich == ""
        assert transcript.token_ids == ()
        assert transcript.audio_ms == pytest.approx(samples / 16)


def test_parity_tiny_silence_and_noise(tiny: Recognizer) -> None:
    rng = np.random.default_rng(1)
    _assert_parity(tiny, np.zeros(SAMPLE_RATE, np.int16), "auto", True)
    _assert_parity(tiny, rng.normal(0, 3000, 2 * SAMPLE_RATE).astype(np.int16), "en", False)
    _assert_parity(tiny, np.full(SAMPLE_RATE, 32767, np.int16), "auto", True)


def test_input_forms_agree(tiny: Recognizer, clips: dict[str, np.ndarray]) -> None:
    pcm = clips["librivox-0880"]
    as_array = tiny.decode(pcm)
    assert tiny.decode(pcm.tobytes()).token_ids == as_array.token_ids
    assert tiny.decode(bytearray(pcm.tobytes())).token_ids == as_array.token_ids
    floats = pcm.astype(np.float32) / 32768
    assert tiny.decode(floats).token_ids == as_array.token_ids
    assert tiny.decode_reference(floats).token_ids == as_array.token_ids


def test_bad_input_is_rejected(tiny: Recognizer) -> None:
    with pytest.raises(ConfigError):
        tiny.decode(b"\x00\x01\x02")  # odd byte count
    with pytest.raises(ConfigError):
        tiny.decode(np.zeros((2, 1600), np.int16))  # stereo
    with pytest.raises(ConfigError):
        tiny.decode(np.zeros(1600, np.int16), language="klingon")


def test_decoding_is_deterministic(tiny: Recognizer, clips: dict[str, np.ndarray]) -> None:
    pcm = clips["front-center"]
    assert len({tiny.decode(pcm).token_ids for _ in range(3)}) == 1


@pytest.mark.slow
def test_parity_small(
    small: Recognizer, clips: dict[str, np.ndarray], long_speech: np.ndarray
) -> None:
    """The real-size model: a CI-sized selection of clips, lengths, languages and ITN."""
    cases = [
        (long_speech[: int(0.2 * SAMPLE_RATE)], "auto", True),
        (long_speech[: 3 * SAMPLE_RATE], "zh", True),
        (long_speech[: 7 * SAMPLE_RATE], "auto", False),
        (clips["tts-zh"], "zh", False),
        (clips["tts-yue"], "yue", True),
        (clips["tts-ja"], "ja", False),
        (clips["tts-ko"], "ko", True),
        (clips["librivox-0930"], "en", True),
        (long_speech[:MIN_DECODE_SAMPLES], "auto", True),
    ]
    for pcm, language, use_itn in cases:
        _assert_parity(small, pcm, language, use_itn)


@pytest.mark.slow
def test_small_transcript_fields(small: Recognizer, clips: dict[str, np.ndarray]) -> None:
    transcript = small.decode(clips["librivox-0880"])
    assert transcript.token_ids
    assert all(0 < t < 25055 for t in transcript.token_ids)
    assert transcript.audio_ms == pytest.approx(clips["librivox-0880"].size / 16)
    assert transcript.decode_ms > 0


# --- the tagged model ------------------------------------------------------------------------


def test_tagged_fields_through_the_direct_path(tagged: Recognizer, speech_cache: Path) -> None:
    pcm = speak("hello there", "en", cache_dir=speech_cache)
    transcript = tagged.decode(pcm, language="auto", use_itn=False)
    assert transcript.raw == "<|en|><|HAPPY|><|Laughter|><|woitn|>hello there"
    assert transcript.language == "en"
    assert (transcript.emotion, transcript.event) == ("HAPPY", "Laughter")
    assert transcript.itn is False
    assert transcript.text == "hello there"
    assert transcript.rich == "😀hello there😊"
    assert transcript.audio_ms == pytest.approx(pcm.size / 16)
    assert 0 < transcript.decode_ms < 5000
    assert all(isinstance(t, int) for t in transcript.token_ids)

    fox = speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=speech_cache)
    transcript = tagged.decode(fox)  # defaults: language auto, ITN on
    assert transcript.raw == (
        "<|en|><|NEUTRAL|><|Speech|><|withitn|>the quick brown fox jumps over the lazy dog"
    )
    assert (transcript.emotion, transcript.event, transcript.itn) == ("NEUTRAL", "Speech", True)


def test_properties_and_random_model_warning(
    cache_dir: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="streamer.model")
    recognizer = Recognizer(
        RecognizerOptions(
            model="random:tiny",
            cache_dir=cache_dir,
            device="auto",
            threads=1,
            random_models=RANDOM_MODELS,
        )
    )
    assert recognizer.name == "random:tiny"
    assert recognizer.sample_rate == 16000
    assert recognizer.device in ("cpu", "cuda:0")
    assert "RANDOM WEIGHTS" in caplog.text
    assert "warm-up took" in caplog.text


def test_funasr_does_not_configure_logging(tiny_model_dir: Path) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    recognizer = _recognizer(tiny_model_dir)
    recognizer.decode_reference(np.zeros(SAMPLE_RATE, np.int16))
    assert root.handlers == handlers
    assert root.level == level


def test_int8_quantized_decode(tiny_model_dir: Path, clips: dict[str, np.ndarray]) -> None:
    import torch

    recognizer = _recognizer(tiny_model_dir, quantize="int8")
    assert any("quantized" in type(module).__module__ for module in recognizer._model.modules())
    assert isinstance(recognizer._model.ctc.ctc_lo, torch.nn.Module)
    transcript = recognizer.decode(clips["librivox-0920"])
    assert transcript.token_ids
    assert recognizer.decode_reference(clips["librivox-0920"]).token_ids == transcript.token_ids


# --- start-up failures: ModelError, quickly ------------------------------------------------


def _assert_fails_fast(options: RecognizerOptions, *needles: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ModelError) as caught:
        Recognizer(options)
    assert time.perf_counter() - started < timeout_s(10)
    for needle in needles:
        assert needle in str(caught.value)


def test_missing_directory(tmp_path: Path) -> None:
    _assert_fails_fast(RecognizerOptions(model=str(tmp_path / "nowhere")), "does not exist")


def test_missing_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "am.mvn").unlink()
    (broken / "model.pt").unlink()
    _assert_fails_fast(RecognizerOptions(model=str(broken)), "model.pt", "am.mvn")


def test_vocabulary_mismatch(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    broken = tmp_path / "mismatch"
    shutil.copytree(tiny_model_dir, broken)
    state = torch.load(broken / "model.pt", weights_only=True)
    state["ctc.ctc_lo.weight"] = state["ctc.ctc_lo.weight"][:300].clone()
    state["ctc.ctc_lo.bias"] = state["ctc.ctc_lo.bias"][:300].clone()
    torch.save(state, broken / "model.pt")
    _assert_fails_fast(RecognizerOptions(model=str(broken)), "400 pieces", "300 outputs")


@pytest.mark.parametrize("hub", ["ms", "hf"])
def test_unreachable_hub(hub: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MODELSCOPE_DOMAIN", "modelscope.invalid")
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.invalid")
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path))
    options = RecognizerOptions(model="streamer-tests/NotCached", hub=hub)
    _assert_fails_fast(options, "streamer-tests/NotCached", "cannot be reached")


def test_missing_fbank_backend(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    from streamer.model.backends.funasr_quiet import import_funasr

    import_funasr()
    from funasr.utils import fbank

    monkeypatch.setattr(fbank, "_HAS_TORCHAUDIO", False)
    monkeypatch.setattr(fbank, "_knf", None)
    _assert_fails_fast(RecognizerOptions(model=str(tiny_model_dir)), "kaldi-native-fbank")


def test_cuda_without_cuda_is_a_config_error(tiny_model_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError):
        Recognizer(RecognizerOptions(model=str(tiny_model_dir), device="cuda"))


# --- GPU ---------------------------------------------------------------------------------


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_gpu_parity_tiny(tiny_model_dir: Path, clips: dict[str, np.ndarray]) -> None:
    _require_cuda()
    recognizer = Recognizer(
        RecognizerOptions(model=str(tiny_model_dir), device="cuda", warmup=True)
    )
    assert recognizer.device == "cuda:0"
    for name in ("tts-en", "librivox-0870", "front-center"):
        for use_itn in (False, True):
            _assert_parity(recognizer, clips[name], "auto", use_itn)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gpu_half_precision_decodes(tagged_model_dir: Path, speech_cache: Path, dtype: str) -> None:
    _require_cuda()
    recognizer = Recognizer(
        RecognizerOptions(model=str(tagged_model_dir), device="cuda", dtype=dtype, warmup=False)
    )
    pcm = speak("hello there", "en", cache_dir=speech_cache)
    transcript = recognizer.decode(pcm)
    assert transcript.text == "hello there"
    assert recognizer.decode_reference(pcm).token_ids == transcript.token_ids


def test_languages_constant() -> None:
    assert set(OPTION_LANGUAGES) <= set(LANGUAGES)


def test_the_tagged_model_is_not_called_meaningless(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from streamer.model.artifacts.files import model_source

    caplog.set_level(logging.WARNING, logger="streamer.model")
    model_source("random:tagged", "ms", cache_dir, RANDOM_MODELS)
    assert "trained on two clips" in caplog.text and "meaningless" not in caplog.text
