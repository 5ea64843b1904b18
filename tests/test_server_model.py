"""Real speech through the real server (webrtcvad + funasr tiny models) over loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.protocol import Final, Partial, StreamOptions
from streamer.core.transcript import parse_tags
from streamer.testkit import speech as synth
from tests.support import ONSET_TOLERANCE_MS, assert_boundaries, five_languages


async def test_five_languages_segment_at_known_silences(server_url, speech_cache):
    pcm, truth = five_languages(speech_cache)
    result = await transcribe(ClientOptions(url=server_url), pcm, 16000)
    assert_boundaries(list(result.finals), truth)
    assert result.end is not None and result.end.segments == 5
    for final in result.finals:
        assert final.raw is not None and final.decode_ms > 0


async def test_noisy_speech_at_20_db_snr(server_url, speech_cache):
    pcm, truth = five_languages(speech_cache)
    noisy = synth.add_noise(pcm, snr_db=20, seed=7)
    result = await transcribe(ClientOptions(url=server_url), noisy, 16000)
    assert_boundaries(list(result.finals), truth)


async def test_monologue_is_cut_into_segments_of_at_most_7_s(server_url, speech_cache):
    sentences = synth.SENTENCES["en"] * 2
    spoken = [("en", s, synth.speak(s, "en", cache_dir=speech_cache)) for s in sentences]
    # 150 ms pauses: shorter than the endpoint (and hidden from webrtcvad by its
    # hangover), so only the energy dips of long segments and the 7 s cap can cut
    pcm, truth = synth.join_with_silence(spoken, 150, lead_ms=400)
    assert pcm.size / 16000 > 14
    result = await transcribe(ClientOptions(url=server_url), pcm, 16000)
    finals = list(result.finals)
    assert len(finals) >= 3
    assert all(f.end_ms - f.start_ms <= 7000 for f in finals)
    assert all(f.reason in ("silence", "max_duration") for f in finals[:-1])
    assert all(f.end_ms - f.start_ms >= 4000 for f in finals[:-1])  # long segments only
    for a, b in zip(finals, finals[1:], strict=False):
        # nothing repeated; a cap's cut tiles the audio, a dip's end leaves only quiet out
        assert b.start_ms == a.end_ms if a.reason == "max_duration" else b.start_ms >= a.end_ms
        if a.reason == "silence":
            gap = pcm[int(a.end_ms * 16) : int(b.start_ms * 16)].astype(np.int32)
            assert gap.size == 0 or np.abs(gap).max() < 1000
    # the speech is covered from its first to its last sample
    assert finals[0].start_ms <= truth[0].start_sample / 16
    assert finals[-1].end_ms >= truth[-1].end_sample / 16 - 60


def librivox_files():
    folder = Path("/usr/share/pocketsphinx/test/data/librivox")
    return sorted(folder.glob("*.wav"))[:3]


async def test_recorded_speech_nothing_lost(server_url):
    files = librivox_files()
    assert files, "pocketsphinx-testdata is not installed"
    parts, spans, position = [], [], 0
    for path in files:
        audio, rate = sf.read(path, dtype="int16")
        assert rate == 16000
        gap = np.zeros(24000, dtype=np.int16)
        parts += [audio, gap]
        spans.append((position / 16, (position + audio.size) / 16))
        position += audio.size + gap.size
    pcm = np.concatenate(parts)
    result = await transcribe(ClientOptions(url=server_url), pcm, 16000, speed=None)
    finals = list(result.finals)
    assert len(finals) >= len(files)
    # every recording's loud part lies inside some final: no speech lost
    frame = 320
    energy = np.array(
        [
            np.abs(pcm[i : i + frame].astype(np.int32)).mean()
            for i in range(0, pcm.size - frame, frame)
        ]
    )
    loud = np.flatnonzero(energy > 4 * np.median(energy[energy > 0]))
    covered = sum(any(f.start_ms <= i * 20 < f.end_ms for f in finals) for i in loud)
    assert covered / loud.size > 0.97
    assert all(f.end_ms - f.start_ms <= 7000 for f in finals)


async def test_resampled_recording_at_48_khz(server_url):
    audio, rate = sf.read("/usr/share/sounds/alsa/Front_Center.wav", dtype="int16")
    assert rate == 48000
    pcm = np.concatenate([np.zeros(24000, np.int16), audio, np.zeros(48000, np.int16)])
    result = await transcribe(ClientOptions(url=server_url), pcm, 48000)
    assert result.ready.sample_rate == 48000
    assert len(result.finals) == 1
    # "front center" starts at 0.5 s of the stream
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > 500)
    assert result.finals[0].start_ms <= loud[0] / 48 + ONSET_TOLERANCE_MS
    assert result.finals[0].end_ms >= loud[-1] / 48 - 60
    assert result.end.audio_ms == pytest.approx(pcm.size / 48, abs=1)


async def test_tags_are_fields_in_partials_and_finals(tagged_server_url, speech_cache):
    fox = synth.speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=speech_cache)
    hello = synth.speak("hello there", "en", cache_dir=speech_cache)
    pcm, _ = synth.join_with_silence([("en", "fox", fox), ("en", "hello", hello)], 1500)
    options = ClientOptions(url=tagged_server_url, stream=StreamOptions(itn=False))
    result = await transcribe(options, pcm, 16000, speed=4.0)
    finals = list(result.finals)
    assert [(f.language, f.emotion, f.event, f.text) for f in finals] == [
        ("en", "NEUTRAL", "Speech", "the quick brown fox jumps over the lazy dog"),
        ("en", "HAPPY", "Laughter", "hello there"),
    ]
    assert finals[1].raw == "<|en|><|HAPPY|><|Laughter|><|woitn|>hello there"
    assert "hello there" in finals[1].rich
    partials = [m.message for m in result.messages if isinstance(m.message, Partial)]
    assert partials, "no partial was sent"
    for p in partials:
        tags = parse_tags(p.raw)
        assert (p.language, p.emotion, p.event, p.text) == (
            tags.language,
            tags.emotion,
            tags.event,
            tags.text,
        )
    assert any(p.language == "en" for p in partials)
    assert all(isinstance(f, Final) for f in finals)


async def test_concurrent_real_model_clients(server_url, speech_cache):
    pcm, truth = five_languages(speech_cache, gap_ms=1000)
    results = await asyncio.gather(
        *[transcribe(ClientOptions(url=server_url), pcm, 16000) for _ in range(8)]
    )
    reference = [(f.start_ms, f.end_ms, f.raw) for f in results[0].finals]
    assert len(reference) == len(truth)
    for result in results[1:]:
        # same audio, same cuts, same decode: concurrency changes nothing
        assert [(f.start_ms, f.end_ms, f.raw) for f in result.finals] == reference
