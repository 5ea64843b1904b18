"""The seam between a wire protocol and the core session (I/O-free).

A :class:`WireAdapter` owns one :class:`~streamer.core.session.Session` and translates
one wire protocol to and from it: client frames in (:meth:`receive_bytes`,
:meth:`receive_text`), encoded frames out (:meth:`drain`). The server's connection
moves frames between the socket and the adapter, decode jobs between the session and
the worker, and never looks inside a frame. Protocol v1 is :class:`V1Adapter`; the
compatible protocols (Deepgram, OpenAI Realtime, FunASR, Wyoming) are adapters too.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamer.core import protocol
from streamer.core.protocol import ServerMessage
from streamer.core.session import Session


@dataclass(frozen=True)
class OutFrame:
    """One frame for the client, and the core message it came from (for metrics)."""

    data: bytes  # the encoded frame
    text: bool = True  # a text frame (JSON); False sends a binary frame
    message: ServerMessage | None = None  # the core message it translates, if any


class WireAdapter:
    """Base class: protocol v1's behaviour, which adapters override where they differ.

    Call :meth:`start` once, then feed client frames; after every input (and after the
    server feeds the session a decode result or a limit), call :meth:`drain` and send
    what it returns, in order. :attr:`close_code` is set once the connection should
    close after those frames.
    """

    name = "v1"  # the metrics label of this protocol

    def __init__(self, session: Session) -> None:
        self.session = session

    def start(self) -> None:
        self.session.start()

    def receive_bytes(self, data: bytes) -> None:
        self.session.receive_audio(data)

    def receive_text(self, text: str) -> None:
        self.session.receive_text(text)

    def drain(self) -> list[OutFrame]:
        return [
            OutFrame(protocol.encode(message), message=message)
            for message in self.session.messages_to_send()
        ]

    @property
    def close_code(self) -> int | None:
        return self.session.close_code

    @property
    def close_reason(self) -> str:
        return self.session.close_reason


class V1Adapter(WireAdapter):
    """Protocol v1 (``docs/protocol.md``): the session's own messages, as JSON."""
