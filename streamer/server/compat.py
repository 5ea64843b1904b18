"""The Deepgram and OpenAI Realtime endpoints on the main port.

The protocols themselves live in :mod:`streamer.core.compat` (I/O-free); this module
gives each one its :class:`~streamer.server.http.Endpoint`: where its key is in the
request, what its handshake means, the subprotocol a browser needs echoed, and the shape
of a refusal. What needs a clock or randomness (Deepgram's request id and creation time)
is decided here and handed to the adapter.
"""

from __future__ import annotations

import datetime
import http
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from urllib.parse import parse_qsl, urlsplit

import orjson
from websockets.http11 import Request, Response

from streamer.core.compat import deepgram, openai_realtime
from streamer.core.compat.deepgram import DeepgramAdapter, ListenOptions
from streamer.core.compat.openai_realtime import RealtimeAdapter, RealtimeOptions
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session
from streamer.media import open_decoder
from streamer.server.http import Endpoint, Negotiation, json_response, offered_subprotocols


def now_iso() -> str:
    now = datetime.datetime.now(datetime.UTC)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _key_in(
    presented_key: Callable[[str | None, Sequence[str]], str | None],
) -> Callable[[Request, Mapping[str, str]], str | None]:
    """An endpoint's ``presented_token``: where both protocols put the key, the
    ``Authorization`` header or (a browser's) offered subprotocols, read by the protocol's
    ``presented_key``."""

    def presented_token(request: Request, query: Mapping[str, str]) -> str | None:
        return presented_key(request.headers.get("Authorization"), offered_subprotocols(request))

    return presented_token


# -- Deepgram ---------------------------------------------------------------------------

_DEEPGRAM_CODES = {"unauthorized": "INVALID_AUTH"}


def _deepgram_negotiate(
    request: Request, query: Mapping[str, str], defaults: StreamOptions
) -> Negotiation:
    every = parse_qsl(urlsplit(request.path).query)  # keywords and keyterm repeat
    options = deepgram.parse_listen_query(
        query,
        defaults,
        keywords=[v for k, v in every if k == "keywords"],
        keyterms=[v for k, v in every if k == "keyterm"],
    )
    request_id, created = str(uuid.uuid4()), now_iso()

    def make_adapter(session: Session) -> DeepgramAdapter:
        return DeepgramAdapter(
            session, options, request_id=request_id, created=created, open_decoder=open_decoder
        )

    return Negotiation(options.stream, make_adapter)


def _deepgram_default_adapter(session: Session) -> DeepgramAdapter:
    options = ListenOptions(stream=session.stream)
    return DeepgramAdapter(session, options, request_id=str(uuid.uuid4()), created=now_iso())


def _deepgram_refusal(status: http.HTTPStatus, code: str, message: str) -> Response:
    request_id = str(uuid.uuid4())
    body = deepgram.refusal_body(_DEEPGRAM_CODES.get(code, code), message, request_id)
    response = json_response(status, body)
    # Deepgram repeats the error in headers: browsers cannot read a refused upgrade's body
    response.headers["dg-request-id"] = request_id
    response.headers["dg-error"] = orjson.dumps(body).decode()
    return response


DEEPGRAM_ENDPOINT = Endpoint(
    name="deepgram",
    presented_token=_key_in(deepgram.presented_key),
    auth_hint="a valid key is required (Authorization: Token KEY)",
    make_adapter=_deepgram_default_adapter,
    negotiate=_deepgram_negotiate,
    select_subprotocol=deepgram.select_subprotocol,
    refusal=_deepgram_refusal,
)


# -- OpenAI Realtime --------------------------------------------------------------------

_OPENAI_CODES = {"unauthorized": "invalid_api_key"}


def _openai_negotiate(
    request: Request, query: Mapping[str, str], defaults: StreamOptions
) -> Negotiation:
    options = openai_realtime.parse_realtime_handshake(
        query, request.headers.get("OpenAI-Beta"), offered_subprotocols(request)
    )

    def make_adapter(session: Session) -> RealtimeAdapter:
        return RealtimeAdapter(session, options)

    # until the client's session.update: the protocol's default format, 24 kHz PCM
    stream = replace(defaults, sample_rate=openai_realtime.PCM_SAMPLE_RATE)
    return Negotiation(stream, make_adapter)


def _openai_default_adapter(session: Session) -> RealtimeAdapter:
    return RealtimeAdapter(session, RealtimeOptions())


def _openai_refusal(status: http.HTTPStatus, code: str, message: str) -> Response:
    return json_response(
        status, openai_realtime.refusal_body(_OPENAI_CODES.get(code, code), message)
    )


OPENAI_ENDPOINT = Endpoint(
    name="openai",
    presented_token=_key_in(openai_realtime.presented_key),
    auth_hint="a valid key is required (Authorization: Bearer KEY)",
    make_adapter=_openai_default_adapter,
    negotiate=_openai_negotiate,
    select_subprotocol=openai_realtime.select_subprotocol,
    refusal=_openai_refusal,
)

COMPAT_ENDPOINTS: dict[str, Endpoint] = {
    deepgram.PATH: DEEPGRAM_ENDPOINT,
    openai_realtime.PATH: OPENAI_ENDPOINT,
}
