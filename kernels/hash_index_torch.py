"""The KeyIndex hash-table kernels in torch: any device torch runs on.

The torch member of the hash-index kernel family, beside the Triton
(:mod:`kvhit.kernels.hash_index`) and numba
(:mod:`kvhit.kernels.hash_index_numba`) ones, with the same launchers:
:func:`find`, :func:`probe`, :func:`insert`, :func:`erase`, :func:`rehash`
(``(table, W, group_ids, hashes)``; ``rehash(table, W, new)``), bit-identical
with them (``tests/test_key_index.py`` checks it). The table layout, sentinels,
slot hash and probe sequence are the contract of
:mod:`kvhit.coordinator.key_index` (module docstring); the constants come from
:mod:`kvhit.kernels.contract`. :func:`new_table` builds an empty table for
every family and :func:`copy_table` copies one (on the CPU both allocate
through numpy, for transparent huge pages).

No validation here: the callers (``KeyIndex``, which validated its arguments,
and the torch scanner :mod:`kvhit.kernels.scan_torch`) pass int64,
contiguous tensors on the table's device, as the contract says. Imports
neither triton nor numba.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from kvhit.kernels.contract import (
    BUSY,
    EMPTY,
    LOW33,
    LOW35,
    M1,
    M2,
    M3,
    SEED,
    TOMBSTONE,
    key_op,
)

__all__ = [
    "copy_table",
    "erase",
    "find",
    "insert",
    "new_table",
    "probe",
    "rehash",
    "slot_hash",
]

# Transient claim markers of the torch insert are <= _MARKER0, below every
# sentinel; they never outlive one insert call.
_MARKER0 = BUSY - 1


def _zeros(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Zeroed int64 ``shape`` on ``device``; on the CPU allocated by numpy.

    numpy asks Linux for transparent huge pages (MADV_HUGEPAGE) on large
    arrays and torch's CPU allocator does not: a lookup probes slots at
    random in tens of MB of table, and with 4 KiB pages each probe also
    misses the TLB. The result is an ordinary contiguous torch tensor.
    """
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(shape, dtype=np.int64))
    return torch.zeros(shape, dtype=torch.int64, device=device)


def new_table(capacity: int, W: int, device: torch.device | str) -> torch.Tensor:
    """An empty table: int64 ``[capacity, W + 1]``, column 0 EMPTY, words 0.

    On the CPU its memory comes from numpy (huge pages, see :func:`_zeros`).
    """
    device = torch.device(device)
    table = _zeros((capacity, W + 1), device)
    # On the CPU numpy writes column 0, on this thread: it is the fresh
    # table's first touch, and torch's strided fill spreads those page faults
    # over its pool, 3-4x slower on a 2-core host (2**21 slots: 22 vs 5-6 ms).
    (table.numpy() if device.type == "cpu" else table)[:, 0] = EMPTY
    return table


def copy_table(table: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A contiguous copy of ``table`` (int64 ``[C, W + 1]``) on ``device``.

    Like ``table.to(device, copy=True)``, but a CPU copy's memory comes from
    numpy (huge pages, see :func:`_zeros`), as :func:`new_table`'s does.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return table.to(device, copy=True).contiguous()
    out = _zeros(tuple(table.shape), device)
    out.copy_(table)
    return out


def slot_hash(group_ids: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """The 64-bit slot hash of keys (mask with ``capacity - 1`` for the slot).

    group_ids: int64 ``[N]``; hashes: int64 ``[N, W]``. Returns int64 ``[N]``.
    Bit-identical with :func:`kvhit.kernels.contract.slot_hash` and the
    Triton and numba kernels.
    """
    h = (group_ids ^ SEED) * M1
    for j in range(hashes.shape[1]):
        x = (h ^ hashes[:, j]) * M2
        h = x ^ ((x >> 31) & LOW33)
    x = h ^ ((h >> 29) & LOW35)
    x = x * M3
    return x ^ ((x >> 31) & LOW33)


def _find(
    table: torch.Tensor, group_ids: torch.Tensor, hashes: torch.Tensor
) -> torch.Tensor:
    """:data:`find` (its words: ``table``'s columns 1..W)."""
    n = group_ids.shape[0]
    dev = table.device
    out = torch.full((n,), -1, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    cap = table.shape[0]
    cap_mask = cap - 1
    gcol = table[:, 0]
    pos = slot_hash(group_ids, hashes) & cap_mask
    idx = torch.arange(n, device=dev)
    gid, key = group_ids, hashes
    # Windows of consecutive slots per round: most keys resolve in the first
    # few slots, and for small batches a round costs the same handful of
    # tensor ops whatever its width, so wide windows cut the rounds a long
    # probe chain needs. Large batches start one slot wide, where gathering
    # the extra slots costs more than the rounds it saves (measured on CPU).
    window = 1 if n > 8192 else 4
    scanned = 0
    while scanned < cap:
        width = min(window, cap - scanned)
        offs = torch.arange(width, device=dev)
        slots = (pos[:, None] + offs[None, :]) & cap_mask
        g = gcol[slots]
        # Words are compared only where the group matches.
        cand = (g == gid[:, None]).nonzero()
        full = torch.zeros_like(g, dtype=torch.bool)
        if cand.numel():
            ci, ck = cand[:, 0], cand[:, 1]
            cs = slots[ci, ck]
            ok = (table.index_select(0, cs)[:, 1:] == key.index_select(0, ci)).all(1)
            full[ci[ok], ck[ok]] = True
        stop = full | (g == EMPTY)
        any_stop = stop.any(dim=1)
        first = stop.to(torch.int8).argmax(dim=1)
        rows = torch.arange(idx.numel(), device=dev)
        hit = any_stop & full[rows, first]
        out[idx[hit]] = slots[rows[hit], first[hit]]
        keep = (~any_stop).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        idx = idx.index_select(0, keep)
        gid = gid.index_select(0, keep)
        key = key.index_select(0, keep)
        pos = (pos.index_select(0, keep) + width) & cap_mask
        scanned += width
        window *= 2
    return out


def _probe(
    table: torch.Tensor, group_ids: torch.Tensor, hashes: torch.Tensor
) -> torch.Tensor:
    """:data:`probe` (its words: ``table``'s columns 1..W)."""
    return _find(table, group_ids, hashes) >= 0


def _insert(
    table: torch.Tensor, group_ids: torch.Tensor, hashes: torch.Tensor
) -> torch.Tensor:
    """:data:`insert` (its words: ``table``'s columns 1..W)."""
    n = group_ids.shape[0]
    stored = torch.zeros(n, dtype=torch.bool, device=table.device)
    if n == 0:
        return stored
    cap_mask = table.shape[0] - 1
    flat = table.view(-1)
    stride = table.shape[1]
    pos = slot_hash(group_ids, hashes) & cap_mask
    idx = torch.arange(n, device=table.device)
    gid, key = group_ids, hashes
    # A key advances or settles each round, except once per slot after losing
    # a claim; more rounds than that means the table had no EMPTY slot left.
    for _ in range(2 * table.shape[0] + 1):
        if idx.numel() == 0:
            break
        g = table[:, 0].index_select(0, pos)
        same = g == gid
        cand = same.nonzero().squeeze(1)
        if cand.numel():
            words = table.index_select(0, pos.index_select(0, cand))[:, 1:]
            same[cand] = (words == key.index_select(0, cand)).all(dim=1)
        empty = g == EMPTY
        won = torch.zeros_like(empty)
        e = empty.nonzero().squeeze(1)
        if e.numel():
            # Several keys may want one EMPTY slot: each writes a distinct
            # marker, the minimum stays, and the key whose marker stayed wins.
            # Losers stay on the slot and compare with the winner next round,
            # which is also how repeats of one key are stored only once.
            pe = pos.index_select(0, e)
            marker = _MARKER0 - torch.arange(e.numel(), device=table.device)
            flat.scatter_reduce_(0, pe * stride, marker, reduce="amin")
            w = e[flat.index_select(0, pe * stride) == marker]
            pw = pos.index_select(0, w)
            table.index_copy_(
                0,
                pw,
                torch.cat([gid.index_select(0, w)[:, None], key.index_select(0, w)], 1),
            )
            won[w] = True
            stored[idx.index_select(0, w)] = True
        done = same | won
        advance = ~done & ~empty
        pos = torch.where(advance, (pos + 1) & cap_mask, pos)
        keep = (~done).nonzero().squeeze(1)
        idx = idx.index_select(0, keep)
        gid = gid.index_select(0, keep)
        key = key.index_select(0, keep)
        pos = pos.index_select(0, keep)
    if idx.numel():
        raise RuntimeError("insert: the table has no free slot for some keys")
    return stored


def _erase(
    table: torch.Tensor, group_ids: torch.Tensor, hashes: torch.Tensor
) -> torch.Tensor:
    """:data:`erase` (its words: ``table``'s columns 1..W)."""
    n = group_ids.shape[0]
    removed = torch.zeros(n, dtype=torch.bool, device=table.device)
    slots = _find(table, group_ids, hashes)
    rows = (slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return removed
    # The first row naming each found slot removes it.
    distinct, which = torch.unique(slots.index_select(0, rows), return_inverse=True)
    first = torch.full_like(distinct, n).scatter_reduce_(0, which, rows, reduce="amin")
    removed[first] = True
    table[:, 0].index_fill_(0, distinct, TOMBSTONE)
    return removed


def _run(
    work: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
    trusted: bool,
) -> torch.Tensor:
    """Every launcher's work, ``work(table, group_ids, hashes)``: the words
    come from ``table``'s width, and nothing is checked (every torch
    launcher is trusted; ``W`` and ``trusted`` are accepted so that the three
    hash-index families share one signature, :func:`kvhit.kernels.contract.key_op`)."""
    return work(table, group_ids, hashes)


find = key_op(
    "find",
    """Slot of each key in ``table``, or -1 where absent: int64 ``[N]``.

    table: int64 ``[capacity, W + 1]``; group_ids: int64 ``[N]``; hashes:
    int64 ``[N, W]``. Vectorised probe rounds over a shrinking set of keys
    still searching.
    """,
    partial(_run, _find),
    trusted_by_default=True,
)
probe = key_op(
    "probe",
    """Membership of keys in a KeyIndex table: bool ``[N]``.

    table: int64 ``[capacity, W + 1]`` (``index.table``); group_ids: int64
    ``[N]``; hashes: int64 ``[N, W]``; all on one device. No validation:
    every torch launcher is trusted (``trusted`` is accepted so that the
    three hash-index families share one signature).
    """,
    partial(_run, _probe),
    trusted_by_default=True,
)
insert = key_op(
    "insert",
    """Insert keys into ``table`` in place; bool ``[N]``, True where stored.

    Keys already present and repeats within the batch are stored once (the
    count of new keys is ``result.sum()``). The caller must leave room (an
    EMPTY slot on every probe path). Same semantics as the Triton insert.
    """,
    partial(_run, _insert),
    trusted_by_default=True,
)
erase = key_op(
    "erase",
    """Replace keys by tombstones in place; bool ``[N]``, True where this row
    removed the key (absent keys and later repeats are False), as the Triton
    and numba erases. Arguments as :func:`probe`.""",
    partial(_run, _erase),
    trusted_by_default=True,
)


def rehash(table: torch.Tensor, W: int, new: torch.Tensor) -> int:
    """Copy every live key of ``table`` into ``new`` in place; returns the
    number copied.

    table: a valid KeyIndex table (its keys distinct), int64 ``[C, W + 1]``;
    new: an empty table (:func:`new_table`), int64 ``[C', W + 1]`` on the same
    device, ``C'`` a power of two with room for every key. Tombstones are
    dropped. Raises RuntimeError if ``new`` has no room.
    """
    live = table[table[:, 0] >= 0]
    stored = _insert(new, live[:, 0].contiguous(), live[:, 1:].contiguous())
    return int(stored.sum().item())
