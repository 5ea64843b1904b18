"""``GET /v1/models``: the served model in OpenAI's list shape.

OpenAI-style front ends (Open WebUI, LibreChat, the openai SDK's ``client.models.list()``)
list models before they call anything else. There is one: the model the workers decode
with, named as ``/readyz`` names it, with what SenseVoice can do (``capabilities``: extra
fields, which OpenAI's clients keep). ``GET /v1/models/{id}`` answers it by its id.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from streamer.core.protocol import LANGUAGES
from streamer.core.transcript import EMOTION_TAGS, EVENT_TAGS

PATH = "/v1/models"
OWNER = "sensevoice-streamer"  # the server that serves it (a random model has no other owner)
CREATED_S = 1720137600  # 2024-07-05, SenseVoiceSmall's release: OpenAI's clients need an int
CAPABILITIES: dict[str, Any] = {
    "transcription": True,  # POST /v1/audio/transcriptions, Deepgram's POST /v1/listen
    "realtime": True,  # OpenAI Realtime transcription, Deepgram live, protocol v1, ...
    "translation": False,  # SenseVoice transcribes in the spoken language only
    "languages": list(LANGUAGES),
    "emotions": sorted(EMOTION_TAGS),
    "audio_events": sorted(EVENT_TAGS),
    "hotwords": True,  # a prompt's or keywords' phrases bias the search
    "word_timestamps": True,
}


def model_entry(model_name: str) -> dict[str, Any]:
    """One model, as OpenAI's ``Model`` object (``id``, ``object``, ``created``,
    ``owned_by``) with SenseVoice's capabilities beside."""
    return {
        "id": model_name,
        "object": "model",
        "created": CREATED_S,
        "owned_by": OWNER,
        "capabilities": CAPABILITIES,
    }


def model_list(model_name: str) -> dict[str, Any]:
    """The answer to ``GET /v1/models``."""
    return {"object": "list", "data": [model_entry(model_name)]}


def requested_model(path: str) -> str | None:
    """The id asked for by ``GET /v1/models/{id}`` (percent-decoded: the openai SDK encodes
    a ``/`` in an id), or None when ``path`` is not one."""
    prefix = PATH + "/"
    if not path.startswith(prefix) or len(path) == len(prefix):
        return None
    return unquote(path[len(prefix) :])
