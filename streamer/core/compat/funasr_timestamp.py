"""FunASR runtime's ``timestamp`` field from our timed words (I/O-free).

FunASR's C++ 2pass server (``websocket-server-2pass.cpp``, the one the docker SDK runs)
sends each ``2pass-offline`` sentence with ``"timestamp": "[[100,400],[400,700]]"``: a
JSON **string** holding one ``[start_ms, end_ms]`` pair of integers per recognised token
(a character of Chinese, a word of English) in the stream's timeline (it adds the VAD
segment's start), without spaces, and leaves the field out when it has no pairs.
funasr-client ``json.loads`` it and funasr-python's pydantic model wants a ``str``, so a
list there loses the message (docs: ``shared/compat-protocols.md`` section 3).

Its punctuation comes from a separate model after recognition and has no time, so words
made only of punctuation get no pair; punctuation attached to a word (``好。``) rides on
that word's pair. Times are truncated to integers as the C++ server's ``(int)`` cast does.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from streamer.core.protocol import Word


def funasr_timestamp(words: Sequence[Word]) -> str | None:
    """``"[[start_ms,end_ms],...]"`` for ``words`` (a final's), or None when no word was
    spoken (then send no ``timestamp``, as FunASR does)."""
    pairs = [
        f"[{int(w.start_ms)},{int(w.end_ms)}]"
        for w in words
        if any(not unicodedata.category(c).startswith("P") for c in w.word)
    ]
    return f"[{','.join(pairs)}]" if pairs else None
