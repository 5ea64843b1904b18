"""A load step whose clients each run in a process of their own (issue 31).

In one process the clients share one interpreter: their own CPU is one core at most,
and the server's decodes do not compete with 16 clients' worth of other processes, as
they do when 16 people's programs (or a test harness's) run beside it. Here the parent
plans the step (:func:`bench.latency.load.plan_clients`) and pickles each client's plan,
with the step's options and a shared wall-clock start, for ``python -m
bench.latency.client_processes JOB`` (one process each, started together); each pickles
its :class:`~bench.latency.load.ClientRecord` beside its job for the parent, which pools
them as an in-process step would be.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.common import AUDIO_CACHE, REPO
from bench.latency.audio import load_bench_audio
from bench.latency.load import ClientRecord, StepOptions, plan_clients, run_step

logger = logging.getLogger(__name__)

SPAWN_SLACK_S = 8.0  # the children's start is this far ahead: their imports fit in it


def run_step_in_processes(
    step: StepOptions, audio_choice: str, out: Path, python: str = sys.executable
) -> list[ClientRecord]:
    """Run ``step``'s clients, one process each; their records, in plan order."""
    out.mkdir(parents=True, exist_ok=True)
    plans = plan_clients(step, load_bench_audio(audio_choice, AUDIO_CACHE))
    start_at = time.time() + SPAWN_SLACK_S
    jobs = [out / f"client-{plan.index}.job" for plan in plans]
    children = []
    for plan, job in zip(plans, jobs, strict=True):
        job.write_bytes(pickle.dumps((step, plan, start_at)))
        command = [python, "-m", "bench.latency.client_processes", str(job)]
        children.append(subprocess.Popen(command, cwd=REPO))
    budget_s = SPAWN_SLACK_S + step.duration_s + step.stagger_s + step.drain_timeout_s + 60
    for child in children:
        child.wait(timeout=budget_s)
    return [pickle.loads(job.with_suffix(".record").read_bytes()) for job in jobs]


def main(argv: list[str] | None = None) -> None:
    (job,) = sys.argv[1:] if argv is None else argv
    step, plan, start_at = pickle.loads(Path(job).read_bytes())
    logging.basicConfig(level=logging.WARNING)
    # the plan's delay counts from the shared start, not from this process's
    delayed = replace(plan, delay_s=max(0.0, start_at + plan.delay_s - time.time()))
    (record,) = asyncio.run(run_step(step, [delayed]))  # one client: this process's
    record.plan = plan
    Path(job).with_suffix(".record").write_bytes(pickle.dumps(record))


if __name__ == "__main__":
    main()
