"""The web demo's transcript export, run by Node on a minimal DOM (no browser).

Each Start opens new sessions whose times begin at 0 again; the exported .srt must keep
one timeline across Start/Stop runs (cues never going backwards).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.timing import timeout_s

WEB_DEMO = Path(__file__).resolve().parent.parent / "web_demo"
NODE = shutil.which("node")

SCRIPT = """
class Node {
  constructor() { this.dataset = {}; this.children = []; }
  append(...nodes) { this.children.push(...nodes); }
  replaceChildren(...nodes) { this.children = nodes; }
  remove() {}
  addEventListener() {}
}
globalThis.document = { createElement: () => new Node() };
const { CaptionView } = await import(process.argv[2] + "/captions.js");
const { toSrt } = await import(process.argv[2] + "/export.js");
const view = new CaptionView(new Node());
const session = { index: 0, offsetMs: 0 };
const final = (id, start, end, text) =>
  ({ type: "final", segment_id: id, start_ms: start, end_ms: end, text });
view.startRun();
view.handle(final(0, 500, 2000, "first run one"), session);
view.handle(final(1, 2500, 4000, "first run two"), session);
view.startRun();  // Stop, then Start: a new session, whose clock starts at 0
view.handle(final(0, 300, 1500, "second run"), { index: 0, offsetMs: 0 });
console.log(JSON.stringify(toSrt(view.finals)));
"""


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_srt_keeps_one_timeline_across_runs(tmp_path: Path) -> None:
    script = tmp_path / "run.mjs"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [NODE, str(script), WEB_DEMO.as_uri()],
        capture_output=True,
        text=True,
        timeout=timeout_s(30),
    )
    assert out.returncode == 0, out.stderr
    cues = json.loads(out.stdout).strip().split("\n\n")
    times = [cue.split("\n")[1] for cue in cues]
    assert times == [
        "00:00:00,500 --> 00:00:02,000",
        "00:00:02,500 --> 00:00:04,000",
        "00:00:04,300 --> 00:00:05,500",  # the second run follows the first's last final
    ]
