"""kernels/launch.py's DirectLauncher: the first call of a variant goes
through Triton's binder (``kernel[grid](...)``), later ones straight to the
compiled kernel's launcher with every argument in signature order; a
launcher that refuses the arguments (TypeError) or a launch hook sends it
back to the binder. Fakes stand in for Triton here (the real path needs a
GPU: test_gpu_parity and the gpu-marked test below)."""

from __future__ import annotations

import pytest
import torch

from kvhit.kernels import launch
from kvhit.kernels.launch import DirectLauncher, int_key


class _Compiled:
    def __init__(self, log, refuse=False):
        self.log, self.refuse = log, refuse
        self.function, self.packed_metadata = "fn", "meta"

    def launch_metadata(self, grid, stream, *args):
        return ("md", grid, stream, len(args))

    def run(self, *a):
        if self.refuse:
            raise TypeError("launcher takes other arguments")
        self.log.append(("direct", a))


class _Kernel:
    def __init__(self, refuse=False):
        self.log, self.refuse = [], refuse

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("binder", grid, args, kwargs))
            return _Compiled(self.log, self.refuse)

        return call


@pytest.fixture
def cuda_stream(monkeypatch):
    class Stream:
        cuda_stream = 7

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    # A device with an index goes through the driver's raw getter instead.
    monkeypatch.setattr(launch, "stream_getter", lambda: lambda index: 7)


def _launcher():
    d = DirectLauncher()
    d.enabled = True  # the interpreter disables it; the fakes need no GPU
    return d


def test_binder_first_then_direct_with_every_argument_in_order(cuda_stream):
    k, d = _Kernel(), _launcher()
    x = torch.zeros(4, dtype=torch.int64)
    dev = torch.device("cpu")
    for _ in range(3):
        d.launch(k, 5, ("v",), (x, 3), {"W": 4, "B": True}, {"num_warps": 2}, dev)
    assert [e[0] for e in k.log] == ["binder", "direct", "direct"]
    assert k.log[0][1:] == ((5,), (x, 3), {"W": 4, "B": True, "num_warps": 2})
    from triton import knobs

    rt = knobs.runtime
    md = ("md", (5,), 7, 4)
    want = (5, 1, 1, 7, "fn", "meta", md, rt.launch_enter_hook, rt.launch_exit_hook)
    assert k.log[1][1] == (*want, x, 3, 4, True)
    assert d.direct_launches == 2
    # Another variant key, or a misaligned tensor, is compiled by the binder.
    d.launch(k, 5, ("w",), (x, 3), {"W": 4}, {}, dev)
    d.launch(k, 5, ("v",), (x[1:], 3), {"W": 4, "B": True}, {}, dev)
    assert [e[0] for e in k.log[3:]] == ["binder", "binder"]


def test_a_two_dimensional_grid_and_the_int_key(cuda_stream):
    # The fleet scan's grid is (requests, programs per request).
    k, d = _Kernel(), _launcher()
    x = torch.zeros(4, dtype=torch.int64)
    dev = torch.device("cpu")
    for _ in range(2):
        d.launch(k, (6, 4), ("v",), (x, 2), {"W": 4}, {"num_warps": 4}, dev)
    assert k.log[0][:2] == ("binder", (6, 4))
    assert k.log[1][0] == "direct" and k.log[1][1][:3] == (6, 4, 1)
    assert k.log[1][1][6] == ("md", (6, 4), 7, 3)
    # The binder's int specialisations: == 1, divisible by 16, 64 bits.
    assert int_key((1, 32, 7, 2**31, -(2**31))) == (
        (True, False, False),
        (False, True, False),
        (False, False, False),
        (False, True, True),
        (False, True, False),
    )


def test_a_refusing_launcher_falls_back_for_good(cuda_stream):
    k, d = _Kernel(refuse=True), _launcher()
    x = torch.zeros(2, dtype=torch.int64)
    dev = torch.device("cpu")
    for _ in range(3):
        d.launch(k, 1, (), (x,), {}, {}, dev)
    assert [e[0] for e in k.log] == ["binder", "binder", "binder"]
    assert not d.enabled and d.direct_launches == 0


def test_the_interpreter_never_launches_directly(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not DirectLauncher().enabled
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("KVHIT_TRITON_DIRECT", "0")
    assert not DirectLauncher().enabled


@pytest.mark.gpu
def test_direct_launches_equal_binder_launches():
    """On CUDA: the engine's lookups through the direct path equal the
    binder's (the direct path switched off), and the direct path ran."""
    import random

    from strategies import chained_hashes, saved_keys

    from kvhit import HashBatch, KeyIndex
    from kvhit.bench.workloads import make_layout
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.kernels import scan

    layout = make_layout("dsv4-flash")
    rng = random.Random(0)
    prompts = [chained_hashes(i, rng.randint(1, 300)) for i in range(40)]
    keys = set()
    for p in prompts[::2]:
        keys |= saved_keys(layout, p, len(p) * 4)
    keys = sorted(keys)
    index = KeyIndex(8, capacity=1 << 14, device="cuda")
    index.add([g for g, _ in keys], [h for _, h in keys])
    engine = LookupEngine(layout, backend="triton", device="cuda")
    batch = HashBatch.from_bytes(prompts, 8, "cuda")
    tokens = [len(p) * 4 - rng.randint(0, 3) for p in prompts]
    before = scan.SCAN_LAUNCHER.direct_launches
    direct = [engine.lookup(batch, tokens, index).tolist() for _ in range(3)]
    assert scan.SCAN_LAUNCHER.direct_launches > before
    scan.SCAN_LAUNCHER.enabled = False
    try:
        binder = engine.lookup(batch, tokens, index).tolist()
    finally:
        scan.SCAN_LAUNCHER.enabled = True
    assert direct == [binder] * 3 and any(binder)


@pytest.mark.gpu
def test_fleet_direct_launches_equal_binder_launches():
    """On CUDA: the Triton fleet's scan (two launches a call, issue 32's host
    path) through the direct path equals the binder's, and the direct path
    ran."""
    import random

    from strategies import chained_hashes, saved_keys

    from kvhit import FleetIndex, HashBatch, LookupEngine
    from kvhit.bench.workloads import make_layout
    from kvhit.kernels import fleet_triton

    layout = make_layout("llama")
    hbs = layout.hash_block_size
    rng = random.Random(0)
    prompts = [chained_hashes(i % 5, rng.randint(1, 600)) for i in range(24)]
    fleet = FleetIndex(3, 8, capacity=1 << 14, device="cuda", backend="triton")
    for e in range(3):
        keys: set = set()
        for p in prompts[e::3]:
            keys |= saved_keys(layout, p, layout.align(rng.randint(0, len(p)) * hbs))
        keys = sorted(keys)
        fleet.add(e, [g for g, _ in keys], [h for _, h in keys])
    engine = LookupEngine(layout, backend="torch", device="cuda")
    batch = HashBatch.from_bytes(prompts, 8, "cuda")
    lens = [len(p) * hbs for p in prompts]
    launchers = (fleet_triton._DIRECT_FLEET, fleet_triton._DIRECT_FINISH)
    before = [d.direct_launches for d in launchers]

    def answers():
        return (
            engine.fleet_hits(batch, lens, fleet).tolist(),
            engine.fleet_lookup(batch, lens, fleet).tolist(),
        )

    direct = [answers() for _ in range(3)]
    assert all(d.direct_launches > b for d, b in zip(launchers, before, strict=True))
    for d in launchers:
        d.enabled = False
    try:
        binder = answers()
    finally:
        for d in launchers:
            d.enabled = True
    assert direct == [binder] * 3 and any(any(row) for row in binder[0])


def test_lookup_launch_runs_its_kept_kernel_with_the_binders_arguments(
    cuda_stream, monkeypatch
):
    """scan.LookupLaunch (the engine's warm lookup): once its variant was
    launched, an aligned call goes straight to ``DirectLauncher.run`` with
    the compiled kernel it kept (no ``launch``), every argument in
    signature order: the real kernel (interpreted) behind a fake compiled
    kernel gives the reference's answers. A misaligned tensor, or direct
    launches off, go back through ``launch``."""
    import random

    from strategies import chained_hashes, saved_keys

    from kvhit import HashBatch, KeyIndex
    from kvhit.bench.workloads import make_layout
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.kernels import scan

    real = scan._scan_kernel
    names = real.arg_names
    log: list[str] = []

    class Compiled(_Compiled):
        def run(self, g0, g1, g2, stream, fn, meta, md, enter, exit_, *every):
            assert (g1, g2) == (1, 1) and len(every) == len(names)
            log.append("direct")
            real[(g0,)](**dict(zip(names, every, strict=True)), **scan._OPTIONS)

    class Kernel:
        def __getitem__(self, grid):
            def call(*args, **kwargs):
                log.append("binder")
                real[grid](*args, **kwargs)
                return Compiled(log)

            return call

    launcher = _launcher()
    launches = []
    generic = launcher.launch

    def counted(*a):
        launches.append(1)
        return generic(*a)

    monkeypatch.setattr(launcher, "launch", counted)
    monkeypatch.setattr(scan, "SCAN_LAUNCHER", launcher)
    monkeypatch.setattr(scan, "_scan_kernel", Kernel())

    layout = make_layout("llama")
    hbs = layout.hash_block_size
    rng = random.Random(1)
    prompts = [chained_hashes(i % 2, rng.randint(1, 24)) for i in range(4)]
    keys: set = set()
    for p in prompts[:1]:
        keys |= saved_keys(layout, p, len(p) * hbs)
    keys = sorted(keys)
    index = KeyIndex(8, capacity=1 << 10)
    index.add([g for g, _ in keys], [h for _, h in keys])
    batch = HashBatch.from_bytes(prompts, 8)
    tokens = torch.tensor([len(p) * hbs - rng.randint(0, 3) for p in prompts])
    want = LookupEngine(layout, backend="reference").lookup(batch, tokens, index)
    engine = LookupEngine(layout, backend="triton", device="cpu")
    got = [engine.lookup(batch, tokens, index).tolist() for _ in range(3)]
    assert got == [want.tolist()] * 3 and any(want.tolist())
    # The first call compiles (the binder), the second launches directly
    # through launch(), the third through run() alone.
    assert log == ["binder", "direct", "direct"] and len(launches) == 2
    # A misaligned tensor (8 bytes in): launch(), which compiles its variant.
    view = batch.view()
    (fast,) = engine.impl._lookups.values()
    shifted = torch.cat([tokens[:1], tokens])[1:]
    assert shifted.data_ptr() % 16 == 8
    hit = fast(view.rows, view.offsets, view.lengths, shifted, index.table)
    assert hit.tolist() == want.tolist()
    assert log[3:] == ["binder"] and len(launches) == 3
    # Direct launches off: launch(), through the binder.
    launcher.enabled = False
    assert engine.lookup(batch, tokens, index).tolist() == want.tolist()
    assert log[4:] == ["binder"] and len(launches) == 4
