"""One accepted WebSocket and its session: reader, writer, keepalive and limits.

The connection moves frames between the socket and a :class:`WireAdapter`, decode jobs
between the adapter's session and the model worker, and results back. It knows no
protocol: what a frame means is the adapter's business.

Back-pressure and liveness
--------------------------
While a session has ``max_pending_finals`` finals waiting for the model, what the
client sends waits in a backlog; once the backlog holds ``max_backlog_bytes`` the
reader stops reading, websockets stops reading the socket once its own queue of
:data:`WS_MAX_QUEUE_FRAMES` frames is full, and TCP pushes back on the client. Memory
per session is therefore bounded by :func:`session_memory_bound_bytes`. A pong or close
frame the client sent after that audio cannot be read before the audio ahead of it, so
liveness never depends on reading it:

* the keepalive (our own, not websockets') counts a pong as late only for the time the
  reader was really waiting on the socket; time paused by our own back-pressure does not
  count, so a live client is never closed because the server is slow;
* pings are still written while reading is paused, so a peer that reset or closed its
  socket is seen on the next write (within one ping interval), and ``TCP_USER_TIMEOUT``
  lets the kernel drop a peer whose host vanished (its ACKs stop);
* what the server sends cannot pile up: the outbox holds at most ``max_outbox_bytes``
  and every send must complete within ``write_timeout_s``, else the session is closed
  with 1008 and its slot freed (a client that does not read);
* closing never waits on a peer: every close is bounded by ``close_timeout_s``, after
  which the transport is aborted.

Pacing: a client is read no faster than ``pacing`` allows (frames and bytes per second,
:mod:`streamer.core.pacing`); past its burst the reader waits before its next read, a
pause counted like back-pressure's, so one client flooding tiny frames cannot take the
event loop from the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections import deque
from collections.abc import Awaitable
from typing import cast
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from streamer.core import protocol
from streamer.core.audio import BYTES_PER_SAMPLE
from streamer.core.jobs import DecodeResult
from streamer.core.pacing import InputBudget, InputPacer
from streamer.core.protocol import Error, Final, Partial, ServerMessage, SpeechStart
from streamer.core.session import State
from streamer.core.wire import OutFrame, WireAdapter
from streamer.errors import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
    ProtocolError,
    close_code_for,
)
from streamer.model.pool import WorkerPool
from streamer.model.worker import ModelWorker
from streamer.server.admission import Admission, expire_for_failure
from streamer.server.http import Endpoint
from streamer.server.metrics import Metrics
from streamer.server.options import ConnectionLimits

logger = logging.getLogger(__name__)

BACKLOG_PIECE_BYTES = 32000  # backlogged audio is fed to the session in 1 s pieces (16 kHz)
MAX_OUTSTANDING_PINGS = 64  # unanswered pings tracked per connection (the oldest decides)


def note_paced(
    pacer: InputPacer,
    wait_s: float,
    session_id: str,
    log: logging.LoggerAdapter[logging.Logger],
    metrics: Metrics,
) -> None:
    """A reader waits ``wait_s`` for ``pacer``: counted, and logged the first time."""
    if pacer.waits == 1:
        log.info(
            "session %s sends faster than %g messages or %g bytes a second: read paced",
            session_id,
            pacer.limits.max_messages_per_s,
            pacer.limits.max_bytes_per_s,
        )
    metrics.input_paced_seconds_total.inc(wait_s)


class Connection:
    """One socket <-> one adapter. :meth:`run` returns when the connection is over."""

    def __init__(
        self,
        ws: ServerConnection,
        adapter: WireAdapter,
        worker: WorkerPool | ModelWorker,
        metrics: Metrics,
        limits: ConnectionLimits,
        budget: InputBudget | None = None,
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
        self._outbox_bytes = 0
        # Back-pressure: while the session has max_pending_finals finals waiting for the
        # model, what the client sends waits here instead of in the session, and once this
        # backlog reaches max_backlog_bytes the reader stops reading (see the module doc).
        self._backlog: deque[bytes | str] = deque()
        self._backlog_bytes = 0
        self._backlog_has_room = asyncio.Event()
        self._backlog_has_room.set()
        self._paused_since: float | None = None  # loop time the reader paused, if it is
        self._paused_total_s = 0.0  # time paused by back-pressure before _paused_since
        self._last_input = self._loop.time()  # last audio or valid control message
        self._send_blocked = False  # the writer is inside a send
        self._closing = False
        self._terminated = asyncio.Event()  # a limit ended the connection: close it now
        self._terminate_code = CLOSE_POLICY_VIOLATION
        self._terminate_reason = ""
        self._gone = False  # the client disconnected: ignore late worker results
        self._speech_started: dict[int, float] = {}  # segment_id -> perf_counter()
        self._skipped_seen = 0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._pacer = InputPacer(limits.pacing, self._loop.time(), budget)

    # -- glue between the session and the world --------------------------------

    def pump(self) -> None:
        """Move the adapter's frames to the writer and the session's jobs to the worker."""
        for frame in self.adapter.drain():
            if self._terminated.is_set():
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
            self._outbox.put_nowait(frame)
        for job in self.session.jobs_to_submit():
            self.worker.submit(job, self._result_from_worker)
        skipped = self.session.stats.partials_skipped
        if skipped > self._skipped_seen:
            self.metrics.partials_skipped_total.inc(skipped - self._skipped_seen)
            self._skipped_seen = skipped
        if self.adapter.close_code is not None and not self._closing:
            self._closing = True
            self._clear_backlog()
            self._outbox.put_nowait(None)

    def _clear_backlog(self) -> None:
        self._backlog.clear()
        self._backlog_bytes = 0
        self._backlog_has_room.set()

    def _session_has_room(self) -> bool:
        return self.session.pending_finals < self.limits.max_pending_finals

    def _feed(self, item: bytes | str) -> None:
        """Hand one client message (or a piece of one) to the adapter."""
        if isinstance(item, bytes):
            self.adapter.receive_bytes(item)
        else:
            errors = self.session.stats.errors
            self.adapter.receive_text(item)
            if self.session.stats.errors == errors:  # junk does not keep a session alive
                self._last_input = self._loop.time()
        self.pump()

    def _receive(self, data: bytes | str) -> None:
        """A message from the socket: queued in order, then fed while the session has room."""
        if isinstance(data, bytes):
            if data:
                self._last_input = self._loop.time()
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
        has_room = self._backlog_has_room
        if self._backlog_bytes < self.limits.max_backlog_bytes:
            if not has_room.is_set():
                has_room.set()
        elif has_room.is_set():
            has_room.clear()

    def _result_from_worker(self, result: DecodeResult) -> None:
        # called in the worker thread; the loop may be gone at shutdown
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._on_result, result)

    def _on_result(self, result: DecodeResult) -> None:
        if self._gone:
            return
        self.session.decode_finished(result)
        self.pump()
        self._drain_backlog()

    # -- server-side events ----------------------------------------------------

    def expire(self, code: str, message: str, close_code: int = CLOSE_POLICY_VIOLATION) -> None:
        """A server-side limit: open speech is finished and sent, then the close."""
        self.session.expire(code, message, close_code)
        self.pump()

    def shutdown(self) -> None:
        self.session.shutdown()
        self.pump()

    def terminate(self, close_code: int, reason: str, detail: str, metric: str) -> None:
        """Close now, without waiting for what is queued (the peer is not reading)."""
        if self._terminated.is_set():
            return
        self.log.warning(
            "session %s closed with %d: %s (%s)",
            self.session.session_id,
            close_code,
            reason,
            detail,
        )
        self.metrics.terminated_total.labels(metric).inc()
        self._terminate_code = close_code
        self._terminate_reason = reason
        self._closing = True
        self._clear_backlog()
        self._terminated.set()

    def abort(self) -> None:
        """Drop the TCP connection at once (the shutdown grace period is over)."""
        self._gone = True
        self.ws.transport.abort()

    # -- timers ----------------------------------------------------------------

    def _paused_s(self, now: float) -> float:
        """Total time the reader has been paused by back-pressure, up to ``now``."""
        current = now - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_total_s + current

    def _arm_idle(self, delay_s: float) -> None:
        self._idle_timer = self._loop.call_later(delay_s, self._check_idle)

    def _check_idle(self) -> None:
        idle_s = self.limits.idle_timeout_s
        now = self._loop.time()
        waiting_on_client = (
            self._paused_since is None
            and not self._backlog
            and self.session.state in (State.CONFIGURING, State.STREAMING)
        )
        if not waiting_on_client:
            # the client is ahead of us, or the session is finishing: not idle
            self._last_input = now
        left_s = self._last_input + idle_s - now
        if left_s > 0:
            self._arm_idle(left_s)
            return
        if self._send_blocked:
            # what we would send to end the session could not reach the client either
            self.terminate(
                CLOSE_POLICY_VIOLATION,
                "idle timeout",
                f"no input for {idle_s:g} s and not reading",
                "idle_timeout",
            )
            return
        self.expire("idle_timeout", f"no audio or keepalive for {idle_s:g} s")

    # -- tasks -----------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it is over (the adapter must have been started)."""
        _set_tcp_user_timeout(self.ws, self.limits)
        self.pump()
        sid = self.session.session_id
        writer = asyncio.create_task(self._write(), name=f"write-{sid}")
        reader = asyncio.create_task(self._read(), name=f"read-{sid}")
        # noticed even while reading is paused for back-pressure: a dropped connection
        # must free its slot and its queued jobs at once
        closed = asyncio.create_task(self.ws.wait_closed(), name=f"closed-{sid}")
        terminated = asyncio.create_task(self._terminated.wait(), name=f"limit-{sid}")
        keepalive = asyncio.create_task(self._keepalive(), name=f"keepalive-{sid}")
        limit = self._loop.call_later(
            self.limits.max_session_s,
            self.expire,
            "max_session_duration",
            "the session reached the server's maximum duration",
        )
        self._arm_idle(self.limits.idle_timeout_s)
        tasks = {writer, reader, closed, terminated, keepalive}
        try:
            done, _ = await asyncio.wait(
                {writer, reader, closed, terminated}, return_when=asyncio.FIRST_COMPLETED
            )
            if self._terminated.is_set():
                writer.cancel()
                await self._close(self._terminate_code, self._terminate_reason)
            elif writer in done and not writer.cancelled():
                writer.result()  # the session ended and the close handshake was sent
                await asyncio.wait({reader, closed}, timeout=self.limits.close_timeout_s)
            elif reader in done:
                reader.result()
        finally:
            limit.cancel()
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._gone = True  # late worker results have nowhere to go
            for task in tasks:
                task.cancel()
            self.adapter.release()
            self.worker.drop_session(sid)

    async def _close(self, code: int, reason: str) -> None:
        """The close handshake, bounded: a peer that does not read or answer is aborted."""
        try:
            async with asyncio.timeout(self.limits.close_timeout_s):
                await self.ws.close(code, reason[:120])
        except TimeoutError:
            self.log.info("session %s: no close acknowledgement", self.session.session_id)
        finally:
            self.ws.transport.abort()  # no-op once the close handshake has completed

    async def _read(self) -> None:
        try:
            while not self._closing:
                if not self._backlog_has_room.is_set():
                    await self._pause(self._backlog_has_room.wait())
                    continue
                message = await self.ws.recv()
                self._receive(message)
                wait_s = self._pacer.charge(self._loop.time(), len(message))
                if wait_s > 0:
                    note_paced(self._pacer, wait_s, self.session.session_id, self.log, self.metrics)
                    await self._pause(asyncio.sleep(wait_s))
            # keep reading until the peer acknowledges the close
            while True:
                await self.ws.recv()
        except ConnectionClosed:
            pass

    async def _pause(self, until: Awaitable[object]) -> None:
        """Stop reading until ``until`` is done; the time is ours, not the client's (for
        the keepalive and the idle timeout)."""
        self._paused_since = self._loop.time()
        try:
            await until
        finally:
            now = self._loop.time()
            self._paused_total_s += now - self._paused_since
            self._paused_since = None
            self._last_input = now

    async def _write(self) -> None:
        while True:
            frame = await self._outbox.get()
            if frame is None:
                await self._close(self.adapter.close_code or 1000, self.adapter.close_reason)
                return
            self._outbox_bytes -= len(frame.data)
            if frame.message is not None:
                self._account(frame.message)
            self._send_blocked = True
            try:
                async with asyncio.timeout(self.limits.write_timeout_s):
                    await self.ws.send(frame.data, text=frame.text)
            except TimeoutError:
                self.terminate(
                    CLOSE_POLICY_VIOLATION,
                    "write timeout",
                    f"the client read nothing for {self.limits.write_timeout_s:g} s",
                    "write_timeout",
                )
                return
            except ConnectionClosed:
                self._gone = True
                return
            finally:
                self._send_blocked = False

    async def _keepalive(self) -> None:
        """A ping every interval, even while pongs are outstanding (module doc).

        The oldest unanswered ping is late after ``ping_timeout_s`` of *reading* time.
        Pings keep going out while reading is paused: each write would fail on a reset
        peer, and they show the client that this server is alive.
        """
        interval_s, timeout_s = self.limits.ping_interval_s, self.limits.ping_timeout_s
        if interval_s is None:
            return
        outstanding: deque[tuple[asyncio.Future[float], float, float]] = deque(
            maxlen=MAX_OUTSTANDING_PINGS
        )
        try:
            while True:
                await asyncio.sleep(interval_s)
                now = self._loop.time()
                while outstanding and outstanding[0][0].done():
                    outstanding.popleft()
                if outstanding and timeout_s is not None:
                    _, sent, paused_at_ping = outstanding[0]
                    reading_s = (now - sent) - (self._paused_s(now) - paused_at_ping)
                    if reading_s >= timeout_s:
                        self.terminate(
                            CLOSE_INTERNAL_ERROR,
                            "keepalive ping timeout",
                            f"no pong after {reading_s:.1f} s of reading",
                            "keepalive_timeout",
                        )
                        return
                try:
                    async with asyncio.timeout(self.limits.write_timeout_s):
                        pong = cast("asyncio.Future[float]", await self.ws.ping())
                except TimeoutError:
                    self.terminate(
                        CLOSE_POLICY_VIOLATION,
                        "write timeout",
                        f"a ping could not be sent for {self.limits.write_timeout_s:g} s",
                        "write_timeout",
                    )
                    return
                sent = self._loop.time()
                outstanding.append((pong, sent, self._paused_s(sent)))
        except ConnectionClosed:
            pass

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
                metrics.segments(message.reason).inc()
            else:
                metrics.partials_sent_total.inc()
        elif isinstance(message, Error):
            metrics.errors(message.code).inc()


def _set_tcp_user_timeout(ws: ServerConnection, limits: ConnectionLimits) -> None:
    """Let the kernel drop a peer that stops acknowledging data (Linux only)."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock = ws.transport.get_extra_info("socket")
    if option is None or sock is None or limits.ping_interval_s is None:
        return
    timeout_s = limits.ping_interval_s + (limits.ping_timeout_s or limits.ping_interval_s)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, option, int(timeout_s * 1000))


async def serve_websocket(admission: Admission, ws: ServerConnection, endpoint: Endpoint) -> None:
    """Serve one admitted WebSocket of ``endpoint``'s protocol until it is over."""
    assert ws.request is not None  # the handshake is over
    options, metrics = admission.options, admission.metrics
    close_timeout_s = options.limits.close_timeout_s
    if admission.full or admission.shutting_down:
        # lost a race with other handshakes admitted at the same time
        metrics.rejected_total.labels("server_full", endpoint.name).inc()
        try:
            async with asyncio.timeout(close_timeout_s):
                await ws.close(CLOSE_TRY_AGAIN_LATER, "server full")
        except TimeoutError:
            ws.transport.abort()
        return
    session_id = secrets.token_hex(6)
    query = dict(parse_qsl(urlsplit(ws.request.path).query))
    try:
        negotiation = endpoint.negotiation(ws.request, query, options.default_stream)
    except ProtocolError as error:
        logger.info("session %s refused: %s", session_id, error.message)
        metrics.errors_total.labels(error.code).inc()
        message = Error(code=error.code, message=error.message, fatal=True)
        try:
            async with asyncio.timeout(close_timeout_s):
                if endpoint.negotiate is None:  # the others refused it before the upgrade
                    await ws.send(protocol.encode(message), text=True)
                await ws.close(close_code_for(error), error.code)
        except (ConnectionClosed, TimeoutError):
            ws.transport.abort()
        return
    stream = negotiation.stream
    session = admission.new_session(stream, session_id)
    adapter = negotiation.make_adapter(session)
    adapter.start()
    connection = Connection(
        ws, adapter, admission.worker, metrics, options.limits, admission.input_budget
    )
    admission.track(connection, endpoint.name)
    peer = ws.remote_address[0] if ws.remote_address else "?"
    forwarded = ws.request.headers.get("X-Forwarded-For") if ws.request else None
    if forwarded:  # behind a proxy (deploy/nginx.conf); logged, never trusted for limits
        peer = f"{peer} for {forwarded[:200]}"
    connection.log.info(
        "session %s opened from %s (%s: %s)",
        session_id,
        peer,
        endpoint.name,
        ", ".join(f"{k}={v}" for k, v in stream.to_dict().items()),
    )
    try:
        if admission.failure is not None:
            expire_for_failure(connection)
        elif admission.shutting_down:
            connection.shutdown()
        await connection.run()
    except Exception:
        connection.log.exception("session %s failed", session_id)
    finally:
        admission.untrack(connection, endpoint.name)
        stats = session.stats
        connection.log.info(
            "session %s closed: %d segments, %.1f s audio, %d partials (%d skipped), %s",
            session_id,
            stats.segments,
            session.audio_ms / 1000,
            stats.partials_sent,
            stats.partials_skipped,
            "client gone" if session.state is not State.ENDED else f"code {session.close_code}",
        )
