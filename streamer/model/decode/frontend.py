"""SenseVoice's features without torch: fbank (kaldi-native-fbank), LFR 7/6, CMVN.

:class:`Frontend` computes what funasr's ``WavFrontend`` computes with ``dither=0`` (the
tests compare them): 80 log-mel bins every 10 ms over 25 ms Hamming windows of the
waveform scaled to the int16 range, stacked 7 frames at a time every 6 frames (low frame
rate; the first frame repeated 3 times in front, the last repeated to fill the end), then
``(x + shift) * scale`` from ``am.mvn``. One output frame covers 60 ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from streamer.errors import ModelError
from streamer.model.sensevoice import (
    FRAME_LENGTH_MS,
    FRAME_SHIFT_MS,
    LFR_M,
    LFR_N,
    N_MELS,
    SAMPLE_RATE,
    WINDOW,
)

WINDOW_SAMPLES = SAMPLE_RATE * FRAME_LENGTH_MS // 1000  # 400 samples in one 25 ms window
SHIFT_SAMPLES = SAMPLE_RATE * FRAME_SHIFT_MS // 1000  # 160 samples between frames


@dataclass(frozen=True)
class Cmvn:
    """Per-dimension normalisation of the stacked features: ``(x + shift) * scale``."""

    shift: np.ndarray  # float32 (560,): minus the mean (Kaldi <AddShift>)
    scale: np.ndarray  # float32 (560,): one over the standard deviation (<Rescale>)


def read_am_mvn(path: Path) -> Cmvn:
    """Read Kaldi nnet1 text CMVN statistics as funasr's ``load_cmvn`` reads them."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ModelError(f"CMVN file {path} cannot be read ({error})") from error
    vectors: dict[str, np.ndarray] = {}
    for index, line in enumerate(lines[:-1]):
        words = line.split()
        if words and words[0] in ("<AddShift>", "<Rescale>"):
            values = lines[index + 1].split()
            if values and values[0] == "<LearnRateCoef>":
                vectors[words[0]] = np.array(values[3:-1], dtype=np.float32)
    shift, scale = vectors.get("<AddShift>"), vectors.get("<Rescale>")
    if shift is None or scale is None or shift.shape != scale.shape or shift.size == 0:
        raise ModelError(
            f"{path} is not a Kaldi nnet1 CMVN file with <AddShift> and <Rescale> vectors "
            "of one size"
        )
    return Cmvn(shift=shift, scale=scale)


class Frontend:
    """Waveform to SenseVoice features, (frames, 560) float32. Stateless; thread-safe."""

    def __init__(
        self,
        cmvn: Cmvn,
        *,
        lfr_m: int = LFR_M,
        lfr_n: int = LFR_N,
    ) -> None:
        import kaldi_native_fbank as knf

        self._knf = knf
        self.lfr_m = lfr_m
        self.lfr_n = lfr_n
        self.cmvn = cmvn
        self.n_mels = N_MELS
        if cmvn.shift.size != self.n_mels * lfr_m:
            raise ModelError(
                f"CMVN has {cmvn.shift.size} dimensions but {self.n_mels} mel bins stacked "
                f"{lfr_m} at a time make {self.n_mels * lfr_m}"
            )
        self._full_window_options = self._fbank_options(float(FRAME_LENGTH_MS))

    @property
    def dim(self) -> int:
        return self.n_mels * self.lfr_m

    def __call__(self, waveform: np.ndarray) -> np.ndarray:
        """Features of float32 ``waveform`` in [-1, 1] at 16 kHz: (frames, 560) float32."""
        return self.stack(self.fbank(waveform))

    def stack(self, fbank: np.ndarray) -> np.ndarray:
        """LFR and CMVN of ``fbank`` (frames, 80): the features, (frames, 560) float32."""
        if fbank.shape[0] == 0:
            return np.zeros((0, self.dim), np.float32)
        stacked = lfr(fbank, self.lfr_m, self.lfr_n)
        stacked += self.cmvn.shift
        stacked *= self.cmvn.scale
        return stacked

    def fbank(self, waveform: np.ndarray) -> np.ndarray:
        """80-bin log-mel filterbank, (frames, 80) float32, as funasr's knf fallback."""
        # WavFrontend shortens the window for audio shorter than one window
        window_ms = min(float(FRAME_LENGTH_MS), waveform.size / SAMPLE_RATE * 1000)
        computer = self._knf.OnlineFbank(self._fbank_options(window_ms))
        computer.accept_waveform(float(SAMPLE_RATE), np.asarray(waveform, np.float32) * 32768)
        computer.input_finished()
        frames = computer.num_frames_ready
        if frames == 0:
            return np.zeros((0, self.n_mels), np.float32)
        return np.stack([computer.get_frame(i) for i in range(frames)]).astype(np.float32)

    def online_fbank(self) -> OnlineFbank:
        """A kaldi-native-fbank ``OnlineFbank`` with full 25 ms windows, to feed audio in
        pieces: its frames are bit for bit :meth:`fbank`'s for audio of one window or more
        (each frame depends on its own window's samples only)."""
        return cast(OnlineFbank, self._knf.OnlineFbank(self._full_window_options))

    def _fbank_options(self, window_ms: float) -> Any:
        options = self._knf.FbankOptions()
        frame = options.frame_opts
        frame.samp_freq = float(SAMPLE_RATE)
        frame.frame_length_ms = window_ms
        frame.frame_shift_ms = float(FRAME_SHIFT_MS)
        frame.dither = 0.0
        frame.snip_edges = True
        frame.window_type = WINDOW
        frame.preemph_coeff = 0.97
        frame.remove_dc_offset = True
        frame.round_to_power_of_two = True
        options.mel_opts.num_bins = self.n_mels
        options.mel_opts.low_freq = 20.0
        options.mel_opts.high_freq = 0.0
        options.energy_floor = 0.0
        options.raw_energy = True
        options.use_energy = False
        options.use_log_fbank = True
        options.use_power = True
        options.htk_compat = False
        return options


class OnlineFbank(Protocol):
    """What :meth:`Frontend.online_fbank` returns (kaldi_native_fbank.OnlineFbank)."""

    @property
    def num_frames_ready(self) -> int: ...

    def accept_waveform(self, sampling_rate: float, waveform: np.ndarray) -> None: ...

    def get_frame(self, frame: int) -> np.ndarray: ...

    def pop(self, n: int) -> None: ...


def fbank_frames(samples: int) -> int:
    """How many fbank frames :meth:`Frontend.online_fbank` has made from ``samples``
    samples (full windows only, as ``snip_edges``)."""
    if samples < WINDOW_SAMPLES:
        return 0
    return 1 + (samples - WINDOW_SAMPLES) // SHIFT_SAMPLES


def lfr(fbank: np.ndarray, lfr_m: int, lfr_n: int) -> np.ndarray:
    """Low frame rate stacking exactly as funasr's ``apply_lfr``: a new float32 array.

    Output frame ``i`` stacks input frames ``i * lfr_n - (lfr_m - 1) // 2`` onwards,
    ``lfr_m`` of them, the first and last input frames repeated where that runs out.
    """
    frames = fbank.shape[0]
    out_frames = -(-frames // lfr_n)  # ceil
    left = (lfr_m - 1) // 2
    index = np.arange(out_frames)[:, None] * lfr_n + np.arange(lfr_m)[None, :] - left
    index = np.clip(index, 0, frames - 1)
    return fbank[index].reshape(out_frames, lfr_m * fbank.shape[1]).astype(np.float32)
