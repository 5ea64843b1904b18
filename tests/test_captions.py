"""Caption formats: pure functions over protocol messages."""

from __future__ import annotations

import io

import orjson
import pytest

from streamer.client.captions import (
    caption_cues,
    display_width,
    format_for,
    format_timestamp,
    make_writer,
    render,
    wrap_caption,
)
from streamer.core.protocol import End, Final, Partial, Ready, SpeechStart, Word
from streamer.errors import ConfigError


def final(segment_id: int, start_ms: float, end_ms: float, text: str, **kw: object) -> Final:
    fields: dict = dict(
        language="en", emotion="NEUTRAL", event="Speech", raw=text, rich=text,
        reason="silence", decode_ms=10.0, queue_ms=1.0,
    )  # fmt: skip
    fields.update(kw)
    return Final(segment_id=segment_id, start_ms=start_ms, end_ms=end_ms, text=text, **fields)


READY = Ready(session_id="s1", protocol=1, sample_rate=16000, model="m", options={})
FINALS = [
    final(0, 1180.0, 4020.0, "The quick brown fox jumps over the lazy dog."),
    final(1, 4500.0, 4600.0, ""),  # nothing recognised: no caption
    final(2, 3_723_456.4, 3_725_000.0, "Hello there."),
]


def as_pairs(messages: list) -> list:
    return [(m, 0.5 * i) for i, m in enumerate(messages)]


@pytest.mark.parametrize(
    ("ms", "fmt", "expected"),
    [
        (0, "srt", "00:00:00,000"),
        (1180, "srt", "00:00:01,180"),
        (1180, "vtt", "00:00:01.180"),
        (59_999.6, "vtt", "00:01:00.000"),
        (3_723_456.4, "srt", "01:02:03,456"),
        (-5, "srt", "00:00:00,000"),
    ],
)
def test_format_timestamp(ms: float, fmt: str, expected: str) -> None:
    assert format_timestamp(ms, fmt) == expected


def test_srt_document() -> None:
    text = render(as_pairs([READY, *FINALS]), "srt")
    assert text == (
        "1\n00:00:01,180 --> 00:00:04,020\nThe quick brown fox jumps over the lazy\ndog.\n\n"
        "2\n01:02:03,456 --> 01:02:05,000\nHello there.\n\n"
    )


def test_vtt_document() -> None:
    text = render(as_pairs([READY, *FINALS]), "vtt")
    assert text.startswith("WEBVTT\n\n")
    blocks = text.split("\n\n")
    assert (
        blocks[1] == "00:00:01.180 --> 00:00:04.020\nThe quick brown fox jumps over the lazy\ndog."
    )
    assert blocks[2] == "01:02:03.456 --> 01:02:05.000\nHello there."
    assert "-->" not in render(as_pairs([final(0, 0, 1000, "a --> b")]), "vtt").split("\n")[3]


def test_txt_skips_empty_finals_and_other_messages() -> None:
    partial = Partial(0, 1, 0.0, 500.0, "the quick", "", "en", None, None, "the quick")
    text = render(as_pairs([READY, SpeechStart(0, 0.0), partial, *FINALS]), "txt")
    assert text == "The quick brown fox jumps over the lazy dog.\nHello there.\n"


def test_jsonl_keeps_every_message_with_arrival_time() -> None:
    end = End(segments=3, audio_ms=9840.0, partials_sent=0, partials_skipped=0)
    lines = render(as_pairs([READY, *FINALS, end]), "jsonl").splitlines()
    records = [orjson.loads(line) for line in lines]
    assert [r["type"] for r in records] == ["ready", "final", "final", "final", "end"]
    assert [r["arrival_s"] for r in records] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert records[1]["start_ms"] == 1180.0 and records[1]["emotion"] == "NEUTRAL"


def test_long_final_is_split_into_two_line_cues_over_its_span() -> None:
    words = " ".join(f"word{i:02d}" for i in range(40))  # 279 characters
    cues = caption_cues(final(0, 1000.0, 11000.0, words))
    assert len(cues) > 1
    assert all(1 <= len(c.lines) <= 2 for c in cues)
    assert all(len(line) <= 42 for c in cues for line in c.lines)
    assert " ".join(line for c in cues for line in c.lines) == words
    assert cues[0].start_ms == 1000.0 and cues[-1].end_ms == pytest.approx(11000.0)
    assert all(a.end_ms == b.start_ms for a, b in zip(cues, cues[1:], strict=False))


def test_wrap_breaks_cjk_between_characters_counting_double_width() -> None:
    text = "今天天气很好" * 6  # 36 wide characters = 72 columns
    lines = wrap_caption(text, 42)
    assert "".join(lines) == text
    assert all(display_width(line) <= 42 for line in lines)
    assert len(lines) == 2


def test_srt_numbering_continues_across_split_cues() -> None:
    long = final(0, 0.0, 6000.0, " ".join(["abcdefghij"] * 16))
    text = render(as_pairs([long, final(1, 7000.0, 8000.0, "bye")]), "srt")
    indices = [block.split("\n")[0] for block in text.strip().split("\n\n")]
    assert indices == [str(i) for i in range(1, len(indices) + 1)]


def test_writer_flushes_each_final() -> None:
    stream = io.StringIO()
    writer = make_writer(stream, "srt")
    writer.write(FINALS[0], 1.0)
    assert stream.getvalue().startswith("1\n00:00:01,180")


@pytest.mark.parametrize(
    ("path", "explicit", "expected"),
    [
        ("out.srt", None, "srt"),
        ("OUT.VTT", None, "vtt"),
        ("a/b.jsonl", None, "jsonl"),
        ("notes.txt", None, "txt"),
        ("out.data", "srt", "srt"),
        ("-", None, "txt"),
        (None, None, "txt"),
    ],
)
def test_format_for(path: str | None, explicit: str | None, expected: str) -> None:
    assert format_for(path, explicit) == expected


@pytest.mark.parametrize(("path", "explicit"), [("out.data", None), ("out.srt", "docx")])
def test_format_for_rejects_unknown(path: str, explicit: str | None) -> None:
    with pytest.raises(ConfigError):
        format_for(path, explicit)


def _timed_words(text: str, start_ms: float, step_ms: list[float]) -> tuple[Word, ...]:
    words, t = [], start_ms
    for word, step in zip(text.split(), step_ms, strict=True):
        words.append(Word(word, t, t + step, 0.9))
        t += step
    return tuple(words)


def test_split_cues_take_their_times_from_the_words() -> None:
    text = " ".join(f"word{i:02d}" for i in range(40))
    # the first 30 words are spoken fast, the last 10 slowly: a proportional split is wrong
    steps = [100.0] * 30 + [500.0] * 10
    words = _timed_words(text, 1200.0, steps)
    cues = caption_cues(final(0, 1000.0, 9500.0, text, words=words))
    assert len(cues) == 4
    spoken = 0
    for cue in cues:
        count = sum(len(line.split()) for line in cue.lines)
        first, last = words[spoken], words[spoken + count - 1]
        assert (cue.start_ms, cue.end_ms) == (first.start_ms, last.end_ms)
        spoken += count
    assert spoken == len(words)
    assert cues[0].start_ms == 1200.0 and cues[-1].end_ms == 9200.0  # not the segment's bounds
    proportional = caption_cues(final(0, 1000.0, 9500.0, text))
    assert [c.lines for c in proportional] == [c.lines for c in cues]  # same text, new times
    assert proportional[1].end_ms != cues[1].end_ms


def test_a_word_broken_over_two_cues_shares_its_time() -> None:
    long_word = "x" * 120  # wider than two lines: broken between characters
    words = (Word("a", 0.0, 100.0, 1.0), Word(long_word, 100.0, 1300.0, 1.0))
    cues = caption_cues(final(0, 0.0, 2000.0, f"a {long_word}", words=words))
    assert len(cues) == 2
    assert cues[0].start_ms == 0.0 and cues[-1].end_ms == 1300.0
    # lines "a", then the word in pieces of 42, 42 and 36 characters: the first cue holds
    # "a" and 42 of the word's 120 characters
    assert cues[0].end_ms == pytest.approx(100.0 + 1200.0 * 42 / 120)
    assert cues[1].start_ms == cues[0].end_ms


def test_cjk_cues_from_per_character_words() -> None:
    text = "今天天气很好" * 6
    words = tuple(Word(c, 100.0 * i, 100.0 * (i + 1), 1.0) for i, c in enumerate(text))
    cues = caption_cues(final(0, 0.0, 5000.0, text, words=words), max_lines=1)
    assert [c.lines for c in cues] == [(text[:21],), (text[21:],)]
    assert [(c.start_ms, c.end_ms) for c in cues] == [(0.0, 2100.0), (2100.0, 3600.0)]


def test_words_that_do_not_spell_the_text_fall_back_to_the_proportional_split() -> None:
    text = " ".join(f"word{i:02d}" for i in range(40))
    words = _timed_words(text.replace("word07", "other"), 1200.0, [100.0] * 40)
    assert caption_cues(final(0, 1000.0, 9000.0, text, words=words)) == caption_cues(
        final(0, 1000.0, 9000.0, text)
    )
