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
from streamer.core.containers import PCM, AudioInput, DecoderFactory, container_in_pcm, pcm_refusal
from streamer.core.protocol import ServerMessage, StopMessage
from streamer.core.session import Session, State
from streamer.errors import CLOSE_UNSUPPORTED_DATA, ProtocolError, UndecodableAudio


@dataclass(frozen=True)
class OutFrame:
    """One frame for the client, and the core message it came from (for metrics)."""

    data: bytes  # the encoded frame; empty: nothing is sent, the message is only counted
    text: bool = True  # a text frame (JSON); False sends a binary frame
    message: ServerMessage | None = None  # the core message it translates, if any


def count_only(message: ServerMessage) -> OutFrame:
    """A frame that sends nothing: ``message``, which the protocol has no event for, is
    still counted by the server's metrics (a speech start times the first partial, a
    final is a segment)."""
    return OutFrame(b"", message=message)


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

    def release(self) -> None:
        """The connection is over (whatever way it ended): free what the adapter holds."""

    @property
    def close_code(self) -> int | None:
        return self.session.close_code

    @property
    def close_reason(self) -> str:
        return self.session.close_reason


class V1Adapter(WireAdapter):
    """Protocol v1 (``docs/protocol.md``): the session's own messages, as JSON.

    With the stream option ``encoding`` other than ``pcm_s16le``, binary frames go
    through an :class:`AudioInput` (containers decoded by ``open_decoder``, which the
    server gives) before the session; bytes that are not that encoding end the session
    with ``undecodable_audio`` (close 1003) after the finals of what was decoded.
    """

    def __init__(self, session: Session, open_decoder: DecoderFactory | None = None) -> None:
        super().__init__(session)
        self._open_decoder = open_decoder
        self._input: AudioInput | None = None  # made at the first binary frame

    def receive_bytes(self, data: bytes) -> None:
        stream = self.session.stream
        if self._input is None:
            if stream.encoding == PCM and self.session.state is State.CONFIGURING:
                # the first frame: a recording's container declared PCM would be noise
                found = container_in_pcm(data)
                if found is not None:
                    hint = f"connect with encoding={found} (or encoding=auto)"
                    self._undecodable(pcm_refusal(found, hint))
                    return
            if stream.encoding == PCM or self.session.state is not State.CONFIGURING:
                self.session.receive_audio(data)
                return
            self._input = AudioInput(stream.encoding, stream.sample_rate, self._open_decoder)
        if self.session.state in (State.STOPPING, State.ENDED):
            self.session.receive_audio(data)  # the session says what late audio gets
            return
        try:
            pcm = self._input.push(data)
        except UndecodableAudio as error:
            self._undecodable(error)
            return
        if pcm:
            self.session.receive_audio(pcm)

    def receive_text(self, text: str) -> None:
        if self._input is not None and self.session.state in (State.CONFIGURING, State.STREAMING):
            try:
                stop = isinstance(protocol.parse_client_message(text), StopMessage)
            except ProtocolError:
                stop = False  # the session answers it
            if stop:  # the decoder's tail goes before the end of the stream
                try:
                    pcm = self._input.flush()
                except UndecodableAudio as error:
                    self._undecodable(error)
                    return
                if pcm:
                    self.session.receive_audio(pcm)
        self.session.receive_text(text)

    def _undecodable(self, error: UndecodableAudio) -> None:
        if self._input is not None:
            self._input.close()
        self.session.expire(error.code, error.message, CLOSE_UNSUPPORTED_DATA)

    def release(self) -> None:
        if self._input is not None:
            self._input.close()
