"""What one vLLM KV event costs through the event follower, stage by stage.

A batch of ``n`` stored blocks (one request's ~25, and 1000) arrives as
vLLM's ZMQ frames ``(topic, seq, payload)``, as one ``BlockStored`` of them
all (a block pool's) or one a block (the Mooncake store connector's); the
follower reads it into a plan (``plan_payload``: a numba scan of stored
blocks, msgspec for anything else) and adds the keys to its index (a
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
    from kvhit.bindings import kv_event_scan as ks
    from kvhit.bindings import kv_events as kv
    from kvhit.bindings.events import EventFollower
except ImportError as exc:  # the `events` extra (msgspec, pyzmq) is missing
    kv = ks = EventFollower = None
    MISSING = str(exc)

TOPIC = b"kv"


#: Token-id forms of the payloads: ``range`` (0, 1, 2, ...: msgpack's
#: shortest ints) or ``vocab`` (uniform in a 128K-token vocabulary, as a
#: Llama 3 prompt spreads over 1-, 3- and 5-byte ints).
TOKENS = ("range", "vocab")


#: How a batch carries its blocks: ``event`` one BlockStored of them all
#: (vLLM's block pools), ``block`` one BlockStored a block, with its parent
#: hash and group (vLLM 0.33.0's Mooncake store connector, ``store/worker.py``).
SHAPES = ("event", "block")


def _payloads(
    n_blocks: int,
    reps: int,
    hash_bytes: int,
    seed: int,
    tokens: str = "range",
    shape: str = "event",
) -> list[bytes]:
    """``reps`` encoded batches of ``n_blocks`` fresh hashes, 16 token ids a
    block (see :data:`TOKENS`), in one event or one a block (:data:`SHAPES`)."""
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
        token_ids = (
            list(range(16 * n_blocks))
            if tokens == "range"
            else [rng.randrange(128_256) for _ in range(16 * n_blocks)]
        )
        if shape == "event":
            events = [
                kv.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=token_ids,
                    block_size=16,
                    lora_id=None,
                    medium="cpu",
                    lora_name=None,
                )
            ]
        else:
            events = [
                kv.BlockStored(
                    block_hashes=[h],
                    parent_block_hash=hashes[i - 1] if i else None,
                    token_ids=token_ids[16 * i : 16 * i + 16],
                    block_size=16,
                    lora_id=None,
                    medium="cpu",
                    lora_name=None,
                    group_idx=0,
                )
                for i, h in enumerate(hashes)
            ]
        out.append(kv.encode_batch(kv.KVEventBatch(time.time(), events)))
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


def measure(
    kind: str, n_blocks: int, hash_bytes: int, reps: int, shape: str = "event"
) -> dict[str, Any]:
    """Median us per batch for every stage and the whole follower path:
    ``decode`` and ``plan`` the general path (msgspec, then Python per
    event), ``scan`` what the follower calls (``plan_payload``: the numba
    scan of stored blocks), ``pack`` and ``add`` the index's side."""
    warm = max(3, reps // 10)
    row: dict[str, Any] = {
        "index": kind,
        "shape": shape,
        "blocks": n_blocks,
        "hash": hash_bytes,
    }
    payloads = _payloads(n_blocks, reps, hash_bytes, seed=1, shape=shape)
    media = frozenset(("cpu",))

    row["decode"] = _per_call_us(lambda i: kv.decode_keys(payloads[i]), reps, warm)
    batches = [kv.decode_keys(p) for p in payloads]
    row["plan"] = _per_call_us(
        lambda i: kv.plan_events(batches[i].events, hash_bytes, media, True, 0),
        reps,
        warm,
    )
    row["scan"] = _per_call_us(
        lambda i: ks.plan_payload(payloads[i], hash_bytes, media, True, 0),
        reps,
        warm,
    )
    plans = [ks.plan_payload(p, hash_bytes, media, True, 0) for p in payloads]
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
    # The follower commits one part (a run of one group) without packing.
    row["rest"] = row["follower"] - row["scan"] - row["add"]
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
    old: Any, kind: str, n_blocks: int, hash_bytes: int, reps: int, shape: str
) -> float:
    """Median us per batch through ``rev``'s follower (the whole path only)."""
    warm = max(3, reps // 10)
    payloads = _payloads(n_blocks, reps, hash_bytes, seed=2, shape=shape)
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
        for shape in SHAPES:
            row = measure(kind, 25, 8, reps=40, shape=shape)
            assert row["follower"] >= row["add"] > 0 and row["decode"] > 0


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--blocks", default="25,1000")
    parser.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="event (one BlockStored of every block), block (one a block, as "
        "the Mooncake store connector publishes)",
    )
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
    shapes = args.shapes.split(",")
    if not set(shapes) <= set(SHAPES):
        parser.error(f"--shapes: each one of {SHAPES}, got {args.shapes!r}")
    for shape in shapes:
        for kind in ("KeyIndex", "FleetIndex"):
            for hash_bytes in (8, 32):
                for n in (int(x) for x in args.blocks.split(",")):
                    reps = args.reps if n <= 100 else max(20, args.reps // 8)
                    if shape == "block" and n > 100:
                        reps = max(10, reps // 4)
                    row = measure(kind, n, hash_bytes, reps, shape)
                    if old is not None:
                        row["baseline"] = measure_baseline(
                            old, kind, n, hash_bytes, reps, shape
                        )
                        row["speedup"] = row["baseline"] / row["follower"]
                    rows.append(row)
    print(format_rows(rows))
    return rows


if __name__ == "__main__":
    main()
