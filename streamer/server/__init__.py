"""The WebSocket server: lifecycle, one connection per session, HTTP routes, metrics.

A thin I/O layer: protocol logic lives in :mod:`streamer.core`, the model in
:mod:`streamer.model`.
"""
