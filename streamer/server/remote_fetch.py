"""Deepgram's ``{"url": ...}`` bodies, when the operator allows it (``--allow-url-fetch``).

Off by default: a server that fetches what a request names can be made to reach what
only it can reach (a server-side request forgery). When allowed:

* only ``http`` and ``https`` URLs are fetched, at every redirect too (at most
  :data:`MAX_REDIRECTS`), and a URL with control characters or spaces is refused;
* the host is resolved here and every address it has must be public: loopback,
  link-local, private, shared, multicast and reserved addresses are refused unless the
  operator allows them (``--allow-url-fetch-private``), and the connection goes to the
  address that was checked (a second resolution cannot point it elsewhere);
* the fetch runs on the event loop (h11 over an asyncio connection), so it is
  cancelled with its request (a client gone, a shutdown), each read within
  ``read_timeout_s``, the whole within ``deadline_s``, the body within the upload limit;
* what is told to the client says which rule refused the URL or that it could not be
  fetched, never what the network answered (a refused port, a timeout, another
  protocol's banner): that goes to the log.

Name resolution is the one blocking call: it runs in a daemon thread of its own (never
the default executor, which a shutdown waits for), and the fetch stops waiting for it
when cancelled or past the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO
from urllib.parse import urljoin, urlsplit

import h11

from streamer.server.file_routes import ApiError, new_spool, too_large

logger = logging.getLogger(__name__)

READ_BYTES = 64 * 1024
MAX_REDIRECTS = 5
MAX_URL_CHARS = 2048
REDIRECTS = frozenset({301, 302, 303, 307, 308})
USER_AGENT = "sensevoice-streamer"
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class FetchLimits:
    """One fetch's bounds."""

    max_bytes: int  # the upload limit (413 past it)
    read_timeout_s: float  # each read of the answer within this
    deadline_s: float  # the whole fetch, redirects included, within this
    allow_private: bool = False  # fetch loopback, link-local and private addresses too


class FetchRefused(Exception):
    """What the client is told (a fixed sentence); ``detail`` is for the log only."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


async def fetch_url(url: str, limits: FetchLimits) -> IO[bytes]:
    """The body at ``url`` in a spool (raises :class:`ApiError`: 400 for a URL refused
    or not fetched, 408 past the deadline, 413 past the upload limit)."""
    target = new_spool()
    try:
        async with asyncio.timeout(limits.deadline_s):
            await _follow(url, limits, target)
    except TimeoutError:
        target.close()
        logger.info("fetching a request's URL took over %g s: given up", limits.deadline_s)
        raise ApiError(
            http.HTTPStatus.REQUEST_TIMEOUT,
            "REMOTE_CONTENT_ERROR",
            f"the audio at the URL was not fetched within {limits.deadline_s:g} s",
        ) from None
    except FetchRefused as error:
        target.close()
        logger.info("a request's URL was not fetched: %s (%s)", error.message, error.detail)
        raise ApiError(http.HTTPStatus.BAD_REQUEST, "REMOTE_CONTENT_ERROR", error.message) from None
    except BaseException:
        target.close()
        raise
    target.seek(0)
    return target


async def _follow(url: str, limits: FetchLimits, target: IO[bytes]) -> None:
    for _ in range(MAX_REDIRECTS + 1):
        location = await _fetch_one(_checked_url(url), limits, target)
        if location is None:
            return
        url = urljoin(url, location)
    raise FetchRefused(f"the URL redirects more than {MAX_REDIRECTS} times")


@dataclass(frozen=True)
class _Url:
    scheme: str
    host: str
    port: int
    target: str  # path and query
    text: str


def _checked_url(url: str) -> _Url:
    """``url`` if it may be fetched: http(s), a host, printable ASCII without spaces."""
    if len(url) > MAX_URL_CHARS or not url.isascii() or not url.isprintable() or " " in url:
        raise FetchRefused("the URL is not valid (control characters, spaces or too long)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise FetchRefused("the URL is not valid") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise FetchRefused("only http and https URLs are fetched", parts.scheme[:20])
    if not parts.hostname:
        raise FetchRefused("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise FetchRefused("a URL with credentials is not fetched")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return _Url(parts.scheme, parts.hostname, port or DEFAULT_PORTS[parts.scheme], target, url)


def public_address(address: str) -> bool:
    """Whether ``address`` is on the public internet (not loopback, link-local, private,
    shared, multicast, reserved or unspecified; an IPv4-mapped IPv6 address as its IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def _fetch_one(url: _Url, limits: FetchLimits, target: IO[bytes]) -> str | None:
    """Fetch ``url`` into ``target``; its redirect's ``Location`` instead, if any."""
    addresses = await _resolve(url.host, url.port)
    if not limits.allow_private:
        refused = [a for a in addresses if not public_address(a)]
        if refused:
            raise FetchRefused(
                "the URL's host is a loopback, link-local or private address, which this "
                "server does not fetch (the operator can allow it with "
                "--allow-url-fetch-private)",
                f"{url.host} resolves to {', '.join(refused)}",
            )
    logger.info("fetching the audio of a request from %s", url.host[:100])
    reader, writer = await _connect(url, addresses)
    try:
        return await _exchange(url, limits, reader, writer, target)
    except (OSError, ssl.SSLError, h11.ProtocolError) as error:
        raise FetchRefused("the audio at the URL could not be fetched", repr(error)) from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)


async def _connect(
    url: _Url, addresses: list[str]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the first of ``addresses`` (all checked) that answers."""
    tls = ssl.create_default_context() if url.scheme == "https" else None
    failures = []
    for address in dict.fromkeys(addresses):  # in order, once each
        try:
            return await asyncio.open_connection(
                address, url.port, ssl=tls, server_hostname=url.host if tls else None
            )
        except (OSError, ssl.SSLError) as error:
            failures.append(f"{address}: {error!r}")
    raise FetchRefused("the audio at the URL could not be fetched", "; ".join(failures))


async def _exchange(
    url: _Url,
    limits: FetchLimits,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    target: IO[bytes],
) -> str | None:
    connection = h11.Connection(h11.CLIENT)
    name = f"[{url.host}]" if ":" in url.host else url.host  # an IPv6 literal in brackets
    host = name if url.port == DEFAULT_PORTS[url.scheme] else f"{name}:{url.port}"
    request = h11.Request(
        method="GET",
        target=url.target,
        headers=[
            ("Host", host),
            ("User-Agent", USER_AGENT),
            ("Accept", "audio/*, */*"),
            ("Connection", "close"),
        ],
    )
    writer.write(connection.send(request) + connection.send(h11.EndOfMessage()))
    await writer.drain()
    size = 0
    location: str | None = None
    target.seek(0)
    target.truncate()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            async with asyncio.timeout(limits.read_timeout_s):
                data = await reader.read(READ_BYTES)
            connection.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            if event.status_code in REDIRECTS:
                location = _header(event.headers, b"location")
                if location is None:
                    raise FetchRefused("the URL redirects without a location")
                return location
            if not 200 <= event.status_code < 300:
                raise FetchRefused(
                    f"the URL answered HTTP {event.status_code} instead of the audio"
                )
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > limits.max_bytes:
                raise too_large(limits.max_bytes)
            target.write(event.data)
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return location
        # h11.InformationalResponse: skipped


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _resolve(host: str, port: int) -> list[str]:
    """``host``'s addresses, resolved in a daemon thread of its own (see the module)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[list[str]] = loop.create_future()

    def settle(result: list[str] | BaseException) -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            result: list[str] | BaseException = [str(info[4][0]) for info in infos]
        except (OSError, UnicodeError) as error:
            result = FetchRefused("the audio at the URL could not be fetched", repr(error))
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=run, name="url-fetch-resolve", daemon=True).start()
    addresses = await future
    if not addresses:
        raise FetchRefused("the audio at the URL could not be fetched", "no address")
    return addresses
