"""kvhit's torch custom ops: ``kvhit::probe`` and ``kvhit::lookup``.

The ops must equal the direct calls (``KeyIndex.contains``,
``LookupEngine.lookup``), pass ``torch.library.opcheck``, run inside
``torch.compile(fullgraph=True)`` with the eager results, and (on a GPU) be
capturable in a CUDA graph with a Triton engine.

Compiles use the ``aot_eager`` backend: it exercises dynamo tracing, the fake
implementations and functionalization without inductor's C++/Triton codegen,
which takes minutes on the loaded CI machine. ``KVHIT_TEST_INDUCTOR=1`` adds
an inductor run.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs

from kvhit import KeyIndex, LookupEngine
from kvhit.bench.workloads import TrafficConfig, Workload, generate, make_layout
from kvhit.bindings import torch_ops
from kvhit.coordinator.packing import pack_hashes

# Prompts long enough to hit in the DeepSeek-V4-Flash layout (256-token
# alignment), a store built from a long history so most requests hit.
_TRAFFIC = TrafficConfig(
    num_requests=8,
    max_tokens=2048,
    seed=2,
    history=4,
    multi_turn_prob=0.9,
    system_tokens=(256, 1024),
)


@pytest.fixture(scope="module")
def workload() -> Workload:
    return generate("dsv4-flash", _TRAFFIC)


def _full_index(w: Workload, device: str | torch.device = "cpu") -> KeyIndex:
    """The workload's store plus every (group, hash) of every request: hits
    cover whole prompts, so the worker's ``num_tokens - 1`` re-run happens."""
    index = w.key_index(device)
    flat = [h for hl in w.hash_lists for h in hl]
    packed = pack_hashes(flat, w.hash_bytes).to(device)
    for g in range(w.layout.num_groups):
        index.add(g, packed)
    return index


def _aligned_tokens(w: Workload, device: str | torch.device = "cpu") -> torch.Tensor:
    """Each prompt cut to a whole number of scheduler blocks that its hashes
    cover, so a full store hits the whole prompt."""
    sched = w.layout.scheduler_block_size
    hb = w.layout.hash_block_size
    n = [len(hl) * hb // sched * sched for hl in w.hash_lists]
    return torch.tensor(n, dtype=torch.int64, device=device)


def _random_keys(
    index: KeyIndex, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Half of ``n`` random keys added to ``index``; returns (group_ids [n],
    hashes [n, W], expected bool [n])."""
    rng = random.Random(seed)
    hashes = [rng.randbytes(index.hash_bytes) for _ in range(n)]
    gids = torch.tensor([rng.randrange(4) for _ in range(n)], dtype=torch.int64)
    packed = pack_hashes(hashes, index.hash_bytes)
    present = torch.tensor([rng.random() < 0.5 for _ in range(n)])
    index.add(gids[present].to(index.device), packed[present].to(index.device))
    # Same hashes under another group id must stay absent (exact keys).
    return gids.to(index.device), packed.to(index.device), present.to(index.device)


# --------------------------------------------------------------------------
# Eager equality with the direct calls
# --------------------------------------------------------------------------


@pytest.mark.parametrize("hash_bytes", [8, 20, 32])
def test_probe_equals_contains(hash_bytes: int) -> None:
    index = KeyIndex(hash_bytes, capacity=256)
    g, h, present = _random_keys(index, 300, seed=hash_bytes)
    g2 = g + 4  # never stored
    for gids in (g, g2):
        want = index.contains(gids, h)
        assert torch.equal(torch.ops.kvhit.probe(index.table, gids, h), want)
        assert torch.equal(torch_ops.probe(index, gids, h), want)
    assert torch.equal(index.contains(g, h), present)
    assert not torch_ops.probe(index, g2, h).any()


def test_probe_empty_and_bad_arguments() -> None:
    index = KeyIndex(8, capacity=16)
    out = torch.ops.kvhit.probe(
        index.table,
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, 1, dtype=torch.int64),
    )
    assert out.dtype == torch.bool and out.shape == (0,)
    with pytest.raises(ValueError, match="table must have shape"):
        torch.ops.kvhit.probe(
            index.table,
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, 2, dtype=torch.int64),
        )
    with pytest.raises(TypeError, match="group_ids must be int64"):
        torch.ops.kvhit.probe(
            index.table,
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int64),
        )
    # The wrapper validates like KeyIndex.contains.
    with pytest.raises(ValueError, match="group_ids must be >= 0"):
        torch_ops.probe(index, [-1], [b"x" * 8])


def test_lookup_equals_engine(workload: Workload) -> None:
    w = workload
    engine = LookupEngine(w.layout)
    batch = w.hash_batch()
    key = torch_ops.register_layout(w.layout)
    cases = [
        (w.key_index(), w.num_tokens_tensor()),
        (_full_index(w), _aligned_tokens(w)),
    ]
    for index, num_tokens in cases:
        want = engine.lookup(batch, num_tokens, index)
        got = torch.ops.kvhit.lookup(
            batch.hashes, batch.offsets, num_tokens, index.table, w.hash_bytes, key
        )
        assert torch.equal(got, want)
        assert torch.equal(torch_ops.lookup(engine, batch, num_tokens, index), want)
        assert torch.equal(torch_ops.lookup(key, batch, num_tokens, index), want)
    # The cases are not trivial: hits, misses and whole-prompt re-runs.
    hits = engine.lookup(batch, w.num_tokens_tensor(), w.key_index())
    assert hits.gt(0).any() and hits.eq(0).any()
    assert hits.tolist() == w.reference_lookup()
    full = engine.lookup(batch, _aligned_tokens(w), _full_index(w))
    assert full.lt(_aligned_tokens(w)).any()  # num_tokens - 1 re-runs


def test_lookup_triton_sync_free_path_equals_engine(workload: Workload) -> None:
    """The host-sync-free worker rule used for Triton engines (the one a CUDA
    graph can capture) equals ``LookupEngine.lookup``. On the CPU the kernel
    runs under TRITON_INTERPRET (set by conftest), so the batch is small."""
    if torch.cuda.is_available():
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    else:  # pragma: no cover - conftest sets it without CUDA
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    # The engine's Triton backend (scan kernel) lands separately from this file.
    pytest.importorskip("kvhit.kernels.scan")
    w = workload.take(4)
    key = torch_ops.register_layout(w.layout, backend="triton")
    assert key != torch_ops.register_layout(w.layout)
    reference = LookupEngine(w.layout, backend="torch", device=device)
    batch = w.hash_batch(device)
    for index, num_tokens in (
        (w.key_index(device), w.num_tokens_tensor(device)),
        (_full_index(w, device), _aligned_tokens(w, device)),
    ):
        want = reference.lookup(batch, num_tokens, index)
        got = torch_ops.lookup(key, batch, num_tokens, index)
        assert torch.equal(got, want), (got, want)


def test_lookup_empty_batch(workload: Workload) -> None:
    w = workload.take(0)
    out = torch_ops.lookup(
        w.layout, w.hash_batch(), w.num_tokens_tensor(), w.key_index()
    )
    assert out.dtype == torch.int64 and out.shape == (0,)


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------


def test_register_layout_keys(workload: Workload) -> None:
    layout = workload.layout
    key = torch_ops.register_layout(layout)
    assert torch_ops.register_layout(layout) == key  # idempotent, deterministic
    assert torch_ops.registered_layouts()[key] == layout
    engine = LookupEngine(layout, backend="reference")
    assert torch_ops.register_layout(engine) == key + "-reference"
    assert torch_ops.layout_engine(key + "-reference", "cpu") is engine
    other = make_layout("llama")
    with pytest.raises(ValueError, match="already registered"):
        torch_ops.register_layout(other, key=key)
    with pytest.raises(TypeError, match="CacheLayout or a LookupEngine"):
        torch_ops.register_layout("not a layout")  # type: ignore[arg-type]
    torch_ops.register_layout(other, key="tmp-key")
    torch_ops.unregister_layout("tmp-key")
    with pytest.raises(KeyError, match="not registered"):
        torch_ops.layout_engine("tmp-key", "cpu")


def test_default_key_is_stable_across_processes() -> None:
    """The default key is a digest of a canonical serialisation: a fresh
    interpreter (another hash seed, other object addresses) computes the same
    one, and tags of different types stay apart."""
    from helpers import run_python

    code = (
        "from kvhit import CacheLayout, FullAttention, Group, SlidingWindow\n"
        "from kvhit.bindings import torch_ops\n"
        "layout = CacheLayout([Group(FullAttention(8, tag='mla'), name='a'),\n"
        "    Group(SlidingWindow(4, 5, tag=3), eagle=True)], 8, 4, use_eagle=True)\n"
        "print(torch_ops.register_layout(layout))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    keys = {run_python(code, env=env).strip() for env["PYTHONHASHSEED"] in ("1", "2")}
    from kvhit import CacheLayout, FullAttention, Group, SlidingWindow

    def layout(tag):
        return CacheLayout(
            [
                Group(FullAttention(8, tag="mla"), name="a"),
                Group(SlidingWindow(4, 5, tag=tag), eagle=True),
            ],
            8,
            4,
            use_eagle=True,
        )

    assert keys == {torch_ops.register_layout(layout(3))}
    assert torch_ops.register_layout(layout("3")) not in keys


def test_default_key_refuses_unstable_tags() -> None:
    from kvhit import CacheLayout, FullAttention, Group, Mamba

    class Tag:  # hashable, but its repr holds an address
        pass

    layout = CacheLayout(
        [Group(FullAttention(4)), Group(Mamba(4, tag=Tag()), name="ssm")], 4, 4
    )
    with pytest.raises(ValueError, match=r"group 1 \('ssm'\).*tag"):
        torch_ops.register_layout(layout)
    # An explicit key needs no default one.
    assert torch_ops.register_layout(layout, key="tagged-layout") == "tagged-layout"
    torch_ops.unregister_layout("tagged-layout")


def test_lookup_reference_engine_through_op(workload: Workload) -> None:
    w = workload.take(3)
    engine = LookupEngine(w.layout, backend="reference")
    batch, nt, index = w.hash_batch(), w.num_tokens_tensor(), w.key_index()
    got = torch_ops.lookup(engine, batch, nt, index)
    assert got.tolist() == w.reference_lookup()


# --------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------

# test_schema checks that the op mutates nothing it declares immutable;
# test_faketensor that the fake impl matches the real output's metadata;
# test_aot_dispatch_static/dynamic that AOTAutograd traces the op. The ops are
# not differentiable (integer/bool outputs), so test_autograd_registration only
# checks that no autograd kernel is wrongly required; it runs too.
_OPCHECK_TESTS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)


def test_opcheck_probe() -> None:
    index = KeyIndex(32, capacity=64)
    g, h, _ = _random_keys(index, 20, seed=1)
    torch.library.opcheck(
        torch.ops.kvhit.probe.default, (index.table, g, h), test_utils=_OPCHECK_TESTS
    )


def test_opcheck_lookup(workload: Workload) -> None:
    w = workload.take(4)
    key = torch_ops.register_layout(w.layout)
    batch, index = w.hash_batch(), w.key_index()
    args = (
        batch.hashes,
        batch.offsets,
        w.num_tokens_tensor(),
        index.table,
        w.hash_bytes,
        key,
    )
    torch.library.opcheck(
        torch.ops.kvhit.lookup.default, args, test_utils=_OPCHECK_TESTS
    )


# --------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------


def _step(
    table: torch.Tensor,
    group_ids: torch.Tensor,
    keys: torch.Tensor,
    hashes: torch.Tensor,
    offsets: torch.Tensor,
    num_tokens: torch.Tensor,
    hash_bytes: int,
    key: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scheduler-like step: probe keys, look up prompts, derive the tokens
    to compute (ordinary tensor ops around the custom ops)."""
    present = torch.ops.kvhit.probe(table, group_ids, keys)
    hits = torch.ops.kvhit.lookup(hashes, offsets, num_tokens, table, hash_bytes, key)
    to_compute = num_tokens - hits
    return present.sum(), hits, to_compute


def _step_args(w: Workload) -> tuple:
    index = w.key_index()
    batch = w.hash_batch()
    gids, keys = index.keys()
    # Present keys, the same hashes under an absent group id, interleaved.
    gids = torch.cat([gids, gids + w.layout.num_groups])
    keys = torch.cat([keys, keys])
    key = torch_ops.register_layout(w.layout)
    return (
        index.table,
        gids,
        keys,
        batch.hashes,
        batch.offsets,
        w.num_tokens_tensor(),
        w.hash_bytes,
        key,
    )


def _assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x, y)


def test_compile_aot_eager_fullgraph(workload: Workload) -> None:
    torch._dynamo.reset()
    args = _step_args(workload)
    eager = _step(*args)
    compiled = torch.compile(_step, backend="aot_eager", fullgraph=True)
    _assert_same(compiled(*args), eager)
    assert int(eager[0]) == args[1].shape[0] // 2
    # The ops are single opaque nodes of the captured graph (not traced into).
    torch._dynamo.reset()
    recorder = EagerAndRecordGraphs()
    _assert_same(torch.compile(_step, backend=recorder, fullgraph=True)(*args), eager)
    (graph,) = recorder.graphs
    # Dynamo records the op packets (torch.ops.kvhit.probe), AOT the overloads.
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.kvhit.probe) == 1
    assert targets.count(torch.ops.kvhit.lookup) == 1
    # Another batch size: a recompile (or a dynamic-shape graph), same answers.
    w3 = workload.take(3)
    args3 = _step_args(w3)
    _assert_same(compiled(*args3), _step(*args3))


def test_compile_wrapper_lookup_with_key(workload: Workload) -> None:
    """The ``lookup`` wrapper with a string key does no host sync, so dynamo
    traces it (and the kvhit objects' attributes) without a graph break. The
    ``probe`` wrapper validates values (``group_ids >= 0``): call the op in
    compiled code."""
    torch._dynamo.reset()
    w = workload
    key = torch_ops.register_layout(w.layout)
    batch, index, nt = w.hash_batch(), w.key_index(), w.num_tokens_tensor()

    def fn(batch, num_tokens, index):
        return torch_ops.lookup(key, batch, num_tokens, index) * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(batch, nt, index), fn(batch, nt, index))


@pytest.mark.skipif(
    os.environ.get("KVHIT_TEST_INDUCTOR") != "1",
    reason="inductor codegen is slow here; set KVHIT_TEST_INDUCTOR=1",
)
def test_compile_inductor(workload: Workload) -> None:
    torch._dynamo.reset()
    args = _step_args(workload)
    compiled = torch.compile(_step, fullgraph=True)
    _assert_same(compiled(*args), _step(*args))


# --------------------------------------------------------------------------
# CUDA graphs (GPU only)
# --------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_captures_probe_and_triton_lookup(
    workload: Workload, device: str
) -> None:
    """Both ops captured in one CUDA graph (Triton engine: no host syncs),
    replayed after keys were added in place and the inputs were refilled."""
    w = workload
    key = torch_ops.register_layout(w.layout, backend="triton")
    # Room for every key without a rehash: the graph holds the table pointer.
    index = KeyIndex(w.hash_bytes, capacity=1 << 16, device=device)
    g0, k0 = w.key_index(device).keys()
    index.add(g0, k0)
    batch = w.hash_batch(device)
    nt = w.num_tokens_tensor(device)
    # Static inputs: the graph reads these buffers on every replay.
    args = (
        index.table,
        g0.clone(),
        k0.clone(),
        batch.hashes.clone(),
        batch.offsets.clone(),
        nt.clone(),
        w.hash_bytes,
        key,
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: triton compiles, plan cached
        for _ in range(2):
            _step(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(*args)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(out, _step(*args))
    engine = LookupEngine(w.layout, backend="torch", device=device)
    assert torch.equal(out[1], engine.lookup(batch, nt, index))

    # New keys in place (same table object), new prompt lengths: replay sees both.
    full = _full_index(w, device)
    fg, fk = full.keys()
    index.add(fg, fk)
    assert index.table is args[0]
    args[5].copy_(_aligned_tokens(w, device))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[1], engine.lookup(batch, args[5], index))


@pytest.mark.gpu
def test_cuda_probe_uses_triton_and_equals_contains(device: str) -> None:
    index = KeyIndex(32, capacity=1024, device=device)
    g, h, present = _random_keys(index, 500, seed=3)
    assert torch.equal(torch.ops.kvhit.probe(index.table, g, h), present)
    assert torch.equal(torch_ops.probe(index, g, h), index.contains(g, h))
