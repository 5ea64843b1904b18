"""Picks the event loop: uvloop when installed (not on Windows), else asyncio's own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            logger.debug("uvloop not installed; using the asyncio event loop")
        else:
            return uvloop.run(main)
    return asyncio.run(main)
