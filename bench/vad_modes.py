"""webrtcvad (each mode) and Silero VAD side by side, clean and in noise.

Synthesised utterances (five languages, known silences) are segmented by the server's
own session logic with each VAD, clean and with white, brown or recorded noise (alsa's
``Noise.wav``, looped) at 20, 10 and 5 dB SNR. Reported per condition: frame-level
agreement of the VAD's per-frame flags (what the segmenter sees) with the truth, silence
frames called speech, speech frames missed (means over ``--seeds`` noise seeds), the
segment counts found, for how many seeds every boundary is right (the check of
tests/test_server_model.py), and the worst start and end error (segment minus speech).
Then each VAD's CPU cost per real-time stream, by ``time.process_time`` over many frames.

    .venv/bin/python -m bench.vad_modes
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from streamer.core.segmenter import SegmentEnd, Segmenter, SegmenterOptions
from streamer.core.session import SessionOptions
from streamer.core.transcript import Transcript
from streamer.core.vad import FrameClassifier, frame_energy, webrtc_classifier
from streamer.model.interface import RecognizerBase
from streamer.offline import transcribe_pcm
from streamer.testkit import speech as synth

FRAME = 320  # 20 ms, the server's frame
RATE = 16000
PRE_ROLL_MS = 300  # a segment may start this much before the speech, no earlier
ONSET_TOLERANCE_MS = 60  # and this much more (tests/test_server_model.py)
END_SLACK_MS = 700  # end pad + VAD hangover (tests/test_server_model.py)
SNRS_DB = (20, 10, 5)
CPU_REPEATS = 3  # CPU costs are the least of this many runs (the machine may be shared)


class _Echo(RecognizerBase):
    name = "echo"

    def decode(self, pcm, *, language="auto", use_itn=True):
        return Transcript.from_raw("", rich="", token_ids=(), audio_ms=0, decode_ms=0)


def vads(webrtc_modes: list[int], silero: bool) -> dict[str, Callable[[], FrameClassifier]]:
    """Name -> factory of a fresh per-stream classifier."""
    found: dict[str, Callable[[], FrameClassifier]] = {
        f"webrtc {mode}": (lambda mode=mode: webrtc_classifier(mode)) for mode in webrtc_modes
    }
    if silero:
        from streamer.model.silero import silero_classifier_factory

        found["silero"] = silero_classifier_factory()
    return found


def with_noise(pcm: np.ndarray, kind: str, snr_db: float, seed: int = 3) -> np.ndarray:
    return synth.add_noise(pcm, snr_db, seed, kind=kind)


def boundary_errors(finals, truth) -> tuple[bool, float, float]:
    """(boundaries right, worst start error ms, worst end error ms); errors are final minus
    truth, NaN when the segment count is wrong."""
    if len(finals) != len(truth):
        return False, float("nan"), float("nan")
    right = True
    start_errors, end_errors = [], []
    for f, u in zip(finals, truth, strict=True):
        start_ms, end_ms = u.start_sample / 16, u.end_sample / 16
        right &= start_ms - PRE_ROLL_MS - ONSET_TOLERANCE_MS <= f.start_ms <= start_ms
        right &= end_ms - 60 <= f.end_ms <= end_ms + END_SLACK_MS
        right &= f.reason == "silence"
        start_errors.append(f.start_ms - start_ms)
        end_errors.append(f.end_ms - end_ms)
    worst_start = max(start_errors, key=abs)
    worst_end = max(end_errors, key=abs)
    return bool(right), worst_start, worst_end


def onset_study(pcm: np.ndarray, truth, seeds: int) -> None:
    """How often white noise at 20 dB SNR starts segments early, per onset threshold."""
    print(f"\nonset confirmation, white noise 20 dB, webrtc mode 2, {seeds} noise seeds")
    print("| min_speech_ms | seeds with wrong boundaries |")
    print("|---|---|")
    for min_speech_ms in (80, 100, 120):
        options = SessionOptions(segmenter=SegmenterOptions(min_speech_ms=min_speech_ms))
        wrong = 0
        for seed in range(seeds):
            noisy = synth.add_noise(pcm, 20, seed)
            finals = list(transcribe_pcm(_Echo(), noisy, session_options=options))
            wrong += not boundary_errors(finals, truth)[0]
        print(f"| {min_speech_ms} | {wrong} / {seeds} |")


def evaluate(
    signals: list[np.ndarray], truth, make: Callable[[], FrameClassifier]
) -> dict[str, float]:
    """Frame rates averaged over ``signals`` (one per noise seed); boundaries right
    counted; the worst errors over the signals whose segment count is right."""
    n = signals[0].size // FRAME
    labels = np.zeros(n, dtype=bool)
    for u in truth:
        labels[u.start_sample // FRAME : u.end_sample // FRAME] = True
    rows = []
    delays: list[float] = []
    for pcm in signals:
        classify = make()
        decided = np.array([classify(pcm[i * FRAME : (i + 1) * FRAME]) for i in range(n)])
        finals = list(transcribe_pcm(_Echo(), pcm, classifier=make()))
        right, start_error, end_error = boundary_errors(finals, truth)
        if right:
            delays += endpoint_delays_ms(pcm, decided, truth)
        rows.append(
            (
                np.mean(decided == labels),
                np.mean(decided[~labels]),
                np.mean(~decided[labels]),
                len(finals),
                right,
                start_error,
                end_error,
            )
        )
    table = np.array(rows, dtype=np.float64)
    counted = table[~np.isnan(table[:, 5])]
    worst = [c[int(np.argmax(np.abs(c)))] if c.size else float("nan") for c in counted[:, 5:7].T]
    segments = sorted({int(k) for k in table[:, 3]})
    return {
        "agreement": float(table[:, 0].mean()),
        "false_speech": float(table[:, 1].mean()),
        "missed_speech": float(table[:, 2].mean()),
        "segments": "/".join(map(str, segments)),
        "right": f"{int(table[:, 4].sum())} / {len(signals)}",
        "start_error": worst[0] if counted.size else float("nan"),
        "end_error": worst[1] if counted.size else float("nan"),
        "delay": float(np.median(delays)) if delays else float("nan"),
    }


def endpoint_delays_ms(pcm: np.ndarray, decided: np.ndarray, truth) -> list[float]:
    """For each utterance, how long after its last sample the segmenter ends it (the
    moment its final can be decoded), from the same per-frame decisions."""
    segmenter = Segmenter(SegmenterOptions())
    ended = []
    for i, flag in enumerate(decided):
        frame = pcm[i * FRAME : (i + 1) * FRAME]
        for event in segmenter.push(bool(flag), frame_energy(frame)):
            if isinstance(event, SegmentEnd):
                ended.append((i + 1) * FRAME)
    return [(e - u.end_sample) / 16 for e, u in zip(ended, truth, strict=True)]


def pause_study(make_by_vad: dict[str, Callable[[], FrameClassifier]], cache_dir: Path) -> None:
    """How much of a pause between two sentences each VAD hears as non-speech: the
    long-segment rule ends a segment at 100 ms of it (``long_endpoint_ms``)."""
    first = synth.speak(synth.SENTENCES["en"][0], "en", cache_dir=cache_dir)
    second = synth.speak(synth.SENTENCES["en"][2], "en", cache_dir=cache_dir)
    gaps_ms = (100, 150, 200, 250, 300, 400)
    print("\nlongest non-speech run (ms) inside a pause between two en sentences")
    print("| VAD | noise | " + " | ".join(f"{g} ms pause" for g in gaps_ms) + " |")
    print("|---|---|" + "---|" * len(gaps_ms))
    for vad, make in make_by_vad.items():
        for snr in (None, 10):
            cells = []
            for gap in gaps_ms:
                clips = [("en", "a", first), ("en", "b", second)]
                pcm, truth = synth.join_with_silence(clips, [gap, 1000])
                if snr is not None:
                    pcm = synth.add_noise(pcm, snr, seed=1)
                classify = make()
                decided = [
                    classify(pcm[i : i + FRAME]) for i in range(0, pcm.size - FRAME + 1, FRAME)
                ]
                inside = decided[truth[0].end_sample // FRAME : -(-truth[1].start_sample // FRAME)]
                longest = run = 0
                for flag in inside:
                    run = 0 if flag else run + 1
                    longest = max(longest, run)
                cells.append(str(longest * FRAME // 16))
            noise = "clean" if snr is None else f"white {snr} dB"
            print(f"| {vad} | {noise} | " + " | ".join(cells) + " |")


def cpu_cost(pcm: np.ndarray, make: Callable[[], FrameClassifier], seconds: float) -> float:
    """CPU seconds per second of audio for one stream's classifier (process time)."""
    frames = [pcm[i : i + FRAME] for i in range(0, pcm.size - FRAME + 1, FRAME)]
    classify = make()
    for frame in frames[:100]:  # warm-up
        classify(frame)
    frames_needed = int(seconds * RATE / FRAME)
    done = 0
    started = time.process_time()
    while done < frames_needed:
        for frame in frames:
            classify(frame)
        done += len(frames)
    return (time.process_time() - started) / (done * FRAME / RATE)


def session_cost(pcm: np.ndarray, make: Callable[[], FrameClassifier], seconds: float) -> float:
    """CPU seconds per second of audio for whole offline sessions (framing, VAD,
    segmenter, buffers; decodes answered empty at once)."""
    runs = max(1, round(seconds * RATE / pcm.size))
    started = time.process_time()
    for _ in range(runs):
        list(transcribe_pcm(_Echo(), pcm, classifier=make()))
    return (time.process_time() - started) / (runs * pcm.size / RATE)


_MEMORY_PROBE = """
import sys, numpy as np, psutil
rss = psutil.Process().memory_info
base = rss().rss
import onnxruntime
ort = rss().rss
from streamer.model.silero import SileroModel
model = SileroModel()
first = rss().rss
second = SileroModel()
more = rss().rss
classifiers = [model.classifier() for _ in range(1000)]
for classify in classifiers:
    classify(np.zeros(320, np.int16))
many = rss().rss
print(ort - base, first - ort, more - first, many - more)
"""


def silero_costs() -> None:
    """Memory (in a fresh process), and one Silero call by batch size (what batching
    streams would save)."""
    import subprocess
    import sys

    from streamer.model.silero import SileroModel

    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE], check=True, capture_output=True, text=True
    ).stdout.split()
    ort, first, second, many = (int(v) / 2**20 for v in out)
    print(
        f"\nSilero memory (RSS, fresh process): import onnxruntime +{ort:.1f} MiB, the model "
        f"+{first:.1f} MiB, a second model +{second:.1f} MiB, 1000 classifiers on one "
        f"model +{many:.1f} MiB"
    )
    model = SileroModel()
    session = model._session  # the bench looks inside: the server never batches
    rate = np.array(RATE, dtype=np.int64)
    print("| streams in one call | µs per call | µs per stream-window |")
    print("|---|---|---|")
    rng = np.random.default_rng(0)
    for batch in (1, 4, 16, 64):
        window = (rng.normal(0, 0.1, (batch, 576))).astype(np.float32)
        state = np.zeros((2, batch, 128), np.float32)
        calls = max(50, 4000 // batch)
        best = float("inf")
        for _ in range(CPU_REPEATS):
            started = time.process_time()
            for _ in range(calls):
                _, state = session.run(None, {"input": window, "state": state, "sr": rate})
            best = min(best, (time.process_time() - started) / calls)
        print(f"| {batch} | {best * 1e6:.0f} | {best * 1e6 / batch:.0f} |")


def ms(value: float) -> str:
    return "—" if np.isnan(value) else f"{value:+.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/speech"))
    parser.add_argument(
        "--webrtc-modes", default="2,3", help="comma-separated webrtcvad modes [%(default)s]"
    )
    parser.add_argument("--no-silero", action="store_true", help="webrtcvad only")
    parser.add_argument(
        "--noises", default="white,brown,recorded", help="noise kinds [%(default)s]"
    )
    parser.add_argument(
        "--seeds", type=int, default=10, help="noise seeds per noisy condition [%(default)s]"
    )
    parser.add_argument(
        "--cpu-s", type=float, default=120.0, help="audio seconds per CPU measurement"
    )
    parser.add_argument(
        "--onset-seeds",
        type=int,
        default=0,
        help="noise seeds for the webrtcvad onset-threshold study (0 skips it)",
    )
    args = parser.parse_args()
    modes = [int(m) for m in args.webrtc_modes.split(",") if m]
    classifiers = vads(modes, silero=not args.no_silero)
    clips = [(lang, synth.SENTENCES[lang][0]) for lang in ("en", "zh", "yue", "ja", "ko")]
    spoken = [
        (lang, text, synth.speak(text, lang, cache_dir=args.cache_dir)) for lang, text in clips
    ]
    pcm, truth = synth.join_with_silence(spoken, 1200)
    kinds = [k for k in args.noises.split(",") if k]
    conditions = [("clean", None, 0.0)] + [
        (f"{kind} {snr:g} dB", kind, snr) for kind in kinds for snr in SNRS_DB
    ]
    print(f"{len(truth)} utterances, {pcm.size / RATE:.1f} s")
    print(
        "| condition | VAD | frame agreement | silence called speech | speech missed "
        f"| segments (truth {len(truth)}) | boundaries right (seeds) | worst start error ms "
        "| worst end error ms | segment ended after speech ms (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, kind, snr in conditions:
        seeds = [0] if kind is None else range(args.seeds)
        signals = [pcm if kind is None else with_noise(pcm, kind, snr, seed) for seed in seeds]
        for vad, make in classifiers.items():
            r = evaluate(signals, truth, make)
            print(
                f"| {name} | {vad} | {r['agreement']:.1%} | {r['false_speech']:.1%} | "
                f"{r['missed_speech']:.1%} | {r['segments']} | {r['right']} | "
                f"{ms(r['start_error'])} | {ms(r['end_error'])} | {ms(r['delay'])} |"
            )

    noisy = with_noise(pcm, "white", 10)
    print(
        f"\nCPU per real-time stream, white noise 10 dB: the least of {CPU_REPEATS} runs of "
        f"{args.cpu_s / CPU_REPEATS:g} s of audio, alternating VADs"
    )
    print("| VAD | classifier µs per 20 ms frame | classifier % of a core | whole session % |")
    print("|---|---|---|---|")
    costs: dict[str, list[tuple[float, float]]] = {vad: [] for vad in classifiers}
    for _ in range(CPU_REPEATS):
        for vad, make in classifiers.items():
            costs[vad].append(
                (
                    cpu_cost(noisy, make, args.cpu_s / CPU_REPEATS),
                    session_cost(noisy, make, args.cpu_s / CPU_REPEATS),
                )
            )
    for vad, runs in costs.items():
        cost = min(c for c, _ in runs)
        whole = min(w for _, w in runs)
        print(f"| {vad} | {cost * 1e6 * FRAME / RATE:.0f} | {cost:.2%} | {whole:.2%} |")
    if "silero" in classifiers:
        silero_costs()
    pause_study(classifiers, args.cache_dir)
    if args.onset_seeds:
        onset_study(pcm, truth, args.onset_seeds)


if __name__ == "__main__":
    main()
