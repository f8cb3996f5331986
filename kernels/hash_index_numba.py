"""numba kernels for the KeyIndex open-addressing hash table, on the CPU.

The same table as the Triton kernels (``kernels/hash_index.py``) and the torch
mirror (``kernels/hash_index_torch.py``; ``coordinator/key_index.py``'s module
docstring is the layout contract): int64 ``[capacity, W + 1]``, column 0 a
group id or a sentinel of :mod:`kvhit.kernels.contract`, columns 1..W the
hash words, home slot ``contract.slot_hash(...) & (capacity - 1)``, linear
probing, a miss at the first EMPTY slot. An index built by any backend
answers through any other.

The kernels are single-threaded loops over the batch (``nogil``, so other
Python threads keep running while one works). They assume one writer: a slot
is claimed and written in program order, so BUSY never appears in a table
only numba writes; a BUSY slot left by another writer is passed over like a
tombstone (it cannot hold the key: a BUSY slot holds no published key).

Launchers (``probe``, ``find``, ``insert``, ``erase``, ``rehash``) take CPU
torch tensors, validate them naming the argument, and run the kernels on
zero-copy numpy views. Importing this module imports numba; the coordinator
imports it only when the numba backend runs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from kvhit.kernels.checks import check_probe_args
from kvhit.kernels.contract import EMPTY, TOMBSTONE, key_op
from kvhit.kernels.msgpack_numba import container, unpack_int_lists
from kvhit.kernels.msgpack_numba import warm_up as msgpack_warm_up
from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.numba_entry import compiled_entry
from kvhit.kernels.probe_numba import (
    key_slot_hash,
    prefetch_row,
    slot_holds_key,
    table_find,
)

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = [
    "REFUSED",
    "erase",
    "find",
    "insert",
    "insert_checked",
    "insert_checked_at",
    "insert_count",
    "insert_entry",
    "insert_int_list",
    "int_list_entry",
    "NOT_READ",
    "probe",
    "rehash",
    "rehash_rows",
    "warm_up",
]

_EMPTY = np.int64(EMPTY)
_TOMBSTONE = np.int64(TOMBSTONE)
# Keys ahead of the current one whose home slot is prefetched. A probe is one
# cache miss into a table far larger than the caches; with the next few
# misses in flight a 10^6-key batch probes ~1.7x faster (measured: 16 and 8
# were alike, 4 lost a third of the gain).
_AHEAD = 8
# The insert's distance: a store batch (a KV event's blocks, a step's new
# blocks) writes each key's slot, and on tables past the last-level cache
# more misses in flight paid: 1000 fresh keys into 2**20 / 2**22 slots,
# 18.7 / 24.6 us at 8 ahead, 14.0 / 17.1 us at 32 (2**18 slots: alike).
_STORE_AHEAD = 32
# Whether warm_up() ran in this process.
_warm = False
#: What :func:`insert_checked` returns for a refused key (below every
#: ``-1 - r`` a batch can return).
REFUSED = -(1 << 62)
_REFUSED = np.int64(REFUSED)
#: What :func:`insert_int_list` returns for a message it does not read.
NOT_READ = REFUSED - 1


@intrinsic
def _address(typingctx, addr):
    """An int64 address as a void pointer, for ``numba.carray``."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(addr), codegen


@numba.njit(inline="always", cache=True, nogil=True)
def _prefetch_home(table, gids, keys, r):
    """Prefetch the home slot of key ``r`` when there is such a key."""
    if r < gids.shape[0]:
        prefetch_row(table, key_slot_hash(gids[r], keys, r) & (table.shape[0] - 1))


@numba.njit(inline="always", cache=True, nogil=True)
def _prefetch_first(table, gids, keys):
    for r in range(min(_AHEAD, gids.shape[0])):
        _prefetch_home(table, gids, keys, r)


@numba.njit(cache=True, nogil=True)
def _find_kernel(table, gids, keys, out):
    _prefetch_first(table, gids, keys)
    for r in range(gids.shape[0]):
        _prefetch_home(table, gids, keys, r + _AHEAD)
        out[r] = table_find(table, gids[r], keys, r)


@numba.njit(cache=True, nogil=True)
def _probe_kernel(table, gids, keys, out):
    _prefetch_first(table, gids, keys)
    for r in range(gids.shape[0]):
        _prefetch_home(table, gids, keys, r + _AHEAD)
        out[r] = table_find(table, gids[r], keys, r) >= 0


@numba.njit(inline="always", cache=True, nogil=True)
def _insert_rows(table, gids, gconst, keys, out):
    """Insert the keys of ``keys`` (int64 ``[N, W]``) with group ids ``gids``
    (int64 ``[N]``), or ``gconst`` for every key when ``gconst >= 0`` (then
    ``gids`` is not read); unless ``out`` is None (bool ``[N]``), out[r] = 1
    where key r was new and stored, 0 where already present (earlier in the
    table or earlier in this batch). Returns the number of keys newly
    stored, or ``-1 - r`` where row ``r`` found no free slot (rows before it
    are inserted). Inlined into each kernel, so a literal ``gconst`` or
    ``out=None`` prunes its branches: the count-only loop, as fast as one
    written for it."""
    cap = table.shape[0]
    mask = cap - 1
    n = keys.shape[0]
    W = keys.shape[1]
    added = 0
    for r in range(min(_STORE_AHEAD, n)):
        g = gconst if gconst >= 0 else gids[r]
        prefetch_row(table, key_slot_hash(g, keys, r) & mask)
    for r in range(n):
        ahead = r + _STORE_AHEAD
        if ahead < n:
            g = gconst if gconst >= 0 else gids[ahead]
            prefetch_row(table, key_slot_hash(g, keys, ahead) & mask)
        gid = gconst if gconst >= 0 else gids[r]
        slot = key_slot_hash(gid, keys, r) & mask
        placed = False
        for _ in range(cap):
            g = table[slot, 0]
            if g == _EMPTY:
                # Only EMPTY slots are claimed, never tombstones: the key may
                # sit further along, behind the tombstone.
                for j in range(W):
                    table[slot, 1 + j] = keys[r, j]
                table[slot, 0] = gid
                added += 1
                if out is not None:
                    out[r] = 1
                placed = True
                break
            if g == gid and slot_holds_key(table, slot, keys, r):
                if out is not None:
                    out[r] = 0
                placed = True
                break
            slot = (slot + 1) & mask
        if not placed:
            return -1 - r
    return added


@numba.njit(cache=True, nogil=True)
def _insert_kernel(table, gids, keys, out):
    """:func:`_insert_rows` with a group id per key (``out`` as there)."""
    return _insert_rows(table, gids, -1, keys, out)


@numba.njit(inline="always", cache=True, nogil=True)
def _insert_checked_rows(table, gids, gconst, keys, pad):
    """:func:`_insert_rows` (count only) after checking every key, so a bad
    one changes nothing: :data:`REFUSED` when a group id is negative or a
    last word has a bit of ``pad`` (the padding bits) set."""
    n = keys.shape[0]
    if gconst < 0:
        for r in range(n):
            if gids[r] < 0:
                return _REFUSED
    if pad != 0:
        last = keys.shape[1] - 1
        for r in range(n):
            if keys[r, last] & pad:
                return _REFUSED
    return _insert_rows(table, gids, gconst, keys, None)


@numba.njit(cache=True, nogil=True)
def insert_checked(table, gids, gconst, keys, pad):
    """Insert keys given as numpy arrays, checked in the same call; for a
    KeyIndex's host store path (``KeyIndex.add``), whose caller has checked
    the arrays' types, shapes and layout.

    table: the index's table, int64 ``[capacity, W + 1]``; gids: int64
    ``[N]`` group ids, or any int64 ``[0]`` array when ``gconst >= 0`` is
    every key's group id; keys: int64 ``[N, W]``; all C-contiguous. pad: the
    bits of a last word that must be zero (``packing.padding_mask``).
    Returns the number of keys newly stored; :data:`REFUSED` when some group
    id is negative or some padding bit set (nothing stored: the caller
    names the argument); ``-1 - r`` when row ``r`` found no free slot (the
    rows before it are stored)."""
    return _insert_checked_rows(table, gids, gconst, keys, pad)


@numba.njit(cache=True, nogil=True)
def insert_int_list(table, gconst, msg, pad, room):
    """:func:`insert_checked` of the keys ``msg`` holds, for group ``gconst``
    (>= 0): ``msg`` the msgpack of a list of one list of ints (msgspec's
    bytes of a router's ``[hashes]``), each key's one word (``table``'s W is
    1), read and inserted in one call. Returns as :func:`insert_checked`, or
    :data:`NOT_READ` (nothing stored) when ``msg`` is anything else (an item
    that is not an int in int64) or holds more than ``room`` keys: the
    caller then converts the list itself, naming a bad item."""
    nb, _ = container(msg, 0, 0x90, 0xDC)
    if nb != 1:
        return NOT_READ
    # unpack_int_lists' layout for one list: offsets [2], length [1], then
    # the values; every msgpack int takes a byte at least.
    out = np.empty(3 + len(msg), np.int64)
    n = unpack_int_lists(msg, out)
    if n < 0 or n > room:
        return NOT_READ
    # The keys copied to an array of their own: the insert inlined on views
    # of one allocation ran 3x slower (900 keys: 46.8 against 13.5 us for
    # insert_checked; the copy costs ~1 ns a key).
    keys = np.empty((n, 1), np.int64)
    keys[:, 0] = out[3 : 3 + n]
    return _insert_checked_rows(table, out[:0], gconst, keys, pad)


@numba.njit(cache=True, nogil=True)
def insert_checked_at(table, gaddr, gconst, kaddr, n, pad):
    """:func:`insert_checked` for keys held by CPU torch tensors, read where
    they lie (``Tensor.numpy()`` costs a microsecond a tensor): ``kaddr``
    the address of ``n`` C-contiguous int64 rows of ``W = table.shape[1] -
    1`` words (``Tensor.data_ptr()``), ``gaddr`` that of ``n`` int64 group
    ids (unused when ``gconst >= 0``). The caller keeps the tensors alive
    and has checked their dtype, device, shape and layout."""
    keys = numba.carray(_address(kaddr), (n, table.shape[1] - 1), np.int64)
    if gconst >= 0:
        gids = numba.carray(_address(kaddr), (0,), np.int64)
    else:
        gids = numba.carray(_address(gaddr), (n,), np.int64)
    return _insert_checked_rows(table, gids, gconst, keys, pad)


def insert_count(table: np.ndarray, gids: np.ndarray, hashes: np.ndarray) -> int:
    """The host fast path of :func:`insert` on numpy views, trusted (a
    KeyIndex's own table and keys it normalized): ``table`` int64
    ``[capacity, W + 1]``, ``gids`` int64 ``[N]``, ``hashes`` int64 ``[N,
    W]``, all C-contiguous. Returns the number of keys newly stored; raises
    RuntimeError as :func:`insert` when some key found no free slot. Only
    the key columns are touched: ``table`` may carry more after its ``W + 1``
    (the fleet index's engine sets)."""
    if gids.shape[0] == 0:
        return 0
    added = _insert_kernel(table, gids, hashes, None)
    if added < 0:
        raise RuntimeError("insert: the table has no free slot for some keys")
    return added


@numba.njit(cache=True, nogil=True)
def _erase_kernel(table, gids, keys, out):
    _prefetch_first(table, gids, keys)
    for r in range(gids.shape[0]):
        _prefetch_home(table, gids, keys, r + _AHEAD)
        slot = table_find(table, gids[r], keys, r)
        if slot >= 0:
            table[slot, 0] = _TOMBSTONE
            out[r] = 1
        else:
            out[r] = 0


@numba.njit(cache=True, nogil=True)
def _rehash_kernel(old, new, W):
    """Copy every live row of ``old`` into ``new`` (all EMPTY, as many
    columns): the key (column 0 its group id, columns ``1..W`` its words)
    and any columns past it (a FleetIndex's engine sets), whole. Keys of a
    valid table are distinct, so each goes to the first EMPTY slot of its
    probe sequence without comparing words. Returns the rows copied, or -1
    when ``new`` ran out of EMPTY slots.

    No prefetch: a key's slot in ``new`` is its slot hash masked by a
    power of two at least ``old``'s, so walking ``old`` in slot order writes
    ``new`` in ``len(new) / len(old)`` ascending streams, which the
    hardware prefetcher follows. Prefetching each home slot ahead (as the
    inserts do) only hashed every key twice: 131,000 keys into 2**19 slots
    41-44 -> 23 ns a key, 10**6 into 2**22 40-45 -> 23-24."""
    cap = new.shape[0]
    mask = cap - 1
    cols = old.shape[1]
    words = old[:, 1 : W + 1]
    n = 0
    for s in range(old.shape[0]):
        gid = old[s, 0]
        if gid < 0:
            continue
        slot = key_slot_hash(gid, words, s) & mask
        steps = 0
        while new[slot, 0] != _EMPTY:
            slot = (slot + 1) & mask
            steps += 1
            if steps == cap:
                return -1
        for j in range(1, cols):
            new[slot, j] = old[s, j]
        new[slot, 0] = gid
        n += 1
    return n


def rehash_rows(old: np.ndarray, new: np.ndarray, W: int) -> int:
    """:func:`rehash` on numpy tables, no checks: every live row of ``old``
    (int64 ``[C, K]``, a valid table whose first ``W + 1`` columns are the
    key) copied whole into ``new`` (int64 ``[C', K]``, C-contiguous, column
    0 EMPTY, ``C'`` a power of two with room for every key). Returns the
    number copied; RuntimeError if ``new`` has no room. A FleetIndex's
    joint table (keys, then engine sets) grows through it."""
    n = _rehash_kernel(old, new, W)
    if n < 0:
        raise RuntimeError("rehash: the new table has no free slot for some keys")
    return int(n)


def _views(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
    trusted: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zero-copy numpy views of the launcher arguments, checked unless
    ``trusted`` (a KeyIndex's own table and normalized keys)."""
    if not trusted:
        check_probe_args(table, W, group_ids, hashes, device_type="cpu")
    return table.numpy(), group_ids.numpy(), hashes.numpy()


def _run(kernel, dtype, table, W, group_ids, hashes, trusted) -> torch.Tensor:
    """Every launcher's work: check (:func:`_views`), allocate ``out``
    (zeros ``[N]`` of ``dtype``) and, when there are keys, run
    ``kernel(table, group_ids, hashes, out)``; ``out`` as a tensor. A
    negative return (the insert's ``-1 - r``) is a key that found no free
    slot: RuntimeError (the rows before it are inserted)."""
    t, g, h = _views(table, W, group_ids, hashes, trusted)
    out = np.zeros(g.shape[0], dtype=dtype)
    if g.shape[0]:
        ret = kernel(t, g, h, out)
        if ret is not None and ret < 0:
            raise RuntimeError("insert: the table has no free slot for some keys")
    return torch.from_numpy(out)


find = key_op(
    "find",
    """Slot of each key, or -1 where absent: int64 ``[N]``.

    table: int64 ``[capacity, W + 1]`` (a KeyIndex table); group_ids: int64
    ``[N]``; hashes: int64 ``[N, W]``; all contiguous, on the CPU.
    ``trusted``: the caller built them so (a KeyIndex): nothing is checked.
    """,
    partial(_run, _find_kernel, np.int64),
)
probe = key_op(
    "probe",
    """Membership of keys: bool ``[N]``. Arguments as :func:`find`.""",
    partial(_run, _probe_kernel, np.bool_),
)
insert = key_op(
    "insert",
    """Insert keys into ``table`` in place; bool ``[N]``, True where the key was
    new and this row stored it.

    Keys already present and repeats inside the batch are stored once (the
    number of new keys is ``result.sum()``), as the torch and Triton inserts.
    The caller must leave room (an EMPTY slot on every probe path; KeyIndex
    keeps load <= max_load < 1). Arguments as :func:`find`. Raises
    RuntimeError if a key found no free slot (rows before it are inserted).
    """,
    partial(_run, _insert_kernel, np.bool_),
)
erase = key_op(
    "erase",
    """Replace keys by tombstones in place; bool ``[N]``, True where this row
    removed the key (absent keys and later repeats are False). Arguments as
    :func:`find`.""",
    partial(_run, _erase_kernel, np.bool_),
)


def rehash(table: torch.Tensor, W: int, new: torch.Tensor) -> int:
    """Copy every live key of ``table`` into ``new`` in place; returns the
    number copied.

    table: a valid KeyIndex table (its keys distinct), int64 ``[C, W + 1]``;
    new: an empty table (column 0 EMPTY, words 0), int64 ``[C', W + 1]``, both
    contiguous on the CPU, ``C'`` a power of two with room for every key.
    Tombstones are dropped. Raises RuntimeError if ``new`` has no room.
    """
    for t in (table, new):
        check_probe_args(t, W, None, None, device_type="cpu")
    return rehash_rows(table.numpy(), new.numpy(), W)


def insert_entry() -> Callable[..., int]:
    """:func:`insert_checked`'s compiled wrapper for ``KeyIndex.add``'s
    numpy path (``numba_entry.compiled_entry``): C-contiguous, aligned int64
    table, group ids and rows, int64 group id and pad; ``KeyIndex.add``
    sends unaligned rows to the dispatcher."""
    one = np.empty(1, dtype=np.int64)
    rows = np.empty((1, 1), dtype=np.int64)
    return compiled_entry(insert_checked, rows, one, 0, rows, 0)


def int_list_entry() -> Callable[..., int]:
    """:func:`insert_int_list`'s compiled wrapper (``numba_entry
    .compiled_entry``): a C-contiguous int64 table, int64 group id, bytes,
    int64 pad and room; ``KeyIndex.add`` hands it only its own table and
    msgspec's bytes."""
    rows = np.empty((1, 2), dtype=np.int64)
    return compiled_entry(insert_int_list, rows, 0, b"", 0, 0)


def warm_up() -> None:
    """Load (or compile, on a cold cache) the kernels a KeyIndex calls on
    its host path, on a scratch table, so that the first store or probe of a
    serving process does not pay for it. Once per process."""
    global _warm
    if _warm:
        return
    table = np.zeros((4, 2), dtype=np.int64)
    table[:, 0] = _EMPTY
    gids = np.zeros(1, dtype=np.int64)
    keys = np.ones((1, 1), dtype=np.int64)
    insert_count(table, gids, keys)  # the insert kernel's out=None copy
    # KeyIndex.add's checked inserts: numpy keys (group ids per key, or one
    # for all), and keys read from a tensor's memory.
    insert_checked(table, gids, np.int64(-1), keys, np.int64(0))
    insert_checked(table, gids, np.int64(0), keys, np.int64(0))
    t = torch.from_numpy(keys)
    insert_checked_at(table, t.data_ptr(), np.int64(0), t.data_ptr(), 1, np.int64(0))
    # A router's list of int hashes ([[1]]).
    insert_int_list(table, np.int64(0), b"\x91\x91\x01", np.int64(0), np.int64(1))
    for kernel, dtype in (
        (_find_kernel, np.int64),
        (_probe_kernel, np.bool_),
        (_insert_kernel, np.bool_),
        (_erase_kernel, np.bool_),
    ):
        kernel(table, gids, keys, np.zeros(1, dtype=dtype))
    new = np.zeros((4, 2), dtype=np.int64)
    new[:, 0] = _EMPTY
    _rehash_kernel(table, new, 1)
    # from_ints' decoder of a batch of lists (coordinator/int_lists.py).
    msgpack_warm_up()
    _warm = True
