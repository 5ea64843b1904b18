"""The web demo in headless Chromium against a running server with the tagged tiny model.

A fake microphone plays a generated WAV (espeak-ng utterances joined by silences). The
page's own WebSocket traffic is observed through Playwright, so the test checks both what
the page shows and what it sent: the audio must match the WAV (the worklet's resampling),
and the captions must match the server's finals.
"""

from __future__ import annotations

import json
import re
import time
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from streamer.testkit import speech as synth
from tests.support import BROWSER_FLAGS, CHROMIUM, FOX, HELLO, REPO, TTS_CACHE
from tests.timing import timeout_s

pytestmark = pytest.mark.browser

playwright_api = pytest.importorskip("playwright.async_api")

ARTIFACTS = REPO / "test-artifacts"

# What the tagged tiny model answers for each espeak clip: (emotion, event).
TAGS = {FOX: ("NEUTRAL", "Speech"), HELLO: ("HAPPY", "Laughter")}
EMOJI = {"HAPPY": "😊", "NEUTRAL": "😐", "SAD": "😢", "ANGRY": "😠"}
EVENT_ICON = {"Laughter": "😀"}

# Records, in the page, every text the open segment's partial shows and how many partial
# elements exist at once (a partial must be replaced, never appended).
WATCH_PARTIALS = """
window.__partials = [];
window.__maxPartials = 0;
new MutationObserver(() => {
  const nodes = document.querySelectorAll(".segment.partial");
  window.__maxPartials = Math.max(window.__maxPartials, nodes.length);
  const text = nodes[0]?.querySelector(".text")?.textContent.replace("…", "").trim();
  if (text && window.__partials.at(-1) !== text) window.__partials.push(text);
}).observe(document, { subtree: true, childList: true, characterData: true });
"""

needs_tools = pytest.mark.skipif(
    not (synth.tools_available() and Path(CHROMIUM).exists()),
    reason="needs espeak-ng, sox and /usr/bin/chromium",
)


def write_speech_wav(path: Path, texts: list[str], gap_ms: int) -> tuple[np.ndarray, list]:
    clips = [("en", text, synth.speak(text, "en", cache_dir=TTS_CACHE)) for text in texts]
    pcm, truth = synth.join_with_silence(clips, gap_ms)
    sf.write(path, pcm, synth.SAMPLE_RATE, subtype="PCM_16")
    return pcm, truth


def best_correlation(sent: np.ndarray, reference: np.ndarray) -> tuple[float, int]:
    """Highest normalised correlation of ``sent`` against ``reference`` and its lag.

    The lag is where ``sent[0]`` falls in ``reference``, in samples (the fake device starts
    playing before the page captures, so it is usually positive).
    """
    a = sent.astype(np.float64)
    b = reference.astype(np.float64)
    n = 1 << int(np.ceil(np.log2(a.size + b.size)))
    xcorr = np.fft.irfft(np.fft.rfft(b, n) * np.conj(np.fft.rfft(a, n)), n)
    lags = np.r_[np.arange(0, b.size), np.arange(-a.size + 1, 0)]
    values = np.r_[xcorr[: b.size], xcorr[n - a.size + 1 :]]
    lag = int(lags[np.argmax(values)])
    # Exact normalised correlation over the overlap at that lag.
    x = a[max(0, -lag) :]
    y = b[max(0, lag) :]
    m = min(x.size, y.size)
    x, y = x[:m], y[:m]
    return float(np.dot(x, y) / np.sqrt(np.dot(x, x) * np.dot(y, y))), lag


def local_correlations(sent: np.ndarray, reference: np.ndarray, window: int = 8000) -> list[float]:
    """Best correlation of each loud ``window``-sample piece of ``sent`` within ``reference``."""
    pieces = []
    for start in range(0, sent.size - window + 1, window):
        piece = sent[start : start + window]
        if np.abs(piece).max() >= 1000:  # pieces of silence match anything
            pieces.append(best_correlation(piece, reference)[0])
    return pieces


class Traffic:
    """The page's WebSocket frames, as Playwright sees them."""

    def __init__(self, page):
        self.received: list[dict] = []
        self.sent_text: list[dict] = []
        self.sent_audio = bytearray()
        self.urls: list[str] = []
        page.on("websocket", self.attach)

    def attach(self, ws) -> None:
        self.urls.append(ws.url)
        ws.on(
            "framereceived",
            lambda payload: (
                self.received.append(json.loads(payload)) if isinstance(payload, str) else None
            ),
        )

        def sent(payload):
            if isinstance(payload, str):
                self.sent_text.append(json.loads(payload))
            else:
                self.sent_audio.extend(payload)

        ws.on("framesent", sent)

    def of_type(self, kind: str) -> list[dict]:
        return [m for m in self.received if m["type"] == kind]


async def open_page(playwright, http_base_url: str, extra_flags: list[str]):
    browser = await playwright.chromium.launch(
        executable_path=CHROMIUM, headless=True, args=BROWSER_FLAGS + extra_flags
    )
    context = await browser.new_context(
        accept_downloads=True, viewport={"width": 1100, "height": 780}
    )
    await context.grant_permissions(["microphone"], origin=http_base_url)
    await context.add_init_script(WATCH_PARTIALS)
    page = await context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    traffic = Traffic(page)
    await page.goto(f"{http_base_url}/")
    return browser, page, traffic, errors


async def check_finals(page, traffic: Traffic, texts: list[str], *, exact: bool) -> None:
    """One caption per final, showing the server's text, and its tags as badges.

    ``exact``: the server's texts and tags must be the tagged model's answers for
    ``texts``. That model is trained on the exact espeak waveforms, so audio that went
    through the fake device's 44.1 kHz and the worklet's resampling may come back a letter
    or a tag off: without ``exact`` the texts must only be close.
    """
    finals = traffic.of_type("final")
    got = [f["text"] for f in finals]
    if exact:
        assert got == texts
        assert [(f["emotion"], f["event"]) for f in finals] == [TAGS[t] for t in texts]
    else:
        assert len(got) == len(texts), got
        for heard, said in zip(got, texts, strict=True):
            assert SequenceMatcher(None, heard, said).ratio() > 0.8, (heard, said)
    nodes = page.locator(".segment.final")
    assert await nodes.count() == len(texts)
    for i, final in enumerate(finals):
        node = nodes.nth(i)
        assert final["language"] == "en"
        assert await node.get_attribute("data-segment-id") == str(final["segment_id"])
        assert await node.locator(".text").inner_text() == final["text"]
        assert await node.get_attribute("data-language") == "en"
        assert await node.get_attribute("data-emotion") == final["emotion"]
        assert await node.get_attribute("data-event") == final["event"]
        assert await node.locator(".badge.lang").inner_text() == "EN"
        emotion = node.locator(".badge.emotion")
        assert await emotion.get_attribute("data-emotion") == final["emotion"]
        assert await emotion.inner_text() == EMOJI[final["emotion"]]
        if final["event"] in EVENT_ICON:
            assert await node.locator(".badge.event").inner_text() == EVENT_ICON[final["event"]]
        else:  # plain speech carries no event badge
            assert await node.locator(".badge.event").count() == 0


async def check_exports(page, traffic: Traffic) -> None:
    """The exported .txt and .srt hold the finals, with the finals' times."""
    texts = [f["text"] for f in traffic.of_type("final")]
    async with page.expect_download() as info:
        await page.click("#export-txt")
    download = await info.value
    assert download.suggested_filename.endswith(".txt")
    assert Path(await download.path()).read_text(encoding="utf-8").splitlines() == texts

    async with page.expect_download() as info:
        await page.click("#export-srt")
    download = await info.value
    assert download.suggested_filename.endswith(".srt")
    cues = Path(await download.path()).read_text(encoding="utf-8").strip().split("\n\n")
    assert len(cues) == len(texts)

    def srt_ms(stamp: str) -> int:
        h, m, rest = stamp.split(":")
        s, ms = rest.split(",")
        return ((int(h) * 60 + int(m)) * 60 + int(s)) * 1000 + int(ms)

    for i, (cue, final) in enumerate(zip(cues, traffic.of_type("final"), strict=True)):
        number, times, text = cue.split("\n")
        assert number == str(i + 1)
        start, end = times.split(" --> ")
        assert abs(srt_ms(start) - final["start_ms"]) <= 1
        assert abs(srt_ms(end) - final["end_ms"]) <= 1
        assert text == final["text"]


@needs_tools
async def test_microphone_captions(http_base_url: str, tmp_path: Path) -> None:
    texts = [HELLO, FOX, HELLO]
    wav = tmp_path / "speech.wav"
    pcm, _ = write_speech_wav(wav, texts, gap_ms=1200)
    flags = [f"--use-file-for-fake-audio-capture={wav}%noloop"]

    async with playwright_api.async_playwright() as playwright:
        browser, page, traffic, errors = await open_page(playwright, http_base_url, flags)
        try:
            await page.click("#start")
            await page.wait_for_selector(
                "#connection[data-state=live]", timeout=timeout_s(10) * 1000
            )
            (url,) = traffic.urls
            assert url.startswith(http_base_url.replace("http", "ws", 1) + "/v1/asr?")
            assert "sample_rate=16000" in url

            await page.wait_for_function(
                f"document.querySelectorAll('.segment.final').length >= {len(texts)}",
                timeout=timeout_s(30) * 1000,
            )
            assert await page.evaluate("window.__partials.length") >= 1
            assert await page.evaluate("window.__maxPartials") == 1
            await check_finals(page, traffic, texts, exact=False)
            latency = page.locator("#latency")
            await playwright_api.expect(latency).to_have_text(
                re.compile(r"latency \d+ ms · median")
            )

            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=ARTIFACTS / "web_demo.png")

            await page.click("#stop")
            await page.wait_for_selector("#summary[data-ended=true]", timeout=timeout_s(10) * 1000)
            await page.wait_for_selector(
                "#connection[data-state=idle]", timeout=timeout_s(5) * 1000
            )
            assert traffic.sent_text == [{"type": "stop"}]
            (end,) = traffic.of_type("end")
            assert end["segments"] == len(texts)
            assert traffic.received[-1]["type"] == "end"
            assert f"{len(texts)} segments" in await page.inner_text("#summary")

            await check_exports(page, traffic)
        finally:
            await browser.close()

    # The worklet's 44.1 kHz -> 16 kHz resampling keeps the waveform. Compared piecewise:
    # on a loaded machine the fake device sometimes drops a 10 ms buffer, which shifts
    # everything after it (measured: 0.9998 overall without a drop, each piece 0.998+).
    sent = np.frombuffer(bytes(traffic.sent_audio), dtype="<i2")
    pieces = local_correlations(sent, pcm)
    assert len(pieces) >= 6
    assert np.median(pieces) > 0.98, pieces
    assert errors == []


def upload_segments(http_base_url: str, path: Path) -> list[dict]:
    """The server's own verbose_json segments for ``path`` (the page's reference)."""
    from openai import OpenAI

    client = OpenAI(api_key="k", base_url=f"{http_base_url}/v1", max_retries=0)
    with path.open("rb") as f:
        body = client.audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json"
        )
    return [segment.model_dump() for segment in body.segments or ()]


@needs_tools
async def test_file_captions_come_from_the_upload_api(http_base_url: str, tmp_path: Path) -> None:
    """ "Caption a file…" uploads it (stream=true): the captions fill in as the server
    decodes, in a fraction of the file's duration, with no WebSocket at all."""
    texts = [FOX, HELLO] * 3
    wav = tmp_path / "file.wav"
    pcm, _ = write_speech_wav(wav, texts, gap_ms=1000)
    duration_s = pcm.size / synth.SAMPLE_RATE
    expected = upload_segments(http_base_url, wav)
    assert [s["text"] for s in expected] == texts

    async with playwright_api.async_playwright() as playwright:
        browser, page, traffic, errors = await open_page(playwright, http_base_url, [])
        posts: list[str] = []
        page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
        try:
            started = time.monotonic()
            await page.set_input_files("#file", wav)
            await page.wait_for_selector("#summary[data-ended=true]", timeout=timeout_s(30) * 1000)
            elapsed_s = time.monotonic() - started
            await page.wait_for_selector(
                "#connection[data-state=idle]", timeout=timeout_s(5) * 1000
            )
            nodes = page.locator(".segment.final")
            assert await nodes.count() == len(expected)
            for i, segment in enumerate(expected):
                node = nodes.nth(i)
                assert await node.locator(".text").inner_text() == segment["text"]
                assert await node.get_attribute("data-emotion") == segment["emotion"]
                assert await node.get_attribute("data-event") == segment["event"]
                assert await node.get_attribute("data-language") == segment["sensevoice_language"]
            summary = await page.inner_text("#summary")
            assert re.fullmatch(
                rf"file\.wav: {len(expected)} captions in [\d.]+ s \(uploaded\)", summary
            )
            async with page.expect_download() as info:
                await page.click("#export-srt")
            cues = Path(await (await info.value).path()).read_text(encoding="utf-8")
            assert cues.strip().count("\n\n") == len(expected) - 1
        finally:
            await browser.close()
    assert [url.split("/", 3)[-1] for url in posts] == ["v1/audio/transcriptions"]
    assert traffic.urls == []  # no WebSocket: the file is not played at real time
    # played at real time it took the file's whole duration; uploaded, a fraction (the
    # issue's quarter is for random:small int8, bench/RESULTS.md, "Files over HTTP": here
    # the bound leaves room for the two cores' other work)
    assert elapsed_s < timeout_s(duration_s / 2), (elapsed_s, duration_s)
    assert errors == []


@needs_tools
async def test_file_captions_without_the_upload_api_are_streamed(
    make_server, tagged_model_dir: Path, tmp_path: Path
) -> None:
    """A server that takes no uploads (--max-file-jobs 0): the file is played into the
    WebSocket at real time, as before."""
    from streamer.server.options import FileOptions
    from tests.server_fixtures import recognizer_loader

    server = make_server(recognizer_loader(tagged_model_dir), files=FileOptions(max_jobs=0))
    texts = [FOX, HELLO]
    wav = tmp_path / "file.wav"
    pcm, _ = write_speech_wav(wav, texts, gap_ms=1000)
    async with playwright_api.async_playwright() as playwright:
        browser, page, traffic, errors = await open_page(playwright, server.http_url, [])
        try:
            await page.set_input_files("#file", wav)
            await page.wait_for_selector("#summary[data-ended=true]", timeout=timeout_s(30) * 1000)
            await page.wait_for_selector(
                "#connection[data-state=idle]", timeout=timeout_s(5) * 1000
            )
            await check_finals(page, traffic, texts, exact=True)
            assert traffic.sent_text == [{"type": "stop"}]
        finally:
            await browser.close()
    sent = np.frombuffer(bytes(traffic.sent_audio), dtype="<i2")
    np.testing.assert_array_equal(sent, pcm)  # a 16 kHz mono file goes out sample for sample
    assert [e for e in errors if "403" not in e] == []  # the refused upload's console line
