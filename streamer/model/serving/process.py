"""The model in a process of its own: features and decoding under another GIL.

In one process, everything that holds Python's GIL shares one core: the event loop
(WebSocket frames, VAD, the sessions' JSON: ~3 ms per stream-second) and, on the model
worker's thread, the filterbank (kaldi-native-fbank holds the GIL: ~2 ms per second of
audio, even computed once per sample), CTC decoding and the tokenizer. At a few hundred
streams on a GPU that is two cores of work for one GIL. ``serve --model-process`` moves
the recognizer into a child process: the worker thread, its queue discipline, batching
and watchdog stay in the server; each decode (a batch of jobs) goes to the child over a
pipe and its transcripts come back.

:class:`ProcessRecognizer` is that recognizer seen from the server: a
:class:`~streamer.model.serving.worker.SpeechRecognizer` with ``decode_jobs`` (so the child's
feature cache still knows each job's segment), ``forget_session``, and :attr:`failure`,
set when the child dies (the worker then starts another, or fails for good: see
:class:`~streamer.model.serving.worker.ModelWorker`'s restarts).
The child's log records are handled by the server's logging, and its loading stages
are shown by ``/readyz``. The child is started with ``spawn`` (forking a process that
holds threads and CUDA is unsafe) and ends when the server closes it, kills it (a
stalled decode), or goes away (its pipe closes; on Linux the kernel also kills it when
the server dies, even mid-decode).

Messages (tuples, pickled by :mod:`multiprocessing`): server to child ``("decode", id,
jobs)``, ``("forget", session_id)``, ``("stop",)``; child to server ``("stage", name)``,
``("log", record_dict)``, ``("ready", info)``, ``("load_error", kind, message)``,
``("result", id, transcripts, error)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import logging.handlers
import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from streamer.core.jobs import DecodeJob
from streamer.core.transcript import Transcript
from streamer.errors import ConfigError, DecodeError, ModelError, ModelProcessGone
from streamer.model.backends.loading import LoadProgress
from streamer.model.interface import RecognizerBase

logger = logging.getLogger(__name__)

# how often a wait for the child checks that it is still alive
POLL_S = 1.0
STOP_TIMEOUT_S = 5.0  # for the child to finish its decode and exit before it is killed
PR_SET_PDEATHSIG = 1  # prctl(2)

RecognizerLoader = Callable[[LoadProgress], Any]  # picklable; builds the child's recognizer


class ProcessRecognizer(RecognizerBase):
    """A recognizer running in a child process. Construct it in the model worker's
    thread (it blocks until the child has loaded the model, relaying its loading stages
    to ``progress``); raises the child's :class:`ModelError` or :class:`ConfigError`.

    ``load(progress)`` must be picklable (a module-level function, or a
    :func:`functools.partial` of one with picklable arguments): the child calls it.
    Decode from one thread at a time (the worker's); :meth:`forget_session`,
    :meth:`close` and :meth:`kill` from any thread.
    """

    # the worker may kill it and build another (a fresh process ends a stuck call and
    # frees its device): see ModelWorker's restarts
    restartable = True
    batches = True  # the child's decode_jobs takes the whole batch

    def __init__(self, load: RecognizerLoader, progress: LoadProgress | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        here, there = context.Pipe(duplex=True)
        self._conn = here
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._pending_lock = threading.Lock()
        self._next_id = 0
        self._closing = False
        self.failure: str | None = None  # why the child is gone (None: it is running)
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._info: dict[str, Any] = {}
        self._progress = progress
        level = logging.getLogger().getEffectiveLevel()
        self._process = context.Process(
            target=_child_main,
            args=(there, load, level),
            name="streamer-model",
            daemon=True,
        )
        self._process.start()
        there.close()
        self._reader = threading.Thread(target=self._read, name="model-process-reader", daemon=True)
        self._reader.start()
        while not self._loaded.wait(POLL_S):
            if not self._process.is_alive():  # its last words may still be in the pipe
                self._loaded.wait(POLL_S)
                break
        if self._load_error is not None:
            self.close()
            raise self._load_error
        if not self._info:
            self.kill()
            raise ModelError(f"the model process exited while loading ({self._exit()})")
        logger.info("model process %d ready", self._process.pid)

    # -- what the worker reads -------------------------------------------------

    @property
    def name(self) -> str:
        return str(self._info["name"])

    @property
    def device(self) -> str:
        return str(self._info["device"])

    @property
    def batch_exact(self) -> bool:
        return bool(self._info["batch_exact"])

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- decoding --------------------------------------------------------------

    def decode(
        self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True
    ) -> Transcript:
        return self.decode_batch([pcm], languages=[language], use_itns=[use_itn])[0]

    def decode_batch(
        self,
        pcms: Sequence[np.ndarray],
        *,
        languages: Sequence[str],
        use_itns: Sequence[bool],
    ) -> list[Transcript]:
        """Audio without a session (warm-up, offline): decoded as one-off finals."""
        jobs = [
            DecodeJob("", 0, "final", np.asarray(pcm), 0, len(pcm), language, itn)
            for pcm, language, itn in zip(pcms, languages, use_itns, strict=True)
        ]
        return self.decode_jobs(jobs)

    def decode_jobs(self, jobs: Sequence[DecodeJob]) -> list[Transcript]:
        """The child's :func:`~streamer.model.decode.decoding.decode_jobs` of ``jobs``. Raises
        DecodeError when it raised there, ModelProcessGone when the child is gone
        (:attr:`failure`)."""
        pending = _Pending()
        with self._pending_lock:
            if self.failure is not None:
                raise ModelProcessGone(self.failure)
            request, self._next_id = self._next_id, self._next_id + 1
            self._pending[request] = pending
        try:
            self._send(("decode", request, list(jobs)))
            while not pending.done.wait(POLL_S):
                if not self._process.is_alive():
                    self._gone(f"it exited ({self._exit()})")
        finally:
            with self._pending_lock:
                self._pending.pop(request, None)
        if pending.gone:
            raise ModelProcessGone(pending.error)
        if pending.error is not None:
            raise DecodeError(pending.error)
        assert pending.transcripts is not None
        return pending.transcripts

    def forget_session(self, session_id: str) -> None:
        """Drop what the child caches for ``session_id``."""
        if self.failure is None:
            with contextlib.suppress(OSError, ValueError):  # gone: nothing to forget
                self._send(("forget", session_id))

    # -- lifetime --------------------------------------------------------------

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to exit after its decode; kill it if it has not within
        ``timeout_s``."""
        self._closing = True
        with contextlib.suppress(OSError, ValueError):
            self._send(("stop",))
        self._reader.join(timeout_s)  # the reader joins the child once its pipe closes
        if self._reader.is_alive():
            self.kill()
        self._gone("it was closed")

    def kill(self) -> None:
        """End the child at once (a stalled decode cannot be interrupted otherwise)."""
        self._closing = True
        with contextlib.suppress(OSError):  # gone already
            self._process.kill()
        self._reader.join(STOP_TIMEOUT_S)
        self._gone(f"it was killed ({self._exit()})")

    # -- internals -------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """The reader thread: every message from the child, until its pipe closes."""
        try:
            while True:
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    break
                self._handle(message)
        except Exception:  # a message we cannot handle: the child is of no use
            logger.exception("reading from the model process failed")
            with contextlib.suppress(Exception):
                self._process.kill()
        finally:
            self._process.join(POLL_S)
            self._gone(f"it exited ({self._exit()})")

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "result":
            _, request, transcripts, error = message
            with self._pending_lock:
                pending = self._pending.get(request)
            if pending is not None:
                pending.transcripts, pending.error = transcripts, error
                pending.done.set()
        elif kind == "log":
            record = logging.makeLogRecord(message[1])
            target = logging.getLogger(record.name)
            if target.isEnabledFor(record.levelno):  # the server's levels, per logger
                target.handle(record)
        elif kind == "stage":
            if self._progress is not None:
                self._progress.show(message[1])
        elif kind == "ready":
            self._info = message[1]
            if self._progress is not None:
                self._progress.show("ready")
            self._loaded.set()
        elif kind == "load_error":
            _, error_kind, text = message
            self._load_error = ConfigError(text) if error_kind == "config" else ModelError(text)
            self._loaded.set()

    def _gone(self, why: str) -> None:
        """The child is gone: answer whatever waits for it, once."""
        with self._pending_lock:
            if self.failure is None and not self._closing:
                logger.error("the model process %s: %s", self._process.pid, why)
            if self.failure is None:
                self.failure = f"the model process is gone: {why}"
            waiting = list(self._pending.values())
        for pending in waiting:
            pending.error, pending.gone = self.failure, True
            pending.done.set()
        self._loaded.set()

    def _exit(self) -> str:
        code = self._process.exitcode
        if code is None:
            return "still running"
        return f"exit status {code}" if code >= 0 else f"signal {-code}"


class _Pending:
    """One decode waiting for the child's answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.transcripts: list[Transcript] | None = None
        self.error: str | None = None
        self.gone = False  # the error is that the child is gone


# --- the child ---------------------------------------------------------------------------


class _PipeQueue:
    """What :class:`logging.handlers.QueueHandler` puts records on: the pipe."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self._send = send

    def put_nowait(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError, ValueError):  # the server went: nobody to tell
            self._send(("log", record.__dict__))


class _RelayedProgress(LoadProgress):
    """The child's loading stages, also sent to the server (for ``/readyz``)."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__()
        self._send = send

    @contextlib.contextmanager
    def stage_of(self, name: str, what: str) -> Iterator[None]:
        self._send(("stage", name))
        with super().stage_of(name, what):
            yield


def _child_main(
    conn: multiprocessing.connection.Connection, load: RecognizerLoader, level: int
) -> None:
    """The child process: load, then decode what the server sends until it says stop
    or goes away."""
    die_with_parent()
    # Ctrl-C in a terminal, and systemd's stop (KillMode=control-group), signal the whole
    # group: the server shuts down gracefully and closes this process after the decodes
    # still owed to its sessions, so the signals are the server's to handle, not ours
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with lock:
            conn.send(message)

    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(_PipeQueue(send))]  # type: ignore[arg-type]
    root.setLevel(level)
    try:
        recognizer = load(_RelayedProgress(send))
    except ConfigError as error:
        send(("load_error", "config", str(error)))
        return
    except Exception as error:  # ModelError, or anything: the server reports it
        if not isinstance(error, ModelError):
            logging.getLogger(__name__).exception("loading the model failed")
        send(("load_error", "model", str(error)))
        return
    from streamer.model.decode.decoding import decode_jobs

    send(
        (
            "ready",
            {
                "name": recognizer.name,
                "device": str(recognizer.device or "cpu"),
                "batch_exact": bool(recognizer.batch_exact),
            },
        )
    )
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server has gone
            return
        kind = message[0]
        if kind == "stop":
            return
        if kind == "forget":
            recognizer.forget_session(message[1])
            continue
        _, request, jobs = message
        started = time.perf_counter()
        try:
            transcripts = decode_jobs(recognizer, jobs)
        except Exception as error:  # one bad decode: the server logs and reports it
            logging.getLogger(__name__).exception(
                "decoding %d job(s) failed after %.0f ms",
                len(jobs),
                (time.perf_counter() - started) * 1000,
            )
            reply: tuple[Any, ...] = ("result", request, None, f"{type(error).__name__}: {error}")
        else:
            reply = ("result", request, transcripts, None)
        try:
            send(reply)
        except (OSError, ValueError):
            return


def die_with_parent() -> None:
    """Linux: the kernel kills this process when the thread that started it ends (the
    server's worker thread, or the whole server killed with SIGKILL), even while a decode
    is stuck in a native call and cannot read the pipe's end."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        logger.debug("no PR_SET_PDEATHSIG: the model process ends when its pipe closes")
