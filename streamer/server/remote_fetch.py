"""Deepgram's ``{"url": ...}`` bodies, when the operator allows it (``--allow-url-fetch``).

Off by default: a server that fetches what a request names can be made to reach what
only it can reach (a server-side request forgery). When allowed, only ``http`` and
``https`` URLs are fetched, within the upload limit and a timeout, in a thread.
"""

from __future__ import annotations

import asyncio
import http
import logging
import urllib.error
import urllib.request
from typing import IO
from urllib.parse import urlsplit

from streamer.server.file_routes import ApiError, new_spool, too_large

logger = logging.getLogger(__name__)

READ_BYTES = 64 * 1024


def _fetch(url: str, limit_bytes: int, timeout_s: float) -> IO[bytes]:
    target = new_spool()
    size = 0
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "sensevoice-streamer"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            while data := response.read(READ_BYTES):
                size += len(data)
                if size > limit_bytes:
                    raise too_large(limit_bytes)
                target.write(data)
    except (urllib.error.URLError, OSError, ValueError) as error:
        target.close()
        reason = getattr(error, "reason", None) or type(error).__name__
        raise ApiError(
            http.HTTPStatus.BAD_REQUEST,
            "REMOTE_CONTENT_ERROR",
            f"the audio at the URL could not be fetched ({reason})"[:200],
        ) from None
    except BaseException:
        target.close()
        raise
    target.seek(0)
    return target


async def fetch_url(url: str, limit_bytes: int, timeout_s: float) -> IO[bytes]:
    """The body at ``url`` in a spool (raises :class:`ApiError`)."""
    if urlsplit(url).scheme not in ("http", "https"):
        raise ApiError(
            http.HTTPStatus.BAD_REQUEST,
            "REMOTE_CONTENT_ERROR",
            "only http and https URLs are fetched",
        )
    logger.info("fetching the audio of a request from %s", urlsplit(url).netloc[:100])
    return await asyncio.to_thread(_fetch, url, limit_bytes, timeout_s)
