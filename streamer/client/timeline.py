"""A streamed signal's timeline: the send log, the messages on the signal's clock, and
where a resumed session starts again.

:class:`SessionResult` is what :func:`streamer.client.streaming.stream_file` returns;
:func:`resume_sample` and :func:`shift_message` put a resumed session's messages onto the
timeline of the whole signal.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

from streamer.client.connection import Received
from streamer.core.protocol import End, Final, Partial, Ready, ServerMessage, SpeechStart

__all__ = [
    "ChunkCallback",
    "MessageCallback",
    "SentChunk",
    "SessionResult",
    "Timeline",
    "resume_sample",
    "shift_message",
]


@dataclass(frozen=True)
class SentChunk:
    """One audio frame handed to the connection."""

    end_sample: int  # samples of the signal sent so far (end of this chunk)
    sent_s: float  # time.monotonic() right after the send returned


@dataclass(frozen=True)
class SessionResult:
    """Everything a streamed signal produced, on the signal's timeline."""

    ready: Ready  # the (first) session's ready message
    sample_rate: int  # rate of the samples counted in `sends`
    messages: tuple[Received, ...]  # every server message in arrival order
    sends: tuple[SentChunk, ...]  # the send log
    finals: tuple[Final, ...]  # finals in order (non-empty and empty text alike)
    end: End | None  # the end message (combined over reconnections); None if none came
    started_s: float  # time.monotonic() when connecting began
    finished_s: float  # time.monotonic() when the last message arrived
    reconnects: int = 0  # reconnections made by stream_file

    @property
    def text(self) -> str:
        """The finals' text joined by spaces (empty finals skipped)."""
        return " ".join(f.text for f in self.finals if f.text.strip())

    @property
    def partials(self) -> tuple[Partial, ...]:
        return tuple(r.message for r in self.messages if isinstance(r.message, Partial))

    def sent_time_s(self, sample: int) -> float | None:
        """When the chunk carrying ``sample`` was sent (None if it never was)."""
        for chunk in self.sends:
            if chunk.end_sample > sample:
                return chunk.sent_s
        return None

    def time_to_first_partial_s(self) -> float | None:
        """From sending the audio where the first segment starts to its first result.

        The first result is its first partial, or its final when partials are off.
        """
        for item in self.messages:
            if isinstance(item.message, Partial | Final):
                sample = int(item.message.start_ms * self.sample_rate / 1000)
                sent = self.sent_time_s(sample)
                return None if sent is None else item.arrival_s - sent
        return None

    def final_latencies_s(self) -> list[float]:
        """Per final: arrival minus the send time of the audio at its ``end_ms``."""
        latencies = []
        for item in self.messages:
            if isinstance(item.message, Final):
                sample = max(0, int(item.message.end_ms * self.sample_rate / 1000) - 1)
                sent = self.sent_time_s(sample)
                if sent is not None:
                    latencies.append(item.arrival_s - sent)
        return latencies

    def median_final_latency_s(self) -> float | None:
        latencies = self.final_latencies_s()
        return median(latencies) if latencies else None


def resume_sample(finals: Sequence[Final], sample_rate: int) -> int:
    """The first sample not covered by a final: where a reconnected stream starts again."""
    if not finals:
        return 0
    return max(0, round(max(f.end_ms for f in finals) * sample_rate / 1000))


def shift_message(message: ServerMessage, offset_ms: float, segment_offset: int) -> ServerMessage:
    """``message`` with its times moved by ``offset_ms`` and its segment id by ``segment_offset``.

    Used to put the messages of a resumed session onto the timeline of the whole signal.
    """
    if offset_ms == 0 and segment_offset == 0:
        return message
    if isinstance(message, SpeechStart):
        return dataclasses.replace(
            message,
            segment_id=message.segment_id + segment_offset,
            start_ms=message.start_ms + offset_ms,
        )
    if isinstance(message, Partial | Final):
        return dataclasses.replace(
            message,
            segment_id=message.segment_id + segment_offset,
            start_ms=message.start_ms + offset_ms,
            end_ms=message.end_ms + offset_ms,
        )
    if isinstance(message, End):
        return dataclasses.replace(message, audio_ms=message.audio_ms + offset_ms)
    return message


ChunkCallback = Callable[[int, float], None]  # (end_sample, time.monotonic())
MessageCallback = Callable[[Received], None]


class Timeline:
    """The messages and sends of one signal streamed over one or more sessions.

    Feed it with :meth:`record` (every server message) and :meth:`sent` (every chunk);
    after a lost session call :meth:`resume`, which says where the next session starts,
    and the next session's messages are shifted onto the signal's timeline. Not
    thread-safe: one event loop.
    """

    def __init__(
        self,
        sample_rate: int,
        on_message: MessageCallback | None = None,
        on_chunk_sent: ChunkCallback | None = None,
    ) -> None:
        self.sample_rate = sample_rate
        self.messages: list[Received] = []
        self.sends: list[SentChunk] = []
        self.finals: list[Final] = []
        self.reconnects = 0
        self.offset_sample = 0  # where the current session's audio starts in the signal
        self._on_message = on_message
        self._on_chunk_sent = on_chunk_sent
        self._segment_offset = 0
        self._partials_sent = self._partials_skipped = 0
        self._last_end: End | None = None

    def record(self, item: Received) -> None:
        """A message of the current session, moved onto the signal's timeline."""
        offset_ms = self.offset_sample * 1000 / self.sample_rate
        message = shift_message(item.message, offset_ms, self._segment_offset)
        if isinstance(message, Final):
            self.finals.append(message)
        elif isinstance(message, End):
            self._partials_sent += message.partials_sent
            self._partials_skipped += message.partials_skipped
            self._last_end = message
        shifted = Received(message, item.arrival_s)
        self.messages.append(shifted)
        if self._on_message is not None:
            self._on_message(shifted)

    def sent(self, end_sample: int, sent_s: float) -> None:
        """A chunk of the signal ending at ``end_sample`` was sent at ``sent_s``."""
        self.sends.append(SentChunk(end_sample, sent_s))
        if self._on_chunk_sent is not None:
            self._on_chunk_sent(end_sample, sent_s)

    def resume(self) -> int:
        """Start the next session after the last final; returns its first sample."""
        self.reconnects += 1
        self.offset_sample = resume_sample(self.finals, self.sample_rate)
        self._segment_offset = len(self.finals)
        return self.offset_sample

    def end(self) -> End | None:
        """The sessions' end messages combined (None before the last one came)."""
        if self._last_end is None:
            return None
        return End(
            segments=len(self.finals),
            audio_ms=self._last_end.audio_ms,
            partials_sent=self._partials_sent,
            partials_skipped=self._partials_skipped,
        )

    def result(self, ready: Ready, started_s: float) -> SessionResult:
        return SessionResult(
            ready=ready,
            sample_rate=self.sample_rate,
            messages=tuple(self.messages),
            sends=tuple(self.sends),
            finals=tuple(self.finals),
            end=self.end(),
            started_s=started_s,
            finished_s=self.messages[-1].arrival_s if self.messages else time.monotonic(),
            reconnects=self.reconnects,
        )
