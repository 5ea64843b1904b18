"""Features of a growing segment, each sample's filterbank computed once.

A segment is decoded again and again while it grows (a partial every few hundred
milliseconds, then its final), always from its first sample. From scratch, its
features cost about 2 ms per second of audio *every time* (13.6 ms for a 7 s partial,
bench/RESULTS.md), so at hundreds of streams the worker would spend seconds per second
re-computing filterbanks it already had. :class:`FeatureCache` keeps, per session, the
filterbank frames of the segment being decoded: a job feeds only the samples that
arrived since the previous job of its segment, and reuses the frames it has (a final
shorter than the last partial, cut at a quiet point, takes a prefix of them). Only the
cheap part is redone per job: LFR stacking and CMVN over the frames (the last LFR
frames depend on where the audio ends).

The result is bit for bit :class:`~streamer.model.decode.frontend.Frontend`'s from scratch
(tests/test_features.py): a filterbank frame depends on the samples of its own 25 ms
window only, and kaldi-native-fbank computes it the same way whether the audio came in
one piece or many.

Thread safety: :meth:`FeatureCache.features` is called by the model worker's thread
only; :meth:`FeatureCache.forget` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from streamer.core.jobs import DecodeJob
from streamer.model.decode.frontend import (
    SHIFT_SAMPLES,
    WINDOW_SAMPLES,
    Frontend,
    OnlineFbank,
    fbank_frames,
)
from streamer.model.sensevoice import SAMPLE_RATE

logger = logging.getLogger(__name__)

# open segments kept (one per session); a 7 s segment's frames are ~225 kB, so the bound
# is ~230 MB at worst. A session past it recomputes its segment from scratch: slower,
# never wrong.
DEFAULT_MAX_SEGMENTS = 1024


@dataclass
class FeatureStats:
    """What the cache saved, in samples (for the bench and the tests)."""

    computed_samples: int = 0  # samples fed to a filterbank
    reused_samples: int = 0  # samples whose frames came from the cache
    restarts: int = 0  # segments whose cached audio did not continue (recomputed)


class _OpenSegment:
    """The filterbank frames of one segment so far, and the computer that makes more."""

    def __init__(self, segment: tuple[int, int], computer: OnlineFbank, n_mels: int) -> None:
        self.segment = segment  # (segment_id, start_sample): which audio this is
        self._computer = computer
        self.fed_samples = 0  # samples fed to the computer
        self._last_fed = 0.0  # the last sample fed: a cheap check that audio continues
        self._frames = np.empty((0, n_mels), np.float32)
        self._count = 0  # frames ready in _frames

    def continues(self, waveform: np.ndarray, offset: int = 0) -> bool:
        """Whether ``waveform`` (the segment's audio from sample ``offset``) holds the
        audio fed so far where the two overlap (checked at the last sample fed; the
        session never rewrites a segment's samples, so this catches bugs)."""
        last = self.fed_samples - offset - 1  # the last sample fed, in waveform
        if offset > self.fed_samples or offset % SHIFT_SAMPLES:
            return False  # a gap, or a window off the filterbank's hops
        if last < 0 or last >= waveform.size:
            return True  # nothing fed yet, or a shorter final: a prefix of our frames
        return bool(waveform[last] == self._last_fed)

    def frames(self, waveform: np.ndarray, offset: int = 0) -> np.ndarray:
        """The fbank frames of ``waveform``: the segment from its first sample, or from
        sample ``offset`` (on a hop: a refresh's window, core/partial_window.py)."""
        end = offset + waveform.size
        if end > self.fed_samples:
            self._computer.accept_waveform(
                float(SAMPLE_RATE), waveform[self.fed_samples - offset :] * np.float32(32768)
            )
            self.fed_samples = end
            self._last_fed = float(waveform[-1])
            self._collect()
        first = offset // SHIFT_SAMPLES
        return self._frames[first : first + fbank_frames(waveform.size)]

    def _collect(self) -> None:
        ready = self._computer.num_frames_ready
        if ready <= self._count:
            return
        if ready > self._frames.shape[0]:
            rows = max(ready, 2 * self._frames.shape[0])
            grown = np.empty((rows, self._frames.shape[1]), np.float32)
            grown[: self._count] = self._frames[: self._count]
            self._frames = grown
        for index in range(self._count, ready):
            self._frames[index] = self._computer.get_frame(index)
        self._computer.pop(ready)  # the computer keeps no frame we hold
        self._count = ready


class FeatureCache:
    """SenseVoice features of decode jobs, computed incrementally per session's segment.

    One open segment per session is kept: a job of another segment (or at another start)
    replaces it, a final ends it, :meth:`forget` drops a departed session's, and past
    ``max_segments`` the least recently used goes.
    """

    def __init__(self, frontend: Frontend, *, max_segments: int = DEFAULT_MAX_SEGMENTS) -> None:
        self.frontend = frontend
        self.max_segments = max_segments
        self.stats = FeatureStats()
        self._lock = threading.Lock()
        self._open: OrderedDict[str, _OpenSegment] = OrderedDict()  # session_id -> segment

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def features(self, job: DecodeJob, waveform: np.ndarray) -> np.ndarray:
        """The features of ``waveform`` (``job``'s audio, float32 in [-1, 1]):
        ``Frontend(waveform)``, with the filterbank of samples already seen reused."""
        if waveform.size < WINDOW_SAMPLES:
            # the frontend shortens its window for audio shorter than one: from scratch
            return self.frontend(waveform)
        segment_start = job.start_sample
        if job.segment_start_sample is not None:  # a window of the segment
            segment_start = job.segment_start_sample
        offset = job.start_sample - segment_start
        segment = (job.segment_id, segment_start)
        with self._lock:
            entry = self._open.get(job.session_id)
            if entry is not None:
                self._open.move_to_end(job.session_id)
        if offset and (
            entry is None or entry.segment != segment or not entry.continues(waveform, offset)
        ):
            # a window the cache cannot serve (the segment's start was not seen): once
            self.stats.computed_samples += waveform.size
            return self.frontend(waveform)
        if entry is not None and entry.segment == segment and not entry.continues(waveform, offset):
            logger.warning(
                "session %s segment %d: audio differs from what was decoded before; "
                "recomputing its features",
                job.session_id,
                job.segment_id,
            )
            self.stats.restarts += 1
            entry = None
        if entry is None or entry.segment != segment:
            entry = _OpenSegment(segment, self.frontend.online_fbank(), self.frontend.n_mels)
            fresh = True
        else:
            fresh = False
        reused = min(max(entry.fed_samples - offset, 0), waveform.size)
        self.stats.reused_samples += reused
        self.stats.computed_samples += waveform.size - reused
        features = self.frontend.stack(entry.frames(waveform, offset))
        with self._lock:
            if job.kind == "final":  # a final ends its segment
                if self._open.get(job.session_id) is entry:
                    del self._open[job.session_id]
            elif fresh:  # (an entry forgotten meanwhile is not brought back)
                self._open[job.session_id] = entry
                while len(self._open) > self.max_segments:
                    self._open.popitem(last=False)
        return features

    def forget(self, session_id: str) -> None:
        """Drop ``session_id``'s open segment (the session has gone)."""
        with self._lock:
            self._open.pop(session_id, None)
