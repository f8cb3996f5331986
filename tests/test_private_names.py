"""No module imports another module's underscore names (CONTRIBUTING.md: private
means private to its module; a name another module needs is public and
documented)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kvhit", "coordinator", "kernels", "bindings", "bench", "tests")


def _sources() -> list[Path]:
    return sorted(p for f in FOLDERS for p in (ROOT / f).rglob("*.py"))


def _private_imports(path: Path) -> list[str]:
    """``file:line name`` for each underscore name imported from kvhit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvhit"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} {alias.name}")
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_imports(path: Path) -> None:
    assert _private_imports(path) == []


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvhit.coordinator.engine import _secret\n")
    assert _private_imports(bad) == ["bad.py:1 _secret"]
