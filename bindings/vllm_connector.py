"""vLLM's Mooncake store connector with kvhit's batched lookup: one flag.

Switch it on with::

    --kv-transfer-config '{"kv_connector": "KvhitMooncakeStoreConnector",
        "kv_connector_module_path": "kvhit.bindings.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {...as for Mooncake..., "kvhit_max_batch": 4096}}'

(with kvhit installed, its ``vllm.general_plugins`` entry point registers the
name, so ``kv_connector_module_path`` may be left out).

:class:`KvhitMooncakeStoreConnector` is vLLM 0.33.0's ``MooncakeStoreConnector``
with one change, the lookup. Loads, saves, metadata, events and the admin
channel (reset) stay vLLM's own code.

- Scheduler side: vLLM's ``MooncakeStoreScheduler`` asks its lookup client
  for one request at a time (one IPC round trip and one ``batch_is_exist`` per
  waiting request per step). Here its client is a :class:`KvhitLookupClient`:
  the first lookup of a step sends ONE message resolving the asked request
  plus every tracked waiting or preempted request that has no computed tokens
  and at least an alignment's worth of tokens (at most ``kvhit_max_batch``);
  the step's later lookups are answered from it; the answers are dropped in
  ``build_connector_meta``. With ``lookup_async`` the message runs in the
  background and lookups return ``None`` until it is answered (vLLM's
  contract). Finished and aborted requests stop being tracked.
- Worker rank 0: beside vLLM's ``LookupKeyServer`` (which keeps serving
  reset), a :class:`KvhitLookupServer` answers each batch with one
  deduplicated ``batch_is_exist`` over the worker's own store handle and the
  batched worker rule, and replies, per request, exactly what
  ``MooncakeStoreWorker.lookup`` returns, tail key boundaries included.

This is the only kvhit module that imports vLLM.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    TailKeyBoundary,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
    decode_lookup_response,
    encode_lookup_response,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    get_zmq_rpc_path_lookup,
)
from vllm.logger import init_logger
from vllm.v1.request import Request, RequestStatus

from kvhit.bindings.mooncake import (
    BatchedLookup,
    MooncakeKeys,
    StoreError,
    TailKeyLookup,
    model_name_for_vllm,
    rank_namespaces_for_vllm,
)
from kvhit.bindings.vllm import layout_from_vllm
from kvhit.coordinator.packing import HashBatch

__all__ = [
    "CONNECTOR_NAME",
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_RETRY_S",
    "DEFAULT_STORE_TIMEOUT_S",
    "MAX_SERVER_CRASHES",
    "KvhitLookupClient",
    "KvhitLookupServer",
    "KvhitMooncakeStoreConnector",
    "kvhit_rpc_path",
    "register",
]

logger = init_logger(__name__)

CONNECTOR_NAME = "KvhitMooncakeStoreConnector"
#: Requests one lookup message resolves at most (``kvhit_max_batch``).
DEFAULT_MAX_BATCH = 4096
#: Seconds a synchronous ``schedule()`` waits at most for a batch's answer
#: (``kvhit_lookup_timeout_s``) before it treats every request of the batch
#: as a miss, whatever the store or the server does.
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
#: Seconds worker rank 0 gives one ``batch_is_exist`` (``kvhit_store_timeout_s``)
#: before it answers the batch with misses; below the lookup timeout, so a
#: slow store yields an answer of misses in time, not a client timeout.
DEFAULT_STORE_TIMEOUT_S = 0.5
#: Seconds after a batch went unanswered (the server itself stalled) during
#: which the client answers misses without asking (``kvhit_lookup_retry_s``);
#: the server's late reply, when it comes, ends that at once.
DEFAULT_RETRY_S = 5.0

_REQUEST = msgspec.msgpack.Encoder()
# Messages: the client's DEALER sends ``[b"", seq (8 bytes), payload]`` and
# the server's ROUTER replies with the same envelope; a REQ client (``[b"",
# payload]``, no seq) is answered ``[b"", reply]``.
_SEQ = struct.Struct("<Q")
#: Consecutive crashes of the serving loop after which the server answers
#: through vLLM's own per-request lookup.
MAX_SERVER_CRASHES = 3
_DECODE_REQUEST = msgspec.msgpack.Decoder(list[tuple[int, int, bytes]])
_DECODE_REPLY = msgspec.msgpack.Decoder(list[bytes])
_EMPTY_REPLY = msgspec.msgpack.encode([])
#: The statuses whose requests a batch resolves (with no computed tokens and
#: at least an alignment's worth of tokens).
_LOOKED_UP = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def kvhit_rpc_path(vllm_config: VllmConfig) -> str:
    """The IPC path of the kvhit lookup socket: vLLM's lookup path (which
    honours ``VLLM_RPC_BASE_PATH``, ``lookup_rpc_port`` and the DP rank) with
    a ``_kvhit`` suffix, so both servers run side by side."""
    return get_zmq_rpc_path_lookup(vllm_config) + "_kvhit"


def _extra(vllm_config: VllmConfig) -> dict[str, Any]:
    assert vllm_config.kv_transfer_config is not None
    return vllm_config.kv_transfer_config.kv_connector_extra_config


def _positive(extra: dict[str, Any], name: str, default: Any, kind: type) -> Any:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(
            f"kv_connector_extra_config[{name!r}] must be a positive "
            f"{kind.__name__}, got {value!r}"
        )
    if kind is int and value != int(value):
        raise ValueError(f"kv_connector_extra_config[{name!r}] must be an int")
    return kind(value)


# -- worker rank 0 ------------------------------------------------------------------


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
    the batch is answered with misses, and while that call has not returned
    the store is not asked again (the following batches are misses at once).

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
        self.store_timeout_s: float = _positive(
            _extra(vllm_config), "kvhit_store_timeout_s", DEFAULT_STORE_TIMEOUT_S, float
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
            cache_prefix=str(_extra(self.vllm_config).get("cache_prefix", "")),
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

    # -- serving -----------------------------------------------------------------

    def _start(self) -> None:
        path = kvhit_rpc_path(self.vllm_config)
        self._ipc_path = path.removeprefix("ipc://")
        if os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(path)
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
                        self.socket.send_multipart([*head, _EMPTY_REPLY])  # type: ignore[union-attr]
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
            reply: list[bytes] = []
            try:
                items = _DECODE_REQUEST.decode(frame)
                reply = [encode_lookup_response(r) for r in self.resolve_packed(items)]
            except Exception as exc:
                # Never leave the client waiting: an empty reply reads as
                # hits of 0 for the whole batch.
                self.last_error = exc
                logger.error(
                    "kvhit lookup server: bad batch, replying misses: %s", str(exc)
                )
            self._send_reply(head, msgspec.msgpack.encode(reply))
            self._in_hand = None
            self._served = True

    def _send_reply(self, head: list[bytes], payload: bytes) -> None:
        try:
            self.socket.send_multipart([*head, payload])  # type: ignore[union-attr]
        except zmq.ZMQError:
            if self.running:
                logger.exception("kvhit lookup server: reply failed")

    def close(self) -> None:
        """Stop serving, remove the socket file and end the ZMQ context."""
        self.running = False
        if self.thread is not None:
            self.thread.join(timeout=5.0)
            if self.thread.is_alive():
                # Closing a socket under a thread still using it aborts the
                # process (a ZMQ assertion): leave it to the daemon thread.
                logger.warning("kvhit lookup server: thread did not stop")
                return
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
            if os.path.exists(self._ipc_path):
                os.unlink(self._ipc_path)
            self.ctx.term()

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
                    self._vllm_lookup(n, _split(blob, hlen)) for n, hlen, blob in items
                ]
            out: list[MooncakeLookupResult] = [MooncakeLookupResult(0)] * len(items)
            for width, idx in by_width.items():
                try:
                    batch, ntok = _joined_batch(items, idx, width)
                    bl = self._lookup_for(width)
                    results = self._answer(
                        bl.lookup_with_tail_keys_unchecked(batch, ntok)
                    )
                except Exception as exc:
                    self._failed(exc)
                    continue
                self._succeeded()
                for i, r in zip(idx, results, strict=True):
                    out[i] = r
            return out

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
            item = _wire_item(n, hashes)
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
        bl = BatchedLookup(
            self.layout, _EveryKey(), self.keys, backend=self.backend, hash_bytes=width
        )
        n = 4 * self.layout.scheduler_block_size // self.layout.hash_block_size
        blob = bytes(range(256)) * (n * width // 256 + 1)
        item = (4 * self.layout.scheduler_block_size, width, blob[: n * width])
        batch, ntok = _joined_batch([item, item], [0, 1], width)
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
            )
            self._lookups[width] = bl
        return bl

    @staticmethod
    def _answer(res: TailKeyLookup) -> list[MooncakeLookupResult]:
        """Per request of ``res``, what the worker's ``lookup`` returns."""
        hits = res.hit_lengths.tolist()
        tails = res.tail_key_boundaries.tolist()
        out: list[MooncakeLookupResult] = []
        for hit, row in zip(hits, tails, strict=True):
            if hit <= 0:
                out.append(MooncakeLookupResult(hit, ()))
                continue
            if any(b < 0 for b in row):
                # vLLM's worker asserts here (and its server thread dies);
                # loading with no key for the tail block is never right.
                logger.warning(
                    "kvhit lookup: no tail key for a hit of %d tokens; a miss", hit
                )
                out.append(MooncakeLookupResult(0))
                continue
            out.append(
                MooncakeLookupResult(
                    hit,
                    tuple(TailKeyBoundary(g, b) for g, b in enumerate(row) if b != 0),
                )
            )
        return out


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


def _wire_item(num_tokens: int, hashes: Sequence[bytes]) -> tuple[int, int, bytes]:
    """One request on the wire: ``(num_tokens, hash width, hashes joined)``."""
    return num_tokens, len(hashes[0]) if hashes else 0, b"".join(hashes)


def _split(blob: bytes, width: int) -> list[bytes]:
    """A joined blob as its ``width``-byte hashes (vLLM's own lookup path
    takes a list)."""
    return [blob[o : o + width] for o in range(0, len(blob), width)] if width else []


def _joined_batch(
    items: Sequence[tuple[int, int, bytes]], idx: list[int], width: int
) -> tuple[HashBatch, torch.Tensor]:
    """The requests ``idx`` of checked wire ``items`` (all of ``width``-byte
    hashes) as one :class:`HashBatch` straight from their joined blobs (no
    per-hash bytes objects), and their ``num_tokens`` (int64 ``[B]``).

    Rows are little-endian words, the last one zero-padded when ``width`` is
    not a multiple of 8, as ``HashBatch.from_bytes`` packs them."""
    blobs = [items[i][2] for i in idx]
    lens = np.fromiter((len(b) for b in blobs), np.int64, len(idx)) // width
    offsets = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    # A bytearray join: one copy, and a writable buffer for torch.
    raw = np.frombuffer(bytearray().join(blobs), dtype=np.uint8).reshape(-1, width)
    words_w = -(-width // 8)
    if width % 8:
        padded = np.zeros((raw.shape[0], 8 * words_w), dtype=np.uint8)
        padded[:, :width] = raw
        raw = padded
    words = raw.view("<i8").astype(np.int64, copy=False)
    batch = HashBatch.from_trusted(
        torch.from_numpy(np.ascontiguousarray(words)), torch.from_numpy(offsets), width
    )
    ntok = torch.from_numpy(np.fromiter((items[i][0] for i in idx), np.int64, len(idx)))
    return batch, ntok


# -- scheduler side --------------------------------------------------------------------


class KvhitLookupClient:
    """Stands in for vLLM's ``LookupKeyClient`` in ``MooncakeStoreScheduler``.

    ``lookup`` keeps vLLM's signature and contract; ``discard``, ``reset``
    and ``close`` go to vLLM's client (the admin channel stays vLLM's).

    Args:
        inner: vLLM's ``LookupKeyClient``.
        vllm_config: the engine's config.
        align: tokens a request needs before it is looked up (the scheduler's
            alignment: the hash block with partial hash hits, else the block).
        max_batch: requests one message resolves at most.
        timeout_s: the most one batch may keep the caller waiting; past it
            every request of the batch is a miss.
        retry_s: after a batch went unanswered, the seconds during which
            batches are misses without asking (unless the late reply comes
            first, which shows the server answers again).

    Every message carries a sequence number and its reply the same one: a
    reply that comes after its batch timed out is dropped, never applied to
    a later step.
    """

    def __init__(
        self,
        inner: Any,
        vllm_config: VllmConfig,
        align: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        self.inner = inner
        self.align = align
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._path = kvhit_rpc_path(vllm_config)
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self._path)
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="KvhitLookupClient"
        )
        self.tracked: dict[str, Request] = {}
        # Answers of this step, and the batch in flight (lookup_async).
        self.results: dict[str, MooncakeLookupResult] = {}
        self.pending: Future[dict[str, MooncakeLookupResult]] | None = None
        self.num_messages = 0
        self.num_timeouts = 0
        self.num_late = 0
        self.num_skipped = 0
        self._seq = 0
        # The newest batch that timed out, while its reply has not come.
        self.overdue: int | None = None
        self._overdue_since = 0.0

    # -- tracking ------------------------------------------------------------------

    def track(self, request: Request) -> None:
        self.tracked[request.request_id] = request

    def untrack(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        self.results.pop(req_id, None)

    def end_step(self) -> None:
        """Drop this step's answers (a batch in flight stays in flight)."""
        self.results.clear()

    def _batch(self, req_id: str, num_tokens: int, block_hashes: Sequence[bytes]):
        # Packed here, in the scheduler's thread: ``(req_id, (num_tokens,
        # hash width, hashes joined))``, the wire format.
        items = [(req_id, _wire_item(num_tokens, block_hashes))]
        results, align = self.results, self.align
        for rid, req in self.tracked.items():
            if len(items) >= self.max_batch:
                break
            if (
                rid == req_id
                or rid in results
                or req.num_computed_tokens
                or req.num_tokens < align
                or req.status not in _LOOKED_UP
            ):
                continue
            items.append((rid, _wire_item(req.num_tokens, req.block_hashes)))
        return items

    # -- the lookup ----------------------------------------------------------------

    def _send(self, items) -> dict[str, MooncakeLookupResult]:
        """One message for the batch, waiting at most ``timeout_s`` for its
        reply; any failure is a miss for each request (as vLLM's client
        turns a failed lookup into a hit of 0)."""
        out = {rid: MooncakeLookupResult(0) for rid, _ in items}
        answers: list[MooncakeLookupResult] = []
        try:
            self._drain()
            if (
                self.overdue is not None
                and time.monotonic() - self._overdue_since < self.retry_s
            ):
                # The server has not answered a batch past its deadline:
                # asking again would only wait out another timeout.
                self.num_skipped += 1
                return out
            answers = self._ask([item for _, item in items])
        except Exception as exc:
            logger.error(
                "kvhit batched lookup failed (%d requests): %s", len(items), str(exc)
            )
        for (rid, _), r in zip(items, answers, strict=False):
            out[rid] = r
        return out

    def _ask(self, payload: list) -> list[MooncakeLookupResult]:
        self.num_messages += 1
        self._seq += 1
        seq = _SEQ.pack(self._seq)
        deadline = time.monotonic() + self.timeout_s
        self.socket.send_multipart([b"", seq, _REQUEST.encode(payload)])
        while True:
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.socket.poll(left_ms):
                if self.overdue is None:
                    logger.error(
                        "kvhit batched lookup: no answer within %.3g s "
                        "(kvhit_lookup_timeout_s); %d requests are misses, and "
                        "batches are misses without asking until the server "
                        "answers again (at most %.3g s)",
                        self.timeout_s,
                        len(payload),
                        self.retry_s,
                    )
                self.num_timeouts += 1
                self.overdue, self._overdue_since = self._seq, time.monotonic()
                return []
            frames = self.socket.recv_multipart()
            if frames[-2] == seq:
                return [
                    decode_lookup_response(r) for r in _DECODE_REPLY.decode(frames[-1])
                ]
            self._late(frames)

    def _drain(self) -> None:
        """Take the replies that came after their batch timed out."""
        while self.socket.poll(0):
            self._late(self.socket.recv_multipart())

    def _late(self, frames: list[bytes]) -> None:
        # A reply to a batch that already counted as misses: dropped. The
        # newest overdue one answered means the server is answering again.
        self.num_late += 1
        if len(frames) >= 2 and len(frames[-2]) == _SEQ.size:
            if _SEQ.unpack(frames[-2])[0] == self.overdue:
                self.overdue = None
                logger.info("kvhit batched lookup: the server answers again")

    def lookup(
        self,
        req_id: str,
        num_tokens: int,
        block_hashes: Sequence[bytes],
        non_block: bool = False,
    ) -> MooncakeLookupResult | None:
        """vLLM's ``LookupKeyClient.lookup``: with ``non_block``, ``None``
        until the answer is ready (the scheduler asks again next step)."""
        if req_id not in self.results and self.pending is not None:
            if non_block and not self.pending.done():
                return None
            self._collect()
        if req_id in self.results:
            return self.results.pop(req_id)
        items = self._batch(req_id, num_tokens, block_hashes)
        if not non_block:
            # Nothing in flight (collected above): send from this thread, no
            # hand-off to the executor and back (two thread switches of a
            # loaded host per step).
            got = self._send(items)
            self.results.update((r, v) for r, v in got.items() if r in self.tracked)
            return self.results.pop(req_id, MooncakeLookupResult(0))
        future = self.executor.submit(self._send, items)
        if not future.done():
            self.pending = future
            return None
        self.pending = future
        self._collect()
        return self.results.pop(req_id, MooncakeLookupResult(0))

    def _collect(self) -> None:
        assert self.pending is not None
        future, self.pending = self.pending, None
        try:
            got = future.result()
        except Exception as exc:  # _send catches everything; a cancel lands here
            logger.error("kvhit batched lookup failed: %s", str(exc))
            return
        # Requests finished meanwhile are not answered.
        self.results.update((r, v) for r, v in got.items() if r in self.tracked)

    def discard(self, req_id: str) -> None:
        self.untrack(req_id)
        self.inner.discard(req_id)

    def reset(self) -> bool:
        self.results.clear()
        return self.inner.reset()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.socket.close(linger=0)
        self.ctx.term()
        self.inner.close()


# -- the connector -----------------------------------------------------------------------


class KvhitMooncakeStoreConnector(MooncakeStoreConnector):
    """vLLM's ``MooncakeStoreConnector`` with kvhit's batched lookup.

    ``kv_connector_extra_config`` takes Mooncake's keys plus
    ``kvhit_max_batch`` (requests one lookup message resolves, default 4096),
    ``kvhit_lookup_timeout_s`` (the most a synchronous ``schedule()`` waits
    for a batch, default 1), ``kvhit_store_timeout_s`` (one
    ``batch_is_exist`` on worker rank 0, default 0.5),
    ``kvhit_lookup_retry_s`` (default 5, see :class:`KvhitLookupClient`) and
    ``kvhit_backend`` (the ``LookupEngine`` backend on worker rank 0,
    default "auto"). Late or failed answers are misses.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        extra = _extra(vllm_config)
        max_batch = _positive(extra, "kvhit_max_batch", DEFAULT_MAX_BATCH, int)
        timeout_s = _positive(
            extra, "kvhit_lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S, float
        )
        retry_s = _positive(extra, "kvhit_lookup_retry_s", DEFAULT_RETRY_S, float)
        _positive(extra, "kvhit_store_timeout_s", DEFAULT_STORE_TIMEOUT_S, float)
        backend = str(extra.get("kvhit_backend", "auto"))
        super().__init__(vllm_config, role, kv_cache_config)
        self.kvhit_client: KvhitLookupClient | None = None
        self.kvhit_server: KvhitLookupServer | None = None
        sched = self.connector_scheduler
        if sched is not None:
            align = (
                sched._hash_block_size
                if sched.enable_partial_hash_hits
                else sched._block_size
            )
            self.kvhit_client = KvhitLookupClient(
                sched.client, vllm_config, align, max_batch, timeout_s, retry_s
            )
            sched.client = self.kvhit_client
        worker = self.connector_worker
        if worker is not None and worker.lookup_server is not None:
            self.kvhit_server = KvhitLookupServer(worker, vllm_config, backend=backend)

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        if self.kvhit_client is not None:
            self.kvhit_client.track(request)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self.kvhit_client is not None:
            for rid in scheduler_output.finished_req_ids:
                self.kvhit_client.untrack(rid)
            self.kvhit_client.end_step()
        return meta

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.kvhit_client is not None:
            self.kvhit_client.untrack(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def shutdown(self) -> None:
        server = getattr(self, "kvhit_server", None)
        if server is not None:
            server.close()
            self.kvhit_server = None
        super().shutdown()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: makes
    ``"kv_connector": "KvhitMooncakeStoreConnector"`` work without a module
    path. Registering twice is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)
    except ValueError:  # "already registered": vLLM loads plugins per process
        pass
