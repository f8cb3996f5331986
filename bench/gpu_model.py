"""A cost model of the GPU lookup that runs without a GPU.

``python -m kvhit.bench.gpu_model`` runs the real Triton kernels of
``kernels/scan.py`` under ``TRITON_INTERPRET=1``, instrumented, and prints:

* per request (one Triton program): the dependent global-memory round trips
  on its critical path and its loads by kind (hash rows, table slots, plan
  rows, per-request scalars), with bytes and 32-byte sectors;
* per call of ``LookupEngine.lookup`` (validated) and ``lookup_unchecked``:
  Triton launches, other kernel launches, host syncs and torch ops, counted on
  the emulated path;
* a calibrated time model, ``launch + makespan(round trips x latency) +
  bytes / bandwidth``, its constants fitted to the H200 figures of
  ``shared/measurements/h200-2026-12-04.md`` (:data:`H200`), and a calibration
  table (measured vs modelled, every H200 graph row).

How the round trips are counted (:class:`Tracer`). Every value the
interpreter makes carries a depth: the most global-memory round trips any of
its inputs waited on. A load's result is one deeper than its address, mask
and ``other`` inputs, and than the program's control depth; the control depth
rises to a value's depth whenever the program branches on it (a ``while``
condition, an ``if``, a ``range`` bound: ``bool()`` / ``__index__`` of a
tensor). Reductions pass depth through. A program's round trips are the
deepest load it made. Loads made together (a 2-D load, or loads whose
addresses do not wait on each other) share a round trip, as on the GPU; a
loop step that waits on the previous step's reduction adds its loads' depth
again, as on the GPU. The model ignores L1/L2 hit rates: a round trip is
``T_RT`` whatever it hits (fitted), which is why it is calibrated.

Per call counts (:func:`count_call`): a ``TorchDispatchMode`` counts the aten
ops outside the Triton launch (views and allocations are not kernels;
``_local_scalar_dense`` is a sync) and a ``TorchFunctionMode`` the Python
calls that sync with the host on CUDA (``item``, ``tolist``, ``cpu``,
``numpy``, ``bool``, ``int``). On the CPU every tensor is on the host, so a
``.cpu()`` of a tensor that would live on the host anyway counts too: the
figures are an upper bound, and what the test watches is that they do not
rise.

Run: ``python -m kvhit.bench.gpu_model [--quick] [--json PATH]``; ``--quick``
runs the small workloads of ``tests/test_gpu_model.py`` only (seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import random
import sys
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field

from kvhit.bench.gpu_common import (
    LONGHIT_BS,
    HostTimes,
    cuda_items,
    eager_report,
    fit_host,
    host_python,  # fmt: skip
    host_time,
    interpret,
    tabulate,
)

__all__ = [
    "H200",
    "RECORDED",
    "CallCounts",
    "GpuTimes",
    "ProgramStats",
    "Tracer",
    "count_call",
    "main",
    "model_time",
    "trace_lookup",
]

# -- the H200 (shared/measurements/h200-2026-12-04.md) -----------------------------


@dataclass(frozen=True)
class GpuTimes:
    """The time model's constants (seconds, bytes/s) and the machine's shape.

    ``t_launch``: a graph-replayed kernel launch and its drain; ``t_rt``: one
    dependent global-memory round trip of a program (L2 or HBM, averaged);
    ``bw``: achieved memory bandwidth for the bytes loaded; ``sms`` and
    ``regs_per_sm`` bound the resident programs (:func:`resident`).
    Fitted by :func:`fit` to the two anchor rows of :data:`H200` (B = 1
    long-hit dsv4 graph 39 us, llama 4096 x 128K graph 737 us)."""

    t_launch: float = 2.0e-6
    t_rt: float = 0.553e-6
    bw: float = 3.0e12
    sms: int = 132
    regs_per_sm: int = 65536
    max_ctas_per_sm: int = 32


#: Measured graph-replay times on the H200 (seconds), by workload name.
H200: dict[str, float] = {
    "longhit-B1": 39e-6,
    "longhit-B64": 60e-6,
    "longhit-B1024": 77e-6,
    "longhit-B4096": 122e-6,
    "llama-4096x128K": 737e-6,
    "gemma3-4096x128K": 900e-6,
    "qwen3-next-4096x128K": 227e-6,
    "dsv4-flash-4096x128K": 225e-6,
}
#: The kernel the H200 ran (commit a094dd7) under this model: critical round
#: trips (the makespan over the resident programs) and bytes from L2/HBM, per
#: H200 row (``python -m kvhit.bench.gpu_model --refit`` on that commit).
H200_KERNEL: dict[str, tuple[int, float]] = {
    "longhit-B1": (68, 8.66e3),
    "longhit-B64": (112, 0.554e6),
    "longhit-B1024": (134, 8.87e6),
    "longhit-B4096": (243, 35.5e6),
    "llama-4096x128K": (1043, 475.2e6),
    "gemma3-4096x128K": (1016, 489.1e6),
    "qwen3-next-4096x128K": (369, 170.0e6),
    "dsv4-flash-4096x128K": (263, 77.7e6),
}
#: The two rows the constants are fitted to (the issue's acceptance rows).
ANCHORS = ("longhit-B1", "llama-4096x128K")

#: The recorded figures tests/test_gpu_model.py holds the kernel to (they may
#: fall, never rise): the most round trips of a request of the quick
#: workloads, and per call of LookupEngine.lookup / lookup_unchecked on the
#: triton backend (warm), Triton launches, other kernel launches, host syncs.
#: Round trips at a094dd7 (the H200's kernel): 136 and 64; issue 31's wide
#: tiles: 42 and 8 (9 once Triton 3.6 forced the prefetch out); a probe's
#: later steps visiting two slots at once, and the chains above a search's
#: first miss stopped: 34 and 7. Bytes per request of quick-llama (hash rows
#: and table slots): the key's words loaded once per probe, not again at
#: every probe step: 18208 -> 12861 bytes; the chains stopped: 12241; the
#: leading run's first tile half as wide (one-warp programs, their wide
#: tile's chains reloading its words): 8297. Per call, before
#: issue 31's host path: ``lookup`` with a
#: tensor of lengths 2 syncs (the view's and the lengths' ``.numpy()``; on
#: CUDA the lengths' check: a compare, an ``any`` and a blocking ``bool``),
#: 5 torch ops; now 1 sync (the answer's copy, which carries the in-kernel
#: length check), 1 torch op (the answer's allocation; the copy is the
#: sync, a ``tolist`` up to 64 requests); a list of lengths 0 syncs (checked on the
#: host, on CUDA through a pinned buffer). ``lookup_unchecked``'s one sync is
#: the engine's ``batch.view()`` (``.numpy()`` on the CPU; on CUDA no sync but
#: one subtraction kernel), which the engine, not the backend, calls.
#: ``min_resident_programs`` may only rise: the scan's programs resident on
#: the H200 at once (:func:`resident`), 1056 at two warps, 2112 at one; at
#: 4096 requests the makespan over them, not one request, bounds a call.
RECORDED: dict[str, int] = {
    "quick_longhit_max_rt": 34,
    # Loading the next tile's words ahead would save a round trip a tile
    # step: Triton 3.6 (the H200 machine's) cannot compile it in a while
    # loop, and in a for loop it spills (the words of two tiles held).
    "quick_llama_max_rt": 7,
    "quick_llama_bytes": 8297,
    "lookup_triton_launches": 1,
    "lookup_other_launches": 0,
    "lookup_syncs": 1,
    "lookup_torch_ops": 1,
    "list_triton_launches": 1,
    "list_other_launches": 0,
    "list_syncs": 0,
    "unchecked_triton_launches": 1,
    "unchecked_other_launches": 0,
    "unchecked_syncs": 1,
    "min_resident_programs": 2112,
    # The eager call's host on CUDA (bench/gpu_common.py's HostTimes, us):
    # its Python measured here with the launch stubbed (thread time; the
    # test allows 2x for a loaded host) and the modelled host time (that
    # Python and the counted items; a094dd7's: 214 us validated, 99 us
    # unchecked, as fitted). Python 37/31/33 -> 19/16/18 once a warm lookup
    # launched through the scan's LookupLaunch (launch_scan's constexprs,
    # ints and key built once); host 70/59/61 -> 55/47/49 (the direct
    # launch's cost raised 6 -> 9 us when its Python was measured, 5 us).
    # Then the warm lookup launched the compiled kernel its LookupLaunch
    # keeps (DirectLauncher.run: no variant key, no alignment tuple; 5.5 ->
    # 1.4 us of Python, t_direct 9 -> t_run 5.4 us), the Python measured on
    # that path (the run stubbed, not the whole launch), and a short
    # answer's flag check read as a list (2.6 -> 0.5 us): Python
    # 18/16/17 -> 12/17/18, host 54/47/48 -> 45/45/45 (side by side with
    # main, load 14).
    "lookup_python_us": 13,
    "list_python_us": 18,
    "unchecked_python_us": 18,
    "lookup_host_us": 46,
    "list_host_us": 46,
    "unchecked_host_us": 46,
}


def resident(num_warps: int, maxnreg: int, g: GpuTimes) -> int:
    """Programs resident on the whole GPU at once (the register file bound)."""
    per_sm = g.regs_per_sm // (maxnreg * 32 * num_warps)
    return g.sms * max(1, min(per_sm, g.max_ctas_per_sm))


def makespan(round_trips: list[int], slots: int) -> int:
    """Round trips until the last of ``round_trips`` programs (in launch
    order) ends, ``slots`` running at once, each taking the next free slot."""
    if len(round_trips) <= slots:
        return max(round_trips, default=0)
    free = [0] * slots
    end = 0
    for rt in round_trips:
        t = heapq.heappop(free) + rt
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def model_time(
    round_trips: list[int], total_bytes: float, slots: int, g: GpuTimes
) -> float:
    """Seconds of one graph-replayed call: launch, the critical path over the
    resident slots, and the bytes at the achieved bandwidth."""
    return g.t_launch + makespan(round_trips, slots) * g.t_rt + total_bytes / g.bw


# Kernel arguments whose loads hit L1 (the plan rows).
_L1_KINDS = frozenset({"sg_ptr", "cand_ptr"})

# -- the tracer ------------------------------------------------------------------


@dataclass
class ProgramStats:
    """One program's (one request's) memory traffic under the tracer."""

    round_trips: int = 0
    loads: Counter = field(default_factory=Counter)  # load instructions by kind
    bytes: Counter = field(default_factory=Counter)  # bytes by kind (lanes on)
    sectors: Counter = field(default_factory=Counter)  # 32-byte sectors by kind


@dataclass
class KernelLaunch:
    name: str
    grid: tuple
    programs: list[ProgramStats]


class Tracer(contextlib.AbstractContextManager):
    """Instruments Triton's interpreter while active (see the module docstring).

    ``launches`` collects one :class:`KernelLaunch` per Triton launch, with
    one :class:`ProgramStats` per program. Needs ``TRITON_INTERPRET=1`` set
    before triton was imported."""

    def __init__(self) -> None:
        self.launches: list[KernelLaunch] = []
        self.inside_launch = 0
        self._undo: list[tuple[object, str, object]] = []
        self._ranges: list[tuple[int, int, str]] = []
        self._prog: ProgramStats | None = None
        self._ctrl = 0

    # depth bookkeeping on the interpreter's TensorHandle.attr
    @staticmethod
    def _depth(x) -> int:
        from triton.runtime.interpreter import TensorHandle

        if isinstance(x, TensorHandle):
            return x.attr.get("rt", 0)
        handle = getattr(x, "handle", None)
        if isinstance(handle, TensorHandle):
            return handle.attr.get("rt", 0)
        if isinstance(x, (list, tuple)):
            return max((Tracer._depth(v) for v in x), default=0)
        return 0

    @staticmethod
    def _set(x, d: int) -> None:
        from triton.runtime.interpreter import TensorHandle

        if isinstance(x, TensorHandle):
            if d > x.attr.get("rt", 0):
                x.attr = {**x.attr, "rt": d}
        elif isinstance(getattr(x, "handle", None), TensorHandle):
            Tracer._set(x.handle, d)
        elif isinstance(x, (list, tuple)):
            for v in x:
                Tracer._set(v, d)

    def _patch(self, obj: object, name: str, value: object) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _kind(self, addr: int) -> str:
        for lo, hi, name in self._ranges:
            if lo <= addr < hi:
                return name
        return "other"

    def _on_load(self, ptrs, mask, result) -> None:
        import numpy as np

        addr = np.asarray(ptrs.data).reshape(-1)
        on = np.asarray(mask.data).reshape(-1).astype(bool)
        if on.size == 1 and addr.size > 1:
            on = np.broadcast_to(on, addr.shape)
        live = addr[on]
        kind = self._kind(int(live[0])) if live.size else "other"
        # The plan rows are a few hundred bytes every program reads: L1 hits
        # after the first, so they add no global round trip (they are
        # counted as loads). A fully masked load moves nothing.
        step = 1 if live.size and kind not in _L1_KINDS else 0
        d = max(self._depth(ptrs), self._depth(mask), self._ctrl) + step
        self._set(result, d)
        prog = self._prog
        if prog is None or not live.size:
            return
        prog.round_trips = max(prog.round_trips, d)
        prog.loads[kind] += 1
        itemsize = max(result.data.dtype.itemsize, 1)
        prog.bytes[kind] += int(live.size) * itemsize
        prog.sectors[kind] += int(np.unique(live // 32).size)

    def __enter__(self) -> Tracer:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the tracer needs TRITON_INTERPRET=1 before triton")
        from triton.runtime import interpreter as it

        # The scan module patches the interpreter when it is imported
        # (launch.fix_interpreter): before the tracer's patches, so that
        # restoring them at exit keeps that fix.
        import kvhit.kernels.scan  # noqa: F401

        tracer = self
        builder = it.interpreter_builder

        def propagate(fn):
            def wrapped(*args, **kwargs):
                out = fn(*args, **kwargs)
                d = max(
                    (tracer._depth(a) for a in (*args, *kwargs.values())), default=0
                )
                if d:
                    tracer._set(out, d)
                return out

            return wrapped

        for name in dir(type(builder)):
            if not name.startswith("create_") or name in (
                "create_masked_load",
                "create_load",
            ):
                continue
            if callable(getattr(builder, name, None)):
                self._patch(builder, name, propagate(getattr(builder, name)))

        masked_load = builder.create_masked_load

        def create_masked_load(ptrs, mask, other, *rest):
            out = masked_load(ptrs, mask, other, *rest)
            tracer._on_load(ptrs, mask, out)
            return out

        self._patch(builder, "create_masked_load", create_masked_load)
        for name in ("create_atomic_load", "create_atomic_cas", "create_atomic_rmw"):
            fn = getattr(builder, name, None)
            if fn is None:
                continue

            def atomic(*args, _fn=fn):
                out = _fn(*args)
                tracer._set(out, max(tracer._depth(args), tracer._ctrl) + 1)
                return out

            self._patch(builder, name, atomic)

        set_grid_idx = builder.set_grid_idx

        def new_program(x, y, z):
            set_grid_idx(x, y, z)
            tracer._ctrl = 0
            tracer._prog = ProgramStats()
            if tracer.launches:
                tracer.launches[-1].programs.append(tracer._prog)

        self._patch(builder, "set_grid_idx", new_program)

        # Reductions compute from numpy directly: carry the input's depth.
        apply = it.ReduceScanOpInterface.apply

        def reduce_apply(op, input):
            out = apply(op, input)
            tracer._set(out, tracer._depth(input))
            return out

        self._patch(it.ReduceScanOpInterface, "apply", reduce_apply)

        # A branch on a value waits for it: the control depth rises.
        patch_tensor = it._patch_lang_tensor

        def patch_lang_tensor(tensor, scope):
            patch_tensor(tensor, scope)
            for dunder in ("__bool__", "__index__", "__int__"):
                conv = tensor.__dict__.get(dunder)
                if conv is None:
                    continue

                def branch(t, _conv=conv):
                    tracer._ctrl = max(tracer._ctrl, tracer._depth(t))
                    return _conv(t)

                scope.set_attr(tensor, dunder, branch)

        self._patch(it, "_patch_lang_tensor", patch_lang_tensor)

        init_args = it.GridExecutor._init_args_hst
        call = it.GridExecutor.__call__

        def init_args_hst(executor, args_dev, kwargs):
            import torch

            args_hst, kwargs_hst = init_args(executor, args_dev, kwargs)
            names = list(executor.arg_names)
            tracer._ranges = []
            for name, arg in zip(names, args_hst, strict=False):
                if isinstance(arg, torch.Tensor):
                    lo = arg.data_ptr()
                    tracer._ranges.append(
                        (lo, lo + arg.numel() * arg.element_size(), name)
                    )
            return args_hst, kwargs_hst

        def grid_call(executor, *args, **kwargs):
            name = getattr(executor.fn, "__name__", "kernel")
            tracer.launches.append(KernelLaunch(name, executor.grid, []))
            tracer.inside_launch += 1
            try:
                return call(executor, *args, **kwargs)
            finally:
                tracer.inside_launch -= 1
                tracer._prog = None

        self._patch(it.GridExecutor, "_init_args_hst", init_args_hst)
        self._patch(it.GridExecutor, "__call__", grid_call)
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)


# -- per call counts ---------------------------------------------------------------

# Aten ops that launch no kernel: allocation, metadata, views.
_NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh",
    "_local_scalar_dense", "set_", "resize_", "is_pinned", "_pin_memory",
}  # fmt: skip
# Python calls that wait for the device on CUDA.
_SYNC_METHODS = {
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__",
    "__float__", "nonzero",
}  # fmt: skip


@dataclass
class CallCounts:
    """What one call asked of the device, counted on the emulated path."""

    triton_launches: int = 0
    other_launches: int = 0
    syncs: int = 0
    torch_ops: int = 0
    ops: Counter = field(default_factory=Counter)
    sync_calls: Counter = field(default_factory=Counter)
    host_python: float = 0.0  # seconds, measured (call_counts, host_python)


def count_call(fn) -> tuple[object, CallCounts, Tracer]:
    """Run ``fn()`` traced; returns its result, the per call counts and the
    tracer (its launches hold the per-program stats)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = CallCounts()
    tracer = Tracer()

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not tracer.inside_launch:
                name = func.overloadpacket.__name__
                counts.torch_ops += 1
                counts.ops[name] += 1
                if name == "_local_scalar_dense":
                    counts.syncs += 1
                    counts.sync_calls[name] += 1
                elif name not in _NO_KERNEL and not func.is_view:
                    counts.other_launches += 1
            return func(*args, **(kwargs or {}))

    # Tensors a counted ``.cpu()`` made: on a GPU they are host memory, and
    # reading them (``.numpy()``) waits on nothing more.
    # id -> weakref (tensors compare elementwise, so no WeakSet).
    on_host: dict[int, weakref.ref] = {}

    def is_on_host(t: object) -> bool:
        ref = on_host.get(id(t))
        return ref is not None and ref() is t

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            copied = name == "cpu"
            if not tracer.inside_launch and name in _SYNC_METHODS:
                # bool()/item() reach _local_scalar_dense too: count once.
                if name in ("item", "__bool__", "__int__", "__index__", "__float__"):
                    pass
                elif args and is_on_host(args[0]):
                    copied = False
                else:
                    counts.syncs += 1
                    counts.sync_calls[name] += 1
            out = func(*args, **(kwargs or {}))
            if copied and not tracer.inside_launch and isinstance(out, torch.Tensor):
                on_host[id(out)] = weakref.ref(out)
            return out

    with tracer, Function(), Dispatch():
        out = fn()
    counts.triton_launches = len(tracer.launches)
    return out, counts, tracer


# -- workloads ---------------------------------------------------------------------


@dataclass
class Case:
    """One modelled workload: the engine inputs of ``requests`` requests, of
    which ``traced`` are run under the tracer."""

    name: str
    layout: object
    batch: object
    num_tokens: object
    index: object
    scale_to: int  # the batch size the H200 row has


def longhit_case(requests: int, max_tokens: int, scale_to: int, name: str) -> Case:
    """Long-hit dsv4 (``bench/workloads.py`` preset ``dsv4-longhit``)."""
    from kvhit.bench.workloads import TrafficConfig, generate

    wl = generate(
        "dsv4-longhit",
        TrafficConfig(num_requests=requests, max_tokens=max_tokens, hash_bytes=32),
    )
    return Case(
        name,
        wl.layout,
        wl.hash_batch("cpu"),
        wl.num_tokens_tensor("cpu"),
        _sorted_index(wl),
        scale_to,
    )


def _sorted_index(wl):
    """``wl``'s store as a KeyIndex, keys added in sorted order: the table
    (and so every probe chain) does not depend on the set's iteration order,
    which changes with the process's hash seed."""
    import torch

    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import pack_hashes

    keys = sorted(wl.store_keys)
    index = KeyIndex(
        wl.hash_bytes, 1 << max(10, (2 * len(keys) - 1).bit_length()), backend="torch"
    )
    if keys:
        gids = torch.tensor([g for g, _ in keys], dtype=torch.int64)
        index.add(gids, pack_hashes([h for _, h in keys], wl.hash_bytes))
    return index


def preset_case(preset: str, requests: int, max_tokens: int, scale_to: int) -> Case:
    """A ``bench/gpu_check.py`` preset workload (random words, shared
    prefixes, the store up to a random length, 5 % evicted) on the CPU."""
    from kvhit.bench import gpu_check

    cfg = gpu_check.Config(
        presets=(preset,), requests=requests, max_tokens=max_tokens, dry_run=True
    )
    import torch

    w = gpu_check.build_workload(preset, cfg, torch.device("cpu"))
    name = f"{preset}-{scale_to}x{max_tokens // 1024}K"
    return Case(name, w.layout, w.batch, w.num_tokens, w.index, scale_to)


@dataclass
class Traced:
    """The tracer's figures for one case."""

    name: str
    requests: int
    traced: list[int]
    round_trips: dict[int, int]  # request -> round trips (traced ones)
    loads: Counter
    bytes_traced: int
    sectors_traced: int
    est_rt: list[int]  # every request's round trips (traced or estimated)
    est_bytes: float  # all requests' bytes (estimated)
    hit_tokens: list[int]
    seconds: float


def trace_lookup(case: Case, sample: int, seed: int = 0) -> Traced:
    """Trace the triton lookup of ``sample`` requests of ``case``: the longest
    hits (the critical path) and a random rest; the other requests' round
    trips and bytes are estimated by a line through the traced ones against
    the hit length (tokens)."""
    import torch

    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.packing import HashBatch

    t0 = time.perf_counter()
    B = len(case.batch)
    ref_engine = LookupEngine(case.layout, backend="torch", device="cpu")
    hits = ref_engine.lookup(case.batch, case.num_tokens, case.index).tolist()
    order = sorted(range(B), key=lambda r: -hits[r])
    n_top = max(1, sample // 2)
    chosen = {0, *order[:n_top]}
    rng = random.Random(seed)
    rest = [r for r in range(B) if r not in chosen]
    chosen.update(rng.sample(rest, min(len(rest), sample - len(chosen))))
    traced = sorted(chosen)
    offs = case.batch.offsets.tolist()
    rows = [case.batch.hashes[offs[r] : offs[r + 1]] for r in traced]
    sub = HashBatch(
        torch.cat(rows) if rows else case.batch.hashes[:0],
        torch.tensor([0, *torch.tensor([len(x) for x in rows]).cumsum(0).tolist()]),
        case.batch.hash_bytes,
    )
    nt = case.num_tokens[traced]
    engine = LookupEngine(case.layout, backend="triton", device="cpu")
    got, _counts, tracer = count_call(
        lambda: engine.lookup_unchecked(sub, nt, case.index)
    )
    if got.tolist() != [hits[r] for r in traced]:
        raise AssertionError(f"{case.name}: the traced triton lookup differs")
    progs = [p for launch in tracer.launches for p in launch.programs]
    progs = progs[-len(traced) :]
    loads: Counter = Counter()
    for p in progs:
        loads.update(p.loads)
    rt = {r: p.round_trips for r, p in zip(traced, progs, strict=True)}
    # Bytes from L2/HBM: the plan rows' loads are L1 hits.
    by = {
        r: sum(v for k, v in p.bytes.items() if k not in _L1_KINDS)
        for r, p in zip(traced, progs, strict=True)
    }
    xs = [hits[r] for r in traced]
    est_rt = _line([rt[r] for r in traced], xs, hits)
    est_by = _line([by[r] for r in traced], xs, hits)
    for r in traced:
        est_rt[r], est_by[r] = rt[r], by[r]
    return Traced(
        case.name,
        B,
        traced,
        rt,
        loads,
        sum(by.values()),
        sum(sum(p.sectors.values()) for p in progs),
        [max(1, round(v)) for v in est_rt],
        float(sum(est_by)),
        hits,
        time.perf_counter() - t0,
    )


def _line(ys: list[float], xs: list[float], at: list[float]) -> list[float]:
    """Least squares line ``y = a + b x`` through ``(xs, ys)`` evaluated at
    ``at`` (the mean where the xs do not vary); never below the least y."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = (
        sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if sxx
        else 0
    )
    lo = min(ys)
    return [max(lo, my + b * (x - mx)) for x in at]


def scaled(t: Traced, to: int) -> tuple[list[int], float]:
    """Round trips of ``to`` requests drawn from ``t``'s (in order, repeated)
    and their bytes: the batch of the H200 row, when fewer were built."""
    reps = -(-to // t.requests)
    rts = (t.est_rt * reps)[:to]
    return rts, t.est_bytes * to / t.requests


# -- calibration ---------------------------------------------------------------------


def fit(points: dict[str, tuple[int, float]], g: GpuTimes) -> GpuTimes:
    """``t_rt`` and ``t_launch`` through the two :data:`ANCHORS` rows,
    ``points[name] = (critical round trips, bytes)`` of the kernel the H200
    ran; the bandwidth kept, the launch never below 2 us."""
    from dataclasses import replace

    (ma, a_by), (mb, b_by) = (points[n] for n in ANCHORS)
    ya = H200[ANCHORS[0]] - a_by / g.bw
    yb = H200[ANCHORS[1]] - b_by / g.bw
    t_rt = (yb - ya) / (mb - ma) if mb != ma else g.t_rt
    t_launch = max(2e-6, ya - ma * t_rt)
    if t_launch == 2e-6:
        t_rt = (yb - t_launch) / mb
    return replace(g, t_rt=t_rt, t_launch=t_launch)


def _cases(quick: bool) -> list[tuple[str, Case, int]]:
    """``(row, case, batch)``: the quick workloads of the test, or every H200
    graph row, each built with fewer requests than the H200 row's batch
    (:func:`scaled` stands them for it)."""
    if quick:
        return [
            ("quick-longhit", longhit_case(8, 2048, 8, "quick-longhit"), 8),
            ("quick-llama", preset_case("llama", 8, 8192, 8), 8),
        ]
    lh = longhit_case(128, 16384, 1, "longhit")
    out = [(f"longhit-B{b}", lh, b) for b in (1, 64, 1024, 4096)]
    for p in ("llama", "gemma3", "qwen3-next", "dsv4-flash"):
        out.append((f"{p}-4096x128K", preset_case(p, 32, 131072, 4096), 4096))
    return out


def report(
    quick: bool, json_path: str | None = None, sample: int = 6, refit: bool = False
) -> dict:
    """Everything the module prints, as a dict (and printed)."""
    from kvhit.kernels import scan

    g = GpuTimes()
    slots = resident(scan.NUM_WARPS, scan.MAXNREG, g)
    print(
        f"gpu_model: kernels/scan.py BLOCK={scan.BLOCK} NUM_WARPS={scan.NUM_WARPS} "
        f"MAXNREG={scan.MAXNREG}: {slots} resident programs on {g.sms} SMs",
        flush=True,
    )
    cache: dict[int, Traced] = {}
    rows, points, per_request_bytes = [], {}, {}
    for name, case, batch in _cases(quick):
        if id(case) not in cache:
            cache[id(case)] = trace_lookup(case, sample if not quick else 8)
        t = cache[id(case)]
        if batch == 1:
            # B = 1 is the batch's first request (traced, see trace_lookup).
            rts, by = [t.round_trips[0]], t.est_bytes / t.requests
        else:
            rts, by = scaled(t, batch)
        points[name] = (rts, by, slots)
        n = len(t.traced)
        per_request_bytes[name] = round(t.bytes_traced / n)
        rows.append(
            [
                name,
                batch,
                f"{n}/{t.requests}",
                f"{sum(t.round_trips.values()) / n:.1f}",
                max(t.round_trips.values()),
                ", ".join(f"{k[:-4]} {v / n:.0f}" for k, v in sorted(t.loads.items())),
                f"{t.bytes_traced / n / 1e3:.1f} KB",
                f"{t.seconds:.0f} s",
            ]
        )
    print(
        tabulate(
            rows,
            headers=[
                "workload",
                "B",
                "traced/built",
                "round trips/request",
                "max",
                "loads/request by kind",
                "bytes/request",
                "trace",
            ],  # fmt: skip
        ),
        flush=True,
    )
    out: dict = {
        "kernel": {"BLOCK": scan.BLOCK, "NUM_WARPS": scan.NUM_WARPS},
        "traced": {k: max(v[0]) for k, v in points.items()},
        # Bytes from L2/HBM per traced request (plan rows aside).
        "bytes": per_request_bytes,
    }
    counts = call_counts(quick)
    print(
        tabulate(
            [[k, *(getattr(c, f) for f in _COUNT_FIELDS)] for k, c in counts.items()],
            headers=["per call (warm, CPU path)", *_COUNT_FIELDS],
        ),
        flush=True,
    )
    out["per_call"] = {
        k: {f: getattr(c, f) for f in _COUNT_FIELDS} for k, c in counts.items()
    }
    h = fit_host(HostTimes(), {b: H200[f"longhit-B{b}"] for b in LONGHIT_BS})
    items = {k: cuda_items(k, c, c.host_python) for k, c in counts.items()}
    hosts = {k: host_time(v, h) for k, v in items.items()}
    out["host"] = {k: {"python_us": round(items[k][0] * 1e6, 1),
                       "host_us": round(v * 1e6, 1)} for k, v in hosts.items()}  # fmt: skip
    print("\n" + tabulate(
        [[k, *("/".join(str(x) for x in items[k][1:5]),), f"{items[k][0] * 1e6:.0f} us",
          f"{v * 1e6:.0f} us"] for k, v in hosts.items()],
        headers=["eager call on CUDA", "binder/direct/ops/syncs before",
                 "Python (measured here)", "host (modelled)"]), flush=True)  # fmt: skip
    if not quick:
        now = {n: (makespan(r, sl), by) for n, (r, by, sl) in points.items()}
        out["points"] = now
        # The constants come from the kernel the H200 ran (H200_KERNEL);
        # ``refit`` takes this kernel's figures instead (only meaningful
        # on that kernel, commit a094dd7).
        then_all = now if refit or not H200_KERNEL else H200_KERNEL
        g = fit(then_all, g)
        cal = []
        for name, meas in H200.items():
            then = then_all[name]
            m0 = g.t_launch + then[0] * g.t_rt + then[1] / g.bw
            m1 = g.t_launch + now[name][0] * g.t_rt + now[name][1] / g.bw
            cal.append(
                [
                    name,
                    f"{meas * 1e6:.0f} us",
                    f"{m0 * 1e6:.0f} us",
                    f"{m0 / meas:.2f}",
                    f"{then[0]} / {now[name][0]}",
                    f"{then[1] / 1e6:.1f} / {now[name][1] / 1e6:.1f} MB",
                    f"{m1 * 1e6:.0f} us",
                ]
            )
        print(
            f"\nfitted to {', '.join(ANCHORS)} (the H200's kernel, a094dd7): "
            f"launch {g.t_launch * 1e6:.1f} us, round trip {g.t_rt * 1e6:.3f} us, "
            f"bandwidth {g.bw / 1e12:.1f} TB/s"
        )
        print(
            tabulate(
                cal,
                headers=[
                    "H200 row (graph)",
                    "measured (a094dd7)",
                    "modelled (a094dd7)",
                    "model/measured",
                    "critical round trips a094dd7 / now",
                    "bytes a094dd7 / now",
                    "modelled now",
                ],  # fmt: skip
            ),
            flush=True,
        )
        out["fit"] = asdict(g)
        out["calibration"] = cal
        by_b = {b: {k: host_time((py, *items[k][1:]), h) for k, py in pys.items()}
                for b, pys in python_by_batch().items()}  # fmt: skip
        out["eager"] = eager_report(h, by_b, g, now, H200, items)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


_COUNT_FIELDS = ("triton_launches", "other_launches", "syncs", "torch_ops")


def call_counts(quick: bool = True) -> dict[str, CallCounts]:
    """Per call counts of ``LookupEngine.lookup`` and ``lookup_unchecked``
    (triton backend, second call: warm) on a small long-hit batch."""
    from kvhit.coordinator.engine import LookupEngine

    case = longhit_case(4, 1024, 4, "counts")
    engine = LookupEngine(case.layout, backend="triton", device="cpu")
    out = {}
    tokens = case.num_tokens.tolist()
    for name, fn in (
        ("lookup", lambda: engine.lookup(case.batch, case.num_tokens, case.index)),
        ("lookup (list)", lambda: engine.lookup(case.batch, tokens, case.index)),
        (
            "lookup_unchecked",
            lambda: engine.lookup_unchecked(case.batch, case.num_tokens, case.index),
        ),
    ):
        fn()
        out[name] = count_call(fn)[1]
    py = host_python(engine, case.batch, case.num_tokens, case.index)
    for name, c in out.items():
        c.host_python = py[name]
    return out


def python_by_batch(bs: tuple[int, ...] = LONGHIT_BS) -> dict[int, dict[str, float]]:
    """Seconds of Python per eager call (:func:`host_python`) at each batch
    size of ``bs``: long-hit dsv4 requests (1K tokens; the Python does not
    read the hashes) repeated up to ``b``, a tensor and a list of lengths."""
    import torch

    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.packing import HashBatch

    base = longhit_case(64, 1024, 64, "host")
    offs = base.batch.offsets.tolist()
    n = len(base.batch)
    out = {}
    for b in bs:
        rows = [base.batch.hashes[offs[r % n] : offs[r % n + 1]] for r in range(b)]
        lens = torch.tensor([len(x) for x in rows]).cumsum(0).tolist()
        batch = HashBatch(torch.cat(rows), torch.tensor([0, *lens]),
                          base.batch.hash_bytes)  # fmt: skip
        nt = base.num_tokens[torch.arange(b) % n].contiguous()
        engine = LookupEngine(base.layout, backend="triton", device="cpu")
        out[b] = host_python(engine, batch, nt, base.index, rounds=3,
                             n=max(20, 300 // max(1, b // 64)))  # fmt: skip
    return out


def asdict_traced(t: Traced) -> dict:
    return {
        "requests": t.requests,
        "traced": len(t.traced),
        "round_trips": t.round_trips,
        "loads": dict(t.loads),
        "bytes_traced": t.bytes_traced,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads only")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument(
        "--sample", type=int, default=6, help="requests traced per case"
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="fit the constants to this kernel (meaningful on a094dd7's only)",
    )
    args = parser.parse_args(argv)
    if (error := interpret()) is not None:
        print(f"gpu_model: {error}", flush=True)
        return 1
    report(args.quick, args.json, args.sample, args.refit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
