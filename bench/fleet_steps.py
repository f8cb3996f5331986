"""Where a router's fleet step goes, and two checkouts' steps side by side.

The step is ``bench_fleet.versus_dynamo``'s (raw trace ids as Python lists, 0
and 1 included; one FullAttention(512) group; lengths as a list; B = 64
requests against E engines that served the trace's first 1024 requests):
``engine.fleet_hits(HashBatch.from_ints(lists), lengths, fleet)``, caches
evicted before each timed call (64 MiB read), as a router meets a batch of
requests it has not seen.

``python -m kvhit.bench.fleet_steps stages [--engines 8,64] [--repeats 60]``
prints each stage of that step alone, cold (caches evicted first) and warm
(the same call again at once), the stages interleaved repeat by repeat:
packing (``from_ints``), the lengths' check (``host_lengths``; the list as
the ``array('q')`` the router path hands the kernel), the kernel's one
dispatch (with the arguments the router path gives it), the
answer's tensor, ``fleet_hits`` on a packed batch (the checks, the kernel
and the answer), the whole step, Dynamo's ``find_matches`` of the same
lists, and the stores a router applies after the step (one
``FleetIndex.add`` per request, a KV event's worth, fresh keys each repeat).

``python -m kvhit.bench.fleet_steps ab OTHER [--rounds 6]`` times the step,
Dynamo's, and the stores in this checkout and in ``OTHER`` (another
checkout with its own ``.venv``), each in its own process, the two
alternating round by round in both orders (this, other; other, this; ...).
Each process times kvhit and Dynamo alternately (call by call) and each
alone, by the same code (this module's :data:`WORKER`, run by each
checkout's Python against its own kvhit). It prints per checkout the median
over rounds of each round's median, in us per request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["WORKER", "ab", "main", "stages"]

#: Read before every cold call: more than the last-level cache.
_EVICT = np.ones(64 << 17)


def _fresh_stores(wl: Any, rep: int) -> list[np.ndarray]:
    """The step's blocks as new keys (int64 ``[n, 1]`` per request), salted
    by ``rep`` so that every repeat stores keys the fleet does not hold."""
    salt = np.int64(((rep + 2) * 0x3C6EF372FE94F82B) % (1 << 63))
    return [np.ascontiguousarray(w ^ salt) for w in wl.words]


def _stage_calls(E: int, warm: int, batch: int) -> dict[str, Callable[[int], Callable]]:
    """Per stage, a maker: ``make(r)`` is the zero-argument call of repeat
    ``r`` (its inputs built outside the timing)."""
    from kvhit.bench import bench_fleet as bf
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.fleet_index import FleetIndex
    from kvhit.coordinator.packing import HashBatch
    from kvhit.kernels.checks import host_lengths

    wl = bf.build_workload("llama", E, warm, batch, ids="raw")
    engine = LookupEngine(wl.layout)
    fleet = bf.fill_fleet(engine, wl)
    qb = HashBatch.from_ints(wl.lists)
    # The kernel's arguments, as the router path passes them.
    seen: list[tuple] = []
    kernel = fleet.host_kernel
    fleet.host_kernel = lambda *a: seen.append(a) or kernel(*a)
    engine.fleet_hits(qb, wl.token_list, fleet)
    fleet.host_kernel = kernel
    args = seen[0]
    answer = kernel(*args)[1]
    stores = FleetIndex(E, 8, capacity=1 << 21)
    for i, w in enumerate(wl.served):
        stores.add(wl.owner(i), 0, w)
    find = None
    if bf.dynamo_available():
        find = bf.dynamo_tree(
            wl, lambda i: int(wl.served_tokens[i]) // 512
        ).find_matches
    lists, lens = wl.lists, wl.token_list

    def store(r: int) -> Callable[[], None]:
        keys = _fresh_stores(wl, r)

        def call() -> None:
            for b, k in enumerate(keys):
                stores.add(b % E, 0, k)

        return call

    calls = {
        "packing: HashBatch.from_ints(lists)":
            lambda r: lambda: HashBatch.from_ints(lists),
        "lengths: the list checked (host_lengths)":
            lambda r: lambda: host_lengths(lens, "max_lengths", batch),
        "lengths: array('q', list) (the router path's form)":
            lambda r: lambda: array("q", lens),
        "kernel: full_hits_checked, one dispatch":
            lambda r: lambda: kernel(*args),
        "answer: torch.from_numpy":
            lambda r: lambda: torch.from_numpy(answer),
        "fleet_hits, packed batch, list lengths":
            lambda r: lambda: engine.fleet_hits(qb, lens, fleet),
        "step: from_ints + fleet_hits":
            lambda r: lambda: engine.fleet_hits(HashBatch.from_ints(lists), lens, fleet),
        "Dynamo: find_matches of the lists":
            lambda r: lambda: [find(c).scores for c in lists],
        f"stores: {batch} x FleetIndex.add (one per request)": store,
    }  # fmt: skip
    if find is None:
        # Dynamo not importable here: its row is left out.
        del calls["Dynamo: find_matches of the lists"]
    return calls


def stages(engines: Sequence[int], repeats: int, out: Any, warm: int = 1024,
           batch: int = 64) -> list[tuple]:  # fmt: skip
    """Each stage's median us (cold, warm) per E; writes a Markdown table to
    ``out`` and returns its rows ``(E, stage, cold us, warm us)``."""
    rows = []
    for E in engines:
        calls = _stage_calls(E, warm, batch)
        cold: dict[str, list[float]] = {k: [] for k in calls}
        hot: dict[str, list[float]] = {k: [] for k in calls}
        for make in calls.values():
            make(-1)()
        for r in range(repeats):
            for k, make in calls.items():
                # Fresh inputs where a stage needs them (the stores' keys).
                fn, again = make(2 * r), make(2 * r + 1)
                _EVICT.sum()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                again()
                t2 = time.perf_counter()
                cold[k].append(t1 - t0)
                hot[k].append(t2 - t1)
        for k in calls:
            rows.append((E, k, statistics.median(cold[k]) * 1e6,
                         statistics.median(hot[k]) * 1e6))  # fmt: skip
    out.write(f"\nA fleet step's stages, B = {batch}, raw trace ids, median of "
              f"{repeats}, us per call (cold: caches evicted first; warm: "
              "the call again at once)\n\n| E | stage | cold | warm |\n"
              "|---:|---|---:|---:|\n")  # fmt: skip
    for E, k, c, w in rows:
        out.write(f"| {E} | {k} | {c:.1f} | {w:.1f} |\n")
    return rows


#: The step timed in each checkout's own process (only API both sides
#: have: bench_fleet's workload, fleet and Dynamo tree; from_ints;
#: fleet_hits; FleetIndex.add). Reads ENGINES, REPEATS; prints JSON
#: ``{E: {metric: median us per request}}``.
WORKER = r"""
import json, statistics, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from kvhit.bench import bench_fleet as bf
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.fleet_index import FleetIndex
from kvhit.coordinator.packing import HashBatch
EV = np.ones(64 << 17)
B = 64
res = {}
for E in ENGINES:
    wl = bf.build_workload("llama", E, 1024, B, ids="raw")
    engine = LookupEngine(wl.layout)
    fleet = bf.fill_fleet(engine, wl)
    got = engine.fleet_hits(HashBatch.from_ints(wl.lists), wl.token_list, fleet)
    ours = lambda: engine.fleet_hits(HashBatch.from_ints(wl.lists), wl.token_list, fleet)
    if bf.dynamo_available():
        tree = bf.dynamo_tree(wl, lambda i: int(wl.served_tokens[i]) // 512)
        assert np.array_equal(got.numpy() // 512, bf.dynamo_scores(tree, wl.words, E))
        find = tree.find_matches
        theirs = lambda: [find(c).scores for c in wl.lists]
    else:
        # Dynamo not importable: its rows time an empty call.
        theirs = lambda: None
    stores = FleetIndex(E, 8, capacity=1 << 21)
    for i, w in enumerate(wl.served):
        stores.add(wl.owner(i), 0, w)
    def keys(r):
        salt = np.int64(((r + 2) * 0x3C6EF372FE94F82B) % (1 << 63))
        return [np.ascontiguousarray(w ^ salt) for w in wl.words]
    def store(ks):
        for b, k in enumerate(ks):
            stores.add(b % E, 0, k)
    def timed(fn):
        EV.sum()
        t0 = time.perf_counter(); fn(); return time.perf_counter() - t0
    ours(), theirs(), store(keys(-1))
    ta, tb, sa, sb, st = [], [], [], [], []
    for r in range(REPEATS):
        ta.append(timed(ours)); tb.append(timed(theirs))
        ks = keys(r)
        st.append(timed(lambda: store(ks)))
    for r in range(REPEATS):
        sa.append(timed(ours))
    for r in range(REPEATS):
        sb.append(timed(theirs))
    med = lambda t: statistics.median(t) * 1e6 / B
    res[E] = {"kvhit alternate": med(ta), "Dynamo alternate": med(tb),
              "kvhit separate": med(sa), "Dynamo separate": med(sb),
              "stores (64 adds), us per request": med(st)}
print(json.dumps(res))
"""


def _run_worker(checkout: Path, engines: Sequence[int], repeats: int) -> dict:
    code = f"ENGINES = {list(engines)!r}\nREPEATS = {repeats}\n" + WORKER
    env = dict(os.environ, NUMBA_NUM_THREADS="1", KVHIT_PEERS="1", PYTHONSAFEPATH="1")
    done = subprocess.run([str(checkout / ".venv/bin/python"), "-c", code],
                          cwd=checkout, env=env, capture_output=True, text=True,
                          check=False)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{checkout}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ab(
    other: Path, engines: Sequence[int], rounds: int, repeats: int, out: Any
) -> dict:
    """This checkout against ``other``, ``rounds`` rounds (order swapped
    every round); writes the table and returns ``{side: {E: {metric:
    [per-round medians]}}}``."""
    here = Path(__file__).resolve().parent.parent
    sides = {"this": here, "other": other.resolve()}
    got: dict[str, dict[str, dict[str, list[float]]]] = {s: {} for s in sides}
    for r in range(rounds):
        order = ("this", "other") if r % 2 == 0 else ("other", "this")
        for side in order:
            res = _run_worker(sides[side], engines, repeats)
            for E, metrics in res.items():
                for m, v in metrics.items():
                    got[side].setdefault(E, {}).setdefault(m, []).append(v)
            print(f"  round {r} {side}: " + ", ".join(
                f"E={E} {m['kvhit alternate']:.2f}/{m['kvhit separate']:.2f}"
                for E, m in res.items()), file=sys.stderr)  # fmt: skip
    out.write(f"\nThis checkout ({here}) vs {sides['other']}: B = 64 fleet step, "
              f"raw ids as lists, us per request, median over {rounds} rounds "
              f"(alternating processes, both orders) of each round's median of "
              f"{repeats}\n\n| E | metric | this | other | this / other |\n"
              "|---:|---|---:|---:|---:|\n")  # fmt: skip
    for E in got["this"]:
        for m, vals in got["this"][E].items():
            a = statistics.median(vals)
            b = statistics.median(got["other"][E][m])
            out.write(f"| {E} | {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x |\n")
    return got


def main(argv: list[str] | None = None) -> int:
    """``stages`` or ``ab OTHER`` (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stages", help="each stage of a B = 64 step, cold and warm")
    s.add_argument("--engines", default="8,64")
    s.add_argument("--repeats", type=int, default=60)
    a = sub.add_parser("ab", help="this checkout's step against another's")
    a.add_argument("other", type=Path, help="another checkout, with its .venv")
    a.add_argument("--engines", default="8,64")
    a.add_argument("--rounds", type=int, default=6)
    a.add_argument("--repeats", type=int, default=31)
    args = p.parse_args(argv)
    engines = [int(e) for e in args.engines.split(",") if e]
    torch.set_num_threads(1)
    if args.cmd == "stages":
        stages(engines, args.repeats, sys.stdout)
    else:
        ab(args.other, engines, args.rounds, args.repeats, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
