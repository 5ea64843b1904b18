"""Continuous speech through the real server: long segments end at pauses, and finals
decoded speculatively during the pause equal finals decoded after the endpoint.

Real webrtcvad, the shipped tagged model (funasr), real espeak speech, loopback server.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.session import SessionOptions
from streamer.testkit import speech as synth
from tests.server_fixtures import recognizer_loader

FOX = "the quick brown fox jumps over the lazy dog"
HELLO = "hello there"


def _conversation(speech_cache: Path) -> np.ndarray:
    """Two known sentences with 1 s pauses, then a run of them with short pauses."""
    fox = synth.speak(FOX, "en", cache_dir=speech_cache)
    hello = synth.speak(HELLO, "en", cache_dir=speech_cache)
    pcm, _ = synth.join_with_silence([("en", FOX, fox), ("en", HELLO, hello)], 1000)
    run, _ = synth.join_with_silence(
        [("en", FOX, fox), ("en", HELLO, hello), ("en", FOX, fox), ("en", HELLO, hello)], 250
    )
    return np.concatenate([pcm, run, np.zeros(16000, np.int16)])


async def _finals(make_server, model_dir: Path, pcm: np.ndarray, speculate: bool):
    base = SessionOptions()
    server = make_server(
        recognizer_loader(model_dir), session=replace(base, speculative_finals=speculate)
    )
    result = await transcribe(ClientOptions(url=server.url), pcm, 16000)
    assert result.end is not None
    return list(result.finals)


async def test_speculative_finals_equal_decoded_finals(make_server, tagged_model_dir, speech_cache):
    pcm = _conversation(speech_cache)
    with_speculation = await _finals(make_server, tagged_model_dir, pcm, True)
    without = await _finals(make_server, tagged_model_dir, pcm, False)
    key = [(f.text, f.raw, f.start_ms, f.end_ms, f.reason) for f in with_speculation]
    assert key == [(f.text, f.raw, f.start_ms, f.end_ms, f.reason) for f in without]
    texts = [f.text for f in with_speculation]
    assert texts[:2] == [FOX, HELLO]  # the model's exact transcripts of its two clips


async def test_continuous_run_is_cut_at_pauses_not_at_the_cap(
    make_server, tagged_model_dir, speech_cache
):
    finals = await _finals(make_server, tagged_model_dir, _conversation(speech_cache), True)
    assert all(f.reason == "silence" for f in finals), [(f.reason, f.end_ms) for f in finals]
    assert all(f.end_ms - f.start_ms <= 7000 for f in finals)
    assert len(finals) >= 4  # the 250 ms-pause run of ~9 s became at least two segments


def _run_without_pauses(speech_cache: Path) -> np.ndarray:
    """Twelve seconds of sentences 120 ms apart: gaps webrtcvad's hangover hides."""
    fox = synth.speak(FOX, "en", cache_dir=speech_cache)
    hello = synth.speak(HELLO, "en", cache_dir=speech_cache)
    clips = [("en", FOX, fox), ("en", HELLO, hello)] * 3
    pcm, _ = synth.join_with_silence(clips, 120)
    return np.concatenate([pcm, np.zeros(16000, np.int16)])


async def _segments(make_server, model_dir: Path, pcm: np.ndarray, pause_dip_ms: int):
    base = SessionOptions()
    segmenter = replace(base.segmenter, pause_dip_ms=pause_dip_ms)
    server = make_server(recognizer_loader(model_dir), session=replace(base, segmenter=segmenter))
    result = await transcribe(ClientOptions(url=server.url), pcm, 16000)
    assert result.end is not None
    return [(f.reason, f.start_ms, f.end_ms) for f in result.finals]


async def test_gaps_the_vad_does_not_see_end_long_segments_by_their_energy_dip(
    make_server, tagged_model_dir, speech_cache
):
    pcm = _run_without_pauses(speech_cache)
    with_dips = await _segments(make_server, tagged_model_dir, pcm, 60)
    vad_only = await _segments(make_server, tagged_model_dir, pcm, 0)
    assert "max_duration" in [reason for reason, _, _ in vad_only]  # the audio needs dips
    assert [reason for reason, _, _ in with_dips] == ["silence"] * len(with_dips), with_dips
    assert len(with_dips) >= 2
    for (_, start, end), (_, next_start, _) in zip(with_dips, with_dips[1:], strict=False):
        assert start < end <= next_start  # in order, nothing shared
