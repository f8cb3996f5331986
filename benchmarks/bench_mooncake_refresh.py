"""Where one 1024-request DeepSeek-V4-Flash step goes, against a real local store.

``BatchedLookup.lookup_with_tail_keys`` (what ``KvhitLookupServer`` runs per
batch) over the dsv4-flash workload, against a real local ``mooncake_master``,
split into its phases by timing the module functions it calls: candidates,
dedup, key strings, the RPC, the index update, the engine, the tail key
boundaries. Medians over ``--reps`` steps after a warm-up.

Run::

    NUMBA_NUM_THREADS=1 PYTHONPATH=tests .venv/bin/python benchmarks/bench_mooncake_refresh.py
        [--requests 1024] [--reps 5] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

PHASES = {
    # module attribute -> phase
    "host_worker_candidates": "candidates",
    "first_occurrences": "dedup",
    "tail_key_boundaries": "tail boundaries",
    "_tail_boundaries": "tail boundaries",
}


def instrument(mod, bl, acc):
    """Wrap what one step calls with timers adding into ``acc``."""

    def timed(fn, phase):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[phase] += time.perf_counter() - t

        return wrapper

    for name, phase in PHASES.items():
        if hasattr(mod, name):
            setattr(mod, name, timed(getattr(mod, name), phase))
    bl.sync._call_store = timed(bl.sync._call_store, "RPC")
    if hasattr(bl.sync, "_key_list"):
        bl.sync._key_list = timed(bl.sync._key_list, "key strings")
    for name in ("clear", "add", "remove", "contains"):
        if hasattr(bl.index, name):
            setattr(bl.index, name, timed(getattr(bl.index, name), "index"))
    for name in ("lookup", "lookup_unchecked"):
        setattr(bl.engine, name, timed(getattr(bl.engine, name), "engine"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", type=Path)
    args = ap.parse_args(argv)

    from mooncake_fixture import MooncakeMaster, connect_client, mooncake_unavailable

    import kvhit.bindings.store_sync as mod
    from kvhit.bench.workloads import TrafficConfig, generate

    why = mooncake_unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    w = generate("dsv4-flash", TrafficConfig(num_requests=args.requests, seed=0))
    layout = w.layout
    keys = mod.MooncakeKeys("DeepSeek-V4-Flash", [[(0, 0, 0, 0)]] * layout.num_groups)
    with MooncakeMaster() as master:
        store = connect_client(master, global_segment_size=512 << 20)
        try:
            all_keys = [k for g, h in sorted(w.store_keys) for k in keys.keys(g, h)]
            for i in range(0, len(all_keys), 20000):
                chunk = all_keys[i : i + 20000]
                store.put_batch(chunk, [b"kv" * 8] * len(chunk))
            batch = w.hash_batch()
            bl = mod.BatchedLookup(layout, store, keys, hash_bytes=w.hash_bytes)
            bl.lookup_with_tail_keys(batch, w.num_tokens)  # warm-up
            acc: dict[str, float] = defaultdict(float)
            instrument(mod, bl, acc)
            rows = []
            prof = cProfile.Profile() if args.profile else None
            for _ in range(args.reps):
                acc.clear()
                if prof:
                    prof.enable()
                t = time.perf_counter()
                out = bl.lookup_with_tail_keys(batch, w.num_tokens)
                total = time.perf_counter() - t
                if prof:
                    prof.disable()
                row = dict(acc)
                row["total"] = total
                row["refresh"] = bl.last_stats.total_seconds
                row["other"] = total - sum(acc.values())
                rows.append(row)
            st = bl.last_stats
            print(
                f"{len(w)} requests, {w.total_hashes} hashes; {st.num_candidates} "
                f"candidates, {st.num_unique} unique, {st.num_keys_asked} keys, "
                f"{st.num_present} present; {int((out.hit_lengths > 0).sum())} hits"
            )
            names = sorted({k for r in rows for k in r})
            for k in names:
                v = statistics.median(r.get(k, 0.0) for r in rows) * 1e3
                print(f"  {k:16s} {v:8.1f} ms")
            beyond = statistics.median(r["total"] - r.get("RPC", 0.0) for r in rows)
            print(f"  {'beyond RPC':16s} {beyond * 1e3:8.1f} ms")
            if prof:
                prof.dump_stats(str(args.profile))
        finally:
            master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
