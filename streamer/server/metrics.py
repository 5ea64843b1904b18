"""Prometheus metrics of one server instance (its own registry, no globals)."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from streamer.core.jobs import DecodeJob, DecodeResult
from streamer.core.live_latency import LiveLatency
from streamer.model.serving.pool import WorkerLoad, WorkerSlot

# Jobs per model call (--max-batch); a GPU sweep goes up to 64.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Buckets in seconds: decodes take 10 ms (GPU) to 1 s (CPU, 7 s of audio).
LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
)
LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST

M = TypeVar("M", Counter, Histogram)


class _Children(Generic[M]):
    """``metric.labels(*values)``, looked up once per distinct label values.

    Safe from any thread: two threads missing at once both get the same child, since
    prometheus_client's ``labels`` returns the existing one.
    """

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class Metrics:
    """Every metric the server exports, prefixed ``streamer_``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # every metric below is this instance's (none in prometheus_client's global registry)
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        histogram = partial(Histogram, registry=r, buckets=LATENCY_BUCKETS_S)
        # process_open_fds / process_max_fds, resident memory, CPU seconds (Linux)
        ProcessCollector(registry=r)
        # protocol: the endpoint's name ("v1", "deepgram", "openai", ...)
        self.sessions_active = gauge("streamer_sessions_active", "Open sessions", ["protocol"])
        # sum(active) / capacity is the utilisation an autoscaler targets (deploy/k8s/)
        self.sessions_capacity = gauge(
            "streamer_sessions_capacity", "Most sessions admitted at once"
        )
        self.draining = gauge(
            "streamer_draining", "1 while new sessions are refused before a restart"
        )
        self.sessions_total = counter("streamer_sessions", "Sessions accepted", ["protocol"])
        self.rejected_total = counter(
            "streamer_handshakes_rejected", "Handshakes refused", ["reason", "protocol"]
        )
        # the file APIs (api: "openai-files", "deepgram-files"): uploads being transcribed,
        # and every upload's outcome ("ok", or the error code it was answered with)
        self.file_jobs_active = gauge(
            "streamer_file_jobs_active", "Uploaded files being transcribed", ["api"]
        )
        self.file_uploads_receiving = gauge(
            "streamer_file_uploads_receiving",
            "Upload bodies being received (no transcription slot held yet)",
        )
        self.files_total = counter("streamer_files", "Uploaded files answered", ["api", "outcome"])
        self.audio_seconds_total = counter("streamer_audio_seconds", "Client audio received")
        self.segments_total = counter("streamer_segments", "Finals sent", ["reason"])
        self.partials_sent_total = counter("streamer_partials_sent", "Partials sent")
        self.partials_skipped_total = counter(
            "streamer_partials_skipped",
            "Partial decodes skipped or discarded because the worker was busy",
        )
        self.errors_total = counter("streamer_errors", "Error messages sent", ["code"])
        self.notices_total = counter(
            "streamer_notices",
            "Warnings given to sessions that go on (hotwords_unused: phrases the model's "
            "vocabulary cannot spell, skipped)",
            ["code"],
        )
        self.decode_seconds = histogram(
            "streamer_decode_seconds", "Model time per decode", ["kind"]
        )
        self.queue_wait_seconds = histogram(
            "streamer_queue_wait_seconds", "Time a job waited for the worker", ["kind"]
        )
        self.decode_batch_size = histogram(
            "streamer_decode_batch_size",
            "Jobs decoded in the same model call, observed once per decoded job",
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.decode_failures_total = counter("streamer_decode_failures", "Decodes that raised")
        self.first_partial_seconds = histogram(
            "streamer_time_to_first_partial_seconds",
            "From sending speech_start to the first partial or final with text",
        )
        # what admission's budgets are on (streamer.core.live_latency): each after the
        # audio concerned arrived, real-time sessions only
        self.live = LiveLatency()
        self.final_latency_seconds = histogram(
            "streamer_final_latency_seconds",
            "A live final after the last sample of its audio arrived (real-time sessions)",
        )
        self.ttft_seconds = histogram(
            "streamer_time_to_first_token_seconds",
            "An utterance's first text after its first sample arrived (real-time sessions)",
        )
        self.loop_lag_seconds = histogram(
            "streamer_event_loop_lag_seconds", "Event-loop scheduling delay", buckets=LAG_BUCKETS_S
        )
        self.queue_depth = gauge("streamer_worker_queue_depth", "Jobs waiting", ["kind"])
        self.terminated_total = counter(
            "streamer_sessions_terminated",
            "Sessions closed at once by a limit (client not reading, keepalive, idle)",
            ["reason"],
        )
        self.unlabelled_finals_total = counter(
            "streamer_diarization_unlabelled_finals",
            "Diarized segments the speaker models did not label: later than "
            "--diarize-max-wait-ms (late: the final went out without speakers), refused by "
            "their full queue (refused) or failed (failed); a refused or failed analysis "
            "speculated in a pause is sent again when the segment closes",
            ["reason"],
        )
        self.speaker_analysis_seconds = histogram(
            "streamer_diarization_analysis_seconds",
            "Speaker models' time per segment (segmentation and embeddings)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.input_paced_seconds_total = counter(
            "streamer_input_paced_seconds",
            "Time readers waited because a client sent frames or bytes faster than the "
            "pacing limits (--max-input-messages-per-s, --max-input-bytes-per-s)",
        )
        self.input_budget_paced_seconds_total = counter(
            "streamer_input_budget_paced_seconds",
            "Of those, time readers waited because all clients together sent more than the "
            "total input budget (--max-total-input-messages-per-s, ...-bytes-per-s)",
        )
        self.saturated = gauge(
            "streamer_saturated",
            "1 while new sessions are refused because one more would break a latency "
            "budget or the load ceiling (--final-p95-budget-ms, --ttft-p95-budget-ms, "
            "--max-final-load, --max-final-lag-ms)",
        )
        self.saturations_total = counter(
            "streamer_saturations", "Times the server became saturated", ["reason"]
        )
        self.final_load = gauge(
            "streamer_final_load",
            "Share of the workers' time spent decoding finals (over the capacity window)",
        )
        self.final_wait_p95 = gauge(
            "streamer_final_wait_p95_seconds",
            "The queue model's projected p95 of a final's wait behind other sessions' "
            "decodes with one more session (an input of the latency projection)",
        )
        # budget: "final" or "ttft"; figure: "measured" (p95 over the capacity window),
        # "projected" (with one more session) or "budget"
        self.latency_p95 = gauge(
            "streamer_latency_p95_seconds",
            "Admission's view of the live sessions' latency p95 and its budgets",
            ["budget", "figure"],
        )
        self.capacity_headroom = gauge(
            "streamer_capacity_headroom_sessions",
            "Sessions admission would still admit within its budgets (and --max-sessions)",
        )
        self.capacity_utilization = gauge(
            "streamer_capacity_utilization",
            "Open sessions / (open + headroom): 1 while new sessions are refused; what an "
            "autoscaler scales on (deploy/k8s/hpa.yaml)",
        )
        self.fast_sessions = gauge(
            "streamer_fast_sessions",
            "Sessions sending audio faster than real time (their audio is decoded at "
            "that rate; their latencies are left out of the budgets)",
        )
        self.partials_interrupted_total = counter(
            "streamer_partials_interrupted",
            "Partial decodes stopped midway so that a final queued behind them went first",
        )
        self.model_ready = gauge("streamer_model_ready", "1 once the model is warmed up")

        # per worker of the pool (--device cuda:0,cuda:1, --workers N): worker is its
        # index, device its device; rate(busy) is a device's utilisation
        self._worker_labels: dict[str, tuple[str, str]] = {}  # worker -> labels set last
        per_worker = ("worker", "device")
        self.worker_sessions = gauge(
            "streamer_worker_sessions", "Sessions pinned to the worker", per_worker
        )
        self.worker_queued = gauge(
            "streamer_worker_queued_jobs", "Jobs waiting for the worker", per_worker
        )
        self.worker_ready = gauge(
            "streamer_worker_ready",
            "1 while the worker is loaded and healthy",
            per_worker,
        )
        self.worker_decodes_total = counter(
            "streamer_worker_decodes", "Decodes done by the worker", [*per_worker, "kind"]
        )
        self.worker_restarts_total = counter(
            "streamer_worker_restarts",
            "Times the worker's model process was started again after it died or stalled",
            per_worker,
        )
        self._restarts_seen: dict[str, int] = {}  # worker -> restarts counted so far
        self.worker_busy_seconds_total = counter(
            "streamer_worker_busy_seconds", "Model time spent by the worker", per_worker
        )

        # children of the labelled series updated per message or per decode: labels() is
        # slow (validation and a lock), a dict lookup is not
        self.segments = _Children(self.segments_total)
        self.errors = _Children(self.errors_total)
        self.notices = _Children(self.notices_total)
        self._queue_wait = _Children(self.queue_wait_seconds)
        self._decode = _Children(self.decode_seconds)
        self._worker_decodes = _Children(self.worker_decodes_total)
        self._worker_busy = _Children(self.worker_busy_seconds_total)

    def observe_worker_decode(self, slot: WorkerSlot, result: DecodeResult) -> None:
        """The pool's decode hook: the totals above, and the worker's own counters."""
        self.observe_decode(result)
        self._worker_decodes(slot.label, slot.device, job_kind(result.job)).inc()
        self._worker_busy(slot.label, slot.device).inc(result.decode_ms / 1000)

    def observe_workers(self, loads: list[WorkerLoad]) -> None:
        """Each worker's gauges (the server calls it a few times a second), and the
        background jobs waiting in all of them (the server sets the other kinds)."""
        self.queue_depth.labels("background").set(
            sum(load.stats.queued_background for load in loads)
        )
        for load in loads:
            labels = (load.slot.label, load.slot.device)
            before = self._worker_labels.setdefault(load.slot.label, labels)
            if before != labels:  # "auto" became the device the worker loaded on
                for series in (
                    self.worker_sessions,
                    self.worker_queued,
                    self.worker_ready,
                    self.worker_restarts_total,
                ):
                    with contextlib.suppress(KeyError):  # never set
                        series.remove(*before)
                self._worker_labels[load.slot.label] = labels
            self.worker_sessions.labels(*labels).set(load.sessions)
            self.worker_queued.labels(*labels).set(
                load.stats.queued_finals + load.stats.queued_partials + load.stats.queued_background
            )
            self.worker_ready.labels(*labels).set(int(load.state == "ready"))
            restarts = self.worker_restarts_total.labels(*labels)  # exported at 0 from the start
            new = load.restarts - self._restarts_seen.get(load.slot.label, 0)
            if new > 0:
                restarts.inc(new)
                self._restarts_seen[load.slot.label] = load.restarts

    def observe_decode(self, result: DecodeResult) -> None:
        """Called from the worker thread for every decode (prometheus_client is thread-safe)."""
        if result.interrupted:  # a partial stopped midway so that a final went first
            self.partials_interrupted_total.inc()
            return
        kind = job_kind(result.job)
        self._queue_wait(kind).observe(result.queue_ms / 1000)
        if result.failure is not None:
            self.decode_failures_total.inc()
        else:
            self._decode(kind).observe(result.decode_ms / 1000)
            self.decode_batch_size.observe(result.batch_size)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def job_kind(job: DecodeJob) -> str:
    """The ``kind`` label of a job's series: ``final`` or ``partial`` for live work,
    ``background`` for a file upload's (its waits behind live work would otherwise
    hide in the live finals' queue times)."""
    return "background" if job.background else job.kind
