"""``from streamer import Transcriber``: in-process transcription with the server's cuts
and text, and docs/python-api.md's examples run as written."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from streamer.core.protocol import Final, Partial
from streamer.errors import ConfigError
from streamer.model.options import RecognizerOptions
from tests.support import v1_texts
from tests.timing import timeout_s

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "python-api.md"


@pytest.fixture(scope="module")
def transcriber(tagged_model_dir: Path, cache_dir: Path):
    from streamer import Transcriber

    # the torch backend, as the test servers load it: the same recognizer, the same text
    options = RecognizerOptions(
        model=str(tagged_model_dir), backend="torch", device="cpu", threads=2,
        cache_dir=cache_dir, warmup=False,
    )  # fmt: skip
    return Transcriber(options=options)


def test_the_same_cuts_and_text_as_the_server(transcriber, tagged_server, speech16) -> None:
    expected = asyncio.run(v1_texts(tagged_server.url, speech16, 16000, partials=False))
    assert len(expected) == 2 and expected[1].lower().startswith("hello")
    finals = transcriber.transcribe(speech16)
    assert [f.text for f in finals] == expected
    assert all(isinstance(f, Final) and f.words for f in finals)
    # a float array at a rate protocol v1 does not take is resampled first
    floats = speech16.astype(np.float32) / 32768
    import soxr

    at_11k = soxr.resample(floats, 16000, 11025)
    assert len(transcriber.transcribe(at_11k, sample_rate=11025)) == 2


def test_a_stream_gives_partials_then_the_same_finals(transcriber, speech16) -> None:
    stream = transcriber.stream_session(16000)
    results = []
    for start in range(0, speech16.size, 1600):
        results += stream.feed(speech16[start : start + 1600])
    results += stream.finish()
    assert stream.finish() == []
    finals = [r for r in results if isinstance(r, Final) and r.text]
    assert [f.text for f in finals] == [f.text for f in transcriber.transcribe(speech16)]
    partials = [r for r in results if isinstance(r, Partial)]
    assert partials and partials[0].segment_id == 0
    # in order: a segment's partials come before its final
    final_index = {r.segment_id: i for i, r in enumerate(results) if isinstance(r, Final)}
    assert all(i < final_index[r.segment_id] for i, r in enumerate(results) if r in partials)
    with pytest.raises(ConfigError, match="finished"):
        stream.feed(speech16[:160])
    with pytest.raises(ConfigError, match="sample rate"):
        transcriber.stream_session(11025)


def test_hotwords_and_bad_options_are_clear(transcriber) -> None:
    from streamer import Transcriber

    with pytest.raises(ConfigError, match="hotwords"):
        Transcriber(recognizer=transcriber.recognizer, hotwords=["x:lots"])
    with pytest.raises(ConfigError, match="language"):
        Transcriber(recognizer=transcriber.recognizer, language="xx")
    boosted = Transcriber(recognizer=transcriber.recognizer, hotwords=["Claude:3", "Claude"])
    assert [(w.phrase, w.boost) for w in boosted.hotwords] == [("Claude", 2.0)]


def test_importing_streamer_stays_light() -> None:
    code = "import sys, streamer\nprint('streamer.model.backends.loading' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("index", [0, 1])
def test_the_documented_examples_run(
    index: int, tagged_model_dir: Path, cache_dir: Path, speech16, tmp_path: Path
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 2
    soundfile.write(tmp_path / "speech.wav", speech16, 16000, subtype="PCM_16")
    env = {
        "SENSEVOICE_MODEL": str(tagged_model_dir),
        "STREAMER_CACHE_DIR": str(cache_dir),  # the model's ONNX export is cached there
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-c", blocks[index]],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout_s(300),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    if index == 0:
        assert len(lines) == 2 and "hello" in lines[1].lower()
    else:
        assert lines[-1].startswith("final ") and "hello" in lines[-1].lower()
        assert any(line.startswith("partial") for line in lines)


SRT_CUE = re.compile(r"\d+\n\d{2}:\d{2}:\d{2},\d{3} --> \d{2}:\d{2}:\d{2},\d{3}\n(.+\n){1,2}")
VTT_TIME = re.compile(r"^\d{2}:\d{2}:\d{2}\.\d{3} --> \d{2}:\d{2}:\d{2}\.\d{3}$", re.M)


def test_streamer_transcribe_writes_subtitles_and_json(
    tagged_model_dir: Path, speech16, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from openai.types.audio import TranscriptionVerbose

    from streamer.cli import main

    wav = tmp_path / "speech.wav"
    soundfile.write(wav, speech16, 16000, subtype="PCM_16")
    model = ["--model", str(tagged_model_dir), "--backend", "torch", "--no-warmup"]
    for suffix in ("srt", "vtt", "json", "txt"):
        out = tmp_path / f"out.{suffix}"
        assert main(["transcribe", str(wav), *model, "--output", str(out)]) == 0
        assert f"wrote {out} ({suffix})" in capsys.readouterr().err
        text = out.read_text(encoding="utf-8")
        if suffix == "srt":
            blocks = text.strip("\n").split("\n\n")
            assert len(blocks) >= 2 and all(SRT_CUE.fullmatch(b + "\n") for b in blocks), text
            assert [b.split("\n")[0] for b in blocks] == [str(i + 1) for i in range(len(blocks))]
        elif suffix == "vtt":
            assert text.startswith("WEBVTT\n\n") and len(VTT_TIME.findall(text)) >= 2
        elif suffix == "json":
            body = TranscriptionVerbose.model_validate_json(text)
            assert len(body.segments or ()) == 2 and body.words
            assert body.segments[1].text.strip().lower().startswith("hello")
        else:
            assert text.lower().splitlines()[1].startswith("hello")
    assert main(["transcribe", str(wav), *model, "--output", str(tmp_path / "x.docx")]) == 2
    assert main(["transcribe", str(wav), str(wav), *model, "-o", str(tmp_path / "x.srt")]) == 2


def test_streamer_transcribe_hotwords(
    tiny_model_dir: Path, speech16, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamer.cli import main

    wav = tmp_path / "speech.wav"
    soundfile.write(wav, speech16, 16000, subtype="PCM_16")
    # random:tiny's logits are near flat: a boosted phrase surfaces exactly when it works
    model = ["--model", str(tiny_model_dir), "--backend", "torch", "--no-warmup"]
    assert main(["transcribe", str(wav), *model, "--log-level", "warning"]) == 0
    assert "kubernetes" not in capsys.readouterr().out
    argv = ["transcribe", str(wav), *model, "--log-level", "warning", "--hotwords", "kubernetes:5"]
    assert main(argv) == 0
    assert "kubernetes" in capsys.readouterr().out
