"""The segmenter driven with boolean sequences: one flag per 20 ms frame."""

import pytest

from streamer.core.segmenter import SegmentEnd, Segmenter, SegmenterOptions, SegmentStart
from streamer.errors import ConfigError

FRAME = 320  # samples per 20 ms frame at 16 kHz


def run(flags, energies=None, options=None, flush=None):
    seg = Segmenter(options or SegmenterOptions())
    events = []
    for i, flag in enumerate(flags):
        energy = energies[i] if energies is not None else (1000.0 if flag else 1.0)
        events += [(i, e) for e in seg.push(flag, energy)]
    if flush:
        events += [(len(flags), e) for e in seg.flush(flush)]
    return seg, events


def starts(events):
    return [e for _, e in events if isinstance(e, SegmentStart)]


def ends(events):
    return [e for _, e in events if isinstance(e, SegmentEnd)]


def test_onset_confirmed_after_min_speech_with_pre_roll():
    flags = [False] * 50 + [True] * 100 + [False] * 40
    _, events = run(flags)
    (frame, start), (_, end) = events
    assert isinstance(start, SegmentStart) and start.segment_id == 0
    # 100 ms = 5 speech frames confirm the onset; the start keeps 300 ms = 15 frames before
    assert frame == 54
    assert start.start_sample == (50 - 15) * FRAME
    assert end.reason == "silence"


def test_pre_roll_is_clamped_at_stream_start():
    _, events = run([True] * 30 + [False] * 40)
    assert starts(events)[0].start_sample == 0


def test_endpoint_after_trailing_silence_and_end_pad():
    flags = [False] * 20 + [True] * 50 + [False] * 30
    _, events = run(flags)
    (end_frame, end) = [(i, e) for i, e in events if isinstance(e, SegmentEnd)][0]
    # 500 ms = 25 non-speech frames end it; the end keeps 200 ms = 10 frames of pad
    assert end_frame == 70 + 25 - 1
    assert end.end_sample == (70 + 10) * FRAME


def test_short_pause_does_not_end_segment():
    flags = [True] * 40 + [False] * 20 + [True] * 40 + [False] * 30
    _, events = run(flags)
    assert len(starts(events)) == 1 and len(ends(events)) == 1


def test_custom_endpoint():
    options = SegmenterOptions(endpoint_ms=200, end_pad_ms=100)
    flags = [True] * 40 + [False] * 15 + [True] * 40 + [False] * 20
    _, events = run(flags, options=options)
    assert [e.reason for e in ends(events)] == ["silence", "silence"]


@pytest.mark.parametrize("blip_frames", [1, 2, 4])
def test_blips_below_min_speech_are_dropped(blip_frames):
    flags = ([False] * 30 + [True] * blip_frames) * 5 + [False] * 30
    _, events = run(flags)
    assert events == []


def test_scattered_speech_within_onset_window_counts():
    # 5 speech frames spread inside a 15-frame window confirm the onset
    flags = [False] * 20 + [True, False, False] * 5 + [False] * 30
    _, events = run(flags)
    assert len(starts(events)) == 1
    # but 4 spread frames do not
    flags = [False] * 20 + [True, False, False] * 4 + [False] * 30
    _, events = run(flags)
    assert events == []


def test_cap_cuts_at_quietest_point_of_its_last_400_ms_and_tiles():
    n = 800  # 16 s of continuous speech
    energies = [1000.0 + (i % 13) * 10 for i in range(n)]
    quiet = 340  # a quiet dip 6.8 s after the start (start is frame 0)
    for i in range(quiet - 1, quiet + 2):
        energies[i] = 5.0
    for i in range(299, 302):  # a quieter one at 6.0 s: too far back, not chosen
        energies[i] = 1.0
    _, events = run([True] * n, energies=energies, flush="stop")
    segs = ends(events)
    assert [e.reason for e in segs[:-1]] == ["max_duration"] * (len(segs) - 1)
    assert segs[-1].reason == "stop"
    assert segs[0].end_sample == quiet * FRAME
    for e in segs:
        assert e.end_sample - e.start_sample <= 7000 * 16
    # consecutive segments tile the audio exactly
    for a, b in zip(segs, segs[1:], strict=False):
        assert b.start_sample == a.end_sample
    assert segs[0].start_sample == 0 and segs[-1].end_sample == n * FRAME
    # every start is announced before its end, ids rise by one
    ids = [(type(e).__name__, e.segment_id) for _, e in events]
    assert ids[:3] == [("SegmentStart", 0), ("SegmentEnd", 0), ("SegmentStart", 1)]


def test_cap_cut_falls_in_last_second():
    n = 400
    energies = [1000.0] * n
    _, events = run([True] * n, energies=energies)
    cut = ends(events)[0]
    assert 6000 * 16 <= cut.end_sample - cut.start_sample <= 7000 * 16


def test_flush_finalize_and_stop():
    seg, events = run([True] * 40, flush="finalize")
    assert ends(events)[0].reason == "finalize"
    assert ends(events)[0].end_sample == 40 * FRAME
    assert not seg.in_segment
    assert seg.flush("stop") == []  # nothing open
    # stop may extend the segment to the last (partial) frame
    seg = Segmenter()
    for _ in range(40):
        seg.push(True, 1.0)
    (end,) = seg.flush("stop", end_sample=40 * FRAME + 77)
    assert end.end_sample == 40 * FRAME + 77


def test_next_segment_never_starts_before_previous_end():
    flags = [True] * 30 + [False] * 26 + [True] * 30 + [False] * 30
    _, events = run(flags)
    first, second = ends(events)
    assert second.start_sample >= first.end_sample


def test_keep_from_sample_bounds_memory():
    seg = Segmenter()
    for _ in range(10_000):
        seg.push(False, 0.0)
    kept = seg.position_sample - seg.keep_from_sample
    assert kept <= (15 + 15) * FRAME  # onset window + pre-roll


def test_options_validated():
    with pytest.raises(ConfigError):
        SegmenterOptions(frame_ms=25)
    with pytest.raises(ConfigError):
        SegmenterOptions(min_speech_ms=500, onset_window_ms=300)
    with pytest.raises(ConfigError):
        SegmenterOptions(max_utterance_ms=500)


# --- continuous speech: long segments end at the first pause --------------------------------


def test_long_segment_ends_at_the_first_short_pause():
    """Past long_segment_ms (4 s), a 100 ms pause ends the segment; before it, it does not."""
    speech, pause = [True] * 50, [False] * 12  # 1 s of speech, 240 ms pauses
    flags = [False] * 20 + (speech + pause) * 6 + [False] * 40
    _, events = run(flags, options=SegmenterOptions(pause_dip_ms=0))  # the VAD's pauses only
    segments = ends(events)
    first = segments[0]
    assert first.reason == "silence"
    # the pauses after 1 and 2 s of speech are too early; the third spans the segment's
    # 4 s mark (the segment began 300 ms before the speech) and ends it
    assert 3.5 <= (first.end_sample - first.start_sample) / 16000 < 4.5
    # it ends 100 ms (the end padding, at most the pause) after the last speech frame
    last_speech = 20 + 3 * 62 - 12
    assert first.end_sample == (last_speech + 5) * FRAME


def _hangover_speech(seconds: int, dip_at_s: tuple[float, ...], dip_frames: int = 4):
    """Flags always speech (a VAD whose hangover hides the pauses), energies that dip."""
    n = seconds * 50
    energies = [2000.0 + (i % 7) * 100 for i in range(n)]
    for at in dip_at_s:
        for i in range(int(at * 50), int(at * 50) + dip_frames):
            energies[i] = 20.0
    return [False] * 50 + [True] * n, [10.0] * 50 + energies  # 1 s of silence first


def test_long_segment_ends_at_an_energy_dip_the_vad_does_not_see():
    flags, energies = _hangover_speech(10, dip_at_s=(2.0, 5.0))
    _, events = run(flags, energies=energies)
    first = ends(events)[0]
    assert first.reason == "silence"
    # the dip at 2 s is too early; the one at 5 s (4.3 s into the segment) ends it after
    # its third quiet frame (pause_dip_ms 60)
    assert first.end_sample == (50 + 250 + 3) * FRAME
    # the VAD's hangover over the rest of the dip opens no segment: the next one starts
    # when the energy is back, at the end of the first (nothing lost in between)
    assert starts(events)[1].start_sample == first.end_sample


def test_the_onset_gate_after_a_dip_lasts_one_endpoint():
    """Quiet frames the VAD calls speech open no segment for one endpoint after a dip,
    then they count again (a quieter speaker after a loud one is not ignored)."""
    flags, energies = _hangover_speech(6, dip_at_s=(4.5,), dip_frames=75)  # 1.5 s quiet
    _, events = run(flags, energies=energies)
    first_end = ends(events)[0].end_sample // FRAME
    assert first_end == 50 + 225 + 3
    (confirmed, second), *_ = [(i, e) for i, e in events if isinstance(e, SegmentStart)][1:]
    assert confirmed == first_end + 25 + 4  # the gate's 25 frames, then 5 speech frames
    assert second.start_sample >= first_end * FRAME


def test_dips_without_contrast_do_not_cut():
    """Speech level within pause_contrast_db of the floor (say under loud noise): no dips."""
    flags, energies = _hangover_speech(10, dip_at_s=(5.0,))
    energies = [max(e, 600.0) for e in energies]  # the floor is 600, speech ~2300: 6 dB
    _, events = run(flags, energies=energies)
    assert ends(events)[0].reason == "max_duration"


def test_energy_dips_can_be_turned_off():
    flags, energies = _hangover_speech(10, dip_at_s=(5.0,))
    _, events = run(flags, energies=energies, options=SegmenterOptions(pause_dip_ms=0))
    assert ends(events)[0].reason == "max_duration"


def test_pause_possible_while_a_long_segment_is_quiet():
    flags, energies = _hangover_speech(6, dip_at_s=(1.0, 5.0))
    seg = Segmenter(SegmenterOptions())
    seen = []
    for flag, energy in zip(flags, energies, strict=True):
        seg.push(flag, energy)
        seen.append(seg.pause_possible)
    assert not any(seen[:100])  # the dip at 1 s: the segment is short
    assert seen[300:302] == [True, True] and not seen[299]


def test_short_pauses_below_the_long_length_keep_the_normal_endpoint():
    flags = [False] * 20 + ([True] * 50 + [False] * 12) * 3 + [False] * 40
    _, events = run(flags)
    assert len(ends(events)) == 1  # one segment: the 240 ms pauses at 1 and 2 s did not cut


def test_long_rule_can_be_turned_off():
    options = SegmenterOptions(long_segment_ms=7000)
    speech, pause = [True] * 50, [False] * 12
    flags = [False] * 20 + (speech + pause) * 6 + [False] * 40
    _, events = run(flags, options=options)
    assert [e.reason for e in ends(events)][0] == "max_duration"


def test_tentative_end_is_known_once_the_pause_holds_the_end_padding():
    seg = Segmenter(SegmenterOptions())
    for flag in [False] * 10 + [True] * 30:
        seg.push(flag, 1000.0 if flag else 1.0)
    assert seg.in_segment and seg.tentative_end_sample is None  # speech goes on
    for _ in range(9):
        seg.push(False, 1.0)
        assert seg.tentative_end_sample is None  # less than 200 ms of pause yet
    seg.push(False, 1.0)
    assert seg.tentative_end_sample == (40 + 10) * FRAME
    events = []
    for _ in range(15):
        events += seg.push(False, 1.0)
    (end,) = [e for e in events if isinstance(e, SegmentEnd)]
    assert end.end_sample == (40 + 10) * FRAME  # the segment ended exactly there
    assert seg.tentative_end_sample is None


def segments(events):
    return [(e.start_sample, e.end_sample) for e in ends(events)]


@pytest.mark.parametrize("every_frames", [1, 2, 3, 5, 10, 25])
def test_finalize_spam_changes_no_segment_whose_pauses_are_short_or_final(every_frames):
    # speech with short gaps (inside words, < end_pad_ms) and long ones (between
    # utterances, > endpoint_ms)
    flags = ([False] * 20 + [True] * 12 + [False] * 3 + [True] * 30 + [False] * 40) * 3
    _, plain = run(flags, flush="stop")
    seg = Segmenter()
    spammed = []
    for i, flag in enumerate(flags):
        spammed += seg.push(flag, 1000.0 if flag else 1.0)
        if i % every_frames == 0:
            spammed += seg.finalize()
    spammed += seg.flush("stop")
    assert [(e.start_sample, e.end_sample) for e in spammed if isinstance(e, SegmentEnd)] == (
        segments(plain)
    )
    assert all(e.reason == "finalize" for e in spammed if isinstance(e, SegmentEnd))


def test_finalize_spam_ends_an_utterance_at_a_pause_the_endpoint_would_bridge():
    # a 300 ms pause inside an utterance: over end_pad_ms (200), under endpoint_ms (500)
    flags = [False] * 20 + [True] * 30 + [False] * 15 + [True] * 30 + [False] * 40
    _, plain = run(flags, flush="stop")
    seg = Segmenter()
    spammed = []
    for flag in flags:
        spammed += seg.push(flag, 1000.0 if flag else 1.0)
        spammed += seg.finalize()
    spammed += seg.flush("stop")
    assert len(segments(plain)) == 1
    (first, second) = [e for e in spammed if isinstance(e, SegmentEnd)]
    assert first.end_sample == (50 + 10) * FRAME  # 200 ms after the last speech frame
    assert first.reason == second.reason == "finalize"


def test_finalize_without_open_segment_keeps_the_onset_window():
    seg = Segmenter()
    events = []
    for _ in range(3):  # 60 ms of speech: not confirmed yet
        events += seg.push(True, 1000.0)
    assert seg.finalize() == [] and not seg.in_segment
    for _ in range(2):  # 40 ms more: 100 ms in all, the onset
        events += seg.push(True, 1000.0)
    assert [e.start_sample for e in starts([(0, e) for e in events])] == [0]


def test_finalize_in_a_pause_ends_at_once_where_silence_would():
    seg = Segmenter()
    for flag in [True] * 30 + [False] * 15:  # 300 ms of non-speech: past end_pad
        seg.push(flag, 1.0)
    (end,) = seg.finalize()
    assert end.reason == "finalize" and end.end_sample == (30 + 10) * FRAME  # + 200 ms pad
