"""Random-weight SenseVoiceSmall model directories, built locally for tests and benchmarks.

The real weights cannot be downloaded everywhere the project is built, so tests and the
bench run on models built here through funasr's own classes (``SenseVoiceSmall``,
``SenseVoiceEncoderSmall``) and loaded by funasr exactly like a hub model:

- ``tiny``: 128 wide, 3 + 1 blocks, 400-piece vocabulary (about 0.8 M parameters). Loads
  in well under a second; its output is meaningless.
- ``small``: the real SenseVoiceSmall configuration and vocabulary size (233,999,167
  parameters, about 900 MiB on disk). Its compute is the real model's, so use it for
  timing; its output is meaningless.
- ``tagged``: ``tiny`` trained for a few hundred steps on two espeak-ng clips so that an
  unmodified ``AutoModel.generate()`` returns exact, known tagged transcripts
  (:data:`TAGGED_TRANSCRIPTS`). One training run is shipped with the package
  (:mod:`streamer.testkit.tagged`), so nothing trains at test time; rebuilding it needs
  espeak-ng and sox.

Every directory uses layout B of funasr's loader: ``config.yaml``, ``model.pt``,
``bpe.model`` (sentencepiece BPE trained here on a generated ASCII + CJK corpus) and
``am.mvn`` (Kaldi nnet1 text). Building is deterministic (fixed seeds).

torch and funasr are imported inside functions only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamer.errors import ConfigError, ModelError
from streamer.model.artifacts.files import MARKER_FILE, build_directory
from streamer.model.sensevoice import (
    FEATURE_DIM,
    FRONTEND_CONF,
    KNOWN_SPECIAL_IDS,
    LID_ROWS,
    REAL_VOCAB_SIZE,
    TEXTNORM_ROWS,
    prepend_queries,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Bump whenever the output of a build changes: cached directories are keyed by it.
BUILDER_VERSION = 2

MODEL_NAMES = ("tiny", "small", "tagged")
# every directory built here holds MARKER_FILE (defined where the model reads it)

# Tags whose real ids funasr's code does not name: placed in free special slots.
OTHER_SPECIALS = (
    "<|Speech|>",
    "<|BGM|>",
    "<|Applause|>",
    "<|Laughter|>",
    "<|Cry|>",
    "<|Sneeze|>",
    "<|Breath|>",
    "<|Cough|>",
    "<|FEARFUL|>",
    "<|DISGUSTED|>",
    "<|SURPRISED|>",
    "<|Sing|>",
    "<|Speech_Noise|>",
    "<|Event_UNK|>",
)
FIRST_SPECIAL_ID = 24884
TINY_VOCAB_SIZE = 400

# What unmodified generate() returns for the two training clips of the tagged model
# (use_itn=False; with use_itn=True the fourth tag is <|withitn|>).
TAGGED_TRANSCRIPTS = {
    "the quick brown fox jumps over the lazy dog": "<|en|><|NEUTRAL|><|Speech|><|woitn|>",
    "hello there": "<|en|><|HAPPY|><|Laughter|><|woitn|>",
}

_ENCODER_COMMON = {
    "dropout_rate": 0.1,
    "positional_dropout_rate": 0.1,
    "attention_dropout_rate": 0.1,
    "input_layer": "pe",
    "pos_enc_class": "SinusoidalPositionEncoder",
    "normalize_before": True,
    "kernel_size": 11,
    "sanm_shfit": 0,
    "selfattention_layer_type": "sanm",
}
ENCODER_CONF = {
    "tiny": {
        "output_size": 128,
        "attention_heads": 4,
        "linear_units": 256,
        "num_blocks": 3,
        "tp_blocks": 1,
        **_ENCODER_COMMON,
    },
    "small": {
        "output_size": 512,
        "attention_heads": 4,
        "linear_units": 2048,
        "num_blocks": 50,
        "tp_blocks": 20,
        **_ENCODER_COMMON,
    },
}
# Training of the tagged model (about 4 minutes on 2 cores; only when it is rebuilt).
TAGGED_STEPS = 800
TAGGED_BATCH = 16  # examples per Adam step, drawn from the pool of padded clips
TAGGED_LEARNING_RATE = 3e-3
TAGGED_MAX_LEAD_MS = 700  # silence before the speech: drawn from 0..700 ms per example
TAGGED_MAX_TAIL_MS = 1000  # silence after it: drawn from 0..1000 ms
TAGGED_CHECKED_PADDINGS_MS = ((0, 0), (300, 200), (250, 350), (450, 800), (700, 1000))


@dataclass(frozen=True)
class BuildInfo:
    """What ``random_model.json`` records about a built directory."""

    name: str  # "tiny", "small" or "tagged"
    builder_version: int  # BUILDER_VERSION at build time
    seed: int  # torch / numpy seed used for weights and corpus
    parameters: int  # number of model parameters
    vocab_size: int  # tokenizer pieces == CTC outputs


def random_model_dir_name(name: str, seed: int = 0) -> str:
    return f"random-{name}-v{BUILDER_VERSION}-seed{seed}"


def ensure_random_model(name: str, cache_dir: Path, *, seed: int = 0) -> Path:
    """The directory of random model ``name``, built under ``cache_dir/models`` if needed.

    ``cache_dir`` is the package cache root (``STREAMER_CACHE_DIR``); speech synthesised
    for ``tagged`` is cached under ``cache_dir/speech``. The directory appears atomically
    (built in a temporary sibling, then renamed), so concurrent callers and interrupted
    builds never see a partial model; a new :data:`BUILDER_VERSION` builds a new one.
    """
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown random model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if name == "tagged" and seed == 0:
        from streamer.testkit.tagged import verified_dir

        return verified_dir()  # shipped: training it again is slow and not reproducible
    models_dir = cache_dir / "models"
    target = models_dir / random_model_dir_name(name, seed)
    if (target / MARKER_FILE).exists():
        return target
    from streamer.extras import TORCH, TORCH_MODULES, require

    require(f"building the random-weight model {name!r}", TORCH, *TORCH_MODULES)
    models_dir.mkdir(parents=True, exist_ok=True)
    logger.warning(
        "random model %r is not cached yet: building it in %s (%s; once per cache)",
        name,
        target,
        "minutes of training on 2 cores"
        if name == "tagged"
        else "about 75 s on 2 cores and 900 MiB on disk"
        if name == "small"
        else "about a second",
    )
    return build_directory(
        target,
        MARKER_FILE,
        lambda building: build_random_model(
            name, building, speech_cache_dir=cache_dir / "speech", seed=seed
        ),
        prefix=f".building-{name}-",
    )


@dataclass(frozen=True)
class RandomModelBuilder:
    """:class:`streamer.model.artifacts.files.RandomModels` for the models built here: what the CLI
    and the test fixtures pass as ``RecognizerOptions.random_models`` (it pickles, so a
    spawned model process gets it too)."""

    names: tuple[str, ...] = MODEL_NAMES

    def is_built(self, name: str, cache_dir: Path) -> bool:
        return (cache_dir / "models" / random_model_dir_name(name) / MARKER_FILE).exists()

    def ensure(self, name: str, cache_dir: Path) -> Path:
        return ensure_random_model(name, cache_dir)


RANDOM_MODELS = RandomModelBuilder()


def build_random_model(
    name: str, out_dir: Path, *, speech_cache_dir: Path | None = None, seed: int = 0
) -> BuildInfo:
    """Write a complete random model directory for ``name`` into ``out_dir`` (created).

    Prefer :func:`ensure_random_model`, which caches and writes atomically. ``tagged``
    needs ``speech_cache_dir`` for its espeak-ng clips.
    """
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown random model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    from streamer.extras import TORCH, TORCH_MODULES, require

    require(f"building the random-weight model {name!r}", TORCH, *TORCH_MODULES)
    import torch

    from streamer.model.backends.funasr_quiet import import_funasr

    import_funasr()
    out_dir.mkdir(parents=True, exist_ok=True)
    size = "small" if name == "small" else "tiny"
    logger.info("building random model %r in %s", name, out_dir)
    vocab_size = _write_tokenizer(out_dir / "bpe.model", size, seed)
    _write_config(out_dir / "config.yaml", size)

    torch.manual_seed(seed)
    model = _new_model(size, vocab_size)
    if name == "tagged":
        if speech_cache_dir is None:
            raise ConfigError("building the tagged model needs speech_cache_dir")
        _train_tagged(model, out_dir, speech_cache_dir, seed)
    else:
        mean = np.full(FEATURE_DIM, 10.0, dtype=np.float32)
        std = np.full(FEATURE_DIM, 3.0, dtype=np.float32)
        write_am_mvn(out_dir / "am.mvn", mean, std)
    torch.save(model.state_dict(), out_dir / "model.pt")
    parameters = sum(p.numel() for p in model.parameters())
    info = BuildInfo(name, BUILDER_VERSION, seed, parameters, vocab_size)
    (out_dir / MARKER_FILE).write_text(
        json.dumps(
            {**info.__dict__, "warning": "random weights: transcripts are meaningless"},
            indent=2,
        )
        + "\n"
    )
    logger.info("built random model %r: %d parameters, vocabulary %d", name, parameters, vocab_size)
    return info


def read_build_info(model_dir: Path) -> BuildInfo | None:
    """The :class:`BuildInfo` of a directory built here, or None for any other model."""
    try:
        data = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return BuildInfo(
        name=data["name"],
        builder_version=data["builder_version"],
        seed=data["seed"],
        parameters=data["parameters"],
        vocab_size=data["vocab_size"],
    )


def write_am_mvn(path: Path, mean: np.ndarray, std: np.ndarray) -> None:
    """Write CMVN statistics in the Kaldi nnet1 text format WavFrontend reads."""
    dim = mean.size

    def vector(values: np.ndarray) -> str:
        return " ".join(f"{v:.8g}" for v in values.tolist())

    path.write_text(
        "<Nnet>\n"
        f"<Splice> {dim} {dim}\n"
        "[ 0 ]\n"
        f"<AddShift> {dim} {dim}\n"
        f"<LearnRateCoef> 0 [ {vector(-mean)} ]\n"
        f"<Rescale> {dim} {dim}\n"
        f"<LearnRateCoef> 0 [ {vector(1.0 / std)} ]\n"
        "</Nnet>\n"
    )


# --- tokenizer --------------------------------------------------------------------------

_ENGLISH_WORDS = (
    "the quick brown fox jumps over lazy dog hello there please turn on lights in kitchen "
    "streaming speech recognition should feel instant what time is it today weather good "
    "we are going to eat dinner together this is a test of the system one two three four "
    "five six seven eight nine ten hundred thousand yes no maybe open close start stop "
    "music play next previous call mom send message tomorrow morning evening night city "
    "river mountain computer model server client network audio signal voice sound word"
).split()


def _special_tokens() -> list[str]:
    return list(KNOWN_SPECIAL_IDS) + list(OTHER_SPECIALS)


def _corpus(size: str, seed: int) -> Iterator[str]:
    from streamer.testkit.speech import SENTENCES

    rng = np.random.default_rng(seed)
    for sentences in SENTENCES.values():
        yield from sentences
    for _ in range(3000):
        yield " ".join(rng.choice(_ENGLISH_WORDS, size=int(rng.integers(3, 12))))
    if size == "small":
        cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 2000)]
        cjk += [chr(c) for c in range(0xAC00, 0xAC00 + 500)]
        cjk += [chr(c) for c in range(0x3041, 0x3097)] + [chr(c) for c in range(0x30A1, 0x30FB)]
        for _ in range(20000):
            yield "".join(rng.choice(cjk, size=int(rng.integers(2, 10))))


def _write_tokenizer(path: Path, size: str, seed: int) -> int:
    """Train the BPE tokenizer; returns its vocabulary size."""
    import io

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    buffer = io.BytesIO()
    common: dict[str, Any] = {
        "model_type": "bpe",
        "character_coverage": 1.0,
        "model_writer": buffer,
        "minloglevel": 2,
        "num_threads": 1,
        "unk_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": -1,
    }
    if size == "tiny":
        spm.SentencePieceTrainer.train(
            sentence_iterator=_corpus(size, seed),
            vocab_size=TINY_VOCAB_SIZE,
            user_defined_symbols=_special_tokens(),
            **common,
        )
        path.write_bytes(buffer.getvalue())
        return TINY_VOCAB_SIZE

    spm.SentencePieceTrainer.train(sentence_iterator=_corpus(size, seed), vocab_size=6000, **common)
    # generated protobuf code: no type stubs
    proto = sentencepiece_model_pb2.ModelProto.FromString(buffer.getvalue())  # type: ignore[attr-defined]
    present = {piece.piece for piece in proto.pieces}
    slots: dict[int, str] = {index: token for token, index in KNOWN_SPECIAL_IDS.items()}
    free = [i for i in range(FIRST_SPECIAL_ID, REAL_VOCAB_SIZE) if i not in slots]
    for token, index in zip(OTHER_SPECIALS, [i for i in free if i > 24992], strict=False):
        slots[index] = token
    # Ordinary ids up to the specials are filled with CJK and Hangul characters, so the
    # real-size CTC head maps onto printable text.
    fillers = (chr(c) for c in [*range(0x4E00, 0xA000), *range(0xAC00, 0xD7A4)])
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED  # type: ignore[attr-defined]
    while len(proto.pieces) < REAL_VOCAB_SIZE:
        index = len(proto.pieces)
        if index >= FIRST_SPECIAL_ID:
            token = slots.get(index, f"<|SPECIAL_{index}|>")
        else:
            token = next(c for c in fillers if c not in present)
        piece = proto.pieces.add()
        piece.piece = token
        piece.score = 0.0
        piece.type = user_defined
    path.write_bytes(proto.SerializeToString())
    processor = spm.SentencePieceProcessor(model_file=str(path))
    for token, index in KNOWN_SPECIAL_IDS.items():
        if processor.piece_to_id(token) != index:
            raise ModelError(f"tokenizer build put {token} at {processor.piece_to_id(token)}")
    return int(processor.get_piece_size())


# --- config and weights -----------------------------------------------------------------


def _write_config(path: Path, size: str) -> None:
    import yaml

    config = {
        "encoder": "SenseVoiceEncoderSmall",
        "encoder_conf": ENCODER_CONF[size],
        "model": "SenseVoiceSmall",
        "model_conf": {"length_normalized_loss": True, "sos": 1, "eos": 2, "ignore_id": -1},
        "tokenizer": "SentencepiecesTokenizer",
        "tokenizer_conf": {"bpemodel": None, "unk_symbol": "<unk>", "split_with_space": True},
        "frontend": "WavFrontend",
        "frontend_conf": {**FRONTEND_CONF, "cmvn_file": None},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def _new_model(size: str, vocab_size: int) -> Any:
    from funasr.models.sense_voice.model import SenseVoiceSmall

    return SenseVoiceSmall(
        encoder="SenseVoiceEncoderSmall",
        encoder_conf=ENCODER_CONF[size],
        input_size=FEATURE_DIM,
        vocab_size=vocab_size,
        length_normalized_loss=True,
        sos=1,
        eos=2,
        ignore_id=-1,
    )


# --- the tagged model -------------------------------------------------------------------


def _features(frontend: Any, pcm: np.ndarray) -> torch.Tensor:
    """(T, 560) features as generate() computes them for int16 PCM."""
    import torch
    from funasr.utils.load_utils import extract_fbank

    waveform = torch.from_numpy(pcm.astype(np.float32) / 32768)
    feats, _ = extract_fbank([waveform], frontend=frontend)
    return feats[0]


def _train_tagged(model: Any, out_dir: Path, speech_cache_dir: Path, seed: int) -> None:
    """Train the tiny model on two clips, each with random lengths of silence around it.

    Servers cut segments with some silence before and after the speech (pre-roll, end
    padding), so every example gets a random silent margin, and both ITN queries and the
    language queries auto and en are trained; the margins in
    :data:`TAGGED_CHECKED_PADDINGS_MS` are verified after training, and the build fails
    if any of them decodes wrongly.
    """
    import sentencepiece as spm
    import torch
    from funasr.frontends.wav_frontend import WavFrontend

    from streamer.testkit.speech import speak

    processor = spm.SentencePieceProcessor(model_file=str(out_dir / "bpe.model"))
    speech = {text: speak(text, "en", cache_dir=speech_cache_dir) for text in TAGGED_TRANSCRIPTS}

    raw_frontend = WavFrontend(cmvn_file=None, dither=0.0, **FRONTEND_CONF)
    stacked = torch.cat([_features(raw_frontend, _pad(pcm, 200, 300)) for pcm in speech.values()])
    write_am_mvn(
        out_dir / "am.mvn", stacked.mean(0).numpy(), stacked.std(0).clamp_min(1e-3).numpy()
    )
    frontend = WavFrontend(cmvn_file=str(out_dir / "am.mvn"), dither=0.0, **FRONTEND_CONF)

    def example(text: str, lead_ms: int, tail_ms: int, itn: str, language: str) -> _Example:
        tagged = TAGGED_TRANSCRIPTS[text].replace("<|woitn|>", f"<|{itn}|>")
        tag_ids = [processor.piece_to_id(t) for t in _split_tags(tagged)]
        return _Example(
            feats=_features(frontend, _pad(speech[text], lead_ms, tail_ms)),
            language_row=LID_ROWS[language],
            textnorm_row=TEXTNORM_ROWS[itn],
            tag_ids=tag_ids,
            text_ids=_text_target(processor, tag_ids, tagged + text),
            expected=tagged + text,
            margins_ms=(lead_ms, tail_ms),
        )

    texts = list(TAGGED_TRANSCRIPTS)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=TAGGED_LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, TAGGED_STEPS, eta_min=TAGGED_LEARNING_RATE / 10
    )
    model.train()
    for step in range(TAGGED_STEPS):
        batch = [
            example(
                texts[i % len(texts)],
                int(rng.integers(0, TAGGED_MAX_LEAD_MS // 10 + 1)) * 10,
                int(rng.integers(0, TAGGED_MAX_TAIL_MS // 10 + 1)) * 10,
                ("woitn", "withitn")[(i // 2) % 2],
                ("auto", "en")[(i // 4) % 2],
            )
            for i in range(TAGGED_BATCH)
        ]
        speech_batch, lengths = _batch(batch)
        x, x_lengths = prepend_queries(
            model,
            speech_batch,
            lengths,
            [e.language_row for e in batch],
            [e.textnorm_row for e in batch],
        )
        encoded, encoded_lengths = model.encoder(x, x_lengths)
        logits = model.ctc.ctc_lo(encoded)
        query_loss = torch.nn.functional.cross_entropy(
            logits[:, :4].reshape(-1, logits.size(-1)),
            torch.tensor([e.tag_ids for e in batch]).reshape(-1),
        )
        ctc_loss = torch.nn.functional.ctc_loss(
            logits[:, 4:].log_softmax(-1).transpose(0, 1),
            torch.cat([torch.tensor(e.text_ids) for e in batch]),
            encoded_lengths - 4,
            torch.tensor([len(e.text_ids) for e in batch]),
            blank=0,
            zero_infinity=True,
        )
        loss = query_loss + ctc_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == TAGGED_STEPS - 1:
            logger.debug(
                "tagged step %d: query %.4f ctc %.4f", step, query_loss.item(), ctc_loss.item()
            )
    model.eval()

    checked = [
        example(text, lead_ms, tail_ms, itn, language)
        for text in texts
        for lead_ms, tail_ms in TAGGED_CHECKED_PADDINGS_MS
        for itn in ("woitn", "withitn")
        for language in ("auto", "en")
    ]
    with torch.inference_mode():
        for case in checked:
            speech_batch, lengths = _batch([case])
            x, x_lengths = prepend_queries(
                model, speech_batch, lengths, [case.language_row], [case.textnorm_row]
            )
            encoded, _ = model.encoder(x, x_lengths)
            ids = torch.unique_consecutive(model.ctc.ctc_lo(encoded)[0].argmax(-1))
            decoded = processor.decode([int(t) for t in ids if t != 0])
            if decoded != case.expected:
                raise ModelError(
                    f"tagged model training did not converge: {decoded!r} instead of "
                    f"{case.expected!r} (silence {case.margins_ms} ms)"
                )


@dataclass(frozen=True)
class _Example:
    feats: torch.Tensor  # (T, 560) features of one padded clip
    language_row: int  # query row of model.embed
    textnorm_row: int  # query row of model.embed
    tag_ids: list[int]  # targets of the 4 query frames
    text_ids: list[int]  # CTC target after the query frames
    expected: str  # what decoding must return
    margins_ms: tuple[int, int]  # silence before and after the speech


def _batch(examples: list[_Example]) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    feats = [e.feats for e in examples]
    lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.int32)
    return torch.nn.utils.rnn.pad_sequence(feats, batch_first=True), lengths


def _pad(pcm: np.ndarray, lead_ms: int, tail_ms: int) -> np.ndarray:
    from streamer.testkit.speech import SAMPLE_RATE

    lead = np.zeros(lead_ms * SAMPLE_RATE // 1000, np.int16)
    tail = np.zeros(tail_ms * SAMPLE_RATE // 1000, np.int16)
    return np.concatenate([lead, pcm, tail])


def _text_target(processor: Any, tag_ids: list[int], transcript: str) -> list[int]:
    """CTC target ids for the text after the tags, so decoding gives no space after them.

    Encoding the whole tagged transcript yields ``['▁', <tags>, 't', 'h', 'e', '▁quick',
    ...]``: the text's first word carries no word-boundary marker, as in the real model.
    """
    ids = processor.encode(transcript)
    skip = 1 + len(tag_ids)
    if processor.id_to_piece(ids[0]) != "▁" or ids[1:skip] != tag_ids:
        raise ModelError(f"unexpected tokenisation of {transcript!r}: {ids}")
    return ids[skip:]


def _split_tags(tags: str) -> list[str]:
    return [f"<|{name}|>" for name in tags.strip("<|>").split("|><|")]
