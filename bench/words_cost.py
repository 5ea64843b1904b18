"""What word timings cost per final: grouping the tokens into words, and the message.

Decodes espeak speech with the shipped tagged model (real English words) and with the
random tiny model (as many tokens as a 7 s final can hold: one per 60 ms frame), then
times :func:`streamer.core.words.transcript_words` on each transcript, and the v1
final's encoding and decoding with and without its ``words``, next to the decode itself.
Best of ``--repeat`` rounds of ``--number`` calls (the least disturbed one: the machine
may be shared); the decode is the median of five.

    python -m bench.words_cost --repeat 7
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson

from streamer.core.protocol import Final, decode_server_message, encode
from streamer.core.words import transcript_words
from streamer.model.loading import load_recognizer
from streamer.model.options import RecognizerOptions
from streamer.testkit.models import ensure_random_model
from streamer.testkit.speech import speak

FOX = "the quick brown fox jumps over the lazy dog"
MONOLOGUE = (
    "streaming speech recognition should feel instant, and every word of a caption "
    "should appear where it was spoken, even in a long sentence like this one"
)


def per_call_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    rounds = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - started) / number * 1e6)
    return min(rounds)  # the least disturbed round


def old_encode(message: Final) -> bytes:
    """How messages were encoded before words: through dataclasses.asdict (deep copies)."""
    return orjson.dumps({"type": message.type, **dataclasses.asdict(message)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache"))
    args = parser.parse_args()

    speech = args.cache_dir / "speech"
    fox = speak(FOX, "en", cache_dir=speech)
    long = speak(MONOLOGUE, "en", cache_dir=speech)[: 7 * 16000]
    cases = [
        ("tagged", "fox clip, 2.8 s", fox),
        ("tiny", "speech, 7 s", np.resize(long, 7 * 16000)),
    ]
    print(
        "| transcript | tokens | words | decode (ONNX) | words grouping | final encode"
        " without / with words | the same with dataclasses.asdict (the old encode)"
        " | bytes without / with | client decode without / with |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, label, pcm in cases:
        directory = ensure_random_model(model, args.cache_dir)
        recognizer = load_recognizer(
            RecognizerOptions(
                model=str(directory),
                backend="onnx",
                device="cpu",
                threads=2,
                warmup=False,
                cache_dir=args.cache_dir,
            )
        )
        transcript = recognizer.decode(pcm, language="auto", use_itn=False)
        decode_ms = statistics.median(
            recognizer.decode(pcm, language="auto", use_itn=False).decode_ms for _ in range(5)
        )
        end_ms = pcm.size / 16
        words = transcript_words(transcript, 1000.0, 1000.0 + end_ms)
        grouping = per_call_us(
            lambda t=transcript, e=end_ms: transcript_words(t, 1000.0, 1000.0 + e),
            args.number,
            args.repeat,
        )
        plain = Final(
            segment_id=0, start_ms=1000.0, end_ms=1000.0 + end_ms, text=transcript.text,
            language=transcript.language, emotion=transcript.emotion, event=transcript.event,
            raw=transcript.raw, rich=transcript.rich, reason="silence", decode_ms=decode_ms,
            queue_ms=0.0,
        )  # fmt: skip
        timed = Final(**{**plain.__dict__, "words": words})
        encode_plain = per_call_us(lambda m=plain: encode(m), args.number, args.repeat)
        encode_timed = per_call_us(lambda m=timed: encode(m), args.number, args.repeat)
        asdict_plain = per_call_us(lambda m=plain: old_encode(m), args.number, args.repeat)
        asdict_timed = per_call_us(lambda m=timed: old_encode(m), args.number, args.repeat)
        data_plain, data_timed = encode(plain), encode(timed)
        decode_plain = per_call_us(
            lambda d=data_plain: decode_server_message(d), args.number, args.repeat
        )
        decode_timed = per_call_us(
            lambda d=data_timed: decode_server_message(d), args.number, args.repeat
        )
        print(
            f"| {model}: {label} | {len(transcript.token_ids)} | {len(words)} "
            f"| {decode_ms:.1f} ms | {grouping:.1f} µs "
            f"| {encode_plain:.1f} / {encode_timed:.1f} µs "
            f"| {asdict_plain:.1f} / {asdict_timed:.1f} µs "
            f"| {len(data_plain)} / {len(data_timed)} "
            f"| {decode_plain:.1f} / {decode_timed:.1f} µs |"
        )


if __name__ == "__main__":
    main()
