"""Shared set-up of the benchmark suites (``make bench``: ``pytest benchmarks
--benchmark-only``), out of the shipped package.

The suites measure through the harness (``bench/harness.py``), as ``kvhit
bench`` does. Knobs (environment variables, read by ``benchmarks/knobs.py``,
which pytest finds through ``pythonpath`` in pyproject; defaults suit this
repo's 2-core CPU box):

``KVHIT_BENCH_MAX_TOKENS``  longest prompt (default 16384 on CPU, 131072 on an
                            accelerator)
``KVHIT_BENCH_BATCH_SIZES`` comma-separated batch sizes (default 1,8,64,1024,4096)
``KVHIT_BENCH_PRESETS``     comma-separated subset of the presets
``KVHIT_BENCH_REF_CAP``     largest B the reference loop is timed at (1024)
``KVHIT_BENCH_HISTORY``     served requests per batch request (default 1.0)

Workloads are generated once per session and preset, at the largest batch
size, and sliced for the smaller ones (same store, same first requests).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from knobs import BATCH_SIZES, DEVICE, HISTORY, MAX_TOKENS

from kvhit.bench.workloads import TrafficConfig, Workload, generate


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    # The suites are named bench_*.py so that `make test` (testpaths = tests)
    # never runs them; collect them here.
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        # A file named on the command line is collected by pytest itself.
        if parent.session.isinitpath(file_path):
            return None
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="session")
def bench_device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def env_info() -> dict[str, str]:
    """Machine, torch, triton (and GPU) versions for ``benchmark.extra_info``."""
    from kvhit.bench.workloads import environment_info

    return environment_info()


@pytest.fixture(scope="session")
def workloads() -> Callable[[str, int], Workload]:
    """``get(preset, batch_size)``: cached workloads, sliced from one per preset."""
    cache: dict[str, Workload] = {}
    largest = max(BATCH_SIZES)

    def get(preset: str, batch_size: int) -> Workload:
        if preset not in cache:
            cfg = TrafficConfig(
                num_requests=largest, max_tokens=MAX_TOKENS, history=HISTORY
            )
            cache[preset] = generate(preset, cfg)
        return cache[preset].take(batch_size)

    return get


@pytest.fixture(scope="session")
def reference_hits() -> Callable[[Workload, list[int]], dict[int, int]]:
    """``get(workload, indices)``: reference hits, computed once per request
    (requests are shared between batch sizes)."""
    cache: dict[tuple[str, int], int] = {}
    refs: dict[str, object] = {}

    def get(wl: Workload, indices: list[int]) -> dict[int, int]:
        ref = refs.setdefault(wl.preset, wl.reference())
        todo = [i for i in indices if (wl.preset, i) not in cache]
        for i, h in zip(todo, wl.reference_lookup(todo, ref=ref), strict=True):
            cache[(wl.preset, i)] = h
        return {i: cache[(wl.preset, i)] for i in indices}

    return get
