"""KeyIndex: an exact hash set of ``(group_id, block_hash)`` keys on a device.

TABLE LAYOUT CONTRACT
=====================

Other code (the LookupEngine, from torch and from its own Triton kernels)
probes the table directly; this is the contract it relies on.

* ``index.table``: one contiguous int64 tensor ``[capacity, W + 1]`` on
  ``index.device``; ``index.capacity`` is a power of two, ``index.W =
  ceil(hash_bytes / 8)``. Row ``s`` is slot ``s``:

  - column 0: the group id (>= 0) of the key stored there, or a sentinel:
    ``EMPTY = -1`` (never used since the last clear/rehash), ``TOMBSTONE =
    -2`` (a removed key), ``BUSY = -3`` (an insert has claimed the slot and is
    writing the words; only seen by code running concurrently with a Triton
    insert). Group ids are therefore int64 in ``[0, 2**63)``.
  - columns 1..W: the hash words, packed as in ``coordinator/packing.py``
    (little-endian int64 words, last word zero-padded). They are 0 in EMPTY
    slots and keep the removed key's words in TOMBSTONE slots.

* Slot hash (int64 arithmetic, wrapping; ``>>`` on int64 is arithmetic in torch
  and Triton, so every shift is masked to make it logical)::

      SEED  = 0x2545F4914F6CDD1D
      M1    = 0x9E3779B97F4A7C15 - 2**64   # as signed int64
      M2    = 0xBF58476D1CE4E5B9 - 2**64
      M3    = 0x94D049BB133111EB - 2**64
      LOW33 = 2**33 - 1;  LOW35 = 2**35 - 1

      hash_init(g)   = (g ^ SEED) * M1
      hash_mix(h, w) = x = (h ^ w) * M2;  x ^ ((x >> 31) & LOW33)
      hash_finish(h) = x = h ^ ((h >> 29) & LOW35);  x = x * M3;
                       x ^ ((x >> 31) & LOW33)

      h = hash_init(group_id)
      for j in 0..W-1: h = hash_mix(h, word[j])
      home = hash_finish(h) & (capacity - 1)

  Every word and the group id feed the hash, but the hash only picks the
  starting slot: membership is decided by comparing all W words and the group
  id exactly, so keys equal in every bit the hash uses, or differing only in
  the group or in the last byte, are told apart.

* Probe sequence: linear, ``home, home + 1, ...`` modulo capacity. A probe for
  key ``K`` stops with a hit at the slot whose column 0 equals K's group id and
  whose words equal K's words, and with a miss at the first EMPTY slot.
  TOMBSTONE and BUSY slots are passed over. There is always an EMPTY slot:
  KeyIndex keeps ``live + tombstones <= max_load * capacity`` with
  ``max_load < 1``.

* Inserts only ever claim EMPTY slots (never tombstones), so a key sits at the
  first EMPTY-at-the-time slot of its probe sequence and, while the table is
  not rehashed, a slot never goes back to EMPTY. Rehashing (on growth, or to
  purge tombstones) builds a new tensor: ``index.table`` then names a new
  object, so holders of the old tensor must re-read ``index.table``.

* The Triton side (``kvhit.kernels.hash_index``) exports ``hash_init``,
  ``hash_mix``, ``hash_finish``, ``slot_hash``, ``find_slots`` and
  ``probe_keys`` as ``@triton.jit`` device functions; this module exports the
  torch mirror: :func:`slot_hash` and :func:`probe_table`.

Memory: the table is the only per-slot state, ``(W + 1) * 8`` bytes per slot,
so ``(W + 1) * 8 / load`` bytes per key.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvhit.coordinator.packing import HashBatch, num_words, pack_hashes, padding_mask

__all__ = [
    "BUSY",
    "EMPTY",
    "TOMBSTONE",
    "KeyIndex",
    "find_slots",
    "insert_table",
    "new_table",
    "probe_table",
    "slot_hash",
]

EMPTY = -1
TOMBSTONE = -2
BUSY = -3
# Transient claim markers of the torch insert are <= _MARKER0; never persisted.
_MARKER0 = -4

# Must equal kvhit.kernels.hash_index.HASH_CONSTANTS (a test checks it); the
# kernels module cannot be imported here without importing triton.
_HASH_CONSTANTS = {
    "SEED": 0x2545F4914F6CDD1D,
    "M1": 0x9E3779B97F4A7C15 - (1 << 64),
    "M2": 0xBF58476D1CE4E5B9 - (1 << 64),
    "M3": 0x94D049BB133111EB - (1 << 64),
    "LOW33": (1 << 33) - 1,
    "LOW35": (1 << 35) - 1,
}
_SEED = _HASH_CONSTANTS["SEED"]
_M1 = _HASH_CONSTANTS["M1"]
_M2 = _HASH_CONSTANTS["M2"]
_M3 = _HASH_CONSTANTS["M3"]
_LOW33 = _HASH_CONSTANTS["LOW33"]
_LOW35 = _HASH_CONSTANTS["LOW35"]

_BACKENDS = ("auto", "torch", "triton")
_STATE_VERSION = 1


# --------------------------------------------------------------------------
# Table primitives (torch). No validation: callers pass int64, contiguous
# tensors on the table's device, as the contract above says.
# --------------------------------------------------------------------------


def new_table(capacity: int, W: int, device: torch.device | str) -> torch.Tensor:
    """An empty table: int64 ``[capacity, W + 1]``, column 0 EMPTY, words 0."""
    table = torch.zeros((capacity, W + 1), dtype=torch.int64, device=device)
    table[:, 0] = EMPTY
    return table


def slot_hash(group_ids: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """The 64-bit slot hash of keys (mask with ``capacity - 1`` for the slot).

    group_ids: int64 ``[N]``; hashes: int64 ``[N, W]``. Returns int64 ``[N]``.
    Bit-identical with ``kvhit.kernels.hash_index.slot_hash``.
    """
    h = (group_ids ^ _SEED) * _M1
    for j in range(hashes.shape[1]):
        x = (h ^ hashes[:, j]) * _M2
        h = x ^ ((x >> 31) & _LOW33)
    x = h ^ ((h >> 29) & _LOW35)
    x = x * _M3
    return x ^ ((x >> 31) & _LOW33)


def find_slots(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
) -> torch.Tensor:
    """Slot of each key in ``table``, or -1 where absent: int64 ``[N]``.

    table: int64 ``[capacity, W + 1]``; group_ids: int64 ``[N]``; hashes:
    int64 ``[N, W]``. Vectorised probe rounds over a shrinking set of keys
    still searching.
    """
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


def probe_table(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
) -> torch.Tensor:
    """Membership of keys in a KeyIndex table: bool ``[N]``.

    table: int64 ``[capacity, W + 1]`` (``index.table``); group_ids: int64
    ``[N]``; hashes: int64 ``[N, W]``; all on one device. No validation.
    """
    return find_slots(table, W, group_ids, hashes) >= 0


def insert_table(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
) -> torch.Tensor:
    """Insert keys into ``table`` in place; bool ``[N]``, True where stored.

    Keys already present and repeats within the batch are stored once (the
    count of new keys is ``result.sum()``). The caller must leave room (an
    EMPTY slot on every probe path). Same semantics as the Triton insert.
    """
    n = group_ids.shape[0]
    stored = torch.zeros(n, dtype=torch.bool, device=table.device)
    if n == 0:
        return stored
    cap_mask = table.shape[0] - 1
    flat = table.view(-1)
    stride = W + 1
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


def erase_table(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
) -> int:
    """Replace keys by tombstones in place; returns the number removed."""
    slots = find_slots(table, W, group_ids, hashes)
    slots = torch.unique(slots[slots >= 0])
    table[:, 0].index_fill_(0, slots, TOMBSTONE)
    return int(slots.numel())


# --------------------------------------------------------------------------
# KeyIndex
# --------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class KeyIndex:
    """Exact hash set of ``(group_id, block_hash)`` keys on one device.

    Args:
        hash_bytes: width of every block hash in bytes (W = ceil(hash_bytes/8)).
        capacity: initial number of slots, rounded up to a power of two. The
            table grows (doubling, with a rehash) before ``live + tombstones``
            would exceed ``max_load * capacity``; no key is ever dropped.
        device: device of the table; all tensor arguments must be there.
        backend: "torch", "triton", or "auto" (triton off the CPU, torch on
            it). Both use the same table, so either answers for the other.
        max_load: the load factor bound, in (0, 1).

    Keys are given as ``group_ids`` (int64 tensor ``[N]``, a Python int
    broadcast to all N keys, or a sequence of ints; each >= 0) and ``hashes``
    (int64 tensor ``[N, W]`` packed as in ``coordinator/packing.py``, a
    :class:`HashBatch`, or a sequence of ``bytes`` of width ``hash_bytes``).
    Bad arguments raise ValueError/TypeError naming them and leave the index
    unchanged. See the module docstring for the table layout.
    """

    def __init__(
        self,
        hash_bytes: int,
        capacity: int = 1024,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        max_load: float = 0.5,
    ) -> None:
        self.hash_bytes = hash_bytes
        self.W = num_words(hash_bytes)
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if isinstance(max_load, bool) or not isinstance(max_load, int | float):
            raise TypeError(f"max_load must be a float, got {type(max_load).__name__}")
        if not 0.0 < max_load < 1.0:
            raise ValueError(f"max_load must be in (0, 1), got {max_load}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self.max_load = float(max_load)
        self._backend = backend
        self.table = new_table(_next_pow2(capacity), self.W, device)
        self._size = 0
        self._tombstones = 0

    # -- properties ---------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Number of slots (a power of two)."""
        return self.table.shape[0]

    @property
    def device(self) -> torch.device:
        """Device of the table."""
        return self.table.device

    @property
    def backend(self) -> str:
        """The backend in use on the current device: "torch" or "triton"."""
        if self._backend == "auto":
            return "torch" if self.device.type == "cpu" else "triton"
        return self._backend

    @property
    def tombstones(self) -> int:
        """Number of TOMBSTONE slots (purged by the next rehash)."""
        return self._tombstones

    @property
    def load(self) -> float:
        """Live keys per slot."""
        return self._size / self.capacity

    def __len__(self) -> int:
        return self._size

    def memory_bytes(self) -> int:
        """Bytes held by the table (the index's only device memory)."""
        return self.table.numel() * self.table.element_size()

    def __repr__(self) -> str:
        return (
            f"KeyIndex(hash_bytes={self.hash_bytes}, len={self._size}, "
            f"capacity={self.capacity}, device={self.device}, "
            f"backend={self.backend!r}, max_load={self.max_load})"
        )

    # -- argument handling ----------------------------------------------------

    def _keys(self, group_ids: Any, hashes: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate and normalise arguments: (int64 [N], int64 [N, W]), both
        contiguous on the table's device. Mutates nothing."""
        dev = self.device
        if isinstance(hashes, HashBatch):
            if hashes.hash_bytes != self.hash_bytes:
                raise ValueError(
                    f"hashes: HashBatch has hash_bytes={hashes.hash_bytes}, "
                    f"index has hash_bytes={self.hash_bytes}"
                )
            hashes = hashes.hashes
        if isinstance(hashes, torch.Tensor):
            if hashes.dtype != torch.int64:
                raise TypeError(f"hashes must be an int64 tensor, got {hashes.dtype}")
            if hashes.dim() != 2 or hashes.shape[1] != self.W:
                raise ValueError(
                    f"hashes must have shape [N, {self.W}] for hash_bytes="
                    f"{self.hash_bytes}, got {list(hashes.shape)}"
                )
            if hashes.device != dev:
                raise ValueError(f"hashes is on {hashes.device}, index is on {dev}")
            pad = padding_mask(self.hash_bytes)
            if pad and hashes.shape[0] and bool(((hashes[:, -1] & pad) != 0).any()):
                raise ValueError(
                    f"hashes: padding bits past hash_bytes={self.hash_bytes} in the "
                    "last word must be zero"
                )
            hashes = hashes.contiguous()
        elif isinstance(hashes, bytes | bytearray | memoryview | str):
            raise TypeError(
                "hashes must be an int64 tensor [N, W] or a sequence of bytes, "
                f"not a single {type(hashes).__name__}"
            )
        elif isinstance(hashes, Sequence):
            hashes = pack_hashes(hashes, self.hash_bytes).to(dev)
        else:
            raise TypeError(
                "hashes must be an int64 tensor [N, W] or a sequence of bytes, "
                f"got {type(hashes).__name__}"
            )
        n = hashes.shape[0]

        if isinstance(group_ids, bool):
            raise TypeError("group_ids must be int64, not bool")
        if isinstance(group_ids, numbers.Integral) and not isinstance(
            group_ids, np.bool_
        ):
            group_ids = int(group_ids)
            if group_ids < 0:
                raise ValueError(f"group_ids must be >= 0, got {group_ids}")
            if group_ids >= 1 << 63:
                raise ValueError(f"group_ids must fit in int64, got {group_ids}")
            return torch.full((n,), group_ids, dtype=torch.int64, device=dev), hashes
        if isinstance(group_ids, np.ndarray):
            if group_ids.dtype.kind not in "iu":
                raise TypeError(
                    f"group_ids must hold integers, got dtype {group_ids.dtype}"
                )
            if (
                group_ids.dtype == np.uint64
                and group_ids.size
                and (int(group_ids.max()) >= 1 << 63)
            ):
                raise ValueError("group_ids must fit in int64")
            group_ids = torch.from_numpy(group_ids.astype(np.int64)).to(dev)
        if isinstance(group_ids, torch.Tensor):
            if group_ids.dtype != torch.int64:
                raise TypeError(
                    f"group_ids must be an int64 tensor, got {group_ids.dtype}"
                )
            if group_ids.device != dev:
                raise ValueError(
                    f"group_ids is on {group_ids.device}, index is on {dev}"
                )
            if group_ids.dim() == 0:
                group_ids = group_ids.expand(n)
        elif isinstance(group_ids, Sequence) and not isinstance(group_ids, str | bytes):
            if not all(
                isinstance(g, numbers.Integral) and not isinstance(g, bool | np.bool_)
                for g in group_ids
            ):
                raise TypeError("group_ids must be a sequence of ints")
            try:
                group_ids = torch.tensor([int(g) for g in group_ids], dtype=torch.int64)
            except (RuntimeError, ValueError, OverflowError) as exc:
                # Out of int64 range.
                raise ValueError(f"group_ids must fit in int64 ({exc})") from None
            group_ids = group_ids.to(dev)
        else:
            raise TypeError(
                "group_ids must be an int, a sequence of ints or an int64 tensor, "
                f"got {type(group_ids).__name__}"
            )
        if group_ids.dim() != 1:
            raise ValueError(
                f"group_ids must have shape [N], got {list(group_ids.shape)}"
            )
        if group_ids.shape[0] != n:
            raise ValueError(
                f"group_ids has {group_ids.shape[0]} entries but hashes has {n} keys"
            )
        if n and bool((group_ids < 0).any()):
            raise ValueError("group_ids must be >= 0 (negative values are sentinels)")
        return group_ids.contiguous(), hashes

    # -- backend dispatch ---------------------------------------------------

    def _kernels(self):
        # Imported here, never at module import: coordinator/ must not pull
        # in triton unless the triton backend is actually used.
        from kvhit.kernels import hash_index

        return hash_index

    def _find(
        self, table: torch.Tensor, g: torch.Tensor, h: torch.Tensor
    ) -> torch.Tensor:
        if self.backend == "triton":
            return self._kernels().probe(table, self.W, g, h)
        return probe_table(table, self.W, g, h)

    def _insert(self, table: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> int:
        if self.backend == "triton":
            stored = self._kernels().insert(table, self.W, g, h)
        else:
            stored = insert_table(table, self.W, g, h)
        return int(stored.sum().item())

    def _erase(self, g: torch.Tensor, h: torch.Tensor) -> int:
        if self.backend == "triton":
            return int(self._kernels().erase(self.table, self.W, g, h).sum().item())
        return erase_table(self.table, self.W, g, h)

    # -- operations ---------------------------------------------------------

    def _limit(self, capacity: int) -> int:
        return math.floor(self.max_load * capacity)

    def _rehash(self, capacity: int) -> None:
        """Rebuild into a new table of ``capacity`` slots, dropping tombstones."""
        live = self.table[self.table[:, 0] >= 0]
        table = new_table(capacity, self.W, self.device)
        stored = self._insert(table, live[:, 0].contiguous(), live[:, 1:].contiguous())
        if stored != self._size:  # pragma: no cover - would be a bug
            raise RuntimeError(f"rehash stored {stored} keys, expected {self._size}")
        self.table = table
        self._tombstones = 0

    def add(self, group_ids: Any, hashes: Any) -> int:
        """Insert keys (idempotent); returns the number of keys that were new."""
        g, h = self._keys(group_ids, hashes)
        if g.shape[0] == 0:
            return 0
        if self._size + self._tombstones + g.shape[0] > self._limit(self.capacity):
            # The batch may not fit: count exactly how many keys are new
            # (absent and distinct) before deciding to grow, so that re-adding
            # known keys never inflates the table.
            absent = ~self._find(self.table, g, h)
            g, h = g[absent], h[absent]
            if g.shape[0] == 0:
                return 0
            rows = torch.unique(torch.cat([g[:, None], h], 1), dim=0)
            g, h = rows[:, 0].contiguous(), rows[:, 1:].contiguous()
            n_new = g.shape[0]
            if self._size + self._tombstones + n_new > self._limit(self.capacity):
                cap = self.capacity
                while self._size + n_new > self._limit(cap):
                    cap *= 2
                self._rehash(cap)
        added = self._insert(self.table, g, h)
        self._size += added
        return added

    def remove(self, group_ids: Any, hashes: Any) -> int:
        """Remove keys (absent keys are ignored); returns the number removed."""
        g, h = self._keys(group_ids, hashes)
        if g.shape[0] == 0:
            return 0
        removed = self._erase(g, h)
        self._size -= removed
        self._tombstones += removed
        return removed

    def contains(self, group_ids: Any, hashes: Any) -> torch.Tensor:
        """Membership of keys: bool ``[N]`` on the index's device."""
        g, h = self._keys(group_ids, hashes)
        if g.shape[0] == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        return self._find(self.table, g, h)

    def __contains__(self, key: object) -> bool:
        """``(group_id, hash_bytes) in index``."""
        if not (isinstance(key, tuple) and len(key) == 2):
            return False
        return bool(self.contains(key[0], [key[1]])[0].item())

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All live keys, in slot order: (int64 ``[len]``, int64 ``[len, W]``)."""
        live = self.table[self.table[:, 0] >= 0]
        return live[:, 0].contiguous(), live[:, 1:].contiguous()

    def clear(self) -> None:
        """Remove every key; the capacity is kept."""
        self.table[:, 0] = EMPTY
        self.table[:, 1:] = 0
        self._size = 0
        self._tombstones = 0

    def to(self, device: torch.device | str) -> KeyIndex:
        """Move the table to ``device`` in place (like ``nn.Module.to``);
        returns ``self``. With backend "auto" the backend follows the device."""
        self.table = self.table.to(device)
        return self

    # -- persistence ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The index as plain data; ``table`` is the live tensor, not a copy."""
        return {
            "version": _STATE_VERSION,
            "hash_bytes": self.hash_bytes,
            "max_load": self.max_load,
            "size": self._size,
            "tombstones": self._tombstones,
            "table": self.table,
        }

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, Any],
        device: torch.device | str | None = None,
        backend: str = "auto",
    ) -> KeyIndex:
        """Rebuild an index from :meth:`state_dict` output (the table is copied).

        The table is checked: shape, dtype, power-of-two capacity, no BUSY or
        unknown sentinel, counts matching ``size``/``tombstones``, and every key
        found at its own slot by the probe (so a table written with another
        hash function or with duplicate keys is rejected).
        """
        for field in (
            "version",
            "hash_bytes",
            "max_load",
            "size",
            "tombstones",
            "table",
        ):
            if field not in state:
                raise ValueError(f"state: missing field {field!r}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"state: unsupported version {state['version']!r}")
        table = state["table"]
        if not isinstance(table, torch.Tensor):
            raise TypeError(
                f"state['table'] must be a tensor, got {type(table).__name__}"
            )
        if table.dtype != torch.int64:
            raise TypeError(f"state['table'] must be int64, got {table.dtype}")
        obj = cls(
            state["hash_bytes"],
            capacity=1,
            device=device if device is not None else table.device,
            backend=backend,
            max_load=state["max_load"],
        )
        cap = table.shape[0] if table.dim() == 2 else 0
        if (
            table.dim() != 2
            or table.shape[1] != obj.W + 1
            or cap & (cap - 1)
            or cap < 1
        ):
            raise ValueError(
                f"state['table'] must have shape [2**k, {obj.W + 1}], got "
                f"{list(table.shape)}"
            )
        table = table.to(obj.device, copy=True).contiguous()
        col = table[:, 0]
        if bool((col < TOMBSTONE).any()):
            raise ValueError("state['table'] holds BUSY or unknown sentinels")
        size = int((col >= 0).sum().item())
        tombs = int((col == TOMBSTONE).sum().item())
        if size != state["size"] or tombs != state["tombstones"]:
            raise ValueError(
                f"state: table holds {size} keys and {tombs} tombstones, fields "
                f"say {state['size']} and {state['tombstones']}"
            )
        pad = padding_mask(obj.hash_bytes)
        live_slots = (col >= 0).nonzero().squeeze(1)
        live = table.index_select(0, live_slots)
        if pad and bool(((live[:, -1] & pad) != 0).any()):
            raise ValueError("state['table'] has nonzero padding bits")
        if size + tombs >= cap:
            raise ValueError("state['table'] has no EMPTY slot")
        found = find_slots(
            table, obj.W, live[:, 0].contiguous(), live[:, 1:].contiguous()
        )
        if not torch.equal(found, live_slots):
            raise ValueError(
                "state['table'] is inconsistent: some keys are not where the slot "
                "hash and probe sequence put them (or appear twice)"
            )
        obj.table = table
        obj._size = size
        obj._tombstones = tombs
        if size + tombs > obj._limit(cap):
            # Saved with a higher max_load; restore the invariant.
            new_cap = cap
            while size > obj._limit(new_cap):
                new_cap *= 2
            obj._rehash(new_cap)
        return obj
