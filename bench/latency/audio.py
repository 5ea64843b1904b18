"""The speech the bench streams: generated (espeak-ng) and recorded (Debian packages).

Audio is kept as a list of :class:`Clip` (speech, then a known pause) so each client can
start at a different clip and loop for as long as the step lasts, always cutting at a
pause: every utterance then ends by silence, not by ``stop``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer.audio_io import load_audio
from streamer.core.audio import SAMPLE_RATE  # Hz, what the bench streams
from streamer.testkit import speech as synth

logger = logging.getLogger(__name__)

AUDIO_CHOICES = ("auto", "synth", "recorded", "mixed")

# Pauses after each clip, cycled: all longer than a 500 ms endpoint plus the VAD's
# hangover, and uneven so clients do not fall into lockstep.
GAPS_MS = (900, 1300, 1100, 1700, 1000, 1500)

LIBRIVOX_DIR = Path("/usr/share/pocketsphinx/test/data/librivox")  # pocketsphinx-testdata
CARDS_DIR = Path("/usr/share/pocketsphinx/test/data/cards")
ALSA_DIR = Path("/usr/share/sounds/alsa")  # alsa-utils: recorded words, 48 kHz


@dataclass(frozen=True)
class Clip:
    """One utterance and the pause that follows it."""

    source: str  # "synth:<lang>" or "recorded:<file name>"
    text: str  # what is said (best effort for recordings)
    pcm: np.ndarray  # int16 mono at SAMPLE_RATE
    gap_ms: int  # silence after the clip


@dataclass(frozen=True)
class BenchAudio:
    """The material a bench run streams, and a description for its report."""

    kind: str  # "synth", "recorded" or "mixed"
    clips: tuple[Clip, ...]

    def describe(self) -> dict[str, object]:
        """What a run's results say of it: the kind, the clips, their speech and sources."""
        speech_s = sum(clip.pcm.size for clip in self.clips) / SAMPLE_RATE
        sources = sorted({clip.source for clip in self.clips})  # synth:LANG, recorded:FILE
        return {
            "kind": self.kind,
            "clips": len(self.clips),
            "speech_s": round(speech_s, 2),
            "sources": sources,
        }


def synth_clips(cache_dir: Path) -> list[Clip]:
    """Every sentence of :data:`streamer.testkit.speech.SENTENCES`, languages interleaved."""
    by_language = [
        [(language, text) for text in texts] for language, texts in synth.SENTENCES.items()
    ]
    order: list[tuple[str, str]] = []
    for i in range(max(len(v) for v in by_language)):
        order.extend(v[i] for v in by_language if i < len(v))
    clips = []
    for i, (language, text) in enumerate(order):
        pcm = synth.speak(text, language, cache_dir=cache_dir)
        clips.append(Clip(f"synth:{language}", text, pcm, GAPS_MS[i % len(GAPS_MS)]))
    return clips


def recorded_clips() -> list[Clip]:
    """Real read speech (librivox, cards) and recorded words (alsa), when installed."""
    files: list[tuple[Path, str]] = []
    transcripts = _librivox_transcripts()
    for path in sorted(LIBRIVOX_DIR.glob("*.wav")):
        files.append((path, transcripts.get(path.stem, "")))
    files.extend((p, "") for p in sorted(CARDS_DIR.glob("*.wav")))
    files.extend(
        (p, p.stem.replace("_", " ").lower())
        for p in sorted(ALSA_DIR.glob("*.wav"))
        if p.stem != "Noise"
    )
    clips = []
    for i, (path, text) in enumerate(files):
        pcm = synth.trim_silence(load_audio(path, SAMPLE_RATE), threshold=300)
        if pcm.size < SAMPLE_RATE // 4:
            continue
        clips.append(Clip(f"recorded:{path.name}", text, pcm, GAPS_MS[i % len(GAPS_MS)]))
    return clips


def _librivox_transcripts() -> dict[str, str]:
    path = LIBRIVOX_DIR / "transcription"
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if "(" not in line:
            continue
        text, _, rest = line.rpartition("(")
        out[rest.rstrip(") ")] = text.replace("<s>", "").replace("</s>", "").strip()
    return out


def load_bench_audio(choice: str, cache_dir: Path) -> BenchAudio:
    """The audio for ``choice`` (one of :data:`AUDIO_CHOICES`).

    ``auto`` takes both kinds when both are available (``mixed``), else whichever is.
    Raises RuntimeError when nothing usable is installed.
    """
    if choice not in AUDIO_CHOICES:
        raise ValueError(f"audio must be one of {AUDIO_CHOICES}, got {choice!r}")
    want_synth = choice in ("auto", "synth", "mixed")
    want_recorded = choice in ("auto", "recorded", "mixed")
    synthesized = synth_clips(cache_dir) if want_synth and synth.tools_available() else []
    recorded = recorded_clips() if want_recorded else []
    if choice in ("synth", "mixed") and not synthesized:
        raise RuntimeError("generated speech needs espeak-ng and sox (apt-get install them)")
    if choice in ("recorded", "mixed") and not recorded:
        raise RuntimeError("recorded speech needs pocketsphinx-testdata or alsa-utils installed")
    if not synthesized and not recorded:
        raise RuntimeError("no bench audio: install espeak-ng and sox, or pocketsphinx-testdata")
    if synthesized and recorded:
        kind = "mixed"
        clips = _interleave(synthesized, recorded)
    else:
        kind = "synth" if synthesized else "recorded"
        clips = synthesized or recorded
    logger.info("bench audio: %s, %d clips", kind, len(clips))
    return BenchAudio(kind, tuple(clips))


def _interleave(a: list[Clip], b: list[Clip]) -> list[Clip]:
    return [clip for pair in itertools.zip_longest(a, b) for clip in pair if clip is not None]


def looped_speech(
    sentences: list[tuple[str, str]], cache_dir: Path, seconds: float, gap_ms: int
) -> np.ndarray:
    """``(language, text)`` sentences spoken by espeak-ng, each followed by ``gap_ms`` of
    silence, repeated to ``seconds`` of audio."""
    clips = [(lang, text, synth.speak(text, lang, cache_dir=cache_dir)) for lang, text in sentences]
    pcm, _ = synth.join_with_silence(clips, gap_ms, lead_ms=0)
    samples = int(seconds * SAMPLE_RATE)
    return np.tile(pcm, -(-samples // pcm.size))[:samples]


def client_track(
    clips: tuple[Clip, ...], first_clip: int, min_s: float, lead_ms: int, tail_ms: int
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One client's stream: clips from ``first_clip`` on, looping, at least ``min_s`` long.

    Starts with ``lead_ms`` of silence and ends with ``tail_ms`` of silence after the
    last clip's pause, so every utterance is closed by silence before the client stops.
    Returns the PCM and the ``[start, end)`` sample span of each clip's speech in it.
    """
    if not clips:
        raise ValueError("no clips")
    parts = [np.zeros(lead_ms * SAMPLE_RATE // 1000, dtype=np.int16)]
    spans: list[tuple[int, int]] = []
    length = parts[0].size
    i = first_clip % len(clips)
    min_samples = int(min_s * SAMPLE_RATE)
    while length < min_samples:
        clip = clips[i]
        gap = np.zeros(clip.gap_ms * SAMPLE_RATE // 1000, dtype=np.int16)
        parts.extend((clip.pcm.astype(np.int16), gap))
        spans.append((length, length + clip.pcm.size))
        length += clip.pcm.size + gap.size
        i = (i + 1) % len(clips)
    parts.append(np.zeros(tail_ms * SAMPLE_RATE // 1000, dtype=np.int16))
    return np.concatenate(parts), spans
