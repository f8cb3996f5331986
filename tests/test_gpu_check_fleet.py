"""``bench/gpu_check_fleet.py`` on the CPU (its ``--dry-run`` path at a
smaller size): every row compared and equal, the table printed, and a
mismatch caught."""

from __future__ import annotations

import torch

from kvhit.bench import gpu_check_fleet as gcf


def small() -> gcf.Config:
    return gcf.Config(presets=("llama",), engines=(1, 65), batches=(1, 3),
                      blocks=40, repeats=1, dry_run=True)  # fmt: skip


def test_dry_run_compares_every_answer(tmp_path):
    cfg = gcf.Config(**{**small().__dict__, "out_dir": str(tmp_path)})
    rows, ok = gcf.run(cfg, torch.device("cpu"))
    assert ok and len(rows) == 4 and all(r["equal"] for r in rows)
    assert [(r["engines"], r["requests"]) for r in rows] == [(1, 1), (1, 3), (65, 1),
                                                              (65, 3)]  # fmt: skip
    assert max(r["hits"] for r in rows) > 0
    assert len((tmp_path / "fleet.jsonl").read_text().splitlines()) == 4
    text = gcf.table(rows, cfg)
    assert text.count("| equal |") == 4 and "dry run" in text


def test_a_mismatch_fails_the_run(monkeypatch):
    from kvhit.coordinator.engine import LookupEngine

    real = LookupEngine.fleet_lookup

    def wrong(self, batch, num_tokens, fleet):
        out = real(self, batch, num_tokens, fleet)
        return out + 1 if fleet.backend == "triton" else out

    monkeypatch.setattr(LookupEngine, "fleet_lookup", wrong)
    cfg = gcf.Config(**{**small().__dict__, "engines": (1,), "batches": (1,)})
    rows, ok = gcf.run(cfg, torch.device("cpu"))
    assert not ok and rows[0]["equal"] is False
    assert "DIFFER" in gcf.table(rows, cfg)


def test_without_a_gpu_the_real_run_skips(capsys):
    if torch.cuda.is_available():
        return
    assert gcf.main([]) == 0
    assert "SKIP" in capsys.readouterr().out
