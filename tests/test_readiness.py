"""Readiness for load balancers: /readyz full and draining, drain(), and the signals.

A balancer routes new sessions only to servers whose ``/readyz`` answers 200 (or retries
the handshake's 503 elsewhere); open sessions are never cut by readiness. The loopback
tests with a real nginx and HAProxy in front are in ``test_balancer.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamer.client.connection import ClientOptions, StreamingClient
from streamer.core.protocol import StreamOptions
from streamer.errors import ConfigError
from streamer.server.server import ServerOptions
from tests.fakes import FakeRecognizer, silence, tone
from tests.server_fixtures import messages_until_close
from tests.support import free_port, http_get, on_loop, readyz_status
from tests.timing import eventually, timeout_s

HANG_GUARD_S = 60  # unscaled: pass it through timeout_s() or eventually()


async def get(url: str) -> tuple[int, dict]:
    reply = await asyncio.to_thread(http_get, url)
    return reply.status, reply.json()


def test_negative_drain_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        ServerOptions(drain_s=-1)


async def test_readyz_says_full_at_max_sessions_and_counts(make_fake_server):
    server = make_fake_server(FakeRecognizer, max_sessions=2)
    base = server.http_url
    status, body = await get(base + "/readyz")
    assert (status, body["status"], body["sessions"], body["max_sessions"]) == (200, "ready", 0, 2)
    clients = [await StreamingClient.connect(ClientOptions(url=server.url)) for _ in range(2)]
    status, body = await get(base + "/readyz")
    assert status == 503
    assert body == {"status": "full", "sessions": 2, "max_sessions": 2}
    assert (await get(base + "/healthz"))[0] == 200  # liveness is not readiness
    metrics = await asyncio.to_thread(
        lambda: urllib.request.urlopen(base + "/metrics", timeout=timeout_s(5)).read().decode()
    )
    assert "streamer_sessions_capacity 2.0" in metrics
    assert 'streamer_sessions_active{protocol="v1"} 2.0' in metrics
    await clients[0].close()
    await eventually(lambda: server.server.session_count == 1)
    assert (await get(base + "/readyz"))[0] == 200
    await clients[1].close()


async def test_draining_refuses_new_sessions_and_serves_open_ones(make_fake_server):
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.01))
    base = server.http_url
    async with connect(server.url + "?partials=false") as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        await ws.send(np.concatenate([silence(300), tone(500), silence(900)]).tobytes())
        assert orjson.loads(await ws.recv())["type"] == "speech_start"
        # what SIGTERM does first: drain for up to 30 s (it ends as soon as no session is open)
        drained = asyncio.run_coroutine_threadsafe(server.server.drain(30.0), server.loop)
        await eventually(lambda: server.server.draining)
        status, body = await get(base + "/readyz")
        assert (status, body["status"], body["sessions"]) == (503, "draining", 1)
        assert (await get(base + "/healthz"))[0] == 200
        with pytest.raises(InvalidStatus) as refused:
            await connect(server.url)
        assert refused.value.response.status_code == 503
        assert orjson.loads(refused.value.response.body)["error"] == "draining"
        # the open session goes on as before: a new utterance, then a normal end
        await ws.send(np.concatenate([tone(400), silence(900)]).tobytes())
        await ws.send('{"type":"stop"}')
        messages, code = await messages_until_close(ws)
    assert code == 1000
    kinds = [m["type"] for m in messages]
    assert kinds.count("final") == 2 and kinds[-1] == "end"
    assert "error" not in kinds  # no shutdown notice: the session ended by itself
    await asyncio.wait_for(asyncio.wrap_future(drained), timeout_s(HANG_GUARD_S))
    assert not server.server.session_count


async def test_drain_period_over_then_shutdown_finishes_open_segments(make_fake_server):
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.01))
    async with connect(server.url + "?partials=false") as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        await ws.send(np.concatenate([silence(300), tone(1500)]).tobytes())  # speech goes on
        assert orjson.loads(await ws.recv())["type"] == "speech_start"
        await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(server.server.drain(0.2), server.loop)
        )
        assert server.server.session_count == 1  # the drain period ended with it open
        await asyncio.to_thread(server.shutdown)
        messages, code = await messages_until_close(ws)
    assert code == 1001
    kinds = [m["type"] for m in messages]
    assert kinds[-2:] == ["final", "end"]
    assert messages[-2]["end_ms"] == pytest.approx(1800, abs=1)  # every sample it was sent


async def test_stop_draining_admits_again(make_fake_server):
    server = make_fake_server(FakeRecognizer)
    on_loop(server, server.server.start_draining)
    assert (await get(server.http_url + "/readyz"))[1]["status"] == "draining"
    with pytest.raises(InvalidStatus):
        await connect(server.url)
    on_loop(server, server.server.stop_draining)
    assert (await get(server.http_url + "/readyz"))[0] == 200
    client = await StreamingClient.connect(ClientOptions(url=server.url))
    await client.close()


# -- the signals of `streamer serve` ---------------------------------------------------


async def test_sigusr1_drains_sigusr2_admits_sigterm_drains_then_exits(cache_dir: Path):
    """The CLI's signals: USR1/USR2 toggle draining; TERM drains (an open session goes on
    and ends normally), then the process exits 0 as soon as no session is left."""
    port = free_port()
    env = {**os.environ, "STREAMER_CACHE_DIR": str(cache_dir)}
    argv = [sys.executable, "-m", "streamer", "serve", "--model", "random:tiny", "--port",
            str(port), "--no-warmup", "--drain-s", "120"]  # fmt: skip
    process = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        text=True, env=env,
    )  # fmt: skip
    url = f"ws://127.0.0.1:{port}/v1/asr"
    try:
        await eventually(lambda: readyz_status(port) == "ready", HANG_GUARD_S)
        process.send_signal(signal.SIGUSR1)
        await eventually(lambda: readyz_status(port) == "draining")
        process.send_signal(signal.SIGUSR2)
        await eventually(lambda: readyz_status(port) == "ready")
        options = ClientOptions(url=url, stream=StreamOptions(partials=False))
        async with await StreamingClient.connect(options) as client:
            process.send_signal(signal.SIGTERM)
            await eventually(lambda: readyz_status(port) == "draining")
            assert (await get(f"http://127.0.0.1:{port}/healthz"))[0] == 200
            with pytest.raises(InvalidStatus) as refused:
                await connect(url)
            assert refused.value.response.status_code == 503
            await client.send_audio(np.zeros(16000, dtype=np.int16))
            await client.stop()
            async for _ in client.messages():
                pass
            assert client.end is not None  # ended normally, not by the shutdown
        _, stderr = await asyncio.to_thread(process.communicate, timeout=timeout_s(HANG_GUARD_S))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "drained: no session is open" in stderr  # it did not wait the full 120 s
    assert "Traceback" not in stderr
