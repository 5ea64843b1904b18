"""Known speakers for an upload: OpenAI's ``known_speaker_names[]`` with
``known_speaker_references[]`` (data URLs of 2-10 s samples) made into the embeddings a
diarized session starts with, so that their voices get their names.

Each reference is decoded like an upload (any container FFmpeg reads, at most
:data:`MAX_REFERENCE_S`), analysed by the server's speaker models on their own thread
(the same path as a segment: the segmentation keeps speech only), and its main voice's
embedding enrolled with its name before the upload's first segment is labelled.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from collections.abc import Sequence

from streamer.core.diarization import SpeakerAnalysis
from streamer.core.session import Session
from streamer.core.session_speakers import (
    KnownSpeaker,
    SpeakerJob,
    SpeakerQueue,
    known_speaker,
    reference_job,
)
from streamer.errors import InvalidOption, UndecodableAudio
from streamer.server.uploads import media_chunks

MAX_KNOWN_SPEAKERS = 4  # OpenAI's limit
MAX_REFERENCE_S = 10.0  # OpenAI's: 2-10 s samples
REFERENCE_TIMEOUT_S = 30.0  # the speaker models' answer for one reference


def parse_data_url(url: str) -> bytes:
    """The bytes of a ``data:[type];base64,...`` URL (InvalidOption otherwise)."""
    head, sep, payload = url.strip().partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise InvalidOption(
            "known_speaker_references[] must be data URLs (data:audio/wav;base64,...)"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidOption("a known_speaker_references[] data URL is not base64") from None


async def known_speakers(
    names: Sequence[str], references: Sequence[str], queue: SpeakerQueue
) -> list[KnownSpeaker]:
    """Each name's embedding from its reference (InvalidOption for a bad pair, a reference
    that is not audio or has no speech; UndecodableAudio passes through)."""
    if not names and not references:
        return []
    if len(names) != len(references):
        raise InvalidOption("known_speaker_names[] and known_speaker_references[] must pair up")
    if len(names) > MAX_KNOWN_SPEAKERS:
        raise InvalidOption(f"at most {MAX_KNOWN_SPEAKERS} known speakers")
    out = []
    for index, (name, reference) in enumerate(zip(names, references, strict=True)):
        name = " ".join(name.split())[:64]
        if not name:
            raise InvalidOption("known_speaker_names[] must not be empty")
        pcm = await _pcm(parse_data_url(reference))
        known = known_speaker(name, await _analyse(queue, reference_job(index, pcm)))
        if known is None:
            raise InvalidOption(f"the reference of {name!r} holds too little speech")
        out.append(known)
    return out


def enrol(session: Session, speakers: Sequence[KnownSpeaker]) -> None:
    """Give a diarized session its known speakers (before any audio)."""
    if session.speakers is not None:
        for known in speakers:
            session.speakers.enrol(known)


async def _pcm(data: bytes) -> bytes:
    chunks, _ = await media_chunks(io.BytesIO(data), MAX_REFERENCE_S)

    def decode() -> bytes:
        return b"".join(chunks())

    try:
        raw = await asyncio.to_thread(decode)
    except UndecodableAudio as error:
        raise InvalidOption(f"a known speaker's reference: {error.message}") from None
    return raw


async def _analyse(queue: SpeakerQueue, job: SpeakerJob) -> SpeakerAnalysis | None:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[SpeakerAnalysis | None] = loop.create_future()

    def settle(analysis: SpeakerAnalysis | None) -> None:
        if not answer.done():
            answer.set_result(analysis)

    def done(_: SpeakerJob, analysis: SpeakerAnalysis | None) -> None:
        loop.call_soon_threadsafe(settle, analysis)

    if not queue.submit(job, done):
        return None
    try:
        return await asyncio.wait_for(answer, REFERENCE_TIMEOUT_S)
    except TimeoutError:
        return None
