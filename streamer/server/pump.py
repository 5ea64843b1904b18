"""One session's pump, whatever carries its bytes: :class:`SessionPump`.

A transport (the WebSocket :class:`~streamer.server.connection.Connection`, the Wyoming
connection, a later HTTP upload) reads its socket and hands what it read to
:meth:`SessionPump.receive`, writes what :meth:`SessionPump.write_all` gives it, and
waits on :attr:`SessionPump.terminated`. The pump owns everything between: the adapter
and its session, the read-ahead backlog and the pending-finals gate, job submission and
the worker's results, the bounded outbox and the write timeout, input pacing, and the
accounting (``/metrics``). It has no socket, so every limit holds on every transport by
construction:

* while the session has ``max_pending_finals`` finals waiting for the model, input waits
  in the backlog; once that holds ``max_backlog_bytes``, :attr:`backlog_has_room` is
  cleared and the transport must stop reading (TCP then pushes back on the client);
* the outbox holds at most ``max_outbox_bytes``, and one write may take at most
  ``write_timeout_s``: past either the session is terminated (a client that does not
  read), its slot freed;
* :meth:`charge` says how long the transport must wait before its next read
  (``streamer.core.pacing``), counted in ``/metrics``;
* audio seconds are the session's own count of the client's audio (any encoding, any
  transport), partials skipped and the first-partial latency are counted alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from prometheus_client import Histogram

from streamer.core.diarization import SpeakerAnalysis
from streamer.core.jobs import DecodeResult
from streamer.core.live_latency import ArrivalLog, LatencyCounts
from streamer.core.pacing import InputBudget, InputPacer
from streamer.core.protocol import Error, Final, Notice, Partial, ServerMessage, SpeechStart
from streamer.core.session_speakers import SessionSpeakers, SpeakerJob, SpeakerQueue
from streamer.core.wire import OutFrame, WireAdapter
from streamer.errors import CLOSE_POLICY_VIOLATION
from streamer.model.serving.pool import WorkerPool
from streamer.model.serving.worker import ModelWorker
from streamer.server.metrics import Metrics
from streamer.server.options import ConnectionLimits

logger = logging.getLogger(__name__)

BACKLOG_PIECE_BYTES = 32000  # backlogged input is fed to the adapter in pieces (1 s of PCM)

Send = Callable[[OutFrame], Awaitable[None]]


class SessionPump:
    """One adapter's session between a transport and the model worker."""

    def __init__(
        self,
        adapter: WireAdapter,
        worker: WorkerPool | ModelWorker,
        metrics: Metrics,
        limits: ConnectionLimits,
        *,
        end_of_input: Callable[[], None] | None = None,
        log: logging.LoggerAdapter[logging.Logger] | None = None,
        budget: InputBudget | None = None,
    ) -> None:
        self.adapter = adapter
        self.session = adapter.session
        self.worker = worker
        self.metrics = metrics
        self.limits = limits
        self.log = log or logging.LoggerAdapter(logger, {"session_id": self.session.session_id})
        self._loop = asyncio.get_running_loop()
        self._end_of_input = end_of_input  # the adapter's, when the input ends (Wyoming)
        self.outbox: asyncio.Queue[OutFrame | None] = asyncio.Queue()
        self._outbox_bytes = 0
        self.backlog: deque[bytes | str] = deque()
        self._backlog_bytes = 0
        self.backlog_has_room = asyncio.Event()
        self.backlog_has_room.set()
        self.closing = False  # the session is over or terminated: no more input is fed
        self.input_ended = False  # the client ended its input (EOF): after the backlog
        self.terminated = asyncio.Event()  # a limit ended the session: close it now
        self.terminate_code = CLOSE_POLICY_VIOLATION
        self.terminate_reason = ""
        self.gone = False  # the client disconnected: late worker results are ignored
        self.send_blocked = False  # the writer is inside a send
        self.last_input = self._loop.time()  # last audio or valid control message
        self._pacer = InputPacer(limits.pacing, self._loop.time(), budget)  # and the total
        # segment_id -> (perf_counter() at speech_start, its start_ms)
        self._speech_started: dict[int, tuple[float, float]] = {}
        self._arrivals = ArrivalLog()  # when the audio arrived: the latencies users feel
        self._real_time = True  # the client sends no faster than real time
        self._skipped_seen = 0
        self._audio_ms_seen = 0.0
        # diarize: the speaker models' worker (the pool's), and per held final its bound
        self.speaker_worker: SpeakerQueue | None = getattr(worker, "speakers", None)
        self._speaker_deadlines: dict[int, asyncio.TimerHandle] = {}

    @property
    def backlog_bytes(self) -> int:
        return self._backlog_bytes

    @property
    def outbox_bytes(self) -> int:
        """Bytes of frames waiting to be written (at most ``limits.max_outbox_bytes``)."""
        return self._outbox_bytes

    # -- session -> world --------------------------------------------------------------

    def pump(self) -> None:
        """Move the adapter's frames to the outbox and the session's jobs to the worker."""
        if self.session.speakers is not None:
            self._pump_speakers(self.session.speakers)
        for frame in self.adapter.drain():
            if self.terminated.is_set():
                break
            if self._outbox_bytes + len(frame.data) > self.limits.max_outbox_bytes:
                self.terminate(
                    CLOSE_POLICY_VIOLATION,
                    "client not reading",
                    f"over {self.limits.max_outbox_bytes} bytes wait to be sent",
                    "outbox_full",
                )
                break
            self._outbox_bytes += len(frame.data)
            self.outbox.put_nowait(frame)
        for job in self.session.jobs_to_submit():
            if not self._real_time:  # after real-time sessions' work (model/serving/job_queue.py)
                job = dataclasses.replace(job, realtime=False)
            self.worker.submit(job, self._result_from_worker)
        stats = self.session.stats
        if stats.partials_skipped > self._skipped_seen:
            self.metrics.partials_skipped_total.inc(stats.partials_skipped - self._skipped_seen)
            self._skipped_seen = stats.partials_skipped
        audio_ms = self.session.audio_ms
        if audio_ms > self._audio_ms_seen:
            self.metrics.audio_seconds_total.inc((audio_ms - self._audio_ms_seen) / 1000)
            self._audio_ms_seen = audio_ms
            if not self.session.background:
                now = time.perf_counter()
                self._arrivals.arrived(audio_ms, now)
                self._real_time = self.metrics.live.note_rate(
                    self.session.session_id, self._arrivals.rate(now)
                )
        if self.adapter.close_code is not None and not self.closing:
            self.closing = True
            self._clear_backlog()
            self.outbox.put_nowait(None)

    async def write_all(self, send: Send) -> bool:
        """Send every frame with ``send``, each within the write timeout; True once the
        session's last frame is sent (the transport closes next), False when the client
        is gone or the session was terminated."""
        while True:
            frame = await self.outbox.get()
            if frame is None:
                return True
            self._outbox_bytes -= len(frame.data)
            if frame.message is not None:
                self._account(frame.message)
            if not frame.data:
                continue  # the client is told nothing of this message: it is only counted
            self.send_blocked = True
            try:
                async with asyncio.timeout(self.limits.write_timeout_s):
                    await send(frame)
            except TimeoutError:
                self.terminate(
                    CLOSE_POLICY_VIOLATION,
                    "write timeout",
                    f"the client read nothing for {self.limits.write_timeout_s:g} s",
                    "write_timeout",
                )
                return False
            except (ConnectionError, OSError):
                self.gone = True
                return False
            finally:
                self.send_blocked = False

    # -- world -> session --------------------------------------------------------------

    def receive(self, data: bytes | str) -> None:
        """What the client sent: queued in order, then fed while the session has room."""
        if isinstance(data, bytes):
            if data:
                self.last_input = self._loop.time()
            pieces: list[bytes | str] = [
                data[offset : offset + BACKLOG_PIECE_BYTES]
                for offset in range(0, len(data), BACKLOG_PIECE_BYTES)
            ]
        else:
            pieces = [data]
        for piece in pieces:
            self.backlog.append(piece)
            self._backlog_bytes += len(piece)
        self.drain_backlog()

    def end_input(self) -> None:
        """The client ended its input (closed its side): it ends after the backlog."""
        self.input_ended = True
        self.drain_backlog()

    def charge(self, nbytes: int) -> float:
        """One read of ``nbytes``: how long to wait before the next read (input pacing)."""
        wait_s = self._pacer.charge(self._loop.time(), nbytes)
        if wait_s > 0:
            if self._pacer.waits == 1:
                self.log.info(
                    "session %s sends faster than %g messages or %g bytes a second: read paced",
                    self.session.session_id,
                    self._pacer.limits.max_messages_per_s,
                    self._pacer.limits.max_bytes_per_s,
                )
            self.metrics.input_paced_seconds_total.inc(wait_s)
        return wait_s

    def drain_backlog(self) -> None:
        while (
            self.backlog
            and self.session.pending_finals < self.limits.max_pending_finals
            and not self.closing
        ):
            item = self.backlog.popleft()
            self._backlog_bytes -= len(item)
            self._feed(item)
        if self.input_ended and not self.backlog and not self.closing:
            if self._end_of_input is not None:
                self._end_of_input()
            self.pump()
        has_room = self.backlog_has_room
        if self._backlog_bytes < self.limits.max_backlog_bytes:
            if not has_room.is_set():
                has_room.set()
        elif has_room.is_set():
            has_room.clear()

    def _feed(self, item: bytes | str) -> None:
        if isinstance(item, bytes):
            self.adapter.receive_bytes(item)
        else:
            errors = self.session.stats.errors
            self.adapter.receive_text(item)
            if self.session.stats.errors == errors:  # junk does not keep a session alive
                self.last_input = self._loop.time()
        self.pump()

    def _observe_latency(
        self, counts: LatencyCounts, histogram: Histogram, audio_ms: float, now: float
    ) -> None:
        """A latency as the user feels it: from when the audio at ``audio_ms`` arrived
        (real-time live sessions only: an unpaced client's audio waits by design)."""
        if self.session.background or not self._real_time:
            return
        arrived = self._arrivals.time_of(audio_ms)
        if arrived is None:
            return
        latency_s = max(0.0, now - arrived)
        counts.record(latency_s * 1000)
        histogram.observe(latency_s)

    def _clear_backlog(self) -> None:
        self.backlog.clear()
        self._backlog_bytes = 0
        self.backlog_has_room.set()

    def _result_from_worker(self, result: DecodeResult) -> None:
        # called in the worker thread; the loop may be gone at shutdown
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_result, result)

    def _on_result(self, result: DecodeResult) -> None:
        if self.gone:
            return
        self.session.decode_finished(result)
        self.pump()
        self.drain_backlog()

    # -- speakers (diarize) ------------------------------------------------------------

    def _pump_speakers(self, speakers: SessionSpeakers) -> None:
        """Closed segments' audio to the speaker worker; a bound on each held final."""
        early = speakers.early_job()  # a head start; refused, the analysis does it all
        if early is not None and self.speaker_worker is not None:
            self.speaker_worker.submit(early, self._speakers_from_worker)
        for job in speakers.jobs_to_submit():
            worker = self.speaker_worker
            if worker is None or not worker.submit(job, self._speakers_from_worker):
                self.metrics.unlabelled_finals_total.labels("refused").inc()
                self.session.speakers_finished(job.segment_id, None)
        diarization = self.session.options.diarization
        for segment_id in speakers.held:
            if segment_id not in self._speaker_deadlines and diarization is not None:
                wait_ms = diarization.max_wait_ms
                if self.session.background:
                    wait_ms = max(wait_ms, diarization.background_max_wait_ms)
                self._speaker_deadlines[segment_id] = self._loop.call_later(
                    wait_ms / 1000, self._speakers_late, segment_id
                )

    def _speakers_from_worker(self, job: SpeakerJob, analysis: SpeakerAnalysis | None) -> None:
        # called in the speaker worker's thread; the loop may be gone at shutdown
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_speakers, job.segment_id, analysis)

    def _on_speakers(self, segment_id: int, analysis: SpeakerAnalysis | None) -> None:
        deadline = self._speaker_deadlines.pop(segment_id, None)
        if deadline is not None:
            deadline.cancel()
        if self.gone:
            return
        if analysis is None:
            self.metrics.unlabelled_finals_total.labels("failed").inc()
        self.session.speakers_finished(segment_id, analysis)
        self.pump()
        self.drain_backlog()

    def _speakers_late(self, segment_id: int) -> None:
        self._speaker_deadlines.pop(segment_id, None)
        if self.gone:
            return
        self.metrics.unlabelled_finals_total.labels("late").inc()
        self.session.speakers_finished(segment_id, None)
        self.pump()
        self.drain_backlog()

    # -- server-side events ------------------------------------------------------------

    def expire(self, code: str, message: str, close_code: int = CLOSE_POLICY_VIOLATION) -> None:
        """A server-side limit: open speech is finished and sent, then the close."""
        self.session.expire(code, message, close_code)
        self.pump()

    def shutdown(self) -> None:
        self.session.shutdown()
        self.pump()

    def terminate(self, close_code: int, reason: str, detail: str, metric: str) -> None:
        """Close now, without waiting for what is queued (the peer is not reading)."""
        if self.terminated.is_set():
            return
        self.log.warning(
            "session %s closed with %d: %s (%s)",
            self.session.session_id,
            close_code,
            reason,
            detail,
        )
        self.metrics.terminated_total.labels(metric).inc()
        self.terminate_code = close_code
        self.terminate_reason = reason
        self.closing = True
        self._clear_backlog()
        self.terminated.set()

    def stop(self) -> None:
        """The transport is done, whatever way it ended (``stop``, a close without it, a
        drop, an error, a timeout): late results have nowhere to go, the worker forgets
        the session's queued jobs, and the adapter frees what it holds now (a compressed
        stream's decoder thread would otherwise wait out its idle timeout)."""
        self.gone = True
        self.worker.drop_session(self.session.session_id)
        for deadline in self._speaker_deadlines.values():
            deadline.cancel()
        self._speaker_deadlines.clear()
        self.adapter.release()
        self.metrics.live.forget(self.session.session_id)

    def _account(self, message: ServerMessage) -> None:
        metrics = self.metrics
        if isinstance(message, SpeechStart):
            self._speech_started[message.segment_id] = (time.perf_counter(), message.start_ms)
        elif isinstance(message, Partial | Final):
            now = time.perf_counter()
            started = self._speech_started.get(message.segment_id)
            if started is not None and message.text:
                metrics.first_partial_seconds.observe(now - started[0])
                del self._speech_started[message.segment_id]
                # without partials the first text is the final, a whole utterance after
                # its start by design: the final's budget counts it, the TTFT's must not
                # (a soak of partials-off sessions read TTFT p95 5 s and refused everyone)
                if self.session.stream.partials:
                    live = metrics.live
                    self._observe_latency(live.ttft, metrics.ttft_seconds, started[1], now)
            if isinstance(message, Final):
                self._speech_started.pop(message.segment_id, None)
                metrics.segments(message.reason).inc()
                live = metrics.live
                self._observe_latency(
                    live.final, metrics.final_latency_seconds, message.end_ms, now
                )
            else:
                metrics.partials_sent_total.inc()
        elif isinstance(message, Error):
            metrics.errors(message.code).inc()
        elif isinstance(message, Notice):
            metrics.notices(message.code).inc()
