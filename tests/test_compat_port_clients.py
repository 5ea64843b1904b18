"""The real FunASR and Wyoming clients against the real server, with the tagged model.

Each client hears the same espeak audio ("the quick brown fox ...", then "hello there")
and must come out with protocol v1's finals for it:

- funasr-client 0.1.6's async client (its sync client deadlocks in its own ``close()``:
  see docs/funasr.md), in 2pass and offline mode;
- funasr-python 0.1.5, in a process of its own (it installs the same package name);
- FunASR's html5 demo's message sequence, in headless Chromium;
- the ``wyoming`` package's client in Home Assistant's call sequence.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.compat.common import join_texts
from streamer.server.server import ServerOptions
from streamer.testkit import speech as synth
from tests.server_fixtures import ServerThread, recognizer_loader
from tests.timing import eventually, timeout_s

REPO = Path(__file__).resolve().parents[1]
FUNASR_PYTHON = Path(os.environ.get("FUNASR_PYTHON_DIR", REPO / ".cache/clients/funasr-python"))
CHROMIUM = "/usr/bin/chromium"
FOX = "the quick brown fox jumps over the lazy dog"
HELLO = "hello there"
CHUNK_60_MS = 1920  # what funasr-client and the html5 demo send (chunk_size [5, 10, 5])


@pytest.fixture(scope="module")
def server(tagged_model_dir: Path):
    options = ServerOptions(funasr_port=0, wyoming_port=0)
    thread = ServerThread(recognizer_loader(tagged_model_dir), options).start()
    yield thread
    thread.shutdown()


@pytest.fixture(scope="module")
def speech(speech_cache: Path) -> np.ndarray:
    clips = [("en", text, synth.speak(text, "en", cache_dir=speech_cache)) for text in (FOX, HELLO)]
    pcm, _ = synth.join_with_silence(clips, 1200)  # the last utterance ends in silence too
    return pcm


@pytest.fixture(scope="module")
def v1_finals(server: ServerThread, speech: np.ndarray) -> list[str]:
    result = asyncio.run(transcribe(ClientOptions(url=server.url), speech, 16000, speed=None))
    texts = [final.text for final in result.finals]
    assert texts == [FOX, HELLO]  # what the tagged model was trained to answer
    return texts


def funasr_uri(server: ServerThread) -> str:
    return f"ws://127.0.0.1:{server.server.listeners['funasr'].port}/"


def wyoming_port(server: ServerThread) -> int:
    return server.server.listeners["wyoming"].port


def pieces(pcm: np.ndarray, size: int) -> list[bytes]:
    data = pcm.astype("<i2").tobytes()
    return [data[i : i + size] for i in range(0, len(data), size)]


# -- funasr-client ---------------------------------------------------------------------


async def funasr_client_session(uri: str, pcm: np.ndarray, mode: str, pace_s: float) -> list:
    from funasr_client import async_funasr_client

    got = []
    async with async_funasr_client(
        uri, mode=mode, wav_name="fox", audio_fs=16000, svs_lang="auto", svs_itn=True, blocking=True
    ) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for index, piece in enumerate(pieces(pcm, CHUNK_60_MS)):
            await client.send(piece)
            await asyncio.sleep(max(0.0, start + (index + 1) * pace_s - loop.time()))
        await client.signal_close()
        async with asyncio.timeout(timeout_s(30)):
            async for message in client.stream():
                got.append(message)
    # leaving the block ran close(), which sends {"is_speaking": false} a second time
    return got


async def test_funasr_client_2pass(server, speech, v1_finals):
    from funasr_client import merge_messages

    # at real-time pace, as from a microphone: partials (and their stable text) form
    got = await funasr_client_session(funasr_uri(server), speech, "2pass", 0.06)
    assert [m["is_final"] for m in got] == [False] * (len(got) - 1) + [True]
    sentences = [m for m in got if m["mode"] == "2pass-offline" and m["text"]]
    assert [m["text"].strip() for m in sentences] == v1_finals
    assert merge_messages(got)["text"] == join_texts(v1_finals)
    assert all(m["wav_name"] == "fox" for m in got)
    online = [m["text"] for m in got if m["mode"] == "2pass-online"]
    assert online, "no 2pass-online text (from the partials)"
    for m in sentences:  # funasr-client decodes the timestamp string itself
        assert len(m["timestamp"]) == len(m["text"].split())
        assert m["timestamp"] == sorted(m["timestamp"])


async def test_funasr_client_offline(server, speech, v1_finals):
    got = await funasr_client_session(funasr_uri(server), speech, "offline", 0.0)
    (only,) = got
    assert (only["mode"], only["is_final"]) == ("offline", True)
    assert only["text"] == join_texts(v1_finals)


# -- funasr-python ---------------------------------------------------------------------


def run_funasr_python(uri: str, mode: str, pcm: np.ndarray, tmp_path: Path) -> list:
    if not (FUNASR_PYTHON / "funasr_client" / "protocols.py").exists():
        pytest.fail(
            f"funasr-python is not installed in {FUNASR_PYTHON}: run scripts/test.sh, or "
            f"pip install --no-deps --target {FUNASR_PYTHON} funasr-python==0.1.5"
        )
    path = tmp_path / f"{mode}.pcm"
    path.write_bytes(pcm.astype("<i2").tobytes())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FUNASR_PYTHON), str(REPO)]))
    driver = Path(__file__).with_name("funasr_python_driver.py")
    done = subprocess.run(
        [sys.executable, str(driver), uri, mode, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s(120),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


async def test_funasr_python_offline_and_2pass(server, speech, v1_finals, tmp_path):
    uri = funasr_uri(server)
    offline = await asyncio.to_thread(run_funasr_python, uri, "offline", speech, tmp_path)
    assert offline == [["final", join_texts(v1_finals)]]
    got = await asyncio.to_thread(run_funasr_python, uri, "2pass", speech, tmp_path)
    # funasr-python calls every is_final: false message a partial, so each sentence shows
    # up there, or as the final when it was still decoding at the end of input
    finals = [text for kind, text in got if kind == "final"]
    assert len(finals) == 1 and finals[0] in ("", v1_finals[-1])
    texts = [text for _, text in got]
    positions = [texts.index(final) for final in v1_finals]
    assert positions == sorted(positions)
    assert not [text for kind, text in got if kind == "error"]


# -- FunASR's html5 demo ---------------------------------------------------------------

# The demo's behaviour (runtime/html5/static/main.js and wsconnecter.js in FunASR),
# written anew: the same first JSON (no "type", no subprotocol), 960-sample Int16 PCM
# pieces, the same stop JSON, and the same caption logic: online text is appended,
# an offline sentence replaces it, timestamps are parsed and indexed per word or character.
H5_PAGE = """<!doctype html><meta charset="utf-8"><textarea id="varArea"></textarea><script>
let recText = "", offlineText = "";
window.received = [];
function withTimestamp(text, stamp) {
  if (stamp == null || text.length <= 0) return text;
  const words = text.replace(/。|？|，|、|\\?|\\.|\\ /g, ",").split(",");
  const times = JSON.parse(stamp);
  let index = 0, out = "";
  for (const word of words) {
    if (word.length <= 0) continue;
    out += times[index][0] / 1000 + ":" + word + "\\n";  // throws if a span is missing
    index += /^[a-zA-Z]+$/.test(word) ? 1 : word.length;
  }
  return out;
}
function onMessage(event) {
  const m = JSON.parse(event.data);
  window.received.push(m);
  if (m.mode == "2pass-offline" || m.mode == "offline") {
    offlineText += withTimestamp("" + m.text, m.timestamp);
    recText = offlineText;
  } else {
    recText += m.text;
  }
  document.getElementById("varArea").value = recText;
}
window.runDemo = (url, pcmBase64, mode) => new Promise((resolve, reject) => {
  const bytes = Uint8Array.from(atob(pcmBase64), c => c.charCodeAt(0));
  const samples = new Int16Array(bytes.buffer);
  const ws = new WebSocket(url);
  ws.onerror = () => reject(new Error("websocket error"));
  ws.onmessage = event => {
    onMessage(event);
    if (JSON.parse(event.data).is_final) setTimeout(() => { ws.close(); resolve(); }, 300);
  };
  ws.onopen = () => {
    ws.send(JSON.stringify({chunk_size: [5, 10, 5], wav_name: "h5", is_speaking: true,
                            chunk_interval: 10, itn: false, mode: mode}));
    let offset = 0;
    const started = performance.now();
    const tick = () => {  // 60 ms of audio every 60 ms, as the microphone mode sends it
      if (offset + 960 <= samples.length) {
        ws.send(samples.slice(offset, offset + 960));
        offset += 960;
        setTimeout(tick, Math.max(0, started + offset / 16 - performance.now()));
        return;
      }
      if (offset < samples.length) ws.send(samples.slice(offset));
      ws.send(JSON.stringify({chunk_size: [5, 10, 5], wav_name: "h5", is_speaking: false,
                              chunk_interval: 10, mode: mode}));
    };
    tick();
  };
});
</script>"""


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs /usr/bin/chromium")
async def test_html5_demo_sequence_in_a_browser_gets_captions(server, speech, v1_finals):
    playwright_api = pytest.importorskip("playwright.async_api")
    pcm64 = base64.b64encode(speech.astype("<i2").tobytes()).decode()
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.set_content(H5_PAGE)
            await page.evaluate(
                "([u, p, m]) => runDemo(u, p, m)", [funasr_uri(server), pcm64, "2pass"]
            )
            received = await page.evaluate("window.received")
            captions = await page.input_value("#varArea")
        finally:
            await browser.close()
    assert errors == []  # the timestamps fit the page's per-word indexing
    assert [m["is_final"] for m in received].count(True) == 1
    assert any(m["mode"] == "2pass-online" for m in received)
    # the captions are the sentences, one "seconds:word" line per word
    lines = captions.strip().split("\n")
    assert all(re.fullmatch(r"\d+(\.\d+)?:[a-z]+", line) for line in lines), lines
    assert " ".join(line.split(":")[1] for line in lines) == join_texts(v1_finals)


# -- Wyoming, in Home Assistant's sequence ---------------------------------------------


async def test_wyoming_client_in_home_assistants_sequence(server, speech, v1_finals):
    from wyoming.asr import Transcribe, Transcript
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    port = wyoming_port(server)
    # setup: describe on a connection of its own
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        info = Info.from_event(await asyncio.wait_for(client.read_event(), timeout_s(10)))
    (asr,) = info.asr
    assert asr.installed and asr.supports_transcript_streaming
    assert set(asr.models[0].languages) == {"zh", "en", "yue", "ja", "ko"}

    # one utterance: a new connection, then read until the transcript
    seen = []
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        for piece in pieces(speech, 1024):
            await client.write_event(
                AudioChunk(rate=16000, width=2, channels=1, audio=piece).event()
            )
            await asyncio.sleep(0.008)  # 32 ms of audio each: four times real time
        await client.write_event(AudioStop().event())
        async with asyncio.timeout(timeout_s(30)):
            while True:
                event = await client.read_event()
                assert event is not None, f"connection lost after {seen}"
                seen.append(event)
                if Transcript.is_type(event.type):
                    break
        transcript = Transcript.from_event(seen[-1])
        after = await asyncio.wait_for(client.read_event(), timeout_s(10))
        assert after is not None and after.type == "transcript-stop"
        closed = await asyncio.wait_for(client.read_event(), timeout_s(10))
        assert closed is None  # the server closed
    assert transcript.text == join_texts(v1_finals)
    assert transcript.language == "en"
    types = [event.type for event in seen]
    assert types[0] == "transcript-start" and "transcript-chunk" in types
    streamed = "".join(e.data["text"] for e in seen if e.type == "transcript-chunk")
    assert streamed == transcript.text


async def _home_assistant_run(port: int, speech: np.ndarray, rate: int = 16000) -> list:
    """Home Assistant's sequence, unpaced; every event read until the server closes."""
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    seen = []
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=rate, width=2, channels=1).event())
        for piece in pieces(speech[: 16000 * 2], 3200):  # 2 s in 100 ms chunks, at once
            await client.write_event(
                AudioChunk(rate=rate, width=2, channels=1, audio=piece).event()
            )
        await client.write_event(AudioStop().event())
        async with asyncio.timeout(timeout_s(30)):
            while (event := await client.read_event()) is not None:
                seen.append(event)
    return seen


async def test_wyoming_errors_reach_the_library_intact_and_describe_works_when_full(
    tagged_model_dir: Path, speech
):
    """The error event is followed by a clean close, never an RST that the wyoming
    library sees as ConnectionResetError; describe is answered while the server is full."""
    from websockets.asyncio.client import connect
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    options = ServerOptions(wyoming_port=0, max_sessions=1)
    thread = ServerThread(recognizer_loader(tagged_model_dir), options).start()
    try:
        port = wyoming_port(thread)
        # an error inside a session: a sample rate the server does not take
        (error,) = await _home_assistant_run(port, speech, rate=11025)
        assert error.type == "error" and error.data["code"] == "unsupported_sample_rate"
        async with connect(thread.url):  # the one session: the server is full now
            await eventually(lambda: thread.server.session_count == 1)
            (error,) = await _home_assistant_run(port, speech)
            assert error.type == "error" and error.data["code"] == "server_full"
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Describe().event())
                info = Info.from_event(await asyncio.wait_for(client.read_event(), timeout_s(10)))
            assert info.asr and info.asr[0].installed
    finally:
        thread.shutdown()
