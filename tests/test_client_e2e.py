"""``streamer client`` against the real server (fixtures ``server_url`` and
``tagged_server_url`` come from conftest.py: a server on port 0 with a tiny model).

The outputs are checked against the server's own finals, obtained independently through
:func:`streamer.client.streaming.transcribe`: segmentation is sample-exact, so every run over the
same audio yields the same segments.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
import soundfile as sf

from streamer.client import cli as client_cli
from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.protocol import StreamOptions
from streamer.testkit import speech as synth
from tests.timing import timeout_s

REPO = Path(__file__).resolve().parents[1]
TTS_CACHE = REPO / ".cache" / "tts"
FOX = "the quick brown fox jumps over the lazy dog"
HELLO = "hello there"

pytestmark = pytest.mark.skipif(not synth.tools_available(), reason="needs espeak-ng and sox")

SRT_TIME = r"(\d\d):(\d\d):(\d\d),(\d\d\d)"
VTT_TIME = r"(\d\d):(\d\d):(\d\d)\.(\d\d\d)"


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    clips = [("en", text, synth.speak(text, "en", cache_dir=TTS_CACHE)) for text in (FOX, HELLO)]
    pcm, _ = synth.join_with_silence(clips, gaps_ms=1200, lead_ms=600)
    return pcm


@pytest.fixture
def speech_wav(speech: np.ndarray, tmp_path: Path) -> Path:
    path = tmp_path / "speech.wav"
    sf.write(path, speech, synth.SAMPLE_RATE, subtype="PCM_16")
    return path


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    client_cli.add_client_arguments(parser)
    return parser.parse_args(argv)


def ms_of(match: tuple[str, ...]) -> int:
    h, m, s, ms = map(int, match)
    return ((h * 60 + m) * 60 + s) * 1000 + ms


def parse_cues(text: str, time_re: str) -> list[tuple[int, int, str]]:
    cues = []
    pattern = re.compile(rf"^{time_re} --> {time_re}$")
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    for block in blocks:
        lines = block.split("\n")
        if lines[0] == "WEBVTT":
            continue
        if time_re == SRT_TIME:
            assert lines[0].isdigit(), block
            lines = lines[1:]
        match = pattern.match(lines[0])
        assert match, block
        start, end = ms_of(match.groups()[:4]), ms_of(match.groups()[4:])
        assert start <= end
        assert 1 <= len(lines[1:]) <= 2 and all(lines[1:]), block
        cues.append((start, end, " ".join(lines[1:])))
    return cues


async def test_outputs_match_the_servers_finals(
    server_url: str, speech: np.ndarray, speech_wav: Path, tmp_path: Path
) -> None:
    reference = await transcribe(ClientOptions(url=server_url), speech, synth.SAMPLE_RATE)
    assert reference.finals, "the server found no segment in two sentences of speech"
    outputs = {fmt: tmp_path / f"out.{fmt}" for fmt in ("txt", "jsonl", "srt", "vtt")}
    argv = [str(speech_wav), "--url", server_url, "--no-pace", "--quiet"]
    for path in outputs.values():
        argv += ["--output", str(path)]
    assert await client_cli.run_client(cli_args(*argv)) == client_cli.EXIT_OK

    records = [orjson.loads(line) for line in outputs["jsonl"].read_text().splitlines()]
    assert records[0]["type"] == "ready" and records[-1]["type"] == "end"
    assert all(a["arrival_s"] <= b["arrival_s"] for a, b in zip(records, records[1:], strict=False))
    finals = [r for r in records if r["type"] == "final"]
    expected = [(f.start_ms, f.end_ms) for f in reference.finals]
    assert [(f["start_ms"], f["end_ms"]) for f in finals] == expected
    assert records[-1]["segments"] == len(finals)

    spoken = [f for f in finals if f["text"].strip()]
    assert outputs["txt"].read_text().splitlines() == [f["text"].strip() for f in spoken]
    for fmt, time_re in (("srt", SRT_TIME), ("vtt", VTT_TIME)):
        text = outputs[fmt].read_text()
        if fmt == "vtt":
            assert text.startswith("WEBVTT\n\n")
        cues = parse_cues(text, time_re)
        assert " ".join(c[2] for c in cues).split() == " ".join(f["text"] for f in spoken).split()
        assert cues[0][0] == round(spoken[0]["start_ms"]) if spoken else not cues
        assert cues[-1][1] == round(spoken[-1]["end_ms"]) if spoken else not cues


async def test_paced_session_reports_latency(server_url: str, speech: np.ndarray) -> None:
    options = ClientOptions(url=server_url, stream=StreamOptions(language="en"))
    result = await transcribe(options, speech, synth.SAMPLE_RATE, speed=4.0)
    assert result.end is not None and result.end.segments == len(result.finals)
    audio_s = speech.size / synth.SAMPLE_RATE
    assert result.sends[-1].sent_s - result.sends[0].sent_s >= audio_s / 4 - 0.15
    assert result.time_to_first_partial_s() is not None
    assert all(latency > 0 for latency in result.final_latencies_s())


async def test_tags_shown_in_the_live_view_and_json(
    tagged_server_url: str, speech_wav: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(speech_wav), "--url", tagged_server_url, "--no-pace", "--json"]
    assert await client_cli.run_client(cli_args(*argv)) == client_cli.EXIT_OK
    captured = capsys.readouterr()
    finals = [orjson.loads(line) for line in captured.out.splitlines()]
    assert all(f["type"] == "final" for f in finals)
    happy = [f for f in finals if (f["emotion"], f["event"]) == ("HAPPY", "Laughter")]
    assert happy, finals  # the tagged model answers "hello there" as happy laughter
    assert "😊 😀]" in captured.err or "HAPPY Laughter]" in captured.err
    assert "utterance" in captured.err.splitlines()[-1]  # the summary


async def test_example_script(server_url: str, speech_wav: Path, tmp_path: Path) -> None:
    # A subprocess, awaited without blocking the loop (the server may share it).
    out = tmp_path / "out.vtt"
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "client_examples" / "stream_file.py"), str(speech_wav),
        "--url", server_url, "--no-pace", "--json", "--output", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=timeout_s(120))
    assert process.returncode == 0, stderr.decode()
    assert all(orjson.loads(line)["type"] == "final" for line in stdout.splitlines())
    assert out.read_text().startswith("WEBVTT")
    assert f"wrote {out} (vtt): " in stderr.decode()  # says where it wrote, and what


async def test_unreachable_and_unsupported(speech_wav: Path, tmp_path: Path) -> None:
    dead = cli_args(str(speech_wav), "--url", "ws://127.0.0.1:9/v1/asr", "-q")
    assert await client_cli.run_client(dead) == client_cli.EXIT_UNREACHABLE
    junk = tmp_path / "junk.flac"
    junk.write_bytes(b"not audio at all" * 10)
    bad = cli_args(str(junk), "--url", "ws://127.0.0.1:9/v1/asr", "-q")
    assert await client_cli.run_client(bad) == client_cli.EXIT_USAGE
