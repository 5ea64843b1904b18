"""Hostile clients on the upload surface (issue 32): bodies that drip, files whose
headers lie, forms built to break the parser, clients that reset mid-transcription.
Each gets a clear 4xx in its API's shape (or is cut), never a traceback, and never
keeps an honest upload out."""

from __future__ import annotations

import asyncio
import http.client
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from streamer.server import uploads
from streamer.server.options import FileOptions
from tests.fakes import FakeRecognizer, silence, tone
from tests.hostile import wav_header
from tests.timing import eventually_sync, timeout_s

OPENAI = "/v1/audio/transcriptions"
DEEPGRAM = "/v1/listen?utterances=true"
BOUNDARY = "hostile-boundary"


def bursts(n: int) -> np.ndarray:
    parts = [silence(300)]
    for _ in range(n):
        parts += [tone(600), silence(700)]
    return np.concatenate(parts)


def wav_of(samples: np.ndarray) -> bytes:
    data = samples.astype("<i2").tobytes()
    return wav_header(sample_rate=16000, bits=16, channels=1, data_bytes=len(data)) + data


def form(*parts: tuple[str, bytes], filename: str | None = "a.wav") -> bytes:
    """A multipart body: ``(name, value)`` parts, the ``file`` part with ``filename``."""
    body = b""
    for name, value in parts:
        disposition = f'form-data; name="{name}"'
        if name == "file" and filename is not None:
            disposition += f'; filename="{filename}"'
        body += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        body += value + b"\r\n"
    return body + f"--{BOUNDARY}--\r\n".encode()


def post(
    port: int, path: str, body: bytes, content_type: str, source: str = "127.0.0.1"
) -> tuple[int, dict[str, str], dict]:
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=timeout_s(60), source_address=(source, 0)
    )
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), orjson.loads(response.read())
    finally:
        connection.close()


def post_openai(port: int, body: bytes, **kwargs) -> tuple[int, dict[str, str], dict]:
    return post(port, OPENAI, body, f"multipart/form-data; boundary={BOUNDARY}", **kwargs)


def post_both(port: int, audio: bytes) -> list[tuple[int, dict]]:
    """``audio`` to each API: [(status, body)] for OpenAI then Deepgram."""
    status, _, body = post_openai(port, form(("file", audio)))
    answers = [(status, body)]
    status, _, body = post(port, DEEPGRAM, audio, "audio/wav")
    return answers + [(status, body)]


def message(body: dict) -> str:
    """The error's text in either API's shape."""
    return body["error"]["message"] if "error" in body else body["err_msg"]


class Dripper:
    """A connection that declares a body and sends it a byte every ``interval_s``."""

    def __init__(self, port: int, path: str, interval_s: float, declared: int = 1 << 20):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout_s(60))
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\n"
            f"Content-Length: {declared}\r\n\r\n".encode()
        )
        self.interval_s = interval_s
        self.answer = b""
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._drip, daemon=True)
        self._thread.start()

    def _drip(self) -> None:
        self.sock.settimeout(self.interval_s)
        try:
            while True:
                try:
                    self.answer += self.sock.recv(4096)
                    if self.answer:
                        break
                except TimeoutError:
                    self.sock.sendall(b"R")
        except OSError:
            pass
        finally:
            self.done.set()

    def close(self) -> None:
        self.sock.close()
        self._thread.join(timeout_s(10))


def test_dripping_uploads_leave_an_honest_upload_served(make_fake_server, no_tracebacks):
    # the attack: 4 bodies of 1 MB, a byte every so often, against 4 file slots
    server = make_fake_server()
    drippers = [Dripper(server.port, DEEPGRAM, 1.0) for _ in range(4)]
    try:
        eventually_sync(lambda: server.server.files.receiving.total == 4)
        assert not server.server.files.jobs.active  # receiving holds no transcription slot
        metrics = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s(10))
        metrics.request("GET", "/metrics")
        assert b"streamer_file_uploads_receiving 4.0" in metrics.getresponse().read()
        metrics.close()
        for answer in post_both(server.port, wav_of(bursts(2))):
            assert answer[0] == 200, answer
        # under the minimum rate, each is cut once the grace is over, with 408
        for dripper in drippers:
            assert dripper.done.wait(timeout_s(30))
            assert dripper.answer.startswith(b"HTTP/1.1 408"), dripper.answer[:200]
            assert b"upload-min-bytes-per-s" in dripper.answer
    finally:
        for dripper in drippers:
            dripper.close()
    eventually_sync(lambda: server.server.files.receiving.total == 0)


def test_one_client_holds_at_most_half_of_the_bodies_received(make_fake_server, no_tracebacks):
    server = make_fake_server(files=FileOptions(max_uploads_receiving=4))
    drippers = [Dripper(server.port, DEEPGRAM, 1.0) for _ in range(2)]
    try:
        eventually_sync(lambda: server.server.files.receiving.total == 2)
        status, headers, body = post(server.port, DEEPGRAM, wav_of(bursts(1)), "audio/wav")
        assert status == 429 and int(headers["Retry-After"]) > 0
        assert "this client" in body["err_msg"]
        # another client (address) is served
        status, _, body = post(
            server.port, DEEPGRAM, wav_of(bursts(1)), "audio/wav", source="127.0.0.2"
        )
        assert status == 200 and len(body["results"]["utterances"]) == 1
    finally:
        for dripper in drippers:
            dripper.close()


def test_a_body_not_complete_by_the_deadline_is_cut(make_fake_server, no_tracebacks):
    server = make_fake_server(files=FileOptions(upload_deadline_s=1.5, upload_min_bytes_per_s=0))
    dripper = Dripper(server.port, DEEPGRAM, 0.2)
    try:
        assert dripper.done.wait(timeout_s(10))
        assert dripper.answer.startswith(b"HTTP/1.1 408")
        assert b"--upload-deadline-s" in dripper.answer
    finally:
        dripper.close()


@pytest.mark.parametrize("path", [OPENAI, DEEPGRAM])
def test_413_names_the_flag_and_its_value(make_fake_server, path, no_tracebacks):
    server = make_fake_server(files=FileOptions(max_upload_bytes=10 << 10))
    audio = wav_of(bursts(2))  # 140 KB
    if path == OPENAI:
        status, _, body = post_openai(server.port, form(("file", audio)))
    else:
        status, _, body = post(server.port, path, audio, "audio/wav")
    assert status == 413
    assert "--max-upload-mb 0.00976562" in message(body), message(body)
    assert "bytes" not in message(body)


@pytest.mark.parametrize(
    ("rate", "bits", "channels", "words"),
    [
        (1, 16, 1, "sample rate of 1 Hz"),
        (1_000_000, 16, 1, "sample rate of 1000000 Hz"),
        (16000, 0, 1, "0 bits per sample"),
        (16000, 16, 0, "no audio channels"),
    ],
)
def test_implausible_wavs_are_refused_on_both_apis(
    make_fake_server, rate, bits, channels, words, no_tracebacks
):
    server = make_fake_server()
    audio = wav_header(sample_rate=rate, bits=bits, channels=channels, data_bytes=28000)
    audio += bytes(28000)
    openai, deepgram = post_both(server.port, audio)
    assert openai[0] == 400 and openai[1]["error"]["code"] == "invalid_file"
    assert deepgram[0] == 400 and deepgram[1]["err_code"] == "BAD REQUEST"
    assert words in message(openai[1]) and words in message(deepgram[1])


def test_four_1_hz_wavs_at_once_are_refused_without_memory(make_fake_server, no_tracebacks):
    server = make_fake_server()
    # 28 KB declaring 14000 s at 1 Hz: 224 M samples once resampled to 16 kHz
    audio = wav_header(sample_rate=1, bits=16, channels=1, data_bytes=28000) + bytes(28000)
    before_mb = _rss_mb()
    peak_mb = before_mb
    done = threading.Event()

    def sample() -> None:  # the server runs in this process
        nonlocal peak_mb
        while not done.wait(0.01):
            peak_mb = max(peak_mb, _rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def four() -> list[tuple[int, dict]]:
        calls = [asyncio.to_thread(post_both, server.port, audio) for _ in range(2)]
        return [answer for pair in await asyncio.gather(*calls) for answer in pair]

    try:
        answers = asyncio.run(four())
    finally:
        done.set()
        sampler.join()
    assert [status for status, _ in answers] == [400] * 4
    assert peak_mb - before_mb < 100


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_truncated_wav_is_refused_on_both_apis(make_fake_server, no_tracebacks):
    server = make_fake_server()
    audio = wav_of(bursts(3))
    for status, body in post_both(server.port, audio[: len(audio) // 2]):
        assert status == 400 and "truncated" in message(body), body


def test_more_than_64_parts_is_a_400(make_fake_server, no_tracebacks):
    server = make_fake_server()
    parts = [(f"field{i}", b"x") for i in range(70)]
    status, _, body = post_openai(server.port, form(*parts, ("file", wav_of(bursts(1)))))
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert "segment count" in body["error"]["message"]


def test_more_than_16_headers_in_a_part_is_a_400(make_fake_server, no_tracebacks):
    server = make_fake_server()
    headers = "".join(f"X-H{i}: v\r\n" for i in range(20))
    body = (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            f"{headers}\r\n"
        ).encode()
        + wav_of(bursts(1))
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )
    status, _, answer = post_openai(server.port, body)
    assert status == 400 and "header count" in answer["error"]["message"]


@pytest.mark.parametrize(
    "name", [b"\xff\xfe\x1b[31mevil", "\x1b[31mevil\u202e".encode()], ids=["latin", "utf8"]
)
def test_a_part_name_is_never_echoed_raw(make_fake_server, name, no_tracebacks):
    server = make_fake_server()
    body = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="'.encode()
        + name
        + b'"\r\n\r\n'
        + b"y" * 70000  # a field too long: its name is in the message
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )
    status, _, answer = post_openai(server.port, body)
    assert status == 400
    text = message(answer)
    assert text.isascii() and text.isprintable(), text
    assert "\\xff" not in text  # not even as a repr of the bytes
    if name.startswith(b"\xff"):  # not UTF-8: the parser's own words, no name
        assert "evil" not in text
    else:  # escaped
        assert "\\x1b[31mevil\\u202e" in text


def test_a_file_part_without_a_filename_is_the_file(make_fake_server, no_tracebacks):
    server = make_fake_server()
    status, _, body = post_openai(server.port, form(("file", wav_of(bursts(2))), filename=None))
    assert status == 200, body
    assert body["text"]


async def test_a_stopped_decoder_thread_has_left_the_file():
    """The caller closes the spool once transcribe_file ends: by then the decoder's
    thread must be off it (PyAV reading a closed file logs a traceback)."""
    reading = threading.Event()

    def chunks():
        while True:
            reading.set()
            time.sleep(0.2)  # FFmpeg decoding a piece of the file
            yield bytes(32000)

    decoder = uploads._Decoder(chunks)
    decoder.start()
    assert await asyncio.to_thread(reading.wait, timeout_s(5))
    await decoder.stop()
    assert not decoder._thread.is_alive()


def test_resets_mid_transcription_leave_no_traceback(make_fake_server, no_tracebacks, tmp_path):
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.05))
    # over the 8 MB kept in memory: the spool is a temporary file, as in the soak
    audio = wav_of(np.tile(bursts(4), 60))
    body = form(("file", audio))
    head = (
        f"POST {OPENAI} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
    ).encode()
    for delay_s in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):
        with socket.create_connection(("127.0.0.1", server.port), timeout_s(30)) as sock:
            sock.sendall(head + body)
            eventually_sync(lambda: server.server.files.jobs.active, timeout_s=30)
            threading.Event().wait(delay_s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        eventually_sync(lambda: not server.server.files.jobs.active, timeout_s=30)
    status, _, answer = post_openai(server.port, form(("file", wav_of(bursts(1)))))
    assert status == 200, answer
