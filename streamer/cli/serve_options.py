"""What ``streamer serve``'s flags build: the server's options and the model workers."""

from __future__ import annotations

import argparse
import logging
import os
from functools import partial
from typing import Any

from streamer.cli.common import _recognizer_options, read_hotwords
from streamer.cli.diarizer import diarization_options, known_speakers_from
from streamer.core.protocol import StreamOptions
from streamer.core.segmenter import SegmenterOptions
from streamer.core.session import SessionOptions

logger = logging.getLogger(__name__)


# the flags that set the option of the same name, per options type (the others are
# converted or renamed below)
_SERVER_FLAGS = (
    "host",
    "port",
    "max_sessions",
    "token",
    "certfile",
    "keyfile",
    "max_message_bytes",
    "max_total_input_messages_per_s",
    "max_total_input_bytes_per_s",
    "shutdown_grace_s",
    "drain_s",
    "public_metrics",
    "vad_aggressiveness",
    "funasr_port",
    "wyoming_port",
    "wyoming_insecure",
)
_LIMITS_FLAGS = (
    "max_backlog_bytes",
    "idle_timeout_s",
    "max_session_s",
    "write_timeout_s",
    "max_input_messages_per_s",
    "max_input_bytes_per_s",
)
_CAPACITY_FLAGS = (
    "max_final_lag_ms",
    "max_final_load",
    "final_p95_budget_ms",
    "ttft_p95_budget_ms",
)
_SEGMENTER_FLAGS = ("max_utterance_ms", "pause_dip_ms", "pause_contrast_db", "cut_search_ms")
_SESSION_FLAGS = ("partial_interval_ms", "speculative_finals")
_FILE_FLAGS = (
    "allow_url_fetch",
    "allow_url_fetch_private",
    "max_uploads_receiving",
    "upload_min_bytes_per_s",
    "upload_deadline_s",
)
_WORKER_FLAGS = ("decode_timeout_s", "max_batch", "max_batch_audio_s")


def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The values of the flags ``names``, as keyword arguments of the same names."""
    return {name: getattr(args, name) for name in names}


def server_options_from(args: argparse.Namespace) -> Any:
    """The :class:`ServerOptions` ``streamer serve``'s flags ask for."""
    from dataclasses import replace

    from streamer.core.capacity import CapacityOptions
    from streamer.server.options import FileOptions
    from streamer.server.server import ConnectionLimits, ServerOptions

    default_stream = replace(StreamOptions(), endpoint_ms=args.endpoint_ms)
    # endpoint_ms is a stream option (clients may choose theirs); this is its default
    segmenter = SegmenterOptions(
        long_segment_ms=min(args.long_segment_ms, args.max_utterance_ms),
        **_flags(args, _SEGMENTER_FLAGS),
    )
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    return ServerOptions(
        allowed_origins=origins,
        limits=ConnectionLimits(**_flags(args, _LIMITS_FLAGS)),
        capacity=CapacityOptions(enabled=args.capacity_admission, **_flags(args, _CAPACITY_FLAGS)),
        default_stream=default_stream,
        session=SessionOptions(
            segmenter=segmenter,
            hotwords=read_hotwords(args.hotwords),
            diarization=diarization_options(args),
            known_speakers=known_speakers_from(args),
            **_flags(args, _SESSION_FLAGS),
        ),
        files=FileOptions(
            max_jobs=args.max_file_jobs,
            max_upload_bytes=round(args.max_upload_mb * (1 << 20)),
            max_duration_s=args.max_file_duration_s,
            **_flags(args, _FILE_FLAGS),
        ),
        **_flags(args, _SERVER_FLAGS),
    )


def worker_pool(args: argparse.Namespace, metrics: Any, progress: Any) -> Any:
    """The model workers ``--device`` and ``--workers`` ask for, each device checked first."""
    from dataclasses import replace

    from streamer.model.backends.loading import load_recognizer, preflight, resolve_devices
    from streamer.model.serving.pool import (
        FILE_WORKER_NICE,
        WorkerHooks,
        WorkerPool,
        WorkerSlot,
        plan_slots,
    )
    from streamer.model.serving.worker import ModelWorker, SpeechRecognizer, WorkerOptions

    devices = resolve_devices(args.device)
    base = _recognizer_options(argparse.Namespace(**{**vars(args), "device": devices[0]}))
    for device in devices:  # impossible devices, missing files: fail in seconds
        preflight(replace(base, device=device))
    slots = plan_slots(
        devices,
        workers_per_device=args.workers,
        threads=args.threads,
        usable_cores=_cores(),
        file_worker=args.file_worker and args.max_file_jobs > 0,
    )

    def build(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        options = replace(base, device=slot.device, threads=slot.threads)
        # the first worker reports its loading stages to /readyz; the others load alike
        shown = progress if slot.index == 0 else None

        def load() -> SpeechRecognizer:
            if args.model_process:  # features and decoding under the child's own GIL
                from streamer.model.serving.process import ProcessRecognizer

                return ProcessRecognizer(partial(load_recognizer, options), shown)
            return load_recognizer(options, shown)

        return ModelWorker(
            load,
            options=WorkerOptions(
                max_restarts=args.model_restarts,
                nice=FILE_WORKER_NICE if slot.background else 0,
                **_flags(args, _WORKER_FLAGS),
            ),
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
