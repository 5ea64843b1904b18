"""Run the real client libraries of other protocols against a server on a port.

The drivers follow ../shared/compat/{deepgram,openai_realtime}_capture.py (which drove
the same libraries against a fake server to capture what they send): each takes a port
and 16-bit mono PCM, streams it the way the library's users do, and returns what the
library handed back, parsed by the library itself.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from typing import Any

from tests.timing import timeout_s

API_KEY = "test-key"

DEEPGRAM_QUERY = dict(
    model="nova-3",
    encoding="linear16",
    sample_rate="16000",
    channels="1",
    interim_results="true",
    endpointing="500",
    utterance_end_ms="1000",
    vad_events="true",
    smart_format="true",
    punctuate="true",
    language="en-US",
)  # fmt: skip  (what deepgram-sdk users send; endpointing 500 = the server default)

GA_SESSION = {
    "type": "transcription",
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": 24000},
            "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
        }
    },
}
BETA_SESSION = {
    "input_audio_format": "pcm16",
    "input_audio_transcription": {"model": "gpt-4o-transcribe", "language": "en"},
    "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
}
COMPLETED = "conversation.item.input_audio_transcription.completed"


def chunks(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


# -- Deepgram (deepgram-sdk 7) --------------------------------------------------------------


def _deepgram_environment(port: int) -> Any:
    from deepgram import DeepgramClientEnvironment

    return DeepgramClientEnvironment(
        base=f"http://127.0.0.1:{port}",
        production=f"ws://127.0.0.1:{port}",
        agent=f"ws://127.0.0.1:{port}",
        agent_rest=f"http://127.0.0.1:{port}",
    )


async def deepgram_sdk_async(port: int, pcm: bytes, **query: str) -> list[Any]:
    """``AsyncDeepgramClient``: 100 ms frames, KeepAlive, CloseStream; every message parsed."""
    from deepgram import AsyncDeepgramClient
    from deepgram.core.events import EventType

    got: list[Any] = []
    client = AsyncDeepgramClient(api_key=API_KEY, environment=_deepgram_environment(port))
    async with client.listen.v1.connect(**{**DEEPGRAM_QUERY, **query}) as conn:
        conn.on(EventType.MESSAGE, got.append)
        listener = asyncio.create_task(conn.start_listening())
        await conn.send_keep_alive()
        for chunk in chunks(pcm, 3200):
            await conn.send_media(chunk)
            await asyncio.sleep(0.005)
        await conn.send_close_stream()
        await asyncio.wait_for(listener, timeout_s(30))  # the server closes after Metadata
    return got


def deepgram_sdk_sync(port: int, pcm: bytes, **query: str) -> list[Any]:
    """``DeepgramClient`` (websockets.sync), listening in a thread as its docs show."""
    from deepgram import DeepgramClient
    from deepgram.core.events import EventType

    got: list[Any] = []
    client = DeepgramClient(api_key=API_KEY, environment=_deepgram_environment(port))
    with client.listen.v1.connect(**{**DEEPGRAM_QUERY, **query}) as conn:
        conn.on(EventType.MESSAGE, got.append)
        listener = threading.Thread(target=conn.start_listening, daemon=True)
        listener.start()
        for chunk in chunks(pcm, 3200):
            conn.send_media(chunk)
            time.sleep(0.005)
        conn.send_finalize()
        conn.send_close_stream()
        listener.join(timeout_s(30))
        assert not listener.is_alive(), "the server did not close after CloseStream"
    return got


def deepgram_finals(messages: list[Any]) -> list[str]:
    """The texts of the final ``Results`` the SDK parsed (empty Finalize answers left out)."""
    from deepgram.listen.v1.types import ListenV1Results

    return [
        m.channel.alternatives[0].transcript
        for m in messages
        if isinstance(m, ListenV1Results) and m.is_final and m.channel.alternatives[0].transcript
    ]


# -- OpenAI Realtime (openai 3.x) -------------------------------------------------------------


async def _read_until_completed(conn: Any, count: int, got: list[Any]) -> None:
    async for event in conn:
        got.append(event)
        if getattr(event, "type", None) == COMPLETED:
            count -= 1
            if count <= 0:
                return


async def _stream_realtime(conn: Any, pcm24: bytes, count: int) -> list[Any]:
    got: list[Any] = []
    reader = asyncio.create_task(_read_until_completed(conn, count, got))
    for chunk in chunks(pcm24, 4800):  # 100 ms at 24 kHz
        await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
        await asyncio.sleep(0.005)
    await conn.input_audio_buffer.commit()
    await asyncio.wait_for(reader, timeout_s(30))
    return got


async def openai_ga(
    port: int, pcm24: bytes, count: int, session: dict[str, Any] = GA_SESSION
) -> list[Any]:
    """``AsyncOpenAI(base_url=http://.../v1).realtime.connect(intent=transcription)``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key=API_KEY, base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await conn.session.update(session=session)  # type: ignore[arg-type]
        return await _stream_realtime(conn, pcm24, count)


async def openai_beta(port: int, pcm24: bytes, count: int) -> list[Any]:
    """The beta client; it forces wss for an http base_url, so ``websocket_base_url``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        api_key=API_KEY,
        base_url="http://127.0.0.1:9/v1",
        websocket_base_url=f"ws://127.0.0.1:{port}/v1",
    )
    async with client.beta.realtime.connect(
        model="gpt-4o-transcribe", extra_query={"intent": "transcription"}
    ) as conn:
        await conn.transcription_session.update(session=BETA_SESSION)
        return await _stream_realtime(conn, pcm24, count)


def openai_transcripts(events: list[Any]) -> list[str]:
    return [e.transcript for e in events if getattr(e, "type", None) == COMPLETED and e.transcript]
