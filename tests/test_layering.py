"""Dependencies point one way: the role programs (`vime.workers`) use the library; the library never
imports them, and the top-level `workers/` entry points only forward to them."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = ("vime.workers", "workers")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def is_program(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PROGRAMS)


def test_the_library_never_imports_the_role_programs() -> None:
    library = [p for p in (REPO / "vime").rglob("*.py") if "workers" not in p.relative_to(REPO / "vime").parts[:1]]
    assert len(library) > 50, "the scan found the library's modules"
    offenders = {str(p.relative_to(REPO)): sorted(m for m in imported_modules(p) if is_program(m)) for p in library}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_top_level_entry_points_only_forward() -> None:
    for path in (REPO / "workers").glob("*.py"):
        assert {m for m in imported_modules(path)} <= {"vime.workers.broker", "vime.workers.broker.main",
                                                        "vime.workers.main", "vime.workers.main.main"}, path
