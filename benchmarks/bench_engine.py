"""The batched engine vs the reference loop, side by side, through the
benchmark harness (``bench/harness.py``, the same code ``kvhit bench`` runs).

Each (preset, batch size) is one pytest-benchmark group holding one row per
backend the harness times on this device (``reference``, ``numba``,
``torch``; ``triton`` off the CPU), one for packing the batch
(``HashBatch.from_bytes``), all on the same batch and store. Parity with the
reference loop is asserted before any timing; a backend whose engine cannot be
built is skipped with the reason. Run with ``make bench`` (``pytest benchmarks
--benchmark-only``); knobs in ``benchmarks/conftest.py``.
"""

from __future__ import annotations

import pytest
from knobs import (
    BATCH_SIZES,
    DEVICE,
    MAX_TOKENS,
    PARITY_SAMPLE,
    PRESET_NAMES,
    REF_CAP,
)

from kvhit.bench import harness

IMPLS = [*harness.default_backends(DEVICE)[0], "pack"]


def _rounds(batch_size: int) -> int:
    # Enough rounds for a stable median, few enough for the slow rows.
    return 20 if batch_size <= 64 else 5


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("impl", IMPLS)
def test_lookup(
    benchmark, impl, preset, batch_size, workloads, reference_hits, env_info
) -> None:
    if impl == harness.REFERENCE and batch_size > REF_CAP:
        pytest.skip(f"reference loop timed only up to B={REF_CAP}")
    wl = workloads(preset, batch_size)
    benchmark.group = f"{preset} B={batch_size}"
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        preset=preset,
        batch_size=batch_size,
        backend=impl,
        device="cpu" if impl == harness.REFERENCE else DEVICE,
        max_tokens=MAX_TOKENS,
        total_hashes=wl.total_hashes,
        store_keys=len(wl.store_keys),
    )
    if impl == "pack":
        benchmark.pedantic(
            wl.hash_batch, args=(DEVICE,), rounds=_rounds(batch_size), iterations=1
        )
        return
    if impl == harness.REFERENCE:
        runner = harness.reference_runner(wl)
        rounds = 3 if batch_size >= 1024 else _rounds(batch_size)
        benchmark.pedantic(runner.run, rounds=rounds, iterations=1)
        return
    try:
        engine = harness.build_engine(wl, impl, DEVICE)
    except Exception as exc:  # the engine's reason is the skip's
        pytest.skip(f"{impl}: {type(exc).__name__}: {exc}")
    runner = harness.engine_runner(engine, wl)
    check = harness.parity_indices(batch_size, REF_CAP, PARITY_SAMPLE, batch_size)
    want = reference_hits(wl, check)
    harness.check_parity(impl, runner.hits(), want, wl.num_tokens)
    benchmark.extra_info["parity_checked"] = len(check)
    benchmark.pedantic(
        runner.run, rounds=_rounds(batch_size), iterations=1, warmup_rounds=1
    )


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_key_index_contains(benchmark, preset, workloads, env_info) -> None:
    """``KeyIndex.contains`` over every (group, hash) of the largest batch."""
    wl = workloads(preset, max(BATCH_SIZES))
    probe, n = harness.key_probe(wl, wl.key_index(DEVICE), DEVICE)
    benchmark.group = "KeyIndex.contains"
    benchmark.extra_info.update(env_info)
    benchmark.extra_info.update(
        preset=preset, probes=n, hash_bytes=wl.hash_bytes, device=DEVICE
    )
    benchmark.pedantic(probe, rounds=10, iterations=1, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["probes_per_s"] = n / benchmark.stats.stats.median
