"""A thread that samples something at a fixed interval while a bench step runs."""

from __future__ import annotations

import threading
from typing import Self


class Poller:
    """Calls :meth:`poll` every ``interval_s`` in a daemon thread, from ``with`` entry to
    exit (the first call one interval in). Subclasses keep what they see as attributes."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()
