"""Choose the webrtcvad aggressiveness by measurement.

Synthesised utterances (five languages, known silences) are segmented by the server's
own session logic at each webrtcvad mode, clean and with white or brown noise at several
SNRs. Reported per condition: frame-level agreement of the raw VAD with the truth,
silence frames called speech, and whether the segments found match the utterances.

    .venv/bin/python bench/vad_modes.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from streamer.core.segmenter import SegmenterOptions
from streamer.core.session import SessionOptions
from streamer.core.transcript import Transcript
from streamer.core.vad import webrtc_classifier
from streamer.offline import transcribe_pcm
from streamer.testkit import speech as synth

FRAME = 320  # 20 ms
PRE_ROLL_MS = 300  # a segment may start this much before the speech, no earlier


class _Echo:
    name = "echo"

    def decode(self, pcm, *, language="auto", use_itn=True):
        return Transcript.from_raw("", rich="", token_ids=(), audio_ms=0, decode_ms=0)


def brown_noise(n: int, seed: int) -> np.ndarray:
    steps = np.random.default_rng(seed).normal(0, 1, n)
    walk = np.cumsum(steps)
    walk -= np.convolve(walk, np.ones(1600) / 1600, mode="same")  # keep it zero-mean
    return walk


def with_noise(pcm: np.ndarray, kind: str, snr_db: float, seed: int = 3) -> np.ndarray:
    if kind == "white":
        return synth.add_noise(pcm, snr_db, seed)
    noise = brown_noise(pcm.size, seed)
    speech = pcm.astype(np.float64)
    loud = speech[np.abs(speech) > 64]
    target = np.mean(loud**2) / 10 ** (snr_db / 10)
    noise *= np.sqrt(target / np.mean(noise**2))
    return np.clip(speech + noise, -32768, 32767).astype(np.int16)


def boundaries_right(finals, truth) -> bool:
    return len(finals) == len(truth) and all(
        u.start_sample / 16 - PRE_ROLL_MS - 60 <= f.start_ms <= u.start_sample / 16 + 60
        and f.end_ms >= u.end_sample / 16 - 60
        for f, u in zip(finals, truth, strict=True)
    )


def onset_study(pcm: np.ndarray, truth, seeds: int) -> None:
    """How often white noise at 20 dB SNR starts segments early, per onset threshold."""
    print(f"\nonset confirmation, white noise 20 dB, mode 2, {seeds} noise seeds")
    print("| min_speech_ms | seeds with wrong boundaries |")
    print("|---|---|")
    for min_speech_ms in (80, 100, 120):
        options = SessionOptions(segmenter=SegmenterOptions(min_speech_ms=min_speech_ms))
        wrong = 0
        for seed in range(seeds):
            noisy = synth.add_noise(pcm, 20, seed)
            finals = list(transcribe_pcm(_Echo(), noisy, session_options=options))
            wrong += not boundaries_right(finals, truth)
        print(f"| {min_speech_ms} | {wrong} / {seeds} |")


def evaluate(pcm: np.ndarray, truth, mode: int) -> dict[str, float]:
    classify = webrtc_classifier(mode)
    n = pcm.size // FRAME
    labels = np.zeros(n, dtype=bool)
    for u in truth:
        labels[u.start_sample // FRAME : u.end_sample // FRAME] = True
    decided = np.array([classify(pcm[i * FRAME : (i + 1) * FRAME]) for i in range(n)])
    finals = list(transcribe_pcm(_Echo(), pcm, vad_aggressiveness=mode))
    matched = boundaries_right(finals, truth)
    return {
        "agreement": float(np.mean(decided == labels)),
        "false_speech": float(np.mean(decided[~labels])),
        "missed_speech": float(np.mean(~decided[labels])),
        "segments": len(finals),
        "matched": matched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/speech"))
    parser.add_argument(
        "--onset-seeds",
        type=int,
        default=20,
        help="noise seeds for the onset-threshold study (0 skips it)",
    )
    args = parser.parse_args()
    clips = [(lang, synth.SENTENCES[lang][0]) for lang in ("en", "zh", "yue", "ja", "ko")]
    spoken = [
        (lang, text, synth.speak(text, lang, cache_dir=args.cache_dir)) for lang, text in clips
    ]
    pcm, truth = synth.join_with_silence(spoken, 1200)
    conditions = [("clean", None, 0.0)] + [
        (f"{kind} {snr:g} dB", kind, snr) for kind in ("white", "brown") for snr in (20, 10, 5)
    ]
    print(f"{len(truth)} utterances, {pcm.size / 16000:.1f} s")
    print(
        "| condition | mode | frame agreement | silence called speech | speech missed "
        "| segments (truth 5) | boundaries right |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, kind, snr in conditions:
        signal = pcm if kind is None else with_noise(pcm, kind, snr)
        for mode in range(4):
            r = evaluate(signal, truth, mode)
            print(
                f"| {name} | {mode} | {r['agreement']:.1%} | {r['false_speech']:.1%} | "
                f"{r['missed_speech']:.1%} | {r['segments']} | "
                f"{'yes' if r['matched'] else 'no'} |"
            )
    if args.onset_seeds:
        onset_study(pcm, truth, args.onset_seeds)


if __name__ == "__main__":
    main()
