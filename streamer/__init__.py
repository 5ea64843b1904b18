"""sensevoice-streamer: real-time SenseVoiceSmall speech recognition over WebSocket.

The package is layered (``docs/architecture.md`` has the picture):

* :mod:`streamer.core`: the sans-I/O core (framing, segmenter, session, protocol
  messages, transcripts) that never touches sockets, clocks, torch or funasr;
* :mod:`streamer.model`: the only importer of torch and funasr: model files, the
  recognizer and the worker thread that owns it;
* :mod:`streamer.server`: the WebSocket server, its HTTP routes and metrics;
* :mod:`streamer.client`: the async protocol client, caption writers, ``streamer client``;
* :mod:`streamer.testkit`: random-weight models and synthesised speech for tests;
* :mod:`streamer.cli`: the ``streamer`` command, the only place logging is configured;
* :mod:`streamer.transcriber`: ``from streamer import Transcriber``, transcription in
  your own process (docs/python-api.md).
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["Transcriber", "TranscriptionStream", "__version__"]

if TYPE_CHECKING:
    from streamer.transcriber import Transcriber, TranscriptionStream


def __getattr__(name: str) -> object:
    # PEP 562: ``import streamer`` (the CLI, the server) stays light; the in-process API
    # loads the model layer only when it is asked for
    if name in ("Transcriber", "TranscriptionStream"):
        from streamer import transcriber

        return getattr(transcriber, name)
    raise AttributeError(f"module 'streamer' has no attribute {name!r}")
