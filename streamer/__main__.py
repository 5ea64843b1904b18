from streamer.cli import entry

entry()
