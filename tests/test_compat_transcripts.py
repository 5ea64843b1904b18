"""The file transcription endpoints' bodies (core/compat/transcripts.py), from hand-built
finals, parsed by the real SDKs' own types: openai's Transcription, TranscriptionVerbose
and stream events, deepgram-sdk's prerecorded response."""

from __future__ import annotations

import math
import re
import zlib

import httpx
import openai
import orjson
import pytest
from deepgram.core.unchecked_base_model import construct_type
from deepgram.listen.v1.media.types.media_transcribe_response import MediaTranscribeResponse
from deepgram.types.error_response_legacy_error import ErrorResponseLegacyError
from deepgram.types.listen_v1response import ListenV1Response
from openai._streaming import SSEDecoder
from openai.types.audio import (
    Transcription,
    TranscriptionTextDeltaEvent,
    TranscriptionTextDoneEvent,
    TranscriptionVerbose,
)
from openai.types.audio.transcription_stream_event import TranscriptionStreamEvent
from pydantic import TypeAdapter

from streamer.core.compat.transcripts import (
    RESPONSE_FORMATS,
    UNKNOWN_LANGUAGE,
    TranscriptStream,
    listen_error_body,
    listen_response,
    openai_error_body,
    parse_listen_file_query,
    sse_frame,
    transcription_body,
    transcription_json,
    transcription_text,
    transcription_verbose_json,
    whisper_language,
)
from streamer.core.protocol import MAX_ERROR_MESSAGE_CHARS, Final, StreamOptions, Word


def final(segment_id: int, start_ms: float, end_ms: float, text: str, **kw: object) -> Final:
    fields: dict = dict(
        language="en", emotion="NEUTRAL", event="Speech", raw=text, rich=text,
        reason="silence", decode_ms=10.0, queue_ms=1.0, words=None,
    )  # fmt: skip
    fields.update(kw)
    return Final(segment_id=segment_id, start_ms=start_ms, end_ms=end_ms, text=text, **fields)


def timed(*spans: tuple[str, float, float, float]) -> tuple[Word, ...]:
    return tuple(Word(w, s, e, c) for w, s, e, c in spans)


FINALS = [
    final(
        0,
        320.0,
        2480.0,
        "Hello there, friends.",
        emotion="HAPPY",
        words=timed(
            ("Hello", 400, 800, 0.9), ("there,", 800, 1300, 0.8), ("friends.", 1300, 2400, 0.95)
        ),
    ),  # fmt: skip
    final(1, 2600.0, 2900.0, "", words=()),  # noise: nothing recognised
    final(
        2,
        3100.0,
        5200.0,
        "今天天气很好。",
        language="zh",
        event="Laughter",
        words=timed(
            ("今", 3200, 3400, 0.7),
            ("天", 3400, 3600, 0.7),
            ("天", 3600, 3800, 0.7),
            ("气", 3800, 4000, 0.7),
            ("很", 4000, 4300, 0.7),
            ("好。", 4300, 5000, 0.7),
        ),
    ),  # fmt: skip
    final(3, 5400.0, 6100.0, "Bye."),  # no word timings: spread over the segment
]
DURATION_S = 6.0
TEXT = "Hello there, friends.今天天气很好。Bye."


# -- OpenAI ----------------------------------------------------------------------------


def test_json_is_a_transcription():
    body = transcription_json(FINALS, duration_s=DURATION_S)
    parsed = Transcription.model_validate(body)
    assert parsed.text == TEXT == transcription_text(FINALS)
    assert parsed.usage is not None and parsed.usage.type == "duration"
    assert parsed.usage.seconds == DURATION_S
    # languages by how much of the text is in each
    assert [language.code for language in parsed.languages or []] == ["en", "zh"]


def test_text_is_the_plain_text():
    body, content_type = transcription_body(FINALS, response_format="text", duration_s=DURATION_S)
    assert body.decode() == TEXT + "\n"
    assert content_type.startswith("text/plain")


def test_verbose_json_is_a_verbose_transcription_with_sensevoice_fields():
    body = transcription_verbose_json(
        FINALS, duration_s=DURATION_S, granularities=["segment", "word"], language="auto"
    )
    parsed = TranscriptionVerbose.model_validate(body)
    assert (parsed.language, parsed.duration, parsed.text) == ("english", DURATION_S, TEXT)
    assert body["task"] == "transcribe"
    segments = parsed.segments or []
    assert [s.id for s in segments] == [0, 1, 2]  # the empty final is no segment
    assert [(s.start, s.end, s.text) for s in segments] == [
        (0.32, 2.48, "Hello there, friends."),
        (3.1, 5.2, "今天天气很好。"),
        (5.4, 6.0, "Bye."),  # inside the audio: the final's end is cut to the duration
    ]
    first = body["segments"][0]
    assert (first["emotion"], first["event"], first["sensevoice_language"]) == (
        "HAPPY",
        "Speech",
        "en",
    )
    assert body["segments"][1]["sensevoice_language"] == "zh"
    assert body["segments"][1]["event"] == "Laughter"
    assert segments[0].seek == 32 and segments[0].tokens == [] and segments[0].temperature == 0
    assert segments[0].avg_logprob == pytest.approx(
        (math.log(0.9) + math.log(0.8) + math.log(0.95)) / 3, abs=1e-6
    )
    assert segments[2].avg_logprob == 0.0  # spread words: no confidence known
    text = b"Hello there, friends."
    assert segments[0].compression_ratio == pytest.approx(len(text) / len(zlib.compress(text)))
    words = parsed.words or []
    assert [w.word for w in words] == ["Hello", "there,", "friends.", *"今天天气很", "好。", "Bye."]
    assert (words[0].start, words[0].end) == (0.4, 0.8)
    starts = [w.start for w in words]
    assert starts == sorted(starts)
    assert all(0.0 <= w.start <= w.end <= DURATION_S for w in words)


@pytest.mark.parametrize(
    ("granularities", "segments", "words"),
    [((), True, False), (["segment"], True, False), (["word"], False, True)],
)
def test_granularities_choose_segments_and_words(granularities, segments, words):
    body = transcription_verbose_json(FINALS, duration_s=DURATION_S, granularities=granularities)
    assert ("segments" in body, "words" in body) == (segments, words)
    TranscriptionVerbose.model_validate(body)


def test_the_language_is_named_as_whisper_names_it():
    zh = [final(0, 0, 1000, "今天天气很好", language="zh"), final(1, 1000, 1200, "ok")]
    assert whisper_language(zh) == "chinese"
    assert whisper_language([final(0, 0, 1, "呢度好靚", language="yue")]) == "cantonese"
    silent = [final(0, 0, 500, "", language="nospeech")]
    assert whisper_language(silent, "ja") == "japanese"
    assert whisper_language(silent) == UNKNOWN_LANGUAGE
    assert whisper_language(zh, "en") == "english"  # a forced language is the one reported
    body = transcription_verbose_json([], duration_s=1.5, language="ko")
    assert TranscriptionVerbose.model_validate(body).language == "korean"
    assert body["text"] == "" and body["segments"] == []


SRT_TIME = r"\d{2}:\d{2}:\d{2},\d{3}"
VTT_TIME = r"\d{2}:\d{2}:\d{2}\.\d{3}"


def cue_times(line: str, pattern: str, separator: str) -> tuple[float, float]:
    assert re.fullmatch(f"{pattern} --> {pattern}", line), line

    def seconds(stamp: str) -> float:
        h, m, s = stamp.replace(separator, ".").split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)

    start, end = line.split(" --> ")
    return seconds(start), seconds(end)


def test_srt_is_numbered_timed_and_in_order():
    body, _ = transcription_body(FINALS, response_format="srt", duration_s=DURATION_S)
    blocks = body.decode().split("\n\n")
    assert blocks[-1] == ""  # every block ends with a blank line
    cues = [block.split("\n") for block in blocks[:-1]]
    assert [int(cue[0]) for cue in cues] == list(range(1, len(cues) + 1))
    times = [cue_times(cue[1], SRT_TIME, ",") for cue in cues]
    assert all(start <= end for start, end in times)
    assert [start for start, _ in times] == sorted(start for start, _ in times)
    assert all(len(cue) >= 3 and all(line.strip() for line in cue[2:]) for cue in cues)
    assert (
        " ".join(" ".join(cue[2:]) for cue in cues) == "Hello there, friends. 今天天气很好。 Bye."
    )
    assert cues[0][1] == "00:00:00,320 --> 00:00:02,480"
    assert cues[-1][1] == "00:00:05,400 --> 00:00:06,000"  # inside the audio


def test_vtt_has_its_header_and_dotted_times():
    body, content_type = transcription_body(FINALS, response_format="vtt", duration_s=DURATION_S)
    assert content_type.startswith("text/vtt")
    text = body.decode()
    assert text.startswith("WEBVTT\n\n")
    blocks = text[len("WEBVTT\n\n") :].split("\n\n")
    assert blocks[-1] == ""
    cues = [block.split("\n") for block in blocks[:-1]]
    assert len(cues) == 3
    assert [cue_times(cue[0], VTT_TIME, ".") for cue in cues][0] == (0.32, 2.48)
    assert transcription_body([], response_format="vtt", duration_s=0.0)[0] == b"WEBVTT\n\n"


def test_every_format_has_a_body():
    for response_format in RESPONSE_FORMATS:
        body, content_type = transcription_body(
            FINALS, response_format=response_format, duration_s=DURATION_S
        )
        assert body and content_type
        if response_format.endswith("json"):
            assert content_type == "application/json"
            orjson.loads(body)
    with pytest.raises(ValueError):
        transcription_body(FINALS, response_format="diarized_srt", duration_s=1.0)


def test_stream_deltas_add_up_to_the_done_text():
    stream = TranscriptStream()
    finals = [*FINALS, final(4, 6100, 6200, "And again")]
    events = [event for f in finals if (event := stream.delta(f)) is not None]
    events.append(stream.done())
    frames = b"".join(sse_frame(event) for event in events)
    # as the openai SDK reads a text/event-stream, then its own event types
    decoded = [sse.json() for sse in SSEDecoder().iter_bytes(iter([frames]))]
    assert decoded == events
    adapter = TypeAdapter(TranscriptionStreamEvent)
    parsed = [adapter.validate_python(event) for event in decoded]
    deltas = parsed[:-1]
    assert all(isinstance(event, TranscriptionTextDeltaEvent) for event in deltas)
    done = parsed[-1]
    assert isinstance(done, TranscriptionTextDoneEvent)
    assert [d.delta for d in deltas] == [  # type: ignore[union-attr]
        "Hello there, friends.",
        "今天天气很好。",
        "Bye.",
        " And again",
    ]
    assert "".join(d.delta for d in deltas) == done.text == TEXT + " And again"  # type: ignore[union-attr]


def test_openai_error_body_is_what_the_sdk_raises_from():
    body = openai_error_body("the file is not audio", code="undecodable_audio", param="file")
    assert body == {
        "error": {
            "message": "the file is not audio",
            "type": "invalid_request_error",
            "param": "file",
            "code": "undecodable_audio",
        }
    }
    client = openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9/v1")
    request = httpx.Request("POST", "http://127.0.0.1:9/v1/audio/transcriptions")
    response = httpx.Response(400, json=body, request=request)
    error = client._make_status_error_from_response(response)
    assert isinstance(error, openai.BadRequestError)
    assert error.code == "undecodable_audio" and error.param == "file"
    assert "the file is not audio" in error.message
    long = openai_error_body("x" * 5000)["error"]["message"]
    assert len(long) == MAX_ERROR_MESSAGE_CHARS and long.endswith("...")


# -- Deepgram --------------------------------------------------------------------------

CREATED = "2026-12-02T01:02:03.456Z"


def listen(query: dict[str, str], finals: list[Final] = FINALS) -> dict:
    options = parse_listen_file_query(query, StreamOptions())
    return listen_response(
        finals,
        duration_s=DURATION_S,
        options=options,
        request_id="req-1",
        created=CREATED,
        sha256="ab" * 32,
        model="iic/SenseVoiceSmall",
        channels=2,
    )


def sdk_parse(body: dict) -> ListenV1Response:
    """As deepgram-sdk's transcribe_file reads a 200 answer, and validated strictly."""
    parsed = construct_type(type_=MediaTranscribeResponse, object_=orjson.loads(orjson.dumps(body)))
    assert isinstance(parsed, ListenV1Response)
    ListenV1Response.model_validate(body)
    return parsed


def test_listen_response_is_what_the_sdk_parses():
    body = listen({"punctuate": "true"})
    parsed = sdk_parse(body)
    metadata = parsed.metadata
    assert (metadata.request_id, metadata.duration, metadata.channels) == ("req-1", 6.0, 2)
    assert metadata.sha256 == "ab" * 32 and metadata.created.year == 2026
    assert metadata.model_info[metadata.models[0]]["arch"] == "sensevoice"
    alternative = parsed.results.channels[0].alternatives[0]  # type: ignore[index]
    assert alternative.transcript == TEXT
    words = body["results"]["channels"][0]["alternatives"][0]["words"]
    assert [w["word"] for w in words][:3] == ["hello", "there", "friends"]
    assert [w["punctuated_word"] for w in words][:3] == ["Hello", "there,", "friends."]
    assert words[-1]["end"] == DURATION_S  # inside the audio
    starts = [w["start"] for w in words]
    assert starts == sorted(starts)
    expected = sum(w["confidence"] for w in words) / len(words)
    assert alternative.confidence == pytest.approx(expected, abs=1e-4)
    assert parsed.results.utterances is None  # not asked for


def test_words_are_bare_without_punctuate():
    words = listen({})["results"]["channels"][0]["alternatives"][0]["words"]
    assert all("punctuated_word" not in w for w in words)


def test_utterances_are_the_spoken_finals():
    body = listen({"utterances": "true", "smart_format": "true"})
    utterances = sdk_parse(body).results.utterances or []
    assert [u.transcript for u in utterances] == ["Hello there, friends.", "今天天气很好。", "Bye."]
    assert [(u.start, u.end) for u in utterances] == [(0.32, 2.48), (3.1, 5.2), (5.4, 6.0)]
    assert all(u.channel == 0 for u in utterances)
    first = utterances[0]
    assert first.confidence == pytest.approx((0.9 + 0.8 + 0.95) / 3, abs=1e-4)
    assert [w.punctuated_word for w in first.words or []] == ["Hello", "there,", "friends."]
    ids = [u.id for u in utterances]
    assert len(set(ids)) == 3
    assert ids == [u.id for u in sdk_parse(listen({"utterances": "true"})).results.utterances or []]


def test_detected_languages_when_asked():
    plain = listen({})["results"]["channels"][0]
    assert "detected_language" not in plain and "languages" not in plain["alternatives"][0]
    detected = listen({"detect_language": "true"})
    assert sdk_parse(detected).results.channels[0].detected_language == "en"
    multi = listen({"language": "multi", "utterances": "true"})
    alternative = multi["results"]["channels"][0]["alternatives"][0]
    assert alternative["languages"] == ["en", "zh"]
    assert {w["language"] for w in alternative["words"]} == {"en", "zh"}
    assert multi["results"]["utterances"][1]["languages"] == ["zh"]


def test_the_file_query_is_the_live_query_plus_utterances():
    options = parse_listen_file_query(
        {"language": "zh-CN", "punctuate": "false", "utterances": "1", "model": "nova-3"},
        StreamOptions(language="en"),
    )
    assert options.listen.stream.language == "zh" and options.listen.stream.itn is False
    assert options.utterances and not options.detect_language
    detect = parse_listen_file_query({"detect_language": "true"}, StreamOptions(language="en"))
    assert detect.detect_language and detect.listen.stream.language == "auto"


def test_nothing_spoken_is_an_empty_transcript():
    body = listen({"utterances": "true"}, finals=[final(0, 0, 900, "", words=())])
    alternative = sdk_parse(body).results.channels[0].alternatives[0]  # type: ignore[index]
    assert (alternative.transcript, alternative.confidence, alternative.words) == ("", 0.0, [])
    assert body["results"]["utterances"] == []


def test_listen_error_body_is_deepgrams():
    body = listen_error_body("undecodable_audio", "the file is not audio", "req-2")
    assert body == {
        "err_code": "UNDECODABLE_AUDIO",
        "err_msg": "the file is not audio",
        "request_id": "req-2",
    }
    assert ErrorResponseLegacyError.model_validate(body).err_msg == "the file is not audio"
