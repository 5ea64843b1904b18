"""The bundled client never reports a truncated transcription as success.

A graceful restart (SIGTERM: drain, then every open session ends with ``end`` and close
1001) cuts a file streamed unpaced short: the server read only part of what the client
had sent. The client compares ``end.audio_ms`` with what it sent: across a restart it
resumes from its last final on the new server; with no reconnection left it exits
non-zero and says why.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
import soundfile as sf

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.errors import ServerClosed
from tests.clips import LIBRIVOX, load_wav
from tests.fakes import FakeRecognizer, silence, tone
from tests.support import free_port, readyz_status
from tests.timing import eventually_sync, timeout_s

HANG_GUARD_S = 120


def serve(port: int, cache_dir: Path, log: Path, *flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "streamer", "serve", "--model", "random:tiny", "--no-warmup",
            "--port", str(port), "--drain-s", "0.5", "--shutdown-grace-s", "2", *flags]  # fmt: skip
    env = {**os.environ, "STREAMER_CACHE_DIR": str(cache_dir)}
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def test_a_graceful_restart_mid_file_is_resumed_on_the_new_server(
    cache_dir: Path, tmp_path: Path
) -> None:
    speech = np.concatenate([load_wav(path) for path in sorted(LIBRIVOX.glob("*.wav"))])
    pcm = np.tile(speech, int(np.ceil(40 * 16000 / speech.size)))[: 40 * 16000]
    wav = tmp_path / "speech.wav"
    sf.write(wav, pcm, 16000, subtype="PCM_16")
    port = free_port()
    # the first server reads 6x real time, so SIGTERM finds the file half read
    first = serve(port, cache_dir, tmp_path / "first.log", "--max-input-bytes-per-s", "192000")
    second = None
    client = None
    try:
        eventually_sync(lambda: readyz_status(port) == "ready", HANG_GUARD_S, "the first server")
        client = subprocess.Popen(
            [sys.executable, "-m", "streamer", "client", str(wav), "--no-pace",
             "--url", f"ws://127.0.0.1:{port}/v1/asr", "--json", "--reconnect-timeout-s", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy(),
        )  # fmt: skip
        eventually_sync(lambda: "session" in (tmp_path / "first.log").read_text()
                        and "opened" in (tmp_path / "first.log").read_text(), 30)  # fmt: skip
        time.sleep(1.5)
        first.send_signal(signal.SIGTERM)  # drain 0.5 s, then end every session (1001)
        assert first.wait(timeout_s(HANG_GUARD_S)) == 0
        second = serve(port, cache_dir, tmp_path / "second.log")
        out, err = client.communicate(timeout=timeout_s(HANG_GUARD_S))
    finally:
        for process in (client, first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    first_log = (tmp_path / "first.log").read_text()
    second_log = (tmp_path / "second.log").read_text()
    assert client.returncode == 0, err.decode()
    assert "reconnecting" in err.decode()  # it noticed the truncation
    # the first server ended the session before it had read the whole file ...
    assert "server shutting down" in first_log or "code 1001" in first_log, first_log
    # ... and the second one got the rest: the client resumed there
    assert " s audio" in second_log and "session" in second_log, second_log
    finals = [orjson.loads(line) for line in out.decode().splitlines() if line.strip()]
    assert finals and max(f["end_ms"] for f in finals) > 30_000  # the end of the file too
    assert "Traceback" not in first_log + second_log


async def test_a_truncated_session_with_no_reconnection_left_is_an_error(make_fake_server):
    """transcribe() does not reconnect: a session the server ended early raises."""
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.3), max_input_bytes_per_s=64_000)
    pcm = np.concatenate([np.concatenate([tone(500), silence(700)]) for _ in range(15)])

    async def stop_soon() -> None:
        await asyncio.sleep(1.5)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            server.server.shutdown(), server.loop))  # fmt: skip

    stopper = asyncio.create_task(stop_soon())
    with pytest.raises(ServerClosed, match="incomplete") as closed:
        await transcribe(ClientOptions(url=server.url), pcm, 16000)
    await stopper
    assert closed.value.code == 1001
