"""Drive a compatible-protocol adapter with plain bytes and JSON, no sockets.

The "worker" here answers each decode job with text naming it, either at once or when
the test says so (to check ordering while finals are still decoding).
"""

from __future__ import annotations

import orjson

from streamer.core.jobs import DecodeFailure, DecodeJob, DecodeResult
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session, SessionOptions
from streamer.core.transcript import Transcript
from streamer.core.wire import WireAdapter
from tests.fakes import loudness_classifier


def make_session(session_id: str = "s1", **stream) -> Session:
    return Session(
        session_id,
        SessionOptions(model_name="fake"),
        StreamOptions(**stream),
        loudness_classifier(),
    )


def words_for(job: DecodeJob) -> str:
    """A transcript that grows with the audio: one word per 100 ms decoded."""
    n = max(1, (job.end_sample - job.start_sample) // 1600)
    return " ".join(f"w{job.segment_id}_{i}" for i in range(n))


class Harness:
    """An adapter, its session, and a worker that answers jobs when asked."""

    def __init__(self, adapter: WireAdapter, *, text_for=words_for, immediate: bool = True):
        self.adapter = adapter
        self.session = adapter.session
        self.text_for = text_for
        self.immediate = immediate
        self.queued: list[DecodeJob] = []
        self.frames = []  # every OutFrame, in order
        self.fail_next_final = False

    @property
    def sent(self) -> list[dict]:
        return [orjson.loads(f.data) for f in self.frames if f.data]  # count-only: not sent

    def types(self) -> list[str]:
        return [m["type"] for m in self.sent]

    def of_type(self, kind: str) -> list[dict]:
        return [m for m in self.sent if m["type"] == kind]

    def start(self) -> Harness:
        self.adapter.start()
        self.pump()
        return self

    def pump(self) -> None:
        """Collect the adapter's frames and the session's jobs (answering them if immediate)."""
        while True:
            self.frames += self.adapter.drain()
            self.queued += self.session.jobs_to_submit()
            if not (self.immediate and self.queued):
                return
            self._decode(len(self.queued))

    def answer(self, count: int | None = None) -> None:
        """Answer the queued jobs (the first ``count`` of them), then pump."""
        self._decode(len(self.queued) if count is None else count)
        self.pump()

    def _decode(self, n: int) -> None:
        jobs, self.queued = self.queued[:n], self.queued[n:]
        for job in jobs:
            # the decode of the next final fails; so does a speculative decode of it (after
            # which the session decodes the final again: that fails too, and ends the flag)
            if (job.kind == "final" or job.speculative) and self.fail_next_final:
                self.fail_next_final = job.kind != "final"
                result = DecodeResult(
                    job=job, failure=DecodeFailure.DECODE_FAILED, detail="injected failure"
                )
            else:
                raw = f"<|en|><|NEUTRAL|><|Speech|><|woitn|>{self.text_for(job)}"
                t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
                result = DecodeResult(job=job, transcript=t, decode_ms=1)
            self.session.decode_finished(result)

    def audio(self, data: bytes, chunk_bytes: int = 3200) -> None:
        for i in range(0, len(data), chunk_bytes):
            self.adapter.receive_bytes(data[i : i + chunk_bytes])
            self.pump()

    def text(self, obj: dict | str) -> None:
        self.adapter.receive_text(obj if isinstance(obj, str) else orjson.dumps(obj).decode())
        self.pump()
