"""No test module imports another (issue 35): what several share lives in a support module.

A test module imported by another runs its module-level code (and its ``importorskip``)
in both, and couples two files that each look self-contained; the shared helpers are in
``support.py``, ``fakes.py``, ``server_fixtures.py`` and the other modules of ``tests/``
whose names do not start with ``test_``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ONCE = {"http_get", "free_port", "readyz_status"}  # each had copies in several modules


def imports_of_test_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every test module an import names, anywhere in ``tree``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            # the module itself, and each name taken from it (which may be a module too)
            names = [module] + [f"{module.rstrip('.')}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [
            (node.lineno, name)
            for name in names
            if any(part.startswith("test_") for part in name.split("."))
        ]
    return found


def test_the_checker_sees_every_form_of_import() -> None:
    source = "\n".join(
        [
            "import tests.test_a",
            "from tests.test_b import x",
            "from .test_c import y",
            "from . import test_d",
            "def f():",
            "    from tests import test_e",
            "from tests.support import http_get",
        ]
    )
    lines = sorted({line for line, _ in imports_of_test_modules(ast.parse(source))})
    assert lines == [1, 2, 3, 4, 6]


def test_no_module_of_the_tests_imports_a_test_module() -> None:
    offenders = [
        f"{path.name}:{line} imports {name}"
        for path in sorted(TESTS.glob("*.py"))
        for line, name in imports_of_test_modules(ast.parse(path.read_text()))
    ]
    assert not offenders, "move the shared helper into tests/support.py:\n" + "\n".join(offenders)


def test_the_shared_http_helpers_are_defined_once_in_the_tests() -> None:
    defined = [
        (path.name, node.name.lstrip("_"))
        for path in sorted(TESTS.glob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.lstrip("_") in ONCE
    ]
    assert sorted(defined) == [("support.py", name) for name in sorted(ONCE)]
