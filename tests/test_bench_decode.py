"""bench/decode.py: every part but ``generate`` (torch's funasr import in a child) on the
tiny random model through ONNX Runtime, and its arguments."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from bench import decode


def test_configurations_become_recognizer_options(tmp_path: Path) -> None:
    args = argparse.Namespace(model="random:tiny", device="cpu", threads=1, cache_dir=tmp_path)
    int8 = decode.options("onnx-int8", args)
    assert (int8.backend, int8.quantize, int8.dtype) == ("onnx", "int8", "fp32")
    torch = decode.options("torch-fp32", args)
    assert (torch.backend, torch.quantize, torch.dtype) == ("torch", None, "fp32")
    args.device = "cuda"
    half = decode.options("torch-fp16", args)
    assert (half.backend, half.quantize, half.dtype) == ("torch", None, "fp16")
    assert decode.edit_distance((1, 2, 3), (1, 3)) == 1


def test_unknown_parts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        decode.main(["--parts", "time,speed"])
    assert "unknown parts: speed" in capsys.readouterr().err


def test_every_part_runs_on_the_tiny_model(
    cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parts = "time,agreement,batch-timing,hotwords"
    argv = ["--model", "random:tiny", "--configs", "onnx-int8,onnx-fp32", "--parts", parts,
            "--reps", "1", "--segments", "3", "--sizes", "1,2", "--lengths", "1",
            "--phrases", "5", "--cache-dir", str(cache_dir), "--out", str(tmp_path)]  # fmt: skip
    assert decode.main(argv) == 0
    out = capsys.readouterr().out
    assert "| onnx-fp32 | " in out.split("### Decode time")[1]
    agreement = re.search(r"\| onnx-fp32 \| (\d)/3 \| ([\d.]+) % \|", out)
    assert agreement is not None, out  # int8 against fp32: counted, whatever it is
    assert "| onnx-int8 | 2 | " in out  # batch of two
    assert "| onnx-int8 | 7 s | " in out  # hotwords
