"""Builders several test modules share, written once.

Imported as ``helpers`` (pytest puts ``tests/`` on the path, as for
``strategies``).
"""

from __future__ import annotations

import enum
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch

from kvhit import (
    CacheLayout,
    ChunkedLocal,
    FleetIndex,
    FullAttention,
    Group,
    KeyIndex,
    Mamba,
    ReferenceCoordinator,
    SlidingWindow,
)


def key_index(
    keys: Iterable[tuple[int, bytes]],
    device: str | torch.device = "cpu",
    width: int = 8,
) -> KeyIndex:
    """A KeyIndex of ``width``-byte hashes on ``device`` holding exactly
    ``keys`` (``(group id, hash)`` pairs), added in sorted order so that the
    table does not depend on a set's iteration order."""
    index = KeyIndex(width, capacity=16, device=device)
    keys = sorted(keys)
    if keys:
        index.add([g for g, _ in keys], [h for _, h in keys])
    return index


def make_fleet(
    stores_: list[Iterable[tuple[int, bytes]]],
    width: int = 8,
    backend: str = "auto",
    capacity: int = 16,
    num_engines: int | None = None,
) -> FleetIndex:
    """A FleetIndex holding ``stores_[e]`` for engine ``e`` (sorted adds)."""
    fleet = FleetIndex(
        num_engines or len(stores_), width, capacity=capacity, backend=backend
    )
    for e, keys in enumerate(stores_):
        keys = sorted(keys)
        if keys:
            fleet.add(e, [g for g, _ in keys], [h for _, h in keys])
    return fleet


def fleet_expected(
    layout: CacheLayout,
    requests: list[list[bytes]],
    stores_: list[Any],
    lens: list[int],
    apply_eagle: bool = True,
    lookup: bool = False,
) -> list[list[int]]:
    """The reference's answer of every request (``[B]``) against every
    engine's store (``[E]``): ``lookup`` (the worker rule at ``lens`` tokens)
    or the longest hit within ``lens``."""
    ref = ReferenceCoordinator(layout)
    return [
        [
            ref.lookup(n, r, keys)
            if lookup
            else ref.find_longest_cache_hit(r, n, keys, apply_eagle)[1]
            for keys in stores_
        ]
        for r, n in zip(requests, lens, strict=True)
    ]


def merged_swa_eagle_layout() -> CacheLayout:
    """The seed layout with two sliding-window groups merged into one
    SpecGroup, one of them EAGLE: full attention 64, SWA(16, 32) twice,
    scheduler block 64, hash block 16, ``use_eagle``."""
    return CacheLayout(
        [
            Group(FullAttention(64)),
            Group(SlidingWindow(16, 32)),
            Group(SlidingWindow(16, 32), eagle=True),
        ],
        64,
        16,
        use_eagle=True,
    )


def full_mamba_eagle_layout() -> CacheLayout:
    """The first seed layout (ARCHITECTURE.md): full attention 16 and Mamba
    16, scheduler and hash block 16, ``use_eagle``."""
    return CacheLayout(
        [Group(FullAttention(16)), Group(Mamba(16))], 16, 16, use_eagle=True
    )


def merged_full_layout() -> CacheLayout:
    """Two equal full-attention groups of 32 tokens, merged into one SpecGroup
    (a block needs its key in both), scheduler block 32, hash block 16."""
    return CacheLayout([Group(FullAttention(32)), Group(FullAttention(32))], 32, 16)


def swa_eagle_layout() -> CacheLayout:
    """Full attention 12 and an EAGLE sliding window (6, 7), hash block 3:
    block sizes that are not powers of two."""
    return CacheLayout(
        [Group(FullAttention(12)), Group(SlidingWindow(6, 7), eagle=True)],
        12,
        3,
        use_eagle=True,
    )


def mamba_partial_layout() -> CacheLayout:
    """Full attention 6, Mamba 6 and a sliding window (3, 5), hash block 3,
    ``use_eagle`` and partial hash hits."""
    return CacheLayout(
        [Group(FullAttention(6)), Group(Mamba(6)), Group(SlidingWindow(3, 5))],
        6,
        3,
        use_eagle=True,
        partial_hash_hits=True,
    )


def chunked_swa_layout() -> CacheLayout:
    """Chunked local attention (4, chunks of 12) and a sliding window (2, 3),
    hash block 2: no full-attention group."""
    return CacheLayout([Group(ChunkedLocal(4, 12)), Group(SlidingWindow(2, 3))], 4, 2)


def block_stored(hashes: list[Any], gid: Any = 0, medium: Any = "cpu") -> Any:
    """A vLLM ``BlockStored`` event (as ``kvhit.bindings.events`` decodes it)
    for ``hashes`` in group ``gid`` on ``medium``; skips the test where the
    events binding cannot be imported."""
    ev = pytest.importorskip("kvhit.bindings.events", exc_type=ImportError)
    return ev.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=gid,
    )


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (wall seconds): the
    figure a timing test compares, the least disturbed by a busy host."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def wait_until(
    cond: Callable[[], Any], timeout_s: float, poll_s: float = 0.005
) -> bool:
    """Poll ``cond`` until it is true (True) or ``timeout_s`` seconds pass
    (False): a test's wait on another thread, bounded."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def bind_retrying(
    sock: Any, addr: str, timeout_s: float, poll_s: float = 0.005
) -> None:
    """Bind the zmq socket ``sock`` to ``addr``, retrying for ``timeout_s``
    while the port is still taken: a closed socket releases its port
    asynchronously (ZMQ's I/O thread)."""
    import zmq  # optional (the events extra): only the event tests bind

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(poll_s)


def run_python(
    code: str, timeout_s: float | None = None, env: dict[str, str] | None = None
) -> str:
    """Run ``code`` in a fresh Python (``sys.executable -c``, ``env`` or this
    process's environment); assert it exits 0 (its stderr's tail otherwise)
    and return its stdout."""
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


class _Color(enum.Enum):
    RED = 3


#: Requests a router's lists call must refuse, named as ``from_ints`` names
#: them (find_hit_list, fleet_hit_array).
BAD_INT_REQUESTS = [
    [[1, True]],
    [[1, 2.0]],
    [[1, None]],
    [[1, "2"]],
    [[1, [2]]],
    [[1, 1 << 63]],
    [[1, -(1 << 63) - 1]],
    [[1, 1 << 64]],
    [{1, 2}],
    [[1], {1, 2}],
    [[1], frozenset((1, 2))],
    [5],
    [None],
    None,
    "ab",
]
#: Lengths (for one request) those calls must refuse, named as the general
#: path names them.
BAD_INT_LENGTHS = [
    [-1],
    [1 << 63],
    [True],
    [1.0],
    [_Color.RED],
    [1, 2],
    [],
    None,
    5,
    np.array([-1]),
    np.array([1.0]),
    np.array([True]),
    np.array([1 << 63], np.uint64),
    np.array([[4]]),
    torch.tensor([-1]),
]


#: The forms a router's lengths come in, each made from a list of ints
#: (find_hit_list, fleet_hit_array: their lists fast path takes a list and
#: the integer numpy arrays; every form goes the general way too).
LENGTH_FORMS = (
    list,
    tuple,
    lambda v: np.array(v, np.int64),
    lambda v: np.array(v, np.int32),
    lambda v: np.array(v, np.uint64),
    lambda v: torch.tensor(v, dtype=torch.int64),
)


def raised(fn: Callable[[], Any]) -> tuple[type, str]:
    """``(type, message)`` of the TypeError or ValueError ``fn()`` raises;
    AssertionError when it raises none."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    raise AssertionError("no error")
