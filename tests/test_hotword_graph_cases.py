"""More context-graph and search cases, found by an independent second implementation
(i22b) and checked against the landed one: phrases that are prefixes of each other, a
phrase with a repeated token, and a query-row token whose run crosses into the audio."""

from __future__ import annotations

import numpy as np
import pytest

from streamer.model.decode.context_graph import ROOT, ContextGraph
from streamer.model.decode.ctc import greedy_ctc
from streamer.model.decode.ctc_beam import biased_ctc

VOCAB = 12  # 0 is the blank


def total_bonus(graph: ContextGraph, tokens: list[int]) -> float:
    state, total = ROOT, 0.0
    for token in tokens:
        gain, state = graph.step(state, token)
        total += gain
    return total + graph.finish(state)


def probabilities(*rows: dict[int, float], floor: float = 1e-4) -> np.ndarray:
    """Log-probabilities: each row's listed tokens at their probability, renormalised."""
    out = np.full((len(rows), VOCAB), floor)
    for t, row in enumerate(rows):
        for token, p in row.items():
            out[t, token] = p
        out[t] /= out[t].sum()
    return np.log(out).astype(np.float32)


def test_a_phrase_that_is_a_prefix_of_another_keeps_its_bonus() -> None:
    graph = ContextGraph([[1, 2], [1, 2, 3]], [1.0, 1.0])
    assert total_bonus(graph, [1, 2, 9]) == pytest.approx(2.0)  # "1 2" done, "1 2 3" broken
    assert total_bonus(graph, [1, 2]) == pytest.approx(2.0)  # the segment ends after "1 2"
    assert total_bonus(graph, [1, 2, 3]) == pytest.approx(5.0)  # both phrases


def test_a_phrase_with_a_repeated_token_matches_after_a_false_start() -> None:
    graph = ContextGraph([[1, 1, 2]], [1.0])
    assert total_bonus(graph, [1, 1, 1, 2]) == pytest.approx(3.0)
    assert total_bonus(graph, [1, 2, 1, 2, 1, 1]) == pytest.approx(0.0)


def test_a_query_token_whose_run_crosses_into_the_audio_is_not_emitted_twice() -> None:
    query = [{7: 0.9}, {8: 0.9}, {9: 0.9}, {10: 0.9}]
    audio = [{10: 0.9}, {1: 0.5, 3: 0.4}, {0: 0.9}, {2: 0.5, 4: 0.4}, {0: 0.9}]
    logits = probabilities(*query, *audio)
    greedy = greedy_ctc(logits)
    assert greedy.ids == (7, 8, 9, 10, 1, 2)
    tokens = biased_ctc(logits, ContextGraph([[3, 4]], [1.0]))
    assert tokens.ids == (7, 8, 9, 10, 3, 4)
    assert tokens.frames[:4] == greedy.frames[:4]
    assert tokens.end_frames[:4] == greedy.end_frames[:4]  # 10's run ends at frame 5


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
def test_a_vanishing_bonus_on_a_token_the_audio_uses_leaves_greedy(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 10))
    graph = ContextGraph([[5], [6, 7]], [1e-9, 1e-9])
    for _ in range(50):
        logits = (rng.normal(0.0, 1.0, (30, VOCAB)) * scale).astype(np.float32)
        assert biased_ctc(logits, graph).ids == greedy_ctc(logits).ids
