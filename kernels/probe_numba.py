"""The KeyIndex slot hash and single-key probe as numba device functions.

Shared by the numba kernels (``kernels/scan_numba.py`` probes from inside the
per-request scan; ``kernels/hash_index_numba.py`` builds its batched probe,
insert and erase on them). They read the table layout of
``coordinator/key_index.py`` with the numbers of :mod:`kvhit.kernels.contract`
and mirror :func:`kvhit.kernels.contract.slot_hash` (tests compare them).

Importing this module imports numba (only the numba kernels import it, lazily).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import load_item

from kvhit.kernels.contract import EMPTY, LOW33, LOW35, M1, M2, M3, SEED
from kvhit.kernels.numba_cache import lock_cache_saves

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = [
    "COUNT_COLS",
    "C_HITS",
    "C_LINES",
    "C_PROBES",
    "C_SLOTS",
    "cell",
    "key_slot_hash",
    "prefetch_cell",
    "prefetch_row",
    "slot_holds_key",
    "table_find",
    "table_find_from",
    "table_find_counted",
]

# Counter columns of :func:`table_find_counted`: probes, probes that found
# their key, table slots visited, 64-byte cache lines touched.
C_PROBES = 0
C_HITS = 1
C_SLOTS = 2
C_LINES = 3
COUNT_COLS = 4
_LINE = 64

_SEED = np.int64(SEED)
_M1 = np.int64(M1)
_M2 = np.int64(M2)
_M3 = np.int64(M3)
_LOW33 = np.int64(LOW33)
_LOW35 = np.int64(LOW35)
_EMPTY = np.int64(EMPTY)


@intrinsic
def prefetch_cell(typingctx, arr, i, j):
    """Hint the CPU to start loading ``arr[i, j]`` (a 2-D array; a read, kept
    in all cache levels); no effect on results."""
    sig = types.void(arr, i, j)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(
            context, builder, aty, ary, [args[1], args[2]], wraparound=False
        )
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # (address, rw=read, locality=3 (keep), cache=data)
        args = [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3)]
        builder.call(fn, [*args, ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cell(typingctx, arr, i, j):
    """``arr[i, j]`` of a 2-D array for indices known to be in bounds and
    non-negative: numba's indexing adds a negative-index fix-up to every
    load, which the probe path (slot, key and hash-row loads) never needs
    (long-hit lookups 1.03-1.06x, side by side)."""
    sig = arr.dtype(arr, i, j)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        inds = [
            context.cast(builder, args[k], signature.args[k], types.intp)
            for k in (1, 2)
        ]
        ptr = cgutils.get_item_pointer(
            context, builder, aty, ary, inds, wraparound=False
        )
        return load_item(context, builder, aty, ptr)

    return sig, codegen


@numba.njit(inline="always", cache=True, nogil=True)
def prefetch_row(arr, i):
    """Hint the CPU to start loading ``arr[i, 0]``; no effect on results."""
    prefetch_cell(arr, i, 0)


@numba.njit(inline="always", cache=True, nogil=True)
def key_slot_hash(gid, keys, r):
    """Slot hash of key ``(gid, keys[r, :])`` (int64 ``[N, W]`` rows);
    int64 arithmetic wraps, as in the Triton kernels."""
    h = (np.int64(gid) ^ _SEED) * _M1
    w = keys.shape[1]
    # The widths kvhit uses, 32- and 8-byte keys, unrolled: the loop's
    # counter and exit test were a fifth of the hash, which every probe and
    # prefetch computes (long-hit lookups 1.02-1.11x, side by side).
    if w == 4:
        x = (h ^ cell(keys, r, 0)) * _M2
        h = x ^ ((x >> 31) & _LOW33)
        x = (h ^ cell(keys, r, 1)) * _M2
        h = x ^ ((x >> 31) & _LOW33)
        x = (h ^ cell(keys, r, 2)) * _M2
        h = x ^ ((x >> 31) & _LOW33)
        x = (h ^ cell(keys, r, 3)) * _M2
        h = x ^ ((x >> 31) & _LOW33)
    elif w == 1:
        x = (h ^ cell(keys, r, 0)) * _M2
        h = x ^ ((x >> 31) & _LOW33)
    else:
        for j in range(w):
            x = (h ^ keys[r, j]) * _M2
            h = x ^ ((x >> 31) & _LOW33)
    x = h ^ ((h >> 29) & _LOW35)
    x = x * _M3
    return x ^ ((x >> 31) & _LOW33)


@numba.njit(inline="always", cache=True, nogil=True)
def slot_holds_key(table, slot, keys, r):
    """True when the words of ``table[slot]`` (int64 ``[C, W + 1]``) are
    ``keys[r, :]`` (int64 ``[N, W]`` rows); the group id in column 0 is the
    caller's to compare."""
    for j in range(keys.shape[1]):
        if cell(table, slot, 1 + j) != cell(keys, r, j):
            return False
    return True


@numba.njit(inline="always", cache=True, nogil=True)
def table_find(table, gid, keys, r):
    """Slot of key ``(gid, keys[r, :])`` in ``table`` (int64 ``[C, W + 1]``,
    ``C`` a power of two), or -1 when absent. Linear probing from the home
    slot, a miss at the first EMPTY slot; TOMBSTONE and BUSY slots are passed
    over; at most ``C`` steps (a table with no EMPTY slot is corrupt)."""
    return table_find_from(
        table, key_slot_hash(gid, keys, r) & (table.shape[0] - 1), gid, keys, r
    )


@numba.njit(inline="always", cache=True, nogil=True)
def table_find_from(table, slot, gid, keys, r):
    """:func:`table_find` from key ``r``'s home ``slot``, computed already
    (e.g. by a caller that prefetched it)."""
    cap = table.shape[0]
    mask = cap - 1
    for _ in range(cap):
        g = cell(table, slot, 0)
        if g == gid:
            if slot_holds_key(table, slot, keys, r):
                return slot
        elif g == _EMPTY:
            return -1
        slot = (slot + 1) & mask
    return -1


@numba.njit(cache=True, nogil=True)
def table_find_counted(table, gid, keys, r, cnt, base):
    """:func:`table_find`, counting into ``cnt[base + C_*]`` (int64): one
    probe, whether it hit, the slots it visited and the distinct 64-byte
    lines it read (column 0 of every visited slot, and the key words it
    compared; the table's first row taken as line-aligned). An instrument
    (``kvhit.kernels.scan_numba.count_probes``), never on the fast path."""
    cap = table.shape[0]
    mask = cap - 1
    width = table.shape[1]
    slot = key_slot_hash(gid, keys, r) & mask
    cnt[base + C_PROBES] += 1
    last = -1
    found = -1
    for _ in range(cap):
        cnt[base + C_SLOTS] += 1
        line = (slot * width * 8) // _LINE
        if line != last:
            cnt[base + C_LINES] += 1
            last = line
        g = table[slot, 0]
        if g == gid:
            same = True
            for j in range(keys.shape[1]):
                line = ((slot * width + 1 + j) * 8) // _LINE
                if line != last:
                    cnt[base + C_LINES] += 1
                    last = line
                if table[slot, 1 + j] != keys[r, j]:
                    same = False
                    break
            if same:
                found = slot
                break
        elif g == _EMPTY:
            break
        slot = (slot + 1) & mask
    if found >= 0:
        cnt[base + C_HITS] += 1
    return found
