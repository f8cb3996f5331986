"""What README.md promises a newcomer, checked (issue 35): the five-line API
runs as written, the connector's configuration is valid JSON, the two set-up
commands, the install extras, the LICENSE, and that nothing puts the
checkout root (with its kernels/ folder) on sys.path."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _pyproject() -> dict:
    if tomllib is None:
        import pytest

        pytest.skip("tomllib needs Python >= 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_api_in_five_lines_runs_as_written() -> None:
    # Regression: "API in five lines" was 11 lines and did not run.
    code = _blocks(_section("API in five lines"), "python")[0]
    lines = [ln for ln in code.splitlines() if ln.strip()]
    assert len(lines) <= 5, lines
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    # The comment says what it prints.
    assert out.getvalue().strip() == "tensor([32, 16])"
    assert "tensor([32, 16])" in lines[-1]


def test_exactly_two_set_up_commands() -> None:
    (block,) = _blocks(_section("Two commands"), "bash")
    commands = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip()]
    assert commands == ["make demo", "make test"]


def test_the_connector_configuration_is_valid_json() -> None:
    # Regression: {...as for MooncakeStoreConnector...} was not JSON and named
    # no Mooncake key.
    text = _section("Using kvhit from vLLM")
    block = _blocks(text, "bash")[0]
    store = json.loads(re.search(r"<<'JSON'\n(.*?)\nJSON\n", block, re.S)[1])
    for key in ("metadata_server", "master_server_address", "protocol"):
        assert key in store
    config = json.loads(re.search(r"--kv-transfer-config '(.*?)'", block, re.S)[1])
    assert config["kv_connector"] == "KvhitMooncakeStoreConnector"
    assert config["kv_connector_module_path"] == "kvhit.bindings.vllm_connector"
    assert isinstance(config["kv_connector_extra_config"], dict)
    assert "MOONCAKE_CONFIG_PATH=" in block
    assert "VLLM_PLUGINS" in text and "kvhit_connector" in text
    entry = _pyproject()["project"]["entry-points"]["vllm.general_plugins"]
    assert "kvhit_connector" in entry


def test_install_extras_and_requirements() -> None:
    project = _pyproject()["project"]
    assert project["requires-python"] == ">=3.10"
    core = " ".join(project["dependencies"])
    # Regression: a CPU install pulled triton (about 1 GB) it cannot use.
    assert "triton" not in core
    extras = project["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["cuda"])
    for extra in ("cuda", "store", "events", "peers", "plot", "test"):
        assert extra in extras and f"`{extra}`" in _section("Install"), extra
    install = _section("Install")
    assert "Python >= 3.10" in install and "pip install" in install


def test_the_license_file_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert _pyproject()["project"]["license"] == {"text": "Apache-2.0"}


def test_the_checkout_root_is_not_on_sys_path() -> None:
    # Regression: pytest's rootdir (and `python -c` from the checkout) put the
    # checkout first on sys.path, so its kernels/ folder shadowed the
    # `kernels` package newer transformers imports.
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin:
        assert ROOT not in Path(spec.origin).resolve().parents, spec.origin
    on_path = [str(Path(p).resolve()) for p in sys.path if p]
    assert str(ROOT) not in on_path, "run Python with PYTHONSAFEPATH=1 (make test does)"
    pyproject = _pyproject()["tool"]["pytest"]["ini_options"]
    assert "--import-mode=importlib" in pyproject["addopts"]
    makefile = (ROOT / "Makefile").read_text()
    assert "export PYTHONSAFEPATH = 1" in makefile
    assert "export PYTHONSAFEPATH=1" in (ROOT / ".ci" / "run").read_text()


def test_no_benchmark_loads_tests_by_path() -> None:
    # benchmarks/ find tests/ helpers through pytest's pythonpath (or
    # PYTHONPATH=tests), never by a path written in the code.
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value.rstrip("/") != "tests", path
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (
                    isinstance(node.value, ast.Name) and node.value.id == "sys"
                ), f"{path}:{node.lineno} touches sys.path"
    # The suites left the shipped package.
    assert not list((ROOT / "bench").glob("bench_engine.py"))
    assert not (ROOT / "bench" / "conftest.py").exists()
