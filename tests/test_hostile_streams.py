"""Hostile clients on the compressed-stream surface (issue 32): streams that end without
``stop`` (closed tabs, dropped connections) and streams whose container declares an
implausible format. Each must leave no decoder thread behind and never stall the server."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect

from tests.containers_audio import encode, needs_ffmpeg, slices
from tests.fakes import silence, tone
from tests.hostile import wav_header
from tests.server_fixtures import messages_until_close
from tests.timing import eventually, timeout_s

pytestmark = needs_ffmpeg

STREAMS = 20  # streams dropped per case (bench/stress/ drops 100)


def _decoder_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("decode-"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(scope="module")
def webm(tmp_path_factory) -> bytes:
    samples = np.concatenate([silence(300), tone(2000), silence(700)])
    return encode(samples, "webm", tmp_path_factory.mktemp("webm"))


async def _open_stream(url: str, pieces: list[bytes]):
    ws = await connect(f"{url}?encoding=webm", max_size=None)
    assert orjson.loads(await ws.recv())["type"] == "ready"
    for piece in pieces:
        await ws.send(piece)
    return ws


@pytest.mark.parametrize("ending", ["close", "abort"])
async def test_streams_ended_without_stop_release_their_decoders(make_fake_server, webm, ending):
    server = make_fake_server()
    baseline_os = _os_threads()
    pieces = slices(webm, 3.0, 0.25)[:4]  # the header and the first second: a live tab
    sockets = await asyncio.gather(*(_open_stream(server.url, pieces) for _ in range(STREAMS)))
    await eventually(lambda: _decoder_threads() >= STREAMS, what="a decoder per stream")
    for ws in sockets:
        if ending == "close":  # a closed tab: a close frame, no stop
            await ws.close()
        else:  # a dropped connection: no close frame at all
            ws.transport.abort()
    await eventually(lambda: _decoder_threads() == 0, timeout_s=30, what="decoders released")
    await eventually(
        lambda: _os_threads() <= baseline_os + 2, timeout_s=30, what="OS threads at baseline"
    )
    assert not server.server.admission.connections  # every slot freed


async def test_a_stream_at_an_implausible_rate_is_refused_before_decoding(make_fake_server):
    server = make_fake_server()
    wav = wav_header(sample_rate=1, bits=16, channels=1, data_bytes=28000) + bytes(28000)
    async with connect(f"{server.url}?encoding=wav", max_size=None) as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        await ws.send(wav)
        await ws.send(orjson.dumps({"type": "stop"}).decode())
        messages, code = await messages_until_close(ws, timeout_s=timeout_s(10))
    errors = [m for m in messages if m["type"] == "error"]
    assert errors and errors[0]["code"] == "undecodable_audio", messages
    assert "sample rate" in errors[0]["message"]
    assert code == 1003
    await eventually(lambda: _decoder_threads() == 0, what="the decoder released")
