"""The Mooncake store client: key strings, the existence call and its answer.

vLLM 0.33.0's Mooncake store worker keys each ``(group, block hash)`` under
every rank namespace a load needs (:class:`MooncakeKeys`) and asks
``store.batch_is_exist`` which exist. This module holds what talks to the
store: the key format, the error kvhit raises when the store cannot answer
(:class:`StoreError`) and the check of an answer (:func:`check_answer`).
Keeping a :class:`KeyIndex` in step with the store is ``store_sync``'s.

A store call that may hang runs through a :class:`StoreCallPool`: at most
``size`` calls in flight, each abandoned at its deadline (its late answer
discarded), so a stuck call never blocks a later one while a slot is free,
and a store that hangs forever holds ``size`` threads, never more.

Error contract: a failed existence call -- an exception from the store, a
negative status for any key, an answer of the wrong length or type -- raises
:class:`StoreError`. It is never turned into a hit.
"""

from __future__ import annotations

import _thread
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvhit.kernels.checks import check_int, check_seconds

__all__ = [
    "DEFAULT_BUSY_LOG_S",
    "DEFAULT_IDLE_S",
    "DEFAULT_POOL_SIZE",
    "DEFAULT_TIMEOUT_S",
    "ExistenceStore",
    "MooncakeKeys",
    "PoolStats",
    "RankNamespace",
    "StoreBusy",
    "StoreCallPool",
    "StoreError",
    "check_answer",
    "model_name_for_vllm",
    "rank_namespaces_for_vllm",
]

#: Seconds a ``batch_is_exist`` call may take before it counts as failed.
DEFAULT_TIMEOUT_S = 5.0
#: Store calls a :class:`StoreCallPool` keeps in flight at most.
DEFAULT_POOL_SIZE = 3
#: Seconds between two "every store call is stuck" log lines of one pool.
DEFAULT_BUSY_LOG_S = 30.0
#: Seconds an idle :class:`StoreCallPool` worker waits for a call before it
#: ends: a server asked every step keeps its workers.
DEFAULT_IDLE_S = 10.0

logger = logging.getLogger(__name__)

# (tp_rank, pcp_rank, dcp_rank, pp_rank), vLLM's ``RankNamespace``.
RankNamespace = tuple[int, int, int, int]


class ExistenceStore(Protocol):
    """What StoreSync needs of a store: ``MooncakeDistributedStore`` fits."""

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...


class StoreError(RuntimeError):
    """The store's existence check failed; the index was left unchanged.

    Attributes:
        num_keys: keys in the failed call.
        codes: the distinct non-0/1 statuses the store returned, if any.
    """

    def __init__(
        self, message: str, num_keys: int = 0, codes: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.num_keys = num_keys
        self.codes = codes


# -- keys ------------------------------------------------------------------------


def model_name_for_vllm(model: str) -> str:
    """The ``model_name`` vLLM's worker puts in keys: the last path component
    of ``model_config.model``."""
    return model.rstrip("/").split("/")[-1]


def rank_namespaces_for_vllm(
    tp_size: int = 1,
    pcp_size: int = 1,
    dcp_size: int = 1,
    pp_size: int = 1,
    tp_replication_factor: int = 1,
) -> tuple[RankNamespace, ...]:
    """The namespaces vLLM's worker checks for one group with the rank-local
    store layout (``_init_lookup_key_prefixes``): every rank whose shard a load
    needs. ``tp_replication_factor`` is the group's count of TP ranks holding
    identical KV (1 for sharded groups)."""
    if dcp_size > 1:
        # DCP is a TP subdivision: dcp_rank == tp_rank % dcp_size.
        return tuple(
            (tp, pcp, tp % dcp_size, pp)
            for pcp in range(pcp_size)
            for tp in range(tp_size)
            for pp in range(pp_size)
        )
    return tuple(
        (shard, pcp, 0, pp)
        for pcp in range(pcp_size)
        for shard in range(tp_size // tp_replication_factor)
        for pp in range(pp_size)
    )


def _check_namespace(ns: Any, where: str) -> RankNamespace:
    if (
        not isinstance(ns, tuple | list)
        or len(ns) != 4
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ns
        )
    ):
        raise ValueError(
            f"{where}: a rank namespace is (tp_rank, pcp_rank, dcp_rank, "
            f"pp_rank) of non-negative ints, got {ns!r}"
        )
    return tuple(ns)  # type: ignore[return-value]


@dataclass(frozen=True)
class MooncakeKeys:
    """vLLM's Mooncake store key strings (rank-local layout, ``PoolKey``)::

        [cache_prefix@]model_name+store_namespace@tp_rank:T@pcpP@dcpD
            @pp_rank:R@group:G@<hash hex>

    Args:
        model_name: see :func:`model_name_for_vllm`.
        rank_namespaces: per layout group, the namespaces a load needs (see
            :func:`rank_namespaces_for_vllm`); a ``(group, hash)`` counts as
            present only when its key exists under every one of them. Groups
            that are not prefix cacheable may have none.
        cache_prefix: vLLM's ``kv_connector_extra_config["cache_prefix"]``.
        store_namespace: the worker's store namespace ("" for the historical
            rank-local format).
        key_group_ids: per layout group, the ``G`` in its keys (default: the
            group's position). vLLM numbers groups among the prefix-cacheable
            ones; ``bindings.vllm.vllm_key_group_ids(layout)`` gives that.
    """

    model_name: str
    rank_namespaces: tuple[tuple[RankNamespace, ...], ...]
    cache_prefix: str = ""
    store_namespace: str = ""
    key_group_ids: tuple[int | None, ...] | None = None
    _prefixes: tuple[tuple[str, ...], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in ("model_name", "cache_prefix", "store_namespace"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str")
        if isinstance(self.rank_namespaces, str | bytes) or not isinstance(
            self.rank_namespaces, Sequence
        ):
            raise TypeError("rank_namespaces must be a sequence (one per group)")
        per_group = tuple(
            tuple(_check_namespace(ns, f"rank_namespaces[{g}]") for ns in group)
            for g, group in enumerate(self.rank_namespaces)
        )
        for g, group in enumerate(per_group):
            if len(set(group)) != len(group):
                raise ValueError(f"rank_namespaces[{g}] has duplicate namespaces")
        object.__setattr__(self, "rank_namespaces", per_group)
        if self.key_group_ids is None:
            kg: tuple[int | None, ...] = tuple(range(len(per_group)))
        else:
            kg = tuple(self.key_group_ids)
            if len(kg) != len(per_group):
                raise ValueError(
                    f"key_group_ids has {len(kg)} entries, rank_namespaces "
                    f"{len(per_group)}"
                )
        object.__setattr__(self, "key_group_ids", kg)
        head = f"{self.cache_prefix}@" if self.cache_prefix else ""
        head += f"{self.model_name}{self.store_namespace}"
        object.__setattr__(
            self,
            "_prefixes",
            tuple(
                ()
                if kg[g] is None
                else tuple(
                    f"{head}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{r}@group:{kg[g]}"
                    for t, p, d, r in per_group[g]
                )
                for g in range(len(per_group))
            ),
        )

    @property
    def num_groups(self) -> int:
        return len(self.rank_namespaces)

    def prefixes(self, group: int) -> tuple[str, ...]:
        """Key prefixes of layout group ``group``, one per namespace, in
        ``rank_namespaces`` order (vLLM's ``build_prefix``)."""
        return self._prefixes[group]

    def keys(self, group: int, block_hash: bytes) -> list[str]:
        """Every namespace's key for ``(group, block_hash)``."""
        hx = bytes(block_hash).hex()
        return [f"{p}@{hx}" for p in self._prefixes[group]]

    def key(self, group: int, block_hash: bytes, namespace: int = 0) -> str:
        """The key of ``(group, block_hash)`` under one namespace."""
        return f"{self._prefixes[group][namespace]}@{bytes(block_hash).hex()}"


# -- answers --------------------------------------------------------------------


def check_answer(answer: Any, n_keys: int) -> np.ndarray:
    """The answer as int64 ``[n_keys]`` of 0/1, or StoreError.

    Every answer must be exactly 0 or 1 (or a negative error status): a
    1.5 or 0.9 is a broken store, never truncated into a presence bit.
    """
    try:
        raw = np.asarray(answer)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(
            f"batch_is_exist returned {type(answer).__name__}, not a list "
            f"of ints: {exc}",
            n_keys,
        ) from exc
    if raw.dtype.kind == "f":
        frac = raw[(raw != 0) & (raw != 1)]
        if frac.size and not bool((frac == np.floor(frac)).all()):
            raise StoreError(
                f"batch_is_exist returned non-integer answers, e.g. "
                f"{float(frac[frac != np.floor(frac)][0])!r}, for {n_keys} keys",
                n_keys,
            )
    elif raw.dtype.kind not in "iub":
        raise StoreError(
            f"batch_is_exist returned {type(answer).__name__} of {raw.dtype}, "
            "not a list of ints",
            n_keys,
        )
    try:
        codes = raw.astype(np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(
            f"batch_is_exist returned answers that are not ints: {exc}", n_keys
        ) from exc
    if codes.shape != (n_keys,):
        raise StoreError(
            f"batch_is_exist returned {codes.size if codes.ndim else 'a scalar'}"
            f" answers for {n_keys} keys",
            n_keys,
        )
    bad = (codes != 0) & (codes != 1)
    if bad.any():
        uniq = tuple(int(c) for c in np.unique(codes[bad])[:8])
        raise StoreError(
            f"batch_is_exist returned error status {uniq} for "
            f"{int(bad.sum())} of {n_keys} keys",
            n_keys,
            uniq,
        )
    return codes


# -- the bounded call pool ----------------------------------------------------------


class StoreBusy(StoreError):
    """Every slot of the :class:`StoreCallPool` holds a call past its
    deadline: the store was not asked (the caller answers misses)."""


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a :class:`StoreCallPool`'s counters.

    Attributes:
        size: calls in flight at most.
        in_flight: calls running now (abandoned ones included).
        max_in_flight: the most calls ever running at once (<= ``size``).
        calls: calls started.
        timeouts: calls abandoned at their deadline.
        late: abandoned calls that returned since (their answer discarded).
        busy: calls refused at once because every slot was taken.
    """

    size: int
    in_flight: int
    max_in_flight: int
    calls: int
    timeouts: int
    late: int
    busy: int


class _Call:
    """One call's outcome, written by its worker under the pool's lock.

    ``done`` is a raw lock held until the outcome is in: the caller waits on
    it with its deadline, the worker releases it (the cheapest hand-off a
    thread can wait on with a timeout: one futex, no condition variable)."""

    __slots__ = ("abandoned", "done", "error", "finished", "result")

    def __init__(self) -> None:
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.finished = False


class _Worker:
    """One worker thread of a :class:`StoreCallPool`: ``wake`` is a raw lock
    held while it has no job; the pool sets ``job`` and releases it."""

    __slots__ = ("job", "wake")

    def __init__(self, job: tuple) -> None:
        self.job: tuple | None = job
        self.wake = _thread.allocate_lock()
        self.wake.acquire()


class StoreCallPool:
    """Store calls with a deadline, at most ``size`` in flight.

    Calls run on at most ``size`` daemon worker threads, kept alive between
    calls: a call goes to an idle worker with one lock release (no thread
    start per call, no queue, no polling), and a new worker starts only when
    none is idle. A call past its deadline is abandoned: the caller gets
    :class:`StoreError` at once and the answer, when it comes, is discarded;
    its worker (and slot) is free again only when the call returns. While a
    slot is free a new call starts at once, whatever hangs; when every slot
    holds a stuck call, :meth:`call` raises :class:`StoreBusy` without asking
    and says so in one WARNING line per ``busy_log_s`` (the rest counted).

    Not a ``ThreadPoolExecutor``: it joins its workers at interpreter exit, so
    a call that never returns would hang the process's exit, and its queue
    would let calls pile up behind stuck ones. A worker idle for ``idle_s``
    ends (a later call starts another); :meth:`close` ends the idle ones at
    once. Threads never number more than ``size``, however long the store
    hangs.

    Args:
        size: calls in flight at most (>= 1).
        busy_log_s: seconds between two "every call is stuck" lines (> 0).
        idle_s: seconds an idle worker waits for a call before it ends (> 0).

    Raises:
        ValueError, TypeError: a bad ``size``, ``busy_log_s`` or ``idle_s``.
    """

    def __init__(
        self,
        size: int = DEFAULT_POOL_SIZE,
        busy_log_s: float = DEFAULT_BUSY_LOG_S,
        idle_s: float = DEFAULT_IDLE_S,
    ) -> None:
        self.size = check_int(size, "size", 1)
        self.busy_log_s = check_seconds(busy_log_s, "busy_log_s")
        self.idle_s = check_seconds(idle_s, "idle_s")
        self._lock = threading.Lock()
        # Start times (monotonic) of the calls in flight, by call id.
        self._running: dict[int, float] = {}
        # Workers waiting for a call, the most recently used last (its
        # stack and caches are the warmest).
        self._idle: list[_Worker] = []
        self._closed = False
        self._ids = itertools.count()
        self._max_in_flight = 0
        self._calls = self._timeouts = self._late = self._busy = 0
        self._last_busy_log = -float("inf")

    @property
    def in_flight(self) -> int:
        """Calls running now, abandoned ones included (<= ``size``)."""
        return len(self._running)

    @property
    def idle_workers(self) -> int:
        """Worker threads waiting for a call (with ``in_flight``, at most
        ``size`` threads in all)."""
        return len(self._idle)

    def stats(self) -> PoolStats:
        """The counters, read together."""
        with self._lock:
            return PoolStats(
                self.size,
                len(self._running),
                self._max_in_flight,
                self._calls,
                self._timeouts,
                self._late,
                self._busy,
            )

    def call(
        self, fn: Callable[[list[str]], Any], keys: list[str], timeout_s: float
    ) -> Any:
        """``fn(keys)`` on a free slot, waiting at most ``timeout_s`` seconds.

        Raises:
            StoreBusy: every slot holds a stuck call (``fn`` not called).
            StoreError: ``fn`` raised, or did not return within ``timeout_s``
                (then abandoned: its answer is discarded).
        """
        n_keys = len(keys)
        now = time.monotonic()
        box = _Call()
        worker: _Worker | None = None
        with self._lock:
            if len(self._running) >= self.size:
                self._busy += 1
                busy, oldest = self._busy, now - min(self._running.values())
                say = now - self._last_busy_log >= self.busy_log_s
                if say:
                    self._last_busy_log = now
            else:
                busy = 0
                cid = next(self._ids)
                self._running[cid] = now
                self._calls += 1
                self._max_in_flight = max(self._max_in_flight, len(self._running))
                job = (cid, fn, keys, box)
                if self._idle:
                    worker = self._idle.pop()
                    worker.job = job
        if busy:
            if say:
                logger.warning(
                    "kvhit store: all %d store calls are stuck (the oldest for "
                    "%.1f s); lookups answer misses without asking until one "
                    "returns (%d refused so far; this line at most every %g s)",
                    self.size,
                    oldest,
                    busy,
                    self.busy_log_s,
                )
            raise StoreBusy(
                f"batch_is_exist not asked for {n_keys} keys: all {self.size} "
                f"store calls are stuck (the oldest for {oldest:.1f} s)",
                n_keys,
            )
        if worker is not None:
            worker.wake.release()
        else:
            # No idle worker: the live ones all run calls, fewer than
            # ``size``, so one more thread keeps the bound.
            thread = threading.Thread(
                target=self._serve, args=(_Worker(job),), daemon=True,
                name="kvhit-store-call",
            )  # fmt: skip
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: a miss, not a crash
                with self._lock:
                    del self._running[cid]
                raise StoreError(f"batch_is_exist not started: {exc}", n_keys) from exc
        if not box.done.acquire(timeout=timeout_s):
            with self._lock:
                if not box.finished:
                    box.abandoned = True
                    self._timeouts += 1
            if box.abandoned:
                raise StoreError(
                    f"batch_is_exist did not answer for {n_keys} keys within "
                    f"{timeout_s} s (timeout_s); the late answer is discarded",
                    n_keys,
                )
        if box.error is not None:
            raise StoreError(
                f"batch_is_exist failed for {n_keys} keys: {box.error!r}", n_keys
            ) from box.error
        return box.result

    def close(self) -> None:
        """End the idle workers now; a worker whose call is still running
        ends when it returns. Calls after ``close`` still run (on a worker
        that ends with its call)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.wake.release()  # with no job: it ends

    def _serve(self, worker: _Worker) -> None:
        """A worker thread: runs its job, then waits ``idle_s`` for the next."""
        job = worker.job
        while job is not None:
            cid, fn, keys, box = job
            job = None
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(keys)
            except BaseException as exc:  # re-raised in the caller's thread
                error = exc
            with self._lock:
                del self._running[cid]
                if box.abandoned:
                    # Nobody waits for it: drop the answer (and its frames).
                    self._late += 1
                else:
                    box.result, box.error = result, error
                box.finished = True
                worker.job = None
                keep = not self._closed
                if keep:
                    self._idle.append(worker)
            box.done.release()
            del fn, keys, box, result, error
            if not keep:
                return
            if not worker.wake.acquire(timeout=self.idle_s):
                with self._lock:
                    if worker.job is None:
                        if worker in self._idle:
                            self._idle.remove(worker)
                        return
                # A call was handed over as the wait ended: its release is
                # on its way.
                worker.wake.acquire()
            job = worker.job
