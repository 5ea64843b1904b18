"""pipecat and LiveKit Agents against the real server: their transcripts must equal v1's.

Their dependencies conflict with the project's (pipecat pins older soxr, soundfile and
protobuf; livekit-agents brings grpc, OpenTelemetry, PyAV and native RTC libraries), so
they are not in the test suite: ``scripts/compat_frameworks.sh`` builds a venv for each
and runs this with the project's venv. This starts a server with the tagged test model on
a free loopback port, runs ``compat_framework_drivers.py`` in the framework's venv, then
sends protocol v1 exactly the audio chunks that the framework's session received, with
the options the framework asked for, and compares the transcripts. Exact chunks, because
the audio differs by a few LSB otherwise, which is enough to change a word of the tiny
test model: LiveKit's own resampler differs from run to run, and the server's streaming
resampler (for rates other than 16 kHz) depends on where the chunks are cut. Exit status
1 when any transcript differs.

    python scripts/compat_frameworks.py --pipecat-python V/bin/python --livekit-python W/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import orjson
from websockets.asyncio.client import connect

from streamer.core.compat.common import join_texts
from streamer.core.session import Session
from streamer.model.backends.torch_backend import Recognizer
from streamer.model.options import RecognizerOptions
from streamer.model.serving.worker import ModelWorker
from streamer.server.server import ServerOptions, StreamingServer
from streamer.testkit import speech as synth
from streamer.testkit.models import ensure_random_model

HERE = Path(__file__).resolve().parent
CLIPS = ["the quick brown fox jumps over the lazy dog", "hello there"]

# what each framework's default query or session.update means for protocol v1
# (../shared/compat-protocols.md sections 1 and 2), and how its finals compare
CASES = {
    "pipecat-deepgram": (dict(language="en", itn=True, partials=True), "finals"),
    "livekit-deepgram": (dict(language="en", itn=True, partials=True, endpoint_ms=100), "finals"),
    "pipecat-openai": (dict(language="en", partials=False), "joined"),  # manual commit
    "livekit-openai": (dict(language="en", endpoint_ms=350), "finals"),  # server_vad 350 ms
}


class AudioTap:
    """Records what every session is fed (the adapters' decoded audio chunks), by session."""

    def __init__(self) -> None:
        self.sessions: dict[str, tuple[int, list[bytes]]] = {}
        original = Session.receive_audio
        tap = self

        def receive_audio(session: Session, data: bytes) -> None:
            rate, pcm = tap.sessions.setdefault(
                session.session_id, (session.stream.sample_rate, [])
            )
            pcm.append(data)
            original(session, data)

        Session.receive_audio = receive_audio  # type: ignore[method-assign]


async def v1_finals(port: int, rate: int, chunks: list[bytes], stream: dict) -> list[str]:
    """Protocol v1's finals for exactly these chunks."""
    query = "&".join(f"{k}={str(v).lower()}" for k, v in {"sample_rate": rate, **stream}.items())
    finals = []
    async with connect(f"ws://127.0.0.1:{port}/v1/asr?{query}", max_size=None) as ws:
        for chunk in chunks:
            await ws.send(chunk)
        await ws.send('{"type": "stop"}')
        async for data in ws:
            message = orjson.loads(data)
            if message["type"] == "final" and message["text"]:
                finals.append(message["text"])
    return finals


def speech(cache_dir: Path) -> np.ndarray:
    spoken = [("en", t, synth.speak(t, "en", cache_dir=cache_dir / "speech")) for t in CLIPS]
    pcm, _ = synth.join_with_silence(spoken, 1500)
    return np.concatenate([pcm, np.zeros(16000, dtype=np.int16)])


async def run_driver(python: str, client: str, port: int, pcm_path: Path, expected: int) -> dict:
    process = await asyncio.create_subprocess_exec(
        python, str(HERE / "compat_framework_drivers.py"), client, "--port", str(port),
        "--pcm", str(pcm_path), "--expected", str(expected),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), 120)
    except TimeoutError:
        process.kill()
        await process.wait()
        return {"client": client, "finals": [], "error": "timed out after 120 s"}
    try:
        return json.loads(out)
    except ValueError:
        return {"client": client, "finals": [], "error": err.decode()[-2000:]}


async def main(args: argparse.Namespace) -> int:
    cache_dir = Path(args.cache_dir)
    model_dir = ensure_random_model("tagged", cache_dir)
    worker = ModelWorker(
        lambda: Recognizer(RecognizerOptions(model=str(model_dir), device="cpu", threads=2))
    )
    worker.start()
    tap = AudioTap()
    server = StreamingServer(ServerOptions(host="127.0.0.1", port=0), worker)
    await server.start()
    await server.wait_ready()
    pcm = speech(cache_dir)
    failures = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            pcm_path = Path(tmp) / "speech.raw"
            pcm_path.write_bytes(pcm.tobytes())
            pythons = {"pipecat": args.pipecat_python, "livekit": args.livekit_python}
            for client, (stream, compare) in CASES.items():
                python = pythons[client.split("-")[0]]
                if python is None:
                    print(f"{client:18} skipped (no venv given)")
                    continue
                tap.sessions.clear()
                got = await run_driver(python, client, server.port, pcm_path, len(CLIPS))
                received = [(rate, chunks) for rate, chunks in tap.sessions.values() if chunks]
                reference = []
                for rate, chunks in received:  # what v1 makes of the same audio
                    reference += await v1_finals(server.port, rate, chunks, stream)
                if compare == "joined":
                    reference = [join_texts(reference)]
                ok = got.get("finals") == reference and not got.get("error")
                failures += not ok
                print(f"{client:18} {'ok' if ok else 'DIFFERS'}: {got.get('finals')!r}"
                      f" (v1: {reference!r})")  # fmt: skip
                if not ok or args.verbose:
                    print(f"{'':18} events: {got.get('events')}  error: {got.get('error')}")
    finally:
        await server.shutdown()
        await asyncio.to_thread(worker.stop)
    return 1 if failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipecat-python", help="python of a venv with pipecat-ai")
    parser.add_argument("--livekit-python", help="python of a venv with livekit-agents")
    parser.add_argument("--cache-dir", default=".cache", help="model and speech cache")
    parser.add_argument("--verbose", action="store_true", help="print every client's events")
    sys.exit(asyncio.run(main(parser.parse_args())))
