"""vLLM's real Scheduler with a Mooncake store connector, on the CPU.

Shared by tests/test_vllm_connector*.py and bench/bench_vllm_step.py. Call
everything here inside ``vllm_oracle.vllm_importable()``: it imports vLLM
lazily. vLLM's test helpers (``tests/v1/kv_connector/unit/utils.py``:
``create_vllm_config`` / ``create_scheduler``) are not in the wheel; the few
lines needed are rebuilt here, with a local tiny model config
(``tests/data/tiny_llama``, nothing from a hub).

The worker side is vLLM's own ``MooncakeStoreWorker`` built with
``object.__new__`` plus its own layout helpers (``_build_token_databases``,
``_init_lookup_key_prefixes``) over any store with ``batch_is_exist``; the
stock path is served by vLLM's real ``LookupKeyServer`` over it, the kvhit
path by ``KvhitLookupServer``.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY_MODEL = str(Path(__file__).parent / "data" / "tiny_llama")
KVHIT_MODULE = "kvhit.bindings.vllm_connector"
_PORTS = itertools.count(20000 + random.Random().randrange(20000))


class Boom(BaseException):
    """A failure no handler expects (not an Exception)."""


def crash_lookups(server: Any, left: int = 0) -> dict[str, int]:
    """Make ``server._lookup_for`` raise :class:`Boom` while the returned
    counter's ``"left"`` is positive (one less per raise); the server's own
    method otherwise."""
    real = server._lookup_for
    crash = {"left": left}

    def lookup_for(width: int) -> Any:
        if crash["left"]:
            crash["left"] -= 1
            raise Boom("injected")
        return real(width)

    server._lookup_for = lookup_for
    return crash


def shared_prompts(
    rng: random.Random,
    n: int,
    system: tuple[int, int],
    tail: tuple[int, int],
    length: tuple[int, int],
) -> list[list[int]]:
    """``n`` prompts: 80 % start with one of 3 system prompts of
    ``randrange(*system)`` tokens, then a tail of ``randrange(*tail)``,
    cut to ``randrange(*length)`` tokens (token ids 3..999)."""
    systems = [[rng.randrange(3, 1000) for _ in range(rng.randrange(*system))]
               for _ in range(3)]  # fmt: skip
    out = []
    for _ in range(n):
        head = rng.choice(systems) if rng.random() < 0.8 else []
        body = [rng.randrange(3, 1000) for _ in range(rng.randrange(*tail))]
        out.append((head + body)[: rng.randrange(*length)])
    return out


def next_port() -> int:
    """A lookup_rpc_port no other scheduler of this process uses."""
    return next(_PORTS)


class CountingStore:
    """``batch_is_exist`` over a set of key strings, counting calls."""

    def __init__(self, keys: set[str] | None = None, delay_s: float = 0.0) -> None:
        self.keys: set[str] = set(keys or ())
        self.delay_s = delay_s
        self.calls = 0
        self.keys_asked = 0
        self.lock = threading.Lock()

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if self.delay_s:
            time.sleep(self.delay_s)
        with self.lock:
            self.calls += 1
            self.keys_asked += len(keys)
            return [1 if k in self.keys else 0 for k in keys]

    def remove_all(self, force: bool = True) -> int:
        self.keys.clear()
        return 0

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class LayoutCase:
    """A KV-cache layout for the Scheduler: ``kinds`` like ("full", 16)."""

    name: str
    groups: tuple[tuple[str, int], ...]
    prefix_match_unit: int | None = None
    sliding_window: int = 32


LAYOUTS = (
    LayoutCase("full", (("full", 16),)),
    LayoutCase("full+swa", (("full", 16), ("swa", 16))),
    LayoutCase("full+mamba_partial", (("full", 32), ("mamba", 32)), 8),
    LayoutCase("full+swa_fine_unit", (("full", 32), ("swa", 32)), 8, 64),
)


def kv_cache_config(case: LayoutCase, num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    groups = []
    for i, (kind, bs) in enumerate(case.groups):
        attn = dict(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)
        if kind == "full":
            spec = FullAttentionSpec(**attn)
        elif kind == "swa":
            spec = SlidingWindowSpec(**attn, sliding_window=case.sliding_window)
        else:
            spec = MambaSpec(
                block_size=bs,
                shapes=((4,),),
                dtypes=(torch.float16,),
                mamba_cache_mode="align",
            )
        groups.append(KVCacheGroupSpec([f"model.layers.{i}"], spec))
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )


def vllm_config(
    connector: str,
    case: LayoutCase,
    extra: dict[str, Any],
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    module_path: str | None = None,
):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=TINY_MODEL, skip_tokenizer_init=True, dtype="float16", seed=42
    )
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=8192,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(
        block_size=case.groups[0][1],
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
        prefix_match_unit=case.prefix_match_unit,
    )
    cache.kv_cache_layout = "LBNHC"
    kv = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra),
    )
    return VllmConfig(
        scheduler_config=sched,
        model_config=model,
        cache_config=cache,
        kv_transfer_config=kv,
        device_config=DeviceConfig("cpu"),
    )


def resolve_sizes(kvc, vc) -> tuple[int, int]:
    """What the engine core does before the Scheduler is built."""
    from vllm.v1.core.kv_cache_utils import (
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )

    bs, hbs = resolve_kv_cache_block_sizes(kvc, vc)
    kvc.hash_block_size = hbs
    kvc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kvc, vc, bs, hbs
    )
    return bs, hbs


def fake_worker(vc, kvc, store):
    """vLLM's MooncakeStoreWorker without a GPU or a master: its own layout
    helpers and key prefixes, over ``store``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (  # noqa: E501
        MooncakeStoreCoordinator,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        KeyMetadata,
        MooncakeLookupResult,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        MooncakeStoreWorker,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    w = object.__new__(MooncakeStoreWorker)
    w.tp_rank, w.tp_size, w.pp_size, w.pp_rank = 0, 1, 1, 0
    w.pcp_size = w.pcp_rank = w.dcp_rank = 0
    w.pcp_size = w.dcp_size = 1
    w.num_kv_head = 1
    w.kv_role = "kv_both"
    w._capacity_only = False
    w.cache_config = vc.cache_config
    w.block_size, w.hash_block_size = resolve_kv_cache_block_sizes(kvc, vc)
    w.coord = MooncakeStoreCoordinator.from_kv_cache_config(
        kvc, vc, w.block_size, w.hash_block_size
    )
    w._kv_cache_groups = w.coord.kv_cache_groups
    w.store_tp_size = None
    extra = vc.kv_transfer_config.kv_connector_extra_config
    md = KeyMetadata(
        model_name=vc.model_config.model.rstrip("/").split("/")[-1],
        tp_rank=0,
        pcp_rank=0,
        dcp_rank=0,
        pp_rank=0,
        cache_prefix=str(extra.get("cache_prefix", "")),
        store_namespace="",
    )
    w._group_tp_replication_factors = w._compute_group_tp_replication_factors()
    w.token_dbs = w._build_token_databases(md, None)
    w._init_lookup_key_prefixes()
    w.store = store
    w.kv_send_thread = None
    w._record_kv_connector_operation = lambda *a, **k: None
    w.tail_key_errors = 0
    real_lookup = w.lookup

    def lookup(num_tokens, block_hashes):
        # vLLM's _tail_key_boundaries asserts on some store contents, which
        # kills vLLM's server thread (its client then waits forever); kvhit
        # answers a miss there. Count it and answer that miss here too.
        try:
            return real_lookup(num_tokens, block_hashes)
        except AssertionError:
            w.tail_key_errors += 1
            return MooncakeLookupResult(0)

    w.lookup = lookup
    return w


def make_request(rid: str, tokens: list[int], hash_block_size: int, max_tokens: int):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )


@dataclass
class Side:
    """One Scheduler with its connector, worker and lookup server(s)."""

    name: str
    scheduler: Any
    worker: Any
    servers: list = field(default_factory=list)
    hash_block_size: int = 16

    def close(self) -> None:
        for s in self.servers:
            if type(s).__name__ == "LookupKeyServer":
                stop_vllm_lookup_server(s, self.scheduler.vllm_config)
            else:
                s.close()
        conn = self.scheduler.connector
        client = conn.connector_scheduler.client
        try:
            client.close()
        except Exception:
            pass


def build_side(
    kind: str,
    case: LayoutCase,
    store,
    extra: dict[str, Any],
    num_blocks: int = 400,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
) -> Side:
    """``kind``: "stock" (vLLM's MooncakeStoreConnector) or "kvhit"."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        LookupKeyServer,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    extra = dict(extra, lookup_rpc_port=next_port())
    if kind == "stock":
        vc = vllm_config("MooncakeStoreConnector", case, extra, max_num_seqs,
                         max_num_batched_tokens)  # fmt: skip
    else:
        vc = vllm_config("KvhitMooncakeStoreConnector", case, extra, max_num_seqs,
                         max_num_batched_tokens, KVHIT_MODULE)  # fmt: skip
    kvc = kv_cache_config(case, num_blocks)
    bs, hbs = resolve_sizes(kvc, vc)
    vc.cache_config.num_gpu_blocks = num_blocks
    worker = fake_worker(vc, kvc, store)
    servers: list = [LookupKeyServer(worker, vc)]
    if kind == "kvhit":
        from kvhit.bindings.vllm_lookup_server import KvhitLookupServer

        servers.append(KvhitLookupServer(worker, vc))
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=kvc,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=bs,
        hash_block_size=hbs,
    )
    return Side(kind, sched, worker, servers, hbs)


def stop_vllm_lookup_server(server, vc) -> None:
    """vLLM's ``LookupKeyServer.close`` closes the socket under its thread's
    blocking ``recv`` (a ZMQ assertion aborts the process): end the loop with
    one last message first, then close."""
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        get_zmq_rpc_path_lookup,
    )

    server.running = False
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(get_zmq_rpc_path_lookup(vc))
    sock.send(b"kvhit-test-stop")
    sock.poll(5000)
    sock.close(linger=0)
    server.thread.join(timeout=5)
    server.close()


def model_runner_output(scheduler_output, finished_recving=None):
    """What the model runner would return: one token per scheduled request,
    every store job of the step done (so pinned blocks are released), and
    ``finished_recving`` loads complete."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeStoreWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    meta = scheduler_output.kv_connector_metadata
    jobs = {
        m.store_job_id: 1
        for m in getattr(meta, "requests", ())
        if m.store_job_id is not None
    }
    kvo = KVConnectorOutput(
        finished_recving=set(finished_recving or ()) or None,
        kv_connector_worker_meta=MooncakeStoreWorkerMetadata(completed_saves=jobs),
    )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kvo,
    )


# -- faults ---------------------------------------------------------------------------


class FaultStore(CountingStore):
    """A :class:`CountingStore` that can misbehave: ``delay_s`` per call,
    ``gate`` (a cleared ``threading.Event``: every call waits for it, at most
    ``max_hang_s``), ``fail`` (an exception raised), ``answer`` (a callable
    turning the keys into the answer, e.g. strings)."""

    def __init__(self, keys: set[str] | None = None) -> None:
        super().__init__(keys)
        self.gate: threading.Event | None = None
        self.max_hang_s = 30.0
        self.fail: BaseException | None = None
        self.answer = None
        self.faulty_calls = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        gate, fail, answer, delay = self.gate, self.fail, self.answer, self.delay_s
        if gate is not None or fail is not None or answer is not None or delay:
            self.faulty_calls += 1
        if gate is not None:
            gate.wait(self.max_hang_s)
        if delay:
            time.sleep(delay)
        if fail is not None:
            raise fail
        with self.lock:
            self.calls += 1
            self.keys_asked += len(keys)
            got = [1 if k in self.keys else 0 for k in keys]
        return answer(got) if answer is not None else got

    def heal(self) -> None:
        gate, self.gate = self.gate, None
        self.fail = self.answer = None
        self.delay_s = 0.0
        if gate is not None:
            gate.set()


@dataclass
class Step:
    """One ``schedule()``: its wall time and the kvhit client's answers
    (``(req_id, num_tokens, block_hashes, result or None)``)."""

    wait_s: float
    answers: list = field(default_factory=list)
    out: Any = None
    #: of ``wait_s``, the time spent inside the kvhit client's lookups
    lookup_s: float = 0.0


class Driver:
    """Steps a kvhit Side's real Scheduler, timing ``schedule()`` and
    recording every answer the kvhit client gives."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.sched = side.scheduler
        self.client = self.sched.connector.kvhit_client
        self._answers: list = []
        self._lookup_s = 0.0
        real = self.client.lookup

        def lookup(req_id, num_tokens, block_hashes, non_block=False):
            t0 = time.perf_counter()
            got = real(req_id, num_tokens, block_hashes, non_block)
            self._lookup_s += time.perf_counter() - t0
            self._answers.append((req_id, num_tokens, list(block_hashes), got))
            return got

        self.client.lookup = lookup
        self.max_tokens = 4

    def add(self, rid: str, tokens: list[int], max_tokens: int | None = None) -> None:
        self.sched.add_request(
            make_request(rid, tokens, self.side.hash_block_size,
                         max_tokens or self.max_tokens)
        )  # fmt: skip

    def abort(self, rids) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)

    def step(self) -> Step:
        self._answers = []
        self._lookup_s = 0.0
        t0 = time.perf_counter()
        out = self.sched.schedule()
        wait = time.perf_counter() - t0
        rec = Step(wait, self._answers, out, self._lookup_s)
        self.sched.update_from_output(out, model_runner_output(out))
        return rec

    def truth(self, rec: Step) -> list[str]:
        """Mismatches between the step's answers and vLLM's own worker lookup
        (``MooncakeStoreWorker.lookup``) on the store as it is now."""
        bad = []
        for rid, n, hashes, got in rec.answers:
            if got is None:
                continue
            try:
                want = self.side.worker.lookup(n, hashes)
            except AssertionError:  # vLLM's _tail_key_boundaries: kvhit misses
                want = type(got)(0)
            if (got.hit_length, got.tail_key_boundaries) != (
                want.hit_length,
                want.tail_key_boundaries,
            ):
                bad.append(f"{rid}: kvhit {got} vLLM {want}")
        return bad


def resources() -> dict[str, int]:
    """This process's threads, open fds, sockets among them, and RSS (KiB);
    ``store_threads``: the store pools' workers among the threads (a pool
    keeps up to its size of them between calls)."""
    import os

    fds = os.listdir("/proc/self/fd")
    socks = 0
    for fd in fds:
        try:
            socks += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    status = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
    )
    return {
        "threads": int(status["Threads"]),
        "store_threads": sum(
            t.name == "kvhit-store-call" for t in threading.enumerate()
        ),
        "fds": len(fds),
        "sockets": socks,
        "rss_kib": int(status["VmRSS"].split()[0]),
    }
