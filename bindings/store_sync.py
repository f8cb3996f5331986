"""The index sync: a KeyIndex kept in step with a Mooncake store, one existence
RPC per scheduler step (the key format and the store call: ``mooncake_store``).

vLLM 0.33.0's Mooncake store worker answers ``lookup(num_tokens, block_hashes)``
one request at a time: it builds the store keys of the ``(group, hash)`` pairs
its lookup masks can probe, expands each over the group's rank namespaces, asks
``store.batch_is_exist`` once *per request*, and runs the hit rule over the
pairs present under every namespace.

Here the same keys are collected for a whole batch, deduplicated across
requests (requests sharing a prefix share keys), asked in **one**
``batch_is_exist`` call, and written into a :class:`KeyIndex` (present keys
added, absent keys removed); the batched :class:`LookupEngine` then resolves
every request against the index. After a refresh the index agrees with the
store on every key the worker rule can read for that batch, so the hits equal
the worker's (``ReferenceCoordinator.lookup`` over the store's key set).

Error contract: a failed existence call -- an exception from the store, a
negative status for any key, an answer of the wrong length or type -- raises
:class:`StoreError` and leaves the index untouched. It is never turned into a
hit. ``BatchedLookup.lookup`` propagates it; ``BatchedLookup.lookup_one``
(the drop-in for the worker's ``lookup``) returns 0 like vLLM's worker does,
and keeps the error in ``last_error``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhit.bindings.mooncake_store import (
    DEFAULT_TIMEOUT_S,
    ExistenceStore,
    MooncakeKeys,
    StoreCallPool,
    StoreError,
    check_answer,
)
from kvhit.coordinator.candidates import (
    first_occurrences,
    format_keys,
    host_worker_candidates,
)
from kvhit.coordinator.packing import HashBatch
from kvhit.coordinator.plan import ScanPlan
from kvhit.coordinator.specs import CacheLayout

__all__ = [
    "DEFAULT_FORGET_AFTER",
    "SERIAL_CLEAR_SLOTS",
    "BatchedLookup",
    "RefreshStats",
    "StoreSync",
    "TailKeyLookup",
    "candidate_rows",
    "compiled_candidates",
    "tail_key_boundaries",
]

#: Refreshes after which a key no refresh asked about is dropped from the index.
DEFAULT_FORGET_AFTER = 64
#: Slots up to which an exclusive index is cleared each refresh rather than
#: having last step's keys removed: the fill stays under torch's intra-op
#: grain (32,768 elements with up to 7 int64 columns), so it runs on the
#: calling thread in ~5-7 us, against ~12 us to remove 50 keys.
SERIAL_CLEAR_SLOTS = 4096


# -- candidates --------------------------------------------------------------------


def candidate_rows(
    layout: CacheLayout,
    offsets: torch.Tensor | Sequence[int],
    num_tokens: torch.Tensor | Sequence[int],
    plan: ScanPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys the store worker asks for each request, as rows of a batch.

    The worker's loop over lookup masks (or over every hash unit with partial
    hash hits), for a whole batch at once, on the CPU: the numba twin of
    :func:`~kvhit.coordinator.candidates.worker_candidates`.

    Args:
        layout: the cache layout.
        offsets: CSR offsets of the batch, int64 ``[B + 1]``.
        num_tokens: prompt length per request, ``[B]``.
        plan: ``ScanPlan.from_layout(layout)``, to reuse across steps.

    Returns:
        ``(group_ids, rows, request)``, each int64 ``[K]`` on the CPU:
        layout group, row into ``batch.hashes``, and the request it came from;
        duplicates across requests are kept.
    """
    plan = plan or ScanPlan.from_layout(layout)
    offs = torch.as_tensor(offsets, dtype=torch.int64).cpu()
    ntok = torch.as_tensor(num_tokens, dtype=torch.int64).cpu()
    compiled = compiled_candidates(plan, offs.numpy(), ntok.numpy())
    return tuple(torch.from_numpy(a) for a in compiled)  # type: ignore[return-value]


def compiled_candidates(
    plan: ScanPlan, offsets: np.ndarray, num_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`candidate_rows` on numpy arrays through the numba kernel
    (``kernels/candidates_numba.py``, mirroring ``worker_candidates``):
    ``(group_ids, rows, request)`` int64 ``[K]``.
    ``offsets`` int64 ``[B + 1]``, ``num_tokens`` int64 ``[B]`` (>= 0)."""
    return host_worker_candidates(plan, offsets, num_tokens)


# -- refresh ---------------------------------------------------------------------


@dataclass(frozen=True)
class RefreshStats:
    """What one :meth:`StoreSync.refresh` did.

    Attributes:
        num_requests: requests in the batch.
        num_candidates: ``(group, hash)`` pairs the worker rule probes, summed
            over requests (duplicates across requests kept).
        num_unique: distinct pairs among them.
        num_keys_asked: key strings in the single ``batch_is_exist`` call
            (distinct pairs x their group's namespaces).
        num_per_request_keys: keys vLLM's per-request path would ask for the
            same batch (``num_candidates`` x namespaces, one RPC per request).
        num_present: distinct pairs present under every namespace.
        num_added: keys newly added to the index.
        num_removed: keys removed from the index.
        num_rpcs: existence calls made (0 when there was nothing to ask, else 1).
        rpc_seconds: wall time of the existence call.
        total_seconds: wall time of the whole refresh.
    """

    num_requests: int
    num_candidates: int
    num_unique: int
    num_keys_asked: int
    num_per_request_keys: int
    num_present: int
    num_added: int
    num_removed: int
    num_rpcs: int
    rpc_seconds: float
    total_seconds: float


def _as_num_tokens(num_tokens: Any, batch: HashBatch) -> torch.Tensor:
    """``num_tokens`` as int64 ``[B]`` on the CPU, validated."""
    if isinstance(num_tokens, int) and not isinstance(num_tokens, bool):
        raise TypeError("num_tokens must have one entry per request, not an int")
    try:
        t = torch.as_tensor(num_tokens).cpu()
    except (TypeError, RuntimeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"num_tokens must be a sequence of ints or an int64 tensor, got "
            f"{type(num_tokens).__name__} ({exc})"
        ) from None
    if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
        raise TypeError(f"num_tokens must be integers, got {t.dtype}")
    t = t.to(torch.int64)
    if t.dim() != 1 or t.shape[0] != len(batch):
        raise ValueError(
            f"num_tokens must have shape [{len(batch)}] (one per request), "
            f"got {list(t.shape)}"
        )
    if t.shape[0] and bool((t < 0).any()):
        raise ValueError("num_tokens must be >= 0")
    return t


class StoreSync:
    """Keeps a :class:`KeyIndex` in step with a Mooncake store for a batch.

    Args:
        store: anything with ``batch_is_exist(list[str]) -> list[int]``
            (1 present, 0 absent, negative: error), e.g.
            ``mooncake.store.MooncakeDistributedStore``.
        keys: the key format and each group's namespaces.
        index: the ``KeyIndex`` to update (its ``hash_bytes`` fixes the width
            every batch must have).
        layout: the cache layout whose worker rule picks the keys.
        timeout_s: seconds one ``batch_is_exist`` may take (run on ``pool``);
            past it the refresh raises :class:`StoreError`, leaves the index
            unchanged and discards the late answer. ``None``: no limit (the
            call runs in the caller's thread).
        forget_after: a key that no refresh asked about during the last
            ``forget_after`` refreshes is dropped from the index (checked every
            ``forget_after`` refreshes), so a long-running index holds about
            ``2 * forget_after`` steps' keys at most. The hit rule reads only
            keys the current refresh asked about, so dropping never changes a
            hit. ``None``: never drop (for an index also fed by KV events).
        exclusive: the index belongs to this StoreSync alone (nothing else
            reads or feeds it): each refresh rewrites it with exactly the
            present keys it asked about (``num_added`` / ``num_removed`` then
            count the keys written and dropped by the rewrite). Faster, and
            the index never holds more than one step's keys; ``forget_after``
            is then moot.
        plan: ``ScanPlan.from_layout(layout)`` when the caller has one (a
            :class:`BatchedLookup` shares its engine's), else built here.
        pool: the :class:`StoreCallPool` the calls run on (shared by the
            lookups of one store, e.g. one per hash width); a pool of
            ``DEFAULT_POOL_SIZE`` of its own when None. Unused without
            ``timeout_s``.

    Raises:
        ValueError: ``keys`` does not describe exactly the layout's groups, or
            a prefix-cacheable group has no namespace or no key group id, or
            ``timeout_s`` / ``forget_after`` is not positive.
    """

    def __init__(
        self,
        store: ExistenceStore,
        keys: MooncakeKeys,
        index: Any,
        layout: CacheLayout,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        forget_after: int | None = DEFAULT_FORGET_AFTER,
        exclusive: bool = False,
        plan: ScanPlan | None = None,
        pool: StoreCallPool | None = None,
    ) -> None:
        if not callable(getattr(store, "batch_is_exist", None)):
            raise TypeError("store must have a batch_is_exist(list[str]) method")
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
                raise TypeError(
                    f"timeout_s must be a number or None, got {timeout_s!r}"
                )
            if not timeout_s > 0 or timeout_s != timeout_s or timeout_s == float("inf"):
                raise ValueError(f"timeout_s must be > 0 and finite, got {timeout_s!r}")
        if forget_after is not None and (
            isinstance(forget_after, bool)
            or not isinstance(forget_after, int)
            or forget_after <= 0
        ):
            raise ValueError(
                f"forget_after must be a positive int or None, got {forget_after!r}"
            )
        if keys.num_groups != layout.num_groups:
            raise ValueError(
                f"keys has rank namespaces for {keys.num_groups} groups, the "
                f"layout has {layout.num_groups} groups"
            )
        seen: dict[int, int] = {}
        for g, grp in enumerate(layout.groups):
            if not grp.prefix_cacheable:
                continue
            kg = keys.key_group_ids[g]  # type: ignore[index]
            if kg is None:
                raise ValueError(
                    f"group {g} is prefix cacheable but has no key group id"
                )
            if kg in seen:
                raise ValueError(
                    f"groups {seen[kg]} and {g} share the key group id {kg}"
                )
            seen[kg] = g
            if not keys.rank_namespaces[g]:
                raise ValueError(
                    f"group {g} is prefix cacheable but has no rank namespace"
                )
        self.store = store
        self.keys = keys
        self.index = index
        self.layout = layout
        self.hash_bytes: int = index.hash_bytes
        if pool is not None and not isinstance(pool, StoreCallPool):
            raise TypeError(f"pool must be a StoreCallPool, got {type(pool).__name__}")
        self.pool: StoreCallPool = pool if pool is not None else StoreCallPool()
        if plan is not None and not isinstance(plan, ScanPlan):
            raise TypeError(f"plan must be a ScanPlan, got {type(plan).__name__}")
        self._plan = plan if plan is not None else ScanPlan.from_layout(layout)
        self._num_ns = np.array([len(ns) for ns in keys.rank_namespaces], np.int64)
        # The key prefixes as bytes for the numba key writer.
        heads = [
            f"{p}@".encode() for g in range(keys.num_groups) for p in keys.prefixes(g)
        ]
        group_pref = np.zeros(keys.num_groups + 1, dtype=np.int64)
        np.cumsum([len(keys.prefixes(g)) for g in range(keys.num_groups)],
                  out=group_pref[1:])  # fmt: skip
        pref_offs = np.zeros(len(heads) + 1, dtype=np.int64)
        np.cumsum([len(h) for h in heads], out=pref_offs[1:])
        self._key_bytes = (
            np.frombuffer(b"".join(heads) or b"\0", dtype=np.uint8).copy(),
            pref_offs,
            group_pref,
        )
        # A prefix holding a newline (the writer's separator) is cut by key
        # lengths instead of split: per group, each namespace's key length.
        self._key_lens: list[np.ndarray] | None = (
            [
                np.array(
                    [len(f"{p}@") + 2 * self.hash_bytes + 1 for p in keys.prefixes(g)],
                    dtype=np.int64,
                )
                for g in range(keys.num_groups)
            ]
            if any(b"\n" in h for h in heads)
            else None
        )
        self.timeout_s: float | None = None if timeout_s is None else float(timeout_s)
        self.forget_after: int | None = forget_after
        self.exclusive = bool(exclusive)
        # The distinct (group, hash words) each recent refresh asked about.
        self._recent: deque[tuple[np.ndarray, np.ndarray]] = deque(
            maxlen=forget_after or 1
        )
        self._refreshes = 0
        # ``(group_ids, rows)`` int64 [K] of the last successful refresh's
        # candidates, kept as the kernel wrote them (numpy).
        self._last_cand: tuple[np.ndarray, np.ndarray] | None = None
        self.num_forgotten = 0
        # The keys the last exclusive refresh wrote (what the index holds).
        self._written: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def last_candidates(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(group_ids, rows)``, int64 ``[K]`` on the CPU: the last
        successful refresh's candidates (see :meth:`candidates`), or None."""
        if self._last_cand is None:
            return None
        return tuple(torch.from_numpy(a) for a in self._last_cand)  # type: ignore[return-value]

    def _check_batch(self, batch: HashBatch) -> None:
        if not isinstance(batch, HashBatch):
            raise TypeError(f"batch must be a HashBatch, got {type(batch).__name__}")
        if batch.hash_bytes != self.hash_bytes:
            raise ValueError(
                f"batch has hash_bytes={batch.hash_bytes}, the index holds "
                f"hash_bytes={self.hash_bytes}"
            )

    def candidates(
        self, batch: HashBatch, num_tokens: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(group, hash)`` pairs the worker rule probes for ``batch``:
        ``(group_ids, rows)``, int64 ``[K]`` on the CPU, ``rows`` indexing
        ``batch.hashes``; duplicates across requests kept."""
        self._check_batch(batch)
        nt = _as_num_tokens(num_tokens, batch)
        gids, rows, _ = candidate_rows(self.layout, batch.offsets, nt, self._plan)
        return gids, rows

    def refresh(self, batch: HashBatch, num_tokens: Any) -> RefreshStats:
        """Ask the store about every key ``batch`` can probe, in one call, and
        make the index agree with the answer on those keys.

        Args:
            batch: the requests' hashes; ``hash_bytes`` must match the index.
            num_tokens: prompt length per request, ``[B]`` (ints or a tensor).

        Raises:
            StoreError: the existence call failed (index unchanged).
            ValueError, TypeError: bad arguments (index unchanged).
        """
        self._last_cand = None
        self._check_batch(batch)
        return self.refresh_unchecked(batch, _as_num_tokens(num_tokens, batch))

    def refresh_unchecked(
        self, batch: HashBatch, num_tokens: torch.Tensor
    ) -> RefreshStats:
        """:meth:`refresh` with **no argument checks**, for inputs kvhit built
        and checked itself: ``batch`` of this index's ``hash_bytes``,
        ``num_tokens`` int64 ``[B]`` >= 0 on the CPU.

        Raises:
            StoreError: the existence call failed (index unchanged).
        """
        t0 = time.perf_counter()
        self._last_cand = None
        offs = batch.offsets.cpu().numpy()
        g_all, r_all, _ = compiled_candidates(self._plan, offs, num_tokens.numpy())
        num_candidates = int(g_all.shape[0])
        if num_candidates == 0:
            self._last_cand = (g_all, r_all)
            return RefreshStats(
                len(batch), 0, 0, 0, 0, 0, 0, 0, 0, 0.0, time.perf_counter() - t0
            )
        num_per_request = int(
            np.bincount(g_all, minlength=self.layout.num_groups) @ self._num_ns
        )
        # Dedup on the CPU: the key strings are built there anyway.
        words = batch.hashes.cpu().numpy()
        # First occurrences, in candidate (group-major) order.
        first = first_occurrences(g_all, r_all, words)
        u_g, u_h = g_all[first], words[r_all[first]]
        bounds = np.searchsorted(u_g, np.arange(self.layout.num_groups + 1))
        # Within a pair, namespaces in rank_namespaces order (as vLLM lays
        # them out).
        key_list = self._key_list(u_g, u_h, bounds)
        n_keys = len(key_list)

        t_rpc = time.perf_counter()
        answer = self._call_store(key_list)
        rpc_seconds = time.perf_counter() - t_rpc
        codes = check_answer(answer, n_keys)

        # A pair is present only when every namespace of its group has it.
        present_np = np.zeros(len(u_g), dtype=bool)
        pos = 0
        for g in range(self.layout.num_groups):
            lo, hi = int(bounds[g]), int(bounds[g + 1])
            k = int(self._num_ns[g]) * (hi - lo)
            if k:
                block = codes[pos : pos + k].reshape(hi - lo, -1)
                present_np[lo:hi] = (block == 1).all(1)
            pos += k
        dev = self.index.device
        if self.exclusive:
            # The hit rule reads only this step's asked keys: rewriting the
            # index with the present ones (one add into a cleared table) is
            # ~4x cheaper than probing every asked key (dsv4-flash, 1024
            # requests: 43 ms vs 173 ms + the changes), and bounds it.
            removed = len(self.index)
            prev = self._written
            if self.index.capacity <= SERIAL_CLEAR_SLOTS:
                # A small table: clearing it is one short memset on this
                # thread, cheaper than removing even a few keys.
                self.index.clear()
            elif (
                prev is not None
                and removed == prev[0].shape[0]
                and 4 * (removed + self.index.tombstones) <= self.index.capacity
            ):
                # Few keys in a large table: removing last step's keys costs
                # what they number, clearing costs the table. The
                # tombstones left are purged by the next clear.
                if removed:
                    self.index.remove_trusted(*prev)
            else:
                self.index.clear()
            # The present keys picked in numpy: a torch mask over a large
            # step's keys would wake the intra-op thread pool.
            put_g = torch.from_numpy(u_g[present_np]).to(dev)
            put_h = torch.from_numpy(u_h[present_np]).to(dev)
            # Keys this refresh built from a checked batch: no second check.
            added = self.index.add_trusted(put_g, put_h) if put_g.shape[0] else 0
            self._written = (put_g, put_h)
        else:
            # One probe, then touch only what changed: in a steady state most
            # answers agree with the index already.
            # Keys this refresh built itself: the trusted probe and removal.
            tg = torch.from_numpy(u_g).to(dev)
            th = torch.from_numpy(np.ascontiguousarray(u_h)).to(dev)
            keep = torch.from_numpy(present_np).to(dev)
            inside = self.index.contains_trusted(tg, th)
            new, stale = keep & ~inside, ~keep & inside
            added = self.index.add_trusted(tg[new], th[new]) if bool(new.any()) else 0
            removed = (
                self.index.remove_trusted(tg[stale], th[stale])
                if bool(stale.any())
                else 0
            )
            self._remember(u_g, u_h)
        self._last_cand = (g_all, r_all)
        return RefreshStats(
            num_requests=len(batch),
            num_candidates=num_candidates,
            num_unique=len(u_g),
            num_keys_asked=n_keys,
            num_per_request_keys=num_per_request,
            num_present=int(present_np.sum()),
            num_added=int(added),
            num_removed=int(removed),
            num_rpcs=1,
            rpc_seconds=rpc_seconds,
            total_seconds=time.perf_counter() - t0,
        )

    def _key_list(
        self, u_g: np.ndarray, u_h: np.ndarray, bounds: np.ndarray
    ) -> list[str]:
        """Every key string of the distinct pairs ``(u_g, u_h)`` (sorted by
        group, ``bounds`` their group bounds): pair-major, namespaces in
        ``rank_namespaces`` order."""
        blob = format_keys(u_h, u_g, self.hash_bytes, *self._key_bytes)
        # One str and one split for all keys: one object per key.
        text = str(memoryview(blob), "utf-8")
        if self._key_lens is None:
            return text.split("\n") if text else []
        # A prefix holds the separator: cut at the keys' known lengths.
        lens = np.concatenate(
            [
                np.tile(self._key_lens[g], int(bounds[g + 1] - bounds[g]))
                for g in range(self.layout.num_groups)
            ]
            or [np.zeros(0, np.int64)]
        )
        ends = np.cumsum(lens).tolist()
        return [text[e - n : e - 1] for e, n in zip(ends, lens.tolist(), strict=True)]

    def _call_store(self, key_list: list[str]) -> Any:
        """``store.batch_is_exist(key_list)``, bounded by ``timeout_s``.

        With a timeout the call runs on :attr:`pool`: a call past its
        deadline is abandoned (StoreError here, its late answer discarded),
        and the next refresh asks the store on another slot at once; only
        when every slot holds a stuck call does a refresh raise StoreBusy
        without asking.
        """
        if self.timeout_s is None:
            try:
                return self.store.batch_is_exist(key_list)
            except Exception as exc:
                raise StoreError(
                    f"batch_is_exist failed for {len(key_list)} keys: {exc!r}",
                    len(key_list),
                ) from exc
        return self.pool.call(self.store.batch_is_exist, key_list, self.timeout_s)

    def _remember(self, u_g: np.ndarray, u_h: np.ndarray) -> None:
        """Note what this refresh asked; every ``forget_after`` refreshes drop
        the index's keys that none of the last ``forget_after`` asked about."""
        if self.forget_after is None:
            return
        self._recent.append((u_g, u_h))
        self._refreshes += 1
        if self._refreshes % self.forget_after:
            return
        from kvhit.coordinator.key_index import KeyIndex

        kg, kh = self.index.keys()
        if kg.shape[0] == 0:
            return
        g = np.concatenate([r[0] for r in self._recent])
        h = np.concatenate([r[1] for r in self._recent])
        # Repeats across refreshes are fine: an insert is idempotent.
        seen = KeyIndex(self.hash_bytes, max(16, 2 * len(g)), "cpu")
        seen.add_trusted(torch.from_numpy(g), torch.from_numpy(np.ascontiguousarray(h)))
        kg_c, kh_c = kg.cpu(), kh.cpu()
        idle = ~seen.contains_trusted(kg_c, kh_c)
        if bool(idle.any()):
            dev = self.index.device
            self.num_forgotten += self.index.remove_trusted(
                kg_c[idle].to(dev), kh_c[idle].to(dev)
            )


# -- tail key boundaries ----------------------------------------------------------


@dataclass(frozen=True)
class TailKeyLookup:
    """What the store worker's ``lookup`` returns, for a whole batch.

    Attributes:
        hit_lengths: int64 ``[B]``, tokens of each prompt to load
            (``MooncakeLookupResult.hit_length``).
        tail_key_boundaries: int64 ``[B, G]`` (``G`` = layout groups): per
            request and group, the token boundary whose block hash keys the
            group's last hit block (``TailKeyBoundary.num_tokens``). 0 where
            the hit is 0 or the group is not prefix cacheable (vLLM lists no
            boundary then); -1 where no asked, present key was found in the
            hit's block (vLLM's worker asserts there).
    """

    hit_lengths: torch.Tensor
    tail_key_boundaries: torch.Tensor

    def boundaries(self, i: int) -> tuple[tuple[int, int], ...]:
        """Request ``i``'s ``(group, num_tokens)`` pairs, in group order, as
        vLLM's ``_tail_key_boundaries`` lists them (one per prefix-cacheable
        group when the hit is > 0, none otherwise); -1 marks a group whose
        tail key was not found."""
        if int(self.hit_lengths[i]) <= 0:
            return ()
        row = self.tail_key_boundaries[i].tolist()
        return tuple((g, b) for g, b in enumerate(row) if b != 0)


def tail_key_boundaries(
    layout: CacheLayout,
    batch: HashBatch,
    hit_lengths: torch.Tensor | Sequence[int],
    index: Any,
    candidates: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """vLLM's ``MooncakeStoreWorker._tail_key_boundaries`` for a batch.

    For each request with a hit and each prefix-cacheable group, the boundary
    is the hit itself when the key of hash ``hit // hash_block_size - 1`` is
    present; with partial hash hits the hit may end inside the group's block,
    whose key is then the first present hash after it, up to the block's end
    (clipped to the request's hashes). "Present" means: in ``index`` *and*
    asked by this request (``candidates``), exactly the worker's
    ``exists_set`` (a (group, hash) value this request asked, at any of its
    positions); a key only another request of the batch asked is not seen.

    Args:
        layout: the cache layout.
        batch: ``B`` requests' hashes.
        hit_lengths: int64 ``[B]``, the worker rule's hits for ``batch``.
        index: a ``KeyIndex`` that agrees with the store on the candidates.
        candidates: ``(group_ids, rows)``, int64 ``[K]``: the keys the worker
            asks for ``batch`` (``LookupEngine.lookup_candidates`` or
            :func:`candidate_rows`), rows indexing ``batch.hashes``.

    Returns:
        int64 ``[B, G]`` on the CPU, as in :class:`TailKeyLookup`.

    Raises:
        ValueError: ``hit_lengths`` of the wrong shape, negative, or past a
            request's hashes.
    """
    B, hbs = len(batch), layout.hash_block_size
    hits = torch.as_tensor(hit_lengths).cpu()
    if hits.is_floating_point() or hits.dtype == torch.bool:
        raise TypeError(f"hit_lengths must be integers, got {hits.dtype}")
    hits = hits.to(torch.int64)
    if hits.shape != (B,):
        raise ValueError(f"hit_lengths must have shape [{B}], got {list(hits.shape)}")
    offs = batch.offsets.cpu().numpy()
    lens = offs[1:] - offs[:-1]
    h_np = hits.numpy()
    if B and bool((h_np < 0).any()):
        raise ValueError("hit_lengths must be >= 0")
    last = h_np // hbs - 1
    if B and bool(((h_np > 0) & ((last < 0) | (last >= lens))).any()):
        bad = int(np.nonzero((h_np > 0) & ((last < 0) | (last >= lens)))[0][0])
        raise ValueError(
            f"hit_lengths[{bad}] = {int(h_np[bad])} does not end on a hash of "
            f"request {bad} ({int(lens[bad])} hashes of {hbs} tokens)"
        )
    cg, cr = (t.cpu().numpy() for t in candidates)
    return torch.from_numpy(_tail_boundaries(layout, batch, h_np, index, cg, cr))


def _tail_boundaries(
    layout: CacheLayout,
    batch: HashBatch,
    h_np: np.ndarray,
    index: Any,
    cg: np.ndarray,
    cr: np.ndarray,
) -> np.ndarray:
    """:func:`tail_key_boundaries` on checked input: ``h_np`` int64 ``[B]``
    (the engine's hits), ``(cg, cr)`` the refresh's candidates as numpy."""
    B, G, hbs = len(batch), layout.num_groups, layout.hash_block_size
    offs = batch.offsets.cpu().numpy()
    lens = offs[1:] - offs[:-1]
    last = h_np // hbs - 1
    out = np.zeros((B, G), dtype=np.int64)
    req = np.nonzero(h_np > 0)[0]
    groups = [g for g, grp in enumerate(layout.groups) if grp.prefix_cacheable]
    if req.size == 0 or not groups:
        return out
    total = int(offs[-1])
    cand_codes = cg * max(total, 1) + cr
    # Rows gathered in numpy (a torch gather of a large step's rows would
    # wake the intra-op thread pool).
    words = batch.hashes.cpu().numpy()
    dev = index.device

    by_value: list[Any] = []

    def asked_by_value(g: np.ndarray, rows: np.ndarray) -> np.ndarray:
        # vLLM's exists_set holds (group, hash bytes): a hash repeated at a
        # position the request did not ask counts when it asked the value.
        from kvhit.coordinator.key_index import KeyIndex

        owner = np.searchsorted(offs, rows, side="right") - 1
        if not by_value:
            # Only the candidates of requests that need it (rare: a repeated
            # hash value), keyed (request, group).
            c_owner = np.searchsorted(offs, cr, side="right") - 1
            wanted = np.zeros(B, dtype=bool)
            wanted[owner] = True
            sel = np.nonzero(wanted[c_owner])[0]
            idx = KeyIndex(batch.hash_bytes, max(16, 2 * sel.size), "cpu")
            if sel.size:
                idx.add_trusted(
                    torch.from_numpy(c_owner[sel] * G + cg[sel]),
                    torch.from_numpy(words[cr[sel]]),
                )
            by_value.append(idx)
        return (
            by_value[0]
            .contains_trusted(
                torch.from_numpy(owner * G + g), torch.from_numpy(words[rows])
            )
            .numpy()
        )

    def present(g: np.ndarray, rows: np.ndarray) -> np.ndarray:
        # Which (group, row) probes some candidate names: the few probes are
        # sorted and the many candidates looked up in them (no sort of K).
        codes = g * max(total, 1) + rows
        uq, inv = np.unique(codes, return_inverse=True)
        pos = np.minimum(np.searchsorted(uq, cand_codes), uq.size - 1)
        named = np.zeros(uq.size, dtype=bool)
        named[pos[uq[pos] == cand_codes]] = True
        asked = named[inv.reshape(-1)]
        if not asked.all():
            other = np.nonzero(~asked)[0]
            asked[other] = asked_by_value(g[other], rows[other])
        found = np.zeros(codes.shape, dtype=bool)
        if asked.any():
            sel = np.nonzero(asked)[0]
            tg = torch.from_numpy(g[sel]).to(dev)
            th = torch.from_numpy(words[rows[sel]]).to(dev)
            found[sel] = index.contains_trusted(tg, th).cpu().numpy()
        return found

    rr = np.repeat(req, len(groups))
    gg = np.tile(np.asarray(groups, dtype=np.int64), req.size)
    hb = last[rr]
    ok = present(gg, offs[rr] + hb)
    out[rr[ok], gg[ok]] = h_np[rr[ok]]
    miss = np.nonzero(~ok)[0]
    if miss.size:
        # Partial hits: the hit ends inside the group's block; its key is the
        # first present hash up to the block's end (vLLM's search loop).
        bs = np.array([grp.spec.block_size for grp in layout.groups], np.int64)
        out[rr[miss], gg[miss]] = -1
        mr, mg, mh = rr[miss], gg[miss], hb[miss]
        chunk = -(-h_np[mr] // bs[mg]) - 1
        stop = np.minimum((chunk + 1) * bs[mg] // hbs, lens[mr])
        span = np.maximum(stop - (mh + 1), 0)
        if layout.partial_hash_hits and span.sum():
            who = np.repeat(np.arange(miss.size), span)
            start = np.repeat(np.cumsum(span) - span, span)
            idx = np.repeat(mh + 1, span) + (np.arange(who.size) - start)
            hit_here = present(mg[who], offs[mr[who]] + idx)
            # The first present hash per (request, group), in hash order.
            none = np.iinfo(np.int64).max
            first = np.full(miss.size, none, dtype=np.int64)
            np.minimum.at(first, who[hit_here], idx[hit_here])
            found = first != none
            out[mr[found], mg[found]] = (first[found] + 1) * hbs
    return out


# -- the scheduler API ------------------------------------------------------------


class BatchedLookup:
    """The per-step scheduler API: one store RPC, then the batched hit rule.

    Args:
        layout: the cache layout.
        store: the store (see :class:`StoreSync`).
        keys: key format and namespaces.
        device: where the index and the engine work.
        backend: ``LookupEngine`` backend ("auto", "torch", "triton",
            "reference"); the index uses the same, or "auto" for "reference".
        hash_bytes: block-hash width (32 for vLLM's sha256, 16 for xxhash128).
        index: an existing ``KeyIndex`` to keep in step (e.g. one also fed by
            KV-cache events); a new one of ``capacity`` slots otherwise.
        timeout_s: limit of one store call (see :class:`StoreSync`).
        forget_after: refreshes after which unasked keys are dropped from an
            ``index`` passed in (see :class:`StoreSync`; default: never, it
            may be fed by KV events as well). An index of its own is rewritten
            each step with that step's present keys (``exclusive``), so it
            stays bounded anyway.
        pool: the :class:`StoreCallPool` its store calls run on (see
            :class:`StoreSync`).
    """

    def __init__(
        self,
        layout: CacheLayout,
        store: ExistenceStore,
        keys: MooncakeKeys,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        hash_bytes: int = 32,
        index: Any = None,
        capacity: int = 1 << 16,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        forget_after: int | None | str = "auto",
        pool: StoreCallPool | None = None,
    ) -> None:
        from kvhit.coordinator.engine import LookupEngine
        from kvhit.coordinator.key_index import KeyIndex

        self.layout = layout
        self.device = torch.device(device)
        if forget_after == "auto":
            forget_after = DEFAULT_FORGET_AFTER if index is None else None
        own_index = index is None
        if index is None:
            index_backend = backend if backend in ("torch", "triton") else "auto"
            index = KeyIndex(hash_bytes, capacity, self.device, index_backend)
        self.index = index
        self.hash_bytes: int = index.hash_bytes
        self.engine = LookupEngine(layout, backend=backend, device=self.device)
        self.sync = StoreSync(
            store,
            keys,
            index,
            layout,
            timeout_s=timeout_s,
            forget_after=forget_after,
            exclusive=own_index,
            plan=self.engine.plan,
            pool=pool,
        )
        self.last_stats: RefreshStats | None = None
        self.last_error: StoreError | None = None

    def lookup(self, batch: HashBatch, num_tokens: Any) -> torch.Tensor:
        """Tokens of each prompt to load from the store: int64 ``[B]`` on
        ``batch.device`` (the worker's ``lookup`` for every request).

        Args:
            batch: the requests' block hashes (any device).
            num_tokens: prompt length per request, ``[B]``.

        Raises:
            StoreError: the store could not answer; the index is unchanged and
                no hit is computed from it.
            ValueError, TypeError: bad arguments (nothing asked or changed).
        """
        self.sync._check_batch(batch)
        nt = _as_num_tokens(num_tokens, batch)
        return self._hits(batch, nt).to(batch.device)

    def _hits(self, batch: HashBatch, nt: torch.Tensor) -> torch.Tensor:
        """One refresh and the engine's rule on checked input (``nt`` int64
        ``[B]`` >= 0 on the CPU): int64 ``[B]`` on the engine's device."""
        self.last_stats = self.sync.refresh_unchecked(batch, nt)
        return self.engine.lookup_unchecked(
            batch.to(self.device), nt.to(self.device), self.index
        )

    def lookup_with_tail_keys(self, batch: HashBatch, num_tokens: Any) -> TailKeyLookup:
        """:meth:`lookup` plus each request's tail key boundaries: for every
        request exactly what vLLM's ``MooncakeStoreWorker.lookup`` returns
        (``hit_length`` and ``tail_key_boundaries``), from one store call.

        Args:
            batch: the requests' block hashes (any device).
            num_tokens: prompt length per request, ``[B]``.

        Returns:
            :class:`TailKeyLookup` with tensors on the CPU.

        Raises:
            StoreError, ValueError, TypeError: as :meth:`lookup`.
        """
        self.sync._check_batch(batch)
        nt = _as_num_tokens(num_tokens, batch)
        return self.lookup_with_tail_keys_unchecked(batch, nt)

    def lookup_with_tail_keys_unchecked(
        self, batch: HashBatch, num_tokens: torch.Tensor
    ) -> TailKeyLookup:
        """:meth:`lookup_with_tail_keys` with **no argument checks**, for a
        batch kvhit packed itself (``HashBatch.from_trusted``) of this
        lookup's ``hash_bytes`` and ``num_tokens`` int64 ``[B]`` >= 0 on the
        CPU, e.g. ``KvhitLookupServer`` after checking its socket's input.

        Raises:
            StoreError: the store could not answer (no hit computed).
        """
        hits = self._hits(batch, num_tokens).cpu()
        h_np = hits.numpy()
        cand = self.sync._last_cand
        if cand is None or len(batch) == 0 or not bool((h_np > 0).any()):
            tails = torch.zeros(len(batch), self.layout.num_groups, dtype=torch.int64)
            return TailKeyLookup(hits, tails)
        tails = _tail_boundaries(self.layout, batch.to("cpu"), h_np, self.index, *cand)
        return TailKeyLookup(hits, torch.from_numpy(tails))

    def lookup_one(self, num_tokens: int, block_hashes: Sequence[bytes]) -> int:
        """Drop-in for the store worker's ``lookup(num_tokens, block_hashes)``
        (its ``hit_length``). On a store error it returns 0, as vLLM's worker
        does, and keeps the error in ``last_error``.

        Raises:
            ValueError: a hash of the wrong width (nothing was asked).
        """
        batch = HashBatch.from_bytes([list(block_hashes)], self.hash_bytes, "cpu")
        try:
            hits = self.lookup(batch, [num_tokens])
        except StoreError as exc:
            self.last_error = exc
            return 0
        self.last_error = None
        return int(hits[0])
