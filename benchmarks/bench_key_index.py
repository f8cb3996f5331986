"""KeyIndex probe and insert throughput for 32-byte keys.

Rows: backend (numba and torch on the CPU; triton off it; a backend this
build's KeyIndex does not have is skipped with the reason) x keys in the index
x load (0.25, 0.5) x probe hit ratio (0, 0.5, 1). Every row asserts its answers
before it is timed. ``benchmark.extra_info`` carries probes/s or inserts/s,
bytes per key, the actual load and the torch/triton versions.

Run with ``pytest benchmarks -k bench_key_index --benchmark-only`` (naming the
file itself collects it twice: once by pytest, once by benchmarks/conftest.py's
``bench_*.py`` hook). Knobs:

``KVHIT_BENCH_KEYINDEX_SIZES``  comma-separated key counts (default
                                ``100000,1000000``; ``+10000000`` on CUDA)
``KVHIT_BENCH_KEYINDEX_LARGE``  ``1`` adds 10^7 keys on the CPU as well
"""

from __future__ import annotations

import os

import pytest
import torch
from knobs import DEVICE

from kvhit.bench.harness import synchronize
from kvhit.coordinator.key_index import KeyIndex

HASH_BYTES = 32
W = 4
GROUPS = 4


def _sizes() -> list[int]:
    raw = os.environ.get("KVHIT_BENCH_KEYINDEX_SIZES", "")
    if raw.strip():
        return [int(x) for x in raw.split(",") if x.strip()]
    sizes = [100_000, 1_000_000]
    if DEVICE != "cpu" or os.environ.get("KVHIT_BENCH_KEYINDEX_LARGE") == "1":
        sizes.append(10_000_000)
    return sizes


SIZES = _sizes()
LOADS = [0.25, 0.5]
HIT_RATIOS = [0.0, 0.5, 1.0]
BACKENDS = ["numba", "torch"] if DEVICE == "cpu" else ["triton", "torch"]


def _sync() -> None:
    # Kernels are asynchronous off the CPU: time them to completion.
    synchronize(DEVICE)


def _new_index(backend: str, capacity: int, **kwargs) -> KeyIndex:
    try:
        return KeyIndex(HASH_BYTES, capacity, device=DEVICE, backend=backend, **kwargs)
    except ValueError as exc:  # a backend this build's KeyIndex does not have
        pytest.skip(f"KeyIndex backend {backend!r}: {exc}")


def _capacity(n: int, load: float) -> int:
    """Smallest power of two with n / capacity <= load."""
    cap = 1
    while n > load * cap:
        cap *= 2
    return cap


def _random_keys(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randint(0, GROUPS, (n,), generator=gen)
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, W), generator=gen)
    return g.to(DEVICE), h.to(DEVICE)


_BUILT: dict[tuple[str, int, float], tuple[KeyIndex, torch.Tensor, torch.Tensor]] = {}


def _built(backend: str, n: int, load: float):
    """An index holding n random keys at the given load, cached per session."""
    key = (backend, n, load)
    if key not in _BUILT:
        _BUILT.clear()  # keep at most one large index alive
        g, h = _random_keys(n, seed=n)
        index = _new_index(backend, _capacity(n, load), max_load=max(load, 0.5))
        assert index.add(g, h) == n
        _BUILT[key] = (index, g, h)
    return _BUILT[key]


def _median(benchmark) -> float:
    """The timed median; NaN under ``--benchmark-disable`` (nothing timed)."""
    return benchmark.stats.stats.median if benchmark.stats is not None else float("nan")


def _record(
    benchmark, env_info, backend: str, index: KeyIndex, keys: int, rate: str, **info
) -> None:
    """The run's environment and figures into ``benchmark.extra_info``: ``rate``
    names the keys per second over the median round; load and bytes per key
    are the index's as it stands."""
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        backend=backend,
        device=DEVICE,
        keys=keys,
        load=round(len(index) / index.capacity, 4),
        capacity=index.capacity,
        bytes_per_key=index.memory_bytes() / len(index),
        **info,
    )
    benchmark.extra_info[rate] = keys / _median(benchmark)


@pytest.mark.parametrize("hit_ratio", HIT_RATIOS)
@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_probe(benchmark, env_info, backend, n, load, hit_ratio) -> None:
    index, g, h = _built(backend, n, load)
    # Queries: n keys, the first hit_ratio * n of them present, shuffled.
    n_hit = int(round(hit_ratio * n))
    mg, mh = _random_keys(n - n_hit, seed=n + 1)
    qg = torch.cat([g[:n_hit], mg])
    qh = torch.cat([h[:n_hit], mh])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    qg, qh = qg[perm].contiguous(), qh[perm].contiguous()
    expect = perm < n_hit
    assert torch.equal(index.contains(qg, qh), expect)

    def run() -> torch.Tensor:
        out = index.contains(qg, qh)
        _sync()
        return out

    benchmark.group = f"probe {backend} n={n:.0e}"
    rounds = 3 if n >= 10_000_000 else 7
    out = benchmark.pedantic(run, rounds=rounds, warmup_rounds=1, iterations=1)
    assert torch.equal(out, expect)
    _record(benchmark, env_info, backend, index, n, "probes_per_s", hit_ratio=hit_ratio)


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_insert(benchmark, env_info, backend, n, load) -> None:
    g, h = _random_keys(n, seed=n)
    cap = _capacity(n, load)
    index = _new_index(backend, cap)

    def setup():
        # A fresh empty table each round (not timed), same capacity: no growth.
        index.clear()
        _sync()
        return (), {}

    def run() -> int:
        added = index.add(g, h)
        _sync()
        return added

    setup()
    assert run() == n and index.capacity == cap
    sample = torch.arange(0, n, max(1, n // 10_000), device=DEVICE)
    assert bool(index.contains(g[sample], h[sample]).all())

    benchmark.group = f"insert {backend} n={n:.0e}"
    rounds = 2 if n >= 10_000_000 else 5
    added = benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1)
    assert added == n and len(index) == n and index.capacity == cap
    _record(benchmark, env_info, backend, index, n, "inserts_per_s")
