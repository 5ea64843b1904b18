"""Mixed soak (issue 32): live PCM, WebM streams and closed tabs, uploads and SSE uploads
together for N minutes against a ``streamer serve`` it starts; the server's RSS,
threads and fds at start, middle and end, and every well-behaved client's finals checked.

    python -m bench.stress soak --minutes 20            # the issue's soak
    python -m bench.stress soak --minutes 4 --out bench/out/soak.md

The well-behaved clients and what each must get, every time, equal to its reference
(the same audio sent once alone before the soak):
  * ``--live`` real-time PCM sessions (protocol v1, partials off): the same finals and
    the end;
  * one WebM stream, real-time, ended by ``stop``: the same finals and the end;
  * an upload (Deepgram, WAV) every ``--upload-every-s``: 200 and the same utterances;
  * an SSE upload (OpenAI, ``stream=true``) every ``--upload-every-s``: the same text in
    its deltas, ended by ``transcript.text.done``.
Beside them, a WebM tab that closes without ``stop`` (or drops its connection) every
``--tab-close-every-s``. The hostile uploads the issue's soak also mixed in (a dripping
upload, 1 Hz, 0-bit and truncated WAVs, a 70-part form, an upload reset
mid-transcription) are each asserted by tests/test_hostile_uploads.py; their clients are
at ``git show 276f9f2:bench/stress/soak.py``.

Every attack talks to 127.0.0.1 only; every wait has a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import io
import itertools
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import soundfile as sf
from websockets.asyncio.client import connect

from bench import common
from bench.common import cpu_name, proc_status, rss_mb
from bench.files import Uploader
from bench.latency.protocols import webm_bytes
from bench.stress.attacks import long_speech, session, stress_server
from streamer.client.connection import ClientOptions, StreamingClient
from streamer.core.protocol import Error, Final, StreamOptions

logger = logging.getLogger("bench.stress.soak")

HTTP_TIMEOUT_S = 120.0  # one upload's answer (it waits behind live work)
SAMPLE_EVERY_S = 5.0
DEEPGRAM_PATH = "/v1/listen?utterances=true"


@dataclass
class Tally:
    """What the clients saw: counts per outcome, and every mismatch described."""

    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def record(self, what: str, failure: str | None) -> None:
        """One outcome of ``what``: None when it was as it must be, else what went wrong."""
        self.counts[f"{what} {'ok' if failure is None else 'FAILED'}"] += 1
        if failure is not None:
            self.failures.append(f"{what}: {failure}"[:300])


@dataclass(frozen=True)
class Sample:
    at_s: float
    rss_mb: float
    threads: int
    fds: int


def sample(pid: int, at_s: float) -> Sample:
    threads = proc_status(pid, "Threads")
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = 0
    return Sample(at_s, rss_mb(pid), threads, fds)


# -- audio ---------------------------------------------------------------------------


def wav_bytes(pcm: np.ndarray) -> bytes:
    """A 16 kHz mono 16-bit WAV of ``pcm``."""
    buffer = io.BytesIO()
    sf.write(buffer, pcm, 16000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


# -- clients --------------------------------------------------------------------------


def post(port: int, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def deepgram_texts(body: bytes) -> list[str]:
    return [u["transcript"] for u in orjson.loads(body)["results"]["utterances"]]


async def webm_session(url: str, webm: bytes, *, slice_s: float, seconds: float) -> list[str]:
    """A real-time WebM stream ended by ``stop`` (the package's client): its finals' texts."""
    options = ClientOptions(url=url, stream=StreamOptions(encoding="webm", partials=False))
    async with await StreamingClient.connect(options) as client:
        for piece in _slices(webm, seconds, slice_s):
            await client.send_audio(piece)
            await asyncio.sleep(slice_s)
        await client.stop()
        async with asyncio.timeout(HTTP_TIMEOUT_S):
            messages = [item.message async for item in client.received()]
    if errors := [m.code for m in messages if isinstance(m, Error)]:
        raise RuntimeError(errors)
    if client.end is None:
        raise RuntimeError("no end")
    return [m.text for m in messages if isinstance(m, Final) and m.text]


async def closed_tab(url: str, webm: bytes, *, abort: bool) -> None:
    """A tab that streams a second of WebM and closes (or drops) without ``stop``."""
    ws = await connect(f"{url}?encoding=webm", max_size=None)
    try:
        await asyncio.wait_for(ws.recv(), 10)
        for piece in _slices(webm, 4.0, 0.25)[:4]:
            await ws.send(piece)
            await asyncio.sleep(0.25)
    finally:
        if abort:
            ws.transport.abort()
        else:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 5)


def _slices(data: bytes, seconds: float, slice_s: float) -> list[bytes]:
    count = max(1, round(seconds / slice_s))
    step = -(-len(data) // count)
    return [data[i : i + step] for i in range(0, len(data), step)]


# -- the soak --------------------------------------------------------------------------


async def soak(args: argparse.Namespace) -> str:
    cache = Path(os.environ.get("STREAMER_CACHE_DIR", "~/.cache/sensevoice-streamer")).expanduser()
    speech = long_speech(cache / "speech", args.clip_s / 60)
    webm = webm_bytes(speech)
    wav = wav_bytes(speech)
    server = stress_server(args, Path(args.log))
    tally = Tally()
    try:
        server.__enter__()  # started and ready; stopped below with SIGTERM, its exit timed
        port, url = server.port or 0, server.url
        # references: each well-behaved client alone, once
        live_ref = (await session(url, speech, ping=False)).texts
        webm_ref = await webm_session(url, webm, slice_s=0.25, seconds=args.clip_s)
        status, body = await asyncio.to_thread(post, port, DEEPGRAM_PATH, wav, "audio/wav")
        assert status == 200, body[:200]
        upload_ref = deepgram_texts(body)
        wav_path = Path(args.log).with_suffix(".wav")
        wav_path.write_bytes(wav)
        text_ref = (await asyncio.to_thread(Uploader(server.http_url).upload, wav_path)).text
        logger.info(
            "references: %d live finals, %d WebM finals, %d utterances", len(live_ref),
            len(webm_ref), len(upload_ref),
        )  # fmt: skip
        await asyncio.sleep(5.0)
        pid = server.process.pid  # type: ignore[union-attr]
        t0 = time.monotonic()
        samples = [sample(pid, 0.0)]
        end = t0 + args.minutes * 60

        def running() -> bool:
            return time.monotonic() < end

        async def repeat(
            what: str, attempt: Callable[[], Awaitable[str | None]], every_s: float = 0.0
        ) -> None:
            """``attempt`` until the end, one every ``every_s`` at most: each returns None
            when its client got what it must, else what went wrong."""
            while running():
                started = time.monotonic()
                try:
                    failure = await attempt()
                except Exception as error:  # the tally records it
                    failure = repr(error)
                tally.record(what, failure)
                await asyncio.sleep(max(0.0, started + every_s - time.monotonic()))

        async def live() -> str | None:
            got = await session(url, speech, speed=1.0)
            ok = got.texts == live_ref and got.ended and not got.errors
            return None if ok else f"{len(got.texts)}/{len(live_ref)} {got.ended} {got.errors}"

        async def webm_stream() -> str | None:
            texts = await webm_session(url, webm, slice_s=0.25, seconds=args.clip_s)
            return None if texts == webm_ref else f"{len(texts)}/{len(webm_ref)} finals"

        tabs = itertools.count()

        async def tab() -> None:
            await closed_tab(url, webm, abort=next(tabs) % 2 == 1)

        async def upload() -> str | None:
            status, body = await asyncio.to_thread(post, port, DEEPGRAM_PATH, wav, "audio/wav")
            ok = status == 200 and deepgram_texts(body) == upload_ref
            return None if ok else f"{status} {body[:120]!r}"

        async def sse_upload() -> str | None:
            up = await asyncio.to_thread(Uploader(server.http_url).upload, wav_path)
            ok = up.error is None and up.deltas_match_done and _same(up.text, text_ref)
            return None if ok else f"{up.error} {up.text[:80]!r}"

        async def sampler() -> None:
            while running():
                await asyncio.sleep(SAMPLE_EVERY_S)
                samples.append(sample(pid, time.monotonic() - t0))

        tasks = [
            *(repeat("live PCM session", live) for _ in range(args.live)),
            repeat("WebM stream", webm_stream),
            repeat("closed tab", tab, args.tab_close_every_s),
            repeat("upload", upload, args.upload_every_s),
            repeat("SSE upload", sse_upload, args.upload_every_s),
            sampler(),
        ]
        await asyncio.gather(*tasks)
        load_end = sample(pid, time.monotonic() - t0)
        await asyncio.sleep(args.settle_s)
        settled = sample(pid, time.monotonic() - t0)
    finally:
        exit_s = server.stop(signal.SIGTERM)
    log = Path(args.log).read_text(errors="replace")
    tally.counts["server log: tracebacks"] = log.count("Traceback (most recent call last)")
    return report(args, samples, load_end, settled, tally, exit_s)


def _same(a: str, b: str) -> bool:
    return a.split() == b.split()


def report(
    args: argparse.Namespace,
    samples: list[Sample],
    load_end: Sample,
    settled: Sample,
    tally: Tally,
    exit_s: float | None,
) -> str:
    middle = min(samples, key=lambda s: abs(s.at_s - args.minutes * 30))
    named = [("start", samples[0]), ("middle", middle), ("end of the load", load_end)]
    named.append((f"{args.settle_s:g} s after", settled))
    rows: list[list[object]] = [
        [name, f"{s.at_s:.0f} s", f"{s.rss_mb:.0f} MiB", s.threads, s.fds] for name, s in named
    ]
    before, after = (np.array([s.rss_mb, s.threads, s.fds], float) for s in (middle, load_end))
    rows.append(
        ["growth over the last half", "", *(f"{g:+.1f} %" for g in 100 * (after / before - 1))]
    )
    lines = [
        f"Mixed soak, {args.minutes:g} min, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{cpu_name()}, {os.cpu_count()} CPUs, model {args.model}",
        "",
        common.markdown_table("when|at|RSS|threads|fds".split("|"), rows),
        "",
        common.markdown_table(["client", "outcomes"], sorted(tally.counts.items())),
        "",
        f"SIGTERM to exit: {'killed' if exit_s is None else f'{exit_s:.1f} s'}",
    ]
    if tally.failures:
        lines += ["", "Failures:", *(f"- {failure}" for failure in tally.failures[:20])]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stress soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--minutes", type=float, default=20.0)
    common.add_server_args(p, model="random:tiny", quantize=None)  # and --server-arg
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--live", type=int, default=2, help="real-time PCM sessions at once")
    p.add_argument("--clip-s", type=float, default=20.0, help="each client's audio")
    p.add_argument("--tab-close-every-s", type=float, default=10.0)
    p.add_argument("--upload-every-s", type=float, default=20.0)
    p.add_argument("--settle-s", type=float, default=30.0)
    p.add_argument("--log", default="/tmp/stress-soak-server.log")
    p.add_argument("--out", help="also write the report to this file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    text = asyncio.run(soak(args))
    command = "python -m bench.stress soak " + " ".join(argv)
    text = f"Command: `{command.strip()}`\n\n{text}"
    sys.stdout.write(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0 if "FAILED" not in text and "tracebacks | 0 |" in text else 1


if __name__ == "__main__":  # also python -m bench.stress soak
    sys.exit(main(sys.argv[1:]))
