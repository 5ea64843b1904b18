"""Stream an audio file to a sensevoice-streamer server, like a live microphone.

    python client_examples/stream_file.py speech.wav --url ws://127.0.0.1:8000/v1/asr
    python client_examples/stream_file.py talk.mp3 --no-pace --output talk.srt

The same code as ``streamer client``; see ``--help`` for every option and the exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from streamer.client.cli import add_client_arguments, run_client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_client_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run_client(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
