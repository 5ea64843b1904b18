"""The model in a child process (serve --model-process): same transcripts, and a child
that fails to load, dies or stalls never leaves the server waiting or an orphan behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from streamer.client.connection import ClientOptions, Received
from streamer.client.streaming import transcribe
from streamer.core.jobs import DecodeFailure, DecodeJob
from streamer.core.protocol import Final
from streamer.errors import ConfigError, DecodeError, ModelError
from streamer.model.backends.loading import LoadProgress, load_recognizer
from streamer.model.options import RecognizerOptions
from streamer.model.serving import supervision
from streamer.model.serving.pool import WorkerPool, WorkerSlot
from streamer.model.serving.process import ProcessRecognizer
from streamer.model.serving.worker import ModelWorker, WorkerOptions
from streamer.server.server import ServerOptions, StreamingServer
from streamer.testkit import speech as synth
from tests.fakes import Answers, FakeRecognizer, load_slow_fake
from tests.support import http_get
from tests.timing import eventually_sync, timeout_s

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

GUARD_S = 60.0


# loaders the child calls: module level, so that they pickle


def _load_fake(progress: LoadProgress) -> FakeRecognizer:
    with progress.stage_of("load", "building a fake"):
        logging.getLogger("tests.child").warning("hello from the model process")
        return FakeRecognizer()


def _fail_model(progress: LoadProgress) -> FakeRecognizer:
    raise ModelError("no weights here: /nowhere/model.pt")


def _fail_config(progress: LoadProgress) -> FakeRecognizer:
    raise ConfigError("--device cuda:7 does not exist")


def _crash(progress: LoadProgress) -> FakeRecognizer:
    os._exit(9)


POISON_SAMPLES = 4321  # a final of this length breaks the model processes below


class _Poisoned(FakeRecognizer):
    """Dies (``crash``) or hangs (otherwise) on audio of POISON_SAMPLES samples."""

    def __init__(self, crash: bool) -> None:
        super().__init__()
        self.crash = crash

    def decode(self, pcm, *, language="auto", use_itn=True):
        if pcm.size == POISON_SAMPLES:
            if self.crash:
                os._exit(7)
            time.sleep(120)
        return super().decode(pcm, language=language, use_itn=use_itn)


def _load_poisoned(crash: bool, progress: LoadProgress) -> FakeRecognizer:
    return _Poisoned(crash)


def _load_slowly(delay_s: float, progress: LoadProgress) -> FakeRecognizer:
    with progress.stage_of("load", "loading slowly"):
        time.sleep(delay_s)
    return FakeRecognizer()


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
    assert time.monotonic() - started < timeout_s(GUARD_S)


NO_RESTARTS = WorkerOptions(max_restarts=0)


def test_a_child_that_dies_fails_the_worker_and_every_job_is_answered() -> None:
    failures: list[str] = []
    worker = ModelWorker(
        lambda: ProcessRecognizer(partial(load_slow_fake, 5.0)),
        options=NO_RESTARTS,
        on_failure=failures.append,
    )
    worker.start()
    try:
        assert worker.ready.wait(timeout_s(GUARD_S)) and worker.load_error is None
        remote = worker.recognizer
        assert isinstance(remote, ProcessRecognizer) and remote.pid is not None
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), answers)
        worker.submit(job(np.zeros(1600, np.int16), session="t", kind="final"), answers)
        eventually_sync(lambda: worker.stats().busy, what="the first job decoding in the child")
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
    worker = ModelWorker(
        lambda: ProcessRecognizer(_load_fake),
        options=NO_RESTARTS,
        on_failure=lambda _: failed.set(),
    )
    worker.start()
    try:
        assert worker.ready.wait(timeout_s(GUARD_S)) and worker.load_error is None
        remote = worker.recognizer
        assert isinstance(remote, ProcessRecognizer) and remote.pid is not None
        os.kill(remote.pid, signal.SIGKILL)
        assert failed.wait(timeout_s(GUARD_S))  # within about IDLE_CHECK_S, no job needed
        assert worker.failure is not None and "signal 9" in worker.failure
    finally:
        worker.stop()


def test_stopping_a_worker_closes_its_child_cleanly() -> None:
    failures: list[str] = []
    worker = ModelWorker(lambda: ProcessRecognizer(_load_fake), on_failure=failures.append)
    worker.start()
    assert worker.ready.wait(timeout_s(GUARD_S))
    remote = worker.recognizer
    assert isinstance(remote, ProcessRecognizer)
    worker.stop()
    assert remote._process.exitcode == 0  # asked to stop, not killed
    assert failures == [] and worker.failure is None


def test_a_stalled_child_is_killed_by_the_watchdog() -> None:
    failures: list[str] = []
    worker = ModelWorker(
        lambda: ProcessRecognizer(partial(load_slow_fake, 120.0)),
        options=WorkerOptions(decode_timeout_s=0.5, max_restarts=0),
        on_failure=failures.append,
    )
    worker.start()
    try:
        assert worker.ready.wait(timeout_s(GUARD_S))
        remote = worker.recognizer
        assert isinstance(remote, ProcessRecognizer)
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), answers)
        assert answers.wait(1)[0].failure is DecodeFailure.MODEL_STALLED
        assert failures and "longer than 0.5 s" in failures[0]
        remote._process.join(timeout_s(GUARD_S))
        assert not remote._process.is_alive()  # no orphan left decoding
        with pytest.raises(DecodeError, match="gone"):
            remote.decode(np.zeros(1600, np.int16))
    finally:
        worker.stop()


def _restarting_worker(loader, **options) -> tuple[ModelWorker, list[str]]:
    failures: list[str] = []
    worker = ModelWorker(
        lambda: ProcessRecognizer(loader),
        options=WorkerOptions(**options),
        on_failure=failures.append,
    )
    worker.start()
    assert worker.ready.wait(timeout_s(GUARD_S)) and worker.load_error is None
    return worker, failures


def _pid(worker: ModelWorker) -> int:
    remote = worker.recognizer
    assert isinstance(remote, ProcessRecognizer) and remote.pid is not None
    return remote.pid


def test_the_child_leaves_ctrl_c_and_sigterm_to_the_server() -> None:
    """A terminal's Ctrl-C (and systemd's stop) signals the whole process group: the
    child must go on decoding what the shutting-down server still owes its sessions."""
    remote = ProcessRecognizer(partial(load_slow_fake, 1.0))
    try:
        assert remote.pid is not None
        decoding = threading.Thread(target=lambda: results.append(remote.decode(pcm)))
        results: list = []
        pcm = np.zeros(1600, np.int16)
        decoding.start()
        time.sleep(0.3)
        os.kill(remote.pid, signal.SIGINT)
        os.kill(remote.pid, signal.SIGTERM)
        decoding.join(timeout_s(GUARD_S))
        assert [t.text for t in results] == ["audio 100 ms"] and remote.failure is None
    finally:
        remote.close()
    assert remote._process.exitcode == 0


def test_a_child_that_dies_while_idle_is_started_again() -> None:
    worker, failures = _restarting_worker(_load_fake)
    try:
        first = _pid(worker)
        os.kill(first, signal.SIGKILL)
        eventually_sync(lambda: worker.restarts == 1, GUARD_S, "the model process to start again")
        assert _pid(worker) != first and worker.restarting is None
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), answers)
        assert answers.wait(1)[0].transcript.text == "audio 100 ms"
        assert failures == [] and worker.failure is None
    finally:
        worker.stop()


def test_the_final_a_child_died_on_is_decoded_again_and_queued_jobs_wait() -> None:
    worker, failures = _restarting_worker(partial(load_slow_fake, 1.0))
    try:
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(1600, np.int16), session="a", kind="final"), answers)
        worker.submit(job(np.zeros(3200, np.int16), session="b", kind="final"), answers)
        worker.submit(job(np.zeros(4800, np.int16), session="c"), answers)  # a partial
        eventually_sync(lambda: worker.stats().busy, what="a's final decoding")
        os.kill(_pid(worker), signal.SIGKILL)
        results = answers.wait(3)
        assert [(r.job.session_id, r.transcript.text) for r in results] == [
            ("a", "audio 100 ms"),  # decoded again by the new process
            ("b", "audio 200 ms"),
            ("c", "audio 300 ms"),
        ]
        assert worker.restarts == 1 and failures == []
    finally:
        worker.stop()


@pytest.mark.parametrize("crash", [True, False], ids=["dies", "stalls"])
def test_a_final_that_breaks_the_model_twice_fails_alone_and_the_rest_is_decoded(
    crash: bool,
) -> None:
    worker, failures = _restarting_worker(partial(_load_poisoned, crash), decode_timeout_s=1.0)
    try:
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(POISON_SAMPLES, np.int16), session="p", kind="final"), answers)
        worker.submit(job(np.zeros(1600, np.int16), session="q", kind="final"), answers)
        worker.submit(job(np.zeros(3200, np.int16), session="r", kind="final"), answers)
        results = {r.job.session_id: r for r in answers.wait(3)}
        assert results["p"].failure is DecodeFailure.DECODE_FAILED
        assert "failed twice" in results["p"].detail
        assert results["q"].transcript.text == "audio 100 ms"
        assert results["r"].transcript.text == "audio 200 ms"
        assert worker.restarts == 2 and failures == [] and worker.failure is None
    finally:
        worker.stop()


def test_past_its_restart_budget_the_worker_fails_for_good() -> None:
    worker, failures = _restarting_worker(_load_fake, max_restarts=1)
    try:
        os.kill(_pid(worker), signal.SIGKILL)
        eventually_sync(lambda: worker.restarts == 1, GUARD_S, "the model process to start again")
        os.kill(_pid(worker), signal.SIGKILL)
        eventually_sync(lambda: worker.failure is not None, GUARD_S, "the worker to fail")
        assert len(failures) == 1 and "signal 9" in failures[0] and worker.restarts == 1
        later = Answers()
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), later)
        assert later.wait(1)[0].failure is DecodeFailure.MODEL_STALLED
    finally:
        worker.stop()


def _load_then_hang(marker: str, progress: LoadProgress) -> FakeRecognizer:
    """Loads the first time; every later load (a restart) hangs."""
    if os.path.exists(marker):
        time.sleep(20)
    Path(marker).touch()
    return FakeRecognizer()


def test_a_restart_that_hangs_fails_the_worker(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(supervision, "RESTART_TIMEOUT_S", 1.0)
    loader = partial(_load_then_hang, str(tmp_path / "loaded"))
    worker, failures = _restarting_worker(loader, decode_timeout_s=5.0)
    try:
        os.kill(_pid(worker), signal.SIGKILL)
        eventually_sync(lambda: worker.restarting is not None, GUARD_S, "a restart to begin")
        answers = Answers(guard_s=GUARD_S)
        worker.submit(job(np.zeros(1600, np.int16), kind="final"), answers)  # waits
        eventually_sync(
            lambda: worker.failure is not None, GUARD_S, "the hanging restart to be given up"
        )
        assert failures == ["starting the model again took over 1 s"]
        assert answers.wait(1)[0].failure is DecodeFailure.MODEL_STALLED
        assert worker.restarting is None and worker.restarts == 0
    finally:
        worker.stop()


@contextlib.asynccontextmanager
async def _serving(load) -> AsyncIterator[tuple[StreamingServer, WorkerPool]]:
    """A ready loopback server whose one worker's recognizer ``load`` builds."""
    pool = WorkerPool.adopt(ModelWorker(load))
    pool.start()
    server = StreamingServer(ServerOptions(host="127.0.0.1", port=0), pool)
    await server.start()
    try:
        await server.wait_ready()
        yield server, pool
    finally:
        await server.shutdown()
        await asyncio.to_thread(pool.stop)


async def test_a_server_is_unready_while_its_model_process_starts_again() -> None:
    async with _serving(lambda: ProcessRecognizer(partial(_load_slowly, 1.5))) as (server, pool):
        base = f"http://127.0.0.1:{server.port}"
        os.kill(_pid(pool.workers[0]), signal.SIGKILL)
        seen = []
        deadline = time.monotonic() + timeout_s(GUARD_S)
        while time.monotonic() < deadline and (not seen or seen[-1][0] != 200):
            await asyncio.sleep(0.1)
            reply = await asyncio.to_thread(http_get, f"{base}/readyz")
            body = reply.json()
            seen.append((reply.status, body["status"]))
        # unready from the first look after the kill until the new process is up
        assert seen[0] == (503, "restarting") and seen[-1] == (200, "ready"), seen
        assert {answer for answer in seen[:-1]} == {(503, "restarting")}, seen
        assert body["workers"][0]["restarts"] == 1
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"{base}/metrics", timeout=timeout_s(10)).read().decode()
        )
        assert 'streamer_worker_restarts_total{device="cpu",worker="0"} 1.0' in metrics
        assert server.failure is None


def test_a_pool_sends_new_sessions_past_a_worker_that_restarts() -> None:
    def build(slot, hooks):
        return ModelWorker(
            lambda: ProcessRecognizer(partial(_load_slowly, 2.0)),
            on_decoded=hooks.on_decoded,
            on_failure=hooks.on_failure,
        )

    pool = WorkerPool(build, [WorkerSlot(0, "cpu", 1), WorkerSlot(1, "cpu", 1)])
    pool.start()
    try:
        assert pool.ready.wait(timeout_s(GUARD_S)) and pool.load_error is None
        answers = Answers(guard_s=GUARD_S)
        pool.submit(job(np.zeros(1600, np.int16), session="old", kind="final"), answers)
        assert answers.wait(1)[0].transcript is not None
        old = pool.worker_of("old")
        assert old is not None
        os.kill(_pid(pool.workers[old.index]), signal.SIGKILL)
        eventually_sync(
            lambda: pool.loads()[old.index].restarting is not None, GUARD_S, "a restart to begin"
        )
        assert pool.restarting is None  # the other worker takes new sessions
        pool.submit(job(np.zeros(3200, np.int16), session="new", kind="final"), answers)
        pool.submit(job(np.zeros(4800, np.int16), session="old", kind="final"), answers)
        new = pool.worker_of("new")
        assert new is not None and new.index != old.index
        results = {r.job.session_id + str(r.job.pcm.size): r for r in answers.wait(3)}
        assert results["new3200"].transcript.text == "audio 200 ms"
        assert results["old4800"].transcript.text == "audio 300 ms"  # waited for its worker
        assert pool.loads()[old.index].restarts == 1 and pool.failure is None
    finally:
        pool.stop()


async def _finals(
    tiny_model_dir: Path,
    cache_dir: Path,
    clip: np.ndarray,
    in_process: bool,
    kill_at_first_final: bool = False,
):
    options = tiny_options(tiny_model_dir, cache_dir)

    def load():
        if in_process:
            return load_recognizer(options)
        return ProcessRecognizer(partial(load_recognizer, options))

    async with _serving(load) as (server, pool):
        url = f"ws://127.0.0.1:{server.port}/v1/asr"
        killed: list[int] = []

        def on_message(received: Received) -> None:
            if kill_at_first_final and isinstance(received.message, Final) and not killed:
                killed.append(_pid(pool.workers[0]))  # the next segment is still to come
                os.kill(killed[0], signal.SIGKILL)

        # paced when killing: unpaced, every segment could be decoded before the first
        # final reaches the client, and the kill would then hit an idle model
        speed = 2.0 if kill_at_first_final else None
        result = await transcribe(
            ClientOptions(url=url), clip, 16000, speed=speed, on_message=on_message
        )
        assert pool.workers[0].restarts == len(killed) and server.failure is None
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
    # the model process killed mid-stream: started again, and no final is lost or changed
    restarted = await _finals(
        tiny_model_dir, cache_dir, clip, in_process=False, kill_at_first_final=True
    )
    assert restarted == here


PARENT = """
import sys, time, numpy as np
from functools import partial
from streamer.model.serving.process import ProcessRecognizer
from tests.fakes import load_slow_fake
import threading

if __name__ == "__main__":
    remote = ProcessRecognizer(partial(load_slow_fake, 120.0))
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
        parent.wait(timeout_s(GUARD_S))
    eventually_sync(lambda: not _alive(child), GUARD_S, "the model process to be gone")


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
