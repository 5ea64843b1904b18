"""Compressed containers: sniffing (core), PyAV's streaming decoder (media), AudioInput.

Real recordings and synthesised speech are encoded with ffmpeg in the test; the decoder
gets them in arbitrary slices, as a socket delivers them.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from streamer.core.containers import AUTO, PCM, AudioInput, sniff
from streamer.errors import UndecodableAudio
from streamer.media import ContainerDecoder, open_decoder
from tests.clips import LIBRIVOX, load_wav
from tests.containers_audio import encode, needs_ffmpeg, slices
from tests.timing import timeout_s

pytestmark = needs_ffmpeg


@pytest.fixture(scope="module")
def recording() -> np.ndarray:
    return load_wav(LIBRIVOX / "sense_and_sensibility_01_austen_64kb-0870.wav")


@pytest.fixture(scope="module")
def encoded(recording, tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("containers")
    return {c: encode(recording, c, folder) for c in ("webm", "ogg", "mp3", "flac", "wav")}


def decode_all(container: str, data: bytes, step: int) -> np.ndarray:
    decoder = ContainerDecoder(container, 16000)
    out = [decoder.push(data[i : i + step]) for i in range(0, len(data), step)]
    out.append(decoder.flush())
    decoder.close()
    return np.frombuffer(b"".join(out), dtype="<i2")


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """How well the loudness of ``a`` follows ``b``'s, 20 ms by 20 ms, at the best lag
    within 40 ms: a lossy codec keeps the speech, not the waveform's phase."""

    def envelope(x: np.ndarray) -> np.ndarray:
        frames = x[: x.size - x.size % 320].astype(np.float64).reshape(-1, 320)
        return np.sqrt((frames**2).mean(axis=1))

    best = 0.0
    for lag in range(0, 640, 80):
        x, y = envelope(a[lag:]), envelope(b)
        n = min(x.size, y.size)
        best = max(best, float(np.corrcoef(x[:n], y[:n])[0, 1]))
    return best


# -- sniffing -------------------------------------------------------------------------


@pytest.mark.parametrize("container", ["webm", "ogg", "mp3", "flac", "wav"])
def test_each_container_is_recognised_by_its_first_bytes(encoded, container) -> None:
    assert sniff(encoded[container][:12]) == container


def test_mpeg_frames_without_an_id3_tag_are_mp3(encoded) -> None:
    data = encoded["mp3"]
    sync = next(i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] & 0xE0 == 0xE0)
    assert sniff(data[sync : sync + 12]) == "mp3"


@pytest.mark.parametrize("first_sample", [-1, -2, 0, 1, -1025])
def test_pcm_is_not_taken_for_a_container(first_sample) -> None:
    # ff ff (-1) has the eleven sync bits of an MPEG frame; its fields are not layer III
    pcm = np.array([first_sample, 3, -7, 12, 0, 0], dtype="<i2").tobytes()
    assert sniff(pcm) is None


# -- the decoder ----------------------------------------------------------------------


@pytest.mark.parametrize("container", ["webm", "ogg", "mp3", "flac", "wav"])
@pytest.mark.parametrize("step", [37, 1000, 4096, 1 << 20])
def test_slices_of_any_size_decode_to_the_recording(recording, encoded, container, step) -> None:
    pcm = decode_all(container, encoded[container], step)
    assert abs(pcm.size - recording.size) < 0.1 * 16000  # codec padding only
    if container in ("flac", "wav"):
        assert np.array_equal(pcm[: recording.size], recording)  # lossless
    else:
        assert correlation(pcm, recording) > 0.95


def test_output_is_incremental(recording, encoded) -> None:
    """A 250 ms slice of WebM/Opus gives its audio at once, not at the end."""
    data = encoded["webm"]
    pieces = slices(data, recording.size / 16000, 0.25)
    decoder = ContainerDecoder("webm", 16000)
    decoded = [decoder.push(p) for p in pieces]
    decoder.close()
    sizes = [len(d) // 2 for d in decoded]
    assert sizes[0] > 0 and all(s > 0 for s in sizes[:-1])
    assert sum(sizes) > 0.95 * recording.size  # nothing waits for the end


def test_output_rate_is_the_one_asked_for(recording, encoded) -> None:
    decoder = ContainerDecoder("ogg", 48000)
    pcm = decoder.push(encoded["ogg"]) + decoder.flush()
    assert abs(len(pcm) // 2 - 3 * recording.size) < 0.1 * 48000


def test_a_corrupt_ogg_stream_is_an_error(encoded) -> None:
    data = bytearray(encoded["ogg"])
    data[6000:6010] = b"x" * 10  # one page broken: FFmpeg skips it, the timestamps show it
    with pytest.raises(UndecodableAudio, match="corrupt"):
        decode_all("ogg", bytes(data), 1000)


def test_noise_after_a_header_is_an_error(encoded) -> None:
    rng = random.Random(7)
    noise = bytes(rng.randrange(256) for _ in range(200_000))
    with pytest.raises(UndecodableAudio):
        decode_all("webm", encoded["webm"][:3000] + noise, 4000)


def test_a_header_must_complete_within_its_bound() -> None:
    decoder = ContainerDecoder("mp3", 16000, max_header_bytes=64 * 1024)
    with pytest.raises(UndecodableAudio):
        for _ in range(100):
            decoder.push(b"ID3\x04\x00\x00\x7f\x7f\x7f\x7f" + bytes(4000))  # a tag that never ends


def test_a_stream_cut_inside_its_header_is_an_error(encoded) -> None:
    with pytest.raises(UndecodableAudio, match="header"):
        decode_all("ogg", encoded["ogg"][:40], 10)


def test_a_closed_decoder_stops_its_thread(encoded) -> None:
    decoder = ContainerDecoder("webm", 16000)
    decoder.push(encoded["webm"][:5000])
    thread = decoder._thread
    decoder.close()
    assert thread is not None
    thread.join(timeout_s(5))
    assert not thread.is_alive()


# -- AudioInput: what an adapter feeds the session ------------------------------------


def test_auto_passes_pcm_through() -> None:
    pcm = np.arange(-500, 500, dtype="<i2").tobytes()
    audio = AudioInput(AUTO, 16000, open_decoder)
    out = audio.push(pcm[:5]) + audio.push(pcm[5:]) + audio.flush()
    assert out == pcm and audio.detected == PCM


def test_auto_decodes_a_container(recording, encoded) -> None:
    audio = AudioInput(AUTO, 16000, open_decoder)
    data = encoded["mp3"]
    out = b"".join(audio.push(data[i : i + 7]) for i in range(0, 70, 7))
    out += audio.push(data[70:]) + audio.flush()
    audio.close()
    assert audio.detected == "mp3"
    assert correlation(np.frombuffer(out, "<i2"), recording) > 0.95


def test_a_declared_container_must_be_what_arrives(recording) -> None:
    audio = AudioInput("ogg", 16000, open_decoder)
    with pytest.raises(UndecodableAudio, match="not ogg"):
        audio.push(recording[:4000].tobytes())


def test_a_change_of_format_mid_stream_is_an_error(encoded) -> None:
    audio = AudioInput(AUTO, 16000, open_decoder)
    audio.push(encoded["webm"][:4000])
    with pytest.raises(UndecodableAudio, match="changed format"):
        audio.push(encoded["ogg"][:4000])
    audio.close()


def test_without_a_decoder_a_container_is_refused_clearly(encoded) -> None:
    with pytest.raises(UndecodableAudio, match="not decoded"):
        AudioInput(AUTO, 16000, None).push(encoded["flac"][:100])


# -- FunASR's wav_format: a compressed file per round ---------------------------------


@pytest.mark.parametrize(("wav_format", "container"), [("mp3", "mp3"), ("ogg", "ogg")])
def test_funasr_offline_mode_decodes_a_compressed_file(tmp_path, wav_format, container) -> None:
    import json

    import orjson

    from streamer.core.compat.funasr import FunAsrAdapter
    from streamer.core.protocol import StreamOptions
    from streamer.core.session import Session, SessionOptions
    from tests.fakes import InstantWorker, loudness_classifier, silence, tone

    session = Session(
        "f1", SessionOptions(model_name="fake"), StreamOptions(), loudness_classifier()
    )
    adapter = FunAsrAdapter(session, open_decoder=open_decoder)
    adapter.start()
    worker = InstantWorker(session, ["first one", "second one"])
    pcm = np.concatenate([silence(300), tone(1500), silence(1000), tone(900), silence(1000)])
    data = encode(pcm, container, tmp_path)
    first = {"mode": "offline", "wav_name": "f", "wav_format": wav_format, "is_speaking": True}
    adapter.receive_text(json.dumps(first))
    for i in range(0, len(data), 4096):  # funasr_wss_client's offline chunks
        adapter.receive_bytes(data[i : i + 4096])
        worker.answer()
    adapter.receive_text(json.dumps({"is_speaking": False}))
    worker.answer()
    got = [orjson.loads(frame.data) for frame in adapter.drain() if frame.data]
    (last,) = got
    assert last["mode"] == "offline" and last["is_final"]
    assert last["text"].split() == ["first", "one", "second", "one"]
    adapter.release()


def test_funasr_pcm_declared_as_mp3_is_an_error() -> None:
    import json

    import orjson

    from streamer.core.compat.funasr import FunAsrAdapter
    from streamer.core.protocol import StreamOptions
    from streamer.core.session import Session, SessionOptions
    from tests.fakes import loudness_classifier, tone

    session = Session(
        "f1", SessionOptions(model_name="fake"), StreamOptions(), loudness_classifier()
    )
    adapter = FunAsrAdapter(session, open_decoder=open_decoder)
    adapter.start()
    adapter.receive_text(json.dumps({"mode": "offline", "wav_format": "mp3"}))
    adapter.receive_bytes(tone(500).astype("<i2").tobytes())
    (error,) = [orjson.loads(frame.data) for frame in adapter.drain() if frame.data]
    assert error["error"]["code"] == "undecodable_audio" and error["is_final"]
