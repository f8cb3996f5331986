"""KvhitMooncakeStoreConnector against vLLM's stock MooncakeStoreConnector,
both inside vLLM 0.33.0's real ``Scheduler`` on the CPU.

The same requests (vLLM's own block hasher), arrivals, aborts and store run
through two Schedulers: one with vLLM's ``MooncakeStoreConnector`` served by
vLLM's ``LookupKeyServer``, one with kvhit's connector served by
``KvhitLookupServer``, both over vLLM's own ``MooncakeStoreWorker`` (built with
``object.__new__`` and its own key helpers, see tests/vllm_sched_harness.py)
and one counting store. Every step is compared per request: the LoadSpec
(tail key boundaries included), the block ids and computed tokens of newly
scheduled requests, the scheduled tokens, the preempted requests and every
request's status and computed tokens after the step. Store calls are counted
per step: one for kvhit whatever the number of waiting requests.

Skips (saying why) only where vLLM's sources cannot be installed
(``.ci/install-vllm-oracle``).
"""

from __future__ import annotations

import random
import time

import pytest
import vllm_sched_harness


@pytest.fixture
def harness(sched_harness):
    return sched_harness


# -- a workload -------------------------------------------------------------------


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Requests sharing a few system prompts, lengths 20..330 tokens."""
    import vllm_sched_harness as h

    return h.shared_prompts(rng, n, system=(24, 140), tail=(4, 190), length=(20, 330))


def fill_store(h, rng, store, worker, reqs, hash_block_size, skip=()):
    """Keys as vLLM's saves leave them, with holes: each group's blocks keyed
    by the last hash inside them, up to a random length, and now and then a
    partial tail block keyed by a hash inside its block (so hits stop early
    and, with partial hash hits, tail keys lie past the hit)."""
    for r, toks in enumerate(reqs):
        if r in skip or rng.random() < 0.3:
            continue
        hashes = h.make_request("x", toks, hash_block_size, 1).block_hashes
        keep = rng.randrange(0, len(hashes) + 1)
        groups = zip(worker.token_dbs, worker._lookup_key_prefixes, strict=True)
        for g, (db, prefixes) in enumerate(groups):
            per_block = db.block_size // hash_block_size
            keyed = [i for i in range(keep) if (i + 1) % per_block == 0]
            if keep % per_block and rng.random() < 0.9:
                # Like a save of a prompt ending at ``keep``: attention keys
                # its partial tail block at the prompt's end, Mamba its state
                # at a checkpoint inside that block.
                start = keep - keep % per_block
                keyed.append(keep - 1 if g == 0 else rng.randrange(start, keep))
            for i in keyed:
                if rng.random() < 0.97:
                    for p in prefixes:
                        store.keys.add(f"{p}@{bytes(hashes[i]).hex()}")


def plant_partial_tail(h, store, worker, toks, hash_block_size):
    """A prompt whose attention tail key lies past the hit: blocks of 4 hashes,
    attention keyed at hashes 3, 7 and 10 (its partial tail), Mamba at 3, 7
    and 8: the hit is 72 tokens (Mamba's state), attention's tail key is at
    88 (vLLM's ``_tail_key_boundaries`` search)."""
    hashes = h.make_request("x", toks, hash_block_size, 1).block_hashes
    pattern = {0: (3, 7, 10), 1: (3, 7, 8)}
    for g, prefixes in enumerate(worker._lookup_key_prefixes):
        for i in pattern[g]:
            for p in prefixes:
                store.keys.add(f"{p}@{bytes(hashes[i]).hex()}")


# -- one run ------------------------------------------------------------------------


def snapshot(out, sched) -> dict:
    meta = out.kv_connector_metadata
    loads = {}
    for m in getattr(meta, "requests", ()):
        ls = m.load_spec
        if ls is not None:
            loads[m.req_id] = (
                ls.vllm_cached_tokens,
                ls.kvpool_cached_tokens,
                ls.can_load,
                tuple((b.group_id, b.num_tokens) for b in ls.tail_key_boundaries),
            )
    return {
        "scheduled": dict(out.num_scheduled_tokens),
        "new": {
            r.req_id: (tuple(tuple(b) for b in r.block_ids), r.num_computed_tokens)
            for r in out.scheduled_new_reqs
        },
        "loads": loads,
        "preempted": sorted(out.preempted_req_ids or ()),
        "finished": sorted(out.finished_req_ids),
    }


def wait_lookups(side, timeout: float = 10.0) -> None:
    """lookup_async: let every batch in flight finish before the next step,
    so both connectors see their answers in the same step."""
    client = side.scheduler.connector.connector_scheduler.client
    futures = list(getattr(client, "futures", {}).values())
    pending = getattr(client, "pending", None)
    if pending is not None:
        futures.append(pending)
    end = time.monotonic() + timeout
    for f in futures:
        while not f.done() and time.monotonic() < end:
            time.sleep(0.002)


def run(h, kind, case, seed, store, reqs, lookup_async, arrivals, aborts,
        num_blocks, max_steps=200):  # fmt: skip
    from vllm.v1.request import RequestStatus

    extra = {"load_async": False, "lookup_async": lookup_async}
    side = h.build_side(kind, case, store, extra, num_blocks=num_blocks,
                        max_num_seqs=16, max_num_batched_tokens=512)  # fmt: skip
    sched = side.scheduler
    steps, calls = [], []
    answers: list = []
    if kind == "kvhit":
        client = sched.connector.kvhit_client
        real_lookup = client.lookup

        def lookup(req_id, num_tokens, block_hashes, non_block=False):
            got = real_lookup(req_id, num_tokens, block_hashes, non_block)
            answers.append((req_id, num_tokens, list(block_hashes), got))
            return got

        client.lookup = lookup
    try:
        for step in range(max_steps):
            for i in arrivals.get(step, ()):
                sched.add_request(
                    h.make_request(f"r{i}", reqs[i], side.hash_block_size, 6 + i % 14)
                )
            if step in aborts:
                sched.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
            c0 = store.calls
            out = sched.schedule()
            snap = snapshot(out, sched)
            if lookup_async:
                wait_lookups(side)
            calls.append(store.calls - c0)
            sched.update_from_output(out, h.model_runner_output(out))
            snap["after"] = {
                rid: (int(r.status), r.num_computed_tokens)
                for rid, r in sorted(sched.requests.items())
            }
            steps.append(snap)
            if step > max(arrivals) and not sched.has_requests():
                break
        tracked = None
        if kind == "kvhit":
            tracked = set(side.scheduler.connector.kvhit_client.tracked)
            assert tracked == set(sched.requests), "tracking != live requests"
        return steps, calls, tracked, side.worker, answers
    finally:
        side.close()


def compare(a, b) -> list[str]:
    out = []
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        for key in x:
            if x[key] != y[key]:
                out.append(f"step {step} {key}: stock {x[key]} kvhit {y[key]}")
    if len(a) != len(b):
        out.append(f"steps: stock {len(a)} kvhit {len(b)}")
    return out


CASES = [
    (case, seed, lookup_async)
    for case_i, case in enumerate(vllm_sched_harness.LAYOUTS)
    for seed, lookup_async in ((case_i + 20, False), (case_i + 10, True))
]


@pytest.mark.parametrize(
    "case, seed, lookup_async",
    CASES,
    ids=[f"{c.name}-s{s}-{'async' if a else 'sync'}" for c, s, a in CASES],
)
def test_scheduler_stock_vs_kvhit(harness, case, seed, lookup_async):
    h = harness
    rng = random.Random(seed)
    n = 22
    reqs = prompts(rng, n)
    arrivals = {0: list(range(14)), 3: list(range(14, 18)), 6: list(range(18, n))}
    aborts = {2: ["r1", "r15"], 5: ["r16", "r5"]}
    store = h.CountingStore(delay_s=0.005 if lookup_async else 0.0)
    store_probe = h.build_side("stock", case, h.CountingStore(), {})
    worker = store_probe.worker
    store_probe.close()
    partial = worker.coord.enable_partial_hash_hits
    if partial:
        # Two prompts of their own (no shared prefix) with a known partial
        # hit whose attention tail key lies past the hit.
        for i in (n - 2, n - 1):
            reqs[i] = [rng.randrange(3, 1000) for _ in range(100)]
            plant_partial_tail(h, store, worker, reqs[i], worker.hash_block_size)
    fill_store(h, rng, store, worker, reqs, worker.hash_block_size,
               skip=(n - 2, n - 1) if partial else ())  # fmt: skip
    # Few blocks: requests are preempted and re-looked-up.
    num_blocks = 48 if case.groups[0][1] == 16 else 40
    mamba = any(kind == "mamba" for kind, _ in case.groups)
    if mamba:
        # vLLM 0.33.0's Mamba manager fails to allocate ("Cannot get 1 free
        # blocks") when a preempted request resumes in a pool this small.
        num_blocks = 160
    stock, stock_calls, _, _, _ = run(h, "stock", case, seed, store, reqs,
                                      lookup_async, arrivals, aborts, num_blocks)  # fmt: skip
    kvhit, kvhit_calls, tracked, kw, answers = run(h, "kvhit", case, seed, store, reqs,
                                                   lookup_async, arrivals, aborts,
                                                   num_blocks)  # fmt: skip
    # Every answer kvhit gave the Scheduler is what vLLM's own worker lookup
    # (MooncakeStoreWorker.lookup, per request) returns on the same store.
    bad = []
    for rid, ntok, hashes, got in answers:
        if got is None:
            continue
        want = kw.lookup(ntok, hashes)
        if (got.hit_length, got.tail_key_boundaries) != (
            want.hit_length,
            want.tail_key_boundaries,
        ):
            bad.append(f"{rid}: kvhit {got} vLLM {want}")
    assert bad == [], "\n".join(bad[:10])
    assert any(a[3] is not None and a[3].hit_length > 0 for a in answers)
    if lookup_async:
        # vLLM's contract: None until the batch is answered.
        assert any(a[3] is None for a in answers)
        # Timing differs from the stock client (its per-request answers may be
        # steps old; kvhit's never outlive the step): compare the outcome.
        assert stock[-1]["after"] == kvhit[-1]["after"] == {}
        done = [
            set(x)
            for s in (stock, kvhit)
            for x in [sum((st["finished"] for st in s), [])]
        ]
        assert done[0] == done[1]
    else:
        mismatches = compare(stock, kvhit)
        assert mismatches == [], "\n".join(mismatches[:10])
        if not mamba:
            assert any(s["preempted"] for s in stock), "no preemption happened"
    # The runs did what they are meant to exercise.
    loads = [ls for s in stock for ls in s["loads"].values()]
    assert any(ls[1] > 0 and ls[2] for ls in loads), "no load happened"
    if case.prefix_match_unit is not None:
        assert kw.hash_block_size < kw.block_size
    if kw.coord.enable_partial_hash_hits:
        # Partial hash hits: some tail key lies past the hit, inside its block.
        assert any(
            b.num_tokens != a[3].hit_length
            for a in answers
            if a[3] is not None
            for b in a[3].tail_key_boundaries
        ), "no tail key boundary differs from its hit"
    # Store calls: one per step with kvhit (at most), one per request stock.
    assert max(kvhit_calls) <= 1, kvhit_calls
    assert sum(stock_calls) > sum(kvhit_calls)
    assert max(stock_calls) > 1
    # Finished and aborted requests are no longer tracked.
    assert tracked == set()


# -- the server on its own ----------------------------------------------------------


def _server_setup(h, store):
    case = h.LAYOUTS[1]
    extra = {"lookup_rpc_port": h.next_port()}
    vc = h.vllm_config("KvhitMooncakeStoreConnector", case, extra,
                       module_path=h.KVHIT_MODULE)  # fmt: skip
    kvc = h.kv_cache_config(case, 100)
    h.resolve_sizes(kvc, vc)
    return vc, h.fake_worker(vc, kvc, store)


def _stored_server(h, seed: int, n: int):
    """A worker over a fresh CountingStore holding part of ``n`` prompts'
    keys: ``(store, vllm_config, worker, prompts, rng)`` (``rng`` as the
    store was filled, for more draws)."""
    rng = random.Random(seed)
    store = h.CountingStore()
    vc, worker = _server_setup(h, store)
    reqs = prompts(rng, n)
    fill_store(h, rng, store, worker, reqs, worker.hash_block_size)
    return store, vc, worker, reqs, rng


def test_server_store_error_gives_misses_and_replies(harness):
    from kvhit.bindings.vllm_lookup_server import KvhitLookupServer

    h = harness
    store, vc, worker, reqs, rng = _stored_server(h, 5, 6)
    server = KvhitLookupServer(worker, vc, start=False)
    batch = [
        (len(t), list(h.make_request("x", t, worker.hash_block_size, 1).block_hashes))
        for t in reqs
    ]
    good = server.resolve(batch)
    assert any(r.hit_length for r in good)
    assert store.calls == 1

    def broken(keys):
        raise ConnectionError("master gone")

    store.batch_is_exist = broken
    assert [r.hit_length for r in server.resolve(batch)] == [0] * len(batch)
    assert "master gone" in repr(server.last_error)


def test_server_mixed_widths_one_path(harness):
    """Requests of 32-byte and 20-byte hashes (a width of no whole words) in
    one batch: each width's joined blobs become one HashBatch, one store call
    per width, answers equal vLLM's worker per request."""
    from kvhit.bindings.vllm_lookup_server import KvhitLookupServer

    h = harness
    store, vc, worker, reqs, rng = _stored_server(h, 8, 8)
    batch = []
    for i, t in enumerate(reqs):
        hs = list(h.make_request("x", t, worker.hash_block_size, 1).block_hashes)
        if i % 2:
            hs = [x[:20] for x in hs]
            for prefixes in worker._lookup_key_prefixes:
                for x in hs[: rng.randrange(len(hs) + 1)]:
                    store.keys.update(f"{p}@{x.hex()}" for p in prefixes)
        batch.append((len(t), hs))
    batch.append((0, []))
    want = [worker.lookup(n, hs) if n else None for n, hs in batch]
    server = KvhitLookupServer(worker, vc, start=False)
    c0 = store.calls
    got = server.resolve(batch)
    assert store.calls - c0 == 2
    assert got[:-1] == want[:-1] and got[-1].hit_length == 0
    assert any(r.hit_length for r in got[1::2]) and any(r.hit_length for r in got[::2])
    with pytest.raises(ValueError, match="request 0"):
        server.resolve([(16, [b"a" * 32, b"b" * 20])])


def test_server_falls_back_when_keys_differ(harness, caplog):
    from kvhit.bindings.vllm_lookup_server import KvhitLookupServer

    h = harness
    store, vc, worker, reqs, rng = _stored_server(h, 6, 5)
    want = [
        worker.lookup(
            len(t), h.make_request("x", t, worker.hash_block_size, 1).block_hashes
        )
        for t in reqs
    ]
    # A store layout kvhit does not model: its keys differ from the worker's.
    real_prefixes = worker._lookup_key_prefixes
    worker._lookup_key_prefixes = tuple(
        tuple(p.replace("@pp_rank", "@tp_shard:0@pp_rank") for p in ps)
        for ps in real_prefixes
    )
    with caplog.at_level("WARNING"):
        server = KvhitLookupServer(worker, vc, start=False)
    assert server.fallback_reason and "differ" in server.fallback_reason
    assert sum("per-request" in r.getMessage() for r in caplog.records) == 1
    worker._lookup_key_prefixes = real_prefixes  # what vLLM's path then reads
    c0 = store.calls
    got = server.resolve(
        [(len(t), h.make_request("x", t, worker.hash_block_size, 1).block_hashes)
         for t in reqs]
    )  # fmt: skip
    assert store.calls - c0 == len(reqs)  # vLLM's path: one call per request
    assert got == want and any(r.hit_length for r in got)


def test_server_always_replies_over_ipc(harness):
    import msgspec
    import zmq

    from kvhit.bindings.vllm_lookup_server import KvhitLookupServer
    from kvhit.bindings.vllm_wire import kvhit_rpc_path

    h = harness
    store = h.CountingStore()
    vc, worker = _server_setup(h, store)
    server = KvhitLookupServer(worker, vc)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kvhit_rpc_path(vc))
    try:
        for payload in (b"\xc1garbage", msgspec.msgpack.encode([[16, 5, b"abc"]])):
            sock.send(payload)
            assert sock.poll(5000), "no reply"
            assert msgspec.msgpack.decode(sock.recv()) == []
        assert server.thread.is_alive()
    finally:
        sock.close(linger=0)
        server.close()


def test_connector_name_alone_after_register(vllm_env):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvhit.bindings.vllm_connector import KvhitMooncakeStoreConnector, register

    register()
    register()  # vLLM loads plugins in every process: twice is fine
    cls = KVConnectorFactory.get_connector_class_by_name("KvhitMooncakeStoreConnector")
    assert cls is KvhitMooncakeStoreConnector
    # The entry point vLLM's plugin loader calls (read from pyproject.toml:
    # an old egg-info in a checkout can shadow the installed metadata).
    import importlib
    from pathlib import Path

    import tomllib

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["vllm.general_plugins"]["kvhit_connector"]
    module, _, func = target.partition(":")
    assert getattr(importlib.import_module(module), func) is register


def test_scheduler_stock_vs_kvhit_real_master(harness):
    """The same comparison against a real local mooncake_master: both
    servers read a real MooncakeDistributedStore handle."""
    from mooncake_fixture import MooncakeMaster, connect_client, mooncake_unavailable

    why = mooncake_unavailable()
    if why:
        pytest.skip(why)
    h = harness
    case = h.LAYOUTS[1]
    rng = random.Random(42)
    n = 16
    reqs = prompts(rng, n)
    arrivals = {0: list(range(12)), 2: list(range(12, n))}
    aborts = {3: ["r2"]}
    staged = h.CountingStore()
    probe = h.build_side("stock", case, h.CountingStore(), {})
    worker = probe.worker
    probe.close()
    fill_store(h, rng, staged, worker, reqs, worker.hash_block_size)
    with MooncakeMaster() as master:
        raw = connect_client(master)
        try:
            keys = sorted(staged.keys)
            assert raw.put_batch(keys, [b"kv" * 8] * len(keys)) == 0

            class Counting:
                calls = 0

                def batch_is_exist(self, ks):
                    Counting.calls += 1
                    return raw.batch_is_exist(ks)

            store = Counting()
            runs = [
                run(h, kind, case, 42, store, reqs, False, arrivals, aborts, 48)
                for kind in ("stock", "kvhit")
            ]
        finally:
            raw.close()
            master.stop()
    (stock, stock_calls, *_), (kvhit, kvhit_calls, *_) = runs
    assert compare(stock, kvhit) == []
    assert any(ls[1] > 0 for s in stock for ls in s["loads"].values())
    assert max(kvhit_calls) <= 1 < max(stock_calls)


@pytest.mark.parametrize("seed", range(3))
def test_array_reply_reads_as_vllms_encoded_results(vllm_env, seed):
    """The array form a kvhit client gets reads back, request by request,
    exactly as vLLM's own encode/decode of the same results: misses (0 and
    non-positive hits never carry boundaries), hits with a boundary in some
    groups only, empty and single-request batches, a group count of 1..3."""
    import numpy as np
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeLookupResult,
        TailKeyBoundary,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
        decode_lookup_response,
        encode_lookup_response,
    )

    from kvhit.bindings.vllm_wire import EMPTY_REPLY, decode_reply, pack_answer

    rng = np.random.default_rng(seed)
    for b in (0, 1, 7, 300):
        for g in (1, 2, 3):
            hits = rng.integers(0, 5, b) * rng.integers(0, 4000, b)
            tails = rng.integers(0, 3, (b, g)) * rng.integers(1, 4000, (b, g))
            tails[hits <= 0] = 0
            want = [
                MooncakeLookupResult(
                    int(h),
                    tuple(TailKeyBoundary(j, int(n)) for j, n in enumerate(row) if n),
                )
                for h, row in zip(hits, tails, strict=True)
            ]
            via_vllm = [decode_lookup_response(encode_lookup_response(r)) for r in want]
            got = decode_reply(pack_answer(hits, tails))
            assert got == via_vllm == want
            assert all(type(r) is MooncakeLookupResult for r in got)
    assert decode_reply(EMPTY_REPLY) == []
