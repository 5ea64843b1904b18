"""What both backends share: features equal funasr's, greedy CTC, tokenizers, tag rendering."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamer.errors import ModelError
from streamer.model.decode.ctc import greedy_ctc
from streamer.model.decode.frontend import Frontend, lfr, read_am_mvn
from streamer.model.decode.tokenizer import (
    PieceTableTokenizer,
    SentencePieceTokenizer,
    read_tokens_json,
    read_tokens_txt,
    write_tokens_txt,
)
from streamer.model.sensevoice import FRONTEND_CONF, KNOWN_SPECIAL_IDS, rich_text
from streamer.testkit.speech import SAMPLE_RATE, speak
from tests.clips import load_wav

FRONT_CENTER = Path("/usr/share/sounds/alsa/Front_Center.wav")


def _funasr():
    from streamer.model.backends.funasr_quiet import import_funasr

    return import_funasr()


# --- features ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def waveforms(speech_cache: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    speech = speak("streaming speech recognition should feel instant", "en", cache_dir=speech_cache)
    recorded = load_wav(FRONT_CENTER)
    signals = {
        "tts": speech,
        "recorded": recorded,
        "noise-7s": rng.normal(0, 2000, 7 * SAMPLE_RATE).astype(np.int16),
        "silence": np.zeros(SAMPLE_RATE, np.int16),
        "clipped": np.full(SAMPLE_RATE // 2, 32767, np.int16),
    }
    for samples in (400, 401, 559, 560, 1000, 1600, 3199, 4000):
        signals[f"short-{samples}"] = speech[:samples]
    return {name: pcm.astype(np.float32) / 32768 for name, pcm in signals.items()}


def test_features_equal_funasr_wavfrontend(
    tiny_model_dir: Path, waveforms: dict[str, np.ndarray]
) -> None:
    """Bit for bit when funasr uses kaldi-native-fbank too (torchaudio: within 1e-4)."""
    _funasr()
    import torch
    from funasr.frontends.wav_frontend import WavFrontend
    from funasr.utils import fbank
    from funasr.utils.load_utils import extract_fbank

    cmvn_file = tiny_model_dir / "am.mvn"
    reference = WavFrontend(cmvn_file=str(cmvn_file), dither=0.0, **FRONTEND_CONF)
    ours = Frontend(read_am_mvn(cmvn_file))
    exact = not getattr(fbank, "_HAS_TORCHAUDIO", False)
    for name, waveform in waveforms.items():
        expected, lengths = extract_fbank([torch.from_numpy(waveform)], frontend=reference)
        got = ours(waveform)
        assert got.dtype == np.float32
        assert got.shape == tuple(expected.shape[1:]), name
        assert int(lengths.reshape(-1)[0]) == got.shape[0]
        if exact:
            np.testing.assert_array_equal(got, expected[0].numpy(), err_msg=name)
        else:
            np.testing.assert_allclose(got, expected[0].numpy(), atol=1e-4, err_msg=name)


@pytest.mark.parametrize("frames", [1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 50, 97])
def test_lfr_equals_funasr_apply_lfr(frames: int) -> None:
    _funasr()
    import torch
    from funasr.frontends.wav_frontend import apply_lfr

    fbank = np.random.default_rng(frames).normal(size=(frames, 80)).astype(np.float32)
    expected = apply_lfr(torch.from_numpy(fbank.copy()), 7, 6).numpy()
    np.testing.assert_array_equal(lfr(fbank, 7, 6), expected)


def test_am_mvn_reads_like_funasr(tagged_model_dir: Path) -> None:
    _funasr()
    from funasr.frontends.wav_frontend import load_cmvn

    expected = load_cmvn(str(tagged_model_dir / "am.mvn")).numpy()
    cmvn = read_am_mvn(tagged_model_dir / "am.mvn")
    np.testing.assert_array_equal(cmvn.shift, expected[0])
    np.testing.assert_array_equal(cmvn.scale, expected[1])


def test_bad_am_mvn_is_a_model_error(tmp_path: Path) -> None:
    path = tmp_path / "am.mvn"
    path.write_text("<Nnet>\n</Nnet>\n")
    with pytest.raises(ModelError, match="AddShift"):
        read_am_mvn(path)
    with pytest.raises(ModelError, match="cannot be read"):
        read_am_mvn(tmp_path / "missing.mvn")


# --- greedy CTC ----------------------------------------------------------------------------


def _logits(best: list[int], vocab: int = 6, margin: float = 5.0) -> np.ndarray:
    rng = np.random.default_rng(len(best))
    logits = rng.normal(0, 0.1, (len(best), vocab)).astype(np.float32)
    logits[np.arange(len(best)), best] += margin
    return logits


def test_greedy_ctc_collapses_repeats_and_drops_blanks() -> None:
    logits = _logits([0, 3, 3, 0, 3, 5, 5, 5, 0, 0, 2])
    tokens = greedy_ctc(logits)
    assert tokens.ids == (3, 3, 5, 2)
    assert tokens.frames == (1, 4, 5, 10)
    assert tokens.end_frames == (3, 5, 8, 11)  # each run's end: a blank, the next token, the end
    shifted = logits - logits.max(axis=1, keepdims=True)
    posterior = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    expected = [posterior[f, t] for f, t in zip(tokens.frames, tokens.ids, strict=True)]
    np.testing.assert_allclose(tokens.confidences, expected, rtol=1e-5)
    assert all(0.0 < c <= 1.0 for c in tokens.confidences)


def test_greedy_ctc_edge_cases() -> None:
    assert greedy_ctc(np.zeros((0, 6), np.float32)).ids == ()
    assert greedy_ctc(_logits([0, 0, 0])).ids == ()
    assert greedy_ctc(_logits([4])).frames == (0,)
    assert greedy_ctc(_logits([4])).end_frames == (1,)
    assert greedy_ctc(_logits([0, 0, 0])).end_frames == ()
    banned = greedy_ctc(_logits([4, 4, 1], margin=5.0), banned_ids=(4,))
    assert 4 not in banned.ids


def test_greedy_ctc_ties_follow_log_softmax() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0]], np.float32)  # an exact tie: the first wins
    assert greedy_ctc(logits).ids == (1,)
    expected = np.exp(3.0) / np.exp([1.0, 3.0, 3.0, 0.0]).sum()
    assert greedy_ctc(logits).confidences[0] == pytest.approx(expected, rel=1e-5)


# --- tokenizers ----------------------------------------------------------------------------


def test_piece_table_decodes_like_sentencepiece(tiny_model_dir: Path, tmp_path: Path) -> None:
    spm_tokenizer = SentencePieceTokenizer(tiny_model_dir / "bpe.model")
    pieces = spm_tokenizer.pieces()
    write_tokens_txt(tmp_path / "tokens.txt", pieces)
    (tmp_path / "tokens.json").write_text(json.dumps(pieces, ensure_ascii=False))
    assert read_tokens_txt(tmp_path / "tokens.txt") == pieces
    assert read_tokens_json(tmp_path / "tokens.json") == pieces
    table = PieceTableTokenizer(pieces)
    assert table.size == spm_tokenizer.size == 400
    rng = np.random.default_rng(0)
    specials = [pieces.index(token) for token in KNOWN_SPECIAL_IDS]
    for length in range(1, 60):
        ids = [int(i) for i in rng.integers(3, 400, length)]
        if length % 3 == 0:
            ids = [*rng.choice(specials, 4).tolist(), *ids]
        assert table.decode(ids) == spm_tokenizer.decode(ids), ids


def test_bad_token_files(tmp_path: Path) -> None:
    (tmp_path / "gap.txt").write_text("<unk> 0\na 2\n")
    with pytest.raises(ModelError, match="0..1"):
        read_tokens_txt(tmp_path / "gap.txt")
    (tmp_path / "bad.txt").write_text("<unk> 0\nnonumber\n")
    with pytest.raises(ModelError, match="piece id"):
        read_tokens_txt(tmp_path / "bad.txt")
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(ModelError, match="JSON list"):
        read_tokens_json(tmp_path / "bad.json")


# --- rich transcription ----------------------------------------------------------------------

RICH_CASES = [
    "",
    "hello",
    "<|en|><|HAPPY|><|Laughter|><|woitn|>hello there",
    "<|en|><|NEUTRAL|><|Speech|><|withitn|>The quick brown fox.",
    "<|zh|><|SAD|><|BGM|><|woitn|>今天天气很好",
    "<|nospeech|><|Event_UNK|>",
    "<|nospeech|><|EMO_UNKNOWN|><|Event_UNK|><|woitn|>",
    "<|en|><|ANGRY|><|Applause|><|woitn|>yes <|en|><|ANGRY|><|Applause|><|woitn|>no",
    "<|en|><|HAPPY|><|Speech|><|woitn|>one<|zh|><|SAD|><|Cry|><|woitn|>two",
    "<|ja|><|FEARFUL|><|Cough|><|withitn|>こんにちは <|ko|><|SURPRISED|><|Sneeze|>안녕",
    "<|yue|><|DISGUSTED|><|Breath|><|Sing|><|withitn|>The. end",
    "<|en|><|HAPPY|><|SAD|><|SAD|><|BGM|><|Laughter|>mixed  spaces 😊 here",
    "<|unknown|>text<|Speech_Noise|> <|GBG|>",
    "<|en|>",
    "<|en|><|en|><|HAPPY|>",
]


@pytest.mark.parametrize("raw", RICH_CASES)
def test_rich_text_equals_funasr(raw: str) -> None:
    _funasr()
    from funasr.utils.postprocess_utils import rich_transcription_postprocess

    if not raw:
        assert rich_text(raw) == ""
        return
    assert rich_text(raw) == rich_transcription_postprocess(raw)
