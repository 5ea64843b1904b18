"""SenseVoice's tagged output, parsed into fields (I/O-free).

SenseVoice prefixes its text with up to four tags, for example
``<|en|><|HAPPY|><|Laughter|><|woitn|>hello there``: language, emotion, audio event and
whether inverse text normalisation was applied. Tags are recognised by their text, not
by token id, so a missing, reordered or unknown tag never breaks parsing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LANGUAGE_TAGS = frozenset({"zh", "en", "yue", "ja", "ko", "nospeech"})
EMOTION_TAGS = frozenset(
    {"HAPPY", "SAD", "ANGRY", "NEUTRAL", "FEARFUL", "DISGUSTED", "SURPRISED", "EMO_UNKNOWN"}
)
EVENT_TAGS = frozenset(
    {
        "Speech",
        "BGM",
        "Applause",
        "Laughter",
        "Cry",
        "Sneeze",
        "Breath",
        "Cough",
        "Sing",
        "Speech_Noise",
        "Event_UNK",
    }
)
ITN_TAGS = {"withitn": True, "woitn": False}

# How clients show the tags: (emoji, words). The one table; web_demo/captions.js holds a
# copy for the browser, and tests/test_transcript_display.py checks that they agree.
# Tags missing here (EMO_UNKNOWN, Speech, Event_UNK) are shown as nothing.
EMOTION_BADGES = {
    "HAPPY": ("😊", "happy"),
    "SAD": ("😢", "sad"),
    "ANGRY": ("😠", "angry"),
    "NEUTRAL": ("😐", "neutral"),
    "FEARFUL": ("😨", "fearful"),
    "DISGUSTED": ("🤢", "disgusted"),
    "SURPRISED": ("😮", "surprised"),
}
EVENT_BADGES = {
    "BGM": ("🎼", "background music"),
    "Applause": ("👏", "applause"),
    "Laughter": ("😀", "laughter"),
    "Cry": ("😭", "crying"),
    "Sneeze": ("🤧", "sneeze"),
    "Cough": ("😷", "cough"),
    "Breath": ("💨", "breath"),
    "Sing": ("🎤", "singing"),
    "Speech_Noise": ("🔊", "noise"),
}

_TAG_RE = re.compile(r"<\|([^|<>]*)\|>")


@dataclass(frozen=True)
class Tags:
    """The fields carried by SenseVoice's tags, and the text with every tag removed."""

    language: str | None  # "en", "zh", ...; None when the model emitted no language tag
    emotion: str | None  # "HAPPY", "NEUTRAL", ...
    event: str | None  # "Speech", "Laughter", ...
    itn: bool | None  # True for <|withitn|>, False for <|woitn|>
    text: str  # the transcript without any tag, whitespace-normalised


def parse_tags(raw: str) -> Tags:
    """Split SenseVoice output into its tag fields and plain text.

    The first tag of each kind wins; unknown tags are dropped from ``text``.
    """
    language = emotion = event = None
    itn: bool | None = None
    for match in _TAG_RE.finditer(raw):
        name = match.group(1)
        if name in LANGUAGE_TAGS and language is None:
            language = name
        elif name in EMOTION_TAGS and emotion is None:
            emotion = name
        elif name in EVENT_TAGS and event is None:
            event = name
        elif name in ITN_TAGS and itn is None:
            itn = ITN_TAGS[name]
    text = " ".join(_TAG_RE.sub(" ", raw).split())
    return Tags(language=language, emotion=emotion, event=event, itn=itn, text=text)


@dataclass(frozen=True)
class Transcript:
    """One decoded utterance."""

    text: str  # transcript without tags
    raw: str  # the model's tagged output, e.g. "<|en|><|NEUTRAL|><|Speech|><|woitn|>hi"
    rich: str  # funasr's rich_transcription_postprocess rendering (emoji for tags)
    language: str | None  # from the language tag
    emotion: str | None  # from the emotion tag
    event: str | None  # from the audio-event tag
    itn: bool | None  # from the ITN tag
    token_ids: tuple[int, ...]  # CTC output tokens after collapsing repeats and blanks
    audio_ms: float  # length of the decoded audio
    decode_ms: float  # wall time the model spent on it
    # Per token (empty when the recognizer does not report them): the encoder frame where
    # its CTC run starts (frames 0-3 are the query frames; frame f >= 4 starts at
    # (f - 4) * 60 ms of the audio), its softmax posterior at that frame, one past the
    # last frame of its run, and its tokenizer piece ("▁the", "<|en|>"; words.py groups
    # the pieces into timed words).
    token_frames: tuple[int, ...] = ()
    token_confidences: tuple[float, ...] = ()
    token_end_frames: tuple[int, ...] = ()
    token_pieces: tuple[str, ...] = ()
    # why some of the job's hotwords could not be used (counts and reasons, no phrase
    # text: the tokenizer could not encode them, or they were too long); "" when all were
    hotwords_unused: str = ""

    @classmethod
    def from_raw(
        cls,
        raw: str,
        *,
        rich: str,
        token_ids: tuple[int, ...],
        audio_ms: float,
        decode_ms: float,
        token_frames: tuple[int, ...] = (),
        token_confidences: tuple[float, ...] = (),
        token_end_frames: tuple[int, ...] = (),
        token_pieces: tuple[str, ...] = (),
        hotwords_unused: str = "",
    ) -> Transcript:
        tags = parse_tags(raw)
        return cls(
            text=tags.text,
            raw=raw,
            rich=rich,
            language=tags.language,
            emotion=tags.emotion,
            event=tags.event,
            itn=tags.itn,
            token_ids=token_ids,
            audio_ms=audio_ms,
            decode_ms=decode_ms,
            token_frames=token_frames,
            token_confidences=token_confidences,
            token_end_frames=token_end_frames,
            token_pieces=token_pieces,
            hotwords_unused=hotwords_unused,
        )
