"""The seam between the model worker and a recognizer: everything the worker uses.

:class:`SpeechRecognizer` declares every capability the worker reads (the worker and the
decoding probe nothing); :class:`RecognizerBase` gives the defaults of a recognizer that
runs in this process, decodes one utterance per call and keeps nothing per session, so a
backend (``backends/torch_backend.py``, ``backends/onnx_backend.py``, both through
:class:`~streamer.model.decode.decoding.CtcRecognizer`), the model process
(:class:`~streamer.model.serving.process.ProcessRecognizer`) and a test double each say
only what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from streamer.core.jobs import DecodeJob
from streamer.core.transcript import Transcript


class SpeechRecognizer(Protocol):
    """What the worker needs of a recognizer."""

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> str | None:
        """Where the model runs ("cpu", "cuda:0"); None where it does not say."""

    @property
    def batches(self) -> bool:
        """Whether :meth:`decode_batch` decodes several utterances in one model call."""

    @property
    def batch_exact(self) -> bool:
        """Whether a batch gives each utterance exactly its tokens alone (fp32)."""

    @property
    def restartable(self) -> bool:
        """Whether the worker may kill it and load another (a model process)."""

    @property
    def failure(self) -> str | None:
        """Why a model process is gone; None while it runs (always, in this process)."""

    @property
    def interruptible(self) -> bool:
        """Whether :meth:`interrupt` can stop a model call midway (ONNX Runtime can)."""

    def decode(
        self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True
    ) -> Transcript: ...

    def decode_batch(
        self,
        pcms: Sequence[np.ndarray],
        *,
        languages: Sequence[str],
        use_itns: Sequence[bool],
    ) -> list[Transcript]: ...

    def decode_jobs(self, jobs: Sequence[DecodeJob]) -> list[Transcript]:
        """The transcripts of ``jobs``, in one model call where it batches: a recognizer
        that keeps features per session (a CTC backend, or its model process) reads the
        jobs themselves; the others decode their audio."""

    def forget_session(self, session_id: str) -> None:
        """Drop what is kept for a departed session (cached features)."""

    def close(self) -> None:
        """Release the model (a model process exits); called from the worker's thread."""

    def kill(self) -> None:
        """End a stuck call at once (a model process is killed); from any thread."""

    def interrupt(self) -> bool:
        """Ask the model call in progress, if any, to stop as soon as it can (from any
        thread): that call then raises :class:`~streamer.errors.DecodeInterrupted`.
        True when a call was asked; False when none runs or the model cannot stop one."""


class RecognizerBase:
    """The defaults: in this process, one utterance per model call, nothing kept."""

    batches = False
    restartable = False
    interruptible = False
    failure: str | None = None

    @property
    def device(self) -> str | None:
        return None

    @property
    def batch_exact(self) -> bool:
        return False

    def decode(
        self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True
    ) -> Transcript:
        raise NotImplementedError

    def decode_batch(
        self,
        pcms: Sequence[np.ndarray],
        *,
        languages: Sequence[str],
        use_itns: Sequence[bool],
    ) -> list[Transcript]:
        """One call per utterance (a recognizer that batches overrides it)."""
        return [
            self.decode(pcm, language=language, use_itn=use_itn)
            for pcm, language, use_itn in zip(pcms, languages, use_itns, strict=True)
        ]

    def decode_jobs(self, jobs: Sequence[DecodeJob]) -> list[Transcript]:
        """The jobs' audio: alone through :meth:`decode`, several through
        :meth:`decode_batch`."""
        if len(jobs) == 1:
            (job,) = jobs
            return [self.decode(job.pcm, language=job.language, use_itn=job.itn)]
        return self.decode_batch(
            [job.pcm for job in jobs],
            languages=[job.language for job in jobs],
            use_itns=[job.itn for job in jobs],
        )

    def forget_session(self, session_id: str) -> None:
        return None

    def close(self) -> None:
        return None

    def kill(self) -> None:
        return None

    def interrupt(self) -> bool:
        return False
