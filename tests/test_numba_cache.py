"""kernels/numba_cache.py: two processes compiling one cached function at once.

numba saves an overload by reading the function's cache index, taking a free
data-file name and writing the index back, unlocked. Here both processes
start compiling together (a file barrier) and each is held for a second
inside its save's index read, so without the lock both read an empty index,
both take data file 1 and the index keeps one of the two signatures (run
with ``"unlocked"`` in place of ``"locked"``: the entry-count assertion
fails on numba 0.65).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")

REPO = Path(__file__).resolve().parents[1]

_WORKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numba
    from numba.core import caching

    kind, mode, barrier = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode == "locked":
        from kvhit.kernels.numba_cache import lock_cache_saves

        assert lock_cache_saves()
    cls = caching.IndexDataCacheFile
    inner_save, inner_read = cls.save, cls._load_index
    state = {"saving": False}

    def save(self, key, data):
        state["saving"] = True
        try:
            return inner_save(self, key, data)
        finally:
            state["saving"] = False

    def read(self):
        out = inner_read(self)
        if state["saving"]:
            time.sleep(1.0)  # the window between reading and writing the index
        return out

    cls.save, cls._load_index = save, read

    (barrier / kind).touch()
    deadline = time.time() + 60
    while len(list(barrier.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.005)
    from cachedmod import twice

    started = time.time()
    value = twice({"int": 21, "float": 1.25}[kind])
    print(repr(value), started)
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
    hits, misses = sum(stats.cache_hits.values()), sum(stats.cache_misses.values())
    print(repr(a), repr(b), hits, misses)
    """
)


def _env(tmp: Path) -> dict[str, str]:
    # None of the caller's numba settings (NUMBA_DISABLE_JIT would compile
    # nothing), a cache of the test's own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["NUMBA_CACHE_DIR"] = str(tmp / "cache")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p
    )
    return env


def _run(argv: list[str], tmp: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        env=_env(tmp),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return out


def _race(tmp: Path, mode: str) -> list[tuple[str, float]]:
    (tmp / "cachedmod.py").write_text(_MODULE)
    (tmp / "worker.py").write_text(_WORKER)
    barrier = tmp / "barrier"
    barrier.mkdir()
    procs = [
        _run([sys.executable, str(tmp / "worker.py"), kind, mode, str(barrier)], tmp)
        for kind in ("int", "float")
    ]
    results = []
    try:
        for p in procs:
            value, started = _finish(p).split()
            results.append((value, float(started)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def _index_entries(tmp: Path) -> dict:
    (index,) = (tmp / "cache").rglob("cachedmod.twice-*.nbi")
    with open(index, "rb") as fh:
        pickle.load(fh)  # numba's version
        _stamp, overloads = pickle.loads(fh.read())
    return overloads


def test_two_processes_compiling_two_signatures_keep_both(tmp_path: Path) -> None:
    (a, t_a), (b, t_b) = _race(tmp_path, "locked")
    assert (a, b) == ("42", "2.5")
    # The race was on: both began compiling (a tenth of a second) within
    # half a second, inside the one second a save spends in its index read,
    # where without the lock both take data file 1.
    assert abs(t_a - t_b) < 0.5, (t_a, t_b)
    entries = _index_entries(tmp_path)
    assert len(entries) == 2 and len(set(entries.values())) == 2, entries
    out = _finish(_run([sys.executable, "-c", _CHECK], tmp_path))
    assert out.split() == ["42", "2.5", "2", "0"], out


def test_the_lock_is_installed_once_and_covers_kvhit_kernels() -> None:
    from numba.core import caching

    from kvhit.kernels import numba_cache, probe_numba  # noqa: F401

    cls = caching.IndexDataCacheFile
    save, load = cls.save, cls.load
    assert save.__wrapped__ and load.__wrapped__
    assert numba_cache.lock_cache_saves() is True
    assert (cls.save, cls.load) == (save, load)  # not wrapped twice
