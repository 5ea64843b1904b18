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
- Every module imports only what its row of docs/architecture.md's package table names in
  the "may import" column: the table is parsed from the doc, so the two cannot drift.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "streamer"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
MODEL_LIBRARIES = {
    "torch",
    "funasr",
    "onnxruntime",
    "onnx",
    "sentencepiece",
    "modelscope",
    "kaldi_native_fbank",
}
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


@dataclass(frozen=True)
class MayImport:
    """One row of the package table: what the modules it covers may import."""

    row: str  # the row's first cell, e.g. "streamer/core/" or "streamer/errors.py"
    anything: bool  # "anything" / "everything": not restricted
    version: bool  # `streamer`: ``from streamer import __version__``
    internal: frozenset[str]  # dotted names under streamer: "streamer.core", "streamer.errors"
    third_party: frozenset[str]  # import names: "numpy", "websockets"

    def allows(self, name: str, own: str) -> bool:
        """Whether a module of this row (``own``: its folder or its own dotted name) may
        import ``name`` (an absolute dotted name as :func:`_imports` gives it)."""
        top = _top(name)
        if self.anything or top == "__future__" or top in sys.stdlib_module_names:
            return True
        if top != "streamer":
            return top in self.third_party
        if name == "streamer" or name == own or name.startswith(own + "."):
            return True  # the package itself (a ``from streamer... import`` base) or its own
        if name.startswith("streamer.__"):  # ``from streamer import __version__``
            return self.version
        for allowed in self.internal:
            if name == allowed or name.startswith(allowed + "."):
                return True
            if allowed.startswith(name + "."):  # the base of ``from streamer.model import worker``
                return True
        return False


def _may_import_cell(row: str, cell: str) -> MayImport:
    words = cell.strip().lower()
    allowed = cell.split(";", 1)[0]
    internal, third_party, version = set(), set(), False
    for token in re.findall(r"`([^`]+)`", allowed):
        path = PACKAGE / token.strip("/")
        if token == "streamer":
            version = True
        elif "/" in token:
            assert path.is_dir() or path.with_suffix(".py").is_file(), (
                f"the row {row} names {token}, which is not in streamer/"
            )
            internal.add("streamer." + token.strip("/").replace("/", "."))
        elif path.with_suffix(".py").is_file() or path.is_dir():
            internal.add(f"streamer.{token}")
        else:
            third_party.add(token)
    return MayImport(
        row=row,
        anything=words.startswith(("anything", "everything")),
        version=version,
        internal=frozenset(internal),
        third_party=frozenset(third_party),
    )


def may_import_table(text: str | None = None) -> dict[str, MayImport]:
    """docs/architecture.md's package table: ``{"core/": ..., "errors.py": ...}`` (paths
    under streamer/), read from the rows whose first cell names something in streamer/."""
    lines = (text if text is not None else ARCHITECTURE.read_text(encoding="utf-8")).splitlines()
    start = lines.index("| folder | owns | may import |")
    table: dict[str, MayImport] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a package-table row without three cells: {line[:80]}"
        name = cells[0].strip("`")
        if name.startswith("streamer/"):
            table[name.removeprefix("streamer/")] = _may_import_cell(name, cells[2])
    return table


def _row_for(path: Path, table: dict[str, MayImport]) -> tuple[MayImport | None, str]:
    """The row covering ``path`` (its deepest folder's that has one) and the dotted name its
    own imports start with: that folder's, or the module's own where the folder is split
    into rows of its own (``model/``: its top modules may import only what their row names,
    not every sub-folder's)."""
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return table.get(rel.name), f"streamer.{rel.stem}"
    folders = rel.parts[:-1]
    for depth in range(len(folders), 0, -1):
        key = "/".join(folders[:depth]) + "/"
        if key in table:
            split = any(other != key and other.startswith(key) for other in table)
            own = folders[:depth] + ((rel.stem,) if split and depth == len(folders) else ())
            return table[key], "streamer." + ".".join(own)
    return None, "streamer." + ".".join(folders)


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
        elif top != "__future__" and top not in may_import_table()["core/"].third_party:
            bad.add(name)
    assert not bad, f"{_rel(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_every_module_imports_only_what_its_row_of_the_architecture_table_names(
    path: Path,
) -> None:
    row, own = _row_for(path, may_import_table())
    assert row is not None, (
        f"{_rel(path)} has no row in docs/architecture.md's package table ('Who owns what')"
    )
    bad = {name for name in _imports(path) if not row.allows(name, own)}
    assert not bad, (
        f"{_rel(path)} imports {sorted(bad)}, which its row ({row.row}) in "
        "docs/architecture.md does not name under 'may import'"
    )


def test_the_table_is_read_from_the_doc() -> None:
    """Every folder of the package has a row, and the rows say what the doc says."""
    table = may_import_table()
    folders = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders <= set(table), f"folders without a row: {sorted(folders - set(table))}"
    core, server = table["core/"], table["server/"]
    assert core.internal == {"streamer.core", "streamer.errors"}
    assert {"numpy", "soxr", "webrtcvad", "orjson"} == core.third_party
    assert "torch" not in core.third_party  # named after the ';', as a ban
    assert {"streamer.model.serving.worker", "streamer.media"} <= server.internal
    assert {"websockets", "h11", "multipart"} <= server.third_party
    assert table["testkit/"].anything and table["cli/"].anything
    assert server.version and not core.version
    assert not table["errors.py"].internal and not table["errors.py"].third_party
    model = PACKAGE / "model"
    subfolders = {f"model/{p.name}/" for p in model.iterdir() if (p / "__init__.py").exists()}
    assert subfolders <= set(table), f"model/ folders without a row: {subfolders - set(table)}"
    assert "streamer.model.serving" not in table["model/decode/"].internal


def test_a_model_folder_may_import_only_what_its_own_row_names() -> None:
    """The model's folders are checked row by row: decoding that imports the worker, or a
    top module of model/ that imports a backend, fails."""
    decode_probe = PACKAGE / "model" / "decode" / "_probe_for_layering_test.py"
    top_probe = PACKAGE / "model" / "_probe_for_layering_test.py"
    decode_probe.write_text("from streamer.model.serving.worker import ModelWorker\n")
    top_probe.write_text("from streamer.model.backends.loading import LoadProgress\n")
    try:
        with pytest.raises(AssertionError, match=r"streamer\.model\.serving\.worker"):
            test_every_module_imports_only_what_its_row_of_the_architecture_table_names(
                decode_probe
            )
        with pytest.raises(AssertionError, match=r"streamer\.model\.backends\.loading"):
            test_every_module_imports_only_what_its_row_of_the_architecture_table_names(top_probe)
    finally:
        decode_probe.unlink()
        top_probe.unlink()


def test_the_table_check_catches_an_import_its_row_does_not_name() -> None:
    """Not vacuous: media importing the server, or a library its row does not name, fails,
    and naming it in the doc's cell is what makes it pass."""
    probe = PACKAGE / "media" / "_probe_for_layering_test.py"
    probe.write_text(
        "def leak() -> object:\n"
        "    from streamer.server.admission import Admission\n"
        "    import requests\n\n"
        "    return Admission, requests\n"
    )
    try:
        with pytest.raises(AssertionError, match=r"requests.*streamer\.server\.admission"):
            test_every_module_imports_only_what_its_row_of_the_architecture_table_names(probe)
        doc = ARCHITECTURE.read_text(encoding="utf-8").replace(
            "| `core/`, `errors`, `av` (FFmpeg), `numpy`,",
            "| `core/`, `errors`, `av` (FFmpeg), `numpy`, `server/`, `requests`,",
        )
        row, own = _row_for(probe, may_import_table(doc))
        assert row is not None
        assert all(row.allows(name, own) for name in _imports(probe))
    finally:
        probe.unlink()


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


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(folder: str) -> dict[str, set[str]]:
    """The modules under ``folder`` and which of them each imports (at the top, inside a
    function or for type checking alike); a package's ``__init__`` is not a node."""
    modules = {_module_name(p): p for p in _modules(folder) if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            while imported and imported not in modules:  # a name in a module: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or around a circle (the strongly
    connected components of more than one module, Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_model_has_no_import_circle() -> None:
    """Issue 35: each module of streamer/model/ sits above what it imports (``ctc_beam``
    and ``decoding`` imported each other, with ``hotword_graphs`` and ``options``)."""
    graph = import_graph("model")
    assert len(graph) > 30 and graph["streamer.model.serving.worker"]
    assert import_circles(graph) == []


def test_the_circle_check_finds_a_circle() -> None:
    """Not vacuous: a circle of three, with a module outside it, is found (only it)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


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


# Issue 34: the server drives websockets' documented sans-I/O protocol itself: nothing
# under streamer/server imports websockets' asyncio server (the client side may).
@pytest.mark.parametrize("path", _modules("server"), ids=_rel)
def test_the_server_imports_no_websockets_asyncio_server(path: Path) -> None:
    imports = _imports(path)
    assert not {n for n in imports if n.startswith("websockets.asyncio")}, _rel(path)


def test_the_websocket_is_websockets_sans_io_protocol() -> None:
    assert "websockets.server.ServerProtocol" in _imports(PACKAGE / "server" / "websocket.py")


# ... and touches websockets only through its documented API (the reference pages of
# websockets.readthedocs.io: sans-I/O server and common, HTTP/1.1 objects, data
# structures, exceptions, types), so that a websockets release cannot break the port
# through an internal it changed.
WEBSOCKETS_DOCUMENTED = {
    "websockets.server": {"ServerProtocol"},
    "websockets.protocol": {"State"},
    "websockets.frames": {"Frame", "Opcode"},
    "websockets.http11": {"Request", "Response"},
    "websockets.datastructures": {"Headers", "MultipleValuesError"},
    "websockets.exceptions": {"ConnectionClosed", "ConnectionClosedError"},
    "websockets.typing": {"Subprotocol"},
}
# ServerProtocol's documented members (reference/sansio/server and common)
SERVER_PROTOCOL_API = {
    "receive_data",
    "receive_eof",
    "accept",
    "reject",
    "send_response",
    "send_continuation",
    "send_text",
    "send_binary",
    "send_close",
    "send_ping",
    "send_pong",
    "fail",
    "events_received",
    "data_to_send",
    "close_expected",
    "state",
    "handshake_exc",
    "close_code",
    "close_reason",
    "close_exc",
    "id",
    "logger",
}


def _websockets_imports(tree: ast.AST) -> set[tuple[str, str]]:
    """(module, name) of every ``import websockets...`` / ``from websockets... import``."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(a.name, "*") for a in node.names if _top(a.name) == "websockets"}
        elif isinstance(node, ast.ImportFrom) and _top(node.module or "") == "websockets":
            found |= {(node.module or "", a.name) for a in node.names}
    return found


def _undocumented_websockets_uses(source: str) -> list[str]:
    """What ``source`` (a server module) takes of websockets beyond its documented API:
    an import not in :data:`WEBSOCKETS_DOCUMENTED` (a module imported whole counts: its
    attributes cannot be checked), an attribute of a ``protocol`` (the ServerProtocol)
    not in :data:`SERVER_PROTOCOL_API`, a private attribute of anything but ``self``."""
    tree = ast.parse(source)
    imported = _websockets_imports(tree)
    found = [
        f"import {module}.{name}"
        for module, name in sorted(imported)
        if name not in WEBSOCKETS_DOCUMENTED.get(module, set())
    ]
    # ``x.protocol`` is a WebSocket's ServerProtocol; a bare ``protocol`` is one only
    # where ServerProtocol is imported (elsewhere: an asyncio protocol, core.protocol)
    bare_is_websockets = ("websockets.server", "ServerProtocol") in imported
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        owner_name = (
            owner.attr
            if isinstance(owner, ast.Attribute)
            else owner.id
            if isinstance(owner, ast.Name)
            else ""
        )
        is_websockets = isinstance(owner, ast.Attribute) or bare_is_websockets
        if owner_name == "protocol" and is_websockets and node.attr not in SERVER_PROTOCOL_API:
            found.append(f"protocol.{node.attr} (line {node.lineno})")
        if (
            node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls"))
        ):
            found.append(f"{owner_name}.{node.attr} (line {node.lineno})")
    return found


@pytest.mark.parametrize("path", _modules("server"), ids=_rel)
def test_the_server_uses_only_websockets_documented_api(path: Path) -> None:
    assert _undocumented_websockets_uses(path.read_text(encoding="utf-8")) == []


def test_the_websockets_api_check_sees_what_the_old_main_port_did() -> None:
    # what server/main_port.py and server/reads.py did before issue 34
    source = (
        "from websockets.asyncio.server import ServerConnection\n"
        "import websockets.legacy.server\n"
        "from websockets.protocol import SEND_EOF\n"
        "tasks = server._handler_tasks\n"
        "self.protocol.parser = None\n"
        "connection.recv_messages._pause = None\n"
    )
    assert _undocumented_websockets_uses(source) == [
        "import websockets.asyncio.server.ServerConnection",
        "import websockets.legacy.server.*",
        "import websockets.protocol.SEND_EOF",
        "server._handler_tasks (line 4)",
        "protocol.parser (line 5)",
        "recv_messages._pause (line 6)",
    ]
