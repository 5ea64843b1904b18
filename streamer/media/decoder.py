"""One stream's container bytes in, s16le mono PCM out, incrementally (PyAV).

FFmpeg's demuxers pull their input (``avio`` calls ``read``) and keep their parsing
state on the stack, so a stream whose bytes arrive in slices cannot be demuxed by a
function called once per slice. Each :class:`ContainerDecoder` therefore runs PyAV in a
thread of its own whose ``read`` waits for the next slice; :meth:`ContainerDecoder.push`
hands a slice over and waits (with a timeout) until the thread has demuxed and decoded
everything the slice completes and asks for more. The caller (the event loop) is held
for that decode only: about a tenth of a millisecond per 250 ms Opus slice
(bench/RESULTS.md, "Compressed audio"), the cost of decoding it anywhere.

Memory per stream is bounded: the thread holds at most one slice not yet read plus
FFmpeg's own read buffer (:data:`AVIO_BUFFER_BYTES`) and one packet; what it decoded
waits for the caller, who takes it with the same call. A header must be complete within
``max_header_bytes``; past the header, ``max_silent_bytes`` read without one decoded
sample is an error (bytes that are not the container any more).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import av
import av.error
import numpy as np

from streamer.core.containers import CONTAINER_FORMATS
from streamer.errors import UndecodableAudio
from streamer.media.convert import MonoConverter

logger = logging.getLogger(__name__)

AVIO_BUFFER_BYTES = 4096  # FFmpeg's read buffer; also the most one read() returns
MAX_HEADER_BYTES = 1 << 20  # a header (ID3 tags and cover art included) within 1 MiB
MAX_SILENT_BYTES = 64 * 1024  # past the header, this many bytes must yield a sample
STEP_TIMEOUT_S = 5.0  # one push may wait this long for the decoder thread
IDLE_TIMEOUT_S = 600.0  # a thread left waiting this long for bytes treats it as the end
MAX_GAP_S = 0.05  # audio missing between two decoded frames: a corrupt stream
PROBE_BYTES = 32  # what FFmpeg may read to find the stream's parameters (its minimum)
# sample rates a stream or file may declare: below, one frame resampled to 16 kHz is
# thousands of times its size (2048 samples at 1 Hz are 32.8 M at 16 kHz); above, no
# audio interface records
MIN_SAMPLE_RATE_HZ = 8000
MAX_SAMPLE_RATE_HZ = 384000


class ContainerDecoder:
    """A container stream (one of :data:`CONTAINER_FORMATS`) → s16le mono PCM at
    ``sample_rate``. Not thread-safe: one owner calls :meth:`push`, :meth:`flush` and
    :meth:`close`. Raises :class:`UndecodableAudio` for what is not the container."""

    def __init__(
        self,
        container: str,
        sample_rate: int,
        *,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_silent_bytes: int = MAX_SILENT_BYTES,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        if container not in CONTAINER_FORMATS:
            raise ValueError(f"unknown container {container!r}")
        self.container = container
        self.sample_rate = sample_rate
        self.max_header_bytes = max_header_bytes
        self.max_silent_bytes = max_silent_bytes
        self.step_timeout_s = step_timeout_s
        self.bytes_in = 0  # bytes pushed
        self.samples_out = 0  # samples decoded
        self._cond = threading.Condition()
        self._input = bytearray()  # pushed, not yet read by FFmpeg
        self._read_total = 0  # bytes FFmpeg has read
        self._header_done = False
        self._read_at_last_sample = 0
        self._output: list[bytes] = []
        self._eof = False  # no more bytes will come
        self._closed = False
        self._waiting = False  # the thread waits in read() with nothing left to read
        self._done = False  # the thread has returned
        self._error: str | None = None  # what the owner is told
        self._failure: str | None = None  # found by read(): FFmpeg then sees the end
        self._thread: threading.Thread | None = None

    # -- the owner's side ------------------------------------------------------

    def push(self, data: bytes) -> bytes:
        """Decode what ``data`` completes; returns the PCM (possibly empty)."""
        if self._closed or self._eof:
            raise ValueError("push after flush or close")
        with self._cond:
            self.bytes_in += len(data)
            self._input += data
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"decode-{self.container}", daemon=True
            )
            self._thread.start()
        return self._settle()

    def flush(self) -> bytes:
        """The end of the stream: decode what is left; returns the last PCM."""
        if self._closed:
            return b""
        with self._cond:
            self._eof = True
            self._cond.notify_all()
        if self._thread is None:
            return b""
        return self._settle(until_done=True)

    def close(self) -> None:
        """Stop the thread (without waiting for it); later calls are no-ops."""
        with self._cond:
            self._closed = True
            self._input.clear()
            self._cond.notify_all()

    def _settle(self, *, until_done: bool = False) -> bytes:
        """Wait until the thread has used up its input (or, ``until_done``, returned),
        then collect what it decoded."""
        with self._cond:
            settled = self._cond.wait_for(
                lambda: self._done or (not until_done and self._waiting and not self._input),
                timeout=self.step_timeout_s,
            )
            out, self._output = self._output, []
            error = self._error
        if error is not None:
            raise UndecodableAudio(error)
        if not settled:
            self.close()
            raise UndecodableAudio(
                f"decoding the {self.container} stream took over {self.step_timeout_s:g} s"
            )
        return b"".join(out)

    # -- the thread's side -----------------------------------------------------

    def read(self, size: int) -> bytes:
        """FFmpeg's input: what has been pushed, waiting for more; b"" is the end (also
        after a failure or a close: an exception raised here would not reach us)."""
        with self._cond:
            if self._failure is None:
                self._failure = self._progress_failure()
            if not self._input and not (self._eof or self._closed or self._failure):
                self._waiting = True
                self._cond.notify_all()
                if not self._cond.wait_for(
                    lambda: self._input or self._eof or self._closed, timeout=IDLE_TIMEOUT_S
                ):
                    self._eof = True
                self._waiting = False
            if self._closed or self._failure:
                return b""
            chunk = bytes(self._input[:size])
            del self._input[:size]
            self._read_total += len(chunk)
            return chunk

    def _progress_failure(self) -> str | None:
        if not self._header_done and self._read_total > self.max_header_bytes:
            return f"no complete {self.container} header in the first {self.max_header_bytes} bytes"
        silent_bytes = self._read_total - self._read_at_last_sample
        if self._header_done and silent_bytes > self.max_silent_bytes:
            return f"{silent_bytes} bytes of the {self.container} stream decoded to no audio"
        return None

    def _run(self) -> None:
        try:
            for pcm in self._decode():
                with self._cond:
                    self._output.append(pcm)
                    self.samples_out += len(pcm) // 2
                    self._read_at_last_sample = self._read_total
            if self._failure is not None:
                self._set_error(self._failure)
        except UndecodableAudio as error:
            self._set_error(error.message)
        except (av.error.FFmpegError, ValueError, IndexError) as error:
            # FFmpeg's own words name what is wrong ("Invalid data found when processing
            # input"); the stream cannot be read further
            if self._failure is None and not self._header_done:
                self._failure = f"no {self.container} header could be read ({error})"
            self._set_error(
                self._failure or f"the {self.container} stream cannot be decoded: {error}"
            )
        except Exception as error:  # noqa: BLE001 - never let a thread die silently
            logger.exception("decoder thread failed")
            self._set_error(f"the {self.container} stream cannot be decoded: {error}")
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _set_error(self, message: str) -> None:
        with self._cond:
            if self._error is None and not self._closed:
                self._error = message

    def _decode(self) -> Iterator[bytes]:
        options = {"probesize": str(PROBE_BYTES), "analyzeduration": "0"}
        with av.open(
            self,
            mode="r",
            format=CONTAINER_FORMATS[self.container],
            options=options,
            buffer_size=AVIO_BUFFER_BYTES,
        ) as container:
            if not container.streams.audio:
                raise UndecodableAudio(f"the {self.container} stream has no audio track")
            stream = container.streams.audio[0]
            check_format(stream, f"{self.container} stream", complete=False)
            with self._cond:
                self._header_done = True
                self._read_at_last_sample = self._read_total
            # the uploads' conversion (soxr, channels averaged): the same bytes give
            # the same samples, uploaded or streamed
            converter = MonoConverter(self.sample_rate)
            expected_s: float | None = None  # where the next frame should start
            for packet in container.demux(stream):
                for frame in packet.decode():
                    check_rate(frame.sample_rate, f"{self.container} stream")
                    expected_s = check_gap(frame, expected_s, f"{self.container} stream")
                    yield from _pcm(converter.push(frame))
            yield from _pcm(converter.flush())


def check_format(stream: Any, what: str, *, complete: bool = True) -> None:
    """Refuse, before a sample is decoded, an audio stream whose header declares what no
    recording is: no codec (a WAV of 0 bits per sample), a rate outside
    :data:`MIN_SAMPLE_RATE_HZ`..:data:`MAX_SAMPLE_RATE_HZ`, no channels. Raises
    :class:`UndecodableAudio`; ``what`` names the input ("file", "wav stream"). A live
    stream's header may not give the rate and channels yet (``complete=False``: only
    what it gives is checked; :func:`check_rate` checks each frame)."""
    codec = stream.codec_context
    if codec is None or not codec.name:
        raise UndecodableAudio(
            f"the {what}'s audio format is invalid (no codec for it: 0 bits per sample?)"
        )
    if codec.sample_rate or complete:
        check_rate(codec.sample_rate or 0, what)
    if complete and not codec.channels:
        raise UndecodableAudio(f"the {what} declares no audio channels")


def check_rate(rate: int, what: str) -> None:
    """Raises :class:`UndecodableAudio` for a sample rate no recording has."""
    if not MIN_SAMPLE_RATE_HZ <= rate <= MAX_SAMPLE_RATE_HZ:
        raise UndecodableAudio(
            f"the {what}'s sample rate of {rate} Hz is outside the "
            f"{MIN_SAMPLE_RATE_HZ}-{MAX_SAMPLE_RATE_HZ} Hz this server decodes"
        )


def check_gap(frame: av.AudioFrame, expected_s: float | None, what: str) -> float | None:
    """Where the frame after ``frame`` should start (None when it has no timestamp);
    raises :class:`UndecodableAudio` when ``frame`` starts over :data:`MAX_GAP_S` after
    ``expected_s``. FFmpeg skips a corrupt page or block and goes on; the timestamps
    show it. ``what`` names the input in the message ("ogg stream", "file")."""
    if frame.pts is None or frame.time_base is None or not frame.sample_rate:
        return None
    start_s = float(frame.pts * frame.time_base)
    if expected_s is not None and start_s - expected_s > MAX_GAP_S:
        raise UndecodableAudio(
            f"the {what} is corrupt: {start_s - expected_s:.3f} s of "
            f"audio missing at {expected_s:.3f} s"
        )
    return start_s + frame.samples / frame.sample_rate


def _pcm(samples: np.ndarray) -> Iterator[bytes]:
    if samples.size:
        yield np.ascontiguousarray(samples, dtype="<i2").tobytes()


def open_decoder(container: str, sample_rate: int) -> ContainerDecoder:
    """The decoder factory the server hands to the protocol adapters."""
    return ContainerDecoder(container, sample_rate)
