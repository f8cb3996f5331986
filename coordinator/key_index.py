"""KeyIndex: an exact hash set of ``(group_id, block_hash)`` keys on a device.

TABLE LAYOUT CONTRACT
=====================

Other code (the LookupEngine's backends: torch, Triton and numba kernels)
probes the table directly; this is the contract it relies on. The numbers
(sentinels, slot-hash constants) are defined once, in
:mod:`kvhit.kernels.contract`; this docstring says what they mean.

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

* Slot hash (int64 arithmetic, wrapping; ``>>`` on int64 is arithmetic in torch,
  Triton and numba, so every shift is masked to make it logical)::

      hash_init(g)   = (g ^ SEED) * M1
      hash_mix(h, w) = x = (h ^ w) * M2;  x ^ ((x >> 31) & LOW33)
      hash_finish(h) = x = h ^ ((h >> 29) & LOW35);  x = x * M3;
                       x ^ ((x >> 31) & LOW33)

      h = hash_init(group_id)
      for j in 0..W-1: h = hash_mix(h, word[j])
      home = hash_finish(h) & (capacity - 1)

  with the constants of :mod:`kvhit.kernels.contract` (its ``slot_hash`` is
  the plain-Python definition). Every word and the group id feed the hash,
  but the hash only picks the starting slot: membership is decided by
  comparing all W words and the group id exactly, so keys equal in every bit
  the hash uses, or differing only in the group or in the last byte, are told
  apart.

* Probe sequence: linear, ``home, home + 1, ...`` modulo capacity. A probe for
  key ``K`` stops with a hit at the slot whose column 0 equals K's group id and
  whose words equal K's words, and with a miss at the first EMPTY slot.
  TOMBSTONE and BUSY slots are passed over. There is always an EMPTY slot:
  KeyIndex keeps ``live + tombstones <= max_load * capacity`` with
  ``max_load <= 0.95``.

* Inserts only ever claim EMPTY slots (never tombstones), so a key sits at the
  first EMPTY-at-the-time slot of its probe sequence and, while the table is
  not rehashed, a slot never goes back to EMPTY. Rehashing (on growth, or to
  purge tombstones) builds a new tensor: ``index.table`` then names a new
  object, so holders of the old tensor must re-read ``index.table``. A
  fixed-capacity index (``growable=False``) never replaces its tensor: it
  purges tombstones by copying the rebuilt table into the same storage.

* Implementations, one kernel family each, with the same launchers
  (``find``, ``probe``, ``insert``, ``erase``, ``rehash``; see
  :data:`KERNEL_MODULES`): ``kvhit.kernels.hash_index`` (Triton; also the
  device functions ``hash_init``, ``hash_mix``, ``hash_finish``,
  ``slot_hash``, ``find_slots``, ``probe_keys`` the scan kernel calls),
  ``kvhit.kernels.hash_index_numba`` with ``kvhit.kernels.probe_numba``
  (numba, CPU) and ``kvhit.kernels.hash_index_torch`` (torch, any device).
  A KeyIndex binds one of them when it is built.

Memory: the table is the only per-slot state, ``(W + 1) * 8`` bytes per slot,
so ``(W + 1) * 8 / load`` bytes per key.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvhit.coordinator.int_lists import decoder_ready, encode_lists
from kvhit.coordinator.key_index_backends import (
    BACKENDS,
    KERNEL_MODULES,
    hash_kernels,
    resolve_backend,
)
from kvhit.coordinator.key_index_keys import (
    NO_IDS,
    cpu_int64_data,
    host_key_arrays,
    insert_host_forms,
    keys_on_device,
    normalize_keys,
)
from kvhit.coordinator.key_index_state import (
    STATE_VERSION,
    capturing,
    next_pow2,
    refuse_growth_in_capture,
    state_fields,
    table_checksum,
    verify_checksum,
    verify_structure,
)
from kvhit.coordinator.packing import num_words, padding_mask
from kvhit.kernels.checks import (
    check_int,
    check_max_load,
    check_table_tensor,
    resolve_device,
)
from kvhit.kernels.contract import EMPTY, TOMBSTONE
from kvhit.kernels.hash_index_torch import copy_table, new_table

__all__ = [
    "BACKENDS",
    "MAX_CAPACITY",
    "MAX_LOAD_RANGE",
    "CapacityError",
    "KERNEL_MODULES",
    "KeyIndex",
    "ReadOnlyIndexError",
    "hash_kernels",
    "capturing",
    "normalize_keys",
    "refuse_growth_in_capture",
    "resolve_backend",
]


#: Bounds of ``max_load``: below 0.05 a table is mostly air (1e-9 would ask
#: for 43 GB on the first add); above 0.95 linear probing chains explode and
#: an EMPTY slot must always remain.
MAX_LOAD_RANGE = (0.05, 0.95)
#: The most slots a table may have (2**34: 640 GiB at 32-byte keys); growth
#: past it is refused with ValueError instead of attempting the allocation.
MAX_CAPACITY = 1 << 34
# add's inline checks: a dtype compared by identity; the group ids' end.
_NP_INT64 = np.dtype(np.int64)
_GID_END = 1 << 63


class CapacityError(RuntimeError):
    """A fixed-capacity KeyIndex (``growable=False``) was asked to hold more
    keys than its table can; the index is unchanged."""


class ReadOnlyIndexError(TypeError):
    """A mutator was called on a read-only KeyIndex (:meth:`KeyIndex.from_table`)."""


# --------------------------------------------------------------------------
# Arguments: devices and keys
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# KeyIndex
# --------------------------------------------------------------------------


class KeyIndex:
    """Exact hash set of ``(group_id, block_hash)`` keys on one device.

    Args:
        hash_bytes: width of every block hash in bytes (W = ceil(hash_bytes/8)).
        capacity: initial number of slots, rounded up to a power of two (at
            most :data:`MAX_CAPACITY`). The table grows (doubling, with a
            rehash) before ``live + tombstones`` would exceed ``max_load *
            capacity``; no key is ever dropped.
        device: device of the table; all tensor arguments must be there.
        backend: "numba" (CPU), "triton" (CUDA; the CPU only under
            ``TRITON_INTERPRET=1``), "torch" (any device), or "auto": numba on
            the CPU, triton on CUDA, torch on other devices (MPS, XPU). All
            read and write the same table, so any answers for any other.
        max_load: the load factor bound, in :data:`MAX_LOAD_RANGE`.
        growable: False fixes the capacity (see below).
        warm: load or compile the bound kernel family now where it compiles
            ahead (numba), so that the first store or probe of a serving
            process does not pay for it; ``False`` defers it (and the import
            of numba) to the first call.

    Keys are given as in :func:`normalize_keys`. Every public method validates
    all of its arguments before it changes anything: a bad argument raises
    ValueError/TypeError naming it, and the index is then exactly as before.

    **Fixed capacity and CUDA graphs.** With ``growable=False`` (or after
    :meth:`freeze`) the table tensor is never freed, replaced or moved: an add
    that would need more slots raises :class:`CapacityError` (naming the
    capacity and the size needed) and changes nothing, tombstones are purged
    by rebuilding into the same storage, and :meth:`to` to another device is
    refused. That is what a captured CUDA graph holding ``index.table``'s
    pointer needs; size the index first (``capacity=`` or :meth:`reserve`).
    A growable index frees its old table on growth: a graph captured before
    would then read freed memory.

    **Streams and threads.** Lookups and mutations must be ordered on one
    CUDA stream (or synchronized by the caller): a lookup on another stream
    may see a half-inserted batch, and after a growth read a table the caching
    allocator has reused. On the CPU, too, a mutation must not overlap any
    other call on the same index (hold one lock around mutations and lookups,
    as ``bindings/events.EventFollower`` does); :meth:`grown_for` builds the
    slow part of a growth outside that lock, reading the index only.

    **Growth outside a lock.** ``new = index.grown_for(n)`` builds a grown,
    rehashed copy without touching ``index``; ``index.adopt(new)`` swaps it in
    in O(1). See :meth:`grown_for`.

    See the module docstring for the table layout.
    """

    def __init__(
        self,
        hash_bytes: int,
        capacity: int = 1024,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        max_load: float = 0.5,
        growable: bool = True,
        warm: bool = True,
    ) -> None:
        W = num_words(hash_bytes)
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if capacity > MAX_CAPACITY:
            raise ValueError(
                f"capacity must be <= MAX_CAPACITY = 2**34, got {capacity}"
            )
        max_load = check_max_load(max_load, MAX_LOAD_RANGE)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(growable, bool):
            raise TypeError(f"growable must be a bool, got {type(growable).__name__}")
        if not isinstance(warm, bool):
            raise TypeError(f"warm must be a bool, got {type(warm).__name__}")
        dev = resolve_device(device)
        resolve_backend(backend, dev)
        self._init(
            hash_bytes,
            new_table(next_pow2(int(capacity)), W, dev),
            backend,
            max_load,
            growable,
            size=0,
            tombstones=0,
        )
        if warm:
            self.warm_up()

    def warm_up(self) -> None:
        """Load (or compile) the bound kernel family's kernels now where it
        has a ``warm_up`` (numba), and ``from_ints``' list decoder with them;
        see ``warm`` in the class docstring."""
        if self._host:
            self._kernels.warm_up()
            decoder_ready()

    def _init(
        self,
        hash_bytes: int,
        table: torch.Tensor,
        backend: str,
        max_load: float,
        growable: bool,
        size: int | None,
        tombstones: int | None,
        read_only: bool = False,
    ) -> None:
        """Set every attribute (the one place that lists them)."""
        self.hash_bytes = hash_bytes
        self.W = num_words(hash_bytes)
        self.max_load = max_load
        self._backend = backend
        self.table = table
        self._bind(table.device)
        # None for a read-only view over a table whose counts are not known.
        self._size = size
        self._tombstones = tombstones
        self._growable = growable
        self._read_only = read_only
        self._pad = padding_mask(hash_bytes)
        # Bumped by every change of the table's contents or identity, so that
        # adopt() can tell a grown copy built from the current state.
        self._version = 0
        self._grown_from: tuple[int, int] | None = None

    @classmethod
    def from_table(
        cls,
        table: torch.Tensor,
        hash_bytes: int,
        read_only: bool = True,
        backend: str = "auto",
        max_load: float = 0.5,
        growable: bool = True,
    ) -> KeyIndex:
        """A KeyIndex over an existing table tensor, without copying it.

        table: int64 ``[2**k, W + 1]`` honouring the layout contract (module
        docstring), ``W = ceil(hash_bytes / 8)``; it becomes ``index.table``.

        With ``read_only=True`` (the default) only the tensor's metadata is
        checked (no value is read, no host sync: usable inside a custom op or
        a CUDA graph capture); ``contains``/``keys``/``len`` work (``len``
        counts live slots), and every mutator (``add``, ``remove``, ``clear``,
        ``reserve``, ``adopt``, ``to`` another device) raises
        :class:`ReadOnlyIndexError`. With ``read_only=False`` the table is
        read once to count keys and tombstones and check its sentinels, and
        the index then owns it (writes go into this tensor; growth replaces
        it unless ``growable=False``).
        """
        W = num_words(hash_bytes)
        check_table_tensor(table, W, "table", MAX_CAPACITY)
        if not table.is_contiguous():
            raise ValueError("table must be contiguous")
        if not isinstance(read_only, bool):
            raise TypeError(f"read_only must be a bool, got {type(read_only).__name__}")
        if not isinstance(growable, bool):
            raise TypeError(f"growable must be a bool, got {type(growable).__name__}")
        max_load = check_max_load(max_load, MAX_LOAD_RANGE)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        resolve_backend(backend, table.device)
        obj = cls.__new__(cls)
        if read_only:
            obj._init(hash_bytes, table, backend, max_load, False, None, None, True)
            return obj
        col = table[:, 0]
        if bool((col < TOMBSTONE).any()):
            raise ValueError("table holds BUSY or unknown sentinels")
        size = int((col >= 0).sum().item())
        tombs = int((col == TOMBSTONE).sum().item())
        if size + tombs >= table.shape[0]:
            raise ValueError("table has no EMPTY slot")
        obj._init(hash_bytes, table, backend, max_load, growable, size, tombs)
        return obj

    # -- properties ---------------------------------------------------------

    @property
    def table(self) -> torch.Tensor:
        """The table: int64 ``[capacity, W + 1]`` (module docstring)."""
        return self._table

    @table.setter
    def table(self, table: torch.Tensor) -> None:
        self._table = table
        # A numpy view of a host table, made once per table rather than per
        # store (``Tensor.numpy()`` costs about a microsecond), and the load
        # limit of its capacity: the host store path reads only these.
        # The device too: a tensor makes a new torch.device on every read.
        self._device = table.device
        host = self._device.type == "cpu" and not table.requires_grad
        self._np_table = table.numpy() if host else None
        self._cap_limit = self._limit(table.shape[0])
        self._store = None  # add's plan, made again for this table

    def __getstate__(self) -> dict[str, Any]:
        # The numpy view must alias the table: a copy or unpickle rebuilds it.
        state = self.__dict__.copy()
        state.pop("_np_table", None)
        state.pop("_kernels", None)
        state.pop("_store", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.table = state["_table"]

    @property
    def capacity(self) -> int:
        """Number of slots (a power of two)."""
        return self.table.shape[0]

    @property
    def device(self) -> torch.device:
        """Device of the table."""
        return self._device

    @property
    def backend(self) -> str:
        """The backend in use on the current device: "numba", "torch" or
        "triton"."""
        return self._resolved

    def _bind(self, device: torch.device) -> None:
        """Bind the kernel family that runs on ``device`` (at construction
        and when :meth:`to` moves the table)."""
        self._resolved = resolve_backend(self._backend, device)
        self.__dict__.pop("_kernels", None)
        # The numba family stores through numpy views (see add_trusted).
        self._host = self._resolved == "numba"
        self._store = None

    @functools.cached_property
    def _kernels(self) -> ModuleType:
        # The bound family's module, imported on first use rather than when
        # the index is built: an index that is never probed (or one built
        # inside a custom op) does not pay for importing numba or triton.
        return hash_kernels(self._resolved)

    @property
    def growable(self) -> bool:
        """False when the capacity is fixed (see the class docstring)."""
        return self._growable

    @property
    def read_only(self) -> bool:
        """True for a view made by ``from_table(..., read_only=True)``."""
        return self._read_only

    @property
    def tombstones(self) -> int:
        """Number of TOMBSTONE slots (purged by the next rehash)."""
        if self._tombstones is None:
            return int((self.table[:, 0] == TOMBSTONE).sum().item())
        return self._tombstones

    @property
    def load(self) -> float:
        """Live keys per slot."""
        return len(self) / self.capacity

    def __len__(self) -> int:
        if self._size is None:
            return int((self.table[:, 0] >= 0).sum().item())
        return self._size

    def memory_bytes(self) -> int:
        """Bytes held by the table (the index's only device memory)."""
        return self.table.numel() * self.table.element_size()

    def __repr__(self) -> str:
        extra = "" if self._growable else ", growable=False"
        extra += ", read_only=True" if self._read_only else ""
        return (
            f"KeyIndex(hash_bytes={self.hash_bytes}, len={len(self)}, "
            f"capacity={self.capacity}, device={self.device}, "
            f"backend={self.backend!r}, max_load={self.max_load}{extra})"
        )

    # -- argument handling ----------------------------------------------------

    def normalize_keys(
        self, group_ids: Any, hashes: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`normalize_keys` for this index's ``hash_bytes`` and device:
        ``(int64 [N], int64 [N, W])``, contiguous, on ``self.device``."""
        return keys_on_device(group_ids, hashes, self.hash_bytes, self.device)

    def _check_writable(self, what: str) -> None:
        if self._read_only:
            raise ReadOnlyIndexError(
                f"{what}: this KeyIndex is a read-only view over a table "
                "(KeyIndex.from_table(..., read_only=True))"
            )

    # -- kernel calls (the module bound by _bind) --------------------------

    def _insert(self, table: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> int:
        return int(self._kernels.insert(table, self.W, g, h).sum().item())

    # -- sizing ----------------------------------------------------------------

    def _limit(self, capacity: int) -> int:
        return math.floor(self.max_load * capacity)

    def room(self) -> int:
        """How many new keys fit before the next rehash (growth or tombstone
        purge): ``floor(max_load * capacity) - len - tombstones``."""
        if self._size is None or self._tombstones is None:
            return self._limit(self.capacity) - len(self) - self.tombstones
        return self._cap_limit - self._size - self._tombstones

    def has_room_for(self, extra_keys: int) -> bool:
        """Whether ``extra_keys`` new keys can be added without a rehash (no
        growth and no tombstone purge)."""
        extra_keys = check_int(extra_keys, "extra_keys", 0)
        return len(self) + self.tombstones + extra_keys <= self._limit(self.capacity)

    def _capacity_for(self, n_new: int) -> int:
        """Capacity a rehash needs for ``len + n_new`` keys (tombstones purged),
        checked against MAX_CAPACITY and the fixed-capacity mode."""
        need = len(self) + n_new
        cap = self.capacity
        while need > self._limit(cap):
            cap *= 2
            if cap > MAX_CAPACITY:
                raise ValueError(
                    f"{need} keys at max_load={self.max_load} need more than "
                    f"MAX_CAPACITY = {MAX_CAPACITY} slots"
                )
        if cap != self.capacity and not self._growable:
            raise CapacityError(
                f"KeyIndex has fixed capacity {self.capacity} (growable=False, "
                f"at most {self._limit(self.capacity)} keys at max_load="
                f"{self.max_load}); {need} keys need capacity {cap}"
            )
        return cap

    def _distinct(
        self, g: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first occurrence of each key, in batch order: the batch is
        inserted into a scratch table, whose insert reports exactly one row
        per distinct key (several times faster than ``torch.unique(dim=0)``
        on rows)."""
        scratch = new_table(next_pow2(2 * g.shape[0] + 1), self.W, self.device)
        first = self._kernels.insert(scratch, self.W, g, h)
        return g[first].contiguous(), h[first].contiguous()

    def _rebuilt(self, capacity: int) -> torch.Tensor:
        """A new table of ``capacity`` slots holding every live key; the live
        table is only read."""
        table = new_table(capacity, self.W, self.device)
        stored = self._kernels.rehash(self.table, self.W, table)
        if stored != len(self):  # pragma: no cover - would be a bug
            raise RuntimeError(f"rehash stored {stored} keys, expected {len(self)}")
        return table

    def _rehash(self, capacity: int) -> None:
        """Rebuild into ``capacity`` slots, dropping tombstones."""
        table = self._rebuilt(capacity)
        if capacity == self.capacity and not self._growable:
            self.table.copy_(table)  # same storage: captured pointers stay valid
        else:
            self.table = table
        self._tombstones = 0
        self._version += 1

    def reserve(self, extra_keys: int) -> None:
        """Make room now for ``extra_keys`` more new keys, so that adding them
        never rehashes (e.g. before :meth:`freeze`). A no-op when they fit."""
        extra_keys = check_int(extra_keys, "extra_keys", 0)
        self._check_writable("reserve")
        if not self.has_room_for(extra_keys):
            self._rehash(self._capacity_for(extra_keys))

    def freeze(self) -> KeyIndex:
        """Fix the capacity from now on (``growable=False``); returns self."""
        self._check_writable("freeze")
        self._growable = False
        return self

    def grown_for(self, extra_keys: int) -> KeyIndex:
        """A rehashed copy of this index with room for ``extra_keys`` more new
        keys (and tombstones purged); this index is only read.

        The copy has the capacity :meth:`add` would grow to (at least the
        current one) and the same ``hash_bytes``, ``max_load``, backend and
        device. It is an ordinary KeyIndex: the caller may add to it or remove
        from it before :meth:`adopt`. The pattern for a writer that holds a
        lock readers also take::

            if not index.has_room_for(n):
                grown = index.grown_for(n)  # slow: outside the lock
                with lock:
                    index.adopt(grown)      # O(1)
            with lock:
                index.add(...)              # n new keys at most: no rehash

        Raises CapacityError on a fixed-capacity index (its table is never
        replaced), ValueError past MAX_CAPACITY.
        """
        extra_keys = check_int(extra_keys, "extra_keys", 0)
        self._check_writable("grown_for")
        cap = self._capacity_for(extra_keys)
        if not self._growable:
            raise CapacityError(
                f"KeyIndex has fixed capacity {self.capacity} (growable=False): "
                "its table cannot be replaced, so there is nothing to adopt"
            )
        new = KeyIndex.__new__(KeyIndex)
        new._init(
            self.hash_bytes,
            self._rebuilt(cap),
            self._backend,
            self.max_load,
            True,
            len(self),
            0,
        )
        new._grown_from = (id(self), self._version)
        return new

    def adopt(self, grown: KeyIndex) -> None:
        """Swap in the table of ``grown`` (from ``self.grown_for``) in O(1).

        ``grown`` must come from this index's :meth:`grown_for`, with this
        index unchanged since (else ValueError: keys added or removed in
        between would be lost). Afterwards ``self`` holds ``grown``'s table
        and counts (``index.table`` names a new tensor), and ``grown`` becomes
        a read-only view of the old table: the old table is freed when the
        caller drops ``grown``, so a caller holding a lock frees it after
        releasing the lock (freeing a large table takes milliseconds).
        Refused (CapacityError) on a fixed-capacity index.
        """
        if not isinstance(grown, KeyIndex):
            raise TypeError(f"grown must be a KeyIndex, got {type(grown).__name__}")
        self._check_writable("adopt")
        if grown._grown_from != (id(self), self._version):
            raise ValueError(
                "grown: not built by this index's grown_for(), or this index "
                "changed since (its keys would be lost)"
            )
        if grown.hash_bytes != self.hash_bytes or grown.device != self.device:
            raise ValueError("grown: hash_bytes or device differ from this index")
        if not self._growable:
            raise CapacityError(
                f"KeyIndex has fixed capacity {self.capacity} (growable=False): "
                "its table cannot be replaced"
            )
        old = self.table
        self.table = grown.table
        self._size = len(grown)
        self._tombstones = grown.tombstones
        self._version += 1
        grown._init(
            self.hash_bytes, old, self._backend, self.max_load, False, None, None, True
        )

    # -- operations ---------------------------------------------------------

    def add(self, group_ids: Any, hashes: Any) -> int:
        """Insert keys (idempotent); returns the number of keys that were new.

        Raises CapacityError (index unchanged) when a fixed-capacity index
        cannot take the new keys.
        """
        plan = self._store
        if plan is None:
            plan = self._store = self._store_plan()
        if plan:
            # A router's forms checked inline: a store runs on caches the
            # step evicted, where each frame, attribute or tensor call is a
            # cache miss. Other host forms: insert_host_forms; the rest, a
            # refused value or a rehash: the general path (it names them).
            (table, W, pad, limit, insert_at, insert_arrays, refused, _, rows_at,
             int_list_at, not_read) = plan  # fmt: skip
            th, tg = type(hashes), type(group_ids)
            added = None
            if th is torch.Tensor:
                shape = hashes.shape
                n = shape[0] if len(shape) == 2 and shape[1] == W else 0
                if tg is int:
                    gaddr, gconst = 0, group_ids
                    if not 0 <= group_ids < _GID_END:
                        n = 0
                elif (
                    tg is torch.Tensor
                    and group_ids.shape == (n,)
                    and cpu_int64_data(group_ids)
                ):
                    gaddr, gconst = group_ids.data_ptr(), -1
                else:
                    n = 0
                if (
                    n
                    and self._size + self._tombstones + n <= limit
                    and cpu_int64_data(hashes)
                ):
                    added = insert_at(table, gaddr, gconst, hashes.data_ptr(), n, pad)
            elif th is list and tg is int:
                # A router's int hashes for one group (W == 1): msgspec's
                # bytes read and inserted in one compiled call (~0.2 us less
                # than through insert_host_forms, warm). What it does not
                # take (a bad item, too many keys, a padding bit) goes on to
                # insert_host_forms, which converts it or names it.
                room = limit - self._size - self._tombstones
                if (
                    hashes
                    and W == 1
                    and room > 0
                    and type(hashes[0]) is int
                    and 0 <= group_ids < _GID_END
                ):
                    msg = encode_lists([hashes])
                    if msg is not None:
                        got = int_list_at(table, group_ids, msg, pad, room)
                        if got != not_read and got != refused:
                            added = got
            elif th is np.ndarray and tg is int:
                shape = hashes.shape
                n = shape[0] if len(shape) == 2 and shape[1] == W else 0
                if (
                    n
                    and 0 <= group_ids < _GID_END
                    and self._size + self._tombstones + n <= limit
                    and hashes.dtype is _NP_INT64
                    and (flags := hashes.flags).c_contiguous
                ):
                    # The compiled entry's loads assume aligned rows.
                    insert = rows_at if flags.aligned else insert_arrays
                    added = insert(table, NO_IDS, group_ids, hashes, pad)
            if added is None and self._size + self._tombstones < limit:
                added = insert_host_forms(
                    plan, limit - self._size - self._tombstones, group_ids, hashes
                )
            if added is not None:
                if added >= 0:
                    self._size += added
                    if added:
                        self._version += 1
                    return added
                if added != refused:
                    return self._counted(added)
        g, h = self.normalize_keys(group_ids, hashes)
        return self.add_trusted(g, h)

    def _store_plan(self) -> tuple[Any, ...]:
        """What :meth:`add`'s host path reads, in one tuple (the table's numpy
        view, W, pad, load limit, the numba ``insert_checked_at``,
        ``insert_checked``, ``REFUSED``, ``hash_bytes``, ``insert_entry()``,
        ``int_list_entry()``, ``NOT_READ``), or ``()`` for an index with no
        such path; made at the first add after the table or binding changes."""
        if not (self._host and self._np_table is not None and not self._read_only):
            return ()
        k = self._kernels
        return (self._np_table, self.W, self._pad, self._cap_limit,
                k.insert_checked_at, k.insert_checked, k.REFUSED, self.hash_bytes,
                k.insert_entry(), k.int_list_entry(), k.NOT_READ)  # fmt: skip

    def host_keys(
        self, group_ids: Any, hashes: Any
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The keys as numpy views (int64 ``[N]``, int64 ``[N, W]``,
        C-contiguous) for the fleet's host store path when they come in a
        form that needs no conversion and pass every check
        :func:`normalize_keys` makes (``key_index_keys.host_key_arrays``),
        else None (the caller's general path converts or names them)."""
        return host_key_arrays(group_ids, hashes, self.hash_bytes, self.W, self._pad)

    def _counted(self, added: int) -> int:
        """The return of a host insert kernel (``hash_index_numba``'s
        ``insert_checked``): the keys newly stored, counted; ``-1 - r`` (row
        ``r`` found no free slot; the rows before it are stored): the table
        is counted again and RuntimeError raised."""
        if added < 0:
            self._recount()
            raise RuntimeError("insert: the table has no free slot for some keys")
        self._size += added
        if added:
            self._version += 1
        return added

    def _stored(self, insert: Callable[..., int], table: Any, g: Any, h: Any) -> int:
        """``insert(table, g, h)`` (the keys newly stored), counted. A failed
        insert (RuntimeError: the table full; triton: a BUSY wait ran out too)
        stored the batch's other keys, so the table is counted again."""
        try:
            added = insert(table, g, h)
        except RuntimeError:
            self._recount()
            raise
        self.note_stored(added)
        return added

    @property
    def table_view(self) -> np.ndarray | None:
        """The table as a numpy view when it is on the CPU (any backend; made
        once per table tensor), for readers (the numba lookup); else None."""
        return self._np_table

    @property
    def host_table(self) -> np.ndarray | None:
        """The table as a numpy view when the numba family stores into it on
        the host (a writable CPU table), else None."""
        if self._host and not self._read_only:
            return self._np_table
        return None

    def note_stored(self, n: int) -> None:
        """Count ``n`` keys a caller's kernel stored into :attr:`host_table`
        (the fleet's fused store, which leaves room first)."""
        self._size += n
        if n:
            self._version += 1

    def _recount(self) -> None:
        """Count the table again after a failed insert stored part of a batch,
        so that len() and the tombstones match it."""
        col = self.table[:, 0]
        self._size = int((col >= 0).sum().item())
        self._tombstones = int((col == TOMBSTONE).sum().item())
        self._version += 1

    def add_trusted(
        self,
        group_ids: torch.Tensor | np.ndarray | int,
        hashes: torch.Tensor | np.ndarray,
    ) -> int:
        """:meth:`add` with **no key validation**, for keys kvhit built
        itself in the normalized form (``group_ids`` int64 ``[N]`` >= 0, or
        one int >= 0 for every key, ``hashes`` int64 ``[N, W]`` with zero
        padding bits, both contiguous on this index's device; on the CPU
        numpy arrays too), e.g. a store refresh's present keys or a KV
        event's (``bindings/kv_events.py``)."""
        g, h = group_ids, hashes
        if self._read_only:
            self._check_writable("add")
        n = h.shape[0]
        if n == 0:
            return 0
        if (
            self._host
            and self._np_table is not None
            and self._size + self._tombstones + n <= self._cap_limit
        ):
            # The numba family on the host table, no tensor made: one kernel
            # call (a batch that may need a rehash takes the general path).
            if type(h) is not np.ndarray:
                h = h.numpy()
            gconst = -1
            if type(g) is int:
                g, gconst = NO_IDS, g
            elif type(g) is not np.ndarray:
                g = g.numpy()
            return self._counted(
                self._kernels.insert_checked(self._np_table, g, gconst, h, 0)
            )
        if type(h) is np.ndarray:
            h = torch.from_numpy(h)
        if type(g) is int:
            g = torch.full((n,), g, dtype=torch.int64, device=self.device)
        elif type(g) is np.ndarray:
            g = torch.from_numpy(g)
        if not self.has_room_for(g.shape[0]):
            refuse_growth_in_capture(
                "add",
                g.shape[0],
                self._limit(self.capacity) - len(self) - self.tombstones,
            )
            # The batch may not fit: count exactly how many keys are new
            # (absent and distinct) before deciding to grow, so that re-adding
            # known keys never inflates the table.
            absent = ~self._kernels.probe(self.table, self.W, g, h, trusted=True)
            g, h = g[absent].contiguous(), h[absent].contiguous()
            if g.shape[0] == 0:
                return 0
            g, h = self._distinct(g, h)
            if not self.has_room_for(g.shape[0]):
                self._rehash(self._capacity_for(g.shape[0]))
        return self._stored(self._insert, self.table, g, h)

    def remove(self, group_ids: Any, hashes: Any) -> int:
        """Remove keys (absent keys are ignored); returns the number removed."""
        g, h = self.normalize_keys(group_ids, hashes)
        return self.remove_trusted(g, h)

    def remove_trusted(
        self, group_ids: torch.Tensor | np.ndarray, hashes: torch.Tensor | np.ndarray
    ) -> int:
        """:meth:`remove` with **no key validation**, for keys kvhit built
        itself in the normalized form (as :meth:`add_trusted`, numpy arrays
        too on the CPU), e.g. a store sync's evicted keys."""
        self._check_writable("remove")
        if group_ids.shape[0] == 0:
            return 0
        if type(group_ids) is np.ndarray:
            group_ids, hashes = torch.from_numpy(group_ids), torch.from_numpy(hashes)
        erased = self._kernels.erase(
            self.table, self.W, group_ids, hashes, trusted=True
        )
        removed = int(erased.sum().item())
        self._size -= removed
        self._tombstones += removed
        if removed:
            self._version += 1
        return removed

    def contains(self, group_ids: Any, hashes: Any) -> torch.Tensor:
        """Membership of keys: bool ``[N]`` on the index's device."""
        g, h = self.normalize_keys(group_ids, hashes)
        return self.contains_trusted(g, h)

    def contains_trusted(
        self, group_ids: torch.Tensor, hashes: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`contains` with **no key validation**, for keys kvhit built
        itself in the normalized form (as :meth:`add_trusted`): bool ``[N]``."""
        if group_ids.shape[0] == 0:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        return self._kernels.probe(self.table, self.W, group_ids, hashes, trusted=True)

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
        """Remove every key; the capacity (and the table's storage) is kept."""
        self._check_writable("clear")
        # On the CPU numpy fills on this thread: torch's fill of a table past
        # its intra-op grain wakes the thread pool (16K slots: 5 ms median
        # against 67 us on a loaded 2-core host).
        table = self.table
        if table.device.type == "cpu":
            table = table.numpy()
            table.fill(0)
        else:
            table.zero_()
        table[:, 0] = EMPTY
        self._size = 0
        self._tombstones = 0
        self._version += 1

    def to(self, device: torch.device | str) -> KeyIndex:
        """Move the table to ``device`` in place (like ``nn.Module.to``);
        returns ``self``. With backend "auto" the backend follows the device.
        Refused for a fixed-capacity or read-only index unless ``device`` is
        the current one (its table must not move)."""
        dev = resolve_device(device)
        if dev == self.device:
            return self
        self._check_writable("to")
        if not self._growable:
            raise CapacityError(
                f"KeyIndex has a fixed table (growable=False): cannot move it "
                f"from {self.device} to {dev}"
            )
        self._bind(dev)
        self.table = copy_table(self.table, dev)
        self._version += 1
        return self

    # -- persistence ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The index as plain data; ``table`` is the live tensor, not a copy.

        ``checksum`` (blake2b of the table bytes, ``hash_bytes`` and the
        counts; ``max_load`` is a policy and is not signed) lets
        :meth:`from_state_dict` refuse a corrupted dict. Computing it reads
        the whole table once (about 0.3 s per 100 MB of table on one core; a
        CUDA table is copied to the host for it).
        """
        size, tombs = len(self), self.tombstones
        return {
            "version": STATE_VERSION,
            "hash_bytes": self.hash_bytes,
            "max_load": self.max_load,
            "size": size,
            "tombstones": tombs,
            "table": self.table,
            "checksum": table_checksum(self.table, self.hash_bytes, size, tombs),
        }

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, Any],
        device: torch.device | str | None = None,
        backend: str = "auto",
        growable: bool = True,
    ) -> KeyIndex:
        """Rebuild an index from :meth:`state_dict` output (the table is copied).

        Verified before anything is built: the checksum, then the table's
        structure (shape, dtype, power-of-two capacity, no BUSY or unknown
        sentinel, zero words in EMPTY slots and in padding bits, counts equal
        to ``size``/``tombstones``, an EMPTY slot left) and every live key
        reachable from its home slot along its probe sequence, once (so a
        table written with another hash function, with a key moved or
        duplicated, is refused). Any failure raises ValueError/TypeError.
        A state saved with a higher ``max_load`` is rehashed to this one.
        """
        hash_bytes, max_load, size, tombs, table, cap = state_fields(
            state, MAX_LOAD_RANGE, MAX_CAPACITY
        )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(growable, bool):
            raise TypeError(f"growable must be a bool, got {type(growable).__name__}")
        dev = resolve_device(device if device is not None else table.device)
        resolve_backend(backend, dev)
        verify_checksum(state, table, hash_bytes, size, tombs)
        table = copy_table(table, dev)
        obj = cls.__new__(cls)
        obj._init(hash_bytes, table, backend, max_load, growable, size, tombs)
        verify_structure(obj.table, hash_bytes, obj._kernels.find, size, tombs)
        if size + tombs > obj._limit(cap):
            # Saved with a higher max_load; restore the invariant.
            obj._rehash(obj._capacity_for(0))
        return obj
