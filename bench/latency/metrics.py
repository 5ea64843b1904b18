"""Latency maths of the bench, free of I/O: map server audio times onto client wall times.

The server reports where a segment starts and ends in *client audio time* (``start_ms``,
``end_ms``, counted in samples). The client knows when it handed each chunk of that audio
to the socket (its send log, monotonic seconds). Joining the two gives what a user
feels:

* time to first token: first non-empty partial or final of a segment, minus the moment
  the segment's first sample (``speech_start.start_ms``) left the client;
* final latency: the final's arrival minus the moment the segment's last sample
  (``end_ms``) left the client.

Everything here takes plain numbers and returns plain numbers, so the tests need no
server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.common import percentiles
from streamer.core.protocol import End, Final, Partial, ServerMessage, SpeechStart

# A segment's start lies before the speech onset (pre-roll) and its end after the last
# speech (end padding): a known utterance is matched to it within this distance.
TRUTH_MATCH_MS = 1000


@dataclass(frozen=True)
class SendLog:
    """When each chunk of a client's audio was handed to the socket.

    Entry ``k`` says that after the ``k``-th chunk, ``end_samples[k]`` samples in all had
    been sent, at monotonic time ``times_s[k]``.
    """

    end_samples: tuple[int, ...]  # cumulative samples sent after each chunk, rising
    times_s: tuple[float, ...]  # time.monotonic() right after each chunk was sent
    sample_rate: int  # rate of the PCM the client sends, Hz

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, float]], sample_rate: int) -> SendLog:
        ends: list[int] = []
        times: list[float] = []
        for end, t in pairs:
            ends.append(int(end))
            times.append(float(t))
        if any(b <= a for a, b in zip(ends, ends[1:], strict=False)):
            raise ValueError("send log end samples must rise strictly")
        return cls(tuple(ends), tuple(times), sample_rate)

    def sample_at_ms(self, ms: float) -> int:
        """Index of the sample that starts at audio time ``ms`` (rounded to a sample)."""
        return int(round(ms * self.sample_rate / 1000.0))

    def time_of_sample(self, sample: int) -> float | None:
        """When the chunk holding sample ``sample`` (0-based) was sent; None if never."""
        if sample < 0:
            sample = 0
        k = int(np.searchsorted(np.asarray(self.end_samples), sample, side="right"))
        if k >= len(self.end_samples):
            return None
        return self.times_s[k]

    def time_of_start_ms(self, start_ms: float) -> float | None:
        """When the first sample at or after ``start_ms`` was sent."""
        return self.time_of_sample(self.sample_at_ms(start_ms))

    def time_of_end_ms(self, end_ms: float) -> float | None:
        """When the last sample before ``end_ms`` (an exclusive end) was sent."""
        return self.time_of_sample(self.sample_at_ms(end_ms) - 1)


@dataclass(frozen=True)
class Arrival:
    """One server message and the monotonic time the client received it."""

    message: ServerMessage
    t: float  # time.monotonic() when the client read the message


@dataclass(frozen=True)
class SegmentLatency:
    """What one segment felt like from the client's side."""

    segment_id: int
    start_ms: float  # speech_start.start_ms
    end_ms: float | None  # final.end_ms; None when no final arrived
    reason: str | None  # final.reason
    first_token_s: float | None  # first non-empty text minus send time of start_ms
    first_token_from: str | None  # "partial" or "final"
    final_s: float | None  # final arrival minus send time of end_ms
    partials: int  # partial messages received for this segment
    partial_gaps_s: tuple[float, ...]  # arrival gaps between consecutive partials
    decode_ms: float | None  # server's model time for the final
    queue_ms: float | None  # server's queue wait for the final
    onset_first_token_s: float | None = None  # first token minus send of the true onset
    speech_end_final_s: float | None = None  # final minus send of the true last speech


def match_onset(spans: Sequence[tuple[int, int]], start_sample: int, window: int) -> int | None:
    """The first known speech onset in ``[start_sample, start_sample + window]``."""
    for begin, _ in spans:
        if start_sample <= begin <= start_sample + window:
            return begin
    return None


def match_speech_end(spans: Sequence[tuple[int, int]], end_sample: int, window: int) -> int | None:
    """The last known speech end in ``[end_sample - window, end_sample]`` (exclusive end)."""
    found = None
    for _, end in spans:
        if end_sample - window <= end <= end_sample:
            found = end
    return found


def segment_latencies(
    arrivals: Sequence[Arrival],
    send_log: SendLog,
    speech_spans: Sequence[tuple[int, int]] = (),
) -> list[SegmentLatency]:
    """Per-segment latencies of one session, in segment order.

    Segments whose start or end sample was never sent (should not happen) get ``None``
    in the affected field rather than a guess. With ``speech_spans`` (the ``[start, end)``
    samples of the utterances actually in the stream), the latencies are also measured
    from the true speech onset and end, which the server's pre-roll and end padding
    move: the onset is matched only when it lies shortly after ``start_ms``, the end
    only for segments closed by silence.
    """
    window = TRUTH_MATCH_MS * send_log.sample_rate // 1000
    starts: dict[int, tuple[float, float]] = {}  # segment -> (start_ms, arrival t)
    first_token: dict[int, tuple[float, str]] = {}
    partial_times: dict[int, list[float]] = {}
    finals: dict[int, tuple[Final, float]] = {}
    for arrival in arrivals:
        msg = arrival.message
        if isinstance(msg, SpeechStart):
            starts.setdefault(msg.segment_id, (msg.start_ms, arrival.t))
        elif isinstance(msg, Partial):
            partial_times.setdefault(msg.segment_id, []).append(arrival.t)
            if msg.text.strip():
                first_token.setdefault(msg.segment_id, (arrival.t, "partial"))
        elif isinstance(msg, Final):
            finals.setdefault(msg.segment_id, (msg, arrival.t))
            if msg.text.strip():
                first_token.setdefault(msg.segment_id, (arrival.t, "final"))
    result = []
    for segment_id in sorted(starts):
        start_ms, _ = starts[segment_id]
        sent_start = send_log.time_of_start_ms(start_ms)
        token = first_token.get(segment_id)
        first_token_s = first_from = onset_first_token_s = None
        if token is not None and sent_start is not None:
            first_token_s = token[0] - sent_start
            first_from = token[1]
        onset = match_onset(speech_spans, send_log.sample_at_ms(start_ms), window)
        if token is not None and onset is not None:
            sent_onset = send_log.time_of_sample(onset)
            if sent_onset is not None:
                onset_first_token_s = token[0] - sent_onset
        final_entry = finals.get(segment_id)
        final_s = end_ms = reason = decode_ms = queue_ms = speech_end_final_s = None
        if final_entry is not None:
            final, t_final = final_entry
            end_ms, reason = final.end_ms, final.reason
            decode_ms, queue_ms = final.decode_ms, final.queue_ms
            sent_end = send_log.time_of_end_ms(final.end_ms)
            if sent_end is not None:
                final_s = t_final - sent_end
            speech_end = (
                match_speech_end(speech_spans, send_log.sample_at_ms(final.end_ms), window)
                if reason == "silence"
                else None
            )
            sent_speech_end = (
                None if speech_end is None else send_log.time_of_sample(speech_end - 1)
            )
            if sent_speech_end is not None:
                speech_end_final_s = t_final - sent_speech_end
        times = partial_times.get(segment_id, [])
        result.append(
            SegmentLatency(
                segment_id=segment_id,
                start_ms=start_ms,
                end_ms=end_ms,
                reason=reason,
                first_token_s=first_token_s,
                first_token_from=first_from,
                final_s=final_s,
                partials=len(times),
                partial_gaps_s=tuple(b - a for a, b in zip(times, times[1:], strict=False)),
                decode_ms=decode_ms,
                queue_ms=queue_ms,
                onset_first_token_s=onset_first_token_s,
                speech_end_final_s=speech_end_final_s,
            )
        )
    return result


def send_lags(send_log: SendLog, speed: float = 1.0) -> np.ndarray:
    """How late each chunk left compared with an exact ``speed``-times-real-time pace.

    The pace is anchored at the first chunk, so the answer does not depend on whether the
    sender sleeps before or after a chunk. A load generator that cannot keep up shows
    rising lags here: its latencies then say nothing about the server.
    """
    if not send_log.end_samples:
        return np.zeros(0)
    ends = np.asarray(send_log.end_samples, dtype=np.float64)
    times = np.asarray(send_log.times_s, dtype=np.float64)
    ideal = (ends - ends[0]) / (send_log.sample_rate * speed)
    return (times - times[0]) - ideal


def skip_share(ends: Iterable[End]) -> float | None:
    """Share of partial decodes the server skipped, from the sessions' ``end`` messages."""
    sent = skipped = 0
    for end in ends:
        sent += end.partials_sent
        skipped += end.partials_skipped
    total = sent + skipped
    return skipped / total if total else None


def carried_clients(p95_by_clients: dict[int, float | None], limit_s: float) -> int | None:
    """The most clients served before final-latency p95 first passes ``limit_s``.

    Steps are taken in rising client count; the first step over the limit (or without a
    measurement) ends the count. None when even the smallest step is over.
    """
    carried = None
    for n in sorted(p95_by_clients):
        p95 = p95_by_clients[n]
        if p95 is None or p95 > limit_s:
            break
        carried = n
    return carried


def next_client_count(tried: dict[int, bool], max_clients: int) -> int | None:
    """The next client count of an automatic sweep, or None when it is done.

    ``tried`` maps each client count already run to whether it was within the limit.
    The sweep doubles from 1 until a step fails (or ``max_clients``), then bisects
    between the last good and the first failing count.
    """
    if not tried:
        return 1
    good = [n for n, ok in tried.items() if ok]
    bad = [n for n, ok in tried.items() if not ok]
    if not bad:
        top = max(tried)
        if top >= max_clients:
            return None
        return min(top * 2, max_clients)
    first_bad = min(bad)
    below = [n for n in good if n < first_bad]
    last_good = max(below) if below else 0
    if first_bad - last_good <= 1:
        return None
    return (last_good + first_bad) // 2


def summarize_segments(segments: Sequence[SegmentLatency]) -> dict[str, Any]:
    """Percentiles and counts over pooled segments (finals ended by ``stop`` left out).

    A ``stop`` final is forced by the end of the stream, not by the speaker pausing, so it
    says nothing about endpointing latency; it is counted but not timed.
    """
    timed = [s for s in segments if s.reason != "stop"]
    gaps = [g for s in segments for g in s.partial_gaps_s]
    return {
        "segments": len(segments),
        "finals_missing": sum(1 for s in segments if s.end_ms is None),
        "stop_finals": sum(1 for s in segments if s.reason == "stop"),
        "no_text": sum(1 for s in timed if s.first_token_s is None),
        "first_token_s": percentiles(s.first_token_s for s in timed),
        "final_s": percentiles(s.final_s for s in timed),
        "onset_first_token_s": percentiles(s.onset_first_token_s for s in timed),
        "speech_end_final_s": percentiles(s.speech_end_final_s for s in timed),
        "partials_per_segment": _mean(s.partials for s in timed),
        "partial_gap_s": percentiles(gaps),
        "decode_ms": percentiles(s.decode_ms for s in timed),
        "queue_ms": percentiles(s.queue_ms for s in timed),
    }


def _mean(values: Iterable[float]) -> float | None:
    data = list(values)
    return sum(data) / len(data) if data else None
