"""``streamer serve``: its flags and the process's life (what the flags build is in
:mod:`streamer.cli.serve_options`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from streamer.cli.common import (
    VAD_MODES,
    VADS,
    _add_logging_arguments,
    _add_model_arguments,
    _bool,
    _classifier_factory,
    _flag,
    _max_batch,
    _positive_or_auto,
    _within,
)
from streamer.cli.diarizer import add_diarize_arguments, speaker_worker
from streamer.cli.process_limits import raise_open_files_limit
from streamer.cli.serve_options import server_options_from, worker_pool
from streamer.core.protocol import MAX_ENDPOINT_MS, MIN_ENDPOINT_MS
from streamer.core.segmenter import SegmenterOptions
from streamer.core.session import SessionOptions

logger = logging.getLogger(__name__)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from streamer.model.serving import pool
    from streamer.model.serving.supervision import DEFAULT_MAX_RESTARTS
    from streamer.model.serving.worker import DEFAULT_DECODE_TIMEOUT_S, DEFAULT_MODEL_PROCESS
    from streamer.server.server import ServerOptions

    server = ServerOptions()  # the flags' defaults are its fields' (and its options')
    p = sub.add_parser(
        "serve",
        help="run the streaming server",
        description="Serve protocol v1 on ws://HOST:PORT/v1/asr, file uploads on "
        "POST /v1/audio/transcriptions and POST /v1/listen, the web demo "
        "on /, and /healthz, /readyz, /metrics. Every flag has a "
        "STREAMER_* environment equivalent (--max-sessions -> "
        "STREAMER_MAX_SESSIONS).",
    )
    _flag(p, "--host", server.host, help="interface; 0.0.0.0 for all [%(default)s]")
    _flag(p, "--port", server.port, _within(int, 0, 65535), help="[%(default)s]")
    _add_model_arguments(p)
    g = p.add_argument_group("streaming")
    _flag(
        g,
        "--max-sessions",
        server.max_sessions,
        _within(int, 1),
        help="concurrent sessions; more get HTTP 503 [%(default)s]",
    )
    _flag(
        g,
        "--vad",
        VADS[0],
        choices=VADS,
        help="voice-activity detector: webrtc (webrtcvad), or silero (Silero VAD on ONNX "
        "Runtime: finds utterances in noise where webrtcvad hears only speech, about "
        "0.5 %% of a core per stream) [STREAMER_VAD, %(default)s]",
    )
    _flag(
        g,
        "--vad-aggressiveness",
        server.vad_aggressiveness,
        int,
        choices=VAD_MODES,
        help="webrtcvad mode; 2-3 resist background noise [%(default)s]",
    )
    _flag(
        g,
        "--endpoint-ms",
        server.default_stream.endpoint_ms,
        _within(int, MIN_ENDPOINT_MS, MAX_ENDPOINT_MS),
        help="default trailing silence that ends an utterance [%(default)s]",
    )
    _flag(
        g,
        "--max-utterance-ms",
        SegmenterOptions().max_utterance_ms,
        _within(int, 1000),
        help="hard cap on an utterance [%(default)s]",
    )
    _flag(
        g,
        "--long-segment-ms",
        SegmenterOptions().long_segment_ms,
        _within(int, 1),
        help="from this length on, a short pause (about 230 ms) ends an utterance; "
        "--max-utterance-ms turns it off [%(default)s]",
    )
    _flag(
        g,
        "--pause-dip-ms",
        SegmenterOptions().pause_dip_ms,
        _within(int, 0),
        help="a long utterance also ends at this much quiet (an energy dip the VAD's "
        "hangover hides); 0 leaves it to the VAD [%(default)s]",
    )
    _flag(
        g,
        "--pause-contrast-db",
        SegmenterOptions().pause_contrast_db,
        _within(float, 0),
        help="energy dips count only where speech is this much over the noise floor [%(default)s]",
    )
    _flag(
        g,
        "--cut-search-ms",
        SegmenterOptions().cut_search_ms,
        _within(int, 1),
        help="an utterance reaching --max-utterance-ms is cut at the quietest point of "
        "this last stretch [%(default)s]",
    )
    _flag(
        g,
        "--speculative-finals",
        SessionOptions().speculative_finals,
        _bool,
        action=argparse.BooleanOptionalAction,
        help="decode an utterance during its final pause, so its final is sent the moment "
        "the endpoint is reached [%(default)s]",
    )
    _flag(
        g,
        "--hotwords",
        None,
        Path,
        metavar="FILE",
        help="phrases every session favours: one 'phrase' or 'phrase:boost' a line "
        "(# comments), merged with each session's own (docs/protocol.md, Hotwords)",
    )
    _flag(
        g,
        "--partial-interval-ms",
        SessionOptions().partial_interval_ms,
        _within(int, 20),
        help="re-decode the open utterance after this much new audio (its first partial is "
        "decoded at its onset) [%(default)s]",
    )
    _flag(
        g,
        "--idle-timeout-s",
        server.limits.idle_timeout_s,
        _within(float, 0.01),
        help="end sessions that send no audio and no valid message for this long [%(default)s]",
    )
    _flag(
        g,
        "--max-session-s",
        server.limits.max_session_s,
        _within(float, 0.01),
        help="longest session [%(default)s]",
    )
    _flag(
        g,
        "--max-message-bytes",
        server.max_message_bytes,
        _within(int, 1024),
        help="largest client frame; larger ones close with 1009 [%(default)s]",
    )
    _flag(
        g,
        "--max-backlog-bytes",
        server.limits.max_backlog_bytes,
        _within(int, 1024),
        help="audio a session may send ahead of the model before the server stops "
        "reading its socket [%(default)s]",
    )
    _flag(
        g,
        "--shutdown-grace-s",
        server.shutdown_grace_s,
        _within(float, 0),
        help="time to finish open utterances on SIGTERM [%(default)s]",
    )
    _flag(
        g,
        "--drain-s",
        server.drain_s,
        _within(float, 0),
        help="on SIGTERM, first refuse new sessions (/readyz 503 draining) and serve open "
        "ones up to this long, so a load balancer moves new sessions elsewhere; then shut "
        "down. SIGUSR1 drains without exiting, SIGUSR2 admits again [%(default)s]",
    )
    _flag(
        g,
        "--write-timeout-s",
        server.limits.write_timeout_s,
        _within(float, 0.01),
        help="close (1008) a client that reads nothing for this long [%(default)s]",
    )
    _flag(
        g,
        "--max-input-messages-per-s",
        server.limits.max_input_messages_per_s,
        _within(float, 1),
        help="read one client's WebSocket messages no faster than this (after a 1 s burst; "
        "TCP then pushes back on that client alone) [%(default)s]",
    )
    _flag(
        g,
        "--max-input-bytes-per-s",
        server.limits.max_input_bytes_per_s,
        _within(float, 1000),
        help="read one client's bytes no faster than this (the default is 50x real time "
        "for 16 kHz int16) [%(default)s]",
    )
    _flag(
        g,
        "--max-total-input-messages-per-s",
        server.max_total_input_messages_per_s,
        _within(float, 1),
        help="read all clients' messages together no faster than this: past it, clients "
        "beyond their share of it wait (many small floods cannot take the loop) [%(default)s]",
    )
    _flag(
        g,
        "--max-total-input-bytes-per-s",
        server.max_total_input_bytes_per_s,
        _within(float, 1000),
        help="likewise for all clients' bytes together [%(default)s]",
    )
    _flag(
        g,
        "--capacity-admission",
        server.capacity.enabled,
        _bool,
        action=argparse.BooleanOptionalAction,
        help="refuse new sessions (503 saturated) while one more would break the admitted "
        "sessions' latency budgets (--final-p95-budget-ms, --ttft-p95-budget-ms) or the "
        "load ceiling (--max-final-load, --max-final-lag-ms) [%(default)s]",
    )
    _flag(
        g,
        "--max-final-lag-ms",
        server.capacity.max_final_lag_ms,
        _within(float, 1),
        help="a final queued longer than this makes the server saturated [%(default)s]",
    )
    _flag(
        g,
        "--max-final-load",
        server.capacity.max_final_load,
        _within(float, 0.01, 1.0),
        help="the most share of the workers' time the finals may take with one more "
        "session (measured over 15 s; a new session counts at the finals' real-time "
        "factor) [%(default)s]",
    )
    _flag(
        g,
        "--final-p95-budget-ms",
        server.capacity.final_p95_budget_ms,
        _within(float, 1),
        help="the most p95 of the admitted sessions' final latency (a final after the last "
        "sample of its audio arrived), measured or projected with one more session "
        "[%(default)s]",
    )
    _flag(
        g,
        "--ttft-p95-budget-ms",
        server.capacity.ttft_p95_budget_ms,
        _within(float, 1),
        help="the most p95 of the admitted sessions' time to first token (an utterance's "
        "first text after its first sample arrived), measured or projected with one more "
        "session [%(default)s]",
    )
    f = p.add_argument_group("file APIs (POST /v1/audio/transcriptions, POST /v1/listen)")
    _flag(
        f,
        "--max-file-jobs",
        server.files.max_jobs,
        _within(int, 0),
        help="files transcribed at once (their jobs wait behind every live one); more "
        "are refused with 429; 0 refuses every upload [%(default)s]",
    )
    _flag(
        f,
        "--max-upload-mb",
        server.files.max_upload_bytes / (1 << 20),
        _within(float, 0.001),
        help="a larger upload is refused with 413 [%(default)s]",
    )
    _flag(
        f,
        "--max-file-duration-s",
        server.files.max_duration_s,
        _within(float, 1),
        help="longer audio is refused with 400 [%(default)s]",
    )
    _flag(
        f,
        "--file-worker",
        False,
        _bool,
        action=argparse.BooleanOptionalAction,
        help="decode the uploads on a model worker of their own whose threads run at nice "
        "19, so that a live decode never waits for a file's (on 2 CPU cores the file "
        "queue alone lets a live final wait for one file decode); costs one more model "
        "in memory; the ONNX backend's threads are its own, torch's are shared and do "
        "not take the priority [%(default)s]",
    )
    _flag(
        f,
        "--max-uploads-receiving",
        server.files.max_uploads_receiving,
        _within(int, 1),
        help="upload bodies received at once (a file takes its --max-file-jobs slot only "
        "once its body is complete); one client address may send at most half of them; "
        "more are refused with 429 [%(default)s]",
    )
    _flag(
        f,
        "--upload-min-bytes-per-s",
        server.files.upload_min_bytes_per_s,
        _within(int, 0),
        help="an upload that comes slower than this on average (after its first 10 s) is "
        "cut with 408; 0: no minimum [%(default)s]",
    )
    _flag(
        f,
        "--upload-deadline-s",
        server.files.upload_deadline_s,
        _within(float, 1),
        help="an upload body (or a --allow-url-fetch fetch) not complete within this is "
        "cut with 408 [%(default)s]",
    )
    _flag(
        f,
        "--allow-url-fetch",
        server.files.allow_url_fetch,
        _bool,
        action=argparse.BooleanOptionalAction,
        help='let Deepgram\'s {"url": ...} bodies make the server fetch that URL (off: '
        "a request cannot make the server reach what only it can reach) [%(default)s]",
    )
    _flag(
        f,
        "--allow-url-fetch-private",
        server.files.allow_url_fetch_private,
        _bool,
        action=argparse.BooleanOptionalAction,
        help="with --allow-url-fetch, fetch from loopback, link-local and private "
        "addresses too (off: only public addresses, so a request cannot reach this "
        "host's or its network's own services) [%(default)s]",
    )
    _flag(
        g,
        "--max-batch",
        None,
        _max_batch,
        help="jobs decoded in one model call when several are queued (one queued job "
        "always runs alone at once); 'auto': 8 on CUDA, 1 on the CPU, where batching "
        "measured no better; int8 batches are not token-identical to batch 1 "
        "(bench/RESULTS.md) [auto]",
    )
    _flag(
        g,
        "--max-batch-audio-s",
        None,
        _positive_or_auto,
        help="padded audio (jobs x longest) one batch may hold, which bounds how long a "
        "final can wait behind a batch; 'auto': 7 s on the CPU, no bound on CUDA "
        "[STREAMER_MAX_BATCH_AUDIO_S, auto]",
    )
    _flag(
        g,
        "--decode-timeout-s",
        DEFAULT_DECODE_TIMEOUT_S,
        _within(float, 0.01),
        help="a decode running longer means the model is stalled: with --model-process its "
        "process is killed and started again (--model-restarts); otherwise, or past that, "
        "the server turns unready, tells every session and exits with status 3 for its "
        "supervisor to restart it [%(default)s]",
    )
    _flag(
        g,
        "--model-process",
        DEFAULT_MODEL_PROCESS,
        _bool,
        nargs="?",
        const=True,
        help="run each worker's model (features, decoding) in a child process of its own, "
        "so that it does not share one GIL with the event loop: for hundreds of streams "
        "on a GPU (bench/RESULTS.md) [STREAMER_MODEL_PROCESS, %(default)s]",
    )
    _flag(
        g,
        "--model-restarts",
        DEFAULT_MAX_RESTARTS,
        _within(int, 0),
        help="with --model-process, how often in 10 minutes a model process that died or "
        "stalled is started again while its sessions wait (the finals it was decoding "
        "are decoded again); 0: fail for good at once [STREAMER_MODEL_RESTARTS, %(default)s]",
    )
    _flag(
        g,
        "--workers",
        pool.DEFAULT_WORKERS_PER_DEVICE,
        _within(int, 1),
        help="model workers per device, each with its own thread and model copy; "
        "sessions go to the least loaded (on a CPU, --threads is shared between them) "
        "[STREAMER_WORKERS, %(default)s]",
    )
    s = p.add_argument_group("security")
    _flag(
        s,
        "--token",
        server.token,
        help="require this token (v1: Authorization: Bearer or ?token=; Deepgram: "
        "Authorization: Token; OpenAI Realtime: Authorization: Bearer; FunASR: ?token=)",
    )
    _flag(s, "--certfile", None, Path, help="TLS certificate (enables wss:// and https://)")
    _flag(s, "--keyfile", None, Path, help="TLS private key")
    _flag(
        s,
        "--allowed-origins",
        ",".join(server.allowed_origins),
        help="comma-separated Origin values browsers may connect from; empty allows any",
    )
    _flag(
        s,
        "--public-metrics",
        server.public_metrics,
        _bool,
        action="store_true",
        help="serve /metrics without --token (it requires the token by default)",
    )
    c = p.add_argument_group("other protocols (each on its own port; off by default)")
    _flag(
        c,
        "--funasr-port",
        server.funasr_port,
        _within(int, 0, 65535),
        help="serve FunASR's runtime WebSocket protocol on ws://HOST:PORT/ for "
        "funasr-client, funasr-python and FunASR's html5 demo (FunASR uses 10095; "
        "docs/funasr.md); --token is then required as ?token= in the URL",
    )
    _flag(
        c,
        "--wyoming-port",
        server.wyoming_port,
        _within(int, 0, 65535),
        help="serve Wyoming, Home Assistant's speech protocol, on tcp://HOST:PORT "
        "(convention 10300; docs/wyoming.md)",
    )
    _flag(
        c,
        "--wyoming-insecure",
        server.wyoming_insecure,
        _bool,
        action="store_true",
        help="serve --wyoming-port although --token is set: Wyoming has no authentication, "
        "so bind it to a trusted network only",
    )
    add_diarize_arguments(p)
    _add_logging_arguments(p)
    _flag(
        p,
        "--no-uvloop",
        False,
        _bool,
        action="store_true",
        help="use asyncio's default event loop",
    )
    p.set_defaults(func=_cmd_serve)


async def _serve(args: argparse.Namespace) -> int:
    from streamer.model.backends.loading import LoadProgress
    from streamer.server.metrics import Metrics
    from streamer.server.server import StreamingServer

    server_options = server_options_from(args)
    raise_open_files_limit(server_options.max_sessions)
    progress = LoadProgress()
    metrics = Metrics()
    worker = worker_pool(args, metrics, progress)
    worker.speakers = speaker_worker(args, metrics)
    classifier_factory = _classifier_factory(args.vad)
    server = StreamingServer(
        server_options,
        worker,
        metrics=metrics,
        loading=progress,
        classifier_factory=classifier_factory,
    )
    return await server.run()


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
