"""Greedy CTC decoding of one utterance's logits (argmax, repeats collapsed, blanks
dropped), with each token's first encoder frame, its posterior there and its run's end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streamer.errors import DecodeError
from streamer.model.sensevoice import BLANK_ID

# log_softmax subtracts one constant per frame, so the argmax of the logits is the argmax
# of inference()'s log-probabilities except where rounding makes two near-equal logits
# equal; frames whose best two logits are this close (relative) are decided on log_softmax.
_TIE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class CtcTokens:
    """Greedy CTC output of one utterance."""

    ids: tuple[int, ...]  # token ids, repeats collapsed and blanks removed
    frames: tuple[int, ...]  # encoder frame where each token's run starts
    confidences: tuple[float, ...]  # softmax posterior of each token at that frame
    end_frames: tuple[int, ...] = ()  # one past the last frame of each token's run


def greedy_ctc(
    logits: np.ndarray, *, blank_id: int = BLANK_ID, banned_ids: Sequence[int] = ()
) -> CtcTokens:
    """Greedy CTC decoding of ``logits`` (frames, vocab), as SenseVoice's inference().

    ``banned_ids`` never win a frame (inference()'s ``ban_emo_unk``).
    """
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2:
        raise DecodeError(f"CTC logits must be (frames, vocab), not shape {logits.shape}")
    if logits.shape[0] == 0:
        return CtcTokens((), (), (), ())
    if banned_ids:
        logits = logits.copy()
        logits[:, list(banned_ids)] = -np.inf
    best = logits.argmax(axis=-1)
    rows = np.arange(logits.shape[0])
    top = logits[rows, best]
    runner_up = logits.copy()
    runner_up[rows, best] = -np.inf
    second = runner_up.max(axis=-1)
    close = (top - second) <= _TIE_TOLERANCE * np.maximum(np.abs(top), 1.0)
    if close.any():
        best[close] = _log_softmax(logits[close]).argmax(axis=-1)
    runs = np.flatnonzero(np.concatenate(([True], best[1:] != best[:-1])))
    run_ends = np.append(runs[1:], best.size)
    spoken = best[runs] != blank_id
    starts, ends = runs[spoken], run_ends[spoken]
    if starts.size == 0:
        return CtcTokens((), (), (), ())
    ids = best[starts]
    log_posteriors = _log_softmax(logits[starts])[np.arange(starts.size), ids]
    return CtcTokens(
        ids=tuple(int(i) for i in ids),
        frames=tuple(int(f) for f in starts),
        confidences=tuple(float(p) for p in np.exp(log_posteriors)),
        end_frames=tuple(int(f) for f in ends),
    )


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
