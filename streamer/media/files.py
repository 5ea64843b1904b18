"""Uploaded audio files in, 16 kHz mono s16le PCM out, chunk by chunk (PyAV).

The file transcription endpoints hand over a whole, seekable file (a path, or a binary
file object such as a ``SpooledTemporaryFile``), so FFmpeg reads it itself: the moov
atom at the end of an M4A is found by seeking, and the header's duration is known
before anything is decoded. :func:`probe_file` says what a file is; :func:`iter_pcm`
decodes it lazily, holding one chunk and one decoded frame at a time, never the whole
file. Both block (run them in a thread) and raise :class:`UndecodableAudio` for what is
not audio, or :class:`AudioTooLong` for a file over the caller's duration limit.

The samples are converted by :class:`~streamer.media.convert.MonoConverter` (not by
libswresample), as a container streamed live is: channels averaged, other rates
resampled with soxr and rounded without dither, and a 16 kHz mono s16 file (a WAV, a
16-bit FLAC) comes out bit-identical to its samples, so its finals are those protocol
v1 gives for the same samples, and an Ogg or WebM file's are those it gives streamed.

Only the demuxers of :data:`AUDIO_DEMUXERS` may open a file: FFmpeg's ``concat`` and
``hls`` demuxers read the files or URLs a playlist names, which an upload must never
make the server do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import av
import av.error
import numpy as np

from streamer.core.audio import SAMPLE_RATE
from streamer.errors import AudioTooLong, UndecodableAudio
from streamer.media.convert import MonoConverter
from streamer.media.decoder import check_format, check_gap, check_rate

__all__ = [
    "AUDIO_DEMUXERS",
    "CHUNK_SAMPLES",
    "FileInfo",
    "Source",
    "iter_pcm",
    "probe_file",
]

# FFmpeg demuxers a file may be read with (a name matches any of a demuxer's own names:
# "mov" is "mov,mp4,m4a,3gp,3g2,mj2", "matroska" is "matroska,webm")
AUDIO_DEMUXERS = (
    "wav",
    "w64",
    "flac",
    "ogg",
    "mp3",
    "mov",
    "matroska",
    "aac",
    "aiff",
    "caf",
    "amr",
    "au",
)
# demuxers whose duration FFmpeg may only estimate from the bit rate (an MP3 without a
# Xing header, ADTS AAC): far off for a VBR file, so no limit is enforced from it
BITRATE_DURATION_DEMUXERS = frozenset({"mp3", "aac"})
SHORTFALL_S = 0.25  # decoded audio this much shorter than the header says: a bad file
SHORTFALL_RATIO = 0.02  # ... or this share of it, whichever is more
CHUNK_SAMPLES = SAMPLE_RATE  # one second of output per chunk unless asked otherwise
WAV_HEADER_SCAN_BYTES = 64 * 1024  # a WAV's data chunk is looked for this far in

# a binary file open for reading, or a path
Source = str | os.PathLike[str] | IO[bytes]


@dataclass(frozen=True)
class FileInfo:
    """What an audio file holds, read from its header."""

    container: str  # FFmpeg's demuxer name ("wav", "mov,mp4,m4a,3gp,3g2,mj2", "ogg")
    codec: str  # FFmpeg's decoder name ("pcm_s16le", "aac", "opus", "mp3float")
    channels: int  # channels in the file (averaged to one by iter_pcm)
    sample_rate: int  # the file's rate, Hz (resampled to 16 kHz by iter_pcm)
    duration_s: float | None  # from the header; None when the header does not say
    duration_estimated: bool  # duration_s may be FFmpeg's guess from the bit rate

    @property
    def trusted_duration_s(self) -> float | None:
        """The header's duration where it is not a guess from the bit rate (a limit
        may refuse a file by it before decoding); None otherwise."""
        return None if self.duration_estimated else self.duration_s


def probe_file(source: Source) -> FileInfo:
    """What ``source`` is (a file object is read from its start and left open).

    Raises :class:`UndecodableAudio` for a file that is not audio in one of the
    containers of :data:`AUDIO_DEMUXERS`, is truncated before its first audio, or has
    no audio track.
    """
    _check_wav_length(source)
    with _open(source) as container:
        return _info(container, _audio_stream(container))


def iter_pcm(
    source: Source, *, max_duration_s: float | None, chunk_samples: int = CHUNK_SAMPLES
) -> Iterator[bytes]:
    """The audio of ``source`` as s16le mono 16 kHz, ``chunk_samples`` samples a chunk
    (the last one shorter). A file object is read from its start and left open.

    Raises :class:`AudioTooLong` when the file is longer than ``max_duration_s``: before
    the first chunk when its header says so (not from a duration guessed from the bit
    rate), else as soon as decoding passes the limit (the chunks before were within it).
    Raises :class:`UndecodableAudio` for what :func:`probe_file` refuses, for corrupt
    data met while decoding, for a file with no audio samples, and, after the last
    chunk, for a file whose audio ends well before the duration its header gives
    (truncated, or corrupt where FFmpeg skipped to the end): the chunks before an
    error were good audio, but the file as a whole is not.
    """
    if chunk_samples <= 0:
        raise ValueError(f"chunk_samples must be positive, got {chunk_samples}")
    limit_samples = None if max_duration_s is None else int(max_duration_s * SAMPLE_RATE)
    _check_wav_length(source)
    with _open(source) as container:
        stream = _audio_stream(container)
        info = _info(container, stream)
        header_s = info.trusted_duration_s
        if max_duration_s is not None and header_s is not None:
            if header_s > max_duration_s:
                raise _too_long(max_duration_s, header_s)
        pending: list[np.ndarray] = []  # int16 output not yet yielded
        pending_samples = 0
        total_samples = 0
        for samples in _mono_16k(container, stream):
            total_samples += samples.size
            if limit_samples is not None and total_samples > limit_samples:
                raise _too_long(limit_samples / SAMPLE_RATE)
            pending.append(samples)
            pending_samples += samples.size
            while pending_samples >= chunk_samples:
                joined = np.concatenate(pending)
                yield joined[:chunk_samples].astype("<i2").tobytes()
                rest = joined[chunk_samples:]
                pending, pending_samples = ([rest] if rest.size else []), rest.size
        if total_samples == 0:
            raise UndecodableAudio("the file holds no audio samples")
        if pending_samples:
            yield np.concatenate(pending).astype("<i2").tobytes()
        decoded_s = total_samples / SAMPLE_RATE
        if header_s is not None and decoded_s < header_s - max(
            SHORTFALL_S, SHORTFALL_RATIO * header_s
        ):
            raise UndecodableAudio(
                f"the file's audio ends at {decoded_s:.3f} s, before the {header_s:.3f} s"
                " its header gives: it is truncated or corrupt"
            )


# -- opening --------------------------------------------------------------------------


def _check_wav_length(source: Source) -> None:
    """A RIFF WAV whose ``data`` chunk declares more bytes than the file holds is
    truncated: FFmpeg clamps the chunk to the file's size (its duration then agrees
    with what is there), so the declared size is read here. A size of 0 or 0xFFFFFFFF
    is a stream's WAV (written before its length was known) and is taken as it is."""
    if hasattr(source, "read"):
        handle: Any = source
        handle.seek(0)
        head = handle.read(WAV_HEADER_SCAN_BYTES)
        size = handle.seek(0, os.SEEK_END)
        handle.seek(0)
    else:
        with open(source, "rb") as handle:
            head = handle.read(WAV_HEADER_SCAN_BYTES)
            size = handle.seek(0, os.SEEK_END)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return
    offset = 12
    while offset + 8 <= len(head):
        chunk, length = (
            head[offset : offset + 4],
            int.from_bytes(head[offset + 4 : offset + 8], "little"),
        )
        offset += 8
        if chunk == b"data":
            if length not in (0, 0xFFFFFFFF) and offset + length > size:
                raise UndecodableAudio(
                    f"the WAV file is truncated: its header declares {length} bytes of "
                    f"audio, the file holds {max(0, size - offset)}"
                )
            return
        offset += length + (length & 1)  # chunks are padded to an even size


def _open(source: Source) -> Any:
    """``source`` opened by one of :data:`AUDIO_DEMUXERS`; the error names no file."""
    if hasattr(source, "read"):
        source.seek(0)  # type: ignore[union-attr]
        target: Any = source
    else:
        target = os.fspath(source)
    try:
        return av.open(target, mode="r", options={"format_whitelist": ",".join(AUDIO_DEMUXERS)})
    except av.error.FileNotFoundError:
        raise  # the caller's own mistake, not the upload's
    except (av.error.FFmpegError, ValueError, OSError) as error:
        raise UndecodableAudio(
            "the file is not audio this server reads (WAV, FLAC, Ogg Opus or Vorbis, MP3,"
            f" M4A/AAC, WebM and a few more): {_reason(error)}"
        ) from None


def _reason(error: Exception) -> str:
    """FFmpeg's words for what failed, without the file's name."""
    if isinstance(error, av.error.FFmpegError) and error.strerror:
        text = str(error.strerror)
        if text == "Invalid argument":
            return "not an audio container it knows"
        return text[0].lower() + text[1:]
    return "it cannot be read"


def _audio_stream(container: Any) -> Any:
    if not container.streams.audio:
        raise UndecodableAudio("the file has no audio track")
    stream = container.streams.audio[0]
    check_format(stream, "file")
    return stream


def _info(container: Any, stream: Any) -> FileInfo:
    codec = stream.codec_context
    return FileInfo(
        container=container.format.name,
        codec=codec.name,
        channels=codec.channels or 1,
        sample_rate=codec.sample_rate or 0,
        duration_s=_duration_s(container, stream),
        duration_estimated=bool(BITRATE_DURATION_DEMUXERS & set(container.format.name.split(","))),
    )


def _duration_s(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return container.duration / av.time_base
    return None


def _too_long(limit_s: float, duration_s: float | None = None) -> AudioTooLong:
    if duration_s is None:  # found while decoding
        return AudioTooLong(f"the audio is longer than the limit of {limit_s:g} s")
    return AudioTooLong(f"the audio is {duration_s:.1f} s long; the limit is {limit_s:g} s")


# -- decoding ---------------------------------------------------------------------------


def _mono_16k(container: Any, stream: Any) -> Iterator[np.ndarray]:
    """The stream's frames as int16 mono at 16 kHz (:class:`MonoConverter`: the live
    container decoder's conversion too)."""
    converter = MonoConverter(SAMPLE_RATE)
    expected_s: float | None = None  # where the next frame should start
    for frame in _frames(container, stream):
        if frame.pts is None and expected_s is not None and frame.sample_rate:
            # a frame FFmpeg decoded from bytes it resynchronised on: the next
            # timestamp shows whether audio went missing before it
            expected_s += frame.samples / frame.sample_rate
        else:
            expected_s = check_gap(frame, expected_s, "file")
        # a chained Ogg stream's rate is its own: each frame's is checked (a 1 Hz frame
        # would resample 2048 samples into 32.8 M); within 8-384 kHz a frame's output is
        # at most twice its input
        check_rate(frame.sample_rate, "file")
        yield converter.push(frame)
    yield converter.flush()


def _frames(container: Any, stream: Any) -> Iterator[av.AudioFrame]:
    """The decoded frames; FFmpeg's errors become :class:`UndecodableAudio`."""
    position_s = 0.0
    try:
        for packet in container.demux(stream):
            if packet.pts is not None and packet.time_base is not None:
                position_s = float(packet.pts * packet.time_base)
            yield from packet.decode()
    except (av.error.FFmpegError, ValueError, IndexError) as error:
        raise UndecodableAudio(
            f"the file is corrupt near {max(0.0, position_s):.3f} s: {_reason(error)}"
        ) from None
