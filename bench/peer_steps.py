"""kvhit beside a peer index the way a router meets them (issue 33).

A router holds each request's block ids as it read them (a Mooncake trace's
``hash_ids``: raw ints from 0, so 0 and 1 in nearly every request) in Python
lists, and the prompt lengths in a list. :func:`peer_sweep` replays the trace
in steps of ``B`` requests on exactly those inputs, kvhit (``HashBatch
.from_ints`` packing, ``find_longest_cache_hit``, one ``KeyIndex.add`` per
step) and Dynamo's ``RadixTree`` (one ``find_matches`` per request, one stored
event per request), every answer compared, in both orders:

* ``alternate``: step by step, kvhit then the peer: what a host running both
  side by side sees (each pays for the cache state the other leaves behind);
* ``separate``: kvhit's whole replay, then the peer's, each a pass of its own.

``ids="hashed"`` gives the older inputs instead: every trace id expanded into
a position-dependent 64-bit hash (``bench/traces.py``'s ``hash_words``), which
never holds a 0 or a 1.

:func:`targets` measures issue 33's targets table (lookup and stores vs
Dynamo at B = 1, 64, 1024, ``from_ints`` ns per int per input form, and the
fleet vs Dynamo at B = 64); ``python -m kvhit.bench.peer_steps`` prints it as
Markdown (run it with ``NUMBA_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvhit.bench.harness import (
    PEER_BLOCK_SIZE,
    PEER_ORDERS,
    MismatchError,
    PeerRow,
    Skip,
    peer_rows_past,
)
from kvhit.bench.peers import DYNAMO, PEERS, DynamoIndex, busy_host, load_dynamo

__all__ = [
    "FORMS",
    "PEER_IDS",
    "StepInputs",
    "format_orders",
    "from_ints_rates",
    "peer_sweep",
    "main",
    "step_inputs",
    "targets",
]

#: What the replay feeds both indexes: ``raw`` trace ids (the default: what a
#: router reads) or ``hashed`` (each id expanded into a 64-bit hash).
PEER_IDS = ("raw", "hashed")


@dataclass(frozen=True)
class StepInputs:
    """The trace as both indexes are given it, one entry per request.

    Attributes:
        ints: each request's full blocks' ids, a Python list of ints (what
            ``HashBatch.from_ints`` packs).
        tokens: each request's prompt length in tokens, a Python list.
        chains: each request's block hashes as Dynamo takes them (unsigned
            64-bit ints; for raw ids, the same lists as ``ints``).
    """

    ints: list[list[int]]
    tokens: list[int]
    chains: list[list[int]]


def step_inputs(
    requests: Sequence[Any], ids: str = "raw", block_size: int = PEER_BLOCK_SIZE
) -> StepInputs:
    """The inputs of :func:`peer_sweep` from trace requests
    (``bench/traces.py``'s ``TraceRequest``), one block per trace id
    (``block_size`` must be the trace's block).

    Only a prompt's full blocks are hashed (a worker stores no partial
    block), so each request holds ``input_length // block_size`` ids.
    """
    from kvhit.bench.peers import as_u64
    from kvhit.bench.traces import hash_block_ids, hash_words

    if ids not in PEER_IDS:
        raise ValueError(f"ids must be one of {PEER_IDS}, got {ids!r}")
    tokens = [r.input_length for r in requests]
    if ids == "raw":
        ints = [r.hash_ids[: r.input_length // block_size].tolist() for r in requests]
        # Trace ids are non-negative: the same ints are Dynamo's u64 hashes.
        return StepInputs(ints, tokens, ints)
    words = [hash_words(*hash_block_ids(r, block_size), 1)[:, 0] for r in requests]
    return StepInputs([w.tolist() for w in words], tokens, [as_u64(w) for w in words])


class _KvhitSteps:
    """kvhit's side, one step at a time: pack the step's lists, look them up
    (lengths as the step's list), store each request's blocks past its hit (a
    worker's new blocks) with one ``KeyIndex.add``. Per step, seconds per
    request: medians resist the load spikes of a shared machine."""

    def __init__(self, engine: Any, index: Any, inputs: StepInputs) -> None:
        import torch

        from kvhit.coordinator.packing import HashBatch

        self.engine, self.index, self.inputs = engine, index, inputs
        self.from_ints, self.torch = HashBatch.from_ints, torch
        self.look: list[float] = []
        self.pack: list[float] = []
        self.t_store = 0.0
        self.stored = self.hit_blocks = 0

    def step(self, lo: int, hi: int) -> list[int]:
        perf, torch = time.perf_counter, self.torch
        reqs, tokens = self.inputs.ints[lo:hi], self.inputs.tokens[lo:hi]
        t0 = perf()
        batch = self.from_ints(reqs)
        t1 = perf()
        hits = self.engine.find_longest_cache_hit(
            batch, tokens, self.index, apply_eagle=False
        )
        t2 = perf()
        self.pack.append((t1 - t0) / (hi - lo))
        self.look.append((t2 - t0) / (hi - lo))
        mine = (hits.hit_lengths // PEER_BLOCK_SIZE).tolist()
        self.hit_blocks += sum(mine)
        t0 = perf()
        rows, starts, lengths = batch.host_arrays()
        take = peer_rows_past(starts, lengths, np.array(mine, dtype=np.int64))
        if take.size:
            self.index.add(
                torch.zeros(take.size, dtype=torch.int64),
                torch.from_numpy(rows[take]),
            )
        self.t_store += perf() - t0
        self.stored += int(take.size)
        return mine


class _PeerSteps:
    """The peer's side: one ``find_matches`` per request, its answers checked
    against kvhit's (:class:`~kvhit.bench.harness.MismatchError`), then one
    stored event per request and a wait for the indexer thread to apply them
    (``apply_event`` returns before it does: without the wait that work would
    land in the next step's lookup)."""

    def __init__(self, peer: str, b: int, tree: DynamoIndex, chains) -> None:
        self.peer, self.b, self.tree, self.chains = peer, b, tree, chains
        self.look: list[float] = []
        self.t_store = 0.0

    def step(self, lo: int, hi: int, mine: list[int]) -> None:
        perf, tree, chs = time.perf_counter, self.tree, self.chains[lo:hi]
        t0 = perf()
        theirs = tree.find(chs)
        self.look.append((perf() - t0) / (hi - lo))
        if mine != theirs:
            bad = [i for i in range(hi - lo) if mine[i] != theirs[i]][:5]
            raise MismatchError(
                f"{self.peer} disagrees with kvhit at B={self.b}: "
                + ", ".join(
                    f"request {lo + i}: {self.peer}={theirs[i]} kvhit={mine[i]} blocks"
                    for i in bad
                )
            )
        t0 = perf()
        for ch, m in zip(chs, mine, strict=True):
            if m < len(ch):
                tree.store_after(ch[m - 1] if m else None, ch[m:])
        tree.sync()
        self.t_store += perf() - t0


def _replay(peer: str, b: int, engine: Any, index: Any, tree: DynamoIndex,
            inputs: StepInputs, order: str, bar: Any) -> PeerRow:  # fmt: skip
    """One batch size, one order, on fresh stores: both replays."""
    from kvhit.coordinator.packing import HashBatch

    n = len(inputs.ints)
    # Warm-up, untimed: compiled kernels loaded, both paths exercised once.
    first = next((k for k, r in enumerate(inputs.ints) if r), 0)
    warm = HashBatch.from_ints([inputs.ints[first]])
    engine.find_longest_cache_hit(
        warm, [inputs.tokens[first]], index, apply_eagle=False
    )
    tree.find([inputs.chains[first]])
    steps = [(lo, min(n, lo + b)) for lo in range(0, n, b)]
    kv = _KvhitSteps(engine, index, inputs)
    them = _PeerSteps(peer, b, tree, inputs.chains)
    if order == "alternate":
        for lo, hi in steps:
            them.step(lo, hi, kv.step(lo, hi))
            if bar is not None:
                bar.update(hi - lo)
    else:
        mine_at = []
        for lo, hi in steps:
            mine_at.append(kv.step(lo, hi))
            if bar is not None:
                bar.update((hi - lo) // 2)
        for (lo, hi), mine in zip(steps, mine_at, strict=True):
            them.step(lo, hi, mine)
            if bar is not None:
                bar.update(hi - lo - (hi - lo) // 2)
    steps_len = [hi - lo for lo, hi in steps]
    look, peer_look = np.median(kv.look), np.median(them.look)
    return PeerRow(
        peer=peer,
        batch_size=b,
        requests=n,
        kvhit_lookup_s=float(look),
        kvhit_pack_s=float(np.median(kv.pack)),
        peer_lookup_s=float(peer_look),
        lookup_ratio=float(peer_look / max(look, 1e-12)),
        kvhit_store_bps=kv.stored / max(kv.t_store, 1e-12),
        peer_store_bps=kv.stored / max(them.t_store, 1e-12),
        blocks_stored=kv.stored,
        hit_blocks=kv.hit_blocks,
        kvhit_mean_s=float(np.dot(kv.look, steps_len)) / n,
        peer_mean_s=float(np.dot(them.look, steps_len)) / n,
        order=order,
    )


class _NumbaThreads:
    """numba's thread count set for a block (restored after)."""

    def __init__(self, n: int) -> None:
        self.n, self.old = n, None

    def __enter__(self) -> None:
        import numba

        self.old = numba.get_num_threads()
        numba.set_num_threads(min(self.n, numba.config.NUMBA_NUM_THREADS))

    def __exit__(self, *exc: object) -> None:
        import numba

        numba.set_num_threads(self.old)


def peer_sweep(
    peer: str,
    batch_sizes: Sequence[int],
    limit: int | None = None,
    quiet: bool = True,
    trace: str | os.PathLike[str] | None = None,
    host_load: int = 0,
    order: str | Sequence[str] = PEER_ORDERS,
    ids: str = "raw",
) -> tuple[list[PeerRow], Skip | None]:
    """kvhit against ``peer`` on the conversation trace (or ``trace``).

    For each batch size ``B`` and each order the trace is replayed in steps
    of ``B`` requests on fresh stores (see the module docstring), one numba
    thread, 8-byte keys, one FullAttention group of
    :data:`~kvhit.bench.harness.PEER_BLOCK_SIZE` tokens (one key per trace
    block). ``order``: one of :data:`~kvhit.bench.harness.PEER_ORDERS` or
    several (default both; the rows come order by order, each over every
    ``B``). ``ids``: :data:`PEER_IDS`. ``host_load`` CPU-bound processes spin
    during the run (:func:`~kvhit.bench.peers.busy_host`). Returns the rows,
    or ``([], Skip)`` when the peer cannot be imported; raises
    :class:`~kvhit.bench.harness.MismatchError` on any differing answer.
    """
    from kvhit.bench.traces import SHIPPED_TRACE, load_trace
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.specs import CacheLayout, FullAttention, Group

    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")
    orders = (order,) if isinstance(order, str) else tuple(order)
    if not orders or not set(orders) <= set(PEER_ORDERS):
        raise ValueError(f"order must name some of {PEER_ORDERS}, got {order!r}")
    if ids not in PEER_IDS:
        raise ValueError(f"ids must be one of {PEER_IDS}, got {ids!r}")
    tree_cls, why = load_dynamo()
    if tree_cls is None:
        return [], Skip(peer, why)
    bs = PEER_BLOCK_SIZE
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=bs))],
        scheduler_block_size=bs,
        hash_block_size=bs,
    )
    inputs = step_inputs(load_trace(trace or SHIPPED_TRACE, limit), ids, bs)
    sizes = sorted(set(batch_sizes))
    bar = None
    if not quiet:
        from tqdm import tqdm

        total = len(orders) * len(sizes) * len(inputs.ints)
        bar = tqdm(total=total, desc="  peer", unit="req", leave=False)
    rows = []
    with _NumbaThreads(1), busy_host(host_load):
        engine = LookupEngine(layout, backend="numba", device="cpu")
        for o in orders:
            for b in sizes:
                row = _replay(peer, b, engine, KeyIndex(8, 1 << 20),
                              DynamoIndex(tree_cls), inputs, o, bar)  # fmt: skip
                rows.append(replace(row, host_load=host_load))
    if bar is not None:
        bar.close()
    return rows, None


def format_orders(rows: Sequence[PeerRow]) -> str:
    """The rows of both orders side by side, one line per batch size and host
    load: ``alternate / separate`` for each figure (Markdown)."""
    by = {(r.host_load, r.batch_size, r.order): r for r in rows}
    keys = sorted({(r.host_load, r.batch_size) for r in rows})
    orders = [o for o in ("alternate", "separate") if any(r.order == o for r in rows)]

    def cell(key: tuple[int, int], f: Callable[[PeerRow], str]) -> str:
        return " / ".join(f(by[(*key, o)]) if (*key, o) in by else "-" for o in orders)

    us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    lines = [
        f"| host | B | kvhit us/req incl. packing ({' / '.join(orders)}) | of it "
        "packing | peer us/req | lookup vs peer | kvhit stores M blocks/s | peer "
        "stores M blocks/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in keys:
        host = "quiet" if key[0] == 0 else f"busy{key[0]}"
        lines.append(
            f"| {host} | {key[1]} | {cell(key, lambda r: us(r.kvhit_lookup_s))} | "
            f"{cell(key, lambda r: us(r.kvhit_pack_s))} | "
            f"{cell(key, lambda r: us(r.peer_lookup_s))} | "
            f"{cell(key, lambda r: f'{r.lookup_ratio:.1f}x')} | "
            f"{cell(key, lambda r: f'{r.kvhit_store_bps / 1e6:.2f}')} | "
            f"{cell(key, lambda r: f'{r.peer_store_bps / 1e6:.2f}')} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# from_ints per input form
# ---------------------------------------------------------------------------

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
    repeats: int = 7,
    steps: int = 100,
    impls: dict[str, Callable[[Any], Any]] | None = None,
) -> dict[str, dict[str, float]]:
    """ns per int of ``from_ints`` on steps of ``batch`` requests of ``ints``
    (the first ``steps`` steps), per input form of :data:`FORMS`: the best of
    ``repeats`` passes over the steps. ``impls``: name -> a ``from_ints`` to
    time (default the current one); the implementations are timed in turn
    within each repeat, so a load change hits all alike. Returns
    ``{form: {impl: ns per int}}``."""
    from kvhit.coordinator.packing import HashBatch

    impls = impls or {"from_ints": HashBatch.from_ints}
    chunks = [list(ints[lo : lo + batch]) for lo in range(0, len(ints), batch)]
    chunks = [c for c in chunks if len(c) == batch][:steps] or [list(ints)]
    n = sum(len(r) for c in chunks for r in c)
    out: dict[str, dict[str, float]] = {}
    for name, form in FORMS.items():
        data = [[form(r) for r in c] for c in chunks]
        best = dict.fromkeys(impls, float("inf"))
        for fn in impls.values():
            for c in data[:3]:
                fn(c)
        for _ in range(repeats):
            for tag, fn in impls.items():
                t0 = time.perf_counter()
                for c in data:
                    fn(c)
                best[tag] = min(best[tag], time.perf_counter() - t0)
        out[name] = {tag: t / n * 1e9 for tag, t in best.items()}
    return out


# ---------------------------------------------------------------------------
# Issue 33's targets table
# ---------------------------------------------------------------------------

#: Issue 33's targets: lookup vs Dynamo by batch size, stores in M blocks/s
#: (B = 1, then B >= 64), fleet at B = 64 vs Dynamo, from_ints ns per int.
LOOKUP_TARGETS = {1: 2.0, 64: 8.0, 1024: 10.0}
STORE_TARGETS = {1: 2.0, 64: 10.0, 1024: 10.0}
FLEET_TARGET = 8.0
PACK_TARGET_NS = 40.0


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


def targets(
    trace: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    batch_sizes: Sequence[int] = (1, 64, 1024),
    fleet_engines: Sequence[int] = (8, 64),
    fleet_warm: int = 1024,
    repeats: int = 15,
    baseline_packing: str | None = None,
    quiet: bool = True,
) -> str:
    """Issue 33's targets table on ``trace`` (default: the shipped
    conversation trace), as Markdown: lookup incl. packing vs Dynamo and
    kvhit's stores (:func:`peer_sweep`, raw ids, both orders), the fleet at
    B = 64 vs Dynamo (``bench_fleet.versus_dynamo``, raw ids, both orders; on
    the shipped trace only) and ``from_ints`` ns per int per input form
    (:func:`from_ints_rates`; with ``baseline_packing``, the same beside that
    copy's). Set ``NUMBA_NUM_THREADS=1`` before the process starts."""
    import io

    import torch

    from kvhit.bench.traces import SHIPPED_TRACE, load_trace

    torch.set_num_threads(1)
    rows, skip = peer_sweep(DYNAMO, batch_sizes, limit, quiet, trace)
    out = [
        f"numba threads: {os.environ.get('NUMBA_NUM_THREADS', 'default')}; trace: "
        f"{os.path.basename(str(trace or SHIPPED_TRACE))}"
        + (f", first {limit} requests" if limit else "")
        + "; inputs: raw trace ids as Python lists, lengths as a list; figures "
        "as alternate / separate\n"
    ]
    if skip is not None:
        out.append(f"Dynamo skipped: {skip.reason}\n")
    else:
        by = {(r.batch_size, r.order): r for r in rows}

        def both(b: int, f: Callable[[PeerRow], float], fmt: str) -> str:
            return " / ".join(
                format(f(by[(b, o)]), fmt) for o in ("alternate", "separate")
            )

        out += [
            "| target | " + " | ".join(f"B = {b}" for b in batch_sizes) + " |",
            "|---|" + "---:|" * len(batch_sizes),
            "| lookup incl. packing vs Dynamo (target "
            + ", ".join(f"{LOOKUP_TARGETS.get(b, 0):g}x" for b in batch_sizes)
            + ") | "
            + " | ".join(
                both(b, lambda r: r.lookup_ratio, ".1f") + "x" for b in batch_sizes
            )
            + " |",
            "| kvhit lookup us/request (of it from_ints) | "
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
            + ", ".join(f"{STORE_TARGETS.get(b, 10):g}" for b in batch_sizes)
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
        if trace is None and fleet_engines:
            from kvhit.bench import bench_fleet

            fleet = bench_fleet.versus_dynamo(
                fleet_engines, fleet_warm, 64, repeats, io.StringIO()
            )
            out += [
                f"| fleet_hits at B = 64 vs Dynamo (target {FLEET_TARGET:g}x) | "
                "kvhit us/request | Dynamo us/request | ratio |",
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
    p.add_argument("--trace", default=None, help="a Mooncake-format trace")
    p.add_argument("--limit", type=int, default=None, help="first N requests")
    p.add_argument("--batch-sizes", default="1,64,1024")
    p.add_argument("--fleet-engines", default="8,64", help="'' for none")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--baseline-packing",
        default=None,
        metavar="FILE.py",
        help="another copy of coordinator/packing.py whose from_ints is timed "
        "beside the current one",
    )
    args = p.parse_args(argv)
    sys.stdout.write(
        targets(
            args.trace,
            args.limit,
            [int(b) for b in args.batch_sizes.split(",")],
            [int(e) for e in args.fleet_engines.split(",") if e],
            repeats=args.repeats,
            baseline_packing=args.baseline_packing,
            quiet=False,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
