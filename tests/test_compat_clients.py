"""The real Deepgram and OpenAI client libraries against the real server and tagged model.

Each protocol's transcripts must equal protocol v1's finals for the same audio: the
adapters change the wire, never what is recognised.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soxr

from tests import compat_clients as clients
from tests.support import ulaw_encode, v1_texts


@pytest.fixture(scope="module")
def speech24(speech16) -> np.ndarray:
    return soxr.resample(speech16, 16000, 24000).astype(np.int16)


# what deepgram-sdk's query (clients.DEEPGRAM_QUERY) means for protocol v1
DEEPGRAM_AS_V1 = dict(language="en", itn=True, partials=True, endpoint_ms=500)


async def test_deepgram_sdk_async(tagged_server, speech16) -> None:
    reference = await v1_texts(tagged_server.url, speech16, 16000, **DEEPGRAM_AS_V1)
    assert len(reference) == 2 and reference[1].lower().startswith("hello")
    messages = await clients.deepgram_sdk_async(tagged_server.port, speech16.tobytes())
    assert clients.deepgram_finals(messages) == reference
    names = [type(m).__name__ for m in messages]
    assert names.count("ListenV1SpeechStarted") == 2
    assert names.count("ListenV1UtteranceEnd") == 2
    assert "ListenV1Results" in names and names[-1] == "ListenV1Metadata"
    assert None not in messages  # every message parsed to a known type


async def test_deepgram_sdk_sync(tagged_server, speech16) -> None:
    reference = await v1_texts(tagged_server.url, speech16, 16000, **DEEPGRAM_AS_V1)
    messages = await asyncio.to_thread(
        clients.deepgram_sdk_sync, tagged_server.port, speech16.tobytes()
    )
    assert clients.deepgram_finals(messages) == reference
    from deepgram.listen.v1.types import ListenV1Results

    finals = [m for m in messages if isinstance(m, ListenV1Results) and m.is_final]
    assert finals[-1].from_finalize  # the Finalize sent before CloseStream is answered
    assert type(messages[-1]).__name__ == "ListenV1Metadata"


async def test_deepgram_sdk_telephony_mulaw(tagged_server, speech16) -> None:
    """8 kHz μ-law (Twilio's format) decodes like the same audio as linear16 at 8 kHz."""
    pcm8 = soxr.resample(speech16, 16000, 8000).astype(np.int16)
    reference = await v1_texts(tagged_server.url, pcm8, 8000, **DEEPGRAM_AS_V1)
    ulaw = ulaw_encode(pcm8)
    mulaw = await clients.deepgram_sdk_async(
        tagged_server.port, ulaw, encoding="mulaw", sample_rate="8000"
    )
    assert len(clients.deepgram_finals(mulaw)) == len(reference) == 2


async def test_openai_realtime_ga(tagged_server, speech24) -> None:
    reference = await v1_texts(tagged_server.url, speech24, 24000, language="en")
    events = await clients.openai_ga(tagged_server.port, speech24.tobytes(), len(reference))
    assert clients.openai_transcripts(events) == reference
    types = [e.type for e in events]
    assert types[:2] == ["session.created", "session.updated"]
    assert types.count("input_audio_buffer.speech_started") == 2
    assert types.count("input_audio_buffer.committed") == 2
    assert "error" not in types


async def test_openai_realtime_beta(tagged_server, speech24) -> None:
    reference = await v1_texts(tagged_server.url, speech24, 24000, language="en")
    events = await clients.openai_beta(tagged_server.port, speech24.tobytes(), len(reference))
    assert clients.openai_transcripts(events) == reference
    types = [e.type for e in events]
    assert types[:2] == ["transcription_session.created", "transcription_session.updated"]
    assert "error" not in types
