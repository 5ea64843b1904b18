"""Dynamic batching: batched decodes equal batch-1 decodes, and the worker's batch policy."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from streamer.core.jobs import DecodeFailure, DecodeJob, DecodeResult
from streamer.core.transcript import Transcript
from streamer.core.words import transcript_words
from streamer.errors import ConfigError
from streamer.model.artifacts.onnx_export import cached_export
from streamer.model.backends.onnx_backend import OnnxRecognizer
from streamer.model.backends.torch_backend import Recognizer
from streamer.model.decode.decoding import CtcRecognizer
from streamer.model.interface import RecognizerBase
from streamer.model.options import RecognizerOptions
from streamer.model.sensevoice import MIN_DECODE_SAMPLES
from streamer.model.serving.worker import (
    DEFAULT_MAX_BATCH,
    ModelWorker,
    WorkerOptions,
    select_batch,
)
from streamer.testkit.speech import SAMPLE_RATE
from tests import clips as clips_module
from tests.clips import load_clips
from tests.fakes import Answers, FakeRecognizer
from tests.timing import timeout_s

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

# mixed lengths 0.1-7 s, one below the shortest decodable audio (no model call)
SECONDS = (7.0, 0.1, 3.2, 1.0, 5.5, 0.45, 2.0)
LANGUAGES = ("auto", "en", "zh", "auto", "ja", "auto", "nospeech")


def _options(model: Path | str, **options: object) -> RecognizerOptions:
    defaults: dict[str, object] = {"device": "cpu", "threads": 2, "warmup": False}
    return RecognizerOptions(model=str(model), **{**defaults, **options})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def long_speech(speech_cache: Path) -> np.ndarray:
    return clips_module.long_speech(load_clips(speech_cache))


def _segments(long_speech: np.ndarray, seconds: Sequence[float] = SECONDS) -> list[np.ndarray]:
    pcms = []
    for index, length in enumerate(seconds):
        samples = int(length * SAMPLE_RATE)
        start = (index * 11_113) % (long_speech.size - samples)
        pcms.append(long_speech[start : start + samples])
    pcms.append(long_speech[: MIN_DECODE_SAMPLES - 1])
    return pcms


def _words(transcript: Transcript) -> tuple[object, ...]:
    return transcript_words(transcript, 0.0, transcript.audio_ms)


def assert_batch_exact(recognizer: CtcRecognizer, pcms: list[np.ndarray]) -> None:
    languages = [LANGUAGES[i % len(LANGUAGES)] for i in range(len(pcms))]
    itns = [i % 2 == 0 for i in range(len(pcms))]
    assert recognizer.batch_exact
    batch = recognizer.decode_batch(pcms, languages=languages, use_itns=itns)
    for got, pcm, language, itn in zip(batch, pcms, languages, itns, strict=True):
        alone = recognizer.decode(pcm, language=language, use_itn=itn)
        case = (pcm.size, language, itn)
        assert got.token_ids == alone.token_ids, case
        assert got.raw == alone.raw and got.rich == alone.rich, case
        assert got.token_frames == alone.token_frames, case
        assert got.token_end_frames == alone.token_end_frames, case
        np.testing.assert_allclose(got.token_confidences, alone.token_confidences, atol=1e-5)
        assert _words(got) == _words(alone), case
    assert batch[-1].token_ids == ()  # shorter than MIN_DECODE_SAMPLES
    assert sum(bool(t.token_ids) for t in batch) >= len(pcms) - 2  # a real test: tokens


# --- exactness: tiny model, both backends ------------------------------------------------------


@pytest.fixture(scope="module")
def torch_tiny(tiny_model_dir: Path) -> Recognizer:
    return Recognizer(_options(tiny_model_dir, backend="torch"))


@pytest.fixture(scope="module")
def onnx_tiny(tiny_model_dir: Path, cache_dir: Path) -> OnnxRecognizer:
    return OnnxRecognizer(_options(cached_export(tiny_model_dir, cache_dir), backend="onnx"))


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_fp32_batches_equal_batch_1_tiny(torch_tiny, onnx_tiny, long_speech, backend) -> None:
    recognizer = torch_tiny if backend == "torch" else onnx_tiny
    assert_batch_exact(recognizer, _segments(long_speech))


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_int8_is_not_batch_exact(tiny_model_dir: Path, backend: str) -> None:
    """int8 quantizes a whole activation tensor with one scale (bench/RESULTS.md)."""
    options = _options(tiny_model_dir, backend=backend, quantize="int8")
    from streamer.model.backends.loading import load_recognizer

    assert not load_recognizer(options).batch_exact


# --- exactness: real size ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def onnx_small(small_model_dir: Path, cache_dir: Path) -> Iterator[OnnxRecognizer]:
    recognizer = OnnxRecognizer(_options(cached_export(small_model_dir, cache_dir)))
    yield recognizer
    del recognizer


@pytest.mark.slow
def test_fp32_batches_equal_batch_1_small_onnx(onnx_small, long_speech) -> None:
    assert_batch_exact(onnx_small, _segments(long_speech, (7.0, 0.1, 2.5, 0.6)))


@pytest.mark.slow
def test_fp32_batches_equal_batch_1_small_torch(small_model_dir: Path, long_speech) -> None:
    recognizer = Recognizer(_options(small_model_dir, backend="torch"))
    assert_batch_exact(recognizer, _segments(long_speech, (6.0, 0.1, 1.5)))


# --- the selection policy ---------------------------------------------------------------------


def job(
    session: str, kind: str = "final", tag: int = 0, samples: int = 1600, first: bool = False
) -> DecodeJob:
    # the tag rides in the first sample so a recognizer can report what it decoded
    pcm = np.full(samples, tag, dtype=np.int16)
    return DecodeJob(
        session_id=session,
        segment_id=0,
        kind=kind,  # type: ignore[arg-type]
        pcm=pcm,
        start_sample=0,
        end_sample=samples,
        language="auto",
        itn=True,
        reason="silence" if kind == "final" else None,
        first=first,
    )


def test_select_takes_the_head_and_similar_lengths_in_order() -> None:
    lengths = [16000, 1000, 15000, 16000, 30000, 14000]
    jobs = [job(f"s{i}", samples=n) for i, n in enumerate(lengths)]
    # 1000 and 30000 would pad the batch past 1.25 x its samples
    assert select_batch(jobs, max_batch=8, max_padding_ratio=1.25) == [0, 2, 3, 5]
    assert select_batch(jobs, max_batch=2, max_padding_ratio=1.25) == [0, 2]
    assert select_batch(jobs, max_batch=1, max_padding_ratio=1.25) == [0]
    assert select_batch(jobs, max_batch=8, max_padding_ratio=100.0) == [0, 1, 2, 3, 4, 5]
    assert select_batch([], max_batch=8, max_padding_ratio=1.25) == []


def test_select_bounds_the_padded_audio_of_a_batch() -> None:
    jobs = [job(f"s{i}", samples=16000) for i in range(6)]
    assert select_batch(jobs, max_batch=8, max_padding_ratio=1.25, max_batch_samples=64000) == [
        0,
        1,
        2,
        3,
    ]
    # the first job is taken even when it alone is longer than the bound
    assert select_batch(jobs, max_batch=8, max_padding_ratio=1.25, max_batch_samples=100) == [0]


def test_select_never_mixes_finals_and_partials() -> None:
    jobs = [job("a"), job("b", "partial"), job("c"), job("d", "partial", first=True)]
    assert select_batch(jobs, max_batch=8, max_padding_ratio=1.25) == [0, 2]
    assert select_batch(jobs[1:], max_batch=8, max_padding_ratio=1.25) == [0, 2]


def test_select_always_takes_the_head_even_when_alone_it_is_an_outlier() -> None:
    jobs = [job("old", samples=400), *(job(f"s{i}", samples=100_000) for i in range(5))]
    assert select_batch(jobs, max_batch=8, max_padding_ratio=1.25) == [0]


def test_worker_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        WorkerOptions(max_batch=0)
    with pytest.raises(ConfigError):
        WorkerOptions(max_padding_ratio=0.5)
    with pytest.raises(ConfigError):
        WorkerOptions(decode_timeout_s=0)


# --- the worker: recording recognizers next to a real one -------------------------------------


class BatchingFake(FakeRecognizer):
    """Decodes batches as its utterances alone; records the tags of every call; can be
    held busy (``gate``) and made to fail on one tag."""

    batch_exact = True  # type: ignore[assignment]
    batches = True

    def __init__(self, fail_tag: int | None = None, gated: bool = False) -> None:
        super().__init__(fail_when=lambda pcm: fail_tag is not None and pcm[0] == fail_tag)
        self.calls_seen: list[list[int]] = []
        self.gate = threading.Semaphore(0)
        self.gated = gated
        self.started = threading.Event()

    def decode_batch(self, pcms, *, languages, use_itns):
        self._enter([int(p[0]) for p in pcms])
        return [
            FakeRecognizer.decode(self, p, language=la, use_itn=i)
            for p, la, i in zip(pcms, languages, use_itns, strict=True)
        ]

    def decode(self, pcm, *, language="auto", use_itn=True):
        self._enter([int(pcm[0])])
        return super().decode(pcm, language=language, use_itn=use_itn)

    def _enter(self, tags: list[int]) -> None:
        self.calls_seen.append(tags)
        self.started.set()
        if self.gated:
            self.gate.acquire(timeout=timeout_s(10))


class Recording(RecognizerBase):
    """A real recognizer that records the size of every batch it decodes."""

    def __init__(self, inner: CtcRecognizer) -> None:
        self.inner = inner
        self.sizes: list[int] = []
        self.name = inner.name
        self.batches = True
        self.exact = inner.batch_exact

    @property
    def batch_exact(self) -> bool:
        return self.exact

    def decode(self, pcm, *, language="auto", use_itn=True):
        self.sizes.append(1)
        return self.inner.decode(pcm, language=language, use_itn=use_itn)

    def decode_batch(self, pcms, *, languages, use_itns):
        self.sizes.append(len(pcms))
        return self.inner.decode_batch(pcms, languages=languages, use_itns=use_itns)


def _speech_job(session: str, pcm: np.ndarray, kind: str = "final") -> DecodeJob:
    return DecodeJob(session, 0, kind, pcm, 0, pcm.size, "auto", True)  # type: ignore[arg-type]


def test_queued_jobs_go_in_one_real_call_with_their_batch_1_results(onnx_tiny, long_speech) -> None:
    recording = Recording(onnx_tiny)
    worker = ModelWorker(lambda: recording, decode_timeout_s=None, max_batch=DEFAULT_MAX_BATCH)
    pcms = _segments(long_speech, (1.0, 1.1, 0.9, 1.2))
    collect = Answers()
    for index, pcm in enumerate(pcms[:4]):  # queued before the worker runs: one batch
        worker.submit(_speech_job(f"s{index}", pcm), collect)
    worker.start()
    results = collect.wait(4)
    worker.stop()
    assert recording.sizes == [4]
    for result in results:
        assert result.batch_size == 4 and result.transcript is not None
        alone = onnx_tiny.decode(result.job.pcm)
        assert result.transcript.token_ids == alone.token_ids
        assert result.queue_ms >= 0 and result.decode_ms > 0


class HeldFirst(Recording):
    """A real recognizer whose first decode waits until :attr:`release` is set."""

    def __init__(self, inner: CtcRecognizer) -> None:
        super().__init__(inner)
        self.started = threading.Event()
        self.release = threading.Event()

    def decode(self, pcm, *, language="auto", use_itn=True):
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(timeout_s(30))
        return super().decode(pcm, language=language, use_itn=use_itn)


def test_a_live_final_goes_before_the_background_finals_waiting(onnx_tiny, long_speech) -> None:
    """Two uploads' finals wait while one of them decodes; a live final that comes then
    waits for that one decode only, and alone; the uploads' finals then go in one batch,
    round robin, each with its batch-1 tokens."""
    recording = HeldFirst(onnx_tiny)
    worker = ModelWorker(lambda: recording, decode_timeout_s=None, max_batch=DEFAULT_MAX_BATCH)
    pcms = _segments(long_speech, (1.0, 1.1, 0.9, 1.2, 1.0, 1.05, 0.95))
    collect = Answers()
    worker.start()
    assert worker.ready.wait(timeout_s(30))

    def background(session: str, index: int) -> DecodeJob:
        return replace(_speech_job(session, pcms[index]), segment_id=index, background=True)

    worker.submit(background("a", 0), collect)
    assert recording.started.wait(timeout_s(30))  # a's first final is decoding
    for session, index in (("a", 1), ("a", 2), ("a", 3), ("b", 4), ("b", 5)):
        worker.submit(background(session, index), collect)
    worker.submit(_speech_job("live", pcms[6]), collect)
    recording.release.set()
    results = collect.wait(7)
    worker.stop()
    order = [(r.job.session_id, r.job.segment_id) for r in results]
    assert order == [("a", 0), ("live", 0), ("a", 1), ("b", 4), ("a", 2), ("b", 5), ("a", 3)]
    assert recording.sizes == [1, 1, 5] and results[1].batch_size == 1
    for result in results:
        assert result.transcript is not None
        assert result.transcript.token_ids == onnx_tiny.decode(result.job.pcm).token_ids


def test_one_queued_job_runs_alone_through_decode(onnx_tiny, long_speech) -> None:
    recording = Recording(onnx_tiny)
    worker = ModelWorker(lambda: recording, decode_timeout_s=None)
    collect = Answers()
    worker.start()
    assert worker.ready.wait(timeout_s(10))
    worker.submit(_speech_job("s", long_speech[:SAMPLE_RATE]), collect)
    (result,) = collect.wait(1)
    worker.stop()
    assert recording.sizes == [1] and result.batch_size == 1


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_the_cpu_decodes_at_batch_1_unless_asked(
    tiny_model_dir: Path, long_speech, quantize
) -> None:
    """Automatic batching is for accelerators (on 2 CPU cores it measured no better)."""
    from streamer.model.backends.loading import load_recognizer

    recognizer = load_recognizer(_options(tiny_model_dir, backend="onnx", quantize=quantize))
    for max_batch, sizes in ((None, [1, 1, 1]), (3, [3])):
        recording = Recording(recognizer)
        worker = ModelWorker(lambda r=recording: r, max_batch=max_batch)
        collect = Answers()
        for index in range(3):
            worker.submit(_speech_job(f"s{index}", long_speech[:SAMPLE_RATE]), collect)
        worker.start()
        collect.wait(3)
        worker.stop()
        assert recording.sizes == sizes


def test_batch_order_first_partials_then_finals_then_refreshes(monkeypatch) -> None:
    """First partials go first, batched with each other but not with a refresh (which
    would hold up the finals); then the finals; the refresh last."""
    from streamer.model.serving import job_queue

    monkeypatch.setattr(job_queue, "FINAL_PATIENCE_MS", 60_000.0)  # none has waited it
    fake = BatchingFake()
    worker = ModelWorker(lambda: fake, max_batch=3)
    collect = Answers()
    worker.submit(job("a", "partial", 1), collect)  # a refresh
    worker.submit(job("b", "partial", 2, first=True), collect)
    worker.submit(job("c", "final", 3), collect)
    worker.submit(job("d", "partial", 4, first=True), collect)
    worker.submit(job("e", "final", 5), collect)
    worker.start()
    results = collect.wait(5)
    worker.stop()
    assert fake.calls_seen == [[2, 4], [3, 5], [1]]
    assert sorted(r.batch_size for r in results) == [1, 2, 2, 2, 2]


def test_a_failing_batch_fails_only_its_bad_job() -> None:
    fake = BatchingFake(fail_tag=7)
    worker = ModelWorker(lambda: fake, max_batch=8)
    collect = Answers()
    for tag in (6, 7, 8):
        worker.submit(job(f"s{tag}", "final", tag), collect)
    worker.start()
    results = {int(r.job.pcm[0]): r for r in collect.wait(3)}
    worker.stop()
    assert fake.calls_seen == [[6, 7, 8], [6], [7], [8]]  # the batch, then one by one
    assert results[7].failure == DecodeFailure.DECODE_FAILED
    assert "injected decode failure" in results[7].detail
    assert results[6].transcript is not None and results[8].transcript is not None
    assert worker.failure is None


def test_superseding_and_dropping_while_a_batch_runs() -> None:
    fake = BatchingFake(gated=True)
    worker = ModelWorker(lambda: fake, max_batch=8)
    collect = Answers()
    worker.submit(job("a", "partial", 1), collect)
    worker.submit(job("b", "partial", 2), collect)
    worker.start()
    assert fake.started.wait(timeout_s(10))  # [1, 2] is running
    worker.submit(job("a", "partial", 3), collect)  # queued: does not touch the running 1
    worker.submit(job("a", "partial", 4), collect)  # supersedes 3
    worker.submit(job("b", "partial", 5), collect)
    assert worker.drop_session("b") == 1  # 5 is forgotten; the running 2 is answered
    for _ in range(3):
        fake.gate.release()
    results = collect.wait(4)
    worker.stop()
    tags = [int(r.job.pcm[0]) for r in results]
    assert sorted(tags) == [1, 2, 3, 4]  # each answered once, 5 never
    assert [int(r.job.pcm[0]) for r in results if r.dropped] == [3]
    assert fake.calls_seen[0] == [1, 2] and [4] in fake.calls_seen


def test_the_watchdog_answers_every_job_of_a_stalled_batch() -> None:
    fake = BatchingFake(gated=True)
    worker = ModelWorker(lambda: fake, decode_timeout_s=0.2, max_batch=8)
    failed = threading.Event()
    worker.on_failure = lambda reason: failed.set()
    collect = Answers()
    worker.submit(job("a", "final", 1), collect)
    worker.submit(job("b", "partial", 2), collect)
    worker.submit(job("c", "final", 3), collect)
    worker.start()
    assert failed.wait(timeout_s(10))
    results = {int(r.job.pcm[0]): r for r in collect.wait(3)}
    fake.gate.release()
    worker.stop()
    assert fake.calls_seen == [[1, 3]]  # the finals' batch stalled; the partial waited
    assert results[1].failure == results[3].failure == DecodeFailure.MODEL_STALLED
    assert results[2].dropped
    assert len(collect.results) == 3  # the late batch is not delivered again


# --- the command line -------------------------------------------------------------------------


def test_serve_max_batch_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamer.cli import build_parser

    assert build_parser().parse_args(["serve"]).max_batch is None  # auto
    assert build_parser().parse_args(["serve", "--max-batch", "16"]).max_batch == 16
    assert build_parser().parse_args(["serve", "--max-batch", "auto"]).max_batch is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-batch", "0"])
    monkeypatch.setenv("STREAMER_MAX_BATCH", "4")
    assert build_parser().parse_args(["serve"]).max_batch == 4


def test_metrics_count_batch_sizes() -> None:
    from streamer.server.metrics import Metrics

    metrics = Metrics()
    for size in (1, 4, 4):
        metrics.observe_decode(DecodeResult(job=job("s"), decode_ms=5.0, batch_size=size))
    text = metrics.render().decode()
    assert 'streamer_decode_batch_size_bucket{le="1.0"} 1.0' in text
    assert 'streamer_decode_batch_size_bucket{le="4.0"} 3.0' in text
    assert "streamer_decode_batch_size_sum 9.0" in text
