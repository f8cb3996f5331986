"""Fleet scoring benchmark: B requests against E engines, and beside Dynamo.

Workload (Mooncake conversation trace, ``bench/traces.py``): the first
``warm`` requests are served round-robin by E engines, each engine saving
what the store worker writes for its requests (``bench/route.py``'s
:func:`saved_keys`); the next ``B`` requests are the batch scored against
every engine. The same keys are spread over E engines at every E, so the
sweep isolates the cost of E.

Every timing is preceded by a parity check: ``fleet_hits`` equals a
per-engine ``find_longest_cache_hit`` against that engine's keys alone (a
KeyIndex each) for every request and engine, and on full attention (no
EAGLE) each engine's hit in blocks equals Dynamo's ``RadixTree.find_matches``
score for that worker, fed the same stores as KV events.

The Dynamo table's inputs are by default what a router reads from the trace
(``--ids raw``): each request's raw ``hash_ids`` (ints from 0, 0 and 1 in
nearly every request) as Python lists, one FullAttention group of the trace's
512-token block (one key per id), prompt lengths as a list; ``--ids hashed``
gives the llama layout on ids expanded into 64-bit hashes instead. Both
orders are timed: alternating call by call, and each side alone (all of
kvhit's repeats, then all of Dynamo's).

Run ``python -m kvhit.bench.bench_fleet [--quick]``; prints Markdown tables
of medians and ratios measured side by side in one process.
``bench/fleet_steps.py`` splits the Dynamo table's step into its stages
(packing, lengths, kernel, answer, stores) and times it in two checkouts
side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvhit.bench.harness import MismatchError
from kvhit.bench.peers import as_u64, busy_host, load_dynamo, pinned
from kvhit.bench.route import saved_keys, trace_batch
from kvhit.bench.traces import TRACE_BLOCK_SIZE, load_trace
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.fleet_index import FleetIndex
from kvhit.coordinator.packing import HashBatch, num_words
from kvhit.coordinator.specs import CacheLayout, FullAttention, Group

__all__ = [
    "FLEET_CALLS",
    "FLEET_IDS",
    "FleetWorkload",
    "build_workload",
    "dynamo_available",
    "dynamo_tree",
    "dynamo_scores",
    "main",
    "pack",
]


#: The Dynamo table's inputs: ``raw`` trace ids as Python lists (the
#: default) or ``hashed`` (the llama layout on expanded 64-bit hashes).
FLEET_IDS = ("raw", "hashed")
#: How the Dynamo table calls kvhit: ``lists``, one
#: ``LookupEngine.fleet_hit_array`` (the router's lists in, numpy hits in
#: blocks out; the default), or ``batch``, ``fleet_hits`` of
#: ``HashBatch.from_ints`` (a tensor of hits in tokens).
FLEET_CALLS = ("lists", "batch")


class FleetWorkload:
    """Per-request hash words of the query batch, the prompt lengths, and the
    stores: ``stores[e]`` = (group ids, hash words) of engine ``e``'s keys,
    ``chains[e]`` the prompts (hash words) engine ``e`` served."""

    def __init__(self, layout, words, tokens, served, served_tokens, engines):
        self.layout = layout
        self.words: list[np.ndarray] = words
        # The same hashes one-dimensional, as a router holds a request's
        # block hashes (what both sides of the Dynamo comparison are given).
        self.ints: list[np.ndarray] = [np.ascontiguousarray(w[:, 0]) for w in words]
        # And as Python lists, as a router reads them from a trace (with the
        # prompt lengths as a list): the inputs of the raw-id Dynamo table.
        self.lists: list[list[int]] = [w.tolist() for w in self.ints]
        self.token_list: list[int] = tokens.tolist()
        self.tokens: np.ndarray = tokens
        self.served: list[np.ndarray] = served
        self.served_tokens: np.ndarray = served_tokens
        self.engines = engines

    def owner(self, i: int) -> int:
        """The engine that served warm request ``i`` (round-robin)."""
        return i % self.engines


def build_workload(preset: str, engines: int, warm: int, batch: int,
                   hash_bytes: int = 8, ids: str = "hashed") -> FleetWorkload:  # fmt: skip
    """The trace's first ``warm`` requests served round-robin by ``engines``
    engines, and the next ``batch`` as the query batch.

    ``ids="hashed"``: ``preset``'s layout on ids expanded into hashes;
    ``ids="raw"``: ``preset`` is not used, one FullAttention group of the
    trace's block with each request's raw ``hash_ids`` (its full blocks) as
    its keys (8-byte keys only)."""
    if ids not in FLEET_IDS:
        raise ValueError(f"ids must be one of {FLEET_IDS}, got {ids!r}")
    reqs = load_trace(limit=warm + batch)
    served, served_tokens = (
        reqs[:warm],
        np.array([r.input_length for r in reqs[:warm]], dtype=np.int64),
    )
    if ids == "raw":
        if hash_bytes != 8:
            raise ValueError(f"raw ids are 8-byte keys, got hash_bytes={hash_bytes}")
        bs = TRACE_BLOCK_SIZE
        layout = CacheLayout(
            groups=[Group(FullAttention(block_size=bs))],
            scheduler_block_size=bs,
            hash_block_size=bs,
        )

        def full(r: Any) -> np.ndarray:
            return r.hash_ids[: r.input_length // bs].reshape(-1, 1).copy()

        tokens = np.array([r.input_length for r in reqs[warm:]], dtype=np.int64)
        return FleetWorkload(layout, [full(r) for r in reqs[warm:]], tokens,
                             [full(r) for r in served], served_tokens, engines)  # fmt: skip
    layout = make_layout(preset)
    wb, _ = trace_batch(served, layout, hash_bytes)
    offs = wb.offsets.numpy()
    chains = [wb.hashes.numpy()[offs[i] : offs[i + 1]] for i in range(warm)]
    qb, tokens = trace_batch(reqs[warm:], layout, hash_bytes)
    qo = qb.offsets.numpy()
    words = [qb.hashes.numpy()[qo[i] : qo[i + 1]] for i in range(len(tokens))]
    return FleetWorkload(layout, words, tokens, chains, served_tokens, engines)


def fill_fleet(engine: LookupEngine, wl: FleetWorkload, hash_bytes: int = 8,
               chunk: int = 256) -> FleetIndex:  # fmt: skip
    """A FleetIndex holding every engine's saved keys."""
    fleet = FleetIndex(wl.engines, hash_bytes, capacity=1 << 16)
    for lo in range(0, len(wl.served), chunk):
        part = wl.served[lo : lo + chunk]
        batch = pack(part, hash_bytes)
        g, rows = saved_keys(engine, batch, wl.served_tokens[lo : lo + chunk])
        req = torch.searchsorted(batch.offsets[1:], rows, right=True)
        owner = (req + lo) % wl.engines
        fleet.add(owner, g, batch.hashes[rows])
    return fleet


def pack(words: Sequence[np.ndarray], hash_bytes: int = 8) -> HashBatch:
    """Per-request hash words -> a validated HashBatch (what a router does
    with the hashes it computed for each request): ``HashBatch.from_ints``
    (each request's one-word hashes checked, then concatenated) when a hash
    is one word, else the constructor on the concatenated words."""
    if num_words(hash_bytes) == 1:
        return HashBatch.from_ints(
            [w if w.ndim == 1 else w[:, 0] for w in words], hash_bytes
        )
    offsets = np.zeros(len(words) + 1, dtype=np.int64)
    np.cumsum([len(w) for w in words], out=offsets[1:])
    flat = np.concatenate(words) if words else np.zeros((0, 1), dtype=np.int64)
    return HashBatch(torch.from_numpy(flat), torch.from_numpy(offsets), hash_bytes)


def dynamo_available() -> bool:
    """Whether ``ai-dynamo-runtime`` (``dynamo._core.RadixTree``) imports."""
    return load_dynamo()[0] is not None


def dynamo_tree(wl: FleetWorkload, full_blocks: Callable[[int], int]) -> Any:
    """A Dynamo RadixTree fed, per served request, one ``stored`` event with
    the chain of its first ``full_blocks(i)`` block hashes (as u64) from the
    root, from worker ``owner(i)``. Raises RuntimeError, with the reason,
    where ``ai-dynamo-runtime`` does not import (:func:`dynamo_available`)."""
    tree_cls, why = load_dynamo()
    if tree_cls is None:
        raise RuntimeError(f"Dynamo's RadixTree is not available: {why}")
    tree = tree_cls()
    for i, words in enumerate(wl.served):
        n = full_blocks(i)
        if n <= 0:
            continue
        hashes = as_u64(words[:n, 0])
        event = {"event_id": i + 1, "data": {"stored": {"parent_hash": None,
                 "blocks": [{"block_hash": h, "tokens_hash": h} for h in hashes]}}}  # fmt: skip
        tree.apply_event(wl.owner(i), json.dumps(event).encode())
    return tree


def dynamo_scores(tree: Any, words: Sequence[np.ndarray], engines: int) -> np.ndarray:
    """Dynamo's matched blocks per request and worker: int64 ``[B, E]``."""
    out = np.zeros((len(words), engines), dtype=np.int64)
    for b, w in enumerate(words):
        scores = tree.find_matches(as_u64(w if w.ndim == 1 else w[:, 0])).scores
        for (worker, _rank), n in scores.items():
            out[b, worker] = n
    return out


def dynamo_find(tree: Any, words: Sequence[np.ndarray]) -> list[dict]:
    """What a router gets from Dynamo for each request: ``find_matches``'s
    scores, ``{(worker, dp_rank): blocks}`` (the u64 list conversion
    included; turning them into a ``[B, E]`` array, as :func:`dynamo_scores`
    does for the parity check, is not timed)."""
    return [tree.find_matches(as_u64(w)).scores for w in words]


# Read before every timed call of the Dynamo comparison, so that each starts
# with cold caches, as a router's lookup of requests it has not seen does
# (64 MiB: more than the last-level cache).
_EVICT = np.ones(64 << 17)


def _interleaved_us(fa: Callable[[], Any], fb: Callable[[], Any],
                    repeats: int) -> tuple[list[float], list[float]]:  # fmt: skip
    """Times (us) of ``fa`` and ``fb`` timed alternately (a load change on a
    shared machine hits both alike), each after evicting the caches."""
    fa(), fb()
    ta, tb = [], []
    for _ in range(repeats):
        _EVICT.sum()
        t0 = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t0)
        _EVICT.sum()
        t0 = time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t0)
    return [t * 1e6 for t in ta], [t * 1e6 for t in tb]


def check_parity(engine: LookupEngine, fleet: FleetIndex, batch: HashBatch,
                 lens: np.ndarray) -> torch.Tensor:  # fmt: skip
    """fleet_hits, checked against one KeyIndex per engine; raises MismatchError."""
    got = engine.fleet_hits(batch, lens, fleet)
    for e in range(fleet.num_engines):
        want = engine.find_longest_cache_hit(
            batch, lens, fleet.key_index(e)
        ).hit_lengths
        if not torch.equal(got[:, e], want):
            raise MismatchError(f"engine {e}: {got[:, e].tolist()} != {want.tolist()}")
    return got


def sweep(preset: str, engines: Sequence[int], warm: int, batch: int,
          repeats: int, out) -> None:  # fmt: skip
    """fleet_hits at B = ``batch`` for each E, ratio to the first E; the E
    are timed in turn within each repeat (a load change hits all alike)."""
    calls = []
    for E in engines:
        wl = build_workload(preset, E, warm, batch)
        engine = LookupEngine(wl.layout)
        fleet = fill_fleet(engine, wl)
        check_parity(engine, fleet, pack(wl.words), wl.tokens)
        calls.append(lambda wl=wl, fleet=fleet, engine=engine: engine.fleet_hits(
            pack(wl.words), wl.tokens, fleet))  # fmt: skip
    times: list[list[float]] = [[] for _ in calls]
    for fn in calls:
        fn()
    for _ in range(repeats):
        for k, fn in enumerate(calls):
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    rows, base = [], None
    for E, t in zip(engines, times, strict=True):
        us = statistics.median(t) * 1e6
        base = base or us
        rows.append((E, us, us / base))
        print(f"  {preset} E={E}: {us:.0f} us", file=sys.stderr)
    out.write(f"\n{preset}: B = {batch} against E engines ({warm} served requests "
              "spread round-robin), fleet_hits incl. packing, median\n\n")  # fmt: skip
    out.write(
        "| E | us per batch | us per request | vs first E |\n|---:|---:|---:|---:|\n"
    )
    for E, us, ratio in rows:
        out.write(f"| {E} | {us:.0f} | {us / batch:.1f} | {ratio:.2f}x |\n")


def _separate_us(fa: Callable[[], Any], fb: Callable[[], Any],
                 repeats: int) -> tuple[list[float], list[float]]:  # fmt: skip
    """Times (us) of ``fa``, then of ``fb``, each timed alone (all of one
    side's repeats, then the other's), each call after evicting the caches."""
    out = []
    for fn in (fa, fb):
        fn()
        times = []
        for _ in range(repeats):
            _EVICT.sum()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out.append([t * 1e6 for t in times])
    return out[0], out[1]


def versus_dynamo(engines: Sequence[int], warm: int, batch: int, repeats: int,
                  out, host_load: int = 0, ids: str = "raw",
                  pin: int | None = None, call: str = "lists") -> list[tuple]:  # fmt: skip
    """Full attention: per-engine hits in blocks equal Dynamo's scores; time
    per request side by side, in both orders (alternating call by call, and
    each side alone), with ``host_load`` CPU-bound processes spinning beside
    the timed calls (:func:`~kvhit.bench.peers.busy_host`; 0: a quiet host)
    and, with ``pin``, every thread on that CPU while timed
    (:func:`~kvhit.bench.peers.pinned`).

    ``ids="raw"`` (default): raw trace ids in Python lists, one
    FullAttention(512) group, lengths as a list, Dynamo given the same lists;
    ``ids="hashed"``: llama (Full 16, hash 16, no EAGLE) on expanded hashes,
    both sides given numpy arrays (Dynamo's u64 list conversion timed).
    ``call`` (:data:`FLEET_CALLS`): kvhit's call, ``lists``
    (``fleet_hit_array``, hits in blocks) or ``batch`` (``from_ints`` and
    ``fleet_hits``); its answers are checked against Dynamo's before timing.

    Writes the table to ``out`` and returns its rows: ``(E, kvhit us/request
    alternate, Dynamo alternate, kvhit separate, Dynamo separate, (request,
    engine) pairs with a hit)``."""
    if call not in FLEET_CALLS:
        raise ValueError(f"call must be one of {FLEET_CALLS}, got {call!r}")
    rows = []
    for E in engines:
        wl = build_workload("llama", E, warm, batch, ids=ids)
        engine = LookupEngine(wl.layout)
        fleet = fill_fleet(engine, wl)
        bs = wl.layout.spec_groups[0].block_size
        align = wl.layout.alignment
        tree = dynamo_tree(
            wl, lambda i, wl=wl, a=align, bs=bs: int(wl.served_tokens[i]) // a * a // bs
        )
        qb = pack(wl.words)
        got = check_parity(engine, fleet, qb, wl.tokens)
        dyn = dynamo_scores(tree, wl.words, E)
        if not np.array_equal(got.numpy() // bs, dyn):
            bad = int((got.numpy() // bs != dyn).sum())
            raise MismatchError(
                f"E={E}: {bad} (request, engine) pairs differ from Dynamo"
            )
        reqs, lens = (wl.lists, wl.token_list) if ids == "raw" else (wl.ints, wl.tokens)
        if call == "lists":
            ours = lambda r=reqs, n=lens, f=fleet, e=engine, bs=bs: e.fleet_hit_array(  # noqa: E731
                r, n, f, True, bs)  # fmt: skip
            if not np.array_equal(ours(), dyn):
                raise MismatchError(f"E={E}: fleet_hit_array differs from Dynamo")
        else:
            ours = lambda r=reqs, n=lens, f=fleet, e=engine: e.fleet_hits(  # noqa: E731
                HashBatch.from_ints(r, 8), n, f)  # fmt: skip
        if ids == "raw":
            find = tree.find_matches
            theirs = lambda find=find, wl=wl: [find(c).scores for c in wl.lists]  # noqa: E731
        else:
            theirs = lambda tree=tree, wl=wl: dynamo_find(tree, wl.ints)  # noqa: E731
        per_req = []
        with busy_host(host_load), pinned(pin):
            for timed in (_interleaved_us, _separate_us):
                ta, tb = timed(ours, theirs, repeats)
                per_req += [statistics.median(t) / batch for t in (ta, tb)]
        rows.append((E, *per_req, int((dyn > 0).sum())))
        print(f"  dynamo E={E}: ours {per_req[0]:.2f} / {per_req[2]:.2f} us/request, "
              f"dynamo {per_req[1]:.2f} / {per_req[3]:.2f}", file=sys.stderr)  # fmt: skip
    what = (
        "raw trace ids as Python lists (0 and 1 included), FullAttention(512), "
        "lengths as a list; both sides given the same lists"
        if ids == "raw"
        else "llama (full attention) on expanded hashes, numpy inputs; Dynamo's "
        "u64 list conversion included"
    )
    kv_call = ("fleet_hit_array (one call, hits in blocks)" if call == "lists"
               else "fleet_hits (from_ints packing included)")  # fmt: skip
    out.write(f"\nFleet vs Dynamo, B = {batch}, {what}: kvhit {kv_call} vs Dynamo "
              "RadixTree.find_matches(...).scores, us per "
              f"request (median of {repeats}), caches evicted before each call; "
              "alternate = call by call, separate = each side's repeats alone; "
              f"host: {'quiet' if not host_load else f'{host_load} CPU-bound processes spinning'}"
              + (f", every thread on CPU {pin}" if pin is not None else "") +
              "; 0 mismatches\n\n")  # fmt: skip
    out.write("| E | kvhit (alternate / separate) | Dynamo (alternate / separate) | "
              "speedup (alternate / separate) | (request, engine) pairs with a hit |"
              "\n|---:|---:|---:|---:|---:|\n")  # fmt: skip
    for E, aa, ba, asep, bsep, n in rows:
        out.write(f"| {E} | {aa:.2f} / {asep:.2f} | {ba:.2f} / {bsep:.2f} | "
                  f"{ba / aa:.1f}x / {bsep / asep:.1f}x | {n} |\n")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the E sweep (llama, dsv4-flash, qwen3-next) and the Dynamo table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small warm set, few repeats")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warm", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--presets", default="llama,dsv4-flash,qwen3-next")
    p.add_argument("--engines", default="1,8,64,256")
    p.add_argument(
        "--ids",
        choices=FLEET_IDS,
        default="raw",
        help="the Dynamo table's inputs: raw trace ids as Python lists "
        "(default) or hashed (llama layout, expanded hashes, numpy inputs)",
    )
    p.add_argument(
        "--call",
        choices=FLEET_CALLS,
        default="lists",
        help="the Dynamo table's kvhit call: lists (fleet_hit_array, default) "
        "or batch (from_ints + fleet_hits)",
    )
    p.add_argument(
        "--host-load",
        default="0",
        metavar="N[,N...]",
        help="the Dynamo table once per N, with N CPU-bound processes "
        "spinning beside it (default 0: a quiet host)",
    )
    args = p.parse_args(argv)
    warm, repeats = (256, 5) if args.quick else (args.warm, args.repeats)
    engines = [int(e) for e in args.engines.split(",")]
    out = sys.stdout
    torch.set_num_threads(1)
    for preset in args.presets.split(","):
        if preset:
            sweep(preset, engines, warm, args.batch, repeats, out)
    if dynamo_available():
        for load in (int(n) for n in args.host_load.split(",")):
            versus_dynamo([e for e in engines if e in (8, 64)] or engines, warm,
                          args.batch, repeats, out, host_load=load, ids=args.ids,
                          call=args.call)  # fmt: skip
    else:
        out.write("\n(Dynamo not importable: pip install ai-dynamo-runtime)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
