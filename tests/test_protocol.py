import dataclasses

import orjson
import pytest

from streamer.core import protocol
from streamer.core.protocol import (
    ConfigMessage,
    Final,
    FinalizeMessage,
    KeepaliveMessage,
    StopMessage,
    StreamOptions,
)
from streamer.core.transcript import parse_tags
from streamer.errors import InvalidOption, MalformedMessage, UnsupportedSampleRate


def test_parse_stream_options_from_query_strings():
    options = protocol.parse_stream_options(
        {
            "language": "en",
            "itn": "false",
            "sample_rate": "48000",
            "partials": "0",
            "endpoint_ms": "800",
            "token": "secret",
        },
        strings=True,
    )
    assert options == StreamOptions("en", False, 48000, False, 800)


@pytest.mark.parametrize(
    "params", [{"endpoint_ms": "300"}, {"itn": "false"}, {"sample_rate": "16000"}, {"words": 1}]
)
def test_a_config_messages_values_must_have_their_json_types(params):
    with pytest.raises(InvalidOption, match="must be"):
        protocol.parse_stream_options(params)
    # 16000.0 is a JSON number like 16000 (JavaScript has one number type)
    assert protocol.parse_stream_options({"sample_rate": 16000.0}).sample_rate == 16000


def test_parse_stream_options_from_json_types_over_base():
    base = StreamOptions(endpoint_ms=700)
    options = protocol.parse_stream_options({"type": "config", "itn": True}, base)
    assert options.endpoint_ms == 700 and options.itn is True


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"language": "fr"}, InvalidOption),
        ({"itn": "maybe"}, InvalidOption),
        ({"sample_rate": 11025}, UnsupportedSampleRate),
        ({"sample_rate": "abc"}, InvalidOption),
        ({"endpoint_ms": 50}, InvalidOption),
        ({"endpoint_ms": True}, InvalidOption),
        ({"colour": "red"}, InvalidOption),
    ],
)
def test_bad_options(params, error):
    with pytest.raises(error):
        protocol.parse_stream_options(params)
    with pytest.raises(error):
        protocol.parse_stream_options(params, strings=True)


def test_client_messages_round_trip():
    for message in (
        ConfigMessage({"language": "zh"}),
        FinalizeMessage(),
        StopMessage(),
        KeepaliveMessage(),
    ):
        assert protocol.parse_client_message(protocol.client_message_json(message)) == message


@pytest.mark.parametrize("text", ["", "nope", "1", '"stop"', '{"type":"STOP"}', "{}"])
def test_malformed_client_messages(text):
    with pytest.raises(MalformedMessage):
        protocol.parse_client_message(text)


def test_server_message_round_trip_and_unknown_fields():
    final = Final(
        segment_id=2,
        start_ms=1.0,
        end_ms=2.0,
        text="hi",
        language="en",
        emotion="HAPPY",
        event="Speech",
        raw="<|en|>hi",
        rich="hi",
        reason="silence",
        decode_ms=3.0,
        queue_ms=0.5,
    )
    data = protocol.encode(final)
    obj = orjson.loads(data)
    assert obj["type"] == "final" and obj["error"] is None
    assert protocol.decode_server_message(data) == final
    obj["added_in_a_later_version"] = 1
    assert protocol.decode_server_message(orjson.dumps(obj)) == final
    with pytest.raises(MalformedMessage):
        protocol.decode_server_message(b'{"type":"bogus"}')
    with pytest.raises(MalformedMessage, match="not JSON"):
        protocol.decode_server_message("{not json")


def test_a_words_speaker_is_its_own_else_the_finals():
    words = (
        protocol.SpeakerWord("hi", 0.0, 100.0, 0.9, speaker="B"),
        protocol.SpeakerWord("there", 100.0, 200.0, 0.9, speaker=""),
        protocol.Word("you", 200.0, 300.0, 0.9),
    )
    final = Final(
        2,
        0.0,
        300.0,
        "hi there you",
        None,
        None,
        None,
        "",
        "",
        "silence",
        1.0,
        0.0,
        words=words,
        speaker="A",
    )
    assert [final.word_speaker(i) for i in range(4)] == ["B", "A", "A", "A"]
    assert dataclasses.replace(final, words=None).word_speaker(0) == "A"


@pytest.mark.parametrize(
    ("previous", "current", "stable"),
    [
        ("", "hello", ""),
        ("the quick", "the quick brown", "the quick"),
        ("the quack", "the quick", "the "),
        ("hello world", "hello world", "hello world"),
        ("今天天气", "今天天气很好", "今天天气"),
        ("今天天汽", "今天天气很好", "今天天"),
    ],
)
def test_stable_prefix(previous, current, stable):
    assert protocol.stable_prefix(previous, current) == stable


def test_parse_tags():
    tags = parse_tags("<|en|><|HAPPY|><|Laughter|><|woitn|>hello there")
    assert (tags.language, tags.emotion, tags.event, tags.itn, tags.text) == (
        "en",
        "HAPPY",
        "Laughter",
        False,
        "hello there",
    )
    tags = parse_tags("<|zh|><|withitn|>你好。")
    assert (tags.language, tags.emotion, tags.event, tags.itn, tags.text) == (
        "zh",
        None,
        None,
        True,
        "你好。",
    )
    tags = parse_tags("<|ko|><|NEW_TAG|><|Cough|>  a  b ")
    assert tags.event == "Cough" and tags.text == "a b"
    assert parse_tags("plain text").text == "plain text"
    assert parse_tags("").language is None
