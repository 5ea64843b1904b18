"""Silero VAD (``--vad silero``): the real graph of the silero-vad package on ONNX Runtime.

Its probabilities equal the package's own wrapper; it calls espeak and recorded speech
speech and silence or noise silence; through the real server it gives the tagged model's
expected finals, and at 10 dB SNR white noise it finds every utterance boundary.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from streamer.cli.common import _classifier_factory
from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.protocol import StreamOptions
from streamer.errors import ConfigError, ModelError
from streamer.model.backends import silero
from streamer.model.backends.silero import (
    WINDOW_SAMPLES,
    SileroClassifier,
    SileroModel,
    SileroOptions,
    silero_classifier_factory,
)
from streamer.server.server import ServerOptions
from streamer.testkit import speech as synth
from tests.clips import LIBRIVOX, load_wav
from tests.server_fixtures import ServerThread, recognizer_loader
from tests.support import assert_boundaries, five_languages
from tests.timing import timeout_s

FRAME = 320  # the server's 20 ms frames

pytestmark = pytest.mark.skipif(not synth.tools_available(), reason="needs espeak-ng and sox")


@pytest.fixture(scope="module")
def model() -> SileroModel:
    return SileroModel()


class Recording:
    """The real model, keeping every probability it returns."""

    def __init__(self, model: SileroModel) -> None:
        self.model = model
        self.probabilities: list[float] = []

    def score(self, window: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        probability, state = self.model.score(window, state)
        self.probabilities.append(probability)
        return probability, state


def flags(model: SileroModel, pcm: np.ndarray, frame: int = FRAME) -> np.ndarray:
    classify = model.classifier()
    return np.array([classify(pcm[i : i + frame]) for i in range(0, pcm.size - frame + 1, frame)])


def probabilities(model: SileroModel, pcm: np.ndarray, chunk: int) -> list[float]:
    recording = Recording(model)
    classify = SileroClassifier(recording, SileroOptions())  # type: ignore[arg-type]
    for i in range(0, pcm.size, chunk):
        classify(pcm[i : i + chunk])
    return recording.probabilities


@pytest.fixture(scope="module")
def fox(speech_cache: Path) -> np.ndarray:
    pcm = synth.speak(synth.SENTENCES["en"][0], "en", cache_dir=speech_cache)
    return np.concatenate([np.zeros(4800, np.int16), pcm, np.zeros(8000, np.int16)])


# -- the model contract ----------------------------------------------------------------


def test_probabilities_equal_the_packages_own_wrapper(model, fox, tmp_path) -> None:
    """silero_vad's OnnxWrapper (in a subprocess: the package's import sets torch's
    thread count) scores the same 512-sample windows with the same 64-sample context."""
    noisy = synth.add_noise(fox, 10, seed=1)
    np.save(tmp_path / "pcm.npy", noisy)
    script = (
        "import sys, numpy as np, torch\n"
        "from silero_vad.utils_vad import OnnxWrapper\n"
        "from streamer.model.backends.silero import packaged_model_path\n"
        "pcm = np.load(sys.argv[1]).astype(np.float32) / 32768\n"
        "wrapper = OnnxWrapper(str(packaged_model_path()), force_onnx_cpu=True)\n"
        "probs = wrapper.audio_forward(torch.from_numpy(pcm), 16000).numpy().ravel()\n"
        "np.save(sys.argv[2], probs)\n"
    )
    out = tmp_path / "reference.npy"
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "pcm.npy"), str(out)],
        check=True,
        timeout=timeout_s(120),
        capture_output=True,
    )
    reference = np.load(out)
    ours = probabilities(model, noisy, FRAME)
    assert len(ours) == noisy.size // WINDOW_SAMPLES  # the wrapper also pads the last
    np.testing.assert_allclose(ours, reference[: len(ours)], atol=1e-6)
    assert max(ours) > 0.9 and min(ours) < 0.1  # speech and silence were both in it


@pytest.mark.parametrize("chunk", [160, 320, 480, 511, 513, 16000])
def test_any_frame_length_gives_the_same_windows(model, fox, chunk) -> None:
    assert probabilities(model, fox, chunk) == probabilities(model, fox, WINDOW_SAMPLES)


def test_hysteresis() -> None:
    """Speech starts at ``threshold`` and lasts until below ``off_threshold``."""

    class Scripted:  # a stand-in graph that answers a given probability per window
        def __init__(self, answers: list[float]) -> None:
            self.answers = iter(answers)

        def score(self, window: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
            return next(self.answers), state

    answers = [0.2, 0.49, 0.5, 0.4, 0.35, 0.34, 0.45, 0.6, 0.1]
    classify = SileroClassifier(Scripted(answers), SileroOptions())  # type: ignore[arg-type]
    window = np.zeros(WINDOW_SAMPLES, np.int16)
    got = [classify(window) for _ in answers]
    assert got == [False, False, True, True, True, False, False, True, False]


def test_decision_waits_for_a_whole_window(model) -> None:
    classify = model.classifier()
    classify(np.zeros(WINDOW_SAMPLES - 1, np.int16))
    assert classify.windows == 0
    classify(np.zeros(1, np.int16))
    assert classify.windows == 1


# -- speech is speech, silence and noise are not -----------------------------------------


@pytest.mark.parametrize("lang", ["en", "zh", "yue", "ja", "ko"])
def test_espeak_speech_is_speech(model, speech_cache, lang) -> None:
    pcm = synth.speak(synth.SENTENCES[lang][0], lang, cache_dir=speech_cache)
    lead, tail = 4800, 16000  # 300 ms before, 1 s after
    decided = flags(
        model, np.concatenate([np.zeros(lead, np.int16), pcm, np.zeros(tail, np.int16)])
    )
    start, end = lead // FRAME, (lead + pcm.size) // FRAME
    assert not decided[:start].any()  # nothing before the speech
    assert decided[start:end].mean() >= 0.8
    assert decided[start : start + 6].any()  # found within 120 ms of its onset
    assert not decided[end + 15 :].any()  # and over within 300 ms of its end


def test_recorded_speech_is_speech(model) -> None:
    files = sorted(LIBRIVOX.glob("*.wav"))
    assert files, "pocketsphinx-testdata is not installed"
    for path in files:
        assert flags(model, load_wav(path)).mean() >= 0.75, path.name


@pytest.mark.parametrize("kind", synth.NOISE_KINDS)
@pytest.mark.parametrize("rms", [300, 3000])
def test_noise_alone_is_never_speech(model, kind, rms) -> None:
    noise = synth.noise_of(kind, 5 * 16000, seed=4)
    pcm = np.clip(noise * rms / noise.std(), -32768, 32767).astype(np.int16)
    assert not flags(model, pcm).any()


def test_digital_silence_is_never_speech(model) -> None:
    assert not flags(model, np.zeros(3 * 16000, np.int16)).any()


# -- errors ----------------------------------------------------------------------------------


def test_missing_package_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setattr(silero.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ConfigError, match=r"sensevoice-streamer\[torch\].*pip install --no-deps silero-vad"
    ):
        silero.packaged_model_path()


def test_a_file_that_is_not_silero_is_a_model_error(tmp_path) -> None:
    import onnx
    from onnx import TensorProto, helper

    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a graph")
    with pytest.raises(ModelError, match="cannot load"):
        SileroModel(garbage)

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    other = tmp_path / "identity.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), other)
    with pytest.raises(ModelError, match="not a Silero VAD"):
        SileroModel(other)


@pytest.mark.parametrize("on, off", [(0.5, 0.6), (1.0, 0.5), (0.5, 0.0)])
def test_bad_thresholds(on, off) -> None:
    with pytest.raises(ConfigError):
        SileroOptions(threshold=on, off_threshold=off)


def test_cli_choice() -> None:
    assert _classifier_factory("webrtc") is None
    factory = _classifier_factory("silero")
    assert factory is not None
    a, b = factory(), factory()
    assert isinstance(a, SileroClassifier) and a is not b  # one state per stream
    with pytest.raises(ConfigError, match="unknown VAD"):
        _classifier_factory("energy")


# -- through the real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def silero_server(tagged_model_dir: Path) -> Iterator[ServerThread]:
    """The tagged model behind Silero VAD (what ``serve --vad silero`` builds)."""
    thread = ServerThread(
        recognizer_loader(tagged_model_dir),
        ServerOptions(),
        classifier_factory=silero_classifier_factory(),
    ).start()
    yield thread
    thread.shutdown()


async def test_server_gives_the_tagged_finals(silero_server, speech_cache) -> None:
    fox = synth.speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=speech_cache)
    hello = synth.speak("hello there", "en", cache_dir=speech_cache)
    pcm, truth = synth.join_with_silence([("en", "fox", fox), ("en", "hello", hello)], 1500)
    options = ClientOptions(url=silero_server.url, stream=StreamOptions(itn=False))
    result = await transcribe(options, pcm, 16000, speed=4.0)
    finals = list(result.finals)
    assert [(f.language, f.emotion, f.event, f.text) for f in finals] == [
        ("en", "NEUTRAL", "Speech", "the quick brown fox jumps over the lazy dog"),
        ("en", "HAPPY", "Laughter", "hello there"),
    ]
    assert_boundaries(finals, truth)


async def test_server_finds_every_boundary_at_10_db_white_noise(silero_server, speech_cache):
    pcm, truth = five_languages(speech_cache)
    noisy = synth.add_noise(pcm, snr_db=10, seed=7)
    result = await transcribe(ClientOptions(url=silero_server.url), noisy, 16000)
    assert_boundaries(list(result.finals), truth)


async def test_server_resamples_before_silero(silero_server, speech_cache) -> None:
    """A 48 kHz stream reaches the VAD at 16 kHz: the same segments, to a few ms."""
    import soxr

    pcm, truth = five_languages(speech_cache)
    pcm48 = soxr.resample(synth.add_noise(pcm, 10, seed=7), 16000, 48000).astype(np.int16)
    options = ClientOptions(url=silero_server.url, stream=StreamOptions(sample_rate=48000))
    result = await transcribe(options, pcm48, 48000)
    assert_boundaries(list(result.finals), truth)


def test_transcribe_command(tagged_model_dir, speech_cache, tmp_path, capsys) -> None:
    import soundfile as sf

    from streamer.cli import main

    fox = synth.speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=speech_cache)
    hello = synth.speak("hello there", "en", cache_dir=speech_cache)
    pcm, _ = synth.join_with_silence([("en", "fox", fox), ("en", "hello", hello)], 1500)
    wav = tmp_path / "two.wav"
    sf.write(wav, pcm, 16000, subtype="PCM_16")
    model = ["--model", str(tagged_model_dir), "--backend", "torch", "--no-warmup"]
    argv = ["transcribe", str(wav), "--vad", "silero", "--no-itn", "--json", *model]
    assert main(argv) == 0
    finals = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [f["text"] for f in finals] == [
        "the quick brown fox jumps over the lazy dog",
        "hello there",
    ]


def test_transcribe_at_log_level_warning_logs_no_info(
    tagged_model_dir, speech_cache, tmp_path, capsys
) -> None:
    """At its default it tells the loading stages (seconds to a minute); at an explicit
    --log-level warning it prints the transcript and nothing else."""
    import soundfile as sf

    from streamer.cli import main

    hello = synth.speak("hello there", "en", cache_dir=speech_cache)
    wav = tmp_path / "hello.wav"
    sf.write(wav, hello, 16000, subtype="PCM_16")
    model = ["--model", str(tagged_model_dir), "--backend", "onnx", "--no-warmup"]
    try:
        assert main(["transcribe", str(wav), *model, "--log-level", "warning"]) == 0
        quiet = capsys.readouterr()
        assert quiet.out.strip() == "hello there"
        assert "INFO" not in quiet.err, quiet.err
        assert main(["transcribe", str(wav), *model]) == 0
        assert "model ready after" in capsys.readouterr().err
    finally:
        logging.getLogger("streamer.model.backends.loading").setLevel(logging.NOTSET)
