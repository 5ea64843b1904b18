"""The worker pool: routing, pinning, failure, device lists, and a server with two workers.

The routing tests run real :class:`ModelWorker` threads over recognizers that block
until released, so which worker holds which job is decided, not raced; the server test
runs the real tiny model on loopback with one worker and with two.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.jobs import DecodeFailure, DecodeJob
from streamer.core.transcript import Transcript
from streamer.errors import ConfigError, ModelError
from streamer.model.backends import loading
from streamer.model.interface import RecognizerBase
from streamer.model.options import parse_devices
from streamer.model.serving.pool import (
    FILE_WORKER_NICE,
    WorkerHooks,
    WorkerPool,
    WorkerSlot,
    plan_slots,
)
from streamer.model.serving.worker import ModelWorker, WorkerOptions
from streamer.server.metrics import Metrics
from streamer.server.server import ServerOptions, StreamingServer
from streamer.testkit import speech as synth
from tests.fakes import Answers
from tests.server_fixtures import recognizer_loader
from tests.timing import timeout_s

GUARD_S = 30.0  # how long a test waits for something that should happen at once


class Gate(RecognizerBase):
    """A recognizer that blocks every decode until :meth:`open` (then answers at once)."""

    name = "gate"

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Semaphore(0)

    def decode(self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True):
        self.entered.release()
        self.opened.wait(timeout_s(GUARD_S))
        raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>gate"
        return Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0.0, decode_ms=0.0)


def job(session: str, kind: str = "final", segment: int = 0) -> DecodeJob:
    return DecodeJob(
        session_id=session,
        segment_id=segment,
        kind=kind,
        pcm=np.zeros(1600, dtype=np.int16),
        start_sample=0,
        end_sample=1600,
        language="auto",
        itn=True,
    )


def gated_pool(n: int, on_decoded=None, **worker_options) -> tuple[WorkerPool, list[Gate]]:
    gates = [Gate() for _ in range(n)]

    def factory(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        gate = gates[slot.index]
        return ModelWorker(
            lambda: gate,
            on_decoded=hooks.on_decoded,
            on_failure=hooks.on_failure,
            **worker_options,
        )

    slots = [WorkerSlot(i, "cpu", 1) for i in range(n)]
    pool = WorkerPool(factory, slots, on_decoded=on_decoded)
    pool.start()
    assert pool.ready.wait(timeout_s(GUARD_S))
    return pool, gates


@pytest.fixture
def two() -> Iterator[tuple[WorkerPool, list[Gate]]]:
    pool, gates = gated_pool(2)
    yield pool, gates
    for gate in gates:
        gate.opened.set()
    pool.stop()


def test_sessions_go_to_the_least_loaded_worker_and_stay_there(two) -> None:
    pool, gates = two
    answers = Answers()
    pool.submit(job("a"), answers)  # both idle: the lowest index
    assert gates[0].entered.acquire(timeout=timeout_s(GUARD_S))
    pool.submit(job("b"), answers)  # worker 0 has a session and a running job
    assert gates[1].entered.acquire(timeout=timeout_s(GUARD_S))
    pool.submit(job("c"), answers)  # a tie again: the lowest index
    assert [pool.worker_of(s).index for s in "abc"] == [0, 1, 0]
    # b's second job follows b to worker 1, though worker 1 is not the least loaded
    pool.submit(job("b", segment=1), answers)
    pool.submit(job("b", segment=2), answers)
    assert pool.worker_of("b").index == 1
    assert [load.sessions for load in pool.loads()] == [2, 1]
    stats = [load.stats for load in pool.loads()]
    assert (stats[0].queued_finals, stats[1].queued_finals) == (1, 2)
    assert pool.stats().queued_finals == 3 and pool.stats().busy
    for gate in gates:
        gate.opened.set()
    results = answers.wait(5)
    by_session = {(r.job.session_id, r.job.segment_id) for r in results if r.transcript}
    assert by_session == {("a", 0), ("b", 0), ("c", 0), ("b", 1), ("b", 2)}


def test_one_worker_counts_its_sessions_too() -> None:
    pool, gates = gated_pool(1)
    try:
        answers = Answers()
        pool.submit(job("a"), answers)
        assert gates[0].entered.acquire(timeout=timeout_s(GUARD_S))  # a's job is running
        pool.submit(job("b"), answers)
        assert [load.sessions for load in pool.loads()] == [2]  # what /readyz and metrics show
        assert pool.drop_session("a") == 0  # its job is running, not queued
        assert [load.sessions for load in pool.loads()] == [1]
        assert pool.worker_of("a") is None and pool.worker_of("b").index == 0
    finally:
        gates[0].opened.set()
        pool.stop()


def test_background_jobs_are_summed_counted_and_labelled_apart() -> None:
    """File uploads' jobs: in the pool's stats and the queue metrics as their own kind,
    in each worker's queued jobs, and not in the live finals' wait that admission reads."""
    metrics = Metrics()
    pool, gates = gated_pool(1, on_decoded=metrics.observe_worker_decode)
    try:
        answers = Answers()
        pool.submit(job("live"), answers)
        assert gates[0].entered.acquire(timeout=timeout_s(GUARD_S))  # decoding
        for segment in range(3):
            pool.submit(replace(job("file", segment=segment), background=True), answers)
        stats = pool.stats()
        assert (stats.queued_background, stats.queued_finals, stats.live.oldest_final_age_ms) == (
            3,
            0,
            0.0,
        )
        metrics.observe_workers(pool.loads())
        sample = metrics.registry.get_sample_value
        assert sample("streamer_worker_queue_depth", {"kind": "background"}) == 3
        assert sample("streamer_worker_queued_jobs", {"worker": "0", "device": "cpu"}) == 3
        gates[0].opened.set()
        answers.wait(4)
        metrics.observe_workers(pool.loads())
        assert sample("streamer_worker_queue_depth", {"kind": "background"}) == 0
        labels = {"worker": "0", "device": "cpu"}
        assert sample("streamer_worker_decodes_total", {**labels, "kind": "background"}) == 3
        assert sample("streamer_worker_decodes_total", {**labels, "kind": "final"}) == 1
        assert sample("streamer_queue_wait_seconds_count", {"kind": "background"}) == 3
    finally:
        gates[0].opened.set()
        pool.stop()


def test_partials_of_a_session_supersede_each_other_on_its_worker(two) -> None:
    pool, gates = two
    answers = Answers()
    pool.submit(job("a"), answers)
    assert gates[0].entered.acquire(timeout=timeout_s(GUARD_S))
    pool.submit(job("a", "partial", segment=1), answers)
    pool.submit(job("a", "partial", segment=1), answers)  # replaces the one before
    assert answers.wait(1)[0].dropped
    assert pool.loads()[1].stats.queued_partials == 0


def test_drop_session_goes_to_its_worker_and_unpins_it(two) -> None:
    pool, gates = two
    answers = Answers()
    pool.submit(job("a"), answers)
    assert gates[0].entered.acquire(timeout=timeout_s(GUARD_S))
    pool.submit(job("b"), answers)
    assert gates[1].entered.acquire(timeout=timeout_s(GUARD_S))
    pool.submit(job("b", segment=1), answers)  # queued behind b's running job
    assert pool.drop_session("b") == 1
    assert pool.worker_of("b") is None
    assert [load.sessions for load in pool.loads()] == [1, 0]
    assert pool.drop_session("b") == 0  # twice is harmless
    assert pool.drop_session("never-seen") == 0
    for gate in gates:
        gate.opened.set()
    results = answers.wait(2)
    assert {(r.job.session_id, r.job.segment_id) for r in results} == {("a", 0), ("b", 0)}


def test_stop_answers_queued_jobs_dropped_and_joins_every_worker() -> None:
    pool, gates = gated_pool(2)
    answers = Answers()
    pool.submit(job("a"), answers)
    assert gates[0].entered.acquire(timeout=timeout_s(GUARD_S))
    pool.submit(job("a", segment=1), answers)
    stopper = threading.Thread(target=pool.stop)
    stopper.start()
    assert answers.wait(1)[0].dropped  # the queued job, at once
    gates[0].opened.set()  # the running decode finishes and is answered
    stopper.join(timeout_s(GUARD_S))
    results = answers.wait(2)
    assert [r.dropped for r in results] == [True, False]
    assert not any(w._thread.is_alive() for w in pool.workers)
    late = Answers()
    pool.submit(job("z"), late)  # after stop: answered dropped, not lost
    assert late.wait(1)[0].dropped


def test_a_stalled_worker_fails_the_whole_pool() -> None:
    pool, gates = gated_pool(2, decode_timeout_s=0.2)
    failed: list[str] = []
    failed_once = threading.Event()
    pool.on_failure = lambda reason: (failed.append(reason), failed_once.set())
    answers = Answers()
    pool.submit(job("a"), answers)
    pool.submit(job("b"), answers)  # worker 1: its gate never opens either
    assert failed_once.wait(timeout_s(GUARD_S))
    codes = {r.job.session_id: r.failure for r in answers.wait(2)}
    assert codes["a"] is DecodeFailure.MODEL_STALLED
    assert pool.failure is not None and pool.failure.startswith("worker ")
    assert len(failed) == 1  # once, although both workers stall
    for gate in gates:
        gate.opened.set()
    pool.stop(0.5)


def test_a_worker_that_fails_to_load_makes_the_pool_ready_with_its_error() -> None:
    release = threading.Event()

    def factory(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        def load() -> Gate:
            if slot.index == 1:
                raise ModelError("worker 1 has no model")
            release.wait(timeout_s(GUARD_S))  # worker 0 is still loading when worker 1 fails
            return Gate()

        return ModelWorker(load, on_decoded=hooks.on_decoded, on_failure=hooks.on_failure)

    pool = WorkerPool(factory, [WorkerSlot(0, "cpu", 1), WorkerSlot(1, "cpu", 1)])
    pool.start()
    assert pool.ready.wait(timeout_s(GUARD_S))
    assert isinstance(pool.load_error, ModelError)
    release.set()
    pool.stop()


def test_one_worker_is_used_directly() -> None:
    pool, gates = gated_pool(1)
    gates[0].opened.set()
    answers = Answers()
    pool.submit(job("a"), answers)
    assert answers.wait(1)[0].transcript is not None
    assert pool.model_name == "gate"
    assert pool.drop_session("a") == 0
    pool.stop()


# -- device lists and thread shares -----------------------------------------------


def test_device_lists() -> None:
    assert parse_devices("cpu") == ("cpu",)
    assert parse_devices("cuda:0, cuda:1") == ("cuda:0", "cuda:1")
    assert parse_devices("cuda:all") == ("cuda:all",)
    for bad in ("cuda:0,", "cuda:0,cuda:0", "cuda,cuda:0", "auto,cpu", "cuda:all,cuda:0"):
        with pytest.raises(ConfigError):
            parse_devices(bad)


def test_threads_are_shared_between_workers() -> None:
    one = plan_slots(("cpu",), workers_per_device=1, threads=0, usable_cores=16)
    assert one == (WorkerSlot(0, "cpu", 0),)  # one worker: exactly as before
    split = plan_slots(("cpu",), workers_per_device=4, threads=0, usable_cores=16)
    assert [s.threads for s in split] == [4, 4, 4, 4]
    wide = plan_slots(("cpu",), workers_per_device=2, threads=0, usable_cores=64)
    assert [s.threads for s in wide] == [8, 8]  # automatic: the backend's cap each
    assert [
        s.threads for s in plan_slots(("cpu",), workers_per_device=2, threads=64, usable_cores=64)
    ] == [32, 32]
    assert [
        s.threads for s in plan_slots(("cpu",), workers_per_device=3, threads=2, usable_cores=2)
    ] == [1, 1, 1]
    gpus = plan_slots(("cuda:0", "cuda:1"), workers_per_device=2, threads=8, usable_cores=16)
    assert [(s.index, s.device, s.threads) for s in gpus] == [
        (0, "cuda:0", 2),
        (1, "cuda:0", 2),
        (2, "cuda:1", 2),
        (3, "cuda:1", 2),
    ]
    with pytest.raises(ConfigError):
        plan_slots(("cpu",), workers_per_device=0, threads=0, usable_cores=2)


@pytest.mark.skipif(not loading._no_gpu_visible(), reason="this machine may have a GPU")
def test_cuda_all_without_a_gpu_fails_before_anything_slow() -> None:
    with pytest.raises(ConfigError, match="cuda:all needs CUDA GPUs"):
        loading.resolve_devices("cuda:all")


def test_the_cli_checks_every_listed_device() -> None:
    from streamer.cli import build_parser
    from streamer.cli.serve_options import worker_pool

    def pool_of(*argv: str):
        args = build_parser().parse_args(["serve", "--model", "random:tiny", *argv])
        return worker_pool(args, Metrics(), loading.LoadProgress())

    with pytest.raises(ConfigError, match="twice"):
        pool_of("--device", "cpu,cpu")
    with pytest.raises(ConfigError, match="device must be"):
        pool_of("--device", "cpu,gpu:1")
    with pytest.raises(SystemExit):  # refused by the parser, like any flag out of range
        pool_of("--workers", "0")
    pool = pool_of("--device", "cpu", "--workers", "2", "--threads", "2")
    assert [(s.device, s.threads) for s in pool.slots] == [("cpu", 1), ("cpu", 1)]


# -- a real server with two workers ----------------------------------------------


async def _finals_of(server_workers: int, tiny_model_dir: Path, clips: list[np.ndarray]):
    load = recognizer_loader(tiny_model_dir)
    metrics = Metrics()

    def factory(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        return ModelWorker(load, on_decoded=hooks.on_decoded, on_failure=hooks.on_failure)

    slots = plan_slots(("cpu",), workers_per_device=server_workers, threads=2, usable_cores=2)
    pool = WorkerPool(factory, slots, on_decoded=metrics.observe_worker_decode)
    pool.start()
    server = StreamingServer(ServerOptions(host="127.0.0.1", port=0), pool, metrics=metrics)
    await server.start()
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/asr"
        results = await asyncio.gather(
            *(transcribe(ClientOptions(url=url), clip, 16000) for clip in clips)
        )
        per_worker = [  # a final may come from its pause's speculative decode (a partial)
            sum(
                metrics.registry.get_sample_value(
                    "streamer_worker_decodes_total",
                    {"worker": s.label, "device": "cpu", "kind": kind},
                )
                or 0.0
                for kind in ("final", "partial")
            )
            for s in slots
        ]
    finally:
        await server.shutdown()
        await asyncio.to_thread(pool.stop)
    finals = [[(f.start_ms, f.end_ms, f.text) for f in r.finals] for r in results]
    return finals, per_worker


async def test_two_workers_give_the_finals_of_one(tiny_model_dir: Path, speech_cache: Path) -> None:
    spoken = [
        (
            lang,
            synth.SENTENCES[lang][0],
            synth.speak(synth.SENTENCES[lang][0], lang, cache_dir=speech_cache),
        )
        for lang in ("en", "zh", "ja", "ko")
    ]
    clips = [synth.join_with_silence([item, item], 1000)[0] for item in spoken]
    one, _ = await _finals_of(1, tiny_model_dir, clips)
    two, per_worker = await _finals_of(2, tiny_model_dir, clips)
    assert two == one
    assert all(finals for finals in one)
    assert all(count and count > 0 for count in per_worker), per_worker  # both decoded


def test_auto_is_shown_as_the_device_the_worker_loaded_on() -> None:
    """--device auto: /readyz and the per-worker metrics name the device the model went
    to once loaded, and the "auto" series of the loading time goes."""

    class CpuGate(Gate):
        device = "cpu"  # where the model went (the recognizer says so once loaded)

    gate = CpuGate()
    loaded = threading.Event()

    def load() -> Gate:
        assert loaded.wait(timeout_s(GUARD_S))
        return gate

    metrics = Metrics()

    def factory(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        return ModelWorker(load, on_decoded=hooks.on_decoded, on_failure=hooks.on_failure)

    pool = WorkerPool(factory, [WorkerSlot(0, "auto", 1)], on_decoded=metrics.observe_worker_decode)
    pool.start()
    try:
        metrics.observe_workers(pool.loads())
        assert pool.loads()[0].slot.device == "auto"  # not loaded yet
        ready = {"worker": "0", "device": "auto"}
        assert metrics.registry.get_sample_value("streamer_worker_ready", ready) == 0
        loaded.set()
        assert pool.ready.wait(timeout_s(GUARD_S))
        assert pool.loads()[0].slot.device == "cpu"
        metrics.observe_workers(pool.loads())
        assert metrics.registry.get_sample_value("streamer_worker_ready", ready) is None
        ready["device"] = "cpu"
        assert metrics.registry.get_sample_value("streamer_worker_ready", ready) == 1
        gate.opened.set()
        answers = Answers()
        pool.submit(job("a"), answers)
        answers.wait(1)
        decodes = {"worker": "0", "device": "cpu", "kind": "final"}
        assert metrics.registry.get_sample_value("streamer_worker_decodes_total", decodes) == 1
    finally:
        gate.opened.set()
        pool.stop()


def test_the_file_worker_takes_background_jobs_only_at_its_niceness() -> None:
    assert [
        s.background
        for s in plan_slots(
            ("cpu",), workers_per_device=1, threads=0, usable_cores=2, file_worker=True
        )
    ] == [False, True]
    niceness: dict[int, int] = {}
    gates = [Gate(), Gate()]

    def factory(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        def load() -> Gate:  # in the worker's thread, after it set its priority
            niceness[slot.index] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return gates[slot.index]

        nice = FILE_WORKER_NICE if slot.background else 0
        return ModelWorker(load, options=WorkerOptions(nice=nice), on_failure=hooks.on_failure)

    slots = [WorkerSlot(0, "cpu", 1), WorkerSlot(1, "cpu", 1, background=True)]
    pool = WorkerPool(factory, slots)
    pool.start()
    try:
        assert pool.ready.wait(timeout_s(GUARD_S))
        assert niceness[1] == FILE_WORKER_NICE and niceness[0] < FILE_WORKER_NICE
        answers = Answers()
        pool.submit(replace(job("file"), background=True), answers)
        assert gates[1].entered.acquire(timeout=timeout_s(GUARD_S))  # on the file worker
        # live sessions never go to it, however busy the live worker is
        for session in ("a", "b", "c"):
            pool.submit(job(session), answers)
        assert {pool.worker_of(s).index for s in "abc"} == {0}
        assert pool.worker_of("file").index == 1
        for gate in gates:
            gate.opened.set()
        assert len(answers.wait(4)) == 4
    finally:
        for gate in gates:
            gate.opened.set()
        pool.stop()
