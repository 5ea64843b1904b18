"""The ONNX Runtime backend: torch's exact tokens, the three layouts, clear failures."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamer.errors import ConfigError, DecodeInterrupted, ModelError
from streamer.model.artifacts import onnx_export
from streamer.model.artifacts.onnx_export import cached_export, read_manifest
from streamer.model.backends.loading import load_recognizer, resolve_backend
from streamer.model.backends.onnx_backend import OnnxRecognizer, onnx_model_dir
from streamer.model.backends.torch_backend import Recognizer
from streamer.model.options import RecognizerOptions
from streamer.model.sensevoice import MIN_DECODE_SAMPLES
from streamer.testkit.models import RANDOM_MODELS
from streamer.testkit.onnx_layouts import funasr_layout, rewrite_graph, sherpa_layout
from streamer.testkit.speech import SAMPLE_RATE, speak
from tests import clips as clips_module
from tests.clips import OPTION_LANGUAGES, load_clips
from tests.timing import timeout_s

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def clips(speech_cache: Path) -> dict[str, np.ndarray]:
    return load_clips(speech_cache)


@pytest.fixture(scope="module")
def long_speech(clips: dict[str, np.ndarray]) -> np.ndarray:
    return clips_module.long_speech(clips)


def _options(model: Path | str, **options: object) -> RecognizerOptions:
    defaults: dict[str, object] = {"device": "cpu", "threads": 2, "warmup": False}
    return RecognizerOptions(model=str(model), **{**defaults, **options})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_export(tiny_model_dir: Path, cache_dir: Path) -> Path:
    return cached_export(tiny_model_dir, cache_dir)


@pytest.fixture(scope="module")
def torch_tiny(tiny_model_dir: Path) -> Recognizer:
    return Recognizer(_options(tiny_model_dir, backend="torch"))


@pytest.fixture(scope="module")
def onnx_tiny(tiny_export: Path) -> OnnxRecognizer:
    return OnnxRecognizer(_options(tiny_export, backend="onnx"))


def _assert_same(torch_rec: Recognizer, onnx_rec: OnnxRecognizer, pcm, language, use_itn) -> None:
    expected = torch_rec.decode(pcm, language=language, use_itn=use_itn)
    got = onnx_rec.decode(pcm, language=language, use_itn=use_itn)
    assert got.token_ids == expected.token_ids, (language, use_itn, len(pcm))
    assert got.raw == expected.raw and got.rich == expected.rich
    assert got.token_frames == expected.token_frames
    np.testing.assert_allclose(got.token_confidences, expected.token_confidences, atol=1e-4)


# --- parity: fp32 ONNX gives torch's exact tokens ---------------------------------------------


def test_parity_every_clip(torch_tiny, onnx_tiny, clips) -> None:
    for pcm in clips.values():
        for use_itn in (False, True):
            _assert_same(torch_tiny, onnx_tiny, pcm, "auto", use_itn)


@pytest.mark.parametrize("clip", ["tts-zh", "librivox-0890"])
def test_parity_every_language(torch_tiny, onnx_tiny, clips, clip: str) -> None:
    for language in OPTION_LANGUAGES:
        for use_itn in (False, True):
            _assert_same(torch_tiny, onnx_tiny, clips[clip], language, use_itn)


@pytest.mark.parametrize("seconds", [0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.5, 6.0, 7.0])
def test_parity_lengths(torch_tiny, onnx_tiny, long_speech, seconds: float) -> None:
    pcm = long_speech[: int(seconds * SAMPLE_RATE)]
    for use_itn in (False, True):
        _assert_same(torch_tiny, onnx_tiny, pcm, "auto", use_itn)


@pytest.mark.parametrize("samples", [0, 399, MIN_DECODE_SAMPLES, 401, 559, 1000, 3199])
def test_parity_very_short(torch_tiny, onnx_tiny, long_speech, samples: int) -> None:
    _assert_same(torch_tiny, onnx_tiny, long_speech[:samples], "auto", True)


def test_parity_silence_noise_and_input_forms(torch_tiny, onnx_tiny, clips) -> None:
    rng = np.random.default_rng(1)
    _assert_same(torch_tiny, onnx_tiny, np.zeros(SAMPLE_RATE, np.int16), "auto", True)
    noise = rng.normal(0, 3000, 2 * SAMPLE_RATE).astype(np.int16)
    _assert_same(torch_tiny, onnx_tiny, noise, "en", False)
    pcm = clips["librivox-0880"]
    expected = onnx_tiny.decode(pcm).token_ids
    assert onnx_tiny.decode(pcm.tobytes()).token_ids == expected
    assert onnx_tiny.decode(pcm.astype(np.float32) / 32768).token_ids == expected


def test_tagged_model_through_onnx(tagged_model_dir: Path, cache_dir: Path, speech_cache) -> None:
    recognizer = load_recognizer(_options(tagged_model_dir, backend="onnx"))
    assert isinstance(recognizer, OnnxRecognizer)
    pcm = speak("hello there", "en", cache_dir=speech_cache)
    transcript = recognizer.decode(pcm, language="auto", use_itn=False)
    assert transcript.raw == "<|en|><|HAPPY|><|Laughter|><|woitn|>hello there"
    assert (transcript.language, transcript.emotion, transcript.event) == (
        "en",
        "HAPPY",
        "Laughter",
    )
    assert transcript.rich == "😀hello there😊"
    assert transcript.token_frames[:4] == (0, 1, 2, 3)  # the tags sit on the query frames
    assert all(4 <= f < 4 + pcm.size / 960 + 1 for f in transcript.token_frames[4:])
    assert list(transcript.token_frames) == sorted(transcript.token_frames)
    assert all(0.0 < c <= 1.0 for c in transcript.token_confidences)


# --- batches -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_a_batch_decodes_as_its_utterances_alone(
    torch_tiny, onnx_tiny, long_speech, backend: str
) -> None:
    recognizer = torch_tiny if backend == "torch" else onnx_tiny
    pcms = [long_speech[: 7 * SAMPLE_RATE], long_speech[8000:12000], long_speech[:300]]
    pcms.append(long_speech[SAMPLE_RATE : 3 * SAMPLE_RATE])
    languages, itns = ["auto", "en", "auto", "zh"], [True, False, True, False]
    batch = recognizer.decode_batch(pcms, languages=languages, use_itns=itns)
    for transcript, pcm, language, itn in zip(batch, pcms, languages, itns, strict=True):
        alone = recognizer.decode(pcm, language=language, use_itn=itn)
        assert transcript.token_ids == alone.token_ids
        assert transcript.token_frames == alone.token_frames
        assert transcript.audio_ms == pytest.approx(pcm.size / 16)
    assert batch[2].token_ids == ()
    with pytest.raises(ConfigError):
        recognizer.decode_batch(pcms, languages=["auto"], use_itns=itns)


# --- int8 ----------------------------------------------------------------------------------------


def test_int8_graph_decodes(tiny_export: Path, clips, onnx_tiny) -> None:
    """int8 is not token-exact (bench/RESULTS.md reports its agreement); it must decode."""
    int8 = OnnxRecognizer(_options(tiny_export, backend="onnx", quantize="int8"))
    assert int8.model_dir.graph.name == "model.int8.onnx"
    agree = total = 0
    for pcm in clips.values():
        tokens = int8.decode(pcm).token_ids
        assert tokens and all(0 < t < 400 for t in tokens)
        reference = onnx_tiny.decode(pcm).token_ids
        agree += sum(a == b for a, b in zip(tokens, reference, strict=False))
        total += max(len(tokens), len(reference))
    assert agree / total > 0.5  # far from random (1/400): the quantized weights are used


def test_an_interrupted_run_stops_and_the_next_decodes(onnx_tiny, clips) -> None:
    """interrupt() sets the running call's RunOptions.terminate: ONNX Runtime itself
    ends that run (here the flag is set as the run starts, so it cannot finish first),
    the decode raises DecodeInterrupted, and the session decodes the next call as
    before. With no call running there is nothing to stop."""
    pcm = clips["tts-en"]
    before = onnx_tiny.decode(pcm).token_ids
    assert onnx_tiny.interruptible and onnx_tiny.interrupt() is False
    session = onnx_tiny._session

    class StopsAsItStarts:
        def run(self, outputs, inputs, run_options):
            assert onnx_tiny.interrupt() is True  # the call in progress is this one
            return session.run(outputs, inputs, run_options)

        def __getattr__(self, name):
            return getattr(session, name)

    onnx_tiny._session = StopsAsItStarts()
    try:
        with pytest.raises(DecodeInterrupted):
            onnx_tiny.decode(pcm)
    finally:
        onnx_tiny._session = session
    assert onnx_tiny.interrupt() is False
    assert onnx_tiny.decode(pcm).token_ids == before


# --- export and cache ---------------------------------------------------------------------------


def test_manifest_and_files(tiny_export: Path, tiny_model_dir: Path) -> None:
    manifest = read_manifest(tiny_export)
    assert manifest is not None
    assert manifest.opset == onnx_export.ONNX_OPSET
    assert manifest.int8_weight_type == onnx_export.default_int8_weight_type()
    assert manifest.vocab_size == 400
    assert len(manifest.source_sha256) == 64
    assert {"torch", "funasr", "onnx", "onnxruntime"} <= set(manifest.versions)
    for name in manifest.files.values():
        assert (tiny_export / name).is_file(), name
    assert tiny_export.name == f"{manifest.source_sha256[:16]}-{manifest.int8_weight_type.lower()}"
    lines = (tiny_export / "tokens.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 400 and lines[0] == "<unk> 0"

    import onnx

    model = onnx.load(str(tiny_export / "model.int8.onnx"), load_external_data=False)
    metadata = {p.key: p.value for p in model.metadata_props}
    assert metadata["model_type"] == "sense_voice_ctc"
    assert metadata["lang_zh"] == "3" and metadata["with_itn"] == "14"
    assert len(metadata["neg_mean"].split(",")) == 560
    assert {o.domain for o in model.opset_import} >= {""}


def test_cache_is_keyed_by_content(
    tiny_export: Path, tiny_model_dir: Path, cache_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx_export, "export_in_child", no_export)
    started = time.perf_counter()
    assert cached_export(tiny_model_dir, cache_dir) == tiny_export
    assert time.perf_counter() - started < timeout_s(5)  # the hash memo makes this a stat per file
    copy = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, copy)
    with (copy / "am.mvn").open("a") as stream:
        stream.write("\n")
    with pytest.raises(AssertionError, match="exported again"):
        cached_export(copy, tmp_path / "cache")


def test_export_runs_in_a_child_and_its_log_shows_here(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    export = cached_export(tiny_model_dir, tmp_path / "cache")
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert any(m.startswith("export: running in child process") for _, m in messages)
    # the child's own lines, logged again here under their logger
    assert any(
        n == "streamer.model.artifacts.onnx_export" and m.startswith("exported ")
        for n, m in messages
    )
    assert read_manifest(export) is not None
    # the weights are beside the graph, once: the graph file holds only its structure
    import onnx

    graph = onnx.load(str(export / "model.onnx"), load_external_data=False)
    assert graph.graph.initializer
    for weight in graph.graph.initializer:
        assert weight.data_location == onnx.TensorProto.EXTERNAL and not weight.raw_data
    assert (export / "model.onnx.data").stat().st_size > 3_000_000  # 0.8 M float32


@pytest.mark.parametrize(("weight_type", "reduce_range"), [("QUInt8", False), ("QInt8", True)])
def test_the_lean_quantizer_writes_onnxruntimes_graph(
    tiny_export: Path, tmp_path: Path, weight_type: str, reduce_range: bool
) -> None:
    """quantize_matmuls holds one weight at a time; what it writes is quantize_dynamic's."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from streamer.model.artifacts.onnx_quantize import quantize_matmuls

    source, ours, theirs = tiny_export / "model.onnx", tmp_path / "ours", tmp_path / "theirs"
    quantize_matmuls(source, ours, weight_type, reduce_range=reduce_range)
    quantize_dynamic(
        str(source),
        str(theirs),
        op_types_to_quantize=["MatMul"],
        weight_type=getattr(QuantType, weight_type),
        reduce_range=reduce_range,
    )
    a, b = onnx.load(str(ours)), onnx.load(str(theirs))
    assert sum(n.op_type == "MatMulInteger" for n in a.graph.node) == 17

    def nodes(model: onnx.ModelProto) -> list[bytes]:  # theirs are sorted differently
        return sorted(n.SerializeToString(deterministic=True) for n in model.graph.node)

    assert nodes(a) == nodes(b)
    mine = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    reference = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    assert list(mine) == list(reference)
    for name, array in reference.items():
        assert mine[name].dtype == array.dtype and np.array_equal(mine[name], array), name
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((2, 40, 560)).astype(np.float32),
        "x_length": np.array([40, 25], dtype=np.int32),
        "language": np.array([0, 4], dtype=np.int32),
        "text_norm": np.array([14, 15], dtype=np.int32),
    }
    outputs = [ort.InferenceSession(str(p)).run(None, feeds)[0] for p in (ours, theirs)]
    assert np.array_equal(*outputs)


def test_a_failing_export_says_why(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match="export of .* failed"):
        onnx_export.export_in_child(
            broken, tmp_path / "out", int8_weight_type="QUInt8", name="broken", digest="0" * 64
        )


def test_cli_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    from streamer.cli import main

    out = tmp_path / "export"
    command = ["export-onnx", str(tiny_model_dir), "--out", str(out)]
    assert main([*command, "--int8-weight-type", "QUInt8"]) == 0
    manifest = read_manifest(out)
    assert manifest is not None and manifest.int8_weight_type == "QUInt8"
    assert main(command) == 2  # not empty


# --- published layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["bpe", "json"])
def test_funasr_layout(tiny_export, tmp_path, onnx_tiny, clips, tokenizer: str) -> None:
    directory = funasr_layout(tiny_export, tmp_path / "funasr", tokenizer=tokenizer)
    assert onnx_model_dir(directory, quantized=False).kind == "funasr"
    recognizer = OnnxRecognizer(_options(directory, backend="onnx"))
    for name in ("tts-en", "librivox-0870"):
        expected = onnx_tiny.decode(clips[name], language="en")
        assert recognizer.decode(clips[name], language="en").raw == expected.raw
    quantized = OnnxRecognizer(_options(directory, backend="onnx", quantize="int8"))
    assert quantized.model_dir.graph.name == "model_quant.onnx"
    assert quantized.decode(clips["tts-en"]).token_ids


def test_sherpa_layout(tiny_export, tmp_path, onnx_tiny, clips) -> None:
    directory = sherpa_layout(tiny_export, tmp_path / "sherpa")
    assert not (directory / "am.mvn").exists()  # CMVN comes from the graph's metadata
    recognizer = OnnxRecognizer(_options(directory, backend="onnx"))
    assert recognizer.model_dir.kind == "sherpa-onnx"
    for name in ("tts-zh", "front-center"):
        assert recognizer.decode(clips[name]).raw == onnx_tiny.decode(clips[name]).raw
    only_int8 = sherpa_layout(tiny_export, tmp_path / "int8-only", graphs=("model.int8.onnx",))
    # sherpa-onnx's int8 releases ship model.int8.onnx alone: it runs without --quantize
    assert OnnxRecognizer(_options(only_int8, backend="onnx")).model_dir.graph.name == (
        "model.int8.onnx"
    )
    assert (
        OnnxRecognizer(_options(only_int8, backend="onnx", quantize="int8"))
        .decode(clips["tts-zh"])
        .token_ids
    )


def test_wrong_graph_inputs(tiny_export: Path, tmp_path: Path) -> None:
    directory = sherpa_layout(tiny_export, tmp_path / "renamed", graphs=())
    rewrite_graph(
        tiny_export / "model.onnx", directory / "model.onnx", {"x": "features"}, drop_metadata=False
    )
    with pytest.raises(ModelError, match=r"inputs are features.*expected \(x, x_length"):
        OnnxRecognizer(_options(directory, backend="onnx"))


def test_vocabulary_mismatch(tiny_export: Path, tmp_path: Path) -> None:
    directory = sherpa_layout(tiny_export, tmp_path / "short-vocab")
    lines = (directory / "tokens.txt").read_text(encoding="utf-8").splitlines()
    (directory / "tokens.txt").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    with pytest.raises(ModelError, match="400 CTC outputs but the tokenizer has 300"):
        OnnxRecognizer(_options(directory, backend="onnx"))


def test_not_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="neither an ONNX model"):
        OnnxRecognizer(_options(tmp_path / "empty", backend="onnx"))
    with pytest.raises(ModelError, match="does not exist"):
        OnnxRecognizer(_options(tmp_path / "nowhere", backend="onnx"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(b"not a graph")
    (broken / "tokens.txt").write_text("<unk> 0\n")
    with pytest.raises(ModelError, match="cannot load"):
        OnnxRecognizer(_options(broken, backend="onnx"))


# --- choosing the backend, devices, start-up --------------------------------------------------


def test_resolve_backend() -> None:
    assert resolve_backend(RecognizerOptions(backend="torch")) == "torch"
    assert resolve_backend(RecognizerOptions(backend="onnx")) == "onnx"
    assert resolve_backend(RecognizerOptions(device="cpu")) == "onnx"
    assert resolve_backend(RecognizerOptions(device="cuda")) == "torch"
    assert resolve_backend(RecognizerOptions(device="cuda", dtype="fp16")) == "torch"
    with pytest.raises(ConfigError):
        Recognizer(RecognizerOptions(backend="onnx"))


def test_cuda_without_the_cuda_provider(tiny_export: Path) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA execution provider")
    with pytest.raises(ConfigError, match="onnxruntime-gpu"):
        OnnxRecognizer(_options(tiny_export, backend="onnx", device="cuda"))
    from streamer.model.backends.loading import preflight

    with pytest.raises(ConfigError, match="onnxruntime-gpu"):
        preflight(_options(tiny_export, backend="onnx", device="cuda:0"))


def test_load_random_model_through_loading(cache_dir: Path, tiny_export: Path) -> None:
    recognizer = load_recognizer(
        RecognizerOptions(
            model="random:tiny",
            backend="onnx",
            cache_dir=cache_dir,
            threads=1,
            random_models=RANDOM_MODELS,
        )
    )
    assert recognizer.name == "random:tiny"
    assert recognizer.backend == "onnx" and recognizer.device == "cpu"
    assert isinstance(recognizer, OnnxRecognizer)
    assert recognizer.model_dir.directory == tiny_export


def test_onnx_decoding_imports_neither_torch_nor_funasr(tiny_export: Path) -> None:
    code = (
        "import sys\n"
        "from streamer.model.backends.onnx_backend import OnnxRecognizer\n"
        "from streamer.model.options import RecognizerOptions\n"
        f"r = OnnxRecognizer(RecognizerOptions(model={str(tiny_export)!r}, device='cpu'))\n"
        "r.decode(b'\\x10\\x00' * 16000)\n"
        "print(sorted(m for m in ('torch', 'funasr') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_the_backend_loads_no_model_library() -> None:
    code = (
        "import sys, streamer.model.backends.onnx_backend, streamer.model.artifacts.onnx_export, "
        "streamer.model.backends.loading, streamer.testkit.onnx_layouts\n"
        "print(sorted(m for m in ('torch', 'funasr', 'onnxruntime', 'onnx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- the server ----------------------------------------------------------------------------------


async def test_server_with_the_onnx_backend(make_server, tagged_model_dir, speech_cache) -> None:
    from streamer.client.connection import ClientOptions
    from streamer.client.streaming import transcribe
    from streamer.core.protocol import StreamOptions
    from streamer.testkit import speech as synth

    options = _options(tagged_model_dir, backend="onnx", warmup=True)
    server = make_server(lambda: load_recognizer(options))
    pcm = speak("hello there", "en", cache_dir=speech_cache)
    signal, _ = synth.join_with_silence([("en", "hello there", pcm)], 800)
    result = await transcribe(
        ClientOptions(url=server.url, stream=StreamOptions(itn=False)),
        signal,
        16000,
    )
    finals = list(result.finals)
    assert [f.text for f in finals] == ["hello there"]
    assert (finals[0].emotion, finals[0].event) == ("HAPPY", "Laughter")


# --- real size and GPU ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pair(
    small_model_dir: Path, cache_dir: Path
) -> Iterator[tuple[Recognizer, OnnxRecognizer]]:
    export = cached_export(small_model_dir, cache_dir)
    pair = (
        Recognizer(_options(small_model_dir, backend="torch")),
        OnnxRecognizer(_options(export, backend="onnx")),
    )
    yield pair
    del pair


@pytest.mark.slow
def test_parity_small(small_pair, clips, long_speech) -> None:
    torch_rec, onnx_rec = small_pair
    cases = [
        (long_speech[: int(0.1 * SAMPLE_RATE)], "auto", True),
        (long_speech[:SAMPLE_RATE], "en", False),
        (long_speech[: 3 * SAMPLE_RATE], "zh", True),
        (long_speech[: 7 * SAMPLE_RATE], "auto", False),
        (clips["tts-yue"], "yue", True),
        (clips["tts-ja"], "ja", False),
        (clips["tts-ko"], "ko", True),
        (clips["librivox-0930"], "nospeech", False),
        (long_speech[:MIN_DECODE_SAMPLES], "auto", True),
    ]
    for pcm, language, use_itn in cases:
        _assert_same(torch_rec, onnx_rec, pcm, language, use_itn)


@pytest.mark.gpu
def test_gpu_parity_tiny(tiny_export: Path, onnx_tiny, clips) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs onnxruntime-gpu (CUDAExecutionProvider)")
    gpu = OnnxRecognizer(_options(tiny_export, backend="onnx", device="cuda", warmup=True))
    assert gpu.device == "cuda:0"
    for name in ("tts-en", "librivox-0870", "front-center"):
        assert gpu.decode(clips[name]).token_ids == onnx_tiny.decode(clips[name]).token_ids


def test_export_manifest_is_json(tiny_export: Path) -> None:
    data = json.loads((tiny_export / "manifest.json").read_text())
    assert data["format"] == "sensevoice-streamer-onnx"
