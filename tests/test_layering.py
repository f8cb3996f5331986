"""The package's layers, read from the source (ARCHITECTURE.md, "Layers").

Every module under kernels/, coordinator/, bindings/, bench/ and kvhit/ is
parsed (not imported) and each import statement found, at module level or
inside a function, is checked against the layering:

- kernels/ imports nothing from coordinator/, bindings/ or bench/;
- coordinator/ imports nothing from bindings/ or bench/;
- bindings/ import nothing from bench/ or the CLI (kvhit/'s modules), bench/
  nothing from the CLI;
- bindings/ reach kernels/ only through coordinator/ (and the one
  validation module, kernels/checks.py);
- coordinator/engine.py compares no backend name, and only
  kernels/checks.py defines check functions (a short list of reasoned
  exceptions aside);
- nothing in the package imports from tests/ (nor puts tests/ on sys.path);
- the graph of kvhit's modules, drawn from every import that runs (at module
  level or inside a function: a function-level import only hides a cycle),
  has no cycle, and none either with the imports under ``if TYPE_CHECKING``;
- coordinator/ imports neither triton nor numba at module level, not even
  through a kernels/ module it imports at module level;
- no module imports another's underscore names, and no product module is
  over MAX_MODULE_LINES lines.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: folder -> the package it is installed as (pyproject's package-dir).
PACKAGES = {
    "kvhit": "kvhit",
    "kernels": "kvhit.kernels",
    "coordinator": "kvhit.coordinator",
    "bindings": "kvhit.bindings",
    "bench": "kvhit.bench",
}
TEST_MODULES = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests"}
#: Package files allowed to reach tests/ (a module name -> the tests/ modules
#: it imports): none. The benchmark scripts that start the real-store
#: fixtures live in benchmarks/, out of the package, and find tests/ through
#: PYTHONPATH=tests or pytest's pythonpath.
CHECKOUT_SCRIPTS: dict[str, set[str]] = {}


@dataclass(frozen=True)
class Import:
    target: str  # the imported module (absolute, dotted)
    line: int
    at_import_time: bool  # module level and outside ``if TYPE_CHECKING``
    type_only: bool = False  # under ``if TYPE_CHECKING``: never runs


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    stem = [] if rel.stem == "__init__" else [rel.stem]
    return ".".join([PACKAGES[rel.parts[0]], *rel.parts[1:-1], *stem])


def _all_modules() -> dict[str, Path]:
    out = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _all_modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_pkg = MODULES.get(module, Path()).name == "__init__.py"
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.Module) -> list[Import]:
    found: list[Import] = []

    def visit(nodes: list[ast.stmt], top: bool, typing: bool = False) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(
                    Import(a.name, node.lineno, top, typing) for a in node.names
                )
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                for a in node.names:
                    # ``from pkg import mod`` imports the submodule pkg.mod.
                    sub = f"{base}.{a.name}"
                    target = sub if sub in MODULES else base
                    found.append(Import(target, node.lineno, top, typing))
            elif isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.body, False, True)
                visit(node.orelse, top, typing)
            elif isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                # A class body runs at import time; a function body does not.
                visit(node.body, top and isinstance(node, ast.ClassDef), typing)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    child = getattr(node, field, None)
                    if isinstance(child, list):
                        body = [c for c in child if isinstance(c, ast.AST)]
                        visit(body, top, typing)

    visit(tree.body, True)
    return found


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


IMPORTS = {m: _imports(m, _parse(p)) for m, p in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in {
        "kernels", "coordinator", "bindings", "bench",
    } else "kvhit"  # fmt: skip


def _in(target: str, layer: str) -> bool:
    return target == f"kvhit.{layer}" or target.startswith(f"kvhit.{layer}.")


def _imports_of(layer: str, is_bad: Callable[[Import], bool]) -> list[str]:
    """``module:line imports target`` for each import in ``layer`` that
    ``is_bad``."""
    return [
        f"{m}:{i.line} imports {i.target}"
        for m, imports in IMPORTS.items()
        if _layer(m) == layer
        for i in imports
        if is_bad(i)
    ]


def test_every_folder_is_read():
    layers = {_layer(m) for m in MODULES}
    assert layers == {"kvhit", "kernels", "coordinator", "bindings", "bench"}
    assert "kvhit.coordinator.reference" in MODULES
    assert any(
        i.target == "kvhit.kernels.contract" for i in IMPORTS["kvhit.kernels.scan"]
    )


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("kernels", ("coordinator", "bindings", "bench")),
        ("coordinator", ("bindings", "bench")),
    ],
)
def test_lower_layers_do_not_import_higher_ones(layer, forbidden):
    bad = _imports_of(layer, lambda i: any(_in(i.target, f) for f in forbidden))
    assert not bad, "\n".join(bad)


#: The CLI's modules (kvhit/): the top layer; the package's ``kvhit`` (its
#: ``__version__``) is read by every layer.
CLI_MODULES = ("kvhit.cli", "kvhit.commands", "kvhit.errors", "kvhit.__main__")


def test_bindings_and_bench_do_not_import_higher_layers():
    # ARCHITECTURE.md "Layers": kvhit/ (the CLI) -> bench/ -> bindings/.
    def higher(*layers: str):
        return lambda i: (
            any(_in(i.target, f) for f in layers)
            or any(i.target == m or i.target.startswith(m + ".") for m in CLI_MODULES)
        )

    bad = _imports_of("bindings", higher("bench"))
    bad += _imports_of("bench", higher())
    assert not bad, "\n".join(bad)


def test_bindings_reach_kernels_only_through_the_coordinator():
    # Except the one validation module, kernels/checks.py, which every
    # layer's public entry points check their input with (issue 36).
    bad = _imports_of(
        "bindings",
        lambda i: _in(i.target, "kernels") and i.target != "kvhit.kernels.checks",
    )
    assert not bad, "\n".join(bad)


def test_nothing_in_the_package_reaches_into_tests():
    bad = []
    for m, imports in IMPORTS.items():
        allowed = CHECKOUT_SCRIPTS.get(m, set())
        for i in imports:
            top = i.target.split(".")[0]
            if top in TEST_MODULES and top not in allowed:
                bad.append(f"{m}:{i.line} imports {i.target}")
        if m in CHECKOUT_SCRIPTS:
            continue
        for node in ast.walk(_parse(MODULES[m])):
            # A path to tests/ (``ROOT / "tests"``, ``sys.path.insert(...)``)
            # in code; docstrings and comments may name test files.
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.rstrip("/") == "tests"
            ):
                bad.append(f"{m}:{node.lineno} names the tests/ folder")
    assert not bad, "\n".join(bad)


def _module_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Each module's imports of other kvhit modules; ``type_only``: those under
    ``if TYPE_CHECKING`` too."""
    return {
        m: {
            i.target
            for i in imports
            if (type_only or not i.type_only) and i.target in MODULES
        }
        - {m}
        for m, imports in IMPORTS.items()
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = _find_cycle(_module_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycles_even_type_only():
    # Issue 36's target: 0 import circles, type-only ones included
    # (ARCHITECTURE.md, "Layers").
    cycle = _find_cycle(_module_graph(type_only=True))
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_inside_functions_are_seen():
    tree = ast.parse(
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import numba\n"
        "def f():\n    from kvhit.coordinator import reference\n"
        "try:\n    import triton\nexcept ImportError:\n    pass\n"
    )
    got = {
        (i.target, i.at_import_time, i.type_only)
        for i in _imports("kvhit.kernels.x", tree)
    }
    assert got == {
        ("os", True, False),
        ("typing", True, False),
        ("numba", False, True),
        ("kvhit.coordinator.reference", False, False),
        ("triton", True, False),
    }


def test_coordinator_imports_no_compiler_at_import_time():
    bad = _imports_of(
        "coordinator",
        lambda i: i.at_import_time and i.target.split(".")[0] in {"triton", "numba"},
    )
    assert not bad, "\n".join(bad)


def _loads_at_import(module: str) -> set[str]:
    """Every module importing ``module`` loads: its module-level imports, and
    theirs, followed through kvhit's modules."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for i in IMPORTS.get(todo.pop(), []):
            if i.at_import_time and i.target not in seen:
                seen.add(i.target)
                if i.target in MODULES:
                    todo.append(i.target)
    return seen


def test_coordinator_loads_no_compiler_through_kernels_at_import_time():
    # ARCHITECTURE.md: not even through a kernels/ module (a backend, a
    # KeyIndex, a FleetIndex or the candidate rule imports its kernel module
    # when it is built or first runs).
    bad = {
        m: sorted(
            t for t in _loads_at_import(m) if t.split(".")[0] in {"triton", "numba"}
        )
        for m in MODULES
        if _layer(m) == "coordinator"
    }
    bad = {m: ts for m, ts in bad.items() if ts}
    assert not bad, bad
    assert "numba" in _loads_at_import("kvhit.kernels.scan_numba")


def _on_a_cycle(graph: dict[str, set[str]], modules: list[str]) -> list[str]:
    """The ``modules`` that reach themselves in ``graph``."""
    bad = []
    for m in modules:
        seen, todo = set(), [m]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        if m in seen:
            bad.append(m)
    return bad


def test_no_cycle_through_the_fleet_even_type_only():
    # The fleet modules and the engine (issue 36: engine <-> fleet was a
    # circle of type-only imports): no cycle passes through them, imports
    # under ``if TYPE_CHECKING`` counted too.
    graph = _module_graph(type_only=True)
    fleet = [m for m in MODULES if "fleet" in m or m.endswith(".routing")]
    assert "kvhit.coordinator.fleet_index" in fleet
    bad = _on_a_cycle(graph, [*fleet, "kvhit.coordinator.engine"])
    assert not bad, f"import cycles through {bad}"


# -- backends own their paths; one validation module (issue 36) --------------

#: The names LookupEngine's backends are registered by.
BACKEND_NAMES = {"numba", "triton", "torch", "reference"}


def test_the_engine_compares_no_backend_name():
    # The engine never names a backend: each backend owns its fast path
    # (BatchBackend.find_batch / lookup_batch), and "auto" and the
    # backend/device rule live in coordinator/backend.py.
    tree = _parse(MODULES["kvhit.coordinator.engine"])
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [
                s.value
                for s in sides
                if isinstance(s, ast.Constant) and s.value in BACKEND_NAMES
            ]
            if names:
                bad.append(f"engine.py:{node.lineno} compares with {names[0]!r}")
    assert not bad, "\n".join(bad)


#: Module-level check functions allowed outside kernels/checks.py, each
#: with why. Everything else that validates arguments lives in
#: kernels/checks.py. The entries marked "pending" are in files other
#: helpers own this round; they move into kernels/checks.py at merge.
CHECKS_ELSEWHERE = {
    # The backend/device rule, which lives in backend.py with auto_backend.
    ("kvhit.coordinator.backend", "check_runs_on"),
    # Checks a FleetIndex (a coordinator type kernels/ cannot name).
    ("kvhit.coordinator.fleet_index", "check_fleet"),
    # The spec-kind registry's own consistency, at import (not an argument).
    ("kvhit.coordinator.kinds", "_check_table"),
    # Not an argument: the Mooncake store's reply (its wire format), and the
    # installed vLLM release the connector reproduces.
    ("kvhit.bindings.mooncake_store", "check_answer"),
    ("kvhit.bindings.vllm_connector", "check_vllm_version"),
    # pending: kernels/scan.py, kernels/fleet_triton.py (the Triton launchers),
    # and bindings/ are other helpers' files.
    ("kvhit.kernels.scan", "_check_row_values"),
    ("kvhit.kernels.fleet_triton_bits", "check_tables"),
    ("kvhit.kernels.fleet_triton_bits", "_check_update"),
    ("kvhit.bindings.torch_ops", "_check_tensor"),
    ("kvhit.bindings.torch_ops", "_check_probe"),
    ("kvhit.bindings.torch_ops", "_check_lookup"),
    ("kvhit.bindings.mooncake_store", "_check_namespace"),
}
#: Names of the private copies the second review found (issue 36).
PRIVATE_COPIES = {"_resolve_device", "_is_int", "is_int", "_check_max_load"}


def test_only_kernels_checks_defines_check_functions():
    # One validation module: no private copies of a check (key_index.py and
    # fleet_index.py each had four; one raised another error type).
    found = set()
    for m, path in MODULES.items():
        if m == "kvhit.kernels.checks" or _layer(m) not in {
            "kernels",
            "coordinator",
            "bindings",
        }:
            continue
        for node in _parse(path).body:
            if isinstance(node, ast.FunctionDef) and (
                node.name.lstrip("_").startswith("check_")
                or node.name in PRIVATE_COPIES
            ):
                found.add((m, node.name))
    assert found <= CHECKS_ELSEWHERE, sorted(found - CHECKS_ELSEWHERE)
    # The list shrinks as copies go: an entry whose function is gone fails.
    assert CHECKS_ELSEWHERE <= found, sorted(CHECKS_ELSEWHERE - found)


def test_no_cycle_through_the_backends_even_type_only():
    # backend <-> key_index was a type-only circle (issue 36).
    graph = _module_graph(type_only=True)
    roots = [
        m
        for m in MODULES
        if m.endswith(("backend", ".key_index", ".engine", ".plan"))
        and _layer(m) == "coordinator"
    ]
    assert "kvhit.coordinator.backend" in roots
    bad = _on_a_cycle(graph, roots)
    assert not bad, f"import cycles through {bad}"


def _underscore_imports(path: Path) -> list[str]:
    """``path:line imports module._name`` for each private name ``path``
    imports from another module (dunders and ``__future__`` aside)."""
    own = path.stem
    bad = []
    for node in ast.walk(_parse(path)):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        module = node.module or ""
        if module.rsplit(".", 1)[-1] == own and not node.level:
            continue  # a module importing itself (a child process's script)
        bad.extend(
            f"{path.relative_to(ROOT)}:{node.lineno} imports {module}.{a.name}"
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")
        )
    return bad


def test_no_underscore_imports_across_modules():
    # Issue 36: a private name stays in its module; what another module needs
    # is public (the package, its tests and the benchmark scripts alike).
    paths = [*MODULES.values(), *sorted((ROOT / "tests").glob("*.py"))]
    paths += sorted((ROOT / "benchmarks").glob("*.py"))
    assert len(paths) > len(MODULES)
    bad = [b for p in paths for b in _underscore_imports(p)]
    assert not bad, "\n".join(bad)


#: The most lines a product module may have (issue 36: a module past it
#: holds two concerns; split it along a seam, as scan/scan_sg).
MAX_MODULE_LINES = 1000


def test_no_product_module_over_the_line_limit():
    long = {
        str(path.relative_to(ROOT)): n
        for folder in PACKAGES
        for path in (ROOT / folder).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long
