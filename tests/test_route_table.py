"""The main port's one table of (method, path): every path answers each method from it,
405 with the table's ``Allow`` for a method the path does not take, whichever parser
(the WebSocket's for GET and HEAD, h11's for the rest) read the request."""

from __future__ import annotations

import http.client

import pytest

from streamer.errors import HttpError
from streamer.server.route_table import BodyRoute, PageRoute, RouteTable, UpgradeRoute
from tests.timing import timeout_s

METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


def answer(port: int, method: str, path: str) -> tuple[int, str | None]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s(20))
    try:
        body = None if method in ("GET", "HEAD", "OPTIONS") else b""
        connection.request(method, path, body=body)
        response = connection.getresponse()
        response.read()
        return response.status, response.getheader("Allow")
    finally:
        connection.close()


def page(request, url):
    return None


async def body(exchange) -> None:
    pass


def test_the_table_lists_every_endpoint() -> None:
    table = RouteTable(fallback=page)
    for path in ("/healthz", "/readyz", "/metrics", "/v1/models", "/"):
        table.page(path, page)
    table.page("/v1/models/", page, prefix=True)
    for path in ("/v1/asr", "/v1/listen"):
        table.upgrade(path, page)
    for path in ("/v1/listen", "/v1/audio/transcriptions"):
        table.body(("POST", "OPTIONS"), path, body)
    assert table.allowed("/v1/listen") == ("GET", "POST", "OPTIONS")  # live and prerecorded
    assert table.allowed("/v1/asr") == ("GET",)
    assert table.allowed("/v1/audio/transcriptions") == ("POST", "OPTIONS")
    assert table.allowed("/healthz") == ("GET", "HEAD")
    assert table.allowed("/app.js") == ("GET", "HEAD") and not table.is_known("/app.js")
    assert table.is_known("/v1/models/any-id")
    # a CORS preflight is answered where the table lists OPTIONS, with its upload methods
    assert table.preflight_methods("/v1/listen") == ("POST", "OPTIONS")
    assert table.preflight_methods("/v1/audio/transcriptions") == ("POST", "OPTIONS")
    assert table.preflight_methods("/v1/asr") == table.preflight_methods("/healthz") == ()
    # one route per (method, path), found by one lookup
    assert isinstance(table.find("GET", "/v1/listen"), UpgradeRoute)
    assert isinstance(table.find("POST", "/v1/listen"), BodyRoute)
    assert isinstance(table.find("HEAD", "/v1/models/any-id"), PageRoute)
    assert table.find("GET", "/app.js") == PageRoute(page)  # the fallback
    with pytest.raises(ValueError, match="routed twice"):
        table.page("/healthz", page)


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("HEAD", "/v1/asr", 405, "GET"),
        ("GET", "/v1/audio/transcriptions", 405, "POST, OPTIONS"),
        ("POST", "/v1/models/x", 405, "GET, HEAD"),
        ("POST", "/app.js", 404, None),
        ("PUT", "/nothing", 404, None),
    ],
)
def test_a_method_or_path_not_routed_is_a_refusal(method, path, status, allow) -> None:
    table = RouteTable(fallback=page)
    table.page("/v1/models/", page, prefix=True)
    table.upgrade("/v1/asr", page)
    table.body(("POST", "OPTIONS"), "/v1/audio/transcriptions", body)
    with pytest.raises(HttpError) as refused:
        table.find(method, path)
    assert refused.value.status == status
    assert refused.value.headers.get("Allow") == allow


def test_every_method_on_every_path_answers_from_the_table(make_fake_server) -> None:
    server = make_fake_server()
    table = server.server.routes.table
    paths = {*table.paths, "/v1/models/fake"}
    assert {"/v1/asr", "/v1/listen", "/v1/realtime", "/v1/audio/transcriptions"} <= paths
    assert {"/healthz", "/readyz", "/metrics", "/v1/models", "/"} <= paths
    wrong: list[str] = []
    for path in sorted(paths):
        allowed = table.allowed(path)
        for method in METHODS:
            status, allow = answer(server.port, method, path)
            if method in allowed:
                if status in (404, 405):
                    wrong.append(f"{method} {path}: {status}, which the table serves")
            elif status != 405 or allow != ", ".join(allowed):
                wrong.append(f"{method} {path}: {status} Allow {allow!r}, not 405 {allowed}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_an_unknown_path_is_404_for_any_method(make_fake_server, method) -> None:
    server = make_fake_server()
    assert answer(server.port, method, "/v1/nothing-here")[0] == 404
    assert answer(server.port, "GET", "/v1/nothing-here")[0] == 404


def test_the_funasr_port_answers_from_its_table(make_fake_server) -> None:
    """FunASR's port: its one WebSocket endpoint takes GET (a plain GET: 426, no upgrade),
    every other method is 405 with the table's ``Allow``; a GET on another path is 404."""
    server = make_fake_server(funasr_port=0)
    listener = server.server.listeners["funasr"]
    port = listener.port
    assert listener.table.paths == {"/": ("GET",)}
    wrong: list[str] = []
    for method in METHODS:
        status, allow = answer(port, method, "/")
        expected = (426, None) if method == "GET" else (405, "GET")
        if (status, allow) != expected:
            wrong.append(f"{method} /: {status} Allow {allow!r}, not {expected}")
        # the method is checked first, as it always was: GET elsewhere is a 404
        status, _ = answer(port, method, "/healthz")
        if status != (404 if method == "GET" else 405):
            wrong.append(f"{method} /healthz: {status}")
    assert not wrong, "\n".join(wrong)
