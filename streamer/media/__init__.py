"""Compressed audio containers decoded for the session (PyAV, off the core)."""

from streamer.media.decoder import ContainerDecoder, open_decoder

__all__ = ["ContainerDecoder", "open_decoder"]
