"""Whether the model keeps up with the sessions it serves (I/O-free).

A server that admits every session until ``--max-sessions`` degrades every session
together once the model falls behind: measured on 2 cores with random:small int8, one
real-time client's finals came in about a second, eight clients' in 8-16 s each, and
``/readyz`` said ``ready`` throughout. :class:`CapacityEstimator` decides instead, from
what the workers measured, whether one more session can be served without the admitted
ones losing their latency; the server refuses new sessions while it says ``saturated``
(and ``/readyz`` answers 503), and admits again when it recovers.

It is fed, a few times a second, a :class:`LoadSample`: the workers' cumulative time
spent decoding finals (and the finals' audio, squared decode times and waits), the age
of the oldest final still waiting in a queue, and the sessions open. From those it knows:

* **lagging**: a final has waited longer than ``max_final_lag_ms`` (the model is behind
  now; the sessions' partials are already being shed, since the worker keeps one per
  session and decodes finals first);
* **final load** ``rho``: the share of the workers' time the finals took over the last
  ``window_s``, and what one more session would add: a real-time session costs at most
  the finals' real-time factor (decode time per second of audio: a session that speaks
  all the time), or the measured mean per session if that is more. Sessions admitted
  within the window count at that cost on top of the load measured (their own share of
  it is not there yet, so they are not diluted into the mean); past
  ``max_final_load`` the model would fall behind;
* **the finals' wait** (the tail the admitted sessions feel): a final finds the model
  busy with another session's final with probability ``p``, the others' share of the
  load, and then waits about the residual of that decode, ``E[S^2] / 2E[S]``, stretched
  by ``1 / (1 - rho)`` as the queue grows (M/G/1). The wait's 95th percentile is then 0
  while ``p <= 5 %``, else ``residual / (1 - rho) * ln(p / 5 %)``: one more session is
  refused when that would pass ``max_final_wait_ms``. Where the recognizer cannot stop a
  partial's decode for a final (the torch backend, a model process), the partials'
  share of the time counts in ``p`` as well; ONNX Runtime's partials are stopped
  (:meth:`~streamer.model.worker.ModelWorker.submit`), so only the finals count.
* **the finals' measured wait**, the check on that model: the p95 of what the finals of
  the window waited (the worker counts them per ``WAIT_BINS_MS`` bin; at least
  ``MIN_MEASURED_FINALS``) past ``max_final_wait_ms`` refuses one more session too.

On 2 cores of an AVX-512 VNNI EPYC with the real-size model in int8 a 7 s final takes
about 0.4 s: there the wait rule admitted one or two live sessions beside the first at
the default 100 ms (each collision costs a final up to a decode), where a GPU's 20-40 ms
decodes let the load rule decide (bench/RESULTS.md, "Capacity-aware admission").

Once saturated, the estimator says so until every signal is below ``recover_ratio``
of its limit: a session ending, or speech pausing, does not flap the answer. Time is
whatever clock the caller passes (seconds); nothing here reads one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from streamer.errors import ConfigError

DEFAULT_MAX_FINAL_LAG_MS = 1000.0
DEFAULT_MAX_FINAL_LOAD = 0.8  # the queue grows without bound as the load nears 1
DEFAULT_MAX_FINAL_WAIT_MS = 100.0  # bench/RESULTS.md, "Capacity-aware admission"
TAIL = 0.05  # the wait limit is on the 95th percentile
# the finals' measured waits are counted in these bins (ms; the last one is open): the
# projection is checked against what the finals actually waited
WAIT_BINS_MS = (10, 25, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)
MIN_MEASURED_FINALS = 20  # fewer in the window: their p95 says nothing
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
    # most projected p95 of a final's wait behind other sessions' decodes
    max_final_wait_ms: float = DEFAULT_MAX_FINAL_WAIT_MS
    window_s: float = DEFAULT_WINDOW_S  # the final load is measured over this long
    recover_ratio: float = DEFAULT_RECOVER_RATIO  # saturated until both are below this x limit
    enabled: bool = True  # False admits up to --max-sessions whatever the load

    def __post_init__(self) -> None:
        if not self.max_final_lag_ms > 0:
            raise ConfigError("max_final_lag_ms must be positive")
        if not 0 < self.max_final_load <= 1:
            raise ConfigError("max_final_load must be in (0, 1]")
        if not self.max_final_wait_ms > 0:
            raise ConfigError("max_final_wait_ms must be positive")
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
    final_audio_ms_total: float = 0.0  # cumulative: their audio
    final_decode_sq_ms_total: float = 0.0  # cumulative: their decode times, squared
    partial_decode_ms_total: float = 0.0  # cumulative: time spent on live partials
    interruptible: bool = True  # a final stops a partial's decode (else it waits for it)
    # cumulative: the live finals' queue waits, counted per WAIT_BINS_MS bin (with one
    # more for the waits past the last edge); empty where the worker does not say
    final_waits: tuple[int, ...] = ()


@dataclass(frozen=True)
class Window:
    """What the workers did over the window."""

    final_load: float = 0.0  # share of worker time spent on finals
    session_load: float = 0.0  # of which one session's share, on average
    rtf: float = 0.0  # finals' decode time per audio time, per worker (0: unknown)
    residual_ms: float = 0.0  # a final's mean wait behind another's decode (0: unknown)
    partial_load: float = 0.0  # share of worker time spent on live partials
    wait_p95_ms: float = 0.0  # the p95 the finals waited (a bin's upper edge; 0: unknown)


@dataclass(frozen=True)
class Capacity:
    """The estimator's answer after a sample."""

    saturated: str | None  # LAGGING or LOADED, or None while a session is admitted
    final_load: float  # share of worker time spent on finals over the window
    session_load: float  # what one more real-time session would add to it
    oldest_final_age_ms: float
    sessions: int  # the sessions open at the sample
    young: int = 0  # of which admitted within the window (counted at session_load)
    projected_wait_ms: float = 0.0  # p95 of a final's wait with one more session
    window: Window = Window()

    def projected_load(self, sessions: int) -> float:
        """The final load once ``sessions`` (the open ones and new ones) are served:
        the load measured, and each session not yet in it at :attr:`session_load`."""
        unmeasured = max(self.young, sessions - self.sessions + self.young)
        return self.final_load + max(0, unmeasured) * self.session_load

    @property
    def measured_wait_ms(self) -> float:
        """The p95 of what the finals waited in the window (0: too few to say)."""
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

    def as_dict(self) -> dict[str, object]:
        return {
            "final_load": round(self.final_load, 3),
            "session_load": round(self.session_load, 3),
            "oldest_final_age_ms": round(self.oldest_final_age_ms),
            "projected_wait_ms": round(min(self.projected_wait_ms, 1e9)),
            "measured_wait_ms": round(min(self.measured_wait_ms, 1e9)),
        }


class CapacityEstimator:
    """Feed it :meth:`observe` a few times a second and :meth:`admitted` for each session
    admitted; ask :meth:`refusal` before admitting."""

    def __init__(self, options: CapacityOptions | None = None) -> None:
        self.options = options or CapacityOptions()
        self._samples: deque[LoadSample] = deque()
        self._admitted: deque[float] = deque()  # when sessions were admitted (window)
        self.current = Capacity(None, 0.0, 0.0, 0.0, 0)
        self.saturations = 0  # how often it became saturated

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
            None, window.final_load, session_load, sample.oldest_final_age_ms,
            sample.sessions, young, window=window,
        )  # fmt: skip
        reason = self._reason(probe, sample.sessions, was)
        if reason is not None and was is None:
            self.saturations += 1
        wait_ms = probe.wait_p95_ms(sample.sessions + 1)
        self.current = replace(probe, saturated=reason, projected_wait_ms=wait_ms)
        return self.current

    def refusal(self, sessions: int) -> str | None:
        """Why a new session is refused with ``sessions`` open now (LAGGING, LOADED), or
        None. Sessions admitted since the last sample count as young ones; with none
        open, the load measured is of sessions gone and refuses nothing."""
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
        if capacity.projected_load(sessions + 1) > o.max_final_load * ratio:
            return LOADED
        wait_limit = o.max_final_wait_ms * ratio
        if capacity.wait_p95_ms(sessions + 1) > wait_limit:
            return LOADED
        if capacity.measured_wait_ms > wait_limit:  # the finals already wait that long
            return LOADED
        return None

    def _window(self, last: LoadSample) -> Window:
        """What the workers did over the window (all 0 until enough of it is measured)."""
        first = self._samples[0]
        span_s = last.now_s - first.now_s
        if span_s < self.options.window_s * MIN_WINDOW_FRACTION:
            return Window()
        workers = max(1, last.workers)
        busy_ms = max(0.0, last.final_decode_ms_total - first.final_decode_ms_total)
        load = busy_ms / (span_s * 1000 * workers)
        # the sessions that made that load: the mean over the window, weighted by time
        weighted = 0.0
        samples = list(self._samples)
        for before, after in zip(samples, samples[1:], strict=False):
            weighted += before.sessions * (after.now_s - before.now_s)
        mean_sessions = weighted / span_s
        audio_ms = last.final_audio_ms_total - first.final_audio_ms_total
        squares = last.final_decode_sq_ms_total - first.final_decode_sq_ms_total
        partial_ms = max(0.0, last.partial_decode_ms_total - first.partial_decode_ms_total)
        return Window(
            final_load=load,
            session_load=load / mean_sessions if mean_sessions > 0 else 0.0,
            rtf=busy_ms / audio_ms / workers if audio_ms > 0 else 0.0,
            residual_ms=squares / (2 * busy_ms) if busy_ms > 0 else 0.0,
            partial_load=0.0 if last.interruptible else partial_ms / (span_s * 1000 * workers),
            wait_p95_ms=_wait_p95_ms(first.final_waits, last.final_waits),
        )


def _wait_p95_ms(first: tuple[int, ...], last: tuple[int, ...]) -> float:
    """The p95 of the waits counted between two samples' bins: the upper edge of the bin
    it falls in (the last edge for the open bin); 0 with too few finals to say."""
    if len(first) != len(last) or not last:
        return 0.0
    counts = [b - a for a, b in zip(first, last, strict=True)]
    total = sum(counts)
    if total < MIN_MEASURED_FINALS:
        return 0.0
    seen = 0
    for index, count in enumerate(counts):
        seen += count
        if seen >= (1 - TAIL) * total:
            return float(WAIT_BINS_MS[min(index, len(WAIT_BINS_MS) - 1)])
    return float(WAIT_BINS_MS[-1])
