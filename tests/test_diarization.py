"""Online speaker labels, I/O-free: powerset decoding, the tracker, turns and words, and a
diarized session's finals (held for their speakers, released by the answer or the bound)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from streamer.core.diarization import (
    END_TO_END,
    PIECE_STEP_SAMPLES,
    PIECE_WINDOW_SAMPLES,
    SEGMENTATION_STEP_SAMPLES,
    DiarizationOptions,
    LocalSpeaker,
    SpeakerAnalysis,
    SpeakerTracker,
    Turn,
    closed_windows,
    local_regions,
    main_speaker,
    powerset_activity,
    speaker_label,
    speaker_turns,
    window_span,
    windows_inside,
    word_speaker,
)
from streamer.core.jobs import DecodeResult
from streamer.core.protocol import (
    Final,
    SpeakerWord,
    StreamOptions,
    decode_server_message,
    encode,
    message_dict,
    parse_stream_options,
)
from streamer.core.segmenter import SegmentEnd
from streamer.core.session import Session, SessionOptions
from streamer.core.session_speakers import SessionSpeakers, speaker_parts
from streamer.core.transcript import Transcript
from streamer.errors import InvalidOption
from tests.fakes import loudness_classifier, silence, tone
from tests.support import diarized_final

RATE = 16000
STEP = SEGMENTATION_STEP_SAMPLES


def voice(seed: int, dim: int = 192) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dim)
    return v / np.linalg.norm(v)


def near(center: np.ndarray, seed: int, spread: float = 0.5) -> np.ndarray:
    """An embedding of the same voice: cosine with ``center`` about 0.9."""
    noise = np.random.default_rng(1000 + seed).standard_normal(center.shape)
    v = center + spread * noise / np.linalg.norm(noise)
    return v / np.linalg.norm(v)


def utterance(
    segment_id: int, *speakers: tuple[np.ndarray | None, float, float]
) -> SpeakerAnalysis:
    """Local speakers (embedding, start s, end s), one region each, all solo."""
    locals_ = []
    end = 0
    for i, (emb, a, b) in enumerate(speakers):
        region = (int(a * RATE), int(b * RATE))
        end = max(end, region[1])
        locals_.append(LocalSpeaker(i, (region,), region[1] - region[0], emb))
    return SpeakerAnalysis(segment_id, samples=end + RATE // 10, speakers=tuple(locals_))


# -- powerset and regions ------------------------------------------------------------


def test_powerset_classes_decode_to_local_speakers() -> None:
    scores = np.full((7, 7), -10.0)
    for frame, cls in enumerate(range(7)):
        scores[frame, cls] = 0.0
    activity = powerset_activity(scores)
    assert activity.tolist() == [
        [False, False, False],
        [True, False, False],
        [False, True, False],
        [False, False, True],
        [True, True, False],
        [True, False, True],
        [False, True, True],
    ]
    with pytest.raises(ValueError):
        powerset_activity(np.zeros((3, 4)))


def test_local_regions_in_samples_with_solo_parts() -> None:
    activity = np.zeros((100, 3), dtype=bool)
    activity[10:60, 0] = True
    activity[50:90, 1] = True  # overlaps speaker 0 on frames 50-59
    regions = {slot: (spans, solo) for slot, spans, solo in local_regions(activity, 1000, 10**6)}
    assert set(regions) == {0, 1}
    spans, solo = regions[0]
    assert len(spans) == 1 and len(solo) == 1
    assert spans[0][0] == pytest.approx(1000 + 10 * STEP + 495 - 135, abs=1)
    assert solo[0][1] < spans[0][1]  # the overlap is not solo
    assert sum(b - a for a, b in solo) == pytest.approx(40 * STEP, abs=2)


def test_grid_windows_closed_and_inside_regions() -> None:
    window, step = PIECE_WINDOW_SAMPLES, PIECE_STEP_SAMPLES
    assert [closed_windows(n) for n in (0, window - 1, window, window + step)] == [0, 0, 1, 2]
    assert window_span(2) == (2 * step, 2 * step + window)
    region = (RATE // 10, 3 * RATE)  # 0.1 s to 3 s: from the first grid start after 0.1 s
    inside = windows_inside([region])
    assert inside == list(range(1, closed_windows(3 * RATE)))
    assert all(region[0] <= window_span(k)[0] < window_span(k)[1] <= region[1] for k in inside)
    assert windows_inside([region], 4 * RATE) == []  # a region shorter than asked: none
    assert windows_inside([(0, window - 1)]) == []  # shorter than one window: none
    end_to_end = windows_inside([(0, 6 * RATE)], every=END_TO_END)
    spans = [window_span(k) for k in end_to_end]
    gaps = [b[0] - a[1] for a, b in zip(spans[:-1], spans[1:], strict=True)]
    assert len(spans) >= 4 and all(0 <= gap < step for gap in gaps)  # apart, nearly touching


def test_speaker_labels_are_letters() -> None:
    assert [speaker_label(i) for i in (0, 1, 25, 26, 27)] == ["A", "B", "Z", "AA", "AB"]


# -- the tracker -------------------------------------------------------------------------


def test_tracker_matches_known_voices_and_adds_new_ones() -> None:
    a, b = voice(1), voice(2)
    tracker = SpeakerTracker(DiarizationOptions(match_threshold=0.5))
    assert tracker.assign(utterance(0, (near(a, 1), 0, 2))) == {0: 0}
    assert tracker.assign(utterance(1, (near(b, 2), 0, 2))) == {0: 1}
    assert tracker.assign(utterance(2, (near(a, 3), 0, 1), (near(b, 4), 1, 3))) == {0: 0, 1: 1}
    assert tracker.count == 2


def test_a_new_speaker_needs_enough_speech_and_room() -> None:
    a, b, c = voice(1), voice(2), voice(3)
    options = DiarizationOptions(new_speaker_min_ms=1000, max_speakers=2)
    tracker = SpeakerTracker(options)
    tracker.assign(utterance(0, (near(a, 1), 0, 2)))
    # 0.5 s of an unknown voice is not enough to start a speaker: the nearest is taken
    assert tracker.assign(utterance(1, (near(b, 2), 0, 0.5))) == {0: 0}
    assert tracker.assign(utterance(2, (near(b, 3), 0, 1.5))) == {0: 1}
    # max_speakers reached: a third voice goes to the nearest known one
    assert tracker.assign(utterance(3, (near(c, 4), 0, 3))) in ({0: 0}, {0: 1})
    assert tracker.count == 2


def test_short_local_speakers_take_the_main_speaker_or_the_last() -> None:
    a = voice(1)
    tracker = SpeakerTracker()
    assert tracker.assign(utterance(0, (None, 0, 0.2))) == {0: 0}  # a first, unheard speaker
    assert tracker.assign(utterance(1, (near(a, 1), 0, 2), (None, 2, 2.2))) == {0: 0, 1: 0}
    tracker.last_speaker = 0
    assert tracker.assign(utterance(2, (None, 0, 0.2))) == {0: 0}


def test_a_label_once_given_never_changes() -> None:
    """Online: the labels of the first utterances are the same whatever follows them,
    and feeding the same utterances again (after any others) never relabels the past."""
    rng = np.random.default_rng(7)
    centers = [voice(s) for s in range(4)]
    stream = []
    for i in range(60):
        who = int(rng.integers(4))
        stream.append(
            utterance(i, (near(centers[who], i, spread=0.9), 0, float(rng.uniform(0.5, 3))))
        )
    full = SpeakerTracker()
    labels_full = [full.assign(u) for u in stream]
    for cut in (1, 10, 30):
        prefix = SpeakerTracker()
        labels_prefix = [prefix.assign(u) for u in stream[:cut]]
        assert labels_prefix == labels_full[:cut]
    # the returned mappings are copies: later input cannot reach into them
    snapshot = [dict(m) for m in labels_full]
    for u in stream:
        full.assign(u)
    assert labels_full == snapshot


def test_enrolled_speakers_are_matched_first() -> None:
    a, b = voice(1), voice(2)
    tracker = SpeakerTracker()
    assert tracker.enrol(a) == 0 and tracker.enrol(b) == 1
    assert tracker.assign(utterance(0, (near(b, 1), 0, 2))) == {0: 1}


def test_offline_clustering_finds_the_voices_with_and_without_the_count() -> None:
    from streamer.core.diarization import cluster_speakers

    centers = [voice(s) for s in range(3)]
    who = [0, 1, 0, 2, 1, 1, 0, 2, 2, 0]
    embeddings = np.array([near(centers[w], i, spread=0.6) for i, w in enumerate(who)])
    expected = [{0: 0, 1: 1, 2: 2}[w] for w in who]  # numbered in order of appearance
    assert cluster_speakers(embeddings, 3) == expected
    assert cluster_speakers(embeddings) == expected  # the eigengap says 3
    assert cluster_speakers(embeddings[:1]) == [0] and cluster_speakers(np.zeros((0, 8))) == []


def test_a_window_clearly_of_another_voice_changes_the_turn() -> None:
    """Two voices the segmentation gave one local speaker: the window of the other known
    voice becomes its turn; the mapping and the centroids stay."""
    from streamer.core.diarization import Piece

    a, b = voice(1), voice(2)
    tracker = SpeakerTracker(DiarizationOptions(change_margin=0.15))
    tracker.assign(utterance(0, (a, 0, 2)))
    tracker.assign(utterance(1, (b, 0, 2)))
    pieces = tuple(
        Piece(int(s * RATE), int((s + 1.5) * RATE), near(b if 1.5 <= s < 3 else a, int(s * 4)))
        for s in (0.0, 0.75, 1.5, 2.25, 3.0, 3.75)
    )
    region = (0, int(5.25 * RATE))
    local = LocalSpeaker(0, (region,), region[1], near(a, 99, spread=0.3), pieces)
    analysis = SpeakerAnalysis(2, region[1] + RATE // 10, (local,))
    mapping = tracker.assign(analysis)
    assert mapping == {0: 0}
    changes = tracker.changes(analysis, mapping)
    assert changes and {c.speaker for c in changes} == {1}
    turns = speaker_turns(analysis, mapping, DiarizationOptions(), changes)
    assert [t.speaker for t in turns] == [0, 1, 0]
    assert 1.5 * RATE <= turns[1].start < turns[1].end <= 4.0 * RATE


# -- turns and words -------------------------------------------------------------------


def test_turns_split_at_the_change_and_absorb_short_runs() -> None:
    a, b = voice(1), voice(2)
    analysis = utterance(0, (a, 0.1, 2.0), (b, 2.2, 4.0), (a, 4.0, 4.1))
    turns = speaker_turns(analysis, {0: 0, 1: 1, 2: 0}, DiarizationOptions(min_turn_ms=250))
    assert [t.speaker for t in turns] == [0, 1]  # the 0.1 s run joined its neighbour
    assert turns[0].start == pytest.approx(0.1 * RATE, abs=STEP)
    assert turns[0].end == turns[1].start
    assert turns[0].end == pytest.approx(2.1 * RATE, abs=STEP)  # the pause split in two
    assert turns[1].end == pytest.approx(4.1 * RATE, abs=STEP)
    assert main_speaker(turns) == 0


def test_words_take_the_speaker_active_over_them() -> None:
    turns = [Turn(0, 2 * RATE, 0), Turn(2 * RATE, 4 * RATE, 1)]
    assert word_speaker(turns, int(0.5 * RATE), RATE) == 0
    assert word_speaker(turns, int(1.8 * RATE), int(2.6 * RATE)) == 1  # more of it in 1
    assert word_speaker(turns, 5 * RATE, 6 * RATE) == 1  # after all turns: the nearest
    assert word_speaker([], 0, 1) is None


# -- protocol -------------------------------------------------------------------------------


def test_stream_options_diarize() -> None:
    options = parse_stream_options(
        {"diarize": "true", "max_speakers": "3", "min_speakers": "2"}, strings=True
    )
    assert (options.diarize, options.min_speakers, options.max_speakers) == (True, 2, 3)
    assert options.to_dict()["max_speakers"] == 3
    assert "diarize" not in StreamOptions().to_dict()  # unchanged without diarize
    with pytest.raises(InvalidOption):
        parse_stream_options({"max_speakers": 0})
    with pytest.raises(InvalidOption):
        parse_stream_options({"min_speakers": 3, "max_speakers": 2})


# -- a diarized session ------------------------------------------------------------------------


def diarized_session(**stream: object) -> Session:
    options = SessionOptions(model_name="fake", diarization=DiarizationOptions())
    return Session("s1", options, StreamOptions(diarize=True, **stream), loudness_classifier())


def decode_all(session: Session) -> None:
    while jobs := session.jobs_to_submit():
        for job in jobs:
            raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>hello"
            t = Transcript.from_raw(
                raw,
                rich=raw,
                token_ids=(1,),
                audio_ms=0,
                decode_ms=1,
                token_frames=(4,),
                token_confidences=(0.9,),
                token_end_frames=(8,),
                token_pieces=("▁hello",),
            )
            session.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))


def run(session: Session, pcm: np.ndarray) -> None:
    session.start()
    data = pcm.tobytes()
    for i in range(0, len(data), 3200):
        session.receive_audio(data[i : i + 3200])
        decode_all(session)
    session.receive_text('{"type":"stop"}')
    decode_all(session)


def finals(session: Session) -> list[Final]:
    return [m for m in session.messages_to_send() if isinstance(m, Final)]


def test_a_diarized_final_waits_for_its_speakers_and_carries_them() -> None:
    session = diarized_session()
    run(session, np.concatenate([silence(300), tone(1500), silence(1000)]))
    assert session.speakers is not None
    jobs = session.speakers.jobs_to_submit()
    assert [j.segment_id for j in jobs] == [0]
    assert len(jobs[0].pcm) == jobs[0].pcm.size > RATE
    assert finals(session) == []  # held: its speakers are not known yet
    assert session.speakers.held == [0]
    samples = len(jobs[0].pcm)
    session.speakers_finished(0, utterance(0, (voice(1), 0.0, samples / RATE - 0.1)))
    messages = session.messages_to_send()
    assert [m.type for m in messages] == ["final", "end"]  # the end waited for it
    final = messages[0]
    assert isinstance(final, Final)
    assert final.speaker == "A"
    assert [t.speaker for t in final.turns or ()] == ["A"]
    assert final.words and all(isinstance(w, SpeakerWord) and w.speaker == "A" for w in final.words)
    wire = message_dict(final)
    assert wire["speaker"] == "A" and wire["words"][0]["speaker"] == "A"
    assert wire["turns"][0]["speaker"] == "A"
    assert decode_server_message(encode(final)) == final


def test_without_an_answer_in_time_the_final_goes_unlabelled() -> None:
    session = diarized_session()
    run(session, np.concatenate([silence(300), tone(1500), silence(1000)]))
    assert session.speakers is not None
    session.speakers.jobs_to_submit()
    session.speakers_finished(0, None)  # the transport's bound passed
    (final,) = finals(session)
    assert final.speaker is None and final.turns is None
    assert "speaker" not in message_dict(final) and "turns" not in message_dict(final)
    # a late answer changes nothing: the final is sent
    session.speakers_finished(0, utterance(0, (voice(1), 0.0, 1.0)))
    assert finals(session) == []


def test_an_answer_before_the_text_labels_the_final_at_once() -> None:
    session = diarized_session()
    session.start()
    pcm = np.concatenate([silence(300), tone(1500), silence(1000)]).tobytes()
    for i in range(0, len(pcm), 3200):
        session.receive_audio(pcm[i : i + 3200])
    assert session.speakers is not None
    (job,) = session.speakers.jobs_to_submit()
    answer = utterance(0, (voice(1), 0.0, 1.0))
    session.speakers_finished(job.segment_id, SpeakerAnalysis(0, len(job.pcm), answer.speakers))
    decode_all(session)
    (final,) = finals(session)
    assert final.speaker == "A"


def test_without_diarize_nothing_changes() -> None:
    plain = Session("s1", SessionOptions(model_name="fake"), StreamOptions(), loudness_classifier())
    with_models = Session(
        "s1",
        SessionOptions(model_name="fake", diarization=DiarizationOptions()),
        StreamOptions(),
        loudness_classifier(),
    )
    pcm = np.concatenate([silence(300), tone(1500), silence(1000)])
    out = []
    for session in (plain, with_models):
        run(session, pcm)
        assert session.speakers is None
        out.append([encode(m) for m in session.messages_to_send()])
    assert out[0] == out[1]
    assert b"speaker" not in b"".join(out[0]) and b"diarize" not in b"".join(out[0])


def test_diarize_on_a_server_without_speaker_models_is_told() -> None:
    session = Session(
        "s1", SessionOptions(model_name="fake"), StreamOptions(diarize=True), loudness_classifier()
    )
    session.start()
    errors = [m for m in session.messages_to_send() if m.type == "error"]
    assert [e.code for e in errors] == ["diarize_unavailable"]
    assert not errors[0].fatal


def test_session_speakers_forget_and_names() -> None:
    speakers = SessionSpeakers(
        "s", StreamOptions(diarize=True), DiarizationOptions(), names={0: "Ann"}
    )
    speakers.tracker.enrol(voice(1))
    speakers.segment_closed(SegmentEnd(0, 0, RATE, "silence"), np.zeros(RATE, np.int16))
    final = Final(0, 0.0, 1000.0, "hi", "en", None, None, "", "", "silence", 1.0, 0.0, words=())
    assert speakers.label(final) is None
    labelled = speakers.analysed(0, utterance(0, (near(voice(1), 1), 0.1, 0.9)))
    assert labelled is not None and labelled.speaker == "Ann"
    speakers.segment_closed(SegmentEnd(1, RATE, 2 * RATE, "silence"), np.zeros(RATE, np.int16))
    speakers.forget(1)
    assert speakers.held == []


def test_speaker_analysis_is_speculated_in_the_pause_like_the_final() -> None:
    """A pause sends the open segment's audio to the speaker models at once; if the segment
    closes there, that answer is its (no second job); if speech resumed, the stale answer
    is ignored and the closed audio is analysed."""
    from streamer.core.open_segment import OpenSegment

    def fresh() -> SessionSpeakers:
        return SessionSpeakers("s", StreamOptions(diarize=True), DiarizationOptions())

    def final(segment_id: int = 0) -> Final:
        return Final(segment_id, 0.0, 2000.0, "hi", "en", None, None, "", "", "silence", 1.0, 0.0,
                     words=())  # fmt: skip

    pcm = np.zeros(3 * RATE, np.int16)
    # 1. the speculation's answer comes first, then the segment closes on the same audio
    speakers = fresh()
    speakers.speculate(OpenSegment(0, 0), pcm[: 2 * RATE])
    assert len(speakers.jobs_to_submit()) == 1
    assert speakers.analysed(0, utterance(0, (voice(1), 0.1, 1.9))) is None  # stored
    speakers.segment_closed(SegmentEnd(0, 0, 2 * RATE, "silence"), pcm[: 2 * RATE])
    assert speakers.jobs_to_submit() == []
    labelled = speakers.label(final())
    assert labelled is not None and labelled.speaker == "A"
    # 2. two pauses: the first pause's answer is stale, the second's is used
    speakers = fresh()
    speakers.speculate(OpenSegment(0, 0), pcm[:RATE])
    speakers.speculate(OpenSegment(0, 0), pcm[: 2 * RATE])
    assert len(speakers.jobs_to_submit()) == 2
    stale = utterance(0, (voice(1), 0.1, 0.9))
    assert stale.samples != 2 * RATE
    speakers.analysed(0, SpeakerAnalysis(0, RATE, stale.speakers))
    speakers.segment_closed(SegmentEnd(0, 0, 2 * RATE, "silence"), pcm[: 2 * RATE])
    assert speakers.jobs_to_submit() == []
    assert speakers.label(final()) is None  # still waiting for the second pause's answer
    done = speakers.analysed(
        0, SpeakerAnalysis(0, 2 * RATE, utterance(0, (voice(2), 0.1, 1.9)).speakers)
    )
    assert done is not None and done.speaker == "A"
    # 3. speech resumed after the pause: the closed audio is analysed anew
    speakers = fresh()
    speakers.speculate(OpenSegment(0, 0), pcm[:RATE])
    speakers.jobs_to_submit()
    speakers.segment_closed(SegmentEnd(0, 0, 3 * RATE, "silence"), pcm)
    (job,) = speakers.jobs_to_submit()
    assert len(job.pcm) == 3 * RATE
    assert speakers.analysed(0, SpeakerAnalysis(0, RATE, ())) is None  # the stale one
    assert speakers.label(final()) is None
    assert (
        speakers.analysed(
            0, SpeakerAnalysis(0, 3 * RATE, utterance(0, (voice(3), 0, 2.5)).speakers)
        )
        is not None
    )


def test_an_open_segments_whole_windows_go_early_only_where_the_models_use_them() -> None:
    """While a segment is spoken, each new whole window sends its audio so far (one job
    kept, the newest): the models embed those windows before the segment ends, when they
    embed windows end to end (change_windows off). With the default, the models pick
    their windows at the end and embed nothing early: no early job is made at all."""
    for background, change_windows in ((False, False), (True, False), (False, True)):
        diarization = DiarizationOptions(change_windows=change_windows)
        options = SessionOptions(model_name="fake", diarization=diarization)
        stream = StreamOptions(diarize=True)
        session = Session("s1", options, stream, loudness_classifier(), background=background)
        session.start()
        data = np.concatenate([silence(300), tone(3000)]).tobytes()  # still speaking
        early = []
        for i in range(0, len(data), 3200):
            session.receive_audio(data[i : i + 3200])
            decode_all(session)
            assert session.speakers is not None
            if (job := session.speakers.early_job()) is not None:
                early.append(job)
        assert session.speakers is not None
        assert session.speakers.jobs_to_submit() == []  # nothing closed: no analysis yet
        if background or change_windows:
            assert early == []
            continue
        windows = [closed_windows(len(j.pcm)) for j in early]
        assert windows[0] >= 1 and windows == sorted(set(windows))  # one per new window
        assert all(j.early and j.segment_id == 0 and j.start_sample == 0 for j in early)
        assert np.abs(early[-1].pcm).max() > 1000  # the tone, from the segment's start


def test_a_final_is_cut_where_its_words_speaker_changes() -> None:
    final = diarized_final(
        [
            ("one", 100.0, 200.0, "A"),
            ("two", 200.0, 300.0, ""),  # unset: the final's (A)
            ("three", 400.0, 500.0, "B"),
            ("four", 600.0, 700.0, "A"),
        ],
        "A",
    )
    parts = speaker_parts(final)
    assert [(p.speaker, p.text, p.start_ms, p.end_ms) for p in parts] == [
        ("A", "one two", 0.0, 300.0),  # the first starts where the final does
        ("B", "three", 400.0, 500.0),
        ("A", "four", 600.0, 800.0),  # the last ends where the final does
    ]
    assert all(p.turns is None for p in parts)
    one = diarized_final([("four", 600.0, 700.0, "A")], "B")
    assert speaker_parts(one) == [replace(one, speaker="A")]  # its one speaker is its words'
    assert speaker_parts(replace(one, words=None)) == [replace(one, words=None)]
