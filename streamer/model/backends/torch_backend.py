"""SenseVoiceSmall on torch/funasr: the torch backend (beside :mod:`onnx_backend`).

:func:`streamer.model.backends.loading.load_recognizer` builds the backend
:attr:`RecognizerOptions.backend` names (:mod:`streamer.model.options`): :class:`Recognizer`
here (torch and funasr) or :class:`streamer.model.backends.onnx_backend.OnnxRecognizer` (ONNX
Runtime). Both decode through :class:`streamer.model.decode.decoding.CtcRecognizer`, so greedy CTC,
tokens, tags and token times are computed by the same code whichever runs the network.

:class:`Recognizer` runs the model directly (features, query frames, encoder, CTC logits)
instead of going through ``AutoModel.generate()``, whose per-call bookkeeping
(deep-copying its configuration, building batches, emptying the CUDA cache) buys
nothing for one short utterance. It produces exactly the token ids of
``AutoModel.generate(..., batch_size=1)`` on the same weights and audio; the tests hold
it to that, and :meth:`Recognizer.decode_reference` runs ``generate()`` for comparison.

torch and funasr are imported inside functions only, so importing this module is fast.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from streamer.core.transcript import Transcript
from streamer.errors import ConfigError, ModelError
from streamer.model.artifacts.files import (
    check_vocabulary,
    locate_model,
    model_files,
)
from streamer.model.artifacts.published import AUTO_MODEL, DEFAULT_TORCH_MODEL
from streamer.model.backends.funasr_quiet import import_funasr, quiet_funasr
from streamer.model.decode.decoding import (
    CtcRecognizer,
    Utterance,
    as_int16,
    as_waveform,
    empty_transcript,
    language_row,
    padded_features,
)
from streamer.model.decode.frontend import Cmvn, Frontend
from streamer.model.decode.tokenizer import SentencePieceTokenizer
from streamer.model.options import RecognizerOptions, default_threads
from streamer.model.sensevoice import (
    EMO_UNKNOWN_ID,
    FRONTEND_CONF,
    LFR_M,
    MIN_DECODE_SAMPLES,
    N_MELS,
    SAMPLE_RATE,
    prepend_queries,
)

logger = logging.getLogger(__name__)

__all__ = ["Recognizer"]


class Recognizer(CtcRecognizer):
    """SenseVoiceSmall on torch and funasr, loaded once; see :class:`CtcRecognizer`.

    This is the torch backend whatever ``options.backend`` says ("onnx" is refused):
    :func:`load_recognizer` picks the backend. Construction blocks for seconds (hub
    look-up, loading, warm-up): call it off the event loop, in the thread that will
    decode. Not thread-safe: decode from one thread at a time. Start-up problems raise
    :class:`ModelError` (or :class:`ConfigError` for impossible options) with a message
    meant for the person starting the server.
    """

    def __init__(self, options: RecognizerOptions | None = None) -> None:
        self.options = options or RecognizerOptions()
        if self.options.model == AUTO_MODEL:  # torch's default (loading.resolve_model)
            self.options = replace(self.options, model=DEFAULT_TORCH_MODEL)
        if self.options.backend == "onnx":
            raise ConfigError("Recognizer is the torch backend; load_recognizer() picks ONNX")
        started = time.perf_counter()
        source = locate_model(
            self.options.model,
            self.options.hub,
            self.options.cache_dir,
            self.options.random_models,
        )
        _check_fbank_backend()

        import torch

        self._torch = torch
        self._device = _resolve_device(self.options.device, torch)
        if self.options.dtype != "fp32" and not self._device.startswith("cuda"):
            raise ConfigError(f"dtype {self.options.dtype} needs CUDA, and none is available")
        self._threads = self.options.threads or default_threads()
        self._automodel = self._load(source)
        kwargs = self._automodel.kwargs
        self._model = self._automodel.model
        self._funasr_frontend = kwargs["frontend"]
        self.frontend = _same_frontend(self._funasr_frontend)
        self._funasr_tokenizer = kwargs["tokenizer"]
        self.tokenizer: _FunasrTokenizer = _FunasrTokenizer(self._funasr_tokenizer)
        if kwargs.get("ban_emo_unk", False):
            self.banned_ids = (EMO_UNKNOWN_ID,)
        self._dtype = next(self._model.parameters()).dtype
        model_path = kwargs.get("model_path")
        self.model_dir = Path(model_path) if model_path else None  # where funasr read it
        if not isinstance(source, Path) and self.model_dir and self.model_dir.is_dir():
            check_vocabulary(model_files(self.model_dir))  # downloaded just now
        if self.options.quantize == "int8":
            self._quantize_int8()
        logger.info(
            "loaded model %s on %s with torch (%s%s, %d threads) in %.1f s",
            self.name,
            self._device,
            self.options.dtype,
            ", int8" if self.options.quantize else "",
            self._threads,
            time.perf_counter() - started,
        )
        if self.options.warmup:
            self.warmup()

    # --- properties ---------------------------------------------------------------------

    @property
    def backend(self) -> str:
        return "torch"

    @property
    def tokenizer_file(self) -> Path | None:
        """The sentencepiece model funasr decodes with (None for other tokenizers)."""
        return self.tokenizer.sentencepiece_file

    # --- decoding -----------------------------------------------------------------------

    def _logits(self, batch: Sequence[Utterance]) -> list[np.ndarray]:
        """Features, query frames, encoder, CTC head: one (frames, vocab) array each."""
        torch = self._torch
        from funasr.utils.load_utils import extract_fbank

        with torch.inference_mode(), self._autocast():
            if self.frontend is not None:  # funasr's features, bit for bit (_same_frontend)
                padded, frames = padded_features(self.frontend, batch)
                feats = torch.from_numpy(padded)
                lengths = torch.tensor(frames, dtype=torch.int32)
            else:
                waveforms = [torch.from_numpy(u.waveform) for u in batch]
                feats, lengths = extract_fbank(waveforms, frontend=self._funasr_frontend)
            feats = feats.to(device=self._device)
            lengths = lengths.to(device=self._device).reshape(-1)
            # As SenseVoiceSmall.inference(): [language, 1, 2, textnorm] + features, in new
            # tensors each call (the encoder scales its input in place).
            speech, speech_lengths = prepend_queries(
                self._model,
                feats,
                lengths,
                [u.language_row for u in batch],
                [u.textnorm_row for u in batch],
            )
            encoded, encoded_lengths = self._model.encoder(speech, speech_lengths)
            if isinstance(encoded, tuple):
                encoded = encoded[0]
            logits = self._model.ctc.ctc_lo(encoded).float().cpu().numpy()
            frames = encoded_lengths.reshape(-1).tolist()
        return [logits[i, : int(frames[i])] for i in range(len(batch))]

    def decode_reference(
        self, pcm: np.ndarray | bytes, language: str = "auto", use_itn: bool = True
    ) -> Transcript:
        """The same decode through ``AutoModel.generate(..., batch_size=1)`` (slower).

        For parity tests and the bench. int16 input goes in as s16le bytes (generate()
        mis-scales int16 arrays), float32 input as an array. ``rich`` is funasr's own
        rich_transcription_postprocess.
        """
        from funasr.utils.postprocess_utils import rich_transcription_postprocess

        waveform = as_waveform(pcm)
        started = time.perf_counter()
        language_row(language)
        if waveform.size < MIN_DECODE_SAMPLES:
            return empty_transcript(waveform.size)
        data: bytes | np.ndarray
        if isinstance(pcm, np.ndarray) and pcm.dtype.kind == "f":
            data = waveform
        else:
            data = as_int16(pcm).tobytes()
        recorder = _RecordingTokenizer(self._funasr_tokenizer)
        with quiet_funasr(), self._autocast():
            results = self._automodel.generate(
                data, language=language, use_itn=use_itn, batch_size=1, tokenizer=recorder
            )
        raw = results[0]["text"]
        token_ids = tuple(int(t) for t in recorder.decoded[-1]) if recorder.decoded else ()
        return Transcript.from_raw(
            raw,
            rich=rich_transcription_postprocess(raw) if raw else "",
            token_ids=token_ids,
            audio_ms=waveform.size * 1000 / SAMPLE_RATE,
            decode_ms=(time.perf_counter() - started) * 1000,
        )

    # --- internals ----------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Half precision: weights are fp16/bf16, and autocast keeps every op consistent.

        Without it the encoder fails on mixed types (its positional encoding and the
        features are fp32); with it generate() runs half-precision models too.
        """
        if self._dtype == self._torch.float32:
            return contextlib.nullcontext()
        return self._torch.autocast(device_type="cuda", dtype=self._dtype)

    def _load(self, source: Path | str) -> Any:
        from funasr import AutoModel

        kwargs: dict[str, Any] = {
            "model": str(source),
            "hub": self.options.hub,
            "device": self._device,
            "disable_update": True,
            "disable_pbar": True,
            "disable_log": True,
            "ncpu": self._threads,
            "log_level": "ERROR",
            "frontend_conf": {"dither": 0.0},
        }
        if self.options.dtype == "fp16":
            kwargs["fp16"] = True
        elif self.options.dtype == "bf16":
            kwargs["bf16"] = True
        try:
            with quiet_funasr():
                automodel = AutoModel(**kwargs)
        except ModelError:
            raise
        except Exception as error:
            raise ModelError(
                f"funasr could not load model {self.options.model!r} ({source}): "
                f"{type(error).__name__}: {error}. Check that the directory is a complete "
                "SenseVoiceSmall download, or delete it and download it again."
            ) from error
        if getattr(automodel, "model", None) is None or "frontend" not in automodel.kwargs:
            raise ModelError(
                f"funasr built no model from {source}; it is not a SenseVoiceSmall directory"
            )
        return automodel

    def _quantize_int8(self) -> None:
        torch = self._torch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.ao.quantization.quantize_dynamic(
                self._model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
            )


class _FunasrTokenizer:
    """funasr's SentencepiecesTokenizer as a :class:`~streamer.model.decode.decoding.Tokenizer`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._encoder: SentencePieceTokenizer | None = None

    @property
    def size(self) -> int:
        return int(self._tokenizer.get_vocab_size())

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids)))

    def pieces(self) -> list[str]:
        if self.sentencepiece_file is None:
            raise ModelError("this model's tokenizer is not sentencepiece; it has no piece list")
        return SentencePieceTokenizer(self.sentencepiece_file).pieces()

    def encode(self, text: str) -> list[int]:
        """``text``'s ids by the model's sentencepiece file (what funasr encodes with)."""
        if self._encoder is None:
            if self.sentencepiece_file is None:
                raise ModelError("this model's tokenizer is not sentencepiece; it cannot encode")
            self._encoder = SentencePieceTokenizer(self.sentencepiece_file)
        return self._encoder.encode(text)

    @property
    def sentencepiece_file(self) -> Path | None:
        path = getattr(self._tokenizer, "bpemodel", None)
        return Path(path) if path else None


class _RecordingTokenizer:
    """Delegates to funasr's tokenizer and remembers the ids each decode() received."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.decoded: list[list[int]] = []

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        self.decoded.append(list(token_ids))
        return self._tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> _RecordingTokenizer:
        return self  # generate() may deep-copy its kwargs; keep recording into this one


# --- start-up checks ----------------------------------------------------------------------


def _resolve_device(requested: str, torch: Any) -> str:
    if requested == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {requested} requested but torch sees no CUDA device "
                f"(torch {torch.__version__}); use --device cpu or auto"
            )
        index = int(requested.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {requested} does not exist: torch sees "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
        return f"cuda:{index}"
    return "cpu"


def _check_fbank_backend() -> None:
    try:
        import_funasr()
        from funasr.utils import fbank
    except ImportError as error:
        raise ModelError(
            f"funasr cannot be imported ({error}); install the project's dependencies "
            "(pip install sensevoice-streamer)"
        ) from error
    if not getattr(fbank, "_HAS_TORCHAUDIO", False) and getattr(fbank, "_knf", None) is None:
        raise ModelError(
            "No fbank backend: funasr computes features with kaldi-native-fbank or "
            "torchaudio and neither imports here, so the first decode would fail. Install "
            "kaldi-native-fbank (pip install kaldi-native-fbank) or a torchaudio build that "
            "matches your torch."
        )


def _same_frontend(frontend: Any) -> Frontend | None:
    """This project's :class:`Frontend` where it computes exactly what funasr's
    ``WavFrontend`` ``frontend`` computes (funasr on kaldi-native-fbank, SenseVoice's
    settings; tests/test_decoding.py compares them), so the feature cache can serve the
    torch backend; None where it would not (torchaudio's fbank differs by up to 1e-4,
    another frontend class or other settings): funasr then computes the features."""
    from funasr.utils import fbank as funasr_fbank

    if getattr(funasr_fbank, "_HAS_TORCHAUDIO", True) or type(frontend).__name__ != "WavFrontend":
        return None
    settings = {**FRONTEND_CONF, "dither": 0.0, "snip_edges": True, "upsacle_samples": True}
    if any(getattr(frontend, name, None) != value for name, value in settings.items()):
        return None
    cmvn = getattr(frontend, "cmvn", None)
    if cmvn is None or tuple(cmvn.shape) != (2, N_MELS * LFR_M):
        return None
    rows = cmvn.detach().cpu().numpy().astype(np.float32)
    return Frontend(Cmvn(shift=rows[0].copy(), scale=rows[1].copy()))
