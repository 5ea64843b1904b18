"""Compressed audio streamed live to the server: the same utterances as PCM.

Real recordings (pocketsphinx's librivox) and synthesised speech, encoded with ffmpeg as
WebM/Opus, Ogg/Opus and MP3, streamed at real time in 250 ms slices over Deepgram's
``/v1/listen`` without ``encoding`` and over protocol v1 with ``encoding=auto``, all at
once, against the tiny model and the real webrtcvad; the reference is the same signal as
linear16 in 40 ms chunks. A corrupt Ogg stream gets each protocol's error.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect

from streamer.testkit.speech import speak
from tests.clips import LIBRIVOX, load_wav
from tests.containers_audio import encode, needs_ffmpeg, slices
from tests.server_fixtures import messages_until_close
from tests.timing import timeout_s

SLICE_S = 0.25
PCM_CHUNK_S = 0.04


pytestmark = needs_ffmpeg


@pytest.fixture(scope="module")
def speech(speech_cache) -> np.ndarray:
    gap = np.zeros(int(1.2 * 16000), dtype=np.int16)
    parts = [gap]
    for name in ("0870", "0880"):
        parts += [load_wav(LIBRIVOX / f"sense_and_sensibility_01_austen_64kb-{name}.wav"), gap]
    parts += [
        speak("streaming speech recognition should feel instant", "en", cache_dir=speech_cache),
        gap,
    ]
    return np.concatenate(parts)


async def _paced(ws, pieces: list[bytes], interval_s: float) -> None:
    start = time.monotonic()
    for i, piece in enumerate(pieces):
        await asyncio.sleep(max(0.0, start + i * interval_s - time.monotonic()))
        await ws.send(piece)


async def v1_finals(url: str, pieces: list[bytes], interval_s: float, query: str) -> list[tuple]:
    async with connect(f"{url}?{query}", max_size=None) as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        await _paced(ws, pieces, interval_s)
        await ws.send(orjson.dumps({"type": "stop"}).decode())
        finals = []
        async for frame in ws:
            message = orjson.loads(frame)
            assert message["type"] != "error", message
            if message["type"] == "final":
                finals.append((message["start_ms"], message["end_ms"]))
            if message["type"] == "end":
                break
        return finals


async def deepgram_finals(port: int, pieces: list[bytes], query: str = "") -> tuple[list, dict]:
    url = f"ws://127.0.0.1:{port}/v1/listen?model=nova-3&interim_results=true{query}"
    async with connect(url, max_size=None) as ws:
        await _paced(ws, pieces, SLICE_S)
        await ws.send(orjson.dumps({"type": "CloseStream"}).decode())
        finals, metadata = [], {}
        async for frame in ws:
            message = orjson.loads(frame)
            assert message["type"] != "Error", message
            if message["type"] == "Results" and message["is_final"]:
                start_ms = message["start"] * 1000
                finals.append((start_ms, start_ms + message["duration"] * 1000))
            if message["type"] == "Metadata":
                metadata = message
        return finals, metadata


def assert_same_utterances(got: list[tuple], reference: list[tuple], label: str) -> None:
    assert abs(len(got) - len(reference)) <= 1, (label, got, reference)
    for start, end in got:
        assert any(start < r_end and r_start < end for r_start, r_end in reference), (
            label,
            (start, end),
            reference,
        )


async def test_compressed_streams_give_the_utterances_of_pcm(tiny_server, speech, tmp_path):
    duration_s = speech.size / 16000
    pcm = speech.astype("<i2").tobytes()
    pcm_pieces = [pcm[i : i + 1280] for i in range(0, len(pcm), 1280)]
    encoded = {c: encode(speech, c, tmp_path) for c in ("webm", "ogg", "mp3")}
    runs = {"v1 linear16": v1_finals(tiny_server.url, pcm_pieces, PCM_CHUNK_S, "")}
    for container, data in encoded.items():
        pieces = slices(data, duration_s, SLICE_S)
        runs[f"v1 auto {container}"] = v1_finals(tiny_server.url, pieces, SLICE_S, "encoding=auto")
        runs[f"deepgram {container}"] = deepgram_finals(tiny_server.port, pieces)
    # the linear16 Deepgram stream is paced like the others: 40 ms chunks every 40 ms
    runs["deepgram linear16"] = _deepgram_pcm(tiny_server.port, pcm_pieces)
    results = dict(zip(runs, await asyncio.gather(*runs.values()), strict=True))
    reference = results.pop("v1 linear16")
    assert len(reference) >= 3, reference
    dg_reference, dg_meta = results.pop("deepgram linear16")
    assert_same_utterances(dg_reference, reference, "deepgram linear16")
    for label, result in results.items():
        finals, metadata = result if label.startswith("deepgram") else (result, None)
        assert_same_utterances(finals, reference, label)
        if metadata is not None:  # the decoded audio's duration, not the bytes'
            assert abs(metadata["duration"] - duration_s) < 0.2, (label, metadata)
    assert abs(dg_meta["duration"] - duration_s) < 0.05


async def _deepgram_pcm(port: int, pieces: list[bytes]) -> tuple[list, dict]:
    url = f"ws://127.0.0.1:{port}/v1/listen?encoding=linear16&sample_rate=16000"
    async with connect(url, max_size=None) as ws:
        await _paced(ws, pieces, PCM_CHUNK_S)
        await ws.send(orjson.dumps({"type": "CloseStream"}).decode())
        finals, metadata = [], {}
        async for frame in ws:
            message = orjson.loads(frame)
            if message["type"] == "Results" and message["is_final"]:
                start_ms = message["start"] * 1000
                finals.append((start_ms, start_ms + message["duration"] * 1000))
            if message["type"] == "Metadata":
                metadata = message
        return finals, metadata


def _corrupt_ogg(speech: np.ndarray, folder) -> bytes:
    data = bytearray(encode(speech[: 6 * 16000], "ogg", folder))
    data[len(data) // 2 : len(data) // 2 + 16] = b"x" * 16
    return bytes(data)


async def test_a_corrupt_ogg_stream_gets_a_v1_error(tiny_server, speech, tmp_path) -> None:
    data = _corrupt_ogg(speech, tmp_path)
    async with connect(f"{tiny_server.url}?encoding=ogg") as ws:
        await ws.recv()  # ready
        for piece in slices(data, 6, 0.5):
            await ws.send(piece)
        messages, close_code = await messages_until_close(ws)
        errors = [m for m in messages if m["type"] == "error"]
        assert errors and errors[0]["code"] == "undecodable_audio" and errors[0]["fatal"]
        assert "corrupt" in errors[0]["message"]
        assert messages[-1]["type"] == "end"
        assert close_code == 1003


async def test_a_corrupt_ogg_stream_gets_a_deepgram_error(tiny_server, speech, tmp_path) -> None:
    data = _corrupt_ogg(speech, tmp_path)
    async with connect(f"ws://127.0.0.1:{tiny_server.port}/v1/listen") as ws:
        for piece in slices(data, 6, 0.5):
            await ws.send(piece)
        messages, close_code = await messages_until_close(ws)
        assert messages[-1]["type"] == "Error" and messages[-1]["variant"] == "DATA-0000"
        assert close_code == 1008


async def test_pcm_declared_as_ogg_is_refused_not_transcribed(tiny_server, speech) -> None:
    async with connect(f"ws://127.0.0.1:{tiny_server.port}/v1/listen?encoding=opus") as ws:
        await ws.send(speech[:16000].tobytes())
        messages, close_code = await messages_until_close(ws)
        assert [m["type"] for m in messages] == ["Error"]
        assert "not ogg" in messages[0]["description"]
        assert close_code == 1008


async def test_v1_encoding_option_is_checked(tiny_server) -> None:
    async with connect(f"{tiny_server.url}?encoding=aac") as ws:
        message = orjson.loads(await ws.recv())
        assert message["type"] == "error" and message["code"] == "invalid_option"


# -- a container declared raw PCM, raw PCM without a declaration (issue 33) ----------------


@pytest.fixture(scope="module")
def webm_bytes(speech, tmp_path_factory) -> bytes:
    return encode(speech[: 3 * 16000], "webm", tmp_path_factory.mktemp("declared"))


async def test_v1_webm_sent_as_pcm_is_refused_with_what_to_declare(tiny_server, webm_bytes):
    # protocol v1's default encoding is pcm_s16le: a browser recording sent without
    # encoding=webm would decode as noise into one meaningless final
    async with connect(tiny_server.url) as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        for piece in slices(webm_bytes, 3, 0.25):
            await ws.send(piece)
        messages, close_code = await messages_until_close(ws)
    errors = [m for m in messages if m["type"] == "error"]
    assert [(e["code"], e["fatal"]) for e in errors] == [("undecodable_audio", True)]
    assert "declared raw PCM" in errors[0]["message"]
    assert "encoding=webm" in errors[0]["message"]
    assert not [m for m in messages if m["type"] == "final" and m["text"]]
    assert close_code == 1003


async def test_deepgram_linear16_that_is_webm_is_refused(tiny_server, webm_bytes) -> None:
    url = f"ws://127.0.0.1:{tiny_server.port}/v1/listen?encoding=linear16&sample_rate=16000"
    async with connect(url) as ws:
        for piece in slices(webm_bytes, 3, 0.25):
            await ws.send(piece)
        messages, close_code = await messages_until_close(ws)
    assert [m["type"] for m in messages] == ["Error"]
    assert "webm header" in messages[0]["description"]
    assert "omit encoding" in messages[0]["description"]
    assert close_code == 1008


async def test_deepgram_raw_pcm_without_encoding_gets_a_hint(tiny_server, speech) -> None:
    pieces = slices(speech[: 3 * 16000].tobytes(), 3, 0.25)
    finals, metadata = await deepgram_finals(tiny_server.port, pieces)
    (warning,) = metadata["warnings"]
    assert (warning["parameter"], warning["type"]) == ("encoding", "pcm_assumed")
    assert "encoding=linear16&sample_rate=N" in warning["message"]
    # a declared one gets none
    _, metadata = await deepgram_finals(
        tiny_server.port, pieces, "&encoding=linear16&sample_rate=16000"
    )
    assert "warnings" not in metadata


def test_deepgram_prerecorded_declared_and_undeclared(tiny_server, speech, webm_bytes) -> None:
    import urllib.error
    import urllib.request

    def post(query: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{tiny_server.port}/v1/listen{query}",
            data=body,
            headers={"Authorization": "Token k", "Content-Type": "audio/*"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s(30)) as response:
                return response.status, orjson.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, orjson.loads(error.read())

    status, body = post("?encoding=linear16&sample_rate=16000", webm_bytes)
    assert status == 400 and "omit encoding" in str(body), body
    status, body = post("", speech[: 3 * 16000].tobytes())  # raw PCM, not said
    assert status == 400 and "encoding=linear16&sample_rate=N" in str(body), body
