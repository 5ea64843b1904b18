"""The context graph and the biased CTC beam search, on crafted CTC posteriors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from streamer.model.decode.context_graph import ROOT, ContextGraph
from streamer.model.decode.ctc import greedy_ctc
from streamer.model.decode.ctc_beam import biased_ctc, log_probabilities

VOCAB = 8  # 0 is the blank


def frames(*rows: dict[int, float], floor: float = -12.0) -> np.ndarray:
    """Logits: each row's listed tokens at their log-probability, the rest at ``floor``."""
    out = np.full((len(rows), VOCAB), floor, np.float32)
    for t, row in enumerate(rows):
        for token, logp in row.items():
            out[t, token] = logp
    return out


def total_bonus(graph: ContextGraph, tokens: list[int]) -> float:
    state, total = ROOT, 0.0
    for token in tokens:
        gain, state = graph.step(state, token)
        total += gain
    return total + graph.finish(state)


# -- the context graph -------------------------------------------------------------------


def test_a_full_match_keeps_its_bonus_a_partial_one_gives_it_back() -> None:
    graph = ContextGraph([[3, 4, 5]], [1.5])
    assert total_bonus(graph, [3, 4, 5]) == pytest.approx(4.5)
    assert total_bonus(graph, [3, 4, 5, 7]) == pytest.approx(4.5)  # banked before the break
    gain, state = graph.step(ROOT, 3)
    assert gain == pytest.approx(1.5)
    gain, state = graph.step(state, 4)
    assert gain == pytest.approx(1.5)
    gain, state = graph.step(state, 7)  # the match breaks: both tokens' bonus goes back
    assert gain == pytest.approx(-3.0) and state == ROOT
    assert total_bonus(graph, [3, 4]) == pytest.approx(0.0)  # ended mid-phrase
    assert total_bonus(graph, [1, 2, 6]) == 0.0


def test_a_broken_match_falls_back_to_the_suffix_that_still_matches() -> None:
    graph = ContextGraph([[1, 2, 3], [2, 4]], [1.0, 1.0])
    # 1 2 then 4: "1 2 3" breaks, "2 4" (its suffix 2 and then 4) completes
    assert total_bonus(graph, [1, 2, 4]) == pytest.approx(2.0)
    # 1 1 2 3: the first 1 breaks into a new start, the phrase still completes
    assert total_bonus(graph, [1, 1, 2, 3]) == pytest.approx(3.0)


def test_overlapping_phrases_both_count() -> None:
    graph = ContextGraph([[1, 2], [2, 3]], [1.0, 1.0])
    assert total_bonus(graph, [1, 2, 3]) == pytest.approx(4.0)  # 1 2 and 2 3, 2 each
    nested = ContextGraph([[1, 2, 3], [2]], [1.0, 1.0])
    assert total_bonus(nested, [1, 2, 3]) == pytest.approx(4.0)  # 1 2 3 (3) and 2 (1)
    assert total_bonus(nested, [1, 2, 7]) == pytest.approx(1.0)  # only the inner one


def test_zero_boosts_and_empty_phrases_make_an_empty_graph() -> None:
    graph = ContextGraph([[1, 2], []], [0.0, 3.0])
    assert len(graph) == 1 and graph.phrases == 0
    assert graph.step(ROOT, 1) == (0.0, ROOT)


def test_a_shared_prefix_earns_the_larger_boost() -> None:
    graph = ContextGraph([[1, 2], [1, 3]], [1.0, 2.5])
    assert total_bonus(graph, [1, 2]) == pytest.approx(3.5)  # 2.5 for 1, then 1.0 for 2
    assert total_bonus(graph, [1, 3]) == pytest.approx(5.0)


# -- the search ------------------------------------------------------------------------


def test_greedy_picks_the_competitor_and_the_biased_search_the_hotword() -> None:
    logits = frames(
        {2: -0.4, 3: -1.3, 0: -3.0},
        {0: -0.1},
        {5: -0.5, 4: -1.2, 0: -3.0},
        {0: -0.1},
    )
    assert greedy_ctc(logits).ids == (2, 5)
    assert biased_ctc(logits, ContextGraph([], []), query_frames=0).ids == (2, 5)
    tokens = biased_ctc(logits, ContextGraph([[3, 4]], [1.0]), query_frames=0)
    assert tokens.ids == (3, 4)
    assert tokens.frames == (0, 2)
    assert tokens.end_frames == (1, 3)
    posteriors = np.exp(log_probabilities(logits))
    assert tokens.confidences == pytest.approx((posteriors[0, 3], posteriors[2, 4]), rel=1e-5)
    assert tokens.confidences[0] == pytest.approx(math.exp(-1.3), rel=0.05)  # rows ~ normalised


def test_a_hotword_ranked_low_by_the_audio_still_enters_the_beam() -> None:
    # token 6 is the 6th most likely of 8: the plain top-beam would never consider it
    row = {1: -1.0, 2: -1.1, 3: -1.2, 4: -1.3, 5: -1.4, 6: -1.6, 0: -2.0}
    logits = frames(row, {0: -0.01})
    assert biased_ctc(logits, ContextGraph([[6]], [2.0]), beam=2, query_frames=0).ids == (6,)


def test_a_broken_partial_match_gives_its_bonus_back() -> None:
    # 3 is 0.5 below 2, and what follows is 5, not the phrase's 4: without the bonus
    # given back, 3 5 (bonus 1.0) would beat 2 5
    logits = frames({2: -0.3, 3: -0.8}, {0: -0.1}, {5: -0.05, 4: -6.0}, {0: -0.1})
    graph = ContextGraph([[3, 4]], [1.0])
    assert biased_ctc(logits, graph, query_frames=0).ids == (2, 5)
    # the same when the utterance ends inside the phrase
    short = frames({2: -0.3, 3: -0.8}, {0: -0.1})
    assert biased_ctc(short, graph, query_frames=0).ids == (2,)
    # and with a bonus large enough for the whole phrase, the phrase wins
    assert biased_ctc(logits, ContextGraph([[3, 4]], [4.0]), query_frames=0).ids == (3, 4)


def test_two_overlapping_phrases_both_match_in_the_output() -> None:
    logits = frames(
        {1: -0.1},
        {0: -0.1},
        {5: -0.4, 2: -1.4},
        {0: -0.1},
        {6: -0.4, 3: -1.4},
        {0: -0.1},
    )
    assert greedy_ctc(logits).ids == (1, 5, 6)
    one = ContextGraph([[1, 2]], [1.2])
    assert biased_ctc(logits, one, query_frames=0).ids == (1, 2, 6)
    both = ContextGraph([[1, 2], [2, 3]], [1.2, 1.2])
    assert biased_ctc(logits, both, query_frames=0).ids == (1, 2, 3)


def test_repeats_collapse_and_a_blank_separates_a_doubled_token() -> None:
    logits = frames({3: -0.1}, {3: -0.1}, {0: -0.1}, {3: -0.1}, {4: -0.1})
    tokens = biased_ctc(logits, ContextGraph([[3, 3, 4]], [1.0]), query_frames=0)
    assert tokens.ids == (3, 3, 4) == greedy_ctc(logits).ids
    assert tokens.frames == (0, 3, 4)
    assert tokens.end_frames == (2, 4, 5)


def test_the_query_frames_are_decoded_as_greedy_decodes_them() -> None:
    # frames 0-3 (language, emotion, event, ITN): the hotword 7 would win frame 1 with
    # its bonus if the search covered the query rows; the run of 6 crosses into frame 4
    logits = frames(
        {1: -0.1},
        {2: -0.5, 7: -0.9},
        {0: -0.1},
        {6: -0.1},
        {6: -0.2},
        {7: -1.0, 5: -0.5},
    )
    tokens = biased_ctc(logits, ContextGraph([[7]], [2.0]))
    greedy = greedy_ctc(logits)
    assert greedy.ids == (1, 2, 6, 5)
    assert tokens.ids == (1, 2, 6, 7)
    assert tokens.frames[:3] == greedy.frames[:3] and tokens.end_frames[:3] == (1, 2, 5)


@pytest.mark.parametrize("seed", range(5))
def test_with_no_bonus_the_search_is_exactly_greedy(seed: int) -> None:
    """Peaky random posteriors (runs, blanks, near ties): with an empty graph the
    search's best prefix and its frames are greedy's, token for token."""
    rng = np.random.default_rng(seed)
    labels = rng.choice(VOCAB, size=120, p=[0.5] + [0.5 / (VOCAB - 1)] * (VOCAB - 1))
    labels = np.repeat(labels, rng.integers(1, 4, size=labels.size))[:200]
    logits = rng.normal(0, 1.0, (labels.size, VOCAB)).astype(np.float32)
    logits[np.arange(labels.size), labels] += 3.0
    for beam in (1, 4, 8):
        tokens = biased_ctc(logits, ContextGraph([[7, 7, 7, 7]], [0.0]), beam=beam)
        greedy = greedy_ctc(logits)
        assert tokens.ids == greedy.ids
        assert tokens.frames == greedy.frames
        assert tokens.end_frames == greedy.end_frames
        assert tokens.confidences == pytest.approx(greedy.confidences, rel=1e-5)


def test_banned_tokens_never_win_in_the_search_either() -> None:
    logits = frames({3: -0.1, 4: -2.0}, {0: -0.1})
    assert biased_ctc(logits, ContextGraph([[3]], [5.0]), banned_ids=(3,), query_frames=0).ids == (
        4,
    )
