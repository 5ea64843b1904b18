"""Whether one more session keeps the admitted ones within their latency budgets
(I/O-free).

A server that admits every session until ``--max-sessions`` degrades every session
together once the model falls behind: measured on 2 cores with random:small int8, one
real-time client's finals came in about a second, eight clients' in 8-16 s each, and
``/readyz`` said ``ready`` throughout. :class:`CapacityEstimator` decides instead, in
the terms users feel, whether one more session can be served: the admitted sessions'
**final p95** (a final after the last sample of its audio arrived) and **TTFT p95** (the
first words of an utterance after its first sample arrived) must stay within their
budgets (``final_p95_budget_ms``, ``ttft_p95_budget_ms``). The server refuses new
sessions while it says saturated (and ``/readyz`` answers 503), and admits again when it
recovers. Sessions already admitted are never closed.

It is fed, a few times a second, a :class:`LoadSample`: the workers' cumulative time
spent decoding finals (and the finals' audio, squared decode times and queue waits), the
live sessions' latencies (cumulative counts per ``LATENCY_BINS_MS`` bin, from
:mod:`streamer.core.live_latency`), the age of the oldest final still waiting, the
sessions open and how fast the unpaced ones send. One more session is refused when:

* **lagging**: a final has waited longer than ``max_final_lag_ms`` (the model is behind
  now);
* **loaded**: the finals' share ``rho`` of the workers' time over the last ``window_s``,
  plus what one more session would add, would pass ``max_final_load``: the model would
  not keep up however long the budgets. A real-time session costs the finals'
  real-time factor (decode time per second of audio: a session that speaks all the
  time), or the measured mean per session if that is more; sessions admitted within the
  window count at that cost on top of the load measured. A session sending faster than
  real time costs what it sends: its share is in the load measured, at its real audio
  rate, and the refusal says so (:attr:`Capacity.fast_rate`);
* **final_p95** or **ttft_p95**: the p95 measured over the window (at least
  ``MIN_MEASURED`` of them), plus what one more session would add to a final's mean
  wait, would pass its budget; or the projected p95 of a final's queue wait alone would
  pass the final budget. The waits are the queue model's: a final finds the model busy
  with another session's final with probability ``p``, the others' share of the load,
  and then waits about the residual of that decode, ``E[S^2] / 2E[S]``, stretched by
  ``1 / (1 - rho)`` (M/G/1): a mean of ``p * residual / (1 - rho)``, a 95th percentile of
  0 while ``p <= 5 %``, else ``residual / (1 - rho) * ln(p / 5 %)``. One more session adds
  the difference of the mean wait at the load it makes and at the load the latencies
  were measured under (the p95 of a sum is below the sum of the p95s, and the measured
  p95 catches up within the window as the new session speaks). Where the recognizer
  cannot stop a partial's decode for a final (the torch backend, a model process), the
  partials' share of the time counts in ``p`` as well.

Sessions that have gone leave their load and latencies in the window: the load counts
at the share of the sessions open now (:attr:`Capacity.present_load`), and latencies
measured while more than twice the sessions open now were served do not refuse
(:attr:`Capacity.latencies_apply`; the load rule still holds).

So the queue model is an input, not the rule: on 2 cores of an AVX-512 VNNI EPYC with
random:small int8 the finals' wait projection said 115 ms (above the old 100 ms limit)
while the model was busy 3-7 % of the time and the finals' p95 was 600 ms, and seven of
eight clients were refused (issue 31). Other processes on the machine slow the decodes:
the measured latencies show it, and the budgets hold under it. Nothing is refused while
nothing is measured, beyond the load ceiling.

:attr:`Capacity.headroom` is how many more sessions fit by the same rules (the signal an
autoscaler scales on). Once saturated, the estimator says so until the lag and the load
are below ``recover_ratio`` of their limits and the latencies below
``LATENCY_RECOVER_RATIO`` of their budgets: a session ending, or speech pausing, does not
flap the answer. Time is whatever clock the caller passes (seconds); nothing here reads
one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from streamer.core.live_latency import p95_between
from streamer.errors import ConfigError

DEFAULT_MAX_FINAL_LAG_MS = 1000.0
DEFAULT_MAX_FINAL_LOAD = 0.8  # the queue grows without bound as the load nears 1
# the budgets: a real-time client on 2 idle cores (random:small int8) sees final p95
# about 0.6 s and TTFT p95 about 0.35-0.9 s (issue 31); these leave room for load
DEFAULT_FINAL_P95_BUDGET_MS = 1000.0
DEFAULT_TTFT_P95_BUDGET_MS = 1500.0
TAIL = 0.05  # the budgets are on the 95th percentile
# the finals' measured queue waits are counted in these bins (ms; the last one is open)
WAIT_BINS_MS = (10, 25, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)
MIN_MEASURED_FINALS = 20  # fewer waits in the window: their p95 says nothing
DEFAULT_WINDOW_S = 15.0
DEFAULT_RECOVER_RATIO = 0.7
# the latencies are measured in 100 ms bins and include what no load changes (the
# endpoint's silence): a margin of 10 % is what it takes not to flap
LATENCY_RECOVER_RATIO = 0.9
MIN_WINDOW_FRACTION = 0.3  # no projection until this much of the window is measured
MAX_HEADROOM = 256  # headroom is counted up to this many sessions
LATENCY_SESSIONS_SHARE = 0.5  # fewer open than this x the window's mean: see latencies_apply

LAGGING = "lagging"
LOADED = "loaded"
FINAL_P95 = "final_p95"
TTFT_P95 = "ttft_p95"


@dataclass(frozen=True)
class CapacityOptions:
    """When the server stops admitting sessions: the admitted ones' latency budgets."""

    max_final_lag_ms: float = DEFAULT_MAX_FINAL_LAG_MS  # a final queued longer: saturated
    max_final_load: float = DEFAULT_MAX_FINAL_LOAD  # most share of worker time for finals
    # the most p95 of the admitted sessions' final latency and time to first token,
    # measured or projected with one more session
    final_p95_budget_ms: float = DEFAULT_FINAL_P95_BUDGET_MS
    ttft_p95_budget_ms: float = DEFAULT_TTFT_P95_BUDGET_MS
    window_s: float = DEFAULT_WINDOW_S  # the load and latencies are measured over this
    recover_ratio: float = DEFAULT_RECOVER_RATIO  # saturated until below this x limit
    enabled: bool = True  # False admits up to --max-sessions whatever the load

    def __post_init__(self) -> None:
        if not self.max_final_lag_ms > 0:
            raise ConfigError("max_final_lag_ms must be positive")
        if not 0 < self.max_final_load <= 1:
            raise ConfigError("max_final_load must be in (0, 1]")
        if not self.final_p95_budget_ms > 0:
            raise ConfigError("final_p95_budget_ms must be positive")
        if not self.ttft_p95_budget_ms > 0:
            raise ConfigError("ttft_p95_budget_ms must be positive")
        if not self.window_s > 0:
            raise ConfigError("window_s must be positive")
        if not 0 < self.recover_ratio <= 1:
            raise ConfigError("recover_ratio must be in (0, 1]")


@dataclass(frozen=True)
class LiveFigures:
    """What the workers measured of their live work, the figures capacity reads: declared
    here once. A worker counts its own (``model/serving/live_load.py``), a pool sums its
    workers' (:meth:`combined`), and admission passes them on in a :class:`LoadSample`.
    File uploads' jobs are not counted: their wait behind live work is by design."""

    # cumulative time spent decoding live finals (a speculative decode counts as the final
    # it will be)
    final_decode_ms_total: float = 0.0
    oldest_final_age_ms: float = 0.0  # how long the oldest queued final has waited (0: none)
    # cumulative: the live finals decoded, their audio, and their decode times squared (a
    # final's mean wait behind another is E[S^2] / 2E[S])
    finals_total: int = 0
    final_audio_ms_total: float = 0.0
    final_decode_sq_ms_total: float = 0.0
    # cumulative time spent on live partials (a final waits behind one unless it stops it)
    partial_decode_ms_total: float = 0.0
    interruptible: bool = True  # a final stops a partial's decode (else it waits for it)
    partials_interrupted: int = 0  # cumulative: partial decodes stopped so a final went first
    # cumulative: the live finals' queue waits, counted per WAIT_BINS_MS bin (with one more
    # for the waits past the last edge); empty where the worker does not say
    final_waits: tuple[int, ...] = ()

    @staticmethod
    def combined(each: Sequence[LiveFigures]) -> LiveFigures:
        """Several workers' figures as one: sums, the oldest wait, interruptible only
        where every worker is."""
        return LiveFigures(
            final_decode_ms_total=sum(f.final_decode_ms_total for f in each),
            oldest_final_age_ms=max((f.oldest_final_age_ms for f in each), default=0.0),
            finals_total=sum(f.finals_total for f in each),
            final_audio_ms_total=sum(f.final_audio_ms_total for f in each),
            final_decode_sq_ms_total=sum(f.final_decode_sq_ms_total for f in each),
            partial_decode_ms_total=sum(f.partial_decode_ms_total for f in each),
            interruptible=all(f.interruptible for f in each),
            partials_interrupted=sum(f.partials_interrupted for f in each),
            final_waits=tuple(map(sum, zip(*(f.final_waits for f in each), strict=True))),
        )


@dataclass(frozen=True)
class LoadSample:
    """The workers and the live sessions as seen at one moment."""

    now_s: float  # the caller's clock
    sessions: int  # sessions open
    live: LiveFigures = LiveFigures()  # the workers' (summed)
    workers: int = 1  # workers serving (the load is their average)
    # cumulative: the real-time sessions' final latencies and times to first token, per
    # live_latency.LATENCY_BINS_MS bin; empty where nobody measures them
    final_latencies: tuple[int, ...] = ()
    ttft_latencies: tuple[int, ...] = ()
    fast_sessions: int = 0  # sessions sending faster than real time
    fast_rate: float = 0.0  # their audio seconds per second, in all


@dataclass(frozen=True)
class Window:
    """What the workers did over the window."""

    final_load: float = 0.0  # share of worker time spent on finals
    session_load: float = 0.0  # of which one session's share, on average
    rtf: float = 0.0  # finals' decode time per audio time, per worker (0: unknown)
    residual_ms: float = 0.0  # a final's mean wait behind another's decode (0: unknown)
    partial_load: float = 0.0  # share of worker time spent on live partials
    wait_p95_ms: float = 0.0  # the p95 the finals waited (a bin's upper edge; 0: unknown)
    final_p95_ms: float = 0.0  # the p95 of the finals' latency (0: too few to say)
    ttft_p95_ms: float = 0.0  # the p95 of the times to first token (0: too few)
    mean_sessions: float = 0.0  # the sessions open over the window, on average


@dataclass(frozen=True)
class Capacity:
    """The estimator's answer after a sample."""

    saturated: str | None  # LAGGING, LOADED, FINAL_P95 or TTFT_P95; None: admitting
    final_load: float  # share of worker time spent on finals over the window
    session_load: float  # what one more real-time session would add to it
    oldest_final_age_ms: float
    sessions: int  # the sessions open at the sample
    young: int = 0  # of which admitted within the window (counted at session_load)
    projected_wait_ms: float = 0.0  # p95 of a final's queue wait with one more session
    window: Window = Window()
    budgets: tuple[float, float] = (DEFAULT_FINAL_P95_BUDGET_MS, DEFAULT_TTFT_P95_BUDGET_MS)
    headroom: int = 0  # how many more sessions the rules admit (MAX_HEADROOM: no bound)
    fast_sessions: int = 0  # sessions sending faster than real time
    fast_rate: float = 0.0  # their audio seconds per second, in all

    @property
    def present_load(self) -> float:
        """The load measured, scaled to the sessions open now where fewer are open than
        the window's mean: the load of sessions gone is not there any more."""
        mean = self.window.mean_sessions
        if mean <= 0 or self.sessions >= mean:
            return self.final_load
        return self.final_load * self.sessions / mean

    @property
    def latencies_apply(self) -> bool:
        """Whether the latencies measured say something of the sessions open now: not
        while fewer than half the window's mean are open (they were measured under a
        load that is gone; the load rule still holds)."""
        return self.sessions >= LATENCY_SESSIONS_SHARE * self.window.mean_sessions

    def projected_load(self, sessions: int) -> float:
        """The final load once ``sessions`` (the open ones and new ones) are served:
        the load present, and each session not yet in it at :attr:`session_load`."""
        unmeasured = max(self.young, sessions - self.sessions + self.young)
        return self.present_load + max(0, unmeasured) * self.session_load

    @property
    def measured_wait_ms(self) -> float:
        """The p95 of what the finals waited in the queue in the window (0: too few)."""
        return self.window.wait_p95_ms

    def wait_p95_ms(self, sessions: int) -> float:
        """The 95th percentile of a final's wait behind other sessions' decodes once
        ``sessions`` are served (see the module's doc); 0 while it is not known."""
        w = self.window
        if w.residual_ms <= 0 or sessions <= 1:
            return 0.0
        load = self.projected_load(sessions)
        if load >= 1:
            return math.inf
        busy = max(0.0, load - self.session_load) + w.partial_load  # the others' share
        if busy <= TAIL:
            return 0.0
        return w.residual_ms / (1 - load) * math.log(min(1.0, busy) / TAIL)

    def mean_wait_ms(self, load: float) -> float:
        """A final's mean wait behind other sessions' decodes at ``load`` (M/G/1: the
        others' share times the residual, stretched by ``1 / (1 - load)``)."""
        w = self.window
        if load >= 1:
            return math.inf
        busy = max(0.0, load - self.session_load) + w.partial_load
        return min(1.0, busy) * w.residual_ms / (1 - load)

    def added_wait_ms(self, sessions: int) -> float:
        """What serving ``sessions`` adds to a final's mean wait against the load the
        latencies were measured under (negative when sessions have gone since). The
        mean, not the p95: a latency's p95 does not grow by the wait's p95 (the p95 of
        a sum is below the sum of the p95s), and the measured p95 catches up within the
        window as the new sessions speak."""
        if self.window.residual_ms <= 0:
            return 0.0
        return self.mean_wait_ms(self.projected_load(sessions)) - self.mean_wait_ms(self.final_load)

    def projected_p95_ms(self, measured_ms: float, sessions: int) -> float:
        """A measured latency p95 once ``sessions`` are served; 0 while not measured."""
        if measured_ms <= 0:
            return 0.0
        return max(0.0, measured_ms + self.added_wait_ms(sessions))

    def projected_final_ms(self, sessions: int) -> float:
        """The final p95 the rules expect once ``sessions`` are served: the measured p95
        with the added wait (where the latencies apply), and at least the queue wait's
        projected p95 (a final waits at least that)."""
        projected = self.wait_p95_ms(sessions)
        if self.latencies_apply:
            projected = max(projected, self.projected_p95_ms(self.window.final_p95_ms, sessions))
        return projected

    def projected_ttft_ms(self, sessions: int) -> float:
        """The TTFT p95 the rules expect once ``sessions`` are served (0: not measured)."""
        if not self.latencies_apply:
            return 0.0
        return self.projected_p95_ms(self.window.ttft_p95_ms, sessions)

    def as_dict(self) -> dict[str, object]:
        """The figures behind the answer, for ``/readyz`` and the refusal."""
        w, after = self.window, self.sessions + 1
        return {
            "final_load": round(self.final_load, 3),
            "session_load": round(self.session_load, 3),
            "oldest_final_age_ms": round(self.oldest_final_age_ms),
            "final_p95_ms": round(w.final_p95_ms),
            "final_p95_projected_ms": _ms(self.projected_final_ms(after)),
            "final_p95_budget_ms": round(self.budgets[0]),
            "ttft_p95_ms": round(w.ttft_p95_ms),
            "ttft_p95_projected_ms": _ms(self.projected_ttft_ms(after)),
            "ttft_p95_budget_ms": round(self.budgets[1]),
            "projected_wait_ms": _ms(self.projected_wait_ms),
            "measured_wait_ms": _ms(self.measured_wait_ms),
            "headroom": self.headroom,
            "fast_sessions": self.fast_sessions,
            "fast_rate": round(self.fast_rate, 1),
        }

    def explain(self) -> str:
        """Why a session is refused, in words, with the figures (for the 503 body)."""
        w, after = self.window, self.sessions + 1
        reason = self.saturated
        if reason == LAGGING:
            why = f"a final has waited {self.oldest_final_age_ms:.0f} ms for the model"
        elif reason == FINAL_P95:
            measured = (
                f"is {w.final_p95_ms:.0f} ms"
                if w.final_p95_ms > 0 and self.latencies_apply
                else "is not measured yet"
            )
            why = (
                f"the sessions' final p95 {measured}, {self.projected_final_ms(after):.0f} ms "
                f"with one more (queue wait p95 {self.wait_p95_ms(after):.0f} ms), over the "
                f"{self.budgets[0]:.0f} ms budget"
            )
        elif reason == TTFT_P95:
            why = (
                f"the sessions' time to first token p95 is {w.ttft_p95_ms:.0f} ms, "
                f"{self.projected_ttft_ms(after):.0f} ms with one more, over the "
                f"{self.budgets[1]:.0f} ms budget"
            )
        else:
            why = (
                f"finals take {self.final_load:.0%} of the model's time and one more "
                f"session would take it to {self.projected_load(after):.0%}"
            )
        if self.fast_sessions:
            why += (
                f"; {self.fast_sessions} session(s) send audio faster than real time "
                f"({self.fast_rate:.1f} s of audio per second in all), and it is decoded "
                "at that rate"
            )
        return why


def _ms(value: float) -> int:
    return round(min(value, 1e9))


class CapacityEstimator:
    """Feed it :meth:`observe` a few times a second and :meth:`admitted` for each session
    admitted; ask :meth:`refusal` before admitting."""

    def __init__(self, options: CapacityOptions | None = None) -> None:
        self.options = options or CapacityOptions()
        self._samples: deque[LoadSample] = deque()
        self._admitted: deque[float] = deque()  # when sessions were admitted (window)
        self.current = Capacity(None, 0.0, 0.0, 0.0, 0, budgets=self.budgets, headroom=MAX_HEADROOM)
        self.saturations = 0  # how often it became saturated

    @property
    def budgets(self) -> tuple[float, float]:
        return (self.options.final_p95_budget_ms, self.options.ttft_p95_budget_ms)

    def admitted(self, now_s: float) -> None:
        """A session was admitted: until the window has measured it, it counts at the
        cost of a session that speaks all the time."""
        self._admitted.append(now_s)

    def observe(self, sample: LoadSample) -> Capacity:
        """Take one sample; the answer is also :attr:`current`."""
        o = self.options
        self._samples.append(sample)
        while len(self._samples) > 2 and sample.now_s - self._samples[1].now_s >= o.window_s:
            self._samples.popleft()  # keep one sample at or before the window's start
        while self._admitted and sample.now_s - self._admitted[0] >= o.window_s:
            self._admitted.popleft()
        window = self._window(sample)
        # a real-time session's cost: what the finals measured per second of audio (it
        # may speak all the time), or the mean session's if that is more
        session_load = max(window.rtf, window.session_load)
        young = min(sample.sessions, len(self._admitted))
        was = self.current.saturated
        probe = Capacity(
            None, window.final_load, session_load, sample.live.oldest_final_age_ms,
            sample.sessions, young, window=window, budgets=self.budgets,
            fast_sessions=sample.fast_sessions, fast_rate=sample.fast_rate,
        )  # fmt: skip
        reason = self._reason(probe, sample.sessions, was)
        if reason is not None and was is None:
            self.saturations += 1
        self.current = replace(
            probe,
            saturated=reason,
            projected_wait_ms=probe.wait_p95_ms(sample.sessions + 1),
            headroom=0 if reason is not None else self._headroom(probe, sample.sessions),
        )
        return self.current

    def refusal(self, sessions: int) -> str | None:
        """Why a new session is refused with ``sessions`` open now (LAGGING, LOADED,
        FINAL_P95, TTFT_P95), or None. Sessions admitted since the last sample count as
        young ones; with none open, what was measured is of sessions gone and refuses
        nothing but a lag."""
        current = self.current
        return self._reason(current, sessions, current.saturated)

    def _reason(self, capacity: Capacity, sessions: int, was: str | None) -> str | None:
        o = self.options
        if not o.enabled:
            return None
        ratio = o.recover_ratio if was is not None else 1.0  # hysteresis
        if capacity.oldest_final_age_ms > o.max_final_lag_ms * ratio:
            return LAGGING
        if sessions == 0:
            return None
        return self._over(capacity, sessions + 1, was is not None)

    def _over(self, capacity: Capacity, sessions: int, recovering: bool) -> str | None:
        """The budget ``sessions`` in all would break (LOADED, FINAL_P95, TTFT_P95)."""
        o = self.options
        ratio = o.recover_ratio if recovering else 1.0
        if capacity.projected_load(sessions) > o.max_final_load * ratio:
            return LOADED
        ratio = LATENCY_RECOVER_RATIO if recovering else 1.0
        if capacity.projected_final_ms(sessions) > o.final_p95_budget_ms * ratio:
            return FINAL_P95
        if capacity.projected_ttft_ms(sessions) > o.ttft_p95_budget_ms * ratio:
            return TTFT_P95
        return None

    def _headroom(self, capacity: Capacity, sessions: int) -> int:
        """How many sessions more than ``sessions`` the rules admit (up to MAX_HEADROOM)."""
        if not self.options.enabled:
            return MAX_HEADROOM

        def over(more: int) -> bool:
            return self._over(capacity, max(1, sessions + more + 1), False) is not None

        # the rules only tighten as sessions are added: the first count over them, by
        # bisection (a probe a tenth of a second must not cost the event loop much)
        low, high = 0, MAX_HEADROOM
        while low < high:
            middle = (low + high) // 2
            if over(middle):
                high = middle
            else:
                low = middle + 1
        return low

    def _window(self, last: LoadSample) -> Window:
        """What the workers did over the window (all 0 until enough of it is measured)."""
        first = self._samples[0]
        span_s = last.now_s - first.now_s
        if span_s < self.options.window_s * MIN_WINDOW_FRACTION:
            return Window()
        workers = max(1, last.workers)
        busy_ms = max(0.0, last.live.final_decode_ms_total - first.live.final_decode_ms_total)
        load = busy_ms / (span_s * 1000 * workers)
        # the sessions that made that load: the mean over the window, weighted by time
        weighted = 0.0
        samples = list(self._samples)
        for before, after in zip(samples, samples[1:], strict=False):
            weighted += before.sessions * (after.now_s - before.now_s)
        mean_sessions = weighted / span_s
        audio_ms = last.live.final_audio_ms_total - first.live.final_audio_ms_total
        squares = last.live.final_decode_sq_ms_total - first.live.final_decode_sq_ms_total
        partial_ms = last.live.partial_decode_ms_total - first.live.partial_decode_ms_total
        partial_ms = max(0.0, partial_ms)
        return Window(
            final_load=load,
            session_load=load / mean_sessions if mean_sessions > 0 else 0.0,
            rtf=busy_ms / audio_ms / workers if audio_ms > 0 else 0.0,
            residual_ms=squares / (2 * busy_ms) if busy_ms > 0 else 0.0,
            partial_load=0.0 if last.live.interruptible else partial_ms / (span_s * 1000 * workers),
            wait_p95_ms=p95_between(
                first.live.final_waits, last.live.final_waits, WAIT_BINS_MS, MIN_MEASURED_FINALS
            ),
            final_p95_ms=p95_between(first.final_latencies, last.final_latencies),
            mean_sessions=mean_sessions,
            ttft_p95_ms=p95_between(first.ttft_latencies, last.ttft_latencies),
        )
