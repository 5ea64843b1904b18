"""The other commands: ``transcribe``, ``build-model``, ``export-onnx``, ``client``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import orjson

from streamer.cli.common import (
    VAD_MODES,
    VADS,
    _add_logging_arguments,
    _add_model_arguments,
    _classifier_factory,
    _flag,
    _recognizer_options,
    random_models_for,
)
from streamer.core.protocol import LANGUAGES, Final, StreamOptions
from streamer.core.vad import DEFAULT_AGGRESSIVENESS
from streamer.errors import ConfigError, StreamerError

logger = logging.getLogger(__name__)


def _add_transcribe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "transcribe",
        help="transcribe audio files offline",
        description="Decode audio files (any common format, resampled to "
        "16 kHz mono), cut into utterances by the same VAD the "
        "server uses.",
    )
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--language", choices=LANGUAGES, default=StreamOptions().language)
    p.add_argument("--no-itn", action="store_true", help="no inverse text normalisation")
    p.add_argument(
        "--json", action="store_true", help="JSON lines (one per utterance, with tags and times)"
    )
    p.add_argument("--vad", choices=VADS, default=VADS[0], help="as for serve [%(default)s]")
    p.add_argument(
        "--vad-aggressiveness", type=int, choices=VAD_MODES, default=DEFAULT_AGGRESSIVENESS
    )
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the transcript to FILE: subtitles (.srt, .vtt), OpenAI's verbose_json "
        "(.json: segments and words with times), or text (.txt); one input file only",
    )
    p.add_argument(
        "--hotwords",
        default=None,
        metavar="PHRASES|FILE",
        help="phrases to favour: 'Kubernetes,Anthropic:3' or a file of one a line",
    )
    p.add_argument(
        "--diarize-model",
        default=None,
        metavar="DIR|auto",
        help="label speakers with these speaker models (as serve's; docs/diarization.md): "
        "'A: text' per speaker's turn, or speaker fields with --json",
    )
    _add_model_arguments(p)
    _add_logging_arguments(p)
    # None: warnings, plus the loading stages (a model takes seconds to a minute to load);
    # an explicit --log-level (or STREAMER_LOG_LEVEL) is obeyed as given
    p.set_defaults(func=_cmd_transcribe, log_level=None)


_OUTPUT_FORMATS = {".srt": "srt", ".vtt": "vtt", ".json": "json", ".txt": "txt"}


def _output_format(args: argparse.Namespace) -> str | None:
    """``--output``'s format from its extension; ConfigError when it cannot be written."""
    if args.output is None:
        return None
    if len(args.files) != 1:
        raise ConfigError("--output takes one input file (run once per file)")
    fmt = _OUTPUT_FORMATS.get(args.output.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"--output {args.output}: the extension says the format: {', '.join(_OUTPUT_FORMATS)}"
        )
    return fmt


def _write_output(
    path: Path, fmt: str, finals: list[Final], duration_s: float, language: str
) -> None:
    from streamer.client.captions import render
    from streamer.core.compat.transcripts import transcription_verbose_json

    if fmt == "json":
        body = transcription_verbose_json(
            finals, duration_s=duration_s, granularities=("segment", "word"), language=language
        )
        text = orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n"
    else:
        text = render(((final, 0.0) for final in finals), fmt)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot write {path}: {error.strerror or error}") from None


def _cmd_transcribe(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from streamer.audio_io import load_audio
    from streamer.client.cli import read_hotwords_argument
    from streamer.core.protocol import message_dict
    from streamer.core.session_speakers import speaker_parts
    from streamer.core.session_state import SessionOptions
    from streamer.model.backends.loading import LoadProgress, load_recognizer, preflight
    from streamer.offline import transcribe_pcm

    output_format = _output_format(args)
    words = read_hotwords_argument(args.hotwords) if args.hotwords else ()
    options = _recognizer_options(args)
    preflight(options)
    classifier_factory = _classifier_factory(args.vad)
    # by default, say what is happening while the model loads; else obey --log-level
    stages = logging.INFO if args.log_level is None else logging.NOTSET
    logging.getLogger("streamer.model.backends.loading").setLevel(stages)
    recognizer = load_recognizer(options, LoadProgress())
    session_options = replace(SessionOptions(model_name=recognizer.name), hotwords=words)
    speakers = _speaker_models(args)
    out = sys.stdout
    status = 0
    for path in args.files:
        try:
            pcm = load_audio(path)
        except StreamerError as error:
            logger.error("%s: %s", path, error)
            status = 2
            continue
        texts: list[str] = []
        finals: list[Final] = []
        for final in transcribe_pcm(
            recognizer,
            pcm,
            language=args.language,
            itn=not args.no_itn,
            session_options=session_options,
            vad_aggressiveness=args.vad_aggressiveness,
            classifier=None if classifier_factory is None else classifier_factory(),
            speakers=speakers,
        ):
            finals.append(final)
            if args.json:
                record = {"file": str(path), **message_dict(final)}
                out.write(orjson.dumps(record).decode() + "\n")
            elif final.text and speakers is not None:  # a line per speaker's turn
                texts.extend(f"{p.speaker or '?'}: {p.text}" for p in speaker_parts(final))
            elif final.text:
                texts.append(final.text)
        if not args.json:
            prefix = f"{path}: " if len(args.files) > 1 else ""
            out.write(prefix + ("\n" if speakers is not None else " ").join(texts) + "\n")
        out.flush()
        if output_format is not None:
            duration_s = pcm.size / 16000
            _write_output(args.output, output_format, finals, duration_s, args.language)
            sys.stderr.write(f"wrote {args.output} ({output_format})\n")
    return status


def _speaker_models(args: argparse.Namespace) -> Any:
    """transcribe --diarize-model: the speaker models, loaded here (None without it)."""
    if not args.diarize_model:
        return None
    from streamer.cli.diarizer import diarizer_files
    from streamer.model.speakers.models import SpeakerModels

    return SpeakerModels(diarizer_files(args))


# -- build-model -----------------------------------------------------------------


def _add_build_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-model",
        help="build a random-weight SenseVoiceSmall model",
        description="Write a complete model directory with random weights "
        "(tiny, small = real size, tagged = tiny trained to emit "
        "known tags) for tests and timing without downloads.",
    )
    p.add_argument("name", choices=("tiny", "small", "tagged"))
    _flag(p, "--cache-dir", None, Path)
    _add_logging_arguments(p)
    p.set_defaults(func=_cmd_build_model)


def _cmd_build_model(args: argparse.Namespace) -> int:
    from streamer.model.options import RecognizerOptions
    from streamer.testkit.models import ensure_random_model

    cache_dir = args.cache_dir or RecognizerOptions().cache_dir
    path = ensure_random_model(args.name, cache_dir)
    sys.stdout.write(f"{path}\n")
    return 0


# -- export-onnx -----------------------------------------------------------------


def _add_export_onnx(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-onnx",
        help="export a torch/funasr model to ONNX",
        description="Write model.onnx (fp32, its weights in model.onnx.data), model.int8.onnx "
        "(MatMul weights quantized dynamically), tokens.txt, bpe.model, am.mvn and "
        "manifest.json for --backend "
        "onnx. Without --out the export goes to the cache that serve --backend onnx "
        "reads, keyed by the model's content hash.",
    )
    p.add_argument("model", help="torch/funasr model directory, cached hub id, or random:NAME")
    p.add_argument("--out", type=Path, default=None, help="directory to create")
    p.add_argument(
        "--int8-weight-type",
        choices=("QInt8", "QUInt8"),
        default=None,
        help="weights of model.int8.onnx [QInt8 on CPUs with VNNI/dotprod, where it is as "
        "accurate and 2-3x faster; else QUInt8, which cannot saturate]",
    )
    _flag(p, "--hub", "ms", choices=("ms", "hf"))
    _flag(p, "--cache-dir", None, Path)
    # what a server passes when it runs the export as its child (model/artifacts/export_process.py)
    p.add_argument("--source-name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--source-sha256", default=None, help=argparse.SUPPRESS)
    p.add_argument("--die-with-parent", action="store_true", help=argparse.SUPPRESS)
    _add_logging_arguments(p)
    p.set_defaults(func=_cmd_export_onnx)


def _cmd_export_onnx(args: argparse.Namespace) -> int:
    from streamer.model.artifacts.files import locate_model
    from streamer.model.artifacts.onnx_export import cached_export, export_onnx
    from streamer.model.options import RecognizerOptions

    random_models = random_models_for(args.model)
    options = RecognizerOptions(
        model=args.model, hub=args.hub, backend="torch", random_models=random_models
    )
    cache_dir = args.cache_dir or options.cache_dir
    source = locate_model(args.model, args.hub, cache_dir, random_models)
    if not isinstance(source, Path):
        raise ConfigError(f"{args.model} is not downloaded yet; run streamer serve with it once")
    if args.out is None:
        out = cached_export(
            source, cache_dir, name=args.model, int8_weight_type=args.int8_weight_type
        )
    else:
        if args.out.exists() and any(args.out.iterdir()):
            raise ConfigError(f"{args.out} exists and is not empty")
        if args.die_with_parent:
            from streamer.model.serving.process import die_with_parent

            die_with_parent()
        export_onnx(
            source,
            args.out,
            int8_weight_type=args.int8_weight_type,
            name=args.source_name or args.model,
            digest=args.source_sha256,
        )
        out = args.out
    sys.stdout.write(f"{out}\n")
    return 0


# -- client --------------------------------------------------------------------


def _add_client(sub: argparse._SubParsersAction) -> None:
    from streamer.client.cli import add_client_arguments

    p = sub.add_parser("client", help="stream an audio file to a server and show captions")
    add_client_arguments(p)
    p.set_defaults(func=_cmd_client)


def _cmd_client(args: argparse.Namespace) -> int:
    from streamer.client.cli import run_client

    return asyncio.run(run_client(args))


# -- entry point ---------------------------------------------------------------
