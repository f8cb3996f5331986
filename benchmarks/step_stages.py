"""Where a router's step goes: microseconds per request of each stage of a
lookup on the shipped conversation trace (raw ids as Python lists, one numba
thread), at B = 1 and B = 64 by default.

Stages: ``HashBatch.from_ints`` of the step's lists; the lengths' check in
every form a router holds them (list, tuple, numpy int64/int32/uint64, CPU
torch int64), through the numba backend's ``lengths``; ``find`` (the
engine's ``find_longest_cache_hit`` of a packed batch, lengths as a list);
and reading the answer as a router does: ``(hit_lengths // bs).tolist()``,
or ``hit_list()`` where the checkout has it. Each figure is CPU time
(``time.process_time``, so a descheduled process does not count), the best
of ``--rounds`` passes over the steps, divided by the requests.

``--cold`` times a step the way the replay's alternate order meets it
instead (:func:`cold_stages`): before every step a 32 MB buffer is written
and some other Python runs (what Dynamo's step leaves behind), then
``from_ints``, ``find`` (lengths as a list, then as numpy) and the answer
are each timed once per step (``perf_counter``), each step's best over the
rounds. The trace's first 3,000 requests are stored and the next ones
looked up, at least 8 steps at every batch size (B = 1024 included).

``--replay`` times the alternate order itself (:func:`replay_stages`): the
whole trace replayed against Dynamo's ``RadixTree`` (when it imports), one
step of each side in turn, kvhit's stages timed apart as above. Measured so
(issue 33, B = 1, lengths as a list, load ~3): a kvhit step of ~11 us where
it takes ~5 us replayed alone, spread over every stage: ``from_ints`` ~5
(np.array of the list alone ~2.3, its type scan ~1, the batch object ~1),
``find`` ~4.5 (the compiled call ~2.8), the answer ~1.5 (``hit_list`` ~0.6,
the router's list comprehension ~0.6).

Run ``NUMBA_NUM_THREADS=1 PYTHONSAFEPATH=1 .venv/bin/python
benchmarks/step_stages.py [--root DIR] [--cold | --replay] [--batch-sizes
1,64,1024]``;
``--root`` loads kvhit's packages from another checkout (e.g.
``/work/main``), so two checkouts can be timed alternately by one
interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def _use_root(root: str) -> None:
    """Load kvhit's packages from ``root`` (the editable install's map)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("__editable__") and hasattr(mod, "MAPPING"):
            for pkg, folder in list(mod.MAPPING.items()):
                mod.MAPPING[pkg] = os.path.join(root, os.path.basename(folder))


#: Requests of the trace stored before the timed lookups (the rest looked up).
STORED = 3000
#: What the alternate order's other side leaves behind, modelled: a buffer
#: larger than this host's last-level cache, touched before every step.
EVICT_BYTES = 32 << 20


def _best(fn: Callable[[], Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def stages(batch_size: int, rounds: int) -> dict[str, float]:
    """Microseconds per request of each stage at ``batch_size``."""
    import numpy as np
    import torch

    from kvhit.coordinator.packing import HashBatch

    engine, index, steps, BS = _setup(batch_size)
    n = len(steps) * batch_size
    pack, find = HashBatch.from_ints, engine.find_longest_cache_hit
    batches = [pack(r) for r, _ in steps]
    out: dict[str, float] = {}

    def per_request(fn: Callable[[Any, Any, Any], Any]) -> float:
        # A loop that keeps no answer (as a router's, and so that the
        # collector has no growing list to walk).
        def run() -> None:
            for b, (r, t) in zip(batches, steps, strict=True):
                fn(b, r, t)

        return _best(run, rounds) / n * 1e6

    out["from_ints"] = per_request(lambda b, r, t: pack(r))
    forms = {
        "list": list,
        "tuple": tuple,
        "numpy int64": lambda t: np.array(t, dtype=np.int64),
        "numpy int32": lambda t: np.array(t, dtype=np.int32),
        "numpy uint64": lambda t: np.array(t, dtype=np.uint64),
        "torch int64": lambda t: torch.tensor(t, dtype=torch.int64),
    }
    lengths = engine.impl.lengths
    for form, make in forms.items():
        held = {id(t): make(t) for _, t in steps}
        out[f"lengths check, {form}"] = per_request(
            lambda b, r, t, held=held: lengths(held[id(t)], "max_lengths", batch_size)
        )
    out["find (lengths as a list)"] = per_request(
        lambda b, r, t: find(b, t, index, False)
    )
    out["from_ints + find"] = per_request(
        lambda b, r, t: find(pack(r), t, index, False)
    )
    out["... + (hit_lengths // bs).tolist()"] = per_request(
        lambda b, r, t: (find(pack(r), t, index, False).hit_lengths // BS).tolist()
    )
    if hasattr(find(batches[0], steps[0][1], index, False), "hit_list"):
        out["... + [h // bs for h in hit_list()]"] = per_request(
            lambda b, r, t: [h // BS for h in find(pack(r), t, index, False).hit_list()]
        )
    return out


def _trace_engine() -> tuple[Any, Any]:
    """The shipped trace's step inputs (raw ids) and a numba engine of its
    layout (full attention, one block per trace id)."""
    from kvhit.bench.peer_steps import PEER_BLOCK_SIZE as BS
    from kvhit.bench.peer_steps import step_inputs
    from kvhit.bench.traces import SHIPPED_TRACE, load_trace
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.specs import CacheLayout, FullAttention, Group

    inp = step_inputs(load_trace(SHIPPED_TRACE, None), "raw", BS)
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=BS))],
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    return inp, LookupEngine(layout, backend="numba", device="cpu")


def _setup(batch_size: int) -> tuple[Any, ...]:
    """The engine, the index of the trace's first :data:`STORED` requests,
    and the later requests as steps of ``batch_size`` (raw ids as lists,
    lengths as lists)."""
    from kvhit.bench.peer_steps import PEER_BLOCK_SIZE as BS
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch

    inp, engine = _trace_engine()
    index = KeyIndex(8, 1 << 20)
    index.add(0, HashBatch.from_ints(inp.ints[:STORED]).hashes)
    ints, tokens = inp.ints[STORED:], inp.tokens[STORED:]
    n = min(len(ints), max(1000, 8 * batch_size)) // batch_size * batch_size
    steps = [
        (ints[lo : lo + batch_size], tokens[lo : lo + batch_size])
        for lo in range(0, n, batch_size)
    ]
    return engine, index, steps, BS


def cold_stages(
    batch_size: int, rounds: int, lengths: str = "list"
) -> dict[str, float]:
    """Microseconds per request of each stage of a step in the alternate
    order, modelled: before every step a touch of :data:`EVICT_BYTES` and a
    few hundred microseconds of unrelated Python (Dynamo's step, in the
    replay), then ``from_ints``, ``find_longest_cache_hit`` (lengths as a
    ``list`` or ``numpy`` int64 slice) and the answer as ints
    (``[h // bs for h in hit_list()]``), each timed on its own
    (``perf_counter``); per step the best over ``rounds``, then the sum
    over the steps divided by the requests (and the median step)."""
    import numpy as np

    from kvhit.coordinator.packing import HashBatch

    engine, index, steps, bs = _setup(batch_size)
    if lengths == "numpy":
        steps = [(r, np.asarray(t, dtype=np.int64)) for r, t in steps]
    pack, find = HashBatch.from_ints, engine.find_longest_cache_hit
    junk = np.ones(EVICT_BYTES // 8, dtype=np.int64)
    other = [list(range(k, k + 40)) for k in range(200)]
    perf = time.perf_counter
    best = np.full((len(steps), 3), np.inf)
    for _ in range(rounds):
        for k, (r, t) in enumerate(steps):
            junk += 1  # every cache line written: the caches hold junk
            sum(map(sum, other))  # the other side's Python
            t0 = perf()
            batch = pack(r)
            t1 = perf()
            res = find(batch, t, index, False)
            t2 = perf()
            [h // bs for h in res.hit_list()]
            t3 = perf()
            row = best[k]
            np.minimum(row, (t1 - t0, t2 - t1, t3 - t2), out=row)
    per = best.sum(axis=0) / (len(steps) * batch_size) * 1e6
    med = np.median(best.sum(axis=1)) / batch_size * 1e6
    return {
        f"cold from_ints ({lengths} run)": float(per[0]),
        f"cold find (lengths {lengths})": float(per[1]),
        f"cold answer ({lengths} run)": float(per[2]),
        f"cold step ({lengths} run)": float(per.sum()),
        f"cold median step ({lengths} run)": float(med),
    }


def replay_stages(
    batch_size: int, rounds: int, lengths: str = "list"
) -> dict[str, float]:
    """Microseconds per request of each kvhit stage in the alternate order
    itself, as ``peer_steps`` replays it: the trace in steps of
    ``batch_size`` on fresh stores, ``rounds`` times, kvhit's step
    (``from_ints``, ``find_longest_cache_hit``, the answer as ints, then its
    store) and Dynamo's (``peer_steps.PeerSteps``: ``find_matches``, its
    store, the wait for its indexer thread), the side going first switching
    every step; per step the best over the rounds, then the median step. An
    empty dict when Dynamo does not import."""
    import numpy as np

    from kvhit.bench.peer_steps import PEER_BLOCK_SIZE as BS
    from kvhit.bench.peer_steps import PeerSteps, rows_past
    from kvhit.bench.peers import DynamoIndex, load_dynamo
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch

    tree_cls, _ = load_dynamo()
    if tree_cls is None:
        return {}
    inp, engine = _trace_engine()
    tokens: Any = inp.tokens
    if lengths == "numpy":
        tokens = np.asarray(tokens, dtype=np.int64)
    n = len(inp.ints)
    steps = [(lo, min(n, lo + batch_size)) for lo in range(0, n, batch_size)]
    pack, perf = HashBatch.from_ints, time.perf_counter
    best = np.full((len(steps), 4), np.inf)
    for _ in range(rounds):
        index = KeyIndex(8, 1 << 20)
        them = PeerSteps("dynamo", batch_size, DynamoIndex(tree_cls), inp.chains,
                         RuntimeError)  # fmt: skip
        find = engine.find_longest_cache_hit
        for k, (lo, hi) in enumerate(steps):
            theirs = them.find(lo, hi) if k % 2 else None
            reqs, t = inp.ints[lo:hi], tokens[lo:hi]
            t0 = perf()
            batch = pack(reqs)
            t1 = perf()
            res = find(batch, t, index, False)
            t2 = perf()
            mine = [h // BS for h in res.hit_list()]
            t3 = perf()
            row = best[k]
            np.minimum(row, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), out=row)
            rows, starts, lens = batch.host_arrays()
            new = rows[rows_past(starts, lens, np.array(mine, dtype=np.int64))]
            if new.shape[0]:
                index.add(0, new)
            if theirs is None:
                theirs = them.find(lo, hi)
            them.check(lo, mine, theirs)
            them.add(lo, hi, theirs)
    sizes = np.array([hi - lo for lo, hi in steps], dtype=np.float64)
    med = np.median(best / sizes[:, None], axis=0) * 1e6
    names = ("from_ints", "find", "answer", "step")
    return {
        f"replay {s} (lengths {lengths})": float(v)
        for s, v in zip(names, med, strict=True)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="load kvhit from this checkout")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="the alternate order's stages instead (caches evicted per step)",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="the alternate order's stages, replayed against Dynamo itself",
    )
    args = parser.parse_args(argv)
    if args.root:
        _use_root(args.root)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        if args.replay:
            out = replay_stages(b, args.rounds, "list")
            out.update(replay_stages(b, args.rounds, "numpy"))
        elif args.cold:
            out = cold_stages(b, args.rounds, "list")
            out.update(cold_stages(b, args.rounds, "numpy"))
        else:
            out = stages(b, args.rounds)
        for name, us in out.items():
            print(f"B={b:<4d} {name:40s} {us:7.3f} us/request", flush=True)


if __name__ == "__main__":
    main()
