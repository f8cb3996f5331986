"""What the GPU checks (``bench/gpu_check.py``, ``bench/gpu_check_fleet.py``)
share, and the GPU tests with them: their command-line overrides, timing and
CUDA-graph capture; and the host model of one eager lookup on CUDA that the
cost model (``bench/gpu_model.py``) prints (:class:`HostTimes`, issue 31),
with the H200's eager rows it is fitted to; and the Triton interpreter's
speed-ups (:func:`speed_up_interpreter`) for every CPU run of the kernels.

torch is imported inside the functions: the checks' ``--help`` and
``--env-line`` run before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "A094_EAGER",
    "H200_EAGER",
    "H200_NUMBA_ALL",
    "LONGHIT_BS",
    "HostTimes",
    "capture_graph",
    "config_changes",
    "cuda_items",
    "eager_report",
    "fit_host",
    "host_python",
    "host_time",
    "interpret",
    "patch_lang_once_per_launch",
    "reduce_bits_in_numpy",
    "run_seconds",
    "speed_up_interpreter",
    "tabulate",
]


def interpret() -> str | None:
    """Run Triton kernels under its interpreter from now on (a check's or the
    cost model's CPU run): set ``TRITON_INTERPRET=1`` and
    :func:`speed_up_interpreter`. Returns None, or the error to print
    when triton was imported before the variable was set (its kernels are
    then compiled ones, which need a GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            return "FAIL: triton imported before TRITON_INTERPRET=1 was set"
        os.environ["TRITON_INTERPRET"] = "1"
    speed_up_interpreter()
    return None


def speed_up_interpreter() -> None:
    """Both interpreter speed-ups, where ``TRITON_INTERPRET=1`` (idempotent;
    the suite's conftest and :func:`interpret` call it):
    :func:`patch_lang_once_per_launch` and :func:`reduce_bits_in_numpy`.
    Neither changes an answer; both are tested under the newest Triton and
    the floor (``tests/test_interpreter_patch.py``)."""
    patch_lang_once_per_launch()
    reduce_bits_in_numpy()


def reduce_bits_in_numpy() -> None:
    """Under the interpreter, a ``tl.reduce`` whose combine function is
    ``kernels/fleet_probe.bit_and`` or ``bit_or`` runs as one numpy
    ``bitwise_and.reduce`` / ``bitwise_or.reduce`` instead of the
    interpreter's generic path, which calls the combine function once per
    element in Python (the fleet's class kernel: 64 reductions a tile). The
    two are associative and commutative, so the answer is the same. Any
    other combine function takes the interpreter's own path."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    from kvhit.kernels.fleet_probe import bit_and, bit_or

    ops = getattr(interpreter, "ReduceOps", None)
    real = getattr(ops, "apply_impl", None)
    if real is None or getattr(real, "kvhit_numpy", False):
        return
    ufuncs = {id(bit_and): np.bitwise_and, id(bit_or): np.bitwise_or}

    def apply_impl(self: Any, input: tuple) -> Any:
        ufunc = ufuncs.get(id(self.combine_fn))
        if ufunc is None or len(input) != 1:
            return real(self, input)
        (x,) = input
        out = ufunc.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(out, x.dtype)

    apply_impl.kvhit_numpy = True  # type: ignore[attr-defined]
    apply_impl.__wrapped__ = real  # type: ignore[attr-defined]
    ops.apply_impl = apply_impl


def patch_lang_once_per_launch() -> None:
    """Under the interpreter, skip the re-patching of ``triton.language`` that
    each device-function call does inside a launch that already patched it
    (the suite's conftest and :func:`interpret` call it; idempotent).

    Triton 3.6-3.9's ``InterpretedFunction.__call__`` runs ``_patch_lang`` on
    every call of a ``@triton.jit`` helper, walking the language modules with
    ``inspect.getmembers`` again, though the launch's own patch stays in
    force until the launch ends (its scope is restored then; a helper's is
    never restored). The patches are the same functions, so the answers are
    too; the walks were a third of the interpreter tests' CPU time (those
    seven files, two workers: 377 -> 249 s). A helper that sees a language
    module not patched yet in this launch (the ``tl.sum`` family's module
    imports ``triton.language.core`` where kvhit's kernels import
    ``triton.language``) is patched as before, once: that patch is never
    restored, so it holds for the rest of the launch. Nothing happens where
    the interpreter lacks ``_patch_lang`` (another Triton) or
    ``TRITON_INTERPRET`` is unset."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    real = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if real is None or scope_type is None or getattr(real, "kvhit_once", False):
        return
    launches: list[set[int]] = []  # the modules patched in the launch in progress

    def patch_lang(fn: Any) -> Any:
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if launches:
            # A helper's call inside a launch.
            if langs <= launches[-1]:
                return scope_type()  # patched in this launch, still in force
            launches[-1] |= langs  # a helper's patch is never restored
            return real(fn)
        # A launch's own patch: GridExecutor restores its scope when the
        # launch ends, and the modules are forgotten then.
        scope = real(fn)
        launches.append(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            launches.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang.kvhit_once = True  # type: ignore[attr-defined]
    patch_lang.__wrapped__ = real  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang


def config_changes(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """The ``Config`` fields a check's command line sets: ``--presets``
    (comma-separated) as a tuple, and each argument named in ``fields``
    (argument -> field) that was given (not None, not 0)."""
    changes: dict[str, Any] = {}
    if args.presets:
        changes["presets"] = tuple(p for p in args.presets.split(",") if p)
    for arg, name in fields.items():
        if getattr(args, arg):
            changes[name] = getattr(args, arg)
    return changes


def run_seconds(fn: Callable[[], Any], device: Any) -> float:
    """Seconds one call of ``fn()`` takes: CUDA events around it on a CUDA
    ``device`` (a ``torch.device``; the kernels' time, the launch included),
    the wall clock elsewhere."""
    if device.type == "cuda":
        import torch

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def capture_graph(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn`` (already warm) captured in a CUDA graph: ``(graph, out)``, where
    ``out`` is what the captured call returned, refreshed by each
    ``graph.replay()``. One call runs first on a side stream, as
    ``torch.cuda.graph`` requires; the graph is replayed once and synchronized
    before it is returned."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


# -- the eager call: host time on CUDA (issue 31) ---------------------------------

#: The long-hit batch sizes of the H200's rows.
LONGHIT_BS = (1, 64, 1024, 4096)


@dataclass(frozen=True)
class HostTimes:
    """The host's part of one eager call on CUDA (seconds), by counted item.

    ``py``: the call's Python with the Triton launch stubbed, **measured** on
    this CPU (:func:`host_python`, thread time, best of rounds), taken as the
    H200 host's (``cpu_scale`` 1, held). ``t_binder``: a launch through
    Triton 3.6's ``JITFunction.run`` binder (**measured**, issue 31: 25 us);
    ``t_direct``: a launch past it (``launch.DirectLauncher``: 5.0 us of
    Python **measured** here with a fake compiled kernel, 6.6 before its
    stream getter and hooks were read once; the C launcher and
    ``cuLaunchKernel`` ~4 us **estimated**; the fleet's launches, kept
    for ``gpu_model_fleet``); ``t_run``: the scan lookup's warm launch,
    ``DirectLauncher.run`` of the compiled kernel ``scan.LookupLaunch``
    keeps (no variant key, no per-tensor alignment tuple: 1.4 us of Python
    **measured** here with a fake compiled kernel, against 5.5 us for
    ``DirectLauncher.launch`` in the same run; the C launcher's ~4 us
    **estimated**), what a direct launch costs in :func:`host_time`; ``t_op``: a
    torch op that launches a kernel or a copy (**estimated**); ``t_sync``: a
    blocking read before the launch (the device drained, then idle while the
    host goes on) and ``t_tail``: launch to kernel start plus the closing
    ``synchronize``, both **fitted** by :func:`fit_host` to the H200's eager
    rows of a094dd7 (:data:`H200_EAGER`); ``t_copy``: the answer's copy to
    the host after the launch, waiting on the kernel the caller waits on
    anyway (**estimated**)."""

    t_binder: float = 25e-6
    t_direct: float = 9e-6
    t_run: float = 5.4e-6
    t_op: float = 5e-6
    t_sync: float = 57.0e-6
    t_tail: float = 17.0e-6
    t_copy: float = 10e-6
    cpu_scale: float = 1.0


#: The H200's eager long-hit dsv4 rows (wall clock with ``synchronize``,
#: seconds): (call, B) -> time, ``lookup`` validated with a CUDA tensor of
#: lengths (shared/measurements/h200-2026-12-04.md, commit a094dd7).
H200_EAGER: dict[tuple[str, int], float] = {
    **{("lookup", b): t for b, t in
       zip(LONGHIT_BS, (257e-6, 220e-6, 192e-6, 373e-6), strict=True)},
    **{("lookup_unchecked", b): t for b, t in
       zip(LONGHIT_BS, (116e-6, 149e-6, 155e-6, 274e-6), strict=True)},
}  # fmt: skip
#: numba on all 16 cores of that host, the same workload (two runs).
H200_NUMBA_ALL: dict[int, tuple[float, float]] = {
    1: (8.7e-6, 16.0e-6), 64: (133e-6, 166e-6), 1024: (250e-6, 283e-6),
    4096: (998e-6, 1.10e-3),
}  # fmt: skip
#: a094dd7's eager calls on CUDA: (host Python with the launch stubbed,
#: **measured** on this CPU on ``git archive a094dd7``, median of three runs
#: at B = 1, 64, 1024; binder launches, direct launches, other kernel
#: launches, syncs before the launch, answer copies after it). The validated
#: call's items are the H200 profiler's (1 sync with its memcpy, 3 kernels:
#: the view's subtraction, the lengths' compare and ``any``), the
#: unchecked's its one kernel (the subtraction).
A094_EAGER: dict[str, tuple[float, int, int, int, int, int]] = {
    "lookup": (72e-6, 1, 0, 3, 1, 0),
    "lookup_unchecked": (52e-6, 1, 0, 1, 0, 0),
}


def host_time(items: tuple[float, int, int, int, int, int], h: HostTimes) -> float:
    """Seconds the host adds to the device's time in one eager call."""
    py, binder, direct, ops, syncs, copies = items
    return (py * h.cpu_scale + binder * h.t_binder + direct * h.t_run
            + ops * h.t_op + syncs * h.t_sync + copies * h.t_copy + h.t_tail)  # fmt: skip


def fit_host(h: HostTimes, graph: dict[int, float]) -> HostTimes:
    """``t_tail`` through the mean of the unchecked rows (eager less
    ``graph``, the H200's graph time by B), then ``t_sync`` through the
    validated rows' mean; the other constants held."""

    def gap(call: str) -> float:
        rows = [(t - graph[b]) for (c, b), t in H200_EAGER.items()
                if c == call]  # fmt: skip
        return sum(rows) / len(rows)

    h = replace(h, t_tail=0.0, t_sync=0.0)
    t_tail = gap("lookup_unchecked") - host_time(A094_EAGER["lookup_unchecked"], h)
    h = replace(h, t_tail=t_tail)
    items = A094_EAGER["lookup"]
    t_sync = (gap("lookup") - host_time(items, h)) / items[4]
    return replace(h, t_sync=t_sync)


def cuda_items(name: str, counts: Any, py: float) -> tuple:
    """The CUDA items of call ``name`` (as :data:`A094_EAGER`'s) from its
    counts on the CPU path. The CPU path differs in two places: a list of
    lengths is checked on the host there, where CUDA copies it through the
    pinned buffer (one copy op, no sync), and ``lookup_unchecked``'s
    ``batch.view()`` reads the offsets through numpy (a counted sync), where
    CUDA runs one subtraction kernel and no sync. The validated call's sync
    is the answer's copy, after the launch."""
    want = {"lookup": 1, "lookup (list)": 0, "lookup_unchecked": 1}[name]
    if counts.syncs != want or counts.triton_launches != 1:
        raise ValueError(f"{name}: {counts.syncs} syncs on the CPU path, not "
                         f"{want}: cuda_items needs updating")  # fmt: skip
    extra = 0 if name == "lookup" else 1
    copies = 1 if name == "lookup" else 0
    return (py, 0, 1, counts.other_launches + extra, 0, copies)


def best_thread_times(calls: dict, rounds: int, n: int) -> dict[str, float]:
    """Seconds of thread time per call of each of ``calls`` (name -> a
    function of no arguments): one warm-up call, then the best of ``rounds``
    rounds of ``n`` calls."""
    out = {}
    for name, fn in calls.items():
        fn()
        best = float("inf")
        for _ in range(rounds):
            t0 = time.thread_time()
            for _ in range(n):
                fn()
            best = min(best, (time.thread_time() - t0) / n)
        out[name] = best
    return out


def host_python(engine, batch, num_tokens, index, rounds: int = 5,
                n: int = 300) -> dict[str, float]:  # fmt: skip
    """Seconds of Python per call (thread time, best of ``rounds`` of ``n``
    calls) of ``engine.lookup`` (a tensor and a list of lengths) and
    ``lookup_unchecked``: what the host does on CUDA but the launch. The
    warm CUDA path is taken (``scan.SCAN_LAUNCHER`` enabled, as on CUDA
    outside the interpreter, with a stand-in compiled kernel) and its
    ``DirectLauncher.run`` stubbed (it writes a zero answer: 0.5 us here);
    a launch through the generic ``launch`` is stubbed the same way."""
    from unittest import mock

    from kvhit.kernels import scan

    def stub(kernel, grid, key, args, constexprs, options, device):
        args[9].zero_()

    def run(compiled, grid, every, device):
        every[9].zero_()
        return True

    tokens = num_tokens.tolist()
    calls = {
        "lookup": lambda: engine.lookup(batch, num_tokens, index),
        "lookup (list)": lambda: engine.lookup(batch, tokens, index),
        "lookup_unchecked": lambda: engine.lookup_unchecked(batch, num_tokens, index),
    }
    launcher = scan.SCAN_LAUNCHER
    with (
        mock.patch.object(launcher, "launch", stub),
        mock.patch.object(launcher, "run", run),
        mock.patch.object(launcher, "enabled", True),
        mock.patch.object(launcher, "compiled", lambda *a: "compiled"),
    ):
        out = best_thread_times(calls, rounds, n)
    # The LookupLaunch keeps the stand-in kernel, never run again: the
    # interpreter's launcher is disabled once the patches are undone.
    return out


def tabulate(rows: list[list], headers: list[str]) -> str:
    """A GitHub Markdown table (tabulate is not among kvhit's dependencies)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} us"


def eager_report(h: HostTimes, hosts: dict[int, dict[str, float]], g: Any,
                 now: dict[str, tuple[int, float]], graph: dict[str, float],
                 items: dict[str, tuple]) -> dict:  # fmt: skip
    """Print and return the eager figures: the host fit against the H200's
    eager rows (a094dd7), the parts of this tree's eager call at B = 1, 64
    and 4096, then its eager calls (host + the modelled graph time) against issue
    31's targets and numba on all cores. ``hosts``: the modelled host time
    by batch size and call (its Python measured at that B), ``items`` the
    calls' CUDA items (:func:`cuda_items`; their Python is ``hosts``'), ``g``:
    the device model (``gpu_model.GpuTimes``), ``now`` its critical round
    trips and bytes by row, ``graph`` the H200's graph rows (measured)."""
    cal, out = [], {}
    for (call, b), meas in H200_EAGER.items():
        m = graph[f"longhit-B{b}"] + host_time(A094_EAGER[call], h)
        cal.append([call, b, _us(meas), _us(m), f"{m / meas:.2f}"])
    print(
        f"\nhost fitted to the H200's eager rows (a094dd7): tail {_us(h.t_tail)}, "
        f"sync before the launch {_us(h.t_sync)} (held: binder {_us(h.t_binder)}, "
        f"direct run {_us(h.t_run)}, op {_us(h.t_op)}, copy {_us(h.t_copy)})"
    )
    print(
        tabulate(
            cal,
            headers=[
                "call",
                "B",
                "measured (a094dd7)",
                "modelled (a094dd7)",
                "model/measured",
            ],  # fmt: skip
        )
    )
    dev = {n: g.t_launch + rt * g.t_rt + by / g.bw for n, (rt, by) in now.items()}
    out["parts"] = parts = {}
    rows = []
    for b in (1, 64, 4096):
        for call, total in hosts[b].items():
            _, binder, direct, ops, syncs, copies = items[call]
            py = total - host_time((0.0, *items[call][1:]), h)
            k = dev[f"longhit-B{b}"]
            p = {"kernel (graph, modelled)": k, "Python (measured)": py,
                 "binder launches (measured)": binder * h.t_binder,
                 "direct run (1.4 measured + 4 estimated)": direct * h.t_run,
                 "torch ops (estimated)": ops * h.t_op,
                 "syncs before (fitted)": syncs * h.t_sync,
                 "answer copy (estimated)": copies * h.t_copy,
                 "launch + sync tail (fitted)": h.t_tail}  # fmt: skip
            parts[f"{call} B={b}"] = {n: v * 1e6 for n, v in p.items()}
            rows.append([f"{call}, B = {b}", *(_us(v) for v in p.values()),
                         _us(k + total), _us(k + total - py)])  # fmt: skip
    print("\nthe eager call's parts (modelled, this tree)")
    print(tabulate(rows, headers=["call", *(n for n in next(iter(parts.values()))),
                                  "eager", "eager without Python"]))  # fmt: skip
    rows = []
    for b in LONGHIT_BS:
        e = {k: dev[f"longhit-B{b}"] + v for k, v in hosts[b].items()}
        lo, hi = H200_NUMBA_ALL[b]
        out[f"longhit-B{b}"] = {k: v * 1e6 for k, v in e.items()}
        rows.append(
            [
                f"long-hit B = {b}",
                _us(dev[f"longhit-B{b}"]),
                *(_us(v) for v in e.values()),
                f"{lo / e['lookup']:.1f}-{hi / e['lookup']:.1f}x",
            ]
        )
    for n in graph:
        if "x128K" in n:
            e = dev[n] + hosts[4096]["lookup"]
            out[n] = {"lookup": e * 1e6, "graph": dev[n] * 1e6}
            rows.append(
                [n, _us(dev[n]), _us(e), "", "", f"eager/graph {e / dev[n]:.2f}"]
            )
    print(
        tabulate(
            rows,
            headers=[
                "modelled now",
                "graph",
                "lookup (tensor)",
                "lookup (list)",
                "lookup_unchecked",
                "numba 16 cores / lookup",
            ],  # fmt: skip
        ),
        flush=True,
    )
    return out  # fmt: skip
