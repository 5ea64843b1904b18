"""SenseVoiceSmall on ONNX Runtime: no torch or funasr at run time.

:class:`OnnxRecognizer` loads one of three directory layouts:

- an export made by :mod:`streamer.model.artifacts.onnx_export` (``manifest.json``,
  ``model.onnx``, ``model.int8.onnx``, ``tokens.txt``, ``bpe.model``, ``am.mvn``);
- FunASR's export (``model.onnx`` / ``model_quant.onnx``, ``am.mvn``, the sentencepiece
  model ``*.bpe.model`` or ``tokens.json``; inputs ``speech``, ``speech_lengths``,
  ``language``, ``textnorm``; outputs ``ctc_logits``, ``encoder_out_lens``);
- sherpa-onnx's (``model.onnx`` / ``model.int8.onnx`` with CMVN and LFR in the graph's
  metadata, ``tokens.txt``; inputs ``x``, ``x_length``, ``language``, ``text_norm``).

A torch/funasr directory (or ``random:NAME``, or a cached hub id) is exported once and
the export cached under ``cache_dir/onnx`` by content hash.

Threads: ``intra_op_num_threads`` is the ``threads`` option, and ONNX Runtime's worker
threads do not spin while waiting for work (``session.intra_op.allow_spinning = 0``)
unless ``spin_wait`` is set: spinning threads fight any other busy process on the same
cores and turn 0.3 s decodes into multi-second stalls (bench/RESULTS.md).

Interrupting: every model call runs with a ``RunOptions`` of its own, and
:meth:`OnnxRecognizer.interrupt` sets its ``terminate`` flag from the worker's submitting
thread; ONNX Runtime then ends the run between two nodes (within milliseconds), so a
final queued behind a partial's decode does not wait for all of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamer.errors import ConfigError, DecodeInterrupted, ModelError
from streamer.model.artifacts.files import missing_directory, model_source
from streamer.model.artifacts.onnx_export import (
    CMVN_FILE,
    FP32_FILE,
    INT8_FILE,
    TOKENIZER_FILE,
    TOKENS_FILE,
    cached_export,
    read_manifest,
)
from streamer.model.artifacts.published import (
    AUTO_MODEL,
    PUBLISHED_ONNX_MODEL,
    fetch_published,
    is_published,
)
from streamer.model.decode.decoding import CtcRecognizer, Utterance, padded_features
from streamer.model.decode.frontend import Cmvn, Frontend, read_am_mvn
from streamer.model.decode.tokenizer import (
    PieceTableTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    read_tokens_json,
    read_tokens_txt,
)
from streamer.model.sensevoice import FEATURE_DIM, LID_ROWS, QUERY_FRAMES, TEXTNORM_ROWS

if TYPE_CHECKING:
    from streamer.model.options import RecognizerOptions

logger = logging.getLogger(__name__)

FUNASR_FP32_FILE = "model.onnx"
FUNASR_INT8_FILE = "model_quant.onnx"
_ONNX_FILES = (FP32_FILE, INT8_FILE, FUNASR_INT8_FILE)


@dataclass(frozen=True)
class GraphLayout:
    """The input and output names of one family of SenseVoice ONNX exports."""

    name: str  # "sherpa-onnx" (also ours) or "funasr"
    features: str  # (N, T, 560) float32
    lengths: str  # (N,) valid frames of each row
    language: str  # (N,) language query row
    textnorm: str  # (N,) ITN query row
    logits: str  # (N, T + 4, V) CTC logits


LAYOUTS = (
    GraphLayout("sherpa-onnx", "x", "x_length", "language", "text_norm", "logits"),
    GraphLayout("funasr", "speech", "speech_lengths", "language", "textnorm", "ctc_logits"),
)


@dataclass(frozen=True)
class OnnxModelDir:
    """The files one ONNX model directory provides, once located."""

    directory: Path
    kind: str  # "streamer", "funasr" or "sherpa-onnx"
    graph: Path  # the .onnx file to run
    tokenizer: Tokenizer
    cmvn: Cmvn | None  # None: read from the graph's metadata (sherpa-onnx)


class OnnxRecognizer(CtcRecognizer):
    """SenseVoiceSmall on ONNX Runtime; decodes like :class:`CtcRecognizer` says.

    Construction blocks (locating, perhaps a one-time export, loading, warm-up): call it
    in the thread that will decode. Not thread-safe. Start-up problems raise ModelError,
    impossible options ConfigError.
    """

    frontend: Frontend  # always ours: the graph takes features
    interruptible = True  # a run stops when its RunOptions.terminate is set

    def __init__(
        self,
        options: RecognizerOptions,
        *,
        model_dir: OnnxModelDir | None = None,
        spin_wait: bool = False,
    ) -> None:
        """``model_dir``: already located (:func:`locate_onnx_model`); ``spin_wait``: let
        idle ONNX Runtime threads spin (faster on an idle machine, see the module doc)."""
        if options.dtype != "fp32":
            raise ConfigError(f"dtype {options.dtype} runs on the torch backend only")
        from streamer.model.options import default_threads

        started = time.perf_counter()
        self.options = options
        self._threads = options.threads or default_threads()
        self.model_dir = model_dir or locate_onnx_model(options)
        self.tokenizer = self.model_dir.tokenizer
        import onnxruntime as ort

        self._ort = ort
        self._run_lock = threading.Lock()  # guards _run_options (interrupt's other thread)
        self._run_options: Any = None  # the RunOptions of the call in progress
        providers, self._device = _providers(options.device, options.quantize, ort)
        session_options = ort.SessionOptions()
        session_options.intra_op_num_threads = self._threads
        session_options.inter_op_num_threads = 1
        session_options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session_options.log_severity_level = 3  # errors only
        spinning = "1" if spin_wait else "0"
        session_options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        session_options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
        try:
            self._session = ort.InferenceSession(
                str(self.model_dir.graph), sess_options=session_options, providers=providers
            )
        except Exception as error:  # ORT raises its own exception types for bad graphs
            raise ModelError(
                f"ONNX Runtime cannot load {self.model_dir.graph}: {type(error).__name__}: {error}"
            ) from error
        if self._device.startswith("cuda") and "CUDAExecutionProvider" not in (
            self._session.get_providers()
        ):
            raise ConfigError(
                "ONNX Runtime could not start its CUDA execution provider (CUDA or cuDNN "
                "libraries missing?); use --device cpu"
            )
        self._layout, self._integer_types = _check_graph(self._session, self.model_dir)
        metadata = self._session.get_modelmeta().custom_metadata_map
        _check_query_rows(metadata, self.model_dir.graph)
        self.frontend = Frontend(self.model_dir.cmvn or _metadata_cmvn(metadata, self.model_dir))
        logger.info(
            "loaded model %s with ONNX Runtime from %s (%s, %s, %d threads) in %.1f s",
            self.name,
            self.model_dir.graph,
            self.model_dir.kind,
            self._device,
            self._threads,
            time.perf_counter() - started,
        )
        if options.warmup:
            self.warmup()

    @property
    def backend(self) -> str:
        return "onnx"

    def interrupt(self) -> bool:
        with self._run_lock:
            run_options = self._run_options
            if run_options is None:
                return False
            run_options.terminate = True
            return True

    def _logits(self, batch: Sequence[Utterance]) -> list[np.ndarray]:
        padded, lengths = padded_features(self.frontend, batch)
        layout, types = self._layout, self._integer_types
        inputs = {
            layout.features: padded,
            layout.lengths: np.array(lengths, dtype=types[layout.lengths]),
            layout.language: np.array(
                [u.language_row for u in batch], dtype=types[layout.language]
            ),
            layout.textnorm: np.array(
                [u.textnorm_row for u in batch], dtype=types[layout.textnorm]
            ),
        }
        run_options = self._ort.RunOptions()
        with self._run_lock:
            self._run_options = run_options
        try:
            (logits,) = self._session.run([layout.logits], inputs, run_options)
        except Exception as error:  # ORT's failures are not RuntimeError subclasses
            if run_options.terminate:
                raise DecodeInterrupted("stopped so that a final goes first") from None
            raise RuntimeError(f"{type(error).__name__}: {error}") from error
        finally:
            with self._run_lock:
                self._run_options = None
        if logits.shape[-1] != self.tokenizer.size:
            raise ModelError(
                f"{self.model_dir.graph} returns {logits.shape[-1]} CTC outputs but its "
                f"tokenizer has {self.tokenizer.size} pieces"
            )
        return [logits[row, : n + QUERY_FRAMES] for row, n in enumerate(lengths)]


# --- locating ------------------------------------------------------------------------------


def locate_onnx_model(options: RecognizerOptions) -> OnnxModelDir:
    """The ONNX directory ``options.model`` names, exporting a torch model once if needed."""
    model = PUBLISHED_ONNX_MODEL if options.model == AUTO_MODEL else options.model
    if is_published(model):  # runs as published: its int8 graph, nothing to export
        return onnx_model_dir(fetch_published(model, options.cache_dir), quantized=True)
    quantized = options.quantize == "int8"
    source = model_source(model, options.hub, options.cache_dir, options.random_models)
    directory = _download(options) if isinstance(source, str) else source
    if not directory.is_dir():
        raise missing_directory(directory)
    if not any((directory / name).is_file() for name in _ONNX_FILES):
        if not (directory / "model.pt").is_file() and not (directory / "config.yaml").is_file():
            raise ModelError(
                f"{directory} holds neither an ONNX model ({', '.join(_ONNX_FILES)}) nor a "
                "torch/funasr model (config.yaml, model.pt) to export"
            )
        directory = cached_export(directory, options.cache_dir, name=model)
    return onnx_model_dir(directory, quantized=quantized)


def _download(options: RecognizerOptions) -> Path:
    """Download a hub id through funasr (the one code path that knows both hubs)."""
    from streamer.extras import TORCH, TORCH_MODULES, require

    require(f"downloading {options.model} and exporting it to ONNX", TORCH, *TORCH_MODULES)
    from streamer.model.backends.torch_backend import Recognizer
    from streamer.model.options import RecognizerOptions

    recognizer = Recognizer(
        RecognizerOptions(
            model=options.model,
            backend="torch",
            hub=options.hub,
            device="cpu",
            warmup=False,
            cache_dir=options.cache_dir,
        )
    )
    if recognizer.model_dir is None or not recognizer.model_dir.is_dir():
        raise ModelError(f"funasr did not say where it downloaded {options.model}")
    return recognizer.model_dir


def onnx_model_dir(directory: Path, *, quantized: bool) -> OnnxModelDir:
    """Recognise the layout of ONNX directory ``directory`` and pick its files."""
    manifest = read_manifest(directory)
    if manifest is not None:
        tokenizer_file = directory / manifest.files.get("tokenizer", TOKENIZER_FILE)
        tokenizer: Tokenizer
        if tokenizer_file.is_file():
            tokenizer = SentencePieceTokenizer(tokenizer_file)
        else:
            tokenizer = PieceTableTokenizer(read_tokens_txt(directory / TOKENS_FILE))
        graph = directory / manifest.files["int8" if quantized else "fp32"]
        cmvn = read_am_mvn(directory / manifest.files.get("cmvn", CMVN_FILE))
        return OnnxModelDir(directory, "streamer", _require(graph), tokenizer, cmvn)
    if (directory / TOKENS_FILE).is_file() and not (directory / CMVN_FILE).is_file():
        graph = directory / (INT8_FILE if quantized else FP32_FILE)
        if not graph.is_file() and (directory / INT8_FILE).is_file():
            graph = directory / INT8_FILE  # sherpa-onnx's int8 releases ship only this one
        tokenizer = PieceTableTokenizer(read_tokens_txt(directory / TOKENS_FILE))
        return OnnxModelDir(directory, "sherpa-onnx", _require(graph), tokenizer, None)
    if (directory / CMVN_FILE).is_file():
        graph = directory / (FUNASR_INT8_FILE if quantized else FUNASR_FP32_FILE)
        return OnnxModelDir(
            directory,
            "funasr",
            _require(graph),
            _funasr_tokenizer(directory),
            read_am_mvn(directory / CMVN_FILE),
        )
    raise ModelError(
        f"{directory} is not a SenseVoiceSmall ONNX directory: expected manifest.json (an "
        "export of this project), am.mvn and a tokenizer next to model.onnx / "
        "model_quant.onnx (FunASR), or tokens.txt next to model.onnx / model.int8.onnx "
        "(sherpa-onnx)"
    )


def _require(graph: Path) -> Path:
    if graph.is_file():
        return graph
    present = sorted(p.name for p in graph.parent.glob("*.onnx"))
    hint = " (--quantize int8 picks the quantized one)" if present else ""
    raise ModelError(
        f"{graph} does not exist; {graph.parent} holds {', '.join(present) or 'no .onnx file'}"
        + hint
    )


def _funasr_tokenizer(directory: Path) -> Tokenizer:
    named = None
    config = directory / "config.yaml"
    if config.is_file():
        import yaml

        try:
            conf = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as error:
            raise ModelError(f"{config} is not valid YAML ({error})") from error
        bpemodel = (conf.get("tokenizer_conf") or {}).get("bpemodel")
        named = directory / Path(str(bpemodel)).name if bpemodel else None
    candidates = [named] if named is not None else []
    candidates += sorted(directory.glob("*.bpe.model")) + [directory / TOKENIZER_FILE]
    for candidate in candidates:
        if candidate is not None and candidate.is_file():
            return SentencePieceTokenizer(candidate)
    if (directory / "tokens.json").is_file():
        return PieceTableTokenizer(read_tokens_json(directory / "tokens.json"))
    raise ModelError(
        f"{directory} has no tokenizer: expected a sentencepiece model (*.bpe.model) or "
        "tokens.json next to model.onnx"
    )


# --- checks ----------------------------------------------------------------------------------


def check_cuda_provider(device: str) -> None:
    """ConfigError unless this onnxruntime has the CUDA execution provider."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise ConfigError(
            f"device {device} with the onnx backend needs ONNX Runtime's CUDA execution "
            f"provider, and this onnxruntime {ort.__version__} has only "
            f"{', '.join(available)}. Install onnxruntime-gpu instead of onnxruntime, or "
            "use --device cpu (or --backend torch)."
        )


def _providers(device: str, quantize: str | None, ort: Any) -> tuple[list[Any], str]:
    """Execution providers for ``device``, and the device they run on."""
    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    if device == "auto":
        device = "cuda:0" if cuda and quantize is None else "cpu"
    if device == "cpu":
        return ["CPUExecutionProvider"], "cpu"
    check_cuda_provider(device)
    index = int(device.partition(":")[2] or 0)
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"], (
        f"cuda:{index}"
    )


_INTEGER_TYPES = {"tensor(int32)": np.int32, "tensor(int64)": np.int64}


def _check_graph(session: Any, model_dir: OnnxModelDir) -> tuple[GraphLayout, dict[str, Any]]:
    """The layout the graph's inputs follow; ModelError naming what is wrong otherwise."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    graph = model_dir.graph
    found = ", ".join(f"{i.name} {i.type} {i.shape}" for i in inputs.values())
    for layout in LAYOUTS:
        names = (layout.features, layout.lengths, layout.language, layout.textnorm)
        if set(inputs) != set(names):
            continue
        features = inputs[layout.features]
        if features.type != "tensor(float)" or len(features.shape) != 3:
            raise ModelError(f"{graph}: input {features.name} must be float (N, T, 560)")
        if isinstance(features.shape[2], int) and features.shape[2] != FEATURE_DIM:
            raise ModelError(
                f"{graph}: input {features.name} has {features.shape[2]} features per frame; "
                f"SenseVoiceSmall takes {FEATURE_DIM} (80 mel bins x 7 stacked frames)"
            )
        types = {}
        for name in names[1:]:
            if inputs[name].type not in _INTEGER_TYPES or len(inputs[name].shape) != 1:
                raise ModelError(f"{graph}: input {name} must be an int32 or int64 vector")
            types[name] = _INTEGER_TYPES[inputs[name].type]
        if layout.logits not in outputs:
            raise ModelError(f"{graph}: no output named {layout.logits} (CTC logits)")
        vocab = outputs[layout.logits].shape[-1]
        size = model_dir.tokenizer.size
        if isinstance(vocab, int) and vocab != size:
            raise ModelError(
                f"Vocabulary mismatch in {model_dir.directory}: {graph.name} has {vocab} CTC "
                f"outputs but the tokenizer has {size} pieces. Use the tokenizer that was "
                "shipped with this model."
            )
        return layout, types
    expected = " or ".join(
        f"({layout.features}, {layout.lengths}, {layout.language}, {layout.textnorm})"
        for layout in LAYOUTS
    )
    raise ModelError(
        f"{graph} is not a SenseVoiceSmall CTC graph: its inputs are {found or 'none'}; "
        f"expected {expected}"
    )


def _check_query_rows(metadata: dict[str, str], graph: Path) -> None:
    """sherpa-onnx metadata names the query rows; they must be SenseVoiceSmall's."""
    expected = {f"lang_{k}": v for k, v in LID_ROWS.items()}
    expected |= {"with_itn": TEXTNORM_ROWS["withitn"], "without_itn": TEXTNORM_ROWS["woitn"]}
    wrong = {k: metadata[k] for k, v in expected.items() if k in metadata and metadata[k] != str(v)}
    if wrong:
        raise ModelError(f"{graph} uses other query rows than SenseVoiceSmall: {wrong}")


def _metadata_cmvn(metadata: dict[str, str], model_dir: OnnxModelDir) -> Cmvn:
    try:
        shift = np.array(metadata["neg_mean"].split(","), dtype=np.float32)
        scale = np.array(metadata["inv_stddev"].split(","), dtype=np.float32)
        window = int(metadata.get("lfr_window_size", 7)), int(metadata.get("lfr_window_shift", 6))
    except (KeyError, ValueError) as error:
        raise ModelError(
            f"{model_dir.graph} has no usable CMVN in its metadata (neg_mean, inv_stddev) "
            f"and {model_dir.directory} has no am.mvn: {error}"
        ) from error
    if window != (7, 6):
        raise ModelError(f"{model_dir.graph} stacks frames {window}; SenseVoiceSmall uses (7, 6)")
    return Cmvn(shift=shift, scale=scale)
