"""KvhitLookupServer over vLLM's REAL worker role, on the CPU.

A gloo world of one (``init_distributed_environment(backend="gloo")``,
``ensure_model_parallel_initialized(1, 1)``) and a local ``mooncake_master``
(tests/mooncake_fixture.py) let vLLM 0.33.0 build the worker role of
``KvhitMooncakeStoreConnector`` as a serving engine does: vLLM's own
``MooncakeStoreWorker.__init__`` (its ``MooncakeDistributedStore`` set up from
``MOONCAKE_CONFIG_PATH``, its ``LookupKeyServer``, its key prefixes) and, beside
it, the ``KvhitLookupServer`` the connector starts. Keys are put through the
worker's own store handle, spelled as the worker spells them
(``PoolKey.build_key_string`` over ``worker._lookup_key_prefixes``); then,
for every layout of tests/vllm_sched_harness.py, kvhit's answers (direct,
packed, and over the connector's IPC socket) are compared with the real
``worker.lookup`` per request: hit length and tail key boundaries, 0
mismatches, and exactly one ``batch_is_exist`` per kvhit batch.

Saves need ``torch.cuda.Event``, so only lookups run here. Skips (saying why)
only where vLLM's sources or Mooncake are not installed.
"""

from __future__ import annotations

import contextlib
import json
import random
import time

import pytest
import vllm_sched_harness
from conftest import short_ipc_dir

from kvhit.bench import vllm_oracle as vo

# The faults below bound a step's wait to about a second: run alone, never
# beside another test process (make test's second pass).
pytestmark = pytest.mark.timing


@pytest.fixture(scope="module")
def world():
    """vLLM importable, a local master, vLLM's Mooncake config pointing at
    it, and a gloo world of one; all torn down after the module."""
    mods, reason = vo.load_vllm()
    if mods is None:
        pytest.skip(reason)
    from mooncake_fixture import HOST, MooncakeMaster, free_port, mooncake_unavailable

    why = mooncake_unavailable()
    if why:
        pytest.skip(why)
    with (
        vo.vllm_importable(),
        pytest.MonkeyPatch.context() as mp,
        contextlib.ExitStack() as stack,
    ):
        import torch.distributed as dist
        import vllm_sched_harness as h
        from vllm.config import set_current_vllm_config
        from vllm.distributed import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        assert not dist.is_initialized(), "another test left a process group"
        base = stack.enter_context(short_ipc_dir())
        mp.setenv("VLLM_RPC_BASE_PATH", str(base))
        # The transfer engine and vLLM's requester hostname: loopback only.
        mp.setenv("MC_TCP_BIND_ADDRESS", HOST)
        mp.setenv("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", HOST)
        with MooncakeMaster() as master:
            cfg = base / "mooncake.json"
            cfg.write_text(
                json.dumps(
                    {
                        "metadata_server": master.address.metadata_server,
                        "master_server_address": master.address.master_server_address,
                        "protocol": "tcp",
                        "device_name": "",
                        "global_segment_size": 32 << 20,
                        "local_buffer_size": 16 << 20,
                    }
                )
            )
            mp.setenv("MOONCAKE_CONFIG_PATH", str(cfg))
            # The parallel state reads the engine's config (a world of one).
            vc = h.vllm_config("MooncakeStoreConnector", h.LAYOUTS[0], {})
            with set_current_vllm_config(vc):
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    distributed_init_method=f"tcp://{HOST}:{free_port()}",
                    local_rank=0,
                    backend="gloo",
                )
            try:
                with set_current_vllm_config(vc):
                    ensure_model_parallel_initialized(1, 1)
                h.master = master  # the fault tests stop and restart it
                yield h
            finally:
                destroy_model_parallel()
                destroy_distributed_environment()
                master.stop()
        assert not dist.is_initialized()


class CountingStore:
    """The worker's ``MooncakeDistributedStore``, counting ``batch_is_exist``
    (everything else goes to the real handle)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def batch_is_exist(self, keys):
        self.calls += 1
        return self.inner.batch_is_exist(keys)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """A few shared system prompts, then tails; 8..300 tokens."""
    import vllm_sched_harness as h

    return h.shared_prompts(rng, n, system=(20, 120), tail=(1, 180), length=(8, 300))


def store_keys(rng, worker, all_hashes, partial_tail) -> list[str]:
    """Keys as vLLM's saves leave them, with holes, spelled by the worker's
    own prefixes: each group's blocks keyed at their last hash up to a random
    length, now and then a partial tail block keyed inside it, and some stray
    hashes. ``partial_tail``: hashes of one prompt whose attention tail key
    lies past a (Mamba-limited) partial hit."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        PoolKey,
    )

    hbs = worker.hash_block_size
    keyed: set[tuple[int, bytes]] = set()
    for hashes in all_hashes:
        if not hashes or rng.random() < 0.25:
            continue
        keep = rng.randrange(0, len(hashes) + 1)
        for g, db in enumerate(worker.token_dbs):
            per_block = db.block_size // hbs
            idx = [i for i in range(keep) if (i + 1) % per_block == 0]
            if keep % per_block and rng.random() < 0.8:
                start = keep - keep % per_block
                idx.append(keep - 1 if g == 0 else rng.randrange(start, keep))
            idx += [rng.randrange(len(hashes)) for _ in range(rng.randrange(3))]
            keyed.update((g, bytes(hashes[i])) for i in idx if rng.random() < 0.97)
    if partial_tail is not None:
        # Blocks of 4 hashes: attention keyed at 3, 7, 10, Mamba at 3, 7, 8:
        # the hit is 9 hashes, attention's tail key is at 11.
        for g, pattern in enumerate(((3, 7, 10), (3, 7, 8))):
            keyed.update((g, bytes(partial_tail[i])) for i in pattern)
    return sorted(
        PoolKey.build_key_string(p, h.hex())
        for g, h in keyed
        for p in worker._lookup_key_prefixes[g]
    )


def vllm_answer(worker, n, hashes):
    """The real ``MooncakeStoreWorker.lookup``; its ``_tail_key_boundaries``
    asserts on some stores (vLLM's server thread dies there), kvhit answers
    a miss, so that is the expected answer."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeLookupResult,
    )

    try:
        return worker.lookup(n, hashes)
    except AssertionError:
        return MooncakeLookupResult(0)


def pair(r) -> tuple:
    return r.hit_length, tuple(
        (b.group_id, b.num_tokens) for b in r.tail_key_boundaries
    )


def ipc_batch(vc, items):
    """One message to the connector's started server, as its client sends."""
    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
        decode_lookup_response,
    )

    from kvhit.bindings.vllm_wire import kvhit_rpc_path

    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kvhit_rpc_path(vc))
    try:
        sock.send(msgspec.msgpack.encode(items))
        assert sock.poll(10000), "the kvhit server did not reply"
        return [decode_lookup_response(r) for r in msgspec.msgpack.decode(sock.recv())]
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize(
    "case_i",
    range(len(vllm_sched_harness.LAYOUTS)),
    ids=[c.name for c in vllm_sched_harness.LAYOUTS],
)
def test_real_worker_lookup_vs_kvhit(world, case_i):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        MooncakeStoreWorker,
    )

    from kvhit.bindings.vllm_connector import KvhitMooncakeStoreConnector
    from kvhit.bindings.vllm_lookup_server import KvhitLookupServer

    h = world
    case = h.LAYOUTS[case_i]
    rng = random.Random(100 + case_i)
    # A cache_prefix of its own: the cases share one master.
    extra = {"lookup_rpc_port": h.next_port(), "cache_prefix": f"wr{case_i}",
             "load_async": False}  # fmt: skip
    vc = h.vllm_config("KvhitMooncakeStoreConnector", case, extra,
                       module_path=h.KVHIT_MODULE)  # fmt: skip
    kvc = h.kv_cache_config(case, 100)
    h.resolve_sizes(kvc, vc)
    conn = KvhitMooncakeStoreConnector(vc, KVConnectorRole.WORKER, kvc)
    worker = conn.connector_worker
    try:
        assert type(worker) is MooncakeStoreWorker
        assert worker.lookup_server is not None and conn.kvhit_server is not None
        assert conn.kvhit_server.fallback_reason is None
        raw = worker.store
        assert type(raw).__name__ == "MooncakeDistributedStore"
        store = CountingStore(raw)
        worker.store = store

        hbs = worker.hash_block_size
        reqs = prompts(rng, 40)
        partial = worker.coord.enable_partial_hash_hits
        if partial:
            reqs[-1] = [rng.randrange(3, 1000) for _ in range(100)]
        batch = [
            (len(t), list(h.make_request("x", t, hbs, 1).block_hashes)) for t in reqs
        ]
        batch.append((0, []))  # an empty request rides along
        # The planted prompt gets no random keys of its own.
        hashes = [hs for _, hs in batch[: -2 if partial else -1]]
        keys = store_keys(rng, worker, hashes, batch[-2][1] if partial else None)
        assert raw.put_batch(keys, [b"kv" * 8] * len(keys)) == 0
        assert sum(raw.batch_is_exist(keys)) == len(keys)

        want = [pair(vllm_answer(worker, n, hs)) for n, hs in batch]
        assert any(w[0] > 0 for w in want) and any(w[0] == 0 for w in want)
        if partial:
            # The planted prompt: a partial hit with a tail key past it.
            assert want[-2] == (72, ((0, 88), (1, 72))), want[-2]

        server = KvhitLookupServer(worker, vc, start=False)
        store.calls = 0
        got = [pair(r) for r in server.resolve(batch)]
        assert store.calls == 1
        bad = [f"req {i} {batch[i][0]} tokens: kvhit {g} vLLM {w}"
               for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]  # fmt: skip
        assert bad == [], "\n".join(bad[:10])

        # The wire format, directly and over the connector's own server.
        packed = [(n, len(hs[0]) if hs else 0, b"".join(hs)) for n, hs in batch]
        store.calls = 0
        assert [pair(r) for r in server.resolve_packed(packed)] == want
        assert store.calls == 1
        store.calls = 0
        cuts = [0, 7, 8, 25, len(packed)]  # one single-request batch
        over_ipc = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            over_ipc += [pair(r) for r in ipc_batch(vc, packed[a:b])]
        assert over_ipc == want
        assert store.calls == len(cuts) - 1
        assert conn.kvhit_server.last_error is None
        # The tail boundary differs from the hit somewhere (partial hits).
        if partial:
            assert any(b != w[0] for w in want for _, b in w[1])
    finally:
        worker.store = getattr(worker.store, "inner", worker.store)
        h.stop_vllm_lookup_server(worker.lookup_server, vc)
        conn.shutdown()
        assert worker.store is None


# -- faults against the real master --------------------------------------------------

#: The connector's defaults: a schedule() waits at most 1 s for the store.
BOUND_S = 1.0
#: Over the bound: the Scheduler's own work and a loaded 2-core host.
SLACK_S = 0.5
#: The least time between two steps' starts in the SIGSTOP test (a short
#: forward pass).
STEP_S = 0.05


def _healthy_start(d, reqs, waits: list[float], pace_s: float = 0.0):
    """A ``step()`` that adds 3 more of ``reqs`` and runs one scheduler step
    (at most one per ``pace_s``), noting its lookup wait in ``waits``;
    three such steps are run and must match vLLM's worker with some hits."""
    k = 0
    last = 0.0

    def step():
        nonlocal k, last
        if pace_s:
            time.sleep(max(0.0, last + pace_s - time.monotonic()))
            last = time.monotonic()
        for _ in range(3):
            d.add(f"r{k}", reqs[k % len(reqs)])
            k += 1
        rec = d.step()
        waits.append(rec.wait_s)
        return rec

    recs = [step() for _ in range(3)]
    assert all(d.truth(r) == [] for r in recs) and any(_hits(r) for r in recs)
    return step


def _end_to_end(h, tag: str):
    """vLLM's real Scheduler with the kvhit connector (scheduler role) and the
    connector's worker role over the real master, on one config: every
    lookup crosses the connector's IPC socket to the KvhitLookupServer the
    worker role started. Returns (driver, worker, close)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvhit.bindings.vllm_connector import KvhitMooncakeStoreConnector

    case = h.LAYOUTS[1]
    extra = {"lookup_rpc_port": h.next_port(), "cache_prefix": tag,
             "load_async": False}  # fmt: skip
    vc = h.vllm_config("KvhitMooncakeStoreConnector", case, extra, 16, 512,
                       module_path=h.KVHIT_MODULE)  # fmt: skip
    kvc = h.kv_cache_config(case, 400)
    bs, hbs = h.resolve_sizes(kvc, vc)
    vc.cache_config.num_gpu_blocks = 400
    conn = KvhitMooncakeStoreConnector(vc, KVConnectorRole.WORKER, kvc)
    worker = conn.connector_worker
    assert conn.kvhit_server is not None and conn.kvhit_server.fallback_reason is None
    sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=True,
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=bs, hash_block_size=hbs)  # fmt: skip
    side = h.Side("kvhit", sched, worker, [], hbs)
    driver = h.Driver(side)

    def close():
        side.close()
        h.stop_vllm_lookup_server(worker.lookup_server, vc)
        conn.shutdown()

    return driver, worker, conn.kvhit_server, close


def _hits(rec) -> list[int]:
    return [a[3].hit_length for a in rec.answers if a[3] is not None]


def _stored_prompts(h, worker, rng, n: int):
    reqs = prompts(rng, n)
    hashes = [list(h.make_request("x", t, worker.hash_block_size, 1).block_hashes)
              for t in reqs]  # fmt: skip
    keys = store_keys(rng, worker, hashes, None)
    assert worker.store.put_batch(keys, [b"kv" * 8] * len(keys)) == 0
    return reqs


def _report(name: str, waits: list[float]) -> None:
    print(f"\n[{name}] steps {len(waits)}, worst schedule() {max(waits):.3f} s")


def test_master_sigstop_then_sigcont(world):
    """The master frozen (SIGSTOP) for 3x the store timeout mid-run: no
    schedule() waits longer than the bound, the requests looked up meanwhile
    get misses, in-flight store calls stay within the pool, and hits come
    back within one step of SIGCONT (the step that starts while the resumed
    master still answers the stuck calls may miss), equal to vLLM's worker."""
    import os
    import signal

    h = world
    rng = random.Random(7)
    d, worker, server, close = _end_to_end(h, "sigstop")
    waits = []
    pid = h.master.proc.pid
    try:
        reqs = _stored_prompts(h, worker, rng, 30)
        # A step at most every STEP_S, as a model's forward pass paces
        # vLLM's steps: back to back, the steps of an empty model come a
        # millisecond apart and a step counts no time.
        step = _healthy_start(d, reqs, waits, pace_s=STEP_S)
        os.kill(pid, signal.SIGSTOP)
        try:
            t_end = time.monotonic() + 3 * server.store_timeout_s
            while time.monotonic() < t_end:
                rec = step()
                assert all(x == 0 for x in _hits(rec))
                assert rec.wait_s < BOUND_S + SLACK_S
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        frozen = server.store_stats()
        # The stuck calls hold at most the pool's slots, however long the
        # freeze; a step after the resume asks the store on a free slot (or
        # on one the resumed master just freed) and answers from it.
        assert frozen.in_flight <= frozen.size and frozen.timeouts >= 1
        deadline = resumed + 20
        back, after = False, []
        while not back and time.monotonic() < deadline:
            rec = step()
            back = any(_hits(rec))
            after.append((round(time.monotonic() - resumed, 3), server.store_stats(),
                          repr(server.last_error)[:120]))  # fmt: skip
        steps_to_hits = len(after)
        assert back, f"no hit within 20 s of SIGCONT (last error {server.last_error!r})"
        assert steps_to_hits <= 2, "\n".join(map(str, after[:3] + after[-2:]))
        recs = [step() for _ in range(3)]
        assert all(d.truth(r) == [] for r in [rec, *recs])
        st = server.store_stats()
        assert st.max_in_flight <= st.size
        print(f"\n[SIGCONT] hits again at step {steps_to_hits} after the resume "
              f"({time.monotonic() - resumed:.3f} s); while frozen {frozen}")  # fmt: skip
    finally:
        close()
    assert max(waits) < BOUND_S + SLACK_S
    _report("master SIGSTOP/SIGCONT", waits)


def test_master_killed_and_restarted_empty(world):
    """The master killed, then restarted empty on the same address: misses
    meanwhile, each step within the bound; never a hit for a key the new
    master lacks; then the connector either serves the new master's keys
    (reconnected) or keeps answering misses with the store error logged."""
    import signal

    from kvhit.bindings.mooncake_store import StoreError

    h = world
    rng = random.Random(8)
    d, worker, server, close = _end_to_end(h, "restart")
    waits = []
    try:
        reqs = _stored_prompts(h, worker, rng, 30)
        step = _healthy_start(d, reqs, waits)
        h.master.proc.send_signal(signal.SIGKILL)
        h.master.proc.wait(10)
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            assert all(x == 0 for x in _hits(step()))
        h.master.start()  # same address, empty
        t_end = time.monotonic() + 6
        while time.monotonic() < t_end:
            assert all(x == 0 for x in _hits(step())), "a hit the new master lacks"
        # One prompt's keys into the new master, through the worker's handle.
        fresh = [rng.randrange(3, 1000) for _ in range(96)]
        hashes = list(
            h.make_request("x", fresh, worker.hash_block_size, 1).block_hashes
        )
        keys = [f"{p}@{bytes(x).hex()}"
                for g, ps in enumerate(worker._lookup_key_prefixes)
                for x in hashes for p in ps]  # fmt: skip
        rc = worker.store.put_batch(keys, [b"kv" * 8] * len(keys))
        outcome = "put refused"
        if rc == 0:
            deadline = time.monotonic() + 15
            n = 0
            while time.monotonic() < deadline:
                d.add(f"f{n}", fresh)
                n += 1
                rec = d.step()
                waits.append(rec.wait_s)
                if any(_hits(rec)):
                    assert d.truth(rec) == []
                    outcome = "reconnected: hits from the new master"
                    break
            else:
                outcome = "put accepted, no hit"
        if not outcome.startswith("reconnected"):
            assert isinstance(server.last_error, StoreError), server.last_error
        print(f"\n[master restarted empty] {outcome}; last error {server.last_error!r}")
    finally:
        close()
    assert max(waits) < BOUND_S + SLACK_S
    _report("master killed, restarted empty", waits)
