"""The web demo's "Caption a file…": seconds from choosing a file to its last caption.

Starts ``streamer serve`` (by default random:small int8 on ONNX Runtime, 2 threads),
opens the page in headless Chromium, chooses a WAV of espeak speech about ``--seconds``
long and times until the page's summary says it is done: through the upload API
(``stream=true``) ``--runs`` times, then once with ``--max-file-jobs 0``, where the page
plays the file into the WebSocket at real time (the path before issue 33).

    python -m bench.web_file_captions --seconds 30 --runs 3
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from bench import common
from streamer.testkit import speech as synth

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
TEXTS = (
    "the quick brown fox jumps over the lazy dog",
    "streaming speech recognition should feel instant",
    "hello there, how are you today",
)


def speech_wav(seconds: float, folder: Path, cache: Path) -> tuple[Path, float]:
    clips: list[tuple[str, str, np.ndarray]] = []
    total = 0.0
    while total < seconds:
        text = TEXTS[len(clips) % len(TEXTS)]
        pcm = synth.speak(text, "en", cache_dir=cache)
        clips.append(("en", text, pcm))
        total += pcm.size / synth.SAMPLE_RATE + 1.0
    pcm, _ = synth.join_with_silence(clips, 1000)
    path = folder / "speech.wav"
    sf.write(path, pcm, synth.SAMPLE_RATE, subtype="PCM_16")
    return path, pcm.size / synth.SAMPLE_RATE


# `streamer serve` with this checkout's web_demo/ as its page (an editable install of
# another checkout, as in a worktree, would serve that one's)
LAUNCH = """
import dataclasses, pathlib, sys
import streamer.cli.serve as serve
build = serve.server_options_from
root = pathlib.Path(sys.argv.pop(1))
serve.server_options_from = lambda args: dataclasses.replace(build(args), web_root=root)
from streamer.cli import main
sys.exit(main(sys.argv[1:]))
"""
WEB_ROOT = Path(__file__).resolve().parent.parent / "web_demo"


@dataclass(frozen=True)
class DemoServerOptions(common.ServerOptions):
    """``streamer serve`` through LAUNCH, with ``--model-args`` and the run's own arguments
    as given."""

    serve_args: tuple[str, ...] = ()
    ready_timeout_s: float = 300.0

    def command(self, port: int) -> list[str]:
        command = [self.python, "-c", LAUNCH, str(WEB_ROOT), "serve", "--port", str(port)]
        return command + list(self.serve_args)


def serve(model: list[str], extra: list[str], log_path: Path) -> common.ManagedServer:
    """The demo's server on a port of its own; enter it to start it and wait for /readyz."""
    return common.ManagedServer(DemoServerOptions(serve_args=(*model, *extra)), log_path)


async def caption(base: str, wav: Path, runs: int) -> list[float]:
    from playwright.async_api import async_playwright

    times = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=FLAGS
        )
        try:
            page = await browser.new_page()
            await page.goto(f"{base}/")
            for _ in range(runs):
                await page.evaluate(
                    "document.getElementById('summary').removeAttribute('data-ended')"
                )
                started = time.monotonic()
                await page.set_input_files("#file", wav)
                await page.wait_for_selector("#summary[data-ended=true]", timeout=600_000)
                times.append(time.monotonic() - started)
                print(f"  {times[-1]:.2f} s: {await page.inner_text('#summary')}", flush=True)
                await page.wait_for_selector("#connection[data-state=idle]", timeout=60_000)
        finally:
            await browser.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, prog="python -m bench.web_file_captions")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--model-args",
        default="--model random:small --quantize int8 --device cpu --threads 2",
        help="what serve loads [%(default)s]",
    )
    parser.add_argument("--no-realtime", action="store_true", help="skip the real-time run")
    args = parser.parse_args(argv)
    cache = common.CACHE_DIR / "tts"
    with tempfile.TemporaryDirectory() as folder:
        wav, duration_s = speech_wav(args.seconds, Path(folder), cache)
        print(f"file: {duration_s:.1f} s of speech; serve {args.model_args}")
        model = args.model_args.split()
        for label, extra, runs in (
            ("upload API (stream=true)", [], args.runs),
            ("real time over the WebSocket (--max-file-jobs 0)", ["--max-file-jobs", "0"], 1),
        ):
            if extra and args.no_realtime:  # (not `runs == 1`: --runs 1 skipped the upload)
                continue
            with serve(model, extra, Path(folder) / "server.log") as server:
                print(label)
                times = asyncio.run(caption(server.http_url, wav, runs))
            shares = ", ".join(f"{t / duration_s:.2f}" for t in times)
            print(f"  share of the file's duration: {shares}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
