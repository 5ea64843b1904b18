"""sensevoice-streamer: real-time SenseVoiceSmall speech recognition over WebSocket.

The package is layered:

* an I/O-free core (:mod:`streamer.framing`, :mod:`streamer.segmenter`,
  :mod:`streamer.session`, :mod:`streamer.protocol`, :mod:`streamer.tags`) that never
  touches sockets, clocks, torch or funasr;
* thin I/O layers around it: the model worker (:mod:`streamer.worker`, owning
  :mod:`streamer.recognizer`), the WebSocket server (:mod:`streamer.server`), the
  async client (:mod:`streamer.client`) and the CLI (:mod:`streamer.cli`).
"""

__version__ = "0.1.0"
