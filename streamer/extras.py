"""The parts of the install that are optional (pyproject's extras), and the one-line error
that names the extra to install when a feature needs a part that is missing.

The plain ``pip install sensevoice-streamer`` is the client and the CPU server on ONNX
Runtime; ``[torch]`` adds torch and funasr (the torch backend, exporting a torch model to
ONNX, the random-weight test models), ``[gpu]`` the same for CUDA, ``[bench]`` the
benches' psutil.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shlex
import sys
from pathlib import Path

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
    """The command that adds ``extra`` to this install, for how it was installed: from a
    checkout (``pip install -e .``, what the README does) the checkout's own extra with
    its constraints; otherwise the extra's packages by name (the distribution is not on
    PyPI, so ``pip install 'sensevoice-streamer[torch]'`` would not be found)."""
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    checkout = _checkout()
    if checkout is not None:
        constraints = " -c constraints.txt" if (checkout / "constraints.txt").is_file() else ""
        return f"cd {shlex.quote(str(checkout))} && {pip}{constraints} -e '.[{extra}]'"
    packages = _extra_requirements(extra)
    if not packages:
        return f"{pip} '{DISTRIBUTION}[{extra}]'"
    return f"{pip} " + " ".join(shlex.quote(p) for p in packages)


def _checkout() -> Path | None:
    """The source directory this package was installed from (PEP 610), if it still is one."""
    # the installed record (a .dist-info) has direct_url.json; a checkout's own
    # .egg-info, found first where the checkout is on sys.path (python -m, pytest), has not
    texts = (
        d.read_text("direct_url.json") for d in importlib.metadata.distributions(name=DISTRIBUTION)
    )
    text = next((t for t in texts if t), None)
    try:
        origin = json.loads(text) if text else {}
    except ValueError:
        return None
    url = origin.get("url", "") if isinstance(origin, dict) else ""
    if "dir_info" not in origin or not url.startswith("file://"):
        return None
    directory = Path(url.removeprefix("file://"))
    return directory if (directory / "pyproject.toml").is_file() else None


def _extra_requirements(extra: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """The requirements ``extra`` adds (an extra naming another of ours is expanded)."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    packages = []
    for line in requires:
        spec, _, marker = line.partition(";")
        if f'extra == "{extra}"' not in marker.replace("'", '"'):
            continue
        spec = spec.strip()
        if spec.startswith(f"{DISTRIBUTION}[") and extra not in seen:
            for inner in spec[len(DISTRIBUTION) + 1 : -1].split(","):
                packages += _extra_requirements(inner.strip(), seen | {extra})
        else:
            packages.append(spec)
    return packages


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
