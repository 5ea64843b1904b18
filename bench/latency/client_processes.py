"""A load step whose clients each run in a process of their own (issue 31).

In one process the clients share one interpreter: their own CPU is one core at most,
and the server's decodes do not compete with 16 clients' worth of other processes, as
they do when 16 people's programs (or a test harness's) run beside it. Here each
client of :func:`bench.latency.load.plan_clients`'s plan is ``python -m
bench.latency.client_processes`` (the same plan, rebuilt from the same arguments; one
index each), started together and aligned on a shared wall-clock start; each pickles
its :class:`~bench.latency.load.ClientRecord` for the parent, which pools them as an
in-process step would be.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.latency.audio import AUDIO_CHOICES, load_bench_audio
from bench.latency.load import ClientRecord, StepOptions, plan_clients, run_step

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SPAWN_SLACK_S = 8.0  # the children's start is this far ahead: their imports fit in it


def run_step_in_processes(
    step: StepOptions, audio_choice: str, out: Path, python: str = sys.executable
) -> list[ClientRecord]:
    """Run ``step``'s clients, one process each; their records, in plan order."""
    out.mkdir(parents=True, exist_ok=True)
    start_at = time.time() + SPAWN_SLACK_S
    children = []
    for index in range(step.clients):
        argv = [
            python, "-m", "bench.latency.client_processes", "--url", step.url,
            "--clients", str(step.clients), "--index", str(index),
            "--duration-s", str(step.duration_s), "--stagger-s", str(step.stagger_s),
            "--audio", audio_choice, "--start-at", repr(start_at),
            "--out", str(out / f"client-{index}.pickle"),
        ]  # fmt: skip
        children.append(subprocess.Popen(argv, cwd=REPO))
    budget_s = SPAWN_SLACK_S + step.duration_s + step.stagger_s + step.drain_timeout_s + 60
    for child in children:
        child.wait(timeout=budget_s)
    records = []
    for index in range(step.clients):
        path = out / f"client-{index}.pickle"
        with path.open("rb") as f:
            records.append(pickle.load(f))
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.latency.client_processes")
    p.add_argument("--url", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--stagger-s", type=float, required=True)
    p.add_argument("--audio", choices=AUDIO_CHOICES, default="synth")
    p.add_argument("--start-at", type=float, required=True, help="time.time() of the step start")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    step = StepOptions(
        url=args.url, clients=args.clients, duration_s=args.duration_s, stagger_s=args.stagger_s
    )
    audio = load_bench_audio(args.audio, REPO / "bench" / "out" / "audio-cache")
    plan = plan_clients(step, audio)[args.index]
    # the plan's delay counts from the shared start, not from this process's
    plan = replace(plan, delay_s=max(0.0, args.start_at + plan.delay_s - time.time()))
    (record,) = asyncio.run(run_step(step, [plan]))  # one client: this process's
    record.plan = replace(plan, delay_s=plan_clients(step, audio)[args.index].delay_s)
    with args.out.open("wb") as f:
        pickle.dump(record, f)


if __name__ == "__main__":
    main()
