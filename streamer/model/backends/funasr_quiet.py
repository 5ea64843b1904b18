"""funasr without its side effects: it configures logging and prints while it loads.

:func:`import_funasr` is the one place funasr is imported for the first time;
:func:`quiet_funasr` wraps every call into it that may log or print.

funasr runs on the model worker's thread while the event loop keeps logging and a
caller's other threads keep printing, so the quieting is per thread: only the threads
inside :func:`quiet_funasr` lose their ``logging.basicConfig`` calls, have their root-logger
chatter demoted and their stdout collected (to DEBUG lines on our logger). Every other
thread's output goes where it went before. While any thread is quiet, ``sys.stdout`` and
``logging.basicConfig`` are thread-aware proxies over the originals; the last thread out
puts the originals back (unless somebody replaced them meanwhile, whose choice stands).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO, cast

logger = logging.getLogger(__name__)

__all__ = ["import_funasr", "quiet_funasr"]


def import_funasr() -> Any:
    """``import funasr`` without letting it configure logging (it calls basicConfig)."""
    with quiet_funasr():
        import funasr

    return funasr


@contextlib.contextmanager
def quiet_funasr() -> Iterator[None]:
    """Keep funasr from configuring logging or printing, in this thread, while inside.

    AutoModel calls ``logging.basicConfig`` (and root-logger helpers that call it when
    the root has no handler), logs chatter on the root logger and prints to stdout.
    Only our CLI configures logging. Re-entrant; safe from several threads at once.
    """
    buffer = _QUIET.enter()
    try:
        yield
    finally:
        _QUIET.exit()
        for line in buffer.getvalue().splitlines():
            if line.strip():
                logger.debug("funasr printed: %s", line)


class _ThreadStdout:
    """``sys.stdout`` while some thread is quiet: that thread's writes are collected.

    Everything but ``write`` and ``flush`` (encoding, isatty, fileno, ...) is the target's.
    """

    def __init__(self, quiet: _Quiet, target: TextIO) -> None:
        self._quiet = quiet
        self.target = target  # the stdout it replaced; other threads write there

    def write(self, text: str) -> int:
        buffer = self._quiet.buffer()
        if buffer is None:
            return self.target.write(text)
        return buffer.write(text)

    def flush(self) -> None:
        if self._quiet.buffer() is None:
            self.target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


class _Quiet:
    """Which threads are quiet, and the proxies installed while any is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[int, tuple[io.StringIO, int]] = {}  # thread -> (buffer, depth)
        self._stdout: _ThreadStdout | None = None
        self._basic_config: Callable[..., None] | None = None  # the original
        self._filter = _QuietThreadFilter(self)

    def buffer(self) -> io.StringIO | None:
        entry = self._buffers.get(threading.get_ident())
        return None if entry is None else entry[0]

    def enter(self) -> io.StringIO:
        ident = threading.get_ident()
        with self._lock:
            buffer, depth = self._buffers.get(ident, (io.StringIO(), 0))
            self._buffers[ident] = (buffer, depth + 1)
            if self._stdout is None:
                self._install()
        return buffer

    def exit(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            buffer, depth = self._buffers[ident]
            if depth > 1:
                self._buffers[ident] = (buffer, depth - 1)
                return
            del self._buffers[ident]
            if not self._buffers:
                self._uninstall()

    def _install(self) -> None:
        self._stdout = _ThreadStdout(self, sys.stdout)
        sys.stdout = cast(TextIO, self._stdout)
        original = logging.basicConfig
        self._basic_config = original

        def basic_config(*args: Any, **kwargs: Any) -> None:
            if self.buffer() is None:  # not a quiet thread: the real thing
                original(*args, **kwargs)

        logging.basicConfig = basic_config
        logging.getLogger().addFilter(self._filter)

    def _uninstall(self) -> None:
        assert self._stdout is not None and self._basic_config is not None
        if sys.stdout is self._stdout:
            sys.stdout = self._stdout.target
        logging.basicConfig = self._basic_config
        logging.getLogger().removeFilter(self._filter)
        self._stdout = None
        self._basic_config = None


class _QuietThreadFilter(logging.Filter):
    """Demotes what quiet threads log straight on the root logger to DEBUG on ours.

    (A logger's filters see only records logged on it, not those propagated from named
    loggers: our own log lines pass untouched.)
    """

    def __init__(self, quiet: _Quiet) -> None:
        super().__init__()
        self._quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or self._quiet.buffer() is None:
            return True
        logger.debug("funasr: %s", record.getMessage())
        return False


_QUIET = _Quiet()  # process-wide by nature: sys.stdout and logging are
