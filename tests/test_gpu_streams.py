"""What only a GPU exercises (``pytest -m gpu``): inserts and probes running
at once on several CUDA streams, lookups captured in CUDA graphs (with and
without the table growing between capture and replay; growth during a
capture), and an add that runs out of device memory.

Each test's logic runs on ``cpu`` too: streams become the current stream (so
the work is sequential), a graph "replay" runs the captured call again, and
an out-of-memory error is raised by a patched allocator; that run proves the
test code. Only the ``cuda`` cases are marked ``gpu``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from kvhit import FleetIndex, HashBatch, KeyIndex, LookupEngine
from kvhit.bench.workloads import make_layout
from kvhit.coordinator import fleet_index, key_index
from kvhit.coordinator.key_index import CapacityError
from kvhit.kernels import hash_index
from kvhit.kernels.hash_index_torch import new_table

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
W = 4  # 32-byte keys


def keys(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random keys (distinct: random 64-bit words), group ids 0-2."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randint(0, 3, (n,), generator=gen)
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, W), generator=gen)
    return g, h


def stream(device: str) -> contextlib.AbstractContextManager:
    """A fresh CUDA stream made current (ordered after the current one), or,
    on the CPU, nothing: the work runs in order."""
    if device == "cpu":
        return contextlib.nullcontext()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(s)


# -- several streams ---------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_inserts_and_probes_on_several_streams(device):
    # Four streams insert overlapping batches (most keys in two batches) into
    # one table while other streams probe it with the concurrent reader's
    # acquire reads, each probe launched just before an insert (an insert
    # syncs with the host at its end, its own stream only): a key stored
    # before is found by every probe, each key ends in exactly one slot, and
    # the new-key counts add up to the distinct keys.
    n = 20_000 if device == "cuda" else 200
    table = new_table(1 << 17 if device == "cuda" else 1024, W, device)
    g0, h0 = keys(n // 4, seed=1)
    g0, h0 = g0.to(device), h0.to(device)
    assert int(hash_index.insert(table, W, g0, h0).sum()) == n // 4
    g, h = keys(n, seed=2)
    g, h = g.to(device), h.to(device)
    parts = [slice(i * n // 4, (i + 2) * n // 4) for i in range(3)]
    parts.append(slice(3 * n // 4, n))
    # Probes of the old keys and of every key, repeated: long enough to
    # overlap the inserts.
    ga, ha = torch.cat([g0, g]).repeat(4), torch.cat([h0, h]).repeat(4, 1)
    new, seen = [], []
    for part in parts:
        with stream(device):
            seen.append(hash_index.probe(table, W, ga, ha, concurrent=True))
        with stream(device):
            new.append(hash_index.insert(table, W, g[part], h[part]))
    if device == "cuda":
        torch.cuda.synchronize()
    assert sum(int(x.sum()) for x in new) == n
    for found in seen:
        assert bool(found.view(4, -1)[:, : n // 4].all())
    assert bool(hash_index.probe(table, W, g, h).all())
    slots = hash_index.find(table, W, torch.cat([g0, g]), torch.cat([h0, h]))
    assert int(slots.unique().numel()) == n + n // 4 and bool((slots >= 0).all())
    assert int((table[:, 0] >= 0).sum()) == n + n // 4


# -- CUDA graphs ---------------------------------------------------------------------


def capture(device: str, fn: Callable[[], torch.Tensor]):
    """(output, replay): ``fn``'s output tensor captured in a CUDA graph (after
    a warm-up on a side stream, as torch's docs do) and the graph's replay;
    on the CPU the output of one call and a replay that calls ``fn`` again
    into the same tensor."""
    if device == "cpu":
        out = fn()
        return out, lambda: out.copy_(fn())
    with stream(device):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        torch.cuda.synchronize()
        return out

    return out, replay


def llama_case(device: str, growable: bool):
    layout = make_layout("llama")
    prompts = [[bytes([r, i]) * 16 for i in range(3 + 40 * r)] for r in range(5)]
    batch = HashBatch.from_bytes(prompts, 32).to(device)
    # Fixed: room for every key of the prompts from the start.
    index = KeyIndex(32, capacity=64 if growable else 1024, device=device,
                     growable=growable)  # fmt: skip
    num_tokens = torch.tensor([16 * len(p) for p in prompts], device=device)
    return layout, prompts, batch, index, num_tokens


@pytest.mark.parametrize("device", DEVICES)
def test_graph_replay_sees_later_adds_without_growth(device):
    # A fixed-capacity index (its table never moves): a lookup captured once
    # answers every later add and remove on replay, as eager does.
    layout, prompts, batch, index, num_tokens = llama_case(device, growable=False)
    engine = LookupEngine(layout, backend="triton", device=device)
    table = index.table
    out, replay = capture(
        device, lambda: engine.lookup_unchecked(batch, num_tokens, index)
    )
    assert int(out.sum()) == 0
    seen = set()
    for cut in (1, 5, 40, 200):
        stored = [(0, p[i]) for p in prompts for i in range(min(cut, len(p)))]
        index.add([k[0] for k in stored], [k[1] for k in stored])
        if cut == 40:
            index.remove([0], [prompts[4][10]])
        got = replay()
        want = engine.lookup(batch, num_tokens, index)
        assert torch.equal(got, want)
        seen.add(int(want.sum()))
    assert index.table is table and len(seen) == 4  # the answers changed


@pytest.mark.parametrize("device", DEVICES)
def test_graph_recaptured_after_growth(device):
    # A growable index replaces its table when it grows: a graph captured
    # before reads the old one, so a scheduler captures again; the new
    # graph's answers equal eager, and adds after it that do not grow are
    # seen on replay.
    layout, prompts, batch, index, num_tokens = llama_case(device, growable=True)
    engine = LookupEngine(layout, backend="triton", device=device)
    index.add([0], [prompts[0][0]])
    capture(device, lambda: engine.lookup_unchecked(batch, num_tokens, index))
    before = index.table.data_ptr()
    stored = [(0, p[i]) for p in prompts for i in range(len(p) // 2)]
    index.add([k[0] for k in stored], [k[1] for k in stored])
    assert index.table.data_ptr() != before  # grew: the old graph is stale
    index.reserve(200)
    out, replay = capture(
        device, lambda: engine.lookup_unchecked(batch, num_tokens, index)
    )
    assert torch.equal(out, engine.lookup(batch, num_tokens, index))
    hits_before = int(out.sum())
    table = index.table
    stored = [(0, p[i]) for p in prompts for i in range(len(p))]
    index.add([k[0] for k in stored], [k[1] for k in stored])
    assert index.table is table
    got = replay()
    assert torch.equal(got, engine.lookup(batch, num_tokens, index))
    assert int(got.sum()) > hits_before


def capturing(device: str) -> contextlib.AbstractContextManager:
    """A CUDA graph capture, or on the CPU one as the code sees it (the
    capture flag raised)."""
    if device == "cpu":
        return mock.patch.object(
            torch.cuda, "is_current_stream_capturing", lambda: True
        )
    return torch.cuda.graph(torch.cuda.CUDAGraph())


@pytest.mark.parametrize("device", DEVICES)
def test_growth_during_capture_is_refused_with_a_clear_error(device):
    # An add that must grow the table inside a capture would allocate and
    # sync: it must be refused before anything changes, saying why.
    _, prompts, _, index, _ = llama_case(device, growable=True)
    stored = [(0, p[i]) for p in prompts for i in range(len(p))]
    with pytest.raises((RuntimeError, CapacityError), match="captur"):
        with capturing(device):
            index.add([k[0] for k in stored], [k[1] for k in stored])
    assert len(index) == 0


# -- out of memory -------------------------------------------------------------------


@contextlib.contextmanager
def no_memory_past(device: str, slots: int):
    """Table allocations of more than ``slots`` slots fail with
    torch.OutOfMemoryError: on CUDA for real (the process's memory capped
    just above what it holds), on the CPU from the table allocators."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        held = torch.cuda.memory_reserved()
        row = (W + 1 + 1) * 8
        torch.cuda.set_per_process_memory_fraction((held + slots * row) / total)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        return

    def failing(real):
        def alloc(capacity, *a, **k):
            if capacity > slots:
                raise torch.OutOfMemoryError(f"no memory for {capacity} slots")
            return real(capacity, *a, **k)

        return alloc

    ops = type(fleet_index.fleet_ops("torch"))
    with (
        mock.patch.object(key_index, "new_table", failing(key_index.new_table)),
        mock.patch.object(fleet_index, "new_table", failing(fleet_index.new_table)),
        mock.patch.object(ops, "new_tables", failing(ops.new_tables)),
    ):
        yield


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_memory_add_leaves_the_key_index_intact(device):
    n = 1 << 16 if device == "cuda" else 200
    index = KeyIndex(32, capacity=n, device=device, backend="triton")
    g, h = keys(3 * n // 4, seed=3)
    g, h = g.to(device), h.to(device)
    half = 3 * n // 8
    assert index.add(g[:half], h[:half]) == half
    index.remove(g[:10], h[:10])
    table = index.table.clone()
    state = (len(index), index.tombstones, index.capacity)
    with no_memory_past(device, n), pytest.raises(torch.OutOfMemoryError):
        index.add(g, h)  # needs twice the slots
    assert (len(index), index.tombstones, index.capacity) == state
    assert torch.equal(index.table, table)
    assert index.contains(g, h).tolist() == [False] * 10 + [True] * (half - 10) + [
        False
    ] * (len(g) - half)
    assert index.add(g, h) == len(g) - half + 10  # and it grows once memory is back


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_memory_add_leaves_the_fleet_intact(device):
    # The FleetIndex's growth (its tables, and its entry index) runs out of
    # memory: counts, engine sizes and holders are as before the add.
    n = 1 << 14 if device == "cuda" else 64
    with contextlib.ExitStack() as stack:
        if device == "cpu":
            stack.enter_context(
                mock.patch.object(fleet_index, "auto_backend", lambda d: "triton")
            )
        fleet = FleetIndex(3, 32, capacity=n, device=device, backend="triton")
        g, h = keys(n, seed=4)
        hb = [bytes(x.numpy().tobytes()) for x in h]
        gl = g.tolist()
        half = n // 4
        fleet.add(1, gl[:half], hb[:half])
        state = (len(fleet), fleet.tombstones, fleet.engine_sizes().tolist())
        holders = fleet.holders(gl, hb).tolist()
        with no_memory_past(device, n), pytest.raises(torch.OutOfMemoryError):
            fleet.add(2, gl, hb)
        assert (len(fleet), fleet.tombstones, fleet.engine_sizes().tolist()) == state
        assert fleet.holders(gl, hb).tolist() == holders
