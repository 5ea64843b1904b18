"""One client's stream as a state machine (I/O-free).

Inputs: :meth:`Session.receive_audio` (binary frames), :meth:`Session.receive_text`
(control messages), :meth:`Session.decode_finished` (the worker's answers) and the
server-side events :meth:`Session.expire` and :meth:`Session.shutdown`.
Outputs, drained by the caller after every input: :meth:`Session.messages_to_send`
(protocol messages, in order) and :meth:`Session.jobs_to_submit` (decode jobs).

The session never reads a clock and never blocks; time is the count of 16 kHz samples.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from streamer.core import hotwords, protocol
from streamer.core.audio import SAMPLE_RATE
from streamer.core.error_burst import ErrorBurst
from streamer.core.framing import AudioBuffer, PcmFramer, S16Decoder
from streamer.core.jobs import (
    DecodeFailure,
    DecodeJob,
    DecodeResult,
    final_message,
    final_of_speculation,
)
from streamer.core.jobs import samples_ms as _ms
from streamer.core.open_segment import OpenSegment, Speculation, window_job_fields
from streamer.core.protocol import (
    ConfigMessage,
    End,
    Error,
    Final,
    FinalizeMessage,
    KeepaliveMessage,
    Notice,
    Partial,
    Ready,
    ServerMessage,
    SpeechStart,
    StopMessage,
    StreamOptions,
)
from streamer.core.resample import StreamResampler
from streamer.core.segmenter import SegmentEnd, Segmenter, SegmentEvent, SegmentStart
from streamer.core.session_speakers import SpeakerAnalysis
from streamer.core.session_state import SessionOptions, SessionStats, State
from streamer.core.vad import FrameClassifier, frame_energies
from streamer.errors import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    MalformedMessage,
    ProtocolError,
    UnexpectedMessage,
    close_code_for,
)

__all__ = ["Session", "SessionOptions", "SessionStats", "State"]


class Session:
    """The protocol logic of one WebSocket connection. See the module docstring."""

    def __init__(
        self,
        session_id: str,
        options: SessionOptions,
        stream: StreamOptions,
        classifier: FrameClassifier,
        *,
        background: bool = False,
    ) -> None:
        """``background``: a file upload's session. Its jobs are marked ``background``
        (the worker decodes them after every live job) and it submits finals only: no
        partials and no speculative finals, whose only gain is latency (what follows a
        pause in a file is already there), whatever ``stream.partials`` says."""
        self.session_id = session_id
        self.background = background
        self.options = options
        self.stream = stream
        self.stats = SessionStats()
        self.state = State.CONFIGURING
        self.close_code: int | None = None  # set once the connection should close
        self.close_reason = ""
        self._classify = classifier
        self._messages: list[ServerMessage] = []
        self._jobs: list[DecodeJob] = []
        self._held: list[ServerMessage] = []  # messages of segments after the next final
        self._next_final_id = 0
        self._pending_finals: set[int] = set()
        self._finalize_tail: np.ndarray | None = None  # an immediate finalize's last samples
        self._end_close_code = CLOSE_NORMAL
        self._server_stopped = False  # shutdown/expire: late client input is dropped quietly
        self._burst = ErrorBurst()  # one answer per burst of the same non-fatal error
        self._configure(stream)

    # -- outputs ---------------------------------------------------------------

    def messages_to_send(self) -> list[ServerMessage]:
        """Messages produced since the last call, in the order they must be sent."""
        out, self._messages = self._messages, []
        return out

    def jobs_to_submit(self) -> list[DecodeJob]:
        """Decode jobs produced since the last call."""
        out, self._jobs = self._jobs, []
        return out

    @property
    def pending_finals(self) -> int:
        """Finals queued or decoding; the server stops reading audio while this is high."""
        return len(self._pending_finals)

    @property
    def audio_ms(self) -> float:
        return self.stats.audio_samples_in * 1000 / self.stream.sample_rate

    @property
    def retained_samples(self) -> int:
        return self._buffer.retained_samples

    # -- inputs ----------------------------------------------------------------

    def start(self) -> None:
        """Queue the ``ready`` message; call once, right after construction."""
        self._send_ready()

    def receive_audio(self, data: bytes) -> None:
        """A binary frame: s16le PCM at the session's sample rate."""
        if self.state in (State.STOPPING, State.ENDED):
            if not self._server_stopped:  # the client sent a stop: tell it once per burst
                self._non_fatal(UnexpectedMessage("audio after stop is ignored"))
            return
        if not data:
            return
        self._end_burst()
        self.state = State.STREAMING
        self._bytes_in += len(data)
        self.stats.audio_samples_in = self._bytes_in // 2
        if self._resampler is None:
            frames = self._framer.push_bytes_block(data)
        else:
            samples = self._decoder.push(data)
            frames = self._framer.push_samples_block(self._resampler.push(samples))
        self._process_frames(frames)

    def receive_text(self, text: str | bytes) -> None:
        """A text frame: one JSON control message."""
        if self.state is State.ENDED:
            return
        try:
            if len(text) > self.options.max_text_message_bytes:
                raise MalformedMessage(
                    f"control message of {len(text)} bytes exceeds "
                    f"{self.options.max_text_message_bytes}"
                )
            message = protocol.parse_client_message(text)
            if self._server_stopped and self.state is not State.CONFIGURING:
                return  # finalize/stop/keepalive racing the server's own stop: moot
            self._handle_control(message)
        except ProtocolError as error:
            if error.fatal:
                self._fail(error)
            else:
                self._non_fatal(error)
        else:
            self._end_burst()

    def speakers_finished(self, segment_id: int, analysis: SpeakerAnalysis | None) -> None:
        """The speaker models' answer for a closed segment; None: no answer in time."""
        if self.speakers and (final := self.speakers.analysed(segment_id, analysis)):
            self._send_final(final)

    def decode_finished(self, result: DecodeResult) -> None:
        """The worker's answer to one of this session's jobs."""
        job = result.job
        if result.transcript is not None and result.transcript.hotwords_unused:
            self._hotwords_unused(result.transcript.hotwords_unused)
        if job.kind == "partial":
            self._partial_finished(result)
        else:
            self._final_finished(result)

    def expire(self, code: str, message: str, close_code: int = CLOSE_POLICY_VIOLATION) -> None:
        """A server-side limit ended the session (idle timeout, maximum duration).

        Open speech is still finished and delivered before the close (``close_code``,
        1008 by default; 1011 when the server itself failed). Client input that arrives
        after this is dropped without an error.
        """
        if self.state in (State.STOPPING, State.ENDED):
            return  # the last finals are on their way; they end the session
        self._server_stopped = True
        self._end_burst()
        self._emit(Error(code=code, message=message, fatal=True))
        self._end_close_code = close_code
        self.close_reason = code
        self._stop()

    def shutdown(self) -> None:
        """The server is stopping: finish every open segment, send ``end``, close 1001."""
        if self.state is State.ENDED:
            return
        self._server_stopped = True
        self._end_burst()
        if self.state is not State.STOPPING:
            self._emit(
                Error(code="server_shutdown", message="the server is shutting down", fatal=False)
            )
        self._end_close_code = CLOSE_GOING_AWAY
        self.close_reason = "server shutting down"
        self._stop()

    def configure(self, params: dict[str, object]) -> None:
        """Change stream options before the first audio (raises ProtocolError)."""
        if self.state is not State.CONFIGURING:
            raise UnexpectedMessage("config is only accepted before the first audio frame")
        self._configure(protocol.parse_stream_options(params, self.stream))
        self._send_ready()

    def finalize(self, *, at_pause: bool = True) -> None:
        """End the open segment (its final follows); raises UnexpectedMessage after stop.

        ``at_pause`` (protocol v1's ``finalize``): at once when the audio so far ends in
        ``end_pad_ms`` (200 ms) of non-speech, else at the next such pause, so a
        finalize never splits a word (see :mod:`streamer.core.segmenter`). Without it
        the segment ends now, at the current position: what Deepgram's ``Finalize`` and
        OpenAI's ``commit`` promise their clients (a push-to-talk release, an agent's
        end of turn), whose answers must not wait for more audio.
        """
        if self.state in (State.STOPPING, State.ENDED):
            raise UnexpectedMessage("finalize after stop is ignored")
        if self._resampler is not None:  # the filter's held-back audio is sent audio too
            self._process_frames(self._framer.push_samples_block(self._resampler.drain()))
        if at_pause:
            self._handle_events(self._segmenter.finalize())
            return
        # every sample sent so far is in the final, also those of the frame not yet
        # complete (they stay in the framer for the stream's next frame as well)
        tail = self._framer.pending()
        end_sample = self._buffer.end_sample + tail.size
        self._finalize_tail = tail
        try:
            self._handle_events(self._segmenter.flush("finalize", end_sample=end_sample))
        finally:
            self._finalize_tail = None

    def stop(self) -> None:
        """End of stream: finish every open segment, then ``end`` (raises after a stop)."""
        if self.state in (State.STOPPING, State.ENDED):
            raise UnexpectedMessage("the stream is already stopped")
        self._stop()

    # -- control ---------------------------------------------------------------

    def _handle_control(self, message: protocol.ClientMessage) -> None:
        if isinstance(message, KeepaliveMessage):
            return
        if isinstance(message, ConfigMessage):
            self.configure(message.params)
        elif isinstance(message, FinalizeMessage):
            self.finalize()
        elif isinstance(message, StopMessage):
            self.stop()

    def _configure(self, stream: StreamOptions) -> None:
        self.stream = stream
        self._hotwords = hotwords.merge(self.options.hotwords, stream.hotwords)
        self._hotwords_told: hotwords.Hotwords | None = None  # the set hotwords_unused named
        # the client's endpoint wins; the segmenter keeps its end padding within it
        seg_options = replace(self.options.segmenter, endpoint_ms=stream.endpoint_ms)
        self._segmenter = Segmenter(seg_options)
        self._framer = PcmFramer(seg_options.frame_samples)
        self._buffer = AudioBuffer()
        self._bytes_in = 0
        if stream.sample_rate == SAMPLE_RATE:
            self._resampler: StreamResampler | None = None
        else:
            self._resampler = StreamResampler(stream.sample_rate, SAMPLE_RATE)
            self._decoder = S16Decoder()  # whole input samples for the resampler
        self._open: OpenSegment | None = None
        # the partial last submitted, until it is answered (None: none in flight); an
        # older one's answer (dropped: superseded in the queue) does not clear it, or the
        # next tick would supersede the pending one in turn (a first partial was replaced
        # every 300 ms and never decoded: issue 31)
        self._partial_inflight: DecodeJob | None = None
        # speculative final of the open segment: the range submitted, and its result
        self._spec = Speculation()
        # segments that ended while their speculative decode runs: their finals follow it
        self._awaiting_spec: dict[int, SegmentEnd] = {}
        # diarize: the speaker models' jobs and the finals held for them (None without)
        self.speakers = self.options.speakers_for(self.session_id, stream, self.background)

    def _send_ready(self) -> None:
        self._emit(
            Ready(
                session_id=self.session_id,
                protocol=protocol.PROTOCOL_VERSION,
                sample_rate=self.stream.sample_rate,
                model=self.options.model_name,
                options=self.stream.to_dict(),
            )
        )
        if self.stream.diarize and self.speakers is None:
            self._non_fatal_code(protocol.DIARIZE_UNAVAILABLE, "this server has no speaker models")

    # -- audio -----------------------------------------------------------------

    def _process_frames(self, frames: np.ndarray) -> None:
        """Feed a block of frames (one per row) through the VAD and the segmenter."""
        # The whole block is buffered first: what a frame's events submit only reaches
        # up to that frame, and nothing is discarded before the end of the block.
        self._buffer.append(frames)
        segmenter = self._segmenter
        classify = self._classify
        for frame, energy in zip(frames, frame_energies(frames), strict=True):
            events = segmenter.push(classify(frame), energy)
            if events:
                self._handle_events(events)
            elif self._open is not None:
                self._maybe_speculate()
                self._maybe_partial()
        if self.speakers is not None and self._open is not None:  # windows embedded early
            self.speakers.grow(self._open, self._segmenter.position_sample, self._buffer.slice)
        self._buffer.discard_before(self._segmenter.keep_from_sample)

    def _handle_events(self, events: list[SegmentEvent]) -> None:
        for event in events:
            if isinstance(event, SegmentStart):
                self._open = OpenSegment(
                    event.segment_id, event.start_sample, self.options.partial_window
                )
                self._spec.reset()
                self._emit(
                    SpeechStart(segment_id=event.segment_id, start_ms=_ms(event.start_sample))
                )
                # the first partial is due at the onset, however little audio the segment
                # holds: after silence its pre-roll makes it long enough anyway, and a
                # segment that follows another at once (its pre-roll clipped at the
                # previous end) must not wait for the interval to fill (issue 14)
                self._maybe_partial(onset=True)
            elif isinstance(event, SegmentEnd):
                self._open = None
                self._end_segment(event)

    def _maybe_partial(self, *, onset: bool = False) -> None:
        seg = self._open
        if not self.stream.partials or self.background or seg is None:
            return
        position = self._segmenter.position_sample
        interval = self.options.partial_interval_ms * SAMPLE_RATE // 1000
        if not onset and position - seg.partial_mark < interval:
            return
        if self._segmenter.pause_possible:
            return  # a long segment may end here: keep the worker free for its final
        seg.partial_mark = position
        if self._segmenter.last_speech_sample <= seg.partial_submitted_end:
            return  # only silence since the last partial: its text cannot have changed
        inflight = self._partial_inflight
        if inflight is not None and inflight.segment_id == seg.segment_id:
            # the worker is still busy with this segment's last partial: skip this tick
            # (an ended segment's speculative decode, its final, holds up no first partial)
            self.stats.partials_skipped += 1
            return
        self._submit_partial(position)

    def _submit_partial(self, position: int, speculative: bool = False) -> DecodeJob:
        seg = self._open
        assert seg is not None
        seg.partial_submitted_end = max(position, seg.partial_submitted_end)
        start, segment_start = window_job_fields(seg, speculative)
        job = DecodeJob(
            session_id=self.session_id,
            segment_id=seg.segment_id,
            kind="partial",
            pcm=self._buffer.slice(start, position),
            start_sample=start,
            end_sample=position,
            segment_start_sample=segment_start,
            language=self.stream.language,
            itn=self.stream.itn,
            hotwords=self._hotwords,
            first=seg.revision == 0,
            speculative=speculative,
            background=self.background,
        )
        self._partial_inflight = job
        self._jobs.append(job)
        return job

    def _maybe_speculate(self) -> None:
        """In a pause that holds the segment's whole end, decode what its final will be."""
        if (
            not self.options.speculative_finals
            or self.background
            or self.state is not State.STREAMING
        ):
            return
        end = self._segmenter.tentative_end_sample
        if end is None or self._open is None:
            return
        if self._spec.range == (self._open.start_sample, end):
            return  # already submitted (or decoded) for this pause
        self._spec.reset((self._open.start_sample, end))
        job = self._submit_partial(end, speculative=True)
        if self.speakers is not None:  # and what its speakers will be (the same audio)
            self.speakers.speculate(self._open, job.pcm)

    def _end_segment(self, event: SegmentEnd) -> None:
        """Finish a closed segment: from its speculative decode when that covered it."""
        pcm = None  # the segment's audio, copied out of the buffer once
        if self.speakers is not None:  # its audio to the speaker models (unless speculated)
            pcm = self._final_pcm(event)
            self.speakers.segment_closed(event, pcm)
        if (
            event.reason in ("silence", "max_duration")
            and self._spec.range == (event.start_sample, event.end_sample)
            and not self._spec.failed
        ):
            self._pending_finals.add(event.segment_id)
            if self._spec.result is not None:
                result = self._spec.result
                self._spec.reset()
                self._final_finished(
                    replace(result, job=final_of_speculation(result.job, event.reason))
                )
            else:
                self._awaiting_spec[event.segment_id] = event
            return
        self._spec.reset()
        self._submit_final(event, self._final_pcm(event) if pcm is None else pcm)

    def _submit_final(self, event: SegmentEnd, pcm: np.ndarray) -> None:
        self._pending_finals.add(event.segment_id)
        self._jobs.append(
            DecodeJob(
                session_id=self.session_id,
                segment_id=event.segment_id,
                kind="final",
                pcm=pcm,
                start_sample=event.start_sample,
                end_sample=event.end_sample,
                language=self.stream.language,
                itn=self.stream.itn,
                hotwords=self._hotwords,
                reason=event.reason,
                background=self.background,
            )
        )

    def _final_pcm(self, event: SegmentEnd) -> np.ndarray:
        """The segment's audio (an immediate finalize's incomplete frame included)."""
        return self._buffer.slice_with_tail(
            event.start_sample, event.end_sample, self._finalize_tail
        )

    def _stop(self) -> None:
        if self._resampler is not None:
            self._process_frames(self._framer.push_samples_block(self._resampler.flush()))
        rest = self._framer.flush()
        if rest.size:
            self._buffer.append(rest)
        events = self._segmenter.flush("stop", end_sample=self._buffer.end_sample)
        self.state = State.STOPPING
        self._handle_events(events)
        self._maybe_end()

    def _maybe_end(self) -> None:
        if self.state is State.STOPPING and not self._pending_finals:
            self._end_burst()
            self._emit(
                End(
                    segments=self.stats.segments,
                    audio_ms=round(self.audio_ms, 1),
                    partials_sent=self.stats.partials_sent,
                    partials_skipped=self.stats.partials_skipped,
                )
            )
            self.state = State.ENDED
            self.close_code = self._end_close_code

    # -- results ---------------------------------------------------------------

    def _partial_finished(self, result: DecodeResult) -> None:
        job = result.job
        if job is self._partial_inflight:  # not an older one, superseded in the queue
            self._partial_inflight = None
        if job.speculative and self._speculation_finished(result):
            return
        seg = self._open
        if (
            result.dropped
            or seg is None
            or job.segment_id != seg.segment_id
            or result.transcript is None
        ):
            # superseded, too late (the segment already ended) or failed: not shown
            if not job.speculative:
                self.stats.partials_skipped += 1
        elif self.stream.partials:  # with partials off, a speculative decode is not shown
            partial = seg.partial_of(result, self.stream.words)
            if partial is not None:
                self._emit(partial)
        # catch up at once if audio arrived while this partial was decoding
        seg = self._open
        if self.stream.partials and seg is not None and self.state is State.STREAMING:
            interval = self.options.partial_interval_ms * SAMPLE_RATE // 1000
            position = self._segmenter.position_sample
            onset_missed = seg.partial_submitted_end == seg.start_sample  # none yet
            if (
                self._partial_inflight is None
                and (onset_missed or position - seg.partial_submitted_end >= interval)
                and self._segmenter.last_speech_sample > seg.partial_submitted_end
                and not self._segmenter.pause_possible
            ):
                seg.partial_mark = position
                self._submit_partial(position)

    def _speculation_finished(self, result: DecodeResult) -> bool:
        """Keep a speculative result for the final; True when it was the final itself."""
        job = result.job
        waiting = self._awaiting_spec.get(job.segment_id)
        if waiting is not None and (job.start_sample, job.end_sample) == (
            waiting.start_sample,
            waiting.end_sample,
        ):
            del self._awaiting_spec[job.segment_id]
            if result.dropped:  # superseded or the worker stopped: decode it as a final
                self._jobs.append(final_of_speculation(job, waiting.reason))
            else:  # decoded, or failed (a final of the same audio would fail the same way)
                self._final_finished(replace(result, job=final_of_speculation(job, waiting.reason)))
            return True
        if (
            result.transcript is not None
            and self._open is not None
            and job.segment_id == self._open.segment_id
            and self._spec.range == (job.start_sample, job.end_sample)
        ):
            self._spec.result = result
        elif self._spec.range == (job.start_sample, job.end_sample):
            # dropped or failed while the segment is open: not again for this pause; if
            # the segment ends there, its final is decoded the ordinary way
            self._spec.failed = True
        return False

    def _final_finished(self, result: DecodeResult) -> None:
        job = result.job
        t = result.transcript
        error = None
        if t is None:
            # the worker's exception text stays in the server log; clients get a code
            failure = result.failure or DecodeFailure.DECODE_FAILED  # a dropped final too
            code, message = failure.code, failure.client_message(job.segment_id)
            error = {"code": code, "message": message}
            if code == self.close_reason:
                # the fatal error (model_stalled) said it already; the final carries it
                self.stats.errors += 1
            else:
                self._non_fatal_code(code, message)
        final = final_message(result, error)
        # diarize: None while held until its speakers are known
        labelled = self.speakers.label(final) if self.speakers is not None else final
        if labelled is not None:
            self._send_final(labelled)

    def _send_final(self, final: Final) -> None:
        self._pending_finals.discard(final.segment_id)
        self._emit(final)
        self.stats.segments += 1
        self._maybe_end()

    # -- emitting --------------------------------------------------------------

    def _emit(self, message: ServerMessage) -> None:
        segment_id = getattr(message, "segment_id", None)
        if segment_id is None or segment_id == self._next_final_id:
            self._deliver(message)
        else:
            self._held.append(message)

    def _deliver(self, message: ServerMessage) -> None:
        if isinstance(message, Partial):
            self.stats.partials_sent += 1
        self._messages.append(message)
        if isinstance(message, Final):
            self._next_final_id = message.segment_id + 1
            held, self._held = self._held, []
            for m in held:
                self._emit(m)

    def _hotwords_unused(self, why: str) -> None:
        """Some phrases could not be tokenized: told once per phrase set, as a notice
        (a prompt is text, not a contract: the others are used, the session goes on)."""
        if self._hotwords_told != self._hotwords:
            self._hotwords_told = self._hotwords
            self._emit(Notice(code=protocol.NOTICE_HOTWORDS_UNUSED, message=why))

    def _non_fatal(self, error: ProtocolError) -> None:
        self._non_fatal_code(error.code, error.message)

    def _non_fatal_code(self, code: str, message: str) -> None:
        self.stats.errors += 1
        for error in self._burst.record(code, message):
            self._emit(error)

    def _end_burst(self) -> None:
        for error in self._burst.end():
            self._emit(error)

    def _fail(self, error: ProtocolError) -> None:
        self.stats.errors += 1
        self._end_burst()
        self._emit(Error(code=error.code, message=error.message, fatal=True))
        self.state = State.ENDED
        self.close_code = close_code_for(error)
        self.close_reason = error.code
