"""FleetIndex: the keys of E engines in one table, and every request scored
against every engine in one call.

A KV-aware router in front of E vLLM instances asks, for each waiting request,
how many prompt tokens each instance would load from its cache. Under vLLM's
rules (``coordinator/reference.py``) that is ``find_longest_cache_hit`` against
that engine's keys alone. :class:`FleetIndex` holds the keys ``(engine, group,
block hash)`` of all engines; :func:`fleet_find` (``LookupEngine.fleet_hits``
/ ``fleet_lookup``) answers ``[B, E]`` in one call.

STORAGE
=======

* ``keys``: int64 ``[C, W + 1]``, a KeyIndex table (the layout of
  ``coordinator/key_index.py``, probed by the same kernels) of the keys
  ``(group, hash)`` that at least one engine holds, and beside it ``bits``:
  int64 ``[C, NW]``, ``NW = ceil(E / 64)``, the set of engines holding each
  slot's key (engine ``e`` is bit ``e % 64`` of word ``e // 64``). A live slot
  has at least one bit set; when its last engine drops the key the slot
  becomes a TOMBSTONE with zero bits. ``(W + 1 + NW) * 8`` bytes per slot,
  whatever the number of engines sharing the key. With the numba backend
  ``keys`` and ``bits`` are the two column ranges of one table int64 ``[C, W
  + 1 + NW]`` (``FleetIndex._table``, allocated by numpy for transparent huge
  pages): a slot's engine set lies beside its key, so a block scanned costs
  one cache miss (and, with 2 MiB pages, rarely a TLB miss). The torch
  backend keeps them as two contiguous tables (its kernels index them flat).
* ``entries``: a :class:`KeyIndex` of the pairs (engine, key) as keys
  ``(group * E + engine, hash)`` (so group ids are at most
  :attr:`FleetIndex.max_group_id`): each engine's own store, which the
  single-engine scans below read with the plan's groups renamed. ``(W + 1) *
  8`` bytes per slot, one slot per (engine, key) pair.

Every mutation updates both, after validating all of its input.

COST OF A LOOKUP
================

* Full attention (a layout whose only SpecGroup is full attention, not
  fine-grained; numba): one probe per block and member group, the engine sets
  ANDed block by block until no engine is left, then vLLM's closed-form
  full-attention hit per engine, all in one kernel call
  (``kernels/fleet_numba.full_hits_checked``: blocks loaded in tiles, hashes
  then a tight prefetch loop then the run logic on cached rows; the next
  request's first tile during this one's logic). The cost grows with the
  blocks scanned, not with E x blocks (E only adds ``ceil(E / 64)`` words per
  block and the ``[B, E]`` output). A router's call (a ``from_ints`` batch,
  numpy or CPU tensor lengths) is checked and answered by
  :func:`fleet_full_host` at the cost of one kernel dispatch.
* Every other layout (sliding window, Mamba, chunked local, several
  SpecGroups, fine-grained hits; numba): the single-engine numba scan of
  ``kernels/scan_numba.py`` (vLLM's whole rule) per (request, engine) pair
  that may hit, reading ``entries`` with the plan's group ids renamed ``g *
  E + e``. With a full-attention first SpecGroup only the engines holding a
  request's first block (any hash unit of it, fine-grained) may hit it, found
  with one joint probe per request; other pairs are 0. And there, for a
  request that at least :data:`CLASS_MIN_ENGINES` engines may hit, engines
  that must answer alike share one scan
  (``kernels/fleet_numba.engine_classes``): a scan reads keys only below the
  block ending the first SpecGroup's run (plus, under EAGLE, one proof
  margin: a later SpecGroup is scanned that far past the hit it is given),
  so engines are grouped by that run, then split by
  each key below it that some but not all of them hold, one probe per key
  for all engines. The cost is then the keys below the runs plus one scan
  per class: on the Mooncake trace, where engines share the prompts' first
  blocks and one engine holds a conversation's earlier turn, a handful of
  classes a request whatever E. Without a full-attention first SpecGroup
  every active engine is scanned (E x the single-engine scan).

Backends: numba on the CPU (the kernels of ``kernels/fleet_numba.py``,
compiled); with ``backend="torch"`` (any device) the table operations run
as torch ops (the KeyIndex torch primitives). There the joint full-attention
scan is torch ops too (every block below the bound probed once, no early
stop, then ``[B, blocks, E]`` boolean ops), and other layouts probe each
(group, hash) of the batch once for all engines, then run the LookupEngine's
own backend (triton on CUDA) per engine over a small table of the batch's
keys that engine holds. On CUDA (``backend.auto_backend``'s rule; the
``"triton"`` backend) the same tables are driven by Triton kernels instead
(``_TritonOps``): keys inserted
and found by ``kernels/hash_index.py``, engine sets updated, and the joint
full-attention scan (runs and hits in one launch) and ``prefix_blocks`` run
by ``kernels/fleet_triton.py``; hybrid layouts keep the per-engine path.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvhit.coordinator.backend import auto_backend
from kvhit.coordinator.checks import check_device, check_tensor
from kvhit.coordinator.key_index import (
    MAX_CAPACITY,
    MAX_LOAD_RANGE,
    KeyIndex,
    normalize_keys,
)
from kvhit.coordinator.packing import HashBatch, num_words, padding_mask
from kvhit.coordinator.plan import ScanPlan
from kvhit.kernels.contract import EMPTY, KIND_FULL, TOMBSTONE
from kvhit.kernels.hash_index_torch import find as find_slots
from kvhit.kernels.hash_index_torch import insert as insert_table
from kvhit.kernels.hash_index_torch import new_table

if TYPE_CHECKING:
    from kvhit.coordinator.engine import LookupEngine

__all__ = [
    "CLASS_MIN_ENGINES",
    "FLEET_BACKENDS",
    "EngineView",
    "FleetIndex",
    "check_fleet",
    "fleet_find",
    "fleet_full_host",
    "prefix_blocks",
    "route",
    "state_checksum",
]

#: Backends a FleetIndex accepts ("auto": numba on the CPU, torch elsewhere).
FLEET_BACKENDS = ("auto", "numba", "torch", "triton")
#: The most engines a FleetIndex may hold (a bound on the ``[B, E]`` outputs).
MAX_ENGINES = 1 << 16
_STATE_VERSION = 1


# --------------------------------------------------------------------------
# Table operations: numba (CPU) and torch (any device). No validation.
# --------------------------------------------------------------------------


class _NumbaOps:
    """The table operations through the compiled kernels (CPU tensors)."""

    @staticmethod
    def kernels():
        from kvhit.kernels import fleet_numba, hash_index_numba

        return fleet_numba, hash_index_numba

    def find(self, table, W, g, h):
        return torch.from_numpy(
            self.kernels()[0].find_keys(table.numpy(), g.numpy(), h.numpy())
        )

    def insert(self, table, W, g, h) -> int:
        return self.kernels()[0].insert_keys(table.numpy(), g.numpy(), h.numpy())

    @staticmethod
    def new_tables(cap, W, NW, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One table int64 ``[cap, W + 1 + NW]`` (keys, then engine sets: one
        cache line or two per slot scanned) and its two column views."""
        # Allocated by numpy, which asks Linux for transparent huge pages on
        # large arrays (torch's CPU allocator does not): a scan probes slots
        # at random in tens of MB, and with 4 KiB pages each probe also
        # misses the TLB; 2 MiB pages halve a cold batch's scan time here.
        table = torch.from_numpy(np.zeros((cap, W + 1 + NW), dtype=np.int64))
        table[:, 0] = EMPTY
        return table, table[:, : W + 1], table[:, W + 1 :]

    def set_bits(self, bits, slots, engines, E) -> np.ndarray:
        new = self.kernels()[0].set_bits(bits.numpy(), slots.numpy(), engines.numpy())
        return np.bincount(engines.numpy()[new > 0], minlength=E)

    def clear_bits(self, keys, bits, slots, engines, E) -> tuple[np.ndarray, int]:
        out, freed = self.kernels()[0].clear_bits(
            keys.numpy(), bits.numpy(), slots.numpy(), engines.numpy()
        )
        return np.bincount(engines.numpy()[out > 0], minlength=E), freed

    def clear_engine(self, keys, bits, e) -> tuple[int, int]:
        return self.kernels()[0].clear_engine(keys.numpy(), bits.numpy(), e)

    def probe_bits(self, keys, bits, gids, rows) -> np.ndarray:
        return self.kernels()[0].probe_bits(
            keys.numpy(), bits.numpy(), gids.numpy(), rows.numpy()
        )


class _TorchOps:
    """The same operations through :mod:`kvhit.kernels.fleet_torch` (any
    device)."""

    @staticmethod
    def kernels():
        from kvhit.kernels import fleet_torch

        return fleet_torch

    def find(self, table, W, g, h):
        return find_slots(table, W, g, h)

    def insert(self, table, W, g, h) -> int:
        return int(insert_table(table, W, g, h).sum().item())

    @staticmethod
    def new_tables(cap, W, NW, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two tables (the torch kernels read contiguous ones): the keys (also
        the table probed) and the engine sets."""
        keys = new_table(cap, W, dev)
        return keys, keys, torch.zeros((cap, NW), dtype=torch.int64, device=dev)

    def set_bits(self, bits, slots, engines, E) -> np.ndarray:
        return self.kernels().set_bits(bits, slots, engines, E).numpy()

    def clear_bits(self, keys, bits, slots, engines, E) -> tuple[np.ndarray, int]:
        gone, freed = self.kernels().clear_bits(keys, bits, slots, engines, E)
        return gone.numpy(), freed

    def clear_engine(self, keys, bits, e) -> tuple[int, int]:
        return self.kernels().clear_engine(keys, bits, e)

    def probe_bits(self, keys, bits, gids, rows) -> np.ndarray:
        return self.kernels().probe_bits(keys, bits, gids, rows).cpu().numpy()


class _TritonOps(_TorchOps):
    """The torch backend's tables on CUDA (``auto_backend``'s rule), driven
    by Triton kernels: the KeyIndex kernels of ``kernels/hash_index.py`` for
    the keys, ``kernels/fleet_triton.py`` for the engine sets."""

    @staticmethod
    def triton():
        from kvhit.kernels import fleet_triton, hash_index

        return fleet_triton, hash_index

    def find(self, table, W, g, h):
        return self.triton()[1].find(table, W, g, h)

    def insert(self, table, W, g, h) -> int:
        return int(self.triton()[1].insert(table, W, g, h).sum().item())

    def set_bits(self, bits, slots, engines, E) -> np.ndarray:
        return self.triton()[0].set_bits(bits, slots, engines, E).numpy()

    def clear_bits(self, keys, bits, slots, engines, E) -> tuple[np.ndarray, int]:
        gone, freed = self.triton()[0].clear_bits(keys, bits, slots, engines, E)
        return gone.numpy(), freed

    def probe_bits(self, keys, bits, gids, rows) -> np.ndarray:
        return self.triton()[0].probe_bits(keys, bits, gids, rows).cpu().numpy()


def _entries_backend(backend: str) -> str:
    # The entry index (a KeyIndex) of a Triton fleet shares the torch
    # backend's layout; its few updates per call stay torch ops.
    return "torch" if backend == "triton" else backend


def _resolve_backend(backend: Any, device: torch.device) -> str:
    if not isinstance(backend, str) or backend not in FLEET_BACKENDS:
        raise ValueError(f"backend must be one of {FLEET_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cpu":
            return "numba"
        return "triton" if auto_backend(device) == "triton" else "torch"
    if backend == "numba" and device.type != "cpu":
        raise ValueError(f"backend 'numba' runs on the CPU only, device is {device}")
    if backend == "triton" and auto_backend(device) != "triton":
        raise ValueError(f"backend 'triton' runs on CUDA only, device is {device}")
    return backend


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {bound}, got {value}")
    return int(value)


def _resolve_device(device: Any) -> torch.device:
    if not isinstance(device, torch.device | str):
        raise TypeError(f"device must be a str or torch.device, got {device!r}")
    return check_device(device, "device")


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _state_checksum(
    keys: torch.Tensor,
    bits: torch.Tensor,
    active: torch.Tensor,
    hash_bytes: int,
    num_engines: int,
    size: int,
    tombs: int,
) -> str:
    """blake2b of both tables, the active engines and the counts (hex)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(
        f"kvhit.FleetIndex/{_STATE_VERSION}/{hash_bytes}/{num_engines}/"
        f"{list(keys.shape)}/{list(bits.shape)}/{size}/{tombs}/".encode()
    )
    for t in (keys, bits, active.to(torch.int64)):
        data = t.detach().to("cpu").contiguous().numpy()
        h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def state_checksum(state: Mapping[str, Any]) -> str:
    """The checksum :meth:`FleetIndex.state_dict` signs ``state`` with
    (blake2b of ``keys``, ``bits``, ``active`` and the counts, hex), for
    tools that write a state dict themselves. Reads ``state``'s fields
    ``keys``, ``bits``, ``active``, ``hash_bytes``, ``num_engines``, ``size``
    and ``tombstones`` without checking them."""
    return _state_checksum(
        state["keys"], state["bits"], state["active"], state["hash_bytes"],
        state["num_engines"], state["size"], state["tombstones"],
    )  # fmt: skip


# --------------------------------------------------------------------------
# FleetIndex
# --------------------------------------------------------------------------


class FleetIndex:
    """The keys ``(engine, group_id, block_hash)`` of ``num_engines`` engines.

    Args:
        num_engines: E, the engines ``0 .. E - 1`` (at most 65536). Every
            engine starts active and empty.
        hash_bytes: width of every block hash in bytes (``W = ceil(hash_bytes
            / 8)``).
        capacity: initial number of slots (distinct ``(group, hash)`` keys
            over all engines), rounded up to a power of two; the table grows
            (doubling, with a rehash) before ``keys + tombstones`` would
            exceed ``max_load * capacity``.
        device: device of the tables; tensor arguments must be there.
        backend: "numba" (CPU), "triton" (CUDA: the torch backend's tables
            driven by Triton kernels), "torch" (any device) or "auto" (numba
            on the CPU, triton on CUDA, torch elsewhere).
        max_load: the load factor bound, in ``key_index.MAX_LOAD_RANGE``.

    Keys are given as in :func:`kvhit.coordinator.key_index.normalize_keys`;
    ``engine_ids`` as an int (every key), a sequence of ints, an integer numpy
    array ``[N]`` or an int64 tensor ``[N]`` on ``device``, each in ``[0, E)``.
    As for :class:`KeyIndex`, every public method validates all its
    arguments before it changes anything: a bad argument raises
    ValueError/TypeError naming it and the index is exactly as before.

    Engines leave and join: :meth:`remove_engine` drops an engine's keys and
    marks it inactive (its column of every lookup is 0, adding keys for it is
    refused) until :meth:`add_engine`; :meth:`clear_engine` drops its keys and
    keeps it active (an engine that restarted with an empty cache).

    As with a KeyIndex, a mutation must not overlap any other call on the
    same fleet: hold one lock around mutations and lookups
    (``bindings/fleet_events.FleetFollower`` does).

    Attributes:
        keys: int64 ``[C, W + 1]``, a KeyIndex table of every key some engine
            holds (module docstring).
        bits: int64 ``[C, NW]``, each slot's engine set.
        entries: a KeyIndex of ``(group * E + engine, hash)``, one key per
            (engine, key) pair.
    """

    def __init__(
        self,
        num_engines: int,
        hash_bytes: int,
        capacity: int = 1024,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        max_load: float = 0.5,
    ) -> None:
        num_engines = _check_int(num_engines, "num_engines", 1, MAX_ENGINES + 1)
        W = num_words(hash_bytes)
        capacity = _check_int(capacity, "capacity", 1, MAX_CAPACITY + 1)
        max_load = _check_max_load(max_load)
        dev = _resolve_device(device)
        backend = _resolve_backend(backend, dev)
        cap = _next_pow2(capacity)
        nw = (num_engines + 63) // 64
        entries = KeyIndex(hash_bytes, capacity=cap, device=dev,
                           backend=_entries_backend(backend), max_load=max_load)  # fmt: skip
        self._init(
            num_engines,
            hash_bytes,
            new_table(cap, W, dev),
            torch.zeros((cap, nw), dtype=torch.int64, device=dev),
            entries,
            torch.ones(num_engines, dtype=torch.bool),
            backend,
            max_load,
            0,
            0,
        )

    def _init(self, num_engines, hash_bytes, keys, bits, entries, active, backend,
              max_load, size, tombs) -> None:  # fmt: skip
        """Set every attribute (the one place that lists them)."""
        self.num_engines = num_engines
        self.hash_bytes = hash_bytes
        self.W = num_words(hash_bytes)
        self.NW = (num_engines + 63) // 64
        self._backend = backend
        self._ops = (
            _NumbaOps()
            if backend == "numba"
            else _TritonOps()  # the Triton fleet kernels (CUDA)
            if backend == "triton"
            else _TorchOps()
        )
        # The table probed (numba: keys and engine sets side by side, a row
        # per slot) and its views ``keys`` / ``bits``.
        self._table, self.keys, self.bits = self._ops.new_tables(
            keys.shape[0], self.W, self.NW, keys.device
        )
        self._table_np = self._host_view()
        self.keys.copy_(keys)
        self.bits.copy_(bits)
        self.entries = entries
        self._active = active.to("cpu").clone()
        self._live = self.live_words()
        self.max_load = max_load
        self._size = size
        self._tombstones = tombs
        # Per engine, how many keys it holds (kept exact by every mutation).
        self._per_engine = np.zeros(num_engines, dtype=np.int64)
        self._version = 0

    def _host_view(self) -> np.ndarray | None:
        """The numba table as numpy (a view, kept beside the tensor so that a
        lookup makes no torch call for it), None on the torch backend."""
        return self._table.numpy() if self._backend == "numba" else None

    # -- properties -----------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Number of slots (a power of two)."""
        return self.keys.shape[0]

    @property
    def device(self) -> torch.device:
        """Device of the tables."""
        return self.keys.device

    @property
    def backend(self) -> str:
        """ "numba", "triton" or "torch"."""
        return self._backend

    @property
    def tombstones(self) -> int:
        """Number of TOMBSTONE slots (purged by the next rehash)."""
        return self._tombstones

    @property
    def active(self) -> torch.Tensor:
        """bool ``[E]`` (CPU), True for engines in the fleet (a copy)."""
        return self._active.clone()

    @property
    def version(self) -> int:
        """Bumped by every change of the keys or the engines."""
        return self._version

    def __len__(self) -> int:
        """Distinct ``(group, hash)`` keys held by at least one engine."""
        return self._size

    def engine_sizes(self) -> torch.Tensor:
        """int64 ``[E]`` (CPU): the keys each engine holds."""
        return torch.from_numpy(self._per_engine.copy())

    def memory_bytes(self) -> int:
        """Bytes held by the tables (keys, bits and the entry index)."""
        return (self.keys.numel() + self.bits.numel()) * 8 + self.entries.memory_bytes()

    def __repr__(self) -> str:
        return (
            f"FleetIndex(num_engines={self.num_engines}, hash_bytes="
            f"{self.hash_bytes}, len={len(self)}, capacity={self.capacity}, "
            f"device={self.device}, backend={self.backend!r})"
        )

    def live_words(self) -> np.ndarray:
        """The active engines as an engine set: int64 ``[NW]``."""
        words = np.zeros(self.NW * 64, dtype=np.uint8)
        words[: self.num_engines] = self._active.numpy()
        return np.packbits(words, bitorder="little").view(np.int64).copy()

    # -- arguments -------------------------------------------------------------

    def normalize_engine_ids(
        self, engine_ids: Any, n: int, need_active: bool = False
    ) -> torch.Tensor:
        """``engine_ids`` for ``n`` keys as a contiguous int64 ``[n]`` tensor
        on the index's device, each in ``[0, E)`` (and active, with
        ``need_active``). Raises TypeError/ValueError naming ``engine_ids``."""
        dev = self.device
        E = self.num_engines
        if isinstance(engine_ids, bool | np.bool_):
            raise TypeError("engine_ids must be int64, not bool")
        if _is_int(engine_ids):
            e = _check_int(engine_ids, "engine_ids", 0, E)
            t = torch.full((n,), e, dtype=torch.int64, device=dev)
        elif isinstance(engine_ids, np.ndarray):
            if engine_ids.dtype.kind not in "iu":
                raise TypeError(
                    f"engine_ids must hold integers, got dtype {engine_ids.dtype}"
                )
            if engine_ids.ndim != 1:
                raise ValueError(
                    f"engine_ids must have shape [N], got {list(engine_ids.shape)}"
                )
            if engine_ids.size and (
                int(engine_ids.max()) >= E or int(engine_ids.min()) < 0
            ):
                raise ValueError(f"engine_ids must be in [0, {E})")
            t = torch.from_numpy(engine_ids.astype(np.int64)).to(dev)
        elif isinstance(engine_ids, torch.Tensor):
            check_tensor(engine_ids, "engine_ids", device=dev, device_of="index")
            t = engine_ids.expand(n) if engine_ids.dim() == 0 else engine_ids
        elif isinstance(engine_ids, Sequence) and not isinstance(
            engine_ids, str | bytes
        ):
            bad = next((i for i, v in enumerate(engine_ids) if not _is_int(v)), None)
            if bad is not None:
                raise TypeError(
                    "engine_ids must be a sequence of ints, got "
                    f"{type(engine_ids[bad]).__name__} at position {bad}"
                )
            vals = [int(v) for v in engine_ids]
            if any(not 0 <= v < E for v in vals):
                raise ValueError(f"engine_ids must be in [0, {E})")
            t = torch.tensor(vals, dtype=torch.int64).to(dev)
        else:
            raise TypeError(
                "engine_ids must be an int, a sequence of ints or an int64 "
                f"tensor, got {type(engine_ids).__name__}"
            )
        if t.dim() != 1:
            raise ValueError(f"engine_ids must have shape [N], got {list(t.shape)}")
        if t.shape[0] != n:
            raise ValueError(
                f"engine_ids has {t.shape[0]} entries but hashes has {n} keys"
            )
        if n and bool(((t < 0) | (t >= E)).any()):
            raise ValueError(f"engine_ids must be in [0, {E})")
        if need_active and n:
            inactive = ~self._active.to(dev)[t]
            if bool(inactive.any()):
                e = int(t[inactive.nonzero()[0, 0]])
                raise ValueError(
                    f"engine_ids: engine {e} was removed from the fleet "
                    "(add_engine first)"
                )
        return t.contiguous()

    def _entries(
        self, engine_ids: Any, group_ids: Any, hashes: Any, need_active: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, h = normalize_keys(group_ids, hashes, self.hash_bytes, self.device)
        e = self.normalize_engine_ids(engine_ids, g.shape[0], need_active)
        if g.shape[0] and int(g.max()) > self.max_group_id:
            raise ValueError(
                f"group_ids must be <= {self.max_group_id} in a fleet of "
                f"{self.num_engines} engines (entry keys are group * E + engine)"
            )
        return e, g, h

    @property
    def max_group_id(self) -> int:
        """The largest group id a key may have: entry keys ``group * E +
        engine`` must fit in int64."""
        return ((1 << 63) - 1 - (self.num_engines - 1)) // self.num_engines

    def _engine(self, engine: Any) -> int:
        return _check_int(engine, "engine", 0, self.num_engines)

    # -- sizing -----------------------------------------------------------------

    def _limit(self, capacity: int) -> int:
        return math.floor(self.max_load * capacity)

    def _capacity_for(self, n_new: int) -> int:
        need = self._size + n_new
        cap = self.capacity
        while need > self._limit(cap):
            cap *= 2
            if cap > MAX_CAPACITY:
                raise ValueError(
                    f"{need} keys at max_load={self.max_load} need more than "
                    f"MAX_CAPACITY = {MAX_CAPACITY} slots"
                )
        return cap

    def _rehash(self, capacity: int) -> None:
        """Rebuild into ``capacity`` slots (tombstones purged); the new tables
        are complete before they replace the old ones."""
        live = (self.keys[:, 0] >= 0).nonzero().squeeze(1)
        g = self.keys[live, 0].contiguous()
        h = self.keys[live, 1:].contiguous()
        table, keys, bits = self._ops.new_tables(capacity, self.W, self.NW, self.device)
        stored = self._ops.insert(table, self.W, g, h)
        if stored != self._size:  # pragma: no cover - would be a bug
            raise RuntimeError(f"rehash stored {stored} keys, expected {self._size}")
        slots = self._ops.find(table, self.W, g, h)
        bits[slots] = self.bits[live]
        self._table, self.keys, self.bits = table, keys, bits
        self._table_np = self._host_view()
        self._tombstones = 0
        self._version += 1

    # -- operations ---------------------------------------------------------------

    def add(self, engine_ids: Any, group_ids: Any, hashes: Any) -> int:
        """Engine ``engine_ids[i]`` now holds key ``(group_ids[i],
        hashes[i])``; idempotent. Returns the number of (engine, key) entries
        that were new. Refused (ValueError naming ``engine_ids``) for an
        engine removed by :meth:`remove_engine`."""
        e, g, h = self._entries(engine_ids, group_ids, hashes, need_active=True)
        n = g.shape[0]
        if n == 0:
            return 0
        if self._size + self._tombstones + n > self._limit(self.capacity):
            # Count the keys that are really new before growing, so that
            # re-adding known keys never inflates the table.
            absent = self._ops.find(self._table, self.W, g, h) < 0
            ga, ha = g[absent].contiguous(), h[absent].contiguous()
            scratch = new_table(_next_pow2(2 * ga.shape[0] + 1), self.W, self.device)
            n_new = self._ops.insert(scratch, self.W, ga, ha)
            if self._size + self._tombstones + n_new > self._limit(self.capacity):
                self._rehash(self._capacity_for(n_new))
        self._size += self._ops.insert(self._table, self.W, g, h)
        slots = self._ops.find(self._table, self.W, g, h)
        new = self._ops.set_bits(self.bits, slots, e, self.num_engines)
        self.entries.add(g * self.num_engines + e, h)
        self._per_engine += new
        self._version += 1
        return int(new.sum())

    def remove(self, engine_ids: Any, group_ids: Any, hashes: Any) -> int:
        """Engine ``engine_ids[i]`` no longer holds key ``(group_ids[i],
        hashes[i])`` (absent entries are ignored). Returns the number of
        entries removed."""
        e, g, h = self._entries(engine_ids, group_ids, hashes, need_active=False)
        if g.shape[0] == 0:
            return 0
        slots = self._ops.find(self._table, self.W, g, h)
        gone, freed = self._ops.clear_bits(
            self.keys, self.bits, slots, e, self.num_engines
        )
        self.entries.remove(g * self.num_engines + e, h)
        self._per_engine -= gone
        self._size -= freed
        self._tombstones += freed
        self._version += 1
        return int(gone.sum())

    def clear_engine(self, engine: int) -> int:
        """Drop every key of ``engine`` (it stays in the fleet); returns how
        many it held."""
        e = self._engine(engine)
        g, h = self.engine_keys(e)
        self.entries.remove(g * self.num_engines + e, h)
        cleared, freed = self._ops.clear_engine(self.keys, self.bits, e)
        self._per_engine[e] -= cleared
        self._size -= freed
        self._tombstones += freed
        self._version += 1
        return cleared

    def remove_engine(self, engine: int) -> int:
        """Drop every key of ``engine`` and take it out of the fleet: its
        column of every lookup is 0 and adding keys for it is refused until
        :meth:`add_engine`. Returns how many keys it held."""
        e = self._engine(engine)
        cleared = self.clear_engine(e)
        self._active[e] = False
        self._live = self.live_words()
        return cleared

    def add_engine(self, engine: int) -> None:
        """Put ``engine`` (back) into the fleet, with no keys."""
        e = self._engine(engine)
        if not bool(self._active[e]):
            self._active[e] = True
            self._live = self.live_words()
            self._version += 1

    def clear(self) -> None:
        """Drop every key of every engine (engines stay as they are)."""
        self.keys.zero_()
        self.keys[:, 0] = EMPTY
        self.bits.zero_()
        self.entries.clear()
        self._size = 0
        self._tombstones = 0
        self._per_engine[:] = 0
        self._version += 1

    def contains(self, engine_ids: Any, group_ids: Any, hashes: Any) -> torch.Tensor:
        """Whether engine ``engine_ids[i]`` holds key ``i``: bool ``[N]``."""
        e, g, h = self._entries(engine_ids, group_ids, hashes, need_active=False)
        if g.shape[0] == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        slots = self._ops.find(self._table, self.W, g, h)
        hit = slots >= 0
        words = torch.zeros_like(e)
        words[hit] = self.bits[slots[hit], e[hit] >> 6]
        return hit & (((words >> (e & 63)) & 1) == 1)

    def holders(self, group_ids: Any, hashes: Any) -> torch.Tensor:
        """Which engines hold each key: bool ``[N, E]`` on the index's device."""
        g, h = normalize_keys(group_ids, hashes, self.hash_bytes, self.device)
        slots = self._ops.find(self._table, self.W, g, h)
        words = torch.zeros((g.shape[0], self.NW), dtype=torch.int64,
                            device=self.device)  # fmt: skip
        hit = slots >= 0
        words[hit] = self.bits[slots[hit]]
        return _unpack_engines(words.cpu().numpy(), self.num_engines).to(self.device)

    def engine_keys(self, engine: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys ``engine`` holds, in slot order: (int64 ``[n]``, int64
        ``[n, W]``)."""
        e = self._engine(engine)
        mine = (self.keys[:, 0] >= 0) & (((self.bits[:, e >> 6] >> (e & 63)) & 1) == 1)
        rows = self.keys[mine]
        return rows[:, 0].contiguous(), rows[:, 1:].contiguous()

    def engine_view(self, engine: int) -> EngineView:
        """Engine ``engine``'s keys behind the KeyIndex mutation API
        (:class:`EngineView`), e.g. for ``bindings.events.apply`` or an
        ``EventFollower``."""
        return EngineView(self, self._engine(engine))

    def key_index(self, engine: int) -> KeyIndex:
        """A new :class:`KeyIndex` holding exactly ``engine``'s keys (for
        single-engine lookups and checks; the fleet is only read)."""
        g, h = self.engine_keys(engine)
        index = KeyIndex(
            self.hash_bytes, capacity=max(2 * g.shape[0], 16), device=self.device
        )
        if g.shape[0]:
            index.add(g, h)
        return index

    # -- persistence ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The index as plain data (``keys``/``bits`` are the live tensors,
        not copies); ``checksum`` lets :meth:`from_state_dict` refuse a
        corrupted dict (computing it reads both tables once)."""
        active = self._active.clone()
        return {
            "version": _STATE_VERSION,
            "num_engines": self.num_engines,
            "hash_bytes": self.hash_bytes,
            "max_load": self.max_load,
            "size": self._size,
            "tombstones": self._tombstones,
            "keys": self.keys,
            "bits": self.bits,
            "active": active,
            "entries": self.entries.state_dict(),
            "checksum": _state_checksum(
                self.keys,
                self.bits,
                active,
                self.hash_bytes,
                self.num_engines,
                self._size,
                self._tombstones,
            ),  # fmt: skip
        }

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, Any],
        device: torch.device | str | None = None,
        backend: str = "auto",
    ) -> FleetIndex:
        """Rebuild an index from :meth:`state_dict` output (tables copied).

        Verified before anything is built: the checksum, then the structure
        (shapes and dtypes, power-of-two capacity, no BUSY or unknown
        sentinel, zero words and zero engine bits in EMPTY slots, zero bits
        in TOMBSTONE slots, at least one engine in every live slot and none
        past ``num_engines`` or inactive, counts equal to ``size`` /
        ``tombstones``, an EMPTY slot left, zero padding bits) and every live
        key reachable from its home slot along its probe sequence, once.
        Any failure raises ValueError/TypeError.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        fields = ("version", "num_engines", "hash_bytes", "max_load", "size",
                  "tombstones", "keys", "bits", "active", "entries",
                  "checksum")  # fmt: skip
        for field in fields:
            if field not in state:
                raise ValueError(f"state: missing field {field!r}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"state: unsupported version {state['version']!r}")
        E = _check_int(state["num_engines"], "state['num_engines']", 1,
                       MAX_ENGINES + 1)  # fmt: skip
        hash_bytes = state["hash_bytes"]
        W = num_words(hash_bytes)
        nw = (E + 63) // 64
        max_load = _check_max_load(state["max_load"])
        size = _check_int(state["size"], "state['size']", 0)
        tombs = _check_int(state["tombstones"], "state['tombstones']", 0)
        keys = check_tensor(state["keys"], "state['keys']", dim=2)
        bits = check_tensor(state["bits"], "state['bits']", dim=2)
        active = check_tensor(state["active"], "state['active']", dtype=torch.bool,
                              dim=1)  # fmt: skip
        cap = keys.shape[0]
        if keys.shape[1] != W + 1 or cap < 1 or cap & (cap - 1) or cap > MAX_CAPACITY:
            raise ValueError(
                f"state['keys'] must have shape [2**k, {W + 1}], got {list(keys.shape)}"
            )
        if list(bits.shape) != [cap, nw]:
            raise ValueError(
                f"state['bits'] must have shape [{cap}, {nw}], got {list(bits.shape)}"
            )
        if active.shape[0] != E:
            raise ValueError(f"state['active'] must have shape [{E}]")
        dev = _resolve_device(device if device is not None else keys.device)
        backend = _resolve_backend(backend, dev)
        if state["checksum"] != _state_checksum(keys, bits, active, hash_bytes, E,
                                                size, tombs):  # fmt: skip
            raise ValueError(
                "state: checksum mismatch: the tables or counts were changed or "
                "corrupted after state_dict()"
            )
        entries = KeyIndex.from_state_dict(state["entries"], device=dev,
                                           backend=_entries_backend(backend))  # fmt: skip
        if entries.hash_bytes != hash_bytes:
            raise ValueError("state['entries'] has another hash width")
        obj = cls.__new__(cls)
        obj._init(E, hash_bytes, keys.to(dev, copy=True).contiguous(),
                  bits.to(dev, copy=True).contiguous(), entries, active, backend,
                  max_load, size, tombs)  # fmt: skip
        obj._check_structure()
        if size + tombs > obj._limit(cap):
            obj._rehash(obj._capacity_for(0))
        return obj

    def _check_structure(self) -> None:
        keys, bits = self.keys, self.bits
        col = keys[:, 0]
        if bool((col < TOMBSTONE).any()):
            raise ValueError("state['keys'] holds BUSY or unknown sentinels")
        live_mask = col >= 0
        n_live = int(live_mask.sum().item())
        n_tombs = int((col == TOMBSTONE).sum().item())
        if n_live != self._size or n_tombs != self._tombstones:
            raise ValueError(
                f"state: tables hold {n_live} keys and {n_tombs} tombstones, "
                f"fields say {self._size} and {self._tombstones}"
            )
        if n_live + n_tombs >= keys.shape[0]:
            raise ValueError("state['keys'] has no EMPTY slot")
        if bool((keys[col == EMPTY, 1:] != 0).any()):
            raise ValueError("state['keys'] has nonzero words in EMPTY slots")
        if bool((bits[~live_mask] != 0).any()):
            raise ValueError("state['bits'] has engines in EMPTY or TOMBSTONE slots")
        if bool((bits[live_mask] == 0).all(dim=1).any()):
            raise ValueError("state['bits'] has a live key no engine holds")
        per = _unpack_engines(bits[live_mask].cpu().numpy(), self.NW * 64).numpy()
        counts = per.sum(axis=0, dtype=np.int64)
        if counts[self.num_engines :].any():
            raise ValueError("state['bits'] names engines past num_engines")
        counts = counts[: self.num_engines]
        if counts[~self._active.numpy()].any():
            raise ValueError("state['bits'] gives keys to an inactive engine")
        live_slots = live_mask.nonzero().squeeze(1)
        live = keys.index_select(0, live_slots)
        pad = padding_mask(self.hash_bytes)
        if pad and bool(((live[:, -1] & pad) != 0).any()):
            raise ValueError("state['keys'] has nonzero padding bits")
        found = self._ops.find(
            self._table, self.W, live[:, 0].contiguous(), live[:, 1:].contiguous()
        )
        if not torch.equal(found.to(live_slots.device), live_slots):
            raise ValueError(
                "state['keys'] is inconsistent: some keys are not reachable from "
                "their home slot along the probe sequence (or appear twice)"
            )
        self._per_engine = counts.astype(np.int64)
        # The entry index holds exactly the (engine, key) pairs of the bits.
        v, h = self.entries.keys()
        E = self.num_engines
        if len(self.entries) != int(counts.sum()) or (
            v.numel() and not bool(self.contains(v % E, v // E, h).all())
        ):
            raise ValueError(
                "state['entries'] does not hold exactly the (engine, key) pairs "
                "of state['bits']"
            )


class EngineView:
    """One engine of a :class:`FleetIndex` with the KeyIndex API a writer
    uses: ``hash_bytes``, ``device``, ``len()``, ``add(group_ids, hashes)``,
    ``remove(group_ids, hashes)``, ``contains(group_ids, hashes)``,
    ``keys()`` and ``clear()`` (drops this engine's keys only), each
    validating as the FleetIndex does. Built by :meth:`FleetIndex.engine_view`.
    """

    def __init__(self, fleet: FleetIndex, engine: int) -> None:
        self.fleet = fleet
        self.engine = engine

    @property
    def hash_bytes(self) -> int:
        """The fleet's hash width in bytes."""
        return self.fleet.hash_bytes

    @property
    def device(self) -> torch.device:
        """The fleet's device."""
        return self.fleet.device

    def __len__(self) -> int:
        return int(self.fleet.engine_sizes()[self.engine])

    def add(self, group_ids: Any, hashes: Any) -> int:
        """:meth:`FleetIndex.add` for this engine; returns the keys new to it."""
        return self.fleet.add(self.engine, group_ids, hashes)

    def remove(self, group_ids: Any, hashes: Any) -> int:
        """:meth:`FleetIndex.remove` for this engine."""
        return self.fleet.remove(self.engine, group_ids, hashes)

    def contains(self, group_ids: Any, hashes: Any) -> torch.Tensor:
        """Whether this engine holds each key: bool ``[N]``."""
        return self.fleet.contains(self.engine, group_ids, hashes)

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This engine's keys (:meth:`FleetIndex.engine_keys`)."""
        return self.fleet.engine_keys(self.engine)

    def clear(self) -> None:
        """Drop this engine's keys (:meth:`FleetIndex.clear_engine`)."""
        self.fleet.clear_engine(self.engine)

    def __repr__(self) -> str:
        return (
            f"EngineView(engine={self.engine}, len={len(self)}, fleet={self.fleet!r})"
        )


def _check_max_load(max_load: Any) -> float:
    if isinstance(max_load, bool) or not isinstance(max_load, numbers.Real):
        raise TypeError(f"max_load must be a float, got {type(max_load).__name__}")
    lo, hi = MAX_LOAD_RANGE
    if not lo <= max_load <= hi:
        raise ValueError(f"max_load must be in [{lo}, {hi}], got {max_load}")
    return float(max_load)


def _unpack_engines(words: np.ndarray, num_engines: int) -> torch.Tensor:
    """Engine sets int64 ``[..., NW]`` -> bool ``[..., num_engines]`` (CPU)."""
    w = np.ascontiguousarray(words, dtype=np.int64)
    flat = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(flat[..., :num_engines].astype(bool))


# --------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------


def check_fleet(fleet: Any, batch: HashBatch, device: torch.device) -> None:
    """Raise TypeError/ValueError naming ``fleet`` unless it is a FleetIndex
    on ``device`` with the batch's hash width."""
    if not isinstance(fleet, FleetIndex):
        raise TypeError(f"fleet must be a FleetIndex, got {type(fleet).__name__}")
    if fleet.device != device:
        raise ValueError(f"fleet is on {fleet.device}, the engine on {device}")
    if fleet.hash_bytes != batch.hash_bytes:
        raise ValueError(
            f"batch hash width ({batch.hash_bytes} bytes) differs from the "
            f"fleet's ({fleet.hash_bytes} bytes)"
        )


def _full_path(plan: ScanPlan, lookup: bool) -> bool:
    """Whether the joint full-attention scan answers this layout exactly: one
    SpecGroup, full attention, not fine-grained (for the worker's lookup,
    every member group prefix-cacheable, so every probed key is one the
    worker asks about)."""
    if len(plan.spec_groups) != 1:
        return False
    sg = plan.spec_groups[0]
    if sg.kind != KIND_FULL or sg.fine:
        return False
    return not lookup or all(plan.candidates[g].cacheable for g in sg.group_ids)


def _full_hits(runs: np.ndarray, bs: int, align: int, drop: bool) -> np.ndarray:
    """vLLM's full-attention hit from the leading run of ``runs`` blocks
    (``reference.full_attention_hit`` without the fine-grained tail, as
    ``kernels/scan_numba.py``'s ``_scan_sg`` for a non-fine full SpecGroup):
    ``run * bs``, less ``min(align, bs)`` under the EAGLE drop, aligned."""
    hit = runs * bs
    if drop:
        hit = np.where(hit > 0, hit - min(align, bs), 0)
    return hit - hit % align


class _HostPlan:
    """What the fused numba kernel needs of one engine's plan, built once per
    plan: whether the joint full-attention scan answers it (``full`` for
    ``fleet_hits``, ``full_lookup`` for ``fleet_lookup``; see
    :func:`_full_path`), its member group ids (int64 ``[M]``) and the kernel's
    ``params`` for E engines and each (EAGLE drop, lookup) pair."""

    __slots__ = ("full", "full_lookup", "members", "use_eagle", "kernels", "_params",
                 "_base")  # fmt: skip

    def __init__(self, engine: LookupEngine) -> None:
        plan = engine.plan
        # The numba kernel module, held once the numba path first needs it,
        # so that a lookup runs no import statement (the Triton path reads
        # the same plan on a machine that may have no numba).
        self.kernels: Any = None
        self.full = _full_path(plan, False)
        self.full_lookup = _full_path(plan, True)
        sg = plan.spec_groups[0]
        self.use_eagle = bool(sg.use_eagle)
        self.members = np.array(sg.group_ids, dtype=np.int64)
        self.members.flags.writeable = False
        self._base = (sg.scale, sg.block_size, plan.alignment)
        # (NW, E, drop, lookup) -> params int64 [7] (read-only)
        self._params: dict[tuple[int, int, bool, bool], np.ndarray] = {}

    def params(self, nw: int, num_engines: int, drop: bool, lookup: bool) -> np.ndarray:
        """``kernels/fleet_numba.full_hits_checked``'s params: (NW, scale,
        block size, alignment, EAGLE drop, lookup, E), int64 ``[7]``."""
        key = (nw, num_engines, drop, lookup)
        got = self._params.get(key)
        if got is None:
            got = np.array([nw, *self._base, drop, lookup, num_engines], dtype=np.int64)
            got.flags.writeable = False
            if len(self._params) >= 64:
                self._params.clear()
            self._params[key] = got
        return got


# id(plan) -> (plan, _HostPlan): keyed by identity (an engine keeps its plan),
# since hashing a ScanPlan costs more than a cold lookup; the plan held keeps
# its id from being reused.
_HOST_PLANS: dict[int, tuple[ScanPlan, _HostPlan]] = {}


def _host_plan(engine: LookupEngine) -> _HostPlan:
    plan = engine.plan
    got = _HOST_PLANS.get(id(plan))
    if got is not None and got[0] is plan:
        return got[1]
    if len(_HOST_PLANS) >= 64:
        _HOST_PLANS.clear()
    host = _HostPlan(engine)
    _HOST_PLANS[id(plan)] = (plan, host)
    return host


_INT64 = np.dtype(np.int64)


def fleet_full_host(
    engine: LookupEngine,
    batch: Any,
    lens: Any,
    fleet: Any,
    apply_eagle: bool,
    lookup: bool,
) -> torch.Tensor | None:
    """``LookupEngine.fleet_hits`` / ``fleet_lookup`` (``lookup``) on the
    router's common path, checked and answered at the cost of one kernel
    dispatch: a CPU ``batch`` (a :class:`HashBatch` whose host arrays exist,
    as :meth:`HashBatch.from_ints` builds them), ``lens`` an int64 numpy
    array ``[B]`` or a CPU int64 tensor, a numba ``fleet`` of the batch's hash
    width, a full-attention layout. Returns int64 ``[B, E]``, or None when
    any of that does not hold or ``lens`` holds a negative value: the caller
    then takes the general path, which validates everything and raises
    naming the bad argument. Nothing is modified either way.

    A router scores each batch once, with caches cold: each further Python
    or torch call there costs ~10-20 us, as much as scanning a request. So
    every check here is a type or attribute test on objects kvhit built
    (the batch's host arrays, the fleet's table, the plan's parameters,
    cached per plan), and ``lens``' values are checked inside the kernel.
    """
    if type(fleet) is not FleetIndex or fleet._backend != "numba":
        return None
    if type(batch) is not HashBatch or batch.hash_bytes != fleet.hash_bytes:
        return None
    host = _host_plan(engine)
    if not (host.full_lookup if lookup else host.full) or engine.device.type != "cpu":
        return None
    if type(lens) is torch.Tensor:
        if (
            lens.dtype is not torch.int64
            or lens.layout is not torch.strided
            or lens.requires_grad
            or lens.is_cuda
        ):
            return None
        lens = lens.numpy() if lens.device.type == "cpu" else None
        if lens is None:
            return None
    elif type(lens) is not np.ndarray or lens.dtype is not _INT64:
        return None
    try:
        # Cached on the batch (from_ints builds them); raises off the CPU.
        rows, offsets, lengths = batch.host_arrays()
    except ValueError:
        return None
    if lens.ndim != 1 or lens.shape[0] != offsets.shape[0]:
        return None
    if not (lens.flags.c_contiguous and lens.flags.writeable):
        # numba compiles a kernel per array layout and write flag (~15 s each
        # on a fresh machine): a strided or read-only lens is copied to the
        # one form the kernel is compiled for (B ints; never written).
        lens = lens.copy()
    drop = host.use_eagle and (apply_eagle or lookup)
    params = host.params(fleet.NW, fleet.num_engines, drop, lookup)
    kernels = host.kernels
    if kernels is None:
        from kvhit.kernels import fleet_numba as kernels

        host.kernels = kernels
    bad, out = kernels.full_hits_checked(
        fleet._table_np, rows, offsets, lengths, lens, host.members, fleet._live,
        params,
    )  # fmt: skip
    return None if bad >= 0 else torch.from_numpy(out)


def _fleet_full_triton(engine, batch, lens, fleet, apply_eagle, lookup):
    """:func:`_fleet_full` on CUDA: one launch of the Triton kernel (runs and
    hits), int64 ``[B, E]`` on the device."""
    host = _host_plan(engine)
    drop = host.use_eagle and (apply_eagle or lookup)
    # The Triton launcher takes E apart: the first six of the numba params.
    params = host.params(fleet.NW, fleet.num_engines, drop, lookup)[:6]
    view = batch.view()
    return fleet._ops.triton()[0].full_hits(
        fleet.keys, fleet.bits, view.rows, view.offsets, view.lengths, lens,
        host.members, fleet._live, params, fleet.num_engines,
    )  # fmt: skip


def _fleet_full(engine, view, lens, fleet, apply_eagle, lookup) -> np.ndarray:
    """The joint full-attention scan on any device (torch ops), then vLLM's
    hit per engine."""
    from kvhit.kernels import fleet_torch

    plan = engine.plan
    sg = plan.spec_groups[0]
    bs, align = sg.block_size, plan.alignment
    drop = sg.use_eagle and (apply_eagle or lookup)
    lens = lens.cpu().numpy()
    n_units = view.lengths.cpu().numpy()
    bound = lens // align * align if lookup else lens
    runs = fleet_torch.full_runs(
        fleet.keys, fleet.bits, view.rows, view.offsets, view.lengths,
        torch.from_numpy(bound // bs), sg.scale, sg.group_ids, fleet._active,
        fleet.num_engines,
    ).cpu().numpy()  # fmt: skip
    hit = _full_hits(runs, bs, align, drop)
    if not lookup:
        return hit
    # The store worker's rule (ReferenceCoordinator.lookup): a hit covering the
    # whole prompt is re-derived at num_tokens - 1; the leading run under the
    # smaller bound is the run clipped to it.
    n_tok = lens[:, None]
    again = (n_tok - 1) // align * align
    hit2 = _full_hits(np.minimum(runs, again // bs), bs, align, drop)
    hit = np.where(hit >= n_tok, np.where(again > 0, hit2, 0), hit)
    ok = (n_units > 0) & (bound > 0)
    return np.where(ok[:, None], hit, 0)


def _engine_table(fleet: FleetIndex, g: torch.Tensor, h: torch.Tensor) -> KeyIndex:
    """A read-only KeyIndex over a new table holding exactly keys (g, h)."""
    table = new_table(_next_pow2(2 * g.shape[0] + 1), fleet.W, fleet.device)
    if g.shape[0]:
        fleet._ops.insert(table, fleet.W, g, h)
    return KeyIndex.from_table(table, fleet.hash_bytes)


def _fleet_generic(engine, view, lens, fleet, apply_eagle, lookup) -> torch.Tensor:
    B, E = len(view), fleet.num_engines
    dev = fleet.device
    rows = view.rows
    G = engine.plan.num_groups
    gids = torch.arange(G, dtype=torch.int64, device=dev)
    pb = fleet._ops.probe_bits(fleet.keys, fleet.bits, gids, rows)  # [G, T, NW]
    held = _unpack_engines(pb, E).numpy()  # [G, T, E]
    held &= fleet._active.numpy()[None, None, :]
    offs = view.offsets.cpu().numpy()
    lengths = view.lengths.cpu().numpy()
    # Row t -> request (rows may be shared by requests: a view of a batch
    # holds each request's rows once, in order).
    row_any = held.any(axis=0)  # [T, E]
    touches = np.zeros((B, E), dtype=bool)
    for r in range(B):
        if lengths[r]:
            touches[r] = row_any[offs[r] : offs[r] + lengths[r]].any(axis=0)

    def run(sub, sub_lens, index):
        if lookup:
            return engine.impl.lookup(sub, sub_lens, index)
        return engine.impl.find(sub, sub_lens, index, apply_eagle)[0]

    empty = _engine_table(fleet, gids[:0], rows[:0])
    base = run(view, lens, empty).cpu()
    out = base[:, None].repeat(1, E)
    out[:, ~fleet._active] = 0
    e_idx, g_idx, t_idx = (
        np.ascontiguousarray(a) for a in np.nonzero(held.transpose(2, 0, 1))
    )
    bounds = np.searchsorted(e_idx, np.arange(E + 1))
    for e in np.flatnonzero(touches.any(axis=0)):
        lo, hi = bounds[e], bounds[e + 1]
        g = torch.from_numpy(g_idx[lo:hi]).to(dev)
        t = torch.from_numpy(t_idx[lo:hi]).to(dev)
        index = _engine_table(fleet, g, rows.index_select(0, t).contiguous())
        reqs = torch.from_numpy(np.flatnonzero(touches[:, e])).to(view.offsets.device)
        out[reqs.cpu(), int(e)] = run(view.select(reqs), lens[reqs], index).cpu()
    return out


@functools.lru_cache(maxsize=32)
def _engine_plans(plan: ScanPlan, E: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The plan rows that make the numba scan read engine ``e``'s entries:
    candidate rows for every virtual group ``v = g * E + e`` (row ``v`` is
    group ``v // E``'s) and, per engine, SpecGroup rows whose members are
    ``g * E + e``."""
    from kvhit.kernels.contract import CAND_GROUP_ID, SG_MEMBERS

    sg = np.array(plan.as_rows(), dtype=np.int64)
    cand = np.repeat(np.array(plan.candidates_as_rows(), dtype=np.int64), E, axis=0)
    cand[:, CAND_GROUP_ID] = np.arange(cand.shape[0])
    per_engine = []
    members = sg[:, SG_MEMBERS:]
    for e in range(E):
        rows = sg.copy()
        rows[:, SG_MEMBERS:] = np.where(members >= 0, members * E + e, members)
        per_engine.append(rows)
    return cand, per_engine


def _first_block_holders(plan, view, fleet) -> np.ndarray | None:
    """bool ``[B, E]``: engines that may hit each request at all, or None when
    the layout gives no such bound. With a full-attention first SpecGroup a
    hit needs the engine to hold (in every member group) block 0's key or,
    fine-grained, one hash unit of block 0: its scan is a leading run from
    block 0 (and the fine tail inside block 0), and the convergence loop
    never lets a later SpecGroup raise the hit above it
    (``reference.full_attention_hit``, ``ReferenceCoordinator._find``)."""
    sg = plan.spec_groups[0]
    if sg.kind != KIND_FULL:
        return None
    fscale = sg.block_size // plan.alignment if sg.fine else sg.scale
    first = 0 if sg.fine else fscale - 1
    offs = view.offsets.numpy()
    n_units = view.lengths.numpy()
    reqs, units = [], []
    for u in range(first, fscale):
        r = np.flatnonzero(n_units > u)
        reqs.append(r)
        units.append(offs[r] + u)
    req = np.concatenate(reqs)
    rows = view.rows[torch.from_numpy(np.concatenate(units))].contiguous()
    members = torch.tensor(sg.group_ids, dtype=torch.int64)
    pb = fleet._ops.probe_bits(fleet.keys, fleet.bits, members, rows)  # [M, R, NW]
    held = np.bitwise_and.reduce(pb, axis=0)
    words = np.zeros((len(view), fleet.NW), dtype=np.int64)
    np.bitwise_or.at(words, req, held)
    return _unpack_engines(words, fleet.num_engines).numpy()


def _fleet_entries(engine, view, lens, fleet, apply_eagle, lookup) -> np.ndarray:
    """Every (request, engine) pair that may hit, by the engine's own numba
    scan over the entry index with the plan's groups renamed ``g * E + e``:
    vLLM's whole rule, exactly, at the cost of one single-engine scan per
    pair."""
    from kvhit.kernels import scan_numba

    plan = engine.plan
    B, E = len(view), fleet.num_engines
    cand, sg_rows = _engine_plans(plan, E)
    active = fleet._active.numpy()
    sg = plan.spec_groups[0]
    runs = None
    if sg.kind == KIND_FULL and not sg.fine:
        # The first block held (in every member) is a leading run of >= 1.
        runs = _first_runs(plan, view, fleet)
        may = (runs > 0) & active
    else:
        may = _first_block_holders(plan, view, fleet)
        may = np.broadcast_to(active, (B, E)) if may is None else may & active
    out = np.zeros((B, E), dtype=np.int64)
    rows = view.rows.numpy()
    offs, lengths, lens_np = view.offsets.numpy(), view.lengths.numpy(), lens.numpy()
    table = fleet.entries.table.numpy()
    kw = dict(hash_block_size=plan.hash_block_size, alignment=plan.alignment,
              partial=plan.partial, simple_hybrid=plan.simple_hybrid,
              parallel=False)  # fmt: skip
    rep = None
    if sg.kind == KIND_FULL and (may.sum(axis=1) >= CLASS_MIN_ENGINES).any():
        # Scan one engine per class of engines that must answer alike.
        if runs is None:
            runs = _first_runs(plan, view, fleet)
        rep = _engine_classes(plan, view, fleet, may, runs)
        may = rep == np.arange(E)[None, :]
    for e in np.flatnonzero(may.any(axis=0)):
        r = np.flatnonzero(may[:, e])
        args = (rows, offs[r], lengths[r], lens_np[r], sg_rows[e], cand)
        if lookup:
            out[r, e] = scan_numba.lookup_hits(*args, table=table, **kw)
        else:
            out[r, e] = scan_numba.find_hits(
                *args, table=table, token_lens=None, apply_eagle=apply_eagle, **kw
            )[0]
    if rep is not None:
        hit = rep >= 0
        out[hit] = np.take_along_axis(out, np.maximum(rep, 0), axis=1)[hit]
    return out


@functools.lru_cache(maxsize=32)
def _class_groups(plan: ScanPlan) -> tuple[np.ndarray, np.ndarray, int]:
    """Every group id of the plan and the step of the rows a scan may probe
    it at (its SpecGroup's scale; 1 when fine-grained): int64 ``[G]`` each;
    and how many hash units past the start of the first SpecGroup's run
    (full attention) a later SpecGroup's scan may read: the units of the
    first's hit past it (fine-grained: up to ``scale - 1``; else none),
    plus the largest EAGLE proof margin (a later SpecGroup under EAGLE is
    scanned that far past the hit it is given: ``ReferenceCoordinator._round``;
    ``fleet_numba.engine_classes``' ``reach_rows``)."""
    gids, steps = [], []
    for sg in plan.spec_groups:
        for g in sg.group_ids:
            gids.append(g)
            steps.append(1 if sg.fine else sg.scale)
    hbs = plan.hash_block_size
    first = plan.spec_groups[0]
    reach = max(-(-sg.margin // hbs) for sg in plan.spec_groups)
    reach += first.scale - 1 if first.fine else 0
    return np.array(gids, dtype=np.int64), np.array(steps, dtype=np.int64), reach


#: Hybrid layouts: a request that fewer engines than this may hit scans
#: every one of them; from this many on, engines that must answer alike
#: share one scan (``kernels/fleet_numba.engine_classes``). Below it the
#: classes (a probe per key a scan might read) cost more than the scans they
#: save (B = 64, Mooncake trace: they lose at E = 8, win from E = 16).
CLASS_MIN_ENGINES = 12


def _first_runs(plan, view, fleet) -> np.ndarray:
    """The first SpecGroup's (full attention) leading run of blocks per
    request and engine, unbounded: int64 ``[B, E]`` (one joint scan)."""
    from kvhit.kernels import fleet_numba

    sg = plan.spec_groups[0]
    lengths = view.lengths.numpy()
    return fleet_numba.full_runs(
        fleet._table_np, fleet.NW, view.rows.numpy(), view.offsets.numpy(), lengths,
        lengths // sg.scale, sg.scale, np.array(sg.group_ids, dtype=np.int64),
        fleet._live, fleet.num_engines,
    )  # fmt: skip


def _engine_classes(plan, view, fleet, may, runs) -> np.ndarray:
    """``kernels/fleet_numba.engine_classes`` for a plan whose first
    SpecGroup is full attention (``runs`` its :func:`_first_runs`): rep int64
    ``[B, E]``, the engine whose scan answers for ``(r, e)``, -1 where
    ``may`` is False."""
    from kvhit.kernels import fleet_numba

    gids, steps, reach = _class_groups(plan)
    return fleet_numba.engine_classes(
        fleet._table_np, fleet.NW, view.rows.numpy(), view.offsets.numpy(),
        view.lengths.numpy(), runs, np.ascontiguousarray(may),
        plan.spec_groups[0].scale, reach, gids, steps, CLASS_MIN_ENGINES,
    )  # fmt: skip


def fleet_find(
    engine: LookupEngine,
    batch: HashBatch,
    lens: torch.Tensor,
    fleet: FleetIndex,
    apply_eagle: bool = True,
    lookup: bool = False,
) -> torch.Tensor:
    """Every request against every engine of ``fleet``: int64 ``[B, E]`` on
    the engine's device. Entry ``[b, e]`` is what ``engine`` answers for
    request ``b`` against engine ``e``'s keys alone: its
    ``find_longest_cache_hit(...).hit_lengths`` at ``max_length = lens[b]``
    or, with ``lookup``, its ``lookup`` of a ``lens[b]``-token prompt (the
    store worker's rule). Inactive engines' columns are 0.

    Inputs are trusted (``LookupEngine.fleet_hits`` / ``fleet_lookup`` check
    them): ``batch`` on the engine's device, ``lens`` int64 ``[B]`` >= 0
    there, ``fleet`` as :func:`check_fleet` requires.
    """
    B, E = len(batch), fleet.num_engines
    if B == 0:
        return torch.zeros((0, E), dtype=torch.int64, device=engine.device)
    if _full_path(engine.plan, lookup):
        if fleet.backend == "numba":
            hit = fleet_full_host(engine, batch, lens, fleet, apply_eagle, lookup)
            if hit is None:  # pragma: no cover - the inputs were checked
                raise RuntimeError("fleet_find: checked inputs refused")
            return hit
        if isinstance(fleet._ops, _TritonOps):
            return _fleet_full_triton(engine, batch, lens, fleet, apply_eagle, lookup)
        hit = _fleet_full(engine, batch.view(), lens, fleet, apply_eagle, lookup)
        return torch.from_numpy(hit).to(engine.device)
    view = batch.view()
    if fleet.backend == "numba":
        return torch.from_numpy(
            _fleet_entries(engine, view, lens, fleet, apply_eagle, lookup)
        )
    out = _fleet_generic(engine, view, lens, fleet, apply_eagle, lookup)
    return out.to(engine.device)


def prefix_blocks(
    batch: HashBatch,
    fleet: FleetIndex,
    group_ids: Sequence[int],
    scale: int,
    max_blocks: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """How many leading blocks of each request every engine holds, counting
    only the keys of ``group_ids`` (a block needs its key in each): int64
    ``[B, E]`` (0 for inactive engines). This is the overlap score of a router
    that counts cached blocks of one attention type, e.g. Dynamo's
    ``find_matches`` over full-attention events; it is not vLLM's hit (no
    alignment, EAGLE drop, sliding-window or Mamba rule).

    Args:
        batch: ``B`` requests' hashes (on the fleet's device, its hash width).
        fleet: the engines' keys.
        group_ids: the groups whose keys count (non-empty, each >= 0).
        scale: hash units per block (block ``i`` is keyed by hash unit
            ``(i + 1) * scale - 1``), >= 1.
        max_blocks: int64 ``[B]``, the most blocks counted per request, or
            None (every whole block of the request).
    """
    if not isinstance(batch, HashBatch):
        raise TypeError(f"batch must be a HashBatch, got {type(batch).__name__}")
    check_fleet(fleet, batch, batch.device)
    scale = _check_int(scale, "scale", 1)
    if isinstance(group_ids, str | bytes) or not isinstance(group_ids, Iterable):
        raise TypeError(
            f"group_ids must be a sequence of ints, got {type(group_ids).__name__}"
        )
    gids = [_check_int(g, "group_ids", 0) for g in group_ids]
    if not gids:
        raise ValueError("group_ids must name at least one group")
    B, E = len(batch), fleet.num_engines
    view = batch.view()
    n_units = view.lengths.cpu().numpy()
    if max_blocks is None:
        ends = n_units // scale
    else:
        ends = _max_blocks(max_blocks, B)
    members = np.array(gids, dtype=np.int64)
    if B == 0:
        return torch.zeros((0, E), dtype=torch.int64, device=fleet.device)
    if fleet.backend == "numba":
        from kvhit.kernels import fleet_numba

        runs = fleet_numba.full_runs(
            fleet._table.numpy(), fleet.NW, view.rows.numpy(),
            view.offsets.numpy(), n_units, ends, scale, members,
            fleet._live, E,
        )  # fmt: skip
        return torch.from_numpy(runs)
    if isinstance(fleet._ops, _TritonOps):
        return fleet._ops.triton()[0].full_runs(
            fleet.keys, fleet.bits, view.rows, view.offsets, view.lengths,
            torch.tensor(ends, device=fleet.device), scale, members, fleet._live, E,
        )  # fmt: skip
    # Any device: each (group, hash) probed once, then the runs on the host.
    pb = fleet._ops.probe_bits(
        fleet.keys, fleet.bits, torch.from_numpy(members).to(fleet.device), view.rows
    )
    held = _unpack_engines(pb, E).numpy().all(axis=0) & fleet._active.numpy()
    offs = view.offsets.cpu().numpy()
    runs = np.zeros((B, E), dtype=np.int64)
    for r in range(B):
        end = int(min(ends[r], n_units[r] // scale))
        rows = offs[r] + (np.arange(end) + 1) * scale - 1
        ok = np.logical_and.accumulate(held[rows], axis=0)
        runs[r] = ok.sum(axis=0)
    return torch.from_numpy(runs).to(fleet.device)


def _max_blocks(value: Any, B: int) -> np.ndarray:
    """:func:`prefix_blocks`' ``max_blocks`` as int64 ``[B]`` (a copy),
    each an integer in ``[0, 2**63)``; TypeError/ValueError naming it (a
    float or bool is refused, not truncated)."""
    if isinstance(value, torch.Tensor):
        arr = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        bad = next((i for i, v in enumerate(value) if not _is_int(v)), None)
        if bad is not None:
            raise TypeError(
                f"max_blocks[{bad}] must be an int, got {type(value[bad]).__name__}"
            )
        if any(not 0 <= v < 1 << 63 for v in value):
            raise ValueError(f"max_blocks must be [{B}] ints in [0, 2**63)")
        arr = np.array([int(v) for v in value], dtype=np.int64)
    else:
        raise TypeError(
            "max_blocks must be an int64 tensor, an integer array or a sequence "
            f"of ints, got {type(value).__name__}"
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(f"max_blocks must hold integers, got dtype {arr.dtype}")
    if arr.shape != (B,):
        raise ValueError(f"max_blocks must have shape [{B}], got {list(arr.shape)}")
    if B and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 63):
        raise ValueError(f"max_blocks must be [{B}] ints in [0, 2**63)")
    return arr.astype(np.int64)


# --------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------


def route(
    hits: torch.Tensor,
    loads: torch.Tensor | Sequence[float] | None = None,
    *,
    prompt_tokens: torch.Tensor | Sequence[int] | None = None,
    block_size: int = 1,
    overlap_weight: float = 1.0,
    update_loads: bool = True,
) -> torch.Tensor:
    """Pick one engine per request, in one call: int64 ``[B]``.

    Cost model: Dynamo's KV router ("Routing Concepts", Cost Calculation,
    docs.nvidia.com/dynamo/dev/components/router/routing-concepts: ``cost =
    overlap_score_weight * prefill_blocks + decode_blocks``, prefill blocks the
    prompt tokens not cached on the worker over the block size, decode blocks
    the worker's active blocks), per request ``b`` and engine ``e``::

        prefill_blocks[b, e] = (prompt_tokens[b] - hits[b, e]) / block_size
        decode_blocks[e]     = loads[e]
        cost[b, e]           = overlap_weight * prefill_blocks[b, e] + loads[e]

    and the request goes to the engine of least cost. ``prompt_tokens``
    defaults to the row's largest hit (only the differences between engines
    matter, so the choice is the same for any prompt length). With
    ``update_loads`` (default) requests are placed in batch order and each
    placement adds its prompt's blocks (``prompt_tokens[b] / block_size``, or
    the row's largest hit in blocks) to the chosen engine's load before the
    next request is placed, as a router that sees them one at a time would.

    Ties: among engines of equal least cost, the one with the longest hit,
    then the least load, then the lowest engine id (deterministic; callers
    wanting random spreading permute engine ids themselves).

    Args:
        hits: int64 ``[B, E]``, tokens each engine would load
            (``LookupEngine.fleet_hits`` / ``fleet_lookup``); a negative
            entry marks an engine that may not take the request.
        loads: float or int ``[E]`` (decode blocks in flight per engine), or
            None (all 0).
        prompt_tokens: int ``[B]`` >= every hit of its row, or None.
        block_size: tokens per block (> 0) for the prefill term.
        overlap_weight: the prefill weight (>= 0).
        update_loads: add each placed request's blocks to its engine's load.

    Returns:
        int64 ``[B]`` on ``hits``' device; -1 for a request no engine may take.
    """
    check_tensor(hits, "hits", dim=2)
    B, E = hits.shape
    if E < 1:
        raise ValueError("hits must have at least one engine column")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
    ):
        raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
    if not isinstance(overlap_weight, int | float) or not overlap_weight >= 0:
        raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight!r}")
    h = hits.detach().cpu().numpy().astype(np.float64)
    if loads is None:
        load = np.zeros(E, dtype=np.float64)
    else:
        load = np.asarray(
            loads.detach().cpu().numpy() if isinstance(loads, torch.Tensor) else loads,
            dtype=np.float64,
        )
        if load.shape != (E,) or not np.isfinite(load).all():
            raise ValueError(
                f"loads must be {E} finite numbers, got shape {load.shape}"
            )
        load = load.copy()
    allowed = h >= 0
    best = np.where(allowed, h, 0).max(axis=1) if E else np.zeros(B)
    if prompt_tokens is None:
        prompt = best
    else:
        prompt = np.asarray(
            prompt_tokens.detach().cpu().numpy()
            if isinstance(prompt_tokens, torch.Tensor)
            else prompt_tokens,
            dtype=np.float64,
        )
        if prompt.shape != (B,) or bool((prompt < best).any()):
            raise ValueError(
                f"prompt_tokens must be [{B}] with each >= its row's largest hit"
            )
    prefill = (prompt[:, None] - h) / block_size
    out = np.full(B, -1, dtype=np.int64)
    for b in range(B):
        if not allowed[b].any():
            continue
        cost = overlap_weight * prefill[b] + load
        cost = np.where(allowed[b], cost, np.inf)
        # Lexicographic: cost, then longer hit, then lower load, then lower id.
        order = np.lexsort((np.arange(E), load, -h[b], cost))
        e = int(order[0])
        out[b] = e
        if update_loads:
            load[e] += prompt[b] / block_size
    return torch.from_numpy(out).to(hits.device)
