"""Hostile URLs for ``--allow-url-fetch`` (issue 32): redirects to other schemes and
loops, loopback and private addresses, other protocols, CR/LF, bodies that never end,
a client that leaves and a SIGTERM during slow fetches. The fetch source is a local
HTTP server on 127.0.0.1, port 0: loopback, so the tests that fetch from it opt in with
``allow_url_fetch_private``, and one shows the refusal without it."""

from __future__ import annotations

import http.client
import http.server
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import orjson
import pytest

from streamer.server import remote_fetch
from streamer.server.options import FileOptions
from streamer.server.remote_fetch import public_address
from tests.fakes import silence, tone
from tests.hostile import wav_header
from tests.timing import eventually_sync, timeout_s

FETCH = FileOptions(allow_url_fetch=True, allow_url_fetch_private=True)


def audio() -> bytes:
    samples = np.concatenate([silence(300), tone(600), silence(700), tone(600), silence(700)])
    data = samples.astype("<i2").tobytes()
    return wav_header(sample_rate=16000, bits=16, channels=1, data_bytes=len(data)) + data


class Source(http.server.ThreadingHTTPServer):
    """The remote server: ``/audio.wav``, ``/slow`` (a body that never ends),
    ``/to?url=...`` (a redirect), ``/loop`` (a redirect to itself)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.slow_open = 0  # /slow answers being sent now
        self.slow_served = 0
        self.lock = threading.Lock()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Source

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/audio.wav":
            body = audio()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path.startswith("/to?url="):
            self.send_response(302)
            self.send_header("Location", self.path[len("/to?url=") :])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/slow":
            self._slow()
        else:
            self.send_error(404)

    def _slow(self) -> None:
        with self.server.lock:
            self.server.slow_open += 1
            self.server.slow_served += 1
        try:
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            for _ in range(600):
                self.wfile.write(b"R" * 16)
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass  # the fetcher left
        finally:
            with self.server.lock:
                self.server.slow_open -= 1


@pytest.fixture
def source() -> Iterator[Source]:
    server = Source()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class Listener:
    """A TCP service that is not HTTP: it sends ``banner``, records what it is sent."""

    def __init__(self, banner: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.banner = banner
        self.received = b""
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(1)
                conn.sendall(self.banner)
                try:
                    self.received += conn.recv(4096)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def fetch(port: int, url: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s(60))
    try:
        connection.request(
            "POST",
            "/v1/listen?utterances=true",
            body=orjson.dumps({"url": url}),
            headers={"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        connection.close()


def test_a_url_is_fetched_and_transcribed(make_fake_server, source, no_tracebacks):
    server = make_fake_server(files=FETCH)
    status, body = fetch(server.port, source.url("/audio.wav"))
    assert status == 200, body
    assert len(body["results"]["utterances"]) == 2


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.1.2.3", "192.168.0.1", "0.0.0.0"],
)
def test_loopback_link_local_and_private_hosts_are_refused(
    make_fake_server, source, host, no_tracebacks
):
    server = make_fake_server(files=FileOptions(allow_url_fetch=True))
    status, body = fetch(server.port, f"http://{host}:{source.server_address[1]}/audio.wav")
    assert status == 400 and body["err_code"] == "REMOTE_CONTENT_ERROR"
    assert "--allow-url-fetch-private" in body["err_msg"]
    assert host.strip("[]") not in body["err_msg"]  # nothing of what it resolved to


def test_public_addresses():
    assert not public_address("::ffff:127.0.0.1") and not public_address("100.64.0.1")
    assert not public_address("fe80::1%eth0") and not public_address("224.0.0.1")
    assert public_address("93.184.215.14") and public_address("2606:2800:21f:cb07::1")


def test_a_redirect_to_a_private_address_is_refused(
    make_fake_server, source, monkeypatch, no_tracebacks
):
    # the source (127.0.0.1) taken as public, so that its redirect is what is refused
    monkeypatch.setattr(remote_fetch, "public_address", lambda address: address == "127.0.0.1")
    server = make_fake_server(files=FileOptions(allow_url_fetch=True))
    assert fetch(server.port, source.url("/audio.wav"))[0] == 200
    private = f"http://127.0.0.2:{source.server_address[1]}/audio.wav"
    status, body = fetch(server.port, source.url(f"/to?url={private}"))
    assert status == 400 and "--allow-url-fetch-private" in body["err_msg"]


def test_a_redirect_to_another_scheme_is_refused(make_fake_server, source, no_tracebacks):
    ftp = Listener(b"220 FTP ready\r\n")
    try:
        server = make_fake_server(files=FETCH)
        status, body = fetch(server.port, source.url(f"/to?url=ftp://127.0.0.1:{ftp.port}/a"))
        assert status == 400 and "only http and https" in body["err_msg"]
        assert ftp.connections == 0 and ftp.received == b""
        status, body = fetch(server.port, source.url("/to?url=file:///etc/passwd"))
        assert status == 400 and "only http and https" in body["err_msg"]
    finally:
        ftp.close()


def test_a_redirect_loop_is_answered(make_fake_server, source, no_tracebacks):
    server = make_fake_server(files=FETCH)
    status, body = fetch(server.port, source.url("/loop"))
    assert status == 400 and "redirects more than" in body["err_msg"]


def test_what_the_network_answers_is_not_told(make_fake_server, source, no_tracebacks):
    """A closed port, another protocol and an HTTP server are told apart by nothing
    but the HTTP server's status."""
    ssh = Listener(b"SSH-2.0-OpenSSH_9.6\r\n")
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        server = make_fake_server(files=FETCH)
        answers = [
            fetch(server.port, f"http://127.0.0.1:{ssh.port}/"),
            fetch(server.port, f"http://127.0.0.1:{closed_port}/"),
            fetch(server.port, "http://no-such-host.invalid/a.wav"),
        ]
        assert {status for status, _ in answers} == {400}
        assert len({body["err_msg"] for _, body in answers}) == 1, answers
        assert "SSH" not in answers[0][1]["err_msg"]
        status, body = fetch(server.port, source.url("/missing"))
        assert status == 400 and "HTTP 404" in body["err_msg"]
    finally:
        ssh.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/a\r\nX-Injected: 1",
        "http://127.0.0.1/a b",
        "http://user:pass@127.0.0.1/a",
        "http://127.0.0.1:99999/a",
        "http:///a",
        "gopher://127.0.0.1/",
    ],
)
def test_malformed_urls_are_a_400(make_fake_server, url, no_tracebacks):
    server = make_fake_server(files=FETCH)
    status, body = fetch(server.port, url)
    assert status == 400 and body["err_code"] == "REMOTE_CONTENT_ERROR", body


def test_a_fetch_past_its_deadline_is_a_408(make_fake_server, source, no_tracebacks):
    server = make_fake_server(files=FileOptions(**vars_of(FETCH), upload_deadline_s=1.5))
    started = time.monotonic()
    status, body = fetch(server.port, source.url("/slow"))
    assert status == 408 and "within 1.5 s" in body["err_msg"]
    assert time.monotonic() - started < timeout_s(5)
    eventually_sync(lambda: source.slow_open == 0, what="the remote connection closed")


def test_a_client_that_leaves_cancels_its_fetch(make_fake_server, source, no_tracebacks):
    server = make_fake_server(files=FETCH)
    body = orjson.dumps({"url": source.url("/slow")})
    with socket.create_connection(("127.0.0.1", server.port), timeout_s(10)) as sock:
        sock.sendall(
            b"POST /v1/listen HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        eventually_sync(lambda: source.slow_open == 1, what="the fetch started")
        # a reset: a FIN is noticed once the HTTP front reads it as the client gone
        # (issue 32, item 5, the front's side)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    eventually_sync(lambda: source.slow_open == 0, what="the fetch cancelled")
    assert server.server.files.receiving.total == 0


def test_sigterm_during_slow_fetches_exits_within_drain_and_grace(
    make_fake_server, source, no_tracebacks
):
    server = make_fake_server(files=FETCH, lifecycle=True, drain_s=1.0, shutdown_grace_s=1.0)
    clients = [
        threading.Thread(target=fetch, args=(server.port, source.url("/slow")), daemon=True)
        for _ in range(3)
    ]
    for client in clients:
        client.start()
    eventually_sync(lambda: source.slow_open == 3, what="three slow fetches")
    started = time.monotonic()
    server.request_stop()
    assert server.join(timeout=timeout_s(10))
    assert time.monotonic() - started < timeout_s(1.0 + 1.0 + 3.0)
    eventually_sync(lambda: source.slow_open == 0, what="the remote connections closed")


def vars_of(options: FileOptions) -> dict[str, object]:
    return {f: getattr(options, f) for f in ("allow_url_fetch", "allow_url_fetch_private")}
