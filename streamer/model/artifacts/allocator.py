"""glibc's malloc, told to give back what loading an ONNX graph frees (issue 23).

glibc serves a request of at least its *mmap threshold* (128 KiB at start) with a
mapping of its own, unmapped again on ``free``. But it raises the threshold to the size
of every such block freed (up to 32 MiB), so that a program freeing large blocks gets
later ones from its heaps: fewer system calls, at the price of memory that stays
resident once freed. ONNX Runtime loading a graph frees exactly such blocks (the
protobuf's weights, once made tensors): with the threshold raised, the server held
about 200 MiB more than it used, 588-635 MiB at its peak for the published model's size
instead of about 420 (bench/RESULTS.md, "The plain install"). Setting the threshold
turns the raising off (glibc's ``mallopt``: a threshold set by hand is kept), so the
blocks a session frees go back to the system.

Decoding does not pay for it: ONNX Runtime's arena keeps its own blocks, and what the
decode path allocates outside it per call (the features, the logits) costs page
faults that the same bench measured within the noise of a 7 s decode. The torch backend
is left alone: it allocates every operator's output through malloc, which is what the
raising is for, and that was not measured.

Where glibc is absent (musl, macOS, Windows) nothing is done.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept from now on


def pin_mmap_threshold(
    threshold_bytes: int = MMAP_THRESHOLD_BYTES, *, libc: Any | None = None
) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` for the rest of the process, so
    that large blocks freed later are returned to the system; whether it was set.

    Call it before the graph is loaded (it applies to allocations from then on).
    ``libc``: the C library to call (tests pass a stand-in); found in the process if None.
    """
    libc = _glibc() if libc is None else libc
    if libc is None:
        logger.debug("not glibc: the malloc thresholds are left as they are")
        return False
    try:
        done = int(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes)) == 1
    except (AttributeError, OSError, ctypes.ArgumentError) as error:
        logger.debug("mallopt(M_MMAP_THRESHOLD) failed: %s", error)
        return False
    if done:
        logger.debug("glibc's mmap threshold fixed at %d bytes", threshold_bytes)
    else:
        logger.debug("glibc refused mmap threshold %d", threshold_bytes)
    return done


def _glibc() -> Any | None:
    """The process's glibc (its symbols are the program's own), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version  # glibc's alone: musl has no such symbol
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (AttributeError, OSError):
        return None
    version.restype = ctypes.c_char_p
    return libc
