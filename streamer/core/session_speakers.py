"""One diarized stream's speakers: jobs for the speaker models, finals held for their
labels (I/O-free).

A session with the stream option ``diarize`` owns a :class:`SessionSpeakers`. When a
segment closes, :meth:`segment_closed` queues a :class:`SpeakerJob` with the segment's
audio (the transport sends it to the speaker models, in parallel with the final's
decode); in a pause that may close it, :meth:`speculate` sends the audio at once, as
the final's speculative decode does, and a closing on exactly that audio needs no
second job (an answer for other audio is told by its length and ignored). While a
segment is still spoken, :meth:`grow` offers its audio so far at each new whole window
(:meth:`early_job`), so that the models embed those windows before it ends (only where
they embed windows end to end, ``change_windows`` off). When the
final's transcript is ready, :meth:`label` returns it labelled if the speakers' answer
is there, or holds it; :meth:`analysed` gives the answer (or None: the
models failed, were full, or were later than the server's bound) and returns a held
final, labelled as far as the answer allows. Labels are assigned when a final is
labelled, in the order finals are completed, by one :class:`SpeakerTracker`: once a final
is sent, nothing here changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.diarization import (
    DiarizationOptions,
    SpeakerAnalysis,
    SpeakerTracker,
    closed_windows,
    main_speaker,
    speaker_label,
    speaker_turns,
    word_speaker,
)
from streamer.core.open_segment import OpenSegment
from streamer.core.protocol import Final, SpeakerTurn, SpeakerWord, StreamOptions
from streamer.core.segmenter import SegmentEnd
from streamer.core.words import join_words

_PENDING = None  # a closed segment whose speakers are not known yet


@dataclass(frozen=True, eq=False)
class SpeakerJob:
    """One closed segment's audio for the speaker models."""

    session_id: str
    segment_id: int
    pcm: np.ndarray  # 16 kHz mono int16, the segment's audio as the final decodes it
    start_sample: int  # where it begins in the session's timeline
    background: bool = False  # a file upload's: no latency bound worth the name
    # the audio so far of a segment still open: the models embed the windows it holds
    # whole, ahead of its end, and answer nothing
    early: bool = False


@dataclass(frozen=True, eq=False)
class KnownSpeaker:
    """A speaker known before the stream starts: a name and its voice's embedding."""

    name: str
    embedding: np.ndarray  # unit length
    speech_samples: int  # the solo speech behind it (its weight against new evidence)


def reference_job(index: int, pcm_s16le: bytes) -> SpeakerJob:
    """The speaker job of a known speaker's reference sample (16 kHz s16le bytes)."""
    pcm = np.frombuffer(pcm_s16le, dtype="<i2").astype(np.int16)
    return SpeakerJob("known", -1 - index, pcm, 0)


def known_speaker(name: str, analysis: SpeakerAnalysis | None) -> KnownSpeaker | None:
    """The main voice of a reference's analysis, or None when it holds too little speech."""
    voices = [s for s in analysis.speakers if s.embedding is not None] if analysis else []
    if not voices:
        return None
    main = max(voices, key=lambda s: s.solo_samples)
    assert main.embedding is not None
    return KnownSpeaker(name, main.embedding, main.solo_samples)


class SpeakerAnalyser(Protocol):
    """The speaker models seen from a caller that waits for them (offline transcription)."""

    def analyse(self, segment_id: int, pcm: np.ndarray) -> SpeakerAnalysis: ...


class SpeakerQueue(Protocol):
    """Where the transport sends speaker jobs (``model/speakers/worker.SpeakerWorker``)."""

    def submit(
        self, job: SpeakerJob, callback: Callable[[SpeakerJob, SpeakerAnalysis | None], None]
    ) -> bool: ...


class SessionSpeakers:
    """The speaker side of one diarized session. See the module docstring."""

    def __init__(
        self,
        session_id: str,
        stream: StreamOptions,
        options: DiarizationOptions,
        *,
        background: bool = False,
        names: dict[int, str] | None = None,
    ) -> None:
        self.session_id = session_id
        self.background = background
        self.options = replace(
            options, min_speakers=stream.min_speakers, max_speakers=stream.max_speakers
        )
        self.tracker = SpeakerTracker(self.options)
        self.names = dict(names or {})  # enrolled speakers' labels
        self._jobs: list[SpeakerJob] = []
        self._answers: dict[int, SpeakerAnalysis | None | bool] = {}  # False: given up
        self._held: dict[int, Final] = {}  # finals waiting for their speakers
        self._starts: dict[int, int] = {}  # segment -> its first sample
        self._lengths: dict[int, int] = {}  # closed segment -> its samples
        self._speculated: dict[int, tuple[int, int]] = {}  # open segment -> (start, samples)
        self._early_windows: dict[int, int] = {}  # open segment -> whole windows sent early
        self._early: SpeakerJob | None = None

    def jobs_to_submit(self) -> list[SpeakerJob]:
        out, self._jobs = self._jobs, []
        return out

    def early_job(self) -> SpeakerJob | None:
        """The open segment's latest early job, if not taken yet (see :meth:`grow`): a
        caller that waits for its analyses at once may leave it, only the newest is kept."""
        job, self._early = self._early, None
        return job

    def enrol(self, known: KnownSpeaker) -> None:
        """A known speaker: matched like the others, labelled with its name."""
        self.names[self.tracker.enrol(known.embedding, known.speech_samples)] = known.name

    @property
    def held(self) -> list[int]:
        """Segments whose final is ready and waits for its speakers (the transport's
        bound on that wait starts now)."""
        return list(self._held)

    def grow(
        self, segment: OpenSegment, end_sample: int, audio: Callable[[int, int], np.ndarray]
    ) -> None:
        """The open segment reaches ``end_sample``: when it holds another whole window,
        its audio so far (``audio(start, end)``) goes to the speaker models, which embed
        the closed windows now, so that at its end only the tail is left to analyse.
        Uploads, which do not wait for a pause, skip it, and so does every session when
        the models pick their windows from the segmentation at the end
        (``change_windows``): they embed nothing early, and the copy would be waste."""
        if self.background or self.options.change_windows:
            return
        windows = closed_windows(end_sample - segment.start_sample)
        if windows <= self._early_windows.get(segment.segment_id, 0):
            return
        self._early_windows = {segment.segment_id: windows}  # the open segment's only
        pcm = audio(segment.start_sample, end_sample)
        self._early = SpeakerJob(
            self.session_id, segment.segment_id, pcm, segment.start_sample, early=True
        )

    def speculate(self, segment: OpenSegment, pcm: np.ndarray) -> None:
        """A pause that may end the open segment: analyse what it holds now, so that the
        answer is ready when the segment closes there (as its final's decode is)."""
        self._speculated[segment.segment_id] = (segment.start_sample, len(pcm))
        self._answers[segment.segment_id] = _PENDING
        self._jobs.append(
            SpeakerJob(
                self.session_id, segment.segment_id, pcm, segment.start_sample, self.background
            )
        )

    def segment_closed(self, event: SegmentEnd, pcm: np.ndarray) -> None:
        """A closed segment: its audio to the speaker models, unless the speculation in
        its pause already sent exactly this audio."""
        segment_id = event.segment_id
        self._starts[segment_id] = event.start_sample
        self._lengths[segment_id] = len(pcm)
        answer = self._answers.get(segment_id)
        if self._speculated.pop(segment_id, None) == (event.start_sample, len(pcm)):
            if answer is _PENDING or isinstance(answer, SpeakerAnalysis):
                return  # the speculation's answer is this segment's
        self._answers[segment_id] = _PENDING
        self._jobs.append(
            SpeakerJob(self.session_id, segment_id, pcm, event.start_sample, self.background)
        )

    def label(self, final: Final) -> Final | None:
        """``final`` labelled, or None while its speakers are still being analysed."""
        segment_id = final.segment_id
        if segment_id not in self._answers:  # not closed through segment_closed
            return final
        answer = self._answers[segment_id]
        if answer is _PENDING:
            self._held[segment_id] = final
            return None
        del self._answers[segment_id]
        return self._labelled(final, answer if isinstance(answer, SpeakerAnalysis) else None)

    def analysed(self, segment_id: int, analysis: SpeakerAnalysis | None) -> Final | None:
        """The speaker models' answer (None: none); a held final, now to be sent."""
        if self._answers.get(segment_id, False) is not _PENDING:
            return None  # already answered or given up: a late answer changes nothing
        expected = self._lengths.get(segment_id)
        if expected is None and segment_id in self._speculated:
            expected = self._speculated[segment_id][1]  # the latest pause's audio
        if analysis is not None and expected is not None and analysis.samples != expected:
            return None  # a speculation of audio the segment did not end with
        final = self._held.pop(segment_id, None)
        if final is None:
            self._answers[segment_id] = analysis if analysis is not None else False
            return None
        del self._answers[segment_id]
        return self._labelled(final, analysis)

    def forget(self, segment_id: int) -> None:
        """A segment whose final will never come (the session ended without it)."""
        for table in (self._answers, self._held, self._starts, self._lengths, self._speculated):
            table.pop(segment_id, None)

    def _labelled(self, final: Final, analysis: SpeakerAnalysis | None) -> Final:
        self._lengths.pop(final.segment_id, None)
        start = self._starts.pop(final.segment_id, 0)
        if analysis is None or final.error is not None:
            return final
        mapping = self.tracker.assign(analysis)
        changes = self.tracker.changes(analysis, mapping)
        turns = speaker_turns(analysis, mapping, self.options, changes)
        speaker = main_speaker(turns)
        if speaker is None:
            speaker = self.tracker.last_speaker
            if speaker is None:
                return replace(final, turns=())
            turns = []
        self.tracker.last_speaker = speaker
        origin_ms = start * 1000 / SAMPLE_RATE
        words = []
        for w in final.words or ():
            a, b = _sample(w.start_ms - origin_ms), _sample(w.end_ms - origin_ms)
            who = word_speaker(turns, a, b) if turns else speaker
            words.append(SpeakerWord(w.word, w.start_ms, w.end_ms, w.confidence, self._name(who)))
        return replace(
            final,
            words=tuple(words),
            speaker=self._name(speaker),
            turns=tuple(
                SpeakerTurn(
                    round(origin_ms + t.start * 1000 / SAMPLE_RATE, 1),
                    round(origin_ms + t.end * 1000 / SAMPLE_RATE, 1),
                    self._name(t.speaker),
                )
                for t in turns
            ),
        )

    def _name(self, speaker: int | None) -> str:
        if speaker is None:
            return ""
        return self.names.get(speaker) or speaker_label(speaker)


def _sample(ms: float) -> int:
    return int(round(ms * SAMPLE_RATE / 1000))


def speaker_parts(final: Final) -> list[Final]:
    """A diarized final cut where its speaker changes: one final per run of one
    speaker's words (its text those words joined, its ``speaker`` theirs), for captions
    and segments per speaker. A final without speakers, or with one, is itself."""
    words = final.words or ()
    labels = [final.word_speaker(i) for i in range(len(words))]
    runs = speaker_runs(labels)
    if final.speaker is None or len(runs) <= 1:
        return [
            final if not labels or final.speaker == labels[0] else replace(final, speaker=labels[0])
        ]
    return [
        replace(
            final,
            start_ms=final.start_ms if start == 0 else words[start].start_ms,
            end_ms=final.end_ms if end == len(words) else words[end - 1].end_ms,
            text=join_words(words[start:end]),
            words=words[start:end],
            speaker=labels[start],
            turns=None,
        )
        for start, end in runs
    ]


def speaker_runs(labels: Sequence[object]) -> list[tuple[int, int]]:
    """Where the speaker changes: the ``[start, end)`` index ranges of the runs of equal
    ``labels`` (one per word), in order; none for no labels."""
    if not labels:
        return []
    changes = [i for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
    return list(zip([0, *changes], [*changes, len(labels)], strict=True))
