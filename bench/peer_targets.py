"""Issue 33's targets table: kvhit beside Dynamo as a router meets them.

``python -m kvhit.bench.peer_targets`` (with ``NUMBA_NUM_THREADS=1``)
prints, as Markdown, on the two shipped traces (Mooncake's FAST'25
conversation and synthetic traces; ``--trace`` names one, or a path):
lookup incl. packing vs Dynamo and kvhit's stores at B = 1, 64, 1024 (:func:`~kvhit.bench
.peer_steps.peer_sweep`: raw trace ids in Python lists, both orders), the
fleet at B = 64 vs Dynamo at E = 8 and 64 (``bench_fleet.versus_dynamo``, raw
ids, both orders) and ``HashBatch.from_ints`` ns per int per input form
(:func:`from_ints_rates`; ``--baseline-packing`` times another copy of
``coordinator/packing.py`` beside the current one). ``--host-load 0,2``
repeats the lookup and fleet runs beside two CPU-bound processes (Dynamo's
indexer thread wakes slower on a quiet host, so the ratio moves with the
host's state: show both); ``--pin none,0`` repeats them with every thread
of the process on CPU 0, where Dynamo's hop to its indexer thread is a
switch on that core rather than a cross-core wake-up (its fast case,
steady from run to run); ``--lengths list,numpy`` repeats the lookup runs
with the lengths as a numpy int64 array; ``--call lists,batch`` repeats them
with kvhit's lookup as ``from_ints``, ``find_longest_cache_hit`` and
``hit_list`` instead of one ``find_hit_list`` (and the fleet as ``from_ints``
and ``fleet_hits`` instead of one ``fleet_hit_array``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvhit.bench.peer_steps import PEER_CALLS, PeerRow, peer_sweep, step_inputs
from kvhit.bench.peers import DYNAMO, check_cpu, load_dynamo

__all__ = ["FORMS", "from_ints_rates", "main", "targets"]


#: The input forms :func:`from_ints_rates` times: name -> one request's
#: Python int list in that form.
FORMS: dict[str, Callable[[list[int]], Any]] = {
    "list of int": list,
    "numpy int64": lambda r: np.array(r, dtype=np.int64),
    "numpy int32": lambda r: np.array(r, dtype=np.int32),
    "numpy uint64": lambda r: np.array(r, dtype=np.uint64),
    "array('q')": lambda r: array("q", r),
    "torch int64": lambda r: _torch().tensor(r, dtype=_torch().int64),
    "torch int32": lambda r: _torch().tensor(r, dtype=_torch().int32),
}


def _torch() -> Any:
    import torch

    return torch


def from_ints_rates(
    ints: Sequence[list[int]],
    batch: int = 64,
    repeats: int = 9,
    steps: int = 100,
    impls: dict[str, Callable[[Any], Any]] | None = None,
) -> dict[str, dict[str, float]]:
    """ns per int of ``from_ints`` on steps of ``batch`` requests of ``ints``
    (the first ``steps`` steps), per input form of :data:`FORMS`: each step's
    best time over ``repeats`` passes, summed over the steps (a step takes
    tens of us, so on a shared host the best of a few misses the other
    processes' time slices, where a whole pass would not). ``impls``: name ->
    a ``from_ints`` to time (default the current one), each over all the
    steps in turn within every pass, so a load change hits all alike. Returns ``{form: {impl: ns per
    int}}``."""
    from kvhit.coordinator.packing import HashBatch

    impls = impls or {"from_ints": HashBatch.from_ints}
    chunks = [list(ints[lo : lo + batch]) for lo in range(0, len(ints), batch)]
    chunks = [c for c in chunks if len(c) == batch][:steps] or [list(ints)]
    n = sum(len(r) for c in chunks for r in c)
    perf = time.perf_counter
    out: dict[str, dict[str, float]] = {}
    for name, form in FORMS.items():
        data = [[form(r) for r in c] for c in chunks]
        best = {tag: [float("inf")] * len(data) for tag in impls}
        for fn in impls.values():
            for c in data[:3]:
                fn(c)
        for _ in range(repeats):
            for tag, fn in impls.items():
                # One implementation over every step, then the next: a call
                # right after another implementation's on the same step would
                # find that step's data in cache (up to 2x faster here) or
                # the caches flushed by a slow one's garbage.
                mine = best[tag]
                for k, c in enumerate(data):
                    t0 = perf()
                    fn(c)
                    t = perf() - t0
                    if t < mine[k]:
                        mine[k] = t
        out[name] = {tag: sum(t) / n * 1e9 for tag, t in best.items()}
    return out


#: Issue 33's targets: lookup vs Dynamo by batch size, stores in M blocks/s
#: (B = 1, then B >= 64), fleet at B = 64 vs Dynamo, from_ints ns per int.
LOOKUP_TARGETS = {1: 2.0, 64: 8.0, 1024: 10.0}
STORE_TARGETS = {1: 2.0, 64: 10.0, 1024: 10.0}
FLEET_TARGET = 8.0
PACK_TARGET_NS = 40.0


def _target(value: float | None, unit: str = "") -> str:
    """A target as the table prints it; "-" for a batch size the issue
    sets none for (B = 2, 8, ...)."""
    return "-" if value is None else f"{value:g}{unit}"


def _load_from_ints(path: str) -> Callable[..., Any]:
    """``HashBatch.from_ints`` of another copy of ``coordinator/packing.py``
    (e.g. ``git show HEAD~3:coordinator/packing.py > /tmp/old.py``), for a
    before/after in one process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvhit_packing_before", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"baseline_packing: cannot load {path!r}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.HashBatch.from_ints


_FORM_NOTE = {"list": "(Python list)", "numpy": "(numpy int64 array)"}
_CALL_NOTE = {
    "lists": "kvhit's lookup one find_hit_list",
    "batch": "kvhit's lookup from_ints + find_longest_cache_hit + hit_list",
}
# The fleet row's kvhit call (bench_fleet.FLEET_CALLS, named as PEER_CALLS).
_FLEET_CALL_NOTE = {"lists": "fleet_hit_array", "batch": "from_ints + fleet_hits"}


def _lookup_table(rows: Sequence[PeerRow], batch_sizes: Sequence[int]) -> list[str]:
    """The lookup and stores rows of one :func:`peer_sweep` (both orders)."""
    by = {(r.batch_size, r.order): r for r in rows}

    def both(b: int, f: Callable[[PeerRow], float], fmt: str) -> str:
        # NaN (the packing of find_hit_list, inside its one call): "-".
        return " / ".join(
            "-" if (v := f(by[(b, o)])) != v else format(v, fmt)
            for o in ("alternate", "separate")
        )

    return [
        "| target | " + " | ".join(f"B = {b}" for b in batch_sizes) + " |",
        "|---|" + "---:|" * len(batch_sizes),
        "| lookup incl. packing vs Dynamo (target "
        + ", ".join(_target(LOOKUP_TARGETS.get(b), "x") for b in batch_sizes)
        + ") | "
        + " | ".join(
            both(b, lambda r: r.lookup_ratio, ".1f") + "x" for b in batch_sizes
        )
        + " |",
        "| kvhit lookup us/request (of it from_ints; -: inside find_hit_list) | "
        + " | ".join(
            both(b, lambda r: r.kvhit_lookup_s * 1e6, ".1f")
            + " ("
            + both(b, lambda r: r.kvhit_pack_s * 1e6, ".1f")
            + ")"
            for b in batch_sizes
        )
        + " |",
        "| Dynamo us/request | "
        + " | ".join(
            both(b, lambda r: r.peer_lookup_s * 1e6, ".1f") for b in batch_sizes
        )
        + " |",
        "| stores (KeyIndex.add) M blocks/s (target "
        + ", ".join(
            # The store targets: 2 M/s at B = 1, 10 M/s from B = 64.
            _target(STORE_TARGETS.get(b, 10.0 if b >= 64 else None))
            for b in batch_sizes
        )
        + ") | "
        + " | ".join(
            both(b, lambda r: r.kvhit_store_bps / 1e6, ".2f") for b in batch_sizes
        )
        + " |",
        "| Dynamo stores (events applied) M blocks/s | "
        + " | ".join(
            both(b, lambda r: r.peer_store_bps / 1e6, ".2f") for b in batch_sizes
        )
        + " |",
        "",
    ]


def targets(
    trace: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    batch_sizes: Sequence[int] = (1, 64, 1024),
    fleet_engines: Sequence[int] = (8, 64),
    fleet_warm: int = 1024,
    repeats: int = 15,
    baseline_packing: str | None = None,
    quiet: bool = True,
    passes: int = 3,
    host_loads: Sequence[int] = (0,),
    lengths: Sequence[str] = ("list",),
    pins: Sequence[int | None] = (None,),
    calls: Sequence[str] = ("lists",),
) -> str:
    """Issue 33's targets table on ``trace`` (default: the shipped
    conversation trace), as Markdown: lookup incl. packing vs Dynamo and
    kvhit's stores (:func:`peer_sweep`, raw ids, both orders), the fleet at
    B = 64 vs Dynamo (``bench_fleet.versus_dynamo``, raw ids, both orders; on
    the shipped trace only) and ``from_ints`` ns per int per input form
    (:func:`from_ints_rates`; with ``baseline_packing``, the same beside that
    copy's). ``passes``: replays of each (order, B), each step's best time
    taken. ``host_loads``: each a run beside that many CPU-bound processes
    (0: a quiet host; Dynamo's indexer thread wakes 4-6x slower on a quiet
    host, so a fair table shows both). ``lengths``: each a run with the
    lengths in that form (``peer_steps.PEER_LENGTHS``). ``pins``: each a
    run with every thread on that CPU (``None``: unpinned). ``calls``: each
    a run with kvhit's lookup called that way (``peer_steps.PEER_CALLS``).
    Set ``NUMBA_NUM_THREADS=1`` before the process starts."""
    import io

    import torch

    from kvhit.bench.traces import SHIPPED_TRACE, load_trace

    torch.set_num_threads(1)
    out = [
        f"numba threads: {os.environ.get('NUMBA_NUM_THREADS', 'default')}; trace: "
        f"{os.path.basename(str(trace or SHIPPED_TRACE))}"
        + (f", first {limit} requests" if limit else "")
        + "; inputs: raw trace ids as Python lists; each step's best of "
        f"{passes} replays; figures as alternate / separate\n"
    ]
    for pin, load in [(pin, load) for pin in pins for load in host_loads]:
        host = (
            ("no process started beside it" if load == 0
             else f"beside {load} busy processes")
            + (f", every thread on CPU {pin}" if pin is not None else "")
            + f" (load average {os.getloadavg()[0]:.1f} before)"
        )  # fmt: skip
        for form, call in [(f, c) for f in lengths for c in calls]:
            rows, skip = peer_sweep(
                DYNAMO, batch_sizes, limit, quiet, trace, passes=passes,
                host_load=load, lengths=form, pin=pin, call=call,
            )  # fmt: skip
            out.append(
                f"### {host}, lengths as a {form} {_FORM_NOTE[form]}, "
                f"{_CALL_NOTE[call]}\n"
            )
            if skip is not None:
                out.append(f"Dynamo skipped: {skip.reason}\n")
                break
            out += _lookup_table(rows, batch_sizes)
        if trace is None and fleet_engines:
            from kvhit.bench import bench_fleet

            tree_cls, why = load_dynamo()
            if tree_cls is None:
                out.append(f"Fleet vs Dynamo skipped: {why}\n")
                continue
            for call in calls:
                fleet = bench_fleet.versus_dynamo(
                    fleet_engines,
                    fleet_warm,
                    64,
                    repeats,
                    io.StringIO(),
                    host_load=load,
                    pin=pin,
                    call=call,
                )
                out += [
                    f"| {_FLEET_CALL_NOTE[call]} at B = 64 vs Dynamo, {host} (target "
                    f"{FLEET_TARGET:g}x) | kvhit us/request | Dynamo us/request | ratio |",
                    "|---|---:|---:|---:|",
                ]
                for e, aa, ba, asep, bsep, _n in fleet:
                    out.append(
                        f"| E = {e} | {aa:.2f} / {asep:.2f} | {ba:.2f} / {bsep:.2f} | "
                        f"{ba / aa:.1f}x / {bsep / asep:.1f}x |"
                    )
                out.append("")
    requests = load_trace(trace or SHIPPED_TRACE, limit)
    impls = {"after": None}
    if baseline_packing is not None:
        impls = {"before": _load_from_ints(baseline_packing), "after": None}
    from kvhit.coordinator.packing import HashBatch

    impls = {k: v or HashBatch.from_ints for k, v in impls.items()}
    rates = from_ints_rates(step_inputs(requests).ints, impls=impls)
    head = " | ".join(impls)
    out += [
        f"| from_ints, steps of 64 requests, ns/int (target <= {PACK_TARGET_NS:g}) | "
        + head
        + " |",
        "|---|" + "---:|" * len(impls),
    ]
    for form, r in rates.items():
        out.append(f"| {form} | " + " | ".join(f"{r[k]:.1f}" for k in impls) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print issue 33's targets table (Markdown)."""
    p = argparse.ArgumentParser(description="issue 33's targets vs Dynamo")
    p.add_argument(
        "--trace",
        default="conversation,synthetic",
        help="comma-separated: shipped trace names (conversation, synthetic) or "
        "paths of Mooncake-format traces (default both shipped traces; the "
        "fleet runs on the conversation trace)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N requests")
    p.add_argument("--batch-sizes", default="1,64,1024")
    p.add_argument("--fleet-engines", default="8,64", help="'' for none")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--host-load",
        default="0",
        help="CPU-bound processes spinning beside each run, comma-separated "
        "(default 0; '0,2' adds a busy host)",
    )
    p.add_argument(
        "--lengths",
        default="list",
        help="the lengths' forms, comma-separated: list, numpy (default list)",
    )
    p.add_argument(
        "--call",
        default="lists",
        help="how kvhit's lookup and fleet are called, comma-separated: lists "
        "(find_hit_list, fleet_hit_array), batch (from_ints + "
        "find_longest_cache_hit + hit_list, from_ints + fleet_hits) "
        "(default lists)",
    )
    p.add_argument(
        "--pin",
        default="none",
        metavar="CPU[,CPU...]",
        help="runs with every thread of the process on that CPU, 'none' for "
        "a run as the scheduler places them, comma-separated (default none; "
        "'none,0' shows both: Dynamo's indexer hop is a cross-core wake-up "
        "unpinned, a switch on one core pinned)",
    )
    p.add_argument(
        "--passes",
        type=int,
        default=3,
        help="replays of each (order, B) on fresh stores, each step's best "
        "time taken (default 3)",
    )
    p.add_argument(
        "--baseline-packing",
        default=None,
        metavar="FILE.py",
        help="another copy of coordinator/packing.py whose from_ints is timed "
        "beside the current one",
    )
    args = p.parse_args(argv)
    try:
        loads = [int(h) for h in args.host_load.split(",")]
    except ValueError:
        loads = [-1]
    if min(loads) < 0:
        p.error(
            f"--host-load takes counts >= 0, comma-separated; got {args.host_load!r}"
        )
    try:
        pins = [None if x.strip() == "none" else int(x) for x in args.pin.split(",")]
    except ValueError:
        p.error(f"--pin takes CPU numbers or 'none', comma-separated; got {args.pin!r}")
    for cpu in pins:
        if cpu is not None:
            try:
                check_cpu(cpu)  # now, not after the runs before it
            except ValueError as exc:
                p.error(f"--pin: {exc}")
    calls = args.call.split(",")
    if not calls or not set(calls) <= set(PEER_CALLS):
        p.error(f"--call takes some of {', '.join(PEER_CALLS)}; got {args.call!r}")
    from kvhit.bench.names import SHIPPED_TRACE, TRACES

    for name in args.trace.split(","):
        path = TRACES.get(name, name)
        sys.stdout.write(
            targets(
                None if path == SHIPPED_TRACE else path,
                args.limit,
                [int(b) for b in args.batch_sizes.split(",")],
                [int(e) for e in args.fleet_engines.split(",") if e],
                repeats=args.repeats,
                baseline_packing=args.baseline_packing,
                quiet=False,
                passes=args.passes,
                host_loads=loads,
                lengths=args.lengths.split(","),
                pins=pins,
                calls=calls,
            )
            + "\n"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
