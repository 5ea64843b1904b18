"""The model worker's supervision: its watchdog, restarts and failure for good.

Watchdog: a decode (one batch) that runs longer than ``decode_timeout_s``, a worker thread
that dies for any reason, or a model process (:mod:`streamer.model.serving.process`) that dies,
makes the worker *failed* for good (:attr:`ModelWorker.failure`
says why): every job waiting or running is answered with ``DecodeFailure.MODEL_STALLED``,
later jobs are answered so at once, and :attr:`ModelWorker.on_failure` is called (the
server then turns unready and the process exits non-zero for its supervisor to restart
it; a stuck native call cannot be interrupted from Python).

Restarts: a recognizer in a process of its own (``restartable``: killing it ends a stuck
call and frees its device) is instead killed and loaded again, in the worker's thread, at
most ``max_restarts`` times in ``RESTART_WINDOW_S``. Meanwhile :attr:`ModelWorker.restarting`
says why, jobs wait in the queue (the queue discipline still applies), and the finals the
model was decoding are decoded again, alone, once the new model is up; a final that was
being decoded at a second failure gets ``DecodeFailure.DECODE_FAILED`` (it may be the cause),
the partials are answered ``dropped`` (the next one replaces them). Past the budget, or if
loading again fails, the worker fails for good as above.

:class:`Supervised` holds this state and these steps;
:class:`~streamer.model.serving.worker.ModelWorker` inherits them, and its thread and the
watchdog share them under the worker's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from streamer.core.jobs import DecodeFailure, DecodeJob, DecodeResult
from streamer.model.interface import SpeechRecognizer
from streamer.model.serving.job_queue import JobQueue, Queued

logger = logging.getLogger(__name__)

# a model process that dies or stalls is started again at most this often in
# RESTART_WINDOW_S before the worker fails for good (a crash loop is not served on)
DEFAULT_MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
# a restart that has not loaded the model after this long fails the worker (the watchdog's,
# so only with decode_timeout_s); the model is cached by then, so this is a hang
RESTART_TIMEOUT_S = 300.0


class Supervised:
    """The watchdog and restarts of a model worker (the base of
    :class:`~streamer.model.serving.worker.ModelWorker`, which owns the state declared
    first and answers jobs with :meth:`_answer`)."""

    # the worker's: its lock, queue, the batch being decoded (and since when), its model
    _lock: threading.Condition
    _queue: JobQueue
    _stopping: bool
    _running: list[Queued] | None
    _running_since: float
    _load: Callable[[], SpeechRecognizer]
    recognizer: SpeechRecognizer | None
    decode_timeout_s: float | None

    def _init_supervision(
        self, max_restarts: int, on_failure: Callable[[str], None] | None
    ) -> None:
        self._max_restarts = max_restarts  # per RESTART_WINDOW_S; 0: a failure is for good
        self.failure: str | None = None  # why the worker failed for good (None: healthy)
        # why its model process is being started again (None: it is not); guarded by _lock
        self._restarting: str | None = None
        self.restarts = 0  # model processes started again so far
        self._restart_times: deque[float] = deque()  # time.monotonic() of each restart
        self._restart_started: float | None = None  # time.monotonic() of the one loading
        self.on_failure = on_failure  # called once, from a thread, when the worker fails
        self._watchdog = threading.Thread(target=self._watch, name="model-watchdog", daemon=True)

    def _answer(self, item: Queued, result: DecodeResult) -> None:
        raise NotImplementedError  # the worker's

    @property
    def restarting(self) -> str | None:
        """Why the model is being started again (its process died or stalled), from the
        moment the process is gone until the new one is up; None otherwise (and once
        the worker has failed for good)."""
        if self.failure is not None or self._stopping:
            return None
        if self._restarting is not None:
            return self._restarting
        gone = process_gone(self.recognizer)  # died; the worker thread is about to see it
        return gone if gone is not None and self._may_restart() else None

    def _settle(
        self, batch: list[Queued], results: list[DecodeResult]
    ) -> list[tuple[Queued, DecodeResult]]:
        """The answers to give for a batch the worker thread decoded: none when the
        watchdog answered it already; when the model process died meanwhile and may be
        started again, what it did not decode waits for the next one (:meth:`_requeue`)."""
        with self._lock:
            late = self._running is not batch  # the watchdog answered it already
            self._running = None
            answers = list(zip(batch, results, strict=True))
            gone = process_gone(self.recognizer)
            if not late and gone is not None and self._may_restart():
                # died while decoding: what it did not decode waits for the next
                self._restarting = gone
                done = [(q, r) for q, r in answers if r.failure is None]
                failed = [q for q, r in answers if r.failure is not None]
                answers = done + self._requeue(failed, gone)
        return [] if late else answers

    def _watch(self) -> None:
        """The watchdog thread: when one decode runs too long, restarts the model process
        (:meth:`_recover`) or fails the worker; fails it when a restart takes too long."""
        while (running := self._stalled_batch()) is not None:
            if not running:  # the restart itself hangs
                logger.error(
                    "starting the model again has taken over %g s: giving up", RESTART_TIMEOUT_S
                )
                self._fail(f"starting the model again took over {RESTART_TIMEOUT_S:g} s")
                return
            logger.error(
                "a decode has run for over %g s (sessions %s): the model is stalled",
                self.decode_timeout_s,
                ", ".join(sorted({q.job.session_id for q in running})),
            )
            reason = f"a decode ran longer than {self.decode_timeout_s:g} s"
            if not self._may_restart():
                self._fail(reason)
                return
            self._recover(running, reason)

    def _stalled_batch(self) -> list[Queued] | None:
        """Wait until the running batch is overdue and return it, or ``[]`` once a restart
        has taken longer than RESTART_TIMEOUT_S; None once the worker stops or has failed."""
        assert self.decode_timeout_s is not None
        with self._lock:
            while not self._stopping and self.failure is None:
                if self._restart_started is not None:
                    left_s = self._restart_started + RESTART_TIMEOUT_S - time.monotonic()
                    if left_s <= 0:
                        return []
                    self._lock.wait(left_s)
                    continue
                if self._running is None:
                    self._lock.wait()
                    continue
                running = self._running
                overdue_s = self._running_since + self.decode_timeout_s - time.perf_counter()
                if overdue_s > 0:
                    self._lock.wait(overdue_s)
                    continue
                if self._running is running:
                    return running
        return None

    # -- restarts --------------------------------------------------------------

    def _may_restart(self) -> bool:
        """Whether a failed model may be started again: it runs in a process of its own
        (``restartable``) and the restart budget is not spent."""
        recognizer = self.recognizer
        if self._max_restarts == 0 or recognizer is None or not recognizer.restartable:
            return False
        horizon = time.monotonic() - RESTART_WINDOW_S
        return sum(1 for t in self._restart_times if t > horizon) < self._max_restarts

    def _recover(self, running: list[Queued], reason: str) -> None:
        """The watchdog's restart: answer or requeue the stalled batch, then kill the model
        process (which ends the stuck call; the worker thread then loads it again)."""
        with self._lock:
            if self._running is not running:  # it finished after all
                return
            self._running = None  # the worker thread's late results are not answered
            self._restarting = reason
            answers = self._requeue(running, reason)
            self._lock.notify_all()
        self._kill_model()
        for item, result in answers:
            self._answer(item, result)

    def _requeue(self, items: list[Queued], reason: str) -> list[tuple[Queued, DecodeResult]]:
        """Call with the lock held, for jobs the failed model did not decode: finals go back
        to the front of the queue, to be decoded alone by the next model, unless they were
        already retried once (then they fail: they may be the cause); partials are dropped
        (the session asks again). Returns the answers to give, outside the lock."""
        answers = []
        for item in reversed(items):
            job = item.job
            if job.kind != "final":
                answers.append((item, DecodeResult(job=job, dropped=True)))
            elif item.retried:
                logger.error(
                    "the model failed again while decoding segment %d of session %s: "
                    "it is answered with an error",
                    job.segment_id,
                    job.session_id,
                )
                detail = f"the model failed twice while decoding it ({reason})"
                failure = DecodeResult(job=job, failure=DecodeFailure.DECODE_FAILED, detail=detail)
                answers.append((item, failure))
            else:
                self._queue.retry_first(item)
        return answers[::-1]

    def _restart(self, reason: str) -> bool:
        """In the worker thread, after its model process failed (``reason``): load the
        model again. False when the worker failed for good instead (no budget left, or
        the load failed)."""
        if not self._may_restart():
            self._fail(reason)
            return False
        now = time.monotonic()
        with self._lock:
            self._restarting = reason
            while self._restart_times and self._restart_times[0] <= now - RESTART_WINDOW_S:
                self._restart_times.popleft()
            self._restart_times.append(now)
            self._restart_started = now
            self._lock.notify_all()  # the watchdog times the restart
            waiting = len(self._queue)
        logger.warning(
            "the model failed (%s): starting it again (%d of at most %d restarts in %g s; "
            "%d jobs wait)",
            reason,
            len(self._restart_times),
            self._max_restarts,
            RESTART_WINDOW_S,
            waiting,
        )
        self._kill_model()  # dead already, or stuck
        started = time.perf_counter()
        try:
            recognizer = self._load()
        except BaseException as exc:
            logger.exception("loading the model again failed")
            self._fail(f"{reason}; loading the model again failed: {exc}")
            return False
        with self._lock:
            late = self.failure is not None  # the watchdog gave up on this restart
            if not late:
                self.recognizer = recognizer
                self._restarting = self._restart_started = None
                self.restarts += 1
            self._lock.notify_all()
        if late:
            recognizer.close()
            return False
        logger.warning(
            "the model is running again after %.1f s (%s)",
            time.perf_counter() - started,
            recognizer.name,
        )
        return True

    def _fail(self, reason: str) -> None:
        """Fail for good: tell the server, then answer every job waiting or running (so
        that a session hears the fatal error before the finals that failed with it)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            self._restarting = self._restart_started = None
            waiting = self._queue.clear()
            if self._running is not None:
                waiting[:0] = self._running
            self._running = None
            self._lock.notify_all()
        self._kill_model()  # a model process: end a stuck call
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:
                logger.exception("failure hook failed")
        for item in waiting:
            self._answer(item, stalled_answer(item.job, reason))

    def _kill_model(self) -> None:
        """End a model process at once (a stuck call cannot be interrupted otherwise)."""
        if self.recognizer is not None:
            try:
                self.recognizer.kill()
            except Exception:
                logger.exception("ending the model process failed")


def process_gone(recognizer: SpeechRecognizer | None) -> str | None:
    """Why a model process (:class:`~streamer.model.serving.process.ProcessRecognizer`) is gone;
    None while it runs, and for a recognizer in this process."""
    failure = recognizer.failure if recognizer is not None else None
    return None if failure is None else str(failure)


def stalled_answer(job: DecodeJob, reason: str) -> DecodeResult:
    if job.kind == "partial":
        return DecodeResult(job=job, dropped=True)
    return DecodeResult(job=job, failure=DecodeFailure.MODEL_STALLED, detail=reason)
