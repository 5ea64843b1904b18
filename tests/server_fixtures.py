"""Real servers on loopback (port 0) for the tests, each in a thread with its own loop.

A thread (rather than the test's own loop) lets synchronous tests, subprocess clients
and the browser talk to the same server as async tests do.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path

import orjson
import pytest
from websockets.exceptions import ConnectionClosed

from bench.common import LoopbackUrls
from streamer.core.capacity import CapacityOptions
from streamer.model.serving.worker import ModelWorker, SpeechRecognizer
from streamer.server.server import ConnectionLimits, ServerOptions, StreamingServer
from tests.fakes import FakeRecognizer, loudness_classifier
from tests.timing import timeout_s as scaled

LIMIT_FIELDS = frozenset(f.name for f in fields(ConnectionLimits))


def server_options(**options) -> ServerOptions:
    """``ServerOptions`` from flat keywords: a :class:`ConnectionLimits` field's name
    (``idle_timeout_s=1``) goes into ``limits``."""
    limits = {name: options.pop(name) for name in list(options) if name in LIMIT_FIELDS}
    return ServerOptions(**options, limits=ConnectionLimits(**limits))


class ServerThread(LoopbackUrls):
    """A :class:`StreamingServer` with its model worker, running in a background thread.

    With ``lifecycle`` it runs the process's whole life as the CLI does,
    :meth:`StreamingServer.run` (without signal handlers: :meth:`request_stop` is what a
    signal does), and :attr:`exit_status` is what it returned. Without, it calls
    ``start()`` and, at :meth:`shutdown`, ``shutdown()`` itself, and stays up after a load
    error or a model failure so that tests can look at it.
    """

    def __init__(
        self,
        load: Callable[[], SpeechRecognizer],
        options: ServerOptions,
        classifier_factory: Callable | None = None,
        lifecycle: bool = False,
        *,
        uvloop: bool = False,
        speakers=None,
        **worker_options,
    ) -> None:
        """``speakers``: a SpeakerWorker (diarize), started and stopped with the model's."""
        if options.capacity == CapacityOptions():
            # the suite's servers share two cores with their own clients, whose load would
            # make them refuse sessions: only a test that passes CapacityOptions (of its
            # own) gets capacity-aware admission (tests/test_capacity.py)
            options = replace(options, capacity=CapacityOptions(enabled=False))
        if options.web_root is None:
            # this checkout's page: the package's streamer.web_demo may resolve to another
            # checkout's folder (the editable install's), as it does in a worktree
            options = replace(options, web_root=Path(__file__).resolve().parent.parent / "web_demo")
        self.options = replace(options, host="127.0.0.1", port=0)
        self.classifier_factory = classifier_factory
        self.worker = ModelWorker(load, **worker_options)
        self.speakers = speakers
        self.server: StreamingServer | None = None
        # uvloop: the loop `streamer serve` runs (its transports are not asyncio's classes)
        self.loop = _uvloop_loop() if uvloop else asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.lifecycle = lifecycle
        self.exit_status: int | None = None  # what run() returned (lifecycle only)
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def start(self, wait_ready: bool = True) -> ServerThread:
        self._thread.start()
        self._started.wait(scaled(60))
        if self._error is not None:
            raise self._error
        if wait_ready:
            self.call(self.server.wait_ready(), timeout=600)  # call() scales it
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        if self.lifecycle:
            await self._run_lifecycle()
            return
        try:
            self.worker.start()
            if self.speakers is not None:
                self.speakers.start()
            self.server = StreamingServer(
                self.options, self.worker, classifier_factory=self.classifier_factory
            )
            self.server.worker.speakers = self.speakers  # the pool the server made
            await self.server.start()
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        await self._stop.wait()
        await self.server.shutdown()
        await asyncio.to_thread(self.worker.stop)
        if self.speakers is not None:
            await asyncio.to_thread(self.speakers.stop)

    async def _run_lifecycle(self) -> None:
        server = self.server = StreamingServer(
            self.options, self.worker, classifier_factory=self.classifier_factory
        )
        serving = asyncio.ensure_future(server.run(signals=False))
        listening = asyncio.ensure_future(server.listening.wait())
        await asyncio.wait({serving, listening}, return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if serving.done() and serving.exception() is not None:
            self._error = serving.exception()
        self._started.set()
        try:
            self.exit_status = await serving
        except BaseException as exc:  # the model's loading error: start() raised it already
            self._error = exc

    def request_stop(self, *, now: bool = False) -> None:
        """What SIGTERM (``now``: SIGINT) does to a ``lifecycle`` server, from any thread."""
        assert self.lifecycle and self.server is not None
        server = self.server
        with contextlib.suppress(RuntimeError):  # the loop is closed: run() has returned
            self.loop.call_soon_threadsafe(lambda: server.request_stop(now=now))

    def join(self, timeout: float = 30) -> bool:
        """Wait for the thread to end (``timeout`` unscaled); whether it did."""
        self._thread.join(scaled(timeout))
        return not self._thread.is_alive()

    def call(self, coro, timeout: float = 30):
        """Run ``coro`` on the server's loop and return its result (``timeout`` unscaled)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(scaled(timeout))

    def shutdown(self, timeout: float = 30) -> None:
        """The graceful shutdown without a drain (what SIGINT does; SIGTERM drains first),
        then wait for the thread (timeout unscaled)."""
        if not self._thread.is_alive() or self._stop is None:
            return
        if self.lifecycle:
            self.request_stop(now=True)
        else:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(scaled(timeout))

    @property
    def port(self) -> int:  # type: ignore[override]  # LoopbackUrls's, read from the server
        return self.server.port


@pytest.fixture
def make_server() -> Iterator[Callable[..., ServerThread]]:
    """Factory: ``make_server(load, **server_options)`` started and ready."""
    started: list[ServerThread] = []

    def factory(
        load: Callable[[], SpeechRecognizer],
        wait_ready: bool = True,
        classifier_factory: Callable | None = None,
        decode_timeout_s: float = 30.0,
        lifecycle: bool = False,
        uvloop: bool = False,
        **options,
    ) -> ServerThread:
        thread = ServerThread(
            load,
            server_options(**options),
            classifier_factory,
            lifecycle=lifecycle,
            uvloop=uvloop,
            decode_timeout_s=decode_timeout_s,
        )
        started.append(thread)
        return thread.start(wait_ready=wait_ready)

    yield factory
    for thread in started:
        thread.shutdown()


@pytest.fixture
def make_fake_server(make_server):
    """Servers whose VAD is a loudness threshold, so tone bursts are exact utterances."""

    def factory(load=FakeRecognizer, **options):
        return make_server(load, classifier_factory=loudness_classifier, **options)

    return factory


@pytest.fixture
def make_ports_server(make_fake_server):
    """``make_fake_server``'s servers with the FunASR and Wyoming ports on as well."""

    def factory(load=lambda: FakeRecognizer(delay_s=0.01), **options):
        return make_fake_server(load, **({"funasr_port": 0, "wyoming_port": 0} | options))

    return factory


async def messages_until_close(ws, timeout_s: float = 20) -> tuple[list[dict], int | None]:
    """Every JSON message until the server closes, and its close code (None: no close frame).

    ``timeout_s`` (unscaled: the suite's factor applies) bounds the wait for each message."""
    messages = []
    try:
        while True:
            messages.append(orjson.loads(await asyncio.wait_for(ws.recv(), scaled(timeout_s))))
    except ConnectionClosed as closed:
        return messages, closed.rcvd.code if closed.rcvd else None


def recognizer_loader(model_dir: Path) -> Callable[[], SpeechRecognizer]:
    """Loads the real recognizer (funasr) from a model directory."""

    def load() -> SpeechRecognizer:
        from streamer.model.backends.torch_backend import Recognizer
        from streamer.model.options import RecognizerOptions

        return Recognizer(RecognizerOptions(model=str(model_dir), device="cpu", threads=2))

    return load


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    """A server with the random tiny model and the real webrtcvad, shared by a session."""
    thread = ServerThread(recognizer_loader(tiny_model_dir), ServerOptions()).start()
    yield thread
    thread.shutdown()


@pytest.fixture(scope="session")
def tagged_server(tagged_model_dir: Path) -> Iterator[ServerThread]:
    """A server with the tiny model trained to emit known tagged text for two clips."""
    thread = ServerThread(recognizer_loader(tagged_model_dir), ServerOptions()).start()
    yield thread
    thread.shutdown()


@pytest.fixture(scope="session")
def server_url(tiny_server: ServerThread) -> str:
    return tiny_server.url


@pytest.fixture(scope="session")
def tagged_server_url(tagged_server: ServerThread) -> str:
    return tagged_server.url


@pytest.fixture(scope="session")
def http_base_url(tagged_server: ServerThread) -> str:
    return tagged_server.http_url


def _uvloop_loop() -> asyncio.AbstractEventLoop:
    import uvloop

    return uvloop.new_event_loop()
