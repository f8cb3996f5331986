"""TritonBackend's cost outside the kernel: torch ops, launches, host syncs.

The GPU targets of ARCHITECTURE.md (a 4096-request lookup in well under a
millisecond, capturable in a CUDA graph) need ``TritonBackend.lookup`` to be
one launch, with no host sync and a handful of torch ops around it. These
tests count on the CPU (interpreter) what would cost host time on a GPU:

* **torch ops**: every ATen op dispatched during the call (allocations,
  arithmetic, copies), seen by a ``TorchDispatchMode``, outside the kernel
  launch itself. Under ``TRITON_INTERPRET=1`` the launch copies every tensor
  argument to numpy and back (there it *is* the device); on a GPU it is one
  driver call with no ATen op, so the launch is excluded.
* **host syncs**, outside the launch: any ATen op whose result the host must
  wait for (``_local_scalar_dense`` behind ``.item()`` / ``bool()`` /
  ``int()``, ``is_nonzero``, data-dependent shapes such as ``nonzero`` or
  ``masked_select``), any copy between devices, and the Python-level calls
  that read tensor values (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``,
  ``.numpy()``), seen by a ``TorchFunctionMode``. On a CPU every tensor is on
  the host, so a device copy cannot show; the Python-level check covers it.

Before issue 13 the engine's triton ``lookup`` ran 79 torch ops, two launches
and one ``.item()`` per call; now: one op (the output), one launch, none.
"""

from __future__ import annotations

import pytest
import torch
from strategies import chained_hashes, saved_keys
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kvhit import HashBatch, KeyIndex, ReferenceCoordinator
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.backend import Backend
from kvhit.coordinator.plan import ScanPlan
from kvhit.coordinator.triton_backend import TritonBackend

MAX_TORCH_OPS = 10

_SYNC_ATEN = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::equal",
}
_SYNC_METHODS = {"item", "tolist", "__bool__", "cpu", "numpy", "__int__", "__index__"}


class _Recorder(TorchDispatchMode):
    """ATen ops dispatched while ``counting``; host syncs among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting:
            name = func._schema.name
            self.ops.append(name)
            devices = {
                a.device
                for a in (*args, *kwargs.values())
                if isinstance(a, torch.Tensor)
            }
            if name in _SYNC_ATEN or len(devices) > 1:
                self.syncs.append(name)
        return func(*args, **kwargs)


class _ValueReads(TorchFunctionMode):
    """Python-level reads of tensor values while ``counting``."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.counting = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.counting and name in _SYNC_METHODS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _case(device, n_req: int = 5):
    layout = make_layout("dsv4-flash")
    hl = chained_hashes(4, 130)
    other = chained_hashes(5, 70, prefix=hl[:40])
    exists = saved_keys(layout, hl, 512) | saved_keys(layout, other, 280)
    keys = sorted(exists)
    index = KeyIndex(8, capacity=1024, device=device)
    index.add([g for g, _ in keys], [h for _, h in keys])
    requests = [hl, other, hl[:3], [], hl[:100]][:n_req]
    num_tokens = [512, 281, 12, 0, 400][:n_req]
    return layout, requests, exists, index, num_tokens


def _instrumented_call(monkeypatch, fn):
    """Run ``fn()`` under both recorders, the kernel launch not recorded;
    returns ``(result, recorder, value_reads, launches)``."""
    import kvhit.kernels.scan as scan

    rec, reads = _Recorder(), _ValueReads()
    launches = []
    kernel = scan._scan_kernel

    class Launch:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append(grid)
                rec.counting = reads.counting = False
                try:
                    return kernel[grid](*args, **kwargs)
                finally:
                    rec.counting = reads.counting = True

            return run

    monkeypatch.setattr(scan, "_scan_kernel", Launch())
    with reads, rec:
        out = fn()
    return out, rec, reads, launches


def test_backend_implements_the_protocol(device):
    backend = TritonBackend(ScanPlan.from_layout(make_layout("dsv4-flash")), device)
    assert isinstance(backend, Backend) and backend.name == "triton"


def test_lookup_is_one_launch_few_ops_no_sync(device, monkeypatch):
    layout, requests, exists, index, num_tokens = _case(device)
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    view = HashBatch.from_bytes(requests, 8, device).view()
    n = torch.tensor(num_tokens, dtype=torch.int64, device=device)
    backend.lookup(view, n, index)  # plan tensors cached, kernel compiled

    out, rec, reads, launches = _instrumented_call(
        monkeypatch, lambda: backend.lookup(view, n, index)
    )
    assert launches == [(len(requests),)]
    assert len(rec.ops) <= MAX_TORCH_OPS, rec.ops
    assert rec.syncs == [] and reads.reads == [], (rec.syncs, reads.reads)
    ref = ReferenceCoordinator(layout)
    want = [
        ref.lookup(t, hl, exists) for hl, t in zip(requests, num_tokens, strict=True)
    ]
    assert out.tolist() == want
    # The case exercises the in-kernel second search and the early exits.
    assert want[0] < 512 and 0 in want


def test_find_is_one_launch_few_ops_no_sync(device, monkeypatch):
    layout, requests, exists, index, num_tokens = _case(device)
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    view = HashBatch.from_bytes(requests, 8, device).view()
    n = torch.tensor(num_tokens, dtype=torch.int64, device=device)
    backend.find(view, n, index, True)

    (hit, _), rec, reads, launches = _instrumented_call(
        monkeypatch, lambda: backend.find(view, n, index, True)
    )
    assert launches == [(len(requests),)]
    assert len(rec.ops) <= MAX_TORCH_OPS, rec.ops
    assert rec.syncs == [] and reads.reads == [], (rec.syncs, reads.reads)
    ref = ReferenceCoordinator(layout)
    want = [
        ref.find_longest_cache_hit(hl, t, exists)[1]
        for hl, t in zip(requests, num_tokens, strict=True)
    ]
    assert hit.tolist() == want


def test_the_recorders_see_what_they_must(device, monkeypatch):
    """The checks above could fail: an ``.item()``, a ``nonzero`` and a few
    ops outside the launch are all seen."""
    t = torch.arange(4, device=device)

    def syncing():
        (t + 1).nonzero()
        return int((t * 2).sum().item())

    _, rec, reads, _ = _instrumented_call(monkeypatch, syncing)
    assert "aten::nonzero" in rec.syncs and "aten::_local_scalar_dense" in rec.syncs
    assert "item" in reads.reads and len(rec.ops) >= 4


def test_lookup_refuses_a_view_with_token_lens(device):
    layout, requests, _, index, num_tokens = _case(device, 2)
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    n = torch.tensor(num_tokens, dtype=torch.int64, device=device)
    view = HashBatch.from_bytes(requests, 8, device).view(n)
    with pytest.raises(ValueError, match="token_lens"):
        backend.lookup(view, n, index)


# -- issue 31: the engine's host path on the triton backend ---------------------


def test_engine_lookup_checks_lengths_in_the_kernel(device, monkeypatch):
    """A tensor of lengths is not read before the launch: the kernel flags a
    negative length and the one copy of the answer raises, naming the
    argument and position; nothing is returned for it."""
    from kvhit.coordinator.engine import LookupEngine

    layout, requests, exists, index, num_tokens = _case(device)
    engine = LookupEngine(layout, backend="triton", device=device)
    batch = HashBatch.from_bytes(requests, 8, device)
    n = torch.tensor(num_tokens, dtype=torch.int64, device=device)
    want = engine.lookup(batch, num_tokens, index).tolist()

    out, rec, reads, launches = _instrumented_call(
        monkeypatch, lambda: engine.lookup(batch, n, index)
    )
    assert out.tolist() == want and launches == [(len(requests),)]
    # One copy to the host, the answer's (a short one read as a list); no
    # other read (the view is cached per batch).
    assert reads.reads == ["tolist"], reads.reads
    assert rec.syncs == [] and len(rec.ops) <= 3, rec.ops

    for bad, pos, value in (
        ([4, -4, 8, 0, 1], 1, -4),
        ([0, 1, 2, 3, -(2**40)], 4, -(2**40)),
    ):
        t = torch.tensor(bad, dtype=torch.int64, device=device)
        with pytest.raises(
            ValueError, match=rf"num_tokens\[{pos}\] must be >= 0, got {value}"
        ):
            engine.lookup(batch, t, index)
        with pytest.raises(ValueError, match=rf"max_lengths\[{pos}\] must be >= 0"):
            engine.find_longest_cache_hit(batch, t, index)
    # A list is checked on the host: no read of device values at all.
    out, rec, reads, _ = _instrumented_call(
        monkeypatch, lambda: engine.lookup(batch, num_tokens, index)
    )
    assert out.tolist() == want and reads.reads == [] and rec.syncs == []
    with pytest.raises(ValueError, match=r"num_tokens\[2\] must be >= 0, got -1"):
        engine.lookup(batch, [1, 2, -1, 0, 3], index)


def test_check_answer_reads_a_long_answer_through_numpy(device):
    """Past 64 requests the answer's one copy is read as numpy, not a list:
    a flagged entry still raises the lengths' ValueError at its position,
    and an answer without one passes."""
    from kvhit.kernels.scan import LENGTH_FLAG

    layout, *_ = _case(device)
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    for n, pos in ((64, 63), (65, 64), (300, 170)):
        lens = torch.arange(n, dtype=torch.int64, device=device)
        hit = lens.clone()
        backend.check_answer(hit, (lens, (lens, "num_tokens")))
        lens[pos] = -3
        hit[pos] = LENGTH_FLAG
        with pytest.raises(ValueError, match=rf"num_tokens\[{pos}\] must be >= 0"):
            backend.check_answer(hit, (lens, (lens, "num_tokens")))
        # Lengths checked on the host: nothing read.
        backend.check_answer(hit, (lens, None))


def test_the_kernel_flags_negative_lengths_and_scans_the_rest(device):
    """``launch_scan`` with negative lengths: those requests' hits are
    ``LENGTH_FLAG``, every other request's equals the reference."""
    from kvhit.kernels.scan import LENGTH_FLAG, launch_scan

    layout, requests, exists, index, num_tokens = _case(device)
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    view = HashBatch.from_bytes(requests, 8, device).view()
    lens = torch.tensor([-1, 281, -7, 0, 400], dtype=torch.int64, device=device)
    sg_rows, cand_rows = backend._rows(view.device)
    kwargs = dict(ScanPlan.from_layout(layout).params._asdict())
    for lookup in (True, False):
        hit, _ = launch_scan(view.rows, view.offsets, view.lengths, lens, None,
                             index.table, sg_rows, cand_rows, apply_eagle=True,
                             lookup=lookup, **kwargs)  # fmt: skip
        ref = ReferenceCoordinator(layout)
        got = hit.tolist()
        assert got[0] == got[2] == LENGTH_FLAG
        for r in (1, 3, 4):
            t = int(lens[r])
            want = (
                ref.lookup(t, requests[r], exists)
                if lookup
                else ref.find_longest_cache_hit(requests[r], t, exists)[1]
            )
            assert got[r] == want, (lookup, r)


def test_the_view_is_built_once_per_batch(device):
    layout, requests, _, index, num_tokens = _case(device)
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    batch = HashBatch.from_bytes(requests, 8, device)
    v = backend.view(batch)
    assert backend.view(batch) is v
    other = HashBatch.from_bytes(requests[:2], 8, device)
    assert backend.view(other) is not v and len(backend.view(other)) == 2
    # Offsets written in place: the view is built again.
    batch.offsets.add_(0)
    assert backend.view(batch) is not v


def test_warm_up_is_a_no_op_under_the_interpreter(device):
    backend = TritonBackend(ScanPlan.from_layout(make_layout("dsv4-flash")), device)
    if torch.device(device).type == "cuda":
        pytest.skip(
            "the CUDA warm-up is tested by test_warm_up_loads_the_lookup_variant"
        )
    backend.warm_up()
    assert backend._warm == set()


@pytest.mark.gpu
def test_warm_up_loads_the_lookup_variant():
    """After ``warm_up`` the first lookup compiles nothing: it may even run
    inside a CUDA-graph capture (the backend refuses a cold variant there)."""
    layout, requests, exists, index, num_tokens = _case("cuda")
    index = KeyIndex(32, capacity=1024, device="cuda")
    backend = TritonBackend(ScanPlan.from_layout(layout), "cuda")
    backend.warm_up()
    assert ("lookup", 4) in backend._warm
    hashes = [[bytes([i]) * 32 for i in range(1, 9)]]
    view = HashBatch.from_bytes(hashes, 32, "cuda").view()
    n = torch.tensor([32], dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.lookup(view, n, index)
    graph.replay()
    assert out.tolist() == [0]


@pytest.mark.gpu
def test_pinned_lengths_equal_tensor_lengths_on_cuda():
    """Lists of lengths of growing and shrinking sizes go through the two
    reused pinned buffers; every answer equals the tensor path's."""
    from kvhit.coordinator.engine import LookupEngine

    layout, requests, exists, index, num_tokens = _case("cuda")
    engine = LookupEngine(layout, backend="triton", device="cuda")
    for n in (1, 5, 2, 5, 3, 5):
        batch = HashBatch.from_bytes(requests[:n], 8, "cuda")
        t = torch.tensor(num_tokens[:n], dtype=torch.int64, device="cuda")
        want = engine.lookup(batch, t, index).tolist()
        assert engine.lookup(batch, num_tokens[:n], index).tolist() == want


def test_a_warm_lookup_launches_as_launch_scan_does(device, monkeypatch):
    """The second call of a lookup variant goes through the scan's
    LookupLaunch (its constexprs, ints and key built once): the same key,
    arguments and constexprs as launch_scan's first call, the same answers;
    keys added since are seen (the index's table is read at each call)."""
    import kvhit.kernels.scan as scan

    layout, requests, exists, index, num_tokens = _case(device)
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    view = HashBatch.from_bytes(requests, 8, device).view()
    n = torch.tensor(num_tokens, dtype=torch.int64, device=device)
    seen = []
    launch = scan.SCAN_LAUNCHER.launch

    def spy(kernel, grid, key, args, constexprs, options, dev):
        seen.append((grid, key, args, dict(constexprs), options))
        return launch(kernel, grid, key, args, constexprs, options, dev)

    monkeypatch.setattr(scan.SCAN_LAUNCHER, "launch", spy)
    first = backend.lookup(view, n, index)
    assert (view.device, 1) in backend._lookups  # 8-byte hashes: one word
    second = backend.lookup(view, n, index)
    assert second.tolist() == first.tolist()
    (g0, k0, a0, c0, o0), (g1, k1, a1, c1, o1) = seen
    assert (g0, k0, c0, o0) == (g1, k1, c1, o1)
    # Every argument but the fresh answer (hit, and mask_spans = hit).
    same = [i for i in range(len(a0)) if i not in (9, 10)]
    for i in same:
        x, y = a0[i], a1[i]
        assert (x is y) if isinstance(x, torch.Tensor) else (x == y), i
    assert a1[9] is a1[10] is second
    # Keys added since (the table read at each call, a grown one too).
    ref = ReferenceCoordinator(layout)
    extra = chained_hashes(9, 130)
    more = saved_keys(layout, extra, 512)
    index.add([g for g, _ in sorted(more)], [h for _, h in sorted(more)])
    grown = HashBatch.from_bytes([*requests, extra], 8, device).view()
    lens = torch.tensor([*num_tokens, 512], dtype=torch.int64, device=device)
    got = backend.lookup(grown, lens, index).tolist()
    want = [ref.lookup(t, h, exists | more)
            for h, t in zip([*requests, extra], [*num_tokens, 512], strict=True)]  # fmt: skip
    assert got == want and want[-1] > 0
    assert seen[-1][2][5] is index.table
