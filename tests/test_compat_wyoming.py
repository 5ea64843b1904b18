"""Wyoming framing and the Wyoming adapter over a real Session, with bytes and no sockets."""

from __future__ import annotations

import io

import numpy as np
import pytest
import wyoming.event as wyoming_event
import wyoming.info as wyoming_info

from streamer.core.compat.wyoming import (
    AudioFormat,
    EventLimits,
    EventParser,
    PcmConverter,
    WyomingAdapter,
    WyomingEvent,
    WyomingInfo,
    encode_event,
)
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session, SessionOptions
from streamer.errors import MalformedMessage, MessageTooBig
from tests.fakes import InstantWorker, loudness_classifier, silence, tone

FORMAT = {"rate": 16000, "width": 2, "channels": 1}


def make(finals=("the quick brown fox jumps", "hello there"), limits=None):
    session = Session(
        "w1", SessionOptions(model_name="fake"), StreamOptions(), loudness_classifier()
    )
    adapter = WyomingAdapter(session, WyomingInfo(model_name="fake-model", version="9.9"), limits)
    adapter.start()
    return adapter, InstantWorker(session, list(finals))


def events(adapter) -> list[WyomingEvent]:
    parser = EventParser()
    return [e for frame in adapter.drain() for e in parser.feed(frame.data)]


def send(adapter, *items: WyomingEvent) -> None:
    adapter.receive_bytes(b"".join(encode_event(item) for item in items))


def chunk(pcm_bytes: bytes, audio_format=FORMAT) -> WyomingEvent:
    return WyomingEvent("audio-chunk", dict(audio_format, timestamp=None), pcm_bytes)


def home_assistant(adapter, worker, pcm: np.ndarray, language="en") -> list[WyomingEvent]:
    """Home Assistant's sequence (homeassistant/components/wyoming/stt.py)."""
    send(
        adapter,
        WyomingEvent("transcribe", {"language": language}),
        WyomingEvent("audio-start", dict(FORMAT, timestamp=None)),
    )
    got = events(adapter)
    data = pcm.astype("<i2").tobytes()
    for i in range(0, len(data), 1024):
        send(adapter, chunk(data[i : i + 1024]))
        worker.answer()
        got += events(adapter)
    send(adapter, WyomingEvent("audio-stop", {"timestamp": None}))
    worker.answer()
    return got + events(adapter)


def two_utterances():
    return np.concatenate([silence(300), tone(1500), silence(1000), tone(900), silence(1000)])


# -- framing ---------------------------------------------------------------------------


def test_framing_round_trips_with_the_wyoming_package():
    ours = WyomingEvent("audio-chunk", dict(FORMAT, timestamp=5), b"\x01\x02" * 300)
    theirs = wyoming_event.read_event(io.BytesIO(encode_event(ours)))
    assert (theirs.type, theirs.data, theirs.payload) == (ours.type, ours.data, ours.payload)
    buffer = io.BytesIO()
    wyoming_event.write_event(wyoming_event.Event("transcript", {"text": "你好"}), buffer)
    wyoming_event.write_event(wyoming_event.Event("audio-stop"), buffer)
    assert EventParser().feed(buffer.getvalue()) == [
        WyomingEvent("transcript", {"text": "你好"}),
        WyomingEvent("audio-stop"),
    ]


def test_parser_takes_any_split_and_merges_header_data():
    wire = (
        b'{"type": "x", "data": {"a": 1, "b": 2}, "data_length": 8, "payload_length": 3}\n'
        b'{"b": 3}pcm' + encode_event(WyomingEvent("describe"))
    )
    whole = EventParser().feed(wire)
    assert whole == [WyomingEvent("x", {"a": 1, "b": 3}, b"pcm"), WyomingEvent("describe")]
    parser = EventParser()
    byte_by_byte = [e for i in range(len(wire)) for e in parser.feed(wire[i : i + 1])]
    assert byte_by_byte == whole


@pytest.mark.parametrize(
    ("wire", "error"),
    [
        (b"x" * 100, MessageTooBig),
        (b'{"type": "a", "data_length": 65}\n', MessageTooBig),
        (b'{"type": "a", "payload_length": 1000}\n', MessageTooBig),
        (b'{"type": "a", "data_length": -1}\n', MalformedMessage),
        (b'{"type": "a", "payload_length": "3"}\n', MalformedMessage),
        (b"not json\n", MalformedMessage),
        (b'{"no": "type"}\n', MalformedMessage),
        (b'{"type": "a", "data_length": 4}\n[1] ', MalformedMessage),
    ],
)
def test_parser_refuses_bad_or_oversized_input(wire, error):
    parser = EventParser(EventLimits(max_line_bytes=64, max_data_bytes=64, max_payload_bytes=512))
    with pytest.raises(error):
        parser.feed(wire)


def test_pcm_converter_downmixes_and_widens_across_chunks():
    stereo = np.array([[1000, 3000], [-2000, 0], [5, 7]], dtype="<i2").tobytes()
    converter = PcmConverter(AudioFormat(16000, 2, 2))
    out = converter.push(stereo[:5]) + converter.push(stereo[5:])  # split inside a frame
    assert np.frombuffer(out, "<i2").tolist() == [2000, -1000, 6]
    u8 = PcmConverter(AudioFormat(16000, 1, 1)).push(bytes([128, 255, 0]))
    assert np.frombuffer(u8, "<i2").tolist() == [0, 127 * 256, -128 * 256]
    s32 = np.array([1 << 20, -(1 << 30)], dtype="<i4").tobytes()
    assert np.frombuffer(PcmConverter(AudioFormat(16000, 4, 1)).push(s32), "<i2").tolist() == [
        16,
        -(1 << 14),
    ]


# -- Home Assistant's sequence -----------------------------------------------------------


def test_describe_answers_info_in_wyomings_schema():
    adapter, _ = make()
    send(adapter, WyomingEvent("describe"))
    (info,) = events(adapter)
    parsed = wyoming_info.Info.from_event(wyoming_event.Event(info.type, info.data))
    (asr,) = parsed.asr
    assert asr.installed and asr.supports_transcript_streaming and asr.version == "9.9"
    assert asr.models[0].name == "fake-model"
    assert asr.models[0].languages == ["zh", "en", "yue", "ja", "ko"]
    assert adapter.close_code is None  # describe keeps the connection


def test_transcript_streams_chunks_then_the_whole_text_then_closes():
    adapter, worker = make()
    got = home_assistant(adapter, worker, two_utterances())
    types = [e.type for e in got]
    assert types[0] == "transcript-start" and got[0].data == {"language": "en"}
    assert types[-2:] == ["transcript", "transcript-stop"]
    assert set(types[1:-2]) == {"transcript-chunk"}
    transcript = got[-2].data
    assert transcript == {"text": "the quick brown fox jumps hello there", "language": "en"}
    # the chunks are pieces to append: together they spell the transcript
    assert (
        "".join(e.data["text"] for e in got if e.type == "transcript-chunk") == (transcript["text"])
    )
    assert types.count("transcript-chunk") > 2  # partials streamed while the audio flowed
    assert adapter.close_code == 1000


def test_audio_stop_without_audio_gives_an_empty_transcript():
    adapter, _ = make(finals=[])
    send(adapter, WyomingEvent("transcribe", {}), WyomingEvent("audio-stop"))
    assert [(e.type, e.data) for e in events(adapter)] == [
        ("transcript-start", {}),
        ("transcript", {"text": ""}),
        ("transcript-stop", {}),
    ]


def test_audio_chunks_without_audio_start_and_in_another_format():
    adapter, worker = make(finals=["stereo at 48 kHz"])
    pcm = np.repeat(np.concatenate([silence(300), tone(900), silence(900)]), 3)
    stereo = np.repeat(pcm, 2).astype("<i2").tobytes()
    audio_format = {"rate": 48000, "width": 2, "channels": 2}
    for i in range(0, len(stereo), 4096):
        send(adapter, chunk(stereo[i : i + 4096], audio_format))
        worker.answer()
    send(adapter, WyomingEvent("audio-stop"))
    worker.answer()
    transcript = [e for e in events(adapter) if e.type == "transcript"]
    assert transcript[0].data["text"] == "stereo at 48 kHz"
    assert adapter.session.stream.sample_rate == 48000
    assert adapter.session.audio_ms == pytest.approx(2100, abs=1)


def test_ping_pong_and_unknown_events_are_ignored():
    adapter, _ = make()
    send(
        adapter,
        WyomingEvent("ping", {"text": "hi"}),
        WyomingEvent("run-pipeline"),
        WyomingEvent("select-program", {"name": "sensevoice-streamer"}),
    )
    assert [(e.type, e.data) for e in events(adapter)] == [("pong", {"text": "hi"})]
    assert adapter.close_code is None


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (b"garbage\n", "bad_message"),
        (b"x" * 70_000, "message_too_big"),
        (
            encode_event(WyomingEvent("audio-start", {"rate": 11025, "width": 2, "channels": 1})),
            "unsupported_sample_rate",
        ),
        (
            encode_event(WyomingEvent("audio-start", {"rate": 16000, "width": 3, "channels": 1})),
            "invalid_option",
        ),
        (encode_event(WyomingEvent("audio-chunk", {"rate": 16000}, b"\0\0")), "invalid_option"),
    ],
)
def test_bad_input_gets_a_wyoming_error_and_the_connection_closes(wire, code):
    adapter, _ = make(finals=[])
    adapter.receive_bytes(wire)
    (error,) = events(adapter)
    assert (error.type, error.data["code"]) == ("error", code)
    assert adapter.close_code == 1008
    send(adapter, WyomingEvent("describe"))  # nothing after the error
    assert events(adapter) == []


def test_an_error_after_speech_still_delivers_what_was_heard():
    adapter, worker = make(finals=["heard"])
    send(adapter, WyomingEvent("audio-start", FORMAT))
    data = np.concatenate([silence(300), tone(800), silence(800)]).tobytes()
    send(adapter, chunk(data))
    worker.answer()
    events(adapter)
    send(adapter, chunk(b"\0\0", {"rate": 8000, "width": 2, "channels": 1}))  # format change
    worker.answer()
    got = events(adapter)
    assert [e.type for e in got] == ["transcript", "transcript-stop", "error"]
    assert got[0].data["text"] == "heard" and got[2].data["code"] == "invalid_option"


def test_idle_timeout_mid_stream():
    adapter, worker = make(finals=["cut"])
    send(adapter, WyomingEvent("audio-start", FORMAT), chunk(tone(800).tobytes()))
    worker.answer()
    adapter.session.expire("idle_timeout", "no audio for 60 s")
    worker.answer()
    got = events(adapter)
    assert [e.type for e in got][-3:] == ["transcript", "transcript-stop", "error"]
    assert got[-1].data == {"text": "no audio for 60 s", "code": "idle_timeout"}
