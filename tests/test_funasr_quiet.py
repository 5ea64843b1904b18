"""quiet_funasr quiets the thread that loads funasr and nobody else."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import pytest

from streamer.model.backends.funasr_quiet import quiet_funasr

WAIT_S = 10.0


def run_quiet_while(other: Any) -> None:
    """Run ``other()`` on this thread while a worker thread is inside quiet_funasr and
    prints, logs on the root logger and calls basicConfig, as funasr does."""
    inside, done = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def quiet_thread() -> None:
        try:
            with quiet_funasr():
                print("funasr chatter on stdout")
                logging.basicConfig(level=logging.DEBUG)
                logging.getLogger().info("funasr chatter on the root logger")
                inside.set()
                assert done.wait(WAIT_S)
                print("more funasr chatter")
        except BaseException as exc:  # reported on the test's thread
            failures.append(exc)
            inside.set()

    thread = threading.Thread(target=quiet_thread, name="model-worker")
    thread.start()
    try:
        assert inside.wait(WAIT_S)
        other()
    finally:
        done.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and not failures, failures


def test_other_threads_output_is_not_lost(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    stdout_before = sys.stdout

    def event_loop_meanwhile() -> None:
        print("the event loop prints")
        logging.getLogger("streamer.server").info("a session opened")
        logging.getLogger().warning("a root warning from elsewhere")

    run_quiet_while(event_loop_meanwhile)
    assert sys.stdout is stdout_before  # put back
    out = capsys.readouterr().out
    assert "the event loop prints" in out
    assert "funasr chatter" not in out
    messages = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("streamer.server", logging.INFO, "a session opened") in messages
    assert ("root", logging.WARNING, "a root warning from elsewhere") in messages
    # funasr's own output is kept, one level down, on our logger
    assert ("root", logging.INFO, "funasr chatter on the root logger") not in messages
    quiet = [m for name, level, m in messages if name == "streamer.model.backends.funasr_quiet"]
    assert "funasr: funasr chatter on the root logger" in quiet
    assert "funasr printed: funasr chatter on stdout" in quiet
    assert "funasr printed: more funasr chatter" in quiet


def test_only_the_quiet_thread_loses_basic_config(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def basic_config(**kwargs: Any) -> None:
        calls.append(threading.current_thread().name)

    monkeypatch.setattr(logging, "basicConfig", basic_config)
    run_quiet_while(lambda: logging.basicConfig(level=logging.INFO))
    assert calls == [threading.current_thread().name]  # not the worker's call
    assert logging.basicConfig is basic_config  # put back


def test_nested_and_sequential_use_restore_stdout() -> None:
    before = sys.stdout
    with quiet_funasr():
        with quiet_funasr():
            print("inner")
        assert sys.stdout is not before  # still quiet in the outer block
    assert sys.stdout is before
    with quiet_funasr():
        pass
    assert sys.stdout is before
