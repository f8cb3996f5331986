"""bench/gpu_check.py's dry run: every step of the GPU check on the CPU at tiny
sizes, the triton lookup under the interpreter (about 15 s here)."""

from __future__ import annotations

import json

import pytest
import torch

from kvhit.bench import gpu_check


def test_dry_run_runs_every_step(capsys, tmp_path):
    argv = ["--dry-run", "--presets", "dsv4-flash,llama", "--out", str(tmp_path)]
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("### GPU check") :]
    for step in ("dsv4-flash: build", "dsv4-flash: lookup timing", "llama: parity"):
        assert f"| {step} | PASS |" in table
    assert "| KeyIndex | PASS |" in table
    # The long-hit table: every batch size, every request equal to numba's,
    # numba's thread count stated.
    assert "| long-hit: lookup | PASS |" in table
    assert "Long-hit dsv4-flash" in table and "threads = all cores" in table
    assert "| 3 | " in table and "numba 3/3" in table
    assert "| fleet | PASS |" in table and "E = 256:" in table
    assert "| dsv4-flash | " in table and "ref 4/4" in table
    # Every request of a preset against numba, not the reference's sample.
    assert "numba 4/4" in table
    assert "commit" in table and "triton" in table
    # Each step's time is printed as it ends; the smallest preset runs first.
    assert "== llama: lookup timing: PASS in " in out
    assert out.index("== llama: build") < out.index("== dsv4-flash: build")
    # Every result row reached results.jsonl, in the order it was measured.
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").open()]
    kinds = [(r["kind"], r.get("preset")) for r in rows]
    assert (
        kinds
        == [
            ("env", None),
            ("key_index", None),
            ("longhit", None),
            ("longhit", None),
            ("lookup", "llama"),
            ("parity", "llama"),
            ("lookup", "dsv4-flash"),
            ("parity", "dsv4-flash"),
        ]
        + [("fleet", None)] * 4
    )
    assert rows[4]["first_call_s"] > 0 and rows[4]["eager_s"] > 0
    assert rows[2]["B"] == 1 and rows[3]["B"] == 3 and rows[3]["numba_1_s"] > 0
    assert rows[2]["runner_s"] > 0 and "GraphRunner.lookup" in table
    assert (tmp_path / "summary.md").read_text().startswith("### GPU check")


def test_env_line_names_everything(capsys):
    assert gpu_check.main(["--env-line"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    for word in ("python", "torch", "triton", "numba", "CUDA", "driver", "GPU"):
        assert word in line
    assert "commit" in line and "triton features: all present" in line


def test_env_line_stops_on_a_missing_triton_feature(capsys, monkeypatch):
    from kvhit.kernels import launch

    monkeypatch.setattr(launch, "missing_features", lambda: ["atomic_or(sem)"])
    assert gpu_check.main(["--env-line"]) == 2
    out = capsys.readouterr().out
    assert "triton features: missing: atomic_or(sem)" in out.splitlines()[0]
    assert "FAIL: triton" in out and "needs triton >= 3.6" in out


def test_a_spent_budget_skips_the_remaining_steps(capsys):
    cfg = gpu_check.Config(
        **{**gpu_check.Config.dry(("llama",)).__dict__, "budget_s": 0.0}
    )
    report = gpu_check.run(cfg)
    # KeyIndex, long-hit build, preset build, fleet
    assert [s[1] for s in report.steps] == ["SKIP", "SKIP", "SKIP", "SKIP"]
    assert not report.failed
    assert "| llama: build | SKIP |" in gpu_check.summary(report, cfg)


def test_parity_keeps_the_workload_index_where_it_is(monkeypatch):
    from kvhit import KeyIndex

    cfg = gpu_check.Config.dry(("llama",))
    w = gpu_check.build_workload("llama", cfg, torch.device("cpu"))
    table = w.index.table
    got = gpu_check.time_lookup(w, cfg)["result"]
    monkeypatch.setattr(KeyIndex, "to", lambda *a: pytest.fail("index moved"))
    gpu_check.check_parity(w, got, cfg)
    assert w.index.table is table


def test_parity_step_catches_a_wrong_answer():
    cfg = gpu_check.Config.dry(("llama",))
    w = gpu_check.build_workload("llama", cfg, torch.device("cpu"))
    timing = gpu_check.time_lookup(w, cfg)
    got = timing["result"]
    assert int((got > 0).sum()) > 0  # the store is not empty: hits happen
    verdict, _ = gpu_check.check_parity(w, got, cfg)
    assert verdict.startswith("ref 4/4")
    with pytest.raises(AssertionError, match="parity mismatch"):
        gpu_check.check_parity(w, got + 1, cfg)


def test_no_gpu_without_dry_run_skips(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_check.main([]) == 0
    assert "SKIP" in capsys.readouterr().out
