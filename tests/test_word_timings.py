"""Word timings from the real models: inside the speech, the same on both backends, through
the server, and next to funasr's own CTC timestamps."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.core.protocol import Final, Partial, StreamOptions, Word
from streamer.core.transcript import Transcript
from streamer.core.words import FRAME_MS, QUERY_FRAMES, join_words, transcript_words
from streamer.model.artifacts.onnx_export import cached_export
from streamer.model.backends.onnx_backend import OnnxRecognizer
from streamer.model.backends.torch_backend import Recognizer
from streamer.model.decode.decoding import CtcRecognizer
from streamer.model.options import RecognizerOptions
from streamer.model.sensevoice import FRAME_MS as MODEL_FRAME_MS
from streamer.model.sensevoice import QUERY_FRAMES as MODEL_QUERY_FRAMES
from streamer.testkit import speech as synth
from tests.clips import load_clips

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

FOX = "the quick brown fox jumps over the lazy dog"
HELLO = "hello there"
SAMPLES_PER_MS = 16
# CTC marks a token a frame or two after its sound, so a word may start that late; the
# last word ends with its token's CTC run, which the tiny tagged model stretches up to
# five frames past the sound (measured: 160-260 ms on the fox clip)
LATE_MS = 2 * FRAME_MS
LAST_END_LATE_MS = 5 * FRAME_MS


def _options(model: Path, **options: object) -> RecognizerOptions:
    defaults: dict[str, object] = {"device": "cpu", "threads": 2, "warmup": False}
    return RecognizerOptions(model=str(model), **{**defaults, **options})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tagged(tagged_model_dir: Path, cache_dir: Path) -> dict[str, CtcRecognizer]:
    export = cached_export(tagged_model_dir, cache_dir)
    return {
        "torch": Recognizer(_options(tagged_model_dir, backend="torch")),
        "onnx": OnnxRecognizer(_options(export, backend="onnx")),
    }


def _speech_span_ms(pcm: np.ndarray, threshold: int = 64) -> tuple[float, float]:
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > threshold)
    return loud[0] / SAMPLES_PER_MS, (loud[-1] + 1) / SAMPLES_PER_MS


def _assert_well_formed(words: tuple[Word, ...], t: Transcript, start: float, end: float) -> None:
    assert words, t.raw
    assert join_words(words) == t.text
    assert all(start <= w.start_ms <= w.end_ms <= end for w in words)
    assert all(a.end_ms <= b.start_ms for a, b in zip(words, words[1:], strict=False))
    assert all(w.start_ms < w.end_ms for w in words)
    assert all(0.0 < w.confidence <= 1.0 for w in words)


def test_constants_match_the_model() -> None:
    assert (QUERY_FRAMES, FRAME_MS) == (MODEL_QUERY_FRAMES, MODEL_FRAME_MS)


@pytest.mark.parametrize("backend", ["torch", "onnx"])
@pytest.mark.parametrize(("text", "lead_ms", "trail_ms"), [(FOX, 500, 800), (HELLO, 1000, 800)])
def test_words_fall_inside_the_speech(
    tagged, speech_cache: Path, backend: str, text: str, lead_ms: int, trail_ms: int
) -> None:
    """The espeak clip sits at a known place in silence; the words must sit on it.

    Every word but the first starts inside the speech (give or take the CTC delay), and
    so every word but the last ends inside it (where the next one starts). The first
    word's start is only checked to come before the speech: this tiny model emits its
    first piece on the first audio frame whatever the silence before (it was trained on
    unpadded clips), so that word starts at the audio's start. The last word ends with
    its token's CTC run, shortly after the speech and long before the silence ends.
    """
    clip = synth.speak(text, "en", cache_dir=speech_cache)
    pcm = np.concatenate(
        [np.zeros(lead_ms * SAMPLES_PER_MS, np.int16), clip, np.zeros(trail_ms * 16, np.int16)]
    )
    speech_start, speech_end = _speech_span_ms(pcm)
    segment_start = 10_000.0  # anywhere in the session: the words move with it
    segment_end = segment_start + pcm.size / SAMPLES_PER_MS
    t = tagged[backend].decode(pcm, language="auto", use_itn=False)
    assert t.text == text
    words = transcript_words(t, segment_start, segment_end)
    _assert_well_formed(words, t, segment_start, segment_end)
    assert [w.word for w in words] == text.split()
    low, high = segment_start + speech_start, segment_start + speech_end + LATE_MS
    assert all(low <= w.start_ms <= high for w in words[1:]), (low, high, words)
    assert all(low <= w.end_ms <= high for w in words[:-1]), (low, high, words)
    assert words[0].start_ms <= low
    assert words[-1].end_ms <= segment_start + speech_end + LAST_END_LATE_MS
    assert words[-1].end_ms < segment_end - trail_ms / 2  # not the silence after the speech


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_words_move_with_the_speech(tagged, speech_cache: Path, backend: str) -> None:
    """1200 ms more silence before the clip (20 frames exactly) moves every word (but the
    first's start, see above) by 1200 ms, to within a frame."""
    clip = synth.speak(FOX, "en", cache_dir=speech_cache)
    trail = np.zeros(500 * SAMPLES_PER_MS, np.int16)
    times = []
    for lead_ms in (0, 1200):
        pcm = np.concatenate([np.zeros(lead_ms * SAMPLES_PER_MS, np.int16), clip, trail])
        t = tagged[backend].decode(pcm, language="auto", use_itn=False)
        words = transcript_words(t, 0.0, pcm.size / SAMPLES_PER_MS)
        times.append([(w.start_ms, w.end_ms) for w in words])
    moved = [
        (after[0] - before[0], after[1] - before[1])
        for before, after in zip(times[0], times[1], strict=True)
    ]
    assert all(abs(d_end - 1200) <= FRAME_MS for _, d_end in moved), moved
    assert all(abs(d_start - 1200) <= FRAME_MS for d_start, _ in moved[1:]), moved


def test_both_backends_give_the_same_words(tagged, tiny_model_dir, cache_dir, speech_cache) -> None:
    """Same logits, same tokens, same words: on the tagged clips and on every language
    through the tiny model (whose text is gibberish in every script)."""
    cases = [(synth.speak(text, "en", cache_dir=speech_cache), tagged) for text in (FOX, HELLO)]
    tiny = {
        "torch": Recognizer(_options(tiny_model_dir, backend="torch")),
        "onnx": OnnxRecognizer(_options(cached_export(tiny_model_dir, cache_dir), backend="onnx")),
    }
    cases += [(pcm, tiny) for pcm in load_clips(speech_cache).values()]
    spelled = 0
    for pcm, pair in cases:
        for use_itn in (False, True):
            end_ms = 500.0 + pcm.size / SAMPLES_PER_MS
            got = {}
            for name, recognizer in pair.items():
                t = recognizer.decode(pcm, language="auto", use_itn=use_itn)
                got[name] = (t, transcript_words(t, 500.0, end_ms))
            (t_torch, w_torch), (t_onnx, w_onnx) = got["torch"], got["onnx"]
            assert t_torch.token_end_frames == t_onnx.token_end_frames
            assert t_torch.token_pieces == t_onnx.token_pieces
            assert [(w.word, w.start_ms, w.end_ms) for w in w_torch] == [
                (w.word, w.start_ms, w.end_ms) for w in w_onnx
            ]
            np.testing.assert_allclose(
                [w.confidence for w in w_torch], [w.confidence for w in w_onnx], atol=2e-4
            )
            if t_torch.text:
                assert "".join(w.word for w in w_torch) == t_torch.text.replace(" ", "")
                pairs = zip(w_torch, w_torch[1:], strict=False)
                assert all(a.end_ms <= b.start_ms for a, b in pairs)
                spelled += join_words(w_torch) == t_torch.text
    assert spelled >= 4


def test_token_runs_and_pieces_come_with_every_transcript(tagged, speech_cache: Path) -> None:
    pcm = synth.speak(HELLO, "en", cache_dir=speech_cache)
    for recognizer in tagged.values():
        t = recognizer.decode(pcm, use_itn=False)
        frames_total = QUERY_FRAMES + -(-pcm.size // (FRAME_MS * SAMPLES_PER_MS))
        assert len(t.token_pieces) == len(t.token_end_frames) == len(t.token_ids)
        assert t.token_pieces[:4] == ("<|en|>", "<|HAPPY|>", "<|Laughter|>", "<|woitn|>")
        assert all(s < e for s, e in zip(t.token_frames, t.token_end_frames, strict=True))
        assert all(e <= s for e, s in zip(t.token_end_frames, t.token_frames[1:], strict=False))
        assert t.token_end_frames[-1] <= frames_total + 1


async def test_finals_and_partials_carry_words_through_the_server(
    tagged_server_url: str, speech_cache: Path
) -> None:
    fox = synth.speak(FOX, "en", cache_dir=speech_cache)
    hello = synth.speak(HELLO, "en", cache_dir=speech_cache)
    pcm, truth = synth.join_with_silence([("en", "fox", fox), ("en", "hello", hello)], 1500)
    stream = StreamOptions(itn=False, words=True)
    options = ClientOptions(url=tagged_server_url, stream=stream)
    result = await transcribe(options, pcm, 16000, speed=4.0)  # paced: partials come
    finals = list(result.finals)
    assert [f.text for f in finals] == [FOX, HELLO]
    for final, utterance in zip(finals, truth, strict=True):
        assert isinstance(final, Final) and final.words is not None
        words = final.words
        assert join_words(words) == final.text
        assert all(final.start_ms <= w.start_ms <= w.end_ms <= final.end_ms for w in words)
        assert all(a.end_ms <= b.start_ms for a, b in zip(words, words[1:], strict=False))
        speech_start = utterance.start_sample / SAMPLES_PER_MS
        speech_end = utterance.end_sample / SAMPLES_PER_MS
        assert all(speech_start <= w.start_ms <= speech_end + LATE_MS for w in words[1:])
        assert all(speech_start <= w.end_ms <= speech_end + LATE_MS for w in words[:-1])
        assert words[-1].end_ms <= speech_end + LAST_END_LATE_MS
    partials = [m.message for m in result.messages if isinstance(m.message, Partial)]
    assert partials and all(p.words is not None for p in partials)
    assert all(join_words(p.words or ()) == p.text for p in partials)
    # without the option, partials stay small; finals still carry their words
    plain_options = ClientOptions(url=tagged_server_url, stream=StreamOptions(itn=False))
    plain = await transcribe(plain_options, pcm, 16000, speed=4.0)
    plain_partials = [m.message for m in plain.messages if isinstance(m.message, Partial)]
    assert plain_partials and all(p.words is None for p in plain_partials)
    assert [f.words for f in plain.finals] == [f.words for f in finals]


# --- funasr's own CTC timestamps ----------------------------------------------------------
# funasr's generate(..., output_timestamp=True) re-tokenizes the decoded text and encodes
# every piece again (with a dummy prefix, so "▁the" becomes two ids) before aligning: on the
# tagged model's 400-piece vocabulary that raises IndexError, and on the real-size random
# model, which emits a token on nearly every frame, the longer target leaves one
# degenerate span for the whole clip. So the tests run funasr's own alignment and time
# conventions (ctc_forced_align over the speech frames' log-probabilities, blanks favoured
# where they win, ts = frame * 60 - 30 ms, and its word grouping ``post()``) the way
# inference() does, on the tokens the text was decoded from.


def _funasr_spans(recognizer: Recognizer, pcm: np.ndarray, t: Transcript) -> list[tuple]:
    """funasr's [piece, start_s, end_s] for each token on the speech frames of ``t``."""
    from itertools import groupby

    import torch
    from funasr.models.sense_voice.utils.ctc_alignment import ctc_forced_align

    from streamer.model.decode.decoding import Utterance, as_waveform, language_row, textnorm_row

    utterance = Utterance(as_waveform(pcm), language_row("auto"), textnorm_row(False))
    logits = recognizer._logits([utterance])[0]
    speech = torch.from_numpy(logits).log_softmax(-1)[QUERY_FRAMES:]
    speech[speech.argmax(-1) == 0, 0] = 0  # as inference(): blank wins where it is best
    kept = [i for i, f in enumerate(t.token_frames) if f >= QUERY_FRAMES]
    targets = torch.tensor([[t.token_ids[i] for i in kept]])
    frames = speech.shape[0]
    align = ctc_forced_align(
        speech.unsqueeze(0).float(), targets, torch.tensor([frames]), torch.tensor([len(kept)])
    )
    spans = []
    position = 0
    pieces = iter(t.token_pieces[i] for i in kept)
    for token, run in groupby(align[0].tolist()):
        end = position + len(list(run))
        if token != 0:
            left = max((position * 60 - 30) / 1000, 0)
            right = min((end * 60 - 30) / 1000, (frames * 60 - 30) / 1000)
            spans.append([next(pieces), left, right])
        position = end
    assert len(spans) == len(kept)
    return spans


def _assert_agree_with_funasr(recognizer: Recognizer, pcm: np.ndarray) -> tuple[int, int]:
    """Tokens (and words, where funasr groups them as we do) compared."""
    t = recognizer.decode(pcm, language="auto", use_itn=False)
    spans = _funasr_spans(recognizer, pcm, t)
    ours = [
        ((f - QUERY_FRAMES) * FRAME_MS, (e - QUERY_FRAMES) * FRAME_MS)
        for f, e in zip(t.token_frames, t.token_end_frames, strict=True)
        if f >= QUERY_FRAMES
    ]
    # the same frames: funasr writes a frame's time 30 ms earlier (clamped at 0)
    for (start, end), (_, left_s, right_s) in zip(ours, spans, strict=True):
        assert start == pytest.approx(left_s * 1000 + 30 if left_s > 0 else 0.0), (start, left_s)
        assert end == pytest.approx(right_s * 1000 + 30), (end, right_s)
    # funasr's word grouping over those spans starts each word where ours starts
    funasr_words = recognizer._model.post([list(span) for span in spans])[0]
    words = transcript_words(t, 0.0, pcm.size / SAMPLES_PER_MS)
    if len(funasr_words) != len(words):  # CJK pieces of several characters: one word there
        return len(spans), 0
    for word, (start_ms, end_ms) in zip(words, funasr_words, strict=True):
        assert abs(word.start_ms - start_ms) <= 30 + FRAME_MS, (word, start_ms)
        assert word.end_ms >= end_ms - 30  # ours runs on to the next token
    return len(spans), len(words)


def test_token_times_agree_with_funasr_alignment(tagged, speech_cache: Path) -> None:
    for text in (FOX, HELLO):
        clip = synth.speak(text, "en", cache_dir=speech_cache)
        silence = np.zeros(500 * SAMPLES_PER_MS, np.int16)
        pcm = np.concatenate([silence, clip, silence])
        assert _assert_agree_with_funasr(tagged["torch"], pcm)[1] == len(text.split())


@pytest.fixture(scope="module")
def small(small_model_dir: Path) -> Iterator[Recognizer]:
    recognizer = Recognizer(_options(small_model_dir, backend="torch"))
    yield recognizer
    del recognizer


@pytest.mark.slow
def test_token_times_agree_with_funasr_alignment_real_size(small: Recognizer, speech_cache) -> None:
    """The real vocabulary and frame layout (random weights: gibberish in every script)."""
    clips = load_clips(speech_cache)
    compared = sum(
        _assert_agree_with_funasr(small, clips[name][: 4 * 16000])[0]
        for name in ("tts-en", "tts-zh", "librivox-0870")
    )
    assert compared >= 30
