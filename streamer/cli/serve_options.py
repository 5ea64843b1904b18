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


def server_options_from(args: argparse.Namespace) -> Any:
    """The :class:`ServerOptions` ``streamer serve``'s flags ask for."""
    from dataclasses import replace

    from streamer.core.capacity import CapacityOptions
    from streamer.server.options import FileOptions
    from streamer.server.server import ConnectionLimits, ServerOptions

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
        limits=ConnectionLimits(
            max_backlog_bytes=args.max_backlog_bytes,
            idle_timeout_s=args.idle_timeout_s,
            max_session_s=args.max_session_s,
            write_timeout_s=args.write_timeout_s,
            max_input_messages_per_s=args.max_input_messages_per_s,
            max_input_bytes_per_s=args.max_input_bytes_per_s,
        ),
        max_total_input_messages_per_s=args.max_total_input_messages_per_s,
        max_total_input_bytes_per_s=args.max_total_input_bytes_per_s,
        capacity=CapacityOptions(
            max_final_lag_ms=args.max_final_lag_ms,
            max_final_load=args.max_final_load,
            final_p95_budget_ms=args.final_p95_budget_ms,
            ttft_p95_budget_ms=args.ttft_p95_budget_ms,
            enabled=args.capacity_admission,
        ),
        shutdown_grace_s=args.shutdown_grace_s,
        drain_s=args.drain_s,
        public_metrics=args.public_metrics,
        vad_aggressiveness=args.vad_aggressiveness,
        default_stream=default_stream,
        session=SessionOptions(
            segmenter=segmenter,
            partial_interval_ms=args.partial_interval_ms,
            speculative_finals=args.speculative_finals,
            hotwords=read_hotwords(args.hotwords),
            diarization=diarization_options(args),
            known_speakers=known_speakers_from(args),
        ),
        funasr_port=args.funasr_port,
        wyoming_port=args.wyoming_port,
        wyoming_insecure=args.wyoming_insecure,
        files=FileOptions(
            max_jobs=args.max_file_jobs,
            max_upload_bytes=round(args.max_upload_mb * (1 << 20)),
            max_duration_s=args.max_file_duration_s,
            allow_url_fetch=args.allow_url_fetch,
            allow_url_fetch_private=args.allow_url_fetch_private,
            max_uploads_receiving=args.max_uploads_receiving,
            upload_min_bytes_per_s=args.upload_min_bytes_per_s,
            upload_deadline_s=args.upload_deadline_s,
        ),
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
                decode_timeout_s=args.decode_timeout_s,
                max_batch=args.max_batch,
                max_batch_audio_s=args.max_batch_audio_s,
                max_restarts=args.model_restarts,
                nice=FILE_WORKER_NICE if slot.background else 0,
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
