"""One accepted WebSocket and its session: reader, writer, keepalive and limits.

The connection reads the socket's frames into a :class:`~streamer.server.pump.SessionPump`
(which owns the adapter, the backlog, the outbox, the jobs and results, and the
accounting, as for every transport) and writes what the pump gives it; its own part is
what is WebSocket's: the keepalive, the close handshake, the idle timer. It knows no
protocol: what a frame means is the adapter's business.

Back-pressure and liveness
--------------------------
While a session has ``max_pending_finals`` finals waiting for the model, what the
client sends waits in a backlog; once the backlog holds ``max_backlog_bytes`` the
reader stops reading, the :class:`~streamer.server.websocket.WebSocket` stops reading
the socket once :data:`WS_MAX_QUEUE_FRAMES` messages wait in its queue, and TCP pushes
back on the client. Memory
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
from collections import deque
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl, urlsplit

from websockets.exceptions import ConnectionClosed

from streamer.core import protocol
from streamer.core.pacing import InputBudget
from streamer.core.protocol import Error
from streamer.core.session import State
from streamer.core.wire import OutFrame, WireAdapter
from streamer.errors import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
    ProtocolError,
    close_code_for,
)
from streamer.model.serving.pool import WorkerPool
from streamer.model.serving.worker import ModelWorker
from streamer.server.admission import Admission, expire_for_failure
from streamer.server.http import Endpoint
from streamer.server.metrics import Metrics
from streamer.server.options import ConnectionLimits
from streamer.server.pump import SessionPump
from streamer.server.websocket import WebSocket

logger = logging.getLogger(__name__)

MAX_OUTSTANDING_PINGS = 64  # unanswered pings tracked per connection (the oldest decides)


class Connection:
    """One WebSocket <-> one :class:`SessionPump`. :meth:`run` returns when it is over."""

    def __init__(
        self,
        ws: WebSocket,
        adapter: WireAdapter,
        worker: WorkerPool | ModelWorker,
        metrics: Metrics,
        limits: ConnectionLimits,
        budget: InputBudget | None = None,
    ) -> None:
        self.ws = ws
        self.session = adapter.session
        self.limits = limits
        self.log = logging.LoggerAdapter(logger, {"session_id": self.session.session_id})
        self.pump = SessionPump(adapter, worker, metrics, limits, log=self.log, budget=budget)
        # called once the session's last message (``end``) is written, before the close
        # handshake: the client may connect again at once, and its slot must be free
        self.on_ended: Callable[[], None] = lambda: None
        self._loop = asyncio.get_running_loop()
        self._paused_since: float | None = None  # loop time the reader paused, if it is
        self._paused_total_s = 0.0  # time paused by back-pressure before _paused_since
        self._paced = False  # the pause under way is input pacing's
        self._idle_timer: asyncio.TimerHandle | None = None

    # -- server-side events ----------------------------------------------------

    def expire(self, code: str, message: str, close_code: int = CLOSE_POLICY_VIOLATION) -> None:
        """A server-side limit: open speech is finished and sent, then the close."""
        self.pump.expire(code, message, close_code)

    def shutdown(self) -> None:
        self.pump.shutdown()

    def abort(self) -> None:
        """Drop the TCP connection at once (the shutdown grace period is over)."""
        self.pump.gone = True
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
        pump = self.pump
        waiting_on_client = (
            (self._paused_since is None or self._paced)
            and not pump.backlog
            and self.session.state in (State.CONFIGURING, State.STREAMING)
        )
        if not waiting_on_client:
            # the client is ahead of us, or the session is finishing: not idle
            pump.last_input = now
        left_s = pump.last_input + idle_s - now
        if left_s > 0:
            self._arm_idle(left_s)
            return
        if pump.send_blocked:
            # what we would send to end the session could not reach the client either
            pump.terminate(
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
        pump = self.pump
        pump.pump()
        sid = self.session.session_id
        writer = asyncio.create_task(self._write(), name=f"write-{sid}")
        reader = asyncio.create_task(self._read(), name=f"read-{sid}")
        # noticed even while reading is paused for back-pressure: a dropped connection
        # must free its slot and its queued jobs at once
        closed = asyncio.create_task(self.ws.wait_closed(), name=f"closed-{sid}")
        terminated = asyncio.create_task(pump.terminated.wait(), name=f"limit-{sid}")
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
            if pump.terminated.is_set():
                writer.cancel()
                await self._close(pump.terminate_code, pump.terminate_reason)
            elif writer in done and not writer.cancelled():
                writer.result()  # the session ended and the close handshake was sent
                await asyncio.wait({reader, closed}, timeout=self.limits.close_timeout_s)
            elif reader in done:
                reader.result()
        finally:
            limit.cancel()
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            for task in tasks:
                task.cancel()
            pump.stop()  # late worker results have nowhere to go

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
        pump = self.pump
        try:
            while not pump.closing:
                if not pump.backlog_has_room.is_set():
                    await self._pause(pump.backlog_has_room.wait())
                    continue
                message = await self.ws.recv()
                pump.receive(message)
                wait_s = pump.charge(len(message))
                if wait_s > 0:
                    await self._pause(asyncio.sleep(wait_s), paced=True)
            # keep reading until the peer acknowledges the close
            while True:
                await self.ws.recv()
        except ConnectionClosed:
            pass

    async def _pause(self, until: Awaitable[object], *, paced: bool = False) -> None:
        """Stop reading until ``until`` is done; the time is ours, not the client's (for
        the keepalive and the idle timeout). A pause for input pacing (``paced``) is the
        client's for the idle timeout: it sent faster than allowed, and only its audio
        and valid messages count as input (junk sent as fast as it can still times out).
        """
        self._paused_since = self._loop.time()
        self._paced = paced
        try:
            await until
        finally:
            now = self._loop.time()
            self._paused_total_s += now - self._paused_since
            self._paused_since = None
            if not paced:
                self.pump.last_input = now

    async def _send(self, frame: OutFrame) -> None:
        try:
            await self.ws.send(frame.data, text=frame.text)
        except ConnectionClosed as closed:
            raise ConnectionResetError("the client is gone") from closed

    async def _write(self) -> None:
        if await self.pump.write_all(self._send):
            self.on_ended()
            adapter = self.pump.adapter
            await self._close(adapter.close_code or 1000, adapter.close_reason)

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
                        self.pump.terminate(
                            CLOSE_INTERNAL_ERROR,
                            "keepalive ping timeout",
                            f"no pong after {reading_s:.1f} s of reading",
                            "keepalive_timeout",
                        )
                        return
                try:
                    async with asyncio.timeout(self.limits.write_timeout_s):
                        pong = await self.ws.ping()
                except TimeoutError:
                    self.pump.terminate(
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


def _set_tcp_user_timeout(ws: WebSocket, limits: ConnectionLimits) -> None:
    """Let the kernel drop a peer that stops acknowledging data (Linux only)."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock = ws.transport.get_extra_info("socket")
    if option is None or sock is None or limits.ping_interval_s is None:
        return
    timeout_s = limits.ping_interval_s + (limits.ping_timeout_s or limits.ping_interval_s)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, option, int(timeout_s * 1000))


async def serve_websocket(admission: Admission, ws: WebSocket, endpoint: Endpoint) -> None:
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
    tracked = True

    def release() -> None:  # at `end` (Connection.on_ended), else when the connection is over
        nonlocal tracked
        if tracked:
            tracked = False
            admission.untrack(connection, endpoint.name)

    connection.on_ended = release
    peer = ws.remote_address[0] if ws.remote_address else "?"
    forwarded = ws.request.headers.get("X-Forwarded-For") if ws.request else None
    if forwarded:  # behind a proxy (deploy/nginx.conf); logged, never trusted for limits
        peer = f"{peer} for {forwarded[:200]}"
    connection.log.info(
        "session %s opened from %s (%s: %s)",
        session_id,
        peer,
        endpoint.name,
        ", ".join(f"{k}={v}" for k, v in stream.log_fields().items()),
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
        release()
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
