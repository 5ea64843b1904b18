"""Export a torch/funasr SenseVoiceSmall directory to ONNX, once per model (cached).

The graph is SenseVoiceSmall's embedding, encoder and CTC head::

    x           float32 (N, T, 560)   features: fbank -> LFR 7/6 -> CMVN (model/decode/frontend.py)
    x_length    int32   (N,)          valid frames of each row of x
    language    int32   (N,)          query row: LID_ROWS
    text_norm   int32   (N,)          query row: TEXTNORM_ROWS
    -> logits   float32 (N, T + 4, V) CTC logits; the first 4 frames are the query frames

N and T are dynamic, so one call can decode a padded batch. The names and the metadata
are sherpa-onnx's (scripts/sense-voice/export-onnx.py), so an export made here is also a
sherpa-onnx model. ``model.onnx``'s weights are in ``model.onnx.data`` (ONNX external
data: :mod:`streamer.model.artifacts.onnx_trace`). ``model.int8.onnx`` holds the same graph with
MatMul weights quantized dynamically to 8 bits (QInt8 on CPUs with an int8 dot-product
unit, QUInt8 elsewhere: :func:`default_int8_weight_type`). ``manifest.json`` records
where it came from.

torch, funasr, onnx and onnxruntime are imported inside functions only.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamer.errors import ConfigError, ModelError
from streamer.model.artifacts.export_process import export_in_child
from streamer.model.artifacts.files import ModelFiles, build_directory, file_sha256, model_files
from streamer.model.artifacts.onnx_trace import DATA_SUFFIX, ONNX_OPSET
from streamer.model.decode.frontend import read_am_mvn
from streamer.model.decode.tokenizer import SentencePieceTokenizer, write_tokens_txt
from streamer.model.sensevoice import LFR_M, LFR_N, LID_ROWS, TEXTNORM_ROWS

logger = logging.getLogger(__name__)

# Bump when the exported graph or the directory layout changes: the cache is keyed by it.
EXPORT_VERSION = 1
INT8_WEIGHT_TYPES = ("QInt8", "QUInt8")
# CPU flags of an int8 dot-product unit (x86 VNNI, Arm dotprod): with one, ONNX Runtime's
# u8 x s8 kernels are exact and 2-3x faster than u8 x u8 (bench/RESULTS.md); without one,
# u8 x s8 saturates (what onnxruntime's reduce_range and sherpa-onnx's choice of QUInt8
# work around): measured on AVX2, QInt8 weights gave 69 % token errors against fp32 and
# QUInt8 5.6 %, with QInt8 reduce_range no faster (bench/RESULTS.md, "int8 weight types
# without VNNI"), so QUInt8 is the choice there.
_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "avx512vnni", "asimddp"})
_CPUINFO = Path("/proc/cpuinfo")

MANIFEST_FILE = "manifest.json"
FP32_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
TOKENS_FILE = "tokens.txt"
TOKENIZER_FILE = "bpe.model"
CMVN_FILE = "am.mvn"
_HASH_MEMO_FILE = "hashes.json"


@dataclass(frozen=True)
class ExportManifest:
    """What ``manifest.json`` says about an export directory."""

    format: str  # always "sensevoice-streamer-onnx"
    export_version: int  # EXPORT_VERSION at export time
    source: str  # the model as named when exported (directory, hub id)
    source_sha256: str  # content hash of the source's config, weights, tokenizer and CMVN
    opset: int  # ONNX opset of both graphs
    int8_weight_type: str  # "QUInt8" or "QInt8"
    vocab_size: int  # CTC outputs == tokenizer pieces
    versions: dict[str, str]  # torch, funasr, onnx, onnxruntime, sensevoice-streamer
    files: dict[str, str]  # role ("fp32", "int8", "tokens", "tokenizer", "cmvn") -> file name


def read_manifest(directory: Path) -> ExportManifest | None:
    """The manifest of an export directory, or None when it has none."""
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        manifest = ExportManifest(**data)
    except (OSError, ValueError, TypeError) as error:
        raise ModelError(f"{path} is not a valid export manifest ({error})") from error
    if manifest.format != "sensevoice-streamer-onnx":
        raise ModelError(f"{path} is not a sensevoice-streamer export manifest")
    return manifest


def source_sha256(files: ModelFiles, memo_dir: Path | None = None) -> str:
    """Content hash of a torch model directory (config, weights, tokenizer, CMVN).

    Hashing 900 MiB of weights takes seconds, so each file's hash is remembered in
    ``memo_dir`` under its path, size and modification time.
    """
    paths = [files.config, files.checkpoint, files.cmvn]
    if files.tokenizer is not None:
        paths.append(files.tokenizer)
    memo_path = memo_dir / _HASH_MEMO_FILE if memo_dir else None
    memo: dict[str, str] = {}
    if memo_path is not None and memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            memo = {}
    total = hashlib.sha256(f"sensevoice-streamer-source-{EXPORT_VERSION}".encode())
    changed = False
    for path in paths:
        stat = path.stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        digest = memo.get(key)
        if digest is None:
            digest = file_sha256(path)
            memo[key] = digest
            changed = True
        total.update(f"{path.name}:{digest}\n".encode())
    if changed and memo_path is not None:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(memo_path, json.dumps(memo, indent=1) + "\n")
    return total.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(handle, "w", encoding="utf-8") as stream:
        stream.write(text)
    os.replace(temporary, path)


def default_int8_weight_type() -> str:
    """QInt8 on CPUs with an int8 dot-product unit, else QUInt8 (see _DOT_PRODUCT_FLAGS)."""
    try:
        text = _CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "QUInt8"
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return "QInt8" if flags & _DOT_PRODUCT_FLAGS else "QUInt8"


def cached_export(
    model_dir: Path,
    cache_dir: Path,
    *,
    name: str | None = None,
    int8_weight_type: str | None = None,
) -> Path:
    """The export of torch model ``model_dir`` under ``cache_dir/onnx``, made if needed.

    Keyed by :func:`source_sha256` and the int8 weight type (default:
    :func:`default_int8_weight_type`): a changed model gets a new export, an unchanged one
    is found in milliseconds. The directory appears atomically, as random models do. The
    export runs in a child process (:mod:`streamer.model.artifacts.export_process`), so this
    process never imports torch for it.
    """
    weight_type = int8_weight_type or default_int8_weight_type()
    files = model_files(model_dir)
    onnx_dir = cache_dir / "onnx"
    digest = source_sha256(files, onnx_dir)
    target = onnx_dir / f"{digest[:16]}-{weight_type.lower()}"
    if (target / MANIFEST_FILE).is_file():
        logger.info("using the cached ONNX export %s of %s", target, model_dir)
        return target
    onnx_dir.mkdir(parents=True, exist_ok=True)
    logger.warning(
        "exporting %s to ONNX in %s (once per model; about a minute for the real size)",
        model_dir,
        target,
    )
    return build_directory(
        target,
        MANIFEST_FILE,
        lambda building: export_in_child(
            model_dir, building, int8_weight_type=weight_type, name=name, digest=digest
        ),
        prefix=".exporting-",
    )


def export_onnx(
    model_dir: Path,
    out_dir: Path,
    *,
    int8_weight_type: str | None = None,
    name: str | None = None,
    digest: str | None = None,
    threads: int = 0,
) -> ExportManifest:
    """Write ``model.onnx``, ``model.int8.onnx``, tokens, CMVN and a manifest to ``out_dir``.

    ``model_dir`` is a torch/funasr SenseVoiceSmall directory (as ``streamer serve`` takes
    it). Reads it with torch on the CPU, its weights mapped from the checkpoint, and frees
    torch before quantizing: about 2.1 GiB at the peak for the real size, while tracing
    (bench/RESULTS.md). A server runs this in a child process (:func:`cached_export`).
    """
    int8_weight_type = int8_weight_type or default_int8_weight_type()
    if int8_weight_type not in INT8_WEIGHT_TYPES:
        raise ConfigError(
            f"int8 weight type must be one of {', '.join(INT8_WEIGHT_TYPES)}, "
            f"not {int8_weight_type!r}"
        )
    from streamer.extras import TORCH, require

    require(
        f"exporting the torch model {name or model_dir} to ONNX", TORCH, "torch", "funasr", "onnx"
    )
    import torch

    from streamer.model.artifacts.onnx_trace import read_torch_model, trace_to_onnx
    from streamer.model.options import default_threads

    started = time.perf_counter()
    files = model_files(model_dir)
    if files.tokenizer is None:
        raise ModelError(f"{model_dir}: the export needs a sentencepiece tokenizer (bpe.model)")
    digest = digest or source_sha256(files)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads or default_threads())
    pieces = SentencePieceTokenizer(files.tokenizer).pieces()
    model = read_torch_model(files, len(pieces))
    logger.info(
        "export: read the torch model in %.1f s; tracing it to ONNX", time.perf_counter() - started
    )
    proto, vocab_size = trace_to_onnx(model, out_dir / FP32_FILE)
    del model  # the mapped checkpoint goes before the quantizer loads the graph
    gc.collect()
    if vocab_size != len(pieces):
        raise ModelError(
            f"{model_dir}: the CTC head has {vocab_size} outputs but the tokenizer has "
            f"{len(pieces)} pieces"
        )
    cmvn = read_am_mvn(files.cmvn)
    metadata = _metadata(cmvn, vocab_size, name or str(model_dir), digest)
    _put_metadata(proto, metadata)
    import onnx

    onnx.save(proto, str(out_dir / FP32_FILE))  # the graph; its weights are in .data
    del proto
    logger.info(
        "export: traced in %.1f s; quantizing the MatMul weights to %s",
        time.perf_counter() - started,
        int8_weight_type,
    )
    quantize_int8(out_dir / FP32_FILE, out_dir / INT8_FILE, int8_weight_type)
    _set_metadata(out_dir / INT8_FILE, {**metadata, "int8_weight_type": int8_weight_type})
    write_tokens_txt(out_dir / TOKENS_FILE, pieces)
    shutil.copyfile(files.cmvn, out_dir / CMVN_FILE)
    shutil.copyfile(files.tokenizer, out_dir / TOKENIZER_FILE)
    roles = {
        "fp32": FP32_FILE,
        "fp32_weights": FP32_FILE + DATA_SUFFIX,
        "int8": INT8_FILE,
        "tokens": TOKENS_FILE,
        "cmvn": CMVN_FILE,
        "tokenizer": TOKENIZER_FILE,
    }
    manifest = ExportManifest(
        format="sensevoice-streamer-onnx",
        export_version=EXPORT_VERSION,
        source=name or str(model_dir),
        source_sha256=digest,
        opset=ONNX_OPSET,
        int8_weight_type=int8_weight_type,
        vocab_size=vocab_size,
        versions=_versions(),
        files=roles,
    )
    (out_dir / MANIFEST_FILE).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    logger.info(
        "exported %s to %s in %.1f s (this process's peak resident memory: %d MiB)",
        model_dir,
        out_dir,
        time.perf_counter() - started,
        _peak_rss_mib(),
    )
    return manifest


def _peak_rss_mib() -> int:
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak // (1 << 20) if sys.platform == "darwin" else peak // 1024)  # bytes / KiB


def _metadata(cmvn: Any, vocab_size: int, source: str, digest: str) -> dict[str, str]:
    """sherpa-onnx's SenseVoice metadata keys, and where the export came from."""
    metadata = {
        "model_type": "sense_voice_ctc",
        "version": "2",
        "lfr_window_size": str(LFR_M),
        "lfr_window_shift": str(LFR_N),
        "normalize_samples": "0",
        "neg_mean": ",".join(f"{v:.8g}" for v in cmvn.shift.tolist()),
        "inv_stddev": ",".join(f"{v:.8g}" for v in cmvn.scale.tolist()),
        "vocab_size": str(vocab_size),
        "with_itn": str(TEXTNORM_ROWS["withitn"]),
        "without_itn": str(TEXTNORM_ROWS["woitn"]),
        "maintainer": "sensevoice-streamer",
        "comment": source,
        "source_sha256": digest,
    }
    for language, row in LID_ROWS.items():
        metadata[f"lang_{language}"] = str(row)
    return metadata


def _set_metadata(path: Path, metadata: dict[str, str]) -> None:
    import onnx

    model = onnx.load(str(path))
    _put_metadata(model, metadata)
    onnx.save(model, str(path))


def _put_metadata(model: Any, metadata: dict[str, str]) -> None:
    del model.metadata_props[:]
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value


def quantize_int8(
    source: Path,
    target: Path,
    weight_type: str,
    *,
    per_channel: bool = False,
    reduce_range: bool = False,
) -> None:
    """Write ``target``: graph ``source`` with its MatMul weights quantized dynamically
    (activations are always quantized to uint8 at run time by ONNX Runtime).

    Per tensor, one weight at a time
    (:func:`~streamer.model.artifacts.onnx_quantize.quantize_matmuls`: onnxruntime's graph
    and numbers, a fraction of its memory); ``per_channel`` goes
    through onnxruntime's ``quantize_dynamic``, which holds three copies of the weights.
    """
    if not per_channel:
        from streamer.model.artifacts.onnx_quantize import quantize_matmuls

        quantize_matmuls(source, target, weight_type, reduce_range=reduce_range)
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    chatter = _RootChatterFilter()
    root.addFilter(chatter)  # the quantizer logs a line per tensor on the root logger
    try:
        quantize_dynamic(
            model_input=str(source),
            model_output=str(target),
            op_types_to_quantize=["MatMul"],
            weight_type=getattr(QuantType, weight_type),
            per_channel=per_channel,
            reduce_range=reduce_range,
        )
    finally:
        root.removeFilter(chatter)


class _RootChatterFilter(logging.Filter):
    """The quantizer's per-tensor lines, and its advice to run its pre-processing first:
    shape inference and graph optimisation, which ONNX Runtime does when it loads the
    graph (ORT_ENABLE_ALL), on a graph traced with its shapes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith("Please consider to run pre-processing"):
            return False
        return record.levelno >= logging.WARNING


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "funasr", "onnx", "onnxruntime", "sensevoice-streamer"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found
