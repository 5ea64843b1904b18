"""Streaming a whole signal over protocol v1: paced chunks, concurrent reading, and
resuming after a lost connection from the first sample not yet covered by a final.

:func:`transcribe` streams a signal in one session and :func:`stream_file` does the same,
reconnecting with backoff when the connection drops; both return a
:class:`streamer.client.timeline.SessionResult`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamer.audio_io import load_audio
from streamer.client.connection import (
    ABNORMAL_CLOSURE,
    RETRYABLE_CLOSE_CODES,
    ClientOptions,
    StreamingClient,
    _retryable,
    connect_with_backoff,
)
from streamer.client.timeline import ChunkCallback, MessageCallback, SessionResult, Timeline
from streamer.errors import ClientError, ServerClosed

__all__ = [
    "PaceSchedule",
    "chunk_bounds",
    "stream_pcm",
    "run_session",
    "transcribe",
    "stream_file",
]

logger = logging.getLogger(__name__)

COVERED_SLACK_MS = 5.0  # end.audio_ms may round; less than this short is not a truncation


def chunk_bounds(
    start_sample: int, total_samples: int, chunk_samples: int
) -> list[tuple[int, int]]:
    """``[start, end)`` sample ranges of ``chunk_samples`` from ``start_sample`` to the end."""
    if chunk_samples <= 0:
        raise ValueError("chunk_samples must be positive")
    return [
        (a, min(a + chunk_samples, total_samples))
        for a in range(max(0, start_sample), total_samples, chunk_samples)
    ]


@dataclass(frozen=True)
class PaceSchedule:
    """When each chunk is due, like a live source: sample ``n`` exists at ``origin + n/rate``.

    Due times come from one origin, never from the previous send, so late sends do not
    accumulate drift; a chunk that is already late goes out at once.
    """

    origin_s: float  # monotonic time at which sample `origin_sample` is due
    sample_rate: int  # Hz
    speed: float = 1.0  # 2.0 sends twice as fast as real time
    origin_sample: int = 0

    def due_s(self, end_sample: int) -> float:
        """When the chunk ending at ``end_sample`` may be sent (all of it has "happened")."""
        return self.origin_s + (end_sample - self.origin_sample) / (self.sample_rate * self.speed)


async def stream_pcm(
    client: StreamingClient,
    pcm_int16: np.ndarray,
    sample_rate: int,
    *,
    chunk_ms: int = 100,
    speed: float | None = 1.0,
    on_chunk_sent: ChunkCallback | None = None,
    start_sample: int = 0,
    schedule: PaceSchedule | None = None,
    send_stop: bool = True,
) -> None:
    """Send ``pcm_int16[start_sample:]`` in ``chunk_ms`` chunks, then ``stop``.

    ``speed`` paces the chunks like a live source (1.0 real time, 4.0 four times faster;
    ``None`` sends as fast as the connection takes them). A chunk is sent when its last
    sample is due on the ``schedule`` (default: starting now at ``start_sample``).
    ``on_chunk_sent(end_sample, time.monotonic())`` is called right after each send.
    Read the messages from another task meanwhile.
    """
    if sample_rate != client.ready.sample_rate:
        raise ClientError(
            f"the session expects {client.ready.sample_rate} Hz audio, got {sample_rate} Hz;"
            " set ClientOptions.stream.sample_rate or resample first"
        )
    if pcm_int16.dtype != np.int16 or pcm_int16.ndim != 1:
        raise TypeError("stream_pcm needs a 1-D int16 array (see streamer.audio_io.load_audio)")
    if speed is not None and speed <= 0:
        raise ValueError(f"speed must be positive or None, got {speed}")
    chunk_samples = max(1, sample_rate * chunk_ms // 1000)
    if speed is not None and schedule is None:
        schedule = PaceSchedule(time.monotonic(), sample_rate, speed, start_sample)
    for start, end in chunk_bounds(start_sample, pcm_int16.size, chunk_samples):
        if schedule is not None and speed is not None:
            delay_s = schedule.due_s(end) - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
        await client.send_audio(pcm_int16[start:end])
        sent_s = time.monotonic()
        if on_chunk_sent is not None:
            on_chunk_sent(end, sent_s)
        if speed is None:
            # Let the reader timestamp what arrived while the sends do not block.
            await asyncio.sleep(0)
    if send_stop:
        await client.stop()


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        logger.debug("sender ended with %r after the session ended", task.exception())


async def run_session(
    client: StreamingClient,
    pcm_int16: np.ndarray,
    sample_rate: int,
    *,
    on_message: MessageCallback,
    chunk_ms: int = 100,
    speed: float | None = 1.0,
    on_chunk_sent: ChunkCallback | None = None,
    start_sample: int = 0,
    schedule: PaceSchedule | None = None,
) -> bool:
    """Stream the signal on an open session while reading its messages concurrently.

    Every message goes to ``on_message`` as it arrives. Returns True when the session
    ended after all audio and ``stop`` were sent, False when the server ended it first
    (shutting down). Raises :class:`ServerClosed` on an abnormal close.
    """
    sender = asyncio.create_task(
        stream_pcm(
            client,
            pcm_int16,
            sample_rate,
            chunk_ms=chunk_ms,
            speed=speed,
            on_chunk_sent=on_chunk_sent,
            start_sample=start_sample,
            schedule=schedule,
        )
    )
    try:
        async for item in client.received():
            on_message(item)
    except BaseException:
        await _cancel(sender)
        raise
    if not sender.done():
        await _cancel(sender)
        return False
    error = sender.exception()
    if isinstance(error, ServerClosed):
        return False  # the session closed normally while audio was still being sent
    if error is not None:
        raise error
    return client.stop_sent


def _truncation(
    timeline: Timeline, total_samples: int, client: StreamingClient
) -> ServerClosed | None:
    """The session ended normally (``end``), but did it cover all the audio sent? None
    when it did; else the error to report (with the server's close code) or retry."""
    end = timeline.end()
    if end is None:
        return None
    sent_ms = total_samples * 1000 / timeline.sample_rate
    if end.audio_ms >= sent_ms - COVERED_SLACK_MS:
        return None
    # called once the connection is closed: no close frame from the server is an abnormal
    # closure (RFC 6455 7.1.5), as when the server went away before its frame reached us
    code = client.close_code
    return ServerClosed(
        ABNORMAL_CLOSURE if code is None else code,
        f"the server ended the session after {end.audio_ms / 1000:.1f} s of the "
        f"{sent_ms / 1000:.1f} s sent: the transcription is incomplete",
    )


def _with_rate(options: ClientOptions, sample_rate: int) -> ClientOptions:
    if options.stream.sample_rate == sample_rate:
        return options
    stream = dataclasses.replace(options.stream, sample_rate=sample_rate)
    return dataclasses.replace(options, stream=stream)


async def transcribe(
    options: ClientOptions,
    pcm: np.ndarray,
    sample_rate: int,
    *,
    speed: float | None = None,
    chunk_ms: int = 100,
    on_message: MessageCallback | None = None,
    on_chunk_sent: ChunkCallback | None = None,
) -> SessionResult:
    """Stream ``pcm`` (int16 mono at ``sample_rate``) in one session; no reconnection.

    :func:`stream_file` with ``max_reconnects=0``. The session is opened with
    ``sample_rate`` as its stream rate (the server resamples rates other than 16000).
    ``speed=None`` streams unpaced. Raises like :meth:`StreamingClient.connect`, and
    :class:`ServerClosed` if the session ends abnormally or before all audio was sent.
    """
    return await stream_file(
        dataclasses.replace(options, max_reconnects=0), pcm, sample_rate=sample_rate,
        speed=speed, chunk_ms=chunk_ms, on_message=on_message, on_chunk_sent=on_chunk_sent,
    )  # fmt: skip


async def stream_file(
    options: ClientOptions,
    source: str | Path | np.ndarray,
    *,
    sample_rate: int | None = None,
    speed: float | None = 1.0,
    chunk_ms: int = 100,
    on_message: MessageCallback | None = None,
    on_chunk_sent: ChunkCallback | None = None,
    on_reconnect: Callable[[int, int, BaseException | None], None] | None = None,
) -> SessionResult:
    """Stream a file (path, or int16 array at ``sample_rate``), reconnecting when dropped.

    When the connection is lost or the server restarts mid-stream (not when it refuses
    or rejects the audio), a new session is opened with :func:`connect_with_backoff` and
    the audio is sent again from the end of the last final; that session's times and
    segment ids are shifted so every message stays on the file's timeline. Pacing keeps
    the original schedule: the resent backlog goes out at once. ``on_reconnect(count,
    resume_sample, error)`` is called before each reconnection (at most
    ``options.max_reconnects``). The first connection is a single attempt so that a
    wrong URL fails fast.
    """
    if isinstance(source, np.ndarray):
        if sample_rate is None:
            raise ValueError("pass sample_rate with a PCM array")
        pcm = source
    else:
        sample_rate = sample_rate or options.stream.sample_rate
        pcm = load_audio(source, target_rate=sample_rate)
    options = _with_rate(options, sample_rate)
    timeline = Timeline(sample_rate, on_message, on_chunk_sent)
    client = await StreamingClient.connect(options)
    first_ready = client.ready
    started_s = client.started_s
    schedule = None if speed is None else PaceSchedule(time.monotonic(), sample_rate, speed)
    while True:
        error: BaseException | None = None
        try:
            async with client:
                complete = await run_session(
                    client, pcm, sample_rate, on_message=timeline.record, chunk_ms=chunk_ms,
                    speed=speed, on_chunk_sent=timeline.sent, start_sample=timeline.offset_sample,
                    schedule=schedule,
                )  # fmt: skip
        except ServerClosed as exc:
            if not _retryable(exc) or timeline.reconnects >= options.max_reconnects:
                raise
            complete, error = False, exc
        if complete and (truncated := _truncation(timeline, pcm.size, client)) is not None:
            # the server ended (`end`) before it read all we sent: a graceful restart
            if truncated.code not in RETRYABLE_CLOSE_CODES:
                raise truncated
            if timeline.reconnects >= options.max_reconnects:
                raise ServerClosed(truncated.code, f"{truncated.reason}; no reconnection left")
            complete, error = False, truncated
        if complete:
            break
        if timeline.reconnects >= options.max_reconnects:
            raise ServerClosed(1001, "the server ended the session before all audio was sent")
        offset_sample = timeline.resume()
        logger.warning(
            "session %s ended early (%s); reconnecting (%d) from %.2f s", client.session_id,
            error or "server ended it", timeline.reconnects, offset_sample / sample_rate,
        )  # fmt: skip
        if on_reconnect is not None:
            on_reconnect(timeline.reconnects, offset_sample, error)
        client = await connect_with_backoff(options, timeout_s=options.reconnect_timeout_s)
    return timeline.result(first_ready, started_s)
