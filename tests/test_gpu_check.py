"""bench/gpu_check.py's dry run: every step of the GPU check on the CPU at tiny
sizes, the triton lookup under the interpreter (about 15 s here)."""

from __future__ import annotations

import pytest
import torch

from kvhit.bench import gpu_check


def test_dry_run_runs_every_step(capsys):
    assert gpu_check.main(["--dry-run", "--presets", "dsv4-flash,llama"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("### GPU check") :]
    for step in ("dsv4-flash: build", "dsv4-flash: lookup timing", "llama: parity"):
        assert f"| {step} | PASS |" in table
    assert "| KeyIndex | PASS |" in table
    assert "| dsv4-flash | " in table and "ref 4/4" in table
    assert "commit" in table and "triton" in table


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
