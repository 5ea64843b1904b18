"""Files over HTTP: an upload's speed and time to first text beside funasr's
AutoModel.generate on the same weights, and what an upload costs a live client.

    flock /tmp/bench.lock python -m bench files --model random:small --quantize int8 \
        --parts throughput
    flock /tmp/bench.lock python -m bench files --model random:small --quantize int8 \
        --parts interference --also-server=--file-worker

**throughput**: recordings of about 30 and 300 seconds are built from real read
speech (pocketsphinx-testdata's librivox and cards, alsa-utils' words; ``--audio``) with
pauses of 0.9 to 1.7 s, written as 16 kHz WAV under ``--out``. Then, in each round, one
after the other on the same loaded processes (so drift on a shared machine hits all
alike), each recording goes through:

- the server's ``POST /v1/audio/transcriptions`` with ``stream=true``: the time to the
  first ``transcript.text.delta`` and to ``transcript.text.done`` from the request's
  start;
- funasr's ``AutoModel.generate`` with the SenseVoice recipe
  (``generate(input=path, cache={}, language="auto", use_itn=True, batch_size_s=60,
  merge_vad=True, merge_length_s=15)``) on the torch directory the server's model comes
  from (the ONNX files are exported from it), in a process of its own with ``ncpu`` =
  ``--threads``. The recipe's ``fsmn-vad`` comes from the model hub, which is out of
  reach here: funasr 1.4.16's own ``vad_model="silero-vad"`` (the silero-vad package's
  ONNX graph, ``max_single_segment_time`` 30 s) stands in for it (its time apart was
  timed at 276f9f2).
  ``--funasr fp32,int8``: the weights as they are, and with torch's dynamic int8
  quantization of the Linear layers (what the project's torch backend does).
  (``streamer transcribe`` on the same recordings, the same decodes after its load, was
  timed beside them at 276f9f2.)

Speed is audio seconds per wall second (x real time). generate() answers once, so its
first text is its end.

**interference**: one real-time protocol v1 client (``bench.latency``'s client, partials
on, 100 ms chunks) streams 60 s of speech, alone and then while the longest
recording is uploaded with ``stream=true`` again and again (a new upload as soon as one
is done, so the whole stream overlaps one); two rounds alternate the order. Its final latency
(the final's arrival minus the send time of the utterance's last sample) is compared:
p50, p95 and the p95 ratio with the upload to without. ``--also-server=--file-worker``
(repeatable) starts one more server with those arguments, loaded beside the default one,
and the rounds take the servers in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import logging
import multiprocessing
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import soundfile as sf

from bench import common
from bench.latency.audio import AUDIO_CHOICES, SAMPLE_RATE, client_track, load_bench_audio
from bench.latency.load import StepOptions, plan_clients, run_client, warm_up
from bench.latency.metrics import percentiles, segment_latencies

logger = logging.getLogger("bench.files")

PATH = "/v1/audio/transcriptions"
UPLOAD_TIMEOUT_S = 600.0  # one socket operation (the server sends SSE keepalives)
FUNASR_RECIPE: dict[str, Any] = {
    "cache": {},
    "language": "auto",
    "use_itn": True,
    "batch_size_s": 60,
    "merge_vad": True,
    "merge_length_s": 15,
}
FUNASR_VAD_KWARGS = {"max_single_segment_time": 30000, "silero_onnx": True}
UPLOAD_RETRY_S = 5.0  # after a failed upload during a live stream
LENGTHS_S = [30, 300]  # the recordings (at least)
LIVE_S, LIVE_ROUNDS = 60.0, 2  # the live stream; interference rounds (alone, with uploads)


# ---------------------------------------------------------------------------
# Recordings


def build_recordings(
    lengths_s: list[int], audio_choice: str, cache_dir: Path, folder: Path
) -> tuple[list[Path], Path]:
    """A 16 kHz mono WAV of at least each length (speech clips with their pauses,
    looping), and a 5 s one for warming up."""
    audio = load_bench_audio(audio_choice, cache_dir / "speech")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, length_s, first_clip in [("warm-up", 5, 1)] + [
        (f"speech-{n}s", n, 0) for n in lengths_s
    ]:
        pcm, _ = client_track(audio.clips, first_clip, float(length_s), lead_ms=300, tail_ms=500)
        sf.write(folder / f"{name}.wav", pcm, SAMPLE_RATE, subtype="PCM_16")
        paths.append(folder / f"{name}.wav")
    return paths[1:], paths[0]


def wav_seconds(path: Path) -> float:
    return float(sf.info(path).duration)


# ---------------------------------------------------------------------------
# The server's upload (OpenAI's transcriptions API)


@dataclass
class Upload:
    """What one upload took (seconds from the request's start)."""

    started: float = 0.0  # time.monotonic() at the request's start
    first_delta_s: float | None = None
    total_s: float | None = None
    deltas: int = 0
    text: str = ""
    deltas_match_done: bool | None = None  # the deltas concatenated are the done text
    error: str | None = None


def multipart_body(path: Path) -> tuple[bytes, str]:
    """The form the openai SDK sends (model, ``stream=true``, the WAV) and its content type."""
    boundary = secrets.token_hex(16)
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in (("model", "whisper-1"), ("stream", "true"))
    )
    body += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"'
        "\r\nContent-Type: audio/wav\r\n\r\n"
    ).encode()
    body += path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def sse_events(lines: Any) -> Any:
    """The JSON payloads of server-sent events read line by line (comments skipped)."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield json.loads("\n".join(data))
            data = []
    if data:
        yield json.loads("\n".join(data))


class Uploader:
    """Uploads to one server; :meth:`abort` breaks the upload under way (from any thread)."""

    def __init__(self, http_url: str) -> None:
        parts = urlsplit(http_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self._conn: http.client.HTTPConnection | None = None

    def abort(self) -> None:
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def upload(self, path: Path) -> Upload:
        """``path`` uploaded with ``stream=true``, its events read as they come."""
        body, content_type = multipart_body(path)
        result = Upload(started=time.monotonic())
        conn = http.client.HTTPConnection(self.host, self.port, timeout=UPLOAD_TIMEOUT_S)
        self._conn = conn
        try:
            conn.request("POST", PATH, body=body, headers={"Content-Type": content_type})
            response = conn.getresponse()
            if response.status != 200:
                result.error = f"HTTP {response.status}: {response.read()[:300]!r}"
                return result
            self._read_stream(response, result)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
            result.error = f"{type(error).__name__}: {error}"
        finally:
            self._conn = None
            conn.close()
        return result

    @staticmethod
    def _read_stream(response: http.client.HTTPResponse, result: Upload) -> None:
        deltas: list[str] = []
        for event in sse_events(response):
            now = time.monotonic() - result.started
            if event.get("type") == "transcript.text.delta":
                deltas.append(event["delta"])
                if result.first_delta_s is None and event["delta"].strip():
                    result.first_delta_s = now
            elif event.get("type") == "transcript.text.done":
                result.total_s = now
                result.text = event["text"]
                result.deltas_match_done = "".join(deltas) == event["text"]
            elif "error" in event:
                result.error = str(event["error"])
        result.deltas = len(deltas)
        if result.total_s is None and result.error is None:
            result.error = "the stream ended without transcript.text.done"


# ---------------------------------------------------------------------------
# funasr's AutoModel.generate, in a process of its own


def funasr_child(connection: Any, model_dir: str, precision: str, threads: int) -> None:
    """Load AutoModel (with the silero-vad stand-in), answer ``path`` with timings."""
    logging.basicConfig(level=logging.WARNING)  # before AutoModel, which configures it
    import torch
    from funasr import AutoModel

    started = time.monotonic()
    model = AutoModel(
        model=model_dir, vad_model="silero-vad", vad_kwargs=dict(FUNASR_VAD_KWARGS),
        device="cpu", disable_update=True, disable_pbar=True, ncpu=threads,
        log_level="WARNING", frontend_conf={"dither": 0.0},
    )  # fmt: skip
    if precision == "int8":
        torch.ao.quantization.quantize_dynamic(
            model.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
        )
    connection.send({"load_s": time.monotonic() - started})
    while (path := connection.recv()) is not None:
        t0 = time.perf_counter()
        result = model.generate(input=path, **dict(FUNASR_RECIPE, cache={}))
        total_s = time.perf_counter() - t0
        text = " ".join(r.get("text", "") for r in result)
        connection.send({"total_s": total_s, "text_chars": len(text)})


class FunasrProcess:
    """A child process holding one AutoModel (``precision`` fp32 or int8).

    Its OpenMP threads sleep when idle (OMP_WAIT_POLICY PASSIVE), as the server's ONNX
    Runtime threads do (``allow_spinning`` 0): torch's spinning threads are several times
    slower beside other busy processes on 2 cores."""

    def __init__(self, model_dir: Path, precision: str, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self.process = context.Process(
            target=funasr_child, args=(child_end, str(model_dir), precision, threads)
        )
        before = os.environ.get("OMP_WAIT_POLICY")
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read once, when the child loads torch
        try:
            self.process.start()
        finally:
            if before is None:
                del os.environ["OMP_WAIT_POLICY"]
            else:
                os.environ["OMP_WAIT_POLICY"] = before
        self.load_s = float(self._conn.recv()["load_s"])

    def generate(self, path: Path) -> dict[str, Any]:
        self._conn.send(str(path))
        return dict(self._conn.recv())

    def close(self) -> None:
        self._conn.send(None)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


# ---------------------------------------------------------------------------
# throughput


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from streamer.testkit.models import ensure_random_model

    paths, warm = build_recordings(LENGTHS_S, args.audio, args.cache_dir, args.out / "audio")
    model_dir = (
        ensure_random_model(args.model.split(":", 1)[1], args.cache_dir)
        if args.model.startswith("random:")
        else Path(args.model)
    )
    rows: list[dict[str, Any]] = []
    loads: dict[str, float | None] = {}
    server_args = ("--threads", str(args.threads))
    with common.started_server(args, args.out / "server.log", extra_args=server_args) as server:
        loads["server"] = server.load_s
        uploader = Uploader(common.http_base(server.url))
        uploader.upload(warm)  # the first decodes pay for warm-up
        funasr = {}
        try:
            for precision in args.funasr:
                funasr[precision] = FunasrProcess(model_dir, precision, args.threads)
                loads[f"funasr {precision}"] = funasr[precision].load_s
                funasr[precision].generate(warm)
            for round_index in range(args.rounds):
                for path in paths:
                    base = {"round": round_index, "file": path.name, "audio_s": wav_seconds(path),
                            "loadavg_1m_before": os.getloadavg()[0]}  # fmt: skip
                    up = asdict(uploader.upload(path))
                    rows.append(_row(base, "upload stream=true", up))
                    for precision, child in funasr.items():
                        out = child.generate(path)
                        out["first_text_s"] = out["total_s"]  # generate() answers once
                        rows.append(_row(base, f"AutoModel.generate {precision}", out))
        finally:
            for child in funasr.values():
                child.close()
    return {"rows": rows, "loads_s": loads, "model_dir": str(model_dir)}


def _row(base: dict[str, Any], method: str, measured: dict[str, Any]) -> dict[str, Any]:
    logger.info("%s %s: %s", base["file"], method, measured)
    return {**base, "loadavg_1m_after": os.getloadavg()[0], "method": method, **measured}


def throughput_table(result: dict[str, Any]) -> str:
    """One line per file and method: speed, first text, and the ratio to AutoModel."""
    head = "file|audio s|method|wall s|x real time|first text s|upload speed / this".split("|")
    lines = []
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in result["rows"]:
        groups.setdefault((row["round"], row["file"]), []).append(row)
    for (_, name), rows in groups.items():
        upload = next((r for r in rows if r["method"] == "upload stream=true"), None)
        upload_s = upload["total_s"] if upload else None
        for row in rows:
            wall = row.get("total_s")
            first = row.get("first_delta_s") or row.get("first_text_s")
            speed = None if not wall else row["audio_s"] / wall
            ratio = None if not (wall and upload_s) else wall / upload_s
            lines.append([name, f"{row['audio_s']:.1f}", _label(row), _f(wall),
                          _f(speed, "{:.1f}"), _f(first), _f(ratio, "{:.2f}x")])  # fmt: skip
    return common.markdown_table(head, lines)


def _label(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"{row['method']} ERROR {row['error']}"
    return str(row["method"])


def _spread(values: list[float]) -> str:
    """``median (min-max)x`` of speeds; ``-`` when there are none."""
    if not values:
        return "-"
    return f"{np.median(values):.1f}x ({min(values):.1f}-{max(values):.1f}x)"


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


# ---------------------------------------------------------------------------
# interference


@dataclass
class Phase:
    condition: str  # "alone" or "upload"
    round: int
    server: str = "default"  # which server configuration
    final_s: list[float] = field(default_factory=list)
    overlapped_final_s: list[float] = field(default_factory=list)  # while an upload ran
    uploads: list[dict[str, Any]] = field(default_factory=list)
    client_error: str | None = None


async def live_phase(
    url: str, plan: Any, options: StepOptions, upload_path: Path | None, phase: Phase
) -> None:
    """One live client's stream; with ``upload_path``, uploads of it back to back."""
    stop = threading.Event()
    uploader = Uploader(common.http_base(url))
    windows: list[tuple[float, float]] = []

    def keep_uploading() -> None:
        assert upload_path is not None
        while not stop.is_set():
            up = uploader.upload(upload_path)
            end = up.started + (up.total_s if up.total_s is not None else 1e9)
            windows.append((up.started, min(end, time.monotonic())))
            phase.uploads.append(asdict(up) | {"aborted": stop.is_set()})
            if up.error is not None and not stop.is_set():
                logger.warning("upload failed: %s", up.error)
                stop.wait(UPLOAD_RETRY_S)

    thread = threading.Thread(target=keep_uploading, daemon=True)
    if upload_path is not None:
        thread.start()
    try:
        record = await run_client(plan, options)
    finally:
        stop.set()
        uploader.abort()
        if upload_path is not None:
            await asyncio.to_thread(thread.join, 60.0)
    phase.client_error = record.error
    log = record.send_log()
    for segment in segment_latencies(record.arrivals, log, plan.speech_spans):
        if segment.final_s is None or segment.reason == "stop" or segment.end_ms is None:
            continue
        phase.final_s.append(segment.final_s)
        sent_end = log.time_of_end_ms(segment.end_ms)
        if sent_end is not None and any(a <= sent_end <= b for a, b in windows):
            phase.overlapped_final_s.append(segment.final_s)


async def interference_async(
    args: argparse.Namespace, urls: dict[str, str], upload: Path
) -> list[Phase]:
    """Each server's live phases, alone and with uploads, interleaved: in each round the
    servers take turns (their order rotated) and the two conditions alternate."""
    audio = load_bench_audio("auto", args.cache_dir / "speech")
    for url in urls.values():
        await warm_up(url, audio)
    names = list(urls)
    phases = []
    for round_index in range(LIVE_ROUNDS):
        order = ("alone", "upload") if round_index % 2 == 0 else ("upload", "alone")
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            options = StepOptions(url=urls[name], clients=1, duration_s=LIVE_S, stagger_s=0.0)
            plan = plan_clients(options, audio)[0]
            for condition in order:
                phase = Phase(condition, round_index, name)
                logger.info("round %d, server %s: live client %s", round_index, name, condition)
                with_upload = upload if condition == "upload" else None
                await live_phase(urls[name], plan, options, with_upload, phase)
                phases.append(phase)
                await asyncio.sleep(args.pause_s)
    return phases


def interference(args: argparse.Namespace) -> dict[str, Any]:
    folder = args.out / "audio"
    [path], _ = build_recordings([max(LENGTHS_S)], args.audio, args.cache_dir, folder)
    configs = {"default": ()} | {arg: tuple(arg.split()) for arg in args.also_server}
    with contextlib.ExitStack() as stack:
        urls = {}
        for index, (name, extra) in enumerate(configs.items()):
            log = args.out / f"server-interference-{index}.log"
            extra_args = ("--threads", str(args.threads), *extra)
            urls[name] = stack.enter_context(
                common.started_server(args, log, extra_args=extra_args)
            ).url
        phases = asyncio.run(interference_async(args, urls, path))
    summaries = {name: summarize_phases([p for p in phases if p.server == name]) for name in urls}
    return {
        "upload_file": path.name,
        "upload_audio_s": wav_seconds(path),
        "phases": [asdict(p) for p in phases],
        "servers": summaries,
    }


def summarize_phases(phases: list[Phase]) -> dict[str, Any]:
    alone = [v for p in phases if p.condition == "alone" for v in p.final_s]
    loaded = [v for p in phases if p.condition == "upload" for v in p.final_s]
    overlapped = [v for p in phases if p.condition == "upload" for v in p.overlapped_final_s]
    rows = {
        "alone": {"finals": len(alone), **percentiles(alone)},
        "with upload": {"finals": len(loaded), **percentiles(loaded)},
        "with upload, finals inside an upload": {
            "finals": len(overlapped),
            **percentiles(overlapped),
        },
    }
    p95_alone, p95_loaded = rows["alone"]["p95"], rows["with upload"]["p95"]
    p50_alone, p50_loaded = rows["alone"]["p50"], rows["with upload"]["p50"]
    uploads = [u for p in phases for u in p.uploads if not u["aborted"] and u.get("total_s")]
    return {
        "rows": rows,
        "p95_ratio": None if not (p95_alone and p95_loaded) else p95_loaded / p95_alone,
        "p50_ratio": None if not (p50_alone and p50_loaded) else p50_loaded / p50_alone,
        "uploads_done_s": [u["total_s"] for u in uploads],
        "client_errors": [p.client_error for p in phases if p.client_error],
        "upload_errors": [
            u["error"] for p in phases for u in p.uploads if u["error"] and not u["aborted"]
        ],  # fmt: skip
    }


def interference_table(result: dict[str, Any]) -> str:
    head = "server|live client|finals|final p50 s|final p95 s|final p99 s".split("|")
    lines, notes = [], []
    for server, summary in result["servers"].items():
        for name, row in summary["rows"].items():
            lines.append(
                [server, name, row["finals"], *(_f(row[q]) for q in ("p50", "p95", "p99"))]
            )
        speeds = [result["upload_audio_s"] / t for t in summary["uploads_done_s"]]
        notes.append(
            f"{server}: with the upload / alone: p50 {_f(summary['p50_ratio'], '{:.2f}x')}, "
            f"p95 {_f(summary['p95_ratio'], '{:.2f}x')}; uploads finished during the live "
            f"streams: {len(speeds)}, at {_spread(speeds)} real time; "
            f"errors: {summary['client_errors'] + summary['upload_errors'] or 'none'}"
        )
    return "\n".join([common.markdown_table(head, lines), "", *notes])


# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = common.parser(__doc__)
    common.add_server_args(parser)
    common.add_output_args(parser, out="bench/out/files")
    parser.add_argument("--parts", default="throughput,interference",
                        help="throughput and/or interference [%(default)s]")  # fmt: skip
    parser.add_argument("--audio", choices=AUDIO_CHOICES, default="recorded",
                        help="what the recordings are made of [%(default)s]")  # fmt: skip
    parser.add_argument("--funasr", default="fp32,int8",
                        help="AutoModel precisions ('' for none) [%(default)s]")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2,
                        help="model threads of the server, AutoModel and the CLI [2]")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="throughput rounds [1]")
    parser.add_argument("--also-server", action="append", default=[], metavar="ARGS",
                        help="interference: one more server with these serve arguments, "
                        "measured beside the default one, e.g. --also-server=--file-worker "
                        "(repeatable)")  # fmt: skip
    parser.add_argument("--pause-s", type=float, default=3.0, help="between live phases [3]")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.funasr = [p for p in args.funasr.split(",") if p]
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - {"throughput", "interference"}:
        raise SystemExit(f"unknown parts: {', '.join(sorted(unknown))}")
    if bad := set(args.funasr) - {"fp32", "int8"}:
        raise SystemExit(f"--funasr takes fp32 and int8, not {', '.join(sorted(bad))}")
    common.setup_logging()
    results: dict[str, Any] = {"cpu": common.cpu_name()}
    texts = []
    if "throughput" in parts:
        results["throughput"] = throughput(args)
        texts.append(throughput_table(results["throughput"]))
    if "interference" in parts:
        results["interference"] = interference(args)
        texts.append(interference_table(results["interference"]))
    common.write_results(args.out, results, args)
    text = "\n\n".join(
        [f"CPU: {results['cpu']}; {common.command_line('bench.files', argv)}", *texts]
    )
    (args.out / "table.md").write_text(text + "\n", encoding="utf-8")
    print(text)  # noqa: T201  (a bench's report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
