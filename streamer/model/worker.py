"""The one model worker: a thread that owns the recognizer and decodes jobs one by one.

The event loop never waits on the model. It submits :class:`~streamer.core.jobs.DecodeJob`
objects with a callback; the worker thread decodes them at batch size 1 and calls the
callback from its own thread (the server hops back to the loop with
``call_soon_threadsafe``).

Queue discipline:

* finals before partials; among partials, a segment's first partial (which decides
  when its speaker sees the first words) before refreshes of segments already shown;
  oldest first within each class;
* at most one pending partial per session: a newer one replaces it (the old one is
  answered ``dropped``);
* a session's pending partial is dropped as soon as one of its finals is queued;
* :meth:`ModelWorker.drop_session` forgets every queued job of a departed client.

Watchdog: a decode that runs longer than ``decode_timeout_s``, or a worker thread that
dies for any reason, makes the worker *failed* for good (:attr:`ModelWorker.failure`
says why): every job waiting or running is answered with ``DecodeFailure.MODEL_STALLED``,
later jobs are answered so at once, and :attr:`ModelWorker.on_failure` is called (the
server then turns unready and the process exits non-zero for its supervisor to restart
it; a stuck native call cannot be interrupted from Python).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from streamer.core.jobs import DecodeFailure, DecodeJob, DecodeResult
from streamer.core.transcript import Transcript
from streamer.errors import ConfigError, ModelError
from streamer.model.decoding import decode_job

logger = logging.getLogger(__name__)

DEFAULT_DECODE_TIMEOUT_S = 30.0  # a 7 s segment decodes in about 1 s on a slow CPU core

ResultCallback = Callable[[DecodeResult], None]


class SpeechRecognizer(Protocol):
    """What the worker needs of a recognizer (:class:`streamer.model.recognizer.Recognizer`)."""

    @property
    def name(self) -> str: ...

    def decode(
        self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True
    ) -> Transcript: ...


@dataclass
class _Queued:
    job: DecodeJob
    callback: ResultCallback
    submitted: float  # time.perf_counter() at submission


@dataclass
class WorkerStats:
    queued_finals: int
    queued_partials: int
    busy: bool


class ModelWorker:
    """Owns the recognizer in a dedicated thread. Start it once; stop it at shutdown.

    ``load`` builds the recognizer inside the worker thread (model loading is slow and
    must not block the loop); :attr:`ready` is set once it returns, and :attr:`load_error`
    holds the exception if it raised. ``on_decoded`` (metrics) is called for every decode
    and ``on_failure`` once when the watchdog fails the worker, both from its threads.
    """

    def __init__(
        self,
        load: Callable[[], SpeechRecognizer],
        *,
        decode_timeout_s: float | None = DEFAULT_DECODE_TIMEOUT_S,
        on_decoded: Callable[[DecodeResult], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        if decode_timeout_s is not None and decode_timeout_s <= 0:
            raise ConfigError("decode_timeout_s must be positive")
        self._load = load
        self.decode_timeout_s = decode_timeout_s  # None: no watchdog
        self._lock = threading.Condition()
        self._finals: deque[_Queued] = deque()
        self._partials: OrderedDict[str, _Queued] = OrderedDict()  # session_id -> job
        self._running_session: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="model-worker", daemon=True)
        self.ready = threading.Event()  # set when the model is loaded (or failed to load)
        self.load_error: BaseException | None = None
        self.recognizer: SpeechRecognizer | None = None
        self.on_decoded = on_decoded  # metrics hook, called for every decode
        # watchdog: the job being decoded and since when (perf_counter), guarded by _lock
        self._running: _Queued | None = None
        self._running_since = 0.0
        self.failure: str | None = None  # why the worker failed for good (None: healthy)
        self.on_failure = on_failure  # called once, from a thread, when the worker fails
        self._watchdog = threading.Thread(target=self._watch, name="model-watchdog", daemon=True)

    # -- control ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if self.decode_timeout_s is not None:
            self._watchdog.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the job in progress, answer queued ones ``dropped``, join the thread."""
        with self._lock:
            self._stopping = True
            dropped = list(self._finals) + list(self._partials.values())
            self._finals.clear()
            self._partials.clear()
            self._lock.notify_all()
        for item in dropped:
            self._answer(item, DecodeResult(job=item.job, dropped=True))
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def model_name(self) -> str:
        return self.recognizer.name if self.recognizer is not None else "loading"

    def stats(self) -> WorkerStats:
        with self._lock:
            return WorkerStats(
                len(self._finals), len(self._partials), self._running_session is not None
            )

    # -- queue -----------------------------------------------------------------

    def submit(self, job: DecodeJob, callback: ResultCallback) -> None:
        """Queue ``job``; ``callback`` is called once, from the worker thread."""
        item = _Queued(job, callback, time.perf_counter())
        superseded: _Queued | None = None
        with self._lock:
            failure = self.failure
            if failure is None and self._stopping:
                superseded = item
            elif failure is None and job.kind == "final":
                self._finals.append(item)
                superseded = self._partials.pop(job.session_id, None)
            elif failure is None:
                superseded = self._partials.pop(job.session_id, None)
                self._partials[job.session_id] = item
            self._lock.notify_all()
        if failure is not None:
            self._answer(item, _stalled(job, failure))
            return
        if superseded is not None:
            self._answer(superseded, DecodeResult(job=superseded.job, dropped=True))

    def drop_session(self, session_id: str) -> int:
        """Forget every queued job of ``session_id`` (its callbacks are not called)."""
        with self._lock:
            before = len(self._finals)
            self._finals = deque(q for q in self._finals if q.job.session_id != session_id)
            dropped = before - len(self._finals)
            if self._partials.pop(session_id, None) is not None:
                dropped += 1
        if dropped:
            logger.debug("dropped %d queued jobs of departed session %s", dropped, session_id)
        return dropped

    def _next(self) -> _Queued | None:
        with self._lock:
            while (
                not self._stopping
                and self.failure is None
                and not self._finals
                and not self._partials
            ):
                self._lock.wait()
            if self._stopping or self.failure is not None:
                return None
            if self._finals:
                item = self._finals.popleft()
            else:
                first = next((k for k, q in self._partials.items() if q.job.first), None)
                if first is None:
                    _, item = self._partials.popitem(last=False)
                else:
                    item = self._partials.pop(first)
            self._running_session = item.job.session_id
            self._running = item
            self._running_since = time.perf_counter()
            self._lock.notify_all()  # wakes the watchdog
            return item

    # -- thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.recognizer = self._load()
        except (ModelError, ConfigError) as exc:  # a clear message; the CLI reports it
            self.load_error = exc
            return
        except BaseException as exc:  # reported to the server, which exits with it
            self.load_error = exc
            logger.exception("loading the model failed")
            return
        finally:
            self.ready.set()
        logger.info("model worker ready (%s)", self.recognizer.name)
        try:
            while (item := self._next()) is not None:
                result = self._decode(item)
                with self._lock:
                    late = self._running is not item  # the watchdog answered it already
                    self._running = None
                    self._running_session = None
                if not late:
                    self._answer(item, result)
        except BaseException:  # whatever it was, the server must not go on silently
            logger.exception("the model worker thread died")
            self._fail("the model worker thread died")

    def _watch(self) -> None:
        """The watchdog thread: fails the worker when one decode runs too long."""
        assert self.decode_timeout_s is not None
        with self._lock:
            while not self._stopping and self.failure is None:
                if self._running is None:
                    self._lock.wait()
                    continue
                running = self._running
                overdue_s = self._running_since + self.decode_timeout_s - time.perf_counter()
                if overdue_s > 0:
                    self._lock.wait(overdue_s)
                    continue
                if self._running is running:
                    break
        if self.failure is None and not self._stopping:
            logger.error(
                "a decode has run for over %g s (session %s): the model is stalled",
                self.decode_timeout_s,
                running.job.session_id,
            )
            self._fail(f"a decode ran longer than {self.decode_timeout_s:g} s")

    def _fail(self, reason: str) -> None:
        """Fail for good: answer every job waiting or running, then tell the server."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            waiting = list(self._finals) + list(self._partials.values())
            if self._running is not None:
                waiting.insert(0, self._running)
            self._running = None
            self._running_session = None
            self._finals.clear()
            self._partials.clear()
            self._lock.notify_all()
        for item in waiting:
            self._answer(item, _stalled(item.job, reason))
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:
                logger.exception("failure hook failed")

    def _decode(self, item: _Queued) -> DecodeResult:
        assert self.recognizer is not None
        queue_ms = (time.perf_counter() - item.submitted) * 1000
        return decode_job(self.recognizer, item.job, queue_ms=queue_ms)

    def _answer(self, item: _Queued, result: DecodeResult) -> None:
        if self.on_decoded is not None and not result.dropped:
            try:
                self.on_decoded(result)
            except Exception:
                logger.exception("metrics hook failed")
        try:
            item.callback(result)
        except Exception:
            logger.exception("result callback failed")


def _stalled(job: DecodeJob, reason: str) -> DecodeResult:
    if job.kind == "partial":
        return DecodeResult(job=job, dropped=True)
    return DecodeResult(job=job, failure=DecodeFailure.MODEL_STALLED, detail=reason)
