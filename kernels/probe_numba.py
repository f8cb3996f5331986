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

from kvhit.kernels.contract import EMPTY, LOW33, LOW35, M1, M2, M3, SEED

__all__ = ["key_slot_hash", "slot_holds_key", "table_find"]

_SEED = np.int64(SEED)
_M1 = np.int64(M1)
_M2 = np.int64(M2)
_M3 = np.int64(M3)
_LOW33 = np.int64(LOW33)
_LOW35 = np.int64(LOW35)
_EMPTY = np.int64(EMPTY)


@numba.njit(inline="always", cache=True, nogil=True)
def key_slot_hash(gid, keys, r):
    """Slot hash of key ``(gid, keys[r, :])`` (int64 ``[N, W]`` rows);
    int64 arithmetic wraps, as in the Triton kernels."""
    h = (np.int64(gid) ^ _SEED) * _M1
    for j in range(keys.shape[1]):
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
        if table[slot, 1 + j] != keys[r, j]:
            return False
    return True


@numba.njit(inline="always", cache=True, nogil=True)
def table_find(table, gid, keys, r):
    """Slot of key ``(gid, keys[r, :])`` in ``table`` (int64 ``[C, W + 1]``,
    ``C`` a power of two), or -1 when absent. Linear probing from the home
    slot, a miss at the first EMPTY slot; TOMBSTONE and BUSY slots are passed
    over; at most ``C`` steps (a table with no EMPTY slot is corrupt)."""
    cap = table.shape[0]
    mask = cap - 1
    slot = key_slot_hash(gid, keys, r) & mask
    for _ in range(cap):
        g = table[slot, 0]
        if g == gid:
            if slot_holds_key(table, slot, keys, r):
                return slot
        elif g == _EMPTY:
            return -1
        slot = (slot + 1) & mask
    return -1
