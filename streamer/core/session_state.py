"""What a session is told and what it reports (I/O-free): its options, its states and
its counters, beside :class:`~streamer.core.session.Session` (which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from streamer.core import hotwords
from streamer.core.diarization import DiarizationOptions
from streamer.core.partial_window import PartialWindowOptions
from streamer.core.protocol import StreamOptions
from streamer.core.segmenter import SegmenterOptions
from streamer.core.session_speakers import KnownSpeaker, SessionSpeakers


@dataclass(frozen=True)
class SessionOptions:
    """Server-side settings every session shares."""

    model_name: str = "unknown"  # reported in the ready message
    segmenter: SegmenterOptions = field(default_factory=SegmenterOptions)  # VAD timing
    # re-decode the open segment after this much new audio (its first partial: at onset)
    partial_interval_ms: int = 300
    # a long segment's refreshes decode a bounded trailing window (core/partial_window.py)
    partial_window: PartialWindowOptions = field(default_factory=PartialWindowOptions)
    speculative_finals: bool = True  # decode a pause's final before its endpoint is reached
    max_text_message_bytes: int = 65536  # larger control messages are rejected
    hotwords: hotwords.Hotwords = ()  # the server's (--hotwords), merged with each session's
    # speaker models' settings when the server has them (--diarize-model); None: it has not
    diarization: DiarizationOptions | None = None
    # known voices every diarized session starts with (--speakers DIR): their names
    known_speakers: tuple[KnownSpeaker, ...] = ()

    def speakers_for(
        self, session_id: str, stream: StreamOptions, background: bool
    ) -> SessionSpeakers | None:
        """A diarized stream's speaker side; None without ``diarize`` or speaker models."""
        if not stream.diarize or self.diarization is None:
            return None
        speakers = SessionSpeakers(session_id, stream, self.diarization, background=background)
        for known in self.known_speakers:
            speakers.enrol(known)
        return speakers


class State(Enum):
    CONFIGURING = "configuring"  # no audio yet: config messages allowed
    STREAMING = "streaming"
    STOPPING = "stopping"  # stream ended, waiting for the last finals
    ENDED = "ended"  # end sent (or fatal error): close the connection


@dataclass
class SessionStats:
    audio_samples_in: int = 0  # samples received at the client's rate
    segments: int = 0  # finals sent
    partials_sent: int = 0
    partials_skipped: int = 0  # partial decodes skipped or discarded under load
    errors: int = 0
