"""FleetIndex kernels on the CPU, compiled by numba.

On the CPU a :class:`kvhit.coordinator.fleet_index.FleetIndex` is one table with one
row per slot: ``table`` int64 ``[C, W + 1 + NW]``, whose first ``W + 1``
columns are a KeyIndex table holding every key that at least one engine holds
(layout of ``coordinator/key_index.py``; probed with
:func:`kvhit.kernels.probe_numba.table_find`, which reads only those
columns), and whose last ``NW`` columns are the set of engines holding that
slot's key (engine ``e`` is bit ``e % 64`` of word ``e // 64``). One probe per
(group, hash) therefore answers for every engine, and the engine set lies in
the key's own row: a block scanned costs one cache miss, not two. The
FleetIndex's ``keys`` and ``bits`` are views of the two column ranges; the
kernels that take them separately accept such strided views.

Launchers take numpy arrays (the coordinator passes zero-copy views of its CPU
tensors) and do not validate: the FleetIndex checks every argument first.
:class:`FleetOps` is the FleetIndex's adapter: its table operations on CPU
tensors, the same calls as the torch and Triton families'.

Importing this module imports numba (a FleetIndex imports it when it is built
with the numba backend).
"""

from __future__ import annotations

from array import array

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from kvhit.kernels.contract import EMPTY, TOMBSTONE
from kvhit.kernels.fleet_numba_classes import TILE, engine_classes, low_engine
from kvhit.kernels.hash_index_numba import insert_count, rehash_rows
from kvhit.kernels.hash_index_torch import new_table
from kvhit.kernels.msgpack_numba import unpack_step
from kvhit.kernels.msgpack_numba import warm_up as msgpack_warm_up
from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.numba_entry import compiled_entry
from kvhit.kernels.numba_views import unowned
from kvhit.kernels.probe_numba import (
    key_slot_hash,
    prefetch_cell,
    table_find,
    table_find_from,
)

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = [
    "LISTS_REFUSED",
    "FleetOps",
    "add_entries",
    "clear_bits",
    "clear_engine",
    "engine_classes",
    "find_keys",
    "full_hits",
    "full_hits_checked",
    "full_lists_hits",
    "full_runs",
    "insert_keys",
    "probe_bits",
    "set_bits",
    "store_entries",
    "warm_up",
]

_JIT = {"cache": True, "nogil": True}
# Whether warm_up() ran in this process.
_warm = False
# Blocks whose home rows are loaded together before the run logic reads them
# (:func:`_gather_tile`): a request's first tile (the most is
# ``fleet_numba_classes.TILE``). Most runs end within the first tile; the
# blocks a tile loads past a run's end are wasted reads, so the first tile is
# small and later ones double.
_TILE0 = 16
# Blocks ahead of the current one whose home row :func:`_find_keys` prefetches.
_AHEAD = 16


@numba.njit(inline="always", **_JIT)
def _prefetch_block(table, gid, rows, row):
    """Prefetch the home row of key ``(gid, rows[row])``: its first and last
    word (a row not a power of two in size may straddle two cache lines).
    Returns the home slot."""
    s = key_slot_hash(gid, rows, row) & (table.shape[0] - 1)
    prefetch_cell(table, s, 0)
    prefetch_cell(table, s, table.shape[1] - 1)
    return s


_TOMB = np.int64(TOMBSTONE)
_EMPTY = np.int64(EMPTY)


@numba.njit(**_JIT)
def _find_keys(table, gids, hashes, out):
    for r in range(gids.shape[0]):
        if r + _AHEAD < gids.shape[0]:
            _prefetch_block(table, gids[r + _AHEAD], hashes, r + _AHEAD)
        out[r] = table_find(table, gids[r], hashes, r)


def find_keys(table: np.ndarray, gids: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """Slot of each key ``(gids[r], hashes[r])`` in ``table`` (int64 ``[C, W +
    1 + NW]``, the key in its first ``W + 1`` columns), or -1 where absent:
    int64 ``[N]``. ``hashes``: int64 ``[N, W]``."""
    out = np.empty(gids.shape[0], dtype=np.int64)
    if gids.shape[0]:
        _find_keys(table, gids, hashes, out)
    return out


def insert_keys(table: np.ndarray, gids: np.ndarray, hashes: np.ndarray) -> int:
    """Insert keys into ``table`` (as :func:`find_keys`) in place, each once;
    returns the number newly stored. The caller leaves room (an EMPTY slot on
    every probe path); RuntimeError if some key found no free slot. The
    KeyIndex's insert (``hash_index_numba.insert_count``), which touches only
    the key columns."""
    return insert_count(table, gids, hashes)


@numba.njit(inline="always", **_JIT)
def _claim(table, gid, keys, r):
    """Key ``(gid, keys[r])``'s slot, stored in its probe sequence's first
    EMPTY slot when absent (tombstones passed over, as KeyIndex's insert):
    ``2 * slot + 1`` stored now, ``2 * slot`` already there, -1 no room."""
    cap = table.shape[0]
    mask = cap - 1
    W = keys.shape[1]
    slot = key_slot_hash(gid, keys, r) & mask
    for _ in range(cap):
        g = table[slot, 0]
        if g == _EMPTY:
            for j in range(W):
                table[slot, 1 + j] = keys[r, j]
            table[slot, 0] = gid
            return 2 * slot + 1
        if g == gid:
            same = True
            for j in range(W):
                if table[slot, 1 + j] != keys[r, j]:
                    same = False
                    break
            if same:
                return 2 * slot
        slot = (slot + 1) & mask
    return -1


@numba.njit(**_JIT)
def _add_entries(table, entries, gids, hashes, engines, active, per_engine, max_gid):
    """:func:`add_entries`' kernel, checked first, then one pass per entry;
    when an engine bit is new, the entry key ``gids[r] * E + engines[r]``
    goes into ``entries`` and ``per_engine`` counts it (``E =
    active.shape[0]``; ``gids`` and ``engines`` of one element hold every
    entry's). ``entries=None`` compiles a copy that leaves the entry index
    out (the fleet builds it from the bits when first read): one cache miss
    a key, not two. Returns (keys, bits, entries) newly stored; ``(-1, r,
    0)``, nothing stored, for the first bad entry ``r``; ``(-2, r, 0)`` when
    entry ``r`` found no free slot (those before it stored). Home rows are
    prefetched ``_AHEAD`` entries early: each is a cache miss into a table
    larger than the caches, and this keeps several in flight."""
    n = hashes.shape[0]
    num_engines = active.shape[0]
    one = engines.shape[0] == 1
    one_g = gids.shape[0] == 1
    for r in range(n):
        e = engines[0] if one else engines[r]
        g = gids[0] if one_g else gids[r]
        if e < 0 or e >= num_engines or not active[e] or g > max_gid:
            return np.int64(-1), np.int64(r), np.int64(0)
        if r < _AHEAD:
            _prefetch_block(table, g, hashes, r)
            if entries is not None:
                _prefetch_block(entries, g * num_engines + e, hashes, r)
    W1 = hashes.shape[1] + 1
    n_keys = np.int64(0)
    n_bits = np.int64(0)
    n_entries = np.int64(0)
    for r in range(n):
        q = r + _AHEAD
        if q < n:
            gq = gids[0] if one_g else gids[q]
            _prefetch_block(table, gq, hashes, q)
            if entries is not None:
                eq = engines[0] if one else engines[q]
                _prefetch_block(entries, gq * num_engines + eq, hashes, q)
        g = gids[0] if one_g else gids[r]
        got = _claim(table, g, hashes, r)
        if got < 0:
            return np.int64(-2), np.int64(r), np.int64(0)
        n_keys += got & 1
        e = engines[0] if one else engines[r]
        slot = got >> 1
        w = W1 + (e >> 6)
        b = np.int64(1) << np.int64(e & 63)
        if table[slot, w] & b == 0:
            if entries is not None:
                got = _claim(entries, g * num_engines + e, hashes, r)
                if got < 0:
                    return np.int64(-2), np.int64(r), np.int64(0)
                n_entries += got & 1
            table[slot, w] |= b
            per_engine[e] += 1
            n_bits += 1
    return n_keys, n_bits, n_entries


#: The checked store kernel (:func:`_add_entries`), which a FleetIndex calls
#: on its host tables with no wrapper between (a store's fixed cost).
store_entries = _add_entries


def add_entries(table: np.ndarray, entries: np.ndarray | None, gids: np.ndarray,
                hashes: np.ndarray, engines: np.ndarray, active: np.ndarray,
                per_engine: np.ndarray, max_gid: int) -> tuple[int, int, int]:  # fmt: skip
    """A FleetIndex store in place: engine ``engines[r]`` (``engines[0]``
    for all when it holds one) holds key ``(gids[r], hashes[r])``
    (``gids[0]`` likewise). table: int64 ``[C, W + 1 + NW]``; entries: int64
    ``[C', W + 1]`` (None: left out); gids, engines: int64 ``[N]`` or
    ``[1]``; hashes: int64 ``[N, W]``; active: bool ``[E]``; per_engine:
    int64 ``[E]``, counted up; max_gid: the largest group id an entry key
    takes. C-contiguous, room left in both tables. Returns (keys,
    bits, entries) newly stored; ValueError, nothing stored, for an engine
    outside ``[0, E)`` or inactive or a group id past ``max_gid``;
    RuntimeError when a table had no free slot (earlier rows stored)."""
    a, b, c = _add_entries(table, entries, gids, hashes, engines, active,
                           per_engine, np.int64(max_gid))  # fmt: skip
    if a == -1:
        raise ValueError(f"add_entries: entry {b} has a bad or inactive engine "
                         "or a group id past max_gid")  # fmt: skip
    if a < 0:
        raise RuntimeError("insert: the table has no free slot for some keys")
    return int(a), int(b), int(c)


@numba.njit(**_JIT)
def _set_bits(bits, slots, engines, out):
    n_new = 0
    for r in range(slots.shape[0]):
        s = slots[r]
        e = engines[r]
        w = e >> 6
        b = np.int64(1) << np.int64(e & 63)
        if bits[s, w] & b == 0:
            bits[s, w] |= b
            out[r] = 1
            n_new += 1
    return n_new


def set_bits(bits: np.ndarray, slots: np.ndarray, engines: np.ndarray) -> np.ndarray:
    """Set engine ``engines[r]``'s bit of slot ``slots[r]`` (every slot a live
    key's). Returns int8 ``[N]``: 1 where the bit was newly set (a repeat in the
    batch counts once)."""
    out = np.zeros(slots.shape[0], dtype=np.int8)
    if slots.shape[0]:
        _set_bits(bits, slots, engines, out)
    return out


@numba.njit(**_JIT)
def _clear_bits(keys, bits, slots, engines, out):
    freed = 0
    for r in range(slots.shape[0]):
        s = slots[r]
        if s < 0:
            continue
        e = engines[r]
        w = e >> 6
        b = np.int64(1) << np.int64(e & 63)
        if bits[s, w] & b == 0:
            continue
        out[r] = 1
        freed += _drop_bit(keys, bits, s, w, b)
    return freed


@numba.njit(inline="always", **_JIT)
def _drop_bit(keys, bits, s, w, b):
    """Clear bit ``b`` of word ``w`` of slot ``s`` (set); 1 if the slot is
    left with no engine and became a tombstone (as KeyIndex's erase), else 0."""
    bits[s, w] &= ~b
    for k in range(bits.shape[1]):
        if bits[s, k] != 0:
            return 0
    keys[s, 0] = _TOMB
    return 1


def clear_bits(
    keys: np.ndarray, bits: np.ndarray, slots: np.ndarray, engines: np.ndarray
) -> tuple[np.ndarray, int]:
    """Clear engine ``engines[r]``'s bit of slot ``slots[r]`` (-1: absent key,
    skipped); a slot left with no engine becomes a TOMBSTONE. Returns (int8
    ``[N]``, 1 where a bit was cleared; the number of slots tombstoned)."""
    out = np.zeros(slots.shape[0], dtype=np.int8)
    freed = 0
    if slots.shape[0]:
        freed = _clear_bits(keys, bits, slots, engines, out)
    return out, int(freed)


@numba.njit(**_JIT)
def _clear_engine(keys, bits, e):
    w = e >> 6
    b = np.int64(1) << np.int64(e & 63)
    cleared = 0
    freed = 0
    for s in range(keys.shape[0]):
        if keys[s, 0] < 0 or bits[s, w] & b == 0:
            continue
        cleared += 1
        freed += _drop_bit(keys, bits, s, w, b)
    return cleared, freed


def clear_engine(keys: np.ndarray, bits: np.ndarray, engine: int) -> tuple[int, int]:
    """Drop every key of ``engine``: (bits cleared, slots tombstoned)."""
    cleared, freed = _clear_engine(keys, bits, np.int64(engine))
    return int(cleared), int(freed)


@numba.njit(**_JIT)
def _probe_bits(keys, bits, gids, rows, out):
    nw = bits.shape[1]
    for gi in range(gids.shape[0]):
        g = gids[gi]
        for t in range(rows.shape[0]):
            s = table_find(keys, g, rows, t)
            if s >= 0:
                for k in range(nw):
                    out[gi, t, k] = bits[s, k]


def probe_bits(
    keys: np.ndarray, bits: np.ndarray, gids: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """The engine set of every key ``(gids[i], rows[t])``: int64 ``[G, T, NW]``
    (all zero where no engine holds it)."""
    out = np.zeros((gids.shape[0], rows.shape[0], bits.shape[1]), dtype=np.int64)
    if rows.shape[0] and gids.shape[0]:
        _probe_bits(keys, bits, gids, rows, out)
    return out


@numba.njit(inline="always", **_JIT)
def _gather_tile(table, gid, rows, row0, scale, n, slots):
    """Start loading a tile of ``n`` blocks (block ``j`` keyed by row ``row0 +
    j * scale``): ``slots[j]`` = its key's home slot, and the home rows
    prefetched (their first word and the next row's last: a row not a power
    of two in size may straddle two cache lines; measured 2-6% faster cold
    than the home row's own last word).

    Hashes first, then the prefetches in a loop of their own: a tight loop
    of independent prefetches keeps every cache miss of the tile in flight
    at once (a router's batch is cold: each block is a miss into a table far
    larger than the caches), where prefetches issued between the probes'
    data-dependent branches leave most of the latency exposed."""
    mask = table.shape[0] - 1
    last = table.shape[1] - 1
    for j in range(n):
        slots[j] = key_slot_hash(gid, rows, row0 + j * scale) & mask
    for j in range(n):
        prefetch_cell(table, slots[j], 0)
        # The next row's last word: the home row's second line if it
        # straddles two, and where linear probing goes on (a home slot holds
        # another key about a third of the time at the default load).
        prefetch_cell(table, (slots[j] + 1) & mask, last)


@numba.njit(inline="always", **_JIT)
def _request_end(offsets, lengths, ends, scale, r):
    """(first row, blocks to scan at most) of request ``r``."""
    return offsets[r] + scale - 1, min(ends[r], lengths[r] // scale)


@numba.njit(inline="always", **_JIT)
def _run_request(table, b0, rows, row0, end, scale, members, acc, runs, r, slots):
    """runs[r, e] = the leading run of request ``r``'s blocks (block ``i``
    keyed by row ``row0 + i * scale``, at most ``end``) that engine ``e``
    holds in every member group, for each engine of ``acc`` (an engine set,
    overwritten); other entries untouched.

    Blocks are scanned in tiles: :func:`_gather_tile` (hashes, prefetches),
    then the run logic on the cached rows. The caller gathered the first
    tile (``min(_TILE0, end)`` blocks) into ``slots`` (int64 ``[TILE]``,
    scratch for the later tiles), during the previous request's logic;
    later tiles double up to ``TILE``. Blocks a tile loads past the run's
    end are read but not used. (Gathering the next tile before a tile's
    logic, speculatively, measured no faster: the waste offsets the gain.)"""
    nw = acc.shape[0]
    n_eng = runs.shape[1]
    n_mem = members.shape[0]
    g0 = members[0]
    i = 0
    n = min(_TILE0, end)
    if nw == 1 and n_mem == 1:
        # The common case (at most 64 engines, one member group): the engine
        # set in a register.
        cur = acc[0]
        while cur != 0 and i < end:
            if i > 0:
                n = min(2 * n, TILE, end - i)
                _gather_tile(table, g0, rows, row0 + i * scale, scale, n, slots)
            for j in range(n):
                s = table_find_from(table, slots[j], g0, rows, row0 + (i + j) * scale)
                nxt = np.int64(0) if s < 0 else cur & table[s, b0]
                if nxt != cur:
                    # Engines whose run ends at block i + j.
                    _store_bits(runs, r, 0, cur & ~nxt, i + j, n_eng)
                    cur = nxt
                    if cur == 0:
                        break
            i += n
        if cur != 0:
            _store_bits(runs, r, 0, cur, end, n_eng)
        return
    alive = True
    while alive and i < end:
        if i > 0:
            n = min(2 * n, TILE, end - i)
            _gather_tile(table, g0, rows, row0 + i * scale, scale, n, slots)
        for j in range(n):
            row = row0 + (i + j) * scale
            s = table_find_from(table, slots[j], g0, rows, row)
            alive = False
            for k in range(nw):
                prev = acc[k]
                if prev == 0:
                    # Every engine of this word has already stopped.
                    continue
                cur = np.int64(0) if s < 0 else prev & table[s, b0 + k]
                # A merged SpecGroup: the key must be in every member group.
                m = 1
                while cur != 0 and m < n_mem:
                    t = table_find(table, members[m], rows, row)
                    cur = np.int64(0) if t < 0 else cur & table[t, b0 + k]
                    m += 1
                if cur != prev:
                    # Engines whose run ends at block i + j.
                    _store_bits(runs, r, k, prev & ~cur, i + j, n_eng)
                    acc[k] = cur
                if cur != 0:
                    alive = True
            if not alive:
                break
        i += n
    if alive:
        for k in range(nw):
            _store_bits(runs, r, k, acc[k], end, n_eng)


@numba.njit(inline="always", **_JIT)
def _gather_first(table, g0, rows, offsets, lengths, ends, scale, r, slots):
    """:func:`_gather_tile` of request ``r``'s first tile."""
    row0, end = _request_end(offsets, lengths, ends, scale, r)
    _gather_tile(table, g0, rows, row0, scale, min(_TILE0, end), slots)


@numba.njit(inline="always", **_JIT)
def _hit_of_run(run, bs, align, drop):
    """``kernels/fleet_torch.hits_of_runs`` for one run (vLLM's
    full-attention hit, ``reference.full_attention_hit`` without the
    fine-grained tail): ``run * bs``, less ``min(align, bs)`` under the EAGLE
    drop, aligned down."""
    hit = run * bs
    if drop:
        hit = hit - min(align, bs) if hit > 0 else 0
    return hit - hit % align


@numba.njit(**_JIT)
def _full_scan(table, nw, scale, rows, offsets, lengths, ends, members, live, out,
               lens, params, scratch):  # fmt: skip
    """Per request and engine the leading run into ``out`` (:func:`full_runs`)
    or, with ``lens`` and ``params`` (not None), the run turned into vLLM's
    hit as soon as its request is scanned (:func:`full_hits`: ``params``
    theirs). ``lens=None`` compiles its own copy with the hit code pruned.
    ``scratch`` int64 ``[nw + 2 TILE]``, the caller's."""
    # Views counting no references (kernels/numba_views.py): the arrays'
    # copies into the inline helpers below cost atomic increments and
    # decrements in the loop otherwise (fleet_hits, B = 64, E = 8, warm:
    # 42-46 -> 12-19 us a call).
    # The callers hold every argument, and the scratch, for the call.
    table = unowned(table)
    rows = unowned(rows)
    offsets = unowned(offsets)
    lengths = unowned(lengths)
    ends = unowned(ends)
    members = unowned(members)
    live = unowned(live)
    out = unowned(out)
    scratch = unowned(scratch)
    b0 = table.shape[1] - nw
    n_req = offsets.shape[0]
    n_eng = out.shape[1]
    if lens is not None:
        # (lens and params are only indexed here, never copied; rebinding
        # them would stop numba pruning this branch where they are None.)
        bs = params[2]
        align = params[3]
        drop = params[4] != 0
        lookup = params[5] != 0
    acc = scratch[:nw]
    cur = scratch[nw : nw + TILE]
    nxt = scratch[nw + TILE : nw + 2 * TILE]
    g0 = members[0]
    _gather_first(table, g0, rows, offsets, lengths, ends, scale, 0, nxt)
    for r in range(n_req):
        cur, nxt = nxt, cur
        if r + 1 < n_req:
            # The next request's first tile loads during this one's logic.
            _gather_first(table, g0, rows, offsets, lengths, ends, scale, r + 1, nxt)
        acc[:] = live
        row0, end = _request_end(offsets, lengths, ends, scale, r)
        _run_request(table, b0, rows, row0, end, scale, members, acc, out, r, cur)
        if lens is None:
            continue
        # Runs -> hits, in place (``kernels/fleet_torch.FleetOps.full_hits``).
        n_tok = lens[r]
        again = (n_tok - 1) // align * align if n_tok > 0 else np.int64(-1)
        ok = lengths[r] > 0 and (n_tok // align * align if lookup else n_tok) > 0
        last_run = np.int64(-1)
        last_hit = np.int64(0)
        for e in range(n_eng):
            run = out[r, e]
            if run == last_run:
                # Engines' runs repeat (most stop at the same block): the
                # divisions below cost more than the scan of a cached block.
                out[r, e] = last_hit
                continue
            hit = _hit_of_run(run, bs, align, drop)
            if lookup:
                # The store worker's rule: a hit covering the whole prompt is
                # re-derived at num_tokens - 1 (the run clipped to it).
                if hit >= n_tok:
                    hit = _hit_of_run(min(run, again // bs), bs, align, drop)
                    hit = hit if again > 0 else 0
                if not ok:
                    hit = 0
            out[r, e] = hit
            last_run = run
            last_hit = hit


@numba.njit(**_JIT)
def _full_hits(table, rows, offsets, lengths, lens, members, live, params, out):
    nw = params[0]
    scale = params[1]
    bs = params[2]
    align = params[3]
    lookup = params[5] != 0
    n_req = offsets.shape[0]
    ends = np.empty(n_req, dtype=np.int64)
    for r in range(n_req):
        bound = lens[r] // align * align if lookup else lens[r]
        ends[r] = bound // bs
    scratch = np.empty(nw + 2 * TILE, dtype=np.int64)
    _full_scan(table, nw, scale, rows, offsets, lengths, ends, members, live, out,
               lens, params, scratch)  # fmt: skip


@numba.njit(inline="always", **_JIT)
def _store_bits(runs, r, k, word, value, n_eng):
    """runs[r, e] = value for every engine e whose bit is set in ``word`` (word
    ``k`` of an engine set)."""
    x = np.uint64(word)
    while x != np.uint64(0):
        low = x & (~x + np.uint64(1))
        e = low_engine(k, low)
        if e < n_eng:
            runs[r, e] = value
        x ^= low


def full_runs(table: np.ndarray, num_words: int, rows: np.ndarray, offsets: np.ndarray,
              lengths: np.ndarray, ends: np.ndarray, scale: int, members: np.ndarray,
              live: np.ndarray, num_engines: int) -> np.ndarray:  # fmt: skip
    """Per request and engine, the leading run of full-attention blocks the
    engine holds (``table`` int64 ``[C, W + 1 + num_words]``: keys, then
    engine sets; the leading-run phase of ``reference.full_attention_hit``,
    as ``kernels/scan_numba_sg.py``'s ``leading_run``): int64 ``[R, E]``.

    Block ``i`` of request ``r`` is keyed by hash row ``offsets[r] + (i + 1) *
    scale - 1`` and needs the key in every group of ``members`` (a merged
    SpecGroup); runs stop at ``min(ends[r], lengths[r] // scale)`` blocks. The
    engine sets are ANDed block by block, so a request costs one probe per
    member and block scanned (until no engine is left) whatever the number of
    engines. ``live`` int64 ``[NW]``: the engines that may hit.
    """
    runs = np.zeros((offsets.shape[0], num_engines), dtype=np.int64)
    if offsets.shape[0]:
        _full_runs(table, np.int64(num_words), np.int64(scale), rows, offsets,
                   lengths, ends, members, live, runs)  # fmt: skip
    return runs


@numba.njit(**_JIT)
def _full_runs(table, nw, scale, rows, offsets, lengths, ends, members, live, runs):
    # The scratch sized here, in the file whose compile slices it: numba's
    # cache does not see an edit of TILE in fleet_numba_classes.py, so a
    # size taken from Python there could disagree with a cached _full_scan.
    scratch = np.empty(nw + 2 * TILE, dtype=np.int64)
    _full_scan(table, nw, scale, rows, offsets, lengths, ends, members, live, runs,
               None, None, scratch)  # fmt: skip


def _least_length(lens):  # pragma: no cover - its overload runs
    """The least length :func:`full_hits_checked` takes from ``lens``: 0
    from an array; 2 from an ``array('q')`` (of a router's list), which took
    bools as 0 and 1 (those lengths go back to the host's exact check)."""


@overload(_least_length, jit_options=_JIT)
def _least_length_impl(lens):
    least = np.int64(0 if isinstance(lens, types.Array) else 2)
    return lambda lens: least


@numba.njit(**_JIT)
def full_hits_checked(table, rows, offsets, lengths, lens, members, live, params):
    """:func:`full_hits` for a router's per-batch call, at the cost of one
    dispatch (no Python wrapper): ``lens`` (int64 ``[B]``, any stride, or an
    ``array('q')``) is checked here, before anything is read, and the output
    allocated here. ``params`` int64 ``[7]``: :func:`full_hits`' six, then
    E. Returns ``(-1, hits int64 [B, E])``, or ``(r, int64 [0, 0])`` when
    ``lens[r]`` is the first below :func:`_least_length` (nothing scanned)."""
    least = _least_length(lens)
    for r in range(len(lens)):
        if lens[r] < least:
            return r, np.zeros((0, 0), dtype=np.int64)
    out = np.zeros((offsets.shape[0], params[6]), dtype=np.int64)
    if out.shape[0]:
        _full_hits(table, rows, offsets, lengths, lens, members, live, params, out)
    return -1, out


#: What :func:`full_lists_hits` answers (first) for a message it does not take.
LISTS_REFUSED = -1


@numba.njit(**_JIT)
def full_lists_hits(msg, table, members, live, params, div):
    """:func:`full_hits_checked` of a router's step from its Python lists, the
    hits floor-divided by ``div`` (>= 1): the fleet's counterpart of
    ``kernels/scan_numba_lists.lists_hits``, whose message it reads.

    ``msg`` is the msgpack of a list of ``B + 1`` lists of ints: ``B``
    requests' 8-byte keys (one int each), then their ``B`` max lengths.
    ``table``, ``members``, ``live`` and ``params`` (int64 ``[7]``) are
    :func:`full_hits_checked`'s, trusted. Returns ``(B, hits int64 [B,
    E])``, or ``(LISTS_REFUSED, int64 [0, 0])`` when ``msg`` is anything
    else: not ``B + 1`` lists, an item that is not an int in int64 (a bool,
    a float, nil, a uint64 past int64), a last list of another length than
    ``B``, or a negative length. Nothing is scanned then; the caller takes
    the general path, which names the bad item."""
    b, out = unpack_step(msg, 0)
    if b < 0:
        return LISTS_REFUSED, np.zeros((0, 0), dtype=np.int64)
    nb = b + 1
    base = 2 * nb + 1
    t = out[b]  # the requests' keys; the lengths list follows them
    lens = out[base + t : base + t + b]
    hits = np.zeros((b, params[6]), dtype=np.int64)
    if b:
        # Unit-step slices of one C array, as from_ints' host arrays are.
        _full_hits(table, out[base : base + t].reshape((t, 1)), out[:b],
                   out[nb + 1 : nb + 1 + b], lens, members, live, params,
                   hits)  # fmt: skip
        if div != 1:
            flat = hits.reshape(-1)
            for i in range(flat.shape[0]):
                flat[i] //= div
    return b, hits


def full_hits(table: np.ndarray, rows: np.ndarray, offsets: np.ndarray,
              lengths: np.ndarray, lens: np.ndarray, members: np.ndarray,
              live: np.ndarray, params: np.ndarray,
              num_engines: int) -> np.ndarray:  # fmt: skip
    """vLLM's full-attention hit of every request against every engine, in
    one pass (``kernels/fleet_torch.FleetOps.full_hits`` on the runs of
    :func:`full_runs`, fused so that a call costs one dispatch and no
    temporaries): int64 ``[B, E]``.

    ``table`` as :func:`full_runs`; ``rows`` int64 ``[T, W]``, ``offsets``
    and ``lengths`` int64 ``[B]`` a HashBatch's ``host_arrays()``; ``lens`` int64
    ``[B]`` the max lengths (or, ``lookup``, the prompt lengths); ``members``
    the SpecGroup's group ids; ``live`` int64 ``[NW]`` the active engines;
    ``params`` int64 ``[6]``: (NW, scale, block size, alignment, EAGLE drop,
    lookup).
    """
    out = np.zeros((offsets.shape[0], num_engines), dtype=np.int64)
    if out.shape[0]:
        _full_hits(table, rows, offsets, lengths, lens, members, live, params, out)
    return out


def warm_up() -> None:
    """Load (or compile, on a cold numba cache) the kernels a FleetIndex's
    stores and a router's fleet call run, on scratch tables with the argument
    types of the real calls, so that a serving process's first call does not
    pay for them. Once per process."""
    global _warm
    if _warm:
        return
    W = NW = 1
    table = np.zeros((4, W + 1 + NW), dtype=np.int64)
    table[:, 0] = _EMPTY
    keys, bits = table[:, : W + 1], table[:, W + 1 :]
    entries = np.zeros((4, W + 1), dtype=np.int64)
    entries[:, 0] = _EMPTY
    one = np.zeros(1, dtype=np.int64)
    h = np.ones((1, W), dtype=np.int64)
    # The store's engines: a 1-element array (one engine for every key) or
    # one per key; the active flags a bool view of the fleet's tensor.
    for ent in (entries, None):  # the entry index kept, or left to the fleet
        add_entries(table, ent, one, h, one, np.ones(1, dtype=np.bool_),
                    np.zeros(1, dtype=np.int64), (1 << 63) - 1)  # fmt: skip
    insert_keys(table, one, h)
    slots = find_keys(table, one, h)
    set_bits(bits, slots, one)
    clear_bits(keys, bits, slots, one)
    none = np.zeros(0, dtype=np.int64)
    params = np.zeros(7, dtype=np.int64)
    params[6] = 1
    # The router's members and params are read-only arrays (cached per
    # plan): numba types them apart from writable ones.
    members = one.copy()
    for a in (members, params):
        a.flags.writeable = False
    full_hits_checked(table, h, none, none, none, members, one, params)
    # A router's list of lengths, as fleet_full_host hands it over.
    full_hits_checked(table, h, none, none, array("q"), members, one, params)
    # A router's lists (a step of no request: [[]]), and the decoder that
    # coordinator/int_lists.py waits for before it encodes.
    msgpack_warm_up()
    if full_lists_hits(b"\x91\x90", table, members, one, params, 1)[0] != 0:
        raise AssertionError("fleet_numba.full_lists_hits failed its warm-up")
    _warm = True


# -- the FleetIndex's table operations -----------------------------------------------


class FleetOps:
    """A FleetIndex's table operations on this family's kernels (CPU
    tensors as numpy views; no validation: the FleetIndex checks every
    argument first), the same calls as ``kernels/fleet_torch.FleetOps`` and
    ``kernels/fleet_triton.FleetOps`` (``fleet_index.FLEET_KERNEL_MODULES``
    picks one per backend). Keys and engine sets share one table (the
    module docstring); :meth:`host_table` gives it as numpy, which the
    fleet's host paths (the router's kernel, the entry-index scans) read
    without a torch call."""

    #: The backend of the fleet's entry index (a KeyIndex of its own).
    entries_backend = "numba"

    def __init__(self) -> None:
        #: The router call's kernel (:func:`full_hits_checked`; fleet_full_host
        #: calls its compiled entry), read at build: a test may patch the module's.
        self.host_kernel = full_hits_checked
        #: The router's call from its lists (:func:`full_lists_hits`;
        #: fleet_scoring.fleet_lists_host), read at build as host_kernel is.
        self.lists_kernel = full_lists_hits

    @staticmethod
    def new_tables(
        capacity: int, W: int, NW: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One table int64 ``[capacity, W + 1 + NW]`` (keys, then engine
        sets: one cache line or two per slot scanned) and its two column
        views ``keys`` and ``bits``."""
        # A KeyIndex table whose words are the key's and the engine sets
        # (new_table: numpy's huge pages and first touch on this thread).
        table = new_table(capacity, W + NW, device)
        return table, table[:, : W + 1], table[:, W + 1 :]

    #: The fused host store (:func:`add_entries`'s kernel, no wrapper:
    #: ``(keys, bits, entries)`` newly stored or a negative code), on numpy.
    store_entries = staticmethod(store_entries)
    #: Growth: each live row (key and engine set) moved whole, on numpy.
    rehash_rows = staticmethod(rehash_rows)
    #: A kernel's compiled wrapper for its arguments' types (the router's).
    compiled_entry = staticmethod(compiled_entry)
    #: Load the kernels now (:func:`warm_up`); a warm FleetIndex calls it.
    warm_up = staticmethod(warm_up)

    @staticmethod
    def host_table(table: torch.Tensor) -> np.ndarray:
        """``table`` as numpy (a view)."""
        return table.numpy()

    @staticmethod
    def find(
        table: torch.Tensor, W: int, gids: torch.Tensor, hashes: torch.Tensor
    ) -> torch.Tensor:
        """:func:`find_keys`: int64 ``[N]`` slots, -1 where absent."""
        return torch.from_numpy(find_keys(table.numpy(), gids.numpy(), hashes.numpy()))

    @staticmethod
    def insert(
        table: torch.Tensor, W: int, gids: torch.Tensor, hashes: torch.Tensor
    ) -> int:
        """:func:`insert_keys`: the number of keys newly stored."""
        return insert_keys(table.numpy(), gids.numpy(), hashes.numpy())

    @staticmethod
    def set_bits(
        bits: torch.Tensor, slots: torch.Tensor, engines: torch.Tensor, num_engines: int
    ) -> np.ndarray:
        """:func:`set_bits`; returns int64 ``[E]``, the bits newly set per
        engine."""
        new = set_bits(bits.numpy(), slots.numpy(), engines.numpy())
        return np.bincount(engines.numpy()[new > 0], minlength=num_engines)

    @staticmethod
    def clear_bits(keys: torch.Tensor, bits: torch.Tensor, slots: torch.Tensor,
                   engines: torch.Tensor,
                   num_engines: int) -> tuple[np.ndarray, int]:  # fmt: skip
        """:func:`clear_bits`; returns (int64 ``[E]``, the bits cleared per
        engine; the slots tombstoned)."""
        out, freed = clear_bits(keys.numpy(), bits.numpy(), slots.numpy(),
                                engines.numpy())  # fmt: skip
        return np.bincount(engines.numpy()[out > 0], minlength=num_engines), freed

    @staticmethod
    def clear_engine(
        keys: torch.Tensor, bits: torch.Tensor, engine: int
    ) -> tuple[int, int]:
        """:func:`clear_engine`: (bits cleared, slots tombstoned)."""
        return clear_engine(keys.numpy(), bits.numpy(), engine)

    @staticmethod
    def probe_bits(
        keys: torch.Tensor, bits: torch.Tensor, gids: torch.Tensor, rows: torch.Tensor
    ) -> np.ndarray:
        """:func:`probe_bits`: int64 ``[G, T, NW]``."""
        return probe_bits(keys.numpy(), bits.numpy(), gids.numpy(), rows.numpy())

    def full_runs(self, table: torch.Tensor, keys: torch.Tensor, bits: torch.Tensor,
                  rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                  ends: np.ndarray, scale: int, members: np.ndarray, live: np.ndarray,
                  active: torch.Tensor, num_engines: int) -> torch.Tensor:  # fmt: skip
        """:func:`full_runs` on the joint ``table`` (``keys``, ``bits`` its
        views; ``active`` is what ``live`` packs): int64 ``[B, E]``."""
        return torch.from_numpy(full_runs(
            table.numpy(), bits.shape[1], rows.numpy(), offsets.numpy(),
            lengths.numpy(), ends, scale, members, live, num_engines,
        ))  # fmt: skip

    def full_hits(self, table: torch.Tensor, keys: torch.Tensor, bits: torch.Tensor,
                  rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                  lens: torch.Tensor, members: np.ndarray, live: np.ndarray,
                  active: torch.Tensor, params: np.ndarray,
                  num_engines: int) -> torch.Tensor:  # fmt: skip
        """vLLM's full-attention hit of every request against every engine
        (:func:`full_hits_checked` on tensors' views: ``lens`` int64 ``[B]``,
        >= 0): int64 ``[B, E]``. ``params`` int64 ``[7]``, as there."""
        lens_np = lens.numpy()
        if not (lens_np.flags.c_contiguous and lens_np.flags.writeable):
            # The one form the kernel is compiled for (another would cost a
            # compile of ~15 s): B ints, never written.
            lens_np = lens_np.copy()
        bad, out = full_hits_checked(table.numpy(), rows.numpy(), offsets.numpy(),
                                     lengths.numpy(), lens_np, members, live,
                                     params)  # fmt: skip
        if bad >= 0:  # pragma: no cover - lens was checked
            raise RuntimeError("full_hits: a checked length was refused")
        return torch.from_numpy(out)
