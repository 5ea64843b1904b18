"""The client: pure helpers, then the real client against a scripted loopback server.

The scripted server speaks protocol v1 through :mod:`streamer.core.protocol` but decides
nothing: it answers one final per second of audio, and can drop the connection, refuse
the handshake or send a fatal error on cue. That is what the reconnect, error and exit
code paths need; the real server's behaviour is tested in ``test_client_e2e.py``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

import numpy as np
import orjson
import pytest
import soundfile as sf
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from streamer.client import cli as client_cli
from streamer.client.connection import (
    ClientOptions,
    Received,
    ServerUnreachable,
    StreamingClient,
    backoff_delays,
    connect_with_backoff,
    session_url,
)
from streamer.client.streaming import (
    PaceSchedule,
    chunk_bounds,
    stream_file,
    stream_pcm,
    transcribe,
)
from streamer.client.timeline import resume_sample, shift_message
from streamer.core.protocol import (
    End,
    Error,
    Final,
    Partial,
    Ready,
    SpeechStart,
    StopMessage,
    StreamOptions,
    encode,
    parse_client_message,
)
from streamer.errors import ClientError, ConnectionRefusedByServer, ServerClosed
from tests.timing import timeout_s

RATE = 16000

# ---------------------------------------------------------------------------
# Pure helpers


def make_final(
    segment_id: int, start_ms: float, end_ms: float, text: str = "x", emotion: str = "NEUTRAL"
) -> Final:
    event = "Laughter" if emotion == "HAPPY" else "Speech"
    return Final(
        segment_id=segment_id, start_ms=start_ms, end_ms=end_ms, text=text, language="en",
        emotion=emotion, event=event, raw=text, rich=text, reason="silence",
        decode_ms=1.0, queue_ms=0.0,
    )  # fmt: skip


def test_session_url_adds_only_non_default_options() -> None:
    assert session_url(ClientOptions(url="ws://h:1/v1/asr")) == "ws://h:1/v1/asr"
    stream = StreamOptions(language="en", itn=False, endpoint_ms=800)
    url = session_url(ClientOptions(url="wss://h/v1/asr?x=1", stream=stream))
    assert url == "wss://h/v1/asr?x=1&language=en&itn=false&endpoint_ms=800"


def test_chunk_bounds_cover_the_signal_from_the_start_sample() -> None:
    assert chunk_bounds(0, 3500, 1600) == [(0, 1600), (1600, 3200), (3200, 3500)]
    assert chunk_bounds(1000, 3500, 1600) == [(1000, 2600), (2600, 3500)]
    assert chunk_bounds(3500, 3500, 1600) == []


def test_pace_schedule_has_no_drift() -> None:
    schedule = PaceSchedule(origin_s=100.0, sample_rate=RATE, speed=1.0)
    # Chunk k (100 ms) is due when its last sample exists, whatever happened before.
    assert [schedule.due_s(1600 * k) for k in (1, 2, 600)] == [100.1, 100.2, 160.0]
    fast = PaceSchedule(origin_s=0.0, sample_rate=RATE, speed=4.0, origin_sample=16000)
    assert fast.due_s(16000) == 0.0 and fast.due_s(32000) == 0.25


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    delays = backoff_delays(6, 0.5, 3.0, random.Random(1))
    nominal = [0.5, 1.0, 2.0, 3.0, 3.0]
    assert len(delays) == 5
    assert all(n / 2 <= d <= n for d, n in zip(delays, nominal, strict=True))
    assert backoff_delays(1, 0.5, 3.0) == []


def test_resume_sample_is_the_end_of_the_last_final() -> None:
    assert resume_sample([], RATE) == 0
    finals = [make_final(0, 100.0, 1500.0), make_final(1, 2000.0, 3250.5)]
    assert resume_sample(finals, RATE) == 52008


def test_shift_message_moves_times_and_segment_ids() -> None:
    final = shift_message(make_final(0, 100.0, 900.0), 2000.0, 3)
    assert (final.segment_id, final.start_ms, final.end_ms) == (3, 2100.0, 2900.0)
    partial = Partial(1, 2, 0.0, 500.0, "a", "", None, None, None, "a")
    assert shift_message(partial, 1000.0, 2) == Partial(
        3, 2, 1000.0, 1500.0, "a", "", None, None, None, "a"
    )
    assert shift_message(SpeechStart(0, 40.0), 10.0, 1) == SpeechStart(1, 50.0)
    assert shift_message(End(2, 900.0, 0, 0), 100.0, 5) == End(2, 1000.0, 0, 0)
    error = Error("bad_message", "x", False)
    assert shift_message(error, 5.0, 5) is error


# ---------------------------------------------------------------------------
# Scripted loopback server


@dataclass
class Script:
    """What the scripted server does; the sessions it saw are recorded in `sessions`."""

    refuse: tuple[int, str] | None = None  # (HTTP status, error code) at the handshake
    drop_after_samples: int | None = None  # abort the first session's TCP connection
    fatal_after_samples: int | None = None  # send a fatal error and close 1008
    sessions: list[bytearray] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    headers: list[Headers] = field(default_factory=list)


async def scripted_handler(ws: ServerConnection, script: Script) -> None:
    audio = bytearray()
    first_session = not script.sessions
    script.sessions.append(audio)
    await ws.send(encode(Ready(f"s{len(script.sessions)}", 1, RATE, "scripted", {})).decode())
    segments = 0
    async for frame in ws:
        if isinstance(frame, bytes):
            audio += frame
            samples = len(audio) // 2
            if first_session and script.drop_after_samples and samples >= script.drop_after_samples:
                ws.transport.abort()
                return
            if script.fatal_after_samples and samples >= script.fatal_after_samples:
                await ws.send(encode(Error("invalid_option", "scripted failure", True)).decode())
                await ws.close(1008, "scripted failure")
                return
            while samples >= (segments + 1) * RATE:  # one segment per second of audio
                start_ms, end_ms = segments * 1000.0, segments * 1000.0 + 800.0
                await ws.send(encode(SpeechStart(segments, start_ms)).decode())
                partial = Partial(segments, 1, start_ms, end_ms, f"seg{segments}", "", "en",
                                  "HAPPY", "Laughter", f"seg{segments}")  # fmt: skip
                await ws.send(encode(partial).decode())
                final = make_final(segments, start_ms, end_ms, f"seg{segments}", "HAPPY")
                await ws.send(encode(final).decode())
                segments += 1
        elif isinstance(parse_client_message(frame), StopMessage):
            await ws.send(encode(End(segments, len(audio) / 2 / RATE * 1000, segments, 0)).decode())
            await ws.close(1000)
            return


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[str, Script]]:
    script = Script()

    def process_request(ws: ServerConnection, request: Request) -> Response | None:
        script.queries.append(request.path)
        script.headers.append(request.headers)
        if script.refuse is None:
            return None
        status, code = script.refuse
        body = orjson.dumps({"error": code, "message": "scripted refusal"})
        headers = Headers([("Content-Type", "application/json")])
        return Response(status, HTTPStatus(status).phrase, headers, body)

    async with serve(
        lambda ws: scripted_handler(ws, script), "127.0.0.1", 0, process_request=process_request
    ) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/v1/asr", script


def ramp(seconds: float) -> np.ndarray:
    """A signal whose every sample says where it is (to check what was resent)."""
    return (np.arange(int(seconds * RATE)) % 30000).astype(np.int16)


async def test_transcribe_collects_messages_sends_and_finals(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    options = ClientOptions(url=url, token="s3cret", stream=StreamOptions(language="en"))
    result = await transcribe(options, ramp(3.5), RATE)
    assert [f.text for f in result.finals] == ["seg0", "seg1", "seg2"]
    assert result.text == "seg0 seg1 seg2"
    assert result.end == End(3, 3500.0, 3, 0)
    assert result.sends[-1].end_sample == 56000 and len(result.sends) == 35
    assert all(r.arrival_s >= result.started_s for r in result.messages)
    assert result.time_to_first_partial_s() is not None
    assert len(result.final_latencies_s()) == 3
    assert bytes(script.sessions[0]) == ramp(3.5).tobytes()
    assert script.headers[0]["Authorization"] == "Bearer s3cret"
    assert "language=en" in script.queries[0]


async def test_paced_streaming_follows_the_clock(scripted: tuple[str, Script]) -> None:
    url, _ = scripted
    sent: list[tuple[int, float]] = []
    async with await StreamingClient.connect(ClientOptions(url=url)) as client:
        loop_start = time.monotonic()
        schedule = PaceSchedule(loop_start, RATE, speed=4.0)
        await stream_pcm(client, ramp(1.0), RATE, schedule=schedule, speed=4.0,
                         on_chunk_sent=lambda n, t: sent.append((n, t)))  # fmt: skip
        messages = [m async for m in client.messages()]
    assert isinstance(messages[-1], End)
    # 1 s at 4x: the last chunk is due 250 ms after the start, none is sent early.
    assert all(t >= schedule.due_s(n) - 1e-3 for n, t in sent)
    assert sent[-1][1] - loop_start == pytest.approx(0.25, abs=timeout_s(0.1))


async def test_reconnect_resumes_after_the_last_final(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.drop_after_samples = int(2.5 * RATE)  # two finals arrived, then the drop
    pcm = ramp(4.2)
    reconnects: list[tuple[int, int]] = []
    result = await stream_file(
        ClientOptions(url=url, initial_backoff_s=0.01),
        pcm,
        sample_rate=RATE,
        speed=None,
        on_reconnect=lambda n, sample, _err: reconnects.append((n, sample)),
    )
    assert len(script.sessions) == 2
    resume = int(1.8 * RATE)  # end_ms of the second final (seg1: 1000..1800 ms)
    assert reconnects == [(1, resume)]
    assert bytes(script.sessions[1]) == pcm[resume:].tobytes()
    # The second session's times and ids continue the file's timeline.
    assert [(f.segment_id, f.start_ms, f.end_ms) for f in result.finals] == [
        (0, 0.0, 800.0),
        (1, 1000.0, 1800.0),
        (2, 1800.0, 2600.0),
        (3, 2800.0, 3600.0),
    ]
    assert result.reconnects == 1
    assert result.end is not None and result.end.segments == 4
    assert result.end.audio_ms == pytest.approx(4200.0)


async def test_transcribe_is_one_session_without_reconnection(
    scripted: tuple[str, Script],
) -> None:
    url, script = scripted
    script.drop_after_samples = int(1.5 * RATE)
    with pytest.raises(ServerClosed) as info:
        await transcribe(ClientOptions(url=url, initial_backoff_s=0.01), ramp(3.0), RATE)
    assert info.value.code == 1006 and len(script.sessions) == 1


async def test_a_server_that_does_not_speak_v1_is_a_clear_error() -> None:
    async def handler(ws: ServerConnection) -> None:
        await ws.send("<html>not a protocol v1 server</html>")
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(ClientError, match="not a protocol v1 server: not JSON"):
            await StreamingClient.connect(ClientOptions(url=f"ws://127.0.0.1:{port}/v1/asr"))


async def test_an_unreadable_message_mid_session_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(ws: ServerConnection) -> None:
        await ws.send(encode(Ready("s1", 1, RATE, "scripted", {})).decode())
        await ws.send("{not json")
        await ws.recv()  # the stop
        await ws.send(encode(End(0, 0.0, 0, 0)).decode())

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        url = f"ws://127.0.0.1:{port}/v1/asr"
        async with await StreamingClient.connect(ClientOptions(url=url)) as client:
            await client.stop()
            messages = [m async for m in client.messages()]
    assert [type(m) for m in messages] == [Ready, End]
    assert "ignoring an unreadable server message: not JSON" in caplog.text


async def test_gives_up_after_max_reconnects(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.drop_after_samples = RATE // 2
    with pytest.raises(ServerClosed) as info:
        await stream_file(ClientOptions(url=url, max_reconnects=0), ramp(1.0), sample_rate=RATE)
    assert info.value.code == 1006


async def test_fatal_error_is_yielded_then_raised(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.fatal_after_samples = RATE // 2
    seen: list[Received] = []
    with pytest.raises(ServerClosed) as info:
        await stream_file(ClientOptions(url=url), ramp(2.0), sample_rate=RATE, speed=None,
                          on_message=seen.append)  # fmt: skip
    assert info.value.code == 1008 and info.value.reason == "scripted failure"
    assert isinstance(seen[-1].message, Error) and seen[-1].message.fatal
    assert len(script.sessions) == 1  # a rejection is not retried


@pytest.mark.parametrize(("status", "code"), [(401, "unauthorized"), (503, "server_full")])
async def test_handshake_refusal(scripted: tuple[str, Script], status: int, code: str) -> None:
    url, script = scripted
    script.refuse = (status, code)
    with pytest.raises(ConnectionRefusedByServer) as info:
        await StreamingClient.connect(ClientOptions(url=url))
    assert info.value.status == status
    assert info.value.reason == f"{code}: scripted refusal"


async def test_backoff_retries_503_but_not_401(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    options = ClientOptions(url=url, initial_backoff_s=0.001, max_backoff_s=0.002)
    script.refuse = (503, "server_full")
    with pytest.raises(ConnectionRefusedByServer):
        await connect_with_backoff(options, attempts=3)
    assert len(script.queries) == 3
    script.refuse = (401, "unauthorized")
    with pytest.raises(ConnectionRefusedByServer):
        await connect_with_backoff(options, attempts=3)
    assert len(script.queries) == 4


async def test_unreachable_server() -> None:
    with pytest.raises(ServerUnreachable, match="cannot connect"):
        await StreamingClient.connect(ClientOptions(url="ws://127.0.0.1:9/v1/asr"))


async def test_send_audio_rejects_float_arrays(scripted: tuple[str, Script]) -> None:
    url, _ = scripted
    async with await StreamingClient.connect(ClientOptions(url=url)) as client:
        with pytest.raises(TypeError, match="to_int16"):
            await client.send_audio(np.zeros(10, dtype=np.float32))


# ---------------------------------------------------------------------------
# The command line over the scripted server


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    client_cli.add_client_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def wav(tmp_path: Path) -> Path:
    path = tmp_path / "ramp.wav"
    sf.write(path, ramp(2.5), RATE, subtype="PCM_16")
    return path


async def test_cli_writes_outputs_and_summary(
    scripted: tuple[str, Script], wav: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = scripted
    srt, jsonl = tmp_path / "out.srt", tmp_path / "out.jsonl"
    code = await client_cli.run_client(
        cli_args(str(wav), "--url", url, "--no-pace", "-o", str(srt), "-o", str(jsonl), "--json")
    )
    assert code == client_cli.EXIT_OK
    assert srt.read_text().startswith("1\n00:00:00,000 --> 00:00:00,800\nseg0\n\n2\n")
    types = [orjson.loads(line)["type"] for line in jsonl.read_text().splitlines()]
    assert types[0] == "ready" and types[-1] == "end" and types.count("final") == 2
    captured = capsys.readouterr()
    assert [orjson.loads(line)["text"] for line in captured.out.splitlines()] == ["seg0", "seg1"]
    assert "[en HAPPY Laughter] seg0" in captured.err or "[en 😊 😀] seg0" in captured.err
    assert "2 utterances transcribed" in captured.err
    # what was written, in words: cues from utterances; the JSON lines as messages
    assert f"wrote {srt} (srt): 2 subtitle cues from 2 utterances\n" in captured.err
    assert f"wrote {jsonl} (jsonl): " in captured.err and " messages" in captured.err


async def test_cli_quiet_prints_nothing_but_what_was_asked(
    scripted: tuple[str, Script], wav: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = scripted
    srt = tmp_path / "out.srt"
    args = cli_args(str(wav), "--url", url, "--no-pace", "-q", "-o", str(srt))
    assert await client_cli.run_client(args) == client_cli.EXIT_OK
    captured = capsys.readouterr()  # stdout is not a terminal here: it was the transcript
    assert captured.out == "" and captured.err == ""
    assert srt.read_text().count(" --> ") == 2


async def test_cli_url_without_a_path_gets_the_v1_path(
    scripted: tuple[str, Script], wav: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, script = scripted
    bare = url.split("/v1/")[0]  # ws://127.0.0.1:PORT (the server's root is its web page)
    assert await client_cli.run_client(cli_args(str(wav), "--url", bare, "--no-pace")) == 0
    assert script.queries[0].startswith("/v1/asr")
    assert "2 utterances transcribed" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("refuse", "expected"),
    [
        ((401, "unauthorized"), client_cli.EXIT_AUTH),
        ((503, "server_full"), client_cli.EXIT_UNREACHABLE),
    ],
)
async def test_cli_exit_codes_for_refusals(
    scripted: tuple[str, Script], wav: Path, refuse: tuple[int, str], expected: int
) -> None:
    url, script = scripted
    script.refuse = refuse
    assert await client_cli.run_client(cli_args(str(wav), "--url", url, "-q")) == expected


async def test_cli_exit_codes(
    scripted: tuple[str, Script], wav: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, script = scripted
    unreachable = cli_args(str(wav), "--url", "ws://127.0.0.1:9/v1/asr", "-q")
    assert await client_cli.run_client(unreachable) == client_cli.EXIT_UNREACHABLE
    missing = cli_args(str(tmp_path / "missing.wav"), "--url", url)
    assert await client_cli.run_client(missing) == client_cli.EXIT_USAGE
    bad_format = cli_args(str(wav), "--url", url, "-o", str(tmp_path / "out.docx"))
    assert await client_cli.run_client(bad_format) == client_cli.EXIT_USAGE
    script.fatal_after_samples = RATE // 2
    assert await client_cli.run_client(cli_args(str(wav), "--url", url, "--no-pace")) == 1
    assert "scripted failure" in capsys.readouterr().err


def test_live_view_rewrites_the_partial_in_place() -> None:
    import io

    stream = io.StringIO()
    view = client_cli.LiveView(stream, total_samples=RATE * 10, sample_rate=RATE,
                               interactive=True, emoji=True, width=80)  # fmt: skip
    view.progress(RATE * 5)
    view.message(Partial(0, 1, 0.0, 500.0, "the quick brown", "the quick", "en", None, None, ""))
    view.message(make_final(0, 1200.0, 2000.0, "The quick brown fox."))
    view.close()
    text = stream.getvalue()
    assert " 50% ██████████░░░░░░░░░░   5.0/10.0s" in text
    assert "the quick\x1b[2m brown\x1b[0m" in text
    assert "\r\x1b[2K00:01.2 [en] The quick brown fox.\n" in text
    assert text.endswith("\r\x1b[2K")


def test_tag_label() -> None:
    assert client_cli.tag_label("en", "HAPPY", "Laughter", emoji=True) == "[en 😊 😀]"
    assert client_cli.tag_label("en", "HAPPY", "Laughter", emoji=False) == "[en HAPPY Laughter]"
    assert client_cli.tag_label("zh", "NEUTRAL", "Speech", emoji=True) == "[zh]"
    assert client_cli.tag_label(None, None, None, emoji=True) == ""


async def test_cli_hotwords_from_a_list_or_a_file(
    scripted: tuple[str, Script], wav: Path, tmp_path: Path
) -> None:
    from urllib.parse import parse_qs, urlsplit

    url, script = scripted
    listed = cli_args(
        str(wav), "--url", url, "--no-pace", "-q", "--hotwords", "Kubernetes,Claude:3"
    )
    assert await client_cli.run_client(listed) == client_cli.EXIT_OK
    file = tmp_path / "terms.txt"
    file.write_text("# products\nKubernetes\nClaude:3\n")
    from_file = cli_args(str(wav), "--url", url, "--no-pace", "-q", "--hotwords", str(file))
    assert await client_cli.run_client(from_file) == client_cli.EXIT_OK
    for query in script.queries[-2:]:
        assert parse_qs(urlsplit(query).query)["hotwords"] == ["Kubernetes:2,Claude:3"]
    bad = cli_args(str(wav), "--url", url, "-q", "--hotwords", "Claude:lots")
    assert await client_cli.run_client(bad) == client_cli.EXIT_USAGE


def test_an_incomplete_end_without_a_close_frame_is_retried_as_an_abnormal_closure() -> None:
    """A server that sends `end` before it read all the audio and goes away without a close
    frame reaching the client (a graceful restart whose frame lost the race): the code is
    1006, which the client retries, not None, which it gave up on."""
    from types import SimpleNamespace

    from streamer.client.connection import RETRYABLE_CLOSE_CODES
    from streamer.client.streaming import _truncation
    from streamer.client.timeline import Timeline
    from streamer.core.protocol import End

    timeline = Timeline(16000)
    timeline.record(
        Received(End(segments=1, audio_ms=18_200, partials_sent=3, partials_skipped=0), 0.0)
    )
    for code, expected in ((None, 1006), (1001, 1001), (1008, 1008)):
        truncated = _truncation(timeline, 40 * 16000, SimpleNamespace(close_code=code))
        assert truncated is not None and truncated.code == expected
        assert (truncated.code in RETRYABLE_CLOSE_CODES) == (code != 1008)
    assert _truncation(timeline, 18 * 16000, SimpleNamespace(close_code=None)) is None
