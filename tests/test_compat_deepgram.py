"""The Deepgram adapter, driven with plain bytes and JSON (no sockets)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from streamer.core.compat import deepgram
from streamer.core.compat.deepgram import DeepgramAdapter, ListenOptions, parse_listen_query
from streamer.core.protocol import Final, StreamOptions
from streamer.core.wire import V1Adapter
from streamer.errors import InvalidOption, UnsupportedSampleRate
from tests.compat_harness import Harness, make_session
from tests.fakes import silence, tone
from tests.support import ulaw_encode

# what each real client sends (../shared/compat-protocols.md, section 1)
SDK_QUERY = {
    "channels": "1", "encoding": "linear16", "endpointing": "300", "interim_results": "true",
    "language": "en-US", "model": "nova-3", "punctuate": "true", "sample_rate": "16000",
    "smart_format": "true", "utterance_end_ms": "1000", "vad_events": "true",
}  # fmt: skip
PIPECAT_QUERY = {
    "channels": "1", "detect_entities": "false", "diarize": "false", "dictation": "false",
    "encoding": "linear16", "interim_results": "true", "language": "en",
    "model": "nova-3-general", "multichannel": "false", "numerals": "false",
    "punctuate": "true", "sample_rate": "16000", "smart_format": "false",
}  # fmt: skip
LIVEKIT_QUERY = {
    "model": "nova-3", "punctuate": "true", "smart_format": "false", "no_delay": "true",
    "interim_results": "true", "encoding": "linear16", "vad_events": "true",
    "sample_rate": "16000", "channels": "1", "endpointing": "25", "filler_words": "true",
    "profanity_filter": "false", "numerals": "false", "mip_opt_out": "false",
    "utterance_end_ms": "1000", "language": "en-US",
}  # fmt: skip


def bursts(rate: int = 16000) -> np.ndarray:
    """Two utterances (1.5 s and 0.8 s of tone) with silence around them."""
    return np.concatenate(
        [silence(500, rate), tone(1500, rate=rate), silence(1000, rate),
         tone(800, rate=rate), silence(1000, rate)]
    )  # fmt: skip


def adapter_for(query: dict[str, str], session_id: str = "s1") -> DeepgramAdapter:
    options = parse_listen_query(query, StreamOptions())
    session = make_session(session_id, **options.stream.to_dict())
    return DeepgramAdapter(session, options, request_id="req-1", created="2026-01-01T00:00:00Z")


def v1_finals(pcm: np.ndarray, **stream) -> list[str]:
    """Protocol v1's finals for the same audio through the same fake worker."""
    h = Harness(V1Adapter(make_session(**stream))).start()
    h.audio(pcm.tobytes())
    h.text({"type": "stop"})
    return [m["text"] for m in h.sent if m["type"] == "final"]


# -- the handshake -------------------------------------------------------------------------


def test_the_real_clients_queries_parse() -> None:
    sdk = parse_listen_query(SDK_QUERY, StreamOptions())
    assert sdk.stream == StreamOptions(
        language="en", itn=True, sample_rate=16000, partials=True, endpoint_ms=300, words=True
    )
    assert sdk.punctuated_words
    assert (sdk.vad_events, sdk.utterance_end_ms, sdk.encoding, sdk.channels) == (
        True, 1000, "linear16", 1)  # fmt: skip
    pipecat = parse_listen_query(PIPECAT_QUERY, StreamOptions())
    assert pipecat.stream.itn is True  # punctuate=true wins over smart_format=false
    assert pipecat.punctuated_words
    assert not pipecat.vad_events and pipecat.utterance_end_ms is None
    livekit = parse_listen_query(LIVEKIT_QUERY, StreamOptions())
    assert livekit.stream.endpoint_ms == 100  # endpointing=25, clamped


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({}, dict(sample_rate=16000, partials=False, itn=True, language="auto")),
        ({"encoding": "mulaw"}, dict(sample_rate=8000)),
        ({"encoding": "alaw", "sample_rate": "16000"}, dict(sample_rate=16000)),
        ({"language": "multi"}, dict(language="auto")),
        ({"language": "zh-CN"}, dict(language="zh")),
        ({"language": "zh-HK"}, dict(language="yue")),
        ({"language": "fr"}, dict(language="auto")),  # the model detects what it knows
        ({"punctuate": "false", "smart_format": "false"}, dict(itn=False)),
        ({"smart_format": "true"}, dict(itn=True)),
        ({"endpointing": "false"}, dict(endpoint_ms=500)),
        ({"endpointing": "99999"}, dict(endpoint_ms=5000)),
        ({"interim_results": "maybe"}, dict(partials=False)),
        ({"keywords": "x:2", "diarize": "true", "tag": "t"}, dict(sample_rate=16000)),
    ],
)
def test_lenient_options(query: dict[str, str], expected: dict) -> None:
    stream = parse_listen_query(query, StreamOptions()).stream.to_dict()
    assert {k: stream[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ({"encoding": "speex"}, InvalidOption),
        ({"encoding": "amr-nb"}, InvalidOption),
        ({"sample_rate": "11025"}, UnsupportedSampleRate),
        ({"sample_rate": "fast"}, UnsupportedSampleRate),
        ({"channels": "9"}, InvalidOption),
        ({"channels": "0"}, InvalidOption),
        ({"channels": "2", "multichannel": "true"}, InvalidOption),
    ],
)
def test_unusable_audio_is_refused(query: dict[str, str], error: type) -> None:
    with pytest.raises(error):
        parse_listen_query(query, StreamOptions())


def test_language_multi_reports_the_detected_language() -> None:
    assert parse_listen_query({"language": "multi"}, StreamOptions()).detect_language
    assert not parse_listen_query({"language": "en"}, StreamOptions()).detect_language


def test_presented_key() -> None:
    assert deepgram.presented_key("Token abc", []) == "abc"
    assert deepgram.presented_key("Bearer abc", []) == "abc"
    assert deepgram.presented_key(None, ["token", "abc"]) == "abc"
    assert deepgram.presented_key("Basic abc", []) is None
    assert deepgram.presented_key(None, ["abc"]) is None
    assert deepgram.select_subprotocol(["token", "abc"]) == "token"
    assert deepgram.select_subprotocol(["binary"]) is None


# -- messages --------------------------------------------------------------------------------


def test_a_stream_with_two_utterances() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    assert h.sent == []  # Deepgram sends no greeting
    pcm = bursts()
    h.audio(pcm.tobytes())
    h.text({"type": "KeepAlive"})
    h.text({"type": "CloseStream"})
    kinds = h.types()
    assert kinds[0] == "SpeechStarted" and kinds[-1] == "Metadata"
    finals = [m for m in h.of_type("Results") if m["is_final"]]
    assert [f["channel"]["alternatives"][0]["transcript"] for f in finals] == v1_finals(
        pcm, **parse_listen_query(SDK_QUERY, StreamOptions()).stream.to_dict()
    )
    assert [f["speech_final"] for f in finals] == [True, True]
    assert not any(f["from_finalize"] for f in finals)
    assert len(h.of_type("UtteranceEnd")) == 2
    assert len(h.of_type("SpeechStarted")) == 2
    interims = [m for m in h.of_type("Results") if not m["is_final"]]
    assert interims and all(not m["speech_final"] for m in interims)
    # every utterance: SpeechStarted, its interims, its final, then UtteranceEnd
    first_end = kinds.index("UtteranceEnd")
    assert kinds[1:first_end - 1] == ["Results"] * (first_end - 2)  # fmt: skip
    assert h.session.close_code == 1000


def test_results_carry_every_field_the_clients_read() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    h.audio(bursts().tobytes())
    final = next(m for m in h.of_type("Results") if m["is_final"])
    assert final["channel_index"] == [0, 1]
    assert final["metadata"]["request_id"] == "req-1"
    assert set(final["metadata"]) >= {"model_info", "model_uuid"}
    alt = final["channel"]["alternatives"][0]
    assert alt["confidence"] > 0 and alt["transcript"]
    words = alt["words"]
    assert " ".join(w["punctuated_word"] for w in words) == alt["transcript"]
    assert words[0]["start"] == final["start"]
    assert words[-1]["end"] == pytest.approx(final["start"] + final["duration"], abs=0.002)
    assert all(w["start"] < w["end"] and set(w) >= {"word", "confidence"} for w in words)
    started = h.of_type("SpeechStarted")[0]
    assert started["channel"] == [0, 1] and started["timestamp"] == final["start"]
    utterance_end = h.of_type("UtteranceEnd")[0]
    assert utterance_end["last_word_end"] == words[-1]["end"]


def test_without_interim_results_or_vad_events_only_finals_are_sent() -> None:
    h = Harness(adapter_for({"encoding": "linear16", "sample_rate": "16000"})).start()
    h.audio(bursts().tobytes())
    assert h.types() == ["Results", "Results"]
    assert all(m["is_final"] for m in h.sent)


def test_finalize_with_nothing_open_is_answered_at_once() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    h.text({"type": "Finalize"})
    assert len(h.sent) == 1
    answer = h.sent[0]
    assert answer["type"] == "Results" and answer["is_final"] and answer["from_finalize"]
    assert answer["channel"]["alternatives"][0] == {
        "transcript": "",
        "confidence": 0.0,
        "words": [],
    }


def test_finalize_during_speech_finalizes_it() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    h.audio(np.concatenate([silence(300), tone(1000)]).tobytes())
    h.text({"type": "Finalize"})
    finals = [m for m in h.of_type("Results") if m["is_final"]]
    assert len(finals) == 1  # the segment's own final answers it: no empty extra
    assert finals[0]["from_finalize"] and not finals[0]["speech_final"]
    assert finals[0]["channel"]["alternatives"][0]["transcript"]
    assert not h.of_type("UtteranceEnd")


def test_the_answer_to_finalize_waits_for_finals_still_decoding() -> None:
    h = Harness(adapter_for(SDK_QUERY), immediate=False).start()
    h.audio(np.concatenate([silence(300), tone(600), silence(800)]).tobytes())
    assert h.session.pending_finals == 1  # the utterance ended; its final is decoding
    h.text({"type": "Finalize"})
    assert not [m for m in h.of_type("Results") if m["is_final"]]
    h.answer()
    finals = [m for m in h.of_type("Results") if m["is_final"]]
    assert [(bool(f["channel"]["alternatives"][0]["transcript"]), f["from_finalize"])
            for f in finals] == [(True, False), (False, True)]  # fmt: skip


def test_close_stream_flushes_then_sends_metadata_and_closes_1000() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    pcm = np.concatenate([silence(300), tone(1000)]).tobytes()  # speech still open
    h.audio(pcm)
    h.text({"type": "CloseStream"})
    assert h.types()[-3:] == ["Results", "UtteranceEnd", "Metadata"]
    final = h.of_type("Results")[-1]
    assert final["is_final"] and final["speech_final"]
    metadata = h.sent[-1]
    assert metadata["request_id"] == "req-1" and metadata["channels"] == 1
    assert metadata["duration"] == pytest.approx(1.3)
    assert metadata["sha256"] == hashlib.sha256(pcm).hexdigest()
    assert metadata["created"] == "2026-01-01T00:00:00Z"
    assert h.session.close_code == 1000
    before = len(h.sent)
    h.audio(tone(500).tobytes())  # ignored after CloseStream
    h.text({"type": "CloseStream"})
    assert len(h.sent) == before


def test_finalize_then_close_stream_answers_both() -> None:
    """livekit's end of input: Finalize, then CloseStream at once."""
    h = Harness(adapter_for(LIVEKIT_QUERY), immediate=False).start()
    h.audio(np.concatenate([silence(300), tone(1000)]).tobytes())
    h.text({"type": "Finalize"})
    h.text({"type": "Finalize"})
    h.text({"type": "CloseStream"})
    h.answer()
    finals = [m for m in h.of_type("Results") if m["is_final"]]
    assert [f["from_finalize"] for f in finals] == [True, True]
    assert h.types()[-1] == "Metadata" and h.session.close_code == 1000


def test_garbage_text_gets_a_schema_error_and_the_stream_goes_on() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    h.text("this is not json")
    h.text('["KeepAlive"]')
    h.text({"type": "Configure", "keyterms": ["x"]})  # a newer message: ignored
    errors = h.of_type("Error")
    assert [e["variant"] for e in errors] == ["SchemaError", "SchemaError"]
    assert errors[0]["message"] == "this is not json" and errors[0]["description"]
    assert h.session.close_code is None
    h.audio(bursts().tobytes())
    assert len([m for m in h.of_type("Results") if m["is_final"]]) == 2


def test_a_failed_decode_gives_an_error_and_an_empty_final() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    h.fail_next_final = True
    h.audio(bursts().tobytes())
    assert h.of_type("Error")[0]["variant"] == "decode_failed"
    finals = [m for m in h.of_type("Results") if m["is_final"]]
    assert [bool(f["channel"]["alternatives"][0]["transcript"]) for f in finals] == [False, True]


def test_a_server_limit_sends_the_finals_then_the_error() -> None:
    h = Harness(adapter_for(SDK_QUERY)).start()
    h.audio(np.concatenate([silence(300), tone(1000)]).tobytes())
    h.session.expire("idle_timeout", "no audio or keepalive for 60 s")
    h.pump()
    assert h.types()[-2:] == ["UtteranceEnd", "Error"]
    assert h.sent[-1]["variant"] == "idle_timeout"
    assert not h.of_type("Metadata")  # only CloseStream gets Metadata
    assert h.session.close_code == 1008


# -- audio encodings -------------------------------------------------------------------------


def final_spans(h: Harness) -> list[tuple[float, float]]:
    return [(m["start"], m["duration"]) for m in h.of_type("Results") if m["is_final"]]


def test_mulaw_8khz_gives_the_same_utterances_as_linear16() -> None:
    pcm = bursts(rate=8000)
    linear = Harness(adapter_for({"sample_rate": "8000"})).start()
    linear.audio(pcm.tobytes())
    mulaw = Harness(adapter_for({"encoding": "mulaw"})).start()
    mulaw.audio(ulaw_encode(pcm), chunk_bytes=160)  # 20 ms telephony frames
    assert len(final_spans(mulaw)) == 2
    assert final_spans(mulaw) == final_spans(linear)


def test_stereo_is_mixed_down_even_when_chunks_split_a_frame() -> None:
    pcm = bursts()
    mono = Harness(adapter_for({})).start()
    mono.audio(pcm.tobytes())
    stereo = Harness(adapter_for({"channels": "2"})).start()
    interleaved = np.stack([pcm, pcm], axis=1).reshape(-1)
    stereo.audio(interleaved.tobytes(), chunk_bytes=3001)  # splits samples and frames
    assert final_spans(stereo) == final_spans(mono)
    assert len(final_spans(stereo)) == 2


def test_sessions_do_not_share_state() -> None:
    a = Harness(adapter_for(SDK_QUERY, "a")).start()
    b = Harness(adapter_for(SDK_QUERY, "b")).start()
    a.text("garbage")
    a.audio(bursts().tobytes())
    b.audio(bursts().tobytes())
    assert [m for m in a.sent if m["type"] != "Error"] == b.sent


def test_finals_are_core_finals() -> None:
    """The frames name the core messages they translate (the server counts them)."""
    h = Harness(adapter_for(SDK_QUERY)).start()
    h.audio(bursts().tobytes())
    finals = [f.message for f in h.frames if isinstance(f.message, Final)]
    assert len(finals) == 2


def test_default_adapter_options() -> None:
    options = ListenOptions(stream=StreamOptions())
    assert (options.encoding, options.channels, options.vad_events) == ("linear16", 1, False)
