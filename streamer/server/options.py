"""What the server is told: :class:`ServerOptions`, and the per-session
:class:`ConnectionLimits` it holds (one owner for each default; every transport reads
the same limits object).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from streamer.core.audio import BYTES_PER_SAMPLE, SAMPLE_RATE
from streamer.core.capacity import CapacityOptions
from streamer.core.pacing import (
    DEFAULT_MAX_BYTES_PER_S,
    DEFAULT_MAX_MESSAGES_PER_S,
    DEFAULT_TOTAL_BYTES_PER_S,
    DEFAULT_TOTAL_MESSAGES_PER_S,
    BudgetLimits,
    PacingLimits,
)
from streamer.core.protocol import StreamOptions
from streamer.core.session import SessionOptions
from streamer.core.vad import DEFAULT_AGGRESSIVENESS
from streamer.errors import ConfigError

WS_MAX_QUEUE_FRAMES = 2  # messages a WebSocket holds for its session before reading pauses
SEGMENT_PCM_BYTES = 7 * SAMPLE_RATE * BYTES_PER_SAMPLE  # one queued final's audio (7 s cap)


def session_memory_bound_bytes(
    max_backlog_bytes: int, max_message_bytes: int, max_outbox_bytes: int, max_pending_finals: int
) -> int:
    """The most client-controlled memory one session can hold (documented in protocol.md).

    Our backlog, the WebSocket's queue plus the slice being parsed, the outbox, and the audio
    of the finals waiting for the model. Kernel socket buffers are not process memory.
    """
    return (
        max_backlog_bytes
        + (WS_MAX_QUEUE_FRAMES + 1) * max_message_bytes
        + max_outbox_bytes
        + (max_pending_finals + 1) * SEGMENT_PCM_BYTES
    )


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits every session enforces, whatever its transport."""

    max_pending_finals: int = 3  # per session; reading pauses while more are waiting
    max_backlog_bytes: int = 1 << 20  # per session, audio read ahead of the model (32 s)
    idle_timeout_s: float = 60.0  # no audio or keepalive for this long ends the session
    max_session_s: float = 4 * 3600.0  # longest session
    close_timeout_s: float = 5.0  # wait this long for the client's close acknowledgement
    max_outbox_bytes: int = 1 << 20  # per session, frames waiting to be sent (else 1008)
    write_timeout_s: float = 15.0  # a client that reads nothing for this long is closed (1008)
    ping_interval_s: float | None = 20.0  # keepalive pings detect vanished clients; None: none
    ping_timeout_s: float | None = 20.0  # reading time a pong may take; None never times out
    # one client is read no faster than this (beyond a 1 s burst): streamer.core.pacing
    max_input_messages_per_s: float = DEFAULT_MAX_MESSAGES_PER_S
    max_input_bytes_per_s: float = DEFAULT_MAX_BYTES_PER_S

    def __post_init__(self) -> None:
        if self.idle_timeout_s <= 0 or self.max_session_s <= 0:
            raise ConfigError("idle_timeout_s and max_session_s must be positive")
        if self.max_pending_finals < 1:
            raise ConfigError("max_pending_finals must be at least 1")
        if self.max_backlog_bytes < 1:
            raise ConfigError("max_backlog_bytes must be positive")
        if self.max_outbox_bytes < 1 or self.write_timeout_s <= 0:
            raise ConfigError("max_outbox_bytes and write_timeout_s must be positive")
        _ = self.pacing  # validates the rates (raises ConfigError)

    @property
    def pacing(self) -> PacingLimits:
        return PacingLimits(self.max_input_messages_per_s, self.max_input_bytes_per_s)


@dataclass(frozen=True)
class FileOptions:
    """The file APIs' limits (``--max-file-jobs``, ``--max-upload-mb``, ...)."""

    max_jobs: int = 4  # files transcribed at once, once received; more are refused with 429
    max_upload_bytes: int = 100 << 20  # a larger upload is refused with 413
    max_duration_s: float = 4 * 3600.0  # longer audio is refused with 400
    allow_url_fetch: bool = False  # Deepgram's {"url": ...} bodies (off: no SSRF)
    allow_url_fetch_private: bool = False  # ... from loopback, link-local, private addresses
    read_timeout_s: float = 30.0  # each piece of an upload within this
    # bodies received at once (a transcription slot is taken once one is complete); one
    # client (address) may hold at most half of them; more are refused with 429
    max_uploads_receiving: int = 16
    upload_min_bytes_per_s: int = 4096  # slower on average (after 10 s) is cut with 408
    upload_deadline_s: float = 900.0  # a body (or a fetch) not complete by then: 408

    def __post_init__(self) -> None:
        if self.max_jobs < 0:
            raise ConfigError("max_file_jobs must not be negative (0 turns the file APIs off)")
        if self.max_upload_bytes < 1 or self.max_duration_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("max_upload_mb, max_file_duration_s and the timeout must be positive")
        if self.max_uploads_receiving < 1 or self.upload_deadline_s <= 0:
            raise ConfigError("max_uploads_receiving and upload_deadline_s must be positive")
        if self.upload_min_bytes_per_s < 0:
            raise ConfigError("upload_min_bytes_per_s must not be negative (0: no minimum)")

    @property
    def max_uploads_receiving_per_client(self) -> int:
        """Bodies one client address may send at once: half of :attr:`max_uploads_receiving`
        (at least one), so that one client's stalled uploads never lock out the others."""
        return max(1, self.max_uploads_receiving // 2)


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and which limits it enforces."""

    host: str = "127.0.0.1"  # interface to bind ("0.0.0.0" for every interface)
    port: int = 8000  # TCP port; 0 picks a free one
    max_sessions: int = 64  # concurrent sessions; more are refused with HTTP 503
    token: str | None = None  # when set, clients must present it (Bearer header or ?token=)
    allowed_origins: tuple[str, ...] = ()  # accepted Origin headers; empty accepts any
    certfile: Path | None = None  # TLS certificate chain (serves wss:// and https://)
    keyfile: Path | None = None  # TLS private key
    max_message_bytes: int = 1 << 20  # largest frame a client may send (else close 1009)
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # per session
    shutdown_grace_s: float = 10.0  # time to finish open segments when stopping
    drain_s: float = 5.0  # drain(): refuse new sessions, serve open ones this long at most
    public_metrics: bool = False  # serve /metrics without the token when one is set
    vad_aggressiveness: int = DEFAULT_AGGRESSIVENESS  # webrtcvad mode 0..3
    default_stream: StreamOptions = field(default_factory=StreamOptions)  # client defaults
    session: SessionOptions = field(default_factory=SessionOptions)  # VAD and partial timing
    web_root: Path | None = None  # folder served at "/"; None serves the bundled web demo
    funasr_port: int | None = None  # FunASR runtime protocol (docs/funasr.md); None: off
    wyoming_port: int | None = None  # Wyoming, Home Assistant's protocol (docs/wyoming.md)
    wyoming_insecure: bool = False  # serve Wyoming (which has no auth) despite a token
    # all clients together are read no faster than this: streamer.core.pacing.InputBudget
    max_total_input_messages_per_s: float = DEFAULT_TOTAL_MESSAGES_PER_S
    max_total_input_bytes_per_s: float = DEFAULT_TOTAL_BYTES_PER_S
    # new sessions are refused while the model would fall behind: streamer.core.capacity
    capacity: CapacityOptions = field(default_factory=CapacityOptions)
    files: FileOptions = field(default_factory=FileOptions)  # the file APIs' limits

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("TLS needs both certfile and keyfile")
        if self.drain_s < 0 or self.shutdown_grace_s < 0:
            raise ConfigError("drain_s and shutdown_grace_s must not be negative")
        if self.token is not None and self.wyoming_port is not None and not self.wyoming_insecure:
            raise ConfigError(
                "Wyoming clients cannot send a token: with --token, serve --wyoming-port only "
                "on a trusted network and confirm with --wyoming-insecure (docs/wyoming.md)"
            )
        _ = self.budget  # validates the total rates (raises ConfigError)

    @property
    def budget(self) -> BudgetLimits:
        return BudgetLimits(self.max_total_input_messages_per_s, self.max_total_input_bytes_per_s)

    @property
    def session_memory_bound_bytes(self) -> int:
        """The most client-controlled memory one session can hold."""
        limits = self.limits
        return session_memory_bound_bytes(
            limits.max_backlog_bytes,
            self.max_message_bytes,
            limits.max_outbox_bytes,
            limits.max_pending_finals,
        )
