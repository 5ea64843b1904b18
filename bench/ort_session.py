"""ONNX Runtime session options on one graph: load time, warm-up, decode time, peak memory.

Each configuration runs in a fresh process (so its peak resident memory is its own):
a CPU session with the server's settings (2 intra-op threads, no spinning,
``ORT_ENABLE_ALL``) and one change, then the warm-up's 1, 3 and 7 s of features, then 8
decodes of 7 s (median). ``optimized`` loads the graph ONNX Runtime saved optimized
(``optimized_model_filepath``) with optimization off, its documented offline mode;
``pinned_mmap_threshold`` fixes glibc's mmap threshold first, as the server's ONNX
loading does (``streamer.model.allocator``). ``recognizer`` and ``recognizer_pinned``
run the server's decode path instead (``OnnxRecognizer`` on the graph's directory, its
warm-up, 8 decodes of 7 s of noise: features, the session, the CTC search), without and
with the threshold fixed: what fixing it costs a decode, allocations outside ONNX
Runtime's arena included.

    python -m bench.ort_session GRAPH --rounds 2
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = (
    "server",
    "pinned_mmap_threshold",
    "extended",
    "no_prepacking",
    "initializers_outside_arena",
    "no_mem_pattern",
    "optimized",
    "recognizer",
    "recognizer_pinned",
)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(_one(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])))
        return 0
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ort-session-") as scratch:
        optimized = Path(scratch) / "optimized.onnx"
        for _ in range(args.rounds):
            for config in args.configs.split(","):
                extra = [str(optimized)] if config == "optimized" else []
                if config == "optimized" and not optimized.exists():
                    _run(args.graph, "save_optimized", [str(optimized)])
                print(_run(args.graph, config, extra), flush=True)
    return 0


def _run(graph: Path, config: str, extra: list[str]) -> str:
    command = [sys.executable, "-m", "bench.ort_session", "--one", str(graph), config, *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return done.stdout.strip()


def _one(graph: Path, config: str, extra: list[str]) -> dict[str, object]:
    if config.startswith("recognizer"):
        return _recognizer(graph, pinned=config == "recognizer_pinned")
    started = time.perf_counter()
    import numpy as np
    import onnxruntime as ort

    imported_s = time.perf_counter() - started
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    if config == "extended":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    elif config == "no_prepacking":
        options.add_session_config_entry("session.disable_prepacking", "1")
    elif config == "initializers_outside_arena":
        options.add_session_config_entry("session.use_device_allocator_for_initializers", "1")
    elif config == "no_mem_pattern":
        options.enable_mem_pattern = False
    elif config == "save_optimized":
        options.optimized_model_filepath = extra[0]
    elif config == "pinned_mmap_threshold":
        from streamer.model.allocator import pin_mmap_threshold

        if not pin_mmap_threshold():
            raise RuntimeError("glibc's mmap threshold could not be set")
    elif config == "optimized":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        graph = Path(extra[0])
    started = time.perf_counter()
    session = ort.InferenceSession(
        str(graph), sess_options=options, providers=["CPUExecutionProvider"]
    )
    load_s = time.perf_counter() - started

    def feeds(seconds: float) -> dict[str, object]:
        frames = int(seconds * 100 / 6)
        rng = np.random.default_rng(0)
        return {
            "x": rng.standard_normal((1, frames, 560)).astype(np.float32),
            "x_length": np.array([frames], dtype=np.int32),
            "language": np.array([0], dtype=np.int32),
            "text_norm": np.array([15], dtype=np.int32),
        }

    started = time.perf_counter()
    for seconds in (1, 3, 7):
        session.run(None, feeds(seconds))
    warmup_s = time.perf_counter() - started
    seven = feeds(7)
    times = []
    for _ in range(8):
        started = time.perf_counter()
        session.run(None, seven)
        times.append(time.perf_counter() - started)
    return {
        "config": config,
        "import_s": round(imported_s, 2),
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "decode_7s_ms": round(sorted(times)[len(times) // 2] * 1000, 1),
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def _recognizer(graph: Path, *, pinned: bool) -> dict[str, object]:
    """The server's decode path on ``graph``'s directory, as :func:`_one` measures a session."""
    started = time.perf_counter()
    import numpy as np

    from streamer.model.allocator import pin_mmap_threshold
    from streamer.model.onnx_backend import OnnxRecognizer, onnx_model_dir
    from streamer.model.options import RecognizerOptions

    imported_s = time.perf_counter() - started
    if pinned and not pin_mmap_threshold():
        raise RuntimeError("glibc's mmap threshold could not be set")
    options = RecognizerOptions(
        model=str(graph.parent), backend="onnx", device="cpu", threads=2, warmup=False
    )
    started = time.perf_counter()
    recognizer = OnnxRecognizer(
        options, model_dir=onnx_model_dir(graph.parent, quantized="int8" in graph.name)
    )
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    recognizer.warmup()
    warmup_s = time.perf_counter() - started
    seven = np.random.default_rng(0).normal(0.0, 30.0, 7 * 16000).astype(np.int16)
    times = []
    for _ in range(8):
        started = time.perf_counter()
        recognizer.decode(seven)
        times.append(time.perf_counter() - started)
    return {
        "config": "recognizer_pinned" if pinned else "recognizer",
        "import_s": round(imported_s, 2),
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "decode_7s_ms": round(sorted(times)[len(times) // 2] * 1000, 1),
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


if __name__ == "__main__":
    raise SystemExit(main())
