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

    def __init__(
        self, limits: PacingLimits, now_s: float, budget: InputBudget | None = None
    ) -> None:
        self.limits = limits
        self.budget = budget  # the server's total, shared with the other connections
        # each rate's virtual clock: when the input read so far would be "due" at that rate
        self._messages_due_s = now_s
        self._bytes_due_s = now_s
        # the same at the connection's fair share of the budget (it waits for these only
        # while the budget's total is over)
        self._fair_messages_due_s = now_s
        self._fair_bytes_due_s = now_s
        self.throttled_s = 0.0  # waits asked for so far (how much the client was slowed)
        self.waits = 0  # how many

    def charge(self, now_s: float, nbytes: int) -> float:
        """One message of ``nbytes`` was read at ``now_s``: how long to wait before the
        next read (0.0 while the client keeps to the rates, or to its burst)."""
        limits = self.limits
        self._messages_due_s = max(self._messages_due_s, now_s) + 1 / limits.max_messages_per_s
        self._bytes_due_s = max(self._bytes_due_s, now_s) + nbytes / limits.max_bytes_per_s
        wait_s = max(self._messages_due_s, self._bytes_due_s) - now_s - limits.burst_s
        budget = self.budget
        if budget is not None:
            fair_messages_per_s, fair_bytes_per_s = budget.fair_share()
            self._fair_messages_due_s = max(self._fair_messages_due_s, now_s) + (
                1 / fair_messages_per_s
            )
            self._fair_bytes_due_s = max(self._fair_bytes_due_s, now_s) + (
                nbytes / fair_bytes_per_s
            )
            if budget.charge(now_s, nbytes) > 0:
                fair_s = max(self._fair_messages_due_s, self._fair_bytes_due_s) - now_s
                fair_wait_s = fair_s - budget.limits.burst_s
                if fair_wait_s > wait_s and fair_wait_s > NO_WAIT_S:
                    budget.throttled_s += fair_wait_s
                    budget.waits += 1
                    wait_s = fair_wait_s
        if wait_s <= NO_WAIT_S:
            return 0.0
        self.throttled_s += wait_s
        self.waits += 1
        return wait_s


DEFAULT_TOTAL_MESSAGES_PER_S = 2000.0  # bench/RESULTS.md, "A total input budget"
DEFAULT_TOTAL_BYTES_PER_S = 8_000_000.0  # 250 real-time 16 kHz int16 streams


@dataclass(frozen=True)
class BudgetLimits(PacingLimits):
    """The most the server reads per second from all its connections together (the
    same limits as one connection's, checked alike; ``burst_s``: how far the total may
    run ahead of each rate)."""

    max_messages_per_s: float = DEFAULT_TOTAL_MESSAGES_PER_S
    max_bytes_per_s: float = DEFAULT_TOTAL_BYTES_PER_S


class InputBudget:
    """The server's total input budget, shared by every connection's :class:`InputPacer`.

    Per-connection limits bound one client; many clients each within theirs can still
    take the event loop (12 clients of 2-byte frames at 1000 a second each kept
    ``/readyz`` from answering for 36 s). The budget counts what all connections read.
    While the total keeps to its rates (and burst) nobody waits for it; once it is over,
    a connection waits only if it runs ahead of its fair share (the total rate divided by
    the connections open), so the flooders are slowed and a client reading less than its
    share (a real-time stream) is read as before.
    """

    def __init__(self, limits: BudgetLimits, now_s: float, connections: int = 1) -> None:
        self.limits = limits
        self.connections = connections  # open connections: the caller keeps it current
        self._messages_due_s = now_s
        self._bytes_due_s = now_s
        self.throttled_s = 0.0  # waits the budget asked for so far
        self.waits = 0

    def charge(self, now_s: float, nbytes: int) -> float:
        """Count one message of ``nbytes`` read at ``now_s``; how far (seconds) the total
        is beyond its burst (0.0 within it)."""
        limits = self.limits
        self._messages_due_s = max(self._messages_due_s, now_s) + 1 / limits.max_messages_per_s
        self._bytes_due_s = max(self._bytes_due_s, now_s) + nbytes / limits.max_bytes_per_s
        over_s = max(self._messages_due_s, self._bytes_due_s) - now_s - limits.burst_s
        return over_s if over_s > NO_WAIT_S else 0.0

    def fair_share(self) -> tuple[float, float]:
        """One connection's share of the rates: (messages, bytes) per second."""
        n = max(1, self.connections)
        return self.limits.max_messages_per_s / n, self.limits.max_bytes_per_s / n
