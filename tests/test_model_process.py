"""The model in a child process (serve --model-process): same transcripts, and a child
that fails to load, dies or stalls never leaves the server waiting or an orphan behind."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.jobs import DecodeFailure, DecodeJob
from streamer.errors import ConfigError, DecodeError, ModelError
from streamer.model.loading import LoadProgress, load_recognizer
from streamer.model.pool import WorkerPool
from streamer.model.process import ProcessRecognizer
from streamer.model.recognizer import RecognizerOptions
from streamer.model.worker import ModelWorker
from streamer.server.server import ServerOptions, StreamingServer
from streamer.testkit import speech as synth
from tests.fakes import Answers, FakeRecognizer

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

GUARD_S = 60.0


# loaders the child calls: module level, so that they pickle


def _load_fake(progress: LoadProgress) -> FakeRecognizer:
    with progress.stage_of("load", "building a fake"):
        logging.getLogger("tests.child").warning("hello from the model process")
        return FakeRecognizer()


def _load_slow_fake(delay_s: float, progress: LoadProgress) -> FakeRecognizer:
    return FakeRecognizer(delay_s=delay_s)


def _fail_model(progress: LoadProgress) -> FakeRecognizer:
    raise ModelError("no weights here: /nowhere/model.pt")


def _fail_config(progress: LoadProgress) -> FakeRecognizer:
    raise ConfigError("--device cuda:7 does not exist")


def _crash(progress: LoadProgress) -> FakeRecognizer:
    os._exit(9)


def job(pcm: np.ndarray, session: str = "s", kind: str = "partial") -> DecodeJob:
    return DecodeJob(session, 0, kind, pcm, 0, pcm.size, "auto", True)  # type: ignore[arg-type]


def tiny_options(tiny_model_dir: Path, cache_dir: Path) -> RecognizerOptions:
    return RecognizerOptions(
        model=str(tiny_model_dir), device="cpu", threads=1, cache_dir=cache_dir, warmup=False
    )


def test_the_child_decodes_what_the_model_decodes_in_process(tiny_model_dir, cache_dir) -> None:
    options = tiny_options(tiny_model_dir, cache_dir)
    progress = LoadProgress()
    remote = ProcessRecognizer(partial(load_recognizer, options), progress)
    try:
        local = load_recognizer(options)
        assert (remote.name, remote.device, remote.batch_exact) == (
            local.name,
            local.device,
            local.batch_exact,
        )
        assert progress.stage == "ready"
        assert remote.pid is not None and remote.pid != os.getpid()
        rng = np.random.default_rng(0)
        pcm = rng.normal(0, 3000, 48_000).astype(np.int16)
        growing = [job(pcm[:n]) for n in (8000, 20_000, 48_000)]
        for decode in growing:  # one segment's partials: the child's feature cache
            (got,) = remote.decode_jobs([decode])
            alone = local.decode(decode.pcm)
            assert got.token_ids == alone.token_ids and got.raw == alone.raw
            assert got.token_frames == alone.token_frames
        batch = remote.decode_batch(
            [pcm[:9000], pcm[9000:]], languages=["en", "zh"], use_itns=[1, 0]
        )
        assert [t.token_ids for t in batch] == [
            local.decode(pcm[:9000], language="en").token_ids,
            local.decode(pcm[9000:], language="zh", use_itn=False).token_ids,
        ]
        assert any(t.token_ids for t in batch)
        remote.forget_session("s")  # no answer expected; must not break the next decode
        assert remote.decode(pcm).token_ids == local.decode(pcm).token_ids
    finally:
        remote.close()
    assert remote.failure is not None
    assert not remote._process.is_alive() and remote._process.exitcode == 0


def test_the_childs_logs_and_stages_reach_the_server(caplog) -> None:
    caplog.set_level(logging.INFO)
    progress = LoadProgress()
    remote = ProcessRecognizer(_load_fake, progress)
    try:
        records = [r for r in caplog.records if r.name == "tests.child"]
        assert [r.getMessage() for r in records] == ["hello from the model process"]
        assert records[0].processName == "streamer-model"
        assert "building a fake: done in" in caplog.text  # the child's stage log
        assert remote.decode(np.zeros(1600, np.int16)).text == "audio 100 ms"
    finally:
        remote.close()


@pytest.mark.parametrize(
    ("loader", "error", "text"),
    [
        (_fail_model, ModelError, "no weights here"),
        (_fail_config, ConfigError, "cuda:7 does not exist"),
        (_crash, ModelError, "exited while loading (exit status 9)"),
    ],
)
def test_a_child_that_cannot_load_raises_the_error_it_met(loader, error, text) -> None:
    started = time.monotonic()
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        ProcessRecognizer(loader)
    assert time.monotonic() - started < GUARD_S


def test_a_child_that_dies_fails_the_worker_and_every_job_is_answered() -> None:
    failures: list[str] = []
    worker = ModelWorker(
        lambda: ProcessRecognizer(partial(_load_slow_fake, 5.0)), on_failure=failures.append
    )
    worker.start()
    try:
        assert worker.ready.wait(GUARD_S) and worker.load_error is None
        remote = worker.recognizer
        assert isinstance(remote, ProcessRecognizer) and remote.pid is not None
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), answers)
        worker.submit(job(np.zeros(1600, np.int16), session="t", kind="final"), answers)
        time.sleep(0.5)  # the first is being decoded in the child
        os.kill(remote.pid, signal.SIGKILL)
        results = answers.wait(2)
        assert results[0].failure is DecodeFailure.DECODE_FAILED  # the decode it was in
        assert results[1].failure is DecodeFailure.MODEL_STALLED  # the worker failed
        assert failures and "model process is gone" in failures[0]
        assert "signal 9" in failures[0]
        later = Answers()
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), later)
        assert later.wait(1)[0].failure is DecodeFailure.MODEL_STALLED
    finally:
        worker.stop()


def test_a_child_that_dies_while_idle_fails_the_worker_without_a_decode() -> None:
    """/readyz must not say ready for a worker whose model process is gone."""
    failed = threading.Event()
    worker = ModelWorker(lambda: ProcessRecognizer(_load_fake), on_failure=lambda _: failed.set())
    worker.start()
    try:
        assert worker.ready.wait(GUARD_S) and worker.load_error is None
        remote = worker.recognizer
        assert isinstance(remote, ProcessRecognizer) and remote.pid is not None
        os.kill(remote.pid, signal.SIGKILL)
        assert failed.wait(GUARD_S)  # within about IDLE_CHECK_S, no job needed
        assert worker.failure is not None and "signal 9" in worker.failure
    finally:
        worker.stop()


def test_stopping_a_worker_closes_its_child_cleanly() -> None:
    failures: list[str] = []
    worker = ModelWorker(lambda: ProcessRecognizer(_load_fake), on_failure=failures.append)
    worker.start()
    assert worker.ready.wait(GUARD_S)
    remote = worker.recognizer
    assert isinstance(remote, ProcessRecognizer)
    worker.stop()
    assert remote._process.exitcode == 0  # asked to stop, not killed
    assert failures == [] and worker.failure is None


def test_a_stalled_child_is_killed_by_the_watchdog() -> None:
    failures: list[str] = []
    worker = ModelWorker(
        lambda: ProcessRecognizer(partial(_load_slow_fake, 120.0)),
        decode_timeout_s=0.5,
        on_failure=failures.append,
    )
    worker.start()
    try:
        assert worker.ready.wait(GUARD_S)
        remote = worker.recognizer
        assert isinstance(remote, ProcessRecognizer)
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), answers)
        assert answers.wait(1)[0].failure is DecodeFailure.MODEL_STALLED
        assert failures and "longer than 0.5 s" in failures[0]
        remote._process.join(GUARD_S)
        assert not remote._process.is_alive()  # no orphan left decoding
        with pytest.raises(DecodeError, match="gone"):
            remote.decode(np.zeros(1600, np.int16))
    finally:
        worker.stop()


async def _finals(tiny_model_dir: Path, cache_dir: Path, clip: np.ndarray, in_process: bool):
    options = tiny_options(tiny_model_dir, cache_dir)

    def load():
        if in_process:
            return load_recognizer(options)
        return ProcessRecognizer(partial(load_recognizer, options))

    pool = WorkerPool.adopt(ModelWorker(load))
    pool.start()
    server = StreamingServer(ServerOptions(host="127.0.0.1", port=0), pool)
    await server.start()
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/asr"
        result = await transcribe(ClientOptions(url=url), clip, 16000)
    finally:
        await server.shutdown()
        await asyncio.to_thread(pool.stop)
    return [(f.start_ms, f.end_ms, f.text) for f in result.finals]


async def test_a_server_with_its_model_in_a_process_gives_the_same_finals(
    tiny_model_dir: Path, cache_dir: Path, speech_cache: Path
) -> None:
    sentence = synth.SENTENCES["en"][0]
    item = ("en", sentence, synth.speak(sentence, "en", cache_dir=speech_cache))
    clip = synth.join_with_silence([item, item], 1000)[0]
    here = await _finals(tiny_model_dir, cache_dir, clip, in_process=True)
    there = await _finals(tiny_model_dir, cache_dir, clip, in_process=False)
    assert len(here) >= 2
    assert there == here


PARENT = """
import sys, time, numpy as np
from functools import partial
from streamer.model.process import ProcessRecognizer
from tests.test_model_process import _load_slow_fake
import threading

if __name__ == "__main__":
    remote = ProcessRecognizer(partial(_load_slow_fake, 120.0))
    print(remote.pid, flush=True)
    # a decode that will not end: the child is inside it, not reading its pipe
    threading.Thread(target=remote.decode, args=(np.zeros(1600, np.int16),), daemon=True).start()
    time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_killed_outright_takes_its_model_process_with_it(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the decode has started
        os.kill(child, 0)  # alive
    finally:
        parent.kill()
        parent.wait(GUARD_S)
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its parent, gone, cannot reap it yet)


def _load_chatty(progress: LoadProgress) -> FakeRecognizer:
    logging.getLogger("tests.quiet").info("not wanted")
    logging.getLogger("tests.quiet").warning("wanted")
    return FakeRecognizer()


def test_the_servers_logger_levels_apply_to_the_childs_records(caplog) -> None:
    caplog.set_level(logging.INFO)
    logging.getLogger("tests.quiet").setLevel(logging.WARNING)
    try:
        remote = ProcessRecognizer(_load_chatty)
        remote.close()
    finally:
        logging.getLogger("tests.quiet").setLevel(logging.NOTSET)
    assert [r.getMessage() for r in caplog.records if r.name == "tests.quiet"] == ["wanted"]
