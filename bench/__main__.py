"""``python -m bench``: list the benchmarks; ``python -m bench NAME [ARGS]`` runs one."""

from __future__ import annotations

import ast
import pkgutil
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHES = {"__main__", "common"}  # helpers, not benchmarks


def summary(path: Path) -> str:
    """The first paragraph of a module's docstring on one line (read, not imported)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def benches() -> dict[str, str]:
    found = {}
    for module in pkgutil.iter_modules([str(HERE)]):
        if module.name in NOT_BENCHES:
            continue
        path = HERE / module.name / "__init__.py" if module.ispkg else HERE / f"{module.name}.py"
        found[module.name] = summary(path)
    return dict(sorted(found.items()))


def main(argv: list[str]) -> int:
    known = benches()
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, known))
        print("usage: python -m bench NAME [ARGS]  (or python -m bench.NAME [ARGS])\n")
        for name, line in known.items():
            print(f"  {name:<{width}}  {line}")
        print("\nEach takes --help; figures and their commands are in bench/RESULTS.md.")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in known:
        print(f"no bench named {name!r}; choose one of: {', '.join(known)}", file=sys.stderr)
        return 2
    sys.argv = [f"python -m bench.{name}", *rest]
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
