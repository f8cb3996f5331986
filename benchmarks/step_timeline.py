"""Where the milliseconds of one kvhit scheduler step go: a timestamp timeline.

``bench_vllm_step.py --breakdown`` installs :func:`install`: it wraps the
functions a kvhit lookup passes through (the scheduler side's request and
reply codec, the server's decode, packing, candidates, key strings, the store
pool's hand-off, the store call itself, the index rewrite, the engine, the
tail keys, the reply) so each records ``perf_counter`` at entry and exit in
one process-wide list. A step's events, sorted, cut its wall time into
consecutive intervals ``A -> B`` that sum exactly to the step: an interval
between two of our own marks on different threads (the client's encode end
-> the server's decode start) is a hand-off (IPC and a thread wake-up).

Only for measuring: nothing here is imported by the product.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

#: (perf_counter, label, thread ident) per mark, process-wide.
EVENTS: list[tuple[float, str, int]] = []


def mark(label: str) -> None:
    """Record ``label`` now (list.append is atomic under the GIL)."""
    EVENTS.append((time.perf_counter(), label, threading.get_ident()))


def _timed(label: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(label + ">")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(label + "<")

    return wrapper


class _Codec:
    """A msgspec Encoder/Decoder stand-in whose ``encode``/``decode`` is timed."""

    def __init__(self, inner: Any, label: str) -> None:
        self.inner = inner
        self.label = label

    def encode(self, obj: Any) -> bytes:
        mark(self.label + ">")
        try:
            return self.inner.encode(obj)
        finally:
            mark(self.label + "<")

    def decode(self, buf: Any) -> Any:
        mark(self.label + ">")
        try:
            return self.inner.decode(buf)
        finally:
            mark(self.label + "<")


def _wrap_attr(owner: Any, name: str, label: str) -> None:
    raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if isinstance(raw, staticmethod):
        setattr(owner, name, staticmethod(_timed(label, raw.__func__)))
    else:
        setattr(owner, name, _timed(label, raw))


def install() -> None:
    """Wrap the kvhit step's functions (idempotent only once per process)."""
    from kvhit.bindings import store_sync as ss
    from kvhit.bindings import vllm_connector as vc
    from kvhit.bindings import vllm_lookup_server as ls
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex

    vc.REQUEST_ENCODER = _Codec(vc.REQUEST_ENCODER, "client.encode")
    _wrap_attr(vc, "decode_reply", "client.decode")
    ls.REQUEST_DECODER = _Codec(ls.REQUEST_DECODER, "server.decode")
    _wrap_attr(vc.KvhitLookupClient, "_ask", "client.ask")
    _wrap_attr(ls.KvhitLookupServer, "resolve_packed", "server.resolve")
    _wrap_attr(ls.KvhitLookupServer, "_send_reply", "server.reply")
    _wrap_attr(ls.KvhitLookupServer, "_answer", "server.answer")
    _wrap_attr(ls, "joined_batch", "pack")
    _wrap_attr(ss.StoreSync, "refresh_unchecked", "sync")
    _wrap_attr(ss, "compiled_candidates", "sync.candidates")
    _wrap_attr(ss, "first_occurrences", "sync.dedup")
    _wrap_attr(ss.StoreSync, "_key_list", "sync.key_strings")
    _wrap_attr(ss.StoreSync, "_call_store", "sync.store_call")
    _wrap_attr(ss, "check_answer", "sync.check_answer")
    _wrap_attr(ls._WorkerStore, "batch_is_exist", "store")
    _wrap_attr(KeyIndex, "remove_trusted", "index.remove")
    _wrap_attr(KeyIndex, "add_trusted", "index.add")
    _wrap_attr(KeyIndex, "clear", "index.clear")
    _wrap_attr(KeyIndex, "contains_trusted", "index.contains")
    _wrap_attr(LookupEngine, "lookup_unchecked", "engine")
    _wrap_attr(ss, "_tail_boundaries", "tails")


def step_intervals(t0: float, t1: float) -> list[tuple[str, float]]:
    """The step ``[t0, t1]`` cut at every mark in it: ``("A -> B",
    seconds)`` in time order, summing to ``t1 - t0``."""
    evs = sorted(e for e in EVENTS if t0 <= e[0] <= t1)
    points = [(t0, "step>"), *((t, lab) for t, lab, _ in evs), (t1, "step<")]
    return [
        (f"{a[1]} -> {b[1]}", b[0] - a[0])
        for a, b in zip(points, points[1:], strict=False)
    ]


def table(steps: list[list[tuple[str, float]]]) -> list[tuple[str, float, float]]:
    """Per interval label (in the first step's order, repeats merged within a
    step), the median ms over ``steps`` and the share of the median step."""
    order: list[str] = []
    per: dict[str, list[float]] = {}
    for s in steps:
        sums: dict[str, float] = {}
        for lab, dt in s:
            if lab not in sums and lab not in per:
                order.append(lab)
            sums[lab] = sums.get(lab, 0.0) + dt
        for lab, v in sums.items():
            per.setdefault(lab, []).append(v)
    total = statistics.median(sum(dt for _, dt in s) for s in steps)
    rows = []
    for lab in order:
        vals = per[lab] + [0.0] * (len(steps) - len(per[lab]))
        med = statistics.median(vals) * 1e3
        rows.append((lab, med, med / (total * 1e3) if total else 0.0))
    return rows
