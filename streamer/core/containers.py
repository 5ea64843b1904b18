"""Compressed audio containers: which one a stream is, and the stage that decodes it.

The core never decodes a container itself (that needs FFmpeg, :mod:`streamer.media`):
it recognises one by its first bytes (:func:`sniff`, magic bytes only) and asks a
:data:`DecoderFactory` the server hands in for a :class:`PcmDecoder`. :class:`AudioInput`
is the first stage of a stream's audio in every adapter that accepts containers: bytes
in the declared encoding in, s16le PCM at the session's rate out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from streamer.errors import UndecodableAudio

PCM = "pcm_s16le"  # raw s16le PCM: today's behaviour, and the default
AUTO = "auto"  # a container recognised by its first bytes, else PCM
# container name -> FFmpeg's demuxer for it
CONTAINER_FORMATS = {
    "webm": "matroska",  # WebM/Matroska: MediaRecorder's audio/webm;codecs=opus
    "ogg": "ogg",  # Ogg Opus, Ogg Vorbis, Ogg FLAC
    "mp3": "mp3",
    "flac": "flac",
    "wav": "wav",
}
CONTAINERS = tuple(CONTAINER_FORMATS)
ENCODINGS = (PCM, AUTO, *CONTAINERS)  # protocol v1's values of the encoding option
SNIFF_BYTES = 12  # enough for every magic below (RIFF....WAVE)

_MAGICS = (
    (b"\x1a\x45\xdf\xa3", "webm"),  # EBML header
    (b"OggS", "ogg"),
    (b"fLaC", "flac"),
    (b"ID3", "mp3"),  # an ID3v2 tag before MPEG audio frames
)
# containers whose first bytes raw PCM cannot start with by chance often enough to matter
# (a WAV header over PCM is only a click; an MPEG sync is two samples near -1)
UNMISTAKABLE = ("webm", "ogg", "flac")
# MPEG audio sample-rate index 3 and bitrate indexes 0 (free) and 15 are invalid
_MPEG_BAD_BITRATE = (0x0, 0xF)


def sniff(head: bytes) -> str | None:
    """The container ``head`` (a stream's first :data:`SNIFF_BYTES` or more) starts
    with, or None (raw PCM). An MPEG frame sync counts only as a layer III header with
    valid fields, so that PCM starting with a sample like -1 (``ff ff``) stays PCM."""
    for magic, name in _MAGICS:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if _mpeg_layer3_header(head):
        return "mp3"
    return None


def container_in_pcm(head: bytes) -> str | None:
    """The container (one of :data:`UNMISTAKABLE`) whose header bytes declared raw PCM
    start with: a WebM recording sent as ``linear16`` would decode as noise into one
    meaningless final, so it is refused instead."""
    found = sniff(head[:SNIFF_BYTES])
    return found if found in UNMISTAKABLE else None


def pcm_refusal(found: str, hint: str) -> UndecodableAudio:
    """The error for container bytes declared raw PCM; ``hint`` says, in the protocol's
    own words, how to declare the container."""
    return UndecodableAudio(
        f"the audio was declared raw PCM but starts with a {found} header (a {found} "
        f"file or recording): {hint}"
    )


def _mpeg_layer3_header(head: bytes) -> bool:
    if len(head) < 4 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version = (head[1] >> 3) & 0x3  # 01 is reserved
    layer = (head[1] >> 1) & 0x3  # 01 is layer III
    bitrate = head[2] >> 4
    rate = (head[2] >> 2) & 0x3
    return version != 0x1 and layer == 0x1 and bitrate not in _MPEG_BAD_BITRATE and rate != 0x3


class PcmDecoder(Protocol):
    """One stream's container bytes → s16le mono PCM (streamer.media's decoder)."""

    def push(self, data: bytes) -> bytes: ...  # raises UndecodableAudio

    def flush(self) -> bytes: ...

    def close(self) -> None: ...


# (container, output sample rate) -> a decoder for one stream
DecoderFactory = Callable[[str, int], PcmDecoder]


class AudioInput:
    """A stream's bytes in ``encoding`` (``pcm_s16le``, ``auto`` or a container) →
    s16le PCM at ``sample_rate``. ``auto`` and a named container wait for the first
    :data:`SNIFF_BYTES` (a few bytes); a named container must start with its own magic
    (``wav``, ``mp3`` and ``webm`` too), and a slice that starts with another
    container's magic mid-stream is a change of format. Raises :class:`UndecodableAudio`.
    """

    def __init__(
        self,
        encoding: str,
        sample_rate: int,
        open_decoder: DecoderFactory | None,
        *,
        pcm_hint: str = "",
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}")
        self.encoding = encoding
        # with encoding=PCM: how to declare a container, for a stream that starts with
        # one (refused: see container_in_pcm); "" leaves declared PCM unchecked
        self._pcm_hint = pcm_hint
        self._pcm_checked = not pcm_hint or encoding != PCM
        self.sample_rate = sample_rate
        self._open_decoder = open_decoder
        self.detected: str | None = PCM if encoding == PCM else None  # once known
        self._head = b""
        self._decoder: PcmDecoder | None = None

    @property
    def container(self) -> str | None:
        """The container being decoded, once known; None for PCM."""
        return self.detected if self.detected not in (None, PCM) else None

    def push(self, data: bytes) -> bytes:
        if self.detected == PCM:
            if not self._pcm_checked and data:
                self._pcm_checked = True
                found = container_in_pcm(data)
                if found is not None:
                    raise pcm_refusal(found, self._pcm_hint)
            return data
        if self.detected is None:
            self._head += data
            if len(self._head) < SNIFF_BYTES:
                return b""
            data, self._head = self._head, b""
            self._detect(data)
            if self.detected == PCM:
                return data
        else:
            self._check_same_format(data)
        assert self._decoder is not None
        return self._decoder.push(data)

    def flush(self) -> bytes:
        """The end of the stream: what the decoder still holds (or the bytes held for
        sniffing, as PCM when they name no container)."""
        if self.detected is None and self._head:
            head, self._head = self._head, b""
            self._detect(head)
            if self.detected == PCM:
                return head
            assert self._decoder is not None
            return self._decoder.push(head) + self._decoder.flush()
        if self._decoder is not None:
            return self._decoder.flush()
        return b""

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()

    def _detect(self, head: bytes) -> None:
        found = sniff(head)
        if self.encoding == AUTO and found is None:
            self.detected = PCM
            return
        if self.encoding not in (AUTO, found):
            raise UndecodableAudio(
                f"the stream is not {self.encoding}: it starts with {_describe(head, found)}"
            )
        assert found is not None
        if self._open_decoder is None:
            raise UndecodableAudio(f"{found} streams are not decoded by this server")
        self.detected = found
        self._decoder = self._open_decoder(found, self.sample_rate)

    def _check_same_format(self, data: bytes) -> None:
        found = sniff(data[:SNIFF_BYTES]) if len(data) >= 4 else None
        if found is not None and found != self.detected and found != "mp3":
            # an MPEG sync can occur inside any compressed data; the others cannot
            # start a slice by chance often enough to matter
            raise UndecodableAudio(
                f"the stream changed format mid-stream: {self.detected}, then {found}"
            )


def _describe(head: bytes, found: str | None) -> str:
    if found is not None:
        return f"a {found} header"
    return f"bytes {head[:8].hex(' ')} (no container's header: raw PCM?)"
