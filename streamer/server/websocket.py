"""One WebSocket connection, driven over websockets' documented sans-I/O ``ServerProtocol``.

websockets documents its protocol layer for exactly this use (``docs/howto/sansio.rst``):
bytes go in with ``receive_data``/``receive_eof``, the handshake request and the frames come
out of ``events_received``, and what must be written out of ``data_to_send``. This module
is the asyncio side of it, what :class:`~streamer.server.connection.Connection` reads and
writes through, with the server's reading and writing policies held here by construction:

* what the socket delivered is parsed :data:`READ_SLICE_BYTES` per event-loop callback,
  and only while fewer than ``max_queue`` messages wait for the session: reading is paused
  otherwise, and TCP pushes back on the client (one read of 256 KiB of 2-byte frames would
  otherwise hold the loop for 270 ms: bench/RESULTS.md, "Health probes under floods");
* a write waits while the transport's buffer is full (``pause_writing``): the caller bounds
  that wait (the pump's write timeout);
* pings are answered by the protocol itself; :meth:`WebSocket.ping` returns a future that
  the matching pong (or a later one) resolves with the round trip;
* closing never waits on the peer unbounded: after the close frames the TCP connection is
  closed, and aborted if the peer has not closed it within ``close_timeout_s``.

The opening handshake is the port's: ``route`` answers plain HTTP (a ``Response``) or lets
the upgrade go on (``None``), ``select_subprotocol`` picks a subprotocol, ``process_response``
may replace the answer; then ``handler`` serves the open connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

from websockets.exceptions import ConnectionClosed, ConnectionClosedError
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

logger = logging.getLogger(__name__)

# One callback's parsing: about 1000 frames of the smallest kind (8 bytes on the wire)
# or one 250 ms chunk of 16 kHz PCM.
READ_SLICE_BYTES = 8192
# what data_to_send() returns when the TCP connection must be closed (documented: b"")
END_OF_STREAM = b""

Route = Callable[[Request], Response | None]
ProcessResponse = Callable[[Request, Response], Response]
# the handshake request and the subprotocols its client offers -> the one to echo, if any
SubprotocolChoice = Callable[[Request, Sequence[Subprotocol]], Subprotocol | None]
Handler = Callable[["WebSocket"], Awaitable[None]]


class WebSocket(asyncio.Protocol):
    """One connection: the handshake, then messages in (:meth:`recv`) and out (:meth:`send`),
    pings (:meth:`ping`) and the close (:meth:`close`, :meth:`wait_closed`)."""

    def __init__(
        self,
        handler: Handler,
        *,
        route: Route,
        process_response: ProcessResponse,
        select_subprotocol: SubprotocolChoice,
        max_size_bytes: int,
        max_queue: int,
        close_timeout_s: float,
        open_timeout_s: float,
        server_header: str,
        tasks: set[asyncio.Task[None]],
        malformed: Callable[[], bytes] | None = None,
    ) -> None:
        """``malformed``: the answer, on the wire, to a head websockets cannot parse (it
        closes such a connection unanswered; without ``malformed`` so does this one)."""
        self._handler = handler
        self._route = route
        self._process_response = process_response
        self._select = select_subprotocol
        # messages waiting for the session before reading pauses (named as websockets'
        # connections name their queue's high-water mark)
        self.max_queue_high = max_queue
        self.close_timeout_s = close_timeout_s
        self._open_timeout_s = open_timeout_s
        self._server_header = server_header
        self._tasks = tasks  # the port's handler tasks: shutdown waits for them
        self._malformed = malformed
        self._wrote = False  # something was written (an answer, at least its head)
        self._peer_ended = False  # the client closed its side
        self.protocol = ServerProtocol(
            # a function (ServerProtocol binds it to itself), not a bound method
            select_subprotocol=lambda protocol, offered: self._select_subprotocol(offered),
            max_size=max_size_bytes,
        )
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.request: Request | None = None
        self.remote_address: tuple[str, int] | None = None
        self._held: deque[memoryview] = deque()  # received, not parsed yet
        self._feed_scheduled = False
        self._reading_paused = False
        self._messages: deque[str | bytes] = deque()  # complete messages for recv()
        self._fragments: list[bytes] = []  # a fragmented message under way
        self._fragment_text = False
        self._readable = asyncio.Event()  # a message, or the end, waits for recv()
        self._writable = asyncio.Event()
        self._writable.set()
        self._pings: dict[bytes, tuple[asyncio.Future[float], float]] = {}
        self._ping_count = 0
        self._lost = asyncio.Event()
        self._open_timer: asyncio.TimerHandle | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self.on_lost: Callable[[WebSocket], None] = lambda ws: None  # the port forgets it

    def _select_subprotocol(self, offered: Sequence[Subprotocol]) -> Subprotocol | None:
        assert self.request is not None  # accept() is called with the request
        return self._select(self.request, offered)

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.remote_address = (str(peer[0]), int(peer[1])) if peer else None
        self._open_timer = self._loop.call_later(self._open_timeout_s, self._open_timeout)

    def data_received(self, data: bytes) -> None:
        self._held.append(memoryview(data))
        self._feed()

    def eof_received(self) -> bool | None:
        self._peer_ended = True
        self._feed_all()
        self.protocol.receive_eof()
        self._process()
        return None  # asyncio closes the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._peer_ended = True
        self._feed_all()
        if self._open_timer is not None:
            self._open_timer.cancel()
        if self._close_timer is not None:
            self._close_timer.cancel()
        with contextlib.suppress(EOFError):
            self.protocol.receive_eof()  # the protocol's state is CLOSED from here
        self._process(lost=True)
        for future, _ in self._pings.values():
            if not future.done():
                future.cancel()
        self._pings.clear()
        self._lost.set()
        self._readable.set()
        self._writable.set()
        self.on_lost(self)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- reading -----------------------------------------------------------------------

    def _feed(self) -> None:
        """Parse one slice if the queue has room; schedule the next one."""
        self._feed_scheduled = False
        if self._held and len(self._messages) < self.max_queue_high:
            head = self._held[0]
            if len(head) > READ_SLICE_BYTES:
                self._held[0] = head[READ_SLICE_BYTES:]
                head = head[:READ_SLICE_BYTES]
            else:
                self._held.popleft()
            self.protocol.receive_data(bytes(head))
            self._process()
        if self._held and len(self._messages) < self.max_queue_high and not self._feed_scheduled:
            self._feed_scheduled = True
            self._loop.call_soon(self._feed)
        self._update_reading()

    def _feed_all(self) -> None:
        while self._held:
            self.protocol.receive_data(bytes(self._held.popleft()))
            self._process()

    def _update_reading(self) -> None:
        """Read the socket only while nothing is held and the queue has room."""
        paused = bool(self._held) or len(self._messages) >= self.max_queue_high
        if paused == self._reading_paused or self.transport.is_closing():
            return
        self._reading_paused = paused
        if paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _process(self, *, lost: bool = False) -> None:
        for event in self.protocol.events_received():
            if isinstance(event, Request):
                self._start(event)
            elif isinstance(event, Frame):
                self._on_frame(event)
        self._flush()
        if not lost and self.protocol.close_expected():
            # the close frames are exchanged (or the handshake refused): the peer should
            # close now; after close_timeout_s it is aborted
            self._arm_close_timer()

    def _on_frame(self, frame: Frame) -> None:
        if frame.opcode is Opcode.TEXT or frame.opcode is Opcode.BINARY:
            self._fragment_text = frame.opcode is Opcode.TEXT
            self._fragments = [bytes(frame.data)]
        elif frame.opcode is Opcode.CONT:
            self._fragments.append(bytes(frame.data))
        elif frame.opcode is Opcode.PONG:
            self._on_pong(bytes(frame.data))
            return
        else:
            return  # a ping (the protocol answers it) or a close (the protocol handles it)
        if not frame.fin:
            return
        data = b"".join(self._fragments)
        self._fragments = []
        try:
            message: str | bytes = data.decode() if self._fragment_text else data
        except UnicodeDecodeError:
            self.protocol.fail(1007, "invalid UTF-8")  # RFC 6455 8.1
            return
        self._messages.append(message)
        self._readable.set()

    def _on_pong(self, data: bytes) -> None:
        if data not in self._pings:
            return  # unsolicited, or an answer to a ping already given up
        now = self._loop.time()
        for key in list(self._pings):  # this one, and every older one, is answered
            future, sent = self._pings.pop(key)
            if not future.done():
                future.set_result(now - sent)
            if key == data:
                break

    async def recv(self) -> str | bytes:
        """The next message; raises :class:`ConnectionClosed` once the connection is closed
        and every message before the close was read."""
        while not self._messages:
            if self._lost.is_set():
                raise self._closed_error()
            self._readable.clear()
            await self._readable.wait()
        message = self._messages.popleft()
        if self._held and not self._feed_scheduled:  # room again: parse what waits
            self._feed_scheduled = True
            self._loop.call_soon(self._feed)
        self._update_reading()
        return message

    def _closed_error(self) -> ConnectionClosed:
        try:
            return self.protocol.close_exc
        except AssertionError:  # pragma: no cover - the state is CLOSED once lost
            return ConnectionClosedError(None, None)

    # -- writing -----------------------------------------------------------------------

    def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            if self.transport.is_closing():
                return
            if data == END_OF_STREAM:
                if self.request is None and not self._wrote and not self._peer_ended:
                    self._refuse_malformed()
                # the server closes the TCP connection first (RFC 6455 7.1.1)
                if self.transport.can_write_eof():
                    with contextlib.suppress(OSError, RuntimeError):
                        self.transport.write_eof()
                self.transport.close()
                return
            self._wrote = True
            self.transport.write(data)

    def _refuse_malformed(self) -> None:
        """websockets found no request in the head (not HTTP, or a line it cannot read)
        and ends the connection unanswered: the client is told why first."""
        if self._malformed is not None:
            logger.info("malformed HTTP request from %s: 400", self.remote_address)
            self._wrote = True
            self.transport.write(self._malformed())

    async def send(self, data: str | bytes, *, text: bool | None = None) -> None:
        """One message (text when ``text``, or when ``data`` is a str); waits while the
        transport's buffer is full. Raises :class:`ConnectionClosed` once closing."""
        if self.protocol.state is not State.OPEN:
            await self._closed()
        payload = data.encode() if isinstance(data, str) else data
        if text or (text is None and isinstance(data, str)):
            self.protocol.send_text(payload)
        else:
            self.protocol.send_binary(payload)
        self._flush()
        await self._drain()

    async def ping(self) -> asyncio.Future[float]:
        """Send a ping; the future is the round trip, set when its pong (or a later
        ping's) comes back."""
        if self.protocol.state is not State.OPEN:
            await self._closed()
        self._ping_count += 1
        data = self._ping_count.to_bytes(4, "big")
        future: asyncio.Future[float] = self._loop.create_future()
        self._pings[data] = (future, self._loop.time())
        self.protocol.send_ping(data)
        self._flush()
        await self._drain()
        return future

    async def _drain(self) -> None:
        if not self._writable.is_set():
            await self._writable.wait()
        if self._lost.is_set():
            raise self._closed_error()

    async def _closed(self) -> None:
        """Wait for the end of a closing connection, then raise its ConnectionClosed."""
        await self._lost.wait()
        raise self._closed_error()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """The close handshake: our close frame, the peer's, the TCP close (the caller
        bounds the wait; :attr:`close_timeout_s` aborts a peer that does not close)."""
        if self.protocol.state is State.OPEN:
            self.close_soon(code, reason)
        await self._lost.wait()

    async def wait_closed(self) -> None:
        await self._lost.wait()

    def close_soon(self, code: int, reason: str = "") -> None:
        """Start the close handshake without waiting (the port's shutdown); a connection
        still in its handshake is dropped."""
        if self.protocol.state is State.OPEN:
            self.protocol.send_close(code, reason)  # a close is then expected
            self._flush()
            self._arm_close_timer()
        elif self.protocol.state is State.CONNECTING:
            self.transport.abort()

    def _arm_close_timer(self) -> None:
        """Abort the connection if the peer has not closed within close_timeout_s."""
        if self._close_timer is None:
            self._close_timer = self._loop.call_later(self.close_timeout_s, self.transport.abort)

    # -- the opening handshake -----------------------------------------------------------

    def _open_timeout(self) -> None:
        self._open_timer = None
        if self.protocol.state is State.CONNECTING:
            logger.info("no WebSocket handshake in %g s: closed", self._open_timeout_s)
            self.transport.abort()

    def _start(self, request: Request) -> None:
        if self._open_timer is not None:
            self._open_timer.cancel()
            self._open_timer = None
        self.request = request
        protocol = self.protocol
        try:
            response = self._route(request)
            if response is None:
                response = protocol.accept(request)
            response.headers["Server"] = self._server_header
            response = self._process_response(request, response)
        except Exception:
            logger.exception("answering a WebSocket handshake failed")
            response = protocol.reject(
                http.HTTPStatus.INTERNAL_SERVER_ERROR,
                "Failed to open a WebSocket connection.\nSee server log for more information.\n",
            )
            response.headers["Server"] = self._server_header
        protocol.send_response(response)
        self._flush()
        if protocol.state is State.OPEN:
            task = self._loop.create_task(self._serve(), name="websocket")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self) -> None:
        code = 1000  # the handler returned: a normal close, as websockets' server does
        try:
            await self._handler(self)
        except Exception:
            logger.exception("a WebSocket handler failed")
            code = 1011
        finally:
            if not self._lost.is_set():
                with contextlib.suppress(ConnectionClosed, TimeoutError):
                    async with asyncio.timeout(self.close_timeout_s):
                        await self.close(code)
                if not self._lost.is_set():
                    self.transport.abort()
