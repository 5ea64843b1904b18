"""The worker's queue of decode jobs: its discipline and batch selection (no threads).

* live work first: finals and late speculative decodes that have waited
  ``FINAL_PATIENCE_MS`` (0 by default: all of them), oldest first; then a segment's
  first text when its audio is short (``FIRST_AHEAD_MAX_SAMPLES``): its first partial,
  or the speculative decode that replaced it (a pause before any text was shown); then
  the other finals and late speculative decodes; then longer first partials; then
  speculative decodes that are not late; then refreshes of segments already shown;
  oldest first within each class. With a patience, a first partial goes before the
  finals not yet kept waiting that long (not before its own session's earlier final:
  its text is held until that final is sent); 300 ms cost the finals at sixteen client
  processes on a loaded 2-core machine (issue 31). A speculative decode is the final of
  a segment whose pause may be its end: behind every session's refreshes, with seven
  sessions the first client's final p95 doubled. It is submitted a few hundred ms
  before the endpoint would make it a final; once it has waited
  ``SPECULATIVE_SLACK_MS`` it goes with the finals;
* a session sending faster than real time (``DecodeJob.realtime`` False: a file
  streamed unpaced) has its live jobs after every real-time session's, in the same
  order among themselves: it takes the model at the rate it sends, and the sessions
  admitted before it keep their latency;
* then background jobs (a file upload's finals, ``DecodeJob.background``), shared
  round robin among their sessions: each session's jobs in order, and a session served
  goes to the back, so two uploads progress alike and a short one is not stuck behind
  a long one. A live job waits for no more than the one batch already decoding;
* a batch is of one class: background jobs are batched together (several segments of
  one file, or of several files) but never with live ones; first partials that go ahead
  of the finals only with each other (several sessions' first words in one decode,
  where the worker batches), never with a refresh that would hold up the finals;
* at most one pending partial per session: a newer one replaces it (the old one is
  answered ``dropped``), and a session's pending partial is dropped as soon as one of
  its finals is queued; but a speculative decode of a segment before the new job's is
  that ended segment's final (its session waits for it): it goes on waiting, with the
  finals (dropped, it was queued again as a final behind the others: with first
  partials ahead of finals, sixteen clients' finals waited 3.7 s);
* a final decoded again after the model failed while decoding it is taken alone, first
  in its class;
* :meth:`JobQueue.drop_session` forgets every queued job of a departed client.

The caller (:class:`~streamer.model.serving.worker.ModelWorker`) holds its lock around every
call; nothing here blocks or reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from streamer.core.jobs import DecodeJob, DecodeResult

ResultCallback = Callable[[DecodeResult], None]
# a speculative decode waits behind first partials no longer than this: the endpoint
# that makes it a final follows its submission by endpoint_ms (500) less the pause
# already heard, a first partial's decode is short (its segment is young)
SPECULATIVE_SLACK_MS = 150.0
# a final (or a late speculative decode) that has waited this long goes before first
# partials (0: every final does, the order before issue 31's traces). 300 ms cost the
# finals at 16 client processes on a loaded 2-core machine (final p50 +200-2000 ms in
# six of six side-by-side pairs: git show 06cedb4:bench/results-incoming/wip-ttft3.md); 0
# measured no worse than main there. A quiet machine may pick another value.
FINAL_PATIENCE_MS = 0.0
# a first partial of at most this much audio goes ahead of finals (2 s at 16 kHz): one
# submitted at the onset holds the pre-roll and a few frames; a longer one (a segment
# whose first decodes had no text yet) waits behind the finals like a refresh
FIRST_AHEAD_MAX_SAMPLES = 32_000


@dataclass
class Queued:
    """A submitted job and whom to answer."""

    job: DecodeJob
    callback: ResultCallback
    submitted: float  # time.perf_counter() at submission
    retried: bool = False  # decoded again after the model failed while decoding it


def is_live_final(job: DecodeJob) -> bool:
    """A live session's final, or a speculative decode (the final it may become)."""
    return (job.kind == "final" or job.speculative) and not job.background


def is_first_partial(job: DecodeJob) -> bool:
    """A live segment's first partial: when its speaker sees the first words."""
    return job.kind == "partial" and job.first and not job.speculative and not job.background


def is_refresh(job: DecodeJob) -> bool:
    """A live session's partial that is only shown, never kept for its final."""
    return job.kind == "partial" and not job.speculative and not job.background


def _ended_by(pending: DecodeJob, new: DecodeJob) -> bool:
    """``pending`` is a speculative decode of a segment before ``new``'s: that segment
    has ended, and the decode is its final (the session waits for it)."""
    return pending.speculative and pending.segment_id < new.segment_id


def select_batch(
    candidates: Sequence[DecodeJob],
    *,
    max_batch: int,
    max_padding_ratio: float,
    max_batch_samples: int | None = None,
) -> list[int]:
    """Which of ``candidates`` (in queue-discipline order) to decode together: indices.

    The first candidate is always taken (the worker's queue discipline put it first, so
    it never waits behind later work). The others are taken in order if they are of the
    first one's kind (a final never waits for partials decoded with it: on 2 CPU cores
    that doubled final p95, bench/RESULTS.md), while the batch has fewer than
    ``max_batch`` jobs and ``jobs x longest <= max_padding_ratio x total`` samples holds,
    so a batch groups similar lengths and a long job does not make short ones pay for its
    padding (or the reverse), and while its padded samples stay within
    ``max_batch_samples`` (None: no bound), which bounds how long a batch holds up the
    next final.
    """
    if not candidates:
        return []
    chosen = [0]
    kind = candidates[0].kind
    longest = total = candidates[0].pcm.size
    for index in range(1, len(candidates)):
        if len(chosen) >= max_batch:
            break
        if candidates[index].kind != kind:
            continue
        samples = candidates[index].pcm.size
        new_longest = max(longest, samples)
        padded = (len(chosen) + 1) * new_longest
        if max_batch_samples is not None and padded > max_batch_samples:
            continue
        if padded <= max_padding_ratio * (total + samples):
            chosen.append(index)
            longest, total = new_longest, total + samples
    return chosen


class JobQueue:
    """Live finals in order, one pending live partial per session, and each background
    session's jobs in order."""

    def __init__(self) -> None:
        self.finals: deque[Queued] = deque()  # live
        self.partials: OrderedDict[str, Queued] = OrderedDict()  # live: session_id -> job
        # session_id -> its background jobs in order; the sessions in round-robin order
        self.background: OrderedDict[str, deque[Queued]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.finals) + len(self.partials) + self.background_jobs

    @property
    def background_jobs(self) -> int:
        """How many background jobs wait."""
        return sum(len(lane) for lane in self.background.values())

    def push(self, item: Queued) -> Queued | None:
        """Queue ``item``; returns the pending partial it supersedes (to answer dropped)."""
        session_id = item.job.session_id
        superseded = self.partials.pop(session_id, None)
        if superseded is not None and _ended_by(superseded.job, item.job):
            # the final of a segment that has ended: it waits with the finals, in order
            self.finals = deque(sorted([*self.finals, superseded], key=lambda q: q.submitted))
            superseded = None
        if item.job.background:  # whatever its kind (background sessions send finals)
            self.background.setdefault(session_id, deque()).append(item)
        elif item.job.kind == "final":
            self.finals.append(item)
        else:
            self.partials[session_id] = item
        return superseded

    def oldest_final_submitted(self) -> float | None:
        """When the oldest waiting live final was submitted (None: no final waits). A
        speculative partial counts: it is the final of a segment that may have ended.
        Background jobs do not: they wait behind live work by design, and admission
        (core/capacity.py) must not refuse live sessions because a file waits."""
        waiting = [
            q.submitted for q in self.partials.values() if q.job.speculative and q.job.realtime
        ]
        # a faster-than-real-time session's finals wait behind real-time work by design
        oldest = next((q.submitted for q in self.finals if q.job.realtime), None)
        if oldest is not None:
            waiting.append(oldest)
        return min(waiting, default=None)

    def retry_first(self, item: Queued) -> None:
        """A final the failed model did not decode: first in line of its class (live,
        or background: its session first in the rotation), to be decoded alone."""
        item.retried = True
        if not item.job.background:
            self.finals.appendleft(item)
            return
        session_id = item.job.session_id
        self.background.setdefault(session_id, deque()).appendleft(item)
        self.background.move_to_end(session_id, last=False)

    def drop_session(self, session_id: str) -> int:
        """Forget every queued job of ``session_id``; how many there were."""
        before = len(self.finals)
        self.finals = deque(q for q in self.finals if q.job.session_id != session_id)
        dropped = before - len(self.finals)
        if self.partials.pop(session_id, None) is not None:
            dropped += 1
        dropped += len(self.background.pop(session_id, ()))
        return dropped

    def clear(self) -> list[Queued]:
        """Empty the queue; what it held, live finals first, background jobs last."""
        items = list(self.finals) + list(self.partials.values())
        items += [q for lane in self.background.values() for q in lane]
        self.finals.clear()
        self.partials.clear()
        self.background.clear()
        return items

    def take(
        self,
        *,
        max_batch: int,
        max_padding_ratio: float,
        max_batch_samples: int | None,
        now: float | None = None,
    ) -> list[Queued]:
        """The next batch off the queue (see :func:`select_batch`); [] when empty.
        ``now`` (the clock of :attr:`Queued.submitted`) tells which speculative decodes
        are late and which finals have waited long enough to go before first partials;
        None: all are and all have."""
        if not self:
            return []
        partials = list(self.partials.values())
        # the queue discipline: finals and late speculative decodes that have waited
        # FINAL_PATIENCE_MS, short first texts (a first partial, or the speculative
        # decode of a pause that came before any text was shown, which replaced it), the
        # other finals and late speculative decodes (oldest first in each: a retried
        # final, older than anything queued, comes first), longer first partials,
        # speculative decodes not late, refreshes
        # not of a session whose earlier final waits: its text is held until that final
        # is sent (the protocol's order), so going first would only delay the final
        behind = {q.job.session_id for q in self.finals}
        ahead = [
            q
            for q in partials
            if q.job.first
            and q.job.pcm.size <= FIRST_AHEAD_MAX_SAMPLES
            and q.job.session_id not in behind
        ]
        ahead_ids = {id(q) for q in ahead}
        partials = [q for q in partials if id(q) not in ahead_ids]
        slack_s = SPECULATIVE_SLACK_MS / 1000
        late: list[Queued] = []
        early: list[Queued] = []
        for q in partials:
            if q.job.speculative:
                (early if now is not None and now - q.submitted < slack_s else late).append(q)
        firsts = [q for q in partials if is_first_partial(q.job)]
        finals = sorted([*self.finals, *late], key=lambda q: q.submitted)
        patience_s = FINAL_PATIENCE_MS / 1000
        due = [q for q in finals if now is None or now - q.submitted >= patience_s]
        queued = due + sorted(ahead, key=lambda q: q.submitted)
        due_ids = {id(q) for q in due}
        queued += [q for q in finals if id(q) not in due_ids]
        queued += firsts  # longer ones
        queued += sorted(early, key=lambda q: q.submitted)
        queued += [q for q in partials if is_refresh(q.job) and not q.job.first]
        # real-time sessions' work first (sorted() is stable: each class keeps its order)
        queued = sorted(queued, key=lambda q: (not q.retried, not q.job.realtime))
        if not queued:  # no live work: the background sessions' jobs, interleaved
            queued = self._background_order()
        if queued[0].retried:  # alone: it may be what broke the model
            batch = [queued[0]]
        else:  # queued[0] is fresh[0]
            fresh = [q for q in queued if not q.retried]
            if id(fresh[0]) in ahead_ids:  # first partials with their like only
                fresh = [q for q in fresh if id(q) in ahead_ids]
            chosen = select_batch(
                [q.job for q in fresh],
                max_batch=max_batch,
                max_padding_ratio=max_padding_ratio,
                max_batch_samples=max_batch_samples,
            )
            batch = [fresh[i] for i in chosen]
        for item in batch:
            if item.job.background:
                self._take_background(item)
            elif self.partials.get(item.job.session_id) is item:
                del self.partials[item.job.session_id]
            else:  # a final, or a speculative decode that waits as one
                self.finals.remove(item)
        return batch

    def _background_order(self) -> list[Queued]:
        """Every background job, round robin: each session's first in rotation order,
        then each one's second, and so on (a batch then draws on every upload alike)."""
        lanes = list(self.background.values())
        depth = max(len(lane) for lane in lanes)
        return [lane[i] for i in range(depth) for lane in lanes if i < len(lane)]

    def _take_background(self, item: Queued) -> None:
        """Take ``item`` off its session's lane; the session goes to the back."""
        session_id = item.job.session_id
        lane = self.background[session_id]
        lane.remove(item)
        if lane:
            self.background.move_to_end(session_id)
        else:
            del self.background[session_id]
