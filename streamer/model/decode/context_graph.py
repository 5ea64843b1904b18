"""A context graph: Aho-Corasick over token-id phrases, scoring a decoder's progress.

The idea of icefall's and k2's ``ContextGraph`` (written anew here): the phrases form a
trie; each step that extends a match earns the phrase's bonus for that token; a step
that breaks a match falls back along failure links (to the longest suffix that is still
a phrase's prefix) and gives back the bonus of the tokens that no longer count; a step
that completes a phrase banks its bonus, so breaking off later keeps it. At the end of
a hypothesis, :meth:`ContextGraph.finish` takes back what is still only partial.
Overlapping phrases all count: the output links of each node reach every phrase that
ends there as a suffix.

States are node indices (ints), so a beam search can keep them in plain tuples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROOT = 0  # the state of a hypothesis that matches nothing


@dataclass
class _Node:
    token: int
    token_score: float  # bonus of the step that reaches this node
    node_score: float  # bonus of the whole path from the root (what a break gives back)
    depth: int
    children: dict[int, int] = field(default_factory=dict)
    fail: int = ROOT
    end: bool = False  # a phrase ends here
    output: int | None = None  # the nearest node on the failure chain where a phrase ends
    output_score: float = 0.0  # banked when this node is reached: phrases ending here


class ContextGraph:
    """The phrases ``phrases`` (token-id sequences), each with its per-token ``boosts``.

    Build once per phrase set (it is immutable); :meth:`step` and :meth:`finish` are
    what a decoder calls per emitted token and per finished hypothesis.
    """

    def __init__(self, phrases: Sequence[Sequence[int]], boosts: Sequence[float]) -> None:
        if len(phrases) != len(boosts):
            raise ValueError("one boost per phrase")
        self._nodes = [_Node(token=-1, token_score=0.0, node_score=0.0, depth=0)]
        for tokens, boost in zip(phrases, boosts, strict=True):
            if tokens and boost > 0:
                self._insert([int(t) for t in tokens], float(boost))
        self._link()
        self.phrases = sum(1 for n in self._nodes if n.end)
        # the largest bonus any step to each token can earn (a decoder's pruning bound)
        self.token_bonus: dict[int, float] = {}
        for node in self._nodes[1:]:
            best = self.token_bonus.get(node.token, 0.0)
            self.token_bonus[node.token] = max(best, node.token_score)

    def __len__(self) -> int:
        return len(self._nodes)

    def _insert(self, tokens: list[int], boost: float) -> None:
        state = ROOT
        for token in tokens:
            node = self._nodes[state]
            child = node.children.get(token)
            if child is None:
                child = len(self._nodes)
                node.children[token] = child
                self._nodes.append(_Node(token, boost, 0.0, node.depth + 1))
            else:  # a prefix shared by several phrases earns the largest of their boosts
                self._nodes[child].token_score = max(self._nodes[child].token_score, boost)
            state = child
        self._nodes[state].end = True

    def _link(self) -> None:
        """Path scores, failure and output links, breadth first (a node's failure
        target is shallower, so it is complete when the node is reached)."""
        for index in self._nodes[ROOT].children.values():
            self._nodes[index].node_score = self._nodes[index].token_score
        queue = deque(self._nodes[ROOT].children.values())
        while queue:
            current = queue.popleft()
            node = self._nodes[current]
            fail = self._nodes[node.fail]
            node.output = node.fail if fail.end else fail.output
            node.output_score = (node.node_score if node.end else 0.0) + (
                self._nodes[node.output].output_score if node.output is not None else 0.0
            )
            for token, index in node.children.items():
                child = self._nodes[index]
                child.node_score = node.node_score + child.token_score
                child.fail = self._goto(node.fail, token) if current != ROOT else ROOT
                queue.append(index)

    def _goto(self, state: int, token: int) -> int:
        """Follow failure links from ``state`` to the first node with a ``token`` child."""
        while True:
            child = self._nodes[state].children.get(token)
            if child is not None:
                return child
            if state == ROOT:
                return ROOT
            state = self._nodes[state].fail

    def step(self, state: int, token: int) -> tuple[float, int]:
        """The bonus of emitting ``token`` in ``state`` (negative when a match breaks and
        its partial bonus is given back), and the next state."""
        node = self._nodes[state]
        child = node.children.get(token)
        if child is not None:
            score = self._nodes[child].token_score
        else:
            child = ROOT if state == ROOT else self._goto(node.fail, token)
            score = self._nodes[child].node_score - node.node_score
        return score + self._nodes[child].output_score, child

    def finish(self, state: int) -> float:
        """What a hypothesis ending in ``state`` gives back: its unfinished match."""
        return -self._nodes[state].node_score

    def bonus_vector(self, vocab_size: int) -> np.ndarray:
        """:attr:`token_bonus` as a dense ``(vocab_size,)`` float32 array (0 elsewhere)."""
        vector = np.zeros(vocab_size, np.float32)
        for token, bonus in self.token_bonus.items():
            if 0 <= token < vocab_size:
                vector[token] = bonus
        return vector

    def children(self, state: int) -> list[int]:
        """Tokens that extend the match of ``state`` (its trie children)."""
        return list(self._nodes[state].children)
