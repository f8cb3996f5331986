"""What one vLLM KV event costs through the event follower, stage by stage.

One ``BlockStored`` of ``n`` blocks (one request's ~25, and 1000) arrives as
vLLM's ZMQ frames ``(topic, seq, payload)``; the follower digests it, decodes
it, reduces it to a plan, packs the keys and adds them to its index (a
KeyIndex, or one engine's column of a FleetIndex). This script times the
whole path (``EventFollower._handle_live`` on one message, no sockets) and
each stage alone, in one process, and prints a table::

    PYTHONSAFEPATH=1 .venv/bin/python -m kvhit.bench.bench_events [--reps N]

Hashes are vLLM's defaults: ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
into an 8-byte index, and 32-byte digests into a 32-byte index. Every
iteration stores fresh keys into an index sized so that it never grows
(growth is a rehash, timed elsewhere).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvhit.coordinator.fleet_index import FleetIndex
from kvhit.coordinator.key_index import KeyIndex

try:
    from kvhit.bindings import kv_events as kv
    from kvhit.bindings.events import EventFollower
except ImportError as exc:  # the `events` extra (msgspec, pyzmq) is missing
    kv = EventFollower = None
    MISSING = str(exc)

TOPIC = b"kv"


#: Token-id forms of the payloads: ``range`` (0, 1, 2, ...: msgpack's
#: shortest ints) or ``vocab`` (uniform in a 128K-token vocabulary, as a
#: Llama 3 prompt spreads over 1-, 3- and 5-byte ints).
TOKENS = ("range", "vocab")


def _payloads(
    n_blocks: int, reps: int, hash_bytes: int, seed: int, tokens: str = "range"
) -> list[bytes]:
    """``reps`` encoded batches of one BlockStored of ``n_blocks`` fresh
    hashes, 16 token ids a block (see :data:`TOKENS`)."""
    out = []
    rng = random.Random(seed)
    for r in range(reps):
        if hash_bytes == 8:
            # int hashes: vLLM's low 64 bits (never negative on the wire)
            hashes: list[Any] = [
                int.from_bytes(
                    hashlib.blake2b(f"{seed}:{r}:{i}".encode(), digest_size=8).digest(),
                    "big",
                )
                for i in range(n_blocks)
            ]
        else:
            hashes = [
                hashlib.sha256(f"{seed}:{r}:{i}".encode()).digest()
                for i in range(n_blocks)
            ]
        event = kv.BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=(
                list(range(16 * n_blocks))
                if tokens == "range"
                else [rng.randrange(128_256) for _ in range(16 * n_blocks)]
            ),
            block_size=16,
            lora_id=None,
            medium="cpu",
            lora_name=None,
        )
        out.append(kv.encode_batch(kv.KVEventBatch(time.time(), [event])))
    return out


def _index(kind: str, hash_bytes: int, keys: int) -> Any:
    capacity = 1 << max(10, (4 * keys).bit_length())
    if kind == "KeyIndex":
        return KeyIndex(hash_bytes, capacity=capacity)
    fleet = FleetIndex(8, hash_bytes, capacity=capacity)
    return fleet.engine_view(3)


def _per_call_us(fn: Callable[[int], Any], reps: int, warm: int) -> float:
    for i in range(warm):
        fn(i)
    times = []
    for i in range(warm, reps):
        t0 = time.perf_counter_ns()
        fn(i)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000.0


def measure(kind: str, n_blocks: int, hash_bytes: int, reps: int) -> dict[str, Any]:
    """Median us per event for every stage and the whole follower path."""
    warm = max(3, reps // 10)
    row: dict[str, Any] = {"index": kind, "blocks": n_blocks, "hash": hash_bytes}
    payloads = _payloads(n_blocks, reps, hash_bytes, seed=1)
    media = frozenset(("cpu",))

    row["decode"] = _per_call_us(lambda i: kv.decode_keys(payloads[i]), reps, warm)
    batches = [kv.decode_keys(p) for p in payloads]
    row["plan"] = _per_call_us(
        lambda i: kv.plan_events(batches[i].events, hash_bytes, media, True, 0),
        reps,
        warm,
    )
    plans = [kv.plan_events(b.events, hash_bytes, media, True, 0) for b in batches]
    index = _index(kind, hash_bytes, n_blocks * reps)
    keys = [kv.plan_keys(p, hash_bytes, "cpu") for p in plans]
    row["pack"] = _per_call_us(
        lambda i: kv.plan_keys(plans[i], hash_bytes, "cpu"), reps, warm
    )
    # What the follower calls: KeyIndex.add_trusted, or EngineView.add.
    add = index.add_trusted if isinstance(index, KeyIndex) else index.add
    row["add"] = _per_call_us(lambda i: add(*keys[i].adds), reps, warm)

    # The whole path, fresh keys into a fresh index, through the follower.
    index = _index(kind, hash_bytes, n_blocks * reps)
    follower = EventFollower(
        "tcp://127.0.0.1:1", None, index, topic=TOPIC.decode(), medium="cpu"
    )
    frames = [[TOPIC, i.to_bytes(8, "big"), p] for i, p in enumerate(payloads)]
    row["follower"] = _per_call_us(
        lambda i: follower._handle_live([frames[i]]), reps, warm
    )
    assert follower.batches_applied == reps and not follower.stale
    assert len(index) == n_blocks * reps, (len(index), n_blocks * reps)
    row["rest"] = (
        row["follower"] - row["decode"] - row["plan"] - row["pack"] - row["add"]
    )
    row["w/o add"] = row["follower"] - row["add"]
    row["ns/block"] = 1000.0 * row["follower"] / n_blocks
    return row


def load_baseline(rev: str) -> Any:
    """The follower module of git revision ``rev`` (bindings/kv_events.py and
    bindings/events.py as they were), importable beside today's, so a
    before/after comparison runs in one process."""
    root = Path(__file__).resolve().parent.parent
    mods = {}
    for name in ("kv_events", "events"):
        src = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:bindings/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        full = f"kvhit.bindings.baseline_{name}"
        src = src.replace(
            "kvhit.bindings.kv_events", "kvhit.bindings.baseline_kv_events"
        )
        spec = importlib.util.spec_from_loader(full, loader=None)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        exec(compile(src, f"{rev}:bindings/{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["events"]


def measure_baseline(
    old: Any, kind: str, n_blocks: int, hash_bytes: int, reps: int
) -> float:
    """Median us per event through ``rev``'s follower (the whole path only)."""
    warm = max(3, reps // 10)
    payloads = _payloads(n_blocks, reps, hash_bytes, seed=2)
    index = _index(kind, hash_bytes, n_blocks * reps)
    follower = old.EventFollower(
        "tcp://127.0.0.1:1", None, index, topic=TOPIC.decode(), medium="cpu"
    )
    frames = [[TOPIC, i.to_bytes(8, "big"), p] for i, p in enumerate(payloads)]
    us = _per_call_us(lambda i: follower._handle_live([frames[i]]), reps, warm)
    assert len(index) == n_blocks * reps
    return us


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A plain text table (us per event; ns/block of the whole path)."""
    heads = list(dict.fromkeys(k for r in rows for k in r))
    cells = [
        [
            f"{r[h]:.1f}" if isinstance(r.get(h), float) else str(r.get(h, ""))
            for h in heads
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += [
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells
    ]
    return "\n".join(lines)


def test_event_apply_stages() -> None:
    """The bench suite's smoke run (collected by bench/conftest.py): every
    stage is timed and the whole path costs at least the index add."""
    import pytest

    if kv is None:
        pytest.skip(MISSING)
    for kind in ("KeyIndex", "FleetIndex"):
        row = measure(kind, 25, 8, reps=40)
        assert row["follower"] >= row["add"] > 0 and row["decode"] > 0


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--blocks", default="25,1000")
    parser.add_argument(
        "--baseline",
        default=None,
        help="a git revision whose follower is timed beside today's (whole path)",
    )
    args = parser.parse_args(argv)
    if kv is None:
        raise SystemExit(MISSING)
    torch.set_num_threads(1)
    old = load_baseline(args.baseline) if args.baseline else None
    rows = []
    for kind in ("KeyIndex", "FleetIndex"):
        for hash_bytes in (8, 32):
            for n in (int(x) for x in args.blocks.split(",")):
                reps = args.reps if n <= 100 else max(20, args.reps // 8)
                row = measure(kind, n, hash_bytes, reps)
                if old is not None:
                    row["baseline"] = measure_baseline(old, kind, n, hash_bytes, reps)
                    row["speedup"] = row["baseline"] / row["follower"]
                rows.append(row)
    print(format_rows(rows))
    return rows


if __name__ == "__main__":
    main()
