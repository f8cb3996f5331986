"""Two builds of the numba lookup kernel side by side, in one process.

``python -m kvhit.bench.ab_scan OTHER.py [--sg OTHER_SG.py] [--preset
dsv4-longhit] [--requests 4096] [--pool N] [--repeats 15]`` loads ``OTHER.py`` (another
version of ``kernels/scan_numba.py``, e.g. ``git show
main:kernels/scan_numba.py > /tmp/scan_main.py``) beside this checkout's,
checks that both give the engine's answer on every request of the workload
(the store worker's lookup), then times the two in rounds, the order swapped
every round, one thread, wall clock. It prints each one's median and the
median of the per-round ratios with their quartiles.

The store is that of a workload of ``--pool`` requests (default
``--requests``), as ``kvhit bench`` keeps the store of its largest batch for
every batch size. By default every call answers the pool's first
``--requests`` requests (the bench's setting: what a small batch touches
stays in cache from one call to the next); with ``--fresh`` every call
answers requests drawn at random from the pool, as a scheduler's steps bring
new requests whose lines are not in cache.

Why one process: on a shared machine the same kernel timed in processes run
back to back took 19.6 to 28.8 ms (long-hit B = 4096, eight runs in half an
hour), where against itself in one process it gives 0.99x (quartiles
0.94-1.04x); a kernel change worth 5-10 % is only visible this way.

Only the kernel modules are swapped: ``scan_numba.py``, and with ``--sg
OTHER_SG.py`` its SpecGroup scan ``kernels/scan_numba_sg.py`` (the other
``scan_numba.py`` then imports that one; by default both sides share this
checkout's; numba caches compiled code by file path, so with ``--sg`` give
the other ``scan_numba.py`` as a copy outside this checkout, e.g. ``git show
main:kernels/scan_numba.py``). The table layout, the slot hash (``kernels/probe_numba.py``) and
the plan rows are this checkout's, so a change to those needs two checkouts
and ``kvhit bench`` in each.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from kvhit.bench.workloads import PRESETS, TrafficConfig, Workload, generate
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.plan import plan_tensors

#: The name the other kernel module is loaded under (numba caches its
#: compiled code by the file's path, not by this name).
OTHER_MODULE = "kvhit_ab_scan_other"
#: The name the other SpecGroup scan (``--sg``) is loaded under.
OTHER_SG_MODULE = "kvhit_ab_scan_other_sg"
_SG_NAME = "kvhit.kernels.scan_numba_sg"


def _exec(name: str, path: Path, what: str) -> ModuleType:
    """The file ``path`` imported as module ``name`` (in ``sys.modules``);
    ValueError naming ``what`` when it cannot be."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what}: {str(path)!r} cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_scan(path: str | Path, sg: str | Path | None = None) -> ModuleType:
    """The kernel module at ``path`` (a ``scan_numba.py``), imported under
    :data:`OTHER_MODULE`, built on the SpecGroup scan at ``sg`` (a
    ``scan_numba_sg.py``, imported under :data:`OTHER_SG_MODULE`; default
    this checkout's); ValueError naming ``other`` (or ``sg``) when it is not
    a file or lacks the launcher API (``prepare_scan``, ``scan_prepared``,
    ``LOOKUP``). This checkout's own files are the modules already imported:
    the same source compiles to the same kernel, and a second copy would
    only be compiled again (~30 s on a fresh clone) to be timed against
    itself."""
    from kvhit.kernels import scan_numba, scan_numba_sg

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"other: {str(path)!r} is not a file")
    own_sg = Path(scan_numba_sg.__file__).resolve()
    if sg is not None and not Path(sg).is_file():
        raise ValueError(f"sg: {str(sg)!r} is not a file")
    if sg is None or Path(sg).resolve() == own_sg:
        if p.resolve() == Path(scan_numba.__file__).resolve():
            return scan_numba
        module = _exec(OTHER_MODULE, p, "other")
    else:
        # The other scan_numba.py imports its SpecGroup scan by the package
        # name: that name stands for the other file while it is imported.
        sys.modules[_SG_NAME] = _exec(OTHER_SG_MODULE, Path(sg), "sg")
        try:
            module = _exec(OTHER_MODULE, p, "other")
        finally:
            sys.modules[_SG_NAME] = scan_numba_sg
    missing = [
        n for n in ("prepare_scan", "scan_prepared", "LOOKUP") if not hasattr(module, n)
    ]
    if missing:
        raise ValueError(f"other: {str(path)!r} has no {', '.join(missing)}")
    return module


@dataclass(frozen=True)
class Comparison:
    """Seconds per call of each kernel, one entry per round (float
    ``[repeats]`` each)."""

    this_s: tuple[float, ...]
    other_s: tuple[float, ...]

    def medians(self) -> tuple[float, float]:
        return float(np.median(self.this_s)), float(np.median(self.other_s))

    def paired(self) -> tuple[float, float, float]:
        """``other / this`` per round (above 1: this checkout is faster):
        median, first and third quartile."""
        r = np.asarray(self.other_s) / np.asarray(self.this_s)
        return (
            float(np.median(r)),
            float(np.percentile(r, 25)),
            float(np.percentile(r, 75)),
        )


def compare(
    workload: Workload,
    other: ModuleType,
    repeats: int = 15,
    batch_size: int | None = None,
    fresh: bool = False,
    seed: int = 0,
) -> Comparison:
    """This checkout's kernel against ``other`` on ``workload``'s store,
    every call on ``batch_size`` requests (default: all of them): the first
    ones, or (``fresh``) ones drawn at random for each call.
    AssertionError naming the first request where either differs from
    ``LookupEngine.lookup``; ValueError when ``batch_size`` is not in
    ``[1, len(workload)]``."""
    pool = len(workload)
    b = pool if batch_size is None else batch_size
    if not 1 <= b <= pool:
        raise ValueError(f"batch_size must be in [1, {pool}], got {b}")
    from kvhit.kernels import scan_numba as this

    engine = LookupEngine(workload.layout, backend="numba")
    index = workload.key_index("cpu")
    batch = workload.hash_batch("cpu")
    num_tokens = workload.num_tokens_tensor()
    want = engine.lookup(batch, num_tokens, index).numpy()
    rows, starts, lengths = batch.host_arrays()
    n = np.ascontiguousarray(num_tokens.numpy())
    table = np.ascontiguousarray(index.table.numpy())
    plan = engine.plan
    sg, cand = (t.numpy() for t in plan_tensors(plan, torch.device("cpu")))
    runs = {}
    for name, mod in (("this", this), ("other", other)):
        prep = mod.prepare_scan(
            sg, cand, hash_block_size=plan.hash_block_size, alignment=plan.alignment,
            partial=plan.partial, simple_hybrid=plan.simple_hybrid,
        )  # fmt: skip

        def run(
            req: tuple[np.ndarray, ...], mod: ModuleType = mod, prep: object = prep
        ) -> np.ndarray:
            hit, _ = mod.scan_prepared(
                prep, rows, *req, table, mod.LOOKUP, parallel=False
            )
            return hit

        _check(name, np.asarray(run((starts, lengths, n))), want, np.arange(pool))
        runs[name] = run
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {"this": [], "other": []}
    for k in range(repeats):
        for name in ("this", "other") if k % 2 == 0 else ("other", "this"):
            # A fresh draw for each call: a request the other kernel has
            # just answered would find its lines in cache.
            if fresh:
                idx = np.sort(rng.choice(pool, b, replace=False))
            else:
                idx = np.arange(b)
            req = (starts[idx], lengths[idx], n[idx])
            t0 = time.perf_counter()
            got = runs[name](req)
            times[name].append(time.perf_counter() - t0)
            _check(name, got, want, idx)
    return Comparison(tuple(times["this"]), tuple(times["other"]))


def _check(name: str, got: np.ndarray, want: np.ndarray, idx: np.ndarray) -> None:
    bad = np.flatnonzero(got != want[idx])
    if bad.size:
        i = int(idx[bad[0]])
        raise AssertionError(
            f"{name} kernel: request {i} hit {int(got[bad[0]])}, the engine "
            f"{int(want[i])} ({bad.size} of {len(idx)} requests differ)"
        )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvhit.bench.ab_scan",
        description="This checkout's numba lookup kernel against another "
        "version of kernels/scan_numba.py, paired rounds in one process.",
    )
    p.add_argument("other", help="path of the other scan_numba.py")
    p.add_argument(
        "--sg",
        default=None,
        help="path of the other side's scan_numba_sg.py (default: this checkout's)",
    )
    p.add_argument("--preset", default="dsv4-longhit", choices=sorted(PRESETS))
    p.add_argument("--requests", type=_positive, default=4096, help="per call")
    p.add_argument(
        "--pool",
        type=_positive,
        default=None,
        help="requests of the workload whose store is looked up (default: --requests)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="each call on requests drawn at random from the pool, not the "
        "pool's first --requests every call",
    )
    p.add_argument("--repeats", type=_positive, default=15, help="rounds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    pool = args.requests if args.pool is None else args.pool
    if pool < args.requests:
        p.error(f"--pool must be at least --requests ({args.requests}), got {pool}")
    try:
        other = load_scan(args.other, args.sg)
    except (ValueError, ImportError, SyntaxError) as exc:
        print(f"ab_scan: {exc}", file=sys.stderr)
        return 2
    wl = generate(args.preset, TrafficConfig(num_requests=pool, seed=args.seed))
    try:
        c = compare(wl, other, args.repeats, args.requests, args.fresh, args.seed)
    except AssertionError as exc:
        print(f"ab_scan: parity: {exc}", file=sys.stderr)
        return 1
    this_s, other_s = c.medians()
    mid, lo, hi = c.paired()
    what = f"B={args.requests}" + (
        f" drawn from {pool} for each call"
        if args.fresh
        else (f" (the first of {pool})" if pool > args.requests else "")
    )
    print(
        f"{args.preset} {what}, {args.repeats} rounds, one thread: this "
        f"{this_s * 1e3:.3f} ms, other {other_s * 1e3:.3f} ms a batch (medians); "
        f"other / this per round {mid:.3f}x (quartiles {lo:.3f}-{hi:.3f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
