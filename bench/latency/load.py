"""The load generator: N real-time clients with staggered starts, through the project client.

Each client streams its own rotation of the bench audio at real-time pace from its own
start offset, so utterance boundaries do not line up across clients, and records every
message with its arrival time and every chunk with its send time. Nothing is computed
here: :mod:`bench.latency.metrics` turns the records into latencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from bench.latency.audio import SAMPLE_RATE, BenchAudio, client_track
from bench.latency.metrics import Arrival, SendLog
from streamer.client.connection import ClientOptions, Received, StreamingClient
from streamer.client.streaming import run_session
from streamer.core.protocol import End, StreamOptions
from streamer.errors import StreamerError

logger = logging.getLogger(__name__)

LEAD_MS = 300  # silence before a client's first clip


@dataclass(frozen=True)
class StepOptions:
    """One step of the sweep: how many clients, how long, with which stream options."""

    url: str  # ws://host:port/v1/asr
    clients: int  # concurrent sessions
    duration_s: float  # audio each client streams (at least; it ends after a pause)
    stagger_s: float  # client i starts i * stagger_s / clients after the first
    partials: bool = True  # ask for partial results
    endpoint_ms: int = 500  # trailing silence that ends an utterance
    chunk_ms: int = 100  # audio per WebSocket frame
    speed: float | None = 1.0  # 1.0 = real time; None: as fast as the connection takes it
    ping: bool = True  # keepalive pings
    drain_timeout_s: float = 60.0  # after the last chunk, wait this long for the end
    diarize: bool = False  # ask for speaker labels (the server needs --diarize-model)


@dataclass(frozen=True)
class ClientPlan:
    """What one client will stream, and when it starts."""

    index: int
    delay_s: float  # after the step's start
    first_clip: int  # where in the bench audio its track begins
    track: np.ndarray  # int16 PCM at SAMPLE_RATE
    speech_spans: tuple[tuple[int, int], ...]  # [start, end) samples of each utterance


def plan_clients(options: StepOptions, audio: BenchAudio) -> list[ClientPlan]:
    """Each client's start delay and track; all tracks end at about the same time."""
    plans = []
    for index in range(options.clients):
        delay_s = index * options.stagger_s / max(1, options.clients)
        first_clip = (index * 7) % len(audio.clips)  # 7: neighbours start far apart
        track, spans = client_track(
            audio.clips, first_clip, max(1.0, options.duration_s - delay_s), LEAD_MS,
            tail_ms=options.endpoint_ms + 1000,
        )  # fmt: skip
        plans.append(ClientPlan(index, delay_s, first_clip, track, tuple(spans)))
    return plans


@dataclass
class ClientRecord:
    """What one client saw."""

    plan: ClientPlan
    arrivals: list[Arrival] = field(default_factory=list)
    sends: list[tuple[int, float]] = field(default_factory=list)
    end: End | None = None
    error: str | None = None
    connect_s: float | None = None  # handshake + ready

    def send_log(self) -> SendLog:
        return SendLog.from_pairs(self.sends, SAMPLE_RATE)


async def run_client(plan: ClientPlan, options: StepOptions) -> ClientRecord:
    """Stream one client's track after its delay; errors are recorded, not raised."""
    record = ClientRecord(plan)
    await asyncio.sleep(plan.delay_s)
    stream = StreamOptions(
        partials=options.partials, endpoint_ms=options.endpoint_ms, diarize=options.diarize
    )
    client_options = ClientOptions(url=options.url, stream=stream, open_timeout_s=30.0)
    if not options.ping:
        client_options = replace(client_options, ping_interval_s=None)

    def on_message(item: Received) -> None:
        record.arrivals.append(Arrival(item.message, item.arrival_s))
        if isinstance(item.message, End):
            record.end = item.message

    started = time.monotonic()
    try:
        client = await StreamingClient.connect(client_options)
    except (StreamerError, OSError) as exc:
        record.error = f"connect: {type(exc).__name__}: {exc}"
        logger.warning("client %d: %s", plan.index, record.error)
        return record
    record.connect_s = time.monotonic() - started
    budget_s = plan.track.size / SAMPLE_RATE / (options.speed or math.inf)
    budget_s += options.drain_timeout_s
    try:
        async with client:
            await asyncio.wait_for(
                run_session(
                    client, plan.track, SAMPLE_RATE, on_message=on_message,
                    chunk_ms=options.chunk_ms, speed=options.speed,
                    on_chunk_sent=lambda *sent: record.sends.append(sent),
                ),
                timeout=budget_s,
            )  # fmt: skip
    except TimeoutError:
        record.error = f"no end within {options.drain_timeout_s:g} s of the last chunk"
        logger.warning("client %d: %s", plan.index, record.error)
    except (StreamerError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        logger.warning("client %d: %s", plan.index, record.error)
    return record


async def run_step(options: StepOptions, plans: list[ClientPlan]) -> list[ClientRecord]:
    """Run the planned clients concurrently; one record per client, in order."""
    tasks = [asyncio.create_task(run_client(plan, options)) for plan in plans]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def warm_up(url: str, audio: BenchAudio) -> None:
    """One short fast session, so the first measured step does not pay for warm-up."""
    options = StepOptions(
        url=url, clients=1, duration_s=3.0, stagger_s=0.0, speed=10.0, drain_timeout_s=120.0
    )
    record = await run_client(plan_clients(options, audio)[0], options)
    if record.error:
        raise RuntimeError(f"warm-up session failed: {record.error}")
    logger.info("warm-up: %d messages", len(record.arrivals))
