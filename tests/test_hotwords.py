"""Hotwords as data: each protocol's field parsed and checked, the session carrying them
to its decode jobs, and the model side tokenizing them into a graph once per set."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from streamer.core import hotwords as hw
from streamer.core.compat import deepgram
from streamer.core.compat.funasr import parse_config
from streamer.core.hotwords import DEFAULT_BOOST, Hotword
from streamer.core.jobs import DecodeResult
from streamer.core.protocol import Error, Notice, StreamOptions, parse_stream_options
from streamer.core.session import Session, SessionOptions
from streamer.core.transcript import Transcript
from streamer.errors import InvalidHotwords
from streamer.model.decode.hotword_graphs import HotwordGraphs
from streamer.model.decode.tokenizer import PieceTableTokenizer
from tests.fakes import loudness_classifier

# -- parsing ----------------------------------------------------------------------------


def test_v1_config_takes_phrases_and_objects() -> None:
    options = parse_stream_options(
        {"hotwords": ["  Kubernetes ", {"phrase": "Anthropic  Claude", "boost": 3}]}
    )
    assert options.hotwords == (
        Hotword("Kubernetes", DEFAULT_BOOST),
        Hotword("Anthropic Claude", 3),
    )
    assert options.to_dict()["hotwords"] == (
        {"phrase": "Kubernetes", "boost": DEFAULT_BOOST},
        {"phrase": "Anthropic Claude", "boost": 3.0},
    )
    assert options.log_fields()["hotwords"] == 2  # the log has a count, never the phrases


def test_v1_query_is_a_comma_list_with_optional_boosts() -> None:
    options = parse_stream_options({"hotwords": "Kubernetes, Anthropic:3.5"}, strings=True)
    assert options.hotwords == (Hotword("Kubernetes"), Hotword("Anthropic", 3.5))
    assert parse_stream_options({"hotwords": ""}, strings=True).hotwords == ()


@pytest.mark.parametrize(
    "value",
    [
        [""],
        ["   "],
        ["x" * (hw.MAX_PHRASE_CHARS + 1)],
        [{"phrase": "a", "boost": "high"}],
        [{"phrase": "a", "boost": -1}],
        [{"phrase": "a", "boost": hw.MAX_BOOST + 1}],
        [{"phrase": "a", "boost": float("nan")}],
        [{"boost": 2}],
        [{"phrase": "a", "weight": 2}],
        [3],
        "Kubernetes",  # a config's hotwords are a list
        [f"p{i}" for i in range(hw.MAX_PHRASES + 1)],
    ],
)
def test_v1_bad_hotwords_are_invalid_hotwords(value) -> None:
    with pytest.raises(InvalidHotwords) as caught:
        parse_stream_options({"hotwords": value})
    assert caught.value.code == "invalid_hotwords" and not caught.value.fatal
    assert "x" * 20 not in caught.value.message  # the phrase is not echoed


def test_v1_query_non_numeric_boost() -> None:
    with pytest.raises(InvalidHotwords, match="number"):
        parse_stream_options({"hotwords": "Kubernetes:lots"}, strings=True)


def test_duplicates_merge_and_the_last_boost_wins() -> None:
    assert hw.parse_v1(["a", {"phrase": "a", "boost": 4}]) == (Hotword("a", 4.0),)


def test_deepgram_keywords_and_keyterms() -> None:
    options = deepgram.parse_listen_query(
        {}, StreamOptions(), keywords=["Kubernetes:4", "Anthropic"], keyterms=["Claude Code"]
    )
    assert options.stream.hotwords == (
        Hotword("Kubernetes", 4.0),
        Hotword("Anthropic", DEFAULT_BOOST),
        Hotword("Claude Code", DEFAULT_BOOST),
    )
    # an intensifier over the maximum is the maximum; a negative one (suppression) is refused
    assert deepgram.parse_listen_query({}, StreamOptions(), keywords=["a:50"]).stream.hotwords == (
        Hotword("a", hw.MAX_BOOST),
    )
    for bad in (["a:-3"], ["a:x"], [":2"]):
        with pytest.raises(InvalidHotwords):
            deepgram.parse_listen_query({}, StreamOptions(), keywords=bad)


def test_funasr_hotwords_json_weight_over_ten_is_the_boost() -> None:
    config = parse_config({"mode": "2pass", "hotwords": orjson.dumps({"阿里巴巴": 20}).decode()})
    assert config.hotwords == (Hotword("阿里巴巴", 2.0),)
    assert parse_config({"hotwords": ""}).hotwords == ()  # funasr-python's empty string
    assert parse_config({"hotwords": '{"a": 500}'}).hotwords == (Hotword("a", hw.MAX_BOOST),)
    for bad in ("not json", '["a"]', '{"a": "x"}', '{"": 20}'):
        with pytest.raises(InvalidHotwords):
            parse_config({"hotwords": bad})


def test_openai_prompt_is_a_list_of_terms() -> None:
    assert hw.parse_prompt("Kubernetes, Anthropic; Claude Code\n阿里巴巴，通义") == tuple(
        Hotword(p) for p in ("Kubernetes", "Anthropic", "Claude Code", "阿里巴巴", "通义")
    )


def phrases(words: hw.Hotwords) -> list[str]:
    return [w.phrase for w in words]


def test_a_sentence_prompt_keeps_its_names_and_never_raises() -> None:
    # OpenAI's prompt is free text (pipecat and LiveKit document sentences): its names
    sentence = "The speaker talks about Kubernetes and Anthropic's Claude Code release in 2024."
    assert phrases(hw.parse_prompt(sentence)) == ["Kubernetes", "Anthropic's Claude Code", "2024"]
    assert hw.parse_prompt("expect words related to technology and science") == ()
    # symbols no tokenizer spells (emoji) are dropped; "C++", "Node.js" are kept
    assert phrases(hw.parse_prompt("🚀 Launch, rocket🚀; C++, Node.js.")) == [
        "Launch",
        "rocket",
        "C++",
        "Node.js",
    ]
    assert hw.parse_prompt("🚀 ... !!! ,,,") == ()
    long = ", ".join(f"t{i}" for i in range(hw.MAX_PHRASES + 5)) + ", " + "x" * 300
    assert len(hw.parse_prompt(long)) == hw.MAX_PHRASES  # the rest ignored, no error


def test_openai_keywords_are_terms_leniently() -> None:
    assert phrases(hw.parse_terms(["Kubernetes", 3, "", "🚀", "x" * 300, " Claude  Code "])) == [
        "Kubernetes",
        "Claude Code",
    ]


def test_hotwords_file_lines_comments_and_errors() -> None:
    text = "# products\nKubernetes\n\nAnthropic:3\n"
    assert hw.parse_file(text) == (Hotword("Kubernetes"), Hotword("Anthropic", 3.0))
    with pytest.raises(InvalidHotwords, match="f.txt:2"):
        hw.parse_file("good\nbad:boost\n", name="f.txt")


def test_the_session_overrides_the_server_and_boost_zero_is_inactive() -> None:
    server = (Hotword("a", 1.0), Hotword("b", 1.0))
    merged = hw.merge(server, (Hotword("b", 5.0), Hotword("c", 0.0)))
    assert merged == (Hotword("a", 1.0), Hotword("b", 5.0), Hotword("c", 0.0))
    assert hw.active(merged) == merged[:2]


# -- the session ---------------------------------------------------------------------------


def speech_session(**options) -> Session:
    return Session("s1", SessionOptions(**options), StreamOptions(), loudness_classifier())


LOUD = (np.sin(np.arange(16000) / 3.0) * 8000).astype(np.int16).tobytes()


def test_jobs_carry_the_server_and_session_hotwords() -> None:
    session = speech_session(hotwords=(Hotword("server"),))
    session.start()
    session.receive_text(orjson.dumps({"type": "config", "hotwords": ["mine"]}))
    session.receive_audio(LOUD)
    session.stop()
    jobs = session.jobs_to_submit()
    assert jobs and all(j.hotwords == (Hotword("server"), Hotword("mine")) for j in jobs)


def test_a_bad_config_is_refused_whole_and_the_session_goes_on() -> None:
    session = speech_session()
    session.start()
    session.messages_to_send()
    session.receive_text(orjson.dumps({"type": "config", "language": "en", "hotwords": [""]}))
    (error,) = session.messages_to_send()
    assert isinstance(error, Error) and error.code == "invalid_hotwords" and not error.fatal
    assert session.stream.language == "auto"  # nothing of that config applied
    session.receive_text(orjson.dumps({"type": "config", "hotwords": ["ok"]}))
    assert session.stream.hotwords == (Hotword("ok"),)
    assert session.close_code is None


def test_phrases_the_model_could_not_use_are_told_once() -> None:
    session = speech_session()
    session.start()
    session.receive_text(orjson.dumps({"type": "config", "hotwords": ["zz"]}))
    session.receive_audio(LOUD)
    session.stop()
    session.messages_to_send()
    transcript = Transcript.from_raw(
        "", rich="", token_ids=(), audio_ms=1.0, decode_ms=1.0, hotwords_unused="1 of 1 ..."
    )
    for job in session.jobs_to_submit():
        session.decode_finished(DecodeResult(job=job, transcript=transcript))
    told = session.messages_to_send()
    assert not [m for m in told if isinstance(m, Error)]  # a notice, never an error
    notices = [m for m in told if isinstance(m, Notice)]
    assert [(n.code, n.message) for n in notices] == [("hotwords_unused", "1 of 1 ...")]
    assert session.close_code is None or session.close_code == 1000


# -- the model side: tokenizing, once per phrase set -----------------------------------------

PIECES = ["<unk>", "<|en|>", "▁kub", "er", "net", "es", "▁a", "b", "c", "▁", "阿", "里"]


def test_phrases_become_token_ids_with_and_without_the_word_start() -> None:
    graphs = HotwordGraphs(PieceTableTokenizer(PIECES), max_tokens=4)
    compiled = graphs.compile((Hotword("kubernetes"), Hotword("阿里")))
    assert compiled.unused == "" and compiled.graph is not None
    # kub er net es, and 阿 里 after a lone "▁" also without it (inside CJK text)
    assert compiled.graph.phrases == 3
    assert set(compiled.graph.token_bonus) == {2, 3, 4, 5, 9, 10, 11}


def test_unencodable_overlong_and_special_phrases_are_left_out_and_counted() -> None:
    graphs = HotwordGraphs(PieceTableTokenizer(PIECES), max_tokens=3)
    compiled = graphs.compile(
        (Hotword("kubernetes"), Hotword("xyz"), Hotword("<|en|>"), Hotword("abc"))
    )
    assert compiled.graph is not None and compiled.graph.phrases == 1  # abc
    assert compiled.unused.startswith("3 of 4 hotwords are not used")
    assert "kubernetes" not in compiled.unused and "xyz" not in compiled.unused


def test_a_graph_is_built_once_per_phrase_set() -> None:
    graphs = HotwordGraphs(PieceTableTokenizer(PIECES))
    words = (Hotword("abc"),)
    first = graphs.compile(words)
    assert graphs.compile((Hotword("abc"),)) is first  # an equal tuple from another job
    graphs.compile((Hotword("abc", 3.0),))
    assert graphs.built == 2
    assert graphs.compile((Hotword("abc", 0.0),)).graph is None  # boost 0: greedy
