"""The model worker's queue discipline, with a recognizer that can be held busy."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from streamer.core.capacity import WAIT_BINS_MS
from streamer.core.jobs import DecodeFailure, DecodeJob, DecodeResult
from streamer.errors import DecodeInterrupted
from streamer.model.serving.worker import ModelWorker
from tests.fakes import Answers, DyingRecognizer, FakeRecognizer, HangingRecognizer
from tests.timing import timeout_s


class GatedRecognizer(FakeRecognizer):
    """Blocks every decode until released; records the order of decodes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)
        self.order: list[tuple[str, int, str]] = []
        self.started = threading.Event()

    def decode(self, pcm, *, language="auto", use_itn=True):
        self.started.set()
        self.gate.acquire(timeout=timeout_s(10))
        self.order.append((language, int(pcm[0]), "decoded"))
        return super().decode(pcm, language=language, use_itn=use_itn)


def job(
    session: str,
    kind: str,
    tag: int,
    segment: int = 0,
    first: bool = False,
    background: bool = False,
    samples: int = 1600,
) -> DecodeJob:
    # the tag rides in the first sample so the recognizer can report what it decoded
    pcm = np.full(samples, tag, dtype=np.int16)
    return DecodeJob(
        session_id=session,
        segment_id=segment,
        kind=kind,
        pcm=pcm,
        start_sample=0,
        end_sample=samples,
        language=session,
        itn=True,
        reason="silence" if kind == "final" else None,
        first=first,
        background=background,
    )


def serving(recognizer: GatedRecognizer):
    """A started worker on ``recognizer``: (worker, recognizer, results, collect);
    stopped after the gate is opened wide."""
    worker = ModelWorker(lambda: recognizer)
    worker.start()
    assert worker.ready.wait(timeout_s(10))
    results: list[DecodeResult] = []
    yield worker, recognizer, results, results.append
    for _ in range(20):
        recognizer.gate.release()
    worker.stop()


@pytest.fixture
def gated():
    yield from serving(GatedRecognizer())


def release_all(recognizer: GatedRecognizer, worker: ModelWorker, n: int) -> None:
    for _ in range(n):
        recognizer.gate.release()
    for _ in range(200):
        stats = worker.stats()
        queued = stats.queued_finals + stats.queued_partials + stats.queued_background
        if not (stats.busy or queued):
            return
        threading.Event().wait(0.01)


def test_short_first_partials_first_then_finals_then_long_first_partials_then_refreshes(
    gated, monkeypatch
):
    """A short first partial goes even before finals queued before it (issue 31); one of
    more than FIRST_AHEAD_MAX_SAMPLES waits behind the finals, a refresh behind all."""
    from streamer.model.serving import job_queue
    from streamer.model.serving.job_queue import FIRST_AHEAD_MAX_SAMPLES

    monkeypatch.setattr(job_queue, "FINAL_PATIENCE_MS", 60_000.0)  # none has waited it

    worker, recognizer, results, collect = gated
    worker.submit(job("busy", "partial", 1), collect)  # occupies the worker
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("a", "partial", 2), collect)  # a refresh
    worker.submit(job("c", "final", 4), collect)
    long_first = job("e", "partial", 6, first=True, samples=FIRST_AHEAD_MAX_SAMPLES + 1)
    worker.submit(long_first, collect)
    worker.submit(job("b", "partial", 3, first=True), collect)  # a short first partial
    worker.submit(job("d", "final", 5), collect)
    worker.submit(job("f", "partial", 7, first=True), collect)  # another, newer
    release_all(recognizer, worker, 7)
    assert [tag for _, tag, _ in recognizer.order] == [1, 3, 7, 4, 5, 6, 2]
    assert all(r.transcript is not None for r in results)
    assert all(r.queue_ms >= 0 and r.decode_ms >= 0 for r in results)


def test_a_speculative_decode_goes_after_first_partials_until_it_is_late(gated, monkeypatch):
    """A speculative decode is the final of a segment whose pause may be its end: it
    goes ahead of every refresh, behind first partials and the finals queued before it
    until it has waited SPECULATIVE_SLACK_MS (issue 31: TTFT p95 3.4 s at sixteen
    clients behind finals and speculative decodes)."""
    import dataclasses

    from streamer.model.serving import job_queue

    monkeypatch.setattr(job_queue, "SPECULATIVE_SLACK_MS", 60_000.0)  # none is late
    monkeypatch.setattr(job_queue, "FINAL_PATIENCE_MS", 60_000.0)
    worker, recognizer, results, collect = gated
    worker.submit(job("busy", "partial", 1), collect)  # occupies the worker
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("a", "partial", 2), collect)  # a refresh
    worker.submit(job("b", "partial", 3, first=True), collect)  # a first partial
    worker.submit(dataclasses.replace(job("e", "partial", 4), speculative=True), collect)
    worker.submit(job("c", "final", 5), collect)
    worker.submit(dataclasses.replace(job("f", "partial", 6), speculative=True), collect)
    release_all(recognizer, worker, 6)
    assert [tag for _, tag, _ in recognizer.order] == [1, 3, 5, 4, 6, 2]


def test_late_speculative_decodes_go_with_the_finals_behind_short_first_partials(monkeypatch):
    """Late: with the finals, ahead of a long first partial; not late: behind it."""
    import dataclasses

    from streamer.model.serving import job_queue
    from streamer.model.serving.job_queue import (
        FIRST_AHEAD_MAX_SAMPLES,
        SPECULATIVE_SLACK_MS,
        JobQueue,
        Queued,
    )

    monkeypatch.setattr(job_queue, "FINAL_PATIENCE_MS", 300.0)  # none has waited it

    queue = JobQueue()
    slack_s = SPECULATIVE_SLACK_MS / 1000

    def push(j: DecodeJob, submitted: float) -> None:
        queue.push(Queued(j, lambda result: None, submitted))

    def spec(session: str, tag: int) -> DecodeJob:
        return dataclasses.replace(job(session, "partial", tag), speculative=True)

    push(spec("old", 1), 10.0)  # late at 10 + slack
    push(job("f", "final", 2), 10.0 + slack_s / 2)
    push(job("b", "partial", 3, first=True), 10.0 + slack_s / 2)
    push(spec("new", 4), 10.0 + slack_s / 2)  # not late yet
    push(job("r", "partial", 5), 10.0)  # a refresh, oldest of all

    def take(now: float | None) -> list[int]:
        batch = queue.take(max_batch=1, max_padding_ratio=1.25, max_batch_samples=None, now=now)
        return [int(q.job.pcm[0]) for q in batch]

    long_first = job("l", "partial", 6, first=True, samples=FIRST_AHEAD_MAX_SAMPLES + 1)
    push(long_first, 10.0)
    now = 10.0 + slack_s * 1.1
    assert [take(now) for _ in range(6)] == [[3], [1], [2], [6], [4], [5]]
    push(spec("new", 4), 20.0)
    push(long_first, 20.0)
    assert take(None) == [4]  # no clock: every speculative decode is late


def test_a_pause_decode_that_replaced_a_first_partial_goes_ahead_as_it_would(monkeypatch):
    """A segment's pause before any text was shown: its speculative decode (first) is
    the segment's first text, and short, it goes ahead of finals as a first partial."""
    import dataclasses

    from streamer.model.serving import job_queue
    from streamer.model.serving.job_queue import FIRST_AHEAD_MAX_SAMPLES

    monkeypatch.setattr(job_queue, "FINAL_PATIENCE_MS", 300.0)

    queue, push, take, _ = _queue_and_take()

    def spec(session: str, tag: int, **fields: object) -> DecodeJob:
        return dataclasses.replace(job(session, "partial", tag, **fields), speculative=True)

    push(job("a", "final", 1), 1.9)  # has not waited FINAL_PATIENCE_MS at 2.0
    push(spec("b", 2, first=True), 2.0)
    push(spec("c", 3, first=True, samples=FIRST_AHEAD_MAX_SAMPLES + 1), 2.0)
    push(spec("d", 4), 2.0)  # text already shown: a final in waiting
    queue_take = queue.take(max_batch=1, max_padding_ratio=1.25, max_batch_samples=None, now=2.0)
    assert [int(q.job.pcm[0]) for q in queue_take] == [2]
    assert [take(), take(), take()] == [[1], [3], [4]]  # no clock: late, oldest first


def test_a_final_kept_waiting_its_patience_goes_before_first_partials(monkeypatch):
    """Under overload finals are not starved by every new utterance's first partial."""
    from streamer.model.serving import job_queue
    from streamer.model.serving.job_queue import JobQueue, Queued

    monkeypatch.setattr(job_queue, "FINAL_PATIENCE_MS", 300.0)
    queue = JobQueue()
    patience_s = 0.3
    for j, submitted in [
        (job("young", "final", 1), 10.0 + patience_s / 2),
        (job("b", "partial", 2, first=True), 10.0 + patience_s / 2),
        (job("old", "final", 3), 10.0),
        (job("c", "partial", 4, first=True), 10.0),
    ]:
        queue.push(Queued(j, lambda result: None, submitted))
    now = 10.0 + patience_s * 1.01
    batches = [queue.take(max_batch=1, max_padding_ratio=1.25, max_batch_samples=None, now=now)]
    while batches[-1]:
        batches.append(
            queue.take(max_batch=1, max_padding_ratio=1.25, max_batch_samples=None, now=now)
        )
    assert [int(b[0].job.pcm[0]) for b in batches if b] == [3, 4, 2, 1]


def test_newer_partial_replaces_pending_one_and_final_drops_it(gated):
    worker, recognizer, results, collect = gated
    worker.submit(job("busy", "partial", 1), collect)
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("a", "partial", 2), collect)
    worker.submit(job("a", "partial", 3), collect)  # replaces 2
    worker.submit(job("b", "partial", 4), collect)
    worker.submit(job("b", "final", 5), collect)  # drops 4
    dropped = sorted(int(r.job.pcm[0]) for r in results if r.dropped)
    assert dropped == [2, 4]
    release_all(recognizer, worker, 5)
    assert [tag for _, tag, _ in recognizer.order] == [1, 5, 3]


def test_drop_session_forgets_its_jobs(gated):
    worker, recognizer, results, collect = gated
    worker.submit(job("busy", "partial", 1), collect)
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("gone", "final", 2), collect)
    worker.submit(job("gone", "partial", 3), collect)
    worker.submit(job("stays", "final", 4), collect)
    assert worker.drop_session("gone") == 2
    release_all(recognizer, worker, 5)
    assert [tag for _, tag, _ in recognizer.order] == [1, 4]


def test_decode_error_is_a_result_and_the_worker_goes_on():
    recognizer = FakeRecognizer(fail_when=lambda pcm: pcm[0] == 7)
    worker = ModelWorker(lambda: recognizer)
    worker.start()
    results: list[DecodeResult] = []
    finished = threading.Event()

    def collect(result):
        results.append(result)
        if len(results) == 2:
            finished.set()

    worker.submit(job("s", "final", 7), collect)
    worker.submit(job("s", "final", 8, segment=1), collect)
    assert finished.wait(timeout_s(10))
    worker.stop()
    assert "injected decode failure" in results[0].detail
    assert results[1].transcript is not None
    assert recognizer.threads == {"model-worker"}  # every decode on the one worker thread


def test_load_error_is_reported():
    def broken():
        raise RuntimeError("no weights")

    worker = ModelWorker(broken)
    worker.start()
    assert worker.ready.wait(timeout_s(10))
    assert isinstance(worker.load_error, RuntimeError)


def test_stop_answers_queued_jobs_dropped(gated):
    worker, recognizer, results, collect = gated
    worker.submit(job("busy", "partial", 1), collect)
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("a", "final", 2), collect)
    threading.Timer(0.2, recognizer.gate.release).start()  # lets the busy decode finish
    worker.stop()  # drops job 2 while the worker is still busy, then joins
    worker.submit(job("a", "final", 3), collect)  # after stop: answered dropped at once
    assert [int(r.job.pcm[0]) for r in results if r.dropped] == [2, 3]


def failing_worker(recognizer, **kwargs):
    worker = ModelWorker(lambda: recognizer, **kwargs)
    failed = threading.Event()
    reasons: list[str] = []
    worker.on_failure = lambda reason: (reasons.append(reason), failed.set())
    worker.start()
    assert worker.ready.wait(timeout_s(10))
    return worker, failed, reasons


def collector():
    results: list[DecodeResult] = []
    cond = threading.Condition()

    def collect(result: DecodeResult) -> None:
        with cond:
            results.append(result)
            cond.notify_all()

    def wait_for(n: int) -> list[DecodeResult]:
        with cond:
            assert cond.wait_for(lambda: len(results) >= n, timeout_s(10))
        return results

    return collect, wait_for


def test_watchdog_answers_every_waiting_final_when_a_decode_hangs():
    recognizer = HangingRecognizer()
    worker, failed, reasons = failing_worker(recognizer, decode_timeout_s=0.2)
    collect, wait_for = collector()
    try:
        worker.submit(job("a", "final", 1), collect)  # hangs
        worker.submit(job("b", "final", 2), collect)  # waits behind it
        worker.submit(job("c", "partial", 3), collect)
        assert failed.wait(timeout_s(10))
        results = wait_for(3)
        finals = [r for r in results if r.job.kind == "final"]
        assert sorted(r.job.session_id for r in finals) == ["a", "b"]
        assert all(
            r.failure is DecodeFailure.MODEL_STALLED and r.transcript is None for r in finals
        )
        assert [r.dropped for r in results if r.job.kind == "partial"] == [True]
        assert worker.failure == reasons[0] and "longer than 0.2 s" in reasons[0]
        # after the failure, new jobs are answered at once, never queued
        worker.submit(job("d", "final", 4), collect)
        assert wait_for(4)[3].failure is DecodeFailure.MODEL_STALLED
    finally:
        recognizer.release.set()
        worker.stop()
    # the hung decode returning late answers nobody twice
    assert len(results) == 4


def test_watchdog_leaves_slow_but_finishing_decodes_alone():
    worker, failed, _ = failing_worker(FakeRecognizer(delay_s=0.05), decode_timeout_s=5)
    collect, wait_for = collector()
    try:
        for i in range(5):
            worker.submit(job("a", "final", i, segment=i), collect)
        assert all(r.transcript is not None for r in wait_for(5))
        assert not failed.is_set() and worker.failure is None
    finally:
        worker.stop()


def test_worker_thread_dying_of_a_base_exception_fails_loudly():
    worker, failed, reasons = failing_worker(DyingRecognizer(), decode_timeout_s=None)
    collect, wait_for = collector()
    try:
        worker.submit(job("a", "final", 1), collect)
        assert failed.wait(timeout_s(10))
        (result,) = wait_for(1)
        assert result.failure is DecodeFailure.MODEL_STALLED
        assert reasons == ["the model worker thread died"]
    finally:
        worker.stop()


def test_the_job_queue_keeps_its_discipline_without_a_thread():
    """The queue alone (no clock: every final has waited its patience): finals, then
    first partials, then refreshes; one partial per session; a final drops its
    session's partial; a retried final goes alone, first."""
    from streamer.model.serving.job_queue import JobQueue, Queued

    queue, answered = JobQueue(), []

    def push(j: DecodeJob) -> Queued | None:
        return queue.push(Queued(j, answered.append, 0.0))

    assert push(job("a", "partial", 1)) is None
    assert push(job("b", "partial", 2, first=True)) is None
    replaced = push(job("a", "partial", 3))  # a's newer partial replaces its first
    assert replaced is not None and replaced.job.pcm[0] == 1
    assert push(job("c", "final", 4)) is None
    assert push(job("c", "partial", 5)) is None
    dropped = push(job("c", "final", 6))  # c's final drops its pending partial
    assert dropped is not None and dropped.job.pcm[0] == 5
    assert len(queue) == 4

    def take() -> list[int]:
        batch = queue.take(max_batch=1, max_padding_ratio=1.25, max_batch_samples=None)
        return [int(q.job.pcm[0]) for q in batch]

    assert [take() for _ in range(4)] == [[4], [6], [2], [3]]
    assert take() == [] and len(queue) == 0
    push(job("d", "final", 7))
    push(job("d", "final", 8))
    retried = Queued(job("e", "final", 9), answered.append, 0.0)
    queue.retry_first(retried)
    # alone even with room for a batch: it may be what broke the model
    assert queue.take(max_batch=8, max_padding_ratio=100.0, max_batch_samples=None) == [retried]
    assert queue.drop_session("d") == 2 and not queue and answered == []


# --- background jobs (file uploads): after live work, round robin among their sessions ---


def _queue_and_take():
    from streamer.model.serving.job_queue import JobQueue, Queued

    queue, answered = JobQueue(), []

    def push(j: DecodeJob, submitted: float = 0.0) -> Queued | None:
        return queue.push(Queued(j, answered.append, submitted))

    def take(max_batch: int = 1, ratio: float = 1.25, samples: int | None = None) -> list[int]:
        batch = queue.take(max_batch=max_batch, max_padding_ratio=ratio, max_batch_samples=samples)
        return [int(q.job.pcm[0]) for q in batch]

    return queue, push, take, answered


def test_an_ended_segments_speculative_decode_waits_with_the_finals(monkeypatch):
    """A session's next segment's first partial does not drop the speculative decode of
    the segment before: that segment has ended, and the decode is its final."""
    import dataclasses

    from streamer.model.serving import job_queue

    monkeypatch.setattr(job_queue, "FINAL_PATIENCE_MS", 300.0)

    queue, push, take, answered = _queue_and_take()
    spec = dataclasses.replace(job("a", "partial", 1, segment=0), speculative=True)
    assert push(spec, 1.0) is None
    push(job("b", "final", 2), 2.0)
    assert push(job("a", "partial", 3, segment=1, first=True), 3.0) is None
    assert len(queue) == 3 and queue.oldest_final_submitted() == 1.0
    assert [take(), take(), take(), take()] == [[1], [2], [3], []]
    # with a clock: the first partial still waits for its session's earlier final (its
    # text is held until that final is sent), not for another session's
    push(spec, 9.99)
    push(job("b", "final", 2), 10.0)
    push(job("a", "partial", 3, segment=1, first=True), 10.0)
    push(job("c", "partial", 5, first=True), 10.0)
    now = 10.0 + 0.001
    order = []
    while batch := queue.take(max_batch=1, max_padding_ratio=1.25, max_batch_samples=None, now=now):
        order.append(int(batch[0].job.pcm[0]))
    assert order == [5, 1, 3, 2]  # a's final decoded, its first partial goes ahead
    # within a segment a newer partial still replaces a pending one, speculative or not
    push(spec, 4.0)
    replaced = push(job("a", "partial", 4, segment=0), 5.0)
    assert replaced is not None and replaced.job is spec and take() == [4]
    assert answered == []


def test_background_jobs_wait_behind_every_class_of_live_job():
    queue, push, take, _ = _queue_and_take()
    for tag in (1, 2, 3):
        push(job("file", "final", tag, segment=tag, background=True))
    push(job("a", "partial", 4))  # a refresh
    push(job("b", "partial", 5, first=True))
    push(job("c", "final", 6))
    assert len(queue) == 6 and queue.background_jobs == 3
    assert [take() for _ in range(6)] == [[6], [5], [4], [1], [2], [3]]
    # a live job that comes while background jobs wait is next, whatever waited longer
    for tag in (7, 8):
        push(job("file", "final", tag, background=True))
    assert take() == [7]
    push(job("d", "final", 9))
    assert [take(), take(), take()] == [[9], [8], []]


def test_background_sessions_share_the_worker_round_robin():
    """Each session's jobs in order; a session served goes to the back: a short upload
    is not stuck behind a long one that came first, and a newcomer joins the rotation."""
    _, push, take, _ = _queue_and_take()
    for tag in (10, 11, 12, 13, 14):
        push(job("long", "final", tag, background=True))
    for tag in (20, 21):
        push(job("short", "final", tag, background=True))
    assert [take(), take(), take()] == [[10], [20], [11]]
    push(job("late", "final", 30, background=True))
    assert [take() for _ in range(6)] == [[21], [12], [30], [13], [14], []]


def test_background_batches_draw_on_every_upload_and_never_hold_live_jobs():
    queue, push, take, _ = _queue_and_take()
    for tag in (10, 11, 12):
        push(job("a", "final", tag, background=True))
    for tag in (20, 21):
        push(job("b", "final", tag, background=True))
    push(job("c", "final", 1))
    push(job("d", "final", 2, samples=1700))
    assert take(max_batch=8) == [1, 2]  # the live finals together, no background with them
    assert take(max_batch=3) == [10, 20, 11]  # interleaved across the uploads
    push(job("e", "partial", 3, first=True))
    assert take(max_batch=8) == [3]
    # select_batch's rules hold among background jobs too: padding, padded samples
    push(job("b", "final", 22, samples=16000, background=True))
    assert take(max_batch=8) == [21, 12]  # b was not served last: it leads; 22 is too long
    assert take(max_batch=8, samples=8000) == [22] and not queue


def test_background_jobs_do_not_count_as_waiting_finals_and_are_dropped_and_cleared():
    queue, push, take, answered = _queue_and_take()
    push(job("file", "final", 1, background=True), submitted=1.0)
    push(job("file", "final", 2, background=True), submitted=2.0)
    assert queue.oldest_final_submitted() is None  # admission looks at live work only
    push(job("live", "final", 3), submitted=5.0)
    assert queue.oldest_final_submitted() == 5.0
    push(job("other", "final", 4, background=True))
    assert queue.drop_session("file") == 2 and queue.background_jobs == 1
    assert [int(q.job.pcm[0]) for q in queue.clear()] == [3, 4]
    assert not queue and queue.background_jobs == 0 and answered == []


def test_a_retried_background_final_goes_alone_first_among_background_after_live_work():
    from streamer.model.serving.job_queue import Queued

    queue, push, take, answered = _queue_and_take()
    push(job("a", "final", 10, background=True))
    push(job("b", "final", 20, background=True))
    push(job("live", "final", 1))
    queue.retry_first(Queued(job("b", "final", 19, background=True), answered.append, 0.0))
    assert take(max_batch=8, ratio=100.0) == [1]  # live work first still
    assert take(max_batch=8, ratio=100.0) == [19]  # alone: it may be what broke the model
    assert take(max_batch=8, ratio=100.0) == [10, 20]


def test_worker_stats_report_background_jobs_apart_from_live_finals(gated):
    """What admission goes by counts live work only: a file waiting, or decoded, makes
    no session look lagging or the model loaded (core/capacity.py)."""
    worker, recognizer, results, collect = gated
    worker.submit(job("busy", "partial", 1), collect)  # occupies the worker
    assert recognizer.started.wait(timeout_s(5))
    for tag in (2, 3):
        worker.submit(job("file", "final", tag, background=True), collect)
    stats = worker.stats()
    assert (stats.queued_background, stats.queued_finals, stats.queued_partials) == (2, 0, 0)
    assert stats.live.oldest_final_age_ms == 0.0
    release_all(recognizer, worker, 3)
    stats = worker.stats()
    assert stats.queued_background == 0 and len(results) == 3
    assert all(r.transcript is not None for r in results)
    assert stats.live.final_decode_ms_total == 0.0  # background decodes are not live load


def test_stats_measure_the_finals_work_and_wait_for_capacity(gated):
    """What admission goes by (core/capacity.py): time spent on finals (a speculative
    decode is a final), and how long the oldest waiting one has waited."""
    import dataclasses
    import time

    worker, recognizer, results, collect = gated
    worker.submit(job("busy", "partial", 1), collect)  # occupies the worker
    assert recognizer.started.wait(timeout_s(5))
    assert worker.stats().live.oldest_final_age_ms == 0.0  # a partial waits for nobody
    speculative = dataclasses.replace(job("a", "partial", 2), speculative=True)
    worker.submit(speculative, collect)
    time.sleep(0.2)  # the age under test: the speculative job waits this long
    worker.submit(job("b", "final", 3), collect)
    stats = worker.stats()
    assert stats.live.oldest_final_age_ms >= 200  # the speculative one, which came first
    assert stats.live.final_decode_ms_total == 0.0
    release_all(recognizer, worker, 3)
    stats = worker.stats()
    assert stats.live.oldest_final_age_ms == 0.0
    decoded = [r for r in results if r.job.kind == "final" or r.job.speculative]
    assert len(decoded) == 2
    assert stats.live.final_decode_ms_total == pytest.approx(sum(r.decode_ms for r in decoded))
    # and what the wait projection needs: how many, their audio, their times squared
    assert stats.live.finals_total == 2 and stats.live.final_audio_ms_total == pytest.approx(200)
    squares = sum(r.decode_ms**2 for r in decoded)
    assert stats.live.final_decode_sq_ms_total == pytest.approx(squares)
    assert stats.live.partial_decode_ms_total == pytest.approx(results[0].decode_ms)  # "busy"
    # and what they waited, per bin: the speculative one over 200 ms
    assert (
        sum(stats.live.final_waits) == 2
        and sum(stats.live.final_waits[WAIT_BINS_MS.index(200) :]) >= 1
    )


def test_a_burst_of_failing_partials_is_logged_once_without_a_traceback(caplog):
    """Each growing partial of a bad segment fails the same way: one line for the burst,
    one count when it ends, no traceback; a final that fails keeps its traceback."""
    recognizer = FakeRecognizer(fail_when=lambda pcm: int(pcm[0]) < 100)
    worker = ModelWorker(lambda: recognizer)
    worker.start()
    assert worker.ready.wait(timeout_s(10))
    answers = Answers()
    with caplog.at_level(logging.INFO, logger="streamer.model"):
        for tag in range(1, 11):  # ten failing partials of one segment, one after another
            worker.submit(job("s", "partial", tag), answers)
            answers.wait(tag)
        worker.submit(job("s", "partial", 200), answers)  # one that works ends the burst
        answers.wait(11)
        worker.submit(job("s", "final", 7), answers)  # a final that fails
        answers.wait(12)
    worker.stop()
    failed = [r for r in caplog.records if "decode failed" in r.getMessage()]
    assert len(failed) == 2  # the burst's first partial, and the final
    assert not failed[0].exc_info and failed[1].exc_info
    (counted,) = [r for r in caplog.records if "10 partial decodes failed" in r.getMessage()]
    assert counted.levelname == "WARNING"


class InterruptibleRecognizer(GatedRecognizer):
    """A gated decode that :meth:`interrupt` ends at once with DecodeInterrupted (as
    ONNX Runtime's terminate flag ends a run)."""

    interruptible = True

    def __init__(self) -> None:
        super().__init__()
        self.decoding = threading.Event()
        self.stop = threading.Event()
        self.asked = 0

    def decode(self, pcm, *, language="auto", use_itn=True):
        self.decoding.set()
        self.started.set()
        try:
            while not self.gate.acquire(timeout=0.005):
                if self.stop.is_set():
                    self.stop.clear()
                    raise DecodeInterrupted("stopped")
            self.order.append((language, int(pcm[0]), "decoded"))
            return FakeRecognizer.decode(self, pcm, language=language, use_itn=use_itn)
        finally:
            self.decoding.clear()

    def interrupt(self) -> bool:
        if not self.decoding.is_set():
            return False
        self.asked += 1
        self.stop.set()
        return True


@pytest.fixture
def interruptible():
    yield from serving(InterruptibleRecognizer())


def test_a_final_stops_a_partial_being_decoded_where_the_model_can(interruptible):
    """A final queued behind a refresh does not wait for it: the refresh is answered
    dropped (interrupted), the final decoded next, and the stats count it."""
    worker, recognizer, results, collect = interruptible
    worker.submit(job("a", "partial", 1), collect)
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("b", "final", 2), collect)
    for _ in range(500):  # the stopped partial is answered before anything is released
        if results:
            break
        threading.Event().wait(0.01)
    release_all(recognizer, worker, 1)
    assert [tag for _, tag, _ in recognizer.order] == [2]
    partial = next(r for r in results if r.job.kind == "partial")
    assert partial.dropped and partial.interrupted and partial.transcript is None
    final = next(r for r in results if r.job.kind == "final")
    assert final.transcript is not None
    stats = worker.stats()
    assert stats.live.interruptible and stats.live.partials_interrupted == 1
    assert stats.live.partial_decode_ms_total > 0  # the time the stopped partial took


def test_a_first_partial_stops_a_refresh_but_never_another_first_partial(interruptible):
    """A new utterance's first words do not wait for another segment's refresh."""
    worker, recognizer, results, collect = interruptible
    worker.submit(job("a", "partial", 1), collect)  # a refresh
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("b", "partial", 2, first=True), collect)
    for _ in range(500):
        if results:
            break
        threading.Event().wait(0.01)
    assert results and results[0].interrupted and results[0].job.session_id == "a"
    recognizer.started.clear()
    release_all(recognizer, worker, 1)  # b's first partial is decoded
    worker.submit(job("c", "partial", 3, first=True), collect)
    worker.submit(job("d", "partial", 4, first=True), collect)
    release_all(recognizer, worker, 2)
    assert [tag for _, tag, _ in recognizer.order] == [2, 3, 4]
    assert recognizer.asked == 1 and worker.stats().live.partials_interrupted == 1


@pytest.mark.parametrize("running", ["final", "speculative", "background", "first partial"])
def test_a_final_never_stops_a_final_a_speculative_decode_a_files_job_or_a_first_partial(
    interruptible, running: str
) -> None:
    """A first partial is short: stopped, it would be decoded again from the start."""
    import dataclasses

    worker, recognizer, results, collect = interruptible
    first = {
        "final": job("a", "final", 1),
        "speculative": dataclasses.replace(job("a", "partial", 1), speculative=True),
        "background": job("file", "final", 1, background=True),
        "first partial": job("a", "partial", 1, first=True),
    }[running]
    worker.submit(first, collect)
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("b", "final", 2), collect)
    release_all(recognizer, worker, 2)
    assert [tag for _, tag, _ in recognizer.order] == [1, 2]
    assert recognizer.asked == 0 and worker.stats().live.partials_interrupted == 0
    assert all(r.transcript is not None for r in results)


def test_a_partial_queued_stops_nothing_and_a_model_that_cannot_stop_is_not_asked(gated):
    worker, recognizer, results, collect = gated
    worker.submit(job("a", "partial", 1), collect)
    assert recognizer.started.wait(timeout_s(5))
    worker.submit(job("b", "partial", 2), collect)
    worker.submit(job("c", "final", 3), collect)  # GatedRecognizer cannot stop a decode
    release_all(recognizer, worker, 3)
    assert [tag for _, tag, _ in recognizer.order] == [1, 3, 2]
    assert not worker.stats().live.interruptible and worker.stats().live.partials_interrupted == 0


def test_a_session_faster_than_real_time_goes_after_every_real_time_sessions_work():
    """An unpaced client (its jobs marked not realtime by its pump) takes the model at
    the rate it sends, after the real-time sessions admitted before it; its waiting
    finals do not make the server lag (issue 31)."""
    import dataclasses

    queue, push, take, _ = _queue_and_take()

    def fast(j: DecodeJob) -> DecodeJob:
        return dataclasses.replace(j, realtime=False)

    push(fast(job("file", "final", 1)), 1.0)
    push(fast(job("file2", "partial", 2, first=True)), 1.0)
    push(job("a", "partial", 3), 2.0)  # a real-time session's refresh
    push(job("b", "final", 4), 3.0)
    push(job("c", "partial", 5, first=True), 3.0)
    assert queue.oldest_final_submitted() == 3.0  # b's, not the unpaced one's
    assert [take() for _ in range(5)] == [[4], [5], [3], [1], [2]]
