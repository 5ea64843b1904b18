"""The table, JSON file and Markdown summary of a bench run."""

from __future__ import annotations

import math
from typing import Any

from bench.common import markdown_table

COLUMNS = (  # a step's row, latencies in ms
    "variant|clients|segs|ttft p50|ttft p95|ttft p99|final p50|final p95|final p99|onset ttft p50|"
    "speech-end final p50|cadence|skipped|decode p50|queue p95|loop lag|send lag p95|cpu %|"
    "bench cpu %|other cpu %|rss MiB|gpu %|errors"
).split("|")
SEND_LAG_LIMIT_S = 0.1  # a step whose load generator sent later than this (p95) is flagged


def ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.0f}"


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def step_row(variant: str, step: dict[str, Any]) -> list[str]:
    s = step["summary"]
    mon = step.get("monitor") or {}
    server = mon.get("server") or {}
    lag = server.get("event_loop_lag_s") or {}
    loop_lag = lag.get("p95") if "p95" in lag else lag.get("max")
    send_lag = step["send_lag_s"]["p95"]
    flag = " !" if send_lag is not None and send_lag > SEND_LAG_LIMIT_S else ""
    return [
        variant,
        str(step["clients"]),
        str(s["segments"]),
        ms(s["first_token_s"]["p50"]),
        ms(s["first_token_s"]["p95"]),
        ms(s["first_token_s"]["p99"]),
        ms(s["final_s"]["p50"]),
        ms(s["final_s"]["p95"]),
        ms(s["final_s"]["p99"]),
        ms((s.get("onset_first_token_s") or {}).get("p50")),
        ms((s.get("speech_end_final_s") or {}).get("p50")),
        ms(s["partial_gap_s"]["p50"]),
        _num(None if step["skip_share"] is None else step["skip_share"] * 100, "{:.0f}%"),
        _num(s["decode_ms"]["p50"]),
        _num(s["queue_ms"]["p95"]),
        ms(loop_lag),
        ms(send_lag) + flag,
        _num((mon.get("process_cpu_pct") or {}).get("mean")),
        _num((mon.get("bench_cpu_pct") or {}).get("mean")),
        _num(other_cpu_pct(mon)),
        _num((mon.get("process_rss_mib") or {}).get("max")),
        _num((mon.get("gpu_util_pct") or {}).get("mean")),
        str(len(step["errors"])),
    ]


def other_cpu_pct(monitor: dict[str, Any]) -> float | None:
    """Mean CPU of everything on the machine but the server and the bench (100 = a core).

    High values mean the step shared the machine with other work: its latencies are then
    not the server's alone.
    """
    values = [
        (monitor.get(key) or {}).get("mean")
        for key in ("system_cpu_pct", "process_cpu_pct", "bench_cpu_pct")
    ]
    if values[0] is None:
        return None
    return max(0.0, values[0] - (values[1] or 0.0) - (values[2] or 0.0))


def table(results: dict[str, Any], markdown: bool = False) -> str:
    """Every step of every variant, latencies in ms (``!``: the load generator lagged)."""
    rows = [list(COLUMNS)]
    for variant in results["variants"]:
        for step in variant["steps"]:
            rows.append(step_row(variant["name"], step))
    if markdown:
        return markdown_table(rows[0], rows[1:])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def carried_lines(results: dict[str, Any]) -> list[str]:
    limit = results["options"]["saturation_final_p95_s"]
    lines = []
    for variant in results["variants"]:
        carried = variant.get("carried_clients")
        tried = sorted(s["clients"] for s in variant["steps"])
        if not tried:
            continue
        if carried is None:
            text = f"{variant['name']}: final p95 over {limit:g} s already at {tried[0]} client(s)"
        elif carried == max(tried):
            text = (
                f"{variant['name']}: carries at least {carried} real-time clients"
                f" (largest step tried) with final p95 <= {limit:g} s"
            )
        else:
            text = (
                f"{variant['name']}: carries {carried} real-time clients with final p95"
                f" <= {limit:g} s"
            )
        lines.append(text)
    return lines


def summary_markdown(results: dict[str, Any]) -> str:
    o = results["options"]
    m = results["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
        f"Model {o['model']} on {o['device']}; audio {results['audio']['kind']};"
        f" {o['duration_s']:g} s per step, stagger {o['stagger_s']:g} s, chunks"
        f" {o['chunk_ms']} ms, endpoint {o['endpoint_ms']} ms.",
        f"Command: `{results['command']}`",
        "",
        table(results, markdown=True),
        "",
        *[f"- {line}" for line in carried_lines(results)],
    ]
    return "\n".join(lines) + "\n"
