"""Hotwords end to end: each protocol's field reaching the decoder, on real servers.

random:tiny's logits are near flat, so a boosted phrase surfaces exactly when biasing
works: it is in the finals with it and never without. The real deepgram-sdk and
funasr-client send the fields (tests/compat_clients.py has the SDK's query).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import re
import urllib.parse
import urllib.request
import wave
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import orjson
import pytest
import soxr
import websockets

from streamer.core.capacity import CapacityOptions
from streamer.core.hotwords import Hotword
from streamer.core.jobs import DecodeJob
from streamer.core.session import SessionOptions
from streamer.model.backends.loading import load_recognizer
from streamer.model.decode.context_graph import ContextGraph
from streamer.model.decode.ctc import greedy_ctc
from streamer.model.decode.ctc_beam import biased_ctc
from streamer.model.decode.decoding import Utterance, as_waveform, language_row, textnorm_row
from streamer.model.options import RecognizerOptions
from streamer.model.serving.process import ProcessRecognizer
from streamer.server.server import ServerOptions
from streamer.testkit import speech as synth
from tests import compat_clients as clients
from tests.server_fixtures import ServerThread, recognizer_loader
from tests.support import funasr_finals, spans, texts, v1_finals
from tests.timing import timeout_s

RECORDED = Path(
    "/usr/share/pocketsphinx/test/data/librivox/sense_and_sensibility_01_austen_64kb-0870.wav"
)
UNLIMITED = CapacityOptions(enabled=False)
PHRASE = "kubernetes"  # spelt by random:tiny's vocabulary (ASCII + CJK pieces)
BOOST = 5.0


@pytest.fixture(scope="module")
def speech(speech_cache: Path) -> np.ndarray:
    texts = ("the quick brown fox jumps over the lazy dog", "hello there")
    clips = [("en", t, synth.speak(t, "en", cache_dir=speech_cache)) for t in texts]
    pcm, _ = synth.join_with_silence(clips, 1200)
    return np.concatenate([pcm, np.zeros(16000, np.int16)])


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    # sessions back to back at full speed: the load admission would refuse some
    options = ServerOptions(funasr_port=0, capacity=UNLIMITED)
    thread = ServerThread(recognizer_loader(tiny_model_dir), options).start()
    yield thread
    thread.shutdown()


@pytest.fixture(scope="module")
def greedy(server, speech) -> list[tuple[str, float, float]]:
    finals = asyncio.run(v1_finals(server.url, speech))
    assert len(finals) == 2 and all(finals)
    assert not any(PHRASE in text for text in texts(finals))
    return finals


async def test_v1_config_hotwords_reach_the_finals(server, speech, greedy) -> None:
    boosted = await v1_finals(server.url, speech, hotwords=(Hotword(PHRASE, BOOST),))
    assert any(PHRASE in text for text in texts(boosted))
    assert spans(boosted) == spans(greedy)  # segmentation is the VAD's: unchanged
    zero = await v1_finals(server.url, speech, hotwords=(Hotword(PHRASE, 0.0),))
    assert zero == greedy  # a boost of 0 is the greedy text


async def test_v1_query_hotwords_and_a_bad_one(server, speech, greedy) -> None:
    # the client sends its stream options as a config message; here the URL carries them
    url = f"{server.url}?hotwords={PHRASE}:{BOOST}"
    boosted = await v1_finals(url, speech)
    assert any(PHRASE in text for text in texts(boosted))
    async with websockets.connect(f"{server.url}?hotwords={PHRASE}:lots") as ws:
        error = orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(10)))
        assert (error["type"], error["code"]) == ("error", "invalid_hotwords")
        assert PHRASE not in error["message"]


async def test_a_phrase_the_model_cannot_spell_is_told_and_the_others_used(server, speech) -> None:
    messages = []
    async with websockets.connect(server.url) as ws:
        await ws.recv()  # ready
        config = {"type": "config", "hotwords": ["阿里巴巴", {"phrase": PHRASE, "boost": BOOST}]}
        await ws.send(orjson.dumps(config).decode())
        data = speech.tobytes()
        for i in range(0, len(data), 32000):
            await ws.send(data[i : i + 32000])
        await ws.send('{"type":"stop"}')
        async for raw in ws:
            messages.append(orjson.loads(raw))
    assert not [m for m in messages if m["type"] == "error"]  # a warning, never an error
    warnings = [m for m in messages if m["type"] == "warning"]
    assert [w["code"] for w in warnings] == ["hotwords_unused"]
    assert warnings[0]["message"].startswith("1 of 2 hotwords are not used")
    assert "阿里巴巴" not in warnings[0]["message"]  # phrases are not echoed
    assert any(PHRASE in m["text"] for m in messages if m["type"] == "final")
    assert notices(server) >= 1


def notices(server: ServerThread) -> float:
    """``streamer_notices_total{code="hotwords_unused"}`` as /metrics says it."""
    url = server.http_url + "/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s(5)) as response:
        text = response.read().decode()
    found = re.search(r'^streamer_notices_total\{code="hotwords_unused"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


UNSPELLABLE = "阿里巴巴"  # random:tiny's vocabulary has no piece for it


async def test_deepgram_live_tells_unused_keywords_in_metadata(server, speech) -> None:
    before = notices(server)
    url = (
        f"ws://127.0.0.1:{server.port}/v1/listen?encoding=linear16&sample_rate=16000"
        f"&keyterm={PHRASE}&keyterm={UNSPELLABLE}"
    )
    messages = []
    async with websockets.connect(url, additional_headers={"Authorization": "Token k"}) as ws:
        data = speech.tobytes()
        for i in range(0, len(data), 32000):
            await ws.send(data[i : i + 32000])
        await ws.send('{"type":"CloseStream"}')
        async with asyncio.timeout(timeout_s(30)):
            async for raw in ws:
                messages.append(orjson.loads(raw))
    assert "Error" not in [m["type"] for m in messages]
    (metadata,) = [m for m in messages if m["type"] == "Metadata"]
    (warning,) = metadata["warnings"]
    assert warning["parameter"] == "keywords" and warning["type"] == "hotwords_unused"
    assert warning["message"].startswith("1 of 2 hotwords are not used")
    finals = [m for m in messages if m["type"] == "Results" and m["is_final"]]
    assert any(PHRASE in m["channel"]["alternatives"][0]["transcript"] for m in finals)
    assert notices(server) == before + 1


async def test_openai_realtime_sentence_and_emoji_prompts_as_pipecat_sends_them(
    server, speech
) -> None:
    """pipecat waits for session.created, sends its update (manual commits) and treats
    every ``error`` as fatal (it reconnected 18 times in 8 s); LiveKit raises on one.
    A free-text prompt must give transcripts, and what the model cannot use is told in
    a session.updated's warnings."""
    pcm24 = soxr.resample(speech, 16000, 24000).astype(np.int16).tobytes()
    prompts = {
        "sentence": f"Please transcribe the meeting about {UNSPELLABLE} and its release.",
        "emoji": f"{PHRASE} 🚀, {UNSPELLABLE} 🎉",
    }
    for name, prompt in prompts.items():
        url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"
        events = []
        async with websockets.connect(url, additional_headers={"Authorization": "Bearer k"}) as ws:
            created = orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(10)))
            assert created["type"] == "session.created"
            session = copy.deepcopy(clients.GA_SESSION)
            session["audio"]["input"]["turn_detection"] = None  # pipecat's default
            session["audio"]["input"]["transcription"]["prompt"] = prompt
            await ws.send(orjson.dumps({"type": "session.update", "session": session}).decode())
            for i in range(0, len(pcm24), 3300):  # pipecat's 3300-byte appends
                chunk = base64.b64encode(pcm24[i : i + 3300]).decode()
                await ws.send(
                    orjson.dumps({"type": "input_audio_buffer.append", "audio": chunk}).decode()
                )
            await ws.send('{"type":"input_audio_buffer.commit"}')
            async with asyncio.timeout(timeout_s(30)):
                async for raw in ws:
                    events.append(orjson.loads(raw))
                    if events[-1]["type"].endswith("transcription.completed"):
                        break
        kinds = [e["type"] for e in events]
        assert "error" not in kinds, (name, [e for e in events if e["type"] == "error"])
        completed = events[-1]
        assert completed["transcript"], name
        updates = [e for e in events if e["type"] == "session.updated"]
        assert updates[0].get("warnings") is None  # the answer to the update itself
        warned = [e for e in updates if e.get("warnings")]
        assert [w["code"] for e in warned for w in e["warnings"]] == ["hotwords_unused"], name
        if name == "emoji":  # the phrase the model can spell is used
            assert PHRASE in completed["transcript"]


async def test_openai_realtime_as_livekit_sends_it(server, speech) -> None:
    """LiveKit's openai.STT(use_realtime=True): server VAD (350 ms), 2400-byte appends,
    never a commit, and it raises a non-retryable APIError on any ``error`` event; with
    a newer model it sends ``languages`` for ``language``. A sentence prompt with an
    emoji must still give its transcripts."""
    pcm24 = soxr.resample(speech, 16000, 24000).astype(np.int16).tobytes()
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription&model=gpt-transcribe"
    session = {
        "type": "transcription",
        "audio": {
            "input": {
                "format": {"rate": 24000, "type": "audio/pcm"},
                "transcription": {
                    "languages": ["en"],
                    "model": "gpt-transcribe",
                    "prompt": f"A call about {UNSPELLABLE} and the 🚀 launch of {PHRASE}.",
                },
                "turn_detection": {
                    "type": "server_vad",
                    "prefix_padding_ms": 600,
                    "silence_duration_ms": 350,
                    "threshold": 0.5,
                },
            }
        },
    }
    events = []
    async with websockets.connect(url, additional_headers={"Authorization": "Bearer k"}) as ws:
        await ws.send(orjson.dumps({"type": "session.update", "session": session}).decode())
        for i in range(0, len(pcm24), 2400):
            chunk = base64.b64encode(pcm24[i : i + 2400]).decode()
            await ws.send(
                orjson.dumps({"type": "input_audio_buffer.append", "audio": chunk}).decode()
            )
        completed = 0
        async with asyncio.timeout(timeout_s(30)):
            async for raw in ws:
                events.append(orjson.loads(raw))
                if events[-1]["type"].endswith("transcription.completed"):
                    completed += 1
                    if completed == 2:
                        break
    assert "error" not in [e["type"] for e in events], events
    transcripts = [e["transcript"] for e in events if e["type"].endswith(".completed")]
    assert len(transcripts) == 2 and all(transcripts)
    updated = [e for e in events if e["type"] == "session.updated"]
    assert updated[0]["session"]["audio"]["input"]["transcription"]["languages"] == ["en"]
    assert [w["code"] for e in updated for w in e.get("warnings", ())] == ["hotwords_unused"]


async def test_openai_realtime_keywords_and_languages(server, speech) -> None:
    """LiveKit sends ``languages`` and ``keywords`` (openai 3.60's fields) for newer
    transcription models instead of ``language`` and ``prompt``."""
    pcm24 = soxr.resample(speech, 16000, 24000).astype(np.int16).tobytes()
    session = copy.deepcopy(clients.GA_SESSION)
    transcription = session["audio"]["input"]["transcription"]
    del transcription["language"]
    transcription.update(languages=["zh", "en"], keywords=[PHRASE])
    events = await clients.openai_ga(server.port, pcm24, 2, session)
    assert "error" not in [e.type for e in events]
    assert any(PHRASE in t for t in clients.openai_transcripts(events))
    updated = next(e for e in events if e.type == "session.updated")
    echoed = updated.session.audio.input.transcription
    assert echoed.languages == ["zh", "en"] and echoed.keywords == [PHRASE]


def test_uploads_take_keywords_languages_and_skip_what_cannot_be_spelt(
    server, speech, tmp_path
) -> None:
    from openai import OpenAI

    path = tmp_path / "speech.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000)
        out.writeframes(speech.tobytes())
    client = OpenAI(api_key="k", base_url=f"http://127.0.0.1:{server.port}/v1", max_retries=0)
    before = notices(server)
    with path.open("rb") as f:
        plain = client.audio.transcriptions.create(
            model="whisper-1", file=f, response_format="verbose_json"
        )
    assert PHRASE not in plain.text
    with path.open("rb") as f:
        boosted = client.audio.transcriptions.create(
            model="gpt-transcribe",
            file=f,
            response_format="verbose_json",
            keywords=[PHRASE, UNSPELLABLE],
            languages=["ja", "en"],
            include=["logprobs"],
        )
    assert PHRASE in boosted.text
    assert boosted.language == "japanese"  # languages[0] forced, and reported as forced
    assert notices(server) == before + 1  # the unspellable one: counted, not an error
    # Deepgram's prerecorded answer says it in metadata.warnings
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/listen?keyterm={PHRASE}"
        f"&keyterm={urllib.parse.quote(UNSPELLABLE)}",
        data=path.read_bytes(),
        headers={"Authorization": "Token k", "Content-Type": "audio/wav"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s(30)) as response:
        body = orjson.loads(response.read())
    (warning,) = body["metadata"]["warnings"]
    assert (warning["parameter"], warning["type"]) == ("keywords", "hotwords_unused")
    transcript = body["results"]["channels"][0]["alternatives"][0]["transcript"]
    assert PHRASE in transcript


async def test_deepgram_sdk_keywords_and_keyterm(server, speech, greedy) -> None:
    for query in ({"keywords": f"{PHRASE}:{BOOST:g}"}, {"keyterm": PHRASE}):
        messages = await clients.deepgram_sdk_async(server.port, speech.tobytes(), **query)
        finals = clients.deepgram_finals(messages)
        assert any(PHRASE in text for text in finals), query
    plain = clients.deepgram_finals(await clients.deepgram_sdk_async(server.port, speech.tobytes()))
    assert not any(PHRASE in text for text in plain)


async def test_deepgram_sdk_parses_metadata_with_warnings(server, speech) -> None:
    messages = await clients.deepgram_sdk_async(server.port, speech.tobytes(), keyterm=UNSPELLABLE)
    assert None not in messages  # every message parsed to a known type
    assert type(messages[-1]).__name__ == "ListenV1Metadata"
    metadata = messages[-1].model_dump()  # the extra field kept as the SDK keeps extras
    assert metadata["warnings"][0]["type"] == "hotwords_unused", metadata


async def test_deepgram_bad_keyword_is_a_400_at_the_handshake(server) -> None:
    url = f"ws://127.0.0.1:{server.port}/v1/listen?keywords={PHRASE}:-4"
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(url, additional_headers={"Authorization": "Token k"})
    assert refused.value.response.status_code == 400
    body = orjson.loads(refused.value.response.body)
    assert body["err_code"] == "INVALID_HOTWORDS"


async def test_funasr_client_hotwords(server, speech) -> None:
    boosted = await funasr_finals(server, speech, hotwords={PHRASE: BOOST * 10})
    assert any(PHRASE in text for text in boosted)
    # FunASR's protocol has no place for a warning: one it cannot use is only counted
    before = notices(server)
    hotwords = {PHRASE: BOOST * 10, UNSPELLABLE: 20}
    assert any(PHRASE in text for text in await funasr_finals(server, speech, hotwords=hotwords))
    assert notices(server) == before + 1
    plain = await funasr_finals(server, speech)
    assert plain and not any(PHRASE in text for text in plain)


async def test_openai_realtime_prompt_terms(server, speech) -> None:
    pcm24 = soxr.resample(speech, 16000, 24000).astype(np.int16).tobytes()

    async def transcripts(prompt: str) -> list[str]:
        session = copy.deepcopy(clients.GA_SESSION)
        session["audio"]["input"]["transcription"]["prompt"] = prompt
        events = await clients.openai_ga(server.port, pcm24, 2, session)
        assert "error" not in [e.type for e in events]
        return clients.openai_transcripts(events)

    assert any(PHRASE in t for t in await transcripts(f"hello world, {PHRASE}"))
    assert not any(PHRASE in t for t in await transcripts(""))


async def test_server_wide_hotwords_reach_every_session(tiny_model_dir, speech, greedy) -> None:
    session = SessionOptions(hotwords=(Hotword(PHRASE, BOOST),))
    options = ServerOptions(session=session, capacity=UNLIMITED)
    thread = ServerThread(recognizer_loader(tiny_model_dir), options).start()
    try:
        boosted = await v1_finals(thread.url, speech)
        assert any(PHRASE in text for text in texts(boosted))
        # a session's own boost 0 for the same phrase overrides the server's
        assert await v1_finals(thread.url, speech, hotwords=(Hotword(PHRASE, 0.0),)) == greedy
    finally:
        thread.shutdown()


# -- the recognizer: both backends, and the model in a process of its own -------------------


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_both_backends_and_the_no_hotword_path(tiny_model_dir, cache_dir, speech, backend):
    options = RecognizerOptions(
        model=str(tiny_model_dir), backend=backend, device="cpu", threads=1,
        cache_dir=cache_dir, warmup=False,
    )  # fmt: skip
    recognizer = load_recognizer(options)
    pcm = speech[: 3 * 16000]

    def final(hotwords=()) -> DecodeJob:
        return DecodeJob("s", 0, "final", pcm, 0, pcm.size, "auto", True, hotwords=hotwords)

    (plain,) = recognizer.decode_jobs([final()])
    (zero,) = recognizer.decode_jobs([final((Hotword(PHRASE, 0.0),))])
    (boosted,) = recognizer.decode_jobs([final((Hotword(PHRASE, BOOST),))])
    assert zero.token_ids == plain.token_ids and zero.token_frames == plain.token_frames
    assert PHRASE not in plain.text and PHRASE in boosted.text
    # word timings come from the search's path: every token has its frames, in order
    assert len(boosted.token_frames) == len(boosted.token_ids) == len(boosted.token_end_frames)
    assert list(boosted.token_frames) == sorted(boosted.token_frames)
    # and the search with no bonus on the same logits is the greedy path, token for
    # token, on this speech and on recorded speech (a LibriVox reading)
    with wave.open(str(RECORDED)) as recording:
        recorded = np.frombuffer(recording.readframes(recording.getnframes()), np.int16)
    for audio in (pcm, recorded):
        request = Utterance(as_waveform(audio), language_row("auto"), textnorm_row(True))
        (logits,) = recognizer._logits([request])
        unbiased = biased_ctc(logits, ContextGraph([], []), banned_ids=recognizer.banned_ids)
        assert unbiased == greedy_ctc(logits, banned_ids=recognizer.banned_ids)
        assert len(unbiased.ids) > 20
    banned = recognizer.banned_ids
    assert biased_ctc(logits, ContextGraph([], []), banned_ids=banned).ids == plain_of(
        recognizer, recorded
    )


def plain_of(recognizer, pcm: np.ndarray) -> tuple[int, ...]:
    job = DecodeJob("r", 1, "final", pcm, 0, pcm.size, "auto", True)
    (transcript,) = recognizer.decode_jobs([job])
    return transcript.token_ids


def test_hotwords_cross_into_the_model_process(tiny_model_dir, cache_dir, speech) -> None:
    options = RecognizerOptions(
        model=str(tiny_model_dir), device="cpu", threads=1, cache_dir=cache_dir, warmup=False
    )
    remote = ProcessRecognizer(partial(load_recognizer, options))
    try:
        pcm = speech[: 3 * 16000]
        job = DecodeJob("s", 0, "final", pcm, 0, pcm.size, "auto", True)
        (plain,) = remote.decode_jobs([job])
        (boosted,) = remote.decode_jobs([replace(job, hotwords=(Hotword(PHRASE, BOOST),))])
        assert PHRASE not in plain.text and PHRASE in boosted.text
    finally:
        remote.close()
