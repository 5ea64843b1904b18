"""bench/common.py and ``python -m bench``: the list of benches, the shared arguments."""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common
from bench.__main__ import benches
from tests.timing import eventually_sync, timeout_s

REPO = Path(__file__).resolve().parents[1]


def test_python_m_bench_lists_every_bench_with_its_first_line() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s(60),
        check=True,
    ).stdout
    modules = {p.stem for p in (REPO / "bench").glob("*.py")} - {"__init__", "__main__", "common"}
    modules |= {p.parent.name for p in (REPO / "bench").glob("*/__init__.py")}
    assert set(benches()) == modules
    rows = [row.split(maxsplit=1) for row in listed.splitlines() if row.startswith("  ")]
    assert {name: line for name, line in rows} == benches()
    for name, line in benches().items():
        assert line, f"bench/{name} has no docstring to list"
    assert "Streaming latency bench" in listed


def test_python_m_bench_refuses_an_unknown_name() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "no_such_bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s(60),
    )
    assert result.returncode == 2
    assert "no bench named 'no_such_bench'" in result.stderr


def test_python_m_bench_name_runs_that_bench() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "files", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s(60),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m bench.files")
    assert "--server-arg" in result.stdout


def test_server_arguments_become_server_options() -> None:
    parser = common.parser(__doc__)
    common.add_server_args(parser, model="random:tiny")
    common.add_output_args(parser, out="bench/out/x")
    args = parser.parse_args(
        ["--quantize", "none", "--server-arg=--threads", "--server-arg=2", "--out", "o"]
    )
    options = common.server_options(args, endpoint_ms=500, extra_args=("--max-batch", "4"))
    assert (options.model, options.quantize, options.endpoint_ms) == ("random:tiny", None, 500)
    assert options.extra_args == ("--threads", "2", "--max-batch", "4")
    assert args.out == Path("o")
    command = options.command(port=1234)
    assert command[command.index("--port") + 1] == "1234"
    assert "--quantize" not in command
    defaults = parser.parse_args([])
    assert common.server_options(defaults).quantize == "int8"


def test_int_list_parses_commas_and_refuses_words() -> None:
    assert common.int_list("1,4,8") == [1, 4, 8]
    with pytest.raises(argparse.ArgumentTypeError, match="integers separated by commas"):
        common.int_list("1,many")


def test_results_record_the_command_and_the_machine(tmp_path: Path) -> None:
    args = argparse.Namespace(model="random:tiny", out=tmp_path)
    path = common.write_results(tmp_path / "run", {"figure_ms": 12.5}, args)
    record = json.loads(path.read_text())
    assert record["figure_ms"] == 12.5
    assert record["command"].startswith("python -m ")
    assert record["machine"]["cpu_flags"] == common.cpu_name()
    assert record["args"] == {"model": "random:tiny", "out": str(tmp_path)}


def test_cpu_name_names_the_cpu() -> None:
    name = common.cpu_name()
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    model = next(
        line.split(":", 1)[1].strip()
        for line in cpuinfo.read_text().splitlines()
        if line.startswith("model name")
    )
    assert name.startswith(model)


def test_peak_rss_sees_memory_held_inside_the_block() -> None:
    with common.PeakRss(os.getpid(), interval_s=0.01) as memory:
        # a fresh anonymous mapping, touched page by page: resident memory the process
        # did not hold before (a bytearray may reuse heap pages a long suite freed)
        held = mmap.mmap(-1, 64 << 20)
        for i in range(0, len(held), mmap.PAGESIZE):
            held[i] = 1
        eventually_sync(lambda: memory.peak_mb - memory.start_mb >= 32, 10)
    assert memory.peak_mb - memory.start_mb >= 32
    assert common.rss_mb(os.getpid()) > 0
    held.close()


def test_every_bench_module_imports() -> None:
    # `python -m bench` lists the benches from their source, so a bench whose imports
    # broke (a module renamed under it) would still be listed: import each one
    import importlib
    import pkgutil

    import bench

    names = [m.name for m in pkgutil.walk_packages(bench.__path__, "bench.")]
    assert "bench.files" in names and "bench.stress" in names
    for name in names:
        if not name.endswith("__main__"):
            importlib.import_module(name)


def test_managed_server_listens_on_port_0_and_reads_the_port_back(tmp_path: Path) -> None:
    # io_load's test-double server: streamer's own server without a model, started and
    # stopped the way every bench starts streamer serve
    from bench.io_load import DoubleServerOptions

    options = DoubleServerOptions(ready_timeout_s=timeout_s(60), ready_poll_s=0.05)
    server = common.ManagedServer(options, tmp_path / "server.log")
    assert server.command[server.command.index("--serve") + 1] == "0"
    with server:
        assert server.port is not None and server.port > 0
        assert common.http_get(f"{server.http_url}/healthz")[0] == 200
        assert server.url == f"ws://127.0.0.1:{server.port}/v1/asr"
        assert server.load_s is not None
    assert server.process is not None and server.process.poll() is not None
    assert common.http_get(f"{server.http_url}/healthz", timeout_s=1)[0] == 0


def test_managed_server_reports_a_server_that_exits(tmp_path: Path) -> None:
    options = common.ServerOptions(
        model="random:tiny", extra_args=("--no-such-option",), ready_timeout_s=timeout_s(60)
    )
    with (
        pytest.raises(RuntimeError, match="exited with 2"),
        common.ManagedServer(options, tmp_path / "server.log"),
    ):
        pass


def test_one_percentile_function() -> None:
    assert common.percentiles([1, 2, 3, None, float("nan"), 4, 5]) == {
        "p50": 3.0,
        "p95": pytest.approx(4.8),
        "p99": pytest.approx(4.96),
    }
    assert common.percentiles([], (95,)) == {"p95": None}
