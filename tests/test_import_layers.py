"""Imports run downward: deploy and bench on top; router, prefill_worker, decode_worker in the middle;
engine, kv_transfer, proto at the ground. The two workers never import each other, and engine,
kv_transfer and router import ray only inside the function that needs it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GROUND = {"engine", "kv_transfer", "proto"}
MIDDLE = {"router", "prefill_worker", "decode_worker"}
TOP = {"deploy", "bench"}
MAY_NOT_IMPORT = {
    **{package: MIDDLE | TOP for package in GROUND},
    "router": TOP | {"prefill_worker", "decode_worker"},
    "prefill_worker": TOP | {"decode_worker", "router"},
    "decode_worker": TOP | {"prefill_worker", "router"},
}
NO_MODULE_LEVEL_RAY = {"engine", "kv_transfer", "router"}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level package imported, line, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    module_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], node.lineno, id(node) in module_level) for name in names]
    return found


def sources(package: str) -> list[Path]:
    generated = ("_pb2.py", "_pb2_grpc.py")
    return sorted(path for path in (ROOT / package).rglob("*.py") if not path.name.endswith(generated))


@pytest.mark.parametrize("package", sorted(MAY_NOT_IMPORT))
def test_imports_run_downward(package):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in sources(package) for name, line, _ in imports(path) if name in MAY_NOT_IMPORT[package]]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(NO_MODULE_LEVEL_RAY))
def test_ray_is_imported_only_where_it_is_used(package):
    wrong = [f"{path.relative_to(ROOT)}:{line}"
             for path in sources(package) for name, line, top in imports(path) if name == "ray" and top]
    assert not wrong, "\n".join(wrong)
