"""The web demo shows speakers: a coloured badge per final and each speaker's run of words
in that speaker's colour (web_demo/captions.js, run by node with a minimal DOM)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.timing import timeout_s

WEB_DEMO = Path(__file__).resolve().parent.parent / "web_demo"

SCRIPT = r"""
class Node_ {
  constructor(tag) { this.tag = tag; this.children = []; this.dataset = {}; this.className = ""; }
  set textContent(t) { this.children = [String(t)]; }
  get textContent() {
    return this.children.map((c) => (typeof c === "string" ? c : c.textContent)).join("");
  }
  append(...c) { this.children.push(...c); }
  replaceChildren(...c) { this.children = c; }
  addEventListener() {}
  remove() {}
}
globalThis.document = { createElement: (t) => new Node_(t) };
const { CaptionView } = await import(process.argv[1]);
const container = new Node_("div");
const view = new CaptionView(container);
const session = { index: 0, offsetMs: 0 };
for (const message of JSON.parse(process.argv[2])) view.handle(message, session);
const nodes = (n) => n.children.filter((c) => typeof c !== "string");
console.log(JSON.stringify(container.children.map((final) => ({
  badges: nodes(final.children[0]).map((c) => c.className),
  runs: nodes(final.children[1]).map((c) => [c.className, c.textContent]),
  text: final.children[1].textContent,
}))));
"""


def test_finals_show_their_speakers_in_colours() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    words = [{"word": w, "speaker": s} for w, s in (("hi", "A"), ("there", "A"), ("yo", "B"))]
    messages = [
        {"type": "final", "segment_id": 0, "start_ms": 0, "end_ms": 900, "text": "hi there yo",
         "speaker": "A", "words": words},
        {"type": "final", "segment_id": 1, "start_ms": 1000, "end_ms": 1500, "text": "ok",
         "speaker": "B", "words": [{"word": "ok", "speaker": "B"}]},
        {"type": "final", "segment_id": 2, "start_ms": 2000, "end_ms": 2500, "text": "plain",
         "words": [{"word": "plain"}]},
    ]  # fmt: skip
    done = subprocess.run(
        [node, "--input-type=module", "-e", SCRIPT, str(WEB_DEMO / "captions.js"),
         json.dumps(messages)],
        capture_output=True, text=True, timeout=timeout_s(30),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second, plain = json.loads(done.stdout)
    assert "badge speaker speaker-0" in first["badges"]
    assert first["runs"] == [["speaker-run speaker-0", "hi there"], ["speaker-run speaker-1", "yo"]]
    assert first["text"] == "hi there yo"
    assert "badge speaker speaker-1" in second["badges"]  # B keeps its colour
    assert not any("speaker" in b for b in plain["badges"]) and plain["runs"] == []
    assert plain["text"] == "plain"


def test_the_page_asks_for_speakers_when_checked() -> None:
    html = (WEB_DEMO / "index.html").read_text()
    assert 'id="diarize"' in html
    client = (WEB_DEMO / "asr-client.js").read_text()
    assert 'searchParams.set("diarize", "true")' in client
    css = (WEB_DEMO / "style.css").read_text()
    assert all(f".badge.speaker-{i}" in css for i in range(6))
