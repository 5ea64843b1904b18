"""How to load the model: :class:`RecognizerOptions`, shared by every backend.

:func:`streamer.model.backends.loading.load_recognizer` reads them and builds the backend they name:
the torch one (:mod:`streamer.model.backends.torch_backend`) or ONNX Runtime
(:mod:`streamer.model.backends.onnx_backend`). They are frozen and picklable: a model process
(:mod:`streamer.model.serving.process`) gets them as they are.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from streamer.core.hotwords import MAX_PHRASE_TOKENS
from streamer.errors import ConfigError
from streamer.model.artifacts.files import (
    RANDOM_PREFIX,
    RandomModels,
    default_cache_dir,
    random_model,
)
from streamer.model.decode.ctc_beam import DEFAULT_BEAM, DEFAULT_PARTIAL_BEAM, MAX_BEAM

__all__ = ["BACKENDS", "MAX_DEFAULT_THREADS", "RecognizerOptions", "default_threads"]

BACKENDS = ("auto", "torch", "onnx")
MAX_DEFAULT_THREADS = 8  # beyond this, intra-op threads stop paying on one decode

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class RecognizerOptions:
    """How to load the model. Validated on construction (raises ConfigError)."""

    # hub id, local directory, random:tiny|small|tagged, or "auto": the backend's default
    # (loading.resolve_model: sherpa-onnx's int8 export on ONNX Runtime, else iic/SenseVoiceSmall)
    model: str = "auto"
    backend: str = "auto"  # "torch", "onnx", or "auto" (see loading.resolve_backend)
    hub: str = "ms"  # where a hub id comes from: "ms" (ModelScope) or "hf" (Hugging Face)
    device: str = "auto"  # "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N"
    dtype: str = "fp32"  # weights and activations: "fp32"; "fp16" or "bf16" on CUDA only
    quantize: str | None = None  # "int8": int8 weights (torch: dynamic Linear; onnx: MatMul)
    threads: int = 0  # intra-op threads; 0 = one per usable CPU core, at most 8
    warmup: bool = True  # decode 1, 3 and 7 s at start-up so no user pays first-call costs
    cache_dir: Path = field(default_factory=default_cache_dir)  # random models, ONNX exports
    # hotwords: prefixes the biased CTC search keeps per frame on finals (and on the
    # speculative partials that become finals), on other partials, and the longest
    # phrase in tokens (longer ones are not used, and the session is told)
    hotword_beam: int = DEFAULT_BEAM
    hotword_partial_beam: int = DEFAULT_PARTIAL_BEAM
    hotwords_max_tokens: int = MAX_PHRASE_TOKENS
    # what builds random:NAME (streamer.testkit.models.RANDOM_MODELS, passed by the CLI and
    # the test fixtures: nothing in streamer.model imports the test kit); None: no random:
    random_models: RandomModels | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if not self.model:
            raise ConfigError("model must name a hub id, a directory or random:NAME")
        if self.model.startswith(RANDOM_PREFIX):
            random_model(self.model, self.random_models)  # ConfigError unless it can be built
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if self.hub not in ("ms", "hf"):
            raise ConfigError(f"hub must be 'ms' or 'hf', not {self.hub!r}")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ConfigError(f"dtype must be fp32, fp16 or bf16, not {self.dtype!r}")
        if self.dtype != "fp32" and self.device == "cpu":
            raise ConfigError(f"dtype {self.dtype} needs a CUDA device; use fp32 on the CPU")
        if self.dtype != "fp32" and self.backend == "onnx":
            raise ConfigError(f"dtype {self.dtype} runs on the torch backend only")
        if not 1 <= self.hotword_partial_beam <= self.hotword_beam <= MAX_BEAM:
            raise ConfigError(
                f"hotword beams must be 1 <= partial beam <= beam <= {MAX_BEAM}, not "
                f"{self.hotword_partial_beam} and {self.hotword_beam}"
            )
        if not 1 <= self.hotwords_max_tokens <= 256:
            raise ConfigError(f"hotwords max tokens must be 1..256, not {self.hotwords_max_tokens}")
        if self.quantize not in (None, "int8"):
            raise ConfigError(f"quantize must be int8 or unset, not {self.quantize!r}")
        if self.quantize == "int8" and self.device.startswith("cuda"):
            raise ConfigError("int8 quantization runs on the CPU only; use --device cpu")
        if self.quantize == "int8" and self.dtype != "fp32":
            raise ConfigError("int8 quantization starts from fp32 weights; drop the dtype")
        if self.threads < 0:
            raise ConfigError(f"threads must be 0 (automatic) or positive, not {self.threads}")


def default_threads() -> int:
    """One intra-op thread per CPU core this process may use, at most 8."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return max(1, min(usable, MAX_DEFAULT_THREADS))


def parse_devices(spec: str) -> tuple[str, ...]:
    """``"cuda:0,cuda:1"`` -> ``("cuda:0", "cuda:1")``; ``cuda:all`` stays as it is.

    Raises :class:`ConfigError` for empty items, repeats, and ``auto``/``cuda:all`` in a
    list. Each item is validated further by the recognizer's options.
    """
    items = tuple(part.strip() for part in spec.split(","))
    if any(not item for item in items):
        raise ConfigError(f"--device {spec!r}: an empty item in the device list")
    if len(items) > 1:
        for special in ("auto", "cuda:all"):
            if special in items:
                raise ConfigError(f"--device {spec!r}: {special} cannot be part of a list")
        normalized = [("cuda:0" if item == "cuda" else item) for item in items]
        if len(set(normalized)) != len(normalized):
            raise ConfigError(f"--device {spec!r} names a device twice; use --workers for more")
    return items
