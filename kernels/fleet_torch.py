"""FleetIndex kernels as torch ops (any device): the twins of
:mod:`kvhit.kernels.fleet_numba` on the same two tables (``keys`` int64
``[C, W + 1]``, a KeyIndex table, and ``bits`` int64 ``[C, NW]``, each
slot's engine set; see ``coordinator/fleet.py``).

Launchers take tensors on the tables' device and do not validate: the
FleetIndex checks every argument first.
"""

from __future__ import annotations

import torch

from kvhit.kernels.contract import TOMBSTONE
from kvhit.kernels.hash_index_torch import find

__all__ = ["clear_bits", "clear_engine", "full_runs", "probe_bits", "set_bits"]


def _bit_values(b: torch.Tensor) -> torch.Tensor:
    # 1 << b as int64 (bit 63 is the sign bit: wrapping, as the numba kernels).
    return torch.bitwise_left_shift(torch.ones_like(b), b)


def _cells(bits: torch.Tensor, slots: torch.Tensor, engines: torch.Tensor):
    """Distinct (slot, engine) pairs as (cell of ``bits.view(-1)``, bit, engine)."""
    nw = bits.shape[1]
    code = torch.unique(slots * (nw * 64) + engines)
    s, e = code // (nw * 64), code % (nw * 64)
    return s * nw + (e >> 6), e & 63, e


def _merge(flat, cell, val, op):
    # Distinct bits of one word OR together by summing them (no carries).
    ucell, inv = torch.unique(cell, return_inverse=True)
    acc = torch.zeros(ucell.shape[0], dtype=torch.int64, device=flat.device)
    acc.index_add_(0, inv, val)
    flat[ucell] = op(flat[ucell], acc)
    return ucell


def set_bits(
    bits: torch.Tensor, slots: torch.Tensor, engines: torch.Tensor, num_engines: int
) -> torch.Tensor:
    """Set engine ``engines[r]``'s bit of slot ``slots[r]`` (live slots);
    returns int64 ``[E]`` (CPU): the bits newly set per engine (a repeat in
    the batch counts once)."""
    flat = bits.view(-1)
    cell, b, e = _cells(bits, slots, engines)
    new = ((flat[cell] >> b) & 1) == 0
    _merge(flat, cell[new], _bit_values(b[new]), torch.bitwise_or)
    return torch.bincount(e[new].cpu(), minlength=num_engines)


def clear_bits(
    keys: torch.Tensor,
    bits: torch.Tensor,
    slots: torch.Tensor,
    engines: torch.Tensor,
    num_engines: int,
) -> tuple[torch.Tensor, int]:
    """Clear engine ``engines[r]``'s bit of slot ``slots[r]`` (-1: skipped); a
    slot left with no engine becomes a TOMBSTONE. Returns (int64 ``[E]``
    (CPU) bits cleared per engine, slots tombstoned)."""
    ok = slots >= 0
    flat = bits.view(-1)
    cell, b, e = _cells(bits, slots[ok], engines[ok])
    had = ((flat[cell] >> b) & 1) == 1
    ucell = _merge(flat, cell[had], _bit_values(b[had]), lambda x, a: x & ~a)
    touched = torch.unique(ucell // bits.shape[1])
    empty = touched[(bits[touched] == 0).all(dim=1)]
    keys[:, 0].index_fill_(0, empty, TOMBSTONE)
    return torch.bincount(e[had].cpu(), minlength=num_engines), int(empty.numel())


def clear_engine(
    keys: torch.Tensor, bits: torch.Tensor, engine: int
) -> tuple[int, int]:
    """Drop every key of ``engine``: (bits cleared, slots tombstoned)."""
    w, b = engine >> 6, engine & 63
    has = (((bits[:, w] >> b) & 1) == 1) & (keys[:, 0] >= 0)
    cleared = int(has.sum().item())
    bits[has, w] &= ~_bit_values(torch.tensor(b, device=bits.device))
    empty = has & (bits == 0).all(dim=1)
    keys[empty, 0] = TOMBSTONE
    return cleared, int(empty.sum().item())


def probe_bits(
    keys: torch.Tensor, bits: torch.Tensor, gids: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The engine set of every key ``(gids[i], rows[t])``: int64 ``[G, T, NW]``
    (zero where no engine holds it)."""
    W = rows.shape[1]
    out = torch.zeros((gids.shape[0], rows.shape[0], bits.shape[1]),
                      dtype=torch.int64, device=bits.device)  # fmt: skip
    for i, g in enumerate(gids.tolist()):
        slots = find(keys, W, torch.full_like(rows[:, 0], g), rows)
        hit = slots >= 0
        out[i, hit] = bits[slots[hit]]
    return out


def full_runs(
    keys: torch.Tensor,
    bits: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    ends: torch.Tensor,
    scale: int,
    members: tuple[int, ...],
    active: torch.Tensor,
    num_engines: int,
) -> torch.Tensor:
    """:func:`kvhit.kernels.fleet_numba.full_runs` as torch ops: int64
    ``[R, E]``, the leading run of blocks each engine holds in every member
    group. Every block below ``min(ends[r], lengths[r] // scale)`` is probed
    once per member (no early stop), the engine sets unpacked to ``[R, M,
    E]`` and each run counted by a cumulative minimum; ``active`` bool
    ``[E]`` masks engines out."""
    dev = keys.device
    R = offsets.shape[0]
    ends = torch.minimum(ends.to(dev), lengths.to(dev) // scale)
    M = int(ends.max().item()) if R else 0
    if M == 0:
        return torch.zeros((R, num_engines), dtype=torch.int64, device=dev)
    blocks = torch.arange(M, device=dev)
    valid = blocks[None, :] < ends[:, None]  # [R, M]
    idx = (offsets.to(dev)[:, None] + (blocks[None, :] + 1) * scale - 1)[valid]
    hashes = rows.index_select(0, idx).contiguous()
    words = torch.full((idx.shape[0], bits.shape[1]), -1, dtype=torch.int64, device=dev)
    for g in members:
        slots = find(keys, hashes.shape[1], torch.full_like(idx, g), hashes)
        held = torch.zeros_like(words)
        hit = slots >= 0
        held[hit] = bits[slots[hit]]
        words &= held
    grid = torch.zeros((R, M, bits.shape[1]), dtype=torch.int64, device=dev)
    grid[valid] = words
    e = torch.arange(num_engines, device=dev)
    held = ((grid[:, :, e >> 6] >> (e & 63)) & 1).to(torch.uint8)  # [R, M, E]
    held &= active.to(dev).to(torch.uint8)
    return held.cummin(dim=1).values.to(torch.int64).sum(dim=1)
