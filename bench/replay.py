"""``kvhit replay``: a public request trace replayed against the exact vLLM rules.

A trace (``bench/traces.py``: the Mooncake format, the conversation trace
shipped by default) is replayed in scheduler steps: arrivals fall into
``step_ms`` windows of trace time compressed by ``speedup`` (or fixed steps of
``batch`` requests). Each step:

1. expands every request's trace blocks into the preset's hash blocks
   (:func:`kvhit.bench.traces.hash_block_ids` / ``hash_words``: 8-byte keys,
   prefix-consistent, whole hash blocks of ``input_length`` only);
2. looks the step up with the store worker's exact rule
   (``LookupEngine.lookup`` on a ``KeyIndex``, packing by
   ``HashBatch.from_ints`` included in the timed lookup) and what a
   full-attention-only index (Dynamo's, llm-d's view) would claim on the same
   store: the longest prefix of the full-attention group's keys alone, with
   the last token recomputed as vLLM does;
3. stores what vLLM's saving worker keeps for each served prompt: the
   engine's ``store_masks`` over the whole prompt (keys already present are
   rewritten, which refreshes them) plus Mamba states at scheduler-block
   boundaries (store masks never hold Mamba; the connector saves those states
   separately, as ``bench/workloads.py``'s store does).

With ``store_blocks`` the store keeps at most that many keys, least recently
used first out; a hit refreshes the keys the load reads (``load_masks`` at the
hit). The reference loop (``ReferenceCoordinator.lookup``) answers a sample of
steps against the same store: every answer must agree (``MismatchError``) and
its time per step is reported beside kvhit's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvhit.bench.peers import DYNAMO, PEERS, DynamoIndex, as_u64, load_dynamo
from kvhit.bench.traces import (
    SHIPPED_TRACE,
    TRACE_BLOCK_SIZE,
    TraceRequest,
    hash_block_ids,
    hash_words,
    load_trace,
)
from kvhit.bench.workloads import PRESETS, make_layout

__all__ = [
    "PEERS",
    "REFERENCE_REQUESTS",
    "SHIPPED_TRACE",
    "TRACE_BLOCK_SIZE",
    "ReplayConfig",
    "ReplayResult",
    "StepRecord",
    "format_report",
    "load_trace",
    "plot_replay",
    "replay",
    "steps_of",
]

#: About how many requests the reference loop answers by default (whole
#: steps, spread over the run): it takes ~10-50 ms per long hybrid prompt.
REFERENCE_REQUESTS = 128


@dataclass(frozen=True)
class ReplayConfig:
    """What :func:`replay` runs.

    Attributes:
        trace: a Mooncake-format trace (``.jsonl`` or ``.jsonl.gz``).
        preset: a key of ``bench/workloads.py``'s ``PRESETS``.
        trace_block_size: tokens per trace ``hash_ids`` entry.
        step_ms: window of one scheduler step, in milliseconds of replay time
            (used when ``batch`` is None).
        speedup: trace time runs this many times faster than replay time (a
            window covers ``step_ms * speedup`` ms of the trace).
        batch: fixed steps of this many requests, in trace order (overrides
            ``step_ms``).
        store_blocks: None (unbounded), or the most keys the store keeps (LRU).
        limit: replay only the first ``limit`` requests.
        reference_requests: about how many requests (in whole steps spread
            over the run) the reference loop answers and is timed on.
        peer: None, or ``"dynamo"`` (Dynamo's radix tree beside kvhit).
    """

    trace: Path = SHIPPED_TRACE
    preset: str = "dsv4-flash"
    trace_block_size: int = TRACE_BLOCK_SIZE
    step_ms: float = 100.0
    speedup: float = 1.0
    batch: int | None = None
    store_blocks: int | None = None
    limit: int | None = None
    reference_requests: int = REFERENCE_REQUESTS
    peer: str | None = None

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}"
            )
        for name in ("trace_block_size",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.step_ms > 0 or not self.speedup > 0:
            raise ValueError(
                f"step_ms and speedup must be > 0, got {self.step_ms}, {self.speedup}"
            )
        for name in ("batch", "store_blocks", "limit"):
            v = getattr(self, name)
            if v is not None and v < (0 if name == "limit" else 1):
                raise ValueError(f"{name} must be >= 1 or None, got {v}")
        if self.reference_requests < 0:
            raise ValueError(
                f"reference_requests must be >= 0, got {self.reference_requests}"
            )
        if self.peer not in (None, DYNAMO):
            raise ValueError(f"unknown peer {self.peer!r}; choose from {DYNAMO}")


@dataclass(frozen=True)
class StepRecord:
    """One scheduler step: its trace time, requests, tokens and timings."""

    t_ms: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    claimed_tokens: int
    lookup_s: float
    store_s: float
    stored_keys: int
    reference_s: float | None = None
    peer_lookup_s: float | None = None
    peer_store_s: float | None = None


@dataclass
class ReplayResult:
    """What a replay measured (``to_json`` is the ``--json`` document)."""

    config: ReplayConfig
    steps: list[StepRecord] = field(default_factory=list)
    requests: int = 0
    reference_requests: int = 0
    store_keys: int = 0
    evicted_keys: int = 0
    peer_blocks_stored: int = 0
    kvhit_blocks_stored: int = 0
    peer_skipped: str | None = None
    peer_checked: int = 0
    seconds: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @property
    def hit_tokens(self) -> int:
        return sum(s.hit_tokens for s in self.steps)

    @property
    def claimed_tokens(self) -> int:
        return sum(s.claimed_tokens for s in self.steps)

    def hit_rate(self) -> float:
        """Tokens served from the store / prompt tokens (the exact rule)."""
        return self.hit_tokens / max(1, self.prompt_tokens)

    def claimed_rate(self) -> float:
        """What a full-attention-only index claims, same denominator."""
        return self.claimed_tokens / max(1, self.prompt_tokens)

    def lookup_percentiles(self) -> tuple[float, float]:
        """kvhit's p50 and p99 seconds per step."""
        t = [s.lookup_s for s in self.steps]
        return _p(t, 50), _p(t, 99)

    def reference_percentiles(self) -> tuple[float, float] | None:
        t = [s.reference_s for s in self.steps if s.reference_s is not None]
        return (_p(t, 50), _p(t, 99)) if t else None

    def to_json(self) -> dict[str, Any]:
        from kvhit import __version__

        cfg = asdict(self.config)
        cfg["trace"] = str(self.config.trace)
        p50, p99 = self.lookup_percentiles()
        ref = self.reference_percentiles()
        return {
            "kvhit": __version__,
            "config": cfg,
            "requests": self.requests,
            "steps": len(self.steps),
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "claimed_tokens": self.claimed_tokens,
            "hit_rate": self.hit_rate(),
            "claimed_rate": self.claimed_rate(),
            "lookup_p50_s": p50,
            "lookup_p99_s": p99,
            "reference_p50_s": ref[0] if ref else None,
            "reference_p99_s": ref[1] if ref else None,
            "reference_requests": self.reference_requests,
            "store_keys": self.store_keys,
            "evicted_keys": self.evicted_keys,
            "peer": self.config.peer,
            "peer_skipped": self.peer_skipped,
            "peer_checked": self.peer_checked,
            "seconds": self.seconds,
            "per_step": [asdict(s) for s in self.steps],
        }


def _p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def steps_of(
    requests: Sequence[TraceRequest],
    step_ms: float,
    speedup: float,
    batch: int | None,
) -> list[list[int]]:
    """The requests (indices, trace order) of every non-empty scheduler step:
    fixed groups of ``batch``, or the ``step_ms * speedup`` ms trace windows
    their timestamps fall in."""
    n = len(requests)
    if batch is not None:
        return [list(range(i, min(n, i + batch))) for i in range(0, n, batch)]
    window = step_ms * speedup
    ts = np.array([r.timestamp_ms for r in requests], dtype=np.float64)
    order = np.argsort(ts, kind="stable")
    keys = np.floor(ts[order] / window).astype(np.int64)
    cuts = np.flatnonzero(np.diff(keys)) + 1
    return [part.tolist() for part in np.split(order, cuts) if part.size]


class _Store:
    """The store: a KeyIndex, plus LRU order when bounded."""

    def __init__(self, index: Any, bound: int | None) -> None:
        self.index = index
        self.bound = bound
        self.lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.evicted = 0

    def write(self, gids: np.ndarray, words: np.ndarray) -> tuple[int, list[int]]:
        """Store keys ``(gids [K], words [K, 1])``; returns how many were
        sent and the ``(group, word)`` keys the bound evicted."""
        import torch

        if self.bound is None:
            if gids.size:
                self.index.add(torch.from_numpy(gids), torch.from_numpy(words))
            return int(gids.size), []
        return int(gids.size), self._touch(gids, words, insert=True)

    def refresh(self, gids: np.ndarray, words: np.ndarray) -> None:
        """A hit read these keys: most recently used now (bounded store)."""
        if self.bound is not None and gids.size:
            self._touch(gids, words, insert=False)

    def _touch(self, gids: np.ndarray, words: np.ndarray, insert: bool) -> list:
        import torch

        lru, move = self.lru, self.lru.move_to_end
        new_g, new_w = [], []
        for g, w in zip(gids.tolist(), words[:, 0].tolist(), strict=True):
            key = (g, w)
            if key in lru:
                move(key)
            elif insert:
                lru[key] = None
                new_g.append(g)
                new_w.append(w)
        if new_g:
            self.index.add(
                torch.tensor(new_g, dtype=torch.int64),
                torch.tensor(new_w, dtype=torch.int64).view(-1, 1),
            )
        out = []
        if len(lru) > self.bound:
            drop = [lru.popitem(last=False)[0] for _ in range(len(lru) - self.bound)]
            self.evicted += len(drop)
            self.index.remove(
                torch.tensor([g for g, _ in drop], dtype=torch.int64),
                torch.tensor([w for _, w in drop], dtype=torch.int64).view(-1, 1),
            )
            out = [(g, w) for g, w in drop]
        return out


def _mask_rows(
    masks: Any,
    offsets: np.ndarray,
    scales: Sequence[int],
    cacheable: Sequence[bool],
    last_unit: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(group ids [K], rows [K])`` of every True chunk of per-group bool
    masks ``masks[g] [B, C_g]`` (chunk ``c`` of request ``b`` is keyed by its
    last hash unit, row ``offsets[b] + (c + 1) * scale_g - 1``). With
    ``last_unit`` (int64 ``[B]``), a chunk the hit ends inside (partial hash
    hits) is keyed by the hit's last unit, as the store keys a partial block."""
    gids, rows = [], []
    for g, m in enumerate(masks):
        if not cacheable[g]:
            continue
        b, c = np.nonzero(m.numpy())
        if b.size:
            unit = (c + 1) * scales[g] - 1
            if last_unit is not None:
                unit = np.minimum(unit, last_unit[b])
            rows.append(offsets[b] + unit)
            gids.append(np.full(b.size, g, dtype=np.int64))
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(gids), np.concatenate(rows)


def replay(
    config: ReplayConfig,
    progress: Callable[[int, int], None] | None = None,
    requests: Sequence[TraceRequest] | None = None,
) -> ReplayResult:
    """Replays ``config.trace`` (or ``requests``) and measures it.

    ``progress(done, total)`` is called after each step (requests done).
    Raises ``MismatchError`` (``kvhit.bench.harness``) when kvhit, the
    reference loop or the peer disagree.

    torch runs on one intra-op thread meanwhile (as ``LookupEngine``'s
    ``cpu_threads=1`` default does for its torch backend): the store masks'
    elementwise ops are small, and on a busy machine a parallel region waiting
    for a descheduled thread cost ~100x their work (measured: 320 ms vs 2.7 ms
    for one step's store masks on 2 shared cores).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay(config, progress, requests)
    finally:
        torch.set_num_threads(threads)


def _replay(
    config: ReplayConfig,
    progress: Callable[[int, int], None] | None,
    requests: Sequence[TraceRequest] | None,
) -> ReplayResult:
    import torch

    from kvhit.bench.names import MismatchError
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch
    from kvhit.coordinator.reference import ReferenceCoordinator
    from kvhit.coordinator.specs import FullAttention, Mamba

    t_start = time.perf_counter()
    if requests is None:
        requests = load_trace(config.trace, config.limit, config.trace_block_size)
    elif config.limit is not None:
        requests = requests[: config.limit]
    layout = make_layout(config.preset)
    hbs, sbs = layout.hash_block_size, layout.scheduler_block_size
    engine = LookupEngine(layout, device="cpu")
    ref = ReferenceCoordinator(layout)
    store = _Store(KeyIndex(8, 1 << 16, device="cpu"), config.store_blocks)
    groups = layout.groups
    cacheable = [g.prefix_cacheable for g in groups]
    scales = [layout.coverage_specs[g].block_size // hbs for g in range(len(groups))]
    mamba = [g for g, grp in enumerate(groups) if isinstance(grp.spec, Mamba)]
    full = next(
        (
            g
            for g, grp in enumerate(groups)
            if isinstance(grp.spec, FullAttention) and grp.prefix_cacheable
        ),
        None,
    )
    full_bs = groups[full].spec.block_size if full is not None else 0
    partial_full = [
        g
        for g, grp in enumerate(groups)
        if layout.partial_hash_hits and isinstance(grp.spec, FullAttention)
    ]
    only_full = all(isinstance(g.spec, FullAttention) for g in groups)

    result = ReplayResult(config)
    peer: DynamoIndex | None = None
    if config.peer == DYNAMO:
        tree_cls, why = load_dynamo()
        if tree_cls is None:
            result.peer_skipped = why
        elif full is None:
            result.peer_skipped = f"{config.preset} has no full-attention group"
        elif config.store_blocks is not None:
            # A removed block takes its whole subtree with it in Dynamo's
            # tree; a key-level LRU store cannot be mirrored there.
            result.peer_skipped = (
                "runs on an unbounded store only (Dynamo's tree drops a removed "
                "block's descendants; --store-blocks evicts single keys)"
            )
        else:
            peer = DynamoIndex(tree_cls)

    _warm_up(engine, store.index, layout)
    steps = steps_of(requests, config.step_ms, config.speedup, config.batch)
    # The reference loop answers every ref_every-th step: about
    # reference_requests requests spread over the run.
    ref_every = (
        max(1, len(requests) // config.reference_requests)
        if config.reference_requests
        else 0
    )
    done = 0
    for k, idx in enumerate(steps):
        reqs = [requests[i] for i in idx]
        words = []
        for r in reqs:
            ids, pos = hash_block_ids(r, hbs, config.trace_block_size)
            words.append(hash_words(ids, pos, 1)[:, 0])
        num_tokens = [r.input_length for r in reqs]

        # -- lookup: packing included, as a scheduler would pay it --------
        t0 = time.perf_counter()
        batch = HashBatch.from_ints(words)
        hits = engine.lookup(batch, num_tokens, store.index)
        lookup_s = time.perf_counter() - t0
        hit_list = hits.tolist()
        rows, starts, lengths = batch.host_arrays()

        # -- the full-attention-only view: longest prefix of its keys -----
        claimed, leading = [0] * len(reqs), [0] * len(reqs)
        if full is not None:
            sc = scales[full]
            n_chunks = lengths // sc
            kr = np.concatenate(
                [
                    starts[b] + (np.arange(n_chunks[b]) + 1) * sc - 1
                    for b in range(len(reqs))
                ]
            ).astype(np.int64)
            present = store.index.contains(
                torch.full((kr.size,), full, dtype=torch.int64),
                torch.from_numpy(np.ascontiguousarray(rows[kr])),
            ).numpy()
            pos = 0
            for b, n in enumerate(n_chunks.tolist()):
                run = present[pos : pos + n]
                lead = int(np.argmin(run)) if n and not run.all() else n
                leading[b] = lead
                # vLLM recomputes the last token: a block-aligned cap below it.
                cap = (num_tokens[b] - 1) // full_bs * full_bs if num_tokens[b] else 0
                claimed[b] = min(lead * full_bs, max(cap, 0))
                pos += n

        # -- the peer (Dynamo): the same full-group keys, one call each ----
        peer_lookup_s = peer_store_s = None
        chains: list[list[int]] = []
        if peer is not None:
            sc = scales[full]
            chains = [
                as_u64(rows[starts[b] + sc - 1 : starts[b] + lengths[b] : sc, 0])
                for b in range(len(reqs))
            ]
            t0 = time.perf_counter()
            got = peer.find(chains)
            peer_lookup_s = time.perf_counter() - t0
            result.peer_checked += len(got)
            if got != leading:
                bad = [b for b in range(len(got)) if got[b] != leading[b]][:5]
                raise MismatchError(
                    f"dynamo disagrees with kvhit's full-attention prefix at step "
                    f"{k}: "
                    + ", ".join(
                        f"request {idx[b]}: dynamo={got[b]} kvhit={leading[b]} blocks"
                        for b in bad
                    )
                )

        # -- the reference loop on a sample of steps ----------------------
        ref_s = None
        if ref_every and k % ref_every == 0:
            ref_s = _reference_step(
                ref, layout, store.index, rows, starts, lengths, num_tokens, hit_list,
                idx, k,
            )  # fmt: skip
            result.reference_requests += len(reqs)

        # -- store what the saving worker keeps; a hit refreshes its keys -
        t0 = time.perf_counter()
        aligned = [layout.align(n) for n in num_tokens]
        sm = engine.store_masks(aligned, None, num_tokens)
        gids, krows = _mask_rows(sm.masks, starts, scales, cacheable)
        extra_g, extra_r = [], []
        for b, a in enumerate(aligned):
            for g in mamba:
                units = np.arange(1, a // sbs + 1) * (sbs // hbs) - 1
                if layout.partial_hash_hits and a // hbs:
                    units = np.append(units, a // hbs - 1)
                extra_r.append(starts[b] + units)
                extra_g.append(np.full(units.size, g, dtype=np.int64))
            for g in partial_full:
                if a % groups[g].spec.block_size and a // hbs:
                    extra_r.append(np.array([starts[b] + a // hbs - 1]))
                    extra_g.append(np.array([g], dtype=np.int64))
        if extra_r:
            gids = np.concatenate([gids, *extra_g])
            krows = np.concatenate([krows, *extra_r]).astype(np.int64)
        if store.bound is not None and any(hit_list):
            lm = engine.load_masks(batch, hits)
            last = np.array(hit_list, dtype=np.int64) // hbs - 1
            lg, lr = _mask_rows(lm.masks, starts, scales, cacheable, last)
            store.refresh(lg, rows[lr])
        sent, _ = store.write(gids, np.ascontiguousarray(rows[krows]))
        store_s = time.perf_counter() - t0
        result.kvhit_blocks_stored += sent
        if peer is not None:
            t0 = time.perf_counter()
            result.peer_blocks_stored += peer.store(chains)
            peer_store_s = time.perf_counter() - t0

        result.steps.append(
            StepRecord(
                t_ms=reqs[0].timestamp_ms,
                requests=len(reqs),
                prompt_tokens=sum(num_tokens),
                hit_tokens=sum(hit_list),
                claimed_tokens=sum(claimed),
                lookup_s=lookup_s,
                store_s=store_s,
                stored_keys=sent,
                reference_s=ref_s,
                peer_lookup_s=peer_lookup_s,
                peer_store_s=peer_store_s,
            )
        )
        done += len(reqs)
        if progress is not None:
            progress(done, len(requests))
    result.requests = done
    result.store_keys = len(store.index) if hasattr(store.index, "__len__") else 0
    result.evicted_keys = store.evicted
    result.seconds = time.perf_counter() - t_start
    if only_full and result.claimed_tokens != result.hit_tokens:
        raise MismatchError(
            f"{config.preset} is full attention only, yet the full-attention "
            f"claim ({result.claimed_tokens} tokens) differs from the exact hit "
            f"({result.hit_tokens})"
        )
    return result


def _warm_up(engine: Any, index: Any, layout: Any) -> None:
    """One untimed call of everything a step times (kernels are compiled or
    loaded from numba's disk cache on first use), then the index emptied."""
    import torch

    from kvhit.coordinator.packing import HashBatch

    n = layout.alignment * 4
    batch = HashBatch.from_ints([list(range(1, n // layout.hash_block_size + 1))])
    engine.lookup(batch, [n], index)
    gids = torch.zeros(1, dtype=torch.int64)
    index.add(gids, batch.hashes[:1])
    index.contains(gids, batch.hashes[:1])
    index.remove(gids, batch.hashes[:1])
    engine.store_masks([n], None, [n])
    engine.load_masks(batch, [n])


def _reference_step(
    ref: Any,
    layout: Any,
    index: Any,
    rows: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    num_tokens: list[int],
    hits: list[int],
    idx: list[int],
    step: int,
) -> float:
    """``ReferenceCoordinator.lookup`` over one step's requests: checked
    against ``hits``, returns its seconds. The store is handed over as the
    set of the keys the worker asks about that the index holds (one batched
    ``contains``, not timed), so the loop's time is its own."""
    import torch

    from kvhit.bench.names import MismatchError

    total = 0.0
    for b in range(len(num_tokens)):
        lo = int(starts[b])
        mine = rows[lo : lo + int(lengths[b])]
        hashes = [mine[j].tobytes() for j in range(mine.shape[0])]
        cands = ref.lookup_candidates(num_tokens[b], hashes)
        exists: set[tuple[int, bytes]] = set()
        if cands:
            g = torch.tensor([c[0] for c in cands], dtype=torch.int64)
            w = torch.from_numpy(
                np.frombuffer(b"".join(c[1] for c in cands), dtype="<i8")
                .astype(np.int64)
                .reshape(-1, 1)
            )
            found = index.contains(g, w).tolist()
            exists = {c for c, f in zip(cands, found, strict=True) if f}
        t0 = time.perf_counter()
        want = ref.lookup(num_tokens[b], hashes, exists)
        total += time.perf_counter() - t0
        if want != hits[b]:
            raise MismatchError(
                f"step {step}, request {idx[b]} (num_tokens={num_tokens[b]}): "
                f"kvhit={hits[b]} reference={want}"
            )
    return total


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------


def format_report(result: ReplayResult) -> str:
    """The replay as text: hit rates, the claim, timings."""
    from kvhit.bench.report import fmt_count, fmt_time

    cfg = result.config
    p50, p99 = result.lookup_percentiles()
    ref = result.reference_percentiles()
    mode = (
        f"steps of {cfg.batch} requests"
        if cfg.batch
        else f"{cfg.step_ms:g} ms windows x speedup {cfg.speedup:g}"
    )
    rows = [
        ("trace", f"{cfg.trace}  ({result.requests} requests, {mode}, "
                  f"{len(result.steps)} steps)"),
        ("preset", f"{cfg.preset}  ({PRESETS[cfg.preset].description})"),
        ("store", "unbounded" if cfg.store_blocks is None else
                  f"{fmt_count(cfg.store_blocks)} keys, LRU "
                  f"({fmt_count(result.evicted_keys)} evicted)"),
        ("hit rate (exact)", f"{result.hit_rate():.2%}  ({fmt_count(result.hit_tokens)}"
                             f" of {fmt_count(result.prompt_tokens)} prompt tokens)"),
        ("full-attention claim", f"{result.claimed_rate():.2%}  (longest prefix of "
                                 "the full-attention keys alone: Dynamo's / llm-d's view)"),
        ("lookup per step", f"p50 {fmt_time(p50)}  p99 {fmt_time(p99)}  "
                            "(kvhit, from_ints packing included)"),
    ]  # fmt: skip
    if ref is not None:
        rows.append(
            (
                "reference loop",
                f"p50 {fmt_time(ref[0])}  p99 {fmt_time(ref[1])}  "
                f"({result.reference_requests} requests checked, all equal)",
            )
        )
    if cfg.peer is not None:
        if result.peer_skipped:
            rows.append((f"peer {cfg.peer}", f"skipped: {result.peer_skipped}"))
        else:
            rows += _peer_rows(result)
    rows.append(("total time", f"{result.seconds:.1f} s"))
    from kvhit import __version__
    from kvhit.bench.report import format_rows

    return format_rows(f"kvhit {__version__} replay", rows)


def _peer_rows(result: ReplayResult) -> list[tuple[str, str]]:
    from kvhit.bench.report import fmt_count, fmt_time

    steps = result.steps
    n = max(1, result.requests)
    k_look = sum(s.lookup_s for s in steps) / n
    p_look = sum(s.peer_lookup_s or 0.0 for s in steps) / n
    k_store = sum(s.store_s for s in steps)
    p_store = sum(s.peer_store_s or 0.0 for s in steps)
    return [
        ("peer dynamo", f"{result.peer_checked} requests: same leading full-attention "
                        "blocks as kvhit on every one"),
        ("lookup per request", f"kvhit {fmt_time(k_look)}  dynamo {fmt_time(p_look)}"
                               f"  ({p_look / max(k_look, 1e-12):.1f}x)"),
        ("store", f"kvhit {fmt_count(result.kvhit_blocks_stored / max(k_store, 1e-12))}"
                  f" keys/s (store masks + index)  dynamo "
                  f"{fmt_count(result.peer_blocks_stored / max(p_store, 1e-12))} blocks/s"),
    ]  # fmt: skip


def plot_replay(result: ReplayResult, path: str | Path) -> None:
    """Hit rate over trace time (exact vs the full-attention claim) and step
    latency, as a PNG (needs matplotlib, the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result.steps
    t = np.array([s.t_ms for s in steps], dtype=np.float64) / 1000.0
    prompt = np.cumsum([s.prompt_tokens for s in steps])
    hit = np.cumsum([s.hit_tokens for s in steps]) / np.maximum(prompt, 1)
    claim = np.cumsum([s.claimed_tokens for s in steps]) / np.maximum(prompt, 1)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(t, claim, label="full-attention-only claim")
    a1.plot(t, hit, label="exact (vLLM rules)")
    a1.set_xlabel("trace time (s)")
    a1.set_ylabel("cumulative hit rate (tokens)")
    a1.set_title(result.config.preset)
    a1.legend()
    a1.grid(True, alpha=0.3)
    a2.plot(t, [s.lookup_s * 1e6 for s in steps], ".", ms=2, label="kvhit")
    ref = [(ti, s.reference_s) for ti, s in zip(t, steps, strict=True) if s.reference_s]
    if ref:
        xs, ys = zip(*ref, strict=True)
        a2.plot(xs, [y * 1e6 for y in ys], "x", ms=4, label="reference loop")
    a2.set_yscale("log")
    a2.set_xlabel("trace time (s)")
    a2.set_ylabel("lookup per step (us)")
    a2.legend()
    a2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
