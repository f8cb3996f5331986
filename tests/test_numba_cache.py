"""kernels/numba_cache.py: two processes compiling one cached function at once.

numba saves an overload by reading the function's cache index, taking a free
data-file name and writing the index back, unlocked. Here both processes are
held inside that read for a second (``_load_index`` slowed down), so without
the lock both read an empty index, both take data file 1, and the index keeps
one of the two signatures: the test fails on numba as it is.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("numba")

REPO = Path(__file__).resolve().parents[1]

# A function compiled for the argument type given on the command line, with
# numba's index reads slowed down so that two processes overlap inside a save.
_WORKER = textwrap.dedent(
    """
    import sys, time
    import numba
    from numba.core import caching

    if sys.argv[2] == "locked":
        from kvhit.kernels.numba_cache import lock_cache_saves

        assert lock_cache_saves()
    slow = caching.IndexDataCacheFile._load_index

    def _load_index(self):
        out = slow(self)
        time.sleep(1.0)
        return out

    caching.IndexDataCacheFile._load_index = _load_index

    # Both processes start compiling together.
    go = float(sys.argv[3])
    while time.time() < go:
        time.sleep(0.005)
    from cachedmod import twice

    arg = {"int": 21, "float": 1.25}[sys.argv[1]]
    print(repr(twice(arg)))
    """
)

_MODULE = textwrap.dedent(
    """
    import numba

    @numba.njit(cache=True)
    def twice(x):
        return x + x
    """
)

# In a fresh process, both signatures from the cache, nothing compiled.
_CHECK = textwrap.dedent(
    """
    from cachedmod import twice

    a, b = twice(21), twice(1.25)
    stats = twice.stats
    print(repr(a), repr(b), sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))
    """
)


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NUMBA_CACHE_DIR"] = str(tmp / "cache")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp), env.get("PYTHONPATH", "")] if env.get("PYTHONPATH") else [str(tmp)]
    )
    return env


def _race(tmp: Path, mode: str) -> list[str]:
    (tmp / "cachedmod.py").write_text(_MODULE)
    (tmp / "worker.py").write_text(_WORKER)
    go = str(time.time() + 4.0)  # after both have imported numba
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp / "worker.py"), kind, mode, go],
            env=_env(tmp),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kind in ("int", "float")
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs


def _index_entries(tmp: Path) -> dict:
    (index,) = (tmp / "cache").rglob("cachedmod.twice-*.nbi")
    with open(index, "rb") as fh:
        pickle.load(fh)  # numba's version
        _stamp, overloads = pickle.loads(fh.read())
    return overloads


def test_two_processes_compiling_two_signatures_keep_both(tmp_path: Path) -> None:
    assert _race(tmp_path, "locked") == ["42", "2.5"]
    entries = _index_entries(tmp_path)
    assert len(entries) == 2 and len(set(entries.values())) == 2, entries
    out = subprocess.run(
        [sys.executable, "-c", _CHECK],
        env=_env(tmp_path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # Both loaded from the cache, none compiled.
    assert out.stdout.split() == ["42", "2.5", "2", "0"], out.stdout


def test_the_lock_is_installed_once_and_covers_kvhit_kernels() -> None:
    from numba.core import caching

    from kvhit.kernels import numba_cache, probe_numba  # noqa: F401

    save = caching.IndexDataCacheFile.save
    assert getattr(save, "_kvhit_locked", False)
    assert numba_cache.lock_cache_saves() is True
    assert caching.IndexDataCacheFile.save is save  # not wrapped twice
