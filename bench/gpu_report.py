"""Merge the ``results.json`` of several ``bench.latency`` runs into one table and plot.

``bench/run_on_gpu.sh`` runs one ``bench.latency`` per server configuration (batching
on and off, precisions, CPU worker splits), each into its own folder; this writes
``sweep.md`` (every step of every run) and ``vs_clients_all.png`` (final p95 and time to
first token against clients, one line per run) into ``--out``.

    python -m bench.gpu_report --out OUT RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _ms(summary: dict[str, Any], key: str, q: str) -> float | None:
    value = (summary.get(key) or {}).get(q)
    return None if value is None else 1000 * value


def rows(run_dir: Path) -> list[dict[str, Any]]:
    """One row per step of every variant in ``run_dir/results.json``."""
    path = run_dir / "results.json"
    if not path.exists():
        return [{"run": run_dir.name, "variant": "-", "clients": 0, "note": "no results.json"}]
    results = json.loads(path.read_text())
    out = []
    for variant in results.get("variants", []):
        for step in variant.get("steps", []):
            s = step.get("summary") or {}
            lag = step.get("send_lag_s") or {}
            out.append(
                {
                    "run": run_dir.name,
                    "variant": variant["name"],
                    "clients": step["clients"],
                    "ttft_p50_ms": _ms(s, "first_token_s", "p50"),
                    "final_p50_ms": _ms(s, "final_s", "p50"),
                    "final_p95_ms": _ms(s, "final_s", "p95"),
                    "decode_p50_ms": (s.get("decode_ms") or {}).get("p50"),
                    "send_lag_p95_ms": None if lag.get("p95") is None else 1000 * lag["p95"],
                    "errors": len(step.get("errors") or []),
                    "carried": variant.get("carried_clients"),
                }
            )
    return out


def markdown(all_rows: list[dict[str, Any]]) -> str:
    cols = [
        "run",
        "variant",
        "clients",
        "ttft_p50_ms",
        "final_p50_ms",
        "final_p95_ms",
        "decode_p50_ms",
        "send_lag_p95_ms",
        "errors",
        "carried",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in all_rows:
        cells = []
        for col in cols:
            value = row.get(col)
            cells.append(f"{value:.0f}" if isinstance(value, float) else str(value or "-"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(all_rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in all_rows:
        if row.get("clients"):
            series.setdefault(f"{row['run']} {row['variant']}", []).append(row)
    for name, points in series.items():
        points.sort(key=lambda r: r["clients"])
        xs = [r["clients"] for r in points]
        ax1.plot(xs, [r["final_p95_ms"] for r in points], marker="o", label=name)
        ax2.plot(xs, [r["ttft_p50_ms"] for r in points], marker="o", label=name)
    for ax, title in ((ax1, "final latency p95 (ms)"), (ax2, "time to first token p50 (ms)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("real-time clients")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.axhline(2000, color="grey", linestyle="--", linewidth=1)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_report", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("runs", nargs="+", type=Path)
    args = p.parse_args(argv)
    all_rows = [row for run in args.runs for row in rows(run)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text(markdown(all_rows))
    plot(all_rows, args.out / "vs_clients_all.png")
    sys.stdout.write(markdown(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
