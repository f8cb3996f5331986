"""FleetIndex: the keys of E engines in one table, so that every request is
scored against every engine in one call.

A KV-aware router in front of E vLLM instances asks, for each waiting request,
how many prompt tokens each instance would load from its cache. Under vLLM's
rules (``coordinator/reference.py``) that is ``find_longest_cache_hit`` against
that engine's keys alone. :class:`FleetIndex` holds the keys ``(engine, group,
block hash)`` of all engines; ``LookupEngine.fleet_hits`` / ``fleet_lookup``
answer ``[B, E]`` in one call (:mod:`kvhit.coordinator.fleet_scoring`, through
the fleet's :meth:`FleetIndex.router_hits` and
:meth:`FleetIndex.hits_unchecked`: engine.py imports no fleet module), and
:mod:`kvhit.coordinator.routing` turns those into an engine per request.

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
  + 1 + NW]`` (:attr:`FleetIndex.table`, allocated by numpy for transparent
  huge pages): a slot's engine set lies beside its key, so a block scanned
  costs one cache miss (and, with 2 MiB pages, rarely a TLB miss). The torch
  backend keeps them as two contiguous tables (its kernels index them flat).
* ``entries``: a :class:`KeyIndex` of the pairs (engine, key) as keys
  ``(group * E + engine, hash)`` (so group ids are at most
  :attr:`FleetIndex.max_group_id`): each engine's own store, which the
  single-engine scans read with the plan's groups renamed. ``(W + 1) * 8``
  bytes per slot, one slot per (engine, key) pair. With the numba backend
  it is built from the engine bits when first read (:attr:`FleetIndex.entries`)
  and kept from then on: a router on a full-attention layout never reads
  it, and a store that leaves it out costs one cache miss a key, not two.

Every mutation updates both (the entry index once built), after validating
all of its input.

KERNELS
=======

A fleet binds one kernel family when it is built, by backend name
(:data:`FLEET_KERNEL_MODULES`, as ``key_index.KERNEL_MODULES`` does for a
KeyIndex): each of ``kernels/fleet_numba.py`` (CPU, compiled),
``kernels/fleet_torch.py`` (torch ops, any device) and
``kernels/fleet_triton.py`` (CUDA: the torch family's tables driven by the
Triton kernels of ``kernels/hash_index.py`` and ``kernels/fleet_triton.py``)
exports a ``FleetOps`` taking the same calls (find, insert, new tables,
engine-set updates, probes, the joint full-attention runs and hits). What
differs per backend is a method of that object; nothing here branches on a
backend's name. The numba family's table is also read as numpy
(:attr:`FleetIndex.host_table`; None for the others) by the host paths of
``coordinator/fleet_scoring.py``.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvhit.coordinator import fleet_scoring
from kvhit.coordinator.backend import auto_backend, resolve_backend
from kvhit.coordinator.key_index import (
    MAX_CAPACITY,
    MAX_LOAD_RANGE,
    KeyIndex,
    normalize_keys,
)
from kvhit.coordinator.key_index_keys import host_int64, normalize_ids
from kvhit.coordinator.key_index_state import next_pow2, verify_reachable, verify_slots
from kvhit.coordinator.packing import HashBatch, num_words, padding_mask
from kvhit.kernels.checks import (
    check_bool,
    check_int,
    check_max_load,
    check_tensor,
    resolve_device,
)
from kvhit.kernels.contract import EMPTY
from kvhit.kernels.fleet_torch import unpack_engines
from kvhit.kernels.hash_index_torch import new_table

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvhit.coordinator.engine import LookupEngine

__all__ = [
    "FLEET_BACKENDS",
    "FLEET_KERNEL_MODULES",
    "MAX_ENGINES",
    "EngineView",
    "FleetIndex",
    "check_fleet",
    "fleet_ops",
    "state_checksum",
]

#: Backend -> its fleet kernel module, each exporting ``FleetOps`` (the same
#: table operations), imported when a fleet binds it: coordinator/ never
#: imports triton or numba before.
FLEET_KERNEL_MODULES: Mapping[str, str] = {
    "numba": "kvhit.kernels.fleet_numba",
    "torch": "kvhit.kernels.fleet_torch",
    "triton": "kvhit.kernels.fleet_triton",
}
#: Backends a FleetIndex accepts ("auto": numba on the CPU, triton on CUDA,
#: torch elsewhere).
FLEET_BACKENDS = ("auto", *FLEET_KERNEL_MODULES)
#: The most engines a FleetIndex may hold (a bound on the ``[B, E]`` outputs).
MAX_ENGINES = 1 << 16
_STATE_VERSION = 1
_INT64 = np.dtype(np.int64)


def fleet_ops(backend: str) -> Any:
    """A new ``FleetOps`` of a resolved ``backend``'s kernel family (see
    :data:`FLEET_KERNEL_MODULES`), its module imported now."""
    return importlib.import_module(FLEET_KERNEL_MODULES[backend]).FleetOps()


def _resolve_backend(backend: Any, device: torch.device) -> str:
    # The one rule of coordinator/backend.py. The fleet's Triton kernels run
    # where auto_backend picks triton (CUDA); a test that patches this
    # module's auto_backend drives them under the interpreter on the CPU.
    interpreted = device.type == "cpu" and auto_backend(device) == "triton"
    return resolve_backend(backend, device, FLEET_BACKENDS, interpreted)


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------


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
        warm: load or compile the kernel family's kernels now (numba: the
            stores' and the router call's), so that the first call of a
            serving process does not pay for it; ``False`` defers it.
        lazy_entries: (numba) stores leave the entry index out until it is
            first read (a hybrid layout's lookup, ``state_dict``), which then
            builds it from the engine bits in one pass: stores cost one cache
            miss a key, not two, but that first read pays for every pair held
            (1M pairs: 1.7 s on a loaded 2-core box). A router whose layout is
            hybrid (SWA, Mamba, EAGLE) passes ``False``: kept from the start.

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
        table: the table probed: ``keys`` itself, or (numba) one int64
            ``[C, W + 1 + NW]`` table whose column views ``keys`` and
            ``bits`` are.
        host_table: ``table`` as numpy where the family's host kernels read
            it (numba: a view, kept so that a lookup makes no torch call for
            it), else None.
        host_kernel: the family's compiled router kernel
            (``fleet_numba.full_hits_checked``) where it has one, else None.
        live: int64 ``[NW]``, the active engines as an engine set
            (:meth:`live_words` when they last changed).
        active_mask: bool ``[E]`` (CPU), True for the active engines (the
            live tensor; :attr:`active` gives a copy).
        ops: the backend's ``FleetOps`` (:data:`FLEET_KERNEL_MODULES`).

    The scans of ``coordinator/fleet_scoring.py`` read these; nothing
    outside this class writes them.
    """

    def __init__(
        self,
        num_engines: int,
        hash_bytes: int,
        capacity: int = 1024,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        max_load: float = 0.5,
        warm: bool = True,
        lazy_entries: bool = True,
    ) -> None:
        num_engines = check_int(num_engines, "num_engines", 1, MAX_ENGINES + 1)
        warm = check_bool(warm, "warm")
        lazy_entries = check_bool(lazy_entries, "lazy_entries")
        W = num_words(hash_bytes)
        capacity = check_int(capacity, "capacity", 1, MAX_CAPACITY + 1)
        max_load = check_max_load(max_load, MAX_LOAD_RANGE)
        dev = resolve_device(device)
        backend = _resolve_backend(backend, dev)
        ops = fleet_ops(backend)
        cap = next_pow2(capacity)
        nw = (num_engines + 63) // 64
        entries = KeyIndex(hash_bytes, capacity=cap, device=dev,
                           backend=ops.entries_backend, max_load=max_load,
                           warm=warm)  # fmt: skip
        self._init(
            num_engines,
            hash_bytes,
            new_table(cap, W, dev),
            torch.zeros((cap, nw), dtype=torch.int64, device=dev),
            entries,
            torch.ones(num_engines, dtype=torch.bool),
            backend,
            ops,
            max_load,
            0,
            0,
            lazy_entries=lazy_entries,
        )
        if warm and hasattr(ops, "warm_up"):
            # The family's kernels loaded now (where it compiles ahead), so
            # the first store or router call does not pay for it.
            ops.warm_up()

    def _init(self, num_engines, hash_bytes, keys, bits, entries, active, backend,
              ops, max_load, size, tombs, lazy_entries=False) -> None:  # fmt: skip
        """Set every attribute (the one place that lists them). With
        ``lazy_entries`` (``entries`` empty) and a family with a host store,
        the entry index is left empty until :attr:`entries` is first read."""
        self.num_engines = num_engines
        self.hash_bytes = hash_bytes
        self.W = num_words(hash_bytes)
        self.NW = (num_engines + 63) // 64
        self._backend = backend
        self.ops = ops
        # The table probed (numba: keys and engine sets side by side, a row
        # per slot) and its views ``keys`` / ``bits``.
        self.table, self.keys, self.bits = ops.new_tables(
            keys.shape[0], self.W, self.NW, keys.device
        )
        self.host_table = ops.host_table(self.table)
        # The router call's kernel where the family reads its table on the
        # host (fleet_scoring.fleet_full_host), else None.
        self.host_kernel = getattr(ops, "host_kernel", None)
        self.keys.copy_(keys)
        self.bits.copy_(bits)
        self._entry_index = entries
        self.active_mask = active.to("cpu").clone()
        # Views the host store reads (active_mask changes in place only).
        self._active_np = self.active_mask.numpy()
        self._store_host = getattr(ops, "store_entries", None)
        # Whether the entry index is not kept yet (then empty): built from
        # the bits when first read, kept by every mutation from then on.
        self._entries_lazy = bool(lazy_entries and self._store_host is not None)
        self.live = self.live_words()
        self.max_load = max_load
        # A store's fixed cost: its bounds, computed once (the table's load
        # limit again at each rehash), and engine ids as 1-element arrays.
        self._cap_limit = self._limit(self.table.shape[0])
        self._max_gid = self.max_group_id
        self._one_engine: dict[int, np.ndarray] = {}
        self._one_group: dict[int, np.ndarray] = {}
        self._pad = padding_mask(hash_bytes)
        self._size = size
        self._tombstones = tombs
        # Per engine, how many keys it holds (kept exact by every mutation).
        self._per_engine = np.zeros(num_engines, dtype=np.int64)
        self._version = 0

    # -- properties -----------------------------------------------------------

    @property
    def entries(self) -> KeyIndex:
        """The entry index (module docstring), built from the engine bits
        here on its first read where stores left it out."""
        if self._entries_lazy:
            self._build_entries()
        return self._entry_index

    def _build_entries(self) -> None:
        """Store every (engine, key) pair of the bits into the empty entry
        index, which every mutation keeps from then on."""
        t0 = time.perf_counter()
        table = self.host_table
        live = np.flatnonzero(table[:, 0] >= 0)
        base = table.shape[1] - self.NW
        slots, engines = [], []
        for k in range(self.NW):
            # Slots with an engine in word k, then that word's bits.
            nz = live[table[live, base + k] != 0]
            words = np.ascontiguousarray(table[nz, base + k])
            r, b = np.nonzero(np.unpackbits(words.view(np.uint8).reshape(-1, 8),
                                            axis=1, bitorder="little"))  # fmt: skip
            slots.append(nz[r])
            engines.append(b.astype(np.int64) + 64 * k)
        s, e = np.concatenate(slots), np.concatenate(engines)
        index = self._entry_index
        if s.shape[0]:
            index.reserve(s.shape[0])
            index.add_trusted(
                np.ascontiguousarray(table[s, 0] * self.num_engines + e),
                np.ascontiguousarray(table[s, 1 : 1 + self.W]),
            )  # fmt: skip
        self._entries_lazy = False
        if s.shape[0]:
            # A one-time pause on the caller's thread (a router's first
            # hybrid lookup): said, with the way to avoid it.
            logger.warning(
                "FleetIndex: built the entry index of %d (engine, key) pairs on "
                "its first read in %.0f ms; a router with a hybrid layout "
                "constructs FleetIndex(..., lazy_entries=False) to keep it from "
                "the start", s.shape[0], 1e3 * (time.perf_counter() - t0))  # fmt: skip

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
        return self.active_mask.clone()

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
        index = self._entry_index
        return (self.keys.numel() + self.bits.numel()) * 8 + index.memory_bytes()

    def __repr__(self) -> str:
        return (
            f"FleetIndex(num_engines={self.num_engines}, hash_bytes="
            f"{self.hash_bytes}, len={len(self)}, capacity={self.capacity}, "
            f"device={self.device}, backend={self.backend!r})"
        )

    def live_words(self) -> np.ndarray:
        """The active engines as an engine set: int64 ``[NW]``."""
        words = np.zeros(self.NW * 64, dtype=np.uint8)
        words[: self.num_engines] = self.active_mask.numpy()
        return np.packbits(words, bitorder="little").view(np.int64).copy()

    # -- arguments -------------------------------------------------------------

    def normalize_engine_ids(
        self, engine_ids: Any, n: int, need_active: bool = False
    ) -> torch.Tensor:
        """``engine_ids`` for ``n`` keys as a contiguous int64 ``[n]`` tensor
        on the index's device, each in ``[0, E)`` (and active, with
        ``need_active``). Raises TypeError/ValueError naming ``engine_ids``."""
        dev = self.device
        t = normalize_ids(
            engine_ids, "engine_ids", n, dev, bound=self.num_engines, holds_data=True
        )
        if need_active and n:
            inactive = ~self.active_mask.to(dev)[t]
            if bool(inactive.any()):
                e = int(t[inactive.nonzero()[0, 0]])
                raise ValueError(
                    f"engine_ids: engine {e} was removed from the fleet "
                    "(add_engine first)"
                )
        return t

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
        return check_int(engine, "engine", 0, self.num_engines)

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
        table, keys, bits = self.ops.new_tables(capacity, self.W, self.NW, self.device)
        host = self.ops.host_table(table)
        rows = getattr(self.ops, "rehash_rows", None)
        if rows is not None:
            # A family whose keys and engine sets share one table (numba):
            # each live row moved whole, in one pass (131,000 keys 17-19 ->
            # 7 ms here; the gathers, insert, find and scatter below touch
            # every key four times).
            stored = rows(self.host_table, host, self.W)
        else:
            live = (self.keys[:, 0] >= 0).nonzero().squeeze(1)
            g = self.keys[live, 0].contiguous()
            h = self.keys[live, 1:].contiguous()
            stored = self.ops.insert(table, self.W, g, h)
            slots = self.ops.find(table, self.W, g, h)
            bits[slots] = self.bits[live]
        if stored != self._size:  # pragma: no cover - would be a bug
            raise RuntimeError(f"rehash stored {stored} keys, expected {self._size}")
        self.table, self.keys, self.bits = table, keys, bits
        self.host_table = host
        self._cap_limit = self._limit(capacity)
        self._tombstones = 0
        self._version += 1

    # -- operations ---------------------------------------------------------------

    def add(self, engine_ids: Any, group_ids: Any, hashes: Any) -> int:
        """Engine ``engine_ids[i]`` now holds key ``(group_ids[i],
        hashes[i])``; idempotent. Returns the number of (engine, key) entries
        that were new. Refused (ValueError naming ``engine_ids``) for an
        engine removed by :meth:`remove_engine`."""
        if self._store_host is not None:
            stored = self._add_host(engine_ids, group_ids, hashes)
            if stored is not None:
                return stored
        e, g, h = self._entries(engine_ids, group_ids, hashes, need_active=True)
        n = g.shape[0]
        if n == 0:
            return 0
        entry_keys = g * self.num_engines + e
        index = None if self._entries_lazy else self._entry_index
        if index is not None and not index.has_room_for(n):
            # The entry index grows first, before anything else changes: a
            # growth that runs out of memory then leaves the fleet intact.
            fresh = ~index.contains_trusted(entry_keys, h)
            index.reserve(int(fresh.sum()))
        if self._size + self._tombstones + n > self._limit(self.capacity):
            # Count the keys that are really new before growing, so that
            # re-adding known keys never inflates the table.
            absent = self.ops.find(self.table, self.W, g, h) < 0
            ga, ha = g[absent].contiguous(), h[absent].contiguous()
            scratch = new_table(next_pow2(2 * ga.shape[0] + 1), self.W, self.device)
            n_new = self.ops.insert(scratch, self.W, ga, ha)
            if self._size + self._tombstones + n_new > self._limit(self.capacity):
                self._rehash(self._capacity_for(n_new))
        self._size += self.ops.insert(self.table, self.W, g, h)
        slots = self.ops.find(self.table, self.W, g, h)
        new = self.ops.set_bits(self.bits, slots, e, self.num_engines)
        if index is not None:
            index.add_trusted(entry_keys, h)
        self._per_engine += new
        self._version += 1
        return int(new.sum())

    def _add_host(self, engine_ids: Any, group_ids: Any, hashes: Any) -> int | None:
        """:meth:`add` in one kernel pass on numpy views (the family's
        ``store_entries``: the engines and group ids checked, then keys,
        engine bits, entry index and per-engine counts together), for
        arguments in a form that needs no conversion and a store that needs
        no growth; None hands the call to the general path (which converts,
        grows, or raises naming the argument). A store's fixed cost is what a
        KV event pays, so the checks left here are type tests and counts."""
        entries = self._entry_index
        if (
            type(group_ids) is int
            and type(hashes) is np.ndarray
            and hashes.dtype is _INT64
            and hashes.ndim == 2
            and hashes.shape[1] == self.W
            and not self._pad
            and hashes.flags.c_contiguous
        ):
            # A KV event's form (one group, the blocks' hash words): the
            # group id as a 1-element array the kernel broadcasts (made once
            # per id), no array of N copies.
            h = hashes
            g = self._one_group.get(group_ids)
            if g is None:
                if not 0 <= group_ids <= self._max_gid:
                    return None
                if len(self._one_group) >= 256:
                    self._one_group.clear()
                g = self._one_group[group_ids] = np.full(1, group_ids, np.int64)
        else:
            keys = entries.host_keys(group_ids, hashes)
            if keys is None:
                return None
            g, h = keys
        lazy = self._entries_lazy
        # None: the kernel's copy that leaves the entry index out.
        ent_table = None if lazy else entries.host_table
        if ent_table is None and not lazy:
            return None
        n = h.shape[0]
        if type(engine_ids) is int:
            # One engine for every key: a 1-element array the kernel
            # broadcasts (its range and activity checked there), one per
            # engine id, made once.
            e = self._one_engine.get(engine_ids)
            if e is None:
                if not 0 <= engine_ids < self.num_engines:
                    return None
                e = self._one_engine[engine_ids] = np.full(1, engine_ids, np.int64)
        else:
            e = host_int64(engine_ids)
            if e is None or e.ndim != 1 or e.shape[0] != n or not e.flags.c_contiguous:
                return None
        if n == 0:
            return 0
        if self._size + self._tombstones + n > self._cap_limit or (
            not lazy and n > entries.room()
        ):
            return None
        new_keys, new_bits, new_entries = self._store_host(
            self.host_table, ent_table, g, h, e, self._active_np, self._per_engine,
            self._max_gid,
        )  # fmt: skip
        if new_keys < 0:
            if new_keys == -1:
                # A bad or inactive engine, or a group id past max_group_id:
                # nothing stored; the general path raises naming it.
                return None
            raise RuntimeError(  # pragma: no cover - room was checked
                "insert: the table has no free slot for some keys"
            )
        self._size += new_keys
        if not lazy:
            entries.note_stored(new_entries)
        self._version += 1
        return new_bits

    def remove(self, engine_ids: Any, group_ids: Any, hashes: Any) -> int:
        """Engine ``engine_ids[i]`` no longer holds key ``(group_ids[i],
        hashes[i])`` (absent entries are ignored). Returns the number of
        entries removed."""
        e, g, h = self._entries(engine_ids, group_ids, hashes, need_active=False)
        if g.shape[0] == 0:
            return 0
        slots = self.ops.find(self.table, self.W, g, h)
        gone, freed = self.ops.clear_bits(
            self.keys, self.bits, slots, e, self.num_engines
        )
        if not self._entries_lazy:
            self._entry_index.remove(g * self.num_engines + e, h)
        self._per_engine -= gone
        self._size -= freed
        self._tombstones += freed
        self._version += 1
        return int(gone.sum())

    def clear_engine(self, engine: int) -> int:
        """Drop every key of ``engine`` (it stays in the fleet); returns how
        many it held."""
        e = self._engine(engine)
        if not self._entries_lazy:
            g, h = self.engine_keys(e)
            self._entry_index.remove(g * self.num_engines + e, h)
        cleared, freed = self.ops.clear_engine(self.keys, self.bits, e)
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
        self.active_mask[e] = False
        self.live = self.live_words()
        return cleared

    def add_engine(self, engine: int) -> None:
        """Put ``engine`` (back) into the fleet, with no keys."""
        e = self._engine(engine)
        if not bool(self.active_mask[e]):
            self.active_mask[e] = True
            self.live = self.live_words()
            self._version += 1

    def clear(self) -> None:
        """Drop every key of every engine (engines stay as they are)."""
        self.keys.zero_()
        self.keys[:, 0] = EMPTY
        self.bits.zero_()
        self._entry_index.clear()
        self._size = 0
        self._tombstones = 0
        self._per_engine[:] = 0
        self._version += 1

    def contains(self, engine_ids: Any, group_ids: Any, hashes: Any) -> torch.Tensor:
        """Whether engine ``engine_ids[i]`` holds key ``i``: bool ``[N]``."""
        e, g, h = self._entries(engine_ids, group_ids, hashes, need_active=False)
        if g.shape[0] == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        slots = self.ops.find(self.table, self.W, g, h)
        hit = slots >= 0
        words = torch.zeros_like(e)
        words[hit] = self.bits[slots[hit], e[hit] >> 6]
        return hit & (((words >> (e & 63)) & 1) == 1)

    def holders(self, group_ids: Any, hashes: Any) -> torch.Tensor:
        """Which engines hold each key: bool ``[N, E]`` on the index's device."""
        g, h = normalize_keys(group_ids, hashes, self.hash_bytes, self.device)
        slots = self.ops.find(self.table, self.W, g, h)
        words = torch.zeros((g.shape[0], self.NW), dtype=torch.int64,
                            device=self.device)  # fmt: skip
        hit = slots >= 0
        words[hit] = self.bits[slots[hit]]
        return unpack_engines(words.cpu().numpy(), self.num_engines).to(self.device)

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

    # -- lookups: what LookupEngine.fleet_hits / fleet_lookup call -----------------

    #: A router's call, checked and answered at the cost of one kernel
    #: dispatch where it takes the host path: int64 ``[B, E]``, or None
    #: (nothing checked or changed; the engine then validates everything and
    #: calls :meth:`hits_unchecked`). Called as ``fleet.router_hits(engine,
    #: batch, lens, apply_eagle, lookup)``; the function itself
    #: (:func:`~kvhit.coordinator.fleet_scoring.fleet_full_host`), not a
    #: wrapper: a router's batch is cold, and each Python frame costs
    #: microseconds there.
    router_hits = fleet_scoring.fleet_full_host
    #: ``LookupEngine.fleet_hit_array``'s call on a router's lists, as
    #: :attr:`router_hits` (:func:`~kvhit.coordinator.fleet_scoring.
    #: fleet_lists_host`; block_size trusted): int64 ``[B, E]`` or None.
    router_lists = fleet_scoring.fleet_lists_host

    def check_batch(self, batch: HashBatch, device: torch.device) -> None:
        """Raise naming ``fleet`` unless this fleet is on ``device`` with
        ``batch``'s hash width (:func:`check_fleet`)."""
        check_fleet(self, batch, device)

    def hits_unchecked(
        self,
        engine: LookupEngine,
        batch: HashBatch,
        lens: torch.Tensor,
        apply_eagle: bool,
        lookup: bool,
    ) -> torch.Tensor:
        """Every request of ``batch`` against every engine: int64 ``[B, E]``
        on the engine's device
        (:func:`~kvhit.coordinator.fleet_scoring.fleet_find`). No
        validation: the engine checked ``batch`` and ``lens`` (int64 ``[B]``
        >= 0 on its device) and :meth:`check_batch` the fleet."""
        return fleet_scoring.fleet_find(engine, batch, lens, self, apply_eagle,
                                        lookup)  # fmt: skip

    # -- persistence ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The index as plain data (``keys``/``bits`` are the live tensors,
        not copies); ``checksum`` lets :meth:`from_state_dict` refuse a
        corrupted dict (computing it reads both tables once)."""
        active = self.active_mask.clone()
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
        E = check_int(state["num_engines"], "state['num_engines']", 1,
                      MAX_ENGINES + 1)  # fmt: skip
        hash_bytes = state["hash_bytes"]
        W = num_words(hash_bytes)
        nw = (E + 63) // 64
        max_load = check_max_load(
            state["max_load"], MAX_LOAD_RANGE, "state['max_load']"
        )
        size = check_int(state["size"], "state['size']", 0)
        tombs = check_int(state["tombstones"], "state['tombstones']", 0)
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
        dev = resolve_device(device if device is not None else keys.device)
        backend = _resolve_backend(backend, dev)
        if state["checksum"] != _state_checksum(keys, bits, active, hash_bytes, E,
                                                size, tombs):  # fmt: skip
            raise ValueError(
                "state: checksum mismatch: the tables or counts were changed or "
                "corrupted after state_dict()"
            )
        ops = fleet_ops(backend)
        entries = KeyIndex.from_state_dict(state["entries"], device=dev,
                                           backend=ops.entries_backend)  # fmt: skip
        if entries.hash_bytes != hash_bytes:
            raise ValueError("state['entries'] has another hash width")
        obj = cls.__new__(cls)
        obj._init(E, hash_bytes, keys.to(dev, copy=True).contiguous(),
                  bits.to(dev, copy=True).contiguous(), entries, active, backend, ops,
                  max_load, size, tombs)  # fmt: skip
        obj._check_structure()
        if size + tombs > obj._limit(cap):
            obj._rehash(obj._capacity_for(0))
        return obj

    def _check_structure(self) -> None:
        keys, bits = self.keys, self.bits
        live_mask = verify_slots(keys, "keys", self._size, self._tombstones)
        if bool((bits[~live_mask] != 0).any()):
            raise ValueError("state['bits'] has engines in EMPTY or TOMBSTONE slots")
        if bool((bits[live_mask] == 0).all(dim=1).any()):
            raise ValueError("state['bits'] has a live key no engine holds")
        per = unpack_engines(bits[live_mask].cpu().numpy(), self.NW * 64).numpy()
        counts = per.sum(axis=0, dtype=np.int64)
        if counts[self.num_engines :].any():
            raise ValueError("state['bits'] names engines past num_engines")
        counts = counts[: self.num_engines]
        if counts[~self.active_mask.numpy()].any():
            raise ValueError("state['bits'] gives keys to an inactive engine")
        verify_reachable(
            keys,
            "keys",
            self.hash_bytes,
            live_mask,
            lambda g, h: self.ops.find(self.table, self.W, g, h),
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
