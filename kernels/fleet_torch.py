"""FleetIndex kernels as torch ops (any device): the twins of
:mod:`kvhit.kernels.fleet_numba` on the same two tables (``keys`` int64
``[C, W + 1]``, a KeyIndex table, and ``bits`` int64 ``[C, NW]``, each
slot's engine set; see ``coordinator/fleet_index.py``).

Launchers take tensors on the tables' device and do not validate: the
FleetIndex checks every argument first. :class:`FleetOps` is the
FleetIndex's adapter (the same calls as the numba and Triton families');
:func:`unpack_engines` and :func:`hits_of_runs` are host helpers every
family's caller shares.
"""

from __future__ import annotations

import numpy as np
import torch

from kvhit.kernels.contract import TOMBSTONE
from kvhit.kernels.hash_index_torch import find, insert, new_table

__all__ = [
    "FleetOps",
    "clear_bits",
    "clear_engine",
    "full_runs",
    "hits_of_runs",
    "probe_bits",
    "set_bits",
    "unpack_engines",
]


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


def unpack_engines(words: np.ndarray, num_engines: int) -> torch.Tensor:
    """Engine sets int64 ``[..., NW]`` -> bool ``[..., num_engines]`` (CPU)."""
    w = np.ascontiguousarray(words, dtype=np.int64)
    flat = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(flat[..., :num_engines].astype(bool))


def hits_of_runs(runs: np.ndarray, bs: int, align: int, drop: bool) -> np.ndarray:
    """vLLM's full-attention hit from the leading run of ``runs`` blocks
    (``reference.full_attention_hit`` without the fine-grained tail, as
    ``kernels/scan_numba_sg.py``'s ``scan_sg`` for a non-fine full SpecGroup):
    ``run * bs``, less ``min(align, bs)`` under the EAGLE drop, aligned."""
    hit = runs * bs
    if drop:
        hit = np.where(hit > 0, hit - min(align, bs), 0)
    return hit - hit % align


class FleetOps:
    """A FleetIndex's table operations as torch ops (tensors on the tables'
    device; no validation: the FleetIndex checks every argument first), the
    same calls as ``kernels/fleet_numba.FleetOps``. Keys and engine sets
    are two contiguous tables (the kernels index them flat); there is no
    host table (:meth:`host_table` is None), so a fleet of this family
    takes its device paths. The Triton family's FleetOps is this class with
    its own kernels (the ``*_kernel`` attributes: the same arguments and
    results) and joint scans."""

    #: The backend of the fleet's entry index (a KeyIndex of its own).
    entries_backend = "torch"
    #: The key-table kernels: ``(table, W, gids, hashes)``.
    find_kernel = staticmethod(find)
    insert_kernel = staticmethod(insert)
    #: The engine-set kernels: :func:`set_bits`, :func:`clear_bits`,
    #: :func:`probe_bits`.
    set_bits_kernel = staticmethod(set_bits)
    clear_bits_kernel = staticmethod(clear_bits)
    probe_bits_kernel = staticmethod(probe_bits)

    @staticmethod
    def new_tables(
        capacity: int, W: int, NW: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two tables: the keys (also the table probed, so returned twice)
        and the engine sets."""
        keys = new_table(capacity, W, device)
        bits = torch.zeros((capacity, NW), dtype=torch.int64, device=device)
        return keys, keys, bits

    @staticmethod
    def host_table(table: torch.Tensor) -> None:
        """None: these tables are read by torch ops, not by host kernels."""
        return None

    def find(
        self, table: torch.Tensor, W: int, gids: torch.Tensor, hashes: torch.Tensor
    ) -> torch.Tensor:
        """Slot of each key ``(gids[r], hashes[r])``, -1 where absent: int64
        ``[N]``."""
        return self.find_kernel(table, W, gids, hashes)

    def insert(
        self, table: torch.Tensor, W: int, gids: torch.Tensor, hashes: torch.Tensor
    ) -> int:
        """Insert keys (each once); returns the number newly stored."""
        return int(self.insert_kernel(table, W, gids, hashes).sum().item())

    def set_bits(
        self,
        bits: torch.Tensor,
        slots: torch.Tensor,
        engines: torch.Tensor,
        num_engines: int,
    ) -> np.ndarray:
        """:func:`set_bits`; returns int64 ``[E]``, the bits newly set per
        engine."""
        return self.set_bits_kernel(bits, slots, engines, num_engines).numpy()

    def clear_bits(self, keys: torch.Tensor, bits: torch.Tensor, slots: torch.Tensor,
                   engines: torch.Tensor,
                   num_engines: int) -> tuple[np.ndarray, int]:  # fmt: skip
        """:func:`clear_bits`; returns (int64 ``[E]``, the bits cleared per
        engine; the slots tombstoned)."""
        gone, freed = self.clear_bits_kernel(keys, bits, slots, engines, num_engines)
        return gone.numpy(), freed

    @staticmethod
    def clear_engine(
        keys: torch.Tensor, bits: torch.Tensor, engine: int
    ) -> tuple[int, int]:
        """:func:`clear_engine`: (bits cleared, slots tombstoned)."""
        return clear_engine(keys, bits, engine)

    def probe_bits(
        self,
        keys: torch.Tensor,
        bits: torch.Tensor,
        gids: torch.Tensor,
        rows: torch.Tensor,
    ) -> np.ndarray:
        """:func:`probe_bits`, on the host: int64 ``[G, T, NW]``."""
        return self.probe_bits_kernel(keys, bits, gids, rows).cpu().numpy()

    def full_runs(self, table: torch.Tensor, keys: torch.Tensor, bits: torch.Tensor,
                  rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                  ends: np.ndarray, scale: int, members: np.ndarray, live: np.ndarray,
                  active: torch.Tensor, num_engines: int) -> torch.Tensor:  # fmt: skip
        """:func:`full_runs` (``ends`` int64 ``[B]``; ``active`` bool ``[E]``,
        what ``live`` packs): int64 ``[B, E]`` on the tables' device."""
        return full_runs(keys, bits, rows, offsets, lengths, torch.from_numpy(ends),
                         scale, members.tolist(), active, num_engines)  # fmt: skip

    def full_hits(self, table: torch.Tensor, keys: torch.Tensor, bits: torch.Tensor,
                  rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                  lens: torch.Tensor, members: np.ndarray, live: np.ndarray,
                  active: torch.Tensor, params: np.ndarray,
                  num_engines: int) -> torch.Tensor:  # fmt: skip
        """vLLM's full-attention hit of every request against every engine:
        the runs of :func:`full_runs` (every block below the bound probed
        once, no early stop), then :func:`hits_of_runs` and, with
        ``lookup``, the store worker's rule, on the host. ``lens`` int64
        ``[B]`` >= 0; ``params`` int64 ``[7]``: (NW, scale, block size,
        alignment, EAGLE drop, lookup, E), as
        ``fleet_numba.full_hits_checked``'s. Returns int64 ``[B, E]`` on the
        tables' device."""
        _, scale, bs, align, drop, lookup, _ = (int(p) for p in params)
        lens_np = lens.cpu().numpy()
        n_units = lengths.cpu().numpy()
        bound = lens_np // align * align if lookup else lens_np
        runs = full_runs(
            keys, bits, rows, offsets, lengths, torch.from_numpy(bound // bs), scale,
            members.tolist(), active, num_engines,
        ).cpu().numpy()  # fmt: skip
        hit = hits_of_runs(runs, bs, align, bool(drop))
        if lookup:
            # The store worker's rule (ReferenceCoordinator.lookup): a hit
            # covering the whole prompt is re-derived at num_tokens - 1; the
            # leading run under the smaller bound is the run clipped to it.
            n_tok = lens_np[:, None]
            again = (n_tok - 1) // align * align
            hit2 = hits_of_runs(np.minimum(runs, again // bs), bs, align, bool(drop))
            hit = np.where(hit >= n_tok, np.where(again > 0, hit2, 0), hit)
            ok = (n_units > 0) & (bound > 0)
            hit = np.where(ok[:, None], hit, 0)
        return torch.from_numpy(hit).to(keys.device)
