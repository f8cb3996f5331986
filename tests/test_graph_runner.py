"""coordinator/graph_runner.py: GraphRunner's answers equal the engine's eager
lookup across buckets (padding, reuse, a growing hash buffer, a moved table,
batches past the largest bucket), it refuses what the engine refuses, and on
CUDA it replays captured graphs (marked gpu)."""

from __future__ import annotations

import random

import pytest
import torch
from strategies import chained_hashes, saved_keys

from kvhit import HashBatch, KeyIndex
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.graph_runner import GraphConfig, GraphRunner


def _store(device, capacity: int = 4096):
    layout = make_layout("dsv4-flash")
    rng = random.Random(7)
    prompts = [chained_hashes(4 + i, rng.randint(60, 160)) for i in range(6)]
    # Shared prefixes: later prompts start with an earlier one's hashes.
    prompts += [p[: rng.randint(0, len(p))] + chained_hashes(20 + i, 70)
                for i, p in enumerate(prompts)]  # fmt: skip
    keys = set()
    for p in prompts[::2]:
        keys |= saved_keys(layout, p, len(p) * 4)
    keys = sorted(keys)
    index = KeyIndex(8, capacity=capacity, device=device)
    index.add([g for g, _ in keys], [h for _, h in keys])
    return layout, prompts, index


def _batch(prompts, rng, n, device):
    reqs = [prompts[rng.randrange(len(prompts))] for _ in range(n)]
    tokens = [len(r) * 4 - rng.randint(0, 5) if r else 0 for r in reqs]
    tokens = [max(t, 0) for t in tokens]
    return HashBatch.from_bytes(reqs, 8, device), tokens


def test_answers_equal_eager_across_buckets(device):
    layout, prompts, index = _store(device)
    engine = LookupEngine(layout, backend="triton", device=device)
    runner = GraphRunner(engine, index, GraphConfig(max_requests=8, max_hashes=4096))
    rng = random.Random(1)
    # Non-powers of two, a bucket reused after a larger one (stale padding),
    # single requests, and tensors as well as lists of lengths.
    hits = []
    for i, n in enumerate((3, 1, 8, 3, 1)):
        batch, tokens = _batch(prompts, rng, n, device)
        want = engine.lookup(batch, tokens, index)
        hits += want.tolist()
        if i % 2:
            tokens = torch.tensor(tokens, dtype=torch.int64, device=device)
        assert runner.lookup(batch, tokens).tolist() == want.tolist(), n
    assert set(runner._buckets) == {1, 4, 8}
    assert any(hits) and not all(hits)  # hits and misses


def test_padding_requests_never_leak_into_the_answer(device):
    layout, prompts, index = _store(device)
    engine = LookupEngine(layout, backend="triton", device=device)
    runner = GraphRunner(engine, index, GraphConfig(max_requests=8))
    big, big_tokens = (
        HashBatch.from_bytes(prompts[:8], 8, device),
        [len(p) * 4 for p in prompts[:8]],
    )
    runner.lookup(big, big_tokens)
    small = HashBatch.from_bytes(prompts[:5], 8, device)
    got = runner.lookup(small, big_tokens[:5])
    assert got.shape == (5,)
    assert got.tolist() == engine.lookup(small, big_tokens[:5], index).tolist()
    # The bucket's tail was cleared: no hashes, length 0.
    assert runner._req[:, 5:8].abs().sum().item() == 0


def test_the_hash_buffer_grows_in_powers_of_two(device):
    layout, prompts, index = _store(device)
    engine = LookupEngine(layout, backend="triton", device=device)
    runner = GraphRunner(engine, index)
    rng = random.Random(2)
    sizes = []
    for n in (1, 3, 6):
        batch, tokens = _batch(prompts, rng, n, device)
        assert (
            runner.lookup(batch, tokens).tolist()
            == engine.lookup(batch, tokens, index).tolist()
        )
        cap = runner._hashes.shape[0]
        assert cap >= batch.total and cap & (cap - 1) == 0
        sizes.append(cap)
    assert sizes == sorted(sizes)


def test_past_the_largest_bucket_runs_eagerly(device):
    layout, prompts, index = _store(device)
    engine = LookupEngine(layout, backend="triton", device=device)
    runner = GraphRunner(engine, index, GraphConfig(max_requests=4, max_hashes=64))
    rng = random.Random(3)
    for n in (5, 2):
        batch, tokens = _batch(prompts, rng, n, device)
        want = engine.lookup(batch, tokens, index).tolist()
        assert runner.lookup(batch, tokens).tolist() == want
    assert runner.bucket(5) == -1 and runner.bucket(3) == 4 and runner.bucket(0) == 0


def test_a_moved_table_is_seen(device):
    layout, prompts, index = _store(device, capacity=64)
    engine = LookupEngine(layout, backend="triton", device=device)
    runner = GraphRunner(engine, index)
    rng = random.Random(4)
    batch, tokens = _batch(prompts, rng, 6, device)
    runner.lookup(batch, tokens)
    before = index.table.shape[0]
    # More keys than the table holds: it grows (a new tensor).
    extra = sorted(saved_keys(layout, chained_hashes(99, 800), 3200))
    index.add([g for g, _ in extra], [h for _, h in extra])
    # (The new tensor may reuse the old one's address: the runner keys its
    # graphs on the address and the shape.)
    assert index.table.shape[0] > before
    for p in prompts[1::2]:
        keys = sorted(saved_keys(layout, p, len(p) * 4))
        index.add([g for g, _ in keys], [h for _, h in keys])
    want = engine.lookup(batch, tokens, index).tolist()
    assert runner.lookup(batch, tokens).tolist() == want


def test_empty_and_all_miss_batches(device):
    layout, prompts, _ = _store(device)
    engine = LookupEngine(layout, backend="triton", device=device)
    empty_index = KeyIndex(8, capacity=64, device=device)
    runner = GraphRunner(engine, empty_index)
    batch = HashBatch.from_bytes([], 8, device)
    assert runner.lookup(batch, []).shape == (0,)
    batch = HashBatch.from_bytes(prompts[:3], 8, device)
    assert runner.lookup(batch, [len(p) * 4 for p in prompts[:3]]).tolist() == [0] * 3


def test_bad_arguments_raise_naming_them(device):
    layout, prompts, index = _store(device)
    engine = LookupEngine(layout, backend="triton", device=device)
    runner = GraphRunner(engine, index)
    batch = HashBatch.from_bytes(prompts[:3], 8, device)
    with pytest.raises(ValueError, match=r"num_tokens\[1\] must be >= 0, got -4"):
        runner.lookup(batch, [4, -4, 8])
    t = torch.tensor([4, 8, -3], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"num_tokens\[2\] must be >= 0, got -3"):
        runner.lookup(batch, t)
    with pytest.raises(ValueError, match="num_tokens"):
        runner.lookup(batch, [4, 8])
    with pytest.raises(TypeError, match="batch"):
        runner.lookup([b"x"], [4])
    wide = HashBatch.from_bytes([[bytes(32)]], 32, device)
    with pytest.raises(ValueError, match="hash width"):
        runner.lookup(wide, [4])
    with pytest.raises(ValueError, match="triton"):
        GraphRunner(LookupEngine(layout, backend="reference"), index)
    with pytest.raises(TypeError, match="index"):
        GraphRunner(engine, None)
    with pytest.raises(ValueError, match="min_requests"):
        GraphConfig(max_requests=4, min_requests=8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_graphs"):
            GraphRunner(engine, index, GraphConfig(use_graphs=True))
    # After the errors the runner still answers.
    tokens = [len(p) * 4 for p in prompts[:3]]
    assert (
        runner.lookup(batch, tokens).tolist()
        == engine.lookup(batch, tokens, index).tolist()
    )


@pytest.mark.gpu
def test_cuda_graphs_replay_and_equal_eager():
    layout, prompts, index = _store("cuda")
    engine = LookupEngine(layout, backend="triton", device="cuda")
    runner = GraphRunner(engine, index, GraphConfig(max_requests=64))
    assert runner.use_graphs
    rng = random.Random(5)
    for n in (1, 3, 17, 64, 5):
        batch, tokens = _batch(prompts, rng, n, "cuda")
        want = engine.lookup(batch, tokens, index).tolist()
        assert runner.lookup(batch, tokens).tolist() == want
        assert runner.lookup(batch, tokens).tolist() == want  # a replay
    assert all(b.graph is not None for b in runner._buckets.values())
