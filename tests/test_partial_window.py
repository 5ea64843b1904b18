"""A long segment's refreshes decode a bounded trailing window (core/partial_window.py)."""

from __future__ import annotations

import numpy as np

from streamer.core.jobs import DecodeJob, DecodeResult
from streamer.core.open_segment import OpenSegment, window_job_fields
from streamer.core.partial_window import HOP_SAMPLES, PartialWindow, PartialWindowOptions
from streamer.core.transcript import Transcript

SEGMENT_START = 16_000  # the segment starts 1 s into the session
OPTIONS = PartialWindowOptions(full_ms=3000, keep_ms=2000, overlap_ms=500)


def samples(ms: float) -> int:
    return round(ms * 16)


def transcript(words: list[tuple[str, int]], audio_ms: float) -> Transcript:
    """Words at ms offsets into the decoded audio (multiples of 60: one encoder frame)."""
    frames = tuple(4 + at // 60 for _, at in words)
    raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>" + " ".join(word for word, _ in words)
    return Transcript.from_raw(
        raw,
        rich=raw,
        token_ids=tuple(range(len(words))),
        audio_ms=audio_ms,
        decode_ms=0.0,
        token_frames=frames,
        token_confidences=(0.9,) * len(words),
        token_end_frames=tuple(f + 1 for f in frames),
        token_pieces=tuple("▁" + word for word, _ in words),
    )


def job(start_sample: int, end_sample: int) -> DecodeJob:
    return DecodeJob(
        session_id="s",
        segment_id=0,
        kind="partial",
        pcm=np.zeros(end_sample - start_sample, np.int16),
        start_sample=start_sample,
        end_sample=end_sample,
        language="auto",
        itn=False,
    )


def every_600_ms(count: int, first: int = 0) -> list[tuple[str, int]]:
    return [(f"w{first + i}", 600 * i) for i in range(count)]


def test_a_short_segment_is_decoded_whole_and_nothing_is_committed() -> None:
    window = PartialWindow(SEGMENT_START, OPTIONS)
    t = transcript(every_600_ms(4), 2400)
    text, words = window.view(t, job(SEGMENT_START, SEGMENT_START + samples(2400)))
    assert text == t.text == "w0 w1 w2 w3"
    assert [w.word for w in words] == ["w0", "w1", "w2", "w3"]
    assert window.committed == ()
    assert window.start_sample() == SEGMENT_START


def test_a_long_segment_commits_old_words_and_its_next_refresh_is_a_bounded_window() -> None:
    window = PartialWindow(SEGMENT_START, OPTIONS)
    end = SEGMENT_START + samples(5000)
    text, _ = window.view(transcript(every_600_ms(8), 5000), job(SEGMENT_START, end))
    assert text == "w0 w1 w2 w3 w4 w5 w6 w7"
    # words ending by 5000 - 2000 ms are committed: w0..w3 end at 600..2400, w4 at 3000
    assert [w.word for w in window.committed] == ["w0", "w1", "w2", "w3", "w4"]
    assert window.commit_sample == SEGMENT_START + samples(3000)
    start = window.start_sample()
    assert start == SEGMENT_START + samples(3000 - 500)
    assert (start - SEGMENT_START) % HOP_SAMPLES == 0


def test_a_window_keeps_the_committed_prefix_and_drops_the_words_heard_again() -> None:
    window = PartialWindow(SEGMENT_START, OPTIONS)
    end = SEGMENT_START + samples(5000)
    window.view(transcript(every_600_ms(8), 5000), job(SEGMENT_START, end))
    first_text = "w0 w1 w2 w3 w4"
    start = window.start_sample()  # 2500 ms into the segment
    new_end = SEGMENT_START + samples(6200)
    # the window hears w4 again at its start (in the overlap), then its own words
    heard = [("w4", 0), ("x5", 540), ("x6", 1200), ("x7", 1800), ("x8", 3000)]
    text, words = window.view(transcript(heard, 3700), job(start, new_end))
    assert text == first_text + " x5 x6 x7 x8"
    assert words[5].start_ms == 1000 + 2500 + 540  # x5, in the session's timeline
    assert text.startswith(first_text)  # the committed words stay the text's prefix
    assert [w.word for w in words][:5] == first_text.split()
    assert all(a.end_ms <= b.start_ms for a, b in zip(words, words[1:], strict=False))
    # and the window moves on: x5 ends (where x6 starts, 3700 ms) before 6200 - 2000 ms
    assert [w.word for w in window.committed][-2:] == ["w4", "x5"]
    assert window.start_sample() > start


def test_a_word_heard_a_little_early_starts_where_the_committed_words_end() -> None:
    window = PartialWindow(SEGMENT_START, OPTIONS)
    end = SEGMENT_START + samples(5000)
    window.view(transcript(every_600_ms(8), 5000), job(SEGMENT_START, end))
    start = window.start_sample()  # 2500 ms in; the commit point is 3000 ms in
    # frame 4 + 8 starts at 480 ms of the window: 2980 ms, 20 ms before the commit point
    heard = [("w4", 0), ("x5", 480)]
    text, words = window.view(transcript(heard, 1500), job(start, end + samples(1000)))
    assert text == "w0 w1 w2 w3 w4 x5"
    assert words[5].start_ms == words[4].end_ms == 1000 + 3000


def test_a_whole_segment_decode_replaces_the_committed_words() -> None:
    """A speculative decode (the whole segment, it may become the final) is shown as it
    is, and the commits start again from its words."""
    window = PartialWindow(SEGMENT_START, OPTIONS)
    window.view(
        transcript(every_600_ms(8), 5000), job(SEGMENT_START, SEGMENT_START + samples(5000))
    )
    other = [(f"y{i}", 600 * i) for i in range(10)]
    text, _ = window.view(
        transcript(other, 6000), job(SEGMENT_START, SEGMENT_START + samples(6000))
    )
    assert text == " ".join(word for word, _ in other)
    # words ending by 6000 - 2000 ms: y5 ends at 3600 (where y6 starts)
    assert [w.word for w in window.committed] == ["y0", "y1", "y2", "y3", "y4", "y5"]


def test_a_transcript_without_timings_commits_nothing() -> None:
    window = PartialWindow(SEGMENT_START, OPTIONS)
    raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>some words here"
    t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=6000, decode_ms=0.0)
    text, _ = window.view(t, job(SEGMENT_START, SEGMENT_START + samples(6000)))
    assert text == "some words here"
    assert window.start_sample() == SEGMENT_START


def test_full_ms_zero_decodes_every_refresh_whole() -> None:
    window = PartialWindow(SEGMENT_START, PartialWindowOptions(full_ms=0))
    window.view(
        transcript(every_600_ms(12), 7000), job(SEGMENT_START, SEGMENT_START + samples(7000))
    )
    assert window.committed == () and window.start_sample() == SEGMENT_START


def test_a_speculative_decode_is_the_whole_segment_and_a_refresh_its_window() -> None:
    segment = OpenSegment(0, SEGMENT_START, OPTIONS)
    end = SEGMENT_START + samples(5000)
    partial = segment.partial_of(
        DecodeResult(job=job(SEGMENT_START, end), transcript=transcript(every_600_ms(8), 5000)),
        with_words=True,
    )
    assert partial is not None and partial.start_ms == 1000.0 and partial.words
    assert window_job_fields(segment, speculative=True) == (SEGMENT_START, None)
    start, segment_start = window_job_fields(segment, speculative=False)
    assert start > SEGMENT_START and segment_start == SEGMENT_START
    # a window's partial still starts where the segment does
    heard = [("w4", 0), ("x5", 540)]
    partial = segment.partial_of(
        DecodeResult(job=job(start, end + 1600), transcript=transcript(heard, 4100)),
        with_words=False,
    )
    assert partial is not None and partial.start_ms == 1000.0 and partial.words is None
    assert partial.text == "w0 w1 w2 w3 w4 x5" and partial.revision == 2
    assert partial.stable_text == "w0 w1 w2 w3 w4 "  # stable_prefix keeps the space
    assert partial.raw == "<|en|><|NEUTRAL|><|Speech|><|woitn|>w0 w1 w2 w3 w4 x5"


def test_a_sessions_long_segment_refreshes_a_bounded_window_and_its_final_is_whole() -> None:
    """Through a Session: 6.5 s of continuous speech answered by a decoder that times
    a word every 300 ms; past 3 s the refreshes decode about 2.8 s, every partial's text
    begins with the one before's committed words, and the final is the whole segment."""
    from streamer.core.protocol import Final, Partial, StreamOptions
    from streamer.core.session import Session, SessionOptions
    from tests.fakes import loudness_classifier, silence, tone

    session = Session("s", SessionOptions(), StreamOptions(), loudness_classifier())
    session.start()
    decoded: list[DecodeJob] = []
    messages = []
    pcm = np.concatenate([silence(300), tone(6500), silence(1500)]).tobytes()
    for at in range(0, len(pcm), 1920):  # 60 ms frames
        session.receive_audio(pcm[at : at + 1920])
        while jobs := session.jobs_to_submit():
            for j in jobs:
                decoded.append(j)
                audio_ms = j.pcm.size / 16
                # a word every 300 ms of the job's audio, named by its session time
                at_ms = [ms for ms in range(0, int(audio_ms) - 60, 300)]
                words = [(f"t{round(j.start_sample / 16 + ms)}", ms) for ms in at_ms]
                session.decode_finished(DecodeResult(job=j, transcript=transcript(words, audio_ms)))
        messages += session.messages_to_send()
    refreshes = [j for j in decoded if j.kind == "partial" and not j.speculative]
    finals = [j for j in decoded if j.kind == "final" or j.speculative]
    windowed = [j for j in refreshes if j.segment_start_sample is not None]
    assert windowed, "no refresh of the long segment was a window"
    assert max(j.pcm.size for j in windowed) <= samples(3500)
    assert all(j.start_sample > j.segment_start_sample for j in windowed)
    assert max(j.pcm.size for j in refreshes) < max(j.end_sample - j.start_sample for j in finals)
    segment_start = refreshes[0].start_sample
    assert all(j.start_sample == segment_start for j in finals)  # finals: the whole segment
    partials = [m for m in messages if isinstance(m, Partial)]
    assert all(p.start_ms == segment_start / 16 for p in partials)
    # a window's own first word is named by its later start: the text keeps the segment's
    first_word = partials[0].text.split()[0]
    assert all(p.text.split()[0] == first_word for p in partials)
    assert all(p.text.startswith(p.stable_text) for p in partials)
    assert [m for m in messages if isinstance(m, Final)]
