"""Adapters for wire protocols that existing clients speak (I/O-free, like the core).

Each module translates one protocol to and from the core :class:`~streamer.core.session.Session`
as a :class:`~streamer.core.wire.WireAdapter`: :mod:`.deepgram` (``GET /v1/listen``) and
:mod:`.openai_realtime` (``GET /v1/realtime?intent=transcription``) on the main port,
:mod:`.funasr` (FunASR's runtime protocol) and :mod:`.wyoming` (Home Assistant's, over
TCP) on ports of their own. :mod:`.audio` decodes G.711 and downmixes channels;
:mod:`.common` holds what the protocols share (language tags, lenient option parsing,
word lists); :mod:`.textjoin` the append-only text streams; :mod:`.transcripts` the
answers of the file transcription endpoints (OpenAI's ``/v1/audio/transcriptions``,
Deepgram's prerecorded ``POST /v1/listen``) built from a file's finals. ``docs/deepgram.md``,
``docs/openai-realtime.md``, ``docs/funasr.md`` and ``docs/wyoming.md`` describe what
each client sees.
"""
