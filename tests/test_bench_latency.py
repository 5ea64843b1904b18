"""The latency bench's own logic: mapping server times onto client send times,
percentiles, cadence, skip share, send lag, saturation search, /metrics differences.

The last test runs the whole bench against the tiny random-model server (``server_url``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bench.common import ServerOptions
from bench.latency import metrics, prom, report
from bench.latency.audio import SAMPLE_RATE, Clip, client_track
from bench.latency.metrics import Arrival, SendLog
from bench.latency.sweep import parse_clients, parse_variant
from streamer.core.protocol import End, Final, Partial, SpeechStart

RATE = 16000
CHUNK = 1600  # 100 ms


def paced_log(chunks: int, t0: float = 100.0, lag_s: list[float] | None = None) -> SendLog:
    """Chunk k (100 ms) sent exactly when its audio ends, plus an optional lag."""
    lags = lag_s or [0.0] * chunks
    return SendLog.from_pairs(
        [((k + 1) * CHUNK, t0 + (k + 1) * 0.1 + lags[k]) for k in range(chunks)], RATE
    )


def partial(seg: int, rev: int, end_ms: float, text: str) -> Partial:
    return Partial(seg, rev, 0.0, end_ms, text, "", "en", None, None, text)


def final(seg: int, start_ms: float, end_ms: float, text: str, reason: str = "silence") -> Final:
    return Final(seg, start_ms, end_ms, text, "en", None, None, text, text, reason, 50.0, 2.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Send log -> wall time


def test_sample_maps_to_the_chunk_that_carried_it() -> None:
    log = paced_log(10)
    assert log.time_of_sample(0) == pytest.approx(100.1)
    assert log.time_of_sample(1599) == pytest.approx(100.1)
    assert log.time_of_sample(1600) == pytest.approx(100.2)
    assert log.time_of_sample(15999) == pytest.approx(101.0)
    assert log.time_of_sample(16000) is None  # never sent


def test_start_and_end_ms_use_first_and_last_sample() -> None:
    log = paced_log(10)
    # a segment [200 ms, 400 ms): first sample 3200 is in chunk 2, last sample 6399 in chunk 3
    assert log.time_of_start_ms(200.0) == pytest.approx(100.3)
    assert log.time_of_end_ms(400.0) == pytest.approx(100.4)
    # an end on a chunk boundary must not be charged to the next chunk
    assert log.time_of_end_ms(1000.0) == pytest.approx(101.0)


def test_send_log_with_uneven_chunks_and_other_rates() -> None:
    log = SendLog.from_pairs([(100, 1.0), (4000, 2.0), (8000, 3.0)], 8000)
    assert log.sample_at_ms(500.0) == 4000
    assert log.time_of_start_ms(500.0) == 3.0  # sample 4000 went in the third chunk
    assert log.time_of_end_ms(500.0) == 2.0  # sample 3999 in the second
    assert log.time_of_sample(-5) == 1.0
    assert log.time_of_sample(8000) is None  # never sent


def test_send_log_rejects_unordered_entries() -> None:
    with pytest.raises(ValueError):
        SendLog.from_pairs([(1600, 1.0), (1600, 1.1)], RATE)


# ---------------------------------------------------------------------------
# Segments


def test_first_token_and_final_latency() -> None:
    log = paced_log(40)  # 4 s of audio, sent from t=100.1 to t=104.0
    arrivals = [
        Arrival(SpeechStart(0, 300.0), 100.7),
        Arrival(partial(0, 1, 900.0, ""), 101.1),  # empty text: not a first token
        Arrival(partial(0, 2, 1500.0, "hello"), 101.65),
        Arrival(partial(0, 3, 2100.0, "hello there"), 102.25),
        Arrival(final(0, 300.0, 2500.0, "hello there"), 103.2),
    ]
    [seg] = metrics.segment_latencies(arrivals, log)
    # sample at 300 ms (4800) went with chunk 3 at t=100.4
    assert seg.first_token_s == pytest.approx(101.65 - 100.4)
    assert seg.first_token_from == "partial"
    # last sample before 2500 ms (39999) went with chunk 25 at t=102.5
    assert seg.final_s == pytest.approx(103.2 - 102.5)
    assert seg.partials == 3
    assert seg.partial_gaps_s == pytest.approx((0.55, 0.6))
    assert (seg.reason, seg.decode_ms, seg.queue_ms) == ("silence", 50.0, 2.0)


def test_first_token_falls_back_to_the_final_without_partials() -> None:
    log = paced_log(30)
    arrivals = [
        Arrival(SpeechStart(0, 0.0), 100.5),
        Arrival(final(0, 0.0, 1000.0, "hi"), 101.3),
        Arrival(SpeechStart(1, 1500.0), 101.9),
        Arrival(final(1, 1500.0, 2000.0, "   "), 102.6),  # no text at all
        Arrival(End(2, 3000.0, 0, 0), 103.1),
    ]
    first, second = metrics.segment_latencies(arrivals, log)
    assert first.first_token_s == pytest.approx(101.3 - 100.1)
    assert first.first_token_from == "final"
    assert first.final_s == pytest.approx(101.3 - 101.0)
    assert second.first_token_s is None
    assert second.final_s == pytest.approx(102.6 - 102.0)


def test_latencies_from_the_true_speech_onset_and_end() -> None:
    log = paced_log(60)
    # speech really spans 0.5 s .. 2.0 s; the server's segment has 300 ms of pre-roll and
    # 200 ms of end padding: [200 ms, 2200 ms)
    spans = [(8000, 32000), (48000, 56000)]
    arrivals = [
        Arrival(SpeechStart(0, 200.0), 100.9),
        Arrival(partial(0, 1, 900.0, "hey"), 101.25),
        Arrival(final(0, 200.0, 2200.0, "hey you"), 102.9),
        Arrival(SpeechStart(1, 2900.0), 103.3),  # onset 3.0 s is within the window
        Arrival(final(1, 2900.0, 3700.0, "x", reason="max_duration"), 104.0),
    ]
    first, second = metrics.segment_latencies(arrivals, log, spans)
    assert first.first_token_s == pytest.approx(101.25 - 100.3)  # from start_ms (pre-roll)
    assert first.onset_first_token_s == pytest.approx(101.25 - 100.6)  # from the real onset
    assert first.final_s == pytest.approx(102.9 - 102.2)
    assert first.speech_end_final_s == pytest.approx(102.9 - 102.0)
    assert second.onset_first_token_s == pytest.approx(104.0 - 103.1)
    assert second.speech_end_final_s is None  # a cut segment did not end with the speech
    assert metrics.match_onset(spans, 0, 16000) == 8000
    assert metrics.match_onset(spans, 8001, 16000) is None  # started mid-utterance
    assert metrics.match_speech_end(spans, 35200, 16000) == 32000
    assert metrics.match_speech_end(spans, 60000, 1000) is None


def test_segment_without_final_and_end_never_sent() -> None:
    log = paced_log(10)
    arrivals = [
        Arrival(SpeechStart(0, 100.0), 100.4),
        Arrival(SpeechStart(1, 900.0), 101.2),
        Arrival(final(1, 900.0, 5000.0, "x", reason="stop"), 101.3),
    ]
    missing, beyond = metrics.segment_latencies(arrivals, log)
    assert missing.end_ms is None and missing.final_s is None
    assert beyond.final_s is None  # end_ms beyond what was sent: no guess


def test_summary_leaves_stop_finals_out_of_the_timings() -> None:
    log = paced_log(50)
    arrivals = [
        Arrival(SpeechStart(0, 0.0), 100.3),
        Arrival(partial(0, 1, 500.0, "a"), 100.8),
        Arrival(final(0, 0.0, 1000.0, "a b"), 101.5),
        Arrival(SpeechStart(1, 2000.0), 102.3),
        Arrival(final(1, 2000.0, 4000.0, "c", reason="stop"), 104.2),
    ]
    summary = metrics.summarize_segments(metrics.segment_latencies(arrivals, log))
    assert summary["segments"] == 2
    assert summary["stop_finals"] == 1
    assert summary["final_s"]["p50"] == pytest.approx(101.5 - 101.0)
    assert summary["first_token_s"]["p50"] == pytest.approx(100.8 - 100.1)
    assert summary["no_text"] == 0 and summary["partials_per_segment"] == 1.0


# ---------------------------------------------------------------------------
# Numbers


def test_percentiles_interpolate_and_ignore_missing() -> None:
    values = [float(v) for v in range(1, 101)] + [None, math.nan]
    out = metrics.percentiles(values)
    assert out == {
        "p50": pytest.approx(50.5),
        "p95": pytest.approx(95.05),
        "p99": pytest.approx(99.01),
    }
    assert metrics.percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert metrics.percentiles([3.0], qs=(50, 99.9)) == {"p50": 3.0, "p99.9": 3.0}


def test_send_lag_is_relative_to_an_exact_pace() -> None:
    assert np.allclose(metrics.send_lags(paced_log(20)), 0.0)
    lagging = paced_log(5, lag_s=[0.0, 0.0, 0.05, 0.3, 0.1])
    assert np.allclose(metrics.send_lags(lagging), [0.0, 0.0, 0.05, 0.3, 0.1])
    # at 2x speed, chunks 50 ms apart are on time
    fast = SendLog.from_pairs([((k + 1) * CHUNK, 5 + k * 0.05) for k in range(4)], RATE)
    assert np.allclose(metrics.send_lags(fast, speed=2.0), 0.0)
    assert metrics.send_lags(SendLog((), (), RATE)).size == 0


def test_skip_share() -> None:
    assert metrics.skip_share([End(3, 1.0, 6, 2), End(1, 1.0, 2, 0)]) == pytest.approx(0.2)
    assert metrics.skip_share([End(1, 1.0, 0, 0)]) is None
    assert metrics.skip_share([]) is None


def test_carried_clients_stops_at_the_first_step_over_the_limit() -> None:
    assert metrics.carried_clients({1: 0.8, 2: 0.9, 4: 1.5, 8: 2.6, 16: 1.0}, 2.0) == 4
    assert metrics.carried_clients({1: 2.5}, 2.0) is None
    assert metrics.carried_clients({1: 0.5, 2: None, 4: 0.5}, 2.0) == 1
    assert metrics.carried_clients({}, 2.0) is None


def test_automatic_sweep_doubles_then_bisects() -> None:
    tried: dict[int, bool] = {}
    capacity = 11  # steps up to 11 clients are within the limit
    sequence = []
    while (n := metrics.next_client_count(tried, max_clients=64)) is not None:
        sequence.append(n)
        tried[n] = n <= capacity
    assert sequence == [1, 2, 4, 8, 16, 12, 10, 11]
    assert metrics.carried_clients({n: 0.5 if ok else 3.0 for n, ok in tried.items()}, 2.0) == 11


def test_automatic_sweep_respects_the_ceiling_and_a_failing_first_step() -> None:
    assert metrics.next_client_count({1: True, 2: True, 4: True}, max_clients=6) == 6
    assert metrics.next_client_count({1: True, 2: True, 4: True, 6: True}, max_clients=6) is None
    assert metrics.next_client_count({1: False}, max_clients=64) is None


# ---------------------------------------------------------------------------
# /metrics

SCRAPE_BEFORE = """\
# TYPE streamer_decode_seconds histogram
streamer_decode_seconds_bucket{kind="final",le="0.1"} 1.0
streamer_decode_seconds_bucket{kind="final",le="0.5"} 2.0
streamer_decode_seconds_bucket{kind="final",le="+Inf"} 2.0
streamer_decode_seconds_count{kind="final"} 2.0
streamer_decode_seconds_sum{kind="final"} 0.4
# TYPE streamer_partials_skipped counter
streamer_partials_skipped_total 3.0
"""

SCRAPE_AFTER = """\
# TYPE streamer_decode_seconds histogram
streamer_decode_seconds_bucket{kind="final",le="0.1"} 3.0
streamer_decode_seconds_bucket{kind="final",le="0.5"} 10.0
streamer_decode_seconds_bucket{kind="final",le="+Inf"} 12.0
streamer_decode_seconds_count{kind="final"} 12.0
streamer_decode_seconds_sum{kind="final"} 4.4
streamer_decode_seconds_bucket{kind="partial",le="0.1"} 5.0
streamer_decode_seconds_bucket{kind="partial",le="0.5"} 5.0
streamer_decode_seconds_bucket{kind="partial",le="+Inf"} 5.0
streamer_decode_seconds_count{kind="partial"} 5.0
streamer_decode_seconds_sum{kind="partial"} 0.25
# TYPE streamer_partials_skipped counter
streamer_partials_skipped_total 7.0
# TYPE streamer_sessions_active gauge
streamer_sessions_active 4.0
"""


def test_histogram_and_counter_differences_between_scrapes() -> None:
    before, after = prom.parse_samples(SCRAPE_BEFORE), prom.parse_samples(SCRAPE_AFTER)
    final_hist = prom.histogram_delta(before, after, "streamer_decode_seconds", {"kind": "final"})
    assert final_hist is not None
    assert final_hist.count == 10 and final_hist.sum == pytest.approx(4.0)
    assert final_hist.mean == pytest.approx(0.4)
    assert final_hist.buckets == ((0.1, 2.0), (0.5, 8.0), (math.inf, 10.0))
    # rank 5 of 10 lies in (0.1, 0.5], 3 of its 6 observations in
    assert final_hist.quantile(0.5) == pytest.approx(0.1 + 0.4 * 3 / 6)
    assert final_hist.quantile(0.95) == pytest.approx(0.5)  # in +Inf: highest finite bound
    partial_hist = prom.histogram_delta(
        before, after, "streamer_decode_seconds", {"kind": "partial"}
    )
    assert partial_hist is not None and partial_hist.count == 5
    both = prom.histogram_delta(before, after, "streamer_decode_seconds")
    assert both is not None and both.count == 15
    assert prom.delta(before, after, "streamer_partials_skipped_total") == 4.0
    assert prom.value(after, "streamer_sessions_active") == 4.0
    assert prom.delta(before, after, "streamer_not_there") is None
    assert prom.histogram_delta(before, after, "streamer_not_there") is None


def test_histogram_quantile_edge_cases() -> None:
    assert prom.histogram_quantile(0.5, ()) is None
    assert prom.histogram_quantile(0.5, ((1.0, 0.0), (math.inf, 0.0))) is None
    assert prom.histogram_quantile(0.5, ((1.0, 4.0), (2.0, 4.0), (math.inf, 4.0))) == 0.5
    assert prom.histogram_quantile(1.5, ((1.0, 4.0),)) is None


# ---------------------------------------------------------------------------
# Audio, options, report


def test_client_track_loops_clips_and_ends_in_silence() -> None:
    clips = (
        Clip("synth:en", "a", np.full(SAMPLE_RATE, 1000, dtype=np.int16), 1000),
        Clip("synth:zh", "b", np.full(SAMPLE_RATE // 2, 2000, dtype=np.int16), 500),
    )
    track, spans = client_track(clips, first_clip=1, min_s=4.0, lead_ms=250, tail_ms=800)
    lead = 250 * SAMPLE_RATE // 1000
    # lead 4000, clip 1 (8000) + 8000 of gap, clip 0 (16000) + 16000 of gap, clip 1 ...
    assert spans[:3] == [(4000, 12000), (20000, 36000), (52000, 60000)]
    assert not track[:lead].any()
    # starts with clip 1 (value 2000), then clip 0 (1000), looping until >= 4 s
    assert track[lead] == 2000 and track[lead + SAMPLE_RATE // 2 + SAMPLE_RATE // 2] == 1000
    assert track.size >= 4 * SAMPLE_RATE
    assert not track[-800 * SAMPLE_RATE // 1000 :].any()


def test_variant_and_client_parsing() -> None:
    assert parse_variant("int8:partials").partials is True
    v = parse_variant("fp32:nopartials")
    assert (v.precision, v.partials) == ("fp32", False)
    base = ServerOptions(model="random:small")
    assert "--quantize" not in v.server_options(base).command(8000)
    int8 = parse_variant("int8").server_options(base).command(8000)
    assert int8[int8.index("--quantize") + 1] == "int8"
    bf16 = parse_variant("bf16").server_options(base).command(8000)
    assert bf16[bf16.index("--dtype") + 1] == "bf16"
    assert parse_variant("server:nopartials").precision is None
    with pytest.raises(ValueError):
        parse_variant("int4")
    with pytest.raises(ValueError):
        parse_variant("int8:fast")
    assert parse_clients("8,1,2,2") == [1, 2, 8]
    assert parse_clients("auto") is None
    with pytest.raises(ValueError):
        parse_clients("0,1")


def test_table_renders_missing_values() -> None:
    empty = {"p50": None, "p95": None, "p99": None}
    step = {
        "clients": 2,
        "summary": {
            "segments": 0,
            "first_token_s": empty,
            "final_s": {"p50": 0.61, "p95": 0.9, "p99": 1.2},
            "partial_gap_s": empty,
            "decode_ms": empty,
            "queue_ms": empty,
        },
        "skip_share": None,
        "send_lag_s": {"p50": 0.0, "p95": 0.25, "p99": 0.3, "max": 0.4},
        "errors": [],
        "monitor": {},
    }
    results = {
        "variants": [{"name": "int8", "steps": [step], "carried_clients": 2}],
        "options": {"saturation_final_p95_s": 2.0},
    }
    text = report.table(results)
    assert "610" in text and "900" in text and "250 !" in text
    assert report.table(results, markdown=True).startswith("| variant | clients |")
    busy = {"system_cpu_pct": {"mean": 150.0}, "process_cpu_pct": {"mean": 90.0},
            "bench_cpu_pct": {"mean": 10.0}}  # fmt: skip
    assert report.other_cpu_pct(busy) == pytest.approx(50.0)
    assert report.other_cpu_pct({}) is None
    assert report.carried_lines(results) == [
        "int8: carries at least 2 real-time clients (largest step tried) with final p95 <= 2 s"
    ]


# ---------------------------------------------------------------------------
# End to end, against the tiny random model


def test_bench_runs_against_a_real_server(server_url: str, tmp_path: Path) -> None:
    from bench.latency import cli

    args = cli.build_parser().parse_args([
        "--url", server_url, "--variants", "server,server:nopartials", "--clients", "1,2",
        "--compare-clients", "1", "--duration-s", "3", "--stagger-s", "0.5",
        "--audio", "synth", "--out", str(tmp_path), "--drain-timeout-s", "30",
        "--pause-s", "0.2", "--no-stop-when-saturated",
    ])  # fmt: skip
    results = cli.run(args, [])
    main, nopartials = results["variants"]
    assert [s["clients"] for s in main["steps"]] == [1, 2]
    for step in main["steps"] + nopartials["steps"]:
        assert not step["errors"], step["errors"]
        assert step["summary"]["segments"] > 0
        assert step["summary"]["final_s"]["p50"] is not None
        assert step["send_lag_s"]["p95"] < 0.5
    assert all(s["partials"] == 0 for s in nopartials["steps"][0]["segments"])
    for name in ("results.json", "table.txt", "summary.md"):
        assert (tmp_path / name).stat().st_size > 0
    # --merge: several runs (run_on_gpu.sh's) in one table, each variant named after its run
    for run in ("batch1", "batch32"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "results.json").write_text((tmp_path / "results.json").read_text())
    merged = tmp_path / "merged"
    assert cli.main(["--merge", str(tmp_path / "batch1"), str(tmp_path / "batch32"),
                     "--out", str(merged)]) == 0  # fmt: skip
    table = (merged / "summary.md").read_text()
    assert "| batch1 server | 1 |" in table and "| batch32 server:nopartials | 1 |" in table


# ---------------------------------------------------------------------------
# Side by side: protocols, encodings, continuous speech


def test_kinds_are_the_protocols_times_the_encodings_they_take() -> None:
    from bench.latency import protocols

    options = protocols.RunOptions(
        protocols=("v1", "openai", "deepgram"), encodings=("pcm", "webm")
    )
    assert options.kinds == ("v1", "openai", "deepgram", "v1-webm", "deepgram-webm")
    assert options.spoken
    assert not protocols.RunOptions().spoken
    with pytest.raises(ValueError, match="unknown protocol or encoding: mp3, sip"):
        protocols.validate(protocols.RunOptions(protocols=("sip",), encodings=("mp3",)))
    with pytest.raises(ValueError, match="webm goes through v1 and deepgram only"):
        protocols.validate(protocols.RunOptions(protocols=("openai",), encodings=("webm",)))
    assert protocols.rotation(("a", "b", "c"), 4, 1) == ["b", "c", "a", "b"]


def test_side_by_side_table_compares_with_the_first_kind() -> None:
    from bench.latency import protocols

    def summary(ttft: float | None, final: float) -> dict:
        return {"utterances": 3, "ttft_ms": {"p50": ttft, "p95": 500.0},
                "final_ms": {"p50": final, "p95": 900.0}, "answer_ms": {"p50": 12.0},
                "errors": []}  # fmt: skip

    text = protocols.table({"steps": {4: {"v1": summary(300, 600), "openai": summary(None, 650)}}})
    rows = text.splitlines()
    assert rows[2] == "| 4 | v1 | 3 | 300 / 500 | 600 / 900 | 12 |  |"
    assert rows[3] == "| 4 | openai | 3 | - / 500 | 650 / 900 | 12 | -, +50 |"


def test_every_protocol_and_encoding_against_a_real_server(
    make_server, tiny_model_dir: Path, speech_cache: Path
) -> None:
    import asyncio

    from bench.latency import protocols
    from bench.latency.audio import load_bench_audio
    from tests.server_fixtures import recognizer_loader

    thread = make_server(recognizer_loader(tiny_model_dir), funasr_port=0, wyoming_port=0)
    listeners = thread.server.listeners
    ports = {"v1": thread.port, **{name: listeners[name].port for name in ("funasr", "wyoming")}}
    options = protocols.RunOptions(
        protocols=protocols.PROTOCOLS, encodings=protocols.ENCODINGS, clients=(1,), rounds=1,
        duration_s=3.0, stagger_s=0.3,
    )  # fmt: skip
    audio = load_bench_audio("synth", speech_cache)
    results = asyncio.run(protocols.run_side_by_side(ports, audio, options))
    by_kind = results["steps"][1]
    assert list(by_kind) == list(options.kinds)
    for kind, summary in by_kind.items():
        assert not summary["errors"], (kind, summary["errors"])
        assert summary["ttft_ms"]["p50"] is not None, kind  # text arrived, and was timed
        assert summary["answer_ms"]["p50"] is not None, kind  # the end of input answered
        if kind != "wyoming":  # one transcript at the end: no final per utterance
            assert summary["utterances"] > 0 and summary["final_ms"]["p50"] is not None, kind
    assert results["decode_cost"]["core_percent"] > 0
    assert "| 1 | deepgram-webm |" in protocols.table(results)


def test_continuous_speech_through_the_cli(server_url: str, tmp_path: Path) -> None:
    import json

    from bench.latency import cli

    argv = ["--url", server_url, "--audio", "continuous", "--clients", "1", "--rounds", "1",
            "--duration-s", "6", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["command"].startswith("python -m bench.latency --url")
    summary = record["steps"]["1"]["summary"]
    assert summary["all"]["n"] == summary["onset"]["n"] + summary["continuation"]["n"] > 0
    assert summary["all"]["ttft_ms"]["p50"] is not None


def test_capacity_sweep_rows_count_refusals_apart_from_other_errors() -> None:
    from bench.capacity import summary_row, table

    step = {
        "errors": [
            "connect: ConnectionRefusedByServer: server refused the connection: HTTP 503: "
            "saturated",
            "no end within 60 s of the last chunk",
        ],
        "summary": {
            "first_token_s": {"p50": 0.3, "p95": 0.9},
            "final_s": {"p50": 0.25, "p95": 0.6},
            "segments": 12,
        },
    }
    row = summary_row(step, 4)
    assert (row["admitted"], len(row["refused"]), len(row["other_errors"])) == (3, 1, 1)
    text = table([{"config": "default", "hog": True, "loadavg": [1.0, 2.5], **row}])
    assert "| default | hog | 4 | 3 | 300 / 900 | 250 / 600 | 1.0-2.5 |" in text


def test_capacity_sweep_configurations_are_server_flags() -> None:
    from bench.capacity import config_args

    assert config_args("default") == ()
    assert config_args("off") == ("--no-capacity-admission",)
    assert config_args("off-w2") == ("--no-capacity-admission", "--workers", "2")
    assert config_args("off+diarize") == ("--no-capacity-admission",)  # the clients' option
    with pytest.raises(SystemExit):
        config_args("on")


def test_capacity_sweep_clients_in_processes_of_their_own(server_url: str, tmp_path: Path) -> None:
    from bench.latency.client_processes import run_step_in_processes
    from bench.latency.load import StepOptions

    step = StepOptions(url=server_url, clients=2, duration_s=2.0, stagger_s=0.4)
    records = run_step_in_processes(step, "synth", tmp_path)
    assert [record.plan.index for record in records] == [0, 1]
    assert records[1].plan.delay_s == pytest.approx(0.2)  # the plan's, not the child's own
    for record in records:
        assert record.error is None and record.end is not None and record.sends
