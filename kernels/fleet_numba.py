"""FleetIndex kernels on the CPU, compiled by numba.

A :class:`kvhit.coordinator.fleet.FleetIndex` is two arrays with one row per
slot: ``keys`` int64 ``[C, W + 1]``, a KeyIndex table holding every key that
at least one engine holds (layout of ``coordinator/key_index.py``; probed with
:func:`kvhit.kernels.probe_numba.table_find`), and ``bits`` int64 ``[C, NW]``,
the set of engines holding that slot's key (engine ``e`` is bit ``e % 64`` of
word ``e // 64``). One probe per (group, hash) therefore answers for every
engine.

Launchers take numpy arrays (the coordinator passes zero-copy views of its CPU
tensors) and do not validate: the FleetIndex checks every argument first.

Importing this module imports numba (the FleetIndex imports it lazily).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvhit.kernels.contract import EMPTY, TOMBSTONE
from kvhit.kernels.probe_numba import key_slot_hash, table_find

__all__ = [
    "clear_bits",
    "clear_engine",
    "full_runs",
    "probe_bits",
    "set_bits",
]

_JIT = {"cache": True, "nogil": True}
# Blocks ahead of the current one whose home slot (key row and engine-set row)
# is prefetched. A block costs two cache misses into tables far larger than
# the caches when a batch's slots are not cached already (the common case: a
# router sees each request once); the next blocks' keys are known in advance.
_AHEAD = 16


@intrinsic
def _prefetch_row(typingctx, table, slot):
    """Hint the CPU to start loading ``table[slot, 0]`` (a read); no effect
    on results (the same hint as ``kernels/hash_index_numba.py``'s)."""
    sig = types.void(table, slot)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer(
            context, builder, aty, ary, [args[1], zero], wraparound=False
        )
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # (address, rw=read, locality=3 (keep), cache=data)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])  # fmt: skip
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always", **_JIT)
def _prefetch_block(keys, bits, gid, rows, row):
    s = key_slot_hash(gid, rows, row) & (keys.shape[0] - 1)
    _prefetch_row(keys, s)
    _prefetch_row(bits, s)


_TOMB = np.int64(TOMBSTONE)
_EMPTY = np.int64(EMPTY)


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
    nw = bits.shape[1]
    for r in range(slots.shape[0]):
        s = slots[r]
        if s < 0:
            continue
        e = engines[r]
        w = e >> 6
        b = np.int64(1) << np.int64(e & 63)
        if bits[s, w] & b == 0:
            continue
        bits[s, w] &= ~b
        out[r] = 1
        empty = True
        for k in range(nw):
            if bits[s, k] != 0:
                empty = False
                break
        if empty:
            # No engine holds the key any more: a tombstone, as KeyIndex's erase.
            keys[s, 0] = _TOMB
            freed += 1
    return freed


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
    nw = bits.shape[1]
    cleared = 0
    freed = 0
    for s in range(keys.shape[0]):
        if keys[s, 0] < 0 or bits[s, w] & b == 0:
            continue
        bits[s, w] &= ~b
        cleared += 1
        empty = True
        for k in range(nw):
            if bits[s, k] != 0:
                empty = False
                break
        if empty:
            keys[s, 0] = _TOMB
            freed += 1
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


@numba.njit(**_JIT)
def _full_runs(keys, bits, rows, offsets, lengths, ends, scale, members, live, runs):
    nw = bits.shape[1]
    n_eng = runs.shape[1]
    n_mem = members.shape[0]
    acc = np.empty(nw, dtype=np.int64)
    for r in range(offsets.shape[0]):
        off = offsets[r]
        end = min(ends[r], lengths[r] // scale)
        for k in range(nw):
            acc[k] = live[k]
        for a in range(min(_AHEAD, end)):
            _prefetch_block(keys, bits, members[0], rows, off + (a + 1) * scale - 1)
        i = 0
        while i < end:
            row = off + (i + 1) * scale - 1
            if i + _AHEAD < end:
                _prefetch_block(keys, bits, members[0], rows, row + _AHEAD * scale)
            s = table_find(keys, members[0], rows, row)
            alive = False
            for k in range(nw):
                prev = acc[k]
                if prev == 0:
                    # Every engine of this word has already stopped.
                    continue
                cur = np.int64(0) if s < 0 else prev & bits[s, k]
                # A merged SpecGroup: the key must be in every member group.
                m = 1
                while cur != 0 and m < n_mem:
                    t = table_find(keys, members[m], rows, row)
                    cur = np.int64(0) if t < 0 else cur & bits[t, k]
                    m += 1
                if cur != prev:
                    # Engines whose run ends at block i.
                    _store_bits(runs, r, k, prev & ~cur, i, n_eng)
                    acc[k] = cur
                if cur != 0:
                    alive = True
            if not alive:
                break
            i += 1
        for k in range(nw):
            _store_bits(runs, r, k, acc[k], i, n_eng)


# ctz by de Bruijn multiplication: numba has no count-trailing-zeros intrinsic.
_DEBRUIJN = np.uint64(0x022FDD63CC95386D)
_DEBRUIJN_INDEX = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _DEBRUIJN_INDEX[(((1 << _i) * 0x022FDD63CC95386D) & ((1 << 64) - 1)) >> 58] = _i


@numba.njit(inline="always", **_JIT)
def _store_bits(runs, r, k, word, value, n_eng):
    """runs[r, e] = value for every engine e whose bit is set in ``word`` (word
    ``k`` of an engine set)."""
    x = np.uint64(word)
    while x != np.uint64(0):
        low = x & (~x + np.uint64(1))
        e = k * 64 + _DEBRUIJN_INDEX[(low * _DEBRUIJN) >> np.uint64(58)]
        if e < n_eng:
            runs[r, e] = value
        x ^= low


def full_runs(
    keys: np.ndarray,
    bits: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    ends: np.ndarray,
    scale: int,
    members: np.ndarray,
    live: np.ndarray,
    num_engines: int,
) -> np.ndarray:
    """Per request and engine, the leading run of full-attention blocks the
    engine holds (the leading-run phase of ``reference.full_attention_hit``,
    as ``kernels/scan_numba.py``'s ``_leading_run``): int64 ``[R, E]``.

    Block ``i`` of request ``r`` is keyed by hash row ``offsets[r] + (i + 1) *
    scale - 1`` and needs the key in every group of ``members`` (a merged
    SpecGroup); runs stop at ``min(ends[r], lengths[r] // scale)`` blocks. The
    engine sets are ANDed block by block, so a request costs one probe per
    member and block scanned (until no engine is left) whatever the number of
    engines. ``live`` int64 ``[NW]``: the engines that may hit.
    """
    runs = np.zeros((offsets.shape[0], num_engines), dtype=np.int64)
    if offsets.shape[0]:
        _full_runs(keys, bits, rows, offsets, lengths, ends, np.int64(scale),
                   members, live, runs)  # fmt: skip
    return runs
