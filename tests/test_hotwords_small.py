"""The issue's acceptance check on random:small int8 (the real SenseVoiceSmall size).

random:small's logits are near flat, so a boosted phrase surfaces exactly when biasing
works: through v1 ``config``, Deepgram ``keywords`` (the real deepgram-sdk) and FunASR
``hotwords`` (the real funasr-client) it is in the finals, and never without it; a boost
of 0 gives the greedy text and segmentation does not change. test_hotwords_server.py has
the same on random:tiny, with every protocol and the error cases.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamer.core.capacity import CapacityOptions
from streamer.core.hotwords import Hotword
from streamer.server.server import ServerOptions
from streamer.testkit import speech as synth
from tests import compat_clients as clients
from tests.server_fixtures import ServerThread
from tests.support import funasr_finals, spans, texts, v1_finals

PHRASE = "kubernetes"  # random:small's pieces spell it: ▁k u b er n e t es
BOOST = 5.0


@pytest.fixture(scope="module")
def speech(speech_cache: Path) -> np.ndarray:
    clips = [("en", t, synth.speak(t, "en", cache_dir=speech_cache)) for t in ("hello there",)]
    pcm, _ = synth.join_with_silence(clips, 1200)
    return np.concatenate([pcm, np.zeros(16000, np.int16)])


@pytest.fixture(scope="module")
def server(small_model_dir: Path) -> Iterator[ServerThread]:
    def load():  # noqa: ANN202 - the server's loader
        from streamer.model.backends.torch_backend import Recognizer
        from streamer.model.options import RecognizerOptions

        options = RecognizerOptions(
            model=str(small_model_dir), device="cpu", threads=2, quantize="int8", warmup=False
        )
        return Recognizer(options)

    options = ServerOptions(funasr_port=0, capacity=CapacityOptions(enabled=False))
    thread = ServerThread(load, options).start()
    yield thread
    thread.shutdown()


async def test_a_boosted_phrase_surfaces_in_each_protocol_and_never_without(
    server: ServerThread, speech: np.ndarray
) -> None:
    greedy = await v1_finals(server.url, speech)
    assert greedy and not any(PHRASE in text for text in texts(greedy))

    boosted = await v1_finals(server.url, speech, hotwords=(Hotword(PHRASE, BOOST),))
    assert any(PHRASE in text for text in texts(boosted))
    assert spans(boosted) == spans(greedy)  # segmentation is the VAD's: unchanged
    assert await v1_finals(server.url, speech, hotwords=(Hotword(PHRASE, 0.0),)) == greedy

    query = {"keywords": f"{PHRASE}:{BOOST:g}"}
    deepgram = clients.deepgram_finals(
        await clients.deepgram_sdk_async(server.port, speech.tobytes(), **query)
    )
    assert any(PHRASE in text for text in deepgram)
    plain = clients.deepgram_finals(await clients.deepgram_sdk_async(server.port, speech.tobytes()))
    assert plain and not any(PHRASE in text for text in plain)

    funasr = await funasr_finals(server, speech, hotwords={PHRASE: BOOST * 10})
    assert any(PHRASE in text for text in funasr)
    funasr_plain = await funasr_finals(server, speech)
    assert funasr_plain and not any(PHRASE in text for text in funasr_plain)
