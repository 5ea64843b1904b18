"""How fast one client may make the server read (I/O-free).

Every frame costs the event loop a fixed amount (websockets' parsing, the adapter, the
session's bookkeeping) whatever its size, and every byte of audio costs VAD and framing.
Byte limits alone bound memory, not that work: one client sending 1-byte frames as fast
as it can (about 75,000 a second on loopback) kept the loop busy enough to delay another
client's finals by seconds and ``/readyz`` past a probe's timeout. :class:`InputPacer`
bounds both rates per connection with two token buckets (in their "virtual clock" form):
a client may run ``burst_s`` ahead of each rate, and is then read no faster than the
rate; the connection waits before its next read instead, so TCP pushes back on that
client alone and nothing it sent is lost.

The defaults leave every real client alone: real-time audio is 10-400 frames a second
(a browser's 128-sample worklet frames at 48 kHz are 375) and 16-96 kB a second; a file
streamed unpaced is read at up to 1.6 MB/s (50x real time at 16 kHz, int16), faster than
the model decodes it on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamer.errors import ConfigError

DEFAULT_MAX_MESSAGES_PER_S = 1000.0
DEFAULT_MAX_BYTES_PER_S = 1_600_000.0  # 50 s of 16 kHz int16 audio per second
DEFAULT_BURST_S = 1.0
NO_WAIT_S = 1e-6  # waits shorter than this are rounding, not pacing


@dataclass(frozen=True)
class PacingLimits:
    """The most one connection is read per second, and how far ahead it may run."""

    max_messages_per_s: float = DEFAULT_MAX_MESSAGES_PER_S
    max_bytes_per_s: float = DEFAULT_MAX_BYTES_PER_S
    burst_s: float = DEFAULT_BURST_S  # a client may be this far ahead of each rate

    def __post_init__(self) -> None:
        if self.max_messages_per_s <= 0 or self.max_bytes_per_s <= 0:
            raise ConfigError("the input rate limits must be positive")
        if self.burst_s < 0:
            raise ConfigError("burst_s must not be negative")


class InputPacer:
    """What one connection has been read, against :class:`PacingLimits`."""

    def __init__(self, limits: PacingLimits, now_s: float) -> None:
        self.limits = limits
        # each rate's virtual clock: when the input read so far would be "due" at that rate
        self._messages_due_s = now_s
        self._bytes_due_s = now_s
        self.throttled_s = 0.0  # waits asked for so far (how much the client was slowed)
        self.waits = 0  # how many

    def charge(self, now_s: float, nbytes: int) -> float:
        """One message of ``nbytes`` was read at ``now_s``: how long to wait before the
        next read (0.0 while the client keeps to the rates, or to its burst)."""
        limits = self.limits
        self._messages_due_s = max(self._messages_due_s, now_s) + 1 / limits.max_messages_per_s
        self._bytes_due_s = max(self._bytes_due_s, now_s) + nbytes / limits.max_bytes_per_s
        wait_s = max(self._messages_due_s, self._bytes_due_s) - now_s - limits.burst_s
        if wait_s <= NO_WAIT_S:
            return 0.0
        self.throttled_s += wait_s
        self.waits += 1
        return wait_s
