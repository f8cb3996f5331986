"""Where the numba lookup's time goes: probes per request against the fewest
the rule needs, cache lines per probe, and the engine's fixed cost per call.

``python -m kvhit.bench.probe_count [--preset dsv4-longhit] [--requests N]``
prints one table. The probe counts come from the instrumented twin of the
compiled lookup (``kvhit.kernels.scan_numba.count_probes``: the same kernel,
counting every table probe, its slots and the 64-byte lines it reads); the
floor is computed from each request's answer (:func:`probe_floor`).

The compute / memory split (:func:`kernel_split`): the kernel's thread time
per request on the batch (cold: its lines come from memory) against the
same requests each asked ``k`` times in a row (every ask after the first
finds its lines in cache): the warm time is the compute floor, the rest is
waiting on memory.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvhit.bench.workloads import TrafficConfig, Workload, generate
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.packing import RaggedView
from kvhit.coordinator.plan import plan_tensors
from kvhit.coordinator.specs import FullAttention, SlidingWindow
from kvhit.kernels.masks import sliding_window_need


@dataclass(frozen=True)
class ProbeTable:
    """Per-request means over a batch (see :func:`measure`)."""

    requests: int
    probes: float
    probes_by_group: tuple[float, ...]
    floor_by_group: tuple[float, ...]
    hits: float
    misses: float
    floor: float
    slots_per_probe: float
    lines_per_probe: float
    fixed_call_us: float
    cold_us: float
    warm_us: float


def probe_floor(workload: Workload, hits: list[int]) -> list[int]:
    """Per request, the fewest table probes that prove its answer (the sum
    of :func:`probe_floor_by_group`, plus one miss that stops a hit short of
    the aligned prompt)."""
    layout = workload.layout
    return [
        sum(groups) + (h < layout.align(n))
        for groups, h, n in zip(
            probe_floor_by_group(workload, hits), hits, workload.num_tokens, strict=True
        )
    ]


def probe_floor_by_group(workload: Workload, hits: list[int]) -> list[list[int]]:
    """Per request, the fewest table probes that prove its answer ``hits[i]``
    (tokens), as the issue's model counts them: full attention confirms every
    block below the hit, each member of a merged SpecGroup once per block; a
    sliding window only its window (``need`` blocks, EAGLE included) next to
    the hit, per member; and, when the hit is short of the aligned prompt,
    one miss that stops it (counted by :func:`probe_floor`). Mamba and
    chunked local groups count 1. Per request, one count per SpecGroup."""
    layout = workload.layout
    out = []
    for h in hits:
        row = []
        for sg in layout.spec_groups:
            total = 0
            members = len(sg.group_ids)
            spec = sg.spec
            blocks = h // spec.block_size
            if isinstance(spec, FullAttention):
                total += blocks * members
            elif isinstance(spec, SlidingWindow):
                need = sliding_window_need(
                    spec.sliding_window, spec.block_size, sg.use_eagle
                )
                total += min(need, blocks) * members
            elif h:
                total += members
            row.append(total)
        out.append(row)
    return out


def kernel_split(
    view: RaggedView,
    num_tokens: np.ndarray,
    lookup: Callable[[np.ndarray, np.ndarray, np.ndarray], object],
    k: int = 4,
    repeats: int = 5,
) -> tuple[float, float]:
    """``(cold, warm)`` microseconds of kernel thread time per request.

    ``lookup(offsets, lengths, num_tokens)`` (int64 ``[R']`` each) runs the
    compiled lookup over ``view``'s rows; cold is its time on the batch
    (``view``'s offsets and lengths, ``num_tokens`` int64 ``[R]``), warm the
    cost of a request asked again right after itself: every request
    repeated ``k`` times in a row, ``(T_k - T_1) / ((k - 1) * R)``. Medians
    of ``repeats`` alternating calls, each after the other's traffic."""
    offs, lens = view.offsets.numpy(), view.lengths.numpy()
    rep = (np.repeat(offs, k), np.repeat(lens, k), np.repeat(num_tokens, k))
    one, many = [], []
    for _ in range(repeats):
        t0 = time.thread_time()
        lookup(offs, lens, num_tokens)
        t1 = time.thread_time()
        lookup(*rep)
        t2 = time.thread_time()
        one.append(t1 - t0)
        many.append(t2 - t1)
    n = max(1, len(offs))
    t_one, t_many = float(np.median(one)), float(np.median(many))
    warm = max(0.0, t_many - t_one) / ((k - 1) * n)
    return t_one / n * 1e6, warm * 1e6


@contextlib.contextmanager
def same_prefetch(n_requests: int, table: np.ndarray) -> Iterator[bool]:
    """While inside, the numba scans prefetch (or not) on every call as they
    would for a batch of ``n_requests`` on ``table``; yields that choice.
    :func:`kernel_split`'s warm call asks ``k`` times as many requests, which
    from 32 requests on would cross ``PREFETCH_MIN_REQUESTS`` (128) and time
    the prefetching scan against the plain one."""
    from kvhit.kernels import scan_numba as sn

    saved = sn.PREFETCH_MIN_REQUESTS, sn.PREFETCH_MIN_TABLE_BYTES
    on = sn.prefetching(n_requests, table)
    sn.PREFETCH_MIN_REQUESTS = 0 if on else 1 << 62
    sn.PREFETCH_MIN_TABLE_BYTES = 0 if on else 1 << 62
    try:
        yield on
    finally:
        sn.PREFETCH_MIN_REQUESTS, sn.PREFETCH_MIN_TABLE_BYTES = saved


def measure(workload: Workload, repeats: int = 20) -> ProbeTable:
    """Probe counts of ``workload``'s batch through the instrumented kernel
    (parity-checked against the engine), and the engine's fixed cost: the
    median ``LookupEngine.lookup`` of one request of no hashes."""
    from kvhit.kernels.probe_numba import (
        C_HITS,
        C_LINES,
        C_PROBES,
        C_SLOTS,
        COUNT_COLS,
    )
    from kvhit.kernels.scan_numba import count_probes, lookup_hits

    engine = LookupEngine(workload.layout, backend="numba")
    index = workload.key_index("cpu")
    batch = workload.hash_batch("cpu")
    num_tokens = workload.num_tokens_tensor()
    want = engine.lookup(batch, num_tokens, index).tolist()
    plan = engine.plan
    sg_rows, cand_rows = plan_tensors(plan, torch.device("cpu"))
    view = batch.view()
    hit, counts = count_probes(
        view.rows.numpy(), view.offsets.numpy(), view.lengths.numpy(),
        num_tokens.numpy(), sg_rows.numpy(), cand_rows.numpy(),
        table=index.table.numpy(), params=plan.params,
    )  # fmt: skip
    if hit.tolist() != want:
        raise AssertionError("count_probes disagrees with the engine")
    kw = dict(table=index.table.numpy(), params=plan.params, parallel=False)
    rows, sg_np, cand_np = view.rows.numpy(), sg_rows.numpy(), cand_rows.numpy()
    with same_prefetch(len(workload), kw["table"]):
        cold, warm = kernel_split(
            view, num_tokens.numpy(),
            lambda o, n, t: lookup_hits(rows, o, n, t, sg_np, cand_np, **kw),
        )  # fmt: skip
    floor = probe_floor(workload, want)
    # Sums over n, not means: an empty batch has no rows to take a mean of
    # (and a [0] array would lose the SpecGroup axis).
    n_sg = len(workload.layout.spec_groups)
    by_group = np.asarray(probe_floor_by_group(workload, want), dtype=float)
    by_group = by_group.reshape(len(workload), n_sg)
    probes = counts[:, C_PROBES].sum()
    hits = counts[:, C_HITS].sum()
    n = max(1, len(workload))
    empty = type(batch).from_bytes([[]], workload.hash_bytes, "cpu")
    zero = torch.zeros(1, dtype=torch.int64)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.lookup(empty, zero, index)
        times.append(time.perf_counter() - t0)
    return ProbeTable(
        requests=len(workload),
        probes=probes / n,
        probes_by_group=tuple((counts[:, COUNT_COLS:].sum(axis=0) / n).tolist()),
        floor_by_group=tuple((by_group.sum(axis=0) / n).tolist()),
        hits=hits / n,
        misses=(probes - hits) / n,
        floor=sum(floor) / n,
        slots_per_probe=counts[:, C_SLOTS].sum() / max(1, probes),
        lines_per_probe=counts[:, C_LINES].sum() / max(1, probes),
        fixed_call_us=float(np.median(times)) * 1e6,
        cold_us=cold,
        warm_us=warm,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvhit.bench.probe_count")
    p.add_argument("--preset", default="dsv4-longhit")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    wl = generate(
        args.preset, TrafficConfig(num_requests=args.requests, seed=args.seed)
    )
    t = measure(wl)
    print(
        f"{args.preset} B={t.requests}: probes/request {t.probes:.1f} "
        f"(hits {t.hits:.1f}, misses {t.misses:.1f}), floor {t.floor:.1f}, "
        f"slots/probe {t.slots_per_probe:.2f}, lines/probe {t.lines_per_probe:.2f}, "
        f"fixed cost/call {t.fixed_call_us:.1f} us"
    )
    print(
        f"  kernel thread time per request: cold {t.cold_us:.2f} us, warm (its "
        f"lines in cache) {t.warm_us:.2f} us: memory "
        f"{max(0.0, 1 - t.warm_us / t.cold_us) if t.cold_us else 0.0:.0%}"
    )
    for i, sg in enumerate(wl.layout.spec_groups):
        print(
            f"  SpecGroup {i} ({type(sg.spec).__name__} {sg.spec.block_size}, "
            f"{len(sg.group_ids)} member(s)): {t.probes_by_group[i]:.1f} probes, "
            f"floor {t.floor_by_group[i]:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
