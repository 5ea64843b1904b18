"""What every ``streamer`` command shares: environment defaults, logging, the model flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from streamer.core.hotwords import Hotwords
from streamer.core.hotwords import parse_file as parse_hotwords_file
from streamer.core.vad import FrameClassifier
from streamer.errors import ConfigError, InvalidHotwords

logger = logging.getLogger(__name__)

ENV_PREFIX = "STREAMER_"
# an empty value of these is refused, not taken as unset: an empty STREAMER_TOKEN (an
# unset shell variable in `docker run -e STREAMER_TOKEN="$TOKEN"`, a missing optional
# Secret) must not serve every client unauthenticated
NOT_EMPTY = frozenset({"token"})
VADS = ("webrtc", "silero")  # --vad choices, the first the default
VAD_MODES = (0, 1, 2, 3)  # --vad-aggressiveness choices: webrtcvad's modes


def _env(
    name: str,
    default: Any,
    kind: Callable[[str], Any] = str,
    choices: Sequence[Any] | None = None,
) -> Any:
    """The default of a flag: ``STREAMER_<NAME>`` when set, else ``default``. A value
    that ``kind`` refuses, or outside ``choices``, ends the program with status 2, as
    argparse does for a bad flag."""
    variable = ENV_PREFIX + name.upper().replace("-", "_")
    value = os.environ.get(variable)
    if value == "" and name in NOT_EMPTY:
        sys.stderr.write(
            f"streamer: error: {variable} is set but empty; set it to the token, or unset "
            "it to serve without authentication\n"
        )
        raise SystemExit(2)
    if value is None or value == "":
        return default
    try:
        parsed = kind(value)
        if choices is not None and parsed not in choices:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(map(str, choices))}")
    except (ValueError, argparse.ArgumentTypeError) as error:
        why = f" ({error})" if isinstance(error, argparse.ArgumentTypeError) else ""
        sys.stderr.write(f"streamer: error: {variable}={value!r} is not valid{why}\n")
        raise SystemExit(2) from None
    return parsed


def _within(
    kind: Callable[[str], Any], low: float, high: float = sys.float_info.max
) -> Callable[[str], Any]:
    """``kind`` (int or float) of ``low``..``high``: NaN, infinities and values out of
    range are refused (argparse and :func:`_env` say so) instead of starting a server
    that fails its sessions."""

    def parse(value: str) -> Any:
        number = kind(value)  # ValueError: argparse and _env report it
        if not low <= number <= high:  # NaN compares false
            bound = f"{low:g}..{high:g}" if high < sys.float_info.max else f"{low:g} or more"
            raise argparse.ArgumentTypeError(f"{value!r} must be {bound}")
        return number

    parse.__name__ = kind.__name__
    return parse


def env_name(flag: str) -> str:
    """``--max-sessions`` -> ``STREAMER_MAX_SESSIONS``."""
    return "STREAMER_" + flag.lstrip("-").upper().replace("-", "_")


def _with_variable(help_text: str | None, variable: str) -> str | None:
    """``help_text`` naming ``variable``, so that ``--help`` lists every one: inside its
    closing ``[...]`` (``[%(default)s]`` -> ``[STREAMER_X, %(default)s]``) or appended."""
    if help_text is None or help_text == argparse.SUPPRESS or variable in help_text:
        return help_text
    if help_text.endswith("]") and "[" in help_text:
        at = help_text.rindex("[") + 1
        return f"{help_text[:at]}{variable}, {help_text[at:]}"
    return f"{help_text} [{variable}]"


def _flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    default: Any,
    kind: Callable[[str], Any] = str,
    **kwargs: Any,
) -> None:
    """Add ``flag`` (``--max-sessions``): its default is ``STREAMER_MAX_SESSIONS`` when
    that is set, else ``default``. ``kind`` parses the variable and, unless ``kwargs``
    name an ``action`` (``store_true``), the flag's value too."""
    if kind is not str and "action" not in kwargs:
        kwargs["type"] = kind
    kwargs["help"] = _with_variable(kwargs.get("help"), env_name(flag))
    default = _env(flag.lstrip("-"), default, kind, kwargs.get("choices"))
    parser.add_argument(flag, default=default, **kwargs)


def _max_batch(value: str) -> int | None:
    """``auto`` (None: the worker decides from the model) or a positive count."""
    if value == "auto":
        return None
    count = int(value)  # ValueError: argparse and _env report it
    if count < 1:
        raise ValueError(value)
    return count


def _positive_or_auto(value: str) -> float | None:
    """``auto`` (None: the worker decides from the device) or a positive number."""
    if value == "auto":
        return None
    number = float(value)  # ValueError: argparse and _env report it
    if not number > 0:
        raise ValueError(value)
    return number


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            # ISO 8601 in UTC with milliseconds: log pipelines order and join on it
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        session_id = getattr(record, "session_id", None)
        if session_id is not None:
            entry["session_id"] = session_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # third-party chatter stays at WARNING unless debugging
    quiet = logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING
    for name in ("websockets", "funasr", "modelscope", "jieba", "urllib3"):
        logging.getLogger(name).setLevel(max(quiet, logging.getLogger(name).level))


# -- shared flag groups --------------------------------------------------------


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    from streamer.model.options import RecognizerOptions

    recognizer = RecognizerOptions()  # the flags' defaults are its fields'
    g = parser.add_argument_group("model")
    _flag(
        g,
        "--model",
        recognizer.model,
        help="hub id, local model directory, random:tiny / random:small (random "
        "weights, meaningless text; for tests and timing) / random:tagged (a test model "
        "trained on two clips), or auto: sherpa-onnx's int8 export from Hugging Face on "
        "ONNX Runtime (the CPU), iic/SenseVoiceSmall on torch "
        "[STREAMER_MODEL, default %(default)s]",
    )
    _flag(
        g,
        "--backend",
        recognizer.backend,
        choices=("auto", "torch", "onnx"),
        help="what runs the model: torch (funasr) or onnx (ONNX Runtime; a torch model "
        "is exported once and cached); auto = onnx on the CPU, torch on CUDA "
        "[STREAMER_BACKEND, %(default)s]",
    )
    _flag(
        g,
        "--hub",
        recognizer.hub,
        choices=("ms", "hf"),
        help="model hub for ids: ModelScope or Hugging Face [%(default)s]",
    )
    _flag(
        g,
        "--device",
        recognizer.device,
        help="auto, cpu, cuda or cuda:N; serve also takes a list (cuda:0,cuda:1) or "
        "cuda:all: one worker and model copy per device [%(default)s]",
    )
    _flag(
        g,
        "--dtype",
        recognizer.dtype,
        choices=("fp32", "fp16", "bf16"),
        help="weights precision; fp16/bf16 need CUDA [%(default)s]",
    )
    _flag(
        g,
        "--quantize",
        recognizer.quantize or "none",
        choices=("none", "int8"),
        help="int8 weights (CPU only; torch: dynamic Linear, onnx: model.int8.onnx) [%(default)s]",
    )
    _flag(
        g,
        "--threads",
        recognizer.threads,
        _within(int, 0),
        help="intra-op CPU threads (torch or ONNX Runtime); 0 = all cores; with several "
        "workers this is the total, shared out evenly between them [%(default)s]",
    )
    _flag(
        g,
        "--hotword-beam",
        recognizer.hotword_beam,
        _within(int, 1, 64),
        help="prefixes the CTC beam search keeps per frame when a session has hotwords, "
        "on finals (without hotwords decoding is greedy) [%(default)s]",
    )
    _flag(
        g,
        "--hotword-partial-beam",
        recognizer.hotword_partial_beam,
        _within(int, 1, 64),
        help="the same on partials (at most --hotword-beam) [%(default)s]",
    )
    _flag(
        g,
        "--hotwords-max-tokens",
        recognizer.hotwords_max_tokens,
        _within(int, 1, 256),
        help="a hotword phrase's most tokens; longer ones are not used and the session "
        "is told [%(default)s]",
    )
    _flag(
        g,
        "--no-warmup",
        not recognizer.warmup,
        _bool,
        action="store_true",
        help="skip warm-up decodes at start-up",
    )
    _flag(
        g,
        "--cache-dir",
        None,
        Path,
        help="where random models and ONNX exports are cached "
        "[STREAMER_CACHE_DIR, ~/.cache/sensevoice-streamer]",
    )


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    _flag(
        parser,
        "--log-level",
        "info",
        choices=("debug", "info", "warning", "error"),
        help="[STREAMER_LOG_LEVEL, %(default)s]",
    )
    _flag(
        parser,
        "--log-format",
        "text",
        choices=("text", "json"),
        help="[STREAMER_LOG_FORMAT, %(default)s]",
    )


def read_hotwords(path: Path | None) -> Hotwords:
    """``--hotwords FILE``: one ``phrase`` or ``phrase:boost`` a line (ConfigError if
    unreadable or malformed; the message names the line, never its phrase)."""
    if path is None:
        return ()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--hotwords {path} cannot be read: {error}") from None
    try:
        return parse_hotwords_file(text, name=str(path))
    except InvalidHotwords as error:
        raise ConfigError(f"--hotwords: {error.message}") from None


def random_models_for(model: str) -> Any:
    """What builds ``random:NAME`` (the test kit, imported only for such a model), else None."""
    from streamer.model.artifacts.files import RANDOM_PREFIX

    if not model.startswith(RANDOM_PREFIX):
        return None
    from streamer.testkit.models import RANDOM_MODELS

    return RANDOM_MODELS


def _recognizer_options(args: argparse.Namespace) -> Any:
    from streamer.model.options import RecognizerOptions

    kwargs: dict[str, Any] = dict(
        model=args.model,
        backend=args.backend,
        hub=args.hub,
        device=args.device,
        dtype=args.dtype,
        quantize=None if args.quantize == "none" else args.quantize,
        threads=args.threads,
        warmup=not args.no_warmup,
        hotword_beam=args.hotword_beam,
        hotword_partial_beam=args.hotword_partial_beam,
        hotwords_max_tokens=args.hotwords_max_tokens,
        random_models=random_models_for(args.model),
    )
    if args.cache_dir is not None:
        try:  # found now, not as a traceback from deep inside the model's loading
            args.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"--cache-dir {args.cache_dir} cannot be used: {error.strerror or error}"
            ) from None
        kwargs["cache_dir"] = args.cache_dir
    from streamer.model.backends.loading import resolve_model

    return resolve_model(RecognizerOptions(**kwargs))


# -- serve -----------------------------------------------------------------------


def _classifier_factory(vad: str) -> Callable[[], FrameClassifier] | None:
    """The per-session VAD for ``--vad``; None is the server's own default (webrtcvad at
    ``--vad-aggressiveness``). Loads Silero's graph once, here, so that a missing
    package fails at start."""
    if vad == "webrtc":
        return None
    if vad == "silero":
        from streamer.model.backends.silero import silero_classifier_factory

        return silero_classifier_factory()
    raise ConfigError(f"unknown VAD {vad!r}: choose one of {', '.join(VADS)}")
