"""``kvhit demo`` / ``kvhit bench`` on tiny configurations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvhit import __version__, cli

TINY_DEMO = [
    "demo",
    "--preset",
    "llama",
    "--requests",
    "24",
    "--min-tokens",
    "32",
    "--max-tokens",
    "512",
    "--repeats",
    "1",
    "-q",
]
TINY_BENCH = [
    "bench",
    "--presets",
    "llama,qwen3-next",
    "--batch-sizes",
    "1,8",
    "--min-tokens",
    "32",
    "--max-tokens",
    "512",
    "--repeats",
    "1",
    "-q",
]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_via_python_m() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvhit", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0
    assert "--preset" in res.stdout and "dsv4-flash" in res.stdout


def test_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(TINY_DEMO) == 0
    out = capsys.readouterr().out
    for row in (
        "preset",
        "backend",
        "device",
        "requests",
        "hit / num_tokens",
        "served from store",
        "batch latency",
        "lookups/s",
        "speedup",
        "parity",
    ):
        assert row in out, row
    assert "llama" in out


def test_demo_check_all_dsv4(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY_DEMO, "--check-all", "--preset", "dsv4-flash", "--max-tokens", "2048"]
    assert cli.main(argv) == 0
    assert "24/24 checked requests match" in capsys.readouterr().out


def test_demo_falls_back_to_reference_without_engine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "engine_available", lambda: "engine not built")
    assert cli.main(TINY_DEMO) == 0
    out = capsys.readouterr().out
    assert "reference (fallback: engine not importable)" in out


def _corrupt_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every runner's answer off by one token for every request, so a
    mismatch shows whatever sample the CLI checks."""
    real = cli.make_runner

    def corrupted(workload, backend, device):
        runner = real(workload, backend, device)
        good = runner.run
        runner.run = lambda: [int(h) + 1 for h in good()]
        return runner

    monkeypatch.setattr(cli, "make_runner", corrupted)


def test_demo_mismatch_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _corrupt_runners(monkeypatch)
    assert cli.main(TINY_DEMO) == cli.EXIT_MISMATCH
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "reference=" in err


def test_bench_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    argv = [*TINY_BENCH, "--reference-cap", "1", "--json", str(out_json)]
    assert cli.main(argv) == 0
    data = json.loads(out_json.read_text())
    assert data["environment"]["torch"]
    rows = data["results"]
    assert {r["preset"] for r in rows} == {"llama", "qwen3-next"}
    assert {r["batch_size"] for r in rows} == {1, 8}
    ref8 = [r for r in rows if r["backend"] == "reference" and r["batch_size"] == 8]
    # Above the cap the reference is extrapolated, and says so.
    assert ref8 and all(r["reference_estimated"] for r in ref8)
    assert all(r["parity_checked"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert "lookups/s" in table and "x ref" in table


def test_bench_mismatch_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if cli.engine_available() is not None:
        pytest.skip("needs the engine: the reference cannot disagree with itself")
    _corrupt_runners(monkeypatch)
    assert cli.main(TINY_BENCH) == cli.EXIT_MISMATCH
    assert "MISMATCH" in capsys.readouterr().err


def test_bench_plot_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A None entry makes `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = cli.main([*TINY_BENCH, "--plot", str(tmp_path / "p.png")])
    assert rc == cli.EXIT_MISSING_DEP
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install" in err
    assert not (tmp_path / "p.png").exists()


def test_bench_plot_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    argv = [*TINY_BENCH, "--presets", "llama", "--plot", str(png)]
    assert cli.main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--preset", "nope"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "--backends", "cuda-magic"])
    assert cli.main(["demo", "--min-tokens", "600", "--max-tokens", "500"]) == 2


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    assert "demo" in capsys.readouterr().out
