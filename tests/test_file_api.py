"""The file APIs on the main port, driven by the real clients: the openai SDK's
``audio.transcriptions.create`` (every response format, ``stream=True``), deepgram-sdk's
prerecorded ``transcribe_file``, and plain HTTP.

An upload's transcript must be the protocol v1 finals of the same samples (the tagged
model makes them known text), for a WAV and for the compressed encodings.
"""

from __future__ import annotations

import asyncio
import http.client
import re
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import orjson
import pytest

from streamer.core.compat.common import join_texts
from streamer.media.files import iter_pcm
from tests.audio_files import write_audio
from tests.server_fixtures import ServerThread, recognizer_loader, server_options
from tests.support import v1_texts
from tests.timing import eventually_sync, timeout_s

KEY = "sk-test"


@pytest.fixture(scope="module")
def files_server(tagged_model_dir: Path):
    thread = ServerThread(
        recognizer_loader(tagged_model_dir),
        server_options(token=KEY, files=_file_options(max_jobs=2, max_upload_bytes=4 << 20)),
    ).start()
    yield thread
    thread.shutdown()


def _file_options(**changes):
    from streamer.server.options import FileOptions

    return FileOptions(**changes)


@pytest.fixture(scope="module")
def wav(tmp_path_factory, speech16) -> Path:
    return write_audio(speech16, 16000, "wav", tmp_path_factory.mktemp("files") / "speech.wav")


@pytest.fixture(scope="module")
def reference(files_server, speech16) -> list[str]:
    """Protocol v1's finals for the same samples (the file path's defaults)."""
    url = f"{files_server.url}?token={KEY}"
    finals = asyncio.run(v1_texts(url, speech16, 16000, partials=False))
    assert len(finals) == 2 and finals[1].lower().startswith("hello")
    return finals


def _openai(server: ServerThread, key: str = KEY):
    from openai import OpenAI

    return OpenAI(api_key=key, base_url=f"http://127.0.0.1:{server.port}/v1", max_retries=0)


def test_openai_json_equals_v1_finals(files_server, wav, reference) -> None:
    with wav.open("rb") as f:
        result = _openai(files_server).audio.transcriptions.create(model="whisper-1", file=f)
    assert result.text == join_texts(reference)


def test_openai_verbose_json_segments_and_words(files_server, wav, reference, speech16) -> None:
    duration_s = speech16.size / 16000
    with wav.open("rb") as f:
        result = _openai(files_server).audio.transcriptions.create(
            model="whisper-1",
            file=f,
            response_format="verbose_json",
            timestamp_granularities=["segment", "word"],
        )
    assert [s.text.strip() for s in result.segments] == reference
    assert result.text == join_texts(reference)
    assert abs(float(result.duration) - duration_s) < 0.05
    ends = [0.0]
    for segment in result.segments:
        assert ends[-1] <= segment.start < segment.end <= duration_s + 1e-6
        ends.append(segment.end)
        extra = segment.model_extra or {}
        assert "emotion" in extra and "event" in extra
    assert result.words, "timestamp_granularities=word gives words"
    starts = [w.start for w in result.words]
    assert starts == sorted(starts)
    assert all(0 <= w.start <= w.end <= duration_s + 1e-6 for w in result.words)
    assert " ".join(w.word for w in result.words).lower().startswith("the quick")


def _seconds(stamp: str) -> float:
    hours, minutes, seconds = stamp.replace(",", ".").split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def check_cues(cues: list[tuple[str, str, str]], reference: list[str]) -> None:
    """Timed cues in order, inside the audio, whose words are the finals' words."""
    times = [(_seconds(start), _seconds(end)) for start, end, _ in cues]
    assert all(start < end for start, end in times)
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(times, times[1:], strict=False))
    assert " ".join(text for _, _, text in cues).split() == " ".join(reference).split()


def test_openai_text_srt_vtt(files_server, wav, reference) -> None:
    client = _openai(files_server)
    with wav.open("rb") as f:
        text = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text")
    assert text.strip() == join_texts(reference)
    with wav.open("rb") as f:
        srt = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="srt")
    stamp = r"\d\d:\d\d:\d\d,\d\d\d"
    cues = []
    for index, block in enumerate(srt.strip().split("\n\n"), start=1):
        number, timing, *lines = block.split("\n")
        assert number == str(index)
        assert re.fullmatch(f"({stamp}) --> ({stamp})", timing), timing
        start, end = timing.split(" --> ")
        cues.append((start, end, " ".join(lines)))
    check_cues(cues, reference)
    with wav.open("rb") as f:
        vtt = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="vtt")
    assert vtt.startswith("WEBVTT\n")
    blocks = vtt.strip().split("\n\n")[1:]
    cues = []
    for block in blocks:
        timing, *lines = block.split("\n")
        match = re.fullmatch(r"(\d\d:\d\d:\d\d\.\d\d\d) --> (\d\d:\d\d:\d\d\.\d\d\d)", timing)
        assert match, timing
        cues.append((match[1], match[2], " ".join(lines)))
    assert len(cues) == len(srt.strip().split("\n\n"))
    check_cues(cues, reference)


def test_openai_stream_deltas_then_done(files_server, wav, reference) -> None:
    with wav.open("rb") as f:
        events = list(
            _openai(files_server).audio.transcriptions.create(
                model="gpt-4o-transcribe", file=f, stream=True
            )
        )
    types = [e.type for e in events]
    assert types == ["transcript.text.delta"] * len(reference) + ["transcript.text.done"]
    deltas = "".join(e.delta for e in events[:-1])
    assert deltas == events[-1].text == join_texts(reference)


def test_openai_stream_deltas_carry_their_segment_when_asked(files_server, wav) -> None:
    """include[]=segments (ours, for the web page's captions): each delta has its
    utterance as verbose_json's segment; without it the events are OpenAI's alone."""
    client = _openai(files_server)
    with wav.open("rb") as f:
        verbose = client.audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json"
        )
    with wav.open("rb") as f:
        events = list(
            client.audio.transcriptions.create(
                model="gpt-4o-transcribe", file=f, stream=True, include=["segments"]
            )
        )
    segments = [e.model_extra["segment"] for e in events if e.type == "transcript.text.delta"]
    assert [(s["id"], s["start"], s["end"], s["text"]) for s in segments] == [
        (s.id, s.start, s.end, s.text) for s in verbose.segments or ()
    ]
    assert all({"emotion", "event", "sensevoice_language"} <= set(s) for s in segments)
    with wav.open("rb") as f:
        plain = list(client.audio.transcriptions.create(model="x", file=f, stream=True))
    assert all(not (e.model_extra or {}).get("segment") for e in plain)


@pytest.mark.parametrize("kind", ["mp3", "ogg-opus", "m4a", "flac", "webm"])
def test_compressed_uploads_equal_v1_finals_of_their_samples(
    files_server, speech16, tmp_path, kind
) -> None:
    path = write_audio(speech16, 16000, kind, tmp_path / f"speech.{kind}")
    with path.open("rb") as f:
        samples = np.frombuffer(b"".join(iter_pcm(f, max_duration_s=None)), dtype=np.int16)
    url = f"{files_server.url}?token={KEY}"
    expected = asyncio.run(v1_texts(url, samples, 16000, partials=False))
    assert expected, "the decoded samples give finals"
    with path.open("rb") as f:
        result = _openai(files_server).audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json"
        )
    assert [s.text.strip() for s in result.segments] == expected


async def _streamed_live(server: ServerThread, data: bytes) -> list[str]:
    """Protocol v1 with ``encoding=auto``: the container's bytes in 4 kB slices, as a
    browser's MediaRecorder or a live encoder sends them."""
    from websockets.asyncio.client import connect

    finals = []
    url = f"{server.url}?token={KEY}&encoding=auto&partials=false"
    async with connect(url, max_size=None) as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        for i in range(0, len(data), 4096):
            await ws.send(data[i : i + 4096])
        await ws.send('{"type":"stop"}')
        async with asyncio.timeout(timeout_s(60)):
            async for frame in ws:
                message = orjson.loads(frame)
                assert message["type"] != "error", message
                if message["type"] == "final" and message["text"]:
                    finals.append(message["text"])
    return finals


@pytest.mark.parametrize("kind", ["ogg-opus", "webm"])
def test_an_opus_file_gives_the_same_text_uploaded_and_streamed_live(
    files_server, speech16, tmp_path, kind
) -> None:
    """One resampler for every path: Opus decodes at 48 kHz, and the live container
    decoder and the upload both bring it to 16 kHz with the same soxr conversion, so
    the same bytes give the same samples, cuts and text."""
    path = write_audio(speech16, 16000, kind, tmp_path / f"speech.{kind}")
    live = asyncio.run(_streamed_live(files_server, path.read_bytes()))
    assert len(live) == 2, live
    with path.open("rb") as f:
        result = _openai(files_server).audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json"
        )
    assert [s.text.strip() for s in result.segments] == live


def test_deepgram_sdk_prerecorded(files_server, wav, reference) -> None:
    from deepgram import DeepgramClient

    from tests.compat_clients import _deepgram_environment

    client = DeepgramClient(api_key=KEY, environment=_deepgram_environment(files_server.port))
    response = client.listen.v1.media.transcribe_file(
        request=wav.read_bytes(), model="nova-3", punctuate=True, utterances=True
    )
    alternative = response.results.channels[0].alternatives[0]
    assert alternative.transcript == join_texts(reference)
    words = alternative.words
    assert words and all(w.punctuated_word for w in words)
    assert [w.start for w in words] == sorted(w.start for w in words)
    assert [u.transcript for u in response.results.utterances] == reference
    assert response.metadata.channels == 1
    assert response.metadata.duration > words[-1].end


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s(60))
    try:
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_deepgram_raw_linear16(files_server, speech16, reference) -> None:
    status, headers, body = _post(
        files_server.port,
        "/v1/listen?encoding=linear16&sample_rate=16000",
        speech16.tobytes(),
        {"Authorization": f"Token {KEY}", "Content-Type": "audio/l16"},
    )
    assert status == 200, body
    result = orjson.loads(body)
    assert result["results"]["channels"][0]["alternatives"][0]["transcript"] == join_texts(
        reference
    )


def test_deepgram_url_body_refused_without_the_flag(files_server) -> None:
    status, _, body = _post(
        files_server.port,
        "/v1/listen",
        orjson.dumps({"url": "http://169.254.169.254/latest/meta-data"}),
        {"Authorization": f"Token {KEY}", "Content-Type": "application/json"},
    )
    assert status == 400
    error = orjson.loads(body)
    assert "allow-url-fetch" in error["err_msg"] and error["request_id"]


def test_errors_in_openai_shape(files_server, wav, tmp_path) -> None:
    import openai

    with wav.open("rb") as f, pytest.raises(openai.AuthenticationError) as caught:
        _openai(files_server, key="wrong").audio.transcriptions.create(model="whisper-1", file=f)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "invalid_request_error"
    not_audio = tmp_path / "notes.txt"
    not_audio.write_bytes(b"these are not the droids you are looking for\n" * 50)
    with not_audio.open("rb") as f, pytest.raises(openai.BadRequestError) as caught:
        _openai(files_server).audio.transcriptions.create(model="whisper-1", file=f)
    assert caught.value.body["param"] == "file" and caught.value.body["message"]
    big = tmp_path / "big.wav"
    big.write_bytes(b"RIFF" + bytes(5 << 20))
    with big.open("rb") as f, pytest.raises(openai.APIStatusError) as caught:
        _openai(files_server).audio.transcriptions.create(model="whisper-1", file=f)
    assert caught.value.status_code == 413
    with wav.open("rb") as f, pytest.raises(openai.BadRequestError) as caught:
        _openai(files_server).audio.translations.create(model="whisper-1", file=f)
    assert "translate" in caught.value.body["message"]
    with wav.open("rb") as f, pytest.raises(openai.BadRequestError) as caught:
        _openai(files_server).audio.transcriptions.create(
            model="whisper-1",
            file=f,
            response_format="xml",  # type: ignore[arg-type]
        )
    assert caught.value.body["param"] == "response_format"


def test_plain_http_answers(files_server) -> None:
    status, headers, body = _post(files_server.port, "/healthz", b"x", {})
    assert status == 405 and "GET" in headers["Allow"]
    status, _, _ = _post(files_server.port, "/nowhere", b"x", {})
    assert status == 404
    with socket.create_connection(("127.0.0.1", files_server.port), timeout_s(10)) as sock:
        sock.sendall(b"POST /v1/listen HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400")


def test_a_client_that_disconnects_cancels_its_job(files_server, tmp_path) -> None:
    long_pcm = np.tile(np.sin(np.arange(16000 * 120) / 8).astype(np.float32) * 8000, 1)
    path = write_audio(long_pcm.astype(np.int16), 16000, "flac", tmp_path / "long.flac")
    data = path.read_bytes()
    files = files_server.server.files
    with socket.create_connection(("127.0.0.1", files_server.port), timeout_s(10)) as sock:
        head = (
            f"POST /v1/listen HTTP/1.1\r\nHost: x\r\nAuthorization: Token {KEY}\r\n"
            f"Content-Type: audio/flac\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        sock.sendall(head + data)
        eventually_sync(lambda: len(files.jobs.active) == 1)
    eventually_sync(lambda: not files.jobs.active)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_uploads(files_server, speech16, reference, tmp_path) -> None:
    # over 1 MB, so that curl sends Expect: 100-continue and waits for the server's 100
    long = np.concatenate([speech16, np.zeros(16000 * 30, dtype=np.int16)])
    path = write_audio(long, 16000, "wav", tmp_path / "long.wav")
    assert path.stat().st_size > 1 << 20
    base = f"http://127.0.0.1:{files_server.port}"
    srt = subprocess.run(
        [
            "curl",
            "-sS",
            "--fail-with-body",
            f"{base}/v1/audio/transcriptions",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-F",
            f"file=@{path}",
            "-F",
            "model=whisper-1",
            "-F",
            "response_format=srt",
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s(120),
        check=True,
    ).stdout
    cues = [b.split("\n", 2) for b in srt.strip().split("\n\n")]
    check_cues([(*c[1].split(" --> "), c[2].replace("\n", " ")) for c in cues], reference)
    listen = subprocess.run(
        [
            "curl",
            "-sS",
            "--fail-with-body",
            f"{base}/v1/listen?utterances=true",
            "-H",
            f"Authorization: Token {KEY}",
            "-H",
            "Content-Type: audio/wav",
            "--data-binary",
            f"@{path}",
        ],
        capture_output=True,
        timeout=timeout_s(120),
        check=True,
    ).stdout
    assert [u["transcript"] for u in orjson.loads(listen)["results"]["utterances"]] == reference


ALSA_WORDS = Path("/usr/share/sounds/alsa/Front_Center.wav")  # real speech, 48 kHz (alsa-utils)


@pytest.mark.skipif(not ALSA_WORDS.exists(), reason="needs alsa-utils' recordings")
def test_a_real_48k_recording_equals_v1_at_its_own_rate(files_server, tmp_path) -> None:
    import soundfile

    samples, rate = soundfile.read(ALSA_WORDS, dtype="int16")
    assert rate == 48000
    padded = np.concatenate([samples, np.zeros(rate, dtype=np.int16)])
    url = f"{files_server.url}?token={KEY}"
    expected = asyncio.run(v1_texts(url, padded, rate, partials=False))
    path = write_audio(padded, rate, "wav", tmp_path / "words.wav")
    with path.open("rb") as f:
        result = _openai(files_server).audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json"
        )
    assert expected and [s.text.strip() for s in result.segments] == expected
