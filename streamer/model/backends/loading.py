"""Start-up that tells the truth: checks before anything slow, then timed loading stages.

:func:`preflight` runs in the CLI before the port is bound: it refuses impossible
hardware requests (``--device cuda`` without CUDA, half precision on the CPU) and model
directories that are missing files, within a couple of seconds. :func:`load_recognizer`
runs in the worker thread and loads the backend :func:`resolve_backend` picks in stages
(import, build or locate, export to ONNX once, load and quantize, warm-up), logging each
with its real duration, a heartbeat while a stage takes long, and publishing the current
stage in a :class:`LoadProgress` that ``/readyz`` reports while the model loads.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from streamer.errors import ConfigError, ModelError
from streamer.extras import TORCH, TORCH_MODULES, missing, require
from streamer.model.artifacts.allocator import pin_mmap_threshold
from streamer.model.artifacts.files import RANDOM_PREFIX, looks_like_path, model_files, random_model
from streamer.model.artifacts.published import (
    AUTO_MODEL,
    DEFAULT_TORCH_MODEL,
    PUBLISHED_ONNX_MODEL,
    is_published,
)
from streamer.model.backends.torch_backend import Recognizer
from streamer.model.decode.decoding import CtcRecognizer
from streamer.model.options import RecognizerOptions, parse_devices

logger = logging.getLogger(__name__)


HEARTBEAT_S = 5.0  # a stage that takes longer than this says so every HEARTBEAT_S


class LoadProgress:
    """The loading stage, written by the worker thread and read by the server's loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stage = "starting"
        self._stage_started = time.monotonic()
        self.started = time.monotonic()
        self.durations_s: dict[str, float] = {}  # finished stages, in order

    @property
    def stage(self) -> str:
        with self._lock:
            return self._stage

    def snapshot(self) -> dict[str, object]:
        """What ``/readyz`` shows while loading: the stage and how long it has taken."""
        with self._lock:
            now = time.monotonic()
            return {
                "stage": self._stage,
                "stage_s": round(now - self._stage_started, 1),
                "loading_s": round(now - self.started, 1),
            }

    def show(self, stage: str) -> None:
        """Publish ``stage`` as the current one (a stage timed elsewhere: the model
        process's)."""
        with self._lock:
            self._stage = stage
            self._stage_started = time.monotonic()

    @contextlib.contextmanager
    def stage_of(self, name: str, what: str) -> Iterator[None]:
        """Time one stage (``what`` is its log wording), with a heartbeat while it runs."""
        with self._lock:
            self._stage = name
            self._stage_started = time.monotonic()
        logger.info("%s ...", what)
        done = threading.Event()
        heartbeat = threading.Thread(
            target=self._beat, args=(what, done), name="load-heartbeat", daemon=True
        )
        heartbeat.start()
        started = time.monotonic()
        try:
            yield
        finally:
            done.set()
            elapsed = time.monotonic() - started
            self.durations_s[name] = elapsed
        logger.info("%s: done in %.1f s", what, elapsed)

    def finish(self) -> None:
        with self._lock:
            self._stage = "ready"
        total = time.monotonic() - self.started
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.durations_s.items())
        logger.info("model ready after %.1f s (%s)", total, parts)

    def _beat(self, what: str, done: threading.Event) -> None:
        started = time.monotonic()
        while not done.wait(HEARTBEAT_S):
            logger.info("%s: still working (%.0f s so far)", what, time.monotonic() - started)


def preflight(options: RecognizerOptions) -> None:
    """Refuse what cannot work before anything slow starts (ConfigError / ModelError).

    Checks the device and dtype against the hardware (imports torch only when CUDA is
    asked for) and that a local model directory has every file. Hub ids are checked
    while loading (the hub look-up may need the network).
    """
    options = resolve_model(options)
    backend = resolve_backend(options)
    if backend == "torch":
        require_torch_backend()
        if is_published(options.model):
            raise ConfigError(
                f"{options.model} is an ONNX export: it runs on --backend onnx (or auto), not torch"
            )
    if backend == "onnx" and options.device.startswith("cuda"):
        from streamer.model.backends.onnx_backend import check_cuda_provider

        check_cuda_provider(options.device)
    elif options.device.startswith("cuda") or options.dtype != "fp32":
        _check_cuda(options)
    model = options.model
    if model.startswith(RANDOM_PREFIX) or is_published(model):
        return
    path = Path(model).expanduser()
    if path.exists() or looks_like_path(model):
        checked: list[Path | None]
        if backend == "onnx" and path.is_dir() and any(path.glob("*.onnx")):
            checked = list(sorted(path.glob("*.onnx")))  # the ONNX loader checks the layout
        else:
            files = model_files(path)
            checked = [files.config, files.checkpoint, files.cmvn, files.tokenizer]
        for file in checked:
            if file is not None and not _readable(file):
                raise ModelError(f"model file {file} cannot be read (check its permissions)")


def require_torch_backend() -> None:
    """ConfigError naming the ``[torch]`` extra when torch or funasr is not installed."""
    require("--backend torch", TORCH, *TORCH_MODULES)


def resolve_devices(spec: str) -> tuple[str, ...]:
    """The devices ``--device`` names: a list (``cuda:0,cuda:1``) or ``cuda:all``.

    ``cuda:all`` is every CUDA device torch sees; on a machine without an NVIDIA driver
    or device it fails at once, without importing torch. Check each device with
    :func:`preflight` afterwards.
    """
    devices = parse_devices(spec)
    if devices != ("cuda:all",):
        return devices
    if _no_gpu_visible():
        raise ConfigError(
            "--device cuda:all needs CUDA GPUs, and this machine has none (no NVIDIA "
            "driver or device); use --device cpu (and --workers N for several CPU workers)"
        )
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"--device cuda:all: torch {torch.__version__} sees no CUDA device "
            "(no GPU, no driver, or a CPU-only torch build); use --device cpu"
        )
    return tuple(f"cuda:{i}" for i in range(count))


def resolve_model(options: RecognizerOptions) -> RecognizerOptions:
    """``options`` with ``model="auto"`` replaced by the default of the backend that serves.

    ONNX Runtime (the CPU's backend) runs sherpa-onnx's published int8 export
    (:data:`~streamer.model.artifacts.published.PUBLISHED_ONNX_MODEL`, fetched from Hugging Face,
    nothing to export); torch runs ``iic/SenseVoiceSmall`` through funasr.
    """
    if options.model != AUTO_MODEL:
        return options
    if resolve_backend(options) == "onnx":
        return replace(options, model=PUBLISHED_ONNX_MODEL, quantize="int8")
    return replace(options, model=DEFAULT_TORCH_MODEL)


def resolve_backend(options: RecognizerOptions) -> str:
    """The backend ``options`` get: "torch" or "onnx".

    ``auto`` takes ONNX Runtime on the CPU, where it decodes faster than torch with the
    same tokens, loads in seconds and holds a fraction of the memory (bench/RESULTS.md),
    and torch where only torch was measured or can run: half precision, a CUDA device
    asked for, or ``device=auto`` on a machine that may have an NVIDIA GPU (where torch is
    installed). Without onnxruntime installed, torch.
    """
    if options.backend != "auto":
        return options.backend
    if is_published(options.model):
        return "onnx"  # an ONNX export: nothing else can run it
    if options.dtype != "fp32" or options.device.startswith("cuda"):
        return "torch"
    if options.device == "auto" and not _no_gpu_visible() and not missing(*TORCH_MODULES):
        return "torch"
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        logger.info("onnxruntime is not installed: using the torch backend")
        return "torch"
    return "onnx"


def _readable(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError:
        return False
    return True


def _no_gpu_visible() -> bool:
    """True when this Linux machine certainly has no NVIDIA GPU (no driver, no device).

    Answers without importing torch (1-3 s); anywhere else (WSL's /dev/dxg, other
    systems) it says False and torch decides.
    """
    if not sys.platform.startswith("linux") or os.path.exists("/dev/dxg"):
        return False
    return not os.path.exists("/proc/driver/nvidia/version") and not glob.glob("/dev/nvidia[0-9]*")


def _check_cuda(options: RecognizerOptions) -> None:
    if _no_gpu_visible():
        raise ConfigError(
            f"--device {options.device} --dtype {options.dtype} needs a CUDA GPU, and this "
            "machine has none (no NVIDIA driver or device); use --device cpu and --dtype fp32"
        )
    import torch

    if not torch.cuda.is_available():
        if options.device == "auto":
            raise ConfigError(
                f"dtype {options.dtype} needs CUDA, and torch {torch.__version__} sees no "
                "CUDA device; use --dtype fp32"
            )
        raise ConfigError(
            f"--device {options.device}: torch {torch.__version__} sees no CUDA device "
            "(no GPU, no driver, or a CPU-only torch build); use --device cpu or auto"
        )
    index = int(options.device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {options.device} does not exist: torch sees "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )


def load_recognizer(
    options: RecognizerOptions, progress: LoadProgress | None = None
) -> CtcRecognizer:
    """Load in timed stages (call in the thread that will decode)."""
    progress = progress or LoadProgress()
    options = resolve_model(options)
    if resolve_backend(options) == "onnx":
        return _load_onnx(options, progress)
    require_torch_backend()
    with progress.stage_of("import", "importing torch and funasr"):
        from streamer.model.backends.funasr_quiet import import_funasr

        import_funasr()
    if options.model.startswith(RANDOM_PREFIX):
        name, builder = random_model(options.model, options.random_models)
        what = (
            f"locating random model {name}"
            if builder.is_built(name, options.cache_dir)
            else f"building random model {name}"
        )
        with progress.stage_of("build", what):
            builder.ensure(name, options.cache_dir)
    with progress.stage_of("load", f"loading model {options.model}"):
        recognizer = Recognizer(replace(options, warmup=False))
    if options.warmup:
        with progress.stage_of("warmup", "warming up (decoding 1, 3 and 7 s)"):
            recognizer.warmup()
    progress.finish()
    return recognizer


def _load_onnx(options: RecognizerOptions, progress: LoadProgress) -> CtcRecognizer:
    with progress.stage_of("import", "importing onnxruntime"):
        import onnxruntime  # noqa: F401

        from streamer.model.backends.onnx_backend import OnnxRecognizer, locate_onnx_model
    what = (
        f"fetching the published model {options.model} from Hugging Face (once)"
        if is_published(options.model)
        else f"locating model {options.model} (exported to ONNX once)"
    )
    with progress.stage_of("build", what):
        model_dir = locate_onnx_model(options)
    what = f"loading model {options.model} with ONNX Runtime ({model_dir.graph.name})"
    with progress.stage_of("load", what):
        # what the graph's loading frees goes back to the system (about 200 MiB for
        # the published model's size; streamer/model/artifacts/allocator.py says why)
        pin_mmap_threshold()
        recognizer = OnnxRecognizer(replace(options, warmup=False), model_dir=model_dir)
    if options.warmup:
        with progress.stage_of("warmup", "warming up (decoding 1, 3 and 7 s)"):
            recognizer.warmup()
    progress.finish()
    return recognizer
