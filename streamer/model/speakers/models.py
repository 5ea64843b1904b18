"""The two speaker graphs on ONNX Runtime: :class:`SpeakerModels`.

One :class:`SpeakerModels` holds one ONNX Runtime session per graph, each pinned to one
intra-op thread without spinning (two threads under contention ran over 10x slower), and
is used by one thread at a time (the diarizer's worker). :meth:`SpeakerModels.analyse`
is the whole per-utterance path: segmentation in 10 s windows, the powerset decoded by
``core/diarization.py``, and one CAM++ embedding per local speaker with enough solo
speech, computed from 80-bin Kaldi filterbanks (kaldi-native-fbank, mean-normalised over
the speaker's frames, as 3D-Speaker and sherpa-onnx do; one pass over at most
SOLO_PASS_MAX_SAMPLES of its longest solo runs). CAM++ also embeds 1.25 s windows on a grid
from the utterance's start (:class:`WindowCache`, one batch per call), only where the
segmentation says they may matter: a long region's first and last, then, by bisection,
the one between two embedded ones that disagree (:func:`_refinements`); they are its
pieces, and a local speaker with at least ``MIN_SOLO_WINDOWS`` of them in its solo speech
takes their mean (no pass over its speech). With change_windows off, windows end to end
are embedded instead, and :meth:`SpeakerModels.embed_closed` embeds those an open
utterance already holds, those with a pause left out (:func:`paused_windows`), so that
its analysis has little more than the tail left.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.diarization import (
    END_TO_END,
    FBANK_BINS,
    LOCAL_SPEAKERS,
    MIN_PIECES_REGION_SAMPLES,
    MIN_SOLO_WINDOWS,
    POWERSET,
    REFINE_BELOW_COSINE,
    SEGMENTATION_FRAME_SAMPLES,
    SEGMENTATION_WINDOW_SAMPLES,
    DiarizationOptions,
    LocalSpeaker,
    Piece,
    SpeakerAnalysis,
    closed_windows,
    local_regions,
    powerset_activity,
    window_span,
    windows_inside,
)
from streamer.errors import ModelError
from streamer.model.speakers.layout import DiarizerFiles

logger = logging.getLogger(__name__)

MIN_EMBED_SAMPLES = 400  # one 25 ms fbank frame
MIN_WINDOW_SAMPLES = SAMPLE_RATE // 2  # a shorter last window joins the one before
# an open utterance's window with a pause in it (PAUSE_MIN_BLOCKS blocks in a row under
# PAUSE_LEVEL of its loud blocks' level) is not embedded early: the segmentation seldom
# puts such a window whole inside one voice's region, and the analysis embeds the few it
# needs (on the suite's conversations 38 % of the windows skipped, 3 % of the used ones
# left to the analysis)
PAUSE_BLOCK_SAMPLES = SAMPLE_RATE // 20
PAUSE_MIN_BLOCKS = 3
PAUSE_LEVEL = 0.05
LOUD_PERCENTILE = 90.0
# a local speaker without an embedded window in its solo speech is embedded from at most
# 1.25 s of it (its longest runs): 1 s cost confusion on cards + alsa, 1.25 s none
SOLO_PASS_MAX_SAMPLES = 5 * SAMPLE_RATE // 4


class SpeakerModels:
    """Segmentation and embedding graphs, loaded once; not thread-safe (one caller)."""

    def __init__(self, files: DiarizerFiles, options: DiarizationOptions | None = None) -> None:
        import onnxruntime as ort

        self.options = options or DiarizationOptions()
        session_options = ort.SessionOptions()
        session_options.intra_op_num_threads = 1
        session_options.inter_op_num_threads = 1
        session_options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session_options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        try:
            self._seg = ort.InferenceSession(
                str(files.segmentation), session_options, providers=["CPUExecutionProvider"]
            )
            self._emb = ort.InferenceSession(
                str(files.embedding), session_options, providers=["CPUExecutionProvider"]
            )
        except Exception as error:  # ONNX Runtime raises its own untyped errors
            raise ModelError(f"cannot load the diarizer's graphs: {error}") from error
        self._seg_input = self._seg.get_inputs()[0].name
        self._emb_input = self._emb.get_inputs()[0].name
        self._check_shapes()

    def _check_shapes(self) -> None:
        out = self._seg.run(None, {self._seg_input: np.zeros((1, 1, SAMPLE_RATE), np.float32)})
        if out[0].ndim != 3 or out[0].shape[2] != len(POWERSET):
            raise ModelError(f"segmentation graph gives {out[0].shape}, not (N, frames, 7)")
        emb = self.embed(np.zeros(SAMPLE_RATE, np.float32) + 1e-3)
        if emb.ndim != 1:
            raise ModelError(f"embedding graph gives {emb.shape}, not (N, dim)")

    def analyse(
        self, segment_id: int, pcm: np.ndarray, windows: WindowCache | None = None
    ) -> SpeakerAnalysis:
        """One utterance (16 kHz int16) -> its local speakers with their embeddings.

        ``windows``: the grid windows' embeddings of this utterance computed before (by
        :meth:`embed_closed` while it was spoken); whatever they lack is computed now."""
        started = time.perf_counter()
        audio = pcm.astype(np.float32) / 32768.0
        samples = len(audio)
        cache = windows if windows is not None else WindowCache()
        speakers: list[LocalSpeaker] = []
        min_solo = self.options.min_speaker_ms * SAMPLE_RATE / 1000
        found: list[tuple[int, int, list[tuple[int, int]], list[tuple[int, int]]]] = []
        for window, offset in enumerate(_windows(samples)):
            chunk = audio[offset : offset + SEGMENTATION_WINDOW_SAMPLES]
            if len(chunk) < SEGMENTATION_FRAME_SAMPLES:
                chunk = np.pad(chunk, (0, SEGMENTATION_FRAME_SAMPLES - len(chunk)))
            log_probs = self._seg.run(None, {self._seg_input: chunk[None, None, :]})[0][0]
            activity = powerset_activity(log_probs)
            end = min(samples, offset + SEGMENTATION_WINDOW_SAMPLES)
            found.extend((window, *r) for r in local_regions(activity, offset, end))
        wanted: set[int] = set()
        if not self.options.change_windows:  # windows end to end in solo speech
            for _, _, _, solo in found:
                if len(inside := windows_inside(solo, every=END_TO_END)) >= MIN_SOLO_WINDOWS:
                    wanted.update(inside)
            self._embed_windows(pcm, audio, sorted(wanted), cache)
        while self.options.change_windows:  # long regions' edges, then bisection
            refine = {k for _, _, rs, _ in found for k in _refinements(rs, cache, wanted)}
            if not refine:
                break
            self._embed_windows(pcm, audio, sorted(refine), cache)
            wanted |= refine
        for window, slot, regions, solo in found:
            solo_samples = sum(b - a for a, b in solo)
            embedding = None
            if solo_samples >= max(min_solo, MIN_EMBED_SAMPLES):
                inside = [k for k in windows_inside(solo) if k in wanted]
                if segment_id < 0:  # a known speaker's reference: all its solo speech
                    embedding = self.embed(np.concatenate([audio[a:b] for a, b in solo]))
                elif len(inside) >= MIN_SOLO_WINDOWS:  # the windows' mean: no second pass
                    embedding = _unit(np.mean([cache.get(k) for k in inside], axis=0))
                else:
                    embedding = self.embed(_solo_audio(audio, solo))
            speakers.append(
                LocalSpeaker(
                    index=window * LOCAL_SPEAKERS + slot,
                    regions=tuple(regions),
                    solo_samples=solo_samples,
                    embedding=embedding,
                    pieces=self._pieces(regions, cache, wanted),
                )
            )
        return SpeakerAnalysis(
            segment_id=segment_id,
            samples=samples,
            speakers=tuple(speakers),
            analyse_ms=(time.perf_counter() - started) * 1000,
        )

    def embed_closed(self, pcm: np.ndarray, cache: WindowCache) -> int:
        """Embed the grid windows an utterance's audio so far (16 kHz int16) holds whole
        and its analysis will use (with change_windows off: every END_TO_END-th, those
        with a pause in them left out) that ``cache`` lacks; how many were embedded.
        With change_windows on, the analysis picks its windows from the segmentation
        (regions' edges and bisection), which the open utterance cannot know: none."""
        if self.options.change_windows:
            return 0
        windows = range(0, closed_windows(len(pcm)), END_TO_END)
        missing = [k for k in windows if not cache.has(k, pcm)]
        if missing:
            audio = pcm.astype(np.float32) / 32768.0
            paused = paused_windows(audio, missing)
            missing = [k for k in missing if k not in paused]
            self._embed_windows(pcm, audio, missing, cache)
        return len(missing)

    def _embed_windows(
        self, pcm: np.ndarray, audio: np.ndarray, windows: list[int], cache: WindowCache
    ) -> None:
        """The grid windows ``cache`` lacks, embedded in one batch."""
        missing = [k for k in windows if not cache.has(k, pcm)]
        if not missing:
            return
        features = np.stack([fbank(audio[slice(*window_span(k))]) for k in missing])
        out = self._emb.run(None, {self._emb_input: features})[0]
        for k, vector in zip(missing, out, strict=True):
            cache.put(k, pcm, _unit(vector).astype(np.float32))

    def _pieces(
        self, regions: list[tuple[int, int]], cache: WindowCache, embedded: set[int]
    ) -> tuple[Piece, ...]:
        """The embedded grid windows (``embedded``) of the regions long enough for them:
        their edges and those :func:`_refinements` added."""
        if not self.options.change_windows:
            return ()
        inside = [k for k in windows_inside(regions, MIN_PIECES_REGION_SAMPLES) if k in embedded]
        return tuple(Piece(*window_span(k), cache.get(k)) for k in inside)

    def embed(self, audio: np.ndarray) -> np.ndarray:
        """A CAM++ embedding (unit length) of float audio in [-1, 1]."""
        features = fbank(audio)
        out = self._emb.run(None, {self._emb_input: features[None]})[0][0]
        return _unit(out).astype(np.float32)


class WindowCache:
    """One utterance's grid windows' embeddings, each with a digest of the audio it heard
    (a window of other audio is not taken for it)."""

    def __init__(self) -> None:
        self._windows: dict[int, tuple[int, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def has(self, window: int, pcm: np.ndarray) -> bool:
        held = self._windows.get(window)
        return held is not None and held[0] == _digest(pcm, window)

    def get(self, window: int) -> np.ndarray:
        return self._windows[window][1]

    def put(self, window: int, pcm: np.ndarray, embedding: np.ndarray) -> None:
        self._windows[window] = (_digest(pcm, window), embedding)


def _refinements(
    regions: list[tuple[int, int]], cache: WindowCache, embedded: set[int]
) -> list[int]:
    """The grid windows of ``regions``' long ones to embed next (``embedded``: those
    embedded so far): each region's first and last, and the middle one between two
    embedded neighbours more than one apart whose cosine is under REFINE_BELOW_COSINE
    (a change of voice may lie there), so that a change is placed on the grid by
    bisection."""
    out: list[int] = []
    for region in regions:
        inside = windows_inside([region], MIN_PIECES_REGION_SAMPLES)
        if not inside:
            continue
        out.extend(k for k in (inside[0], inside[-1]) if k not in embedded)
        done = [k for k in inside if k in embedded]
        for before, after in zip(done, done[1:], strict=False):
            if after - before > 1 and _disagree(cache, before, after):
                out.append((before + after) // 2)
    return sorted(set(out))


def _disagree(cache: WindowCache, before: int, after: int) -> bool:
    return float(np.dot(cache.get(before), cache.get(after))) < REFINE_BELOW_COSINE


def _solo_audio(audio: np.ndarray, solo: list[tuple[int, int]]) -> np.ndarray:
    """A local speaker's solo speech for one embedding: its longest runs, at most
    SOLO_PASS_MAX_SAMPLES in all."""
    picked, total = [], 0
    for a, b in sorted(solo, key=lambda r: r[0] - r[1]):
        if total >= SOLO_PASS_MAX_SAMPLES:
            break
        b = min(b, a + SOLO_PASS_MAX_SAMPLES - total)
        picked.append((a, b))
        total += b - a
    return np.concatenate([audio[a:b] for a, b in sorted(picked)])


def paused_windows(audio: np.ndarray, windows: list[int]) -> set[int]:
    """Of the grid ``windows`` of an utterance's float audio, those with a pause in them:
    PAUSE_MIN_BLOCKS blocks in a row quieter than PAUSE_LEVEL times the level of its loud
    blocks (the LOUD_PERCENTILE-th percentile of their RMS)."""
    blocks = len(audio) // PAUSE_BLOCK_SAMPLES
    if blocks < PAUSE_MIN_BLOCKS:
        return set()
    framed = audio[: blocks * PAUSE_BLOCK_SAMPLES].reshape(blocks, PAUSE_BLOCK_SAMPLES)
    rms = np.sqrt(np.mean(np.square(framed, dtype=np.float64), axis=1))
    quiet = (rms < PAUSE_LEVEL * np.percentile(rms, LOUD_PERCENTILE)).astype(np.int64)
    # pause_from[j]: blocks j .. j + PAUSE_MIN_BLOCKS - 1 are all quiet
    pause_from = np.convolve(quiet, np.ones(PAUSE_MIN_BLOCKS, np.int64), "valid")
    pause_from = pause_from == PAUSE_MIN_BLOCKS
    out = set()
    for k in windows:
        start, end = window_span(k)
        first, last = start // PAUSE_BLOCK_SAMPLES, end // PAUSE_BLOCK_SAMPLES - PAUSE_MIN_BLOCKS
        if last >= first and bool(pause_from[first : last + 1].any()):
            out.add(k)
    return out


def _digest(pcm: np.ndarray, window: int) -> int:
    return hash(pcm[slice(*window_span(window))].tobytes())


def _unit(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def fbank(audio: np.ndarray) -> np.ndarray:
    """80-bin Kaldi filterbank (25/10 ms, povey window, no dither), mean-normalised."""
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.samp_freq = SAMPLE_RATE
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = FBANK_BINS
    computer = knf.OnlineFbank(opts)
    # Kaldi's int16 scale: the mean normalisation removes the scale, the log floor does not
    computer.accept_waveform(float(SAMPLE_RATE), np.asarray(audio, np.float32) * 32768.0)
    computer.input_finished()
    frames = computer.num_frames_ready
    if frames == 0:
        return np.zeros((1, FBANK_BINS), np.float32)
    features = np.stack([computer.get_frame(i) for i in range(frames)]).astype(np.float32)
    return features - features.mean(axis=0, keepdims=True)


def _windows(samples: int) -> list[int]:
    """10 s windows' offsets; a short tail joins the previous window's span."""
    offsets = list(range(0, max(1, samples), SEGMENTATION_WINDOW_SAMPLES))
    if len(offsets) > 1 and samples - offsets[-1] < MIN_WINDOW_SAMPLES:
        offsets[-1] = max(0, samples - SEGMENTATION_WINDOW_SAMPLES)
    return offsets
