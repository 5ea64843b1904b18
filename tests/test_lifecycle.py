"""``StreamingServer.run()`` in process: the life the CLI gives a server, with
``request_stop()`` standing in for the signals (SIGTERM drains, then shuts down; SIGINT,
``now``, skips the drain; a second request cuts the drain short), and the exit status
(0, or ``EXIT_MODEL_FAILED`` after a model failure). The signals themselves, through a
real ``streamer serve`` process, are in ``test_readiness.py`` and ``test_restart.py``."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamer.server.server import EXIT_MODEL_FAILED
from tests.fakes import DyingRecognizer, FakeRecognizer, loudness_classifier, silence, tone
from tests.server_fixtures import make_server, messages_until_close  # noqa: F401  (fixture)
from tests.support import http_get
from tests.timing import eventually

BOUND_S = 20  # unscaled: every wait gives up after this (a failure, never a pass)
LONG_S = 600  # a drain or grace period no test waits for: only a cut ends it in time


@pytest.fixture
def running(make_server):  # noqa: F811
    def factory(load=lambda: FakeRecognizer(delay_s=0.01), **options):
        return make_server(load, classifier_factory=loudness_classifier, lifecycle=True, **options)

    return factory


async def open_speaking(server) -> object:
    """A session in the middle of an utterance (speech goes on: the segment stays open)."""
    ws = await connect(server.url + "?partials=false")
    assert orjson.loads(await ws.recv())["type"] == "ready"
    await ws.send(np.concatenate([silence(300), tone(1500)]).tobytes())
    assert orjson.loads(await ws.recv())["type"] == "speech_start"
    return ws


async def test_a_stop_request_drains_serves_the_open_session_then_exits_0(running):
    server = running(drain_s=LONG_S)
    ws = await open_speaking(server)
    server.request_stop()  # SIGTERM
    await eventually(lambda: server.server.draining, BOUND_S, "the drain")
    reply = await asyncio.to_thread(http_get, server.http_url + "/readyz")
    assert (reply.status, reply.json()["status"]) == (503, "draining")
    with pytest.raises(InvalidStatus) as refused:
        await connect(server.url)
    assert refused.value.response.status_code == 503
    # the open session is served to its end; the drain then ends at once, not after LONG_S
    await ws.send(silence(900).tobytes())
    await ws.send('{"type":"stop"}')
    messages, code = await messages_until_close(ws)
    assert code == 1000  # it ended by itself: no shutdown notice
    assert [m["type"] for m in messages][-2:] == ["final", "end"]
    assert await asyncio.to_thread(server.join, BOUND_S), "run() did not return"
    assert server.exit_status == 0


async def test_a_second_stop_request_cuts_the_drain_and_finishes_open_segments(running):
    server = running(drain_s=LONG_S, shutdown_grace_s=LONG_S)
    ws = await open_speaking(server)
    server.request_stop()
    await eventually(lambda: server.server.draining, BOUND_S, "the drain")
    server.request_stop()  # a second SIGTERM: no more waiting for the session to end
    messages, code = await messages_until_close(ws)
    assert code == 1001  # the shutdown's close, with the open segment finished first
    kinds = [m["type"] for m in messages]
    assert kinds[-2:] == ["final", "end"]
    assert messages[-2]["end_ms"] == pytest.approx(1800, abs=1)  # every sample it was sent
    assert await asyncio.to_thread(server.join, BOUND_S), "run() did not return"
    assert server.exit_status == 0


async def test_stop_now_skips_the_drain(running):
    server = running(drain_s=LONG_S)
    ws = await open_speaking(server)
    server.request_stop(now=True)  # SIGINT
    messages, code = await messages_until_close(ws)
    assert code == 1001
    assert [m["type"] for m in messages][-2:] == ["final", "end"]
    assert await asyncio.to_thread(server.join, BOUND_S), "run() did not return"
    assert server.exit_status == 0


async def test_a_model_failure_ends_run_with_exit_model_failed(running):
    server = running(load=DyingRecognizer, shutdown_grace_s=LONG_S)
    async with connect(server.url + "?partials=false") as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        await ws.send(np.concatenate([silence(300), tone(500), silence(900)]).tobytes())
        messages, _ = await messages_until_close(ws)
    assert any(m["type"] == "error" and m["code"] == "model_stalled" for m in messages)
    # nothing asked it to stop: the failure did, after a short grace (not LONG_S)
    assert await asyncio.to_thread(server.join, BOUND_S), "run() did not return"
    assert server.exit_status == EXIT_MODEL_FAILED
