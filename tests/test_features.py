"""The incremental feature cache: bit for bit the frontend's features from scratch."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from streamer.core.jobs import DecodeJob
from streamer.model.artifacts.onnx_export import cached_export
from streamer.model.backends.onnx_backend import OnnxRecognizer
from streamer.model.backends.torch_backend import Recognizer
from streamer.model.decode.decoding import as_waveform
from streamer.model.decode.features import FeatureCache
from streamer.model.decode.frontend import WINDOW_SAMPLES, Cmvn, Frontend, fbank_frames, read_am_mvn
from streamer.model.options import RecognizerOptions
from streamer.model.serving.worker import ModelWorker
from tests.fakes import Answers
from tests.timing import timeout_s

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def frontend(tiny_model_dir: Path) -> Frontend:
    return Frontend(read_am_mvn(tiny_model_dir / "am.mvn"))


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """7.5 s of int16 audio: noise with a louder tone in the middle."""
    rng = np.random.default_rng(7)
    samples = np.arange(120_000)
    tone = 8000 * np.sin(2 * np.pi * 440 * samples / 16000) * (np.abs(samples - 60_000) < 20_000)
    return (rng.normal(0, 900, samples.size) + tone).astype(np.int16)


def job(
    pcm: np.ndarray,
    kind: str = "partial",
    session: str = "s",
    segment: int = 0,
    start: int = 0,
) -> DecodeJob:
    return DecodeJob(
        session_id=session,
        segment_id=segment,
        kind=kind,  # type: ignore[arg-type]
        pcm=pcm,
        start_sample=start,
        end_sample=start + pcm.size,
        language="auto",
        itn=True,
    )


def check(cache: FeatureCache, decode: DecodeJob) -> np.ndarray:
    waveform = as_waveform(decode.pcm)
    got = cache.features(decode, waveform)
    expected = cache.frontend(waveform)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    return got


def test_fbank_frames_counts_what_the_frontend_makes(frontend: Frontend) -> None:
    for samples in (WINDOW_SAMPLES, 401, 559, 560, 561, 16000, 33_333):
        waveform = np.zeros(samples, np.float32)
        assert fbank_frames(samples) == frontend.fbank(waveform).shape[0], samples
    assert fbank_frames(WINDOW_SAMPLES - 1) == 0


def test_growing_partials_then_a_shorter_final_equal_from_scratch(frontend, audio) -> None:
    """Partials at odd lengths (frames and LFR groups split anywhere), a final cut before
    the last partial's end, all bit for bit the frontend's; each sample fed once."""
    cache = FeatureCache(frontend)
    lengths = [401, 1600, 1601, 4805, 4806, 17_777, 56_000, 111_999]
    for length in lengths:
        check(cache, job(audio[:length]))
    assert len(cache) == 1
    assert cache.stats.computed_samples == lengths[-1]  # every sample fed once
    assert cache.stats.reused_samples == sum(lengths[:-1])
    check(cache, job(audio[:100_003], kind="final"))  # cut at a quiet point before the end
    assert cache.stats.computed_samples == lengths[-1]  # from the frames it had
    assert len(cache) == 0  # a final ends the segment


def test_a_final_longer_than_the_last_partial_feeds_the_rest(frontend, audio) -> None:
    cache = FeatureCache(frontend)
    check(cache, job(audio[:30_000]))
    check(cache, job(audio[:45_000], kind="final"))
    assert cache.stats.computed_samples == 45_000
    assert len(cache) == 0


def test_a_new_segment_or_start_replaces_the_open_one(frontend, audio) -> None:
    cache = FeatureCache(frontend)
    check(cache, job(audio[:20_000]))
    # the next segment starts where this one was cut: other samples from its first
    check(cache, job(audio[18_000:30_000], segment=1, start=18_000))
    check(cache, job(audio[18_000:50_000], segment=1, start=18_000))
    assert cache.stats.computed_samples == 20_000 + 32_000
    check(cache, job(audio[5000:20_000], segment=1, start=5000))  # another start
    assert len(cache) == 1


def test_sessions_are_kept_apart_and_forgotten(frontend, audio) -> None:
    cache = FeatureCache(frontend)
    check(cache, job(audio[:20_000], session="a"))
    check(cache, job(audio[50_000:60_000], session="b"))
    check(cache, job(audio[:30_000], session="a"))
    check(cache, job(audio[50_000:70_000], session="b"))
    assert cache.stats.computed_samples == 30_000 + 20_000
    cache.forget("a")
    assert len(cache) == 1
    check(cache, job(audio[:40_000], session="a"))  # from scratch, still exact
    assert cache.stats.computed_samples == 30_000 + 20_000 + 40_000


def test_least_recently_used_segments_go_past_the_bound(frontend, audio) -> None:
    cache = FeatureCache(frontend, max_segments=2)
    for session in ("a", "b", "a", "c"):
        check(cache, job(audio[:3000], session=session))
    assert len(cache) == 2
    before = cache.stats.computed_samples
    check(cache, job(audio[:3000], session="a"))  # kept: used after b
    assert cache.stats.computed_samples == before
    check(cache, job(audio[:3000], session="b"))  # evicted: from scratch
    assert cache.stats.computed_samples == before + 3000


def test_audio_that_does_not_continue_is_recomputed(frontend, audio, caplog) -> None:
    """A segment's samples are never rewritten; were they, the cache must not serve
    stale frames."""
    cache = FeatureCache(frontend)
    check(cache, job(audio[:20_000]))
    changed = audio[:30_000].copy()
    changed[19_999] += 1000
    check(cache, job(changed))
    assert cache.stats.restarts == 1
    assert "differs" in caplog.text


def test_audio_shorter_than_one_window_is_computed_from_scratch(frontend, audio) -> None:
    """The frontend shortens its window below 25 ms; the cache must do the same."""
    cache = FeatureCache(frontend)
    got = check(cache, job(audio[: WINDOW_SAMPLES - 1]))
    assert got.shape[0] == 1
    check(cache, job(audio[:5000]))


def test_random_cmvn_and_every_length_near_a_boundary() -> None:
    rng = np.random.default_rng(3)
    cmvn = Cmvn(
        shift=rng.normal(0, 5, 560).astype(np.float32),
        scale=rng.uniform(0.1, 2, 560).astype(np.float32),
    )
    frontend = Frontend(cmvn)
    pcm = rng.normal(0, 3000, 20_000).astype(np.int16)
    cache = FeatureCache(frontend)
    length = WINDOW_SAMPLES
    while length < pcm.size:
        check(cache, job(pcm[:length]))
        length += int(rng.integers(1, 1200))


# --- in the recognizers and the worker -------------------------------------------------------


def _options(model: Path | str, **options: object) -> RecognizerOptions:
    defaults: dict[str, object] = {"device": "cpu", "threads": 2, "warmup": False}
    return RecognizerOptions(model=str(model), **{**defaults, **options})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def onnx_tiny(tiny_model_dir: Path, cache_dir: Path) -> OnnxRecognizer:
    return OnnxRecognizer(_options(cached_export(tiny_model_dir, cache_dir), backend="onnx"))


@pytest.fixture(scope="module")
def torch_tiny(tiny_model_dir: Path) -> Recognizer:
    return Recognizer(_options(tiny_model_dir, backend="torch"))


def test_torch_uses_the_cache_where_funasr_computes_the_same_features(torch_tiny) -> None:
    from funasr.utils import fbank

    if getattr(fbank, "_HAS_TORCHAUDIO", False):
        assert torch_tiny.frontend is None  # torchaudio's fbank differs by up to 1e-4
    else:
        assert torch_tiny.frontend is not None


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_decoding_jobs_with_the_cache_equals_decoding_their_audio(
    torch_tiny, onnx_tiny, audio, backend
) -> None:
    """A segment's partials and final through the cache give the transcripts of their
    audio decoded alone, and the cache did serve them."""
    recognizer = torch_tiny if backend == "torch" else onnx_tiny
    if recognizer.frontend is None:
        pytest.skip("funasr computes this backend's features (torchaudio)")
    jobs = [job(audio[:n]) for n in (8000, 12_345, 30_000, 64_000)]
    jobs.append(job(audio[:60_000], kind="final"))
    jobs.append(job(audio[60_000:90_000], segment=1, start=60_000))
    for decode in jobs:
        (got,) = recognizer.decode_jobs([decode])
        alone = recognizer.decode(decode.pcm)
        assert got.token_ids == alone.token_ids and got.raw == alone.raw
        assert got.token_frames == alone.token_frames
    # a batch of several sessions' jobs, each reusing its own segment
    batch = [job(audio[60_000:100_000], session="t", segment=1, start=60_000), job(audio[:70_000])]
    transcripts = recognizer.decode_jobs(batch)
    for got, decode in zip(transcripts, batch, strict=True):
        assert got.token_ids == recognizer.decode(decode.pcm).token_ids
    cache = recognizer.feature_cache
    assert cache is not None and cache.stats.reused_samples > 0
    assert sum(bool(recognizer.decode(j.pcm).token_ids) for j in jobs) >= 3  # real output


def test_the_worker_forgets_a_departed_sessions_features(onnx_tiny, audio) -> None:
    worker = ModelWorker(lambda: onnx_tiny)
    worker.start()
    try:
        assert worker.ready.wait(timeout_s(30))
        answers = Answers()
        worker.submit(job(audio[:16_000], session="gone"), answers)
        answers.wait(1)
        cache = onnx_tiny.feature_cache
        assert cache is not None and len(cache) >= 1
        before = len(cache)
        worker.drop_session("gone")
        assert len(cache) == before - 1
    finally:
        worker.stop()


def test_forget_from_another_thread_while_decoding(frontend, audio) -> None:
    cache = FeatureCache(frontend)
    stop = threading.Event()

    def forget() -> None:
        while not stop.is_set():
            cache.forget("s")

    thread = threading.Thread(target=forget)
    thread.start()
    try:
        for length in range(2000, 60_000, 2900):
            check(cache, job(audio[:length]))
    finally:
        stop.set()
        thread.join()
    assert len(cache) <= 1


def test_a_refresh_window_is_served_from_its_segments_frames(frontend, audio) -> None:
    """A window of the segment starting on a hop (core/partial_window.py): bit for bit
    the frontend's features of the window alone, its samples fed once, and the final
    after it still reuses them."""
    cache = FeatureCache(frontend)
    check(cache, job(audio[:48_000]))
    window = replace(job(audio[40_000:64_000], start=40_000), segment_start_sample=0)
    check(cache, window)
    assert cache.stats.computed_samples == 64_000  # only the 16 000 new samples fed
    check(cache, job(audio[:80_000], kind="final"))
    assert cache.stats.computed_samples == 80_000


def test_a_window_the_cache_cannot_serve_is_computed_alone(frontend, audio) -> None:
    cache = FeatureCache(frontend)
    check(cache, job(audio[:20_000]))
    gap = replace(job(audio[40_000:64_000], start=40_000), segment_start_sample=0)
    check(cache, gap)  # past the samples fed: a gap
    off_hop = replace(job(audio[10_001:30_000], start=10_001), segment_start_sample=0)
    check(cache, off_hop)
    check(cache, job(audio[:30_000], kind="final"))  # the segment's entry is intact
    assert cache.stats.restarts == 0
