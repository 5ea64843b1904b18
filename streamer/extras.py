"""The parts of the install that are optional (pyproject's extras), and the one-line error
that names the extra to install when a feature needs a part that is missing.

The plain ``pip install sensevoice-streamer`` is the client and the CPU server on ONNX
Runtime; ``[torch]`` adds torch and funasr (the torch backend, exporting a torch model to
ONNX, the random-weight test models), ``[gpu]`` the same for CUDA, ``[bench]`` the
benches' psutil, tqdm and matplotlib.
"""

from __future__ import annotations

import importlib.util

from streamer.errors import ConfigError

DISTRIBUTION = "sensevoice-streamer"  # the name on PyPI
TORCH = "torch"  # the extra with torch, funasr and onnx
TORCH_MODULES = ("torch", "funasr")


def missing(*modules: str) -> list[str]:
    """Those of ``modules`` that cannot be imported here (found without importing them)."""
    absent = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(module)
    return absent


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(purpose: str, extra: str, *modules: str) -> None:
    """ConfigError naming ``extra`` when one of ``modules`` is not installed.

    ``purpose`` says what needs them (``"--backend torch"``), so the message reads
    "--backend torch needs torch and funasr, which the plain install leaves out: ...".
    """
    absent = missing(*modules)
    if absent:
        raise ConfigError(
            f"{purpose} needs {' and '.join(absent)}, which the plain install leaves out: "
            f"{install_hint(extra)}"
        )
