"""kvhit beside a peer index the way a router meets them (issue 33).

A router holds each request's block ids as it read them (a Mooncake trace's
``hash_ids``: raw ints from 0, so 0 and 1 in nearly every request) in Python
lists, and the prompt lengths in a list. :func:`peer_sweep` replays the trace
in steps of ``B`` requests on exactly those inputs, kvhit (one
``LookupEngine.find_hit_list`` of the step's lists, then one ``KeyIndex.add``
of the blocks past each hit as a list of ints; ``call=
"batch"``: ``from_ints`` of the step, ``find_longest_cache_hit`` and
``hit_list``, the store reusing the packed rows) and Dynamo's ``RadixTree``
(one ``find_matches`` per request, one stored event per request), every
answer compared, in both orders:

* ``alternate``: step by step, both sides: what a host running both side by
  side sees (each pays for the cache state the other leaves behind). The side
  that goes first switches every step: with raw ids both read the same Python
  lists, and whichever reads a step's lists first pays for bringing them into
  cache;
* ``separate``: kvhit's whole replay, then the peer's, each a pass of its own.

``ids="hashed"`` gives the older inputs instead: every trace id expanded into
a position-dependent 64-bit hash (``bench/traces.py``'s ``hash_words``), which
never holds a 0 or a 1.

Issue 33's targets table (lookup and stores vs Dynamo at B = 1, 64, 1024,
``from_ints`` ns per int per input form, the fleet vs Dynamo at B = 64) is
``bench/peer_targets.py``: ``NUMBA_NUM_THREADS=1 python -m
kvhit.bench.peer_targets``.

This module imports nothing from ``bench/harness.py``, which calls
:func:`peer_sweep` for ``kvhit bench --peer``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import numpy as np

from kvhit.bench.peers import PEERS, DynamoIndex, busy_host, load_dynamo, pinned
from kvhit.bench.traces import TRACE_BLOCK_SIZE

__all__ = [
    "PEER_BLOCK_SIZE",
    "PEER_CALLS",
    "PEER_IDS",
    "PEER_LENGTHS",
    "PEER_ORDERS",
    "PeerMismatchError",
    "PeerRow",
    "PeerSkip",
    "StepInputs",
    "format_orders",
    "peer_sweep",
    "rows_past",
    "step_inputs",
]

#: What the replay feeds both indexes: ``raw`` trace ids (the default: what a
#: router reads) or ``hashed`` (each id expanded into a 64-bit hash).
PEER_IDS = ("raw", "hashed")
#: The replay's layout: one full-attention group whose block is the trace's
#: 512 tokens, so every trace id is one key, as Dynamo sees it.
PEER_BLOCK_SIZE = TRACE_BLOCK_SIZE
#: The orders :func:`peer_sweep` replays in: ``separate`` (kvhit's whole
#: replay, then the peer's, each a pass of its own) or ``alternate`` (step by
#: step, kvhit then the peer).
PEER_ORDERS = ("separate", "alternate")
#: How kvhit is given each step's prompt lengths: a Python ``list`` (a slice
#: of the router's list) or a ``numpy`` int64 array (a slice of the router's
#: array).
PEER_LENGTHS = ("list", "numpy")
#: How kvhit's lookup is called: ``lists`` (``LookupEngine.find_hit_list`` of
#: the router's lists: one call) or ``batch`` (``HashBatch.from_ints``, then
#: ``find_longest_cache_hit``, then ``hit_list``).
PEER_CALLS = ("lists", "batch")


class PeerMismatchError(Exception):
    """The peer's answer differs from kvhit's (the default error of
    :func:`peer_sweep`; ``kvhit bench`` passes its own ``MismatchError``).

    (This module imports nothing from ``bench/harness.py``, which calls it,
    so the bench modules import no circle.)"""


@dataclass(frozen=True)
class PeerSkip:
    """The peer left out of a run, and why (the fields of the harness's
    ``Skip``)."""

    backend: str
    reason: str


@dataclass(frozen=True)
class PeerRow:
    """kvhit and a peer on the trace replayed in steps of ``batch_size``, in
    one order (the fields of the harness's peer rows, which its table and
    JSON read).

    Attributes:
        peer: the peer's name (``"dynamo"``).
        batch_size: requests per step (the last step may be shorter).
        requests: requests replayed (each checked).
        kvhit_lookup_s: kvhit's seconds per request, the median over the
            steps of a step's time / its requests: the answer in blocks as
            Python ints from the step's lists (as the peer's time includes
            its Python ints), by ``find_hit_list``, or by
            ``HashBatch.from_ints`` plus ``find_longest_cache_hit`` plus
            ``hit_list(block_size)`` (``call="batch"``).
        kvhit_pack_s: the ``from_ints`` part of it (median likewise); NaN
            for ``find_hit_list``, which packs inside its one call.
        peer_lookup_s: the peer's seconds per request (median likewise).
        lookup_ratio: ``peer_lookup_s / kvhit_lookup_s``.
        kvhit_store_bps, peer_store_bps: blocks stored per second (each
            request's blocks past its hit, as a worker emits them).
        blocks_stored: blocks each stored over the run.
        hit_blocks: blocks both found.
        kvhit_mean_s, peer_mean_s: the means (total time / requests).
        mismatches: always 0 (a mismatch raises).
        host_load: CPU-bound processes spinning beside the run.
        order: an entry of :data:`PEER_ORDERS`.
    """

    peer: str
    batch_size: int
    requests: int
    kvhit_lookup_s: float
    kvhit_pack_s: float
    peer_lookup_s: float
    lookup_ratio: float
    kvhit_store_bps: float
    peer_store_bps: float
    blocks_stored: int
    hit_blocks: int
    kvhit_mean_s: float = 0.0
    peer_mean_s: float = 0.0
    mismatches: int = 0
    host_load: int = 0
    order: str = "separate"


def rows_past(starts: np.ndarray, lengths: np.ndarray, skip: np.ndarray) -> np.ndarray:
    """Rows ``starts[i] + skip[i] .. starts[i] + lengths[i] - 1`` of every
    request ``i`` (int64 ``[B]`` each), concatenated (int64), without a
    Python loop."""
    counts = np.maximum(lengths - skip, 0)
    first = starts + skip
    # Each run's first row, minus where the run starts in the output.
    base = np.repeat(first - (np.cumsum(counts) - counts), counts)
    return base + np.arange(int(counts.sum()), dtype=np.int64)


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
    """kvhit's side, one step at a time: look the step's lists up (lengths as
    a slice of the router's list or numpy array; ``call``, one of
    :data:`PEER_CALLS`), store each request's blocks past its hit (a worker's
    new blocks) with one ``KeyIndex.add``. Per step, seconds per request:
    medians resist the load spikes of a shared machine."""

    def __init__(
        self,
        engine: Any,
        index: Any,
        inputs: StepInputs,
        lengths: str = "list",
        call: str = "lists",
    ) -> None:
        from kvhit.coordinator.packing import HashBatch

        self.engine, self.index, self.inputs = engine, index, inputs
        self.call = call
        # The lengths as the router holds them: each step passes a slice.
        self.tokens: Any = (
            np.asarray(inputs.tokens, dtype=np.int64)
            if lengths == "numpy"
            else inputs.tokens
        )
        self.from_ints = HashBatch.from_ints
        self.look: list[float] = []
        self.pack: list[float] = []
        self.store: list[float] = []  # seconds per step
        self.stored = self.hit_blocks = 0

    def step(self, lo: int, hi: int) -> list[int]:
        if self.call == "lists":
            return self._lists_step(lo, hi)
        perf = time.perf_counter
        reqs, tokens = self.inputs.ints[lo:hi], self.tokens[lo:hi]
        t0 = perf()
        batch = self.from_ints(reqs)
        t1 = perf()
        hits = self.engine.find_longest_cache_hit(
            batch, tokens, self.index, apply_eagle=False
        )
        # The answer as the router reads it, in blocks as Python ints (timed:
        # Dynamo's find_matches hands back Python ints too).
        mine = hits.hit_list(PEER_BLOCK_SIZE)
        t2 = perf()
        self.pack.append((t1 - t0) / (hi - lo))
        self.look.append((t2 - t0) / (hi - lo))
        self.hit_blocks += sum(mine)
        t0 = perf()
        one = batch.host_single() if hi - lo == 1 else None
        if one is not None:
            # One request: its rows past the hit are one slice (as a router
            # slices its list), not rows_past's gather of a batch.
            new = one[mine[0] :]
        else:
            rows, starts, lengths = batch.host_arrays()
            new = rows[rows_past(starts, lengths, np.array(mine, dtype=np.int64))]
        if new.shape[0]:
            # Every key in group 0 (full attention): one int for the group
            # and the numpy rows in hand, KeyIndex.add's documented fast
            # form; no tensor made per store.
            self.index.add(0, new)
        self.store.append(perf() - t0)
        self.stored += new.shape[0]
        return mine

    def _lists_step(self, lo: int, hi: int) -> list[int]:
        """A step as a router holding lists makes it: one ``find_hit_list``
        (the answer in blocks as Python ints), then the blocks past each hit
        sliced from the lists and stored as a list of ints (their
        conversion charged to the store)."""
        perf = time.perf_counter
        reqs, tokens = self.inputs.ints[lo:hi], self.tokens[lo:hi]
        t0 = perf()
        mine = self.engine.find_hit_list(
            reqs, tokens, self.index, False, PEER_BLOCK_SIZE
        )
        self.look.append((perf() - t0) / (hi - lo))
        self.pack.append(float("nan"))
        self.hit_blocks += sum(mine)
        t0 = perf()
        tails = [r[m:] for r, m in zip(reqs, mine, strict=True) if m < len(r)]
        new = tails[0] if len(tails) == 1 else list(chain.from_iterable(tails))
        if new:
            # The ints as the router holds them: KeyIndex.add's list of int
            # hashes (one group id for all).
            self.index.add(0, new)
        self.store.append(perf() - t0)
        self.stored += len(new)
        return mine


class PeerSteps:
    """The peer's side: :meth:`find`, one ``find_matches`` per request;
    :meth:`check`, its answers against kvhit's (``mismatch`` raised on a
    difference); :meth:`add`, one stored event per request past its answer
    and a wait for the indexer thread to apply them (``apply_event`` returns
    before it does: without the wait that work would land in the next step's
    lookup)."""

    def __init__(self, peer: str, b: int, tree: DynamoIndex, chains,
                 mismatch: type[Exception]) -> None:  # fmt: skip
        self.peer, self.b, self.tree, self.chains = peer, b, tree, chains
        self.mismatch = mismatch
        self.look: list[float] = []
        self.store: list[float] = []  # seconds per step

    def find(self, lo: int, hi: int) -> list[int]:
        """Requests ``lo:hi``' hits in blocks (timed)."""
        t0 = time.perf_counter()
        theirs = self.tree.find(self.chains[lo:hi])
        self.look.append((time.perf_counter() - t0) / (hi - lo))
        return theirs

    def add(self, lo: int, hi: int, hits: list[int]) -> None:
        """Store requests ``lo:hi``' blocks past ``hits`` (timed)."""
        perf, tree = time.perf_counter, self.tree
        t0 = perf()
        for ch, m in zip(self.chains[lo:hi], hits, strict=True):
            if m < len(ch):
                tree.store_after(ch[m - 1] if m else None, ch[m:])
        tree.sync()
        self.store.append(perf() - t0)

    def check(self, lo: int, mine: list[int], theirs: list[int]) -> None:
        """Raise ``mismatch`` naming the first requests (from ``lo``) whose
        hits differ."""
        if mine != theirs:
            bad = [i for i in range(len(mine)) if mine[i] != theirs[i]][:5]
            raise self.mismatch(
                f"{self.peer} disagrees with kvhit at B={self.b}: "
                + ", ".join(
                    f"request {lo + i}: {self.peer}={theirs[i]} kvhit={mine[i]} blocks"
                    for i in bad
                )
            )


def _replay(peer: str, b: int, engine: Any, index: Any, tree: DynamoIndex,
            inputs: StepInputs, order: str, bar: Any, mismatch: type[Exception],
            lengths: str = "list", call: str = "lists",
            ) -> tuple[_KvhitSteps, PeerSteps]:  # fmt: skip
    """One batch size, one order, on fresh stores: both replays, their
    per-step times."""
    from kvhit.coordinator.packing import HashBatch

    n = len(inputs.ints)
    # Warm-up, untimed: compiled kernels loaded, both paths exercised once.
    first = next((k for k, r in enumerate(inputs.ints) if r), 0)
    warm = HashBatch.from_ints([inputs.ints[first]])
    engine.find_longest_cache_hit(
        warm, [inputs.tokens[first]], index, apply_eagle=False
    )
    engine.find_hit_list([inputs.ints[first]], [inputs.tokens[first]], index, False)
    tree.find([inputs.chains[first]])
    steps = [(lo, min(n, lo + b)) for lo in range(0, n, b)]
    kv = _KvhitSteps(engine, index, inputs, lengths, call)
    them = PeerSteps(peer, b, tree, inputs.chains, mismatch)
    if order == "alternate":
        for k, (lo, hi) in enumerate(steps):
            if k % 2 == 0:
                mine = kv.step(lo, hi)
                theirs = them.find(lo, hi)
            else:
                theirs = them.find(lo, hi)
                mine = kv.step(lo, hi)
            # Checked before the peer stores past its answer (a wrong one
            # would name a parent block it does not hold).
            them.check(lo, mine, theirs)
            them.add(lo, hi, theirs)
            if bar is not None:
                bar.update(hi - lo)
    else:
        mine_at = []
        for lo, hi in steps:
            mine_at.append(kv.step(lo, hi))
            if bar is not None:
                bar.update((hi - lo) // 2)
        for (lo, hi), mine in zip(steps, mine_at, strict=True):
            theirs = them.find(lo, hi)
            them.check(lo, mine, theirs)
            them.add(lo, hi, theirs)
            if bar is not None:
                bar.update(hi - lo - (hi - lo) // 2)
    return kv, them


def _row(peer: str, b: int, n: int, order: str,
         runs: Sequence[tuple[_KvhitSteps, PeerSteps]]) -> PeerRow:  # fmt: skip
    """The row of ``runs`` (replays of the same steps on fresh stores): each
    step's best time over the runs (a step takes microseconds, so on a shared
    host the best of a few misses the other processes' time slices), then
    per request the median over the steps (and the mean); stores as blocks
    over the summed best step times."""

    def best(f: Callable[[Any], list[float]], k: int) -> np.ndarray:
        return np.min([f(run[k]) for run in runs], axis=0)

    kv = runs[0][0]
    steps_len = np.array([min(b, n - lo) for lo in range(0, n, b)], dtype=np.float64)
    look = best(lambda r: r.look, 0)
    pack = best(lambda r: r.pack, 0)
    peer_look = best(lambda r: r.look, 1)
    kv_store = float(best(lambda r: r.store, 0).sum())
    peer_store = float(best(lambda r: r.store, 1).sum())
    med, peer_med = float(np.median(look)), float(np.median(peer_look))
    return PeerRow(
        peer=peer,
        batch_size=b,
        requests=n,
        kvhit_lookup_s=med,
        kvhit_pack_s=float(np.median(pack)),
        peer_lookup_s=peer_med,
        lookup_ratio=peer_med / max(med, 1e-12),
        kvhit_store_bps=kv.stored / max(kv_store, 1e-12),
        peer_store_bps=kv.stored / max(peer_store, 1e-12),
        blocks_stored=kv.stored,
        hit_blocks=kv.hit_blocks,
        kvhit_mean_s=float(np.dot(look, steps_len)) / n,
        peer_mean_s=float(np.dot(peer_look, steps_len)) / n,
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
    mismatch: type[Exception] = PeerMismatchError,
    passes: int = 1,
    lengths: str = "list",
    pin: int | None = None,
    call: str = "lists",
) -> tuple[list[PeerRow], PeerSkip | None]:
    """kvhit against ``peer`` on the conversation trace (or ``trace``).

    For each batch size ``B`` and each order the trace is replayed in steps
    of ``B`` requests on fresh stores (see the module docstring), one numba
    thread, 8-byte keys, one FullAttention group of :data:`PEER_BLOCK_SIZE`
    tokens (one key per trace block). ``order``: one of :data:`PEER_ORDERS` or
    several (default both; the rows come order by order, each over every
    ``B``). ``ids``: :data:`PEER_IDS`. ``host_load`` CPU-bound processes spin
    during the run (:func:`~kvhit.bench.peers.busy_host`); ``pin``: every
    thread of the process on that CPU for the run (:func:`~kvhit.bench
    .peers.pinned`; the spinners, started before, are not). Returns the rows,
    or ``([], PeerSkip)`` when the peer cannot be imported; raises
    ``mismatch`` (an exception class taking the message) on any differing
    answer. ``passes``: replays of each (order, ``B``) on fresh stores, each
    step's best time taken (1: the times of one replay). ``lengths``: how
    kvhit is given each step's lengths (:data:`PEER_LENGTHS`: a slice of a
    Python list, or of a numpy int64 array). ``call``: how kvhit's lookup is
    called (:data:`PEER_CALLS`).
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
    if lengths not in PEER_LENGTHS:
        raise ValueError(f"lengths must be one of {PEER_LENGTHS}, got {lengths!r}")
    if call not in PEER_CALLS:
        raise ValueError(f"call must be one of {PEER_CALLS}, got {call!r}")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be an int >= 1, got {passes!r}")
    tree_cls, why = load_dynamo()
    if tree_cls is None:
        return [], PeerSkip(peer, why)
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

        total = passes * len(orders) * len(sizes) * len(inputs.ints)
        bar = tqdm(total=total, desc="  peer", unit="req", leave=False)
    rows = []
    with _NumbaThreads(1), busy_host(host_load), pinned(pin):
        engine = LookupEngine(layout, backend="numba", device="cpu")
        for o in orders:
            for b in sizes:
                runs = [
                    _replay(peer, b, engine, KeyIndex(8, 1 << 20),
                            DynamoIndex(tree_cls), inputs, o, bar, mismatch,
                            lengths, call)
                    for _ in range(passes)
                ]  # fmt: skip
                row = _row(peer, b, len(inputs.ints), o, runs)
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

    # NaN: find_hit_list packs inside its one call.
    us = lambda s: "-" if s != s else f"{s * 1e6:.1f}"  # noqa: E731
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
