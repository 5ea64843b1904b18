"""The tag display table has one owner (streamer.core.transcript); the web demo's copy
in web_demo/captions.js must match it entry for entry."""

from __future__ import annotations

import re
from pathlib import Path

from streamer.core.transcript import EMOTION_BADGES, EMOTION_TAGS, EVENT_BADGES, EVENT_TAGS

CAPTIONS_JS = Path(__file__).resolve().parent.parent / "web_demo" / "captions.js"


def _js_table(name: str) -> dict[str, tuple[str, str]]:
    source = CAPTIONS_JS.read_text(encoding="utf-8")
    block = re.search(rf"const {name} = \{{(.*?)\n\}};", source, re.S)
    assert block, f"{name} not found in {CAPTIONS_JS}"
    entries = re.findall(r'^\s*(\w+): \["([^"]+)", "([^"]+)"\],\s*$', block.group(1), re.M)
    return {key: (emoji, words) for key, emoji, words in entries}


def test_web_demo_emotions_match() -> None:
    assert _js_table("EMOTIONS") == EMOTION_BADGES


def test_web_demo_events_match() -> None:
    assert _js_table("EVENTS") == EVENT_BADGES


def test_every_badge_is_a_known_tag() -> None:
    assert set(EMOTION_BADGES) <= EMOTION_TAGS
    assert set(EVENT_BADGES) <= EVENT_TAGS
