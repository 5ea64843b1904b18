"""Latency on continuous speech: onset and continuation segments
(``python -m bench.latency --audio continuous``).

People who talk without stopping (a phone call, a monologue) leave pauses shorter than
the endpoint. The track streamed in real time by each client: two espeak voices taking
turns of 5-20 s, with gaps of 100-400 ms between sentences and turns. (Issue 14 also
streamed recorded, noisy and paused tracks: ``git show a1a79a6:bench/latency/continuous.py``.)

Each segment is measured against the audio's truth (where speech really is, from the clips
before they were joined): **TTFT**, arrival of the segment's first non-empty partial (or
final) minus the send time of the first speech sample inside it; **final**, arrival of the
final minus the send time of the last speech sample inside it (the endpoint is part of
it). Segments are *onset* segments when at least ``endpoint_ms`` of true silence precedes
their first speech, else *continuation* segments. Several clients stream the track from
other places of it, 0.37 s apart. Server settings to compare go in ``--server-arg``, one run
each (the settings compared for issue 14 are in bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import markdown_table, percentiles
from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.client.timeline import SessionResult
from streamer.core.audio import SAMPLE_RATE
from streamer.core.protocol import Final, Partial, StreamOptions
from streamer.testkit import speech as synth

logger = logging.getLogger(__name__)

TRACKS = ("continuous",)

VOICES = (("en-us+m3", 40), ("en-us+f2", 70))  # (espeak voice, pitch): two speakers
SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "please turn on the lights in the kitchen",
    "streaming speech recognition should feel instant",
    "we are going to eat dinner together this evening",
    "what time is it today and how is the weather",
    "send a message to mom tomorrow morning",
    "the river runs past the mountain and the city",
    "one two three four five six seven eight nine ten",
)
SHORT_GAPS_MS = (100, 250, 400, 150, 300, 200, 350)


@dataclass(frozen=True)
class Track:
    name: str
    pcm: np.ndarray
    speech: np.ndarray  # bool per sample: inside a spoken clip (trimmed of silence)


def _turns(cache_dir: Path, seed: int) -> list[tuple[np.ndarray, int]]:
    """Clips of two voices in turns of 5-20 s; each clip with the gap that follows it."""
    rng = np.random.default_rng(seed)
    clips: list[tuple[np.ndarray, int]] = []
    speaker = 0
    for _ in range(6):
        voice, pitch = VOICES[speaker]
        target_s = float(rng.uniform(5, 20))
        spoken_s = 0.0
        while spoken_s < target_s:
            text = SENTENCES[int(rng.integers(len(SENTENCES)))]
            pcm = synth.speak(text, "en", cache_dir=cache_dir, voice=voice, pitch=pitch)
            gap = SHORT_GAPS_MS[len(clips) % len(SHORT_GAPS_MS)]
            clips.append((pcm, gap))
            spoken_s += (pcm.size / SAMPLE_RATE) + gap / 1000
        speaker = 1 - speaker
    return clips


def build_track(name: str, clips: list[tuple[np.ndarray, int]]) -> Track:
    """Clips joined by their gaps, with the truth of where speech is: samples over 64."""
    lead = np.zeros(SAMPLE_RATE, np.int16)
    parts, truth = [lead], [np.zeros(lead.size, bool)]
    for pcm, gap_ms in clips:
        gap = np.zeros(gap_ms * SAMPLE_RATE // 1000, np.int16)
        parts += [pcm, gap]
        truth += [np.abs(pcm.astype(np.int32)) > 64, np.zeros(gap.size, bool)]
    tail = np.zeros(2 * SAMPLE_RATE, np.int16)
    parts.append(tail)
    truth.append(np.zeros(tail.size, bool))
    pcm = np.concatenate(parts)
    speech = np.concatenate(truth)
    # a sample is speech when a loud sample lies within 20 ms (syllables, not waveforms)
    window = SAMPLE_RATE // 50
    speech = np.convolve(speech.astype(np.int32), np.ones(window, np.int32), "same") > 0
    return Track(name, pcm, speech)


def segment_figures(result: SessionResult, track: Track, endpoint_ms: int) -> list[dict]:
    """Per final: kind (onset/continuation), TTFT, final latency, length, reason."""
    first_text: dict[int, float] = {}
    rows = []
    for item in result.messages:
        message = item.message
        if isinstance(message, Partial | Final) and message.text.strip():
            first_text.setdefault(message.segment_id, item.arrival_s)
        if not isinstance(message, Final):
            continue
        start = int(message.start_ms * SAMPLE_RATE / 1000)
        end = int(message.end_ms * SAMPLE_RATE / 1000)
        inside = np.flatnonzero(track.speech[start:end])
        if inside.size == 0 or message.segment_id not in first_text:
            continue
        first_speech, last_speech = start + int(inside[0]), start + int(inside[-1])
        before = track.speech[
            max(0, first_speech - endpoint_ms * SAMPLE_RATE // 1000) : first_speech
        ]
        sent_first = result.sent_time_s(first_speech)
        sent_last = result.sent_time_s(last_speech)
        if sent_first is None or sent_last is None:
            continue
        first_s = first_text[message.segment_id]
        rows.append(
            {
                "segment_id": message.segment_id,
                "kind": "continuation" if before.any() else "onset",
                "ttft_ms": (first_s - sent_first) * 1000,
                "final_ms": (item.arrival_s - sent_last) * 1000,
                "length_s": (end - start) / SAMPLE_RATE,
                "reason": message.reason,
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in ("onset", "continuation", "all"):
        chosen = [r for r in rows if kind == "all" or r["kind"] == kind]
        out[kind] = {
            "n": len(chosen),
            "ttft_ms": percentiles(r["ttft_ms"] for r in chosen),
            "final_ms": percentiles(r["final_ms"] for r in chosen),
            "capped": sum(1 for r in chosen if r["reason"] == "max_duration"),
        }
    return out


def rotated(track: Track, index: int, clients: int) -> Track:
    """Client ``index`` of ``clients`` streams the track from another place (so their
    segments do not end together), with the silent lead kept first."""
    lead = SAMPLE_RATE
    shift = (track.pcm.size - lead) * index // clients
    pcm = np.concatenate([track.pcm[:lead], np.roll(track.pcm[lead:], -shift)])
    speech = np.concatenate([track.speech[:lead], np.roll(track.speech[lead:], -shift)])
    return Track(track.name, pcm, speech)


async def _stream_many(url: str, tracks: list[Track], stagger_s: float) -> list[SessionResult]:
    async def one(i: int, track: Track) -> SessionResult:
        await asyncio.sleep(i * stagger_s)
        options = ClientOptions(url=url, stream=StreamOptions(language="en"))
        return await transcribe(options, track.pcm, SAMPLE_RATE, speed=1.0)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tracks))))


def build(name: str, cache_dir: Path, duration_s: float) -> Track:
    """The track ``name`` (``continuous``), cut after ``duration_s`` (the whole track is
    about 83 s), 2 s of silence after."""
    track = build_track(name, _turns(cache_dir, seed=1))
    cut = int(duration_s * SAMPLE_RATE)
    if cut >= track.pcm.size:
        return track
    tail = 2 * SAMPLE_RATE
    pcm = np.concatenate([track.pcm[:cut], np.zeros(tail, np.int16)])
    return Track(name, pcm, np.concatenate([track.speech[:cut], np.zeros(tail, bool)]))


def run(url: str, track: Track, clients: int, rounds: int, endpoint_ms: int) -> dict[str, Any]:
    """``clients`` at once, ``rounds`` times: the summary by segment kind and every row."""
    each = [rotated(track, i, clients) for i in range(clients)]
    rows = []
    for round_index in range(rounds):
        results = asyncio.run(_stream_many(url, each, stagger_s=0.37))
        for result, client_track in zip(results, each, strict=True):
            rows += segment_figures(result, client_track, endpoint_ms)
        logger.info("%s, %d clients, round %d: %d segments", track.name, clients,
                    round_index + 1, len(rows))  # fmt: skip
    return {"summary": summarize(rows), "rows": rows}


def table(results: dict[str, Any]) -> str:
    head = "audio|clients|segments|n|TTFT p50 / p95 / p99 ms|final p50 / p95 / p99 ms|capped"

    def ms(p: dict[str, float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:.0f}" for v in p.values())

    rows = [
        [results["audio"], clients, kind, s["n"], ms(s["ttft_ms"]), ms(s["final_ms"]), s["capped"]]
        for clients, step in results["steps"].items()
        for kind, s in step["summary"].items()
    ]
    return markdown_table(head.split("|"), rows)
