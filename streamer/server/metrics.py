"""Prometheus metrics of one server instance (its own registry, no globals)."""

from __future__ import annotations

import contextlib
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
        # process_open_fds / process_max_fds, resident memory, CPU seconds (Linux)
        ProcessCollector(registry=r)
        # protocol: the endpoint's name ("v1", "deepgram", "openai", ...)
        self.sessions_active = Gauge(
            "streamer_sessions_active", "Open sessions", ["protocol"], registry=r
        )
        # sum(active) / capacity is the utilisation an autoscaler targets (deploy/k8s/)
        self.sessions_capacity = Gauge(
            "streamer_sessions_capacity", "Most sessions admitted at once", registry=r
        )
        self.draining = Gauge(
            "streamer_draining", "1 while new sessions are refused before a restart", registry=r
        )
        self.sessions_total = Counter(
            "streamer_sessions", "Sessions accepted", ["protocol"], registry=r
        )
        self.rejected_total = Counter(
            "streamer_handshakes_rejected",
            "Handshakes refused",
            ["reason", "protocol"],
            registry=r,
        )
        # the file APIs (api: "openai-files", "deepgram-files"): uploads being transcribed,
        # and every upload's outcome ("ok", or the error code it was answered with)
        self.file_jobs_active = Gauge(
            "streamer_file_jobs_active", "Uploaded files being transcribed", ["api"], registry=r
        )
        self.file_uploads_receiving = Gauge(
            "streamer_file_uploads_receiving",
            "Upload bodies being received (no transcription slot held yet)",
            registry=r,
        )
        self.files_total = Counter(
            "streamer_files", "Uploaded files answered", ["api", "outcome"], registry=r
        )
        self.audio_seconds_total = Counter(
            "streamer_audio_seconds", "Client audio received", registry=r
        )
        self.segments_total = Counter("streamer_segments", "Finals sent", ["reason"], registry=r)
        self.partials_sent_total = Counter("streamer_partials_sent", "Partials sent", registry=r)
        self.partials_skipped_total = Counter(
            "streamer_partials_skipped",
            "Partial decodes skipped or discarded because the worker was busy",
            registry=r,
        )
        self.errors_total = Counter("streamer_errors", "Error messages sent", ["code"], registry=r)
        self.notices_total = Counter(
            "streamer_notices",
            "Warnings given to sessions that go on (hotwords_unused: phrases the model's "
            "vocabulary cannot spell, skipped)",
            ["code"],
            registry=r,
        )
        self.decode_seconds = Histogram(
            "streamer_decode_seconds",
            "Model time per decode",
            ["kind"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "streamer_queue_wait_seconds",
            "Time a job waited for the worker",
            ["kind"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decode_batch_size = Histogram(
            "streamer_decode_batch_size",
            "Jobs decoded in the same model call, observed once per decoded job",
            registry=r,
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.decode_failures_total = Counter(
            "streamer_decode_failures", "Decodes that raised", registry=r
        )
        self.first_partial_seconds = Histogram(
            "streamer_time_to_first_partial_seconds",
            "From sending speech_start to the first partial or final with text",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        # what admission's budgets are on (streamer.core.live_latency): each after the
        # audio concerned arrived, real-time sessions only
        self.live = LiveLatency()
        self.final_latency_seconds = Histogram(
            "streamer_final_latency_seconds",
            "A live final after the last sample of its audio arrived (real-time sessions)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "streamer_time_to_first_token_seconds",
            "An utterance's first text after its first sample arrived (real-time sessions)",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.loop_lag_seconds = Histogram(
            "streamer_event_loop_lag_seconds",
            "Event-loop scheduling delay",
            buckets=LAG_BUCKETS_S,
            registry=r,
        )
        self.queue_depth = Gauge(
            "streamer_worker_queue_depth", "Jobs waiting", ["kind"], registry=r
        )
        self.terminated_total = Counter(
            "streamer_sessions_terminated",
            "Sessions closed at once by a limit (client not reading, keepalive, idle)",
            ["reason"],
            registry=r,
        )
        self.unlabelled_finals_total = Counter(
            "streamer_diarization_unlabelled_finals",
            "Diarized segments the speaker models did not label: later than "
            "--diarize-max-wait-ms (late: the final went out without speakers), refused by "
            "their full queue (refused) or failed (failed); a refused or failed analysis "
            "speculated in a pause is sent again when the segment closes",
            ["reason"],
            registry=r,
        )
        self.speaker_analysis_seconds = Histogram(
            "streamer_diarization_analysis_seconds",
            "Speaker models' time per segment (segmentation and embeddings)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.input_paced_seconds_total = Counter(
            "streamer_input_paced_seconds",
            "Time readers waited because a client sent frames or bytes faster than the "
            "pacing limits (--max-input-messages-per-s, --max-input-bytes-per-s)",
            registry=r,
        )
        self.input_budget_paced_seconds_total = Counter(
            "streamer_input_budget_paced_seconds",
            "Of those, time readers waited because all clients together sent more than the "
            "total input budget (--max-total-input-messages-per-s, ...-bytes-per-s)",
            registry=r,
        )
        self.saturated = Gauge(
            "streamer_saturated",
            "1 while new sessions are refused because one more would break a latency "
            "budget or the load ceiling (--final-p95-budget-ms, --ttft-p95-budget-ms, "
            "--max-final-load, --max-final-lag-ms)",
            registry=r,
        )
        self.saturations_total = Counter(
            "streamer_saturations", "Times the server became saturated", ["reason"], registry=r
        )
        self.final_load = Gauge(
            "streamer_final_load",
            "Share of the workers' time spent decoding finals (over the capacity window)",
            registry=r,
        )
        self.final_wait_p95 = Gauge(
            "streamer_final_wait_p95_seconds",
            "The queue model's projected p95 of a final's wait behind other sessions' "
            "decodes with one more session (an input of the latency projection)",
            registry=r,
        )
        # budget: "final" or "ttft"; figure: "measured" (p95 over the capacity window),
        # "projected" (with one more session) or "budget"
        self.latency_p95 = Gauge(
            "streamer_latency_p95_seconds",
            "Admission's view of the live sessions' latency p95 and its budgets",
            ["budget", "figure"],
            registry=r,
        )
        self.capacity_headroom = Gauge(
            "streamer_capacity_headroom_sessions",
            "Sessions admission would still admit within its budgets (and --max-sessions)",
            registry=r,
        )
        self.capacity_utilization = Gauge(
            "streamer_capacity_utilization",
            "Open sessions / (open + headroom): 1 while new sessions are refused; what an "
            "autoscaler scales on (deploy/k8s/hpa.yaml)",
            registry=r,
        )
        self.fast_sessions = Gauge(
            "streamer_fast_sessions",
            "Sessions sending audio faster than real time (their audio is decoded at "
            "that rate; their latencies are left out of the budgets)",
            registry=r,
        )
        self.partials_interrupted_total = Counter(
            "streamer_partials_interrupted",
            "Partial decodes stopped midway so that a final queued behind them went first",
            registry=r,
        )
        self.model_ready = Gauge(
            "streamer_model_ready", "1 once the model is warmed up", registry=r
        )

        # per worker of the pool (--device cuda:0,cuda:1, --workers N): worker is its
        # index, device its device; rate(busy) is a device's utilisation
        self._worker_labels: dict[str, tuple[str, str]] = {}  # worker -> labels set last
        self.worker_sessions = Gauge(
            "streamer_worker_sessions",
            "Sessions pinned to the worker",
            ["worker", "device"],
            registry=r,
        )
        self.worker_queued = Gauge(
            "streamer_worker_queued_jobs",
            "Jobs waiting for the worker",
            ["worker", "device"],
            registry=r,
        )
        self.worker_ready = Gauge(
            "streamer_worker_ready",
            "1 while the worker is loaded and healthy",
            ["worker", "device"],
            registry=r,
        )
        self.worker_decodes_total = Counter(
            "streamer_worker_decodes",
            "Decodes done by the worker",
            ["worker", "device", "kind"],
            registry=r,
        )
        self.worker_restarts_total = Counter(
            "streamer_worker_restarts",
            "Times the worker's model process was started again after it died or stalled",
            ["worker", "device"],
            registry=r,
        )
        self._restarts_seen: dict[str, int] = {}  # worker -> restarts counted so far
        self.worker_busy_seconds_total = Counter(
            "streamer_worker_busy_seconds",
            "Model time spent by the worker",
            ["worker", "device"],
            registry=r,
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
