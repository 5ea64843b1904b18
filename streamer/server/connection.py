"""One accepted WebSocket and its session: reader, writer and back-pressure.

The connection moves frames between the socket and a :class:`WireAdapter`, decode jobs
between the adapter's session and the model worker, and results back. It knows no
protocol: what a frame means is the adapter's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from streamer.core.audio import BYTES_PER_SAMPLE
from streamer.core.jobs import DecodeResult
from streamer.core.protocol import Error, Final, Partial, ServerMessage, SpeechStart
from streamer.core.session import State
from streamer.core.wire import OutFrame, WireAdapter
from streamer.model.worker import ModelWorker
from streamer.server.metrics import Metrics

logger = logging.getLogger(__name__)

BACKLOG_PIECE_BYTES = 32000  # backlogged audio is fed to the session in 1 s pieces (16 kHz)


@dataclass(frozen=True)
class ConnectionLimits:
    """The per-connection limits a connection enforces (from the server's options)."""

    max_pending_finals: int  # per session; client input waits in the backlog beyond this
    max_backlog_bytes: int  # client input held back; reading the socket pauses beyond this
    idle_timeout_s: float  # no audio or keepalive for this long ends the session
    max_session_s: float  # longest session
    close_timeout_s: float  # wait this long for the client's close acknowledgement


class Connection:
    """One socket <-> one adapter. :meth:`run` returns when the connection is over."""

    def __init__(
        self,
        ws: ServerConnection,
        adapter: WireAdapter,
        worker: ModelWorker,
        metrics: Metrics,
        limits: ConnectionLimits,
    ) -> None:
        self.ws = ws
        self.adapter = adapter
        self.session = adapter.session
        self.worker = worker
        self.metrics = metrics
        self.limits = limits
        self.log = logging.LoggerAdapter(logger, {"session_id": self.session.session_id})
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[OutFrame | None] = asyncio.Queue()
        # Back-pressure: while the session has max_pending_finals finals waiting for the
        # model, what the client sends waits here instead of in the session, and once this
        # backlog reaches max_backlog_bytes the reader stops reading the socket. Reading
        # goes on until then, so keepalive pongs keep flowing while a fast client waits.
        self._backlog: deque[bytes | str] = deque()
        self._backlog_bytes = 0
        self._backlog_has_room = asyncio.Event()
        self._backlog_has_room.set()
        self._closing = False
        self._gone = False  # the client disconnected: ignore late worker results
        self._speech_started: dict[int, float] = {}  # segment_id -> perf_counter()
        self._skipped_seen = 0

    # -- glue between the session and the world --------------------------------

    def pump(self) -> None:
        """Move the adapter's frames to the writer and the session's jobs to the worker."""
        for frame in self.adapter.drain():
            self._outbox.put_nowait(frame)
        for job in self.session.jobs_to_submit():
            self.worker.submit(job, self._result_from_worker)
        skipped = self.session.stats.partials_skipped
        if skipped > self._skipped_seen:
            self.metrics.partials_skipped_total.inc(skipped - self._skipped_seen)
            self._skipped_seen = skipped
        if self.adapter.close_code is not None and not self._closing:
            self._closing = True
            self._backlog.clear()
            self._backlog_bytes = 0
            self._backlog_has_room.set()
            self._outbox.put_nowait(None)

    def _session_has_room(self) -> bool:
        return self.session.pending_finals < self.limits.max_pending_finals

    def _feed(self, item: bytes | str) -> None:
        """Hand one client message (or a piece of one) to the adapter."""
        if isinstance(item, bytes):
            self.adapter.receive_bytes(item)
        else:
            self.adapter.receive_text(item)
        self.pump()

    def _receive(self, data: bytes | str) -> None:
        """A message from the socket: queued in order, then fed while the session has room."""
        if isinstance(data, bytes):
            rate = self.session.stream.sample_rate
            self.metrics.audio_seconds_total.inc(len(data) / BYTES_PER_SAMPLE / rate)
            pieces: list[bytes | str] = [
                data[offset : offset + BACKLOG_PIECE_BYTES]
                for offset in range(0, len(data), BACKLOG_PIECE_BYTES)
            ]
        else:
            pieces = [data]
        for piece in pieces:
            self._backlog.append(piece)
            self._backlog_bytes += len(piece)
        self._drain_backlog()

    def _drain_backlog(self) -> None:
        while self._backlog and self._session_has_room() and not self._closing:
            item = self._backlog.popleft()
            self._backlog_bytes -= len(item)
            self._feed(item)
        if self._backlog_bytes < self.limits.max_backlog_bytes:
            self._backlog_has_room.set()
        else:
            self._backlog_has_room.clear()

    def _result_from_worker(self, result: DecodeResult) -> None:
        # called in the worker thread
        self._loop.call_soon_threadsafe(self._on_result, result)

    def _on_result(self, result: DecodeResult) -> None:
        if self._gone:
            return
        self.session.decode_finished(result)
        self.pump()
        self._drain_backlog()

    # -- server-side events ----------------------------------------------------

    def expire(self, code: str, message: str) -> None:
        self.session.expire(code, message)
        self.pump()

    def shutdown(self) -> None:
        self.session.shutdown()
        self.pump()

    # -- tasks -----------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it is over (the adapter must have been started)."""
        self.pump()
        sid = self.session.session_id
        writer = asyncio.create_task(self._write(), name=f"write-{sid}")
        reader = asyncio.create_task(self._read(), name=f"read-{sid}")
        # noticed even while reading is paused for back-pressure: a dropped connection
        # must free its slot and its queued jobs at once
        closed = asyncio.create_task(self.ws.wait_closed(), name=f"closed-{sid}")
        limit = self._loop.call_later(
            self.limits.max_session_s,
            self.expire,
            "max_session_duration",
            "the session reached the server's maximum duration",
        )
        try:
            done, _ = await asyncio.wait(
                {writer, reader, closed}, return_when=asyncio.FIRST_COMPLETED
            )
            if writer in done and not writer.cancelled():
                writer.result()  # the session ended and the close handshake was sent
                await asyncio.wait({reader, closed}, timeout=self.limits.close_timeout_s)
            elif reader in done:
                reader.result()
        finally:
            limit.cancel()
            self._gone = True  # late worker results have nowhere to go
            for task in (writer, reader, closed):
                task.cancel()
            self.worker.drop_session(sid)

    async def _read(self) -> None:
        session = self.session
        idle_s = self.limits.idle_timeout_s
        try:
            while not self._closing:
                await self._backlog_has_room.wait()
                if self._closing:
                    break
                timeout = idle_s if session.state in (State.CONFIGURING, State.STREAMING) else None
                try:
                    async with asyncio.timeout(timeout):
                        data = await self.ws.recv()
                except TimeoutError:
                    self.expire("idle_timeout", f"no audio or keepalive for {idle_s:g} s")
                    continue
                self._receive(data)
            # keep reading until the peer acknowledges the close
            while True:
                await self.ws.recv()
        except ConnectionClosed:
            pass

    async def _write(self) -> None:
        while True:
            frame = await self._outbox.get()
            if frame is None:
                await self.ws.close(
                    self.adapter.close_code or 1000, self.adapter.close_reason[:120]
                )
                return
            if frame.message is not None:
                self._account(frame.message)
            try:
                await self.ws.send(frame.data, text=frame.text)
            except ConnectionClosed:
                self._gone = True
                return

    def _account(self, message: ServerMessage) -> None:
        metrics = self.metrics
        if isinstance(message, SpeechStart):
            self._speech_started[message.segment_id] = time.perf_counter()
        elif isinstance(message, Partial | Final):
            started = self._speech_started.get(message.segment_id)
            if started is not None and message.text:
                metrics.first_partial_seconds.observe(time.perf_counter() - started)
                del self._speech_started[message.segment_id]
            if isinstance(message, Final):
                self._speech_started.pop(message.segment_id, None)
                metrics.segments_total.labels(message.reason).inc()
            else:
                metrics.partials_sent_total.inc()
        elif isinstance(message, Error):
            metrics.errors_total.labels(message.code).inc()
