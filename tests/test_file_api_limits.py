"""The file APIs' limits and lifecycle with a fake model (tone bursts are utterances):
file slots, live sessions ahead of files, shutdown, TLS, a slow or vanishing uploader."""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
import threading

import numpy as np
import orjson
import pytest

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.protocol import StreamOptions
from streamer.server.options import FileOptions
from tests.audio_files import write_audio
from tests.fakes import FakeRecognizer, HangingRecognizer, silence, tone
from tests.support import self_signed_cert
from tests.timing import eventually_sync, timeout_s


def bursts(n: int) -> np.ndarray:
    parts = [silence(300)]
    for _ in range(n):
        parts += [tone(600), silence(700)]
    return np.concatenate(parts)


def post_raw(port: int, pcm: np.ndarray, **kwargs) -> tuple[int, dict[str, str], dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s(60), **kwargs)
    try:
        connection.request(
            "POST",
            "/v1/listen?encoding=linear16&sample_rate=16000&utterances=true",
            body=pcm.tobytes(),
            headers={"Content-Type": "audio/l16"},
        )
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), orjson.loads(response.read())
    finally:
        connection.close()


def utterance_count(body: dict) -> int:
    return len(body["results"]["utterances"])


def test_file_slots_are_bounded_and_the_excess_refused_with_retry_after(make_fake_server):
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.4), files=FileOptions(max_jobs=1))
    results: list[tuple[int, dict, dict]] = []
    first = threading.Thread(target=lambda: results.append(post_raw(server.port, bursts(4))))
    first.start()
    eventually_sync(lambda: len(server.server.files.jobs.active) == 1)
    status, headers, body = post_raw(server.port, bursts(1))
    assert status == 429 and int(headers["Retry-After"]) > 0
    assert body["err_code"] == "TOO_MANY_REQUESTS"
    first.join(timeout_s(60))
    assert results[0][0] == 200 and utterance_count(results[0][2]) == 4
    status, _, body = post_raw(server.port, bursts(1))  # the slot is free again
    assert status == 200 and utterance_count(body) == 1


def test_a_live_final_is_not_held_behind_a_file(make_fake_server):
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.5))
    upload: list[tuple[int, dict, dict]] = []
    done = threading.Event()

    def send_file() -> None:
        upload.append(post_raw(server.port, bursts(12)))
        done.set()

    threading.Thread(target=send_file, daemon=True).start()
    eventually_sync(lambda: server.worker.stats().queued_background >= 2)
    options = ClientOptions(url=server.url, stream=StreamOptions(partials=False))
    live = asyncio.run(transcribe(options, bursts(1), 16000, speed=4.0))
    assert len(live.finals) == 1
    # the file's twelve decodes take 6 s: the live final came while it was still going
    assert not done.is_set()
    assert done.wait(timeout_s(60)) and upload[0][0] == 200
    assert utterance_count(upload[0][2]) == 12


def test_shutdown_refuses_an_unfinished_file_with_503(make_fake_server):
    server = make_fake_server(
        lambda: FakeRecognizer(delay_s=1.0), drain_s=0.2, shutdown_grace_s=1.0
    )
    results: list[tuple[int, dict, dict]] = []
    sender = threading.Thread(target=lambda: results.append(post_raw(server.port, bursts(10))))
    sender.start()
    eventually_sync(lambda: len(server.server.files.jobs.active) == 1)
    server.shutdown()
    sender.join(timeout_s(30))
    status, headers, body = results[0]
    assert status == 503 and "Retry-After" in headers
    assert body["err_code"] == "SHUTTING_DOWN"


def test_a_model_failure_refuses_an_unfinished_file_with_503(make_fake_server):
    # the file's job is one of the admission's open things, which the failure walks
    instance = HangingRecognizer()
    server = make_fake_server(lambda: instance, decode_timeout_s=0.5)
    try:
        status, headers, body = post_raw(server.port, bursts(3))
        assert status == 503 and "Retry-After" in headers
        assert body["err_code"] == "MODEL_STALLED"
        eventually_sync(lambda: not server.server.admission.open, what="nothing left open")
    finally:
        instance.release.set()


def test_uploads_on_uvloop(make_fake_server):
    # `streamer serve` runs uvloop, whose transports are not asyncio's classes
    server = make_fake_server(uvloop=True)
    status, _, body = post_raw(server.port, bursts(2))
    assert status == 200 and utterance_count(body) == 2


@pytest.mark.parametrize("uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_uploads_over_tls(make_fake_server, tmp_path, uvloop):
    certfile, keyfile = self_signed_cert(tmp_path)
    server = make_fake_server(certfile=certfile, keyfile=keyfile, uvloop=uvloop)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    connection = http.client.HTTPSConnection(
        "localhost", server.port, timeout=timeout_s(30), context=context
    )
    try:
        connection.request(
            "POST",
            "/v1/listen?encoding=linear16&sample_rate=16000&utterances=true",
            body=bursts(2).tobytes(),
        )
        response = connection.getresponse()
        assert response.status == 200
        assert utterance_count(orjson.loads(response.read())) == 2
    finally:
        connection.close()


def test_an_uploader_that_stops_sending_is_timed_out(make_fake_server):
    server = make_fake_server(files=FileOptions(read_timeout_s=0.5))
    with socket.create_connection(("127.0.0.1", server.port), timeout_s(10)) as sock:
        sock.sendall(
            b"POST /v1/listen?encoding=linear16 HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 100000\r\n\r\n" + bytes(1000)
        )
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408")
    eventually_sync(lambda: not server.server.files.jobs.active)


def test_an_oversized_declared_body_is_refused_before_it_is_sent(make_fake_server):
    server = make_fake_server(files=FileOptions(max_upload_bytes=1000))
    with socket.create_connection(("127.0.0.1", server.port), timeout_s(10)) as sock:
        sock.sendall(
            b"POST /v1/listen HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: 999999999\r\n\r\n"
        )
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"100 Continue" not in answer


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_other_methods_on_the_file_paths(make_fake_server, method):
    server = make_fake_server()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s(10))
    try:
        connection.request(method, "/v1/audio/transcriptions", body=b"x")
        response = connection.getresponse()
        assert response.status == 405 and "POST" in response.getheader("Allow")
    finally:
        connection.close()


def _post_file(port: int, path: str, body: bytes, content_type: str) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s(60))
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, orjson.loads(response.read())
    finally:
        connection.close()


def test_multichannel_is_refused_for_a_stereo_file_and_mixed_without_it(make_fake_server, tmp_path):
    server = make_fake_server()
    stereo = np.stack([bursts(2), bursts(2)])
    data = write_audio(stereo, 16000, "wav", tmp_path / "stereo.wav").read_bytes()
    status, body = _post_file(server.port, "/v1/listen?multichannel=true", data, "audio/wav")
    assert status == 400 and "multichannel" in body["err_msg"]
    status, body = _post_file(server.port, "/v1/listen?utterances=true", data, "audio/wav")
    assert status == 200 and utterance_count(body) == 2


def test_a_file_over_the_duration_limit_is_refused_before_a_stream_starts(
    make_fake_server, tmp_path
):
    server = make_fake_server(files=FileOptions(max_duration_s=2.0))
    data = write_audio(bursts(3), 16000, "flac", tmp_path / "long.flac").read_bytes()
    boundary = "x-boundary"
    form = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.flac"\r\n'
            "Content-Type: audio/flac\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    status, body = _post_file(
        server.port,
        "/v1/audio/transcriptions",
        form,
        f"multipart/form-data; boundary={boundary}",
    )
    assert status == 400 and body["error"]["code"] == "invalid_file"
    assert "at most 2 s" in body["error"]["message"]


def test_a_chunked_upload_is_read_to_its_end(make_fake_server):
    server = make_fake_server()
    pcm = bursts(2).tobytes()
    pieces = [pcm[i : i + 7000] for i in range(0, len(pcm), 7000)]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s(30))
    try:
        connection.request(
            "POST",
            "/v1/listen?encoding=linear16&sample_rate=16000&utterances=true",
            body=iter(pieces),
            headers={"Transfer-Encoding": "chunked"},
            encode_chunked=True,
        )
        response = connection.getresponse()
        assert response.status == 200
        assert utterance_count(orjson.loads(response.read())) == 2
    finally:
        connection.close()
