"""The ``streamer`` command: serve, transcribe, client, build-model, export-onnx.

This is the only module that reads argv and the environment and configures logging.
Heavy imports (torch, funasr) happen inside the commands, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from streamer import __version__
from streamer.core.protocol import LANGUAGES, StreamOptions
from streamer.core.segmenter import SegmenterOptions
from streamer.core.session import SessionOptions
from streamer.core.vad import DEFAULT_AGGRESSIVENESS, FrameClassifier
from streamer.errors import ConfigError, ModelError, StreamerError

logger = logging.getLogger("streamer.cli")

ENV_PREFIX = "STREAMER_"
EXIT_MODEL_FAILED = 3  # serve: the model stalled or its worker died; restart the process
VADS = ("webrtc", "silero")  # --vad choices


def _env(name: str, default: Any, kind: Callable[[str], Any] = str) -> Any:
    """The default of a flag: ``STREAMER_<NAME>`` when set, else ``default``."""
    value = os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"))
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(f"error: {ENV_PREFIX}{name.upper()}={value!r} is not valid") from None


def _max_batch(value: str) -> int | None:
    """``auto`` (None: the worker decides from the model) or a positive count."""
    if value == "auto":
        return None
    count = int(value)  # ValueError: argparse and _env report it
    if count < 1:
        raise ValueError(value)
    return count


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        session_id = getattr(record, "session_id", None)
        if session_id is not None:
            entry["session_id"] = session_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # third-party chatter stays at WARNING unless debugging
    quiet = logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING
    for name in ("websockets", "funasr", "modelscope", "jieba", "urllib3"):
        logging.getLogger(name).setLevel(max(quiet, logging.getLogger(name).level))


# -- shared flag groups --------------------------------------------------------


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    from streamer.model.recognizer import RecognizerOptions

    recognizer = RecognizerOptions()  # the flags' defaults are its fields'
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        default=_env("model", recognizer.model),
        help="hub id, local model directory, or random:tiny / random:small / "
        "random:tagged (meaningless text; for tests and timing) "
        "[STREAMER_MODEL, default %(default)s]",
    )
    g.add_argument(
        "--backend",
        choices=("auto", "torch", "onnx"),
        default=_env("backend", recognizer.backend),
        help="what runs the model: torch (funasr) or onnx (ONNX Runtime; a torch model "
        "is exported once and cached); auto = onnx on the CPU, torch on CUDA "
        "[STREAMER_BACKEND, %(default)s]",
    )
    g.add_argument(
        "--hub",
        choices=("ms", "hf"),
        default=_env("hub", recognizer.hub),
        help="model hub for ids: ModelScope or Hugging Face [%(default)s]",
    )
    g.add_argument(
        "--device",
        default=_env("device", recognizer.device),
        help="auto, cpu, cuda or cuda:N; serve also takes a list (cuda:0,cuda:1) or "
        "cuda:all: one worker and model copy per device [%(default)s]",
    )
    g.add_argument(
        "--dtype",
        choices=("fp32", "fp16", "bf16"),
        default=_env("dtype", recognizer.dtype),
        help="weights precision; fp16/bf16 need CUDA [%(default)s]",
    )
    g.add_argument(
        "--quantize",
        choices=("none", "int8"),
        default=_env("quantize", recognizer.quantize or "none"),
        help="int8 weights (CPU only; torch: dynamic Linear, onnx: model.int8.onnx) [%(default)s]",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=_env("threads", recognizer.threads, int),
        help="intra-op CPU threads (torch or ONNX Runtime); 0 = all cores; with several "
        "workers this is the total, shared out evenly between them [%(default)s]",
    )
    g.add_argument(
        "--no-warmup",
        action="store_true",
        default=_env("no_warmup", not recognizer.warmup, _bool),
        help="skip warm-up decodes at start-up",
    )
    g.add_argument(
        "--cache-dir",
        type=Path,
        default=_env("cache_dir", None, Path),
        help="where random models and ONNX exports are cached "
        "[STREAMER_CACHE_DIR, ~/.cache/sensevoice-streamer]",
    )


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=_env("log_level", "info"),
        choices=("debug", "info", "warning", "error"),
        help="[STREAMER_LOG_LEVEL, %(default)s]",
    )
    parser.add_argument(
        "--log-format",
        default=_env("log_format", "text"),
        choices=("text", "json"),
        help="[STREAMER_LOG_FORMAT, %(default)s]",
    )


def _recognizer_options(args: argparse.Namespace) -> Any:
    from streamer.model.recognizer import RecognizerOptions

    kwargs: dict[str, Any] = dict(
        model=args.model,
        backend=args.backend,
        hub=args.hub,
        device=args.device,
        dtype=args.dtype,
        quantize=None if args.quantize == "none" else args.quantize,
        threads=args.threads,
        warmup=not args.no_warmup,
    )
    if args.cache_dir is not None:
        kwargs["cache_dir"] = args.cache_dir
    return RecognizerOptions(**kwargs)


# -- serve -----------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from streamer.model import pool
    from streamer.model.worker import DEFAULT_DECODE_TIMEOUT_S
    from streamer.server.server import ServerOptions

    server = ServerOptions()  # the flags' defaults are its fields' (and its options')
    p = sub.add_parser(
        "serve",
        help="run the streaming server",
        description="Serve protocol v1 on ws://HOST:PORT/v1/asr, the web demo "
        "on /, and /healthz, /readyz, /metrics. Every flag has a "
        "STREAMER_* environment equivalent (--max-sessions -> "
        "STREAMER_MAX_SESSIONS).",
    )
    p.add_argument(
        "--host", default=_env("host", server.host), help="interface; 0.0.0.0 for all [%(default)s]"
    )
    p.add_argument("--port", type=int, default=_env("port", server.port, int), help="[%(default)s]")
    _add_model_arguments(p)
    g = p.add_argument_group("streaming")
    g.add_argument(
        "--max-sessions",
        type=int,
        default=_env("max_sessions", server.max_sessions, int),
        help="concurrent sessions; more get HTTP 503 [%(default)s]",
    )
    g.add_argument(
        "--vad",
        choices=VADS,
        default=_env("vad", "webrtc"),
        help="voice-activity detector: webrtc (webrtcvad), or silero (Silero VAD on ONNX "
        "Runtime: finds utterances in noise where webrtcvad hears only speech, about "
        "0.5 %% of a core per stream) [STREAMER_VAD, %(default)s]",
    )
    g.add_argument(
        "--vad-aggressiveness",
        type=int,
        choices=(0, 1, 2, 3),
        default=_env("vad_aggressiveness", server.vad_aggressiveness, int),
        help="webrtcvad mode; 2-3 resist background noise [%(default)s]",
    )
    g.add_argument(
        "--endpoint-ms",
        type=int,
        default=_env("endpoint_ms", server.default_stream.endpoint_ms, int),
        help="default trailing silence that ends an utterance [%(default)s]",
    )
    g.add_argument(
        "--max-utterance-ms",
        type=int,
        default=_env("max_utterance_ms", SegmenterOptions().max_utterance_ms, int),
        help="hard cap on an utterance [%(default)s]",
    )
    g.add_argument(
        "--long-segment-ms",
        type=int,
        default=_env("long_segment_ms", SegmenterOptions().long_segment_ms, int),
        help="from this length on, a short pause (about 230 ms) ends an utterance; "
        "--max-utterance-ms turns it off [%(default)s]",
    )
    g.add_argument(
        "--pause-dip-ms",
        type=int,
        default=_env("pause_dip_ms", SegmenterOptions().pause_dip_ms, int),
        help="a long utterance also ends at this much quiet (an energy dip the VAD's "
        "hangover hides); 0 leaves it to the VAD [%(default)s]",
    )
    g.add_argument(
        "--pause-contrast-db",
        type=float,
        default=_env("pause_contrast_db", SegmenterOptions().pause_contrast_db, float),
        help="energy dips count only where speech is this much over the noise floor [%(default)s]",
    )
    g.add_argument(
        "--cut-search-ms",
        type=int,
        default=_env("cut_search_ms", SegmenterOptions().cut_search_ms, int),
        help="an utterance reaching --max-utterance-ms is cut at the quietest point of "
        "this last stretch [%(default)s]",
    )
    g.add_argument(
        "--speculative-finals",
        action=argparse.BooleanOptionalAction,
        default=_env("speculative_finals", SessionOptions().speculative_finals, _bool),
        help="decode an utterance during its final pause, so its final is sent the moment "
        "the endpoint is reached [%(default)s]",
    )
    g.add_argument(
        "--partial-interval-ms",
        type=int,
        default=_env("partial_interval_ms", SessionOptions().partial_interval_ms, int),
        help="re-decode the open utterance after this much new audio [%(default)s]",
    )
    g.add_argument(
        "--idle-timeout-s",
        type=float,
        default=_env("idle_timeout_s", server.idle_timeout_s, float),
        help="end sessions without audio or keepalive for this long [%(default)s]",
    )
    g.add_argument(
        "--max-session-s",
        type=float,
        default=_env("max_session_s", server.max_session_s, float),
        help="longest session [%(default)s]",
    )
    g.add_argument(
        "--max-message-bytes",
        type=int,
        default=_env("max_message_bytes", server.max_message_bytes, int),
        help="largest client frame; larger ones close with 1009 [%(default)s]",
    )
    g.add_argument(
        "--max-backlog-bytes",
        type=int,
        default=_env("max_backlog_bytes", server.max_backlog_bytes, int),
        help="audio a session may send ahead of the model before the server stops "
        "reading its socket [%(default)s]",
    )
    g.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=_env("shutdown_grace_s", server.shutdown_grace_s, float),
        help="time to finish open utterances on SIGTERM [%(default)s]",
    )
    g.add_argument(
        "--drain-s",
        type=float,
        default=_env("drain_s", server.drain_s, float),
        help="on SIGTERM, first refuse new sessions (/readyz 503 draining) and serve open "
        "ones up to this long, so a load balancer moves new sessions elsewhere; then shut "
        "down. SIGUSR1 drains without exiting, SIGUSR2 admits again [%(default)s]",
    )
    g.add_argument(
        "--write-timeout-s",
        type=float,
        default=_env("write_timeout_s", server.write_timeout_s, float),
        help="close (1008) a client that reads nothing for this long [%(default)s]",
    )
    g.add_argument(
        "--max-batch",
        type=_max_batch,
        default=_env("max_batch", None, _max_batch),
        help="jobs decoded in one model call when several are queued (one queued job "
        "always runs alone at once); 'auto': 8 on CUDA, 1 on the CPU, where batching "
        "measured no better; int8 batches are not token-identical to batch 1 "
        "(bench/RESULTS.md) [auto]",
    )
    g.add_argument(
        "--decode-timeout-s",
        type=float,
        default=_env("decode_timeout_s", DEFAULT_DECODE_TIMEOUT_S, float),
        help="a decode running longer means the model is stalled: the server turns "
        "unready, tells every session and exits with status 3 for its supervisor to "
        "restart it [%(default)s]",
    )
    g.add_argument(
        "--workers",
        type=int,
        default=_env("workers", pool.DEFAULT_WORKERS_PER_DEVICE, int),
        help="model workers per device, each with its own thread and model copy; "
        "sessions go to the least loaded (on a CPU, --threads is shared between them) "
        "[STREAMER_WORKERS, %(default)s]",
    )
    s = p.add_argument_group("security")
    s.add_argument(
        "--token",
        default=_env("token", server.token),
        help="require this token (v1: Authorization: Bearer or ?token=; Deepgram: "
        "Authorization: Token; OpenAI Realtime: Authorization: Bearer; FunASR: ?token=)",
    )
    s.add_argument(
        "--certfile",
        type=Path,
        default=_env("certfile", None, Path),
        help="TLS certificate (enables wss:// and https://)",
    )
    s.add_argument(
        "--keyfile", type=Path, default=_env("keyfile", None, Path), help="TLS private key"
    )
    s.add_argument(
        "--allowed-origins",
        default=_env("allowed_origins", ",".join(server.allowed_origins)),
        help="comma-separated Origin values browsers may connect from; empty allows any",
    )
    s.add_argument(
        "--public-metrics",
        action="store_true",
        default=_env("public_metrics", server.public_metrics, _bool),
        help="serve /metrics without --token (it requires the token by default)",
    )
    c = p.add_argument_group("other protocols (each on its own port; off by default)")
    c.add_argument(
        "--funasr-port",
        type=int,
        default=_env("funasr_port", server.funasr_port, int),
        help="serve FunASR's runtime WebSocket protocol on ws://HOST:PORT/ for "
        "funasr-client, funasr-python and FunASR's html5 demo (FunASR uses 10095; "
        "docs/funasr.md); --token is then required as ?token= in the URL",
    )
    c.add_argument(
        "--wyoming-port",
        type=int,
        default=_env("wyoming_port", server.wyoming_port, int),
        help="serve Wyoming, Home Assistant's speech protocol, on tcp://HOST:PORT "
        "(convention 10300; docs/wyoming.md)",
    )
    c.add_argument(
        "--wyoming-insecure",
        action="store_true",
        default=_env("wyoming_insecure", server.wyoming_insecure, _bool),
        help="serve --wyoming-port although --token is set: Wyoming has no authentication, "
        "so bind it to a trusted network only",
    )
    _add_logging_arguments(p)
    p.add_argument("--no-uvloop", action="store_true", help="use asyncio's default event loop")
    p.set_defaults(func=_cmd_serve)


def _server_options(args: argparse.Namespace) -> Any:
    from dataclasses import replace

    from streamer.server.server import ServerOptions

    default_stream = replace(StreamOptions(), endpoint_ms=args.endpoint_ms)
    # endpoint_ms is a stream option (clients may choose theirs); this is its default
    segmenter = SegmenterOptions(
        max_utterance_ms=args.max_utterance_ms,
        long_segment_ms=min(args.long_segment_ms, args.max_utterance_ms),
        pause_dip_ms=args.pause_dip_ms,
        pause_contrast_db=args.pause_contrast_db,
        cut_search_ms=args.cut_search_ms,
    )
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    return ServerOptions(
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        token=args.token,
        allowed_origins=origins,
        certfile=args.certfile,
        keyfile=args.keyfile,
        max_message_bytes=args.max_message_bytes,
        max_backlog_bytes=args.max_backlog_bytes,
        idle_timeout_s=args.idle_timeout_s,
        max_session_s=args.max_session_s,
        shutdown_grace_s=args.shutdown_grace_s,
        drain_s=args.drain_s,
        write_timeout_s=args.write_timeout_s,
        public_metrics=args.public_metrics,
        vad_aggressiveness=args.vad_aggressiveness,
        default_stream=default_stream,
        session=SessionOptions(
            segmenter=segmenter,
            partial_interval_ms=args.partial_interval_ms,
            speculative_finals=args.speculative_finals,
        ),
        funasr_port=args.funasr_port,
        wyoming_port=args.wyoming_port,
        wyoming_insecure=args.wyoming_insecure,
    )


def _classifier_factory(vad: str) -> Callable[[], FrameClassifier] | None:
    """The per-session VAD for ``--vad``; None is the server's own default (webrtcvad at
    ``--vad-aggressiveness``). Loads Silero's graph once, here, so that a missing
    package fails at start."""
    if vad == "webrtc":
        return None
    if vad == "silero":
        from streamer.model.silero import silero_classifier_factory

        return silero_classifier_factory()
    raise ConfigError(f"unknown VAD {vad!r}: choose one of {', '.join(VADS)}")


def _worker_pool(args: argparse.Namespace, metrics: Any, progress: Any) -> Any:
    """The model workers ``--device`` and ``--workers`` ask for, each device checked first."""
    from dataclasses import replace

    from streamer.model.loading import load_recognizer, preflight, resolve_devices
    from streamer.model.pool import WorkerHooks, WorkerPool, WorkerSlot, plan_slots
    from streamer.model.worker import ModelWorker

    if args.decode_timeout_s <= 0:
        raise ConfigError("--decode-timeout-s must be positive")
    devices = resolve_devices(args.device)
    base = _recognizer_options(argparse.Namespace(**{**vars(args), "device": devices[0]}))
    for device in devices:  # impossible devices, missing files: fail in seconds
        preflight(replace(base, device=device))
    slots = plan_slots(
        devices, workers_per_device=args.workers, threads=args.threads, usable_cores=_cores()
    )

    def build(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        options = replace(base, device=slot.device, threads=slot.threads)
        # the first worker reports its loading stages to /readyz; the others load alike
        shown = progress if slot.index == 0 else None
        return ModelWorker(
            lambda: load_recognizer(options, shown),
            decode_timeout_s=args.decode_timeout_s,
            max_batch=args.max_batch,
            on_decoded=hooks.on_decoded,
            on_failure=hooks.on_failure,
        )

    if len(slots) > 1:
        logger.info(
            "%d model workers: %s",
            len(slots),
            ", ".join(f"{s.index} on {s.device} ({s.threads} threads)" for s in slots),
        )
    return WorkerPool(build, slots, on_decoded=metrics.observe_worker_decode)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


async def _serve(args: argparse.Namespace) -> int:
    from streamer.model.loading import LoadProgress
    from streamer.server.metrics import Metrics
    from streamer.server.server import StreamingServer

    server_options = _server_options(args)
    progress = LoadProgress()
    metrics = Metrics()
    worker = _worker_pool(args, metrics, progress)
    classifier_factory = _classifier_factory(args.vad)
    server = StreamingServer(
        server_options,
        worker,
        metrics=metrics,
        loading=progress,
        classifier_factory=classifier_factory,
    )
    await server.start()  # bind first: /readyz answers 503 with the stage while loading
    worker.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_now = asyncio.Event()  # SIGINT, or SIGTERM again: no drain (or cut it short)

    def on_signal(sig: signal.Signals) -> None:
        if sig is signal.SIGINT or stop.is_set():
            stop_now.set()
        stop.set()

    handlers: dict[signal.Signals, Callable[[], None]] = {
        signal.SIGINT: lambda: on_signal(signal.SIGINT),
        signal.SIGTERM: lambda: on_signal(signal.SIGTERM),
        # drain by hand (a blue-green switch, a host going into maintenance), then undo
        signal.SIGUSR1: server.start_draining,
        signal.SIGUSR2: lambda: None if stop.is_set() else server.stop_draining(),
    }
    for sig, handler in handlers.items():
        loop.add_signal_handler(sig, handler)
    ready = asyncio.create_task(server.wait_ready())
    stopped = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(server.wait_failed())
    failed.add_done_callback(lambda _: stop.set())
    try:
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()  # raises the model's loading error
            scheme = "https" if server_options.certfile else "http"
            host = (
                "localhost"
                if server_options.host in ("127.0.0.1", "0.0.0.0")
                else server_options.host
            )
            logger.info("ready: open %s://%s:%d/ for live captions", scheme, host, server.port)
            await stopped
        if server.failure is None:
            logger.info("signal received: stopping")
        if server.failure is None and not stop_now.is_set():
            # SIGTERM (an orchestrator, systemd): let the balancer notice before we go
            drained = asyncio.create_task(server.drain())
            interrupted = asyncio.create_task(stop_now.wait())
            await asyncio.wait({drained, interrupted}, return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
            interrupted.cancel()
    finally:
        for sig in handlers:
            loop.remove_signal_handler(sig)
        ready.cancel()
        stopped.cancel()
        failed.cancel()
        await server.shutdown()
        # a model still loading, or a stalled decode, cannot be interrupted: do not wait
        # for that thread (a daemon, it ends with the process)
        usable = worker.ready.is_set() and server.failure is None
        await asyncio.to_thread(worker.stop, 5.0 if usable else 0.0)
    if server.failure is not None:
        logger.error("exiting with status %d: %s", EXIT_MODEL_FAILED, server.failure)
        return EXIT_MODEL_FAILED
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from streamer.loop import run

    status = run(_serve(args), use_uvloop=not args.no_uvloop)
    # The server has shut down and nothing is left to clean up, but garbage-collecting
    # torch and funasr at interpreter exit takes seconds on a busy machine, and SIGTERM
    # must end the process within the grace period (and a stalled decode's thread can
    # never be joined): leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# -- transcribe ----------------------------------------------------------------


def _add_transcribe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transcribe",
        help="transcribe audio files offline",
        description="Decode audio files (any common format, resampled to "
        "16 kHz mono), cut into utterances by the same VAD the "
        "server uses.",
    )
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--language", choices=LANGUAGES, default=StreamOptions().language)
    p.add_argument("--no-itn", action="store_true", help="no inverse text normalisation")
    p.add_argument(
        "--json", action="store_true", help="JSON lines (one per utterance, with tags and times)"
    )
    p.add_argument("--vad", choices=VADS, default="webrtc", help="as for serve [%(default)s]")
    p.add_argument(
        "--vad-aggressiveness", type=int, choices=(0, 1, 2, 3), default=DEFAULT_AGGRESSIVENESS
    )
    _add_model_arguments(p)
    _add_logging_arguments(p)
    p.set_defaults(func=_cmd_transcribe, log_level="warning")


def _cmd_transcribe(args: argparse.Namespace) -> int:
    from streamer.audio_io import load_audio
    from streamer.core.protocol import message_dict
    from streamer.model.loading import LoadProgress, load_recognizer, preflight
    from streamer.offline import transcribe_pcm

    options = _recognizer_options(args)
    preflight(options)
    classifier_factory = _classifier_factory(args.vad)
    # loading takes seconds to a minute: say what is happening even at --log-level warning
    logging.getLogger("streamer.model.loading").setLevel(logging.INFO)
    recognizer = load_recognizer(options, LoadProgress())
    out = sys.stdout
    status = 0
    for path in args.files:
        try:
            pcm = load_audio(path)
        except StreamerError as error:
            logger.error("%s: %s", path, error)
            status = 2
            continue
        texts = []
        for final in transcribe_pcm(
            recognizer,
            pcm,
            language=args.language,
            itn=not args.no_itn,
            vad_aggressiveness=args.vad_aggressiveness,
            classifier=None if classifier_factory is None else classifier_factory(),
        ):
            if args.json:
                record = {"file": str(path), **message_dict(final)}
                out.write(orjson.dumps(record).decode() + "\n")
            elif final.text:
                texts.append(final.text)
        if not args.json:
            prefix = f"{path}: " if len(args.files) > 1 else ""
            out.write(prefix + " ".join(texts) + "\n")
        out.flush()
    return status


# -- build-model -----------------------------------------------------------------


def _add_build_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-model",
        help="build a random-weight SenseVoiceSmall model",
        description="Write a complete model directory with random weights "
        "(tiny, small = real size, tagged = tiny trained to emit "
        "known tags) for tests and timing without downloads.",
    )
    p.add_argument("name", choices=("tiny", "small", "tagged"))
    p.add_argument("--cache-dir", type=Path, default=_env("cache_dir", None, Path))
    _add_logging_arguments(p)
    p.set_defaults(func=_cmd_build_model)


def _cmd_build_model(args: argparse.Namespace) -> int:
    from streamer.model.recognizer import RecognizerOptions
    from streamer.testkit.models import ensure_random_model

    cache_dir = args.cache_dir or RecognizerOptions().cache_dir
    path = ensure_random_model(args.name, cache_dir)
    sys.stdout.write(f"{path}\n")
    return 0


# -- export-onnx -----------------------------------------------------------------


def _add_export_onnx(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-onnx",
        help="export a torch/funasr model to ONNX",
        description="Write model.onnx (fp32), model.int8.onnx (MatMul weights quantized "
        "dynamically), tokens.txt, bpe.model, am.mvn and manifest.json for --backend "
        "onnx. Without --out the export goes to the cache that serve --backend onnx "
        "reads, keyed by the model's content hash.",
    )
    p.add_argument("model", help="torch/funasr model directory, cached hub id, or random:NAME")
    p.add_argument("--out", type=Path, default=None, help="directory to create")
    p.add_argument(
        "--int8-weight-type",
        choices=("QInt8", "QUInt8"),
        default=None,
        help="weights of model.int8.onnx [QInt8 on CPUs with VNNI/dotprod, where it is as "
        "accurate and 2-3x faster; else QUInt8, which cannot saturate]",
    )
    p.add_argument("--hub", choices=("ms", "hf"), default=_env("hub", "ms"))
    p.add_argument("--cache-dir", type=Path, default=_env("cache_dir", None, Path))
    _add_logging_arguments(p)
    p.set_defaults(func=_cmd_export_onnx)


def _cmd_export_onnx(args: argparse.Namespace) -> int:
    from streamer.model.files import locate_model
    from streamer.model.onnx_export import cached_export, export_onnx
    from streamer.model.recognizer import RecognizerOptions

    options = RecognizerOptions(model=args.model, hub=args.hub, backend="torch")
    cache_dir = args.cache_dir or options.cache_dir
    source = locate_model(args.model, args.hub, cache_dir)
    if not isinstance(source, Path):
        raise ConfigError(f"{args.model} is not downloaded yet; run streamer serve with it once")
    if args.out is None:
        out = cached_export(
            source, cache_dir, name=args.model, int8_weight_type=args.int8_weight_type
        )
    else:
        if args.out.exists() and any(args.out.iterdir()):
            raise ConfigError(f"{args.out} exists and is not empty")
        export_onnx(source, args.out, int8_weight_type=args.int8_weight_type, name=args.model)
        out = args.out
    sys.stdout.write(f"{out}\n")
    return 0


# -- client --------------------------------------------------------------------


def _add_client(sub: argparse._SubParsersAction) -> None:
    from streamer.client.cli import add_client_arguments

    p = sub.add_parser("client", help="stream an audio file to a server and show captions")
    add_client_arguments(p)
    p.set_defaults(func=_cmd_client)


def _cmd_client(args: argparse.Namespace) -> int:
    from streamer.client.cli import run_client

    return asyncio.run(run_client(args))


# -- entry point ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamer",
        description="Real-time SenseVoiceSmall speech recognition over WebSocket.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_transcribe(sub)
    _add_client(sub)
    _add_build_model(sub)
    _add_export_onnx(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    try:
        return int(args.func(args) or 0)
    except (ModelError, ConfigError) as error:
        logger.error("%s", error)
        return 2 if isinstance(error, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
