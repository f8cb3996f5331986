"""Peers: the indexes a user would pick instead of kvhit, driven side by side.

One peer today, NVIDIA Dynamo's KV-router indexer (``--peer dynamo``): its
Python binding ships in the ``ai-dynamo-runtime`` wheel (Rust inside; the
``peers`` extra, ``pip install 'kvhit[peers]'``). Its radix tree takes vLLM-style
KV events and answers one request per call with the number of leading blocks
it holds, full attention only::

    tree = dynamo._core.RadixTree()
    tree.apply_event(worker_id, json_bytes)   # {"event_id": n, "data":
        # {"stored": {"parent_hash": h | null, "blocks": [{"block_hash": h,
        # "tokens_hash": h}, ...]}}}
    tree.find_matches([h, ...]).scores        # {(worker_id, dp_rank): blocks}

Dynamo's block hashes are unsigned 64-bit ints; kvhit's keys are int64 words,
so a key goes to Dynamo as ``word & (2**64 - 1)`` (the same 8 bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = [
    "DYNAMO",
    "PEERS",
    "DynamoIndex",
    "busy_host",
    "check_cpu",
    "load_dynamo",
    "pinned",
]

DYNAMO = "dynamo"
#: Peer names ``--peer`` accepts.
PEERS = (DYNAMO,)
_WORKER = 0


def load_dynamo() -> tuple[Any, str]:
    """``(RadixTree class, "")`` when ``ai-dynamo-runtime`` imports here, else
    ``(None, why)`` (the reason a run prints when it skips the peer)."""
    try:
        from dynamo._core import RadixTree
    except Exception as exc:  # ImportError, or a wheel built for another ABI
        return None, (
            f"ai-dynamo-runtime is not importable ({type(exc).__name__}: {exc}); "
            "pip install 'kvhit[peers]'"
        )
    return RadixTree, ""


def as_u64(words: np.ndarray) -> list[int]:
    """int64 ``[n]`` key words as Dynamo's unsigned block hashes."""
    return np.ascontiguousarray(words, dtype=np.int64).view(np.uint64).tolist()


class DynamoIndex:
    """One worker's blocks in a Dynamo ``RadixTree``.

    Args:
        tree_cls: ``RadixTree`` (from :func:`load_dynamo`).
    """

    def __init__(self, tree_cls: Any) -> None:
        self.tree = tree_cls()
        self.event_id = 0

    def store(self, chains: Sequence[list[int]]) -> int:
        """One ``stored`` event per chain (a prompt's block hashes from its
        first block, u64), as a worker emits them; returns the blocks sent."""
        apply, n = self.tree.apply_event, 0
        for chain in chains:
            if not chain:
                continue
            self.event_id += 1
            blocks = [{"block_hash": h, "tokens_hash": h} for h in chain]
            event = {
                "event_id": self.event_id,
                "data": {"stored": {"parent_hash": None, "blocks": blocks}},
            }
            apply(_WORKER, json.dumps(event).encode())
            n += len(chain)
        return n

    def store_after(self, parent: int | None, blocks: list[int]) -> None:
        """One ``stored`` event: ``blocks`` (u64) continuing the block
        ``parent`` (None: from the root), as a worker reports new blocks."""
        self.event_id += 1
        event = {
            "event_id": self.event_id,
            "data": {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": h, "tokens_hash": h} for h in blocks],
                }
            },
        }
        self.tree.apply_event(_WORKER, json.dumps(event).encode())

    def sync(self) -> None:
        """Return once the indexer thread has applied every event sent so far.

        ``apply_event`` only queues an event for the tree's own thread; a
        lookup queued behind the events is answered after them. Timing a
        store up to here charges the store its real work (otherwise the next
        lookup would pay it)."""
        self.tree.find_matches([0])

    def find(self, chains: Sequence[list[int]]) -> list[int]:
        """Leading blocks held, per chain: one ``find_matches`` each."""
        find = self.tree.find_matches
        return [find(c).scores.get((_WORKER, 0), 0) for c in chains]


@contextmanager
def busy_host(processes: int) -> Iterator[None]:
    """``processes`` CPU-bound Python processes spinning while the block runs.

    A scheduler shares its host with the serving engine's other work (the API
    server, tokenizers, the model runner's host side), and the two indexes
    differ in how they take that: kvhit answers on the caller's thread,
    Dynamo's ``RadixTree`` hands each call to its own indexer thread and waits
    for the answer, a hop whose wake-up waits for a free core. ``0`` spins
    nothing (a quiet host).
    """
    if isinstance(processes, bool) or not isinstance(processes, int):
        raise TypeError(f"processes must be an int, got {type(processes).__name__}")
    if processes < 0:
        raise ValueError(f"processes must be >= 0, got {processes}")
    spinners = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(processes)
    ]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def check_cpu(cpu: int) -> None:
    """Raise TypeError for a ``cpu`` that is not an int, ValueError for a CPU
    this process may not run on or where the platform has no
    ``os.sched_setaffinity`` (what :func:`pinned` refuses; a CLI calls it
    before a run's work)."""
    if isinstance(cpu, bool) or not isinstance(cpu, int):
        raise TypeError(f"cpu must be an int or None, got {type(cpu).__name__}")
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pinning needs os.sched_setaffinity (Linux)")
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        raise ValueError(
            f"cpu must be one of this process's CPUs {sorted(allowed)}, got {cpu}"
        )


@contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Every thread of this process on CPU ``cpu`` while the block runs
    (``None``: nothing changes), their affinities restored after.

    Dynamo's ``RadixTree`` answers each call on its indexer thread. When that
    thread runs on another core, every call is a cross-core wake-up, and on
    a virtual machine whose idle core has halted that costs tens of
    microseconds. Measured on the 2-core box: Dynamo took 72-78 us a request
    in a quiet process, and 43-58 or 6-13 beside spinners that only kept
    the cores awake (idle scheduling class), from one process to the next.
    With both threads on one core each hop is a switch on that core: 5.4-8.5
    us a request, run after run. kvhit answers on the caller's thread and is
    timed the same way.

    Threads started inside the block inherit the pin from their creator and
    keep it. Raises TypeError for a ``cpu`` that is not an int, ValueError
    for a CPU this process may not run on or where the platform has no
    ``os.sched_setaffinity``.
    """
    if cpu is None:
        yield
        return
    check_cpu(cpu)
    saved = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            saved[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {cpu})
        except ProcessLookupError:  # the thread ended meanwhile
            saved.pop(tid, None)
    try:
        yield
    finally:
        for tid, cpus in saved.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass
