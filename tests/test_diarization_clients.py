"""The real clients' own types parse the speakers: the openai SDK (diarized_json, with and
without stream=True, with known speakers), deepgram-sdk (live and transcribe_file with
diarize=True); SRT/VTT name the speakers. Recorded voices, the real speaker models."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest

from streamer.core.audio import SAMPLE_RATE
from streamer.core.diarization import DiarizationOptions
from streamer.core.session import SessionOptions
from streamer.model.speakers.worker import SpeakerWorker
from tests.compat_clients import API_KEY as KEY  # the live helper sends it
from tests.compat_clients import _deepgram_environment, deepgram_sdk_async
from tests.fakes import WordyRecognizer
from tests.server_fixtures import ServerThread, server_options
from tests.support import diarized_final
from tests.timing import timeout_s


@pytest.fixture(scope="module")
def server(cache_dir: Path):
    from streamer.model.speakers.layout import resolve_diarizer
    from streamer.model.speakers.models import SpeakerModels
    from streamer.server.options import FileOptions
    from streamer.testkit.diarizer import ensure_diarizer

    files = resolve_diarizer(str(ensure_diarizer(cache_dir)), cache_dir)
    thread = ServerThread(
        WordyRecognizer,
        server_options(
            token=KEY,
            files=FileOptions(max_jobs=2, max_upload_bytes=8 << 20),
            session=SessionOptions(
                diarization=DiarizationOptions(max_wait_ms=timeout_s(30) * 1000)
            ),
        ),
        speakers=SpeakerWorker(lambda: SpeakerModels(files)),
    ).start()
    yield thread
    thread.shutdown()


@pytest.fixture(scope="module")
def talk() -> np.ndarray:
    """Two recorded voices taking turns (pocketsphinx-testdata's reader and its digits
    speaker)."""
    from streamer.testkit.diarizer import conversation

    pcm, _ = conversation(["reader", "digits"], 6, seed=1)
    return pcm


def wav_bytes(pcm: np.ndarray) -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, pcm, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def openai_client(server: ServerThread):
    from openai import OpenAI

    return OpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{server.port}/v1", max_retries=0)


def test_openai_diarized_json(server, talk) -> None:
    from openai.types.audio import TranscriptionDiarized

    result = openai_client(server).audio.transcriptions.create(
        model="gpt-4o-transcribe-diarize",
        file=("talk.wav", wav_bytes(talk)),
        response_format="diarized_json",
        chunking_strategy="auto",
    )
    assert isinstance(result, TranscriptionDiarized)
    speakers = [s.speaker for s in result.segments]
    assert set(speakers) <= {"A", "B", "C"} and len(set(speakers)) >= 2
    assert all(s.type == "transcript.text.segment" and s.end > s.start for s in result.segments)
    assert " ".join(s.text for s in result.segments).split() == result.text.split()


def test_openai_diarized_stream_events(server, talk) -> None:
    from openai.types.audio import TranscriptionTextDoneEvent, TranscriptionTextSegmentEvent

    events = list(
        openai_client(server).audio.transcriptions.create(
            model="gpt-4o-transcribe-diarize",
            file=("talk.wav", wav_bytes(talk)),
            response_format="diarized_json",
            stream=True,
        )
    )
    segments = [e for e in events if isinstance(e, TranscriptionTextSegmentEvent)]
    assert segments and isinstance(events[-1], TranscriptionTextDoneEvent)
    assert len({s.speaker for s in segments}) >= 2


def test_openai_known_speakers_get_their_names(server, talk) -> None:
    """A 4 s WAV reference as a data URL (about 170 KB, over the 64 KB form-field limit
    of other fields) per known speaker."""
    from openai.types.audio import TranscriptionDiarized

    from streamer.testkit.diarizer import VOICES, load_voice

    def reference(voice: str, first: int) -> str:
        clips = [load_voice(p) for p in VOICES[voice][first : first + 3]]
        audio = np.concatenate(clips)[: 4 * SAMPLE_RATE]
        data = wav_bytes((audio * 32767).astype(np.int16))
        return "data:audio/wav;base64," + base64.b64encode(data).decode()

    refs = [reference("reader", 3), reference("digits", 3)]
    assert len(refs[0]) > 150_000
    result = openai_client(server).audio.transcriptions.create(
        model="gpt-4o-transcribe-diarize",
        file=("talk.wav", wav_bytes(talk)),
        response_format="diarized_json",
        known_speaker_names=["Reader", "Counter"],
        known_speaker_references=refs,
    )
    assert isinstance(result, TranscriptionDiarized)
    assert {s.speaker for s in result.segments} == {"Reader", "Counter"}


def test_openai_diarized_json_refuses_bad_references(server, talk) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(server).audio.transcriptions.create(
            model="gpt-4o-transcribe-diarize",
            file=("talk.wav", wav_bytes(talk)),
            response_format="diarized_json",
            known_speaker_names=["X"],
            known_speaker_references=["nope"],
        )
    assert "data URL" in str(caught.value)


def test_srt_and_vtt_name_the_speakers() -> None:
    from streamer.core.captions import srt_document, vtt_document

    final = diarized_final(
        [("hello", 0.0, 400.0, "A"), ("there", 400.0, 800.0, "A"), ("yes", 900.0, 1200.0, "B")],
        "A",
    )
    vtt = vtt_document([final])
    assert "<v A>hello there" in vtt and "<v B>yes" in vtt
    srt = srt_document([final])
    assert "[A] hello there" in srt and "[B] yes" in srt


def test_streamer_client_diarize_writes_speakers() -> None:
    """``streamer client --diarize`` asks for speakers; its SRT/VTT writers name them."""
    import argparse

    from streamer.client.captions import make_writer
    from streamer.client.cli import _stream_options, add_client_arguments

    parser = argparse.ArgumentParser()
    add_client_arguments(parser)
    assert _stream_options(parser.parse_args(["x.wav", "--diarize"])).diarize
    assert not _stream_options(parser.parse_args(["x.wav"])).diarize
    final = diarized_final([("hi", 0.0, 300.0, "A"), ("yo", 500.0, 800.0, "B")], "A")
    out = io.StringIO()
    writer = make_writer(out, "vtt")
    writer.write(final, 1.0)
    writer.close()
    assert "<v A>hi" in out.getvalue() and "<v B>yo" in out.getvalue()


async def test_deepgram_live_diarize(server, talk) -> None:
    from deepgram.listen.v1.types import ListenV1Results

    messages = await deepgram_sdk_async(server.port, talk.tobytes(), diarize="true")
    finals = [m for m in messages if isinstance(m, ListenV1Results) and m.is_final]
    words = [w for m in finals for w in m.channel.alternatives[0].words]
    assert words and all(isinstance(w.speaker, int) for w in words)
    assert {w.speaker for w in words} >= {0, 1}
    assert all(0.0 <= w.speaker_confidence <= 1.0 for w in words)


def test_deepgram_prerecorded_diarize(server, talk) -> None:
    from deepgram import DeepgramClient

    client = DeepgramClient(api_key=KEY, environment=_deepgram_environment(server.port))
    response = client.listen.v1.media.transcribe_file(
        request=wav_bytes(talk), model="nova-3", diarize=True, utterances=True, punctuate=True
    )
    words = response.results.channels[0].alternatives[0].words
    assert words and {w.speaker for w in words} >= {0, 1}
    utterances = response.results.utterances
    assert utterances and all(isinstance(u.speaker, int) for u in utterances)
    for u in utterances:  # each utterance is one speaker's
        assert {w.speaker for w in u.words} == {u.speaker}


def test_without_diarize_deepgram_words_have_no_speaker(server, talk) -> None:
    from deepgram import DeepgramClient

    client = DeepgramClient(api_key=KEY, environment=_deepgram_environment(server.port))
    response = client.listen.v1.media.transcribe_file(request=wav_bytes(talk[: 5 * SAMPLE_RATE]))
    words = response.results.channels[0].alternatives[0].words
    assert words and all(w.speaker is None for w in words)
