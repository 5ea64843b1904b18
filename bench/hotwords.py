"""What hotwords cost on a final, and (with the real weights) what they gain.

Cost (the default): one recognizer (random:small int8 unless ``--model``) decodes espeak
speech of 3 and 7 s as finals with no hotwords (greedy) and with ``--phrases`` phrases
(the biased beam search, beam ``--beam``), interleaved round by round so that machine
noise hits both alike; the phrase set's graph is built before the timed rounds, as a
session's is at its first decode. Prints the medians and their ratio, and whether the
phrases changed the text.

    python -m bench.hotwords                       # random:small int8, 0 vs 100 phrases
    python -m bench.hotwords --model random:tiny --rounds 5

Gain (``--recall``, meaningful only with the real weights): each LibriVox clip of
pocketsphinx's test data is decoded without hotwords and with its ``--per-clip`` longest
transcript words as hotwords (the rarest, roughly); prints the share of those words
found in the finals both ways. Random weights give noise here, so there is no figure
for them in bench/RESULTS.md.

    python -m bench.hotwords --model iic/SenseVoiceSmall --recall
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import wave
from pathlib import Path

import numpy as np

from streamer.core.hotwords import DEFAULT_BOOST, Hotword, Hotwords
from streamer.core.jobs import DecodeJob
from streamer.model.decoding import CtcRecognizer
from streamer.model.loading import load_recognizer
from streamer.model.options import RecognizerOptions
from streamer.testkit.models import RANDOM_MODELS
from streamer.testkit.speech import SAMPLE_RATE, SENTENCES, speak

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
# words for the cost run's phrases: names and jargon of the kind people boost
_WORDS = (
    "kubernetes anthropic claude sensevoice funasr deepgram pipecat livekit grafana "
    "prometheus terraform ansible postgres redis kafka istio envoy nginx haproxy docker "
    "pytorch onnx cuda tensor vector embedding transformer decoder encoder latency "
    "throughput zurich lisbon nairobi osaka toronto quito hanoi bergen tbilisi mombasa"
).split()


def phrases(count: int, boost: float, seed: int = 0) -> Hotwords:
    """``count`` distinct phrases of one to three words from :data:`_WORDS`."""
    rng = np.random.default_rng(seed)
    found: dict[str, Hotword] = {}
    while len(found) < count:
        words = rng.choice(_WORDS, size=int(rng.integers(1, 4)), replace=False)
        text = " ".join(words)
        found[text] = Hotword(text, boost)
    return tuple(found.values())


def speech(seconds: float, cache_dir: Path) -> np.ndarray:
    clips = [speak(text, "en", cache_dir=cache_dir / "speech") for text in SENTENCES["en"]]
    signal = np.concatenate(clips)
    while signal.size < seconds * SAMPLE_RATE:
        signal = np.concatenate([signal, signal])
    return signal[: int(seconds * SAMPLE_RATE)]


def final_job(pcm: np.ndarray, words: Hotwords, segment: int) -> DecodeJob:
    return DecodeJob("bench", segment, "final", pcm, 0, pcm.size, "auto", True, hotwords=words)


def decode_ms(recognizer: CtcRecognizer, job: DecodeJob) -> tuple[float, str]:
    started = time.perf_counter()
    (transcript,) = recognizer.decode_jobs([job])
    return (time.perf_counter() - started) * 1000, transcript.text


def cost(args: argparse.Namespace, recognizer: CtcRecognizer) -> None:
    words = phrases(args.phrases, args.boost)
    print(
        f"model {args.model} ({args.quantize or 'fp32'}, {recognizer.device}), "
        f"{len(words)} phrases, boost {args.boost}, beam {args.beam}, {args.rounds} rounds"
    )
    print("| audio | no hotwords (ms) | with hotwords (ms) | ratio | text changed |")
    print("|---|---|---|---|---|")
    for seconds in (3.0, 7.0):
        pcm = speech(seconds, args.cache_dir)
        segment = 0
        for warm in ((), words):  # the graph is built here, once, as per session
            segment += 1
            decode_ms(recognizer, final_job(pcm, warm, segment))
        plain, biased = [], []
        texts: dict[bool, str] = {}
        for _ in range(args.rounds):
            for with_words in (False, True):
                segment += 1  # a new segment each time: no feature-cache reuse
                job = final_job(pcm, words if with_words else (), segment)
                ms, text = decode_ms(recognizer, job)
                (biased if with_words else plain).append(ms)
                texts[with_words] = text
        a, b = statistics.median(plain), statistics.median(biased)
        changed = "yes" if texts[True] != texts[False] else "no"
        print(f"| {seconds:.0f} s | {a:.0f} | {b:.0f} | {b / a:.2f}x | {changed} |")


def recall(args: argparse.Namespace, recognizer: CtcRecognizer) -> None:
    lines = (LIBRIVOX / "transcription").read_text().splitlines()
    found = {False: 0, True: 0}
    total = 0
    for segment, line in enumerate(lines):
        match = re.match(r"(.*)\((\S+)\)\s*$", line)
        if match is None:
            continue
        text, name = match.group(1).strip().lower(), match.group(2)
        path = LIBRIVOX / f"{name}.wav"
        if not path.exists():
            continue
        with wave.open(str(path)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
        targets = sorted(set(text.split()), key=len, reverse=True)[: args.per_clip]
        words = tuple(Hotword(t, args.boost) for t in targets)
        total += len(targets)
        for with_words in (False, True):
            job = final_job(pcm, words if with_words else (), 2 * segment + with_words)
            _, out = decode_ms(recognizer, job)
            heard = set(re.findall(r"[a-z']+", out.lower()))
            found[with_words] += sum(t in heard for t in targets)
    print(
        f"{total} hotwords in {len(lines)} clips: found without {found[False]} "
        f"({found[False] / max(total, 1):.0%}), with {found[True]} "
        f"({found[True] / max(total, 1):.0%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--quantize", default="int8", help="int8 or none")
    parser.add_argument("--phrases", type=int, default=100)
    parser.add_argument("--boost", type=float, default=DEFAULT_BOOST)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--recall", action="store_true", help="the gain, with real weights")
    parser.add_argument("--per-clip", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    quantize = None if args.quantize == "none" else args.quantize
    options = RecognizerOptions(
        model=args.model,
        backend=args.backend,
        quantize=quantize,
        threads=args.threads,
        warmup=True,
        hotword_beam=args.beam,
        hotword_partial_beam=min(2, args.beam),
        random_models=RANDOM_MODELS,
        **({"cache_dir": args.cache_dir} if args.cache_dir else {}),
    )
    args.cache_dir = options.cache_dir
    args.quantize = quantize
    recognizer = load_recognizer(options)
    assert isinstance(recognizer, CtcRecognizer)
    if args.recall:
        recall(args, recognizer)
    else:
        cost(args, recognizer)


if __name__ == "__main__":
    main()
