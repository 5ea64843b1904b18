"""The main port's HTTP exchange under hostile or careless clients (issue 32's cases): every
request gets its answer in its bound and its connection closed, no slot held for a client
that left; and the small things plain clients expect (405 with ``Allow``, ``/v1/models``).

Loopback servers with the fake model (tone bursts are utterances); raw sockets where a
client library would not send what is tested; the exchange's own failure paths are fed
bytes with no socket.
"""

from __future__ import annotations

import asyncio
import http
import http.client
import os
import socket
import time

import h11
import numpy as np
import orjson
import pytest

from streamer.server.chunked import ChunkSizeError, ChunkSizes
from streamer.server.http_exchange import HttpExchange, HttpLimits, header_value
from streamer.server.options import FileOptions
from tests.audio_files import write_audio
from tests.fakes import FakeRecognizer, FakeTransport, silence, tone
from tests.timing import eventually_sync, timeout_s

KEY = "sk-hostile"


def bursts(n: int) -> np.ndarray:
    parts = [silence(300)]
    for _ in range(n):
        parts += [tone(600), silence(700)]
    return np.concatenate(parts)


def exchange_raw(port: int, request: bytes, wait_s: float = 10) -> tuple[bytes, bool]:
    """Send ``request``, read until the server closes; the answer and whether it closed
    within ``wait_s`` (scaled)."""
    with socket.create_connection(("127.0.0.1", port), timeout_s(10)) as sock:
        sock.sendall(request)
        sock.settimeout(timeout_s(wait_s))
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except TimeoutError:
            return answer, False
        except ConnectionResetError:
            return answer, True
    return answer, True


def head_of(answer: bytes) -> tuple[int, dict[bytes, bytes]]:
    lines = answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


# -- header values, and failures to answer ---------------------------------------------


def test_header_values_are_sanitised() -> None:
    assert header_value("sample_rate must be a number, not '€'") == (
        b"sample_rate must be a number, not '?'"
    )
    assert header_value("redirect loop:\r\nLocation: x\x00") == b"redirect loop:  Location: x"
    assert header_value("plain") == b"plain"


@pytest.mark.parametrize("value", ["%E2%82%AC", "%0D%0Ax", "%C3%A9t%C3%A9"])
def test_an_error_message_that_echoes_the_request_is_answered_and_closed(
    make_fake_server, value
) -> None:
    server = make_fake_server()
    request = (
        f"POST /v1/listen?encoding=linear16&sample_rate={value} HTTP/1.1\r\nHost: x\r\n"
        "Content-Length: 4\r\n\r\nabcd"
    ).encode()
    answer, closed = exchange_raw(server.port, request)
    assert closed, "the connection was left open"
    status, headers = head_of(answer)
    assert status == 400
    assert b"\r" not in headers[b"dg-error"] and b"\n" not in headers[b"dg-error"]
    assert "err_msg" in orjson.loads(answer.split(b"\r\n\r\n", 1)[1])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_unanswerable_headers_leave_no_connection_open(make_fake_server) -> None:
    server = make_fake_server()  # in this process: its sockets are counted with ours
    request = (
        b"POST /v1/listen?encoding=linear16&sample_rate=%E2%82%AC HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    baseline = open_fds()
    clients = [
        socket.create_connection(("127.0.0.1", server.port), timeout_s(10)) for _ in range(200)
    ]
    try:
        for sock in clients:
            sock.sendall(request)  # and never read: the server answers and closes
        # our 200 sockets stay open (issue 32's count); each server side must have closed
        eventually_sync(
            lambda: open_fds() <= baseline + 200 + 2, what="the server's sockets closed"
        )
    finally:
        for sock in clients:
            sock.close()


async def test_a_handler_whose_answer_cannot_be_written_closes_the_connection() -> None:
    async def handler(exchange: HttpExchange) -> None:
        raise RuntimeError("a bug in a handler")

    exchange = HttpExchange(handler, HttpLimits())
    transport = FakeTransport()
    transport.protocol = exchange
    exchange.connection_made(transport)

    async def failing_respond(*args, **kwargs) -> None:
        raise ValueError("an answer that cannot be encoded")

    exchange.respond_json = failing_respond  # type: ignore[method-assign]
    exchange.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert exchange._task is not None
    await asyncio.wait_for(asyncio.shield(exchange._task), timeout_s(5))
    assert transport.closing and transport.aborted


async def test_a_handler_that_returns_without_answering_closes_the_connection() -> None:
    async def handler(exchange: HttpExchange) -> None:
        return None

    exchange = HttpExchange(handler, HttpLimits())
    transport = FakeTransport()
    transport.protocol = exchange
    exchange.connection_made(transport)
    exchange.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert exchange._task is not None
    await asyncio.wait_for(asyncio.shield(exchange._task), timeout_s(5))
    assert transport.closing


# -- the request's head ----------------------------------------------------------------


def test_the_head_is_due_from_the_connection_s_start(make_fake_server) -> None:
    server = make_fake_server(files=FileOptions(read_timeout_s=1.0))
    with socket.create_connection(("127.0.0.1", server.port), timeout_s(10)) as sock:
        started = time.monotonic()
        sock.sendall(b"POS")
        time.sleep(1.5)  # past the head's deadline: the rest must not start a new one
        try:
            sock.sendall(b"T /v1/listen HTTP/1.1\r\nHost: x\r\n")
            sock.settimeout(timeout_s(10))
            while sock.recv(100):
                pass
        except OSError:
            pass  # reset: closed already
        elapsed_s = time.monotonic() - started
    # closed by the head's deadline from the connection's start, not a second later
    assert elapsed_s < 1.5 + timeout_s(0.8)


def test_an_http_version_other_than_1_x_is_refused(make_fake_server) -> None:
    server = make_fake_server()
    answer, closed = exchange_raw(
        server.port, b"POST /v1/listen HTTP/9.9\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    )
    assert closed and head_of(answer)[0] == 505


# -- chunked bodies ----------------------------------------------------------------------


def test_chunk_sizes_are_read_beside_the_body() -> None:
    sizes = ChunkSizes(100)
    sizes.feed(b"5\r\nhello\r\n1")
    sizes.feed(b"0;ext=1\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n")
    with pytest.raises(ChunkSizeError) as refused:
        ChunkSizes(100).feed(b"5\r\nhello\r\n60\r\n")  # 5 + 96 > 100
    assert refused.value.status == http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    with pytest.raises(ChunkSizeError) as refused:
        ChunkSizes(100).feed(b"FFFFFFFFFFFFFFFFF")  # 17 digits: not a 64-bit size
    assert refused.value.status == http.HTTPStatus.BAD_REQUEST
    ChunkSizes(100).feed(b"000000000000000000000000005\r\nhello\r\n")  # leading zeros
    h11_accepts = h11.Connection(h11.SERVER)  # what the guard exists for: h11 waits
    h11_accepts.receive_data(
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\n"
    )
    assert isinstance(h11_accepts.next_event(), h11.Request)
    assert h11_accepts.next_event() is h11.NEED_DATA


def test_a_chunk_larger_than_any_body_is_refused_at_once(make_fake_server) -> None:
    server = make_fake_server()  # read timeout 30 s: the answer must not wait for it
    started = time.monotonic()
    answer, closed = exchange_raw(
        server.port,
        b"POST /v1/listen?encoding=linear16 HTTP/1.1\r\nHost: x\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFFFF\r\n",
    )
    assert head_of(answer)[0] == 400
    assert time.monotonic() - started < timeout_s(5)


def test_a_chunk_over_the_upload_limit_is_refused_at_once(make_fake_server) -> None:
    server = make_fake_server(files=FileOptions(max_upload_bytes=1 << 20))
    answer, _ = exchange_raw(
        server.port,
        b"POST /v1/listen?encoding=linear16 HTTP/1.1\r\nHost: x\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n40000000\r\n" + bytes(1000),
    )
    assert head_of(answer)[0] == 413


# -- a client that leaves ----------------------------------------------------------------


def test_an_upload_whose_client_closes_after_the_body_is_cancelled(make_fake_server) -> None:
    # 30 utterances at 0.4 s each: 12 s of decoding, which must stop with the client
    recognizer = FakeRecognizer(delay_s=0.4)
    server = make_fake_server(lambda: recognizer)
    body = bursts(30).tobytes()
    jobs = server.server.files.jobs
    with socket.create_connection(("127.0.0.1", server.port), timeout_s(10)) as sock:
        sock.sendall(
            b"POST /v1/listen?encoding=linear16&sample_rate=16000 HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        eventually_sync(lambda: recognizer.calls >= 1, what="decoding started")
        sock.shutdown(socket.SHUT_WR)  # the FIN a normal close sends
        eventually_sync(lambda: not jobs.active, timeout_s=5, what="the slot freed")
    calls = recognizer.calls
    time.sleep(1.0)  # the window in which no further decode may start (an absence: no state)
    assert recognizer.calls <= calls + 1  # at most the decode under way when cancelled
    assert calls < 30


# -- methods and paths -------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_get_on_an_upload_path_is_405_with_allow(make_fake_server, method, path) -> None:
    server = make_fake_server()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s(10))
    try:
        connection.request(method, path)
        response = connection.getresponse()
        response.read()
        assert response.status == 405
        assert response.getheader("Allow") == "POST, OPTIONS"
    finally:
        connection.close()


def test_models_with_the_openai_sdk(make_fake_server, tmp_path) -> None:
    import openai

    server = make_fake_server(token=KEY)
    base_url = f"http://127.0.0.1:{server.port}/v1"
    client = openai.OpenAI(api_key=KEY, base_url=base_url, max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake"]
    model = models.data[0]
    assert model.object == "model" and model.owned_by
    capabilities = model.model_extra["capabilities"]
    assert capabilities["transcription"] and not capabilities["translation"]
    assert "en" in capabilities["languages"]
    assert client.models.retrieve("fake").id == "fake"
    # what a front end does next, on the same client (its pool must not reuse a closed
    # connection: the plain answers say Connection: close)
    wav = write_audio(bursts(1), 16000, "wav", tmp_path / "a.wav")
    with wav.open("rb") as f:
        text = client.audio.transcriptions.create(file=f, model="fake", response_format="text")
    assert "audio" in text
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("whisper-1")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=base_url, max_retries=0).models.list()


def test_uploads_check_the_origin_as_every_route_does(make_fake_server) -> None:
    # admission.authorize: one check of token and origin for sessions, pages and files
    server = make_fake_server(token=KEY, allowed_origins=("https://ok.example",))

    def post(origin: str, key: str = KEY) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s(10))
        try:
            connection.request(
                "POST",
                "/v1/audio/transcriptions",
                body=b"",
                headers={"Authorization": f"Bearer {key}", "Origin": origin},
            )
            response = connection.getresponse()
            return response.status, orjson.loads(response.read())
        finally:
            connection.close()

    status, body = post("https://evil.example")
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    status, body = post("https://ok.example", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = post("https://ok.example")
    assert status == 400  # let in: an empty body is the next refusal
