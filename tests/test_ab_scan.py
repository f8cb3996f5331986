"""bench/ab_scan.py: two builds of the numba kernel side by side."""

from __future__ import annotations

import shutil
import sys
import textwrap

import pytest

pytest.importorskip("numba")

from kvhit.bench import ab_scan  # noqa: E402
from kvhit.bench.workloads import TrafficConfig, generate  # noqa: E402
from kvhit.kernels import scan_numba, scan_numba_sg  # noqa: E402

_ARGS = ["--preset", "llama", "--requests", "16", "--repeats", "2"]


def _stub(tmp_path, body: str):
    path = tmp_path / "scan_stub.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_this_kernel_against_itself(capsys):
    # This checkout's file is the imported module, not a copy compiled again.
    assert ab_scan.load_scan(scan_numba.__file__) is scan_numba
    assert ab_scan.main([scan_numba.__file__, *_ARGS]) == 0
    out = capsys.readouterr().out
    assert "llama B=16, 2 rounds" in out and "other / this per round" in out


def test_compare_times_every_round():
    wl = generate("gemma3", TrafficConfig(num_requests=12, seed=3))
    c = ab_scan.compare(wl, ab_scan.load_scan(scan_numba.__file__), repeats=3)
    assert len(c.this_s) == len(c.other_s) == 3
    assert min(c.this_s + c.other_s) > 0
    mid, lo, hi = c.paired()
    assert lo <= mid <= hi


def test_a_wrong_answer_is_refused(tmp_path, capsys):
    # Every hit 7: never a multiple of llama's 16-token blocks.
    stub = _stub(
        tmp_path,
        """
        import numpy as np
        LOOKUP = 2
        def prepare_scan(*args, **kwargs):
            return None
        def scan_prepared(prep, rows, starts, lengths, n, table, mode, parallel=None):
            return np.full(starts.shape[0], 7, np.int64), None
        """,
    )
    assert ab_scan.main([str(stub), *_ARGS]) == 1
    err = capsys.readouterr().err
    assert "parity: other kernel: request 0 hit 7" in err
    assert "16 of 16 requests differ" in err


def test_bad_other_is_named(tmp_path, capsys):
    assert ab_scan.main([str(tmp_path / "missing.py"), *_ARGS]) == 2
    assert "other: " in capsys.readouterr().err
    stub = _stub(tmp_path, "LOOKUP = 2\n")
    assert ab_scan.main([str(stub), *_ARGS]) == 2
    assert "has no prepare_scan, scan_prepared" in capsys.readouterr().err


def test_bad_repeats_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        ab_scan.main([scan_numba.__file__, "--repeats", "0"])
    assert e.value.code == 2
    assert "--repeats" in capsys.readouterr().err


def test_fresh_requests_for_each_call(capsys):
    args = [scan_numba.__file__, "--preset", "llama", "--requests", "4"]
    assert ab_scan.main([*args, "--pool", "16", "--repeats", "3", "--fresh"]) == 0
    assert "llama B=4 drawn from 16 for each call, 3 rounds" in capsys.readouterr().out
    assert ab_scan.main([*args, "--pool", "16", "--repeats", "2"]) == 0
    assert "llama B=4 (the first of 16), 2 rounds" in capsys.readouterr().out
    wl = generate("llama", TrafficConfig(num_requests=16, seed=0))
    other = ab_scan.load_scan(scan_numba.__file__)
    for fresh in (False, True):
        c = ab_scan.compare(wl, other, repeats=3, batch_size=1, fresh=fresh)
        assert len(c.this_s) == len(c.other_s) == 3
    for bad in (0, 17):
        with pytest.raises(ValueError, match="batch_size must be in"):
            ab_scan.compare(wl, other, repeats=1, batch_size=bad)


def test_a_pool_smaller_than_a_call_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        ab_scan.main([scan_numba.__file__, "--requests", "8", "--pool", "4"])
    assert e.value.code == 2
    assert "--pool must be at least --requests (8), got 4" in capsys.readouterr().err


def test_the_other_kernel_imports_the_other_sg(tmp_path):
    """``--sg``: the other scan_numba.py is built on the other
    scan_numba_sg.py, and this checkout's modules are left as they were."""
    other_scan = shutil.copy(scan_numba.__file__, tmp_path / "scan_numba.py")
    other_sg = shutil.copy(scan_numba_sg.__file__, tmp_path / "scan_numba_sg.py")
    module = ab_scan.load_scan(other_scan, other_sg)
    assert module is not scan_numba
    assert module.scan_sg is sys.modules[ab_scan.OTHER_SG_MODULE].scan_sg
    assert module.scan_sg is not scan_numba_sg.scan_sg
    assert sys.modules["kvhit.kernels.scan_numba_sg"] is scan_numba_sg
    # This checkout's sg named explicitly is the default.
    assert ab_scan.load_scan(scan_numba.__file__, scan_numba_sg.__file__) is scan_numba


def test_bad_sg_is_named(tmp_path, capsys):
    missing = str(tmp_path / "missing.py")
    assert ab_scan.main([scan_numba.__file__, "--sg", missing, *_ARGS]) == 2
    assert "sg: " in capsys.readouterr().err
