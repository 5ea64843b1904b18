"""A real browser's MediaRecorder streaming WebM/Opus to Deepgram's ``/v1/listen``.

Headless Chromium with a fake microphone playing synthesised speech runs the code of
Deepgram's browser examples: ``new WebSocket(url, ["token", KEY])``, then a
``MediaRecorder`` (``audio/webm;codecs=opus``) started with a 250 ms timeslice whose
every blob is sent as it comes, with no ``encoding`` in the URL. The server (tagged tiny
model, real webrtcvad, ``--token``) must detect the container and answer with finals
while the microphone is still recording.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import soundfile as sf

from streamer.testkit import speech as synth
from tests.server_fixtures import recognizer_loader
from tests.support import BROWSER_FLAGS, CHROMIUM, FOX, HELLO, TTS_CACHE

pytestmark = pytest.mark.browser

playwright_api = pytest.importorskip("playwright.async_api")

KEY = "browser-key"

# Deepgram's browser example, nearly word for word; it records what it hears with the
# page clock, and what the recorder made.
STREAM = """
async ([url, key, seconds]) => {
  const got = [];
  const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  const socket = new WebSocket(url, ["token", key]);
  await new Promise((ok, fail) => { socket.onopen = ok; socket.onerror = fail; });
  socket.onmessage = (event) => got.push({ at: performance.now(), ...JSON.parse(event.data) });
  const recorder = new MediaRecorder(stream, { mimeType: "audio/webm;codecs=opus" });
  const blobs = [];
  recorder.ondataavailable = (event) => {
    if (event.data.size > 0 && socket.readyState === 1) {
      socket.send(event.data);
      blobs.push(event.data.size);
    }
  };
  const started = performance.now();
  recorder.start(250);
  await new Promise((ok) => setTimeout(ok, seconds * 1000));
  const stoppedAt = performance.now();
  recorder.stop();
  await new Promise((ok) => setTimeout(ok, 300));
  socket.send(JSON.stringify({ type: "CloseStream" }));
  const closed = await new Promise((ok) => { socket.onclose = (e) => ok(e.code); });
  return { got, blobs, started, stoppedAt, closed, protocol: socket.protocol,
           mime: recorder.mimeType };
}
"""


@pytest.mark.skipif(
    not (synth.tools_available() and Path(CHROMIUM).exists()),
    reason="needs espeak-ng, sox and /usr/bin/chromium",
)
async def test_mediarecorder_webm_blobs_get_live_finals(
    make_server, tagged_model_dir, tmp_path
) -> None:
    server = make_server(recognizer_loader(tagged_model_dir), token=KEY)
    texts = [HELLO, FOX, HELLO]
    clips = [("en", text, synth.speak(text, "en", cache_dir=TTS_CACHE)) for text in texts]
    pcm, _ = synth.join_with_silence(clips, 1500)
    wav = tmp_path / "speech.wav"
    sf.write(wav, pcm, synth.SAMPLE_RATE, subtype="PCM_16")
    seconds = pcm.size / synth.SAMPLE_RATE + 1.0
    flags = [f"--use-file-for-fake-audio-capture={wav}%noloop"]
    base = server.http_url
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=BROWSER_FLAGS + flags
        )
        try:
            context = await browser.new_context()
            await context.grant_permissions(["microphone"], origin=base)
            page = await context.new_page()
            await page.goto(f"{base}/healthz")  # any page of the origin: a secure context
            url = f"ws://127.0.0.1:{server.port}/v1/listen?model=nova-3&interim_results=true"
            result = await page.evaluate(STREAM, [url, KEY, seconds])
        finally:
            await browser.close()
    assert result["mime"].startswith("audio/webm") and result["protocol"] == "token"
    assert len(result["blobs"]) >= 0.7 * seconds / 0.25  # a blob per 250 ms slice (timers lag)
    errors = [m for m in result["got"] if m["type"] == "Error"]
    assert not errors, errors
    finals = [
        m
        for m in result["got"]
        if m["type"] == "Results"
        and m["is_final"]
        and m["channel"]["alternatives"][0]["transcript"]
    ]
    assert len(finals) == len(texts), [
        m["channel"]["alternatives"][0]["transcript"] for m in finals
    ]
    # live: every utterance but the last was final while the microphone still recorded
    assert all(m["at"] < result["stoppedAt"] for m in finals[:-1])
    interims = [m for m in result["got"] if m["type"] == "Results" and not m["is_final"]]
    assert interims  # interim results while speaking
    metadata = [m for m in result["got"] if m["type"] == "Metadata"]
    assert metadata and abs(metadata[0]["duration"] - seconds) < 1.5
    assert result["closed"] == 1000
