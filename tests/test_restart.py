"""kill -9 and restart of a real server process mid-file: the client's transcript survives.

The server runs as ``streamer serve`` in a subprocess (random:tagged, whose two espeak
clips decode exactly); it is killed with SIGKILL once the first final has arrived and
started again on the same port. The client retries for ``reconnect_timeout_s`` and
resumes after the last final, so its transcript equals an uninterrupted run's.
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

import pytest

from streamer.client.connection import ClientOptions, Received
from streamer.client.streaming import stream_file, transcribe
from streamer.core.protocol import Final, StreamOptions
from streamer.testkit import speech as synth
from tests.support import free_port
from tests.timing import timeout_s

START_TIMEOUT_S = 180  # importing torch and loading the model on a loaded 2-core machine


def start_server(port: int, cache_dir: Path, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "streamer",
        "serve",
        "--model",
        "random:tagged",
        "--port",
        str(port),
        "--cache-dir",
        str(cache_dir),
        "--no-warmup",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--no-uvloop",
    ]
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


async def wait_ready(port: int, process: subprocess.Popen) -> None:
    def ready() -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/readyz", timeout=timeout_s(2)
            ) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    for _ in range(int(timeout_s(START_TIMEOUT_S) * 4)):
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}")
        if await asyncio.to_thread(ready):
            return
        await asyncio.sleep(0.25)
    raise AssertionError("the server never became ready")


@pytest.fixture
def clips(speech_cache):
    fox = synth.speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=speech_cache)
    hello = synth.speak("hello there", "en", cache_dir=speech_cache)
    pcm, _ = synth.join_with_silence(
        [("en", "a", fox), ("en", "b", hello), ("en", "c", fox), ("en", "d", hello)], 1500
    )
    return pcm


async def test_kill_9_and_restart_mid_file_loses_no_segment(
    tagged_server_url, clips, cache_dir, tmp_path
):
    options = ClientOptions(stream=StreamOptions(itn=False, partials=False))
    reference = await transcribe(
        ClientOptions(url=tagged_server_url, stream=options.stream), clips, 16000
    )
    expected = [f.text for f in reference.finals if f.text]
    assert len(expected) == 4

    port = free_port()
    log = tmp_path / "server.log"
    first = start_server(port, cache_dir, log)
    second = None
    try:
        await wait_ready(port, first)
        first_final = asyncio.Event()

        def on_message(item: Received) -> None:
            if isinstance(item.message, Final):
                first_final.set()

        client = asyncio.create_task(
            stream_file(
                ClientOptions(
                    url=f"ws://127.0.0.1:{port}/v1/asr",
                    stream=options.stream,
                    reconnect_timeout_s=timeout_s(START_TIMEOUT_S),
                ),
                clips,
                sample_rate=16000,
                speed=1.5,
                on_message=on_message,
            )
        )
        await asyncio.wait_for(first_final.wait(), timeout_s(60))
        first.send_signal(signal.SIGKILL)
        first.wait(timeout_s(10))
        second = start_server(port, cache_dir, log)
        result = await asyncio.wait_for(client, timeout_s(START_TIMEOUT_S + 60))
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout_s(10))
    assert result.reconnects >= 1, log.read_text()[-2000:]
    assert [f.text for f in result.finals if f.text] == expected
    assert result.end is not None
