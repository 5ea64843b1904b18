"""Helpers that more than one test module uses, so that no test module imports another.

The test doubles of the model and the VAD are in ``fakes.py``, the servers on loopback and
their fixtures in ``server_fixtures.py``, the scaled clock in ``timing.py``; the rest is
here: HTTP and WebSocket plumbing, a raw Wyoming connection, a TLS certificate, test
audio, the protocol-v1 and FunASR client drivers, and the browser's settings.
``test_support_imports.py`` keeps it so.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.compat.audio import ULAW_TO_S16
from streamer.core.compat.wyoming import EventParser, WyomingEvent, encode_event
from streamer.core.protocol import Final, SpeakerWord, StreamOptions
from streamer.testkit import speech as synth
from tests.fakes import silence, tone
from tests.timing import timeout_s

REPO = Path(__file__).resolve().parents[1]


# --- HTTP and WebSocket ---------------------------------------------------------------


class HttpReply(NamedTuple):
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return orjson.loads(self.body)


def http_get(url: str) -> HttpReply:
    """GET ``url`` (blocking; an error status is a reply, not an exception)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s(5)) as response:
            return HttpReply(response.status, response.read(), dict(response.headers))
    except urllib.error.HTTPError as error:
        return HttpReply(error.code, error.read(), dict(error.headers))


async def recv_json(ws, timeout=10):
    return orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(timeout)))


def on_loop(thread, function) -> None:
    """Call a server method on the server's own loop, as a signal handler would."""

    async def call() -> None:
        function()

    thread.call(call())


def self_signed_cert(folder):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certfile, keyfile


# --- Wyoming --------------------------------------------------------------------------

AUDIO_FORMAT = {"rate": 16000, "width": 2, "channels": 1}


class Wyoming:
    """A raw Wyoming connection (the real client library is in test_compat_clients.py)."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer, self.parser = reader, writer, EventParser()
        self.pending: list[WyomingEvent] = []

    @classmethod
    async def open(cls, server) -> Wyoming:
        port = server.server.listeners["wyoming"].port
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, *events: WyomingEvent) -> None:
        self.writer.write(b"".join(encode_event(e) for e in events))
        await self.writer.drain()

    async def audio(self, pcm: np.ndarray, chunk: int = 2048) -> None:
        data = pcm.astype("<i2").tobytes()
        await self.send(
            WyomingEvent("audio-start", AUDIO_FORMAT),
            *[
                WyomingEvent("audio-chunk", AUDIO_FORMAT, data[i : i + chunk])
                for i in range(0, len(data), chunk)
            ],
        )

    async def events(self, timeout: float = 20) -> list[WyomingEvent]:
        """Every event until the server closes the connection (``timeout`` unscaled)."""
        async with asyncio.timeout(timeout_s(timeout)):
            while data := await self.reader.read(65536):
                self.pending += self.parser.feed(data)
        self.writer.close()
        return self.pending


# --- audio ----------------------------------------------------------------------------


def speech(n_segments: int = 3, lead_ms: int = 400) -> np.ndarray:
    """``n_segments`` tone bursts (600, 800, ... ms) after ``lead_ms`` of silence, each
    followed by 900 ms of silence: with a loudness VAD, exact utterances."""
    parts = [silence(lead_ms)]
    for i in range(n_segments):
        parts += [tone(600 + 200 * i), silence(900)]
    return np.concatenate(parts)


def ulaw_encode(pcm: np.ndarray) -> bytes:
    """The nearest μ-law code of each sample (an encoder for the test only)."""
    order = np.argsort(ULAW_TO_S16)
    values = ULAW_TO_S16[order].astype(np.int32)
    idx = np.clip(np.searchsorted(values, pcm.astype(np.int32)), 1, 255)
    nearer = np.where(pcm - values[idx - 1] < values[idx] - pcm, idx - 1, idx)
    return order[nearer].astype(np.uint8).tobytes()


def five_languages(speech_cache: Path, gap_ms: int = 1200):
    clips = [
        ("en", synth.SENTENCES["en"][0]),
        ("zh", synth.SENTENCES["zh"][0]),
        ("yue", synth.SENTENCES["yue"][0]),
        ("ja", synth.SENTENCES["ja"][0]),
        ("ko", synth.SENTENCES["ko"][0]),
    ]
    spoken = [(lang, text, synth.speak(text, lang, cache_dir=speech_cache)) for lang, text in clips]
    return synth.join_with_silence(spoken, gap_ms)


# --- finals and their boundaries ------------------------------------------------------

ONSET_TOLERANCE_MS = 60  # webrtcvad finds starts within about 50 ms
PRE_ROLL_MS = 300
END_SLACK_MS = 700  # end pad + VAD hangover


def assert_boundaries(finals, truth):
    """One final per utterance, starting just before it and ending just after it."""
    assert len(finals) == len(truth), [(f.start_ms, f.end_ms) for f in finals]
    for final, utterance in zip(finals, truth, strict=True):
        start_ms, end_ms = utterance.start_sample / 16, utterance.end_sample / 16
        assert start_ms - PRE_ROLL_MS - ONSET_TOLERANCE_MS <= final.start_ms
        assert final.start_ms <= start_ms  # the first syllable is never clipped
        assert end_ms - 60 <= final.end_ms <= end_ms + END_SLACK_MS
        assert final.reason == "silence"


async def v1_texts(url: str, pcm: np.ndarray, rate: int, **stream) -> list[str]:
    """The non-empty finals' texts of ``pcm`` streamed over protocol v1 at 8x real time."""
    options = ClientOptions(url=url, stream=StreamOptions(sample_rate=rate, **stream))
    result = await transcribe(options, pcm, rate, speed=8.0)
    return [f.text for f in result.finals if f.text]


async def v1_finals(url: str, pcm: np.ndarray, **stream) -> list[tuple[str, float, float]]:
    """Every final of 16 kHz ``pcm`` sent unpaced over protocol v1: (text, start, end)."""
    options = ClientOptions(url=url, stream=StreamOptions(**stream))
    result = await transcribe(options, pcm, 16000, speed=None)
    return [(f.text, f.start_ms, f.end_ms) for f in result.finals]


def texts(finals: list[tuple[str, float, float]]) -> list[str]:
    return [text for text, _, _ in finals]


def spans(finals: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    return [(start, end) for _, start, end in finals]


def diarized_final(words: list[tuple[str, float, float, str]], speaker: str) -> Final:
    """A diarized final of ``(word, start_ms, end_ms, speaker)`` words, mainly
    ``speaker``'s, from 0 to 100 ms after its last word (its turns empty)."""
    spoken = tuple(SpeakerWord(word, start, end, 0.9, who) for word, start, end, who in words)
    text = " ".join(word.word for word in spoken)
    return Final(
        0, 0.0, spoken[-1].end_ms + 100, text, "en", None, None, "", "", "silence", 1.0, 0.0,
        words=spoken, speaker=speaker, turns=(),
    )  # fmt: skip


async def funasr_finals(server, pcm: np.ndarray, **config) -> list[str]:
    from funasr_client import async_funasr_client

    uri = f"ws://127.0.0.1:{server.server.listeners['funasr'].port}/"
    got = []
    async with async_funasr_client(
        uri, mode="offline", wav_name="w", audio_fs=16000, blocking=True, **config
    ) as client:
        data = pcm.tobytes()
        for i in range(0, len(data), 1920):
            await client.send(data[i : i + 1920])
        await client.signal_close()
        async with asyncio.timeout(timeout_s(30)):
            async for message in client.stream():
                got.append(message["text"])
    return got


# --- the browser ----------------------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
TTS_CACHE = REPO / ".cache" / "tts"
FOX = "the quick brown fox jumps over the lazy dog"
HELLO = "hello there"
# Flags that work as root without network (see shared/browser-testing.md).
BROWSER_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]


# --- servers in other processes -------------------------------------------------------


def free_port() -> int:
    """A loopback port free now, for a server started as a process (``--port`` must be
    known before it starts; in-process servers bind port 0 instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def readyz_status(port: int) -> str | None:
    """The ``status`` /readyz answers on ``port``; None while nothing answers there."""
    try:
        return str(http_get(f"http://127.0.0.1:{port}/readyz").json()["status"])
    except OSError:  # URLError, a refused or reset connection, a timeout
        return None  # not bound yet, or no longer
