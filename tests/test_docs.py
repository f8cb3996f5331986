"""ARCHITECTURE.md and CONTRIBUTING.md held to the code (issue 36, item 6).

What the two documents say that a parser can check cheaply, checked from the
sources (parsed, never imported, but for one small subprocess):

- every file path they name exists, and every ``module.name`` or
  ``Class.member`` they name in backticks is defined there;
- the order inside ``coordinator/`` (ARCHITECTURE.md): each module imports
  only modules before it, type-only imports included, and the order names
  every module;
- the environment variables the package reads, with their defaults;
- which modules import vLLM, which branch on spec types, which numba modules
  lock the cache, and that the scalar oracle imports no torch;
- every product module is named in ARCHITECTURE.md, and every module of
  ``coordinator/``, ``kernels/`` and ``bindings/`` in CONTRIBUTING.md's
  "Where code goes".
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCH = (ROOT / "ARCHITECTURE.md").read_text()
CONTRIB = (ROOT / "CONTRIBUTING.md").read_text()
DOCS = {"ARCHITECTURE.md": ARCH, "CONTRIBUTING.md": CONTRIB}
#: The package's folders (pyproject's package-dir) and the benchmark scripts.
FOLDERS = ("kvhit", "kernels", "coordinator", "bindings", "bench")


def _modules(folder: str) -> dict[str, Path]:
    """Stem -> path of each module of ``folder`` (``__init__`` aside)."""
    return {
        p.stem: p for p in sorted((ROOT / folder).glob("*.py")) if p.stem != "__init__"
    }


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _section(text: str, title: str) -> str:
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


# -- names and paths -----------------------------------------------------------


def _defined(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body binds (defs, classes, assignments,
    imports, annotated fields), ``if``/``try`` blocks included."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        for field in ("body", "orelse", "finalbody", "handlers"):
            child = getattr(node, field, None)
            if isinstance(child, list) and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                names |= _defined([c for c in child if isinstance(c, ast.stmt)])
    return names


@cache
def _namespaces() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module stem -> its top-level names, class name -> its members) over the
    package's modules (a class's fields, annotated names, count)."""
    modules: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).glob("*.py")):
            tree = _tree(path)
            modules.setdefault(path.stem, set()).update(_defined(tree.body))
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, set()).update(_defined(node.body))
    return modules, classes


def _dotted_refs(text: str) -> list[str]:
    """Backticked ``a.b`` / ``a.b.c`` names (a call's ``()`` dropped)."""
    refs = []
    for tok in _backticked(text):
        tok = tok.removesuffix("()")
        if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", tok):
            refs.append(tok)
    return refs


def _unknown_refs(text: str) -> list[str]:
    modules, classes = _namespaces()
    bad = []
    for ref in _dotted_refs(text):
        parts = ref.split(".")
        if parts[0] == "kvhit":
            # kvhit.<folder>.<module>[.name]
            if len(parts) >= 3 and parts[1] in FOLDERS[1:]:
                if parts[2] not in _modules(parts[1]):
                    bad.append(ref)
                elif len(parts) >= 4 and parts[3] not in modules[parts[2]]:
                    bad.append(ref)
            continue
        head, name = parts[0], parts[1]
        if head in modules and not re.fullmatch(r"(py|sh|md|toml|jsonl|gz)", name):
            if name not in modules[head]:
                bad.append(ref)
            elif len(parts) > 2 and name in classes and parts[2] not in classes[name]:
                bad.append(ref)
        elif head in classes and name not in classes[head]:
            bad.append(ref)
    return bad


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_named_module_attribute_exists(doc):
    bad = _unknown_refs(DOCS[doc])
    assert not bad, f"{doc} names what the code does not define: {bad}"


def test_the_name_check_sees_a_stale_name():
    assert _unknown_refs("`engine.BACKEND_CLASSES`, `HashBatch.from_trusted`") == []
    assert _unknown_refs("`engine.NO_SUCH`, `HashBatch.nope`") == [
        "engine.NO_SUCH",
        "HashBatch.nope",
    ]
    assert _unknown_refs("`kvhit.coordinator.nothing`") == ["kvhit.coordinator.nothing"]
    assert _names_module("`coordinator/backend.py`", "backend")
    assert not _names_module("`numba_backend.py`, the backend", "backend")
    assert _unknown_refs("`scan_torch.TorchScanner.nope`") == [
        "scan_torch.TorchScanner.nope"
    ]


def _paths(text: str) -> set[str]:
    found = set()
    for tok in _backticked(text):
        for m in re.finditer(r"(?<![\w/.])((?:\.?[\w-]+/)+[\w.-]*)", tok):
            path = m.group(1)
            if "<" in tok or path.startswith(("vllm/", "http")) or "*" in path:
                continue
            found.add(path)
    return found


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_named_path_exists(doc):
    paths = _paths(DOCS[doc])
    assert "kernels/contract.py" in paths or doc == "CONTRIBUTING.md"
    bad = sorted(p for p in paths if not _path_exists(p))
    assert not bad, f"{doc} names paths that do not exist: {bad}"


def _path_exists(path: str) -> bool:
    """``path`` exists, or is ``folder/module.name`` (a name ``module``
    defines, as ``coordinator/backend.auto_backend``)."""
    if (ROOT / path).exists():
        return True
    m = re.fullmatch(r"(.*/)(\w+)\.(\w+(?:\.\w+)*)", path)
    if m is None or not (ROOT / f"{m[1]}{m[2]}.py").exists():
        return False
    return not _unknown_refs(f"`{m[2]}.{m[3]}`")


# -- every module named --------------------------------------------------------


def _names_module(text: str, stem: str) -> bool:
    """``text`` names module ``stem``: ``stem.py``, `` `stem` `` or a dotted
    ``....stem`` / ``stem.name`` in backticks."""
    return bool(
        re.search(rf"(?<!\w){stem}\.py\b", text)
        or re.search(rf"`([\w.]+\.)?{stem}(\.[\w.]+)?`", text)
    )


def test_architecture_names_every_module():
    # coordinator/: the order block names each (its own test).
    missing = [
        f"{folder}/{stem}.py"
        for folder in ("kvhit", "kernels", "bindings", "bench", "benchmarks")
        for stem in _modules(folder)
        if stem != "__main__" and not _names_module(ARCH, stem)
    ]
    assert not missing, f"ARCHITECTURE.md does not name {missing}"


def test_contributing_places_every_module():
    where = _section(CONTRIB, "## Where code goes")
    missing = [
        f"{folder}/{stem}.py"
        for folder in ("coordinator", "kernels", "bindings")
        for stem in _modules(folder)
        if not _names_module(where, stem)
    ]
    assert not missing, f'CONTRIBUTING.md\'s "Where code goes" leaves out {missing}'


# -- the order inside coordinator/ ----------------------------------------------


def _coordinator_order() -> list[list[str]]:
    """The tiers of ARCHITECTURE.md's order block (``a -> b, c -> d``)."""
    start = ARCH.index("```\n", ARCH.index("Inside `coordinator/`")) + 4
    block = ARCH[start : ARCH.index("\n```", start)]
    tiers = [t.strip() for t in " ".join(block.split()).split("->")]
    return [[m.strip() for m in t.split(",")] for t in tiers]


def _coordinator_imports(stem: str) -> set[str]:
    """The coordinator modules ``stem`` imports, anywhere, type-only too."""
    found = set()
    for node in ast.walk(_tree(ROOT / "coordinator" / f"{stem}.py")):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1:
                mod = f"kvhit.coordinator.{mod}" if mod else "kvhit.coordinator"
            names = [mod + "." + a.name for a in node.names] + [mod]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["kvhit", "coordinator"] and len(parts) > 2:
                found.add(parts[2])
    return found & set(_modules("coordinator")) - {stem}


def test_the_coordinator_order_names_every_module_once():
    listed = [m for tier in _coordinator_order() for m in tier]
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == set(_modules("coordinator"))


def test_each_coordinator_module_imports_only_modules_before_it():
    rank = {m: i for i, tier in enumerate(_coordinator_order()) for m in tier}
    bad = [
        f"{m} imports {dep}"
        for m in rank
        for dep in sorted(_coordinator_imports(m))
        if rank[dep] >= rank[m]
    ]
    assert not bad, "\n".join(bad)


# -- environment variables ---------------------------------------------------------


def _env_table() -> dict[str, str]:
    """Variable -> default, from ARCHITECTURE.md's table."""
    start = ARCH.index("Environment variables read by the package")
    rows = re.findall(r"^\| `(KVHIT_\w+)` \| ([^|]+) \|", ARCH[start:], flags=re.M)
    return {name: default.strip() for name, default in rows}


def _env_reads() -> dict[str, object]:
    """Each ``KVHIT_*`` name the package's Python code holds as a string of its
    own (not inside a message), with a literal default where a call
    ``f("NAME", default)`` gives one (else None)."""
    found: dict[str, object] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).glob("*.py")):
            tree = _tree(path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if re.fullmatch(r"KVHIT_[A-Z0-9_]+", node.value):
                        found.setdefault(node.value, None)
                if (
                    isinstance(node, ast.Call)
                    and len(node.args) >= 2
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and node.args[0].value.startswith("KVHIT_")
                    and isinstance(node.args[1], ast.Constant)
                ):
                    found[node.args[0].value] = node.args[1].value
    return found


def test_the_environment_table_lists_what_the_package_reads():
    table, reads = _env_table(), _env_reads()
    assert set(table) == set(reads), (sorted(table), sorted(reads))
    for name, default in reads.items():
        if default is not None:
            assert table[name] == str(default), (name, table[name], default)


# -- who imports vLLM, who branches on spec types -------------------------------------


def _imports_top(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_only_the_connector_modules_import_vllm():
    # ARCHITECTURE.md "Layers", CONTRIBUTING.md "Where code goes".
    importing = {
        f"{folder}/{stem}.py"
        for folder in FOLDERS
        for stem, path in _modules(folder).items()
        if "vllm" in _imports_top(path)
    }
    assert importing == {
        "bindings/vllm_connector.py",
        "bindings/vllm_lookup_server.py",
        "bindings/vllm_wire.py",
    }


SPEC_CLASSES = {"FullAttention", "SlidingWindow", "Mamba", "ChunkedLocal", "SPEC_TYPES"}


def _branches_on_spec_types(path: Path) -> bool:
    for node in ast.walk(_tree(path)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"isinstance", "issubclass"}
            and len(node.args) == 2
        ):
            names = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, (ast.Name, ast.Attribute))
            }
            if names & SPEC_CLASSES:
                return True
    return False


def test_only_specs_branches_on_spec_types():
    # ARCHITECTURE.md "The spec-kind registry": the reference, ScanPlan, the
    # engine and the bindings look kinds up in coordinator/kinds.py.
    branching = {
        f"{folder}/{stem}.py"
        for folder in ("kernels", "coordinator", "bindings")
        for stem, path in _modules(folder).items()
        if _branches_on_spec_types(path)
    }
    assert branching == {"coordinator/specs.py"}


def test_every_numba_module_locks_the_cache():
    # ARCHITECTURE.md: every numba module calls lock_cache_saves() once
    # imported (CONTRIBUTING.md: right after importing numba).
    bad = []
    for stem, path in _modules("kernels").items():
        tree = _tree(path)
        top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        if "numba" not in top or stem == "numba_cache":
            continue
        calls = [
            n
            for n in tree.body
            if isinstance(n, ast.Expr)
            and isinstance(n.value, ast.Call)
            and getattr(n.value.func, "attr", getattr(n.value.func, "id", ""))
            == "lock_cache_saves"
        ]
        if not calls:
            bad.append(stem)
    assert not bad, f"numba modules without lock_cache_saves(): {bad}"


def test_the_oracle_and_the_contract_import_no_torch():
    # ARCHITECTURE.md: the reference and the managers are pure Python, no
    # torch; kernels/contract.py imports neither torch, triton nor numba.
    script = (
        "import sys\n"
        "import kvhit.coordinator.reference, kvhit.coordinator.managers\n"
        "import kvhit.kernels.contract, kvhit.kernels.masks\n"
        "heavy = {'torch', 'numpy', 'triton', 'numba'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
