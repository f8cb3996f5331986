"""Stores and KV events, this checkout against another, side by side.

Each checkout runs in its own worker process (its own ``.venv``, its own
``kvhit``); the driver asks them in turn for one round of every measurement,
so both see the same load on a shared host, and prints each one's median of
the rounds' medians (us per call) and their ratio::

    NUMBA_NUM_THREADS=1 PYTHONSAFEPATH=1 .venv/bin/python -m kvhit.benchmarks.ab_store \\
        --other /work/main [--rounds 7]

Measurements (fresh keys every call, into an index sized not to grow):

- ``add tensor n``: ``KeyIndex.add(torch.zeros(n), torch.from_numpy(rows))``,
  the tensors made in the call, as a router stores one request's new blocks;
- ``add numpy n``: ``KeyIndex.add(0, rows)``;
- ``event K n [vocab]``: one vLLM ``BlockStored`` of ``n`` blocks (8-byte
  int hashes, 16 token ids a block: 0, 1, 2, ... or, with ``vocab``,
  uniform in a 128K vocabulary) applied through ``EventFollower`` to a
  KeyIndex or one engine of a FleetIndex (``bench/bench_events.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

#: (name, kind, blocks, calls per round)
CASES = (
    ("add tensor 25", "tensor", 25, 2000),
    ("add numpy 25", "numpy", 25, 2000),
    ("add tensor 1000", "tensor", 1000, 100),
    ("add numpy 1000", "numpy", 1000, 100),
    ("event KeyIndex 25", "KeyIndex", 25, 400),
    ("event KeyIndex 1000", "KeyIndex", 1000, 40),
    ("event KeyIndex 25 vocab", "KeyIndex vocab", 25, 400),
    ("event KeyIndex 100 vocab", "KeyIndex vocab", 100, 200),
    ("event KeyIndex 1000 vocab", "KeyIndex vocab", 1000, 40),
    ("event FleetIndex 25", "FleetIndex", 25, 400),
    ("event FleetIndex 1000", "FleetIndex", 1000, 40),
)


def _payloads(n: int, calls: int, tokens: str) -> list[bytes]:
    """``calls`` payloads of one BlockStored of ``n`` fresh int hashes,
    built here so that both checkouts time the same bytes."""
    import random
    import time

    from kvhit.bindings import kv_events as kv

    rng = random.Random(n)
    out = []
    for _ in range(calls):
        ids = (
            list(range(16 * n))
            if tokens == "range"
            else [rng.randrange(128_256) for _ in range(16 * n)]
        )
        event = kv.BlockStored(
            block_hashes=[rng.randrange(1 << 63, 1 << 64) for _ in range(n)],
            parent_block_hash=None,
            token_ids=ids,
            block_size=16,
            lora_id=None,
            medium="cpu",
            lora_name=None,
        )
        out.append(kv.encode_batch(kv.KVEventBatch(time.time(), [event])))
    return out


def _worker() -> None:
    """Answer ``round`` lines with one JSON line: median us per case."""
    import time

    import numpy as np
    import torch

    from kvhit.bench import bench_events as be
    from kvhit.coordinator.key_index import KeyIndex

    torch.set_num_threads(1)
    perf = time.perf_counter_ns
    rng = np.random.default_rng(os.getpid())
    state: dict[str, Any] = {}

    def add_case(kind: str, n: int, calls: int) -> float:
        index = KeyIndex(8, capacity=1 << max(10, (4 * n * calls).bit_length()))
        rows = rng.integers(0, 2**62, size=(calls, n, 1), dtype=np.int64)
        times = []
        for i in range(calls):
            r = rows[i]
            t0 = perf()
            if kind == "tensor":
                index.add(torch.zeros(n, dtype=torch.int64), torch.from_numpy(r))
            else:
                index.add(0, r)
            times.append(perf() - t0)
        assert len(index) == n * calls
        return statistics.median(times) / 1000

    def event_case(kind: str, n: int, calls: int) -> float:
        kind, _, tokens = kind.partition(" ")
        key = (kind, n, calls, tokens)
        if key not in state:
            state[key] = _payloads(n, calls, tokens or "range")
        payloads = state[key]
        index = be._index(kind, 8, n * calls)
        follower = be.EventFollower(
            "tcp://127.0.0.1:1", None, index, topic="kv", medium="cpu"
        )
        frames = [[b"kv", i.to_bytes(8, "big"), p] for i, p in enumerate(payloads)]
        times = []
        for f in frames:
            t0 = perf()
            follower._handle_live([f])
            times.append(perf() - t0)
        assert len(index) == n * calls and not follower.stale
        return statistics.median(times) / 1000

    cases = [c for c in CASES if os.environ.get("AB_STORE_CASES", "") in c[0]]
    for case in cases:  # warm every kernel and import
        (add_case if case[1] in ("tensor", "numpy") else event_case)(*case[1:3], 20)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        out = {
            name: (add_case if kind in ("tensor", "numpy") else event_case)(
                kind, n, calls
            )
            for name, kind, n, calls in cases
        }
        print(json.dumps(out), flush=True)


def _start(root: Path, cases: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONSAFEPATH="1", AB_STORE_CASES=cases)
    proc = subprocess.Popen(
        [str(root / ".venv/bin/python"), str(Path(__file__).resolve()), "--worker"],
        cwd=root,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker in {root} did not start")
    return proc


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="the other checkout's root")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--cases", default="", help="only the cases whose name holds this text"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return {}
    if not args.other:
        parser.error("--other is required")
    here = Path(__file__).resolve().parent.parent
    roots = {"this": here, "other": Path(args.other).resolve()}
    procs = {k: _start(r, args.cases) for k, r in roots.items()}
    got: dict[str, list[dict[str, float]]] = {k: [] for k in procs}
    for r in range(args.rounds):
        for k in procs if r % 2 == 0 else reversed(list(procs)):
            p = procs[k]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("round\n")
            p.stdin.flush()
            got[k].append(json.loads(p.stdout.readline()))
    for p in procs.values():
        p.communicate("stop\n")
    out = {}
    print(
        f"{'us per call':24s} {'other':>9s} {'this':>9s} {'other/this':>10s}"
        "   (medians of the rounds; the rounds' ratio range)"
    )
    for name, *_ in (c for c in CASES if args.cases in c[0]):
        a = statistics.median(x[name] for x in got["other"])
        b = statistics.median(x[name] for x in got["this"])
        ratios = [
            o[name] / t[name] for o, t in zip(got["other"], got["this"], strict=True)
        ]
        out[name] = (a, b)
        print(
            f"{name:24s} {a:9.2f} {b:9.2f} {a / b:10.2f}x"
            f"   ({min(ratios):.2f}-{max(ratios):.2f})"
        )
    return out


if __name__ == "__main__":
    main()
