"""The session state machine, driven with plain arrays and no sockets."""

import numpy as np
import pytest

from streamer.core import protocol
from streamer.core.jobs import DecodeFailure, DecodeResult
from streamer.core.protocol import (
    End,
    Error,
    Final,
    Partial,
    Ready,
    SpeechStart,
    StreamOptions,
)
from streamer.core.session import Session, SessionOptions, State
from streamer.core.transcript import Transcript
from tests.fakes import loudness_classifier, silence, tone


def make_session(**stream):
    return Session(
        "s1", SessionOptions(model_name="fake"), StreamOptions(**stream), loudness_classifier()
    )


def answer(session, text_for=lambda job: f"{job.kind} {job.segment_id} {job.end_sample}"):
    """Answer every queued job at once, like an infinitely fast worker."""
    while jobs := session.jobs_to_submit():
        for job in jobs:
            raw = f"<|en|><|HAPPY|><|Laughter|><|woitn|>{text_for(job)}"
            t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
            session.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))


def feed(session, pcm, chunk_bytes=3200, respond=True):
    data = pcm.tobytes()
    for i in range(0, len(data), chunk_bytes):
        session.receive_audio(data[i : i + chunk_bytes])
        if respond:
            answer(session)


def speech_with_gaps():
    return np.concatenate([silence(500), tone(1500), silence(1000), tone(800), silence(1000)])


def types(messages):
    return [m.type for m in messages]


def check_order(messages):
    """ready (speech_start partial* final)* [end], segment ids 0, 1, 2 ..."""
    assert isinstance(messages[0], Ready)
    expected_id, open_id = 0, None
    for m in messages[1:]:
        if isinstance(m, SpeechStart):
            assert open_id is None and m.segment_id == expected_id
            open_id = m.segment_id
        elif isinstance(m, Partial):
            assert m.segment_id == open_id
        elif isinstance(m, Final):
            assert m.segment_id == open_id
            open_id, expected_id = None, expected_id + 1
        elif isinstance(m, End):
            assert open_id is None
    return expected_id


def test_segments_partials_finals_and_end():
    s = make_session()
    s.start()
    feed(s, speech_with_gaps())
    s.receive_text('{"type":"stop"}')
    answer(s)
    messages = s.messages_to_send()
    assert check_order(messages) == 2
    finals = [m for m in messages if isinstance(m, Final)]
    assert [f.reason for f in finals] == ["silence", "silence"]
    # first tone at 500-2000 ms: pre-roll 300 ms, end pad 200 ms
    assert finals[0].start_ms == pytest.approx(200, abs=20)
    assert finals[0].end_ms == pytest.approx(2200, abs=40)
    assert finals[1].start_ms >= finals[0].end_ms
    assert (finals[0].language, finals[0].emotion, finals[0].event) == ("en", "HAPPY", "Laughter")
    partials = [m for m in messages if isinstance(m, Partial)]
    assert partials and partials[0].revision == 1
    revisions = [p.revision for p in partials if p.segment_id == 0]
    assert revisions == list(range(1, len(revisions) + 1))
    end = messages[-1]
    assert isinstance(end, End) and end.segments == 2
    assert end.audio_ms == pytest.approx(4800, abs=1)
    assert end.partials_sent == len(partials)
    assert s.state is State.ENDED and s.close_code == 1000


def test_odd_chunks_give_the_same_result_as_even_ones():
    pcm = speech_with_gaps()
    results = []
    for chunk in (3200, 1001, 7):
        s = make_session(partials=False)
        s.start()
        feed(s, pcm, chunk_bytes=chunk)
        s.receive_text('{"type":"stop"}')
        answer(s)
        results.append(
            [(m.start_ms, m.end_ms) for m in s.messages_to_send() if isinstance(m, Final)]
        )
    assert results[0] == results[1] == results[2]


def test_resampled_input_keeps_client_timeline():
    pcm16 = speech_with_gaps()
    # the same signal at 48 kHz: times must come out the same (within a frame)
    pcm48 = np.repeat(pcm16, 3)
    s = make_session(sample_rate=48000, partials=False)
    s.start()
    feed(s, pcm48, chunk_bytes=9600)
    s.receive_text('{"type":"stop"}')
    answer(s)
    finals = [m for m in s.messages_to_send() if isinstance(m, Final)]
    assert len(finals) == 2
    assert finals[0].start_ms == pytest.approx(200, abs=40)
    assert s.audio_ms == pytest.approx(4800, abs=1)


def test_stop_finishes_open_segment():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(2000)]))
    s.receive_text('{"type":"stop"}')
    answer(s)
    messages = s.messages_to_send()
    finals = [m for m in messages if isinstance(m, Final)]
    assert [f.reason for f in finals] == ["stop"]
    assert finals[0].end_ms == pytest.approx(2300, abs=1)
    assert isinstance(messages[-1], End)


def test_finalize_ends_utterance_and_stream_goes_on():
    s = make_session(partials=False)
    s.start()
    feed(s, tone(1000))
    s.receive_text('{"type":"finalize"}')
    answer(s)
    feed(s, np.concatenate([silence(1000), tone(1000), silence(1000)]))
    s.receive_text('{"type":"stop"}')
    answer(s)
    finals = [m for m in s.messages_to_send() if isinstance(m, Final)]
    assert [f.reason for f in finals] == ["finalize", "silence"]
    assert [f.segment_id for f in finals] == [0, 1]


def test_finals_are_delivered_in_order_even_if_decoded_out_of_order():
    s = make_session(partials=False)
    s.start()
    feed(s, speech_with_gaps(), respond=False)
    s.receive_text('{"type":"stop"}')
    jobs = s.jobs_to_submit()
    assert [j.segment_id for j in jobs] == [0, 1]
    for job in reversed(jobs):
        t = Transcript.from_raw("<|en|>x", rich="x", token_ids=(), audio_ms=0, decode_ms=0)
        s.decode_finished(DecodeResult(job=job, transcript=t))
    assert check_order(s.messages_to_send()) == 2


def test_partials_skipped_while_one_is_in_flight():
    s = make_session()
    s.start()
    feed(s, np.concatenate([silence(300), tone(3000)]), respond=False)
    jobs = s.jobs_to_submit()
    assert [j.kind for j in jobs] == ["partial"]  # never more than one in flight
    assert s.stats.partials_skipped >= 5
    # the worker drops it (a final was queued): counted as skipped, not lost silently
    before = s.stats.partials_skipped
    s.decode_finished(DecodeResult(job=jobs[0], dropped=True))
    assert s.stats.partials_skipped == before + 1
    # catch-up: a new partial covering all audio so far is submitted at once
    (catch_up,) = s.jobs_to_submit()
    assert catch_up.kind == "partial" and catch_up.end_sample > jobs[0].end_sample
    s.receive_text('{"type":"stop"}')
    answer(s)
    end = s.messages_to_send()[-1]
    assert isinstance(end, End) and end.partials_skipped == s.stats.partials_skipped


def test_partial_of_closed_segment_is_discarded():
    s = make_session()
    s.start()
    feed(s, np.concatenate([silence(300), tone(1000)]), respond=False)
    (partial,) = s.jobs_to_submit()
    s.receive_text('{"type":"finalize"}')
    feed(s, silence(300), respond=False)  # the pause that lets finalize end the segment
    answer(s)
    t = Transcript.from_raw("<|en|>late", rich="", token_ids=(), audio_ms=0, decode_ms=0)
    s.decode_finished(DecodeResult(job=partial, transcript=t))
    assert not [m for m in s.messages_to_send() if isinstance(m, Partial)]


def test_stable_text_is_previous_agreeing_prefix():
    s = make_session()
    s.start()
    texts = iter(["the quick", "the quick brown", "the quick brown fox"])
    feed(s, np.concatenate([silence(300), tone(1500)]), respond=False)
    for _ in range(3):
        for job in s.jobs_to_submit():
            if job.kind == "partial":
                raw = "<|en|>" + next(texts)
                t = Transcript.from_raw(raw, rich="", token_ids=(), audio_ms=0, decode_ms=0)
                s.decode_finished(DecodeResult(job=job, transcript=t))
        feed(s, tone(400), respond=False)
    partials = [m for m in s.messages_to_send() if isinstance(m, Partial)]
    assert [(p.text, p.stable_text) for p in partials] == [
        ("the quick", ""),
        ("the quick brown", "the quick"),
        ("the quick brown fox", "the quick brown"),
    ]


def test_decode_failure_gives_final_with_error_and_session_goes_on():
    s = make_session(partials=False)
    s.start()
    feed(s, speech_with_gaps(), respond=False)
    jobs = s.jobs_to_submit()
    s.decode_finished(
        DecodeResult(job=jobs[0], failure=DecodeFailure.DECODE_FAILED, detail="RuntimeError: boom")
    )
    answer(s)
    t = Transcript.from_raw("<|en|>ok", rich="", token_ids=(), audio_ms=0, decode_ms=0)
    s.decode_finished(DecodeResult(job=jobs[1], transcript=t))
    messages = s.messages_to_send()
    errors = [m for m in messages if isinstance(m, Error)]
    finals = [m for m in messages if isinstance(m, Final)]
    assert errors[0].code == "decode_failed" and not errors[0].fatal
    assert finals[0].error["code"] == "decode_failed" and finals[0].text == ""
    assert finals[1].error is None and finals[1].text == "ok"
    assert s.close_code is None


def test_config_before_audio_changes_options():
    s = make_session()
    s.start()
    s.receive_text('{"type":"config","language":"zh","itn":false,"sample_rate":8000}')
    first, second = s.messages_to_send()
    assert isinstance(second, Ready)
    assert second.options["language"] == "zh" and second.sample_rate == 8000
    feed(s, np.concatenate([silence(300, 8000), tone(1000, rate=8000)]), respond=False)
    job = s.jobs_to_submit()[0]
    assert job.language == "zh" and job.itn is False


def test_config_after_audio_is_a_non_fatal_error():
    s = make_session()
    s.start()
    s.receive_audio(silence(100).tobytes())
    s.receive_text('{"type":"config","language":"zh"}')
    (_, error) = s.messages_to_send()
    assert error.code == "unexpected_message" and not error.fatal
    assert s.stream.language == "auto"


@pytest.mark.parametrize(
    ("text", "code", "close_code"),
    [
        ('{"type":"config","language":"xx"}', "invalid_option", 1008),
        ('{"type":"config","bogus":1}', "invalid_option", 1008),
        ('{"type":"config","sample_rate":11025}', "unsupported_sample_rate", 1003),
        ('{"type":"config","endpoint_ms":"soon"}', "invalid_option", 1008),
    ],
)
def test_fatal_option_errors(text, code, close_code):
    s = make_session()
    s.start()
    s.receive_text(text)
    error = s.messages_to_send()[-1]
    assert isinstance(error, Error) and error.fatal and error.code == code
    assert s.close_code == close_code


@pytest.mark.parametrize(
    "text", ["not json", "[1,2]", '{"type":"hello"}', '{"no":"type"}', "x" * 70000]
)
def test_malformed_messages_are_non_fatal(text):
    s = make_session()
    s.start()
    s.receive_text(text)
    error = s.messages_to_send()[-1]
    assert isinstance(error, Error) and error.code == "bad_message" and not error.fatal
    assert s.close_code is None
    s.receive_text('{"type":"keepalive"}')
    assert s.messages_to_send() == []


def test_audio_after_stop_is_an_error_and_empty_frames_are_ignored():
    s = make_session()
    s.start()
    s.receive_audio(b"")
    s.receive_text('{"type":"stop"}')
    s.receive_audio(b"\x00\x00")
    messages = s.messages_to_send()
    assert types(messages) == ["ready", "end", "error"]
    assert messages[-1].code == "unexpected_message"


def test_expire_delivers_open_speech_then_closes_1008():
    s = make_session(partials=False)
    s.start()
    feed(s, tone(1000))
    s.expire("idle_timeout", "no audio")
    answer(s)
    messages = s.messages_to_send()
    assert types(messages) == ["ready", "speech_start", "error", "final", "end"]
    assert messages[2].fatal and messages[2].code == "idle_timeout"
    assert s.close_code == 1008


def test_shutdown_finishes_segments_and_closes_1001():
    s = make_session(partials=False)
    s.start()
    feed(s, tone(1000))
    s.shutdown()
    answer(s)
    messages = s.messages_to_send()
    assert types(messages)[-2:] == ["final", "end"]
    assert [m for m in messages if isinstance(m, Final)][0].reason == "stop"
    assert s.close_code == 1001


def test_memory_is_bounded_for_long_streams():
    s = make_session()
    s.start()
    for _ in range(60):  # a minute of silence then a minute of speech
        s.receive_audio(silence(1000).tobytes())
    assert s.retained_samples < 16000
    for _ in range(60):
        s.receive_audio(tone(1000).tobytes())
        answer(s)
        assert s.retained_samples <= 7 * 16000 + 16000
    s.receive_text('{"type":"stop"}')
    answer(s)
    finals = [m for m in s.messages_to_send() if isinstance(m, Final)]
    assert all(f.end_ms - f.start_ms <= 7000 for f in finals)
    assert [f.reason for f in finals][:-1] == ["max_duration"] * (len(finals) - 1)
    for a, b in zip(finals, finals[1:], strict=False):
        assert b.start_ms == a.end_ms  # cuts tile the audio


def test_first_partial_of_a_segment_is_marked_until_text_is_shown():
    s = make_session()
    s.start()
    feed(s, np.concatenate([silence(300), tone(600)]), respond=False)
    (first,) = s.jobs_to_submit()
    assert first.first
    t = Transcript.from_raw("<|en|>hello", rich="", token_ids=(), audio_ms=0, decode_ms=0)
    s.decode_finished(DecodeResult(job=first, transcript=t))
    feed(s, tone(400), respond=False)
    (refresh,) = s.jobs_to_submit()
    assert not refresh.first


# --- speculative finals -----------------------------------------------------------------


def _decoded(job, text):
    raw = f"<|en|><|NEUTRAL|><|Speech|><|woitn|>{text}"
    t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
    return DecodeResult(job=job, transcript=t, decode_ms=7.0, queue_ms=2.0)


def test_pause_decode_becomes_the_final_without_a_second_decode():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(1500), silence(300)]), respond=False)
    (spec,) = s.jobs_to_submit()
    assert spec.kind == "partial" and spec.speculative
    s.decode_finished(_decoded(spec, "hello"))
    feed(s, silence(600), respond=False)
    assert s.jobs_to_submit() == []  # the endpoint needed no decode of its own
    (final,) = [m for m in s.messages_to_send() if isinstance(m, Final)]
    assert final.text == "hello" and final.reason == "silence"
    assert (final.start_ms, final.end_ms) == (spec.start_sample / 16, spec.end_sample / 16)
    assert (final.decode_ms, final.queue_ms) == (7.0, 2.0)
    assert not [m for m in s.messages_to_send() if isinstance(m, Partial)]  # partials off


def test_final_waits_for_a_speculative_decode_still_running():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(1500), silence(1000)]), respond=False)
    (spec,) = s.jobs_to_submit()  # the segment ended while its decode is still running
    assert s.pending_finals == 1
    assert not [m for m in s.messages_to_send() if isinstance(m, Final)]
    s.decode_finished(_decoded(spec, "late"))
    (final,) = [m for m in s.messages_to_send() if isinstance(m, Final)]
    assert final.text == "late" and s.pending_finals == 0


def test_speech_after_the_pause_discards_the_speculation():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(1000), silence(300)]), respond=False)
    (spec,) = s.jobs_to_submit()
    s.decode_finished(_decoded(spec, "too early"))
    feed(s, np.concatenate([tone(800), silence(1000)]), respond=False)
    jobs = s.jobs_to_submit()
    specs = [j for j in jobs if j.speculative]
    assert len(specs) == 1 and specs[0].end_sample > spec.end_sample  # the new pause's
    s.decode_finished(_decoded(specs[0], "whole utterance"))
    finals = [m for m in s.messages_to_send() if isinstance(m, Final)]
    assert [f.text for f in finals] == ["whole utterance"]


def test_a_superseded_partials_answer_does_not_free_the_next_tick():
    """One partial in flight per session: the answer of one superseded in the queue
    (dropped) is not the answer of the one in flight, so the next tick does not
    supersede that in turn (a first partial was replaced every 300 ms, issue 31)."""
    s = make_session()
    s.start()
    feed(s, np.concatenate([silence(300), tone(1500)]), respond=False)
    (first,) = s.jobs_to_submit()
    s.decode_finished(_decoded(first, "hel"))
    refresh = next(j for j in s.jobs_to_submit() if not j.speculative)
    feed(s, silence(300), respond=False)
    (spec,) = s.jobs_to_submit()  # the pause's decode supersedes the queued refresh
    assert spec.speculative
    s.decode_finished(DecodeResult(job=refresh, dropped=True))
    feed(s, tone(700), respond=False)  # speech again, ticks pass: the spec is in flight
    assert s.jobs_to_submit() == []
    s.decode_finished(_decoded(spec, "hello"))
    (catch_up,) = s.jobs_to_submit()  # its answer frees the session's next partial
    assert not catch_up.speculative and catch_up.end_sample > spec.end_sample


def test_the_next_segments_first_partial_does_not_wait_for_the_last_ones_final():
    """A segment that ended while its speculative decode (its final) is in flight: the
    next segment's first partial is submitted at its onset all the same (issue 31)."""
    s = make_session()
    s.start()
    feed(s, np.concatenate([silence(300), tone(1500)]), respond=False)
    (first,) = s.jobs_to_submit()
    s.decode_finished(_decoded(first, "one"))
    s.jobs_to_submit()  # a refresh
    feed(s, silence(300), respond=False)
    (spec,) = s.jobs_to_submit()
    assert spec.speculative
    feed(s, np.concatenate([silence(700), tone(600)]), respond=False)
    jobs = s.jobs_to_submit()  # the pause ended the segment; the next one began
    assert [(j.segment_id, j.first) for j in jobs] == [(1, True)]
    s.decode_finished(_decoded(spec, "one two"))
    assert [m.text for m in s.messages_to_send() if isinstance(m, Final)] == ["one two"]


def test_dropped_speculation_is_decoded_as_a_final():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(1500), silence(1000)]), respond=False)
    (spec,) = s.jobs_to_submit()
    s.decode_finished(DecodeResult(job=spec, dropped=True))  # e.g. superseded in the queue
    (job,) = s.jobs_to_submit()
    assert job.kind == "final" and job.reason == "silence" and not job.speculative
    assert (job.start_sample, job.end_sample) == (spec.start_sample, spec.end_sample)
    assert np.array_equal(job.pcm, spec.pcm)
    s.decode_finished(_decoded(job, "decoded again"))
    assert [m.text for m in s.messages_to_send() if isinstance(m, Final)] == ["decoded again"]


def test_speculation_gives_the_same_finals_as_without_it():
    """A deterministic decoder: the finals' text and bounds do not depend on speculation."""
    pcm = np.concatenate(
        [silence(400), tone(1200), silence(900), tone(700), silence(350), tone(900), silence(900)]
    )

    def finals(speculate):
        s = Session(
            "s1",
            SessionOptions(model_name="fake", speculative_finals=speculate),
            StreamOptions(),
            loudness_classifier(),
        )
        s.start()
        data = pcm.tobytes()
        for i in range(0, len(data), 640):
            s.receive_audio(data[i : i + 640])
            answer(s, text_for=lambda job: f"{job.start_sample}-{job.end_sample}")
        s.receive_text('{"type":"stop"}')
        answer(s, text_for=lambda job: f"{job.start_sample}-{job.end_sample}")
        messages = s.messages_to_send()
        return [(m.text, m.start_ms, m.end_ms) for m in messages if isinstance(m, Final)]

    with_speculation = finals(True)
    assert with_speculation == finals(False) and len(with_speculation) == 2


def test_a_background_session_submits_background_finals_only_with_the_same_cuts():
    """A file upload's session: every job it submits is a background final (no partials,
    no speculative decodes, even with partials on), and its finals are the live ones."""
    pcm = np.concatenate(
        [silence(400), tone(1200), silence(900), tone(700), silence(350), tone(900), silence(900)]
    )

    def run(background):
        s = Session(
            "s1",
            SessionOptions(model_name="fake"),
            StreamOptions(partials=True),
            loudness_classifier(),
            background=background,
        )
        s.start()
        submitted = []
        data = pcm.tobytes()
        for i in range(0, len(data), 640):
            s.receive_audio(data[i : i + 640])
            while jobs := s.jobs_to_submit():
                submitted += jobs
                for job in jobs:
                    raw = f"<|en|><|NEUTRAL|><|Speech|><|woitn|>{job.start_sample}-{job.end_sample}"
                    t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
                    s.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))
        s.stop()
        assert s.state is State.ENDED
        messages = s.messages_to_send()
        finals = [(m.text, m.start_ms, m.end_ms) for m in messages if isinstance(m, Final)]
        return submitted, finals, [m for m in messages if isinstance(m, Partial)]

    live_jobs, live_finals, live_partials = run(False)
    file_jobs, file_finals, file_partials = run(True)
    assert any(j.kind == "partial" for j in live_jobs) and live_partials
    assert not any(j.background for j in live_jobs)
    assert file_jobs and all(j.kind == "final" and j.background for j in file_jobs)
    assert file_partials == [] and len(file_finals) == 2
    assert file_finals == live_finals


def test_failed_speculation_is_not_repeated_and_the_final_is_decoded():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(1500), silence(300)]), respond=False)
    (spec,) = s.jobs_to_submit()
    s.decode_finished(
        DecodeResult(job=spec, failure=DecodeFailure.DECODE_FAILED, detail="RuntimeError: boom")
    )
    feed(s, silence(600), respond=False)
    (job,) = s.jobs_to_submit()  # not the same speculation again: the final itself
    assert job.kind == "final" and (job.start_sample, job.end_sample) == (
        spec.start_sample,
        spec.end_sample,
    )
    s.decode_finished(_decoded(job, "second try"))
    assert [m.text for m in s.messages_to_send() if isinstance(m, Final)] == ["second try"]


def test_audio_and_control_after_server_shutdown_are_dropped_quietly():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(500)]))
    s.shutdown()
    for _ in range(50):
        s.receive_audio(tone(40).tobytes())
    s.receive_text('{"type":"finalize"}')
    s.receive_text('{"type":"stop"}')
    answer(s)
    messages = s.messages_to_send()
    errors = [m for m in messages if isinstance(m, Error)]
    assert [e.code for e in errors] == ["server_shutdown"]
    assert isinstance(messages[-1], End) and s.close_code == 1001


def test_error_bursts_are_answered_once_with_a_count():
    s = make_session()
    s.start()
    s.messages_to_send()
    junk = '{"type":"' + "x" * 60000 + '"}'
    for _ in range(1000):
        s.receive_text(junk)
    (first,) = s.messages_to_send()
    assert first.code == "bad_message" and first.suppressed == 0
    assert len(first.message) <= protocol.MAX_ERROR_MESSAGE_CHARS
    s.receive_text('{"type":"keepalive"}')  # valid input ends the burst
    (summary,) = s.messages_to_send()
    assert summary.code == "bad_message" and summary.suppressed == 999
    s.receive_text("nope")  # a new burst is answered again
    assert [m.suppressed for m in s.messages_to_send()] == [0]


def test_decode_errors_reach_clients_as_a_code_and_a_safe_message():
    s = make_session(partials=False)
    s.start()
    feed(s, np.concatenate([silence(300), tone(500)]), respond=False)
    s.receive_text('{"type":"stop"}')
    (job,) = s.jobs_to_submit()
    s.decode_finished(
        DecodeResult(
            job=job,
            failure=DecodeFailure.DECODE_FAILED,
            detail="RuntimeError: /secret/path/model.pt",
        )
    )
    messages = s.messages_to_send()
    final = next(m for m in messages if isinstance(m, Final))
    assert final.error["code"] == "decode_failed" and "secret" not in final.error["message"]
    error = next(m for m in messages if isinstance(m, Error))
    assert "secret" not in error.message


# --- continuous speech: no partial starts in a long segment's quiet frames ---------------


def test_no_partial_starts_on_a_quiet_frame_of_a_long_segment():
    """Past long_segment_ms a quiet frame may begin the pause that ends the segment; a
    partial decode started there would hold up its final, so it waits for loud audio."""
    s = make_session()
    s.start()
    tremolo = np.concatenate([tone(60), silence(40)] * 20)  # 2 quiet frames in every 5
    pcm = np.concatenate([silence(300), tone(4500), tremolo, silence(1000)])
    data = pcm.tobytes()
    partial_ends = []
    for i in range(0, len(data), 640):
        s.receive_audio(data[i : i + 640])
        for job in s.jobs_to_submit():
            if job.kind == "partial" and not job.speculative:
                partial_ends.append(job.end_sample)
            raw = f"<|en|><|NEUTRAL|><|Speech|><|woitn|>{job.kind} {job.end_sample}"
            t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
            s.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))
    tremolo_start = 16 * (300 + 4500)
    late = [end for end in partial_ends if end > tremolo_start + 16 * 200]
    assert len(late) >= 5  # partials go on through the tremolo
    # the frame each was started on (the one ending at end_sample) was loud
    phases = [(end - tremolo_start) // 320 % 5 for end in late]
    assert all(phase in (1, 2, 3) for phase in phases), str(phases)
    finals = [m for m in s.messages_to_send() if isinstance(m, Final)]
    assert [f.reason for f in finals] == ["silence"]  # 40 ms dips end nothing


def test_a_segment_that_follows_another_at_once_gets_its_first_partial_at_onset():
    """Issue 14: a segment cut at a short pause of continuous speech starts where the
    previous one ended (its pre-roll clipped there), so it holds less than one partial
    interval of audio at its onset; its first partial must not wait for the interval
    (onset TTFT 139 ms against 250-350 ms for such segments, bench/RESULTS.md)."""
    s = make_session()
    s.start()
    pcm = np.concatenate([silence(300), tone(4500), silence(120), tone(1500), silence(1000)])
    data = pcm.tobytes()
    first_partials: dict[int, int] = {}  # segment -> position of its first partial
    starts: dict[int, int] = {}
    for i in range(0, len(data), 640):
        s.receive_audio(data[i : i + 640])
        for message in s.messages_to_send():
            if isinstance(message, SpeechStart):
                starts[message.segment_id] = int(message.start_ms * 16)
        for job in s.jobs_to_submit():
            if job.kind == "partial" and not job.speculative:
                first_partials.setdefault(job.segment_id, job.end_sample)
            raw = f"<|en|><|NEUTRAL|><|Speech|><|woitn|>{job.kind} {job.end_sample}"
            t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
            s.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))
    assert sorted(starts) == [0, 1]
    second_speech = 16 * (300 + 4500 + 120)
    assert starts[1] < second_speech  # it starts in the pause: no pre-roll before it
    assert second_speech - starts[1] < 16 * 300  # less than one interval of pre-roll
    # its first partial comes at the onset (100 ms of speech and a frame), not one
    # interval after its start
    assert first_partials[1] <= second_speech + 16 * 140
    assert first_partials[1] - starts[1] < 16 * 300


def test_an_error_burst_answers_once_and_reports_the_count_when_it_ends() -> None:
    from streamer.core.error_burst import ErrorBurst

    burst = ErrorBurst()
    (first,) = burst.record("bad_message", "junk")
    assert (first.code, first.fatal, first.suppressed) == ("bad_message", False, 0)
    assert burst.record("bad_message", "junk") == [] and burst.record("bad_message", "x") == []
    summary, other = burst.record("unexpected_message", "late audio")  # another code ends it
    assert (summary.code, summary.suppressed) == ("bad_message", 2)
    assert other.code == "unexpected_message"
    assert burst.end() == [] and burst.code is None  # no repeat: nothing to report


def test_an_immediate_finalize_keeps_every_sample_sent() -> None:
    """Deepgram's Finalize and OpenAI's commit end the segment now: its final holds the
    samples of the frame not yet complete too (8-32 ms used to be cut off the end)."""
    session = make_session(partials=False)
    session.start()
    pcm = np.concatenate([silence(300), tone(1000)])[:-123]  # not a whole number of frames
    feed(session, pcm, respond=False)
    session.jobs_to_submit()  # partials, speculations: not what this test looks at
    session.finalize(at_pause=False)
    (final,) = [job for job in session.jobs_to_submit() if job.kind == "final"]
    assert final.end_sample == pcm.size
    assert np.array_equal(final.pcm, pcm[final.start_sample :])
    raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>one"
    t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
    session.decode_finished(DecodeResult(job=final, transcript=t, decode_ms=1))
    # the stream goes on: the next audio is framed as before, and stop still works
    feed(session, np.concatenate([silence(500), tone(600), silence(900)]))
    session.stop()
    answer(session)
    messages = session.messages_to_send()
    assert session.state is State.ENDED and types(messages).count("final") == 2


@pytest.mark.parametrize("rate", [8000, 44100, 48000])
def test_an_immediate_finalize_of_a_resampled_stream_keeps_every_sample(rate: int) -> None:
    """soxr holds back up to ~115 ms of its output until more input comes: a finalize
    drains it, so the final ends where the audio sent ends, on the 16 kHz timeline."""
    session = make_session(sample_rate=rate, partials=False)
    session.start()
    pcm = np.concatenate([silence(300, rate), tone(1000, rate=rate)])[:-37]
    feed(session, pcm, chunk_bytes=rate // 25, respond=False)  # 20 ms chunks
    session.jobs_to_submit()
    session.finalize(at_pause=False)
    (final,) = [job for job in session.jobs_to_submit() if job.kind == "final"]
    assert final.end_sample == round(pcm.size * 16000 / rate)
    assert final.pcm.size == final.end_sample - final.start_sample
    # the stream goes on from there: a stop ends the timeline where a plain stream does
    more = tone(700, rate=rate)[:-11]
    feed(session, more, chunk_bytes=rate // 25, respond=False)
    session.stop()
    last = [job for job in session.jobs_to_submit() if job.kind == "final"][-1]
    assert last.end_sample == round((pcm.size + more.size) * 16000 / rate)


def test_a_finalize_at_a_pause_sees_the_resamplers_held_back_audio() -> None:
    """Speech, then 260 ms of silence at 8 kHz: the pause is all sent, so protocol v1's
    finalize ends the segment at once (soxr still held back ~100 ms of it)."""
    session = make_session(sample_rate=8000, partials=False)
    session.start()
    feed(session, np.concatenate([silence(300, 8000), tone(1000, rate=8000)]), respond=False)
    feed(session, silence(260, 8000), chunk_bytes=320, respond=False)
    session.jobs_to_submit()
    session.finalize()
    finals = [job for job in session.jobs_to_submit() if job.kind == "final"]
    assert [job.reason for job in finals] == ["finalize"]
