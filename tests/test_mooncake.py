"""Mooncake store binding (bindings/mooncake_store.py, bindings/store_sync.py).

The first half uses an in-memory fake store (key format, candidate parity with
the reference, one-RPC refresh, the error contract). The second half starts a
real ``mooncake_master`` on 127.0.0.1 (tests/mooncake_fixture.py), stores keys
the way a saving worker would, and checks ``BatchedLookup`` against the
reference over what is really in the store, through removals and a master
that dies mid-run. It skips only where the Mooncake package is unavailable.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch
from mooncake_fixture import MooncakeMaster, connect_client, mooncake_unavailable

from kvhit import CacheLayout, ChunkedLocal, FullAttention, Group, Mamba, SlidingWindow
from kvhit.bindings.mooncake_store import (
    MooncakeKeys,
    StoreBusy,
    StoreCallPool,
    StoreError,
    model_name_for_vllm,
    rank_namespaces_for_vllm,
)
from kvhit.bindings.store_sync import BatchedLookup, StoreSync, candidate_rows
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import HashBatch
from kvhit.coordinator.reference import ReferenceCoordinator

HB = 32  # sha256-wide hashes, as vLLM's default


def dsv4_layout() -> CacheLayout:
    return CacheLayout(
        [
            Group(FullAttention(256)),
            Group(SlidingWindow(64, 128)),
            Group(SlidingWindow(64, 128), eagle=True),
            Group(SlidingWindow(4, 8)),
            Group(SlidingWindow(8, 128)),
        ],
        scheduler_block_size=256,
        hash_block_size=4,
        use_eagle=True,
    )


LAYOUTS = {
    "dsv4": dsv4_layout,
    "hybrid_mamba_partial": lambda: CacheLayout(
        [Group(FullAttention(16)), Group(Mamba(16)), Group(SlidingWindow(8, 16))],
        scheduler_block_size=16,
        hash_block_size=4,
        use_eagle=True,
        partial_hash_hits=True,
    ),
    "chunked_retention": lambda: CacheLayout(
        [
            Group(FullAttention(32)),
            Group(ChunkedLocal(32, 64)),
            Group(SlidingWindow(16, 32, extra_retained_tokens=8)),
            Group(FullAttention(16), prefix_cacheable=False),
        ],
        scheduler_block_size=32,
        hash_block_size=8,
        retention_interval=64,
    ),
}


def chain(seed: bytes, n: int, width: int = HB) -> list[bytes]:
    """Chained block hashes (each folds in the previous one), like vLLM's."""
    out, prev = [], seed
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()[:width]
        out.append(prev)
    return out


def workload(rng: random.Random, layout: CacheLayout, n_req: int, max_blocks: int):
    """Requests sharing prefixes: a few system prompts, each request extends
    one with its own tail; prompts up to ``max_blocks`` scheduler blocks.
    Returns (hash lists, num_tokens)."""
    hbs = layout.hash_block_size
    max_units = max_blocks * layout.scheduler_block_size // hbs
    systems = [chain(b"sys%d" % s, rng.randint(1, max_units // 2)) for s in range(3)]
    reqs, ntoks = [], []
    for r in range(n_req):
        base = systems[rng.randrange(len(systems))]
        tail = chain(b"req%d" % r + base[-1], rng.randint(0, max_units // 2))
        hashes = base + tail
        # Some prompts end exactly on the hashes, some inside the last unit.
        n = len(hashes) * hbs - rng.choice([0, 0, 1, hbs - 1])
        reqs.append(hashes)
        ntoks.append(max(n, 0))
    return reqs, ntoks


def saved_pairs(layout: CacheLayout, hashes: list[bytes], token_len: int):
    """The (group, hash) pairs a saving worker writes for ``token_len`` tokens:
    ``store_mask`` over whole chunks, keyed by each chunk's last hash. Mamba
    states (never in store masks) arrive through vLLM's boundary puts; here
    every block-aligned state is put."""
    ref = ReferenceCoordinator(layout)
    token_len = token_len // layout.alignment * layout.alignment
    hbs = layout.hash_block_size
    masks = ref.store_mask(token_len)
    out = set()
    for g, grp in enumerate(layout.groups):
        if not grp.prefix_cacheable:
            continue
        bs = grp.spec.block_size
        mask = None if isinstance(grp.spec, Mamba) else masks[g]
        for c in range(token_len // bs):
            if mask is None or (c < len(mask) and mask[c]):
                out.add((g, hashes[(c + 1) * (bs // hbs) - 1]))
    return out


def namespaces(layout: CacheLayout, tp: int = 2):
    """Sharded groups (even ids) need every TP rank; replicated ones one."""
    return [
        rank_namespaces_for_vllm(
            tp_size=tp, tp_replication_factor=1 if g % 2 == 0 else tp
        )
        for g in range(layout.num_groups)
    ]


class FakeStore:
    """An in-memory store of key strings recording every existence call."""

    def __init__(self, keys=()):
        self.keys = set(keys)
        self.calls: list[int] = []
        self.fail: Exception | None = None
        self.answer: object | None = None

    def batch_is_exist(self, keys):
        self.calls.append(len(keys))
        if self.fail is not None:
            raise self.fail
        if self.answer is not None:
            return self.answer
        return [1 if k in self.keys else 0 for k in keys]


def put_pairs(keys: MooncakeKeys, pairs, store_keys: set, skip_ns=()):
    for g, h in pairs:
        for j, k in enumerate(keys.keys(g, h)):
            if (g, h, j) not in skip_ns:
                store_keys.add(k)


def store_set(keys: MooncakeKeys, layout: CacheLayout, pairs, present_keys) -> set:
    """Pairs present under every namespace of their group."""
    return {
        (g, h)
        for g, h in pairs
        if layout.groups[g].prefix_cacheable
        and all(k in present_keys for k in keys.keys(g, h))
    }


# -- keys -----------------------------------------------------------------------


def _saved_store(layout: CacheLayout, reqs, ntoks):
    """``(keys, pairs, store)``: one-rank Mooncake keys of model ``m``, the
    ``(group, hash)`` pairs vLLM saves for every request, and a FakeStore
    holding all of them."""
    keys = MooncakeKeys("m", [[(0, 0, 0, 0)]] * 5)
    pairs = set()
    for r, n in zip(reqs, ntoks, strict=True):
        pairs |= saved_pairs(layout, r, n)
    store_keys: set = set()
    put_pairs(keys, pairs, store_keys)
    return keys, pairs, FakeStore(store_keys)


def test_key_strings_match_vllm_format():
    keys = MooncakeKeys(
        "DeepSeek-V4-Flash",
        [[(0, 0, 0, 0), (1, 0, 0, 0)], [(0, 0, 0, 1)]],
        cache_prefix="tenant7",
        store_namespace="@ns",
    )
    h = bytes(range(16))
    assert keys.keys(0, h) == [
        "tenant7@DeepSeek-V4-Flash@ns@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + h.hex(),
        "tenant7@DeepSeek-V4-Flash@ns@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@" + h.hex(),
    ]
    plain = MooncakeKeys("m", [[(3, 1, 2, 4)]])
    assert plain.key(0, h) == f"m@tp_rank:3@pcp1@dcp2@pp_rank:4@group:0@{h.hex()}"
    assert model_name_for_vllm("/models/deepseek-ai/DeepSeek-V4-Flash/") == (
        "DeepSeek-V4-Flash"
    )
    assert rank_namespaces_for_vllm(tp_size=4, dcp_size=2) == (
        (0, 0, 0, 0),
        (1, 0, 1, 0),
        (2, 0, 0, 0),
        (3, 0, 1, 0),
    )
    assert rank_namespaces_for_vllm(tp_size=4, tp_replication_factor=2, pp_size=2) == (
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 0),
        (1, 0, 0, 1),
    )


def test_key_strings_match_real_vllm():
    import importlib

    from kvhit.bench import vllm_oracle as vo

    mods, reason = vo.load_vllm()
    if mods is None:
        pytest.skip(reason)
    with vo.vllm_importable():
        data = importlib.import_module(
            "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data"
        )
    md = data.KeyMetadata(
        model_name="M", tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0, group_id=3,
        cache_prefix="p", store_namespace="@s",
    )  # fmt: skip
    layout = data.RankLocalStoreLayout(md, 16, 4)
    ns = [(0, 0, 0, 0), (1, 0, 1, 2)]
    h = bytes(range(32))
    want = [
        data.PoolKey.build_key_string(p, h.hex())
        for p in layout.lookup_key_prefixes(ns)
    ]
    keys = MooncakeKeys("M", [[]] * 3 + [ns], "p", "@s")
    assert keys.keys(3, h) == want


def test_bad_keys_and_layout_mismatch():
    layout = dsv4_layout()
    with pytest.raises(ValueError, match="rank namespace"):
        MooncakeKeys("m", [[(0, 0, 0)]])
    with pytest.raises(ValueError, match="duplicate"):
        MooncakeKeys("m", [[(0, 0, 0, 0), (0, 0, 0, 0)]])
    idx = KeyIndex(HB)
    with pytest.raises(ValueError, match="5 groups"):
        StoreSync(FakeStore(), MooncakeKeys("m", [[(0, 0, 0, 0)]] * 4), idx, layout)
    with pytest.raises(ValueError, match="no rank namespace"):
        StoreSync(
            FakeStore(), MooncakeKeys("m", [[(0, 0, 0, 0)]] * 4 + [[]]), idx, layout
        )
    with pytest.raises(ValueError, match="share the key group id"):
        StoreSync(
            FakeStore(),
            MooncakeKeys("m", [[(0, 0, 0, 0)]] * 5, key_group_ids=(0, 1, 2, 3, 3)),
            idx,
            layout,
        )
    with pytest.raises(TypeError, match="batch_is_exist"):
        StoreSync(object(), MooncakeKeys("m", [[(0, 0, 0, 0)]] * 5), idx, layout)


# -- candidates -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_candidate_rows_match_reference(name):
    layout = LAYOUTS[name]()
    ref = ReferenceCoordinator(layout)
    rng = random.Random(1)
    reqs, ntoks = workload(rng, layout, 24, 10)
    ntoks[0] = 0
    reqs[1] = []
    # Prompts longer than the hashes given, too.
    ntoks[2] += 5 * layout.scheduler_block_size
    batch = HashBatch.from_bytes(reqs, HB)
    gids, rows, req = candidate_rows(layout, batch.offsets, ntoks)
    flat = [h for r in reqs for h in r]
    got = [[] for _ in reqs]
    for g, row, i in zip(gids.tolist(), rows.tolist(), req.tolist(), strict=True):
        got[i].append((g, flat[row]))
    for i, r in enumerate(reqs):
        assert sorted(got[i]) == sorted(ref.lookup_candidates(ntoks[i], r)), i
    # The engine's vectorised candidates are the same multiset of rows.
    e_g, e_r = LookupEngine(layout, backend="torch").lookup_candidates(batch, ntoks)
    ours = sorted(zip(gids.tolist(), rows.tolist(), strict=True))
    assert sorted(zip(e_g.tolist(), e_r.tolist(), strict=True)) == ours


# -- refresh and lookup over a fake store ------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_lookup_matches_reference_over_fake_store(name, backend):
    layout = LAYOUTS[name]()
    ref = ReferenceCoordinator(layout)
    rng = random.Random(7)
    reqs, ntoks = workload(rng, layout, 32, 10)
    keys = MooncakeKeys("model", namespaces(layout))
    pairs = set()
    for r, n in zip(reqs[:20], ntoks[:20], strict=True):
        pairs |= saved_pairs(layout, r, n)
    pairs = sorted(pairs)
    # Eviction holes, and some pairs stored by only one of two ranks.
    holes = set(rng.sample(pairs, len(pairs) // 40))
    kept = [p for p in pairs if p not in holes]
    skip = {(g, h, 1) for g, h in rng.sample(kept, len(kept) // 40)}
    store_keys: set = set()
    put_pairs(keys, kept, store_keys, skip)
    store = FakeStore(store_keys)
    exists = store_set(keys, layout, pairs, store_keys)

    bl = BatchedLookup(layout, store, keys, hash_bytes=HB, capacity=64, backend=backend)
    batch = HashBatch.from_bytes(reqs, HB)
    hits = bl.lookup(batch, ntoks)
    assert hits.dtype == torch.int64 and hits.shape == (len(reqs),)
    want = [ref.lookup(n, r, exists) for r, n in zip(reqs, ntoks, strict=True)]
    assert hits.tolist() == want
    assert any(want)
    assert store.calls == [bl.last_stats.num_keys_asked]  # one RPC
    st = bl.last_stats
    assert st.num_rpcs == 1 and st.num_unique <= st.num_candidates
    assert st.num_keys_asked <= st.num_per_request_keys
    # Sharing prefixes: the batch asks for fewer keys than per-request would.
    assert st.num_keys_asked < st.num_per_request_keys
    # The drop-in agrees request by request.
    for r, n, w in list(zip(reqs, ntoks, want, strict=True))[:6]:
        assert bl.lookup_one(n, r) == w


def test_refresh_adds_and_removes_exactly_the_candidates():
    layout = dsv4_layout()
    rng = random.Random(3)
    reqs, ntoks = workload(rng, layout, 8, 8)
    keys, pairs, store = _saved_store(layout, reqs, ntoks)
    idx = KeyIndex(HB, capacity=16)
    sync = StoreSync(store, keys, idx, layout)
    # A stale key outside this batch's candidates must survive a refresh.
    stale = (4, b"\xee" * HB)
    idx.add([stale[0]], [stale[1]])
    batch = HashBatch.from_bytes(reqs, HB)
    st = sync.refresh(batch, ntoks)
    assert st.num_present == st.num_added == len(idx) - 1
    assert stale in idx
    # Drop half the store: the next refresh removes exactly those.
    gone = set(rng.sample(sorted(pairs), len(pairs) // 2))
    store.keys -= {k for g, h in gone for k in keys.keys(g, h)}
    st2 = sync.refresh(batch, ntoks)
    assert st2.num_removed == len(gone & _asked(sync, batch, ntoks))
    assert st2.num_added == 0 and stale in idx
    for g, h in gone:
        assert (g, h) not in idx


def _asked(sync: StoreSync, batch: HashBatch, ntoks) -> set:
    gids, rows = sync.candidates(batch, ntoks)
    flat = [h for r in batch.to_bytes() for h in r]
    return {(g, flat[r]) for g, r in zip(gids.tolist(), rows.tolist(), strict=True)}


def _snapshot(idx: KeyIndex):
    g, h = idx.keys()
    rows = torch.cat([g[:, None], h], 1)
    return sorted(map(tuple, rows.tolist()))


@pytest.mark.parametrize(
    "answer, match",
    [
        (RuntimeError("connection refused"), "batch_is_exist failed"),
        ("short", "answers for"),
        ("negative", "error status"),
        ("none", "not a list of ints"),
    ],
)
def test_store_errors_leave_index_unchanged(answer, match):
    layout = dsv4_layout()
    reqs, ntoks = workload(random.Random(5), layout, 6, 8)
    keys, pairs, store = _saved_store(layout, reqs, ntoks)
    bl = BatchedLookup(layout, store, keys, hash_bytes=HB)
    batch = HashBatch.from_bytes(reqs, HB)
    good = bl.lookup(batch, ntoks)
    assert good.any()
    before = _snapshot(bl.index)
    # The store loses everything, then breaks: nothing may change, no hits.
    store.keys.clear()
    n_keys = bl.last_stats.num_keys_asked
    if isinstance(answer, Exception):
        store.fail = answer
    elif answer == "short":
        store.answer = [0] * (n_keys - 1)
    elif answer == "negative":
        store.answer = [0] * (n_keys - 1) + [-900]
    else:
        store.answer = None
        store.batch_is_exist = lambda keys: None  # type: ignore[method-assign]
    with pytest.raises(StoreError, match=match):
        bl.lookup(batch, ntoks)
    assert _snapshot(bl.index) == before
    assert bl.lookup_one(ntoks[0], reqs[0]) == 0
    assert isinstance(bl.last_error, StoreError)


def test_bad_input_leaves_index_unchanged():
    layout = dsv4_layout()
    reqs, ntoks = workload(random.Random(9), layout, 4, 8)
    store = FakeStore()
    keys = MooncakeKeys("m", [[(0, 0, 0, 0)]] * 5)
    bl = BatchedLookup(layout, store, keys, hash_bytes=HB)
    bl.index.add([0], [b"\x01" * HB])
    before = _snapshot(bl.index)
    with pytest.raises(ValueError, match="hash_bytes"):
        bl.lookup(_narrow(reqs), ntoks)
    with pytest.raises(ValueError, match="one per request"):
        bl.lookup(HashBatch.from_bytes(reqs, HB), ntoks[:-1])
    with pytest.raises(ValueError, match="bytes"):
        bl.lookup_one(ntoks[0], [h[:16] for h in reqs[0]])
    with pytest.raises(TypeError):
        bl.lookup(HashBatch.from_bytes(reqs, HB), [1.5] * len(reqs))
    assert store.calls == [] and _snapshot(bl.index) == before


def _narrow(reqs):
    return HashBatch.from_bytes([[h[:16] for h in r] for r in reqs], 16)


# -- a real Mooncake store --------------------------------------------------------


def _bounded(fn, timeout: float = 15.0, what: str = "call"):
    """Run ``fn`` in a daemon thread; fail (never hang) past ``timeout``."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{what} did not return within {timeout}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _put(store, keys: list[str]) -> None:
    rc = store.put_batch(keys, [b"kv" * 8] * len(keys))
    assert rc == 0, f"put_batch returned {rc}"


def test_real_mooncake_store_end_to_end():
    reason = mooncake_unavailable()
    if reason:
        pytest.skip(reason)
    layout = dsv4_layout()
    ref = ReferenceCoordinator(layout)
    rng = random.Random(11)
    reqs, ntoks = workload(rng, layout, 24, 10)
    keys = MooncakeKeys("DeepSeek-V4-Flash", namespaces(layout))

    with MooncakeMaster() as master:
        store = connect_client(master)
        try:
            # A saving worker per rank writes what its store masks keep, for
            # the first 16 requests; one rank misses a few of its keys.
            pairs = set()
            for r, n in zip(reqs[:16], ntoks[:16], strict=True):
                pairs |= saved_pairs(layout, r, n)
            pairs = sorted(pairs)
            skip = {(g, h, 1) for g, h in rng.sample(pairs, 20) if g % 2 == 0}
            written: set = set()
            put_pairs(keys, pairs, written, skip)
            _put(store, sorted(written))
            exists = store_set(keys, layout, pairs, written)

            bl = BatchedLookup(layout, store, keys, hash_bytes=HB)
            batch = HashBatch.from_bytes(reqs, HB)
            hits = _bounded(lambda: bl.lookup(batch, ntoks))
            want = [ref.lookup(n, r, exists) for r, n in zip(reqs, ntoks, strict=True)]
            assert hits.tolist() == want
            assert sum(want) > 0
            st = bl.last_stats
            assert st.num_rpcs == 1 and st.num_keys_asked < st.num_per_request_keys

            # Evict some keys: after a refresh the hits drop accordingly.
            victims = rng.sample(sorted(exists), len(exists) // 3)
            gone = [k for g, h in victims for k in keys.keys(g, h) if k in written]
            codes = store.batch_remove(gone, True)
            assert all(c == 0 for c in codes), set(codes)
            written -= set(gone)
            exists2 = store_set(keys, layout, pairs, written)
            hits2 = _bounded(lambda: bl.lookup(batch, ntoks))
            want2 = [
                ref.lookup(n, r, exists2) for r, n in zip(reqs, ntoks, strict=True)
            ]
            assert hits2.tolist() == want2
            assert sum(want2) < sum(want)
            assert bl.last_stats.num_removed > 0

            # The master dies mid-run: a clear error, index untouched, no hits.
            before = _snapshot(bl.index)
            master.stop()
            t0 = time.perf_counter()
            with pytest.raises(StoreError):
                _bounded(lambda: bl.lookup(batch, ntoks))
            assert time.perf_counter() - t0 < 15
            assert _snapshot(bl.index) == before
            assert _bounded(lambda: bl.lookup_one(ntoks[0], reqs[0])) == 0
            assert isinstance(bl.last_error, StoreError)

            # It comes back empty on the same ports: the client reconnects and
            # the next refresh drops every key (a client closing against a
            # dead master would also spend many seconds retrying).
            master.start()
            hits3 = _bounded(lambda: bl.lookup(batch, ntoks))
            assert hits3.tolist() == [0] * len(reqs)
            assert bl.last_stats.num_present == 0
            assert bl.last_stats.num_removed == len(before)
        finally:
            master.stop()
            # Not under test, but bounded: closing retries against the master.
            _bounded(store.close, 30, "MooncakeDistributedStore.close")


@pytest.mark.slow
def test_dsv4_1024_step_figures(capsys):
    """Figures for a 1024-request DeepSeek-V4-Flash-like step against a real
    local store: keys asked and time, kvhit (one deduplicated RPC + the
    batched engine) vs vLLM's per-request path (one RPC per request + the
    scalar rule, here the reference, which mirrors vLLM's coordinator).
    Run with ``pytest -m slow -s tests/test_mooncake.py -k figures``."""
    reason = mooncake_unavailable()
    if reason:
        pytest.skip(reason)
    from kvhit.bench.workloads import TrafficConfig, generate

    w = generate("dsv4-flash", TrafficConfig(num_requests=1024, seed=0))
    layout, ref = w.layout, ReferenceCoordinator(w.layout)
    keys = MooncakeKeys("DeepSeek-V4-Flash", [[(0, 0, 0, 0)]] * layout.num_groups)
    lines = []
    with MooncakeMaster() as master:
        store = connect_client(master, global_segment_size=512 << 20)
        try:
            t0 = time.perf_counter()
            all_keys = [k for g, h in sorted(w.store_keys) for k in keys.keys(g, h)]
            for i in range(0, len(all_keys), 20000):
                _put(store, all_keys[i : i + 20000])
            lines.append(
                f"store: {len(all_keys)} keys put in {time.perf_counter() - t0:.1f}s; "
                f"batch: {len(w)} requests, {w.total_hashes} hashes, "
                f"mean prompt {sum(w.num_tokens) / len(w):.0f} tokens"
            )
            batch = w.hash_batch()
            bl = BatchedLookup(layout, store, keys, hash_bytes=w.hash_bytes)
            bl.lookup(batch, w.num_tokens)  # warm-up: fills the index
            steps = []
            for _ in range(3):
                t = time.perf_counter()
                hits = bl.lookup(batch, w.num_tokens)
                steps.append((time.perf_counter() - t, bl.last_stats))
            step_s, st = sorted(steps, key=lambda s: s[0])[1]  # median
            lines.append(
                f"kvhit: 1 RPC, {st.num_keys_asked} keys asked "
                f"({st.num_candidates} candidates, {st.num_unique} unique, "
                f"{st.num_present} present); step {step_s * 1e3:.0f} ms "
                f"(RPC {st.rpc_seconds * 1e3:.1f} ms, refresh "
                f"{st.total_seconds * 1e3:.0f} ms, engine "
                f"{(step_s - st.total_seconds) * 1e3:.0f} ms)"
            )

            # vLLM's worker: per request, its keys, one RPC, the scalar rule.
            t = time.perf_counter()
            rpc_s, asked, want = 0.0, 0, []
            for hl, n in zip(w.hash_lists, w.num_tokens, strict=True):
                cands = ref.lookup_candidates(n, hl)
                ks = [k for g, h in cands for k in keys.keys(g, h)]
                asked += len(ks)
                if not ks:
                    want.append(0)
                    continue
                tr = time.perf_counter()
                res = store.batch_is_exist(ks)
                rpc_s += time.perf_counter() - tr
                present = {c for c, r in zip(cands, res, strict=True) if r == 1}
                want.append(ref.lookup(n, hl, present))
            per_req_s = time.perf_counter() - t
            lines.append(
                f"vLLM per-request: {len(w)} RPCs, {asked} keys asked; step "
                f"{per_req_s * 1e3:.0f} ms (RPCs {rpc_s * 1e3:.0f} ms)"
            )
            lines.append(
                f"ratio: keys {asked / max(st.num_keys_asked, 1):.1f}x fewer, "
                f"step {per_req_s / step_s:.1f}x faster"
            )
            assert asked == st.num_per_request_keys
            assert hits.tolist() == want
        finally:
            master.stop()
            _bounded(store.close, 30, "MooncakeDistributedStore.close")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# -- issue 12: answers that are not 0/1, hung stores ----------------------------


def _primed(seed: int = 7, **kw):
    """A BatchedLookup with a good first step behind it, and its inputs."""
    layout = dsv4_layout()
    reqs, ntoks = workload(random.Random(seed), layout, 6, 8)
    keys, pairs, store = _saved_store(layout, reqs, ntoks)
    bl = BatchedLookup(layout, store, keys, hash_bytes=HB, **kw)
    batch = HashBatch.from_bytes(reqs, HB)
    assert bl.lookup(batch, ntoks).any()
    return bl, store, batch, ntoks


@pytest.mark.parametrize(
    "value", [1.5, 0.9, 1.0000001, float("nan"), 0.5, "1", b"\x01", None, [1]]
)
def test_non_binary_answers_are_store_errors(value):
    """1.5 or 0.9 used to be truncated into presence bits: the index gained
    keys the store does not have. Now: StoreError, index unchanged."""
    bl, store, batch, ntoks = _primed()
    before = _snapshot(bl.index)
    n_keys = bl.last_stats.num_keys_asked
    store.keys.clear()  # what a truncated answer would wrongly keep
    store.answer = [0] * (n_keys - 1) + [value]
    with pytest.raises(StoreError, match="batch_is_exist"):
        bl.lookup(batch, ntoks)
    assert _snapshot(bl.index) == before


@pytest.mark.parametrize(
    "as_", [str, lambda v: str(v).encode(), lambda v: "present" if v else "absent"]
)
def test_string_answers_are_store_errors(as_):
    """A store answering strings (e.g. "1"/"0") for every key: StoreError as
    documented, the index unchanged, never a hit from it."""
    bl, store, batch, ntoks = _primed()
    before = _snapshot(bl.index)
    real = store.batch_is_exist
    store.batch_is_exist = lambda keys: [as_(v) for v in real(keys)]  # type: ignore[method-assign]
    with pytest.raises(StoreError, match="not a list of ints"):
        bl.lookup(batch, ntoks)
    assert _snapshot(bl.index) == before
    assert bl.lookup_one(ntoks[0], batch.to_bytes()[0]) == 0
    assert isinstance(bl.last_error, StoreError)


def test_exact_float_and_bool_answers_are_accepted():
    """1.0 / 0.0 and True / False are exactly 1 and 0."""
    for answer_of in (float, bool):
        bl, store, batch, ntoks = _primed()
        n_keys = bl.last_stats.num_keys_asked
        store.answer = None
        want = bl.lookup(batch, ntoks)
        real = store.batch_is_exist
        store.batch_is_exist = lambda keys, real=real, f=answer_of: [  # type: ignore[method-assign]
            f(v) for v in real(keys)
        ]
        assert torch.equal(bl.lookup(batch, ntoks), want)
        assert bl.last_stats.num_keys_asked == n_keys


@pytest.mark.timing  # a 0.2 s store timeout and a 0.15 s bound
def test_hung_store_times_out_and_late_answer_is_discarded():
    """A store call that never returns used to block lookup() forever, then
    blocked every later lookup until it returned. Now each call is abandoned
    at its deadline; the next one asks on a free slot of the pool; when every
    slot is stuck a lookup is refused at once; the late answers change
    nothing."""
    import threading

    pool = StoreCallPool(2)
    bl, store, batch, ntoks = _primed(timeout_s=0.2, pool=pool)
    assert bl.sync.pool is pool
    before = _snapshot(bl.index)
    release = threading.Event()
    real = store.batch_is_exist
    asked = []

    def hung(keys):
        asked.append(len(keys))
        release.wait(10)
        return [0] * len(keys)  # the late answer: "everything is gone"

    store.batch_is_exist = hung  # type: ignore[method-assign]
    for _ in range(2):  # each asks the store again, on a free slot
        t0 = time.perf_counter()
        with pytest.raises(StoreError, match="timeout_s"):
            bl.lookup(batch, ntoks)
        assert 0.15 < time.perf_counter() - t0 < 2.0
    assert len(asked) == 2 and pool.in_flight == 2
    # Both slots stuck: refused at once, not asked.
    t0 = time.perf_counter()
    assert bl.lookup_one(ntoks[0], batch.to_bytes()[0]) == 0
    assert time.perf_counter() - t0 < 0.15
    assert isinstance(bl.last_error, StoreBusy)
    assert "all 2 store calls are stuck" in str(bl.last_error)
    assert len(asked) == 2
    release.set()
    deadline = time.monotonic() + 5
    while pool.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    st = pool.stats()
    assert (st.in_flight, st.max_in_flight, st.calls) == (0, 2, 3)
    assert (st.timeouts, st.late, st.busy) == (2, 2, 1)
    # The late answers changed nothing; the next good call works as before.
    assert _snapshot(bl.index) == before
    store.batch_is_exist = real  # type: ignore[method-assign]
    assert bl.lookup(batch, ntoks).any()


def test_timeout_and_forget_after_are_validated():
    layout = dsv4_layout()
    keys = MooncakeKeys("m", [[(0, 0, 0, 0)]] * 5)
    idx = KeyIndex(HB, 64)
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout_s"):
            StoreSync(FakeStore(), keys, idx, layout, timeout_s=bad)
    with pytest.raises(TypeError, match="timeout_s"):
        StoreSync(FakeStore(), keys, idx, layout, timeout_s="5")
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="forget_after"):
            StoreSync(FakeStore(), keys, idx, layout, forget_after=bad)


# -- issue 11.6: a long-running index stays bounded --------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["own_index", "shared_index"])
def test_index_stays_bounded_over_a_soak(shared):
    """A soak of many steps with fresh prompts: len(index) stays flat (it grew
    by every step's present keys before), and hits are unchanged. An index of
    its own is rewritten with each step's present keys; a shared one forgets
    keys no step asked about for ``forget_after`` steps."""
    layout = dsv4_layout()
    keys = MooncakeKeys("m", [[(0, 0, 0, 0)]] * 5)
    store = FakeStore()
    rng = random.Random(11)
    forget = 8
    if shared:
        index = KeyIndex(HB, 1 << 10)
        bl = BatchedLookup(layout, store, keys, hash_bytes=HB, index=index,
                           forget_after=forget)  # fmt: skip
    else:
        bl = BatchedLookup(layout, store, keys, hash_bytes=HB)
    ref = ReferenceCoordinator(layout)
    sizes, presents = [], []
    for step in range(120):
        reqs, ntoks = workload(rng, layout, 4, 6)
        pairs = set()
        for r, n in zip(reqs, ntoks, strict=True):
            pairs |= saved_pairs(layout, r, n)
        put_pairs(keys, pairs, store.keys)
        hits = bl.lookup(HashBatch.from_bytes(reqs, HB), ntoks)
        if step % 10 == 0:
            exists = store_set(keys, layout, {(g, h) for r in reqs for h in r
                                              for g in range(5)}, store.keys)  # fmt: skip
            want = [ref.lookup(n, r, exists) for r, n in zip(reqs, ntoks, strict=True)]
            assert hits.tolist() == want
        sizes.append(len(bl.index))
        presents.append(bl.last_stats.num_present)
    if shared:
        assert bl.sync.num_forgotten > 0
        # Flat: about 2 * forget_after steps' keys, not 120 steps'.
        assert max(sizes) <= 2 * forget * max(presents) + 1
    else:
        assert sizes == presents
    assert max(sizes[60:]) <= max(sizes[:30]) * 1.5
    assert len(store.keys) > 3 * max(sizes)


@pytest.mark.parametrize("prefix", ["", "tenant", "préfixe✓", "a\nb", "\n"])
def test_store_asked_keys_match_format(prefix):
    """The one call asks ``prefix + hash.hex()`` for every namespace of each
    distinct candidate, whatever the prefix holds (a newline included: the
    numba key writer separates keys with one)."""
    layout = LAYOUTS["hybrid_mamba_partial"]()
    keys = MooncakeKeys(
        "m\n", [[(0, 0, 0, 0), (1, 0, 0, 0)], [(0, 0, 0, 0)], [(0, 0, 0, 0)]],
        cache_prefix=prefix,
    )  # fmt: skip
    rng = random.Random(3)
    for hb in (8, 16, 20, 32):
        reqs = [
            [rng.randbytes(hb) for _ in range(rng.randrange(0, 9))] for _ in range(5)
        ]
        reqs.append(reqs[0])  # duplicates across requests are asked once
        store = FakeStore()
        index = KeyIndex(hb, 64)
        sync = StoreSync(store, keys, index, layout)
        asked = []
        store.batch_is_exist = lambda ks, a=asked: a.extend(ks) or [0] * len(ks)
        batch = HashBatch.from_bytes(reqs, hb)
        ntok = [4 * len(r) for r in reqs]
        sync.refresh(batch, ntok)
        g, r = sync.candidates(batch, ntok)
        words = batch.to_bytes()
        flat = [h for req in words for h in req]
        want = []
        for gi, ri in dict.fromkeys(zip(g.tolist(), r.tolist(), strict=True)):
            ks = keys.keys(gi, flat[ri])
            if ks[0] not in want:
                want += ks
        assert sorted(asked) == sorted(want) and len(asked) == len(set(asked))
        head = f"{prefix}@m\n@" if prefix else "m\n@"
        assert asked and all(k.startswith(head) for k in asked)


def test_exclusive_index_holds_exactly_the_last_steps_present_keys():
    """The exclusive index is rewritten per step, by removing last step's
    keys (a small step in a large table) or by a clear: either way it then
    holds exactly this step's present candidates, and hits stay exact."""
    layout = dsv4_layout()
    keys = MooncakeKeys("m", [[(0, 0, 0, 0)]] * layout.num_groups)
    rng = random.Random(3)
    ref = ReferenceCoordinator(layout)
    store_keys: set = set()
    steps = [workload(rng, layout, n, 8) for n in (6, 1, 2, 9, 1, 3, 1)]
    for reqs, ntoks in steps:
        for r, n in zip(reqs[::2], ntoks[::2], strict=True):
            put_pairs(keys, saved_pairs(layout, r, n), store_keys)
    store = FakeStore(store_keys)
    for capacity in (64, 1 << 16):  # clears, then removals
        bl = BatchedLookup(layout, store, keys, hash_bytes=HB, capacity=capacity)
        for reqs, ntoks in steps:
            batch = HashBatch.from_bytes(reqs, HB)
            hits = bl.lookup(batch, ntoks)
            g, r = bl.sync.last_candidates
            flat = [h for hl in reqs for h in hl]
            want = set()
            for gi, ri in zip(g.tolist(), r.tolist(), strict=True):
                if all(k in store_keys for k in keys.keys(gi, flat[ri])):
                    want.add((gi, flat[ri]))
            got = set(zip(*_index_pairs(bl.index), strict=True))
            assert got == want
            assert hits.tolist() == [
                ref.lookup(n, hl, want) for hl, n in zip(reqs, ntoks, strict=True)
            ]


def _index_pairs(idx: KeyIndex):
    g, h = idx.keys()
    raw = h.numpy().astype("<i8").view("u1").reshape(len(g), -1)[:, :HB]
    return [int(x) for x in g.tolist()], [bytes(x) for x in raw]
