"""The one model worker: a thread that owns the recognizer and decodes queued jobs.

The event loop never waits on the model. It submits :class:`~streamer.core.jobs.DecodeJob`
objects with a callback; the worker thread decodes them and calls the callback from its
own thread (the server hops back to the loop with ``call_soon_threadsafe``).

Dynamic batching: a job found alone in the queue is decoded alone at once (batch 1).
When several are queued, :func:`select_batch` takes up to ``max_batch`` of them, the one
the queue discipline puts first always included (so an older final never waits behind
newer work), the others of its kind (finals with finals, partials with partials) and
class (live jobs, or file uploads' background ones) in queue order as long as padding
them to the longest keeps the batch within ``max_padding_ratio`` of its unpadded
length, and one ``decode_batch`` call decodes them all. A batch is token-exact (each
job gets the tokens it gets alone) in fp32; int8 picks one activation scale per tensor,
so a batch's other rows change a row's result. ``max_batch=None`` (automatic) batches
on an accelerator in fp32/fp16 only; on the CPU it stays at batch 1, where batching
measured no better (bench/RESULTS.md, "Dynamic batching").

The queue discipline (live finals, then a segment's short first partial, then refreshes;
one pending partial per session; then file uploads' background finals round robin among
their sessions) and the batch selection are :mod:`streamer.model.serving.job_queue`.

A batch that raises is decoded again job by job, so only the job that fails gets an error.

Watchdog and restarts (a stalled decode, a dead thread or model process: the model started
again, or the worker failed for good) are :mod:`streamer.model.serving.supervision`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from streamer.core.audio import SAMPLE_RATE
from streamer.core.capacity import LiveFigures
from streamer.core.jobs import DecodeJob, DecodeResult
from streamer.errors import ConfigError, DecodeInterrupted, ModelError
from streamer.model.decode.decoding import PartialFailures, decode_job, decode_jobs, interrupted
from streamer.model.interface import SpeechRecognizer
from streamer.model.serving.job_queue import (
    JobQueue,
    Queued,
    ResultCallback,
    is_first_partial,
    is_live_final,
    is_refresh,
    select_batch,
)
from streamer.model.serving.live_load import LiveLoad
from streamer.model.serving.supervision import (
    DEFAULT_MAX_RESTARTS,
    Supervised,
    process_gone,
    stalled_answer,
)

logger = logging.getLogger(__name__)

DEFAULT_DECODE_TIMEOUT_S = 30.0  # a 7 s segment decodes in about 1 s on a slow CPU core
# jobs per model call where batches are token-exact; 8 x 7 s decode in 1.7-4 s on 2 CPU
# cores, well inside the watchdog (bench/RESULTS.md, "Dynamic batching")
DEFAULT_MAX_BATCH = 8
# a batch's padded samples (jobs x longest) at most this times its real samples: on the
# CPU a row of a 7 s batch costs 80 % of a 7 s decode alone, so padding must stay small
DEFAULT_MAX_PADDING_RATIO = 1.25
# on the CPU a batch of 8 x 7 s takes 6.4 x one 7 s decode, and a final arriving meanwhile
# waits for all of it: bound a batch to one longest segment's audio (7 s)
CPU_MAX_BATCH_AUDIO_S = 7.0
# the recognizer in the worker's own thread; True: in a child process
# (streamer.model.serving.process, serve --model-process)
DEFAULT_MODEL_PROCESS = False
IDLE_CHECK_S = 1.0  # an idle worker looks this often whether its model process has died


@dataclass(frozen=True)
class WorkerOptions:
    """How the worker decodes. Validated on construction (raises ConfigError)."""

    decode_timeout_s: float | None = DEFAULT_DECODE_TIMEOUT_S  # None: no watchdog
    # jobs per model call; None: DEFAULT_MAX_BATCH on an accelerator where the
    # recognizer's batches are token-exact (batch_exact), else 1 (always on the CPU)
    max_batch: int | None = None
    max_padding_ratio: float = DEFAULT_MAX_PADDING_RATIO  # see select_batch
    # padded audio per batch; None: CPU_MAX_BATCH_AUDIO_S on the CPU (a batch then holds
    # up the next final no longer than one longest segment alone), no bound elsewhere
    max_batch_audio_s: float | None = None
    # restarts of a model process per RESTART_WINDOW_S; 0: a failure is for good
    max_restarts: int = DEFAULT_MAX_RESTARTS
    # the worker thread's niceness (Linux), set before the model loads so that the
    # threads the backend starts inherit it: 19 for the file uploads' worker (--file-worker)
    nice: int = 0

    def __post_init__(self) -> None:
        if self.decode_timeout_s is not None and self.decode_timeout_s <= 0:
            raise ConfigError("decode_timeout_s must be positive")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch must be at least 1, not {self.max_batch}")
        if self.max_batch_audio_s is not None and self.max_batch_audio_s <= 0:
            raise ConfigError("max_batch_audio_s must be positive")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be 0 or more, not {self.max_restarts}")
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"nice must be 0..19, not {self.nice}")
        if self.max_padding_ratio < 1:
            raise ConfigError(f"max_padding_ratio must be 1 or more, not {self.max_padding_ratio}")


@dataclass
class WorkerStats:
    queued_finals: int
    queued_partials: int
    busy: bool
    restarting: str | None = None  # why the model is being loaded again, or None
    # file uploads' jobs, decoded after live work (not in ``live``: capacity is about live
    # sessions, and a file's wait behind them is by design)
    queued_background: int = 0
    live: LiveFigures = LiveFigures()  # for capacity (core/capacity.py)


__all__ = [
    "ModelWorker",
    "ResultCallback",
    "SpeechRecognizer",
    "WorkerOptions",
    "WorkerStats",
    "select_batch",
]


class ModelWorker(Supervised):
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
        max_batch: int | None = None,
        options: WorkerOptions | None = None,
        on_decoded: Callable[[DecodeResult], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """``options`` wins over ``decode_timeout_s`` and ``max_batch`` (shorthands)."""
        self.options = options or WorkerOptions(decode_timeout_s, max_batch)
        self._load = load
        self.decode_timeout_s = self.options.decode_timeout_s  # None: no watchdog
        self.max_batch = 1  # resolved from options once the model is loaded
        self._max_batch_samples: int | None = None  # likewise
        self._lock = threading.Condition()
        self._queue = JobQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="model-worker", daemon=True)
        self.ready = threading.Event()  # set when the model is loaded (or failed to load)
        self.load_error: BaseException | None = None
        self.recognizer: SpeechRecognizer | None = None
        self.on_decoded = on_decoded  # metrics hook, called for every decode
        self._live = LiveLoad()  # for capacity; guarded by _lock (read by stats())
        self._partial_failures = PartialFailures()  # the worker thread's alone
        # watchdog: the jobs being decoded and since when (perf_counter), guarded by _lock
        self._running: list[Queued] | None = None
        self._running_since = 0.0
        self._init_supervision(self.options.max_restarts, on_failure)

    # -- control ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if self.decode_timeout_s is not None:
            self._watchdog.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the job in progress, answer queued ones ``dropped``, join the thread."""
        with self._lock:
            self._stopping = True
            dropped = self._queue.clear()
            self._lock.notify_all()
        for item in dropped:
            self._answer(item, DecodeResult(job=item.job, dropped=True))
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():  # a model process, still decoding
            self._kill_model()

    @property
    def model_name(self) -> str:
        return self.recognizer.name if self.recognizer is not None else "loading"

    @property
    def device(self) -> str | None:
        """Where the loaded model runs ("cpu", "cuda:0"); None until it is loaded (or
        where the recognizer does not say)."""
        device = self.recognizer.device if self.recognizer is not None else None
        return None if device is None else str(device)

    def stats(self) -> WorkerStats:
        now = time.perf_counter()
        with self._lock:
            oldest = self._queue.oldest_final_submitted()
            live = replace(
                self._live.figures,
                oldest_final_age_ms=0.0 if oldest is None else (now - oldest) * 1000,
                interruptible=self.recognizer is not None and self.recognizer.interruptible,
            )
            return WorkerStats(
                len(self._queue.finals),
                len(self._queue.partials),
                self._running is not None,
                self.restarting,
                self._queue.background_jobs,
                live,
            )

    # -- queue -----------------------------------------------------------------

    def submit(self, job: DecodeJob, callback: ResultCallback) -> None:
        """Queue ``job``; ``callback`` is called once, from the worker thread."""
        item = Queued(job, callback, time.perf_counter())
        superseded: Queued | None = None
        with self._lock:
            failure = self.failure
            if failure is None and self._stopping:
                superseded = item
            elif failure is None:
                superseded = self._queue.push(item)
                if job.realtime and (is_live_final(job) or is_first_partial(job)):
                    self._interrupt_partials()
            self._lock.notify_all()
        if failure is not None:
            self._answer(item, stalled_answer(job, failure))
            return
        if superseded is not None:
            self._answer(superseded, DecodeResult(job=superseded.job, dropped=True))

    def _interrupt_partials(self) -> None:
        """Call with the lock held, a live final or a segment's first partial just
        queued: if only refreshes of segments already shown are decoding, stop them
        (where the recognizer can) so the new job need not wait for them; they are
        answered dropped and their sessions ask again. A final, a speculative decode (a
        final in waiting) or a file's job is never stopped, nor a first partial: it is
        short, and stopped it is decoded again from the start (with sixteen clients a
        fifth of the first partials decoded were stopped by finals, their work lost)."""
        running, recognizer = self._running, self.recognizer
        if running is None or recognizer is None or not recognizer.interruptible:
            return
        if all(_is_later_refresh(q.job) for q in running) and recognizer.interrupt():
            self._live.interrupted(len(running))

    def drop_session(self, session_id: str) -> int:
        """Forget every queued job of ``session_id`` (its callbacks are not called) and
        what the recognizer keeps for it."""
        with self._lock:
            dropped = self._queue.drop_session(session_id)
        if self.recognizer is not None:
            self.recognizer.forget_session(session_id)  # its cached features
        if dropped:
            logger.debug("dropped %d queued jobs of departed session %s", dropped, session_id)
        return dropped

    def _next(self) -> list[Queued] | None:
        """Wait for work; take the next batch off the queue (see :func:`select_batch`)."""
        with self._lock:
            while True:
                if self._stopping or self.failure is not None or process_gone(self.recognizer):
                    return None
                if self._queue:
                    break
                # idle, but look now and then whether a model process has died
                self._lock.wait(IDLE_CHECK_S)
            batch = self._queue.take(
                max_batch=self.max_batch,
                max_padding_ratio=self.options.max_padding_ratio,
                max_batch_samples=self._max_batch_samples,
                now=time.perf_counter(),
            )
            self._running = batch
            self._running_since = time.perf_counter()
            self._lock.notify_all()  # wakes the watchdog
            return batch

    # -- thread ----------------------------------------------------------------

    def _run(self) -> None:
        if self.options.nice:
            _lower_priority(self.options.nice)
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
        self.max_batch = _resolve_max_batch(self.options.max_batch, self.recognizer)
        audio_s = self.options.max_batch_audio_s
        if audio_s is None and str(self.recognizer.device or "cpu") == "cpu":
            audio_s = CPU_MAX_BATCH_AUDIO_S
        self._max_batch_samples = None if audio_s is None else int(audio_s * SAMPLE_RATE)
        logger.info(
            "model worker ready (%s, at most %d jobs per decode)",
            self.recognizer.name,
            self.max_batch,
        )
        try:
            while True:
                batch = self._next()
                if batch is None:
                    gone = process_gone(self.recognizer)
                    if self._stopping or self.failure is not None or gone is None:
                        break
                    if not self._restart(self._restarting or gone):
                        break
                    continue
                for item, result in self._settle(batch, self._decode(batch)):
                    self._answer(item, result)
            if self._stopping:
                # a model process: asked to exit from this thread, whose end would kill it
                self.recognizer.close()
        except BaseException:  # whatever it was, the server must not go on silently
            logger.exception("the model worker thread died")
            self._fail("the model worker thread died")

    def _decode(self, batch: list[Queued]) -> list[DecodeResult]:
        """Decode ``batch`` in one call; if that raises, job by job (one result each)."""
        if len(batch) == 1:
            return [self._decode_one(batch[0])]
        started = time.perf_counter()
        recognizer = self.recognizer
        assert recognizer is not None and recognizer.batches
        try:
            transcripts = decode_jobs(recognizer, [item.job for item in batch])
        except DecodeInterrupted:  # partials, stopped for a final
            decode_ms = (time.perf_counter() - started) * 1000
            return [
                interrupted(item.job, (started - item.submitted) * 1000, decode_ms, len(batch))
                for item in batch
            ]
        except Exception as exc:  # find the bad job: only that one gets an error
            logger.warning(
                "a batch of %d failed (%s: %s); decoding its jobs one by one",
                len(batch),
                type(exc).__name__,
                exc,
            )
            return [self._decode_one(item) for item in batch]
        decode_ms = (time.perf_counter() - started) * 1000
        return [
            DecodeResult(
                job=item.job,
                transcript=transcript,
                queue_ms=(started - item.submitted) * 1000,
                decode_ms=decode_ms,
                batch_size=len(batch),
            )
            for item, transcript in zip(batch, transcripts, strict=True)
        ]

    def _decode_one(self, item: Queued) -> DecodeResult:
        assert self.recognizer is not None
        queue_ms = (time.perf_counter() - item.submitted) * 1000
        return decode_job(
            self.recognizer, item.job, queue_ms=queue_ms, partial_failures=self._partial_failures
        )

    def _answer(self, item: Queued, result: DecodeResult) -> None:
        with self._lock:
            self._live.record(result)
        if self.on_decoded is not None and (result.interrupted or not result.dropped):
            try:
                self.on_decoded(result)
            except Exception:
                logger.exception("metrics hook failed")
        try:
            item.callback(result)
        except Exception:
            logger.exception("result callback failed")


def _resolve_max_batch(requested: int | None, recognizer: SpeechRecognizer) -> int:
    """The jobs per call: ``requested``, or automatic (exact batches only); 1 where the
    recognizer cannot batch."""
    if not recognizer.batches:
        return 1
    if requested is not None:
        if requested > 1 and not recognizer.batch_exact:
            logger.warning(
                "max_batch %d on %s: batched results are not token-identical to batch 1 "
                "(int8 quantizes each batch as one tensor; bench/RESULTS.md)",
                requested,
                recognizer.name,
            )
        return requested
    # on 2 CPU cores batching did not raise capacity (finals wait for partials' batches),
    # so automatic batching is for accelerators, and only where batches are exact
    exact = recognizer.batch_exact
    on_cpu = str(recognizer.device or "cpu") == "cpu"
    return DEFAULT_MAX_BATCH if exact and not on_cpu else 1


def _is_later_refresh(job: DecodeJob) -> bool:
    """A refresh of a segment already shown (not its first partial)."""
    return is_refresh(job) and not job.first


def _lower_priority(nice: int) -> None:
    """This thread at ``nice`` (Linux: niceness is per thread, and threads started from
    it inherit it); elsewhere a warning, and the worker runs at normal priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as error:
        logger.warning("cannot lower the file worker's priority (%s): it runs as the others", error)
