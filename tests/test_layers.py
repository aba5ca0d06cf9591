"""The package's dependency order, held against its imports.

Each room of `src/gobrrr` (a subpackage or a top-level module) stands on a floor; a room may
import only rooms on lower floors, so no import runs back up and no circle crosses rooms. Every
import counts, those made inside functions too. docs/architecture.md says why each room stands
where it does.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "gobrrr"

#: lowest first; rooms on one floor do not import each other
FLOORS: list[tuple[str, ...]] = [
    ("errors",),
    ("precision", "hardware", "workload", "formulas", "kernels"),
    ("graph", "models"),
    ("cost",),
    ("training", "memory", "schedule"),
    ("passes",),
    ("capture", "evaluate"),
    ("estimate",),
    ("profile",),
    ("calibrate",),
    ("plan",),
    ("report",),
    ("cli",),
    ("__main__",),
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str:
    """ "gobrrr.cost.rates" -> "cost"; "gobrrr" (the package's face) -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports() -> list[tuple[str, str, int, str]]:
    """(file, module imported, line, room of the importing file) of every gobrrr import."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent)
        here = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = (
                    [f"{node.module}.{a.name}" for a in node.names]
                    if node.module == "gobrrr"
                    else [node.module]
                )
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out += [
                (str(rel), n, node.lineno, room_of(here))
                for n in names
                if n.split(".")[0] == "gobrrr"
            ]
    return out


def test_every_room_has_a_floor():
    rooms = {
        p.stem if p.is_file() else p.name
        for p in SRC.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert rooms - set(FLOOR) == set(), "give each new room a floor in FLOORS"
    assert set(FLOOR) - rooms == set(), "FLOORS names a room that is gone"


def test_no_import_runs_back_up():
    up = [
        f"{f}:{line} ({src}, floor {FLOOR[src]}) imports {mod} (floor {FLOOR[room_of(mod)]})"
        for f, mod, line, src in imports()
        if src and room_of(mod) and room_of(mod) != src and FLOOR[room_of(mod)] >= FLOOR[src]
    ]
    assert up == []


def test_the_package_face_is_the_public_api_only():
    """`gobrrr/__init__.py` hands on the public API; nothing inside the package imports it."""
    inward = [f"{f}:{line}" for f, mod, line, src in imports() if mod == "gobrrr" and src]
    assert inward == []
