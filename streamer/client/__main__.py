"""``python -m streamer.client``: the same as ``streamer client``."""

import sys

from streamer.cli import main

if __name__ == "__main__":
    sys.exit(main(["client", *sys.argv[1:]]))
