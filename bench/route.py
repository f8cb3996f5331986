"""``kvhit route``: replay a request trace across E simulated engines under
several routers and score every placement under vLLM's exact hit rules.

Each simulated engine is a vLLM instance with its own external store (one
column of a :class:`~kvhit.coordinator.fleet_index.FleetIndex`). Requests arrive in
trace order, ``batch`` at a time; a router places each on one engine; the
request then loads what the store worker's ``lookup`` finds on that engine
(``LookupEngine.fleet_lookup``, exact for every kind), and once served the
engine saves the request's keys (what the saving worker writes: each group's
store mask at the aligned prompt length, plus Mamba states at scheduler-block
boundaries and, with partial hash hits, at the aligned end, as
``bench/workloads.py`` models the connector). Stores are never evicted.

Routers (all see the engines' loads; only what they score differs):

* ``round-robin``: request ``i`` goes to engine ``i % E``.
* ``kvhit``: :func:`kvhit.route` on the exact hits of every engine.
* ``full-attention-only``: :func:`kvhit.route` on what a router that indexes
  full-attention blocks only believes (Dynamo's KV router on hybrid models,
  llm-d without SWA/Mamba): the leading run of the first full-attention
  SpecGroup's blocks each engine holds (:func:`prefix_blocks`).

Loads: an engine's decode load is the blocks (``(input + output tokens) /
scheduler block``) of its requests still in flight at the batch's arrival
time, a request being in flight for ``output_length * tpot_ms`` after it
arrives. The reported hit rate is hit tokens over prompt tokens, under the
exact rules, whatever the router believed.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tabulate import tabulate

from kvhit.bench.names import ROUTE_LIMIT, ROUTERS, MismatchError
from kvhit.bench.traces import (
    SHIPPED_TRACE,
    TraceRequest,
    hash_block_ids,
    hash_words,
    load_trace,
)
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.fleet_index import FleetIndex
from kvhit.coordinator.packing import HashBatch, num_words
from kvhit.coordinator.routing import prefix_blocks, route
from kvhit.coordinator.specs import CacheLayout, FullAttention, Mamba

__all__ = [
    "ROUTERS",
    "RouteConfig",
    "RouterResult",
    "format_table",
    "plot",
    "replay",
    "saved_keys",
    "to_json",
    "trace_batch",
]


@dataclass(frozen=True)
class RouteConfig:
    """One replay: ``preset`` (a ``bench/workloads.py`` preset name), ``engines``
    simulated engines, the first ``limit`` trace requests routed ``batch`` at
    a time, decode time per output token ``tpot_ms``, the router's prefill
    weight ``overlap_weight``; every ``check_every``-th batch's hits are
    checked against a per-engine ``LookupEngine.lookup`` (0: never)."""

    preset: str = "dsv4-flash"
    engines: int = 8
    limit: int = ROUTE_LIMIT
    batch: int = 8
    routers: tuple[str, ...] = ROUTERS
    tpot_ms: float = 20.0
    overlap_weight: float = 1.0
    hash_bytes: int = 8
    check_every: int = 50
    trace: Path = SHIPPED_TRACE


@dataclass
class RouterResult:
    """What one router achieved over the replay (tokens summed over requests)."""

    router: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    believed_tokens: int = 0
    best_tokens: int = 0
    short_picks: int = 0
    per_engine: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens (exact rules)."""
        return self.hit_tokens / max(self.prompt_tokens, 1)

    @property
    def believed_rate(self) -> float:
        """What the router's own score promised, over prompt tokens."""
        return self.believed_tokens / max(self.prompt_tokens, 1)

    @property
    def best_rate(self) -> float:
        """The hit rate had every request gone to its longest exact hit
        (under this router's placement history)."""
        return self.best_tokens / max(self.prompt_tokens, 1)

    @property
    def short_pick_rate(self) -> float:
        """Requests placed on an engine with a shorter exact hit than another
        engine offered."""
        return self.short_picks / max(self.requests, 1)

    @property
    def imbalance(self) -> float:
        """Most requests on one engine over the mean."""
        n = np.asarray(self.per_engine, dtype=np.float64)
        return float(n.max() / max(n.mean(), 1e-9)) if n.size else 0.0


def trace_batch(
    requests: Sequence[Any], layout: CacheLayout, hash_bytes: int = 8
) -> tuple[HashBatch, np.ndarray]:
    """Trace requests as a HashBatch of ``layout.hash_block_size`` blocks
    (``bench/traces.py``'s prefix-consistent expansion) and their prompt
    lengths (int64 ``[B]``)."""
    W = num_words(hash_bytes)
    words, lens = [], []
    for req in requests:
        ids, pos = hash_block_ids(req, layout.hash_block_size)
        w = hash_words(ids, pos, W)
        if hash_bytes % 8:
            w = w.copy()
            w[:, -1] &= (1 << (8 * (hash_bytes % 8))) - 1
        words.append(w)
        lens.append(len(w))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.concatenate(words) if words else np.zeros((0, W), dtype=np.int64)
    batch = HashBatch(torch.from_numpy(flat), torch.from_numpy(offsets), hash_bytes)
    tokens = np.array([r.input_length for r in requests], dtype=np.int64)
    return batch, tokens


def saved_keys(
    engine: LookupEngine, batch: HashBatch, num_tokens: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys the saving worker writes for each served prompt of ``batch``
    (``num_tokens`` int64 ``[B]``): ``(group_ids int64 [K], rows int64 [K])``,
    ``rows`` indexing ``batch.hashes``. Mirrors ``bench/workloads.py``'s
    store model: each group's store mask at the aligned prompt length (chunk
    ``c`` keyed by its last hash unit), Mamba states at scheduler-block
    boundaries (and the aligned end with partial hash hits), and the partial
    last full-attention block with partial hash hits."""
    layout = engine.layout
    hbs = layout.hash_block_size
    sbs = layout.scheduler_block_size
    n = np.asarray(num_tokens, dtype=np.int64)
    aligned = n // layout.alignment * layout.alignment
    offs = batch.offsets[:-1].cpu().numpy()
    masks = engine.store_masks(aligned.tolist(), num_prompt_tokens=n.tolist())
    gids: list[np.ndarray] = []
    rows: list[np.ndarray] = []

    def put(g: int, req: np.ndarray, unit: np.ndarray) -> None:
        gids.append(np.full(len(req), g, dtype=np.int64))
        rows.append(offs[req] + unit)

    for g, group in enumerate(layout.groups):
        if not group.prefix_cacheable:
            continue
        bs = group.spec.block_size
        if isinstance(group.spec, Mamba):
            for r in np.flatnonzero(aligned >= sbs):
                k = np.arange(1, aligned[r] // sbs + 1)
                put(g, np.full(len(k), r), k * sbs // hbs - 1)
            if layout.partial_hash_hits:
                r = np.flatnonzero(aligned > 0)
                put(g, r, aligned[r] // hbs - 1)
            continue
        req, chunk = np.nonzero(masks.masks[g].cpu().numpy())
        put(g, req, (chunk + 1) * (bs // hbs) - 1)
        if layout.partial_hash_hits and isinstance(group.spec, FullAttention):
            r = np.flatnonzero((aligned % bs != 0) & (aligned > 0))
            put(g, r, aligned[r] // hbs - 1)
    if not gids:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    return torch.from_numpy(np.concatenate(gids)), torch.from_numpy(
        np.concatenate(rows)
    )


def _full_attention_group(layout: CacheLayout) -> tuple[tuple[int, ...], int]:
    sg = layout.spec_groups[0]
    if sg.kind != "full":
        raise ValueError("the layout has no full-attention SpecGroup")
    return sg.group_ids, sg.block_size


def _check(engine, batch, tokens, fleet, hits) -> None:
    for e in range(fleet.num_engines):
        single = engine.lookup(batch, tokens, fleet.key_index(e))
        if not torch.equal(single, hits[:, e]):
            raise MismatchError(f"engine {e}: fleet_lookup {hits[:, e].tolist()} "
                                f"!= lookup {single.tolist()}")  # fmt: skip


def replay(
    config: RouteConfig,
    progress: Callable[[str, int, int], None] | None = None,
    requests: Sequence[TraceRequest] | None = None,
) -> list[RouterResult]:
    """Run the replay once per router of ``config.routers``; see the module
    docstring. ``requests``: the trace already read (default: the first
    ``config.limit`` requests of ``config.trace``); ``progress(router, done,
    total)`` is called after each batch. Raises MismatchError when a checked
    batch's fleet hits differ from per-engine lookups."""
    for r in config.routers:
        if r not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {r!r}")
    layout = make_layout(config.preset)
    engine = LookupEngine(layout)
    if requests is None:
        requests = load_trace(config.trace, limit=config.limit)
    sbs = layout.scheduler_block_size
    fa_groups, fa_bs = _full_attention_group(layout)
    fa_scale = fa_bs // layout.hash_block_size
    E = config.engines
    results = []
    for name in config.routers:
        fleet = FleetIndex(E, config.hash_bytes, capacity=1 << 16)
        res = RouterResult(name, per_engine=[0] * E)
        in_flight: list[list[tuple[float, float]]] = [[] for _ in range(E)]
        load = np.zeros(E, dtype=np.float64)
        start = time.perf_counter()
        for k, lo in enumerate(range(0, len(requests), config.batch)):
            chunk = requests[lo : lo + config.batch]
            batch, tokens = trace_batch(chunk, layout, config.hash_bytes)
            now = float(chunk[0].timestamp_ms)
            for e in range(E):
                while in_flight[e] and in_flight[e][0][0] <= now:
                    load[e] -= heapq.heappop(in_flight[e])[1]
            hits = engine.fleet_lookup(batch, tokens, fleet)
            if config.check_every and k % config.check_every == config.check_every - 1:
                _check(engine, batch, tokens, fleet, hits)
            if name == "round-robin":
                chosen = (np.arange(lo, lo + len(chunk)) % E).astype(np.int64)
                believed = np.zeros(len(chunk), dtype=np.int64)
            else:
                if name == "kvhit":
                    score = hits
                else:
                    runs = prefix_blocks(batch, fleet, fa_groups, fa_scale,
                                         torch.from_numpy(tokens // fa_bs))  # fmt: skip
                    score = runs * fa_bs
                chosen = route(score, loads=load, prompt_tokens=tokens,
                               block_size=sbs, overlap_weight=config.overlap_weight,
                               update_loads=True).numpy()  # fmt: skip
                believed = score.numpy()[np.arange(len(chunk)), chosen]
            got = hits.numpy()[np.arange(len(chunk)), chosen]
            best = hits.numpy().max(axis=1)
            res.best_tokens += int(best.sum())
            res.short_picks += int((got < best).sum())
            res.requests += len(chunk)
            res.prompt_tokens += int(tokens.sum())
            res.hit_tokens += int(got.sum())
            res.believed_tokens += int(believed.sum())
            for b, e in enumerate(chosen.tolist()):
                res.per_engine[e] += 1
                blocks = (chunk[b].input_length + chunk[b].output_length) / sbs
                end = now + chunk[b].output_length * config.tpot_ms
                heapq.heappush(in_flight[e], (end, blocks))
                load[e] += blocks
            g, rows = saved_keys(engine, batch, tokens)
            if g.numel():
                owner = torch.from_numpy(chosen)[_request_of(batch, rows)]
                fleet.add(owner, g, batch.hashes[rows])
            if progress is not None:
                progress(name, res.requests, len(requests))
        res.seconds = time.perf_counter() - start
        results.append(res)
    return results


def _request_of(batch: HashBatch, rows: torch.Tensor) -> torch.Tensor:
    """The request owning each hash row."""
    return torch.searchsorted(batch.offsets[1:], rows, right=True)


def format_table(results: Sequence[RouterResult], config: RouteConfig) -> str:
    """A Markdown table of ``results`` under a line naming the setting."""
    rows = [
        (
            r.router,
            f"{r.hit_rate:.1%}",
            "-" if r.router == "round-robin" else f"{r.believed_rate:.1%}",
            f"{r.short_pick_rate:.1%}",
            f"{r.imbalance:.2f}",
        )
        for r in results
    ]
    headers = (
        "router",
        "hit rate (exact rules)",
        "router's own estimate",
        "placed on a shorter hit than offered",
        "busiest engine / mean",
    )
    n = results[0].requests if results else 0
    title = (
        f"{config.preset}, E = {config.engines}, {n} trace requests, batch "
        f"{config.batch}, --tpot-ms {config.tpot_ms:g}, overlap weight "
        f"{config.overlap_weight:g}"
    )
    table = tabulate(
        rows,
        headers,
        tablefmt="github",
        colalign=("left", *["right"] * 4),
        disable_numparse=True,  # the cells are formatted already: keep "1.00"
    )
    return f"{title}\n\n{table}"


def to_json(results: Sequence[RouterResult], config: RouteConfig) -> dict[str, Any]:
    """``kvhit route --json``: the setting and one object per router, with
    the counts and the rates derived from them."""
    setting = {
        k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()
    }
    rows = []
    for r in results:
        row = asdict(r)
        for rate in ("hit_rate", "believed_rate", "best_rate", "short_pick_rate"):
            row[rate] = getattr(r, rate)
        row["imbalance"] = r.imbalance
        rows.append(row)
    return {"config": setting, "routers": rows}


def plot(
    results: Sequence[RouterResult], config: RouteConfig, path: str | os.PathLike[str]
) -> None:
    """``kvhit route --plot``: the exact hit rate and the router's own
    estimate per router, as bars (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.router for r in results]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(x - 0.2, [100 * r.hit_rate for r in results], 0.4, label="exact hit rate")
    believed = [
        0.0 if r.router == "round-robin" else 100 * r.believed_rate for r in results
    ]
    ax.bar(x + 0.2, believed, 0.4, label="router's own estimate")
    ax.set_xticks(x, names)
    ax.set_ylabel("% of prompt tokens")
    ax.set_title(f"{config.preset}, E = {config.engines}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
