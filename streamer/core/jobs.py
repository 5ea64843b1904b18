"""Decode jobs and their results: what the session asks of the model worker (I/O-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from streamer.core.segmenter import EndReason
from streamer.core.transcript import Transcript

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


@dataclass(frozen=True, eq=False)
class DecodeResult:
    """The worker's answer to one job. Exactly one of transcript/error/dropped is set."""

    job: DecodeJob
    transcript: Transcript | None = None  # the decode succeeded
    error: str | None = None  # the decode raised; this is its message (for the log only)
    error_code: str = "decode_failed"  # what clients are told when error is set
    dropped: bool = False  # the worker discarded the job (superseded partial)
    queue_ms: float = 0.0  # time between submission and the start of decoding
    decode_ms: float = 0.0  # time the model spent (on the whole batch this job ran in)
    batch_size: int = 1  # jobs decoded in the same model call as this one
