"""Who spoke when inside each utterance, and which of the stream's speakers that is
(I/O-free).

The speaker models (``streamer/speakers/``) turn an utterance's audio into a
:class:`SpeakerAnalysis`: pyannote segmentation-3.0's frames, decoded here from its
powerset classes (:func:`powerset_activity`) into at most three *local* speakers per
10 s window (:func:`local_regions`), each with a CAM++ embedding of its solo speech when
it has enough (``min_speaker_ms``). :class:`SpeakerTracker` matches the local speakers to
the stream's running centroids, online: a cosine threshold, a new speaker only from
enough speech, at most ``max_speakers``. Labels are integers from 0, never renumbered or
merged, so a label once sent never changes; what a later utterance teaches moves the
centroids only. :func:`speaker_turns` turns the mapping into the utterance's turns, and
:func:`word_speaker` gives a word the speaker active over its time.

Time is in 16 kHz samples from the utterance's first sample, as the segmentation saw it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from streamer.core.audio import SAMPLE_RATE

SEGMENTATION_STEP_SAMPLES = 270  # one segmentation frame every 16.875 ms
SEGMENTATION_FRAME_SAMPLES = 991  # each frame's receptive field (61.9 ms)
SEGMENTATION_WINDOW_SAMPLES = 10 * SAMPLE_RATE  # the model's training chunk: 10 s
LOCAL_SPEAKERS = 3  # per window
# segmentation-3.0's 7 classes: nobody, each of 3 speakers alone, each pair
POWERSET: tuple[tuple[int, ...], ...] = ((), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2))
EMBEDDING_DIM = 192  # CAM++'s speaker embedding
FBANK_BINS = 80  # CAM++'s input features per frame
# a long local speaker (3 s of speech at least) is also embedded in windows, which catch
# a change of voice the segmentation missed (two voices in one local speaker): 1.25 s
# windows on a grid every 0.375 s from the utterance's first sample (window k starts at
# k * PIECE_STEP_SAMPLES), not all of them: each long region's first and last, then by
# bisection the one between two embedded ones that disagree (cosine under
# REFINE_BELOW_COSINE: a change of voice may lie there), so a change is placed on the
# grid at a few windows per region (bench/RESULTS.md, "Speaker diarization": 1.5 s windows
# 0.75 s apart with the same DER took 2.6x the CAM++ frames; 1 s windows missed changes
# among 4 voices in 24 turns)
PIECE_WINDOW_SAMPLES = 5 * SAMPLE_RATE // 4
PIECE_STEP_SAMPLES = 3 * SAMPLE_RATE // 8
MIN_PIECES_REGION_SAMPLES = 3 * SAMPLE_RATE
REFINE_BELOW_COSINE = 0.4
MIN_CENTROID_SAMPLES = SAMPLE_RATE  # a speaker a piece may switch to has 1 s behind it
# a local speaker with at least this many embedded windows whole in its solo speech takes
# their mean as its embedding (no second pass over it)
MIN_SOLO_WINDOWS = 1
# without the windowed changes (change_windows off) windows every END_TO_END-th of the
# grid (the nearest that do not overlap) are embedded for the solo embeddings' means,
# early while the utterance is spoken
END_TO_END = -(-PIECE_WINDOW_SAMPLES // PIECE_STEP_SAMPLES)


@dataclass(frozen=True)
class DiarizationOptions:
    """How local speakers become the stream's speakers."""

    min_speaker_ms: float = 300.0  # solo speech a local speaker needs to be embedded
    match_threshold: float = 0.45  # cosine at or above which it is a known speaker
    new_speaker_min_ms: float = 1000.0  # solo speech a new speaker must start with
    max_speakers: int = 8  # past it, the nearest known speaker is taken
    min_speakers: int = 1  # uploads: the fewest speakers re-clustering may find
    min_turn_ms: float = 250.0  # shorter runs of one speaker join their neighbours
    # a window of a local speaker goes to another known speaker when it is at least this
    # much closer to it (cosine) than to its own, and past match_threshold
    change_margin: float = 0.15
    # embed long local speakers' region edges in windows too, and bisect where they
    # disagree (off: windows end to end for the solo embeddings only, no cheaper, and
    # changes inside one local speaker go unseen: bench/RESULTS.md, "Speaker diarization")
    change_windows: bool = True
    # how long a live final waits for its speakers once its text is ready (past it, it is
    # sent without them); a file upload's waits up to background_max_wait_ms
    max_wait_ms: float = 300.0
    background_max_wait_ms: float = 30000.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_speakers <= self.max_speakers:
            raise ValueError("need 1 <= min_speakers <= max_speakers")


@dataclass(frozen=True, eq=False)
class LocalSpeaker:
    """One voice the segmentation heard in one 10 s window of an utterance."""

    index: int  # window * LOCAL_SPEAKERS + the model's speaker slot
    regions: tuple[tuple[int, int], ...]  # samples where it speaks (overlap included)
    solo_samples: int  # samples where it speaks alone (what its embedding heard)
    embedding: np.ndarray | None = None  # unit-length, None with too little solo speech
    pieces: tuple[Piece, ...] = ()  # windows of its long regions, each embedded


@dataclass(frozen=True, eq=False)
class Piece:
    """A window of a local speaker's speech and its embedding (samples from the
    utterance's start)."""

    start: int
    end: int
    embedding: np.ndarray  # unit length


@dataclass(frozen=True, eq=False)
class SpeakerAnalysis:
    """The speaker models' answer for one utterance."""

    segment_id: int
    samples: int  # the utterance's length
    speakers: tuple[LocalSpeaker, ...] = ()
    analyse_ms: float = 0.0  # model time spent on it (segmentation and embeddings)


@dataclass(frozen=True)
class Turn:
    """A stretch of one speaker inside an utterance, in samples from its start."""

    start: int
    end: int
    speaker: int


def speaker_label(speaker: int) -> str:
    """``A``, ``B``, ... ``Z``, ``AA``, ...: the letters OpenAI's diarized_json uses."""
    label = ""
    n = speaker
    while True:
        label = chr(ord("A") + n % 26) + label
        n = n // 26 - 1
        if n < 0:
            return label


def powerset_activity(log_probs: np.ndarray) -> np.ndarray:
    """(frames, 7) powerset scores -> (frames, 3) bool: who speaks in each frame."""
    if log_probs.ndim != 2 or log_probs.shape[1] != len(POWERSET):
        raise ValueError(f"expected (frames, {len(POWERSET)}) scores, got {log_probs.shape}")
    mapping = np.zeros((len(POWERSET), LOCAL_SPEAKERS), dtype=bool)
    for row, members in enumerate(POWERSET):
        mapping[row, list(members)] = True
    return mapping[np.argmax(log_probs, axis=1)]


def frame_span(frame: int) -> tuple[int, int]:
    """The samples a frame stands for: one step around its receptive field's centre."""
    centre = frame * SEGMENTATION_STEP_SAMPLES + SEGMENTATION_FRAME_SAMPLES // 2
    half = SEGMENTATION_STEP_SAMPLES // 2
    return max(0, centre - half), centre - half + SEGMENTATION_STEP_SAMPLES


def closed_windows(samples: int) -> int:
    """How many grid windows ``samples`` samples from an utterance's start hold whole."""
    return max(0, (samples - PIECE_WINDOW_SAMPLES) // PIECE_STEP_SAMPLES + 1)


def window_span(window: int) -> tuple[int, int]:
    """Grid window ``window``'s samples from the utterance's start."""
    start = window * PIECE_STEP_SAMPLES
    return start, start + PIECE_WINDOW_SAMPLES


def windows_inside(
    regions: Sequence[tuple[int, int]], min_samples: int = 0, every: int = 1
) -> list[int]:
    """The grid windows lying whole inside one of ``regions`` of at least ``min_samples``
    (of those, every ``every``-th of the grid: ``END_TO_END`` gives windows end to end)."""
    out: list[int] = []
    for start, end in regions:
        if end - start < max(min_samples, PIECE_WINDOW_SAMPLES):
            continue
        first = -(-start // PIECE_STEP_SAMPLES)
        out.extend(k for k in range(first, closed_windows(end)) if k % every == 0)
    return out


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[first, last + 1) of each run of True frames."""
    padded = np.concatenate([[False], mask.astype(bool), [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def local_regions(
    activity: np.ndarray, offset: int, samples: int
) -> list[tuple[int, list[tuple[int, int]], list[tuple[int, int]]]]:
    """Per local speaker of one window: (slot, regions, solo regions) in samples from the
    utterance's start (``offset``: the window's first sample), clipped to ``samples``."""
    alone = activity.sum(axis=1) == 1
    out = []
    for slot in range(activity.shape[1]):
        spans = _spans(runs(activity[:, slot]), offset, samples)
        if spans:
            solo = _spans(runs(activity[:, slot] & alone), offset, samples)
            out.append((slot, spans, solo))
    return out


def _spans(frame_runs: list[tuple[int, int]], offset: int, samples: int) -> list[tuple[int, int]]:
    spans = []
    for first, stop in frame_runs:
        start = offset + frame_span(first)[0]
        end = min(samples, offset + frame_span(stop - 1)[1])
        if end > start:
            spans.append((start, end))
    return spans


def _unit(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


@dataclass
class _Speaker:
    centroid: np.ndarray | None  # running mean of its unit embeddings, None until heard
    weight_samples: int = 0  # solo speech behind the centroid


@dataclass
class SpeakerTracker:
    """The stream's speakers: matches each utterance's local speakers to them, online.

    :meth:`assign` only ever adds speakers and moves centroids: the labels it gave an
    earlier utterance are never recomputed, so what was sent stays true to its word.
    """

    options: DiarizationOptions = field(default_factory=DiarizationOptions)
    _speakers: list[_Speaker] = field(default_factory=list)
    last_speaker: int | None = None  # the latest utterance's main speaker

    @property
    def count(self) -> int:
        return len(self._speakers)

    def enrol(self, embedding: np.ndarray, weight_samples: int = 10 * SAMPLE_RATE) -> int:
        """A known speaker (a reference sample's embedding) before any speech: its label."""
        self._speakers.append(_Speaker(_unit(embedding.astype(np.float64)), weight_samples))
        return len(self._speakers) - 1

    def assign(self, analysis: SpeakerAnalysis) -> dict[int, int]:
        """Local speaker index -> the stream's speaker, for every local speaker."""
        opts = self.options
        mapping: dict[int, int] = {}
        min_new = opts.new_speaker_min_ms * SAMPLE_RATE / 1000
        embedded = sorted(
            (s for s in analysis.speakers if s.embedding is not None),
            key=lambda s: -s.solo_samples,
        )
        for local in embedded:
            assert local.embedding is not None
            vector = _unit(local.embedding.astype(np.float64))
            best, score = self._nearest(vector)
            if best is not None and score >= opts.match_threshold:
                speaker = best
            elif (unheard := self._unheard()) is not None:
                speaker = unheard
            elif best is None or (
                len(self._speakers) < opts.max_speakers and local.solo_samples >= min_new
            ):
                speaker = len(self._speakers)
                self._speakers.append(_Speaker(None))
            else:
                speaker = best
            self._update(speaker, vector, local.solo_samples)
            mapping[local.index] = speaker
        fallback = self._fallback(analysis, mapping)
        for local in analysis.speakers:
            if local.index not in mapping and fallback is not None:
                mapping[local.index] = fallback
        return mapping

    def changes(self, analysis: SpeakerAnalysis, mapping: dict[int, int]) -> list[Turn]:
        """Stretches where a local speaker's window is clearly another known voice (the
        segmentation gave two voices one local speaker): the window's middle half goes
        to that speaker. Centroids are not moved by them."""
        opts = self.options
        known = [
            (i, _unit(s.centroid))
            for i, s in enumerate(self._speakers)
            if s.centroid is not None and s.weight_samples >= MIN_CENTROID_SAMPLES
        ]
        out = []
        for local in analysis.speakers:
            own = mapping.get(local.index)
            for piece in local.pieces:
                scores = {i: float(np.dot(c, piece.embedding)) for i, c in known}
                if not scores:
                    break
                best = max(scores, key=lambda i: scores[i])
                if (
                    best != own
                    and scores[best] >= opts.match_threshold
                    and scores[best] - (scores.get(own, -1.0) if own is not None else -1.0)
                    >= opts.change_margin
                ):
                    quarter = (piece.end - piece.start) // 4
                    out.append(Turn(piece.start + quarter, piece.end - quarter, best))
        return out

    def _nearest(self, vector: np.ndarray) -> tuple[int | None, float]:
        best, score = None, -2.0
        for i, speaker in enumerate(self._speakers):
            if speaker.centroid is not None:
                s = float(np.dot(_unit(speaker.centroid), vector))
                if s > score:
                    best, score = i, s
        return best, score

    def _unheard(self) -> int | None:
        return next((i for i, s in enumerate(self._speakers) if s.centroid is None), None)

    def _update(self, speaker: int, vector: np.ndarray, samples: int) -> None:
        entry = self._speakers[speaker]
        weight = max(1, samples)
        if entry.centroid is None:
            entry.centroid = vector
        else:
            total = entry.weight_samples + weight
            entry.centroid = (entry.centroid * entry.weight_samples + vector * weight) / total
        entry.weight_samples += weight

    def _fallback(self, analysis: SpeakerAnalysis, mapping: dict[int, int]) -> int | None:
        """Who a local speaker too short to embed is taken for: the utterance's main
        embedded speaker, else the stream's latest, else a first speaker."""
        if mapping:
            main = max(
                (s for s in analysis.speakers if s.index in mapping),
                key=lambda s: s.solo_samples,
            )
            return mapping[main.index]
        if self.last_speaker is not None:
            return self.last_speaker
        if analysis.speakers:
            self._speakers.append(_Speaker(None))
            return len(self._speakers) - 1
        return None


def speaker_turns(
    analysis: SpeakerAnalysis,
    mapping: dict[int, int],
    options: DiarizationOptions,
    changes: Sequence[Turn] = (),
) -> list[Turn]:
    """The utterance's turns: one speaker per frame (in overlap, the one already
    speaking; where :meth:`SpeakerTracker.changes` found another voice, that one), runs
    shorter than ``min_turn_ms`` given to a neighbour, pauses inside one
    speaker's speech closed, and a pause between two speakers split in the middle; the
    silence before the first and after the last speech is no one's."""
    step = SEGMENTATION_STEP_SAMPLES
    frames = max(1, -(-analysis.samples // step))
    owner = np.full(frames, -1, dtype=np.int64)
    active: list[set[int]] = [set() for _ in range(frames)]
    for local in analysis.speakers:
        speaker = mapping.get(local.index)
        if speaker is None:
            continue
        for start, end in local.regions:
            for f in range(start // step, min(frames, -(-end // step))):
                active[f].add(speaker)
    previous = -1
    for f in range(frames):
        if active[f]:
            owner[f] = previous if previous in active[f] else min(active[f])
            previous = int(owner[f])
    for change in changes:
        span = owner[change.start // step : -(-change.end // step)]
        span[span >= 0] = change.speaker
    raw = [(a, b, int(owner[a])) for a, b in _label_runs(owner) if owner[a] >= 0]
    min_frames = max(1, round(options.min_turn_ms * SAMPLE_RATE / 1000 / step))
    merged = _absorb_short(raw, min_frames)
    turns = []
    for i, (a, b, speaker) in enumerate(merged):
        start = a if i == 0 else (merged[i - 1][1] + a) // 2
        end = b if i == len(merged) - 1 else (b + merged[i + 1][0]) // 2
        turns.append(Turn(start * step, min(analysis.samples, end * step), speaker))
    return [t for t in turns if t.end > t.start]


def _label_runs(owner: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(owner)) + 1
    bounds = [0, *edges.tolist(), len(owner)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _absorb_short(spans: list[tuple[int, int, int]], min_frames: int) -> list[tuple[int, int, int]]:
    """Short runs go to the longer neighbour; neighbours of one speaker are joined."""
    spans = list(spans)
    while len(spans) > 1:
        lengths = [b - a for a, b, _ in spans]
        i = int(np.argmin(lengths))
        if lengths[i] >= min_frames:
            break
        a, b, _ = spans[i]
        left = spans[i - 1] if i > 0 else None
        right = spans[i + 1] if i + 1 < len(spans) else None
        if right is None or (left is not None and left[1] - left[0] >= right[1] - right[0]):
            assert left is not None
            spans[i - 1] = (left[0], b, left[2])
        else:
            spans[i + 1] = (a, right[1], right[2])
        del spans[i]
        spans = _join(spans)
    return _join(spans)


def _join(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for a, b, speaker in spans:
        if out and out[-1][2] == speaker:
            out[-1] = (out[-1][0], b, speaker)
        else:
            out.append((a, b, speaker))
    return out


def word_speaker(turns: Sequence[Turn], start: int, end: int) -> int | None:
    """The speaker of the turn a word overlaps most (the nearest turn if none)."""
    if not turns:
        return None
    overlaps = [min(end, t.end) - max(start, t.start) for t in turns]
    best = int(np.argmax(overlaps))
    if overlaps[best] > 0:
        return turns[best].speaker
    middle = (start + end) / 2
    return min(turns, key=lambda t: min(abs(t.start - middle), abs(t.end - middle))).speaker


def main_speaker(turns: Sequence[Turn]) -> int | None:
    """The speaker with the most time in the turns."""
    totals: dict[int, int] = {}
    for t in turns:
        totals[t.speaker] = totals.get(t.speaker, 0) + t.end - t.start
    return max(totals, key=lambda s: totals[s]) if totals else None


def cluster_speakers(
    embeddings: np.ndarray, count: int | None = None, *, max_speakers: int = 8
) -> list[int]:
    """Offline labels for unit embeddings (N, dim): spectral clustering on their cosine
    affinity, into ``count`` speakers, or with ``count`` None as many as the largest gap
    of the normalised Laplacian's eigenvalues says (up to ``max_speakers``). Labels are
    numbered in order of first appearance. Deterministic (farthest-point k-means start)."""
    n = len(embeddings)
    if n == 0:
        return []
    if n == 1 or count == 1:
        return [0] * n
    affinity = np.clip(embeddings @ embeddings.T, 0.0, None)
    np.fill_diagonal(affinity, 0.0)
    degree = np.maximum(affinity.sum(axis=1), 1e-9)
    scale = 1.0 / np.sqrt(degree)
    laplacian = np.eye(n) - scale[:, None] * affinity * scale[None, :]
    values, vectors = np.linalg.eigh(laplacian)
    if count is None:
        limit = min(max_speakers, n - 1)
        gaps = np.diff(values[: limit + 1])
        count = int(np.argmax(gaps)) + 1 if limit >= 1 else 1
    count = max(1, min(count, n))
    rows = vectors[:, :count]
    rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-9)
    labels = _kmeans(rows, count)
    order: dict[int, int] = {}
    return [order.setdefault(int(label), len(order)) for label in labels]


def _kmeans(points: np.ndarray, k: int, iterations: int = 50) -> np.ndarray:
    centres = [points[0]]
    for _ in range(1, k):
        distance = np.min([np.sum((points - c) ** 2, axis=1) for c in centres], axis=0)
        centres.append(points[int(np.argmax(distance))])
    centre = np.array(centres)
    labels = np.zeros(len(points), dtype=np.int64)
    for _ in range(iterations):
        new = np.argmin(((points[:, None, :] - centre[None]) ** 2).sum(axis=2), axis=1)
        if np.array_equal(new, labels) and _ > 0:
            break
        labels = new
        for j in range(k):
            if np.any(labels == j):
                centre[j] = points[labels == j].mean(axis=0)
    return labels
