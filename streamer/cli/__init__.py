"""The ``streamer`` command: serve, transcribe, client, build-model, export-onnx,
export-diarizer.

This package is the only code that reads argv and the environment and configures
logging. Heavy imports (torch, funasr) happen inside the commands, so ``--help`` is
instant. ``common`` holds what every command shares (``STREAMER_*`` defaults, logging,
the model flags), ``serve`` the server command, ``tools`` the others.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from streamer import __version__
from streamer.cli.common import ENV_PREFIX, configure_logging
from streamer.cli.diarizer import _add_export_diarizer
from streamer.cli.serve import _add_serve
from streamer.cli.tools import _add_build_model, _add_client, _add_export_onnx, _add_transcribe
from streamer.errors import ConfigError, ModelError

__all__ = ["ENV_PREFIX", "build_parser", "main"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamer",
        description="Real-time SenseVoiceSmall speech recognition over WebSocket.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_transcribe(sub)
    _add_client(sub)
    _add_build_model(sub)
    _add_export_onnx(sub)
    _add_export_diarizer(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info") or "warning"  # None: transcribe's own default
    configure_logging(level, getattr(args, "log_format", "text"))
    try:
        return int(args.func(args) or 0)
    except (ModelError, ConfigError) as error:
        logger.error("%s", error)
        return 2 if isinstance(error, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
