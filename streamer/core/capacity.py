"""Whether the model keeps up with the sessions it serves (I/O-free).

A server that admits every session until ``--max-sessions`` degrades every session
together once the model falls behind: measured on 2 cores with random:small int8, one
real-time client's finals came in about a second, eight clients' in 8-16 s each, and
``/readyz`` said ``ready`` throughout. :class:`CapacityEstimator` decides instead, from
what the workers measured, whether one more session can be served without the admitted
ones losing their real-time latency; the server refuses new sessions while it says
``saturated`` (and ``/readyz`` answers 503), and admits again when it recovers.

It is fed, a few times a second, a :class:`LoadSample`: the workers' cumulative time
spent decoding finals, the age of the oldest final still waiting in a queue, and the
sessions open. From those it knows:

* **lagging**: a final has waited longer than ``max_final_lag_ms`` (the model is behind
  now; the sessions' partials are already being shed, since the worker keeps one per
  session and decodes finals first);
* **final load**: the share of the workers' time the finals took over the last
  ``window_s``. Every admitted session costs about the same on average, so with ``n``
  sessions one more would take the load to ``load * (n + 1) / n``; past ``max_final_load``
  the finals of the sessions already admitted would start to queue behind each other.

Partials are not counted: they are best effort (one pending per session, replaced by
newer ones, dropped when a final comes) and only ever use the time the finals leave.

Once saturated, the estimator says so until both signals are below ``recover_ratio``
of their limits: a session ending, or speech pausing, does not flap the answer. Time is
whatever clock the caller passes (seconds); nothing here reads one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from streamer.errors import ConfigError

DEFAULT_MAX_FINAL_LAG_MS = 1000.0
DEFAULT_MAX_FINAL_LOAD = 0.25  # bench/RESULTS.md, "Capacity-aware admission"
DEFAULT_WINDOW_S = 15.0
DEFAULT_RECOVER_RATIO = 0.7
MIN_WINDOW_FRACTION = 0.3  # no projection until this much of the window is measured

LAGGING = "lagging"
LOADED = "loaded"


@dataclass(frozen=True)
class CapacityOptions:
    """When the server stops admitting sessions because the model would fall behind."""

    max_final_lag_ms: float = DEFAULT_MAX_FINAL_LAG_MS  # a final queued longer: saturated
    max_final_load: float = DEFAULT_MAX_FINAL_LOAD  # most share of worker time for finals
    window_s: float = DEFAULT_WINDOW_S  # the final load is measured over this long
    recover_ratio: float = DEFAULT_RECOVER_RATIO  # saturated until both are below this x limit
    enabled: bool = True  # False admits up to --max-sessions whatever the load

    def __post_init__(self) -> None:
        if not self.max_final_lag_ms > 0:
            raise ConfigError("max_final_lag_ms must be positive")
        if not 0 < self.max_final_load <= 1:
            raise ConfigError("max_final_load must be in (0, 1]")
        if not self.window_s > 0:
            raise ConfigError("window_s must be positive")
        if not 0 < self.recover_ratio <= 1:
            raise ConfigError("recover_ratio must be in (0, 1]")


@dataclass(frozen=True)
class LoadSample:
    """The workers as seen at one moment."""

    now_s: float  # the caller's clock
    final_decode_ms_total: float  # cumulative time the workers spent decoding finals
    oldest_final_age_ms: float  # how long the oldest queued final has waited (0: none)
    sessions: int  # sessions open
    workers: int = 1  # workers serving (the load is their average)


@dataclass(frozen=True)
class Capacity:
    """The estimator's answer after a sample."""

    saturated: str | None  # LAGGING or LOADED, or None while a session is admitted
    final_load: float  # share of worker time spent on finals over the window
    session_load: float  # of which one session's share, on average
    oldest_final_age_ms: float
    sessions: int  # the sessions open at the sample

    def projected_load(self, sessions: int) -> float:
        """The final load once ``sessions`` (the open ones and a new one) are served."""
        return max(self.final_load, self.session_load * sessions)

    def as_dict(self) -> dict[str, object]:
        return {
            "final_load": round(self.final_load, 3),
            "session_load": round(self.session_load, 3),
            "oldest_final_age_ms": round(self.oldest_final_age_ms),
        }


class CapacityEstimator:
    """Feed it :meth:`observe` a few times a second; ask :meth:`refusal` before admitting."""

    def __init__(self, options: CapacityOptions | None = None) -> None:
        self.options = options or CapacityOptions()
        self._samples: deque[LoadSample] = deque()
        self.current = Capacity(None, 0.0, 0.0, 0.0, 0)
        self.saturations = 0  # how often it became saturated

    def observe(self, sample: LoadSample) -> Capacity:
        """Take one sample; the answer is also :attr:`current`."""
        o = self.options
        self._samples.append(sample)
        while len(self._samples) > 2 and sample.now_s - self._samples[1].now_s >= o.window_s:
            self._samples.popleft()  # keep one sample at or before the window's start
        load, mean_sessions = self._window_load(sample)
        session_load = load / mean_sessions if mean_sessions > 0 else 0.0
        was = self.current.saturated
        oldest_ms, sessions = sample.oldest_final_age_ms, sample.sessions
        reason = self._reason(
            Capacity(None, load, session_load, oldest_ms, sessions), sessions, was
        )
        if reason is not None and was is None:
            self.saturations += 1
        self.current = Capacity(reason, load, session_load, oldest_ms, sessions)
        return self.current

    def refusal(self, sessions: int) -> str | None:
        """Why a new session is refused with ``sessions`` open now (LAGGING, LOADED), or
        None. Sessions admitted since the last sample count at the mean session's cost;
        with none open, the load measured is of sessions gone and refuses nothing."""
        current = self.current
        return self._reason(current, sessions, current.saturated)

    def _reason(self, capacity: Capacity, sessions: int, was: str | None) -> str | None:
        o = self.options
        if not o.enabled:
            return None
        lag_limit = o.max_final_lag_ms
        load_limit = o.max_final_load
        if was is not None:  # hysteresis: recover only well below the limits
            lag_limit *= o.recover_ratio
            load_limit *= o.recover_ratio
        if capacity.oldest_final_age_ms > lag_limit:
            return LAGGING
        if sessions > 0 and capacity.projected_load(sessions + 1) > load_limit:
            return LOADED
        return None

    def _window_load(self, last: LoadSample) -> tuple[float, float]:
        """The finals' share of the workers' time over the window, and the mean number
        of sessions open meanwhile (0.0, 0.0 until enough of the window is measured)."""
        first = self._samples[0]
        span_s = last.now_s - first.now_s
        if span_s < self.options.window_s * MIN_WINDOW_FRACTION:
            return 0.0, 0.0
        busy_ms = max(0.0, last.final_decode_ms_total - first.final_decode_ms_total)
        load = busy_ms / (span_s * 1000 * max(1, last.workers))
        # the sessions that made that load: the mean over the window, weighted by time
        weighted = 0.0
        samples = list(self._samples)
        for before, after in zip(samples, samples[1:], strict=False):
            weighted += before.sessions * (after.now_s - before.now_s)
        return load, weighted / span_s
