"""glibc's mmap threshold, fixed before an ONNX graph loads (model/artifacts/allocator.py)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from streamer.model.artifacts import allocator
from streamer.model.artifacts.allocator import (
    M_MMAP_THRESHOLD,
    MMAP_THRESHOLD_BYTES,
    pin_mmap_threshold,
)
from streamer.model.backends import loading, onnx_backend
from streamer.model.options import RecognizerOptions
from tests.timing import timeout_s

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class FakeLibc:
    """Records mallopt's calls and answers ``answer`` (glibc: 1 done, 0 refused)."""

    answer: int = 1
    calls: list[tuple[int, int]] = field(default_factory=list)

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def test_the_threshold_is_fixed_at_glibcs_starting_value() -> None:
    libc = FakeLibc()
    assert pin_mmap_threshold(libc=libc) is True
    assert libc.calls == [(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)] == [(-3, 128 * 1024)]


def test_a_refusal_or_a_libc_without_mallopt_is_tolerated() -> None:
    assert pin_mmap_threshold(libc=FakeLibc(answer=0)) is False
    assert pin_mmap_threshold(libc=SimpleNamespace()) is False  # no mallopt at all


def test_nothing_is_called_where_glibc_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator._glibc() is None
    assert pin_mmap_threshold() is False

    def no_symbols(_name: object) -> Any:
        raise OSError("no such library")

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", no_symbols)
    assert allocator._glibc() is None
    assert pin_mmap_threshold() is False


# Frees an 8 MiB block (which raises glibc's threshold to 8 MiB unless it is fixed), then
# allocates and touches 96 blocks of 1 MiB, each followed by a live 64 KiB one (never
# touched), and frees the large ones: on the heap, between live blocks, they stay
# resident once freed (the graph's protobuf in the server); as mappings of their own they
# go back to the system.
_FREED_AND_KEPT = """
import ctypes, sys
from streamer.model.artifacts.allocator import pin_mmap_threshold
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
if sys.argv[1] == "pinned":
    assert pin_mmap_threshold()
big = libc.malloc(8 << 20)
ctypes.memset(big, 1, 8 << 20)
libc.free(big)
before = anon_kib()
blocks, guards = [], []
for _ in range(96):
    blocks.append(libc.malloc(1 << 20))
    ctypes.memset(blocks[-1], 1, 1 << 20)
    guards.append(libc.malloc(64 << 10))
for block in blocks:
    libc.free(block)
print((anon_kib() - before) // 1024)
"""


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc only")
def test_with_the_threshold_fixed_freed_blocks_leave_the_process() -> None:
    def kept_mib(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _FREED_AND_KEPT, mode],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO_ROOT,
            timeout=timeout_s(60),
        )
        return int(done.stdout.strip())

    assert kept_mib("default") >= 80  # glibc's raised threshold keeps them: the server's case
    assert kept_mib("pinned") <= 16


def test_onnx_loading_fixes_the_threshold_before_the_graph_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    events: list[str] = []
    monkeypatch.setattr(loading, "pin_mmap_threshold", lambda: events.append("pinned") or True)
    model_dir = SimpleNamespace(graph=tmp_path / "model.int8.onnx")
    monkeypatch.setattr(onnx_backend, "locate_onnx_model", lambda options: model_dir)

    class Recognizer:
        def __init__(self, options: RecognizerOptions, *, model_dir: object) -> None:
            events.append("graph loaded")

    monkeypatch.setattr(onnx_backend, "OnnxRecognizer", Recognizer)
    options = RecognizerOptions(model=str(tmp_path), backend="onnx", device="cpu", warmup=False)
    assert isinstance(loading.load_recognizer(options), Recognizer)
    assert events == ["pinned", "graph loaded"]
