"""One vLLM scheduler step, stock MooncakeStoreConnector vs KvhitMooncakeStoreConnector.

vLLM 0.33.0's real ``Scheduler`` (the oracle's sources, ``.ci/install-vllm-oracle``)
with each connector, against a real local ``mooncake_master``: the worker side
is vLLM's own ``MooncakeStoreWorker`` (built without a GPU, see
tests/vllm_sched_harness.py) whose store handle is a real
``MooncakeDistributedStore`` client; vLLM's ``LookupKeyServer`` serves the stock
connector, ``KvhitLookupServer`` the kvhit one. For 8 / 64 / 512 waiting
requests (prompts sharing system prompts, half of them stored), it times the
first ``schedule()`` (every request waiting, each looked up) and counts the
store's existence calls in it. Fresh schedulers per repetition; medians.

What a long-running server pays once (building the side, its engine and
kernels; its first lookup) is timed apart and printed beside each row.
``--split`` times, in both connectors' steps, wall and main-thread CPU:
the lookups (the lookup client's calls), each other connector hook
(``get_num_new_matched_tokens``' own bookkeeping, ``update_state_after_alloc``,
``build_connector_meta``, ``request_finished_all_groups``), vLLM's core (the
rest, which both run) and the cyclic collector's pauses;
``--profile DIR`` writes a cProfile of each connector's steps there, sorted
by cumulative and by own time. ``--floor`` also times kvhit's step with
every lookup free (answered from a dict filled before the step): vLLM's core
plus the connector's other hooks, which both connectors pay; stock / floor
is the most any lookup can give. ``--breakdown`` cuts kvhit's step at every
stage (``step_timeline.py``: the client's codec, the IPC hand-offs, packing, candidates, key strings, the
store pool's hand-off, the store call, the index rewrite, the engine, the
tail keys, the reply) and prints each interval's median.

Run::

    PYTHONSAFEPATH=1 PYTHONPATH=tests:benchmarks .venv/bin/python benchmarks/bench_vllm_step.py
        [--sizes 8 64 512] [--reps 3] [--json out.json] [--breakdown]
        [--split] [--floor] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


class CountingStore:
    """A real store handle, counting ``batch_is_exist`` calls."""

    def __init__(self, store) -> None:
        self.store = store
        self.calls = 0
        self.lock = threading.Lock()

    def batch_is_exist(self, keys):
        with self.lock:
            self.calls += 1
        return self.store.batch_is_exist(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def prompts(rng: random.Random, n: int, length: int = 512) -> list[list[int]]:
    systems = [[rng.randrange(3, 1000) for _ in range(length // 2)] for _ in range(4)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(3, 1000) for _ in range(length - length // 2)]
        out.append(rng.choice(systems) + tail)
    return out


def put_keys(raw_store, worker, reqs, hbs: int, frac: float, rng) -> int:
    """Store every group's keys of a leading part of ``frac`` of the prompts."""
    import vllm_sched_harness as h

    keys = set()
    for toks in reqs:
        if rng.random() > frac:
            continue
        hashes = h.make_request("x", toks, hbs, 1).block_hashes
        keep = rng.randrange(len(hashes) // 2, len(hashes) + 1)
        for prefixes in worker._lookup_key_prefixes:
            for hh in hashes[:keep]:
                keys.update(f"{p}@{bytes(hh).hex()}" for p in prefixes)
    keys = sorted(keys)
    for i in range(0, len(keys), 20000):
        chunk = keys[i : i + 20000]
        rc = raw_store.put_batch(chunk, [b"kv" * 8] * len(chunk))
        if rc != 0:
            raise RuntimeError(f"put_batch returned {rc}")
    return len(keys)


#: The connector hooks ``schedule()`` calls, timed apart by ``--split``:
#: the connector's part of the step (ours to make cheaper), not vLLM's core.
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished_all_groups",
)


class StepSplit:
    """Per ``schedule()``: wall and main-thread CPU seconds inside each
    connector hook (:data:`HOOKS`, on vLLM's ``MooncakeStoreConnector`` and
    kvhit's subclass; only the outermost call counts, so an override calling
    ``super()`` is counted once), the lookups' share of
    ``get_num_new_matched_tokens`` (vLLM's ``MooncakeStoreScheduler``'s
    client call), and the cyclic collector's pauses (seconds, count, the
    full ones). The main thread's CPU tells the work apart from the waits
    for a core on a loaded host: a long CPU burst (kvhit's step after its
    one lookup) is preempted where stock's, cut into 512 short runs by its
    per-request IPC waits, is not."""

    def __init__(self) -> None:
        import gc

        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
            connector,
            scheduler,
        )

        from kvhit.bindings import vllm_connector

        self.reset()
        self._depth = 0
        self._gc_t0 = 0.0
        for cls in (connector.MooncakeStoreConnector,
                    vllm_connector.KvhitMooncakeStoreConnector):  # fmt: skip
            for name in HOOKS:
                if name in vars(cls):
                    setattr(cls, name, self._timed(name, vars(cls)[name]))
        cls = scheduler.MooncakeStoreScheduler
        client_lookup = cls.get_num_new_matched_tokens

        def timed_lookup(sched, *args, **kwargs):
            client = sched.client
            own = vars(client).get("lookup")  # --floor's stand-in
            real = client.lookup

            def lookup(*a, **k):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return real(*a, **k)
                finally:
                    self.lookup_s += time.perf_counter() - t0
                    self.lookup_cpu_s += time.thread_time() - c0

            client.lookup = lookup
            try:
                return client_lookup(sched, *args, **kwargs)
            finally:
                if own is None:
                    del client.lookup
                else:
                    client.lookup = own

        cls.get_num_new_matched_tokens = timed_lookup
        gc.callbacks.append(self._on_gc)

    def _timed(self, name: str, real):
        def timed(*args, **kwargs):
            if self._depth:
                return real(*args, **kwargs)
            self._depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1
                self.hook_s[name] += time.perf_counter() - t0
                self.hook_cpu_s[name] += time.thread_time() - c0

        return timed

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        self.gc_s += time.perf_counter() - self._gc_t0
        self.gc_n += 1
        self.gc_full += info["generation"] == 2

    def reset(self) -> None:
        self.lookup_s = self.lookup_cpu_s = self.gc_s = 0.0
        self.gc_n = self.gc_full = 0
        self.hook_s = dict.fromkeys(HOOKS, 0.0)
        self.hook_cpu_s = dict.fromkeys(HOOKS, 0.0)

    def take(self) -> dict:
        out = {"lookup_s": self.lookup_s, "lookup_cpu_s": self.lookup_cpu_s,
               "gc_s": self.gc_s, "gc_n": self.gc_n, "gc_full": self.gc_full,
               "hook_s": self.hook_s, "hook_cpu_s": self.hook_cpu_s}  # fmt: skip
        self.reset()
        return out


def one_step(h, kind, case, store, reqs, n, freeze: bool = True, split=None,
             profile=None, free_lookup: bool = False):  # fmt: skip
    """One timed ``schedule()`` of ``n`` waiting requests on a fresh side:
    ``(seconds, store calls, scheduled, loads, setup)`` where ``setup`` holds
    what a long-running server pays once (building the side, its engine and
    kernels; its first lookup), timed apart, and the step's ``(t0, t1)``.

    With ``freeze`` the heap is frozen once the side is built, as vLLM's
    ``EngineCore`` does after start-up (``vllm.utils.gc_utils.freeze_gc_heap``)
    and undone at close as its shutdown does: without it, every side this
    process built before (15 per size) stays in the cyclic collector's oldest
    generation and a full collection that lands in the timed step scans them
    all (0.4-0.6 s at 512 waiting, in either connector's step).

    With ``free_lookup`` every lookup of the step is answered from a dict
    filled before it (vLLM's own ``MooncakeStoreWorker.lookup`` per request,
    the answers both connectors give): the step is then vLLM's core plus the
    connector's other hooks, the floor no lookup can go under."""
    import gc

    s0 = time.perf_counter()
    side = h.build_side(kind, case, store, {"load_async": False}, num_blocks=40000,
                        max_num_seqs=max(n, 8),
                        max_num_batched_tokens=max(n, 8) * 600)  # fmt: skip
    try:
        for i, toks in enumerate(reqs[:n]):
            side.scheduler.add_request(
                h.make_request(f"r{i}", toks, side.hash_block_size, 4)
            )
        # What a running server has done long before: build its engine and
        # touch the store once (not timed, not counted).
        warm = h.make_request("warm", reqs[0], side.hash_block_size, 1)
        s1 = time.perf_counter()
        for server in side.servers[1:]:
            server.resolve([(warm.num_tokens, list(warm.block_hashes))])
        side.worker.lookup(warm.num_tokens, warm.block_hashes)
        s2 = time.perf_counter()
        if free_lookup:
            answers = {
                r.request_id: side.worker.lookup(r.num_tokens, list(r.block_hashes))
                for r in side.scheduler.waiting
            }
            client = side.scheduler.connector.connector_scheduler.client
            # An instance attribute: the client's own method stays for close.
            client.lookup = lambda req_id, *args, **kwargs: answers[req_id]
        if freeze:
            from vllm.utils.gc_utils import freeze_gc_heap

            freeze_gc_heap()
        c0 = store.calls
        if split is not None:
            split.reset()
        if profile is not None:
            profile.enable()
        p0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        out = side.scheduler.schedule()
        dt = time.perf_counter() - t0
        cpu_s, main_cpu_s = time.process_time() - p0, time.thread_time() - m0
        if profile is not None:
            profile.disable()
        loaded = sum(
            1
            for m in out.kv_connector_metadata.requests
            if m.load_spec is not None and m.load_spec.can_load
        )
        setup = {"build_s": s1 - s0, "first_lookup_s": s2 - s1}
        if split is not None:
            setup["split"] = split.take()
            # Every thread of the process (the server's and the store
            # calls' too): steadier than the wall time on a loaded host.
            setup["split"]["cpu_s"] = cpu_s
            setup["split"]["main_cpu_s"] = main_cpu_s
        return (dt, store.calls - c0, len(out.scheduled_new_reqs), loaded, setup,
                (t0, t0 + dt))  # fmt: skip
    finally:
        side.close()
        if freeze:
            gc.unfreeze()


def print_split(row: dict, kind: str, v: list) -> None:
    """``--split``'s lines for one connector's repetitions ``v`` (medians),
    also stored in ``row``: the step's wall and main-thread CPU, the lookups,
    each connector hook, vLLM's core (the rest) and the collector."""
    sp = [x[4]["split"] for x in v]

    def med(f) -> float:
        return statistics.median(f(x, y) for x, y in zip(v, sp, strict=True)) * 1e3

    hooks = lambda y, key: sum(y[key].values())  # noqa: E731
    wall, cpu = med(lambda x, y: x[0]), med(lambda x, y: y["main_cpu_s"])
    look, look_cpu = (
        med(lambda x, y: y["lookup_s"]),
        med(lambda x, y: y["lookup_cpu_s"]),
    )
    hook = med(lambda x, y: hooks(y, "hook_s") - y["lookup_s"])
    hook_cpu = med(lambda x, y: hooks(y, "hook_cpu_s") - y["lookup_cpu_s"])
    core = med(lambda x, y: x[0] - hooks(y, "hook_s"))
    core_cpu = med(lambda x, y: y["main_cpu_s"] - hooks(y, "hook_cpu_s"))
    gc_ms = med(lambda x, y: y["gc_s"])
    row.update({f"{kind}_{k}": val for k, val in (
        ("main_cpu_ms", cpu), ("lookup_ms", look), ("lookup_cpu_ms", look_cpu),
        ("hooks_ms", hook), ("hooks_cpu_ms", hook_cpu), ("core_ms", core),
        ("core_cpu_ms", core_cpu), ("gc_ms", gc_ms),
        ("cpu_ms", med(lambda x, y: y["cpu_s"])))})  # fmt: skip
    print(f"     {kind}: wall / main-thread CPU ms: step {wall:.1f} / {cpu:.1f}, "
          f"lookups {look:.1f} / {look_cpu:.1f}, other connector hooks "
          f"{hook:.1f} / {hook_cpu:.1f}, vLLM core {core:.1f} / {core_cpu:.1f}; "
          f"process CPU {row[f'{kind}_cpu_ms']:.1f}, gc {gc_ms:.1f} "
          f"({statistics.median(y['gc_n'] for y in sp):.0f} collections, "
          f"{sum(y['gc_full'] for y in sp)} full in {len(sp)} steps)")  # fmt: skip
    for name in HOOKS:
        w = med(lambda x, y, n=name: y["hook_s"][n])
        c = med(lambda x, y, n=name: y["hook_cpu_s"][n])
        print(f"       {name}: {w:.2f} / {c:.2f}")


def write_profile(prof, stem: Path) -> None:
    """``prof`` as two text files, ``stem``.cumulative.txt and .tottime.txt."""
    import io
    import pstats

    stem.parent.mkdir(parents=True, exist_ok=True)
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(40)
        Path(f"{stem}.{key}.txt").write_text(out.getvalue())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the heap unfrozen (vLLM's EngineCore freezes it after start-up)",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="time the lookups apart from vLLM's own scheduling, and gc pauses",
    )
    ap.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="cProfile each connector's steps into DIR (cumulative and own time)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time kvhit's step with every lookup answered from answers "
        "found before it: the floor (vLLM's core and the connector's other "
        "hooks) no lookup can go under, and stock / floor, the most any can give",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="time kvhit's step stage by stage (benchmarks/step_timeline.py)",
    )
    args = ap.parse_args(argv)
    if any(s <= 0 for s in args.sizes) or args.reps <= 0:
        ap.error("--sizes and --reps must be positive")

    from mooncake_fixture import MooncakeMaster, connect_client, mooncake_unavailable

    from kvhit.bench import vllm_oracle as vo

    why = mooncake_unavailable()
    mods, reason = vo.load_vllm()
    if why or mods is None:
        print(f"skipped: {why or reason}")
        return 0
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="kvhit-rpc-")
    rows = []
    with vo.vllm_importable(), MooncakeMaster() as master:
        import vllm_sched_harness as h

        if args.breakdown:
            import step_timeline

            step_timeline.install()

        split = StepSplit() if args.split else None
        raw = connect_client(master, global_segment_size=256 << 20)
        try:
            store = CountingStore(raw)
            case = h.LAYOUTS[0]
            rng = random.Random(0)
            reqs = prompts(rng, max(args.sizes))
            probe = h.build_side("stock", case, store, {})
            n_keys = put_keys(raw, probe.worker, reqs, probe.hash_block_size, 0.5, rng)
            probe.close()
            print(f"store: {n_keys} keys; prompts of {len(reqs[0])} tokens, "
                  f"layout {case.name}")  # fmt: skip
            for n in args.sizes:
                res = {"stock": [], "kvhit": []}
                if args.floor:
                    res["floor"] = []
                profs = {}
                if args.profile:
                    import cProfile

                    profs = {k: cProfile.Profile() for k in res}
                for _ in range(args.reps):
                    for kind in res:
                        res[kind].append(
                            one_step(
                                h,
                                "kvhit" if kind == "floor" else kind,
                                case,
                                store,
                                reqs,
                                n,
                                freeze=not args.no_freeze,
                                split=split,
                                profile=profs.get(kind),
                                free_lookup=kind == "floor",
                            )  # fmt: skip
                        )
                for kind, prof in profs.items():
                    write_profile(prof, args.profile / f"{kind}_{n}")
                row = {"waiting": n}
                for kind, v in res.items():
                    row[f"{kind}_ms"] = statistics.median(x[0] for x in v) * 1e3
                    row[f"{kind}_store_calls"] = statistics.median(x[1] for x in v)
                    row[f"{kind}_loads"] = v[0][3]
                assert res["stock"][0][3] == res["kvhit"][0][3], "different loads"
                row["speedup"] = row["stock_ms"] / row["kvhit_ms"]
                for part in ("build_s", "first_lookup_s"):
                    row[f"kvhit_setup_{part}"] = statistics.median(
                        x[4][part] for x in res["kvhit"]
                    )
                rows.append(row)
                print(
                    f"{n:4d} waiting: stock {row['stock_ms']:8.1f} ms "
                    f"{row['stock_store_calls']:4.0f} store calls | kvhit "
                    f"{row['kvhit_ms']:8.1f} ms {row['kvhit_store_calls']:2.0f} "
                    f"store call(s) | {row['speedup']:.1f}x, "
                    f"{row['kvhit_loads']} loads"
                )
                print(
                    f"     kvhit one-time setup (apart): side built in "
                    f"{row['kvhit_setup_build_s'] * 1e3:.0f} ms, first lookup "
                    f"{row['kvhit_setup_first_lookup_s'] * 1e3:.1f} ms"
                )
                if args.floor:
                    row["max_speedup"] = row["stock_ms"] / row["floor_ms"]
                    print(
                        f"     floor (kvhit's step, every lookup free): "
                        f"{row['floor_ms']:.1f} ms; stock / floor "
                        f"{row['max_speedup']:.1f}x, the most any lookup gives"
                    )
                if split is not None:
                    for kind, v in res.items():
                        print_split(row, kind, v)
                if args.breakdown:
                    import step_timeline
                    from tabulate import tabulate

                    steps = [step_timeline.step_intervals(*x[5]) for x in res["kvhit"]]
                    parts = step_timeline.table(steps)
                    for s in steps:  # where each repetition's time went
                        top = sorted(s, key=lambda x: -x[1])[:3]
                        print(f"     rep {sum(d for _, d in s) * 1e3:6.2f} ms: " + ", ".join(
                            f"{k} {d * 1e3:.2f}" for k, d in top))  # fmt: skip
                    row["kvhit_breakdown_ms"] = {k: ms for k, ms, _ in parts}
                    print(tabulate(
                        [(k, f"{ms:.3f}", f"{sh:.0%}") for k, ms, sh in parts],
                        headers=["kvhit step interval", "median ms", "share"],
                    ))  # fmt: skip
        finally:
            master.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
