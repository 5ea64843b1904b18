"""The FunASR adapter over a real Session, driven with plain bytes and no sockets."""

from __future__ import annotations

import json
import re

import numpy as np
import orjson
import pytest

from streamer.core.compat.funasr import (
    FunAsrAdapter,
    parse_config,
    spread_spans,
    strip_wav_header,
    timestamp_units,
)
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session, SessionOptions
from streamer.errors import InvalidOption, UnsupportedSampleRate
from tests.fakes import InstantWorker, loudness_classifier, silence, tone

FIRST = {
    "mode": "2pass",
    "chunk_size": [5, 10, 5],
    "wav_name": "demo",
    "is_speaking": True,
    "audio_fs": 16000,
    "itn": True,
    "hotwords": '{"阿里巴巴": 20}',
    "svs_lang": "auto",
    "svs_itn": True,
}
END = '{"is_speaking": false}'


def make(finals=("the quick brown fox jumps", "hello there")):
    session = Session(
        "f1", SessionOptions(model_name="fake"), StreamOptions(), loudness_classifier()
    )
    adapter = FunAsrAdapter(session)
    adapter.start()
    return adapter, InstantWorker(session, list(finals))


def out(adapter) -> list[dict]:
    return [orjson.loads(frame.data) for frame in adapter.drain() if frame.data]


def send_audio(adapter, worker, pcm, chunk=1920, **answer):
    data = pcm.astype("<i2").tobytes()
    got = []
    for i in range(0, len(data), chunk):
        adapter.receive_bytes(data[i : i + chunk])
        worker.answer(**answer)
        got += out(adapter)
    return got


def two_utterances():
    return np.concatenate([silence(300), tone(1500), silence(1000), tone(900), silence(1000)])


def html5_units(text: str, timestamp: str) -> list[list[int]]:
    """What FunASR's html5 demo (handleWithTimestamp) indexes: it fails past the end."""
    spans = json.loads(timestamp)
    words = re.sub(r"[。？，、?. ]", ",", text).split(",")
    index = 0
    for word in words:
        if not word:
            continue
        assert index < len(spans), (text, spans)
        index += 1 if re.fullmatch(r"[a-zA-Z]+", word) else len(word)
    assert index == len(spans), (text, spans)
    return spans


# -- the first JSON --------------------------------------------------------------------


def test_config_reads_what_the_clients_send_and_ignores_the_rest():
    config = parse_config(
        FIRST
        | {
            "chunk_interval": 10,
            "encoder_chunk_look_back": 4,
            "wav_format": "pcm",
            "chunk_size": "5,10,5",
        }
    )
    assert (config.mode, config.wav_name, config.sample_rate) == ("2pass", "demo", 16000)
    assert (config.language, config.itn) == ("auto", True)
    assert parse_config({}).mode == "2pass" and parse_config({}).itn is None
    assert parse_config({"mode": "ONLINE", "audio_fs": "8000"}).sample_rate == 8000
    assert parse_config({"mode": "offline"}).mode == "offline"
    assert parse_config({"mode": "4pass"}).mode == "2pass"  # unknown: the default
    assert parse_config({"svs_itn": False, "itn": True}).itn is False  # SenseVoice's own flag
    assert parse_config({"itn": "false"}).itn is False
    assert parse_config({"svs_lang": "zh-CN"}).language == "zh"
    assert parse_config({"svs_lang": "klingon"}).language == "auto"
    assert parse_config({"wav_format": "PCM"}).mode == "2pass"  # what the html5 demo sends
    assert parse_config({"audio_fs": 16000.0}).sample_rate == 16000
    assert len(parse_config({"wav_name": "x" * 10_000}).wav_name) == 256


@pytest.mark.parametrize(
    ("obj", "error"),
    [
        ({"audio_fs": 11025}, UnsupportedSampleRate),
        ({"audio_fs": "fast"}, InvalidOption),
        ({"audio_fs": True}, InvalidOption),
        ({"audio_fs": 16000.7}, InvalidOption),  # not 16000 Hz
        ({"wav_format": "mp4"}, InvalidOption),
    ],
)
def test_config_refuses_audio_we_cannot_decode(obj, error):
    with pytest.raises(error):
        parse_config(obj)


# -- timestamps ------------------------------------------------------------------------


def test_timestamp_units_follow_the_html5_demo_split():
    assert timestamp_units("hello there, don't") == ["hello", "there", "d", "o", "n", "'", "t"]
    assert timestamp_units("你好，世界。") == ["你", "好", "世", "界"]
    assert timestamp_units("") == []
    for text in ("the quick brown fox.", "你好，世界。", "mixed 中文 and 2024 words?"):
        spans = spread_spans(timestamp_units(text), 1000, 3000)
        html5_units(text, json.dumps(spans))


def test_spans_tile_the_utterance_in_order():
    spans = spread_spans(["a", "bbbb", "cc"], 1000.0, 1700.0)
    assert spans[0][0] == 1000 and spans[-1][1] == 1700
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert [e - s for s, e in spans] == [100, 400, 200]  # proportional to the length


def test_wav_header_is_skipped():
    pcm = tone(100).tobytes()
    header = (
        b"RIFF"
        + (36 + len(pcm)).to_bytes(4, "little")
        + b"WAVEfmt "
        + (16).to_bytes(4, "little")
        + bytes(16)
        + b"LIST"
        + (4).to_bytes(4, "little")
        + b"INFO"
        + b"data"
        + len(pcm).to_bytes(4, "little")
    )
    assert strip_wav_header(header + pcm) == pcm
    assert strip_wav_header(pcm) == pcm


# -- 2pass -----------------------------------------------------------------------------


def test_2pass_deltas_sentences_and_exactly_one_last_message():
    adapter, worker = make()
    adapter.receive_text(json.dumps(FIRST))
    assert out(adapter) == []  # no greeting: FunASR's servers send none
    got = send_audio(adapter, worker, two_utterances())
    adapter.receive_text(END)
    worker.answer()
    got += out(adapter)
    adapter.receive_text(END)  # funasr-client's close() sends it again
    assert out(adapter) == []
    assert all(m["wav_name"] == "demo" for m in got)
    offline = [m for m in got if m["mode"] == "2pass-offline"]
    # both utterances ended in silence and were decoded before the end of input: the
    # last message is empty (but keeps its mode), as the C++ server's is
    assert [m["text"] for m in offline] == ["the quick brown fox jumps", " hello there", ""]
    assert [m["is_final"] for m in got] == [False] * (len(got) - 1) + [True]
    # 2pass-online pieces are appended by the clients: per utterance they must spell a
    # prefix of what the partials said, and never repeat or retract anything
    online = [m for m in got if m["mode"] == "2pass-online"]
    assert online and all(not m["is_final"] for m in online)
    shown = ""
    for m in got:
        if m["mode"] == "2pass-online":
            shown += m["text"]
        else:
            assert m["text"].startswith(shown), (shown, m["text"])  # the sentence replaces
            shown = ""
    for m in offline[:-1]:
        assert isinstance(m["timestamp"], str)  # a JSON string, as the C++ server sends
        spans = html5_units(m["text"], m["timestamp"])
        assert m["stamp_sents"][0]["ts_list"] == spans
        assert m["stamp_sents"][0]["text_seg"] == m["text"].strip()
    assert adapter.close_code is None  # FunASR servers never close: the client does


def test_an_utterance_still_decoding_at_the_end_of_input_is_the_last_message():
    adapter, worker = make()
    adapter.receive_text(json.dumps(FIRST))
    got = send_audio(adapter, worker, two_utterances(), hold_finals=True)
    adapter.receive_text(END)
    worker.answer()
    got += out(adapter)
    offline = [m for m in got if m["mode"] == "2pass-offline"]
    assert [(m["text"], m["is_final"]) for m in offline] == [
        ("the quick brown fox jumps", False),
        (" hello there", True),
    ]
    assert got[-1] is offline[-1]


def test_end_of_input_closes_the_open_utterance_and_sends_it_last():
    adapter, worker = make(finals=["cut short"])
    adapter.receive_text(json.dumps(FIRST))
    send_audio(adapter, worker, np.concatenate([silence(300), tone(1200)]))
    adapter.receive_text(END)
    worker.answer()
    (last,) = [m for m in out(adapter) if m["mode"] == "2pass-offline"]
    assert last["text"] == "cut short" and last["is_final"] is True


def test_end_of_input_with_nothing_said_sends_an_empty_last_message():
    adapter, _ = make(finals=[])
    adapter.receive_text(json.dumps(FIRST | {"is_speaking": False}))
    assert out(adapter) == [
        {"mode": "2pass-offline", "text": "", "wav_name": "demo", "is_final": True}
    ]


def test_is_end_is_acknowledged_after_the_last_message():
    adapter, worker = make(finals=["one"])
    adapter.receive_text(json.dumps(FIRST))
    send_audio(adapter, worker, np.concatenate([silence(300), tone(800), silence(800)]))
    adapter.receive_text('{"is_speaking": false, "is_end": true}')
    worker.answer()
    got = out(adapter)
    assert [m["is_final"] for m in got][-2:] == [True, True]
    assert got[-1] == {
        "mode": "2pass",
        "text": "",
        "wav_name": "demo",
        "is_final": True,
        "is_end": True,
    }
    adapter.receive_text('{"is_speaking": false, "is_end": true}')  # asked again: answered
    assert out(adapter)[-1]["is_end"] is True


def test_a_new_utterance_after_the_last_message_gets_its_own_last_message():
    adapter, worker = make(finals=["first", "second"])
    adapter.receive_text(json.dumps(FIRST))
    for _ in range(2):
        send_audio(adapter, worker, np.concatenate([silence(300), tone(800), silence(800)]))
        adapter.receive_text(END)
        worker.answer()
        assert sum(m["is_final"] for m in out(adapter)) == 1


@pytest.mark.parametrize("mode", ["2pass", "online", "offline"])
def test_a_round_sent_before_the_last_one_is_answered_gets_its_own_last_message(mode):
    """Audio and a second end of input while the first round's final is still decoding:
    each end of input is answered by its own last message, in order, and no text is lost
    (it used to be taken for funasr-client's repeated stop, and never answered)."""
    adapter, worker = make(finals=["first", "second"])
    adapter.receive_text(json.dumps(FIRST | {"mode": mode}))
    got = send_audio(adapter, worker, np.concatenate([silence(300), tone(800)]), hold_finals=True)
    adapter.receive_text(END)  # round 1 ends; its final is held ("decoding")
    worker.answer(hold_finals=True)
    got += send_audio(adapter, worker, np.concatenate([silence(300), tone(800)]), hold_finals=True)
    adapter.receive_text('{"is_speaking": false, "is_end": true}')  # round 2, at once
    adapter.receive_text('{"is_speaking": false, "is_end": true}')  # client's close(): no new round
    worker.answer()
    got += out(adapter)
    results = [m for m in got if not m.get("is_end")]
    if mode == "2pass":  # the 2pass-online pieces are provisional: the sentences replace them
        results = [m for m in results if m["mode"] == "2pass-offline"]
        assert [m["text"] for m in results] == ["first", " second"]
    assert "".join(m["text"] for m in results) == "first second"  # nothing lost
    lasts = [m for m in results if m["is_final"]]
    assert len(lasts) == 2 and lasts[-1] is results[-1]
    assert "first" in "".join(m["text"] for m in results[: results.index(lasts[0]) + 1])
    assert [m.get("is_end", False) for m in got[-2:]] == [False, True]  # one ack, at the end
    assert sum(bool(m.get("is_end")) for m in got) == 1


def test_audio_with_no_speech_between_two_ends_of_input_is_a_round_of_its_own():
    adapter, worker = make(finals=["first"])
    adapter.receive_text(json.dumps(FIRST))
    send_audio(adapter, worker, np.concatenate([silence(300), tone(800)]), hold_finals=True)
    adapter.receive_text(END)
    adapter.receive_bytes(silence(200).astype("<i2").tobytes())
    adapter.receive_text(END)
    worker.answer()
    lasts = [(m["text"], m["is_final"]) for m in out(adapter) if m["mode"] == "2pass-offline"]
    assert lasts == [("first", True), ("", True)]


# -- online and offline ----------------------------------------------------------------


def test_online_mode_sends_only_pieces_to_append():
    adapter, worker = make()
    adapter.receive_text(json.dumps(FIRST | {"mode": "online"}))
    got = send_audio(adapter, worker, two_utterances())
    adapter.receive_text(END)
    worker.answer()
    got += out(adapter)
    assert {m["mode"] for m in got} == {"online"}
    assert "".join(m["text"] for m in got) == "the quick brown fox jumps hello there"
    assert [m["is_final"] for m in got][-1] is True and sum(m["is_final"] for m in got) == 1


def test_offline_mode_sends_one_message_with_everything():
    adapter, worker = make()
    adapter.receive_text(json.dumps(FIRST | {"mode": "offline"}))
    got = send_audio(adapter, worker, two_utterances())
    assert got == []
    assert not worker.partials  # offline asks for no partial decodes
    adapter.receive_text(END)
    worker.answer()
    (only,) = out(adapter)
    assert (only["mode"], only["text"], only["is_final"]) == (
        "offline",
        "the quick brown fox jumps hello there",
        True,
    )
    spans = html5_units(only["text"], only["timestamp"])
    assert len(spans) == 7 and spans == sorted(spans)
    assert [s["text_seg"] for s in only["stamp_sents"]] == [
        "the quick brown fox jumps",
        "hello there",
    ]


# -- errors and limits -----------------------------------------------------------------


def test_audio_before_the_first_json_is_an_error_in_funasr_shape():
    adapter, _ = make()
    adapter.receive_bytes(tone(100).tobytes())
    (error,) = out(adapter)
    assert error["is_final"] is True and error["text"].startswith("ERROR. ")
    assert error["error"]["code"] == "unexpected_message"
    assert adapter.close_code == 1008


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("not json", "bad_message"),
        ("[1, 2]", "bad_message"),
        ('{"audio_fs": 12345}', "unsupported_sample_rate"),
        ('{"wav_format": "aac"}', "invalid_option"),
        ('{"pad": "' + "x" * 70_000 + '"}', "bad_message"),
    ],
)
def test_bad_first_frame(frame, code):
    adapter, _ = make()
    adapter.receive_text(frame)
    (error,) = out(adapter)
    assert (error["error"]["code"], error["is_final"], adapter.close_code) == (code, True, 1008)


@pytest.mark.parametrize("frame", ['{"audio_fs": 11025', '{"wav_format": "m4a"'])
def test_an_error_about_the_first_frame_echoes_its_wav_name(frame):
    adapter, _ = make()
    adapter.receive_text(frame + ', "wav_name": "mic"}')
    (error,) = out(adapter)
    assert error["wav_name"] == "mic" and error["error"]["code"] in (
        "unsupported_sample_rate",
        "invalid_option",
    )


def test_garbage_mid_stream_keeps_the_speech_heard_then_ends_with_the_error():
    adapter, worker = make(finals=["heard", "cut"])
    adapter.receive_text(json.dumps(FIRST))
    got = send_audio(
        adapter, worker, np.concatenate([silence(300), tone(800), silence(800), tone(600)])
    )
    adapter.receive_text("{{{")
    worker.answer()
    got += out(adapter)
    offline = [m["text"] for m in got if m["mode"] == "2pass-offline" and "error" not in m]
    assert offline == ["heard", " cut"]
    assert got[-1]["error"]["code"] == "bad_message" and got[-1]["is_final"] is True
    assert sum(m["is_final"] for m in got) == 1
    assert adapter.close_code == 1008
    adapter.receive_bytes(tone(100).tobytes())  # after the error: ignored
    assert out(adapter) == []


def test_idle_after_the_last_message_closes_quietly():
    adapter, worker = make(finals=["one"])
    adapter.receive_text(json.dumps(FIRST))
    send_audio(adapter, worker, np.concatenate([silence(300), tone(800), silence(800)]))
    adapter.receive_text(END)
    worker.answer()
    out(adapter)
    adapter.session.expire("idle_timeout", "no audio for 60 s")
    assert out(adapter) == [] and adapter.close_code == 1000


def test_idle_mid_stream_sends_the_finals_then_the_error():
    adapter, worker = make(finals=["one"])
    adapter.receive_text(json.dumps(FIRST))
    send_audio(adapter, worker, np.concatenate([silence(300), tone(800)]))
    adapter.session.expire("idle_timeout", "no audio for 60 s")
    worker.answer()
    got = out(adapter)
    assert [m["text"] for m in got][-2:] == ["one", "ERROR. no audio for 60 s"]
    assert got[-1]["error"]["code"] == "idle_timeout" and adapter.close_code == 1008


def test_shutdown_finishes_the_utterance_as_the_last_message():
    adapter, worker = make(finals=["unfinished"])
    adapter.receive_text(json.dumps(FIRST))
    send_audio(adapter, worker, np.concatenate([silence(300), tone(800)]))
    adapter.session.shutdown()
    worker.answer()
    (last,) = [m for m in out(adapter) if m["is_final"]]
    assert last["text"] == "unfinished" and adapter.close_code == 1001


def test_wav_file_bytes_as_the_html5_demo_sends_them():
    adapter, worker = make(finals=["from a file"])
    adapter.receive_text(
        json.dumps(
            {
                "mode": "offline",
                "wav_name": "h5",
                "wav_format": "PCM",
                "audio_fs": 16000,
                "is_speaking": True,
            }
        )
    )
    pcm = np.concatenate([silence(300), tone(800), silence(800)]).tobytes()
    header = (
        b"RIFF"
        + (36 + len(pcm)).to_bytes(4, "little")
        + b"WAVEfmt "
        + (16).to_bytes(4, "little")
        + bytes(16)
        + b"data"
        + len(pcm).to_bytes(4, "little")
    )
    wav = header + pcm
    for i in range(0, len(wav), 960):  # the demo's file mode: 960-byte pieces
        adapter.receive_bytes(wav[i : i + 960])
        worker.answer()
    adapter.receive_text(json.dumps({"is_speaking": False, "mode": "offline"}))
    worker.answer()
    (only,) = out(adapter)
    assert only["text"] == "from a file"
    assert adapter.session.audio_ms == pytest.approx(1900, abs=1)  # the header is not audio
