"""The Wyoming port (``--wyoming-port``; the convention is 10300): plain TCP, no WebSocket.

:class:`WyomingListener` accepts connections with the main server's admission rules and
``--max-sessions``; :class:`WyomingConnection` moves one socket's bytes through a
:class:`~streamer.core.compat.wyoming.WyomingAdapter`, decode jobs to the shared worker
and results back through the same :class:`~streamer.server.pump.SessionPump` as the
WebSocket connections, so with their guarantees: bounded reads (the parser's line, data
and payload limits, and a read-ahead backlog beyond which the socket is not read, so TCP
pushes back), a bounded outbox and ``--write-timeout-s`` (a client that does not read is
closed), input pacing, an idle timeout and a maximum duration.
``docs/wyoming.md`` is the user's page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

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
from streamer.core.pacing import InputBudget
from streamer.core.session import State
from streamer.core.wire import OutFrame
from streamer.errors import ProtocolError
from streamer.model.serving.pool import WorkerPool
from streamer.model.serving.worker import ModelWorker
from streamer.server.admission import Admission
from streamer.server.metrics import Metrics
from streamer.server.options import ConnectionLimits
from streamer.server.pump import SessionPump

logger = logging.getLogger(__name__)

READ_BYTES = 64 * 1024  # one read from the socket
# a connection has no session (no --max-sessions slot) until it sends something; one that
# sends nothing this long is closed: a port scan, a TCP health check, a client that hangs
FIRST_BYTES_TIMEOUT_S = 10.0
# a refused connection is still answered describe/ping, and read until it closes, this long
REFUSAL_LINGER_S = 5.0


class WyomingConnection:
    """One TCP connection <-> one :class:`SessionPump`. :meth:`run` returns when it is
    over: the pump's limits (pending-finals gate and bounded backlog, bounded outbox,
    ``--write-timeout-s``, input pacing) hold as on a WebSocket."""

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
        self.session = adapter.session
        self.limits = limits
        self.log = logging.LoggerAdapter(logger, {"session_id": self.session.session_id})
        self.pump = SessionPump(
            adapter,
            worker,
            metrics,
            limits,
            end_of_input=adapter.end_of_input,
            log=self.log,
            budget=budget,
        )
        self._loop = asyncio.get_running_loop()
        self._first_bytes = first_bytes  # what the listener read before the session

    def expire(self, code: str, message: str, close_code: int | None = None) -> None:
        """A server-side limit or a model failure (TCP has no close code: it is unused)."""
        del close_code
        self.session.expire(code, message)
        self.pump.pump()

    def shutdown(self) -> None:
        self.pump.shutdown()

    def abort(self) -> None:
        """Drop the connection now (the server's grace period is over)."""
        self.pump.gone = True
        self.writer.transport.abort()

    # -- tasks -------------------------------------------------------------------------

    async def run(self) -> None:
        pump = self.pump
        pump.pump()
        if self._first_bytes:
            pump.receive(self._first_bytes)
        sid = self.session.session_id
        writer = asyncio.create_task(self._write(), name=f"wyoming-write-{sid}")
        reader = asyncio.create_task(self._read(), name=f"wyoming-read-{sid}")
        terminated = asyncio.create_task(pump.terminated.wait(), name=f"wyoming-limit-{sid}")
        limit = self._loop.call_later(
            self.limits.max_session_s,
            self.expire,
            "max_session_duration",
            "the session reached the server's maximum duration",
        )
        try:
            done, _ = await asyncio.wait(
                {writer, reader, terminated}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done - {terminated}:
                task.result()
            input_over = self.session.state is State.STOPPING or (pump.input_ended and pump.backlog)
            if not pump.terminated.is_set() and writer not in done:
                if pump.closing or input_over:
                    # The input is over (the client may have half-closed, after
                    # audio-stop or instead of it): deliver the transcript. The worker
                    # answers every final (the backlog then drains); writes time out.
                    await asyncio.wait({writer, terminated}, return_when=asyncio.FIRST_COMPLETED)
                    if writer.done():
                        writer.result()
        finally:
            limit.cancel()
            client_gone = pump.gone or pump.terminated.is_set()
            pump.gone = True  # before: a late result has nowhere to go now
            for task in (writer, reader, terminated):
                task.cancel()
            await asyncio.wait({writer, reader, terminated})  # the reader's read is over
            pump.stop()
            if not client_gone:
                await linger_close(self.reader, self.writer, self.limits.close_timeout_s)
            if not self.writer.is_closing():
                self.writer.transport.abort()

    async def _read(self) -> None:
        idle_s = self.limits.idle_timeout_s
        pump = self.pump
        while not pump.closing:
            await pump.backlog_has_room.wait()
            if pump.closing:
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
                pump.end_input()  # ends a started stream once its audio is in
                return
            pump.receive(data)
            wait_s = pump.charge(len(data))
            if wait_s > 0:
                await asyncio.sleep(wait_s)

    async def _send(self, frame: OutFrame) -> None:
        self.writer.write(frame.data)
        await self.writer.drain()

    async def _write(self) -> None:
        # returns after the last event: run() closes (a FIN after it, not an RST)
        await self.pump.write_all(self._send)


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
