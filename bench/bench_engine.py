"""The batched engine vs the scalar reference loop, side by side.

Each (preset, batch size) is one pytest-benchmark group holding one row per
backend (``torch``, ``triton`` on CUDA) and one for the reference loop, all on
the same batch and store. Parity with the reference is asserted before any
timing. Run with ``make bench`` (``pytest bench --benchmark-only``); knobs in
``bench/conftest.py``.
"""

from __future__ import annotations

import random

import pytest

from bench.conftest import (
    BATCH_SIZES,
    DEVICE,
    MAX_TOKENS,
    PARITY_SAMPLE,
    PRESET_NAMES,
    REF_CAP,
)
from kvhit import cli

ENGINE_BACKENDS = [b for b in cli.available_backends(DEVICE) if b != "reference"]
IMPLS = [*ENGINE_BACKENDS, "reference"]


def _rounds(batch_size: int) -> int:
    # Enough rounds for a stable median, few enough for the slow rows.
    return 20 if batch_size <= 64 else 5


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("impl", IMPLS)
def test_lookup(
    benchmark, impl, preset, batch_size, workloads, reference_hits, env_info
) -> None:
    if impl != "reference" and cli.engine_available() is not None:
        pytest.skip(f"engine not importable: {cli.engine_available()}")
    if impl == "reference" and batch_size > REF_CAP:
        pytest.skip(f"reference loop timed only up to B={REF_CAP}")
    wl = workloads(preset, batch_size)
    benchmark.group = f"{preset} B={batch_size}"
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        preset=preset,
        batch_size=batch_size,
        backend=impl,
        device="cpu" if impl == "reference" else DEVICE,
        max_tokens=MAX_TOKENS,
        total_hashes=wl.total_hashes,
        store_keys=len(wl.store_keys),
    )
    if impl == "reference":
        ref = wl.reference()
        benchmark.pedantic(
            wl.reference_lookup,
            kwargs={"ref": ref},
            rounds=3 if batch_size >= 1024 else _rounds(batch_size),
            iterations=1,
        )
        return

    runner = cli.make_runner(wl, impl, DEVICE)
    check = (
        list(range(batch_size))
        if batch_size <= REF_CAP
        else sorted(
            random.Random(batch_size).sample(
                range(batch_size), min(PARITY_SAMPLE, batch_size)
            )
        )
    )
    want = reference_hits(wl, check)
    cli.check_parity(impl, list(runner.run()), want, wl.num_tokens)
    benchmark.extra_info["parity_checked"] = len(check)
    benchmark.pedantic(
        runner.timed or runner.run,
        rounds=_rounds(batch_size),
        iterations=1,
        warmup_rounds=1,
    )


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_key_index_contains(benchmark, preset, workloads, env_info) -> None:
    """``KeyIndex.contains`` over every (group, hash) of the largest batch."""
    if cli.engine_available() is not None:
        pytest.skip(f"engine not importable: {cli.engine_available()}")
    wl = workloads(preset, max(BATCH_SIZES))
    probe, n = cli.key_probe(wl, DEVICE)
    benchmark.group = "KeyIndex.contains"
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        preset=preset, probes=n, hash_bytes=wl.hash_bytes, device=DEVICE
    )
    benchmark.pedantic(probe, rounds=10, iterations=1, warmup_rounds=1)
    benchmark.extra_info["probes_per_s"] = n / benchmark.stats.stats.median
