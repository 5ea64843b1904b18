"""Diarization end to end: protocol v1 over loopback with the real speaker models, the
bound on a final's wait for its speakers, and the online DER on recorded voices."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect

from streamer.core.audio import SAMPLE_RATE
from streamer.core.diarization import DiarizationOptions, SpeakerAnalysis
from streamer.core.protocol import Final
from streamer.core.session import SessionOptions
from streamer.model.speakers.worker import SpeakerWorker
from streamer.server.server import ServerOptions
from tests.fakes import WordyRecognizer
from tests.server_fixtures import ServerThread, messages_until_close
from tests.timing import timeout_s


@pytest.fixture(scope="module")
def diarizer_files(cache_dir: Path):
    from streamer.model.speakers.layout import resolve_diarizer
    from streamer.testkit.diarizer import ensure_diarizer

    return resolve_diarizer(str(ensure_diarizer(cache_dir)), cache_dir)


def diarized_server(speakers: SpeakerWorker, max_wait_ms: float) -> ServerThread:
    session = SessionOptions(diarization=DiarizationOptions(max_wait_ms=max_wait_ms))
    return ServerThread(WordyRecognizer, ServerOptions(session=session), speakers=speakers)


def two_voices() -> tuple[np.ndarray, list]:
    from streamer.testkit.diarizer import conversation

    return conversation(["reader", "cards"], 8, seed=0)


async def stream(url: str, pcm: np.ndarray, query: str) -> list[dict]:
    async with connect(f"{url}?{query}", max_size=None) as ws:
        data = pcm.tobytes()
        for i in range(0, len(data), 32000):
            await ws.send(data[i : i + 32000])
        await ws.send(orjson.dumps({"type": "stop"}).decode())
        messages, code = await messages_until_close(ws, timeout_s=60)
    assert code == 1000
    return messages


async def test_v1_finals_words_and_turns_carry_speakers(diarizer_files) -> None:
    from streamer.model.speakers.models import SpeakerModels

    worker = SpeakerWorker(lambda: SpeakerModels(diarizer_files))
    server = diarized_server(worker, max_wait_ms=timeout_s(30) * 1000).start()
    try:
        pcm, reference = two_voices()
        messages = await stream(server.url, pcm, "diarize=true&max_speakers=4")
        ready = messages[0]
        assert ready["options"]["diarize"] is True and ready["options"]["max_speakers"] == 4
        finals = [m for m in messages if m["type"] == "final"]
        assert finals and all(f["speaker"] in ("A", "B", "C", "D") for f in finals)
        assert len({f["speaker"] for f in finals}) >= 2
        for f in finals:
            assert f["turns"] and f["turns"][0]["start_ms"] >= f["start_ms"] - 1
            assert {w["speaker"] for w in f["words"]} <= {t["speaker"] for t in f["turns"]}
        # protocol v1's client parses them
        from streamer.core.protocol import decode_server_message

        parsed = [decode_server_message(orjson.dumps(f)) for f in finals]
        assert all(isinstance(p, Final) and p.speaker for p in parsed)
        # without diarize on the same server: no speaker fields anywhere
        plain = await stream(server.url, pcm[: SAMPLE_RATE * 6], "partials=false")
        assert not any("speaker" in m or "turns" in m for m in plain)
        assert "diarize" not in plain[0]["options"]
    finally:
        server.shutdown()


class StuckModels:
    """Speaker models that answer only when released (or after 60 s)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def analyse(self, segment_id: int, pcm: np.ndarray) -> SpeakerAnalysis:
        self.release.wait(timeout_s(60))
        return SpeakerAnalysis(segment_id, len(pcm))


async def test_late_speakers_never_hold_a_final_past_the_bound() -> None:
    stuck = StuckModels()
    server = diarized_server(SpeakerWorker(lambda: stuck), max_wait_ms=200).start()
    try:
        pcm, _ = two_voices()
        messages = await stream(server.url, pcm[: SAMPLE_RATE * 8], "diarize=true")
        finals = [m for m in messages if m["type"] == "final"]
        assert finals and all("speaker" not in f for f in finals)
        with urllib.request.urlopen(server.http_url + "/metrics", timeout=timeout_s(5)) as r:
            metrics = r.read().decode()
        late = [
            line
            for line in metrics.splitlines()
            if line.startswith('streamer_diarization_unlabelled_finals_total{reason="late"}')
        ]
        assert late and float(late[0].split()[-1]) >= len(finals)
    finally:
        stuck.release.set()
        server.shutdown()


@pytest.mark.parametrize(
    "voices, seed, max_der, max_confusion",
    [
        # the targets: DER <= 10 %, confusion <= 5 % (collar 0.25 s)
        (("reader", "digits"), 1, 0.10, 0.05),
        # the segmentation misses changes inside utterances here; the windowed embeddings
        # catch most of them (confusion 8.8 % without them, 4.5 % with)
        (("reader", "cards"), 0, 0.10, 0.05),
        (("reader", "cards", "digits"), 3, 0.10, 0.05),
    ],
)
def test_online_der_on_recorded_voices(
    diarizer_files, voices, seed, max_der, max_confusion
) -> None:
    from streamer.model.speakers.models import SpeakerModels
    from streamer.testkit.diarizer import conversation, der, diarize_stream

    models = SpeakerModels(diarizer_files)
    pcm, reference = conversation(list(voices), 16, seed=seed, overlap_every=4)
    # the live path: a diarized session's finals, their turns as the server sends them
    hypothesis = diarize_stream(models, pcm, DiarizationOptions()).online
    score = der(reference, hypothesis, collar_s=0.25)
    assert score.der <= max_der, score
    assert score.confusion <= max_confusion, score
