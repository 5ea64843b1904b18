"""CTC prefix beam search biased by a context graph (hotwords), over CTC logits.

The search keeps ``beam`` distinct token prefixes; each has two alignments, the best
one ending in a blank and the best one ending in its last token, scored by the sum of
their frames' log-probabilities (a max over alignments, not a sum: with no bonus the
best prefix is then exactly the greedy path's, and each token keeps the frames of one
alignment, so words keep their timings). A prefix's rank adds its context bonus
(:class:`~streamer.model.decode.context_graph.ContextGraph`): each emitted token that extends a
phrase earns the phrase's boost, a broken match gives its bonus back, and at the end an
unfinished match is taken back too.

SenseVoice's first four encoder frames are its query rows (language, emotion, event,
ITN): they are decoded greedily, exactly as :func:`~streamer.model.decode.ctc.greedy_ctc`
decodes them, and the search starts after them from that prefix (a token whose run
crosses into the audio frames is continued, as greedy collapses it).

Each frame considers, besides blank and the repeated last token, the ``beam`` most
likely tokens, the ``beam`` most likely once each token's largest bonus is added (so a
hotword's token can enter although the audio alone ranks it low), and the tokens that
continue each prefix's open match. Those candidates are found for all frames at once
with numpy; the per-prefix bookkeeping is plain Python (a few hundred steps a frame).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from streamer.model.decode.context_graph import ROOT, ContextGraph
from streamer.model.decode.ctc import CtcTokens, greedy_ctc
from streamer.model.sensevoice import BLANK_ID, QUERY_FRAMES

_NONE = -math.inf
DEFAULT_BEAM = 4  # prefixes kept per frame on finals (--hotword-beam)
DEFAULT_PARTIAL_BEAM = 2  # on partials (--hotword-partial-beam)
MAX_BEAM = 64
_MATCH_CANDIDATES = 4  # tokens continuing an open match, most likely first, per prefix

# A token record: (token, start frame, end frame of the token before it, the record
# before it); the last token's own end is kept beside its record (it still grows).
_Record = tuple[int, int, int, "_Record | None"]


class _Prefix:
    __slots__ = (
        "key",
        "last",
        "blank",
        "blank_rec",
        "blank_end",
        "token",
        "token_rec",
        "token_end",
        "state",
        "bonus",
    )

    def __init__(self, key: int, last: int, state: int, bonus: float) -> None:
        self.key = key  # the prefix's id in the search's prefix trie
        self.last = last  # its last token (BLANK_ID for none)
        self.blank = _NONE  # best alignment score ending in a blank
        self.blank_rec: _Record | None = None
        self.blank_end = 0
        self.token = _NONE  # best alignment score ending in the last token
        self.token_rec: _Record | None = None
        self.token_end = 0
        self.state = state  # its context graph state
        self.bonus = bonus  # its context bonus so far

    def rank(self) -> float:
        return max(self.blank, self.token) + self.bonus


def log_probabilities(logits: np.ndarray, banned_ids: Sequence[int] = ()) -> np.ndarray:
    """log_softmax of ``logits`` (frames, vocab), banned tokens at minus infinity."""
    logits = np.asarray(logits, dtype=np.float32)
    if banned_ids:
        logits = logits.copy()
        logits[:, list(banned_ids)] = -np.inf
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top(rows: np.ndarray, count: int) -> np.ndarray:
    """Per row, the indices of its ``count`` largest values (any order)."""
    count = min(count, rows.shape[1])
    return np.argpartition(-rows, count - 1, axis=1)[:, :count]


def biased_ctc(
    logits: np.ndarray,
    graph: ContextGraph,
    *,
    beam: int = DEFAULT_BEAM,
    blank_id: int = BLANK_ID,
    banned_ids: Sequence[int] = (),
    query_frames: int = QUERY_FRAMES,
) -> CtcTokens:
    """The best prefix of a beam search over ``logits`` (frames, vocab) with ``graph``'s
    bonuses: its tokens, each one's first frame, posterior there and end of run."""
    if beam < 1:
        raise ValueError("beam must be at least 1")
    frames = int(np.asarray(logits).shape[0])
    query = greedy_ctc(logits[:query_frames], blank_id=blank_id, banned_ids=banned_ids)
    if frames <= query_frames:
        return query
    logp = log_probabilities(logits, banned_ids)
    search = _Search(graph, blank_id)
    hyps = [search.start(query, query_frames)]
    candidates = _candidates(logp[query_frames:], graph, beam, blank_id)
    for offset, frame_candidates in enumerate(candidates):
        hyps = search.frame(hyps, logp, query_frames + offset, frame_candidates, beam)
    best = max(hyps, key=lambda h: h.rank() + graph.finish(h.state))
    return _tokens(best, query, logp)


def _candidates(audio: np.ndarray, graph: ContextGraph, beam: int, blank_id: int) -> np.ndarray:
    """Per audio frame, the tokens every prefix may extend by: the ``beam + 1`` most
    likely, and the ``beam + 1`` most likely once each token's largest bonus is added."""
    bonus = graph.bonus_vector(audio.shape[1])
    bonus[blank_id] = 0.0
    plain = _top(audio, beam + 1)
    boosted_ids = np.flatnonzero(bonus)  # only the phrases' tokens gain from a bonus
    if boosted_ids.size > beam + 1:
        ranks = _top(audio[:, boosted_ids] + bonus[boosted_ids], beam + 1)
        boosted = boosted_ids[ranks]
    else:
        boosted = np.broadcast_to(boosted_ids, (audio.shape[0], boosted_ids.size))
    return np.concatenate([plain, boosted], axis=1)


class _Search:
    """The search's state across frames: the prefix trie and the graph it scores by."""

    def __init__(self, graph: ContextGraph, blank_id: int) -> None:
        self.graph = graph
        self.blank_id = blank_id
        self.keys: dict[tuple[int, int], int] = {}  # the trie: (parent key, token) -> key

    def key(self, parent: int, token: int) -> int:
        key = self.keys.get((parent, token))
        if key is None:
            key = self.keys[(parent, token)] = len(self.keys) + 1
        return key

    def start(self, query: CtcTokens, query_frames: int) -> _Prefix:
        """The one prefix the search starts from: the query rows' greedy tokens."""
        rec: _Record | None = None
        end = 0
        key = 0
        for token, start, stop in zip(query.ids, query.frames, query.end_frames, strict=True):
            rec = (token, start, end, rec)
            end = stop
            key = self.key(key, token)
        first = _Prefix(key, query.ids[-1] if query.ids else self.blank_id, ROOT, 0.0)
        if query.ids and query.end_frames[-1] == query_frames:  # the run may go on
            first.token, first.token_rec, first.token_end = 0.0, rec, end
        else:
            first.blank, first.blank_rec, first.blank_end = 0.0, rec, end
        return first

    def frame(
        self, hyps: list[_Prefix], logp: np.ndarray, t: int, candidates: np.ndarray, beam: int
    ) -> list[_Prefix]:
        """The ``beam`` best prefixes after frame ``t``."""
        tokens = set(candidates.tolist())
        tokens.discard(self.blank_id)
        row = self._row(hyps, logp, t, tokens)
        out: dict[int, _Prefix] = {}
        for h in hyps:
            self._stay(h, out, row, t)
            self._extend(h, out, row, t, self._new_tokens(h, tokens, row))
        if len(out) <= beam:
            return list(out.values())
        return sorted(out.values(), key=_Prefix.rank, reverse=True)[:beam]

    def _row(
        self, hyps: list[_Prefix], logp: np.ndarray, t: int, tokens: set[int]
    ) -> dict[int, float]:
        """Only the log-probabilities frame ``t`` can use, as Python floats (a whole row
        of the real vocabulary is 25,055 of them)."""
        needed = tokens | {self.blank_id} | {h.last for h in hyps}
        for h in hyps:
            if h.state != ROOT:
                needed.update(self.graph.children(h.state))
        wanted = list(needed)
        return dict(zip(wanted, logp[t, wanted].tolist(), strict=True))

    def _stay(self, h: _Prefix, out: dict[int, _Prefix], row: dict[int, float], t: int) -> None:
        """``h`` unchanged into ``out``: through a blank, or its last token's run going on."""
        p_blank = row[self.blank_id]
        same = out.get(h.key)
        if same is None:
            same = out[h.key] = _Prefix(h.key, h.last, h.state, h.bonus)
        if h.blank + p_blank > same.blank:
            same.blank = h.blank + p_blank
            same.blank_rec, same.blank_end = h.blank_rec, h.blank_end
        if h.token + p_blank > same.blank:
            same.blank = h.token + p_blank
            same.blank_rec, same.blank_end = h.token_rec, h.token_end
        if h.token > _NONE and h.last != self.blank_id:
            score = h.token + row[h.last]
            if score > same.token:
                same.token, same.token_rec, same.token_end = score, h.token_rec, t + 1

    def _new_tokens(self, h: _Prefix, tokens: set[int], row: dict[int, float]) -> set[int]:
        """The frame's candidates, and the likeliest tokens continuing ``h``'s open match."""
        if h.state == ROOT:
            return tokens
        nexts = self.graph.children(h.state)
        if len(nexts) > _MATCH_CANDIDATES:
            nexts = sorted(nexts, key=row.__getitem__, reverse=True)[:_MATCH_CANDIDATES]
        return tokens.union(nexts)

    def _extend(
        self,
        h: _Prefix,
        out: dict[int, _Prefix],
        row: dict[int, float],
        t: int,
        tokens: set[int],
    ) -> None:
        """``h`` extended by each of ``tokens`` into ``out`` (a repeat of its last token
        only after a blank), each new prefix scored with the graph's step."""
        best_from_blank = h.blank >= h.token
        for c in tokens:
            if c == h.last:
                if h.blank == _NONE:
                    continue
                base, src_rec, src_end = h.blank, h.blank_rec, h.blank_end
            elif best_from_blank:
                base, src_rec, src_end = h.blank, h.blank_rec, h.blank_end
            else:
                base, src_rec, src_end = h.token, h.token_rec, h.token_end
            score = base + row[c]
            if score == _NONE:
                continue
            child_key = self.key(h.key, c)
            target = out.get(child_key)
            if target is None:
                gain, state = self.graph.step(h.state, c)
                target = out[child_key] = _Prefix(child_key, c, state, h.bonus + gain)
            if score > target.token:
                target.token, target.token_end = score, t + 1
                target.token_rec = (c, t, src_end, src_rec)


def _tokens(best: _Prefix, query: CtcTokens, logp: np.ndarray) -> CtcTokens:
    """``best``'s tokens read back from its records, the query's greedy confidences kept
    and each audio token's posterior at its first frame."""
    if best.token >= best.blank:
        rec, end = best.token_rec, best.token_end
    else:
        rec, end = best.blank_rec, best.blank_end
    ids: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    while rec is not None:
        token, start, previous_end, rec = rec
        ids.append(token)
        starts.append(start)
        ends.append(end)
        end = previous_end
    ids.reverse()
    starts.reverse()
    ends.reverse()
    count = len(query.ids)
    confidences = list(query.confidences)
    if len(ids) > count:
        rows = np.asarray(starts[count:])
        confidences += np.exp(logp[rows, np.asarray(ids[count:])]).tolist()
    return CtcTokens(
        ids=tuple(ids),
        frames=tuple(starts),
        confidences=tuple(float(c) for c in confidences),
        end_frames=tuple(ends),
    )
