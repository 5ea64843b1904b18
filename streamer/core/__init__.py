"""The sans-I/O core: audio framing, resampling, VAD decisions, the segmenter, one
connection's session state machine, protocol v1's wire messages, transcripts and jobs.

Nothing here reads a clock, opens a socket or imports asyncio, websockets, torch or
funasr; time is counted in samples. ``tests/test_layering.py`` holds it to that.
"""
