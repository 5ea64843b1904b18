"""What every backend shares: audio in, CTC logits from the backend, a transcript out.

A backend (:mod:`streamer.model.backends.torch_backend` for torch,
:mod:`streamer.model.backends.onnx_backend` for ONNX Runtime) only turns a batch of
waveforms into CTC logits, one ``(frames, vocab)`` array per utterance. Everything around
that lives here, once: checking the audio and the options, CTC decoding (greedy,
:mod:`streamer.model.decode.ctc`; with hotwords, :mod:`streamer.model.decode.ctc_beam`),
the tokenizer (:mod:`streamer.model.decode.tokenizer`) and the tagged transcript; and
:func:`decode_job`, the one path from a decode job to its result (the worker thread's and
offline transcription's).

Encoder frame ``f`` of an utterance: frames 0-3 are the query frames (language, emotion,
event, ITN); frame ``f >= 4`` covers audio from ``(f - 4) * FRAME_MS`` milliseconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from streamer.core.jobs import DecodeFailure, DecodeJob, DecodeResult
from streamer.core.transcript import Transcript
from streamer.errors import (
    ConfigError,
    DecodeError,
    DecodeInterrupted,
    ModelError,
    ModelProcessGone,
)
from streamer.model.decode.ctc import greedy_ctc
from streamer.model.decode.tokenizer import (
    Tokenizer,
)
from streamer.model.interface import RecognizerBase
from streamer.model.sensevoice import (
    LANGUAGES,
    LID_ROWS,
    MIN_DECODE_SAMPLES,
    SAMPLE_RATE,
    TEXTNORM_ROWS,
    rich_text,
)

if TYPE_CHECKING:
    from streamer.model.decode.features import FeatureCache
    from streamer.model.decode.frontend import Frontend
    from streamer.model.decode.hotword_graphs import CompiledHotwords, HotwordGraphs
    from streamer.model.interface import SpeechRecognizer
    from streamer.model.options import RecognizerOptions

logger = logging.getLogger(__name__)

WARMUP_SECONDS = (1.0, 3.0, 7.0)  # lengths decoded at start-up


@dataclass(frozen=True)
class Utterance:
    """One item of a decode request, ready for a backend."""

    waveform: np.ndarray  # float32 samples at 16 kHz, scaled like funasr's s16le input
    language_row: int  # query row of the model's embedding (LID_ROWS)
    textnorm_row: int  # query row of the model's embedding (TEXTNORM_ROWS)
    # the waveform's features (frames, 560), computed already (the feature cache's);
    # None: the backend computes them
    features: np.ndarray | None = None
    # hotwords: the phrases' context graph and the search's beam; None decodes greedily
    hotwords: CompiledHotwords | None = None
    beam: int = 1


def padded_features(frontend: Frontend, batch: Sequence[Utterance]) -> tuple[np.ndarray, list[int]]:
    """The batch's features, zero-padded to the longest, (N, T, 560) float32, and each
    one's frames: an utterance's own (the feature cache's) or ``frontend``'s of its
    waveform (what funasr's ``extract_fbank`` returns, as arrays)."""
    features = [u.features if u.features is not None else frontend(u.waveform) for u in batch]
    lengths = [f.shape[0] for f in features]
    padded = np.zeros((len(batch), max(lengths), frontend.dim), np.float32)
    for row, rows in enumerate(features):
        padded[row, : rows.shape[0]] = rows
    return padded, lengths


# --- requests -------------------------------------------------------------------------------


def as_waveform(pcm: np.ndarray | bytes) -> np.ndarray:
    """float32 samples scaled exactly as funasr's load_bytes() scales s16le input.

    ``pcm`` is an int16 array, s16le bytes, or a float32 array in [-1, 1] (used as is).
    """
    if isinstance(pcm, np.ndarray) and pcm.dtype.kind == "f":
        if pcm.ndim != 1:
            raise ConfigError(f"audio must be mono (one dimension), not shape {pcm.shape}")
        return np.ascontiguousarray(pcm, dtype=np.float32)
    return as_int16(pcm).astype(np.float32) / 32768


def as_int16(pcm: np.ndarray | bytes) -> np.ndarray:
    if isinstance(pcm, bytes | bytearray | memoryview):
        data = bytes(pcm)
        if len(data) % 2:
            raise ConfigError("s16le audio must have an even number of bytes")
        return np.frombuffer(data, dtype="<i2")
    array = np.asarray(pcm)
    if array.ndim != 1:
        raise ConfigError(f"audio must be mono (one dimension), not shape {array.shape}")
    if array.dtype == np.int16:
        return array
    raise ConfigError(f"audio must be int16, float32 or s16le bytes, not {array.dtype}")


def language_row(language: str) -> int:
    try:
        return LID_ROWS[language]
    except KeyError:
        raise ConfigError(
            f"unknown language {language!r}; choose one of {', '.join(LANGUAGES)}"
        ) from None


def textnorm_row(use_itn: bool) -> int:
    return TEXTNORM_ROWS["withitn" if use_itn else "woitn"]


def empty_transcript(samples: int) -> Transcript:
    return Transcript.from_raw(
        "", rich="", token_ids=(), audio_ms=samples * 1000 / SAMPLE_RATE, decode_ms=0.0
    )


# --- the shared recognizer ------------------------------------------------------------------


class CtcRecognizer(RecognizerBase):
    """The decode path every backend shares; a backend implements :meth:`_logits`.

    Not thread-safe: decode from one thread at a time (the model worker's).
    """

    options: RecognizerOptions  # how the backend was loaded (set by its constructor)
    tokenizer: Tokenizer
    banned_ids: tuple[int, ...] = ()  # token ids that never win a frame
    _device: str  # "cpu" or "cuda:N" (set by the backend's constructor)
    _piece_table: list[str] | None = None  # the tokenizer's pieces, read at the first decode
    # the backend's features, as this project computes them; None where the backend
    # computes its own (then decode_jobs has no feature cache)
    frontend: Frontend | None = None
    _feature_cache: FeatureCache | None = None
    _hotword_graphs: HotwordGraphs | None = None
    batches = True  # decode_batch is one padded model call

    @property
    def name(self) -> str:
        """The model as the user named it (hub id, directory or random:NAME)."""
        return self.options.model

    @property
    def device(self) -> str:
        """Where the model runs: "cpu" or "cuda:N"."""
        return self._device

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def batch_exact(self) -> bool:
        """Whether :meth:`decode_batch` gives each utterance exactly its tokens alone.

        True in fp32 (measured on the CPU, both backends; bench/RESULTS.md "Dynamic
        batching"). int8 quantizes each activation tensor with one scale, so the other
        rows of a batch (and its padding) change a row's tokens.
        """
        return self.options.quantize is None

    def decode(
        self, pcm: np.ndarray | bytes, *, language: str = "auto", use_itn: bool = True
    ) -> Transcript:
        """Recognise one utterance of 16 kHz mono audio.

        ``pcm`` is an int16 array, s16le bytes, or a float32 array in [-1, 1]. Audio shorter
        than :data:`MIN_DECODE_SAMPLES` gives an empty transcript. Raises DecodeError when
        the model fails (the recognizer stays usable) and ConfigError for malformed audio or
        an unknown language.
        """
        return self.decode_batch([pcm], languages=[language], use_itns=[use_itn])[0]

    def decode_batch(
        self,
        pcms: Sequence[np.ndarray | bytes],
        *,
        languages: Sequence[str],
        use_itns: Sequence[bool],
    ) -> list[Transcript]:
        """Recognise several utterances in one model call (padded to the longest).

        Each transcript is the one :meth:`decode` gives for that utterance alone where
        :attr:`batch_exact` holds (not with int8); ``decode_ms`` is the time of the whole
        call.
        """
        if not len(pcms) == len(languages) == len(use_itns):
            raise ConfigError("decode_batch needs one language and one ITN flag per utterance")
        started = time.perf_counter()
        requests = [
            Utterance(as_waveform(pcm), language_row(language), textnorm_row(use_itn))
            for pcm, language, use_itn in zip(pcms, languages, use_itns, strict=True)
        ]
        return self._decode_requests(requests, started)

    def decode_jobs(self, jobs: Sequence[DecodeJob]) -> list[Transcript]:
        """:meth:`decode_batch` of the jobs' audio, with each segment's features computed
        incrementally: the filterbank of samples an earlier job of the same segment had
        is reused (:class:`~streamer.model.decode.features.FeatureCache`), bit for bit the same.
        """
        started = time.perf_counter()
        cache = self.feature_cache
        requests = []
        for job in jobs:
            waveform = as_waveform(job.pcm)
            request = Utterance(waveform, language_row(job.language), textnorm_row(job.itn))
            if cache is not None and waveform.size >= MIN_DECODE_SAMPLES:
                request = replace(request, features=cache.features(job, waveform))
            if job.hotwords:
                request = self._with_hotwords(request, job)
            requests.append(request)
        return self._decode_requests(requests, started)

    def _with_hotwords(self, request: Utterance, job: DecodeJob) -> Utterance:
        """``request`` with the job's phrase set compiled (once per set: cached)."""
        graphs = self._hotword_graphs
        if graphs is None:
            from streamer.model.decode.hotword_graphs import HotwordGraphs

            graphs = HotwordGraphs(self.tokenizer, max_tokens=self.options.hotwords_max_tokens)
            self._hotword_graphs = graphs
        full = job.kind == "final" or job.speculative  # a speculative partial may be the final
        beam = self.options.hotword_beam if full else self.options.hotword_partial_beam
        return replace(request, hotwords=graphs.compile(job.hotwords), beam=beam)

    @property
    def feature_cache(self) -> FeatureCache | None:
        """The open segments' features (None where the backend computes its own)."""
        if self._feature_cache is None and self.frontend is not None:
            from streamer.model.decode.features import FeatureCache

            self._feature_cache = FeatureCache(self.frontend)
        return self._feature_cache

    def forget_session(self, session_id: str) -> None:
        """Drop what is cached for ``session_id`` (it has gone). Any thread."""
        if self._feature_cache is not None:
            self._feature_cache.forget(session_id)

    def _decode_requests(self, requests: list[Utterance], started: float) -> list[Transcript]:
        runnable = [i for i, r in enumerate(requests) if r.waveform.size >= MIN_DECODE_SAMPLES]
        logits: dict[int, np.ndarray] = {}
        if runnable:
            seconds = sum(requests[i].waveform.size for i in runnable) / SAMPLE_RATE
            try:
                outputs = self._logits([requests[i] for i in runnable])
            except (RuntimeError, MemoryError) as error:  # out of memory, a backend failure
                raise DecodeError(f"decoding {seconds:.2f} s of audio failed: {error}") from error
            logits = dict(zip(runnable, outputs, strict=True))
        results = []
        for index, request in enumerate(requests):
            samples = request.waveform.size
            if index not in logits:
                results.append(empty_transcript(samples))
                continue
            hotwords = request.hotwords
            if hotwords is None or hotwords.graph is None:
                tokens = greedy_ctc(logits[index], banned_ids=self.banned_ids)
            else:
                from streamer.model.decode.ctc_beam import biased_ctc

                tokens = biased_ctc(
                    logits[index], hotwords.graph, beam=request.beam, banned_ids=self.banned_ids
                )
            raw = self.tokenizer.decode(tokens.ids)
            results.append(
                Transcript.from_raw(
                    raw,
                    rich=rich_text(raw) if raw else "",
                    token_ids=tokens.ids,
                    token_frames=tokens.frames,
                    token_confidences=tokens.confidences,
                    token_end_frames=tokens.end_frames,
                    token_pieces=self._pieces_of(tokens.ids),
                    audio_ms=samples * 1000 / SAMPLE_RATE,
                    decode_ms=(time.perf_counter() - started) * 1000,
                    hotwords_unused=hotwords.unused if hotwords is not None else "",
                )
            )
        return results

    def _pieces_of(self, token_ids: Sequence[int]) -> tuple[str, ...]:
        """The tokenizer's piece of each token (``▁the``, ``<|en|>``), for word timings;
        empty when the tokenizer has no piece table."""
        table = self._piece_table
        if table is None:
            try:
                table = self.tokenizer.pieces()
            except ModelError as error:
                logger.warning("no word timings: %s", error)
                table = []
            self._piece_table = table
        if not table or max(token_ids, default=0) >= len(table):
            return ()
        return tuple(table[i] for i in token_ids)

    def warmup(self) -> None:
        """Decode a few lengths of low noise so first users pay no first-call costs."""
        started = time.perf_counter()
        rng = np.random.default_rng(0)
        for seconds in WARMUP_SECONDS:
            noise = rng.normal(0.0, 30.0, int(seconds * SAMPLE_RATE)).astype(np.int16)
            self.decode(noise)
        logger.info("warm-up took %.1f s", time.perf_counter() - started)

    def _logits(self, batch: Sequence[Utterance]) -> list[np.ndarray]:
        """CTC logits, one float32 ``(encoder frames, vocab)`` array per utterance."""
        raise NotImplementedError


def decode_jobs(recognizer: SpeechRecognizer, jobs: Sequence[DecodeJob]) -> list[Transcript]:
    """The transcripts of ``jobs``, in one model call where the recognizer batches
    (:meth:`~streamer.model.interface.SpeechRecognizer.decode_jobs`). Raises what the
    recognizer raises."""
    return list(recognizer.decode_jobs(jobs))


class PartialFailures:
    """Failing partial decodes logged once per burst, not a traceback each.

    A segment's partials are decoded again and again as it grows, so one bad input fails
    them all (16 tracebacks in 14.5 s were seen). The first failure of a session's burst
    is logged in one line (its traceback at DEBUG); the next ones are counted; the
    session's next decode that works (or its final) ends the burst with one line saying
    how many failed. Used by one thread (the worker's).
    """

    def __init__(self) -> None:
        self._failed: dict[str, int] = {}  # session_id -> partial decodes failed in a row

    def failed(self, job: DecodeJob) -> bool:
        """Count a failed partial decode of ``job``; True when it starts a burst (log it)."""
        count = self._failed.get(job.session_id, 0)
        self._failed[job.session_id] = count + 1
        return count == 0

    def ended(self, job: DecodeJob) -> None:
        """A decode of ``job``'s session worked, or its final was tried: the burst ends."""
        count = self._failed.pop(job.session_id, 0)
        if count > 1:
            logger.warning(
                "session %s: %d partial decodes failed in a row (the first is logged above)",
                job.session_id,
                count,
            )


def decode_job(
    recognizer: SpeechRecognizer,
    job: DecodeJob,
    *,
    queue_ms: float = 0.0,
    partial_failures: PartialFailures | None = None,
) -> DecodeResult:
    """Decode one job: a transcript, or ``DecodeFailure.DECODE_FAILED`` when it raised.

    The failure is logged here with its traceback (a burst of failing partials once,
    with ``partial_failures``); its text travels in ``detail`` only.
    """
    started = time.perf_counter()
    try:
        (transcript,) = decode_jobs(recognizer, [job])
    except DecodeInterrupted:  # the worker stopped it for a final: not a failure
        return interrupted(job, queue_ms, (time.perf_counter() - started) * 1000)
    except Exception as exc:  # one bad decode must not stop the worker
        where = f"session {job.session_id}, segment {job.segment_id}, {job.kind}"
        counted = partial_failures is not None and job.kind == "partial"
        if isinstance(exc, ModelProcessGone):  # the worker logs what it does about it
            logger.warning("decode failed (%s): %s", where, exc)
        elif counted and partial_failures is not None:
            if partial_failures.failed(job):  # the first of a burst: one line (and at
                # DEBUG its traceback); the final of the segment keeps its traceback
                logger.error(
                    "decode failed (%s): %s: %s; the session's next failing partials are "
                    "counted, not logged",
                    where,
                    type(exc).__name__,
                    exc,
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )
        else:
            logger.exception("decode failed (%s)", where)
        if job.kind == "final" and partial_failures is not None:
            partial_failures.ended(job)
        return DecodeResult(
            job=job,
            failure=DecodeFailure.DECODE_FAILED,
            detail=f"{type(exc).__name__}: {exc}",
            queue_ms=queue_ms,
            decode_ms=(time.perf_counter() - started) * 1000,
        )
    decode_ms = (time.perf_counter() - started) * 1000
    if partial_failures is not None:
        partial_failures.ended(job)
    return DecodeResult(job=job, transcript=transcript, queue_ms=queue_ms, decode_ms=decode_ms)


def interrupted(
    job: DecodeJob, queue_ms: float, decode_ms: float, batch_size: int = 1
) -> DecodeResult:
    """The answer to a partial whose decode the worker stopped so that a final goes
    first: dropped (the session asks for a newer one), and counted as interrupted.
    ``decode_ms`` is the whole batch's, as in every result."""
    return DecodeResult(
        job=job,
        dropped=True,
        interrupted=True,
        queue_ms=queue_ms,
        decode_ms=decode_ms,
        batch_size=batch_size,
    )
