"""One scaled clock for every timing bound in the tests.

A bound is how long a test waits before it calls something hung; on a slow or
loaded machine the same code takes longer, so every bound is multiplied by one
factor, read once from ``STREAMER_TESTS_TIMEOUT_FACTOR`` (default 1), as
python-websockets' tests do with ``WEBSOCKETS_TESTS_TIMEOUT_FACTOR``.  Scale
bounds (upper limits, ``wait_for`` timeouts) with :func:`timeout_s`; wait for a
state with :func:`eventually` instead of sleeping and hoping.  Sleeps that are
part of a scenario (pacing audio, waiting out an idle timeout the test sets)
are not bounds and stay as they are.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

TIMEOUT_FACTOR = float(os.environ.get("STREAMER_TESTS_TIMEOUT_FACTOR", "1"))
if not TIMEOUT_FACTOR > 0:
    raise ValueError(f"STREAMER_TESTS_TIMEOUT_FACTOR must be > 0, not {TIMEOUT_FACTOR}")

POLL_INTERVAL_S = (
    0.02  # how often eventually() re-checks; short, so a met condition ends the wait at once
)
DEFAULT_EVENTUALLY_S = (
    10.0  # unscaled; enough for a loopback round trip and a fake model on a loaded machine
)


def timeout_s(seconds: float) -> float:
    """Return ``seconds`` scaled by the suite's timeout factor (use it for every bound)."""
    return seconds * TIMEOUT_FACTOR


async def eventually(
    predicate: Callable[[], object], timeout_s: float = DEFAULT_EVENTUALLY_S, what: str = ""
) -> None:
    """Wait until ``predicate()`` is true, polling; fail after the scaled ``timeout_s``.

    ``timeout_s`` is unscaled (the factor is applied here); ``what`` names the
    awaited state in the failure. The predicate runs on the event loop, so it must
    be quick.
    """
    deadline = time.monotonic() + timeout_s * TIMEOUT_FACTOR
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(_not_reached(predicate, timeout_s, what))
        await asyncio.sleep(POLL_INTERVAL_S * TIMEOUT_FACTOR)


def eventually_sync(
    predicate: Callable[[], object], timeout_s: float = DEFAULT_EVENTUALLY_S, what: str = ""
) -> None:
    """The blocking twin of :func:`eventually`, for tests that run no event loop."""
    deadline = time.monotonic() + timeout_s * TIMEOUT_FACTOR
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(_not_reached(predicate, timeout_s, what))
        time.sleep(POLL_INTERVAL_S * TIMEOUT_FACTOR)


def _not_reached(predicate: Callable[[], object], timeout_s: float, what: str) -> str:
    code = getattr(predicate, "__code__", None)
    where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code else ""
    return (
        f"timed out after {timeout_s * TIMEOUT_FACTOR:g} s ({timeout_s:g} s x"
        f" STREAMER_TESTS_TIMEOUT_FACTOR={TIMEOUT_FACTOR:g}) waiting for {what or 'a condition'}"
        f"{where}"
    )
