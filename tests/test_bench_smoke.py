"""A smoke run of each bench that no other test module runs whole: capacity, io_load,
first_start, stress and its soak, and diarization, each for seconds on the tiny
random model (``bench.latency``, ``bench.decode`` and ``bench.files`` have modules of their
own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.__main__ import benches

SMOKED = {  # bench -> the test module that runs it
    "capacity": "test_bench_smoke.py",
    "decode": "test_bench_decode.py",
    "diarization": "test_bench_smoke.py",
    "files": "test_bench_files.py",
    "first_start": "test_bench_smoke.py",
    "io_load": "test_bench_smoke.py",
    "latency": "test_bench_latency.py",
    "stress": "test_bench_smoke.py",
}


def test_every_listed_bench_is_smoked() -> None:
    assert set(benches()) == set(SMOKED)
    here = Path(__file__).parent
    for name, module in SMOKED.items():
        source = (here / module).read_text()
        assert f"bench.{name}" in source or f"bench import {name}" in source, (name, module)


def test_io_load_serves_its_test_double_to_real_time_streams(tmp_path: Path) -> None:
    from bench import io_load

    argv = ["--streams", "2", "--duration-s", "2", "--generators", "1", "--out", str(tmp_path)]
    assert io_load.main(argv) == 0
    (step,) = json.loads((tmp_path / "results.json").read_text())["steps"]
    assert step["streams"] == 2 and step["error_count"] == 0
    assert step["messages"] > 0 and step["loop_cpu_s"] > 0
    assert step["healthz_probes"] > 0


def test_first_start_watches_a_start_with_nothing_to_export(
    tiny_model_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    from bench import first_start
    from streamer.model.artifacts.onnx_export import cached_export

    # a sherpa-onnx layout (int8 graph and tokens), as the plain install serves
    export = cached_export(tiny_model_dir, cache_dir)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("model.int8.onnx", "tokens.txt"):
        shutil.copy(export / name, model / name)
    repo = str(Path(__file__).resolve().parents[1])
    argv = ["--code", repo, "--model", str(model), "--threads", "1",
            "--out", str(tmp_path / "out"), "--cache-dir", str(cache_dir)]  # fmt: skip
    assert first_start.main(argv) == 0
    (start,) = json.loads((tmp_path / "out" / "results.json").read_text())["starts"]
    assert start["ready_s"] > 0 and start["server_peak_mib"] > 0
    assert start["tree_peak_mib"] >= start["server_peak_mib"]
    assert start["healthz_probes"] + start["readyz_probes"] >= 1
    assert "--port 0" in start["command"]


def test_stress_runs_an_attack_and_writes_its_table(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import stress

    monkeypatch.setenv("STREAMER_CACHE_DIR", str(cache_dir))
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\n<!-- stress:begin -->\nold\n<!-- stress:end -->\n")
    argv = ["--attacks", "unpaced", "--clients", "2", "--minutes", "0.05", "--threads", "1",
            "--log", str(tmp_path / "server.log"), "--results", str(results)]  # fmt: skip
    assert stress.main(argv) == 0
    text = results.read_text()
    assert "| 2 unpaced clients x 0.05 min (pings on for half) |" in text and "PASS" in text
    assert "old" not in text


def test_stress_soak_checks_every_client_against_its_reference(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.stress import soak

    if shutil.which("ffmpeg") is None:
        pytest.skip("the soak's WebM clients need ffmpeg")
    monkeypatch.setenv("STREAMER_CACHE_DIR", str(cache_dir))
    out = tmp_path / "soak.md"
    argv = ["--minutes", "0.05", "--clip-s", "3", "--settle-s", "0", "--live", "1",
            "--threads", "1", "--log", str(tmp_path / "server.log"), "--out", str(out)]  # fmt: skip
    assert soak.main(argv) == 0, out.read_text()
    report = out.read_text()
    for client in ("live PCM session ok", "WebM stream ok", "upload ok", "SSE upload ok"):
        assert f"| {client} |" in report
    assert "| server log: tracebacks | 0 |" in report and "FAILED" not in report


def test_diarization_scores_every_conversation_and_times_diarize_on_and_off(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import diarization

    monkeypatch.setenv("STREAMER_CACHE_DIR", str(cache_dir))
    out = tmp_path / "out"
    argv = ["--turns", "2", "--latency-s", "0.1", "--latency-turns", "2",
            "--model", "random:tiny", "--quantize", "none", "--server-arg=--threads",
            "--server-arg=1", "--out", str(out), "--cache-dir", str(cache_dir)]  # fmt: skip
    assert diarization.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["conversations"]
    assert [tuple(row["voices"]) for row in rows] == [v for v, _ in diarization.CONVERSATIONS]
    for row in rows:
        assert row["utterances"] > 0 and row["audio_s"] > 0
        for scored in ("online", "offline_count_given", "offline_eigengap"):
            for collar in ("no_collar", "collar_0.25"):
                score = row[scored][collar]
                parts = score["missed"] + score["false_alarm"] + score["confusion"]
                assert score["der"] == pytest.approx(parts, abs=2e-4) and 0 <= parts < 2
        assert (out / f"{'-'.join(row['voices'])}.rttm").read_text().startswith("SPEAKER ")
        assert 0 < row["close_ms"]["p50"] <= row["close_ms"]["p95"]
        assert 0 < row["close_cpu_ms"]["p50"] <= row["close_cpu_ms"]["p95"]
        assert row["worker_cpu_s_per_audio_s"] > 0 and row["campp_frames_per_audio_s"] > 0
    assert results["live_worker"]["campp_frames_per_audio_s"] > 0
    memory = results["memory_mb"]
    assert 0 < memory["rss_before"] < memory["rss_after_load"]
    latency = results["latency_1_client"]
    for mode in ("off", "on"):  # each mode ran once, though --latency-s is shorter than a turn
        assert latency[mode]["finals"] > 0
        assert 0 < latency[mode]["p50_s"] <= latency[mode]["p95_s"]
    assert latency["unlabelled_finals_on"] == 0


def test_capacity_runs_a_step_per_configuration_and_writes_its_table(tmp_path: Path) -> None:
    from bench.capacity import main

    argv = ["--model", "random:tiny", "--clients", "2", "--duration-s", "2"]
    argv += ["--start-every-s", "0.3", "--configs", "off,default", "--pause-s", "0"]
    argv += ["--hog-clients", "1", "--hog-share", "0.3"]  # beside a hog busy 30 % of a core
    main([*argv, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(row["config"], row["clients"], row["hog_share"]) for row in rows] == [
        ("off", 2, 0.0),
        ("off", 1, 0.3),
        ("default", 2, 0.0),
        ("default", 1, 0.3),
    ]
    assert "| off | hog 0.3 core | 1 | 1 |" in (tmp_path / "table.md").read_text()
    for row in rows:
        assert row["admitted"] == row["clients"] and not row["refused"]
        assert not row["other_errors"]
        assert row["segments"] > 0 and 0 < row["final_p50_s"] <= row["final_p95_s"]
        assert row["server_cpu_s"] > 0
