"""FleetIndex kernels on the CPU for hybrid layouts: the engines whose scans
of a request must answer alike (:func:`engine_classes`), so that a fleet
call scans once per class rather than once per engine.

The fleet's other kernels are in ``kernels/fleet_numba.py``, which takes
:data:`TILE` and :func:`low_engine` from here and gives
:func:`engine_classes` to its callers (``coordinator/fleet_scoring.py``).

Importing this module imports numba.
"""

from __future__ import annotations

import numba
import numpy as np

from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.probe_numba import key_slot_hash, prefetch_cell, table_find_from

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = ["TILE", "engine_classes", "low_engine"]

_JIT = {"cache": True, "nogil": True}
#: The most blocks (or keys) whose home rows are loaded together before the
#: logic reads them: the fleet scan's later tiles (``fleet_numba``, whose
#: first tile is smaller) and a tile of keys here. A block costs a cache
#: miss into a table far larger than the caches when a batch's slots are not
#: cached already (the common case: a router sees each request once).
TILE = 64

# ctz by de Bruijn multiplication: numba has no count-trailing-zeros intrinsic.
_DEBRUIJN = np.uint64(0x022FDD63CC95386D)
_DEBRUIJN_INDEX = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _DEBRUIJN_INDEX[(((1 << _i) * 0x022FDD63CC95386D) & ((1 << 64) - 1)) >> 58] = _i


@numba.njit(inline="always", **_JIT)
def low_engine(k, low):
    """The engine of bit ``low`` (a power of two) of engine-set word ``k``."""
    return k * 64 + _DEBRUIJN_INDEX[(low * _DEBRUIJN) >> np.uint64(58)]


@numba.njit(inline="always", **_JIT)
def _refine(x, label, size, cnt, remap, touched, n_class):
    """Split every class by the engine set ``x`` (int64 ``[NW]``): the members
    of a class that are in ``x`` move to a new class when some member is not.
    ``size[c]`` is class ``c``'s member count; ``cnt`` / ``remap`` scratch
    (zero / -1 on entry and exit). Returns the new number of classes."""
    nt = 0
    for k in range(x.shape[0]):
        w = np.uint64(x[k])
        while w != np.uint64(0):
            low = w & (~w + np.uint64(1))
            c = label[low_engine(k, low)]
            if cnt[c] == 0:
                touched[nt] = c
                nt += 1
            cnt[c] += 1
            w ^= low
    for i in range(nt):
        c = touched[i]
        if cnt[c] < size[c]:
            remap[c] = n_class
            size[n_class] = cnt[c]
            size[c] -= cnt[c]
            n_class += 1
    for k in range(x.shape[0]):
        w = np.uint64(x[k])
        while w != np.uint64(0):
            low = w & (~w + np.uint64(1))
            e = low_engine(k, low)
            if remap[label[e]] >= 0:
                label[e] = remap[label[e]]
            w ^= low
    for i in range(nt):
        cnt[touched[i]] = 0
        remap[touched[i]] = -1
    return n_class


@numba.njit(**_JIT)
def _engine_classes(table, nw, rows, offsets, lengths, runs, may, fscale, reach,
                    gids, steps, min_engines, rep):  # fmt: skip
    n_req, n_eng = runs.shape
    b0 = table.shape[1] - nw
    label = np.zeros(n_eng, dtype=np.int64)
    size = np.zeros(n_eng + 1, dtype=np.int64)
    cnt = np.zeros(n_eng + 1, dtype=np.int64)
    remap = np.full(n_eng + 1, -1, dtype=np.int64)
    touched = np.empty(n_eng + 1, dtype=np.int64)
    first = np.full(n_eng + 1, -1, dtype=np.int64)
    win = np.zeros(n_eng, dtype=np.int64)
    order = np.empty(n_eng, dtype=np.int64)
    elig = np.zeros(nw, dtype=np.int64)
    x = np.zeros(nw, dtype=np.int64)
    n_grp = gids.shape[0]
    tt = np.empty(TILE + n_grp, dtype=np.int64)
    gg = np.empty(TILE + n_grp, dtype=np.int64)
    home = np.empty(TILE + n_grp, dtype=np.int64)
    mask = table.shape[0] - 1
    last = table.shape[1] - 1
    for r in range(n_req):
        off = offsets[r]
        n_units = lengths[r]
        m = 0
        for e in range(n_eng):
            rep[r, e] = -1
            if may[r, e]:
                run = runs[r, e]
                win[e] = min(n_units, max((run + 1) * fscale, run * fscale + reach))
                order[m] = e
                m += 1
        if m < min_engines:
            # Too few engines for the probes below to pay: each its own class.
            for i in range(m):
                rep[r, order[i]] = order[i]
            continue
        by_win = order[:m][np.argsort(win[order[:m]], kind="mergesort")]
        # First classes: the window (the leading run) alone; every member of
        # a class then leaves the eligible set at the same row.
        n_class = 0
        elig[:] = 0
        stop = 0  # rows past which no class has two members left
        for i in range(m):
            e = by_win[i]
            if i == 0 or win[e] != win[by_win[i - 1]]:
                n_class += 1
            elif size[n_class - 1] == 1:
                stop = win[e]
            label[e] = n_class - 1
            size[n_class - 1] += 1
            elig[e >> 6] |= np.int64(1) << np.int64(e & 63)
        p = 0
        t0 = 0
        while t0 < stop and n_class < m:
            # A tile of keys (row t, group gi): home slots computed and
            # prefetched together (see _gather_tile), then split on.
            n = 0
            t1 = t0
            # At least one row a tile (a layout may have more groups than
            # TILE: the scratch arrays hold TILE + n_grp keys).
            while t1 < stop and (n == 0 or n + n_grp <= TILE):
                for gi in range(n_grp):
                    if t1 % steps[gi] == steps[gi] - 1:
                        tt[n] = t1
                        gg[n] = gi
                        home[n] = key_slot_hash(gids[gi], rows, off + t1) & mask
                        n += 1
                t1 += 1
            for j in range(n):
                prefetch_cell(table, home[j], 0)
                prefetch_cell(table, home[j], last)
            t0 = t1
            for j in range(n):
                if n_class == m:
                    break  # every class a single engine: nothing left to split
                t = tt[j]
                while p < m and win[by_win[p]] <= t:
                    e = by_win[p]
                    elig[e >> 6] &= ~(np.int64(1) << np.int64(e & 63))
                    p += 1
                s = table_find_from(table, home[j], gids[gg[j]], rows, off + t)
                some = False
                split = False
                for k in range(nw):
                    xk = elig[k] & table[s, b0 + k] if s >= 0 else np.int64(0)
                    x[k] = xk
                    some = some or xk != 0
                    split = split or xk != elig[k]
                if some and split:
                    n_class = _refine(x, label, size, cnt, remap, touched, n_class)
        for i in range(m):
            e = order[i]
            c = label[e]
            if first[c] < 0:
                first[c] = e
            rep[r, e] = first[c]
        for c in range(n_class):
            first[c] = -1
            size[c] = 0


def engine_classes(
    table: np.ndarray,
    num_words: int,
    rows: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    runs: np.ndarray,
    may: np.ndarray,
    first_scale: int,
    reach_rows: int,
    group_ids: np.ndarray,
    steps: np.ndarray,
    min_engines: int = 1,
) -> np.ndarray:
    """Engines whose single-engine scans of a request must answer alike:
    ``rep[r, e]`` = the lowest engine of ``e``'s class for request ``r``
    (int64 ``[B, E]``; -1 where ``may[r, e]`` (bool ``[B, E]``) is False).

    A scan of request ``r`` against engine ``e`` reads only keys ``(g, row)``
    at rows below ``W = min(lengths[r], max((run + 1) * first_scale, run *
    first_scale + reach_rows))``, ``run = runs[r, e]`` (``runs``: the first
    SpecGroup's leading run of full-attention blocks, unbounded): the first
    SpecGroup reads blocks up to the one that ends its run, and each later
    SpecGroup is asked at most the hit the first left (at most ``run``
    blocks, or fine-grained ``first_scale - 1`` hash units more), an EAGLE
    SpecGroup one proof margin past it (``ReferenceCoordinator._round``);
    ``reach_rows`` is that bound past the run's rows in hash units. Keys of
    group ``g`` are read at every
    ``steps[g]``-th row (its blocks' last hash units; 1: fine-grained). Two
    engines with the same ``W`` holding the same of those keys take the
    same path through the scan and answer alike; so the classes are the
    engines grouped by ``W``, split by every such key that some but not all
    of the class hold. One probe per key (its engine set), whatever the
    number of engines. ``table`` as :func:`full_runs`; ``rows``, ``offsets``,
    ``lengths`` a HashBatch's ``host_arrays()``. A request with fewer than
    ``min_engines`` engines that may hit it gets one class per engine (no
    probe).
    """
    rep = np.empty(runs.shape, dtype=np.int64)
    if runs.shape[0] and runs.shape[1]:
        _engine_classes(table, np.int64(num_words), rows, offsets, lengths, runs,
                        may, np.int64(first_scale), np.int64(reach_rows),
                        group_ids, steps, np.int64(min_engines), rep)  # fmt: skip
    return rep
