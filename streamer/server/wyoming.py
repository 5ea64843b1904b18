"""The Wyoming port (``--wyoming-port``; the convention is 10300): plain TCP, no WebSocket.

:class:`WyomingListener` accepts connections with the main server's admission rules and
``--max-sessions``; :class:`WyomingConnection` moves one socket's bytes through a
:class:`~streamer.core.compat.wyoming.WyomingAdapter`, decode jobs to the shared worker
and results back, with the guarantees of the WebSocket connections: bounded reads (the
parser's line, data and payload limits, and a read-ahead backlog beyond which the socket
is not read, so TCP pushes back), an idle timeout, a maximum duration, write timeouts.
``docs/wyoming.md`` is the user's page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from streamer import __version__
from streamer.core.compat.wyoming import (
    EventLimits,
    EventParser,
    WyomingAdapter,
    WyomingEvent,
    WyomingInfo,
    encode_event,
    sessionless_answer,
)
from streamer.core.jobs import DecodeResult
from streamer.core.pacing import InputBudget, InputPacer
from streamer.core.protocol import Error, Final, Partial, ServerMessage
from streamer.core.session import State
from streamer.core.wire import OutFrame
from streamer.errors import ProtocolError
from streamer.model.pool import WorkerPool
from streamer.model.worker import ModelWorker
from streamer.server.admission import Admission
from streamer.server.connection import note_paced
from streamer.server.metrics import Metrics
from streamer.server.options import ConnectionLimits

logger = logging.getLogger(__name__)

READ_BYTES = 64 * 1024  # one read from the socket
# a connection has no session (no --max-sessions slot) until it sends something; one that
# sends nothing this long is closed: a port scan, a TCP health check, a client that hangs
FIRST_BYTES_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 10.0  # a client that reads nothing for this long is dropped
# a refused connection is still answered describe/ping, and read until it closes, this long
REFUSAL_LINGER_S = 5.0
BACKLOG_PIECE_BYTES = 32000  # read-ahead is fed to the adapter in pieces of this size


class WyomingConnection:
    """One TCP connection <-> one adapter. :meth:`run` returns when it is over.

    The same design as :class:`streamer.server.connection.Connection` (which is bound
    to WebSocket frames): input waits in a bounded backlog while the session has
    ``max_pending_finals`` finals queued, and the socket is not read beyond it.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        adapter: WyomingAdapter,
        worker: WorkerPool | ModelWorker,
        metrics: Metrics,
        limits: ConnectionLimits,
        first_bytes: bytes = b"",
        budget: InputBudget | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.adapter = adapter
        self.session = adapter.session
        self.worker = worker
        self.metrics = metrics
        self.limits = limits
        self.log = logging.LoggerAdapter(logger, {"session_id": self.session.session_id})
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[OutFrame | None] = asyncio.Queue()
        self._backlog: deque[bytes] = deque()
        self._backlog_bytes = 0
        self._backlog_has_room = asyncio.Event()
        self._backlog_has_room.set()
        self._closing = False
        # --max-input-bytes-per-s per read (a read holds many events; the byte rate
        # bounds them); the idle timeout does not run while we wait
        self._pacer = InputPacer(limits.pacing, self._loop.time(), budget)
        self._first_bytes = first_bytes  # what the listener read before the session
        self._eof = False  # the client closed its side: the input ends with the backlog
        self._gone = False
        self._audio_ms_seen = 0.0
        self._speech_started: dict[int, float] = {}

    # -- glue --------------------------------------------------------------------------

    def pump(self) -> None:
        for frame in self.adapter.drain():
            self._outbox.put_nowait(frame)
        for job in self.session.jobs_to_submit():
            self.worker.submit(job, self._result_from_worker)
        audio_ms = self.session.audio_ms
        if audio_ms > self._audio_ms_seen:
            self.metrics.audio_seconds_total.inc((audio_ms - self._audio_ms_seen) / 1000)
            self._audio_ms_seen = audio_ms
        if self.adapter.close_code is not None and not self._closing:
            self._closing = True
            self._backlog.clear()
            self._backlog_bytes = 0
            self._backlog_has_room.set()
            self._outbox.put_nowait(None)

    def _receive(self, data: bytes) -> None:
        for offset in range(0, len(data), BACKLOG_PIECE_BYTES):
            piece = data[offset : offset + BACKLOG_PIECE_BYTES]
            self._backlog.append(piece)
            self._backlog_bytes += len(piece)
        self._drain_backlog()

    def _drain_backlog(self) -> None:
        while (
            self._backlog
            and self.session.pending_finals < self.limits.max_pending_finals
            and not self._closing
        ):
            piece = self._backlog.popleft()
            self._backlog_bytes -= len(piece)
            self.adapter.receive_bytes(piece)
            self.pump()
        if self._eof and not self._backlog and not self._closing:
            self.adapter.end_of_input()
            self.pump()
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

    def expire(self, code: str, message: str, close_code: int | None = None) -> None:
        """A server-side limit or a model failure (TCP has no close code: it is unused)."""
        del close_code
        self.session.expire(code, message)
        self.pump()

    def shutdown(self) -> None:
        self.session.shutdown()
        self.pump()

    def abort(self) -> None:
        """Drop the connection now (the server's grace period is over)."""
        self._gone = True
        self.writer.transport.abort()

    # -- tasks -------------------------------------------------------------------------

    async def run(self) -> None:
        self.pump()
        if self._first_bytes:
            self._receive(self._first_bytes)
        sid = self.session.session_id
        writer = asyncio.create_task(self._write(), name=f"wyoming-write-{sid}")
        reader = asyncio.create_task(self._read(), name=f"wyoming-read-{sid}")
        limit = self._loop.call_later(
            self.limits.max_session_s,
            self.expire,
            "max_session_duration",
            "the session reached the server's maximum duration",
        )
        try:
            done, _ = await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            input_over = self.session.state is State.STOPPING or (self._eof and self._backlog)
            if writer not in done and (self._closing or input_over):
                # The input is over (the client may have half-closed, after audio-stop or
                # instead of it): deliver the transcript. The worker answers every final
                # (the backlog then drains); writes time out.
                await writer
        finally:
            limit.cancel()
            client_gone = self._gone  # before: a late result has nowhere to go now
            self._gone = True
            for task in (writer, reader):
                task.cancel()
            await asyncio.wait({writer, reader})  # the reader's read is over: ours next
            self.worker.drop_session(sid)
            if not client_gone:
                await linger_close(self.reader, self.writer, self.limits.close_timeout_s)
            if not self.writer.is_closing():
                self.writer.transport.abort()

    async def _read(self) -> None:
        idle_s = self.limits.idle_timeout_s
        while not self._closing:
            await self._backlog_has_room.wait()
            if self._closing:
                break
            state = self.session.state
            timeout = idle_s if state in (State.CONFIGURING, State.STREAMING) else None
            try:
                async with asyncio.timeout(timeout):
                    data = await self.reader.read(READ_BYTES)
            except TimeoutError:
                self.expire("idle_timeout", f"no audio for {idle_s:g} s")
                continue
            except ConnectionError:
                return  # the client is gone
            if not data:  # the client closed, or half-closed (after audio-stop or not)
                self._eof = True
                self._drain_backlog()  # ends a started stream once its audio is in
                return
            self._receive(data)
            wait_s = self._pacer.charge(self._loop.time(), len(data))
            if wait_s > 0:
                note_paced(self._pacer, wait_s, self.session.session_id, self.log, self.metrics)
                await asyncio.sleep(wait_s)

    async def _write(self) -> None:
        while True:
            frame = await self._outbox.get()
            if frame is None:
                return  # run() closes: a FIN after the last event, not an RST
            if frame.message is not None:
                self._account(frame.message)
            try:
                self.writer.write(frame.data)
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await self.writer.drain()
            except (ConnectionError, TimeoutError):
                self._gone = True
                return

    def _account(self, message: ServerMessage) -> None:
        metrics = self.metrics
        if isinstance(message, Partial):
            metrics.partials_sent_total.inc()
        elif isinstance(message, Final):
            metrics.segments_total.labels(message.reason).inc()
        elif isinstance(message, Error):
            metrics.errors_total.labels(message.code).inc()


class WyomingListener:
    """Listens on the Wyoming port while the main server runs."""

    name = "wyoming"

    def __init__(self, admission: Admission, port: int) -> None:
        self.admission = admission
        self._requested_port = port
        self._server: asyncio.Server | None = None
        self._open: set[WyomingConnection] = set()
        self._unheard: set[asyncio.StreamWriter] = set()  # connected, nothing sent yet
        self.limits = EventLimits(max_payload_bytes=admission.options.max_message_bytes)

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self, ssl_context: object = None) -> None:
        """Listen (plain TCP: Wyoming has no TLS; ``ssl_context`` is not used)."""
        o = self.admission.options
        self._server = await asyncio.start_server(self._handle, o.host, self._requested_port)
        logger.info("Wyoming protocol on tcp://%s:%d", o.host, self.port)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        for connection in list(self._open):
            connection.abort()
        for writer in list(self._unheard):
            writer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def _refuse(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        info: WyomingInfo,
        code: str,
        message: str,
        first_bytes: bytes,
    ) -> None:
        """No session for this connection, but ``describe`` and ``ping`` still get their
        answers (Home Assistant asks ``describe`` on a connection of its own, also while
        the server is full). The first other event, or REFUSAL_LINGER_S of nothing, gets
        the error; then the connection is half-closed and read until the client closes,
        so the close is a FIN and the error is not destroyed by an RST."""
        parser = EventParser(self.limits)
        refused = False

        def refuse() -> None:
            nonlocal refused
            refused = True
            self.admission.metrics.rejected_total.labels(code, WyomingAdapter.name).inc()
            logger.info("refused a Wyoming connection: %s (%s)", code, message)
            writer.write(encode_event(WyomingEvent("error", {"text": message, "code": code})))

        with contextlib.suppress(ConnectionError, TimeoutError, ProtocolError):
            async with asyncio.timeout(REFUSAL_LINGER_S):
                data = first_bytes or await reader.read(READ_BYTES)
                while data and not refused:
                    for event in parser.feed(data):
                        if (answer := sessionless_answer(event, info)) is not None:
                            writer.write(encode_event(answer))
                        elif not refused:
                            refuse()
                    await writer.drain()
                    if not refused:
                        data = await reader.read(READ_BYTES)
        if not refused and not reader.at_eof():
            refuse()
        await linger_close(reader, writer, REFUSAL_LINGER_S)

    async def _first_bytes(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes:
        """What the client sends first; b"" when it sends nothing for FIRST_BYTES_TIMEOUT_S."""
        self._unheard.add(writer)
        try:
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(FIRST_BYTES_TIMEOUT_S):
                    return await reader.read(READ_BYTES)
            return b""
        finally:
            self._unheard.discard(writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        admission = self.admission
        info = WyomingInfo(model_name=admission.worker.model_name, version=__version__)
        first_bytes = b""
        refusal = admission.refusal()
        if refusal is None:  # admitted, but the session (a slot) waits for the first bytes
            first_bytes = await self._first_bytes(reader, writer)
            if not first_bytes:  # nothing sent: no session was taken, nothing to answer
                logger.debug("a Wyoming connection closed without sending anything")
                writer.close()
                return
            refusal = admission.refusal()  # the server may have filled up meanwhile
        if refusal is not None:
            await self._refuse(reader, writer, info, *refusal, first_bytes)
            return
        session = admission.new_session(admission.options.default_stream)
        adapter = WyomingAdapter(session, info, self.limits)
        adapter.start()
        connection = WyomingConnection(
            reader,
            writer,
            adapter,
            admission.worker,
            admission.metrics,
            admission.options.limits,
            first_bytes,
            admission.input_budget,
        )
        admission.track(connection, WyomingAdapter.name)
        self._open.add(connection)
        peer = writer.get_extra_info("peername")
        connection.log.info(
            "session %s opened from %s (wyoming)", session.session_id, peer[0] if peer else "?"
        )
        started = time.perf_counter()
        try:
            if admission.shutting_down:
                connection.shutdown()
            await connection.run()
        except Exception:
            connection.log.exception("session %s failed", session.session_id)
        finally:
            self._open.discard(connection)
            admission.untrack(connection, WyomingAdapter.name)
            connection.log.info(
                "session %s closed after %.1f s: %d segments, %.1f s audio, %s",
                session.session_id,
                time.perf_counter() - started,
                session.stats.segments,
                session.audio_ms / 1000,
                "client gone" if session.state is not State.ENDED else "ended",
            )


async def linger_close(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float
) -> None:
    """Close after what was written: half-close (FIN), discard what the client still
    sends until it closes or ``timeout_s`` passes, then close. Closing with unread input
    would make the kernel answer with an RST, which can destroy the last events on their
    way (the client then sees ``ConnectionResetError`` instead of the error event)."""
    with contextlib.suppress(ConnectionError, TimeoutError, OSError, RuntimeError):
        async with asyncio.timeout(timeout_s):
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            while await reader.read(READ_BYTES):
                pass
    writer.close()
