"""The speaker models' own thread: :class:`SpeakerWorker`.

Neither the event loop nor the ASR worker waits for the speaker models: a closed
segment's :class:`~streamer.core.session_speakers.SpeakerJob` goes into this worker's
bounded queue (:meth:`SpeakerWorker.submit` says False when it is full, and the final then
goes out without labels), one thread loads the graphs and analyses the jobs in order,
and each answer goes to its callback from that thread (the transport hands it to the
event loop). Live jobs go before file uploads' (``background``); a departed session's
queued jobs are dropped. The transport bounds how long a final waits for its answer, so
under overload a live job that waited in the queue past ``max_live_wait_s`` is dropped
unanswered (its final has gone, or goes at that bound, without speakers): the worker
sheds what nobody waits for and spends itself on fresh segments.

An open segment's *early* jobs (its audio so far; sessions send them only when the models
embed windows end to end, ``--no-diarize-windows``) are embedded between the live jobs, at
most one queued per segment (a newer one replaces it), into a per-segment cache of
window embeddings (:class:`~streamer.model.speakers.models.WindowCache`, the latest
:data:`MAX_CACHED_SEGMENTS`) that the segment's analysis then reuses: when it ends, only
its tail is left. A segment's new analysis job drops its queued jobs (answered by the
newest; the session ignores an answer for other audio anyway), and never is an early job
answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.diarization import SpeakerAnalysis
from streamer.core.session_speakers import SpeakerAnalyser, SpeakerJob
from streamer.model.speakers.models import WindowCache

logger = logging.getLogger(__name__)

SpeakerCallback = Callable[[SpeakerJob, SpeakerAnalysis | None], None]
DEFAULT_MAX_QUEUED = 64  # jobs waiting (live and background together)
LOAD_TIMEOUT_S = 120.0
IDLE_WAIT_S = 5.0  # an idle worker's wait is bounded too (a notify ends it at once)
MAX_CACHED_SEGMENTS = 64  # segments whose windows' embeddings are kept (a few KB each)
# ``serve`` drops a live job queued longer than its final may wait for speakers
# (--diarize-max-wait-ms, counted from the decode's end) and this margin for the decode:
# by then the final has gone without them, and one over 2 s late fails the capacity
# criterion anyway
STALE_MARGIN_S = 2.0

SegmentKey = tuple[str, int]  # (session, segment)
Queued = tuple[SpeakerJob, SpeakerCallback, float]  # the job, its callback, when queued


@runtime_checkable
class WindowedAnalyser(Protocol):
    """Models that can embed an open segment's windows ahead of its analysis
    (:class:`~streamer.model.speakers.models.SpeakerModels`)."""

    def analyse(
        self, segment_id: int, pcm: np.ndarray, windows: WindowCache | None = None
    ) -> SpeakerAnalysis: ...

    def embed_closed(self, pcm: np.ndarray, cache: WindowCache) -> int: ...


@dataclass
class SpeakerStats:
    analysed: int = 0  # jobs answered with an analysis
    failed: int = 0  # jobs whose analysis raised (answered None)
    refused: int = 0  # jobs refused: queue full, or the worker stopped or failed
    superseded: int = 0  # queued jobs dropped for a newer one of the same segment
    stale: int = 0  # live jobs dropped unanswered: queued longer than max_live_wait_s
    early_windows: int = 0  # windows embedded ahead of their segment's analysis
    audio_s: float = 0.0  # audio analysed
    busy_s: float = 0.0  # time spent analysing


class SpeakerWorker:
    """One thread over a bounded queue. Build, :meth:`start`, :meth:`stop` at shutdown."""

    def __init__(
        self,
        load: Callable[[], SpeakerAnalyser],
        *,
        max_queued: int = DEFAULT_MAX_QUEUED,
        on_analysed: Callable[[SpeakerJob, SpeakerAnalysis | None, float], None] | None = None,
        max_live_wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``load`` builds the models in the worker's thread; ``on_analysed(job, answer,
        seconds)`` is called there after every job (metrics); a live job queued longer
        than ``max_live_wait_s`` (None: no bound) by ``clock`` is dropped unanswered."""
        self._load = load
        self.max_queued = max_queued
        self._on_analysed = on_analysed
        self.max_live_wait_s = max_live_wait_s
        self._clock = clock
        self._live: deque[Queued] = deque()
        self._background: deque[Queued] = deque()
        self._early: OrderedDict[SegmentKey, SpeakerJob] = OrderedDict()
        self._windows: OrderedDict[SegmentKey, WindowCache] = OrderedDict()
        self._cond = threading.Condition()
        self._stopping = False
        self.failure: str | None = None  # why loading failed; jobs are then refused
        self.ready = threading.Event()  # loaded, or failed to load
        self.stats = SpeakerStats()
        self._thread = threading.Thread(target=self._run, name="speaker-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout_s: float = LOAD_TIMEOUT_S) -> bool:
        return self.ready.wait(timeout_s) and self.failure is None

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._live) + len(self._background)

    def submit(self, job: SpeakerJob, callback: SpeakerCallback) -> bool:
        """Queue ``job``; False (and no callback) when full, stopped or failed. An early
        job is never answered; a segment's queued jobs make way for its new one."""
        key = (job.session_id, job.segment_id)
        with self._cond:
            full = len(self._early if job.early else self._live) + len(self._background)
            if self._stopping or self.failure is not None or full >= self.max_queued:
                self.stats.refused += 1
                return False
            if job.early:
                self._early.pop(key, None)
                self._early[key] = job
            else:
                self._supersede(key)
                queue = self._background if job.background else self._live
                queue.append((job, callback, self._clock()))
            self._cond.notify()
        return True

    def _supersede(self, key: SegmentKey) -> None:
        """Drop the segment's queued jobs (under the lock)."""
        if self._early.pop(key, None) is not None:
            self.stats.superseded += 1
        for queue in (self._live, self._background):
            kept = [q for q in queue if (q[0].session_id, q[0].segment_id) != key]
            self.stats.superseded += len(queue) - len(kept)
            if len(kept) != len(queue):
                queue.clear()
                queue.extend(kept)

    def drop_session(self, session_id: str) -> int:
        """Forget a departed session's queued jobs (their callbacks are not called)."""
        with self._cond:
            dropped = 0
            for queue in (self._live, self._background):
                kept = [q for q in queue if q[0].session_id != session_id]
                dropped += len(queue) - len(kept)
                queue.clear()
                queue.extend(kept)
            for table in (self._early, self._windows):
                for key in [k for k in table if k[0] == session_id]:
                    del table[key]
            return dropped

    def stop(self, timeout_s: float = 5.0) -> None:
        """Answer queued jobs None, let the current one finish (within ``timeout_s``)."""
        with self._cond:
            self._stopping = True
            pending = list(self._live) + list(self._background)
            self._live.clear()
            self._background.clear()
            self._early.clear()
            self._cond.notify_all()
        for job, callback, _ in pending:
            callback(job, None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            models = self._load()
        except Exception as error:  # a load failure is reported, never raised in a thread
            logger.exception("speaker models failed to load: diarization is off")
            with self._cond:
                self.failure = str(error) or type(error).__name__
                pending = list(self._live) + list(self._background)
                self._live.clear()
                self._background.clear()
            self.ready.set()
            for job, callback, _ in pending:
                callback(job, None)
            return
        self.ready.set()
        while True:
            with self._cond:
                while not (self._live or self._early or self._background or self._stopping):
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
                if not self._live and self._early:
                    early = self._early.popitem(last=False)[1]
                else:
                    early = None
                    job, callback, queued_at = (self._live or self._background).popleft()
                    if self._stale(job, queued_at):
                        self.stats.stale += 1
                        continue
            if early is None:
                self._analyse(models, job, callback)
            elif isinstance(models, WindowedAnalyser):  # else early jobs are dropped
                self._embed_early(models, early)

    def _stale(self, job: SpeakerJob, queued_at: float) -> bool:
        """A live job nobody waits for any more (see STALE_MARGIN_S)."""
        if job.background or self.max_live_wait_s is None:
            return False
        return self._clock() - queued_at > self.max_live_wait_s

    def _cache(self, job: SpeakerJob) -> WindowCache:
        """The segment's window cache (made now if new); older segments' of its session
        are done with, and the least recent go past MAX_CACHED_SEGMENTS. Under the lock:
        drop_session forgets a session's caches from the event loop's thread."""
        key = (job.session_id, job.segment_id)
        with self._cond:
            cache = self._windows.pop(key, None) or WindowCache()
            for old in [k for k in self._windows if k[0] == job.session_id and k[1] < key[1]]:
                del self._windows[old]
            self._windows[key] = cache
            while len(self._windows) > MAX_CACHED_SEGMENTS:
                self._windows.popitem(last=False)
        return cache

    def _embed_early(self, models: WindowedAnalyser, job: SpeakerJob) -> None:
        started = time.perf_counter()
        try:
            embedded = models.embed_closed(job.pcm, self._cache(job))
        except Exception:  # the analysis at the segment's end will do it (or say why)
            logger.exception(
                "early speaker windows of %s/%d failed", job.session_id, job.segment_id
            )
            return
        with self._cond:
            self.stats.early_windows += embedded
            self.stats.busy_s += time.perf_counter() - started

    def _analyse(self, models: SpeakerAnalyser, job: SpeakerJob, callback: SpeakerCallback) -> None:
        started = time.perf_counter()
        answer: SpeakerAnalysis | None
        try:
            if isinstance(models, WindowedAnalyser) and job.segment_id >= 0:
                answer = models.analyse(job.segment_id, job.pcm, self._cache(job))
            else:
                answer = models.analyse(job.segment_id, job.pcm)
        except Exception:  # one bad segment must not end diarization for everyone
            logger.exception("speaker analysis of %s/%d failed", job.session_id, job.segment_id)
            answer = None
        seconds = time.perf_counter() - started
        with self._cond:
            if answer is None:
                self.stats.failed += 1
            else:
                self.stats.analysed += 1
            self.stats.audio_s += len(job.pcm) / SAMPLE_RATE
            self.stats.busy_s += seconds
        if self._on_analysed is not None:
            self._on_analysed(job, answer, seconds)
        callback(job, answer)
