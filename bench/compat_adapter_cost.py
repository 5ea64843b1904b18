"""What the protocol adapters add on the server's path, timed without sockets or a model.

Latency benches on a shared machine measure the machine as much as the code. The
adapters run on the event loop between the socket and the session, so what they can add
to a result's latency is their own CPU time: translating each core message, and each
100 ms chunk of audio on the way in (decoding base64 JSON for OpenAI). This feeds the
same speech through a session behind each adapter (a fake worker answers at once), and
reports per-message and per-chunk times against protocol v1's adapter, best of
``--repeat`` runs (the least disturbed one).

    python -m bench.compat_adapter_cost --repeat 5
"""

from __future__ import annotations

import argparse
import base64
import statistics
import time
from collections.abc import Callable

import numpy as np
import orjson

from streamer.core.compat.deepgram import DeepgramAdapter, parse_listen_query
from streamer.core.compat.openai_realtime import RealtimeAdapter, RealtimeOptions
from streamer.core.jobs import DecodeResult
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session, SessionOptions
from streamer.core.transcript import Transcript
from streamer.core.vad import webrtc_classifier
from streamer.core.wire import V1Adapter, WireAdapter

RATE = 16000
CHUNK = RATE // 10  # 100 ms
TEXT = "the quick brown fox jumps over the lazy dog and keeps on running far away"


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Bursts of noise (speech for webrtcvad) between silences."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(int(seconds / 2.5)):
        parts += [np.zeros(RATE // 2, np.int16), (rng.normal(0, 3000, 2 * RATE)).astype(np.int16)]
    return np.concatenate(parts)


def answer(session: Session) -> None:
    for job in session.jobs_to_submit():
        words = TEXT.split()[: max(1, (job.end_sample - job.start_sample) // 4000)]
        raw = "<|en|><|NEUTRAL|><|Speech|><|withitn|>" + " ".join(words)
        t = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=1)
        session.decode_finished(DecodeResult(job=job, transcript=t, decode_ms=1))


def make(protocol: str) -> tuple[WireAdapter, Callable[[bytes], None]]:
    options = SessionOptions(model_name="bench")
    if protocol == "v1":
        session = Session("b", options, StreamOptions(), webrtc_classifier(2))
        adapter: WireAdapter = V1Adapter(session)
        return adapter, adapter.receive_bytes
    if protocol == "deepgram":
        query = {"encoding": "linear16", "sample_rate": "16000", "interim_results": "true",
                 "vad_events": "true", "utterance_end_ms": "1000"}  # fmt: skip
        listen = parse_listen_query(query, StreamOptions())
        session = Session("b", options, listen.stream, webrtc_classifier(2))
        adapter = DeepgramAdapter(session, listen, request_id="r", created="c")
        return adapter, adapter.receive_bytes
    session = Session("b", options, StreamOptions(sample_rate=RATE), webrtc_classifier(2))
    adapter = RealtimeAdapter(session, RealtimeOptions())
    update = {"type": "session.update", "session": {"audio": {"input": {
        "format": {"type": "audio/pcm", "rate": RATE}}}}}  # fmt: skip
    adapter.start()
    adapter.receive_text(orjson.dumps(update).decode())

    return adapter, adapter.receive_text


def run(protocol: str, pcm: bytes) -> tuple[float, float, int, int]:
    """(seconds in the input path, seconds in drain, chunks, frames out)."""
    adapter, send = make(protocol)
    if protocol != "openai":
        adapter.start()
    pieces: list = [pcm[i : i + 2 * CHUNK] for i in range(0, len(pcm), 2 * CHUNK)]
    if protocol == "openai":  # the client's JSON, encoded before the clock starts
        pieces = [
            orjson.dumps(
                {"type": "input_audio_buffer.append", "audio": base64.b64encode(p).decode()}
            ).decode()
            for p in pieces
        ]
    t_in = t_out = 0.0
    frames = chunks = 0
    for piece in pieces:
        t0 = time.perf_counter()
        send(piece)
        t1 = time.perf_counter()
        frames += sum(1 for f in adapter.drain() if f.data)  # count-only frames: not sent
        t2 = time.perf_counter()
        answer(adapter.session)
        t3 = time.perf_counter()
        frames += sum(1 for f in adapter.drain() if f.data)  # count-only frames: not sent
        t4 = time.perf_counter()
        t_in += t1 - t0
        t_out += (t2 - t1) + (t4 - t3)
        chunks += 1
    return t_in, t_out, chunks, frames


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="audio per run")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    pcm = speech_like(args.seconds).tobytes()
    print(f"{args.seconds:g} s of audio in 100 ms chunks; fastest of {args.repeat} runs")
    print("| protocol | per chunk in (session + adapter) | drain per frame out | frames out |")
    print("|---|---|---|---|")
    base_in = None
    for protocol in ("v1", "deepgram", "openai"):
        results = [run(protocol, pcm) for _ in range(args.repeat)]
        chunks, frames = results[0][2], results[0][3]
        # the least disturbed run of each measure (the machine is shared)
        per_chunk_us = min(r[0] for r in results) / chunks * 1e6
        per_frame_us = min(r[1] for r in results) / max(frames, 1) * 1e6
        median_chunk_us = statistics.median(r[0] for r in results) / chunks * 1e6
        base_in = base_in or per_chunk_us
        added = per_chunk_us - base_in
        print(f"| {protocol} | {per_chunk_us:.0f} us (median {median_chunk_us:.0f}; "
              f"{added:+.0f} vs v1) | {per_frame_us:.0f} us | {frames} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
