"""Compressed audio decoded for the session (PyAV, off the core): streamed containers
(:mod:`.decoder`) and uploaded files (:mod:`.files`)."""

from streamer.media.decoder import ContainerDecoder, open_decoder

__all__ = ["ContainerDecoder", "open_decoder"]
