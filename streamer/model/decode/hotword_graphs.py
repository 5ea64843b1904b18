"""A session's hotwords as a context graph over the model's own tokens, built once.

The session carries its phrases as checked text (:mod:`streamer.core.hotwords`); the
tokenizer lives with the model, so this is where they become token ids. Each phrase is
encoded as sentencepiece does (a ``▁`` word-start in front: how a word after a space or
at the start appears in the output) and, where the vocabulary has it, also without that
``▁`` (how a CJK phrase inside a sentence appears). A phrase whose encoding has the
unknown piece or a special token (``<|en|>``), or more than ``max_tokens`` tokens, is
left out, and the result says how many were and why (never which: phrases are not
logged above debug).

:class:`HotwordGraphs` keeps the graphs of the last few phrase sets (a session sends
the same set with every decode), so a graph is built once per session phrase set.
Not thread-safe: the recognizer's one decoding thread uses it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamer.core.hotwords import MAX_PHRASE_TOKENS, Hotwords, active
from streamer.errors import ModelError
from streamer.model.decode.context_graph import ContextGraph

if TYPE_CHECKING:
    from streamer.model.decode.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHED_GRAPHS = 64  # phrase sets kept (about one per open session with hotwords)
_UNKNOWN_ID = 0  # sentencepiece's <unk>, SenseVoice's CTC blank


@dataclass(frozen=True)
class CompiledHotwords:
    """A phrase set ready for the search."""

    graph: ContextGraph | None  # None: nothing to bias (no phrase, or all boosts 0)
    unused: str = ""  # why some phrases are not used (counts, no phrase text); "" if none


class HotwordGraphs:
    """Phrase sets to context graphs with ``tokenizer``, the last :data:`CACHED_GRAPHS`
    kept."""

    def __init__(self, tokenizer: Tokenizer, *, max_tokens: int = MAX_PHRASE_TOKENS) -> None:
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        self._graphs: OrderedDict[Hotwords, CompiledHotwords] = OrderedDict()
        self._pieces: list[str] | None = None
        self._index: dict[str, int] = {}
        self.built = 0  # graphs built so far (a test counts them)

    def compile(self, words: Hotwords) -> CompiledHotwords:
        found = self._graphs.get(words)
        if found is not None:
            self._graphs.move_to_end(words)
            return found
        compiled = self._build(words)
        self._graphs[words] = compiled
        if len(self._graphs) > CACHED_GRAPHS:
            self._graphs.popitem(last=False)
        return compiled

    def _build(self, words: Hotwords) -> CompiledHotwords:
        self.built += 1
        used = active(words)
        if not used:
            return CompiledHotwords(None)
        phrases: list[list[int]] = []
        boosts: list[float] = []
        unknown = too_long = 0
        skipped: list[str] = []  # for the debug log only: phrases are user data
        for word in used:
            variants = self._encodings(word.phrase)
            if not variants:
                unknown += 1
                skipped.append(word.phrase)
                continue
            if len(variants[0]) > self._max_tokens:
                too_long += 1
                skipped.append(word.phrase)
                continue
            for ids in variants:
                phrases.append(ids)
                boosts.append(word.boost)
        reasons = []
        if unknown:
            reasons.append(f"{unknown} with characters or tags the model's vocabulary lacks")
        if too_long:
            reasons.append(f"{too_long} over {self._max_tokens} tokens")
        unused = ""
        if reasons:
            unused = f"{unknown + too_long} of {len(used)} hotwords are not used: " + ", ".join(
                reasons
            )
        if skipped:
            logger.debug("hotwords skipped (the vocabulary cannot spell them): %r", skipped)
        graph = ContextGraph(phrases, boosts) if phrases else None
        logger.debug("hotword graph: %d phrases, %d nodes", len(phrases), len(graph or ()))
        return CompiledHotwords(graph, unused)

    def _encodings(self, phrase: str) -> list[list[int]]:
        """The phrase's token ids with its word-start ``▁`` (first) and without it;
        empty when it cannot be encoded."""
        try:
            ids = [int(i) for i in self._tokenizer.encode(phrase)]
            pieces = self._piece_table()
        except ModelError as error:
            logger.debug("hotwords cannot be encoded: %s", error)
            return []
        if not ids or any(i == _UNKNOWN_ID or not 0 <= i < len(pieces) for i in ids):
            return []
        if any(_special(pieces[i]) for i in ids):
            return []
        variants = [ids]
        first = pieces[ids[0]]
        if first == "▁" and len(ids) > 1:
            variants.append(ids[1:])
        elif first.startswith("▁") and first[1:] in self._index:
            variants.append([self._index[first[1:]], *ids[1:]])
        return variants

    def _piece_table(self) -> Sequence[str]:
        if self._pieces is None:
            self._pieces = self._tokenizer.pieces()
            self._index = {piece: i for i, piece in enumerate(self._pieces)}
        return self._pieces


def _special(piece: str) -> bool:
    return piece.startswith("<|") and piece.endswith("|>")
