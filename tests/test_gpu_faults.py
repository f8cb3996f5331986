"""Faults only a real GPU shows, tested on the CPU where that is possible.

Found by reading the kernels (issue 17), each with a test here:

* the insert's probe bound summed ``cap_mask + WAITS`` in int32 (a table of
  2**31 slots wrapped it negative and failed every lane): bounds are now
  compared apart, in int64 (``hash_index.insert_gave_up``);
* the insert's BUSY wait counted rounds, not progress: lanes that gave up
  made ``insert`` raise with other keys already written and ``KeyIndex``'s
  counts wrong. Now the launcher retries those lanes, the error says table
  full vs wait ran out, and ``KeyIndex.add`` recounts on failure;
* kernels launched on the current CUDA device, not the table's: they now
  launch under ``launch.device_guard(table.device)``;
* the first call per plan built device tensors, illegal inside a CUDA-graph
  capture: ``TritonBackend`` builds them at construction and refuses a
  variant's first call (its compile) inside a capture.

Plus what Triton 3.6 (the GPU machine's) needs: the interpreter's ``range``
fix and the concurrent reader's acquire read (``probe(concurrent=True)``).
Runs under Triton's interpreter here (conftest sets ``TRITON_INTERPRET=1``
without CUDA), with 3.6.0 in ``.ci/device-twin``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import KeyIndex
from kvhit.bench.gpu_common import capture_graph
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.plan import ScanPlan
from kvhit.coordinator.triton_backend import TritonBackend
from kvhit.kernels import hash_index, launch
from kvhit.kernels.contract import BUSY
from kvhit.kernels.hash_index import INSERT_FULL, INSERT_WAIT, InsertError
from kvhit.kernels.hash_index_torch import new_table, slot_hash

# -- int64 probe bound ----------------------------------------------------------


@triton.jit
def _gave_up_kernel(visited_ptr, waited_ptr, out_ptr, cap_mask, WAITS: tl.constexpr):
    i = tl.arange(0, 4)
    visited = tl.load(visited_ptr + i)
    waited = tl.load(waited_ptr + i)
    why = hash_index.insert_gave_up(visited, waited, cap_mask, WAITS)
    tl.store(out_ptr + i, why)


def test_insert_bound_holds_at_two_to_the_31_slots():
    # cap_mask = 2**31 - 1 is typed i32 by Triton (it fits): the old
    # ``cap_mask + WAITS`` wrapped negative there and failed every lane.
    cap_mask = (1 << 31) - 1
    visited = torch.tensor([0, cap_mask, cap_mask + 1, 5], dtype=torch.int64)
    waited = torch.tensor([0, 0, 0, 9], dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int8)
    _gave_up_kernel[(1,)](visited, waited, out, cap_mask, WAITS=8)
    assert out.tolist() == [0, 0, INSERT_FULL, INSERT_WAIT]


# -- a failed insert leaves the index consistent --------------------------------


def _keys(n: int, seed: int, W: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randint(0, 3, (n,), generator=gen)
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, W), generator=gen)
    return g, h


def _stuck_home(table: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> int:
    """Leave the home slot of key 0 BUSY (a writer that died mid-insert)."""
    home = int(slot_hash(g[:1], h[:1])[0]) & (table.shape[0] - 1)
    table[home, 0] = BUSY
    return home


def test_wait_ran_out_leaves_key_index_consistent(monkeypatch):
    # A short wait: the interpreter spends ~20 ms a round.
    real = hash_index.insert
    monkeypatch.setattr(hash_index, "insert", lambda *a: real(*a, busy_wait_limit=8))
    index = KeyIndex(32, capacity=1024, backend="triton")
    g, h = _keys(40, seed=1)
    _stuck_home(index.table, g, h)
    with pytest.raises(InsertError, match="a wait ran out") as err:
        index.add(g, h)
    assert err.value.wait_ran_out >= 1 and err.value.table_full == 0
    # The other keys were stored, and the counts say so.
    live = int((index.table[:, 0] >= 0).sum())
    assert len(index) == live > 0
    assert int(index.contains(g, h).sum()) == live
    # A rehash stores exactly len(index) keys (it raised before the recount).
    index.reserve(4096)
    assert len(index) == live and index.capacity >= 8192


def test_table_full_is_told_apart_from_a_wait():
    table = new_table(8, 4, "cpu")
    g, h = _keys(9, seed=2)
    assert bool(hash_index.insert(table, 4, g[:8], h[:8]).all())
    with pytest.raises(InsertError, match="the table is full") as err:
        hash_index.insert(table, 4, g[8:], h[8:])
    assert (err.value.table_full, err.value.wait_ran_out) == (1, 0)
    assert "wait ran out" not in str(err.value)


def test_lanes_that_gave_up_are_retried_once_the_slot_is_published(monkeypatch):
    # The claimer of a slot was descheduled past the waiters' limit: after
    # the launch ends its key is published, and the retry completes the batch.
    table = new_table(64, 4, "cpu")
    g, h = _keys(6, seed=3)
    home = _stuck_home(table, g, h)
    launches = []
    real = hash_index._launch

    def launch_then_publish(*args, **kwargs):
        out = real(*args, **kwargs)
        launches.append(out.clone())
        if len(launches) == 1:
            table[home, 1:] = h[0]
            table[home, 0] = g[0]  # the descheduled writer finishes
        return out

    monkeypatch.setattr(hash_index, "_launch", launch_then_publish)
    stored = hash_index.insert(table, 4, g, h, busy_wait_limit=4)
    assert launches[0][0] == INSERT_WAIT and len(launches) == 2
    assert not bool(stored[0]) and bool(stored[1:].all())  # key 0 was there
    assert bool(hash_index.probe(table, 4, g, h).all())


# -- the table's device -----------------------------------------------------------


def test_device_guard_enters_the_tables_device(monkeypatch):
    entered = []

    class FakeModule:
        @staticmethod
        @contextlib.contextmanager
        def device(index):
            entered.append(index)
            yield

    monkeypatch.setattr(torch, "get_device_module", lambda kind: FakeModule)
    with launch.device_guard(torch.device("cuda", 1)):
        pass
    assert entered == [1]
    with launch.device_guard(torch.device("cpu")):
        pass
    assert entered == [1]  # nothing to enter on the CPU


@pytest.mark.parametrize("op", ["probe", "find", "insert", "erase"])
def test_key_index_kernels_launch_under_the_tables_device(monkeypatch, op):
    seen = []
    real = launch.device_guard

    def recording(device):
        seen.append(device)
        return real(device)

    monkeypatch.setattr(hash_index, "device_guard", recording)
    table = new_table(16, 4, "cpu")
    g, h = _keys(3, seed=4)
    getattr(hash_index, op)(table, 4, g, h)
    assert seen == [table.device]


def test_scan_kernel_launches_under_the_tables_device(monkeypatch):
    import kvhit.kernels.scan as scan
    from kvhit import HashBatch, LookupEngine

    seen = []
    real = launch.device_guard
    monkeypatch.setattr(scan, "device_guard", lambda d: seen.append(d) or real(d))
    layout = make_layout("llama")
    engine = LookupEngine(layout, backend="triton", device="cpu")
    batch = HashBatch.from_bytes([[bytes([i]) * 16 for i in range(3)]], 16)
    index = KeyIndex(16)
    engine.lookup(batch, torch.tensor([48]), index)
    assert seen == [torch.device("cpu")]


@pytest.mark.gpu
def test_table_on_a_second_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    g, h = _keys(500, seed=5)
    g, h = g.to("cuda:1"), h.to("cuda:1")
    with torch.cuda.device(0):  # device 0 current, the table on device 1
        index = KeyIndex(32, capacity=1024, device="cuda:1")
        assert index.add(g, h) == 500  # random 64-bit words: all distinct
        assert bool(index.contains(g, h).all())
        assert index.remove(g[:100], h[:100]) == 100
        assert int(index.contains(g, h).sum()) == 400


# -- CUDA-graph capture -------------------------------------------------------------


def _llama_case(device: str):
    from kvhit import HashBatch

    layout = make_layout("llama")
    prompts = [[bytes([r, i]) * 8 for i in range(2 + 3 * r)] for r in range(5)]
    batch = HashBatch.from_bytes(prompts, 16).to(device)
    index = KeyIndex(16, capacity=256, device=device)
    stored = [(0, p[i]) for p in prompts for i in range(len(p) - 1)]
    index.add([k[0] for k in stored], [k[1] for k in stored])
    num_tokens = torch.tensor([16 * len(p) for p in prompts], device=device)
    return layout, batch, index, num_tokens


def test_first_call_inside_a_capture_is_refused(monkeypatch):
    import kvhit.coordinator.triton_backend as tb

    layout, batch, index, num_tokens = _llama_case("cpu")
    backend = TritonBackend(ScanPlan.from_layout(layout), "cpu")
    monkeypatch.setattr(tb, "stream_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        backend.lookup(batch.view(), num_tokens, index)
    monkeypatch.setattr(tb, "stream_capturing", lambda device: False)
    eager = backend.lookup(batch.view(), num_tokens, index)
    # Warm: a "captured" call builds nothing on the device and runs.
    monkeypatch.setattr(tb, "stream_capturing", lambda device: True)
    monkeypatch.setattr(tb, "plan_tensors", lambda *a: pytest.fail("built"))
    assert torch.equal(backend.lookup(batch.view(), num_tokens, index), eager)


@pytest.mark.gpu
def test_lookup_captured_in_a_cuda_graph():
    layout, batch, index, num_tokens = _llama_case("cuda")
    backend = TritonBackend(ScanPlan.from_layout(layout), "cuda")
    view = batch.view()
    eager = backend.lookup(view, num_tokens, index)  # the warm-up
    _, static = capture_graph(lambda: backend.lookup(view, num_tokens, index))
    assert torch.equal(static, eager) and int(eager.sum()) > 0


# -- Triton 3.6 -------------------------------------------------------------------


@triton.jit
def _range_kernel(n_ptr, out_ptr):
    n = tl.load(n_ptr)
    acc = n * 0
    for i in range(n):
        acc += i
    tl.store(out_ptr, acc)


def test_range_over_a_runtime_scalar_runs():
    # Triton 3.6's interpreter raised TypeError here (launch.fix_interpreter).
    launch.fix_interpreter()
    out = torch.zeros(1, dtype=torch.int64)
    _range_kernel[(1,)](torch.tensor([5]), out)
    assert out.tolist() == [10]


def test_installed_triton_has_every_feature_the_kernels_need():
    assert launch.missing_features() == []


@settings(max_examples=15)
@given(n=st.integers(0, 60), seed=st.integers(0, 2**16))
def test_concurrent_probe_matches_the_plain_probe(n, seed):
    table = new_table(64, 4, "cpu")
    g, h = _keys(n, seed)
    hash_index.insert(table, 4, g[: n // 2], h[: n // 2])
    plain = hash_index.probe(table, 4, g, h)
    assert torch.equal(hash_index.probe(table, 4, g, h, concurrent=True), plain)
    # Random 64-bit words: the first half's keys are distinct, none later.
    assert bool(plain[: n // 2].all()) and int(plain.sum()) == n // 2


_ACQUIRE_PTX = r"""
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvhit.kernels import hash_index as k

sig = {"table_ptr": "*i64", "cap_mask": "i64", "gid_ptr": "*i64", "key_ptr": "*i64",
       "out_ptr": "*i8", "n": "i32", "W": "constexpr", "BLOCK": "constexpr",
       "ACQUIRE": "constexpr", "MODE": "constexpr"}
src = ASTSource(fn=k._probe_kernel, signature=sig,
                constexprs={"W": 4, "BLOCK": 128, "ACQUIRE": True, "MODE": k._PROBE})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(" ".join(sorted(set(re.findall(r"(?:atom|fence)\.[\w.]+", ptx)))))
"""


def test_concurrent_probe_reads_with_acquire_atomics():
    from conftest import compile_outside_interpreter

    ops = compile_outside_interpreter(_ACQUIRE_PTX)
    assert "acquire" in ops and ".or." in ops, ops
