"""Utterance segmentation over per-frame voice-activity flags (I/O-free).

The :class:`Segmenter` is a state machine fed one ``(is_speech, energy)`` pair per frame.
It never sees audio or clocks: time is the frame count, so its tests are lists of
booleans. It reports :class:`SegmentStart` and :class:`SegmentEnd` events with absolute
sample indices; the caller keeps the audio and slices it.

Rules:

* **Onset**: speech is confirmed once ``min_speech_ms`` (100 ms) of speech frames fall within the
  last ``onset_window_ms``; shorter blips never produce a start.
* **Pre-roll**: the segment starts ``pre_roll_ms`` before the first speech frame of that
  window (never before the previous segment's end), so the first syllable is kept.
* **Endpoint**: ``endpoint_ms`` of consecutive non-speech ends the segment, which then
  ends ``end_pad_ms`` after its last speech frame.
* **Long segments end at the first pause**: once a segment is ``long_segment_ms`` long,
  ``long_endpoint_ms`` of non-speech (a breath between phrases) ends it, so people who
  talk without stopping get segments cut at pauses and the hard cap stays the exception.
  The VAD's hangover hides pauses of 100-200 ms, so a long segment also ends at an
  **energy dip**: ``pause_dip_ms`` of frames quieter than the geometric middle between
  the stream's noise floor (the 5th percentile of the last ``floor_window_ms``) and the
  segment's speech level (the median energy of its speech frames), measured when the two
  are at least ``pause_contrast_db`` apart. The segment ends at the dip's last frame;
  for ``endpoint_ms`` after it (or until the next segment starts), frames quieter than
  that middle do not count as speech for an onset, so the VAD's hangover over the rest
  of the dip does not open an empty segment (and a quieter speaker is still heard later).
* **Finalize**: the client says the utterance is over. The open segment ends as soon as
  the audio shows ``end_pad_ms`` of non-speech after its last speech (at once when it
  already does), at the sample where the silence endpoint would have ended it: a
  ``finalize`` sent while the speaker is still talking never splits a word; it ends the
  segment at the next ``end_pad_ms`` pause, even one the endpoint would have bridged
  (so a finalize after every chunk acts as an ``end_pad_ms`` endpoint). With no segment
  open it does nothing (speech that has begun but is not confirmed yet stays in the
  onset window).
* **Hard cap**: a segment reaching ``max_utterance_ms`` is cut at the quietest point of
  its last ``cut_search_ms`` (near "now", so the next segment does not start in the
  past); the next segment starts at exactly that sample, so consecutive segments tile
  the audio.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.order_stats import SortedWindow, median_of_sorted, percentile_of_sorted
from streamer.errors import ConfigError

EndReason = Literal["silence", "max_duration", "finalize", "stop"]
VALID_FRAME_MS = (10, 20, 30)  # the frame lengths webrtcvad accepts


@dataclass(frozen=True)
class SegmenterOptions:
    """Segmentation timing. Every duration is rounded to whole frames."""

    sample_rate: int = SAMPLE_RATE  # Hz of the samples the indices count
    frame_ms: int = 20  # VAD frame length: 10, 20 or 30
    onset_window_ms: int = 300  # window in which speech must accumulate to start a segment
    min_speech_ms: int = 100  # speech needed within the onset window; shorter blips dropped
    pre_roll_ms: int = 300  # audio kept before the first speech frame
    endpoint_ms: int = 500  # trailing non-speech that ends a segment
    end_pad_ms: int = 200  # audio kept after the last speech frame (at most endpoint_ms)
    max_utterance_ms: int = 7000  # hard cap on a segment's length
    long_segment_ms: int = 4000  # from this length on, a shorter pause ends the segment
    long_endpoint_ms: int = 100  # that pause, as webrtcvad sees it (about 230 ms of silence)
    pause_dip_ms: int = 60  # in a long segment, this much quiet ends it (0: only the VAD)
    pause_contrast_db: float = 10.0  # speech level over noise floor needed to trust dips
    floor_window_ms: int = 10000  # the noise floor is measured over this much recent audio
    cut_search_ms: int = 400  # a capped segment is cut at the quietest point of this tail
    quiet_window_ms: int = 60  # energy is averaged over this span when looking for the cut

    def __post_init__(self) -> None:
        if self.frame_ms not in VALID_FRAME_MS:
            raise ConfigError(f"frame_ms must be one of {VALID_FRAME_MS}, got {self.frame_ms}")
        if not 0 < self.min_speech_ms <= self.onset_window_ms:
            raise ConfigError("need 0 < min_speech_ms <= onset_window_ms")
        if self.endpoint_ms < self.frame_ms:
            raise ConfigError("endpoint_ms must be at least one frame")
        if not 0 < self.cut_search_ms < self.max_utterance_ms:
            raise ConfigError("need 0 < cut_search_ms < max_utterance_ms")
        if self.max_utterance_ms < 1000:
            raise ConfigError("max_utterance_ms must be at least 1000")
        if self.long_endpoint_ms <= 0 or self.long_segment_ms <= 0:
            raise ConfigError("long_endpoint_ms and long_segment_ms must be positive")
        if self.pause_dip_ms < 0 or self.pause_contrast_db < 0 or self.floor_window_ms <= 0:
            raise ConfigError(
                "need pause_dip_ms >= 0, pause_contrast_db >= 0 and floor_window_ms > 0"
            )
        if self.pre_roll_ms < 0 or self.end_pad_ms < 0:
            raise ConfigError("pre_roll_ms and end_pad_ms must not be negative")

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * self.frame_ms // 1000

    def frames(self, ms: int) -> int:
        """``ms`` as a whole number of frames (at least one for a positive duration)."""
        return max(1, round(ms / self.frame_ms)) if ms > 0 else 0


@dataclass(frozen=True)
class SegmentStart:
    segment_id: int
    start_sample: int


@dataclass(frozen=True)
class SegmentEnd:
    segment_id: int
    start_sample: int
    end_sample: int
    reason: EndReason


SegmentEvent = SegmentStart | SegmentEnd
_LEVEL_EVERY_FRAMES = 10  # the dip threshold is re-estimated this often
_MIN_LEVEL_FRAMES = 25  # speech frames a segment needs before its level is trusted


class Segmenter:
    """Turns per-frame speech flags into utterance boundaries. See the module docstring."""

    def __init__(self, options: SegmenterOptions | None = None) -> None:
        self.options = options or SegmenterOptions()
        o = self.options
        self._frame = o.frame_samples
        self._onset_frames = o.frames(o.onset_window_ms)
        self._min_speech_frames = o.frames(o.min_speech_ms)
        self._pre_roll_frames = o.frames(o.pre_roll_ms)
        self._endpoint_frames = o.frames(o.endpoint_ms)
        self._end_pad_frames = min(o.frames(o.end_pad_ms), self._endpoint_frames)
        self._max_frames = o.max_utterance_ms * o.sample_rate // 1000 // self._frame
        self._long_frames = o.long_segment_ms * o.sample_rate // 1000 // self._frame
        self._long_endpoint_frames = min(o.frames(o.long_endpoint_ms), self._endpoint_frames)
        self._cut_search_frames = o.frames(o.cut_search_ms)
        self._quiet_frames = max(1, o.frames(o.quiet_window_ms))
        self._dip_frames = o.frames(o.pause_dip_ms)
        self._contrast = 10 ** (o.pause_contrast_db / 10)

        self._frame_index = 0  # frames seen so far
        self._next_id = 0
        self._floor_frame = 0  # no segment may start before this frame (previous end)
        self._window: deque[bool] = deque(maxlen=self._onset_frames)
        # open segment state
        self._open_id: int | None = None
        self._start_frame = 0
        self._last_speech_frame = 0  # index of the last speech frame + 1
        self._silence_frames = 0
        self._energies: list[float] = []  # per frame since _start_frame
        self._finalize_pending = False  # end the open segment at its next end_pad pause
        # energy dips (see the module docstring)
        self._history = SortedWindow(max(1, o.frames(o.floor_window_ms)))
        self._speech_energies: list[float] = []  # of the open segment's speech frames, sorted
        self._dip_threshold: float | None = None  # None: no contrast, dips not trusted
        self._dip_run = 0  # consecutive frames below the threshold
        self._gate: float | None = None  # after a dip: onset ignores quieter frames
        self._gate_frames = 0  # for this many frames

    # -- queries ---------------------------------------------------------------

    @property
    def in_segment(self) -> bool:
        return self._open_id is not None

    @property
    def open_segment_id(self) -> int | None:
        return self._open_id

    @property
    def open_start_sample(self) -> int | None:
        return None if self._open_id is None else self._start_frame * self._frame

    @property
    def last_speech_sample(self) -> int:
        """End of the last frame classified as speech in the open segment."""
        return self._last_speech_frame * self._frame

    @property
    def position_sample(self) -> int:
        """Samples consumed so far (always a whole number of frames)."""
        return self._frame_index * self._frame

    @property
    def tentative_end_sample(self) -> int | None:
        """Where the open segment ends if no more speech comes, once that is certain.

        Set while the open segment is in a pause long enough to hold its end padding
        (the audio up to the end is then all here); None otherwise. A caller may decode
        ``[open_start_sample, tentative_end_sample)`` ahead of the endpoint: if the
        segment then ends by silence at exactly that sample, that decode is its final.
        """
        if self._open_id is None or self._silence_frames == 0:
            return None
        pad = min(self._end_pad_frames, self._endpoint_now())
        if self._silence_frames < pad:
            return None
        return (self._last_speech_frame + pad) * self._frame

    @property
    def pause_possible(self) -> bool:
        """The open segment is long and its last frame was quiet: a dip may be starting.

        A partial decode started now would likely delay the final that follows."""
        return self._dip_run > 0 and self._is_long()

    @property
    def keep_from_sample(self) -> int:
        """Audio before this sample will never be part of a segment again."""
        if self._open_id is not None:
            return self._start_frame * self._frame
        earliest = self._frame_index - self._onset_frames - self._pre_roll_frames
        return max(self._floor_frame, earliest, 0) * self._frame

    # -- input -----------------------------------------------------------------

    def push(self, is_speech: bool, energy: float = 0.0) -> list[SegmentEvent]:
        """Consume one frame; returns the events it caused (in order)."""
        events: list[SegmentEvent] = []
        index = self._frame_index
        self._frame_index += 1
        if self._dip_frames:
            self._history.push(energy)
        if self._open_id is None:
            if self._gate is not None:
                self._gate_frames -= 1
                if energy < self._gate:
                    is_speech = False
                if self._gate_frames <= 0:
                    self._gate = None
            self._window.append(is_speech)
            if sum(self._window) >= self._min_speech_frames:
                first_speech = index - len(self._window) + 1 + self._window.index(True)
                start = max(first_speech - self._pre_roll_frames, self._floor_frame, 0)
                events.append(self._open(start, energies_from=start))
                self._last_speech_frame = index + 1
            return events

        self._energies.append(energy)
        if self._dip_frames and self._dip(is_speech, energy):
            events.append(self._close(self._frame_index * self._frame, "silence"))
            self._gate = self._dip_threshold
            self._gate_frames = self._endpoint_frames  # longer than any VAD hangover
            return events
        if is_speech:
            self._last_speech_frame = index + 1
            self._silence_frames = 0
        else:
            self._silence_frames += 1
            endpoint = self._endpoint_now()
            pad = min(self._end_pad_frames, endpoint)
            if self._finalize_pending and self._silence_frames >= pad:
                end = self._last_speech_frame + pad
                events.append(self._close(end * self._frame, "finalize"))
                return events
            if self._silence_frames >= endpoint:
                end = min(self._last_speech_frame + pad, self._frame_index)
                events.append(self._close(end * self._frame, "silence"))
                return events
        if self._frame_index - self._start_frame >= self._max_frames:
            events.extend(self._cut())
        return events

    def finalize(self) -> list[SegmentEvent]:
        """The client ended the utterance: see *Finalize* in the module docstring.

        Returns the segment's end when the audio so far already ends in ``end_pad_ms``
        of non-speech; otherwise the end comes from a later :meth:`push`.
        """
        if self._open_id is None:
            return []
        self._finalize_pending = True
        pad = min(self._end_pad_frames, self._endpoint_now())
        if self._silence_frames >= pad:
            end = self._last_speech_frame + pad
            return [self._close(end * self._frame, "finalize")]
        return []

    def flush(self, reason: EndReason, end_sample: int | None = None) -> list[SegmentEvent]:
        """End the open segment now, at the current position; no-op when none is open.

        For ``stop``, and for the compatible protocols' immediate finalize. ``end_sample``
        may extend the segment past the last whole frame (the stream's final partial
        frame on ``stop``). With no segment open the onset window is kept: speech that
        has begun but is not confirmed yet still becomes a segment.
        """
        if self._open_id is None:
            return []
        end = self.position_sample if end_sample is None else max(end_sample, self.position_sample)
        return [self._close(end, reason)]

    # -- internals -------------------------------------------------------------

    def _is_long(self) -> bool:
        return self._frame_index - self._start_frame >= self._long_frames

    def _endpoint_now(self) -> int:
        """Frames of non-speech that end the open segment at its current length."""
        return self._long_endpoint_frames if self._is_long() else self._endpoint_frames

    def _dip(self, is_speech: bool, energy: float) -> bool:
        """Track the open segment's energy dips; True when one ends the segment now."""
        if is_speech:
            insort(self._speech_energies, energy)
        if self._frame_index % _LEVEL_EVERY_FRAMES == 0:
            self._dip_threshold = self._estimate_threshold()
        threshold = self._dip_threshold
        if threshold is None or energy >= threshold:
            self._dip_run = 0
            return False
        self._dip_run += 1
        return self._dip_run >= self._dip_frames and self._is_long()

    def _estimate_threshold(self) -> float | None:
        """The geometric middle of noise floor and speech level, or None without contrast."""
        if len(self._speech_energies) < _MIN_LEVEL_FRAMES:
            return None
        # exactly np.percentile(history, 5) and np.median(speech), from sorted copies
        floor = max(percentile_of_sorted(self._history.sorted, 5), 1.0)
        level = median_of_sorted(self._speech_energies)
        if level < floor * self._contrast:
            return None
        return math.sqrt(floor * level)

    def _open(self, start_frame: int, energies_from: int) -> SegmentStart:
        self._open_id = self._next_id
        self._next_id += 1
        self._start_frame = start_frame
        self._silence_frames = 0
        self._gate = None
        self._speech_energies = []
        self._dip_threshold = None
        self._dip_run = 0
        # energies of frames already consumed are unknown before the start; treat as loud
        # so the cut search never picks pre-roll it could not measure
        self._energies = [float("inf")] * (self._frame_index - energies_from)
        return SegmentStart(self._open_id, start_frame * self._frame)

    def _close(self, end_sample: int, reason: EndReason) -> SegmentEnd:
        assert self._open_id is not None
        event = SegmentEnd(self._open_id, self._start_frame * self._frame, end_sample, reason)
        self._open_id = None
        self._finalize_pending = False
        self._floor_frame = -(-end_sample // self._frame)  # ceil: whole frames after the end
        self._window.clear()
        self._energies = []
        self._speech_energies = []
        self._dip_run = 0
        return event

    def _cut(self) -> list[SegmentEvent]:
        """Cut the capped segment at the quietest point of its tail; continue after it."""
        energies = np.asarray(self._energies, dtype=np.float64)
        n = energies.size
        lo = max(1, n - self._cut_search_frames)
        smooth = np.convolve(
            np.nan_to_num(energies, posinf=np.finfo(np.float64).max / 16),
            np.ones(self._quiet_frames) / self._quiet_frames,
            mode="same",
        )
        cut_offset = lo + int(np.argmin(smooth[lo:n]))  # frames after the segment start
        cut_frame = self._start_frame + cut_offset
        segment_id = self._open_id
        assert segment_id is not None
        end = SegmentEnd(
            segment_id, self._start_frame * self._frame, cut_frame * self._frame, "max_duration"
        )
        # the rest continues as the next segment, starting exactly at the cut
        self._open_id = self._next_id
        self._next_id += 1
        self._start_frame = cut_frame
        self._energies = self._energies[cut_offset:]
        self._speech_energies = []
        self._dip_threshold = None
        self._dip_run = 0
        return [end, SegmentStart(self._open_id, cut_frame * self._frame)]
