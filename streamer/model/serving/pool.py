"""Several model workers behind the one worker interface: every device of a machine.

A :class:`WorkerPool` owns N :class:`~streamer.model.serving.worker.ModelWorker` objects, each
with its own thread and its own copy of the model, built by a factory from a
:class:`WorkerSlot` (which device, how many threads). The server and its connections
use the pool exactly as they used the one worker (``submit``, ``drop_session``,
``stats``, ``ready``, ``load_error``, ``failure``, ``on_failure``); with one slot it
routes every session to that worker (and still counts them, for ``/readyz`` and metrics).

Routing: a session is pinned to one worker for its life, so that its partials still
supersede each other and its finals stay in order (both are per-worker rules). The
worker is chosen when the session's first job arrives: the least loaded one, counting
the sessions pinned to it plus the jobs waiting or running there, ties to the lowest
index. :meth:`WorkerPool.drop_session` (which every connection calls when it ends)
forwards to that worker and unpins the session.

Readiness and failure: :attr:`WorkerPool.ready` is set once every worker has loaded,
or as soon as one fails to load (:attr:`WorkerPool.load_error` says which). A worker
whose model process is being started again (``--model-process``; see
:class:`~streamer.model.serving.worker.ModelWorker`'s restarts) keeps its sessions, whose jobs
wait for it, but gets no new ones while another worker can take them;
:attr:`WorkerPool.restarting` says why while none can. A worker
that fails for good (its watchdog saw a stalled decode, or its thread died) fails the
whole pool: :attr:`WorkerPool.on_failure` is called once, the server turns unready and
the process exits for its supervisor to restart, as with one worker. Serving on with
the other workers would hide a stuck native call (which Python cannot interrupt and
which may hold a broken CUDA context) behind a server that quietly has less capacity
than its ``--max-sessions`` promises; a restart is the one clean recovery.

Threads: the pool calls the factory and starts the workers; everything else about a
worker (its queue, its batching, its watchdog) stays the worker's business.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from streamer.core.capacity import LiveFigures
from streamer.core.jobs import DecodeJob, DecodeResult
from streamer.errors import ConfigError
from streamer.model.serving.worker import ModelWorker, ResultCallback, WorkerStats
from streamer.model.speakers.worker import SpeakerWorker

logger = logging.getLogger(__name__)

MAX_WORKERS = 64  # more model copies than this is a typo, not a machine
DEFAULT_WORKERS_PER_DEVICE = 1  # one worker (thread and model copy) per device

FILE_WORKER_NICE = 19  # the uploads' worker: the kernel gives a live decode the cores first


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker of the pool runs."""

    index: int  # 0, 1, ...: the worker's label in logs, metrics and /readyz
    device: str  # "cpu", "cuda:0", ...: passed to the recognizer's options
    threads: int  # intra-op CPU threads of this worker; 0 = the backend's default
    # decodes the file uploads' (background) jobs only, at low priority (--file-worker)
    background: bool = False

    @property
    def label(self) -> str:
        return str(self.index)


@dataclass(frozen=True)
class WorkerHooks:
    """What the factory passes to the worker's constructor (called from its threads)."""

    on_decoded: Callable[[DecodeResult], None] | None  # every decode (metrics)
    on_failure: Callable[[str], None]  # once, when the worker fails for good


WorkerFactory = Callable[[WorkerSlot, WorkerHooks], ModelWorker]


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's share, for metrics and ``/readyz``."""

    slot: WorkerSlot
    sessions: int  # sessions pinned to it
    stats: WorkerStats
    ready: bool  # loaded without error
    failure: str | None  # why it failed for good, or None
    restarts: int = 0  # how often its model was started again

    @property
    def restarting(self) -> str | None:
        """Why its model is being started again, or None."""
        return self.stats.restarting

    @property
    def state(self) -> str:
        """``loading``, ``ready``, ``restarting`` or ``failed`` (``/readyz``, metrics)."""
        if self.failure:
            return "failed"
        if self.restarting:
            return "restarting"
        return "ready" if self.ready else "loading"


def plan_slots(
    devices: Sequence[str],
    *,
    workers_per_device: int,
    threads: int,
    usable_cores: int,
    file_worker: bool = False,
) -> tuple[WorkerSlot, ...]:
    """The live slots (:func:`plan_live_slots`), and with ``file_worker`` one more on
    the first device for the file uploads' jobs, with as many threads as a live one: it
    runs at nice 19, so it takes the cores only when the live workers leave them."""
    live = plan_live_slots(
        devices, workers_per_device=workers_per_device, threads=threads, usable_cores=usable_cores
    )
    if not file_worker:
        return live
    return (*live, WorkerSlot(len(live), live[0].device, live[0].threads, background=True))


def plan_live_slots(
    devices: Sequence[str], *, workers_per_device: int, threads: int, usable_cores: int
) -> tuple[WorkerSlot, ...]:
    """One slot per worker: ``workers_per_device`` on each device, threads shared out.

    ``threads`` is the total for the machine (0: ``usable_cores``), divided evenly
    between the workers (at least one each; with 0, at most the backend's own automatic
    cap each). With a single worker it is passed through unchanged, so one worker
    behaves as it always did (0 = the backend's default).
    """
    from streamer.model.options import MAX_DEFAULT_THREADS

    if workers_per_device < 1:
        raise ConfigError(f"--workers must be at least 1, not {workers_per_device}")
    if threads < 0:
        raise ConfigError(f"--threads must be 0 (automatic) or positive, not {threads}")
    count = len(devices) * workers_per_device
    if count > MAX_WORKERS:
        raise ConfigError(f"{count} workers asked for; at most {MAX_WORKERS} are supported")
    if count == 1:
        return (WorkerSlot(0, devices[0], threads),)
    total = threads or usable_cores
    each = max(1, total // count)
    if threads == 0:
        each = min(each, MAX_DEFAULT_THREADS)
    if total < count:
        logger.warning(
            "%d workers share %d threads: each gets 1 and the cores are oversubscribed",
            count,
            total,
        )
    return tuple(
        WorkerSlot(i, device, each)
        for i, device in enumerate(d for d in devices for _ in range(workers_per_device))
    )


class WorkerPool:
    """N model workers that look like one. Build, :meth:`start`, :meth:`stop` at shutdown.

    ``factory(slot, hooks)`` builds each worker (not started); it must pass ``hooks`` to
    the worker's constructor. ``on_decoded(slot, result)`` is called from the workers'
    threads for every decode. :attr:`on_failure` may be set before :meth:`start`.
    """

    def __init__(
        self,
        factory: WorkerFactory,
        slots: Sequence[WorkerSlot],
        *,
        on_decoded: Callable[[WorkerSlot, DecodeResult], None] | None = None,
    ) -> None:
        if not slots:
            raise ConfigError("a worker pool needs at least one worker")
        self.slots = tuple(slots)
        self._lock = threading.Lock()
        self._pinned: dict[str, int] = {}  # session_id -> worker index
        self._sessions = [0] * len(self.slots)  # sessions pinned to each worker
        # the worker of the file uploads' jobs (--file-worker), if there is one
        self._file_worker = next((s.index for s in self.slots if s.background), None)
        if self._file_worker is not None and all(s.background for s in self.slots):
            raise ConfigError("a worker pool needs a worker for live sessions")
        self._loaded = 0  # workers whose ready event is set
        self._failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None  # once, from a worker's thread
        # the speaker models' worker (--diarize-model), started and stopped with the pool
        self.speakers: SpeakerWorker | None = None
        self.ready = threading.Event()  # every worker loaded, or one failed to load
        self.workers: tuple[ModelWorker, ...] = tuple(
            factory(
                slot,
                WorkerHooks(
                    on_decoded=None
                    if on_decoded is None
                    else partial(self._decoded, on_decoded, slot.index),
                    on_failure=partial(self._worker_failed, slot),
                ),
            )
            for slot in self.slots
        )
        # one waiter per worker, so that a worker failing to load is seen at once
        for slot, worker in zip(self.slots, self.workers, strict=True):
            threading.Thread(
                target=self._wait_loaded,
                args=(worker,),
                name=f"pool-ready-{slot.index}",
                daemon=True,
            ).start()

    @classmethod
    def adopt(
        cls,
        worker: ModelWorker,
        *,
        device: str = "cpu",
        on_decoded: Callable[[WorkerSlot, DecodeResult], None] | None = None,
    ) -> WorkerPool:
        """A pool of one worker built elsewhere (tests, scripts, older callers).

        Hooks its constructor was not given are set on it here, since it was built
        without the pool's; a worker built by a factory gets them at construction.
        """

        def factory(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
            if worker.on_decoded is None:
                worker.on_decoded = hooks.on_decoded
            previous = worker.on_failure

            def on_failure(reason: str) -> None:
                if previous is not None:
                    previous(reason)
                hooks.on_failure(reason)

            worker.on_failure = on_failure
            return worker

        return cls(factory, [WorkerSlot(0, device, 0)], on_decoded=on_decoded)

    def slot(self, index: int) -> WorkerSlot:
        """Worker ``index``'s slot, its device the one it runs on once loaded (``auto``
        becomes ``cpu`` or ``cuda:0``)."""
        slot = self.slots[index]
        device = self.workers[index].device
        return slot if device is None or device == slot.device else replace(slot, device=device)

    def _decoded(
        self,
        hook: Callable[[WorkerSlot, DecodeResult], None],
        index: int,
        result: DecodeResult,
    ) -> None:
        hook(self.slot(index), result)

    # -- control ---------------------------------------------------------------

    def start(self) -> None:
        """Start every worker (they load their models at once, in parallel)."""
        for worker in self.workers:
            worker.start()
        if self.speakers is not None:
            self.speakers.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every worker at once; returns within about ``timeout_s``."""
        if self.speakers is not None:
            self.speakers.stop(timeout_s)
        stoppers = [
            threading.Thread(target=w.stop, args=(timeout_s,), name="pool-stop", daemon=True)
            for w in self.workers
        ]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(timeout_s + 1.0)

    def _wait_loaded(self, worker: ModelWorker) -> None:
        worker.ready.wait()
        with self._lock:
            self._loaded += 1
            done = self._loaded == len(self.workers) or worker.load_error is not None
        if done:
            self.ready.set()

    # -- what the server reads ------------------------------------------------

    @property
    def load_error(self) -> BaseException | None:
        """The first loading error among the workers (None: all loaded, or loading)."""
        return next((w.load_error for w in self.workers if w.load_error is not None), None)

    @property
    def failure(self) -> str | None:
        """Why the pool failed for good (a worker stalled or died); None while healthy."""
        return self._failure

    @property
    def restarting(self) -> str | None:
        """Why no worker can take a new session now (each is starting its model again);
        None while one can."""
        reasons = [w.restarting for w in self.workers]
        if any(reason is None for reason in reasons):
            return None
        if len(reasons) == 1:
            return reasons[0]
        pairs = zip(self.slots, reasons, strict=True)
        return "; ".join(f"worker {slot.index}: {reason}" for slot, reason in pairs)

    @property
    def model_name(self) -> str:
        """The model's name (every worker loads the same one); "loading" until ready."""
        names = {w.model_name for w in self.workers}
        return self.workers[0].model_name if len(names) == 1 else "loading"

    def stats(self) -> WorkerStats:
        """The workers' queues summed; busy while any worker decodes; restarting while
        every worker is (:attr:`restarting`)."""
        each = [w.stats() for w in self.workers]
        return WorkerStats(
            sum(s.queued_finals for s in each),
            sum(s.queued_partials for s in each),
            any(s.busy for s in each),
            self.restarting,
            sum(s.queued_background for s in each),
            LiveFigures.combined([s.live for s in each]),
        )

    def loads(self) -> list[WorkerLoad]:
        """Each worker's pinned sessions, queue and state."""
        with self._lock:
            sessions = list(self._sessions)
        return [
            WorkerLoad(
                slot=self.slot(slot.index),
                sessions=sessions[slot.index],
                stats=worker.stats(),
                ready=worker.ready.is_set() and worker.load_error is None,
                failure=worker.failure,
                restarts=worker.restarts,
            )
            for slot, worker in zip(self.slots, self.workers, strict=True)
        ]

    def worker_of(self, session_id: str) -> WorkerSlot | None:
        """The slot ``session_id`` is pinned to, or None."""
        with self._lock:
            index = self._pinned.get(session_id)
        return None if index is None else self.slots[index]

    # -- queue -----------------------------------------------------------------

    def submit(self, job: DecodeJob, callback: ResultCallback) -> None:
        """Queue ``job`` on its session's worker (pinning the session on its first job)."""
        with self._lock:
            index = self._pinned.get(job.session_id)
            if index is None:
                index = self._file_worker if job.background else None
                if index is None:
                    index = self._least_loaded()
                self._pinned[job.session_id] = index
                self._sessions[index] += 1
        self.workers[index].submit(job, callback)

    def drop_session(self, session_id: str) -> int:
        """Forget the session's queued jobs (on its worker) and unpin it."""
        if self.speakers is not None:
            self.speakers.drop_session(session_id)
        with self._lock:
            index = self._pinned.pop(session_id, None)
            if index is not None:
                self._sessions[index] -= 1
        if index is None:
            return 0
        return self.workers[index].drop_session(session_id)

    def _least_loaded(self) -> int:
        """Call with the lock held; each worker's stats take that worker's own lock."""

        def load(index: int) -> tuple[bool, int, int]:
            s = self.workers[index].stats()
            queued = s.queued_finals + s.queued_partials + s.queued_background + int(s.busy)
            return (s.restarting is not None, self._sessions[index] + queued, index)

        live = [i for i, slot in enumerate(self.slots) if not slot.background]
        return min(live, key=load)

    # -- failure ---------------------------------------------------------------

    def _worker_failed(self, slot: WorkerSlot, reason: str) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = (
                reason
                if len(self.workers) == 1
                else f"worker {slot.index} ({slot.device}): {reason}"
            )
            failure = self._failure
        if len(self.workers) > 1:
            logger.error(
                "model worker %d on %s failed: the pool fails with it", slot.index, slot.device
            )
        if self.on_failure is not None:
            try:
                self.on_failure(failure)
            except Exception:
                logger.exception("failure hook failed")
