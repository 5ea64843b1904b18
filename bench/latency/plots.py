"""PNG plots of a bench run: latency CDFs and latency against the number of clients.

Each figure carries a footer with the machine, model, device and options, so a PNG
pasted on its own still says what it measured.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

logger = logging.getLogger(__name__)

METRICS = (("first_token_s", "time to first token"), ("final_s", "final latency"))


def footer(results: dict[str, Any]) -> str:
    m = results["machine"]
    o = results["options"]
    a = results["audio"]
    device = m.get("gpu") or f"{m['cpu']} ({m['cores']} cores)"
    return (
        f"{m['host']}: {device}, {m['memory_gib']} GiB | model {o['model']} on {o['device']}"
        f" | audio {a['kind']} ({a['clips']} clips) | {o['duration_s']:g} s per step,"
        f" chunks {o['chunk_ms']} ms, endpoint {o['endpoint_ms']} ms,"
        f" speed {o['speed']:g}x | torch {m.get('torch')}, funasr {m.get('funasr')}"
    )


def _values(step: dict[str, Any], key: str) -> np.ndarray:
    return np.asarray(
        sorted(s[key] for s in step["segments"] if s[key] is not None and s["reason"] != "stop"),
        dtype=np.float64,
    )


def _cdf(ax: Any, data: np.ndarray, label: str) -> None:
    x = np.concatenate(([data[0]], data)) * 1000
    y = np.concatenate(([0.0], np.arange(1, data.size + 1) / data.size))
    ax.step(x, y, where="post", label=f"{label} (n={data.size})")


def _style_cdf(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("share of segments")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def plot_cdfs(results: dict[str, Any], path: Path) -> None:
    """One row per variant, time to first token and final latency, one curve per step."""
    variants = [v for v in results["variants"] if v["steps"]]
    if not variants:
        return
    fig, axes = plt.subplots(len(variants), 2, figsize=(12, 3.6 * len(variants)), squeeze=False)
    for row, variant in zip(axes, variants, strict=True):
        for ax, (key, label) in zip(row, METRICS, strict=True):
            for step in variant["steps"]:
                data = _values(step, key)
                if data.size:
                    _cdf(ax, data, f"{step['clients']} clients")
            _style_cdf(ax, f"{variant['name']}: {label}")
    _finish(fig, results, path)


def plot_comparison(results: dict[str, Any], path: Path) -> bool:
    """Variants side by side at each client count they share; False when none is shared."""
    counts: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for variant in results["variants"]:
        for step in variant["steps"]:
            counts.setdefault(step["clients"], []).append((variant["name"], step))
    shared = sorted(n for n, entries in counts.items() if len(entries) > 1)
    if not shared:
        return False
    fig, axes = plt.subplots(len(shared), 2, figsize=(12, 3.6 * len(shared)), squeeze=False)
    for row, n in zip(axes, shared, strict=True):
        for ax, (key, label) in zip(row, METRICS, strict=True):
            for name, step in counts[n]:
                data = _values(step, key)
                if data.size:
                    _cdf(ax, data, name)
            _style_cdf(ax, f"{label}, {n} clients")
    _finish(fig, results, path)
    return True


def plot_vs_clients(results: dict[str, Any], path: Path) -> None:
    """p50 and p95 of both latencies against the number of clients, every variant."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    endpoint_s = results["options"]["endpoint_ms"] / 1000.0
    limit_s = results["options"]["saturation_final_p95_s"]
    all_counts = sorted({s["clients"] for v in results["variants"] for s in v["steps"]})
    for ax, (key, label) in zip(axes, METRICS, strict=True):
        for variant in results["variants"]:
            steps = sorted(variant["steps"], key=lambda s: s["clients"])
            if not steps:
                continue
            n = [s["clients"] for s in steps]
            for q, style in (("p50", "-o"), ("p95", "--s")):
                ys = [s["summary"][key][q] for s in steps]
                ys_ms = [np.nan if y is None else y * 1000 for y in ys]
                ax.plot(n, ys_ms, style, label=f"{variant['name']} {q}", markersize=4)
        if key == "final_s":
            ax.axhline(limit_s * 1000, color="red", lw=0.8, ls=":", label=f"{limit_s:g} s")
            ax.axhline(
                (endpoint_s + 0.4) * 1000, color="gray", lw=0.8, ls=":", label="endpoint + 400 ms"
            )
        else:
            ax.axhline(500, color="gray", lw=0.8, ls=":", label="500 ms")
        ax.set_title(f"{label} against concurrent real-time clients")
        ax.set_xlabel("clients")
        ax.set_ylabel("ms")
        ax.set_xscale("log", base=2)
        # Bisection steps crowd the axis: label the doublings (and the ends) only.
        ticks = [c for c in all_counts if c & (c - 1) == 0 or c == all_counts[-1]]
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _finish(fig, results, path)


def _finish(fig: Any, results: dict[str, Any], path: Path) -> None:
    fig.text(0.01, 0.005, footer(results), fontsize=7, ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", path)
