"""WebSocket connections that parse what the socket delivered a slice at a time.

websockets parses all of one socket read at once, in one event-loop callback, however
many frames it holds: a read is up to 256 KiB, which a client sending 2-byte frames fills
with 32768 of them, and parsing those took 270 ms of the loop here (bench/RESULTS.md,
"Health probes under floods"). Every other connection, and every ``/healthz`` probe,
waited that long; the frames also all went into websockets' queue, whatever its
``max_queue`` (2) said.

:class:`SlicedReadConnection` feeds the parser :data:`READ_SLICE_BYTES` per callback and
only while websockets' queue has room: the rest waits (the socket's reading paused) for
the next callback, or until the session reads what is queued. What a client sends is
parsed no faster than the server takes it in, and one callback parses about a thousand
of the smallest frames at most. Nothing is dropped or reordered: at end of stream and when
the connection is lost, what is held is parsed first.
"""

from __future__ import annotations

import asyncio
from collections import deque

from websockets.asyncio.server import ServerConnection

# One callback's parsing: about 1000 frames of the smallest kind (8 bytes on the wire)
# or one 250 ms chunk of 16 kHz PCM.
READ_SLICE_BYTES = 8192


class SlicedReadConnection(ServerConnection):
    """A :class:`ServerConnection` that parses at most :data:`READ_SLICE_BYTES` per
    event-loop callback, and only while its frame queue has room (pass it as ``serve``'s
    ``create_connection``)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._held: deque[memoryview] = deque()  # received, not parsed yet
        self._queue_full = False  # websockets' own flow control: its frame queue is full
        self._reading_paused = False
        self._feed_scheduled = False
        # websockets pauses and resumes the socket itself when its queue fills and drains;
        # reading is paused for either reason, and resumed only when neither holds
        self.recv_messages.pause = self._queue_filled
        self.recv_messages.resume = self._queue_drained

    def data_received(self, data: bytes) -> None:
        self._held.append(memoryview(data))
        self._feed()

    def eof_received(self) -> None:
        self._feed_all()  # the end of the stream comes after everything before it
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._feed_all()  # what arrived before the loss is the client's, as sent
        super().connection_lost(exc)

    def _feed(self) -> None:
        """Parse one slice if the queue has room; schedule the next one."""
        self._feed_scheduled = False
        if self._held and not self._queue_full:
            head = self._held[0]
            if len(head) > READ_SLICE_BYTES:
                self._held[0] = head[READ_SLICE_BYTES:]
                head = head[:READ_SLICE_BYTES]
            else:
                self._held.popleft()
            super().data_received(bytes(head))
        if self._held and not self._queue_full and not self._feed_scheduled:
            self._feed_scheduled = True
            self.loop.call_soon(self._feed)
        self._update_reading()

    def _feed_all(self) -> None:
        while self._held:
            super().data_received(bytes(self._held.popleft()))

    def _queue_filled(self) -> None:
        self._queue_full = True
        self._update_reading()

    def _queue_drained(self) -> None:
        self._queue_full = False
        if self._held and not self._feed_scheduled:
            self._feed_scheduled = True
            self.loop.call_soon(self._feed)
        self._update_reading()

    def _update_reading(self) -> None:
        """Read the socket only while nothing is held and the queue has room."""
        paused = bool(self._held) or self._queue_full
        if paused == self._reading_paused or self.transport.is_closing():
            return
        self._reading_paused = paused
        if paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()


def sliced_reads(connection: type[ServerConnection]) -> type[ServerConnection]:
    """``connection`` (a ServerConnection subclass) with :class:`SlicedReadConnection`'s
    reading underneath its own ``data_received``."""
    if issubclass(connection, SlicedReadConnection):
        return connection
    return type(f"Sliced{connection.__name__}", (connection, SlicedReadConnection), {})
