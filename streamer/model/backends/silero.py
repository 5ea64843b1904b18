"""Per-frame voice activity from Silero VAD on ONNX Runtime (``--vad silero``).

Silero VAD (v5/v6) is a small recurrent network that scores 32 ms windows of 16 kHz
audio; unlike webrtcvad it keeps telling speech from white, brown or recorded noise at
10 and 5 dB SNR (bench/RESULTS.md). Its graph, shipped by the ``silero-vad`` package as
``silero_vad/data/silero_vad.onnx``, takes per call:

- ``input``: float32 ``(1, 576)`` in [-1, 1]: the previous call's last 64 samples (the
  context, zeros at first) followed by 512 new samples;
- ``state``: float32 ``(2, 1, 128)``, the recurrent state (zeros at first);
- ``sr``: int64 scalar, 16000;

and returns the speech probability ``(1, 1)`` and the next state (the contract of
``OnnxWrapper`` in the package's ``utils_vad.py``).

The segmenter keeps its 20 ms frames (its onset, pre-roll, endpoint and cut rules are
exact in those units): a :class:`SileroClassifier` buffers the frames it is given, runs
the model whenever 512 new samples have arrived, and answers every frame with its latest
decision, so a decision lags the audio by at most one window (32 ms). The decision has
hysteresis like Silero's own ``VADIterator``: speech starts at a probability of at least
``threshold`` and lasts until it falls below ``off_threshold``.

Threads: one :class:`SileroModel` (one ONNX Runtime session, one intra-op thread, no
spinning) serves every stream, since all per-stream state travels as inputs; a call costs
0.1-0.2 ms of CPU, so the server runs it on the event loop like webrtcvad.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer.core.audio import SAMPLE_RATE  # every stream is resampled to it before the VAD
from streamer.errors import ConfigError, ModelError
from streamer.extras import DISTRIBUTION

logger = logging.getLogger(__name__)

WINDOW_SAMPLES = 512  # 32 ms: the only window the model scores at 16 kHz
CONTEXT_SAMPLES = 64  # the previous window's tail, prepended to every call
STATE_SHAPE = (2, 1, 128)  # the recurrent state carried from call to call
PACKAGE = "silero-vad"  # on PyPI; its import name is silero_vad
GRAPH_FILE = "silero_vad.onnx"  # in the package's data folder (opset 16, 8 and 16 kHz)
_INPUTS = ("input", "state", "sr")
_OUTPUTS = ("output", "stateN")


@dataclass(frozen=True)
class SileroOptions:
    """How probabilities become speech flags."""

    threshold: float = 0.5  # a window at or above this probability starts speech
    off_threshold: float = 0.35  # speech lasts until a window falls below this
    model_path: Path | None = None  # None: the silero-vad package's silero_vad.onnx

    def __post_init__(self) -> None:
        if not 0.0 < self.off_threshold <= self.threshold < 1.0:
            raise ConfigError("Silero VAD needs 0 < off_threshold <= threshold < 1")


def packaged_model_path() -> Path:
    """The ONNX graph the ``silero-vad`` package ships, found without importing it
    (its ``__init__`` imports torch, which the VAD does not need)."""
    try:
        spec = importlib.util.find_spec("silero_vad")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"--vad silero needs the {PACKAGE} package, which the plain install leaves out: "
            f"pip install '{DISTRIBUTION}[torch]', or only its ONNX graph (it requires torch, "
            f"which the VAD does not use): pip install --no-deps {PACKAGE}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / GRAPH_FILE
        if path.is_file():
            return path
    raise ConfigError(f"the {PACKAGE} package has no data/{GRAPH_FILE}; reinstall it")


class SileroModel:
    """One loaded Silero graph; stateless, so every stream's classifier may share it.

    Construction reads and optimises the graph (tens of milliseconds). :meth:`score` is
    safe to call from any thread (ONNX Runtime sessions are), though the server calls it
    from its event loop only.
    """

    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime as ort

        self.path = path or packaged_model_path()
        options = ort.SessionOptions()
        # one thread, the caller's: nothing to hand work to, nothing spinning beside it
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        try:
            self._session = ort.InferenceSession(
                str(self.path), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as error:  # ORT raises its own exception types for bad files
            raise ModelError(
                f"ONNX Runtime cannot load the Silero VAD graph {self.path}: "
                f"{type(error).__name__}: {error}"
            ) from error
        inputs = tuple(i.name for i in self._session.get_inputs())
        outputs = tuple(o.name for o in self._session.get_outputs())
        if sorted(inputs) != sorted(_INPUTS) or outputs != _OUTPUTS:
            raise ModelError(
                f"{self.path} is not a Silero VAD v5 graph: inputs {inputs}, outputs "
                f"{outputs} (expected {_INPUTS} -> {_OUTPUTS})"
            )
        self._rate = np.array(SAMPLE_RATE, dtype=np.int64)
        logger.info("loaded Silero VAD from %s", self.path)

    def score(self, window: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        """Speech probability of ``window`` (float32 ``(1, 576)``: 64 samples of context,
        512 new) and the state that follows ``state``."""
        probability, next_state = self._session.run(
            _OUTPUTS, {"input": window, "state": state, "sr": self._rate}
        )
        return float(probability[0, 0]), next_state

    def classifier(self, options: SileroOptions | None = None) -> SileroClassifier:
        """A fresh classifier for one stream."""
        return SileroClassifier(self, options or SileroOptions())


class SileroClassifier:
    """One stream's Silero VAD: call it with consecutive int16 frames of 16 kHz audio
    (any length; the server's are 20 ms) and it says whether each is speech.

    Frames must be the stream's audio in order, with nothing skipped: the model's state
    and context follow the stream. Not thread-safe (one per stream).
    """

    def __init__(self, model: SileroModel, options: SileroOptions) -> None:
        self.options = options
        self._model = model
        self._state = np.zeros(STATE_SHAPE, dtype=np.float32)
        # the next call's input: context in the first 64 samples, new audio after it
        self._window = np.zeros((1, CONTEXT_SAMPLES + WINDOW_SAMPLES), dtype=np.float32)
        self._filled = 0  # new samples already in the window
        self._speech = False
        self.probability = 0.0  # of the latest window (for benches and logs)
        self.windows = 0  # windows scored so far

    def __call__(self, frame: np.ndarray) -> bool:
        samples = frame.reshape(-1)
        taken = 0
        while taken < samples.size:
            n = min(WINDOW_SAMPLES - self._filled, samples.size - taken)
            start = CONTEXT_SAMPLES + self._filled
            self._window[0, start : start + n] = samples[taken : taken + n] * (1.0 / 32768)
            self._filled += n
            taken += n
            if self._filled == WINDOW_SAMPLES:
                self._score()
        return self._speech

    def _score(self) -> None:
        self.probability, self._state = self._model.score(self._window, self._state)
        self.windows += 1
        if self._speech:
            self._speech = self.probability >= self.options.off_threshold
        else:
            self._speech = self.probability >= self.options.threshold
        self._window[0, :CONTEXT_SAMPLES] = self._window[0, -CONTEXT_SAMPLES:]
        self._filled = 0


def silero_classifier_factory(
    options: SileroOptions | None = None,
) -> Callable[[], SileroClassifier]:
    """Load the model once; the returned factory makes one classifier per session
    (``StreamingServer(..., classifier_factory=...)``). Raises ConfigError when the
    ``silero-vad`` package is missing, ModelError for a graph that is not Silero's."""
    options = options or SileroOptions()
    model = SileroModel(options.model_path)
    return lambda: model.classifier(options)
