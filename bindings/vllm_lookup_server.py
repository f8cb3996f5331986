"""Worker rank 0 of the kvhit connector: batched lookups beside vLLM's server.

vLLM 0.33.0's ``LookupKeyServer`` answers one request per message with
``MooncakeStoreWorker.lookup``. :class:`KvhitLookupServer` runs beside it (on
the socket :func:`~kvhit.bindings.vllm_wire.kvhit_rpc_path` names) and
answers each batch with one deduplicated ``batch_is_exist`` over the worker's
own store handle and the batched worker rule, replying, per request, exactly
what ``MooncakeStoreWorker.lookup`` returns, tail key boundaries included.
The scheduler side is ``vllm_connector``; the messages are ``vllm_wire``'s.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import zmq
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
    encode_lookup_response,
)
from vllm.logger import init_logger

from kvhit.bindings.mooncake_store import (
    DEFAULT_BUSY_LOG_S,
    DEFAULT_POOL_SIZE,
    MooncakeKeys,
    PoolStats,
    StoreCallPool,
    StoreError,
    model_name_for_vllm,
    rank_namespaces_for_vllm,
)
from kvhit.bindings.store_sync import BatchedLookup, TailKeyLookup
from kvhit.bindings.vllm import layout_from_vllm
from kvhit.bindings.vllm_wire import (
    DEFAULT_STORE_TIMEOUT_S,
    EMPTY_REPLY,
    REQUEST_DECODER,
    connector_extra,
    decode_reply,
    joined_batch,
    kvhit_rpc_path,
    pack_answer,
    positive_option,
    publish_local,
    split_hashes,
    wire_item,
    withdraw_local,
)

__all__ = ["MAX_SERVER_CRASHES", "KvhitLookupServer"]

logger = init_logger(__name__)

#: Consecutive crashes of the serving loop after which the server answers
#: through vLLM's own per-request lookup.
MAX_SERVER_CRASHES = 3


class KvhitLookupServer:
    """Batched lookups on worker rank 0, beside vLLM's ``LookupKeyServer``.

    Args:
        worker: the connector's ``MooncakeStoreWorker`` (fully constructed:
            its coordinator, token databases and ``_lookup_key_prefixes``).
        vllm_config: the engine's config (the socket path and the key format).
        start: bind the socket and start the serving thread (tests that call
            :meth:`resolve` directly pass ``False``).
        backend: the ``LookupEngine`` backend ("auto": the device default).

    ``kvhit_store_timeout_s`` (``kv_connector_extra_config``, default
    :data:`DEFAULT_STORE_TIMEOUT_S`) bounds one ``batch_is_exist``: past it
    the batch is answered with misses and the call abandoned (its late answer
    discarded). The calls run on one :class:`StoreCallPool`
    (:attr:`store_pool`) of ``kvhit_store_pool`` slots (default
    :data:`DEFAULT_POOL_SIZE`): the next batch asks the store on a free slot
    at once, whatever hangs; only when every slot holds a stuck call is a
    batch answered with misses without asking, counted
    (``store_pool.stats().busy``) and logged at most once per
    ``kvhit_store_busy_log_s`` (default :data:`DEFAULT_BUSY_LOG_S`).

    Per batch it makes one deduplicated ``batch_is_exist`` over
    ``worker.store`` and answers every request with what
    ``MooncakeStoreWorker.lookup`` returns. It always replies: a store error
    gives hits of 0 for that batch (as vLLM's worker does), logged. When the
    keys kvhit builds differ from the worker's ``_lookup_key_prefixes`` (a
    store layout kvhit does not model, e.g. TP-sharded), or the worker is
    capacity-only, every request goes through vLLM's own
    ``worker.lookup``; that is logged once.

    The serving loop survives anything a batch raises (it replies misses).
    Should the loop itself fail, it is restarted, the batch in hand is
    answered with misses and the cause logged once; after
    :data:`MAX_SERVER_CRASHES` failures in a row the server answers through
    vLLM's per-request ``worker.lookup`` instead (``fallback_reason``).
    """

    def __init__(
        self,
        worker: Any,
        vllm_config: VllmConfig,
        start: bool = True,
        backend: str = "auto",
    ) -> None:
        self.worker = worker
        self.vllm_config = vllm_config
        self.backend = backend
        self.fallback_reason: str | None = None
        self.layout = None
        self.keys: MooncakeKeys | None = None
        self._lookups: dict[int, BatchedLookup] = {}
        self._lock = threading.Lock()
        self.num_batches = 0
        self.num_requests = 0
        self.num_crashes = 0
        self.num_failed_batches = 0
        self._failing_since: int | None = None
        self.last_error: BaseException | None = None
        self.store_timeout_s: float = positive_option(
            connector_extra(vllm_config),
            "kvhit_store_timeout_s",
            DEFAULT_STORE_TIMEOUT_S,
            float,
        )
        extra = connector_extra(vllm_config)
        self.store_pool = StoreCallPool(
            positive_option(extra, "kvhit_store_pool", DEFAULT_POOL_SIZE, int),
            positive_option(extra, "kvhit_store_busy_log_s", DEFAULT_BUSY_LOG_S, float),
        )
        try:
            self._build()
        except Exception as exc:  # any layout kvhit cannot serve
            self.fallback_reason = f"{type(exc).__name__}: {exc}"
        if self.fallback_reason is None:
            try:
                # vLLM's default block hash (sha256) is 32 bytes: build that
                # engine now, and compile its kernels on a batch of our own,
                # not in the first step's lookup (which has a deadline).
                self._lookup_for(32)
                self._warm_up(32)
            except Exception as exc:
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
        if self.fallback_reason is not None:
            logger.warning(
                "kvhit: batched lookup disabled, answering with vLLM's "
                "per-request MooncakeStoreWorker.lookup: %s",
                self.fallback_reason,
            )
        self.running = False
        self.thread: threading.Thread | None = None
        self.socket = None
        if start:
            self._start()

    def _build(self) -> None:
        w = self.worker
        if getattr(w, "_capacity_only", False):
            self.fallback_reason = "the worker is capacity-only (no lookups)"
            return
        coord = w.coord
        groups = list(w._kv_cache_groups)
        self.layout = layout_from_vllm(
            groups,
            scheduler_block_size=coord.lcm_block_size,
            hash_block_size=coord.hash_block_size,
            use_eagle=bool(coord.use_eagle),
            retention_interval=coord.retention_interval,
            partial_hash_hits=bool(coord.enable_partial_hash_hits),
        )
        factors = tuple(w._group_tp_replication_factors)
        metadata = [db.metadata for db in w.token_dbs]
        cacheable = [g.prefix_cacheable for g in self.layout.groups]
        self.keys = MooncakeKeys(
            model_name=model_name_for_vllm(self.vllm_config.model_config.model),
            rank_namespaces=[
                rank_namespaces_for_vllm(
                    tp_size=w.tp_size,
                    pcp_size=w.pcp_size,
                    dcp_size=w.dcp_size,
                    pp_size=w.pp_size,
                    tp_replication_factor=factors[g],
                )
                if cacheable[g]
                else ()
                for g in range(len(groups))
            ],
            cache_prefix=str(connector_extra(self.vllm_config).get("cache_prefix", "")),
            store_namespace=metadata[0].store_namespace if metadata else "",
            key_group_ids=tuple(
                md.group_id if ok else None
                for md, ok in zip(metadata, cacheable, strict=True)
            ),
        )
        want = tuple(tuple(p) for p in w._lookup_key_prefixes)
        for g in range(len(groups)):
            if cacheable[g] and self.keys.prefixes(g) != want[g]:
                self.fallback_reason = (
                    f"group {g}: kvhit's keys {self.keys.prefixes(g)[:2]} differ "
                    f"from the worker's {want[g][:2]}"
                )
                return

    def describe(self) -> str:
        """How this server answers, for the connector's start-up line, e.g.
        ``batched lookup, backend numba on cpu, store MooncakeDistributedStore
        (one batch_is_exist per step, timeout 0.5 s, at most 3 in flight)``."""
        if self.fallback_reason is not None:
            return f"vLLM's per-request lookup ({self.fallback_reason})"
        engine = self._lookup_for(32).engine
        store = type(getattr(self.worker, "store", None)).__name__
        return (
            f"batched lookup, backend {engine.backend} on {engine.device.type}, "
            f"store {store} (one batch_is_exist per step, timeout "
            f"{self.store_timeout_s:g} s, at most {self.store_pool.size} in flight)"
        )

    def store_stats(self) -> PoolStats:
        """The store calls' counters: in flight, abandoned at their deadline,
        answered late (discarded), refused because every slot was stuck."""
        return self.store_pool.stats()

    # -- serving -----------------------------------------------------------------

    def _start(self) -> None:
        path = kvhit_rpc_path(self.vllm_config)
        self._ipc_path = path.removeprefix("ipc://")
        if os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)
        # The process's shared context: a client in this process reaches the
        # inproc endpoint only on the same context.
        self.ctx = zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(path)
        self._local = publish_local(path)
        self.socket.bind(self._local)
        self._path = path
        self.running = True
        self.thread = threading.Thread(
            target=self._serve, name="KvhitLookupServer", daemon=True
        )
        self.thread.start()

    def _serve(self) -> None:
        """The serving thread: runs :meth:`_serve_loop`, restarting it when
        it fails (the batch in hand is answered with misses)."""
        seen: set[str] = set()
        crashes_in_a_row = 0
        while self.running:
            self._in_hand: list[bytes] | None = None
            self._served = False
            try:
                self._serve_loop()
                return
            except BaseException as exc:  # a daemon thread must not die silently
                if not self.running:
                    return
                self.num_crashes += 1
                crashes_in_a_row = 1 if self._served else crashes_in_a_row + 1
                self.last_error = exc
                cause = f"{type(exc).__name__}: {exc}"
                if cause not in seen:  # once per cause, with its traceback
                    seen.add(cause)
                    logger.error(
                        "kvhit lookup server: serving loop failed (%s); "
                        "answering the batch with misses and restarting\n%s",
                        cause,
                        _trace(exc),
                    )
                if crashes_in_a_row >= MAX_SERVER_CRASHES and not self.fallback_reason:
                    self.fallback_reason = (
                        f"the serving loop failed {crashes_in_a_row} times in a "
                        f"row, last: {cause}"
                    )
                    logger.error(
                        "kvhit: batched lookup disabled, answering with vLLM's "
                        "per-request MooncakeStoreWorker.lookup: %s",
                        self.fallback_reason,
                    )
                head = self._in_hand
                if head is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        self.socket.send_multipart([*head, EMPTY_REPLY])  # type: ignore[union-attr]
                time.sleep(0.01)

    def _serve_loop(self) -> None:
        sock = self.socket
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while self.running:
            try:
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart(copy=True)
            except zmq.ZMQError:
                if not self.running:
                    return
                logger.exception("kvhit lookup server: receive failed")
                continue
            # [identity, b"", (seq,) payload]: everything before the payload
            # goes back with the reply.
            head, frame = frames[:-1], frames[-1]
            self._in_hand = head
            payload = EMPTY_REPLY
            try:
                items = REQUEST_DECODER.decode(frame)
                # A seq in the envelope: the kvhit client, which reads arrays.
                payload = self._reply(items, arrays=len(head) > 2)
            except Exception as exc:
                # Never leave the client waiting: an empty reply reads as
                # hits of 0 for the whole batch.
                self.last_error = exc
                logger.error(
                    "kvhit lookup server: bad batch, replying misses: %s", str(exc)
                )
            self._send_reply(head, payload)
            self._in_hand = None
            self._served = True

    def _send_reply(self, head: list[bytes], payload: bytes) -> None:
        try:
            self.socket.send_multipart([*head, payload])  # type: ignore[union-attr]
        except zmq.ZMQError:
            if self.running:
                logger.exception("kvhit lookup server: reply failed")

    def close(self) -> None:
        """Stop serving, remove the socket file and end the idle store
        workers (the process's shared ZMQ context stays)."""
        self.running = False
        self.store_pool.close()
        if self.thread is not None:
            self.thread.join(timeout=5.0)
            if self.thread.is_alive():
                # Closing a socket under a thread still using it aborts the
                # process (a ZMQ assertion): leave it to the daemon thread.
                logger.warning("kvhit lookup server: thread did not stop")
                return
        if self.socket is not None:
            withdraw_local(self._path, self._local)
            self.socket.close(linger=0)
            self.socket = None
            if os.path.exists(self._ipc_path):
                os.unlink(self._ipc_path)
            # The shared context stays: other sockets of the process use it.

    # -- answering -----------------------------------------------------------------

    def resolve_packed(
        self, items: Sequence[tuple[int, int, bytes]]
    ) -> list[MooncakeLookupResult]:
        """:meth:`resolve` for the wire format: ``(num_tokens, hash_len,
        hashes joined)`` per request. The socket's input is checked here,
        once; what is built from it travels unchecked.

        Raises:
            ValueError: an item whose blob is not a whole number of hashes,
                or a negative count (nothing was asked).
        """
        got = self._resolve(items)
        if isinstance(got, list):
            return got
        return decode_reply(pack_answer(*got))

    def _reply(self, items: Sequence[tuple[int, int, bytes]], arrays: bool) -> bytes:
        """The reply payload for ``items``: in the array form when
        ``arrays`` (a kvhit client) and the batched path answered, else a
        list of vLLM's encoded results (see ``vllm_wire``)."""
        got = self._resolve(items)
        if isinstance(got, list):
            return msgspec.msgpack.encode([encode_lookup_response(r) for r in got])
        if arrays:
            return pack_answer(*got)
        return msgspec.msgpack.encode(
            [encode_lookup_response(r) for r in decode_reply(pack_answer(*got))]
        )

    def _resolve(
        self, items: Sequence[tuple[int, int, bytes]]
    ) -> tuple[np.ndarray, np.ndarray] | list[MooncakeLookupResult]:
        """Checks ``items`` (see :meth:`resolve_packed`) and answers them:
        ``(hits int64 [B], tails int64 [B, G])`` (``G`` layout groups; 0
        where vLLM lists no boundary) on the batched path, vLLM's results
        when the server falls back to its per-request lookup."""
        by_width: dict[int, list[int]] = {}
        for i, (n, hlen, blob) in enumerate(items):
            if n < 0 or hlen < 0 or (hlen == 0 and blob) or (hlen and len(blob) % hlen):
                raise ValueError(
                    f"request {i}: {n} tokens, {len(blob)} bytes of {hlen}-byte hashes"
                )
            if n > 0 and blob:
                by_width.setdefault(hlen, []).append(i)
        with self._lock:
            self.num_batches += 1
            self.num_requests += len(items)
            if self.fallback_reason is not None:
                return [
                    self._vllm_lookup(n, split_hashes(blob, hlen))
                    for n, hlen, blob in items
                ]
            assert self.layout is not None
            hits = np.zeros(len(items), dtype=np.int64)
            tails = np.zeros((len(items), self.layout.num_groups), dtype=np.int64)
            for width, idx in by_width.items():
                try:
                    batch, ntok = joined_batch(items, idx, width)
                    bl = self._lookup_for(width)
                    got_hits, got_tails = self._answer(
                        bl.lookup_with_tail_keys_unchecked(batch, ntok)
                    )
                except Exception as exc:
                    self._failed(exc)
                    continue
                self._succeeded()
                if len(idx) == len(items):  # one width: the whole batch
                    hits, tails = got_hits, got_tails
                else:
                    hits[idx], tails[idx] = got_hits, got_tails
            return hits, tails

    def _failed(self, exc: Exception) -> None:
        """A batch answered with misses because of ``exc``: logged when an
        outage starts (the traceback too unless it is a StoreError), counted
        while it lasts. Log records hold only text: a handler that keeps
        records must not keep every failed batch's frames alive."""
        self.last_error = exc
        self.num_failed_batches += 1
        if self._failing_since is None:
            self._failing_since = self.num_failed_batches
            what = "store error" if isinstance(exc, StoreError) else "lookup failed"
            logger.error(
                "kvhit lookup: %s, batch answered with misses (further failures "
                "are counted, not logged, until a batch succeeds): %s%s",
                what,
                f"{type(exc).__name__}: {exc}",
                "" if isinstance(exc, StoreError) else "\n" + _trace(exc),
            )

    def _succeeded(self) -> None:
        if self._failing_since is not None:
            logger.warning(
                "kvhit lookup: the store answers again after %d failed batches",
                self.num_failed_batches - self._failing_since + 1,
            )
            self._failing_since = None

    def resolve(
        self, requests: Sequence[tuple[int, Sequence[bytes]]]
    ) -> list[MooncakeLookupResult]:
        """Per request ``(num_tokens, block_hashes)``, what
        ``MooncakeStoreWorker.lookup(num_tokens, block_hashes)`` returns.

        One ``batch_is_exist`` for the batch (one per distinct hash width);
        a store error answers hits of 0 for the batch, logged. Packs each
        request as its client does and goes through :meth:`resolve_packed`.

        Raises:
            ValueError: a request whose hashes differ in width.
        """
        items = []
        for i, (n, hashes) in enumerate(requests):
            item = wire_item(n, hashes)
            if any(len(x) != item[1] for x in hashes):
                raise ValueError(f"request {i}: block hashes of different widths")
            items.append(item)
        return self.resolve_packed(items)

    def _vllm_lookup(self, n: int, hashes: Sequence[bytes]) -> MooncakeLookupResult:
        try:
            return self.worker.lookup(n, list(hashes))
        except Exception as exc:  # vLLM's server thread would die here
            self._failed(exc)
            return MooncakeLookupResult(0)

    def _warm_up(self, width: int) -> None:
        """One lookup over a store holding every key (no store call), so the
        kernels compile (hits and tail keys included) before serving."""
        assert self.layout is not None and self.keys is not None
        # No timeout: the call runs in this thread (no pool, no thread).
        bl = BatchedLookup(
            self.layout,
            _EveryKey(),
            self.keys,
            backend=self.backend,
            hash_bytes=width,
            timeout_s=None,
        )
        n = 4 * self.layout.scheduler_block_size // self.layout.hash_block_size
        blob = bytes(range(256)) * (n * width // 256 + 1)
        item = (4 * self.layout.scheduler_block_size, width, blob[: n * width])
        batch, ntok = joined_batch([item, item], [0, 1], width)
        # Twice: the second refresh takes the steady state's path (last
        # step's keys removed, not a cleared table), so its kernels load
        # here, not in the first step.
        for _ in range(2):
            bl.lookup_with_tail_keys_unchecked(batch, ntok)

    def _lookup_for(self, width: int) -> BatchedLookup:
        bl = self._lookups.get(width)
        if bl is None:
            assert self.layout is not None and self.keys is not None
            bl = BatchedLookup(
                self.layout,
                _WorkerStore(self.worker),
                self.keys,
                device="cpu",
                backend=self.backend,
                hash_bytes=width,
                timeout_s=self.store_timeout_s,
                pool=self.store_pool,
            )
            self._lookups[width] = bl
        return bl

    @staticmethod
    def _answer(res: TailKeyLookup) -> tuple[np.ndarray, np.ndarray]:
        """Per request of ``res``, what the worker's ``lookup`` returns, as
        ``(hits int64 [B], tails int64 [B, G])``: no boundary (0) where the
        hit is not positive."""
        hits = res.hit_lengths.numpy().copy()
        tails = res.tail_key_boundaries.numpy().copy()
        tails[hits <= 0] = 0
        # Rows missing a tail key: vLLM's worker asserts there (and its
        # server thread dies); loading with no key for the tail block is
        # never right, so they are misses.
        lost = np.flatnonzero((tails < 0).any(1))
        for i in lost.tolist():
            logger.warning(
                "kvhit lookup: no tail key for a hit of %d tokens; a miss",
                int(hits[i]),
            )
        if lost.size:
            hits[lost] = 0
            tails[lost] = 0
        return hits, tails


class _EveryKey:
    """A store holding every key (the server's warm-up)."""

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1] * len(keys)


class _WorkerStore:
    """The worker's store handle, read at call time (``close`` clears it)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        store = self.worker.store
        if store is None:
            raise RuntimeError("the Mooncake store handle is closed")
        t0 = time.perf_counter()
        out = store.batch_is_exist(keys)
        record = getattr(self.worker, "_record_kv_connector_operation", None)
        if record is not None:
            record("lookup_exists", time.perf_counter() - t0, len(keys))
        return out


def _trace(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)).rstrip()
