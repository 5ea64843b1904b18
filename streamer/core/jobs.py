"""Decode jobs and their results: what the session asks of the model worker (I/O-free)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.core.hotwords import Hotwords
from streamer.core.protocol import Final
from streamer.core.segmenter import EndReason
from streamer.core.transcript import Transcript
from streamer.core.words import transcript_words

JobKind = Literal["final", "partial"]


@dataclass(frozen=True, eq=False)
class DecodeJob:
    """Decode ``pcm`` (one segment so far, or all of it) for one session."""

    session_id: str
    segment_id: int
    kind: JobKind
    pcm: np.ndarray  # 16 kHz mono int16
    start_sample: int  # where pcm begins in the session's 16 kHz timeline
    end_sample: int  # one past where pcm ends
    language: str  # "auto" or a language code
    itn: bool
    reason: EndReason | None = None  # why the segment ended (finals only)
    first: bool = False  # the segment's first partial: it decides time-to-first-token
    # a partial of exactly the audio the segment's final will hold if no speech follows:
    # decoded during the pause, it becomes the final the moment the endpoint is reached
    speculative: bool = False
    hotwords: Hotwords = ()  # phrases to favour (the server's and the session's); () greedy
    background: bool = False  # a file upload's job: decoded after every live job
    # False: its client sends faster than real time (a file streamed unpaced): its live
    # jobs go after every real-time session's, which it must not slow
    realtime: bool = True
    # a partial of a trailing window of its segment (core/partial_window.py): where the
    # segment itself starts (the model's feature cache reuses the segment's frames); None:
    # pcm is the segment from its first sample
    segment_start_sample: int | None = None


class DecodeFailure(Enum):
    """Why a job got no transcript: the one table of decode failures' codes and messages.

    ``code`` is the error code clients are told (in the final's ``error`` and a non-fatal
    ``error`` message); ``message`` is its text, formatted with the ``segment_id``. The
    failure's own detail (an exception's text) stays in the server log.
    """

    DECODE_FAILED = (
        "decode_failed",
        "decoding segment {segment_id} failed (details are in the server log)",
    )
    MODEL_STALLED = (
        "model_stalled",
        "the model stopped answering; the server is restarting (retry shortly)",
    )

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message

    def client_message(self, segment_id: int) -> str:
        return self.message.format(segment_id=segment_id)


@dataclass(frozen=True, eq=False)
class DecodeResult:
    """The worker's answer to one job. Exactly one of transcript/failure/dropped is set."""

    job: DecodeJob
    transcript: Transcript | None = None  # the decode succeeded
    failure: DecodeFailure | None = None  # the decode failed: what clients are told
    detail: str = ""  # why it failed (an exception's text), for the server log only
    dropped: bool = False  # the worker discarded the job (superseded partial)
    interrupted: bool = False  # dropped midway: its decode stopped so that a final goes first
    queue_ms: float = 0.0  # time between submission and the start of decoding
    decode_ms: float = 0.0  # time the model spent (on the whole batch this job ran in)
    batch_size: int = 1  # jobs decoded in the same model call as this one


def final_of_speculation(job: DecodeJob, reason: EndReason) -> DecodeJob:
    """The final's job for a segment that a speculative decode (``job``) already covered."""
    return replace(job, kind="final", reason=reason, first=False, speculative=False)


def final_message(result: DecodeResult, error: dict[str, str] | None) -> Final:
    """The final of a final's (or a speculation's) result; ``error`` when it failed."""
    job, t = result.job, result.transcript
    start_ms, end_ms = samples_ms(job.start_sample), samples_ms(job.end_sample)
    return Final(
        segment_id=job.segment_id,
        start_ms=start_ms,
        end_ms=end_ms,
        text=t.text if t else "",
        language=t.language if t else None,
        emotion=t.emotion if t else None,
        event=t.event if t else None,
        raw=t.raw if t else "",
        rich=t.rich if t else "",
        reason=job.reason or "stop",
        decode_ms=round(result.decode_ms, 1),
        queue_ms=round(result.queue_ms, 1),
        error=error,
        words=transcript_words(t, start_ms, end_ms) if t else (),
    )


def samples_ms(samples: int) -> float:
    """A sample count of the session's timeline in ms, as messages carry it."""
    return round(samples * 1000 / SAMPLE_RATE, 1)
