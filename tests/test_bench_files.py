"""bench/files.py: its form, its event reader, its tables, and a tiny run of each piece
(a streamed upload, a live client beside uploads, funasr's AutoModel) against the tiny
random model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import files
from bench.latency.audio import load_bench_audio
from bench.latency.load import StepOptions, plan_clients


def test_server_sent_events_are_read_line_by_line() -> None:
    lines = [
        b": keepalive\n",
        b"\n",
        b'data: {"type": "transcript.text.delta", "delta": "a"}\r\n',
        b"\r\n",
        b'data: {"type": "transcript.text.done",\n',
        b'data: "text": "a"}\n',
        b"\n",
    ]
    assert list(files.sse_events(lines)) == [
        {"type": "transcript.text.delta", "delta": "a"},
        {"type": "transcript.text.done", "text": "a"},
    ]


def test_throughput_table_divides_by_the_streamed_upload() -> None:
    base = {"round": 0, "file": "f.wav", "audio_s": 40.0}
    rows = [
        {**base, "method": "upload stream=true", "total_s": 4.0, "first_delta_s": 1.0},
        {**base, "method": "AutoModel.generate fp32", "total_s": 8.0, "first_text_s": 8.0},
        {**base, "method": "AutoModel.generate int8", "error": "exit 1"},
    ]
    table = files.throughput_table({"rows": rows}).splitlines()
    assert "| upload stream=true | 4.00 | 10.0 | 1.00 | 1.00x |" in table[2]
    assert "| AutoModel.generate fp32 | 8.00 | 5.0 | 8.00 | 2.00x |" in table[3]
    assert "| AutoModel.generate int8 ERROR exit 1 | - | - | - | - |" in table[4]


def test_live_phases_are_summarized_per_condition() -> None:
    alone = files.Phase("alone", 0, final_s=[0.5] * 19 + [1.0])
    uploads = [{"aborted": False, "total_s": 30.0, "error": None},
               {"aborted": True, "total_s": None, "error": "reset"}]  # fmt: skip
    loaded = files.Phase("upload", 0, final_s=[0.6] * 20, overlapped_final_s=[0.6] * 10,
                         uploads=uploads)  # fmt: skip
    summary = files.summarize_phases([alone, loaded])
    assert summary["rows"]["alone"]["finals"] == 20
    assert summary["rows"]["with upload, finals inside an upload"]["finals"] == 10
    assert summary["p50_ratio"] == pytest.approx(1.2)
    assert summary["p95_ratio"] == pytest.approx(0.6 / 0.525)
    assert summary["uploads_done_s"] == [30.0]
    assert summary["upload_errors"] == []  # the aborted upload's reset is the bench's own
    table = files.interference_table({"servers": {"default": summary}, "upload_audio_s": 300.0})
    assert "p50 1.20x, p95 1.14x" in table and "1, at 10.0x (10.0-10.0x) real time" in table


def test_unknown_parts_and_precisions_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown parts: speed"):
        files.main(["--parts", "throughput,speed"])
    with pytest.raises(SystemExit, match="--funasr takes fp32 and int8"):
        files.main(["--funasr", "fp16"])


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("files")
    [path], warm = files.build_recordings([8], "auto", cache_dir, folder)
    assert files.wav_seconds(path) >= 8.0 and files.wav_seconds(warm) >= 5.0
    return path


def test_uploads_stream_deltas_that_make_the_text(server_url: str, recording: Path) -> None:
    uploader = files.Uploader(files.common.http_base(server_url))
    streamed = uploader.upload(recording)
    assert streamed.error is None, streamed.error
    assert streamed.deltas > 1 and streamed.deltas_match_done
    assert streamed.first_delta_s is not None and streamed.total_s is not None
    assert 0 < streamed.first_delta_s <= streamed.total_s


def test_a_live_client_beside_uploads(server_url: str, recording: Path, cache_dir: Path) -> None:
    audio = load_bench_audio("auto", cache_dir / "speech")
    options = StepOptions(url=server_url, clients=1, duration_s=5.0, stagger_s=0.0)
    plan = plan_clients(options, audio)[0]
    phase = files.Phase("upload", 0)
    asyncio.run(files.live_phase(server_url, plan, options, recording, phase))
    assert phase.client_error is None
    assert phase.final_s and phase.overlapped_final_s
    assert phase.uploads and all(u["error"] is None for u in phase.uploads if not u["aborted"])


def test_funasr_automodel_with_the_silero_stand_in(tiny_model_dir: Path, recording: Path) -> None:
    child = files.FunasrProcess(tiny_model_dir, "fp32", threads=1)
    try:
        out = child.generate(recording)
    finally:
        child.close()
    assert out["text_chars"] > 0 and out["total_s"] > 0
