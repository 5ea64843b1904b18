"""Latency on continuous speech: onset and continuation segments, two server settings.

People who talk without stopping (a phone call, a monologue) leave pauses shorter than
the endpoint. This bench streams, in real time with one client, two kinds of audio:

* ``continuous``: two espeak voices taking turns of 5-20 s, with gaps of 100-400 ms
  between sentences and turns;
* ``recorded``: real recorded read speech (pocketsphinx-testdata: the librivox reader
  and the speakers of ``cards``/``goforward``/``numbers``/``something``) joined the same
  way, two voices taking turns;
* ``noisy``: ``continuous`` under brown noise at 10 dB SNR (``--snr-db``, ``--noise``);
* ``paused``: the espeak sentences with pauses of 0.9-1.7 s (the latency bench's kind).

and measures each segment against the audio's truth (where speech really is, from the
clips before they were joined):

* TTFT: arrival of the segment's first non-empty partial (or final) minus the send time
  of the first speech sample inside the segment;
* final latency: arrival of the final minus the send time of the last speech sample
  inside it (the endpoint is part of it).

Segments are *onset* segments when at least ``endpoint_ms`` of true silence precedes
their first speech, else *continuation* segments. Servers are started with the settings
of :data:`CONFIGS` chosen by ``--configs``: the current defaults ("new"), main before
energy dips and the near cut ("main"), and before long-segment pauses and speculative
finals too ("old"); they alternate in ``--rounds`` rounds within one run so a noisy
machine hits all alike. ``--trace`` prints, per segment, what it waited for: where it
started against its first speech, when the previous final arrived, its final's queue
and decode time.

    python -m bench.continuous --model random:small --quantize int8 --rounds 1 --trace
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import common
from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.client.timeline import SessionResult
from streamer.core.audio import SAMPLE_RATE
from streamer.core.protocol import Final, Partial, StreamOptions
from streamer.testkit import speech as synth

logger = logging.getLogger("bench.continuous")

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
LONG_GAPS_MS = (900, 1300, 1100, 1700, 1000, 1500)
CONFIGS = {
    "new": (),
    "long3s": ("--long-segment-ms", "3000"),  # candidate: shorter long segments
    # before energy dips and the near cut (what main did after the first part of issue 14)
    "main": ("--pause-dip-ms", "0", "--cut-search-ms", "1000"),
    # before long-segment pauses and speculative finals too
    "old": ("--long-segment-ms", "7000", "--no-speculative-finals", "--pause-dip-ms", "0",
            "--cut-search-ms", "1000"),
}  # fmt: skip


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
    for turn in range(6):
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
        del turn
    return clips


RECORDED = Path("/usr/share/pocketsphinx/test/data")
RECORDED_A = tuple(sorted((RECORDED / "librivox").glob("*.wav")))  # one reader
RECORDED_B = (*sorted((RECORDED / "cards").glob("*.wav")),) + tuple(
    RECORDED / f"{name}.raw" for name in ("goforward", "numbers", "something")
)  # other speakers


def _recorded_speech(pcm: np.ndarray) -> np.ndarray:
    """Per sample: inside a 20 ms frame 10 dB over the clip's noise floor (its quietest
    5 %) and within 26 dB of its loudest frames."""
    frame = SAMPLE_RATE // 50
    n = pcm.size // frame
    rms = np.sqrt(np.mean(pcm[: n * frame].astype(np.float64).reshape(n, frame) ** 2, axis=1))
    threshold = max(3 * float(np.percentile(rms, 5)), 0.05 * float(np.percentile(rms, 99)), 30.0)
    loud = np.repeat(rms > threshold, frame)
    return np.concatenate([loud, np.zeros(pcm.size - loud.size, bool)])


def _load_recorded(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A recorded clip trimmed to its speech (50 ms kept either side), and its truth."""
    if path.suffix == ".raw":
        pcm = np.fromfile(path, dtype="<i2")
    else:
        import soundfile as sf

        pcm, rate = sf.read(path, dtype="int16")
        assert rate == SAMPLE_RATE, path
    speech = _recorded_speech(pcm)
    loud = np.flatnonzero(speech)
    keep = slice(max(0, loud[0] - 800), loud[-1] + 800) if loud.size else slice(0, 0)
    return pcm[keep], speech[keep]


def recorded_turns() -> list[tuple[np.ndarray, int, np.ndarray]]:
    """The recorded clips of two speakers, alternating: (pcm, gap after it, truth)."""
    a = [_load_recorded(p) for p in RECORDED_A]
    b = [_load_recorded(p) for p in RECORDED_B]
    clips: list[tuple[np.ndarray, int, np.ndarray]] = []
    turns = [a[0:2], b[0:4], a[2:3], b[4:9], a[3:5]]  # turns of 5-12 s
    for turn in turns:
        for pcm, speech in turn:
            clips.append((pcm, SHORT_GAPS_MS[len(clips) % len(SHORT_GAPS_MS)], speech))
    return clips


def build_track(
    name: str,
    clips: list[tuple[np.ndarray, int]] | list[tuple[np.ndarray, int, np.ndarray]],
    snr_db: float | None = None,
    noise: str = "brown",
) -> Track:
    """Clips joined by their gaps (or LONG_GAPS_MS for ``paused``), with the truth of
    where speech is: a clip's own truth when it has one, else its samples over 64."""
    lead = np.zeros(SAMPLE_RATE, np.int16)
    parts, truth = [lead], [np.zeros(lead.size, bool)]
    for i, (pcm, gap_ms, *known) in enumerate(clips):
        if name == "paused":
            gap_ms = LONG_GAPS_MS[i % len(LONG_GAPS_MS)]
        gap = np.zeros(gap_ms * SAMPLE_RATE // 1000, np.int16)
        parts += [pcm, gap]
        loud = known[0] if known else np.abs(pcm.astype(np.int32)) > 64
        truth += [loud, np.zeros(gap.size, bool)]
    tail = np.zeros(2 * SAMPLE_RATE, np.int16)
    parts.append(tail)
    truth.append(np.zeros(tail.size, bool))
    pcm = np.concatenate(parts)
    if snr_db is not None:
        pcm = synth.add_noise(pcm, snr_db, seed=3, kind=noise)
    speech = np.concatenate(truth)
    # a sample is speech when a loud sample lies within 20 ms (syllables, not waveforms)
    window = SAMPLE_RATE // 50
    speech = np.convolve(speech.astype(np.int32), np.ones(window, np.int32), "same") > 0
    return Track(name, pcm, speech)


def segment_figures(result: SessionResult, track: Track, endpoint_ms: int) -> list[dict]:
    """Per final: kind (onset/continuation), TTFT, final latency, length, reason."""
    first_text: dict[int, float] = {}
    final_arrival: dict[int, float] = {}
    rows = []
    for item in result.messages:
        message = item.message
        if isinstance(message, Partial | Final) and message.text.strip():
            first_text.setdefault(message.segment_id, item.arrival_s)
        if not isinstance(message, Final):
            continue
        final_arrival[message.segment_id] = item.arrival_s
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
        previous = final_arrival.get(message.segment_id - 1)
        first_s = first_text[message.segment_id]
        rows.append(
            {
                "segment_id": message.segment_id,
                "kind": "continuation" if before.any() else "onset",
                "ttft_ms": (first_s - sent_first) * 1000,
                "final_ms": (item.arrival_s - sent_last) * 1000,
                "length_s": (end - start) / SAMPLE_RATE,
                "reason": message.reason,
                # the trace: what the segment waited for
                "start_lag_ms": (start - first_speech) * 1000 / SAMPLE_RATE,  # <0: starts early
                "decode_ms": message.decode_ms,  # its final's decode (0 when speculative)
                "queue_ms": message.queue_ms,
                # its first text came with the previous segment's final (held by ordering)
                "held": previous is not None and first_s - previous < 0.005,
                "prev_final_after_first_speech_ms": None
                if previous is None
                else (previous - sent_first) * 1000,
            }
        )
    return rows


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(rows: list[dict]) -> dict[str, dict[str, float | int | None]]:
    out: dict[str, dict[str, float | int | None]] = {}
    for kind in ("onset", "continuation", "all"):
        chosen = [r for r in rows if kind == "all" or r["kind"] == kind]
        ttft = [r["ttft_ms"] for r in chosen]
        final = [r["final_ms"] for r in chosen]
        out[kind] = {
            "n": len(chosen),
            "ttft_p50": _pct(ttft, 50),
            "ttft_p95": _pct(ttft, 95),
            "ttft_p99": _pct(ttft, 99),
            "final_p50": _pct(final, 50),
            "final_p95": _pct(final, 95),
            "final_p99": _pct(final, 99),
            "capped": sum(1 for r in chosen if r["reason"] == "max_duration"),
        }
    return out


async def _stream(url: str, track: Track) -> SessionResult:
    options = ClientOptions(url=url, stream=StreamOptions(language="en"))
    return await transcribe(options, track.pcm, SAMPLE_RATE, speed=1.0)


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
        return await _stream(url, track)

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tracks))))


def main() -> int:
    parser = common.parser(__doc__)
    common.add_server_args(parser)
    common.add_output_args(parser, out=None)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of old and new")
    parser.add_argument("--snr-db", type=float, default=10.0, help="SNR of the noisy track")
    parser.add_argument("--noise", default="brown", choices=synth.NOISE_KINDS)
    parser.add_argument(
        "--tracks", default="continuous,recorded,paused", help="of continuous,recorded,noisy,paused"
    )
    parser.add_argument(
        "--configs", default="new,main", help=f"server settings, of {','.join(CONFIGS)}"
    )
    parser.add_argument("--endpoint-ms", type=int, default=500)
    parser.add_argument("--clients", type=int, default=1, help="real-time clients at once")
    parser.add_argument("--trace", action="store_true", help="print every segment's trace")
    parser.add_argument("--json", type=Path, default=None, help="write every row here")
    args = parser.parse_args()
    common.setup_logging()

    clips = _turns(args.cache_dir / "speech", seed=1)
    builders = {
        "continuous": lambda: build_track("continuous", clips),
        "recorded": lambda: build_track("recorded", recorded_turns()),
        "noisy": lambda: build_track("noisy", clips, args.snr_db, args.noise),
        "paused": lambda: build_track("paused", clips),
    }
    tracks = [builders[name]() for name in args.tracks.split(",")]
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    for track in tracks:
        logger.info("%s: %.1f s of audio", track.name, track.pcm.size / SAMPLE_RATE)
    rows: dict[tuple[str, str], list[dict]] = {}
    started = time.time()
    for round_index in range(args.rounds):
        for config, extra in configs.items():
            log = Path("bench/out") / f"continuous-{config}-{round_index}.log"
            server = common.started_server(
                args, log, endpoint_ms=args.endpoint_ms, extra_args=extra
            )
            with server:
                for track in tracks:
                    each = [rotated(track, i, args.clients) for i in range(args.clients)]
                    results = asyncio.run(_stream_many(server.url, each, stagger_s=0.37))
                    figures = [
                        row
                        for result, client_track in zip(results, each, strict=True)
                        for row in segment_figures(result, client_track, args.endpoint_ms)
                    ]
                    rows.setdefault((config, track.name), []).extend(figures)
                    logger.info("round %d %s %s: %d segments", round_index, config, track.name,
                                len(figures))  # fmt: skip
    elapsed_s = time.time() - started
    print(f"# continuous-speech bench, {args.model} {args.quantize}, endpoint "
          f"{args.endpoint_ms} ms, {args.clients} clients, {args.rounds} rounds, "
          f"{elapsed_s:.0f} s")  # fmt: skip
    print("| audio | server | segments | n | TTFT p50 / p95 / p99 ms | final p50 / p95 / p99 ms "
          "| capped |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    table = {}
    for (config, track_name), chosen in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        summary = summarize(chosen)
        table[f"{track_name}/{config}"] = summary
        for kind, s in summary.items():

            def f(key: str, s: dict = s) -> str:
                value = s[key]
                return "-" if value is None else f"{value:.0f}"

            print(f"| {track_name} | {config} | {kind} | {s['n']} | {f('ttft_p50')} / "
                  f"{f('ttft_p95')} / {f('ttft_p99')} | {f('final_p50')} / {f('final_p95')} / "
                  f"{f('final_p99')} | {s['capped']} |")  # fmt: skip
    if args.trace:
        print("\n| audio | server | seg | kind | reason | length s | start lag ms | TTFT ms "
              "| held | prev final ms | final ms | queue ms | decode ms |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for (config, track_name), chosen in sorted(rows.items()):
            for r in chosen:
                prev = r["prev_final_after_first_speech_ms"]
                print(f"| {track_name} | {config} | {r['segment_id']} | {r['kind']} | "
                      f"{r['reason']} | {r['length_s']:.2f} | {r['start_lag_ms']:.0f} | "
                      f"{r['ttft_ms']:.0f} | {'yes' if r['held'] else ''} | "
                      f"{'-' if prev is None else f'{prev:.0f}'} | {r['final_ms']:.0f} | "
                      f"{r['queue_ms']:.0f} | {r['decode_ms']:.0f} |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": table, "rows": {
            f"{k[1]}/{k[0]}": v for k, v in rows.items()}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
