"""The peer column of ``kvhit bench --peer dynamo``: Dynamo's KV-router indexer
beside kvhit on the shipped conversation trace, answers asserted equal, lookup
time per request and store throughput from one run (:func:`peer_sweep`; the
peer's own wrapper is ``bench/peers.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvhit.bench.names import PEER_BLOCK_SIZE, PEER_ORDERS, MismatchError, Skip
from kvhit.bench.peers import (
    DYNAMO,
    PEERS,
    DynamoIndex,
    as_u64,
    busy_host,
    load_dynamo,
)

__all__ = ["PeerRow", "peer_rows_past", "peer_sweep"]


@dataclass(frozen=True)
class PeerRow:
    """kvhit and a peer on the trace replayed in steps of ``batch_size``.

    Attributes:
        peer: the peer's name (``"dynamo"``).
        batch_size: requests per step (the last step may be shorter).
        requests: requests replayed (each checked: ``mismatches`` is 0, or
            the sweep raised :class:`MismatchError`).
        kvhit_lookup_s: kvhit's seconds per request, the median over the
            steps of a step's time / its requests: ``HashBatch.from_ints``
            from Python int lists plus ``find_longest_cache_hit``.
        kvhit_pack_s: the ``from_ints`` part of it (median likewise).
        peer_lookup_s: the peer's seconds per request (one call each; median
            likewise).
        lookup_ratio: ``peer_lookup_s / kvhit_lookup_s``.
        kvhit_mean_s, peer_mean_s: the means (total time / requests).
        kvhit_store_bps, peer_store_bps: blocks stored per second (each
            request's blocks past its hit, as a worker emits them).
        blocks_stored: blocks each stored over the run.
        hit_blocks: blocks both found (equal by construction of the check).
        host_load: CPU-bound processes spinning beside the run
            (:func:`~kvhit.bench.peers.busy_host`; 0: a quiet host).
        order: ``"separate"`` (each index replayed in a pass of its own) or
            ``"alternate"`` (step by step, side by side); see
            :data:`PEER_ORDERS`.
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


def peer_sweep(
    peer: str,
    batch_sizes: Sequence[int],
    limit: int | None = None,
    quiet: bool = True,
    trace: str | os.PathLike[str] | None = None,
    host_load: int = 0,
    order: str = "separate",
) -> tuple[list[PeerRow], Skip | None]:
    """kvhit against ``peer`` on the conversation trace (or ``trace``).

    For each batch size ``B`` the trace is replayed in order in steps of
    ``B`` requests on a fresh store: each step is looked up against what
    earlier steps stored (kvhit: ``HashBatch.from_ints`` of the requests'
    Python int lists and ``LookupEngine.find_longest_cache_hit``, one numba
    thread, 8-byte keys; the peer: one call per request), the answers are
    compared (:class:`MismatchError` on any difference), then each request's
    blocks past its hit are stored in both (kvhit: one ``KeyIndex.add`` per
    step; the peer: one event per request, then a wait for its thread to apply
    them). Layout: one FullAttention group of :data:`PEER_BLOCK_SIZE` tokens.
    ``order`` (:data:`PEER_ORDERS`): ``"separate"`` replays kvhit, then the
    peer, each in a pass of its own; ``"alternate"`` interleaves them step by
    step. ``host_load`` CPU-bound processes spin during the run
    (:func:`~kvhit.bench.peers.busy_host`). Returns the rows, or
    ``([], Skip)`` when the peer cannot be imported.
    """
    import torch

    from kvhit.bench.traces import SHIPPED_TRACE, hash_block_ids, hash_words, load_trace
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch
    from kvhit.coordinator.specs import CacheLayout, FullAttention, Group

    if peer != DYNAMO:
        raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")
    if order not in PEER_ORDERS:
        raise ValueError(f"order must be one of {PEER_ORDERS}, got {order!r}")
    tree_cls, why = load_dynamo()
    if tree_cls is None:
        return [], Skip(peer, why)
    bs = PEER_BLOCK_SIZE
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=bs))],
        scheduler_block_size=bs,
        hash_block_size=bs,
    )
    requests = load_trace(trace or SHIPPED_TRACE, limit)
    words = [hash_words(*hash_block_ids(r, bs), 1)[:, 0] for r in requests]
    ints = [w.tolist() for w in words]  # what a caller holds: Python ints
    chains = [as_u64(w) for w in words]
    max_lengths = [len(c) * bs for c in ints]
    rows = []
    bar = _peer_bar(len(batch_sizes) * len(requests), quiet)
    with _numba_threads(1), busy_host(host_load):
        engine = LookupEngine(layout, backend="numba", device="cpu")
        for b in sorted(set(batch_sizes)):
            row = _peer_run(
                peer, b, engine, KeyIndex(8, 1 << 20), DynamoIndex(tree_cls),
                ints, chains, max_lengths, HashBatch, torch, bar, order,
            )  # fmt: skip
            rows.append(replace(row, host_load=host_load))
    if bar is not None:
        bar.close()
    return rows, None


def _peer_bar(total: int, quiet: bool) -> Any:
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="  peer", unit="req", leave=False)


class _numba_threads:
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


def _peer_run(peer, b, engine, index, tree, ints, chains, max_lengths, HashBatch,
              torch, bar, order) -> PeerRow:  # fmt: skip
    """One batch size of :func:`peer_sweep`: both replays, in ``order``.

    ``separate`` times each index on its own: the peer's work does not run
    inside kvhit's timed steps or the other way round. (Dynamo's
    ``RadixTree`` hands each call to its indexer thread and blocks until it
    answers; measured here, a kvhit step that starts right after such a call
    ran 2-3x slower than in its own pass, and ~0.2 ms of busy work in between
    undid most of that: the CPU's state after the hand-off, not kvhit's
    work.)
    ``alternate`` interleaves them step by step, each step looked up by kvhit,
    then by the peer, compared, then stored in both: what a host running the
    two side by side sees."""
    n = len(ints)
    # Warm-up, untimed: compiled kernels loaded, both paths exercised once.
    warm = HashBatch.from_ints([ints[0]])
    engine.find_longest_cache_hit(warm, [max_lengths[0]], index, apply_eagle=False)
    tree.find([chains[0]])
    steps = [(lo, min(n, lo + b)) for lo in range(0, n, b)]
    mine_at: list[list[int]] = []
    kv = _KvhitReplay(engine, index, ints, max_lengths, HashBatch, torch)
    them = _PeerReplay(peer, b, tree, chains)
    if order == "alternate":
        for lo, hi in steps:
            mine = kv.step(lo, hi)
            them.step(lo, hi, mine)
            if bar is not None:
                bar.update(hi - lo)
    else:
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


class _KvhitReplay:
    """kvhit's side of :func:`_peer_run`, one step at a time: pack the step's
    Python int lists, look them up, store each request's blocks past its hit
    (a worker's new blocks). Per step, seconds per request: medians resist the
    load spikes of a shared machine better than totals."""

    def __init__(self, engine, index, ints, max_lengths, HashBatch, torch) -> None:
        self.engine, self.index, self.ints = engine, index, ints
        self.max_lengths, self.HashBatch, self.torch = max_lengths, HashBatch, torch
        self.look: list[float] = []
        self.pack: list[float] = []
        self.t_store = 0.0
        self.stored = self.hit_blocks = 0

    def step(self, lo: int, hi: int) -> list[int]:
        perf, torch = time.perf_counter, self.torch
        reqs, mls = self.ints[lo:hi], self.max_lengths[lo:hi]
        t0 = perf()
        batch = self.HashBatch.from_ints(reqs)
        t1 = perf()
        hits = self.engine.find_longest_cache_hit(
            batch, mls, self.index, apply_eagle=False
        )
        t2 = perf()
        self.pack.append((t1 - t0) / (hi - lo))
        self.look.append((t2 - t0) / (hi - lo))
        mine = (hits.hit_lengths // PEER_BLOCK_SIZE).tolist()
        self.hit_blocks += sum(mine)
        t0 = perf()
        rows, offs, lens = batch.host_arrays()
        take = peer_rows_past(offs, lens, np.array(mine, dtype=np.int64))
        if take.size:
            self.index.add(
                torch.zeros(take.size, dtype=torch.int64),
                torch.from_numpy(rows[take]),
            )
        self.t_store += perf() - t0
        self.stored += int(take.size)
        return mine


class _PeerReplay:
    """The peer's side of :func:`_peer_run`: one call per request, its answers
    checked against kvhit's for the same step (:class:`MismatchError`), then
    one stored event per request. Its store time includes the wait for its
    indexer thread to apply the step's events (a lookup of one block after
    them), since ``apply_event`` returns before the event is applied: without
    the wait, that work would land in the next step's lookup."""

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


def peer_rows_past(
    starts: np.ndarray, lengths: np.ndarray, skip: np.ndarray
) -> np.ndarray:
    """Rows ``starts[i] + skip[i] .. starts[i] + lengths[i] - 1`` of every
    request ``i``, concatenated (int64), without a Python loop."""
    counts = np.maximum(lengths - skip, 0)
    total = int(counts.sum())
    first = starts + skip
    # Each run's first row, minus where the run starts in the output.
    base = np.repeat(first - (np.cumsum(counts) - counts), counts)
    return base + np.arange(total, dtype=np.int64)
