"""The layers hold: read from each module's AST, and from what importing it loads.

- ``streamer/core/`` imports only ``streamer.core``, ``streamer.errors`` and libraries
  that do no I/O, and never reads a clock (no ``time``, ``datetime``, ``asyncio``).
- ``streamer/model/`` and ``streamer/testkit/`` (which builds models) are the only
  importers of torch, funasr and onnxruntime.
- ``streamer/model/`` imports nothing from ``streamer/testkit/`` (not even inside a
  function): ``random:NAME`` gets its builder passed in (``RecognizerOptions.random_models``).
- ``streamer/media/`` is the only importer of PyAV (``av``, FFmpeg), and imports neither
  the server nor the model.
- Only the CLI configures logging; nothing in the package prints.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "streamer"
MODEL_LIBRARIES = {
    "torch",
    "funasr",
    "onnxruntime",
    "onnx",
    "sentencepiece",
    "modelscope",
    "kaldi_native_fbank",
}
# What a core module may import besides the standard library's pure modules.
CORE_THIRD_PARTY = {"numpy", "soxr", "webrtcvad", "orjson"}
CORE_FORBIDDEN_STDLIB = {
    "time",
    "datetime",
    "asyncio",
    "socket",
    "threading",
    "subprocess",
    "ssl",
    "selectors",
    "http",
    "urllib.request",
    "os",
    "io",
    "logging.handlers",
}


def _modules(folder: str | None = None) -> list[Path]:
    root = PACKAGE / folder if folder else PACKAGE
    return sorted(p for p in root.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, resolved to absolute dotted names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


@pytest.mark.parametrize("path", _modules("core"), ids=_rel)
def test_core_imports_only_core_and_pure_libraries(path: Path) -> None:
    bad = set()
    for name in _imports(path):
        top = _top(name)
        if top == "streamer":
            allowed = name.startswith(("streamer.core", "streamer.errors")) or name == "streamer"
            if not allowed:
                bad.add(name)
        elif top in sys.stdlib_module_names:
            if top in CORE_FORBIDDEN_STDLIB or name in CORE_FORBIDDEN_STDLIB:
                bad.add(name)
        elif top != "__future__" and top not in CORE_THIRD_PARTY:
            bad.add(name)
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_model_libraries_only_in_model_and_testkit(path: Path) -> None:
    if path.relative_to(PACKAGE).parts[0] in ("model", "testkit"):
        return
    bad = {name for name in _imports(path) if _top(name) in MODEL_LIBRARIES}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules("model"), ids=_rel)
def test_model_imports_nothing_from_the_testkit(path: Path) -> None:
    bad = {name for name in _imports(path) if name.startswith("streamer.testkit")}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


def test_the_checks_see_a_lazy_testkit_import_in_the_model() -> None:
    """The model check is not vacuous: an import inside a function is caught too."""
    probe = PACKAGE / "model" / "_probe_for_layering_test.py"
    probe.write_text(
        "def build() -> object:\n"
        "    from streamer.testkit.models import ensure_random_model\n\n"
        "    return ensure_random_model\n"
    )
    try:
        with pytest.raises(AssertionError, match="streamer.testkit.models"):
            test_model_imports_nothing_from_the_testkit(probe)
    finally:
        probe.unlink()


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_ffmpeg_only_in_media(path: Path) -> None:
    if path.relative_to(PACKAGE).parts[0] == "media":
        bad = {
            name
            for name in _imports(path)
            if name.startswith(("streamer.server", "streamer.model", "streamer.cli"))
            or _top(name) in MODEL_LIBRARIES
        }
    else:
        bad = {name for name in _imports(path) if _top(name) == "av"}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_no_print_and_no_logging_configuration_outside_the_cli(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "print":
                calls.add("print")
            if isinstance(func, ast.Attribute) and func.attr in ("basicConfig", "dictConfig"):
                calls.add(func.attr)
    if path.parent == PACKAGE / "cli":
        calls.discard("basicConfig")
    assert not calls, f"{_rel(path)} calls {sorted(calls)}"


def test_the_checks_see_a_clock_read() -> None:
    """The core check is not vacuous: a module that reads the clock is caught."""
    probe = PACKAGE / "core" / "_probe_for_layering_test.py"
    probe.write_text("import time\n\nNOW = time.monotonic()\n")
    try:
        with pytest.raises(AssertionError, match="time"):
            test_core_imports_only_core_and_pure_libraries(probe)
    finally:
        probe.unlink()


def test_importing_the_core_loads_no_io_or_model_library() -> None:
    modules = [
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        for p in _modules("core")
        if p.stem != "__init__"
    ]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "bad = [m for m in ('asyncio', 'websockets', 'torch', 'funasr', 'onnxruntime', 'av')"
        " if m in sys.modules]\n" + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cli_help_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom streamer.cli import build_parser\nbuild_parser()\n"
        "print('torch' in sys.modules or 'funasr' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_subpackage_is_installed() -> None:
    """pyproject.toml lists packages by name: a new folder left out of it would be missing
    from a wheel (and from a non-editable install) although every test here passes."""
    import tomllib

    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
            "setuptools"
        ]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for init in PACKAGE.rglob("__init__.py")
    }
    assert found, "no packages found"
    assert found - listed == set(), f"not in pyproject.toml's packages: {sorted(found - listed)}"
