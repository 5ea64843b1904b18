"""The speaker models' own thread: :class:`SpeakerWorker`.

Neither the event loop nor the ASR worker waits for the speaker models: a closed
segment's :class:`~streamer.core.session_speakers.SpeakerJob` goes into this worker's
bounded queue (:meth:`SpeakerWorker.submit` says False when it is full, and the final then
goes out without labels), one thread loads the graphs and analyses the jobs in order,
and each answer goes to its callback from that thread (the transport hands it to the
event loop). Live jobs go before file uploads' (``background``); a departed session's
queued jobs are dropped. The transport bounds how long a final waits for its answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from streamer.core.audio import SAMPLE_RATE
from streamer.core.diarization import SpeakerAnalysis
from streamer.core.session_speakers import SpeakerAnalyser, SpeakerJob

logger = logging.getLogger(__name__)

SpeakerCallback = Callable[[SpeakerJob, SpeakerAnalysis | None], None]
DEFAULT_MAX_QUEUED = 64  # jobs waiting (live and background together)
LOAD_TIMEOUT_S = 120.0
IDLE_WAIT_S = 5.0  # an idle worker's wait is bounded too (a notify ends it at once)


@dataclass
class SpeakerStats:
    analysed: int = 0  # jobs answered with an analysis
    failed: int = 0  # jobs whose analysis raised (answered None)
    refused: int = 0  # jobs refused: queue full, or the worker stopped or failed
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
    ) -> None:
        """``load`` builds the models in the worker's thread; ``on_analysed(job, answer,
        seconds)`` is called there after every job (metrics)."""
        self._load = load
        self.max_queued = max_queued
        self._on_analysed = on_analysed
        self._live: deque[tuple[SpeakerJob, SpeakerCallback]] = deque()
        self._background: deque[tuple[SpeakerJob, SpeakerCallback]] = deque()
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
        """Queue ``job``; False (and no callback) when full, stopped or failed."""
        with self._cond:
            refused = (
                self._stopping
                or self.failure is not None
                or len(self._live) + len(self._background) >= self.max_queued
            )
            if refused:
                self.stats.refused += 1
                return False
            (self._background if job.background else self._live).append((job, callback))
            self._cond.notify()
        return True

    def drop_session(self, session_id: str) -> int:
        """Forget a departed session's queued jobs (their callbacks are not called)."""
        with self._cond:
            dropped = 0
            for queue in (self._live, self._background):
                kept = [(j, c) for j, c in queue if j.session_id != session_id]
                dropped += len(queue) - len(kept)
                queue.clear()
                queue.extend(kept)
            return dropped

    def stop(self, timeout_s: float = 5.0) -> None:
        """Answer queued jobs None, let the current one finish (within ``timeout_s``)."""
        with self._cond:
            self._stopping = True
            pending = list(self._live) + list(self._background)
            self._live.clear()
            self._background.clear()
            self._cond.notify_all()
        for job, callback in pending:
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
            for job, callback in pending:
                callback(job, None)
            return
        self.ready.set()
        while True:
            with self._cond:
                while not (self._live or self._background or self._stopping):
                    self._cond.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
                job, callback = (self._live or self._background).popleft()
            self._analyse(models, job, callback)

    def _analyse(self, models: SpeakerAnalyser, job: SpeakerJob, callback: SpeakerCallback) -> None:
        started = time.perf_counter()
        answer: SpeakerAnalysis | None
        try:
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
