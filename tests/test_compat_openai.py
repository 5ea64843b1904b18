"""The OpenAI Realtime transcription adapter, driven with plain JSON (no sockets)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from streamer.core.compat import openai_realtime as oa
from streamer.core.compat.openai_realtime import RealtimeAdapter, RealtimeOptions
from streamer.core.session import State
from streamer.core.wire import V1Adapter
from streamer.errors import InvalidOption
from tests import compat_clients as clients
from tests.compat_harness import Harness, make_session
from tests.fakes import silence, tone
from tests.support import ulaw_encode

# what the real clients send first (../shared/compat-protocols.md, section 2)
GA_UPDATE = {"type": "session.update", "session": clients.GA_SESSION}
PIPECAT_UPDATE = {
    "type": "session.update",
    "session": {
        "type": "transcription",
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                "turn_detection": None,
            }
        },
    },
}
BETA_UPDATE = {"type": "transcription_session.update", "session": clients.BETA_SESSION}
RATE = 24000


def bursts(rate: int = RATE) -> np.ndarray:
    return np.concatenate(
        [silence(500, rate), tone(1500, rate=rate), silence(1000, rate),
         tone(800, rate=rate), silence(1000, rate)]
    )  # fmt: skip


def harness(beta: bool = False, session_id: str = "s1", **kwargs) -> Harness:
    session = make_session(session_id, sample_rate=RATE)
    return Harness(RealtimeAdapter(session, RealtimeOptions(beta=beta)), **kwargs).start()


def append(h: Harness, data: bytes, chunk_bytes: int = 4800) -> None:
    for i in range(0, len(data), chunk_bytes):
        chunk = base64.b64encode(data[i : i + chunk_bytes]).decode()
        h.text({"type": "input_audio_buffer.append", "audio": chunk})


def completed(h: Harness) -> list[str]:
    return [
        m["transcript"] for m in h.of_type("conversation.item.input_audio_transcription.completed")
    ]


def deltas_by_item(h: Harness) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in h.of_type("conversation.item.input_audio_transcription.delta"):
        out[m["item_id"]] = out.get(m["item_id"], "") + m["delta"]
    return out


def v1_finals(pcm: np.ndarray, **stream) -> list[str]:
    h = Harness(V1Adapter(make_session(**stream))).start()
    h.audio(pcm.tobytes())
    h.text({"type": "stop"})
    return [m["text"] for m in h.sent if m["type"] == "final"]


# -- the handshake -------------------------------------------------------------------------


def test_handshake() -> None:
    ga = oa.parse_realtime_handshake({"intent": "transcription"}, None, [])
    assert ga == RealtimeOptions(beta=False, model=None)
    beta = oa.parse_realtime_handshake(
        {"intent": "transcription", "model": "gpt-4o-transcribe"}, "realtime=v1", []
    )
    assert beta == RealtimeOptions(beta=True, model="gpt-4o-transcribe")
    browser = ["realtime", "openai-insecure-api-key.sk-1", "openai-beta.realtime-v1"]
    assert oa.parse_realtime_handshake({"intent": "transcription"}, None, browser).beta
    for query in ({}, {"intent": "conversation"}, {"model": "gpt-realtime"}):
        with pytest.raises(InvalidOption, match="intent=transcription"):
            oa.parse_realtime_handshake(query, None, [])
    assert oa.presented_key("Bearer sk-1", []) == "sk-1"
    assert oa.presented_key(None, browser) == "sk-1"
    assert oa.presented_key("Token sk-1", []) is None
    assert oa.select_subprotocol(browser) == "realtime"
    assert oa.select_subprotocol([]) is None


# -- server VAD (the SDK and LiveKit) ----------------------------------------------------------


def test_session_created_first_then_updated_with_the_effective_config() -> None:
    h = harness()
    created = h.sent[0]
    assert created["type"] == "session.created" and created["event_id"]
    audio_in = created["session"]["audio"]["input"]
    assert created["session"]["type"] == "transcription"
    assert audio_in["format"] == {"type": "audio/pcm", "rate": 24000}
    assert audio_in["turn_detection"]["type"] == "server_vad"
    h.text(GA_UPDATE)
    updated = h.sent[-1]
    assert updated["type"] == "session.updated"
    audio_in = updated["session"]["audio"]["input"]
    assert audio_in["transcription"]["language"] == "en"
    assert audio_in["turn_detection"]["silence_duration_ms"] == 500
    assert h.session.stream.language == "en" and h.session.stream.sample_rate == RATE


def test_server_vad_events_and_transcripts() -> None:
    h = harness()
    h.text(GA_UPDATE)
    pcm = bursts()
    append(h, pcm.tobytes())
    assert completed(h) == v1_finals(pcm, sample_rate=RATE, language="en")
    kinds = [t for t in h.types() if t != "conversation.item.input_audio_transcription.delta"]
    per_item = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.completed",
    ]
    assert kinds == ["session.created", "session.updated", *per_item, *per_item]
    started = h.of_type("input_audio_buffer.speech_started")
    stopped = h.of_type("input_audio_buffer.speech_stopped")
    committed = h.of_type("input_audio_buffer.committed")
    items = [m["item_id"] for m in started]
    assert len(set(items)) == 2
    assert [m["item_id"] for m in stopped] == items == [m["item_id"] for m in committed]
    assert [m["previous_item_id"] for m in committed] == [None, items[0]]
    assert 0 < started[0]["audio_start_ms"] < stopped[0]["audio_end_ms"] <= 2300
    done = h.of_type("conversation.item.input_audio_transcription.completed")
    assert [m["item_id"] for m in done] == items
    assert done[0]["usage"]["type"] == "duration" and done[0]["usage"]["seconds"] > 1
    assert done[0]["languages"] == [{"code": "en"}] and done[0]["content_index"] == 0
    # the deltas of each item add up to its transcript (LiveKit concatenates them)
    assert deltas_by_item(h) == {m["item_id"]: m["transcript"] for m in done}
    assert not h.of_type("error")


def test_deltas_only_ever_grow_even_when_partials_change_their_mind() -> None:
    revisions = iter(["the cat", "the cap sat", "the cap sat on", "the cat sat on the mat"])

    def text_for(job):
        return next(revisions, "the cat sat on the mat") if job.kind == "partial" else (
            "the cat sat on the mat")  # fmt: skip

    h = harness(text_for=text_for)
    h.text(GA_UPDATE)
    append(
        h, np.concatenate([silence(300, RATE), tone(2000, rate=RATE), silence(900, RATE)]).tobytes()
    )
    deltas = [m["delta"] for m in h.of_type("conversation.item.input_audio_transcription.delta")]
    # "the ca" agreed first (cut back to a word: "the "), then "the cap sat" agreed; the
    # last revision disagrees with what was said, so nothing more is appended
    assert deltas == ["the ", "cap sat"]
    assert completed(h) == ["the cat sat on the mat"]  # the final carries the truth


def test_commit_in_server_vad_mode_finalizes_the_open_speech() -> None:
    """The SDK's sequence: appends, then commit while speech is still open."""
    h = harness()
    h.text(GA_UPDATE)
    append(h, np.concatenate([silence(300, RATE), tone(1000, rate=RATE)]).tobytes())
    h.text({"type": "input_audio_buffer.commit"})
    assert len(completed(h)) == 1 and completed(h)[0]
    h.text({"type": "input_audio_buffer.commit"})  # nothing open: no error, no event
    assert not h.of_type("error")
    assert len(h.of_type("input_audio_buffer.committed")) == 1


# -- manual commits (pipecat's default) -------------------------------------------------------


def test_manual_mode_one_item_per_commit() -> None:
    h = harness()
    h.text(PIPECAT_UPDATE)
    assert h.session.stream.partials is False  # no deltas in this mode: no partial decodes
    pcm = bursts()  # two VAD segments in one buffer
    append(h, pcm.tobytes())
    assert not h.of_type("input_audio_buffer.speech_started")
    assert not completed(h)  # nothing before the commit
    h.text({"type": "input_audio_buffer.commit"})
    committed = h.of_type("input_audio_buffer.committed")
    assert len(committed) == 1 and committed[0]["previous_item_id"] is None
    assert completed(h) == [" ".join(v1_finals(pcm, sample_rate=RATE, language="en"))]
    done = h.of_type("conversation.item.input_audio_transcription.completed")[0]
    assert done["item_id"] == committed[0]["item_id"]
    assert done["usage"]["seconds"] == pytest.approx(pcm.size / RATE, abs=0.01)


def test_an_empty_commit_is_answered_without_an_error() -> None:
    h = harness()
    h.text(PIPECAT_UPDATE)
    h.text({"type": "input_audio_buffer.commit"})
    assert h.types()[-2:] == [
        "input_audio_buffer.committed",
        "conversation.item.input_audio_transcription.completed",
    ]
    assert completed(h) == [""] and not h.of_type("error")


def test_commit_waits_for_the_finals_still_decoding() -> None:
    h = harness(immediate=False)
    h.text(PIPECAT_UPDATE)
    append(h, bursts().tobytes())
    h.text({"type": "input_audio_buffer.commit"})
    first = np.concatenate([silence(300, RATE), tone(700, rate=RATE)])
    append(h, first.tobytes())
    h.text({"type": "input_audio_buffer.commit"})
    assert len(h.of_type("input_audio_buffer.committed")) == 2 and not completed(h)
    h.answer(1)
    assert not completed(h)  # the first item has two segments
    h.answer()
    done = completed(h)
    assert len(done) == 2 and done[0].count("w0_0") == 1 and done[1].startswith("w2_")


def test_clear_drops_the_uncommitted_audio() -> None:
    h = harness()
    h.text(PIPECAT_UPDATE)
    append(h, np.concatenate([silence(300, RATE), tone(900, rate=RATE)]).tobytes())
    h.text({"type": "input_audio_buffer.clear"})
    assert h.types()[-1] == "input_audio_buffer.cleared"
    append(
        h, np.concatenate([silence(300, RATE), tone(600, rate=RATE), silence(900, RATE)]).tobytes()
    )
    h.text({"type": "input_audio_buffer.commit"})
    assert len(completed(h)) == 1
    assert completed(h)[0].startswith("w1_")  # segment 0 was cleared
    assert not h.of_type("error")


# -- audio before the update, other formats, the beta shape ----------------------------------------


def test_audio_before_the_update_is_held_so_the_update_still_applies() -> None:
    h = harness()
    pcm = bursts(rate=8000)
    append(h, ulaw_encode(pcm)[:4000], chunk_bytes=800)  # 0.5 s, before any update
    assert h.session.state is State.CONFIGURING
    h.text({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcmu"},
        "transcription": {"language": "ja"}}}}})  # fmt: skip
    assert h.session.stream.sample_rate == 8000 and h.session.stream.language == "ja"
    append(h, ulaw_encode(pcm)[4000:], chunk_bytes=800)
    assert len(completed(h)) == 2
    assert h.sent[1]["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}


def test_without_an_update_the_defaults_apply_after_a_second() -> None:
    h = harness()
    pcm = bursts()
    append(h, pcm.tobytes())
    assert h.session.stream.sample_rate == RATE
    assert len(completed(h)) == 2


def test_the_beta_shape() -> None:
    h = harness(beta=True)
    created = h.sent[0]
    assert created["type"] == "transcription_session.created"
    assert created["session"]["input_audio_format"] == "pcm16"
    h.text(BETA_UPDATE)
    updated = h.sent[-1]
    assert updated["type"] == "transcription_session.updated"
    assert updated["session"]["input_audio_transcription"]["language"] == "en"
    assert updated["session"]["turn_detection"]["type"] == "server_vad"
    append(h, bursts().tobytes())
    assert len(completed(h)) == 2
    h.text({**BETA_UPDATE, "session": {"input_audio_format": "g711_alaw"}})
    assert h.sent[-1]["type"] == "error"  # the format is fixed once audio flowed


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("{not json", "invalid_json"),
        ('["session.update"]', "invalid_event"),
        ('{"type": "response.create"}', "unknown_event"),
        ('{"type": "input_audio_buffer.append", "audio": "***"}', "invalid_value"),
        ('{"type": "input_audio_buffer.append", "audio": 7}', "invalid_value"),
        ('{"type": "session.update", "session": {"audio": {"input": {"format": '
         '{"type": "audio/opus"}}}}}', "invalid_value"),
        ('{"type": "session.update", "session": {"type": "realtime"}}', "invalid_value"),
        ('{"type": "session.update", "session": "x"}', "invalid_value"),
    ],
)  # fmt: skip
def test_bad_events_get_an_error_event_and_the_session_goes_on(text: str, code: str) -> None:
    h = harness()
    h.text(text)
    error = h.sent[-1]
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == code and error["error"]["message"]
    assert h.session.close_code is None
    h.text(GA_UPDATE)
    append(h, bursts().tobytes())
    assert len(completed(h)) == 2


def test_a_rejected_update_changes_nothing() -> None:
    h = harness()
    h.text(GA_UPDATE)
    h.text({"type": "session.update", "event_id": "evt_9", "session": {"audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 11025}}}}})  # fmt: skip
    error = h.sent[-1]["error"]
    assert error["param"] == "session.audio.input.format.rate" and error["event_id"] == "evt_9"
    assert h.session.stream.sample_rate == RATE


@pytest.mark.parametrize(
    ("audio_in", "param"),
    [
        ({"format": "audio/pcm"}, "session.audio.input.format"),
        ({"turn_detection": {"type": "bogus"}}, "turn_detection.type"),
        ({"turn_detection": {"type": "server_vad", "silence_duration_ms": "x"}},
         "turn_detection.silence_duration_ms"),
        ({"transcription": "en"}, "transcription"),
    ],
)  # fmt: skip
def test_an_update_of_the_wrong_shape_is_refused_not_ignored(audio_in, param) -> None:
    """A typo in turn_detection.type used to make the session manual: no transcripts."""
    h = harness()
    h.text(GA_UPDATE)
    h.text({"type": "session.update", "session": {"audio": {"input": audio_in}}})
    error = h.sent[-1]["error"]
    assert (error["code"], error["param"]) == ("invalid_value", param)
    assert h.adapter.config.server_vad  # nothing changed


def test_turn_detection_without_a_type_is_server_vad() -> None:
    h = harness()
    h.text({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "turn_detection": {"silence_duration_ms": 800}}}}})  # fmt: skip
    turn = h.sent[-1]["session"]["audio"]["input"]["turn_detection"]
    assert turn["type"] == "server_vad" and h.adapter.config.server_vad


def test_benign_changes_mid_stream_are_answered_without_an_error() -> None:
    """LiveKit changes the language mid-stream; any error would be fatal to it."""
    h = harness()
    h.text(GA_UPDATE)
    append(h, bursts().tobytes()[:48000])
    h.text({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "transcription": {"language": "zh"}, "turn_detection": None}}}})  # fmt: skip
    updated = h.sent[-1]
    assert updated["type"] == "session.updated"
    audio_in = updated["session"]["audio"]["input"]
    assert audio_in["transcription"]["language"] == "en"  # kept: the core fixed it
    assert audio_in["turn_detection"] is None  # the turn mode is the adapter's own
    assert not h.of_type("error")


def test_binary_frames_are_refused_once() -> None:
    h = harness()
    h.adapter.receive_bytes(b"\x00" * 100)
    h.adapter.receive_bytes(b"\x00" * 100)
    h.pump()
    assert [m["error"]["code"] for m in h.of_type("error")] == ["unsupported_frame"]


def test_a_failed_decode_is_a_failed_event_not_an_error() -> None:
    h = harness()
    h.text(GA_UPDATE)
    h.fail_next_final = True
    append(h, bursts().tobytes())
    failed = h.of_type("conversation.item.input_audio_transcription.failed")
    assert len(failed) == 1 and failed[0]["error"]["message"]
    assert len(completed(h)) == 1 and not h.of_type("error")


def test_a_server_limit_sends_the_transcripts_first() -> None:
    h = harness()
    h.text(GA_UPDATE)
    append(h, np.concatenate([silence(300, RATE), tone(1000, rate=RATE)]).tobytes())
    h.session.expire("max_session_duration", "the session reached the server's maximum")
    h.pump()
    assert h.types()[-2:] == ["conversation.item.input_audio_transcription.completed", "error"]
    assert h.sent[-1]["error"]["code"] == "session_expired"
    assert h.session.close_code == 1008


WRONG_TYPES = [
    # (the update's session object, the param named): a field of the wrong JSON type
    ({"input_audio_format": {"x": 1}}, "session.input_audio_format"),  # was a TypeError
    ({"input_audio_format": ["pcm16"]}, "session.input_audio_format"),
    ({"input_audio_format": 16}, "session.input_audio_format"),
    ({"audio": {"input": {"format": {"type": {"a": 1}}}}}, "session.audio.input.format.type"),
    ({"audio": {"input": {"format": {"type": ["audio/pcm"]}}}}, "session.audio.input.format.type"),
    ({"audio": 5}, "session.audio"),
    ({"audio": {"input": []}}, "session.audio.input"),
    ({"audio": {"input": {"noise_reduction": "near"}}}, "session.audio.input.noise_reduction"),
    ({"input_audio_noise_reduction": 1}, "session.input_audio_noise_reduction"),
    ({"type": ["transcription"]}, "session.type"),
    ({"turn_detection": {"type": ["server_vad"]}}, "turn_detection.type"),
    ({"turn_detection": {"type": "server_vad", "threshold": "high"}}, "turn_detection.threshold"),
    ({"turn_detection": {"prefix_padding_ms": [300]}}, "turn_detection.prefix_padding_ms"),
    ({"turn_detection": {"create_response": "yes"}}, "turn_detection.create_response"),
    ({"input_audio_transcription": {"language": ["en"]}}, "transcription.language"),
    ({"input_audio_transcription": {"model": 5}}, "transcription.model"),
    ({"input_audio_transcription": {"prompt": {"p": 1}}}, "transcription.prompt"),
    ({"include": "item.input_audio_transcription.logprobs"}, "session.include"),
]


@pytest.mark.parametrize(("session", "param"), WRONG_TYPES)
def test_a_field_of_the_wrong_json_type_is_invalid_value_and_the_session_goes_on(
    session, param
) -> None:
    h = harness()
    h.text({"type": "session.update", "session": session})
    error = h.sent[-1]
    assert error["type"] == "error"
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", param)
    assert h.session.close_code is None
    h.text(GA_UPDATE)  # the session goes on
    append(h, bursts().tobytes())
    assert len(completed(h)) == 2


def test_languages_force_the_first_and_keywords_are_hotwords() -> None:
    """openai 3.60 and LiveKit send ``languages`` and ``keywords`` for newer models."""
    h = harness()
    transcription = {"model": "gpt-transcribe", "languages": ["ja", "en"], "keywords": ["Claude"]}
    h.text(
        {
            "type": "session.update",
            "session": {"audio": {"input": {"transcription": transcription}}},
        }
    )
    assert h.session.stream.language == "ja"
    assert [w.phrase for w in h.session.stream.hotwords] == ["Claude"]
    echoed = h.sent[-1]["session"]["audio"]["input"]["transcription"]
    assert echoed["languages"] == ["ja", "en"] and echoed["keywords"] == ["Claude"]
    # `language` when both are given; an unusable prompt is never an error
    h = harness()
    transcription = {"language": "en", "languages": ["ja"], "prompt": "🚀🚀 ... !!"}
    h.text(
        {
            "type": "session.update",
            "session": {"audio": {"input": {"transcription": transcription}}},
        }
    )
    assert h.session.stream.language == "en" and h.session.stream.hotwords == ()
    assert not h.of_type("error")
