"""Issue 33: the live container decoder's cost per 250 ms slice, FFmpeg's swresample (a
checkout before 27f8d99, given as argv[1]) against the uploads' soxr MonoConverter (this
checkout), interleaved three times on the same WebM/Opus and Ogg/Opus bytes.

    STREAMER_CACHE_DIR=.cache python bench/results-incoming/issue-33-decoder-cost.py OLD
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from streamer.media import decoder as new_decoder  # noqa: E402
from streamer.testkit import speech as synth  # noqa: E402
from tests.audio_files import write_audio  # noqa: E402

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today"]


def load_old(checkout: str):
    path = f"{checkout}/streamer/media/decoder.py"
    spec = importlib.util.spec_from_file_location("old_decoder", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(decoder_module, container: str, data: bytes, step: int) -> tuple[float, float]:
    """(median ms per slice, ms for the whole stream)."""
    decoder = decoder_module.ContainerDecoder(container, 16000)
    times = []
    for i in range(0, len(data), step):
        started = time.perf_counter()
        decoder.push(data[i : i + step])
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    decoder.flush()
    times.append(time.perf_counter() - started)
    decoder.close()
    return statistics.median(times) * 1000, sum(times) * 1000


def main() -> None:
    old = load_old(sys.argv[1])
    cache = Path(os.environ.get("STREAMER_CACHE_DIR", ".cache")) / "tts"
    clips = [("en", t, synth.speak(t, "en", cache_dir=cache)) for t in TEXTS * 4]
    pcm, _ = synth.join_with_silence(clips, 1000)
    duration_s = pcm.size / 16000
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    folder = Path(tempfile.mkdtemp())
    for kind in ("webm", "ogg-opus"):
        data = write_audio(pcm, 16000, kind, folder / f"speech.{kind}").read_bytes()
        slices = int(duration_s / 0.25)
        step = -(-len(data) // slices)
        container = {"ogg-opus": "ogg"}.get(kind, kind)
        print(f"{kind}: {duration_s:.1f} s of audio, {len(data)} bytes, {slices} slices")
        for _ in range(3):
            for name, module in (("swresample", old), ("soxr MonoConverter", new_decoder)):
                results.setdefault((kind, name), []).append(run(module, container, data, step))
    for (kind, name), runs in results.items():
        medians = ", ".join(f"{m:.3f}" for m, _ in runs)
        totals = ", ".join(f"{t:.1f}" for _, t in runs)
        print(f"  {kind:8} {name:18} per slice (median) ms: {medians}; whole stream ms: {totals}")


if __name__ == "__main__":
    main()
