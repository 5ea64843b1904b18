"""SenseVoiceSmall's own layout: query rows, special-token ids, frontend settings.

Facts of the model itself, shared by the recognizer backends and the random-model builder
in :mod:`streamer.testkit.models` (which imports them from here, never the reverse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SAMPLE_RATE = 16000  # the model's input rate, in Hz
# Below one 25 ms analysis window the fbank backends fail (generate() raises), and there
# is nothing to recognise: both decode paths return an empty transcript instead.
MIN_DECODE_SAMPLES = 400

# Rows of SenseVoiceSmall.embed used as query frames (not token ids), as in inference().
LID_ROWS = {"auto": 0, "zh": 3, "en": 4, "yue": 7, "ja": 11, "ko": 12, "nospeech": 13}
TEXTNORM_ROWS = {"withitn": 14, "woitn": 15}
EVENT_EMO_ROWS = (1, 2)

# Special tokens at the ids the real 25055-piece vocabulary uses (from funasr's code).
KNOWN_SPECIAL_IDS = {
    "<|zh|>": 24884,
    "<|en|>": 24885,
    "<|yue|>": 24888,
    "<|ja|>": 24892,
    "<|ko|>": 24896,
    "<|nospeech|>": 24992,
    "<|HAPPY|>": 25001,
    "<|SAD|>": 25002,
    "<|ANGRY|>": 25003,
    "<|NEUTRAL|>": 25004,
    "<|EMO_UNKNOWN|>": 25009,
    "<|withitn|>": 25016,
    "<|woitn|>": 25017,
}
REAL_VOCAB_SIZE = 25055

FRONTEND_CONF = {
    "fs": 16000,
    "window": "hamming",
    "n_mels": 80,
    "frame_length": 25,
    "frame_shift": 10,
    "lfr_m": 7,
    "lfr_n": 6,
}
FEATURE_DIM = 560  # n_mels * lfr_m
LANGUAGES = tuple(LID_ROWS)  # "auto", "zh", "en", "yue", "ja", "ko", "nospeech"


def prepend_queries(
    model: Any,
    speech: torch.Tensor,
    lengths: torch.Tensor,
    language_rows: Sequence[int],
    textnorm_rows: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix features with the 4 query frames exactly as ``SenseVoiceSmall.inference``.

    Frames are ``[language, 1, 2, textnorm]`` rows of ``model.embed``, one row index per
    batch item. Returns new tensors (the encoder scales its input in place).
    """
    import torch

    device = speech.device
    language = model.embed(torch.tensor(list(language_rows), device=device)[:, None])
    textnorm = model.embed(torch.tensor(list(textnorm_rows), device=device)[:, None])
    event_emo = model.embed(torch.tensor([list(EVENT_EMO_ROWS)], device=device)).repeat(
        speech.size(0), 1, 1
    )
    speech = torch.cat((textnorm, speech), dim=1)
    speech = torch.cat((torch.cat((language, event_emo), dim=1), speech), dim=1)
    return speech, lengths + 4
