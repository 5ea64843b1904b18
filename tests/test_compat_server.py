"""Deepgram and OpenAI Realtime on the main port, over loopback with a test-double model:
auth in each protocol's scheme, refusals in its own shape, bad input, the shared session
limit and the protocol label of the metrics. (The real client libraries against the
real model are in ``test_compat_clients.py``.)"""

from __future__ import annotations

import asyncio
import base64
import logging
import urllib.request

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests import compat_clients as clients
from tests.fakes import FakeRecognizer, loudness_classifier, silence, tone
from tests.server_fixtures import messages_until_close
from tests.timing import eventually, timeout_s

TOKEN = "s3cret"


def speech(rate: int = 16000) -> np.ndarray:
    return np.concatenate(
        [silence(400, rate), tone(800, rate=rate), silence(900, rate),
         tone(600, rate=rate), silence(900, rate)]
    )  # fmt: skip


@pytest.fixture
def make_fake_server(make_server):  # noqa: F811
    def factory(**options):
        return make_server(
            lambda: FakeRecognizer(delay_s=0.005), classifier_factory=loudness_classifier, **options
        )

    return factory


@pytest.fixture
def fake_server(make_fake_server):
    return make_fake_server()


def ws_url(server, path: str) -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def refused(url: str, **kwargs) -> tuple[int, dict, dict]:
    with pytest.raises(InvalidStatus) as info:
        async with connect(url, **kwargs):
            pass
    response = info.value.response
    return response.status_code, orjson.loads(response.body), dict(response.headers)


async def recv_until(ws, kind: str, timeout: float = 10) -> list[dict]:
    out = []
    while True:
        message = orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(timeout)))
        out.append(message)
        if message["type"] == kind:
            return out


def metrics(server) -> str:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=timeout_s(5)) as response:
        return response.read().decode()


# -- Deepgram ---------------------------------------------------------------------------------


async def test_deepgram_raw_session(fake_server) -> None:
    url = ws_url(fake_server, "/v1/listen?encoding=linear16&sample_rate=16000&model=nova-3")
    async with connect(url) as ws:
        await ws.send(b"".join([speech().tobytes()]))
        await ws.send('{"type": "CloseStream"}')
        messages, code = await messages_until_close(ws, timeout_s=10)
    assert code == 1000
    assert [m["type"] for m in messages] == ["Results", "Results", "Metadata"]
    assert all(
        m["is_final"] and m["channel"]["alternatives"][0]["transcript"] for m in messages[:2]
    )


@pytest.mark.parametrize(
    "query",
    ["encoding=speex", "encoding=linear16&sample_rate=11025", "channels=2&multichannel=true"],
)
async def test_deepgram_unusable_audio_is_refused_before_the_upgrade(fake_server, query) -> None:
    status, body, headers = await refused(ws_url(fake_server, f"/v1/listen?{query}"))
    assert status == 400
    assert set(body) == {"err_code", "err_msg", "request_id"} and body["err_msg"]
    assert headers["dg-request-id"] == body["request_id"]
    assert orjson.loads(headers["dg-error"]) == body


async def test_deepgram_auth_schemes(make_fake_server) -> None:
    server = make_fake_server(token=TOKEN)
    url = ws_url(server, "/v1/listen")
    status, body, _ = await refused(url)
    assert status == 401 and body["err_code"] == "INVALID_AUTH"
    status, _, _ = await refused(url, additional_headers={"Authorization": "Token wrong"})
    assert status == 401
    for header in (f"Token {TOKEN}", f"Bearer {TOKEN}"):
        async with connect(url, additional_headers={"Authorization": header}) as ws:
            await ws.send('{"type": "Finalize"}')
            assert orjson.loads(await ws.recv())["from_finalize"] is True
    # a browser: new WebSocket(url, ["token", KEY]) needs "token" echoed
    async with connect(url, subprotocols=["token", TOKEN]) as ws:
        assert ws.subprotocol == "token"
        await ws.send('{"type": "Finalize"}')
        assert orjson.loads(await ws.recv())["type"] == "Results"


async def test_deepgram_sdk_gets_refusals_as_errors(make_fake_server) -> None:
    server = make_fake_server(token=TOKEN)
    with pytest.raises(Exception, match="401"):
        await clients.deepgram_sdk_async(server.port, speech().tobytes())


async def test_deepgram_close_right_after_close_stream_is_a_normal_end(fake_server, caplog) -> None:
    """pipecat closes (1000) as soon as it has sent CloseStream."""
    url = ws_url(fake_server, "/v1/listen?interim_results=true&vad_events=true")
    caplog.set_level(logging.INFO, logger="streamer")
    for _ in range(3):
        async with connect(url) as ws:
            await ws.send(speech().tobytes()[:20000])
            await ws.send('{"type": "CloseStream"}')
    await eventually(lambda: fake_server.server.session_count == 0, what="the sessions closed")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    async with connect(url) as ws:  # and the server goes on serving
        await ws.send(speech().tobytes())
        await ws.send('{"type": "CloseStream"}')
        messages, code = await messages_until_close(ws, timeout_s=10)
    assert code == 1000 and messages[-1]["type"] == "Metadata"


async def test_deepgram_garbage_loses_nothing_in_another_session(fake_server) -> None:
    url = ws_url(fake_server, "/v1/listen")
    async with connect(url) as bad, connect(url) as good:
        await bad.send("{{{ not json")
        await bad.send(b"\x01")  # one odd byte, then more garbage
        error = orjson.loads(await bad.recv())
        assert error["type"] == "Error" and error["variant"] == "SchemaError"
        await good.send(speech().tobytes())
        await good.send('{"type": "CloseStream"}')
        messages, code = await messages_until_close(good, timeout_s=10)
        await bad.send(speech().tobytes())
        await bad.send('{"type": "CloseStream"}')
        bad_messages, bad_code = await messages_until_close(bad, timeout_s=10)
    assert code == 1000 and len([m for m in messages if m["type"] == "Results"]) == 2
    assert bad_code == 1000 and bad_messages[-1]["type"] == "Metadata"


# -- OpenAI Realtime ---------------------------------------------------------------------------


def append(pcm: bytes) -> str:
    return orjson.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    ).decode()


async def test_openai_raw_session(fake_server) -> None:
    url = ws_url(fake_server, "/v1/realtime?intent=transcription")
    async with connect(url) as ws:
        assert orjson.loads(await ws.recv())["type"] == "session.created"
        await ws.send(
            orjson.dumps({"type": "session.update", "session": clients.GA_SESSION}).decode()
        )
        assert orjson.loads(await ws.recv())["type"] == "session.updated"
        pcm = speech(24000).tobytes()
        for i in range(0, len(pcm), 4800):
            await ws.send(append(pcm[i : i + 4800]))
        first = await recv_until(ws, clients.COMPLETED)
        second = await recv_until(ws, clients.COMPLETED)
    assert first[0]["type"] == "input_audio_buffer.speech_started"
    assert first[-1]["transcript"] and second[-1]["transcript"]


async def test_openai_refusals(make_fake_server) -> None:
    server = make_fake_server(token=TOKEN)
    status, body, _ = await refused(ws_url(server, "/v1/realtime?intent=transcription"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, body, _ = await refused(ws_url(server, "/v1/realtime"), additional_headers=auth)
    assert status == 400 and "intent=transcription" in body["error"]["message"]
    url = ws_url(server, "/v1/realtime?intent=transcription")
    async with connect(url, additional_headers=auth) as ws:
        assert orjson.loads(await ws.recv())["type"] == "session.created"
    # the browser SDK's form: the key as a subprotocol, "realtime" echoed
    offered = ["realtime", f"openai-insecure-api-key.{TOKEN}", "openai-beta.realtime-v1"]
    async with connect(url, subprotocols=offered) as ws:
        assert ws.subprotocol == "realtime"
        assert orjson.loads(await ws.recv())["type"] == "transcription_session.created"


async def test_openai_sdk_gets_refusals_as_errors(make_fake_server) -> None:
    server = make_fake_server(token=TOKEN)
    with pytest.raises(Exception, match="401"):
        await clients.openai_ga(server.port, speech(24000).tobytes(), 1)


async def test_openai_garbage_loses_nothing_in_another_session(fake_server) -> None:
    url = ws_url(fake_server, "/v1/realtime?intent=transcription")
    async with connect(url) as bad, connect(url) as good:
        await bad.recv()
        await good.recv()
        await bad.send("not json")
        await bad.send(b"raw pcm is not this protocol")
        await bad.send('{"type": "input_audio_buffer.append", "audio": "%%%"}')
        codes = [orjson.loads(await bad.recv())["error"]["code"] for _ in range(3)]
        assert codes == ["invalid_json", "unsupported_frame", "invalid_value"]
        pcm = speech(24000).tobytes()
        for ws in (good, bad):
            for i in range(0, len(pcm), 4800):
                await ws.send(append(pcm[i : i + 4800]))
        for ws in (good, bad):
            texts = [(await recv_until(ws, clients.COMPLETED))[-1]["transcript"] for _ in range(2)]
            assert all(texts)


async def test_the_first_session_update_applies_to_audio_sent_before_it(fake_server) -> None:
    """pipecat sends audio as soon as it connects and its update after session.created."""
    url = ws_url(fake_server, "/v1/realtime?intent=transcription")
    pcm = speech(24000).tobytes()
    async with connect(url) as ws:
        await ws.send(append(pcm[:9600]))
        await ws.recv()  # session.created
        update = {"type": "session.update", "session": {"type": "transcription", "audio": {
            "input": {"turn_detection": None}}}}  # fmt: skip
        await ws.send(orjson.dumps(update).decode())
        for i in range(9600, len(pcm), 4800):
            await ws.send(append(pcm[i : i + 4800]))
        await ws.send('{"type": "input_audio_buffer.commit"}')
        events = await recv_until(ws, clients.COMPLETED)
    kinds = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" not in kinds  # manual mode from the start
    assert kinds[-2:] == ["input_audio_buffer.committed", clients.COMPLETED]
    assert len(events[-1]["transcript"].split("audio")) == 3  # both segments, one item


# -- shared across protocols -------------------------------------------------------------------


async def test_max_sessions_is_shared_across_protocols(make_fake_server) -> None:
    server = make_fake_server(max_sessions=2)
    v1 = await connect(ws_url(server, "/v1/asr"))
    deepgram = await connect(ws_url(server, "/v1/listen"))
    try:
        await v1.recv()  # ready
        status, body, _ = await refused(ws_url(server, "/v1/realtime?intent=transcription"))
        assert status == 503 and body["error"]["code"] == "server_full"
        status, body, _ = await refused(ws_url(server, "/v1/listen"))
        assert status == 503 and body["err_code"] == "SERVER_FULL"
    finally:
        await deepgram.close()
        await v1.close()
    await eventually(lambda: server.server.session_count == 0)
    async with connect(ws_url(server, "/v1/realtime?intent=transcription")) as ws:
        assert orjson.loads(await ws.recv())["type"] == "session.created"


async def test_metrics_are_labelled_by_protocol(fake_server) -> None:
    async with connect(ws_url(fake_server, "/v1/listen")) as ws:
        await ws.send('{"type": "CloseStream"}')
        await messages_until_close(ws, timeout_s=10)
    async with connect(ws_url(fake_server, "/v1/realtime?intent=transcription")) as ws:
        await ws.recv()
    await refused(ws_url(fake_server, "/v1/listen?encoding=speex"))
    await eventually(lambda: fake_server.server.session_count == 0)
    text = metrics(fake_server)
    assert 'streamer_sessions_total{protocol="deepgram"} 1.0' in text
    assert 'streamer_sessions_total{protocol="openai"} 1.0' in text
    assert 'streamer_sessions_active{protocol="v1"} 0.0' in text
    assert (
        'streamer_handshakes_rejected_total{protocol="deepgram",reason="invalid_option"} 1.0'
        in text
    )
