"""Random-weight model directories: layout, tokenizer ids, determinism, the tagged model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from streamer.errors import ConfigError, ModelError
from streamer.model.artifacts.files import build_directory
from streamer.testkit import models as model_builder
from streamer.testkit.models import (
    KNOWN_SPECIAL_IDS,
    MARKER_FILE,
    OTHER_SPECIALS,
    REAL_VOCAB_SIZE,
    TAGGED_TRANSCRIPTS,
    ensure_random_model,
    read_build_info,
)
from streamer.testkit.speech import speak
from tests.timing import timeout_s

MODEL_FILES = ("config.yaml", "model.pt", "bpe.model", "am.mvn", MARKER_FILE)


def _pieces(model_dir: Path) -> list[str]:
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model_dir / "bpe.model"))
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def test_tiny_directory_layout(tiny_model_dir: Path) -> None:
    for name in MODEL_FILES:
        assert (tiny_model_dir / name).is_file(), name
    info = read_build_info(tiny_model_dir)
    assert info is not None
    assert info.name == "tiny"
    assert info.vocab_size == 400
    assert 700_000 < info.parameters < 900_000
    pieces = _pieces(tiny_model_dir)
    assert len(pieces) == 400
    assert pieces[:3] == ["<unk>", "<s>", "</s>"]  # blank 0, sos 1, eos 2 as in the real model
    for token in [*KNOWN_SPECIAL_IDS, *OTHER_SPECIALS]:
        assert token in pieces


def test_am_mvn_reads_back_through_funasr(tmp_path: Path) -> None:
    from streamer.model.backends.funasr_quiet import import_funasr

    import_funasr()
    from funasr.frontends.wav_frontend import load_cmvn

    mean = np.linspace(-3.0, 12.0, 560, dtype=np.float32)
    std = np.linspace(0.5, 4.0, 560, dtype=np.float32)
    model_builder.write_am_mvn(tmp_path / "am.mvn", mean, std)
    cmvn = load_cmvn(str(tmp_path / "am.mvn")).numpy()
    assert cmvn.shape == (2, 560)
    np.testing.assert_allclose(cmvn[0], -mean, rtol=1e-6)
    np.testing.assert_allclose(cmvn[1], 1.0 / std, rtol=1e-6)


def test_ensure_reuses_the_built_directory(cache_dir: Path, tiny_model_dir: Path) -> None:
    stamp = (tiny_model_dir / "model.pt").stat().st_mtime_ns
    started = time.perf_counter()
    assert ensure_random_model("tiny", cache_dir) == tiny_model_dir
    assert time.perf_counter() - started < timeout_s(1.0)  # a stat, not a build
    assert (tiny_model_dir / "model.pt").stat().st_mtime_ns == stamp
    assert f"v{model_builder.BUILDER_VERSION}" in tiny_model_dir.name


def test_ensure_builds_atomically_into_a_fresh_cache(tmp_path: Path) -> None:
    path = ensure_random_model("tiny", tmp_path)
    assert path.parent == tmp_path / "models"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [path.name]  # no temp
    assert json.loads((path / MARKER_FILE).read_text())["builder_version"] == (
        model_builder.BUILDER_VERSION
    )


def test_a_directory_another_process_finished_first_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "model"

    def build(directory: Path) -> None:  # another process wins the race meanwhile
        (directory / MARKER_FILE).write_text("ours")
        target.mkdir()
        (target / MARKER_FILE).write_text("theirs")
        (target / "more").write_text("")  # not empty: the rename fails

    assert build_directory(target, MARKER_FILE, build) == target
    assert (target / MARKER_FILE).read_text() == "theirs"
    assert [p.name for p in target.parent.iterdir()] == ["model"]  # ours removed


def test_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def build(directory: Path) -> None:
        (directory / "half").write_text("")
        raise ModelError("interrupted")

    with pytest.raises(ModelError):
        build_directory(tmp_path / "model", MARKER_FILE, build)
    assert list(tmp_path.iterdir()) == []


def test_build_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    import torch

    model_builder.build_random_model("tiny", tmp_path / "again")
    assert (tmp_path / "again" / "bpe.model").read_bytes() == (
        tiny_model_dir / "bpe.model"
    ).read_bytes()
    assert (tmp_path / "again" / "am.mvn").read_text() == (tiny_model_dir / "am.mvn").read_text()
    first = torch.load(tiny_model_dir / "model.pt", weights_only=True)
    second = torch.load(tmp_path / "again" / "model.pt", weights_only=True)
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert torch.equal(value, second[key]), key


def test_unknown_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        ensure_random_model("huge", tmp_path)
    with pytest.raises(ConfigError):
        model_builder.build_random_model("huge", tmp_path / "x")


def test_tagged_model_with_unmodified_generate(tagged_model_dir: Path, speech_cache: Path) -> None:
    """The contract other tests rely on: plain funasr returns these exact strings."""
    from streamer.model.backends.funasr_quiet import import_funasr, quiet_funasr

    funasr = import_funasr()
    with quiet_funasr():
        model = funasr.AutoModel(
            model=str(tagged_model_dir),
            device="cpu",
            disable_update=True,
            disable_pbar=True,
            ncpu=2,
            log_level="ERROR",
            frontend_conf={"dither": 0.0},
        )
        for text, tags in TAGGED_TRANSCRIPTS.items():
            pcm = speak(text, "en", cache_dir=speech_cache)
            for use_itn in (False, True):
                result = model.generate(
                    pcm.tobytes(), language="auto", use_itn=use_itn, batch_size=1
                )
                expected_tags = tags if not use_itn else tags.replace("woitn", "withitn")
                assert result[0]["text"] == expected_tags + text


@pytest.mark.parametrize("margins_ms", [(300, 200), (450, 800), (1000, 1000)])
def test_tagged_model_tolerates_silent_margins(
    tagged_model_dir: Path, speech_cache: Path, margins_ms: tuple[int, int]
) -> None:
    """Servers decode segments with silence around the speech: the tags and text hold."""
    from streamer.model.backends.torch_backend import Recognizer
    from streamer.model.options import RecognizerOptions

    recognizer = Recognizer(
        RecognizerOptions(model=str(tagged_model_dir), device="cpu", threads=2, warmup=False)
    )
    lead, tail = (np.zeros(ms * 16, np.int16) for ms in margins_ms)
    for text, tags in TAGGED_TRANSCRIPTS.items():
        pcm = np.concatenate([lead, speak(text, "en", cache_dir=speech_cache), tail])
        assert recognizer.decode_reference(pcm, "auto", use_itn=False).raw == tags + text


@pytest.mark.slow
def test_small_matches_the_real_configuration(small_model_dir: Path) -> None:
    import yaml

    info = read_build_info(small_model_dir)
    assert info is not None
    assert info.parameters == 233_999_167
    assert info.vocab_size == REAL_VOCAB_SIZE
    pieces = _pieces(small_model_dir)
    assert len(pieces) == REAL_VOCAB_SIZE
    for token, index in KNOWN_SPECIAL_IDS.items():
        assert pieces[index] == token
    for token in OTHER_SPECIALS:
        assert pieces.index(token) >= model_builder.FIRST_SPECIAL_ID
    assert len(set(pieces)) == len(pieces)
    config = yaml.safe_load((small_model_dir / "config.yaml").read_text())
    encoder = config["encoder_conf"]
    assert (encoder["output_size"], encoder["num_blocks"], encoder["tp_blocks"]) == (512, 50, 20)
    assert config["frontend_conf"]["lfr_m"] == 7 and config["frontend_conf"]["lfr_n"] == 6
    assert (small_model_dir / "model.pt").stat().st_size > 850 * 2**20


@pytest.mark.slow
def test_small_tokenizer_puts_tags_at_real_ids(small_model_dir: Path) -> None:
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(small_model_dir / "bpe.model"))
    pieces = processor.encode("<|zh|><|HAPPY|>你好 hello", out_type=str)
    assert pieces[:3] == ["▁", "<|zh|>", "<|HAPPY|>"]
    ids = processor.encode("<|en|><|woitn|>")
    assert ids[1:] == [24885, 25017]
    assert processor.decode([24885, 25004, 25017]) == "<|en|><|NEUTRAL|><|woitn|>"
