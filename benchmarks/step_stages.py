"""Where a router's step goes: microseconds per request of each stage of a
lookup on the shipped conversation trace (raw ids as Python lists, one numba
thread), at B = 1 and B = 64.

Stages: ``HashBatch.from_ints`` of the step's lists; the lengths' check in
every form a router holds them (list, tuple, numpy int64/int32/uint64, CPU
torch int64), through the numba backend's ``lengths``; ``find`` (the
engine's ``find_longest_cache_hit`` of a packed batch, lengths as a list);
and reading the answer as a router does: ``(hit_lengths // bs).tolist()``,
or ``hit_list()`` where the checkout has it. Each figure is CPU time
(``time.process_time``, so a descheduled process does not count), the best
of ``--rounds`` passes over the steps, divided by the requests.

Run ``NUMBA_NUM_THREADS=1 PYTHONSAFEPATH=1 .venv/bin/python
benchmarks/step_stages.py [--root DIR]``; ``--root`` loads kvhit's packages
from another checkout (e.g. ``/work/main``), so two checkouts can be timed
alternately by one interpreter.
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

    from kvhit.bench.peer_steps import PEER_BLOCK_SIZE as BS
    from kvhit.bench.peer_steps import step_inputs
    from kvhit.bench.traces import SHIPPED_TRACE, load_trace
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch
    from kvhit.coordinator.specs import CacheLayout, FullAttention, Group

    inp = step_inputs(load_trace(SHIPPED_TRACE, 2000), "raw", BS)
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=BS))],
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    engine = LookupEngine(layout, backend="numba", device="cpu")
    index = KeyIndex(8, 1 << 20)
    # The first half of the trace stored; the second half looked up.
    index.add(0, HashBatch.from_ints(inp.ints[:1000]).hashes)
    ints, tokens = inp.ints[1000:2000], inp.tokens[1000:2000]
    steps = [
        (ints[lo : lo + batch_size], tokens[lo : lo + batch_size])
        for lo in range(0, len(ints) - batch_size + 1, batch_size)
    ]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="load kvhit from this checkout")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-sizes", default="1,64")
    args = parser.parse_args(argv)
    if args.root:
        _use_root(args.root)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for name, us in stages(b, args.rounds).items():
            print(f"B={b:<4d} {name:40s} {us:7.3f} us/request")


if __name__ == "__main__":
    main()
