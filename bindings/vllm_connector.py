"""vLLM's Mooncake store connector with kvhit's batched lookup: one flag.

Switch it on with (the Mooncake store itself is configured as for vLLM's
own connector, by the JSON file ``MOONCAKE_CONFIG_PATH`` names)::

    --kv-transfer-config '{"kv_connector": "KvhitMooncakeStoreConnector",
      "kv_connector_module_path": "kvhit.bindings.vllm_connector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"load_async": true, "lookup_async": false,
        "cache_prefix": "", "kvhit_max_batch": 4096,
        "kvhit_lookup_timeout_s": 1.0, "kvhit_store_timeout_s": 0.5,
        "kvhit_backend": "auto"}}'

With kvhit installed, its ``vllm.general_plugins`` entry point registers the
name, so ``kv_connector_module_path`` may be left out; where ``VLLM_PLUGINS``
is set, it must then list ``kvhit_connector``. On start-up the connector logs
``kvhit: KvhitMooncakeStoreConnector ready on ...`` (logger ``vllm.kvhit``);
on a vLLM other than 0.33.0 it refuses to start (RuntimeError).

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

Worker rank 0's side is ``vllm_lookup_server``, the messages between the two
``vllm_wire``; these three are the only kvhit modules that import vLLM.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import vllm
import zmq
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
)
from vllm.logger import init_logger
from vllm.v1.request import Request, RequestStatus

from kvhit.bindings.mooncake_store import (
    DEFAULT_BUSY_LOG_S,
    DEFAULT_POOL_SIZE,
    PoolStats,
)
from kvhit.bindings.vllm_lookup_server import KvhitLookupServer
from kvhit.bindings.vllm_wire import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_MAX_BATCH,
    DEFAULT_RETRY_S,
    DEFAULT_STORE_TIMEOUT_S,
    REQUEST_ENCODER,
    SEQ,
    connector_extra,
    decode_reply,
    kvhit_rpc_path,
    local_endpoint,
    positive_option,
    wire_item,
)

__all__ = [
    "CONNECTOR_NAME",
    "KvhitLookupClient",
    "KvhitMooncakeStoreConnector",
    "SUPPORTED_VLLM",
    "check_vllm_version",
    "register",
]

logger = init_logger(__name__)

CONNECTOR_NAME = "KvhitMooncakeStoreConnector"
#: The one vLLM release whose Mooncake store worker kvhit reproduces.
SUPPORTED_VLLM = "0.33.0"
#: The start-up line goes to vLLM's own logger tree, so vLLM's handler shows
#: it beside vLLM's lines (``kvhit.*`` loggers have no handler under vLLM).
startup_logger = logging.getLogger("vllm.kvhit")
#: The statuses whose requests a batch resolves (with no computed tokens and
#: at least an alignment's worth of tokens).
_LOOKED_UP = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


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
        # The process's shared context: a server in this process is reached
        # on its inproc endpoint (see ``vllm_wire.local_endpoint``).
        self.ctx = zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = local_endpoint(self._path) or self._path
        self.socket.connect(self.endpoint)
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
        items = [(req_id, wire_item(num_tokens, block_hashes))]
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
            items.append((rid, wire_item(req.num_tokens, req.block_hashes)))
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
        endpoint = local_endpoint(self._path) or self._path
        if endpoint != self.endpoint:
            # The server started (or restarted) in this process after we
            # connected, or left it: follow it.
            self.socket.disconnect(self.endpoint)
            self.socket.connect(endpoint)
            self.endpoint = endpoint
        self.num_messages += 1
        self._seq += 1
        seq = SEQ.pack(self._seq)
        deadline = time.monotonic() + self.timeout_s
        self.socket.send_multipart([b"", seq, REQUEST_ENCODER.encode(payload)])
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
                return decode_reply(frames[-1])
            self._late(frames)

    def _drain(self) -> None:
        """Take the replies that came after their batch timed out."""
        while self.socket.poll(0):
            self._late(self.socket.recv_multipart())

    def _late(self, frames: list[bytes]) -> None:
        # A reply to a batch that already counted as misses: dropped. The
        # newest overdue one answered means the server is answering again.
        self.num_late += 1
        if len(frames) >= 2 and len(frames[-2]) == SEQ.size:
            if SEQ.unpack(frames[-2])[0] == self.overdue:
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
        self.socket.close(linger=0)  # the shared context stays
        self.inner.close()


def check_vllm_version(version: str | None = None) -> str:
    """The running vLLM's version (``vllm.__version__`` unless ``version`` is
    given), when it is :data:`SUPPORTED_VLLM` (a local build tag such as
    ``+cu128`` allowed).

    Raises:
        RuntimeError: any other version, naming it and the two ways out.
    """
    got = str(vllm.__version__ if version is None else version)
    if got.split("+")[0] != SUPPORTED_VLLM:
        raise RuntimeError(
            f"{CONNECTOR_NAME} supports vLLM {SUPPORTED_VLLM} only (its lookup "
            f"reproduces that release's MooncakeStoreWorker.lookup bit for bit); "
            f"this is vLLM {got}. Install vllm=={SUPPORTED_VLLM}, or use vLLM's "
            'own connector: "kv_connector": "MooncakeStoreConnector".'
        )
    return got


# -- the connector -----------------------------------------------------------------------


class KvhitMooncakeStoreConnector(MooncakeStoreConnector):
    """vLLM's ``MooncakeStoreConnector`` with kvhit's batched lookup.

    ``kv_connector_extra_config`` takes Mooncake's keys plus
    ``kvhit_max_batch`` (requests one lookup message resolves, default 4096),
    ``kvhit_lookup_timeout_s`` (the most a synchronous ``schedule()`` waits
    for a batch, default 1), ``kvhit_store_timeout_s`` (one
    ``batch_is_exist`` on worker rank 0, default 0.5),
    ``kvhit_lookup_retry_s`` (default 5, see :class:`KvhitLookupClient`),
    ``kvhit_store_pool`` (store calls in flight at most on worker rank 0,
    default 3), ``kvhit_store_busy_log_s`` (the least seconds between two
    "every store call is stuck" lines, default 30) and ``kvhit_backend``
    (the ``LookupEngine`` backend on worker rank 0, default "auto"). Late
    or failed answers are misses; :meth:`kvhit_store_stats` counts them.

    It refuses any vLLM but :data:`SUPPORTED_VLLM` (RuntimeError, before
    anything is built) and logs one INFO line on the ``vllm.kvhit`` logger
    when it is ready: on the scheduler, and on worker rank 0 (the backend,
    the device and the store it asks).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        version = check_vllm_version()
        extra = connector_extra(vllm_config)
        max_batch = positive_option(extra, "kvhit_max_batch", DEFAULT_MAX_BATCH, int)
        timeout_s = positive_option(
            extra, "kvhit_lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S, float
        )
        retry_s = positive_option(extra, "kvhit_lookup_retry_s", DEFAULT_RETRY_S, float)
        positive_option(extra, "kvhit_store_timeout_s", DEFAULT_STORE_TIMEOUT_S, float)
        positive_option(extra, "kvhit_store_pool", DEFAULT_POOL_SIZE, int)
        positive_option(extra, "kvhit_store_busy_log_s", DEFAULT_BUSY_LOG_S, float)
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
            startup_logger.info(
                "kvhit: %s ready on the scheduler (vLLM %s): batched lookup, "
                "up to %d requests per message to worker rank 0, timeout %g s",
                CONNECTOR_NAME,
                version,
                max_batch,
                timeout_s,
            )
        worker = self.connector_worker
        if worker is not None and worker.lookup_server is not None:
            self.kvhit_server = KvhitLookupServer(worker, vllm_config, backend=backend)
            startup_logger.info(
                "kvhit: %s ready on worker rank 0 (vLLM %s): %s",
                CONNECTOR_NAME,
                version,
                self.kvhit_server.describe(),
            )

    def kvhit_store_stats(self) -> PoolStats | None:
        """Worker rank 0's store-call counters (see
        :meth:`KvhitLookupServer.store_stats`); None on other roles."""
        server = getattr(self, "kvhit_server", None)
        return None if server is None else server.store_stats()

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
