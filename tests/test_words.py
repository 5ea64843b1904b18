"""Timed words from CTC tokens: grouping, times, confidence, and the wire (I/O-free)."""

from __future__ import annotations

import random

import numpy as np
import orjson
import pytest

from streamer.core.compat.deepgram import DeepgramAdapter, parse_listen_query
from streamer.core.compat.funasr import utterance_spans
from streamer.core.jobs import DecodeResult
from streamer.core.protocol import (
    Final,
    Partial,
    StreamOptions,
    Word,
    decode_server_message,
    encode,
    message_dict,
    parse_stream_options,
)
from streamer.core.transcript import Transcript, parse_tags
from streamer.core.wire import V1Adapter
from streamer.core.words import FRAME_MS, QUERY_FRAMES, join_words, transcript_words
from streamer.errors import InvalidOption, MalformedMessage
from tests.compat_harness import Harness, make_session, words_for
from tests.fakes import silence, tone

TAGS = ("<|en|>", "<|NEUTRAL|>", "<|Speech|>", "<|woitn|>")


def transcript(
    pieces: list[str],
    frames: list[int] | None = None,
    confidences: list[float] | None = None,
    last_end: int | None = None,
    tags: tuple[str, ...] = TAGS,
) -> Transcript:
    """Tokens as the decoding layer reports them: the tags on the first frames, then one
    token every 3 frames unless ``frames`` says otherwise."""
    n = len(tags)
    pieces = [*tags, *pieces]
    if frames is None:
        frames = [*range(n), *range(5, 5 + 3 * (len(pieces) - n), 3)]
    else:
        frames = [*range(n), *frames]
    confidences = [1.0] * n + (confidences or [0.9] * (len(pieces) - n))
    ends = [f + 1 for f in frames]
    if last_end is not None:
        ends[-1] = last_end
    raw = "".join(pieces).replace("▁", " ")
    return Transcript.from_raw(
        raw.lstrip(" "),
        rich="",
        token_ids=tuple(range(len(pieces))),
        audio_ms=10_000.0,
        decode_ms=1.0,
        token_frames=tuple(frames),
        token_confidences=tuple(confidences),
        token_end_frames=tuple(ends),
        token_pieces=tuple(pieces),
    )


def ms(frame: float) -> float:
    return (frame - QUERY_FRAMES) * FRAME_MS


def test_words_start_at_their_first_token_and_end_at_the_next() -> None:
    t = transcript(
        ["t", "h", "e", "▁quick", "▁bro", "wn", "▁fox"],
        frames=[4, 5, 22, 24, 35, 36, 41],
        confidences=[0.9, 0.8, 0.95, 0.7, 0.99, 0.6, 0.5],
        last_end=43,
    )
    words = transcript_words(t, 1000.0, 5000.0)
    assert [w.word for w in words] == ["the", "quick", "brown", "fox"]
    assert [(w.start_ms, w.end_ms) for w in words] == [
        (1000 + ms(4), 1000 + ms(24)),
        (1000 + ms(24), 1000 + ms(35)),
        (1000 + ms(35), 1000 + ms(41)),
        (1000 + ms(41), 1000 + ms(43)),  # the last token ends with its CTC run
    ]
    assert [w.confidence for w in words] == [0.8, 0.7, 0.6, 0.5]  # the weakest token
    assert join_words(words) == t.text == "the quick brown fox"


def test_punctuation_stays_on_its_word_without_moving_its_time() -> None:
    t = transcript(
        ["▁Hello", ",", "▁world", "."],
        frames=[4, 10, 12, 20],
        confidences=[0.9, 0.1, 0.8, 0.2],
        last_end=21,
    )
    words = transcript_words(t, 0.0, 9000.0)
    assert [w.word for w in words] == ["Hello,", "world."]
    # a word ends where the token after its last letter starts: the comma's frame
    assert (words[0].start_ms, words[0].end_ms) == (ms(4), ms(10))
    assert (words[1].start_ms, words[1].end_ms) == (ms(12), ms(20))
    assert [w.confidence for w in words] == [0.9, 0.8]  # punctuation does not count
    assert join_words(words) == t.text == "Hello, world."


def test_chinese_is_one_word_per_character() -> None:
    # "世界" is one token of two characters: they share its time evenly
    t = transcript(["▁你", "好", "，", "世界", "。"], frames=[4, 8, 12, 14, 24], last_end=25)
    words = transcript_words(t, 500.0, 9000.0)
    assert [w.word for w in words] == ["你", "好，", "世", "界。"]
    assert [(w.start_ms, w.end_ms) for w in words] == [
        (500 + ms(4), 500 + ms(8)),
        (500 + ms(8), 500 + ms(12)),
        (500 + ms(14), 500 + ms(19)),
        (500 + ms(19), 500 + ms(24)),
    ]
    assert join_words(words) == t.text == "你好，世界。"


def test_japanese_and_korean() -> None:
    ja = transcript(["▁こん", "にち", "は", "、", "元気", "です", "か"])
    words = transcript_words(ja, 0.0, 9000.0)
    assert [w.word for w in words] == ["こ", "ん", "に", "ち", "は、", "元", "気", "で", "す", "か"]
    assert join_words(words) == ja.text == "こんにちは、元気ですか"
    # Korean is written with spaces: words at ▁, not per syllable
    ko = transcript(["▁안녕", "하세요", "▁반갑", "습니다"])
    assert [w.word for w in transcript_words(ko, 0.0, 9000.0)] == ["안녕하세요", "반갑습니다"]
    assert join_words(transcript_words(ko, 0.0, 9000.0)) == ko.text


def test_mixed_scripts_join_back_to_the_text() -> None:
    for pieces, expected in [
        (["▁我", "用", "GPU", "跑"], "我用GPU跑"),
        (["▁hello", "你", "好"], "hello你好"),
        (["▁你", "好", ",", "hello"], "你好,hello"),
        (["▁你", "好", "。", "Hi"], "你好。Hi"),
        (["▁don", "'", "t", "▁stop"], "don't stop"),
        (['▁"', "hi", '"', "▁she", "▁said"], '"hi" she said'),
        (["▁3", ".", "5", "%"], "3.5%"),
    ]:
        t = transcript(pieces)
        assert t.text == expected
        assert join_words(transcript_words(t, 0.0, 9000.0)) == expected, pieces


def test_the_documented_exception_a_space_next_to_cjk() -> None:
    t = transcript(["▁我", "喜", "欢", "▁python"])
    words = transcript_words(t, 0.0, 9000.0)
    assert [w.word for w in words] == ["我", "喜", "欢", "python"]
    assert t.text == "我喜欢 python" and join_words(words) == "我喜欢python"


def test_leading_and_lone_punctuation() -> None:
    t = transcript(['▁"', "hello", "▁-", "▁there"], frames=[4, 6, 10, 12], last_end=14)
    words = transcript_words(t, 0.0, 9000.0)
    assert [w.word for w in words] == ['"hello', "-", "there"]
    assert words[0].start_ms == ms(6)  # the quote has no time of its own on a word
    assert (words[1].start_ms, words[1].end_ms) == (ms(10), ms(12))  # alone: its own token's
    assert join_words(words) == t.text


def test_times_are_clamped_to_the_segment() -> None:
    # a token on a query frame (a random model does that) starts at the segment start;
    # a run past the audio's end stops at the segment's end
    t = transcript(["▁a", "▁b"], frames=[2, 10], last_end=200, tags=())
    words = transcript_words(t, 2000.0, 3000.0)
    assert [(w.start_ms, w.end_ms) for w in words] == [(2000.0, 2000 + ms(10)), (2360.0, 3000.0)]


def test_no_words_without_pieces_or_text() -> None:
    plain = Transcript.from_raw("<|en|>hi", rich="", token_ids=(1, 2), audio_ms=1, decode_ms=1)
    assert transcript_words(plain, 0.0, 1000.0) == ()
    assert transcript_words(transcript([]), 0.0, 1000.0) == ()


def test_random_token_sequences_give_ordered_words_that_spell_the_text() -> None:
    """Every mix of pieces: ordered, non-overlapping, inside the segment, and spelling the
    text (wherever no space sits next to a CJK character, the documented exception)."""
    vocab = [
        "▁the", "▁qu", "ick", "s", "▁", ",", ".", "?", "'", "▁\"", "\"", "▁3", "5", "%",
        "你", "好", "世界", "。", "，", "▁今", "天", "こ", "ん", "、", "<|Speech|>", "▁안녕",
        "하세요", "ー", "１",
    ]  # fmt: skip
    rng = random.Random(7)
    checked = 0
    for _ in range(2000):
        pieces = [rng.choice(vocab) for _ in range(rng.randint(1, 14))]
        frames = sorted(rng.sample(range(4, 120), len(pieces)))
        t = transcript(pieces, frames=frames, last_end=frames[-1] + rng.randint(1, 3))
        words = transcript_words(t, 700.0, 700.0 + 118 * FRAME_MS)
        assert all(700.0 <= w.start_ms <= w.end_ms <= 700.0 + 118 * FRAME_MS for w in words)
        assert all(a.end_ms <= b.start_ms for a, b in zip(words, words[1:], strict=False))
        assert all(w.word and not any(c.isspace() for c in w.word) for w in words)
        assert all(0.0 <= w.confidence <= 1.0 for w in words)
        assert "".join(w.word for w in words) == t.text.replace(" ", "")
        if not _space_next_to_cjk(t.text):
            assert join_words(words) == t.text, pieces
            checked += 1
    assert checked > 500


def _space_next_to_cjk(text: str) -> bool:
    """A space next to CJK text (a CJK character or CJK punctuation), other punctuation in
    between aside: the one place where joining the words differs from the text."""
    from streamer.core.words import _is_punctuation, _no_space

    def nearest(chars: str) -> str:
        return next((c for c in chars if _no_space(c) or not _is_punctuation(c)), " ")

    return any(
        c == " " and (_no_space(nearest(text[i - 1 :: -1])) or _no_space(nearest(text[i + 1 :])))
        for i, c in enumerate(text)
        if 0 < i < len(text) - 1
    )


def test_tags_anywhere_are_spaces_as_in_the_text() -> None:
    t = transcript(["▁hi", "<|Laughter|>", "there"])
    assert parse_tags(t.raw).text == "hi there"
    assert [w.word for w in transcript_words(t, 0.0, 9000.0)] == ["hi", "there"]


# --- protocol v1 --------------------------------------------------------------------------

WORDS = (Word("hello", 100.0, 400.0, 0.98), Word("there.", 400.0, 650.5, 0.5))


def _final(**kw: object) -> Final:
    fields: dict = dict(
        segment_id=0, start_ms=0.0, end_ms=900.0, text="hello there.", language="en",
        emotion=None, event=None, raw="", rich="", reason="silence", decode_ms=1.0,
        queue_ms=0.0,
    )  # fmt: skip
    fields.update(kw)
    return Final(**fields)


def test_finals_with_and_without_words_round_trip() -> None:
    final = _final(words=WORDS)
    data = orjson.loads(encode(final))
    assert data["words"] == [
        {"word": "hello", "start_ms": 100.0, "end_ms": 400.0, "confidence": 0.98},
        {"word": "there.", "start_ms": 400.0, "end_ms": 650.5, "confidence": 0.5},
    ]
    assert decode_server_message(encode(final)) == final
    assert message_dict(decode_server_message(encode(final))) == data
    # an older server's final, without words, still decodes
    old = {k: v for k, v in data.items() if k != "words"}
    decoded = decode_server_message(orjson.dumps(old))
    assert isinstance(decoded, Final) and decoded.words is None
    empty = _final(text="", words=())
    assert orjson.loads(encode(empty))["words"] == []
    assert decode_server_message(encode(empty)) == empty
    # unknown fields of a word, as of a message, are ignored
    data["words"][0]["punctuated"] = "Hello"
    assert decode_server_message(orjson.dumps(data)) == final


def test_partials_carry_words_only_when_set() -> None:
    partial = Partial(0, 1, 0.0, 500.0, "hello", "", "en", None, None, "hello")
    assert "words" not in orjson.loads(encode(partial))
    assert decode_server_message(encode(partial)) == partial
    with_words = Partial(0, 1, 0.0, 500.0, "hello", "", "en", None, None, "hello", WORDS[:1])
    assert orjson.loads(encode(with_words))["words"][0]["word"] == "hello"
    assert decode_server_message(encode(with_words)) == with_words


@pytest.mark.parametrize(
    "words",
    ["hello", [1], [{"word": "a", "start_ms": 0.0}], {"word": "a"}],
)
def test_malformed_words_are_refused(words: object) -> None:
    data = orjson.loads(encode(_final()))
    data["words"] = words
    with pytest.raises(MalformedMessage, match="word"):
        decode_server_message(orjson.dumps(data))


def test_words_stream_option() -> None:
    assert StreamOptions().words is False
    assert parse_stream_options({"words": "true"}, strings=True).words is True
    assert parse_stream_options({"words": True}).words is True
    assert parse_stream_options({"words": False}).words is False
    with pytest.raises(InvalidOption, match="words"):
        parse_stream_options({"words": "sometimes"})


# --- FunASR ---------------------------------------------------------------------------------


def _final_of(text: str, words: tuple[Word, ...]) -> Final:
    return Final(
        segment_id=0, start_ms=100.0, end_ms=1400.0, text=text, language="zh", emotion=None,
        event=None, raw=text, rich=text, reason="silence", decode_ms=1.0, queue_ms=0.0,
        words=words,
    )  # fmt: skip


def test_funasr_timestamps_come_from_the_word_timings() -> None:
    words = (
        Word("你", 100.0, 400.0, 0.9),
        Word("好", 400.0, 700.9, 0.9),
        Word("世", 700.9, 1000.2, 0.9),
        Word("界。", 1000.2, 1300.0, 0.9),
    )
    spans = utterance_spans(_final_of("你好世界。", words), "你好世界。")
    # one integer pair per unit the html5 demo counts; punctuation rides on its word
    assert spans == [[100, 400], [400, 700], [700, 1000], [1000, 1300]]  # as the C++ server
    english = (Word("hello", 100.0, 460.0, 0.9), Word("there,", 460.0, 900.0, 0.8))
    assert utterance_spans(_final_of("hello there,", english), "hello there,") == [
        [100, 460],
        [460, 900],
    ]


def test_funasr_timestamps_without_words_are_spread_over_the_utterance() -> None:
    spans = utterance_spans(_final_of("hello there", ()), "hello there")
    assert spans == [[100, 750], [750, 1400]]
    wrong = (Word("other", 100.0, 400.0, 0.9),)  # words that do not spell the text
    assert utterance_spans(_final_of("hello there", wrong), "hello there") == spans


# --- the session and the adapters -----------------------------------------------------------


class TimedHarness(Harness):
    """The compat harness with a worker whose transcripts carry token pieces and frames:
    word ``i`` of a job's text is one token on frame ``5 + i``, its confidence 0.5 + i/100."""

    def _decode(self, n: int) -> None:
        jobs, self.queued = self.queued[:n], self.queued[n:]
        for job in jobs:
            words = words_for(job).split()
            t = transcript(
                [f"▁{w.replace('_', 'x')}" for w in words],
                frames=[5 + i for i in range(len(words))],
                confidences=[0.5 + i / 100 for i in range(len(words))],
                last_end=5 + len(words),
            )
            self.session.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))


def _bursts() -> np.ndarray:
    return np.concatenate([silence(500), tone(1500), silence(1000), tone(800), silence(1000)])


@pytest.mark.parametrize("partial_words", [False, True])
def test_the_session_puts_words_in_the_session_timeline(partial_words: bool) -> None:
    h = TimedHarness(V1Adapter(make_session(words=partial_words))).start()
    h.audio(_bursts().tobytes())
    h.text({"type": "stop"})
    finals = h.of_type("final")
    assert len(finals) == 2
    for final in finals:
        words = final["words"]
        assert join_words([Word(**w) for w in words]) == final["text"]
        assert words[0]["start_ms"] == final["start_ms"] + ms(5)
        assert [w["start_ms"] - final["start_ms"] for w in words[:3]] == [60.0, 120.0, 180.0]
        assert words[-1]["end_ms"] <= final["end_ms"]
        assert words[1]["confidence"] == 0.51
    partials = h.of_type("partial")
    assert partials
    if partial_words:
        assert all(p["words"][0]["start_ms"] == p["start_ms"] + 60.0 for p in partials)
    else:
        assert all("words" not in p for p in partials)


def _deepgram(query: dict[str, str]) -> TimedHarness:
    options = parse_listen_query(query, StreamOptions())
    session = make_session(**options.stream.to_dict())
    adapter = DeepgramAdapter(session, options, request_id="r", created="2026-01-01T00:00:00Z")
    return TimedHarness(adapter).start()


def test_deepgram_words_and_confidence_come_from_the_model() -> None:
    h = _deepgram({"interim_results": "true", "punctuate": "true", "sample_rate": "16000"})
    h.audio(_bursts().tobytes())
    results = h.of_type("Results")
    final = next(r for r in results if r["is_final"])
    alt = final["channel"]["alternatives"][0]
    words = alt["words"]
    assert [w["punctuated_word"] for w in words] == alt["transcript"].split()
    assert words[0]["start"] == pytest.approx(final["start"] + 0.06)
    assert [round(w["start"] - final["start"], 3) for w in words[:3]] == [0.06, 0.12, 0.18]
    expected = sum(0.5 + i / 100 for i in range(len(words))) / len(words)
    assert alt["confidence"] == pytest.approx(expected, abs=1e-4)
    assert [w["confidence"] for w in words[:2]] == [0.5, 0.51]
    interim = next(r for r in results if not r["is_final"])  # interims carry words too
    assert interim["channel"]["alternatives"][0]["words"][0]["start"] == pytest.approx(
        interim["start"] + 0.06
    )


def test_deepgram_punctuated_word_only_when_asked_and_languages_with_multi() -> None:
    h = _deepgram({"sample_rate": "16000", "language": "multi"})
    h.audio(_bursts().tobytes())
    words = h.of_type("Results")[0]["channel"]["alternatives"][0]["words"]
    assert words and all("punctuated_word" not in w for w in words)
    assert all(w["language"] == "en" for w in words)


def test_a_tokenizer_without_a_piece_table_gives_transcripts_without_words(caplog) -> None:
    """The decode goes on; the session then has no words (adapters spread the text)."""
    from streamer.errors import ModelError
    from streamer.model.decode.decoding import CtcRecognizer

    class NoPieces:
        size = 8

        def decode(self, token_ids) -> str:
            return "<|en|>x" if token_ids else ""

        def pieces(self) -> list[str]:
            raise ModelError("this tokenizer has no piece list")

    class Recognizer(CtcRecognizer):
        name = "fake"
        tokenizer = NoPieces()

        def _logits(self, batch):
            logits = np.zeros((6, 8), np.float32)
            logits[np.arange(6), [3, 0, 0, 5, 5, 0]] = 9.0
            return [logits for _ in batch]

    recognizer = Recognizer()
    t = recognizer.decode(np.zeros(16000, np.int16))
    assert t.token_ids == (3, 5) and t.token_end_frames == (1, 5)
    assert t.token_pieces == () and transcript_words(t, 0.0, 1000.0) == ()
    assert "no word timings" in caplog.text
    recognizer.decode(np.zeros(16000, np.int16))  # asked once, remembered
    assert caplog.text.count("no word timings") == 1
