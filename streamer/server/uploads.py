"""A file's transcription on the live path: :func:`transcribe_file` and :class:`FileJobs`.

An uploaded file (spooled by the HTTP endpoint) is decoded to 16 kHz PCM in a thread of
its own (:mod:`streamer.media.files`) and fed, as fast as the model takes it, to a core
:class:`~streamer.core.session.Session` behind the same :class:`SessionPump` as a live
stream: the same VAD cuts, the same 7 s limit, the same decode path, so an upload's
finals are exactly the finals protocol v1 gives for the same samples. Its jobs are
``background``: the worker decodes them after every live job (model/serving/job_queue.py), and
the pending-finals gate holds the decoder back while the model is busy.

:class:`FileJobs` bounds how many files are transcribed at once (``--max-file-jobs``);
each :class:`FileJob` is tracked by the admission beside the live sessions, so the
lifecycle drains and shuts them down with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import IO, TypeVar

from streamer.core.compat.audio import AudioDecoder
from streamer.core.containers import PCM
from streamer.core.protocol import Error, Final, Notice, StreamOptions
from streamer.core.session import Session
from streamer.core.wire import OutFrame, WireAdapter
from streamer.errors import AudioTooLong, FileRefused, UndecodableAudio
from streamer.media.files import FileInfo, iter_pcm, probe_file
from streamer.server.admission import Admission
from streamer.server.pump import SessionPump

logger = logging.getLogger(__name__)

CHUNK_SAMPLES = 16000  # the decoder hands over 1 s of PCM at a time
RAW_READ_BYTES = 64 * 1024  # raw audio is read from its spool this much at a time
CHUNKS_AHEAD = 8  # decoded chunks waiting for the session, at most
FILE_PENDING_FINALS = 6  # finals a file may have queued at once (room for a batch)
DECODER_STEP_TIMEOUT_S = 60.0  # one chunk of decoded audio must come within this
DECODER_STOP_TIMEOUT_S = 5.0  # a stopped decoder thread leaves the file within this
STOP = '{"type": "stop"}'  # protocol v1's end of stream: the last finals, then end

OnFinal = Callable[[Final], Awaitable[None]]
T = TypeVar("T")


@dataclass
class FileTranscript:
    """What one file gave: its finals in order and its length (a non-fatal error, such
    as one segment's failed decode, is in that final's ``error``)."""

    finals: list[Final] = field(default_factory=list)
    duration_s: float = 0.0
    notices: list[Notice] = field(default_factory=list)  # hotwords the model could not use


SHUTTING_DOWN = ("shutting_down", "the server is shutting down; send the file again")


class FileJob:
    """One file being transcribed: what the lifecycle may stop (one of
    :attr:`Admission.open <streamer.server.admission.Admission.open>`'s things)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stopped: tuple[str, str] | None = None  # (code, message) once stopped
        self.stop_event = asyncio.Event()

    def stop(self, code: str, message: str) -> None:
        if self.stopped is None:
            self.stopped = (code, message)
            self.stop_event.set()

    def expire(self, code: str, message: str, close_code: int = 0) -> None:
        """The model failed: the file is refused with ``code`` (no close code: HTTP)."""
        self.stop(code, message)

    def shutdown(self) -> None:
        """A file not finished in the drain is refused (503: send it again elsewhere)."""
        self.stop(*SHUTTING_DOWN)

    def abort(self) -> None:
        """Nothing of its own to drop: its request's connection is (the file API's
        :class:`~streamer.server.file_routes.OpenRequest`)."""


class FileJobs:
    """The files being transcribed now, at most ``max_jobs``."""

    def __init__(self, max_jobs: int) -> None:
        self.max_jobs = max_jobs
        self.active: set[FileJob] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    def add(self, name: str) -> FileJob:
        """A slot for a new file (raises :class:`FileRefused`)."""
        if len(self.active) >= self.max_jobs:
            raise FileRefused(
                "too_many_files", f"the server is transcribing {self.max_jobs} files already"
            )
        job = FileJob(name)
        self.active.add(job)
        self.idle.clear()
        return job

    def remove(self, job: FileJob) -> None:
        self.active.discard(job)
        if not self.active:
            self.idle.set()


class Receiving:
    """The upload bodies being received now: at most ``max_total``, ``max_per_client``
    from one client address. A body holds no transcription slot (:class:`FileJobs`)
    until it is complete, so uploads that drip hold only these."""

    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.by_client: dict[str, int] = {}
        self.total = 0

    def add(self, client: str) -> None:
        """A slot for one more body from ``client`` (raises :class:`FileRefused`)."""
        if self.total >= self.max_total:
            raise FileRefused(
                "too_many_uploads", f"the server is receiving {self.max_total} uploads already"
            )
        held = self.by_client.get(client, 0)
        if held >= self.max_per_client:
            raise FileRefused("too_many_uploads", f"this client is sending {held} uploads already")
        self.by_client[client] = held + 1
        self.total += 1

    def remove(self, client: str) -> None:
        held = self.by_client.get(client, 0)
        if held <= 1:
            self.by_client.pop(client, None)
        else:
            self.by_client[client] = held - 1
        self.total = max(0, self.total - 1)


async def media_chunks(
    source: IO[bytes], max_duration_s: float | None
) -> tuple[Callable[[], Iterator[bytes]], FileInfo]:
    """A container file's PCM (any format :mod:`streamer.media.files` opens), and what
    the file is, once its header says it is audio within ``max_duration_s`` (raises
    :class:`UndecodableAudio`, :class:`~streamer.errors.AudioTooLong`): what is refused
    is refused before anything is answered."""
    info = await _until_done(asyncio.to_thread(probe_file, source))
    header_s = info.trusted_duration_s
    if max_duration_s is not None and header_s is not None and header_s > max_duration_s:
        raise AudioTooLong(
            f"the audio is {header_s:.0f} s long; this server transcribes at most "
            f"{max_duration_s:g} s (--max-file-duration-s)"
        )
    source.seek(0)

    def chunks() -> Iterator[bytes]:
        return iter_pcm(source, max_duration_s=max_duration_s, chunk_samples=CHUNK_SAMPLES)

    return chunks, info


def raw_chunks(source: IO[bytes], encoding: str, channels: int) -> Iterator[bytes]:
    """Raw audio (Deepgram's ``encoding``: linear16, mulaw, alaw) as mono s16le PCM."""
    decoder = AudioDecoder(encoding, channels)
    while data := source.read(RAW_READ_BYTES):
        if pcm := decoder.push(data):
            yield pcm


async def transcribe_file(
    admission: Admission,
    job: FileJob,
    chunks: Callable[[], Iterator[bytes]],
    stream: StreamOptions,
    *,
    on_final: OnFinal | None = None,
    setup: Callable[[Session], None] | None = None,
) -> FileTranscript:
    """Transcribe the PCM ``chunks()`` yields (s16le mono at ``stream.sample_rate``, in a
    thread of its own) as one background session.

    ``on_final`` is awaited with each final as soon as it is decoded (in order). Raises
    :class:`UndecodableAudio` (what ``chunks`` raises: not audio, corrupt, too long) and
    :class:`FileRefused` (the server stopped it); cancelling the caller stops the
    decoder and forgets the session's queued jobs. ``setup`` is called with the new
    session before any audio (known speakers are enrolled there).
    """
    options = replace(stream, partials=False, encoding=PCM)  # a file needs no partials
    session = admission.new_session(options, secrets.token_hex(6), background=True)
    if setup is not None:
        setup(session)
    adapter = WireAdapter(session)
    limits = replace(
        admission.options.limits,
        max_pending_finals=max(FILE_PENDING_FINALS, admission.options.limits.max_pending_finals),
    )
    pump = SessionPump(adapter, admission.worker, admission.metrics, limits)
    transcript = FileTranscript()
    decoder = _Decoder(chunks)

    async def send(frame: OutFrame) -> None:
        message = frame.message
        if isinstance(message, Final):
            transcript.finals.append(message)
            if on_final is not None:
                await on_final(message)
        elif isinstance(message, Notice):
            transcript.notices.append(message)
            logger.debug("file %s: %s", session.session_id, message.message)
        elif isinstance(message, Error) and message.fatal:
            raise _SessionFailed(message)

    async def feed() -> None:
        while True:
            item = await decoder.next()
            if item is None:
                break
            await pump.backlog_has_room.wait()
            if pump.closing:
                return
            pump.receive(item)
        pump.receive(STOP)

    adapter.start()
    pump.pump()
    decoder.start()
    feeder = asyncio.create_task(feed(), name=f"file {session.session_id} feed")
    writer = asyncio.create_task(pump.write_all(send), name=f"file {session.session_id} write")
    stopped = asyncio.create_task(job.stop_event.wait())
    try:
        waiting: set[asyncio.Future[object]] = {feeder, writer, stopped}  # type: ignore[arg-type]
        while writer in waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                assert job.stopped is not None
                raise FileRefused(*job.stopped)
            if feeder in done:
                feeder.result()  # raises the decoder's error
        try:
            finished = writer.result()
        except _SessionFailed as failed:  # the session ended with a fatal error
            raise FileRefused(failed.error.code, failed.error.message) from None
        if not finished:
            raise FileRefused("internal_error", "the transcription stopped early")
    finally:
        for task in (feeder, writer, stopped):
            task.cancel()
        pump.stop()  # releases the adapter
        # the caller closes the file once we return: the thread must be off it first
        await decoder.stop()
    transcript.duration_s = session.audio_ms / 1000
    return transcript


async def _until_done(work: Awaitable[T]) -> T:
    """``work`` (a thread's) awaited to its end even when the caller is cancelled
    meanwhile (the cancellation is raised after it): a thread cannot be interrupted, and
    the file it reads must not be closed under it."""
    future = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait({future}, timeout=DECODER_STOP_TIMEOUT_S)
        raise


class _SessionFailed(Exception):
    def __init__(self, error: Error) -> None:
        super().__init__(error.message)
        self.error = error


class _Decoder:
    """A file's PCM chunks decoded in a thread of its own, at most :data:`CHUNKS_AHEAD` ahead."""

    def __init__(self, chunks: Callable[[], Iterator[bytes]]) -> None:
        self._chunks = chunks
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._room = threading.Semaphore(CHUNKS_AHEAD)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="file-decoder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread and wait (at most :data:`DECODER_STOP_TIMEOUT_S`, even when
        cancelled) until it has left the file, so that the caller may close it: PyAV
        reading a closed file fails with a traceback."""
        self._stop.set()
        self._room.release()  # wake a producer waiting for room
        if self._thread.ident is None:
            return
        await _until_done(asyncio.to_thread(self._thread.join, DECODER_STOP_TIMEOUT_S))

    async def next(self) -> bytes | None:
        try:
            async with asyncio.timeout(DECODER_STEP_TIMEOUT_S):
                item = await self._queue.get()
        except TimeoutError:
            raise UndecodableAudio(
                f"decoding the file made no progress for {DECODER_STEP_TIMEOUT_S:g} s"
            ) from None
        if isinstance(item, BaseException):
            raise item
        if item is not None:
            self._room.release()
        return item

    def _put(self, item: bytes | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _run(self) -> None:
        try:
            for chunk in self._chunks():
                while not self._room.acquire(timeout=1.0):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                self._put(chunk)
        except UndecodableAudio as error:
            self._put(error)
        except Exception as error:  # a decoder bug: logged here, told as undecodable
            if self._stop.is_set():
                return  # stopped: nobody waits for what it was doing
            logger.exception("decoding an uploaded file failed")
            self._put(UndecodableAudio(f"the file could not be decoded ({type(error).__name__})"))
        else:
            self._put(None)
