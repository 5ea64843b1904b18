"""The tagged test model, shipped with the package instead of trained at test time.

Training the tiny model until it decodes its two espeak clips exactly takes minutes and
does not converge the same way on every torch release or CPU, so the result of one
training run lives in ``streamer/testkit/tagged_model/`` (3 MB) with a ``SHA256SUMS``
file. Inference with these weights is exact on any torch: the logits' margins are far
above the rounding differences between releases.

To rebuild it (after a change to the builder or the training recipe)::

    python -m streamer.testkit.tagged --rebuild

which trains, checks every decode (:func:`streamer.testkit.models.build_random_model`
raises when one is wrong), and rewrites the folder and its checksums; commit the result.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from streamer.errors import ModelError
from streamer.model.artifacts.files import file_sha256

logger = logging.getLogger(__name__)

FILES = ("am.mvn", "bpe.model", "config.yaml", "model.pt", "random_model.json")
CHECKSUMS = "SHA256SUMS"


def shipped_dir() -> Path:
    """The folder of the shipped tagged model inside the installed package."""
    return Path(str(importlib.resources.files("streamer.testkit"))) / "tagged_model"


def verified_dir() -> Path:
    """:func:`shipped_dir` after checking every file against ``SHA256SUMS``.

    Raises ModelError naming the damaged or missing file (a partial checkout, a file
    rewritten by an editor or by git's line-ending conversion).
    """
    directory = shipped_dir()
    try:
        lines = (directory / CHECKSUMS).read_text().splitlines()
    except OSError as error:
        raise ModelError(
            f"the shipped tagged test model is missing ({directory / CHECKSUMS}: {error}); "
            "reinstall the package or run python -m streamer.testkit.tagged --rebuild"
        ) from error
    expected: dict[str, str] = {}
    for line in lines:
        if line.strip():
            digest, name = line.split(maxsplit=1)
            expected[name.strip()] = digest
    for name in FILES:
        path = directory / name
        if not path.is_file() or file_sha256(path) != expected.get(name):
            raise ModelError(
                f"the shipped tagged test model file {path} is missing or damaged (its "
                f"SHA-256 differs from {CHECKSUMS}); restore it from git or rebuild it with "
                "python -m streamer.testkit.tagged --rebuild"
            )
    return directory


def write_checksums(directory: Path) -> None:
    lines = [f"{file_sha256(directory / name)}  {name}\n" for name in FILES]
    (directory / CHECKSUMS).write_text("".join(lines))


def rebuild(target: Path, speech_cache_dir: Path, seed: int = 0) -> None:
    """Train the tagged model again and replace ``target``'s files (and checksums)."""
    from streamer.testkit.models import build_random_model

    with tempfile.TemporaryDirectory(prefix="tagged-") as tmp:
        built = Path(tmp) / "model"
        build_random_model("tagged", built, speech_cache_dir=speech_cache_dir, seed=seed)
        target.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(built / name, target / name)
    write_checksums(target)
    logger.info("rebuilt the tagged model in %s", target)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m streamer.testkit.tagged",
        description="Check or rebuild the shipped tagged test model.",
    )
    parser.add_argument("--rebuild", action="store_true", help="train again and rewrite it")
    parser.add_argument("--out", type=Path, default=None, help="folder (default: the shipped one)")
    parser.add_argument("--speech-cache", type=Path, default=Path(".cache/speech"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from streamer.cli.common import configure_logging

    configure_logging("info", "text")
    if args.rebuild:
        rebuild(args.out or shipped_dir(), args.speech_cache, args.seed)
        return 0
    try:
        directory = verified_dir()
    except ModelError as error:
        logger.error("%s", error)
        return 1
    logger.info("%s: every file matches %s", directory, CHECKSUMS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
