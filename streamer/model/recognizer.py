"""SenseVoiceSmall, loaded once and decoding one utterance at a time.

This module and :mod:`streamer.testkit.models` are the only ones that import torch and
funasr, and they do so inside functions, so importing the package stays fast.

:meth:`Recognizer.decode` runs the model directly (features, query frames, encoder, CTC
argmax) instead of going through ``AutoModel.generate()``, whose per-call bookkeeping
(deep-copying its configuration, building batches, emptying the CUDA cache) buys
nothing for one short utterance. It produces exactly the token ids of
``AutoModel.generate(..., batch_size=1)`` on the same weights and audio; the tests hold
it to that, and :meth:`Recognizer.decode_reference` runs ``generate()`` for comparison.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamer.core.transcript import Transcript
from streamer.errors import ConfigError, DecodeError, ModelError
from streamer.model.files import (
    _check_vocabulary,
    _hub_cache_dir,
    _looks_like_path,
    _model_files,
    _require_hub,
    default_cache_dir,
)
from streamer.model.sensevoice import (
    LANGUAGES,
    LID_ROWS,
    MIN_DECODE_SAMPLES,
    SAMPLE_RATE,
    TEXTNORM_ROWS,
    prepend_queries,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
WARMUP_SECONDS = (1.0, 3.0, 7.0)  # lengths decoded at start-up
MAX_DEFAULT_THREADS = 8  # beyond this, torch's intra-op threads stop paying on one decode

_EMO_UNKNOWN_ID = 25009  # what ban_emo_unk suppresses in inference()
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class RecognizerOptions:
    """How to load the model. Validated on construction (raises ConfigError)."""

    model: str = "iic/SenseVoiceSmall"  # hub id, local directory, or random:tiny|small|tagged
    hub: str = "ms"  # where a hub id comes from: "ms" (ModelScope) or "hf" (Hugging Face)
    device: str = "auto"  # "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:N"
    dtype: str = "fp32"  # weights and activations: "fp32"; "fp16" or "bf16" on CUDA only
    quantize: str | None = None  # "int8": dynamic int8 quantization of Linear layers (CPU)
    threads: int = 0  # torch intra-op threads; 0 = one per usable CPU core, at most 8
    warmup: bool = True  # decode 1, 3 and 7 s at start-up so no user pays first-call costs
    cache_dir: Path = field(default_factory=default_cache_dir)  # random models: cache_dir/models

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if not self.model:
            raise ConfigError("model must name a hub id, a directory or random:NAME")
        if self.model.startswith(RANDOM_PREFIX):
            from streamer.testkit.models import MODEL_NAMES

            name = self.model[len(RANDOM_PREFIX) :]
            if name not in MODEL_NAMES:
                raise ConfigError(
                    f"unknown random model {self.model!r}; choose random:"
                    + ", random:".join(MODEL_NAMES)
                )
        if self.hub not in ("ms", "hf"):
            raise ConfigError(f"hub must be 'ms' or 'hf', not {self.hub!r}")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ConfigError(f"dtype must be fp32, fp16 or bf16, not {self.dtype!r}")
        if self.dtype != "fp32" and self.device == "cpu":
            raise ConfigError(f"dtype {self.dtype} needs a CUDA device; use fp32 on the CPU")
        if self.quantize not in (None, "int8"):
            raise ConfigError(f"quantize must be int8 or unset, not {self.quantize!r}")
        if self.quantize == "int8" and self.device.startswith("cuda"):
            raise ConfigError("int8 quantization runs on the CPU only; use --device cpu")
        if self.quantize == "int8" and self.dtype != "fp32":
            raise ConfigError("int8 quantization starts from fp32 weights; drop the dtype")
        if self.threads < 0:
            raise ConfigError(f"threads must be 0 (automatic) or positive, not {self.threads}")


def default_threads() -> int:
    """One torch thread per CPU core this process may use, at most 8."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return max(1, min(usable, MAX_DEFAULT_THREADS))


class Recognizer:
    """SenseVoiceSmall loaded once; decodes one utterance per call.

    Construction blocks for seconds (hub look-up, loading, warm-up): call it off the
    event loop, in the thread that will decode. Not thread-safe: decode from one thread
    at a time. Start-up problems raise :class:`ModelError` (or :class:`ConfigError` for
    impossible options) with a message meant for the person starting the server.
    """

    def __init__(self, options: RecognizerOptions | None = None) -> None:
        self.options = options or RecognizerOptions()
        started = time.perf_counter()
        self._random = self.options.model.startswith(RANDOM_PREFIX)
        source = self._locate_model()
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
        self._frontend = kwargs["frontend"]
        self._tokenizer = kwargs["tokenizer"]
        self._ban_emo_unk = bool(kwargs.get("ban_emo_unk", False))
        self._dtype = next(self._model.parameters()).dtype
        model_path = kwargs.get("model_path")
        if not isinstance(source, Path) and model_path and Path(model_path).is_dir():
            _check_vocabulary(_model_files(Path(model_path)))  # downloaded just now
        if self.options.quantize == "int8":
            self._quantize_int8()
        logger.info(
            "loaded model %s on %s (%s%s, %d threads) in %.1f s",
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
    def name(self) -> str:
        """The model as the user named it (hub id, directory or random:NAME)."""
        return self.options.model

    @property
    def device(self) -> str:
        """Where the model runs: "cpu" or "cuda:N"."""
        return self._device

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    # --- decoding -----------------------------------------------------------------------

    def decode(
        self, pcm: np.ndarray | bytes, *, language: str = "auto", use_itn: bool = True
    ) -> Transcript:
        """Recognise one utterance of 16 kHz mono audio.

        ``pcm`` is an int16 array, s16le bytes, or a float32 array in [-1, 1]. Audio shorter
        than :data:`MIN_DECODE_SAMPLES` gives an empty transcript. Raises DecodeError when
        the model fails (the recognizer stays usable) and ConfigError for malformed audio or
        an unknown language.
        """
        waveform = _waveform(pcm)
        started = time.perf_counter()
        lid = _language_row(language)
        if waveform.size < MIN_DECODE_SAMPLES:
            return _empty_transcript(waveform.size)
        try:
            token_ids = self._run(waveform, lid, use_itn)
        except RuntimeError as error:  # CUDA out of memory, a backend failure, ...
            raise DecodeError(
                f"decoding {waveform.size / SAMPLE_RATE:.2f} s of audio failed: {error}"
            ) from error
        raw = self._tokenizer.decode(list(token_ids))
        return self._transcript(raw, token_ids, waveform.size, started)

    def _run(self, waveform: np.ndarray, lid: int, use_itn: bool) -> tuple[int, ...]:
        """Features, query frames, encoder, CTC argmax: the token ids, blanks removed."""
        torch = self._torch
        from funasr.utils.load_utils import extract_fbank

        with torch.inference_mode(), self._autocast():
            feats, lengths = extract_fbank([torch.from_numpy(waveform)], frontend=self._frontend)
            feats = feats.to(device=self._device)
            lengths = lengths.to(device=self._device)
            speech, speech_lengths = self._prepend_queries(feats, lengths, lid, use_itn)
            encoded, encoded_lengths = self._model.encoder(speech, speech_lengths)
            if isinstance(encoded, tuple):
                encoded = encoded[0]
            logits = self._model.ctc.ctc_lo(encoded)[0, : int(encoded_lengths[0])]
            if self._ban_emo_unk:
                logits[:, _EMO_UNKNOWN_ID] = -float("inf")
            best = self._argmax(logits)
            best = torch.unique_consecutive(best, dim=-1)
            return tuple(best[best != self._model.blank_id].tolist())

    def decode_reference(
        self, pcm: np.ndarray | bytes, language: str = "auto", use_itn: bool = True
    ) -> Transcript:
        """The same decode through ``AutoModel.generate(..., batch_size=1)`` (slower).

        For parity tests and the bench. int16 input goes in as s16le bytes (generate()
        mis-scales int16 arrays), float32 input as an array.
        """
        waveform = _waveform(pcm)
        started = time.perf_counter()
        _language_row(language)
        if waveform.size < MIN_DECODE_SAMPLES:
            return _empty_transcript(waveform.size)
        data: bytes | np.ndarray
        if isinstance(pcm, np.ndarray) and pcm.dtype.kind == "f":
            data = waveform
        else:
            data = _as_int16(pcm).tobytes()
        recorder = _RecordingTokenizer(self._tokenizer)
        with quiet_funasr(), self._autocast():
            results = self._automodel.generate(
                data, language=language, use_itn=use_itn, batch_size=1, tokenizer=recorder
            )
        raw = results[0]["text"]
        token_ids = tuple(int(t) for t in recorder.decoded[-1]) if recorder.decoded else ()
        return self._transcript(raw, token_ids, waveform.size, started)

    def warmup(self) -> None:
        """Decode a few lengths of low noise so first users pay no first-call costs."""
        started = time.perf_counter()
        rng = np.random.default_rng(0)
        for seconds in WARMUP_SECONDS:
            noise = rng.normal(0.0, 30.0, int(seconds * SAMPLE_RATE)).astype(np.int16)
            self.decode(noise)
        logger.info("warm-up took %.1f s", time.perf_counter() - started)

    # --- internals ----------------------------------------------------------------------

    def _prepend_queries(
        self, feats: torch.Tensor, lengths: torch.Tensor, lid: int, use_itn: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As SenseVoiceSmall.inference(): [language, 1, 2, textnorm] + features. New
        # tensors each call: the encoder scales its input in place.
        textnorm = TEXTNORM_ROWS["withitn" if use_itn else "woitn"]
        return prepend_queries(self._model, feats, lengths, [lid], [textnorm])

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Half precision: weights are fp16/bf16, and autocast keeps every op consistent.

        Without it the encoder fails on mixed types (its positional encoding and the
        features are fp32); with it generate() runs half-precision models too.
        """
        if self._dtype == self._torch.float32:
            return contextlib.nullcontext()
        return self._torch.autocast(device_type="cuda", dtype=self._dtype)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-frame argmax of the logits, equal to inference()'s argmax of log_softmax.

        log_softmax subtracts one constant per frame, which preserves the order except
        where two logits are so close that rounding makes them equal; those frames (about
        one in a million) are recomputed through log_softmax.
        """
        torch = self._torch
        top = torch.topk(logits, 2, dim=-1)
        best = top.indices[:, 0]
        values = top.values.float()
        tolerance = 1e-4 * values[:, 0].abs().clamp_min(1.0)
        close = (values[:, 0] - values[:, 1]) <= tolerance
        if bool(close.any()):
            rows = close.nonzero().squeeze(-1)
            exact = torch.nn.functional.log_softmax(logits[rows], dim=-1).argmax(dim=-1)
            best = best.clone()
            best[rows] = exact
        return best

    def _transcript(
        self, raw: str, token_ids: tuple[int, ...], samples: int, started: float
    ) -> Transcript:
        from funasr.utils.postprocess_utils import rich_transcription_postprocess

        return Transcript.from_raw(
            raw,
            rich=rich_transcription_postprocess(raw) if raw else "",
            token_ids=token_ids,
            audio_ms=samples * 1000 / SAMPLE_RATE,
            decode_ms=(time.perf_counter() - started) * 1000,
        )

    def _locate_model(self) -> Path | str:
        """A checked local directory, or the hub id funasr should download."""
        model = self.options.model
        if self._random:
            from streamer.testkit.models import ensure_random_model

            name = model[len(RANDOM_PREFIX) :]
            directory = ensure_random_model(name, self.options.cache_dir)
            logger.warning(
                "MODEL %s HAS RANDOM WEIGHTS: every transcript it produces is meaningless. "
                "Use it for tests and timing only.",
                model,
            )
        else:
            path = Path(model).expanduser()
            if path.exists() or _looks_like_path(model):
                directory = path
            else:
                cached = _hub_cache_dir(model, self.options.hub)
                if cached is None:
                    _require_hub(model, self.options.hub)
                    return model
                directory = cached
        files = _model_files(directory)
        _check_vocabulary(files)
        if not self._random:
            from streamer.testkit.models import read_build_info

            if read_build_info(directory) is not None:
                logger.warning(
                    "model directory %s was built with random weights: its transcripts "
                    "are meaningless",
                    directory,
                )
        return directory

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


# --- audio --------------------------------------------------------------------------------


def _as_int16(pcm: np.ndarray | bytes) -> np.ndarray:
    if isinstance(pcm, bytes | bytearray | memoryview):
        data = bytes(pcm)
        if len(data) % 2:
            raise ConfigError("s16le audio must have an even number of bytes")
        return np.frombuffer(data, dtype="<i2")
    array = np.asarray(pcm)
    if array.ndim != 1:
        raise ConfigError(f"audio must be mono (one dimension), not shape {array.shape}")
    if array.dtype == np.int16:
        return array
    # float arrays never get here: both decode paths use them as they are
    raise ConfigError(f"audio must be int16, float32 or s16le bytes, not {array.dtype}")


def _waveform(pcm: np.ndarray | bytes) -> np.ndarray:
    """float32 samples scaled exactly as funasr's load_bytes() scales s16le input."""
    if isinstance(pcm, np.ndarray) and pcm.dtype.kind == "f":
        if pcm.ndim != 1:
            raise ConfigError(f"audio must be mono (one dimension), not shape {pcm.shape}")
        return np.ascontiguousarray(pcm, dtype=np.float32)
    samples = _as_int16(pcm)
    return (samples.astype(np.float32) - 0) / 32768


def _language_row(language: str) -> int:
    try:
        return LID_ROWS[language]
    except KeyError:
        raise ConfigError(
            f"unknown language {language!r}; choose one of {', '.join(LANGUAGES)}"
        ) from None


def _empty_transcript(samples: int) -> Transcript:
    return Transcript.from_raw(
        "", rich="", token_ids=(), audio_ms=samples * 1000 / SAMPLE_RATE, decode_ms=0.0
    )


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


def import_funasr() -> Any:
    """``import funasr`` without letting it configure logging (it calls basicConfig)."""
    with quiet_funasr():
        import funasr

    return funasr


class _FunasrLogFilter(logging.Filter):
    """Demotes records funasr logs straight on the root logger to DEBUG on ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        logger.debug("funasr: %s", record.getMessage())
        return False


@contextlib.contextmanager
def quiet_funasr() -> Iterator[None]:
    """Keep funasr from configuring logging or printing while it loads.

    AutoModel calls ``logging.basicConfig`` (and root-logger helpers that call it when
    the root has no handler), logs chatter on the root logger and prints to stdout.
    Only our CLI configures logging.
    """
    root = logging.getLogger()
    log_filter = _FunasrLogFilter()
    captured = io.StringIO()
    original = logging.basicConfig
    logging.basicConfig = _no_basic_config
    root.addFilter(log_filter)
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        logging.basicConfig = original
        root.removeFilter(log_filter)
        for line in captured.getvalue().splitlines():
            if line.strip():
                logger.debug("funasr printed: %s", line)


def _no_basic_config(*args: Any, **kwargs: Any) -> None:
    return None
