"""Refreshes of a long segment's partial at a bounded cost (I/O-free policy, issue 31).

The encoder's cost grows with the audio it decodes (random:small int8, one thread: about
40 ms plus 37 ms per second), and a segment's partial used to decode the segment from its
first sample every time, so a refresh of a 7 s segment cost as much as its final and held
the worker while other sessions' first partials waited. A refresh now decodes a bounded
trailing window once the segment is longer than ``full_ms``:

- Every partial result **commits** the words that end at least ``keep_ms`` before its
  end (words that later audio rarely changes); later refreshes keep them as the text's
  prefix and decode only from ``overlap_ms`` before the last committed word's end
  (the audio of the word that follows it starts there), so a refresh decodes at most
  about ``keep_ms + overlap_ms`` plus the audio that arrived since the last one.
- Of a window's words those that start before the commit point (less half an encoder
  frame) are the committed words heard again and are dropped; the text is the committed
  words and the window's other words, joined as :func:`~streamer.core.words.join_words`
  joins a transcript's.
- A decode of the whole segment (a short segment's, or a speculative decode, which
  becomes the final) is taken as it is, and its words are committed afresh.

Finals always decode the whole segment: a partial is a preview, the final is the answer.
A transcript without token timings (a backend that reports none) commits nothing, so
its segment is always decoded whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from streamer.core.audio import SAMPLE_RATE
from streamer.core.jobs import DecodeJob, samples_ms
from streamer.core.protocol import Word
from streamer.core.transcript import Transcript
from streamer.core.words import FRAME_MS, join_words, transcript_words

# a window starts on a filterbank hop (10 ms), so its features are a slice of the
# segment's (the model's feature cache reuses them)
HOP_SAMPLES = SAMPLE_RATE // 100
_LEADING_TAGS = re.compile(r"^(?:<\|[^|<>]*\|>)*")


@dataclass(frozen=True)
class PartialWindowOptions:
    """How long segments' refreshes are bounded; ``full_ms=0`` decodes every refresh whole."""

    full_ms: int = 3000  # refreshes of a segment up to this long decode all of it
    keep_ms: int = 2000  # the words of a result's last keep_ms stay open to revision
    overlap_ms: int = 500  # a window starts this long before the last committed word's end

    @property
    def enabled(self) -> bool:
        return self.full_ms > 0


class PartialWindow:
    """One open segment's committed words and where its next refresh starts."""

    def __init__(self, segment_start_sample: int, options: PartialWindowOptions) -> None:
        self.segment_start_sample = segment_start_sample
        self.options = options
        self.committed: tuple[Word, ...] = ()
        self.commit_sample = segment_start_sample  # where the committed words end

    def start_sample(self) -> int:
        """Where the next refresh's audio starts: the segment's start until words are
        committed, then ``overlap_ms`` before their end, on a filterbank hop."""
        if not self.committed:
            return self.segment_start_sample
        overlap = self.options.overlap_ms * SAMPLE_RATE // 1000
        start = max(self.segment_start_sample, self.commit_sample - overlap)
        return start - (start - self.segment_start_sample) % HOP_SAMPLES

    def view(self, transcript: Transcript, job: DecodeJob) -> tuple[str, tuple[Word, ...]]:
        """The partial's text and words from ``job``'s result (the whole segment or a
        window of it); commits the words that are old enough."""
        words = transcript_words(
            transcript, samples_ms(job.start_sample), samples_ms(job.end_sample)
        )
        if job.start_sample <= self.segment_start_sample:  # the whole segment
            text, all_words = transcript.text, words
            self.committed = ()  # committed afresh from this decode
        else:
            commit_ms = samples_ms(self.commit_sample)
            kept = (w for w in words if w.start_ms >= commit_ms - FRAME_MS / 2)
            # a word heard up to half a frame early starts where the committed ones end
            all_words = self.committed + tuple(_not_before(w, commit_ms) for w in kept)
            text = join_words(all_words)
        self._commit(all_words, job.end_sample, bool(words) or not transcript.text)
        return text, all_words

    def _commit(self, words: tuple[Word, ...], end_sample: int, timed: bool) -> None:
        options = self.options
        full = options.full_ms * SAMPLE_RATE // 1000
        if not options.enabled or not timed or end_sample - self.segment_start_sample <= full:
            self.committed, self.commit_sample = (), self.segment_start_sample
            return
        limit_ms = samples_ms(end_sample) - options.keep_ms
        n = 0
        while n < len(words) and words[n].end_ms <= limit_ms:
            n += 1
        if n and n >= len(self.committed):  # commits only grow between whole decodes
            self.committed = words[:n]
            self.commit_sample = round(words[n - 1].end_ms * SAMPLE_RATE / 1000)
        elif not self.committed:
            self.commit_sample = self.segment_start_sample


def _not_before(word: Word, ms: float) -> Word:
    if word.start_ms >= ms:
        return word
    return replace(word, start_ms=ms, end_ms=max(word.end_ms, ms))


def raw_of(transcript: Transcript, text: str) -> str:
    """The tagged output for a partial's ``text``: the model's own for a whole decode,
    the window's leading tags and ``text`` for a window (whose raw holds only its words)."""
    if text == transcript.text:
        return transcript.raw
    tags = _LEADING_TAGS.match(transcript.raw)
    return (tags.group(0) if tags else "") + text
