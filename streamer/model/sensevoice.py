"""SenseVoiceSmall's own layout: query rows, special-token ids, frontend, tag rendering.

Facts of the model itself, shared by the recognizer backends and the random-model builder
in :mod:`streamer.testkit.models` (which imports them from here, never the reverse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from streamer.core.audio import SAMPLE_RATE as SAMPLE_RATE  # the model's input rate

if TYPE_CHECKING:
    import torch

# Below one 25 ms analysis window the fbank backends fail (generate() raises), and there
# is nothing to recognise: both decode paths return an empty transcript instead.
MIN_DECODE_SAMPLES = 400
QUERY_FRAMES = 4  # encoder frames 0-3: language, emotion, event, ITN; audio starts at 4
FRAME_MS = 60  # audio per encoder frame after the query frames (one LFR frame: 6 x 10 ms)
BLANK_ID = 0  # the CTC blank (<unk> in the tokenizer)
EMO_UNKNOWN_ID = 25009  # what inference()'s ban_emo_unk suppresses (real vocabulary)

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

# WavFrontend's settings in the real model's config.yaml
N_MELS = 80  # mel bins per 10 ms frame
FRAME_LENGTH_MS = 25  # analysis window
FRAME_SHIFT_MS = 10  # between windows
WINDOW = "hamming"
LFR_M = 7  # low frame rate: frames stacked into one feature vector
LFR_N = 6  # frames between stacked vectors (one every 60 ms)
FRONTEND_CONF: dict[str, int | str] = {
    "fs": SAMPLE_RATE,
    "window": WINDOW,
    "n_mels": N_MELS,
    "frame_length": FRAME_LENGTH_MS,
    "frame_shift": FRAME_SHIFT_MS,
    "lfr_m": LFR_M,
    "lfr_n": LFR_N,
}
FEATURE_DIM = N_MELS * LFR_M  # 560
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


# --- rich transcription: tags rendered as emoji, as funasr's rich_transcription_postprocess

_LANGUAGE_TAGS = ("<|zh|>", "<|en|>", "<|yue|>", "<|ja|>", "<|ko|>", "<|nospeech|>")
_EMOTION_EMOJI = {  # in funasr's order: the first of equally frequent emotions wins
    "<|HAPPY|>": "😊",
    "<|SAD|>": "😔",
    "<|ANGRY|>": "😡",
    "<|NEUTRAL|>": "",
    "<|FEARFUL|>": "😰",
    "<|DISGUSTED|>": "🤢",
    "<|SURPRISED|>": "😮",
}
_EVENT_EMOJI = {  # prefixed in this order, so the last present ends up first
    "<|BGM|>": "🎼",
    "<|Speech|>": "",
    "<|Applause|>": "👏",
    "<|Laughter|>": "😀",
    "<|Cry|>": "😭",
    "<|Sneeze|>": "🤧",
    "<|Breath|>": "",
    "<|Cough|>": "🤧",
}
_REMOVED_TAGS = (  # every tag counted and removed from the text
    *_LANGUAGE_TAGS,
    *_EMOTION_EMOJI,
    *_EVENT_EMOJI,
    "<|EMO_UNKNOWN|>",
    "<|Sing|>",
    "<|Speech_Noise|>",
    "<|withitn|>",
    "<|woitn|>",
    "<|GBG|>",
    "<|Event_UNK|>",
)
_EMOTION_CHARS = "😊😔😡😰🤢😮"
_EVENT_CHARS = "🎼👏😀😭🤧😷"
_LANGUAGE_MARK = "<|lang|>"


def rich_text(raw: str) -> str:
    """SenseVoice output with its tags rendered as emoji: ``"😀hello there😊"``.

    Gives what funasr's ``rich_transcription_postprocess`` gives (the tests compare them),
    without importing funasr: the ONNX backend runs without it.
    """
    s = raw.replace("<|nospeech|><|Event_UNK|>", "❓")
    for tag in _LANGUAGE_TAGS:
        s = s.replace(tag, _LANGUAGE_MARK)
    parts = [_render_part(part).strip(" ") for part in s.split(_LANGUAGE_MARK)]
    out = " " + parts[0]
    event = _leading_event(out)
    for part in parts[1:]:
        if part and _leading_event(part) is not None and _leading_event(part) == event:
            part = part[1:]  # the same event as the previous language segment: shown once
        if not part:
            continue
        event = _leading_event(part)
        emotion = _trailing_emotion(part)
        if emotion is not None and emotion == _trailing_emotion(out):
            out = out[:-1]  # the same emotion: shown once, at the end
        out += part.strip()
    return out.replace("The.", " ").strip()


def _render_part(s: str) -> str:
    counts: dict[str, int] = {}
    for tag in _REMOVED_TAGS:
        counts[tag] = counts.get(tag, 0) + s.count(tag)
        s = s.replace(tag, "")
    emotion = "<|NEUTRAL|>"
    for tag in _EMOTION_EMOJI:
        if counts[tag] > counts[emotion]:
            emotion = tag
    for tag, emoji in _EVENT_EMOJI.items():
        if counts[tag] > 0:
            s = emoji + s
    s += _EMOTION_EMOJI[emotion]
    for emoji in _EMOTION_CHARS + _EVENT_CHARS:
        s = s.replace(" " + emoji, emoji).replace(emoji + " ", emoji)
    return s.strip()


def _leading_event(s: str) -> str | None:
    return s[0] if s[0] in _EVENT_CHARS else None


def _trailing_emotion(s: str) -> str | None:
    return s[-1] if s[-1] in _EMOTION_CHARS else None
