"""Hypothesis parity on CUDA (``pytest -m gpu``): the Triton scan (hits and
load masks), the store worker's candidates and lookup, the store/lookup masks,
KeyIndex and the FleetIndex against the scalar reference or a Python model,
for every spec kind.

Every test runs on ``cpu`` too (Triton's interpreter, few examples): that run
proves the test code itself where no GPU is at hand; only the ``cuda`` cases
are marked ``gpu`` (and skip without CUDA). On CUDA every new layout compiles
kernel variants (2-6 s each, ``shared/measurements/h200-2026-12-04.md``), so
the layouts come from a small fixed pool per kind and hypothesis draws the
batches, stores and lengths: the whole ``-m gpu`` run stays within 120 s on an
H200.
"""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import helpers
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ALL_KINDS, case, preset_requests, saved_keys

from kvhit import (
    CacheLayout,
    ChunkedLocal,
    FleetIndex,
    FullAttention,
    Group,
    HashBatch,
    KeyIndex,
    LookupEngine,
    ReferenceCoordinator,
)
from kvhit.bench.workloads import make_layout
from kvhit.coordinator import fleet_index

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Examples per test: the interpreter's few, CUDA's many.
EXAMPLES = {"cpu": 3, "cuda": 25}


# The pool's layout CUDA runs, per kind (each layout compiles ~4 kernel
# variants on a fresh machine: one per kind keeps the run near 60 s of
# compiles); the interpreter runs the whole pool.
ON_CUDA = {"full": 0, "sliding_window": 1, "mamba": 1, "chunked_local": 0}


def pool(kind: str, device: str = "cpu") -> list[CacheLayout]:
    """Layouts holding a group of ``kind`` (presets and edge layouts: block
    sizes that are not powers of two, EAGLE, partial hash hits, merged
    groups); on CUDA the one of ON_CUDA."""
    layouts_ = all_layouts(kind)
    return layouts_ if device == "cpu" else [layouts_[ON_CUDA[kind]]]


def all_layouts(kind: str) -> list[CacheLayout]:
    if kind == "full":
        return [
            make_layout("llama"),
            helpers.merged_full_layout(),
            CacheLayout([Group(FullAttention(12))], 12, 3, use_eagle=True),
        ]
    if kind == "sliding_window":
        return [
            make_layout("gemma3"),
            make_layout("dsv4-flash"),
            helpers.swa_eagle_layout(),
        ]
    if kind == "mamba":
        return [make_layout("qwen3-next"), helpers.mamba_partial_layout()]
    assert kind == "chunked_local"
    return [
        helpers.chunked_swa_layout(),
        CacheLayout([Group(FullAttention(16)), Group(ChunkedLocal(16, 64))], 16, 16),
    ]


def run_examples(device: str, test, *strategies_) -> None:
    """``test`` under hypothesis with ``EXAMPLES[device]`` examples."""
    settings(max_examples=EXAMPLES[device], deadline=None)(given(*strategies_)(test))()


def fleet_of(stores_: list, device: str, backend: str) -> FleetIndex:
    """A FleetIndex on ``device`` holding ``stores_[e]`` for engine ``e``."""
    fleet = FleetIndex(len(stores_), 8, capacity=64, device=device, backend=backend)
    for e, keys in enumerate(stores_):
        keys = sorted(keys)
        if keys:
            fleet.add(e, [g for g, _ in keys], [h for _, h in keys])
    return fleet


def triton_fleets_on(device: str) -> contextlib.AbstractContextManager:
    """On the CPU, FleetIndexes may take the Triton family (the CUDA rule,
    ``fleet_index.auto_backend``; the kernels interpreted); on CUDA nothing
    to do."""
    if device != "cpu":
        return contextlib.nullcontext()
    return mock.patch.object(fleet_index, "auto_backend", lambda device: "triton")


def fleets_agree(
    fleets: list[FleetIndex],
    layout: CacheLayout,
    reqs: list[list[bytes]],
    stores_: list[set],
    lens: list[int],
    device: str,
    apply_eagle: bool = True,
) -> None:
    """fleet_hits (``apply_eagle``) and fleet_lookup of ``reqs`` answer the
    same through each of ``fleets`` (the Triton one on ``device``, the CPU
    torch one), each on its fleet's device; on the CPU also as the reference
    per engine over ``stores_``."""
    batch = HashBatch.from_bytes(reqs, 8)
    answers = []
    for fleet in fleets:
        engine = LookupEngine(layout, backend="torch", device=fleet.device)
        b = batch.to(fleet.device)
        hits = engine.fleet_hits(b, lens, fleet, apply_eagle=apply_eagle)
        assert hits.device == fleet.device
        answers.append((hits.tolist(), engine.fleet_lookup(b, lens, fleet).tolist()))
    assert answers[0] == answers[1]
    if device == "cpu":
        # The interpreter's sizes are small enough for the reference loop
        # (the CPU torch fleet is the oracle on CUDA: it is the reference's
        # in tests/test_fleet.py).
        assert answers[0] == (
            helpers.fleet_expected(layout, reqs, stores_, lens, apply_eagle),
            helpers.fleet_expected(layout, reqs, stores_, lens, lookup=True),
        )


def max_hashes(device: str) -> int:
    # Longer prompts on CUDA: leading runs cross several 128-block tiles.
    return 40 if device == "cpu" else 400


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_scan_and_lookup_parity(device, kind):
    # find_longest_cache_hit (hits and load masks, with and without the
    # EAGLE drop), load_masks, lookup and lookup_candidates of the Triton
    # engine on ``device`` equal the reference's.
    engines = {}

    def test(data, apply_eagle):
        layout, requests, exists, lens = data
        ref = ReferenceCoordinator(layout)
        key = id(layout)
        if key not in engines:
            engines[key] = LookupEngine(layout, backend="triton", device=device)
        engine = engines[key]
        index = helpers.key_index(exists, device)
        batch = HashBatch.from_bytes(requests, 8, device)
        pairs = list(zip(requests, lens, strict=True))
        res = engine.find_longest_cache_hit(
            batch, lens, index, apply_eagle=apply_eagle, with_masks=True
        )
        want = [
            ref.find_longest_cache_hit(hl, n, exists, apply_eagle) for hl, n in pairs
        ]
        assert res.hit_lengths.device.type == device
        assert res.hit_lengths.tolist() == [h for _, h in want]
        assert [tuple(m) for m in res.mask_lists()] == [tuple(m) for m, _ in want]
        got = engine.load_masks(batch, lens).mask_lists()
        assert [list(m) for m in got] == [list(ref.load_mask(hl, n)) for hl, n in pairs]
        got = engine.lookup(batch, lens, index)
        assert got.tolist() == [ref.lookup(n, hl, exists) for hl, n in pairs]
        gids, rows = engine.lookup_candidates(batch, lens)
        flat = [h for hl in requests for h in hl]
        got_keys = sorted(
            zip(gids.tolist(), (flat[r] for r in rows.tolist()), strict=True)
        )
        assert got_keys == sorted(
            k for hl, n in pairs for k in ref.lookup_candidates(n, hl)
        )

    layouts_ = st.sampled_from(pool(kind, device))
    run_examples(device, test, case(layouts_, max_requests=6,
                                    max_hashes=max_hashes(device)),
                 st.booleans())  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_store_and_lookup_masks_parity(device, kind):
    engines = {}

    def test(data):
        layout = data.draw(st.sampled_from(pool(kind, device)))
        ref = ReferenceCoordinator(layout)
        if id(layout) not in engines:
            engines[id(layout)] = LookupEngine(layout, backend="triton", device=device)
        engine = engines[id(layout)]
        n = data.draw(st.integers(0, 6))
        aligned = [data.draw(st.integers(0, 40)) * layout.alignment for _ in range(n)]
        starts = [data.draw(st.integers(0, a + 3)) for a in aligned]
        got = engine.store_masks(aligned, starts).mask_lists()
        assert got == [
            ref.store_mask(a, s) for a, s in zip(aligned, starts, strict=True)
        ]
        assert engine.lookup_masks(aligned).mask_lists() == [
            ref.lookup_mask(a) for a in aligned
        ]

    run_examples(device, test, st.data())


@pytest.mark.parametrize("device", DEVICES)
def test_key_index_against_a_set(device):
    # Random adds, removes and membership (repeats in a batch, absent keys,
    # colliding group ids, a small table that grows and purges tombstones)
    # of a Triton KeyIndex on ``device`` against a Python set.
    universe = [(g, bytes([i, g]) * 16) for i in range(60) for g in range(3)]

    def test(data):
        index = KeyIndex(32, capacity=16, device=device, backend="triton")
        model: set = set()
        for _ in range(data.draw(st.integers(1, 6))):
            keys = data.draw(st.lists(st.sampled_from(universe), max_size=80))
            g, h = [k[0] for k in keys], [k[1] for k in keys]
            if data.draw(st.booleans()):
                assert index.add(g, h) == len(set(keys) - model)
                model |= set(keys)
            else:
                assert index.remove(g, h) == len(set(keys) & model)
                model -= set(keys)
            assert len(index) == len(model)
            got = index.contains([k[0] for k in universe], [k[1] for k in universe])
            assert got.device.type == device
            assert got.tolist() == [k in model for k in universe]

    run_examples(device, test, st.data())


@pytest.mark.parametrize("device", DEVICES)
def test_fleet_parity(device):
    # A Triton FleetIndex on ``device`` (the joint scan of
    # kernels/fleet_triton.py) against the reference loop over engines:
    # fleet_hits and fleet_lookup, 1 to 130 engines, random cuts of the
    # saved prefixes, removed engines, long prompts (runs across tiles and
    # programs), an empty request.
    def test(preset, E, seed):
        with triton_fleets_on(device):
            check(preset, E, seed)

    def check(preset, E, seed):
        n = 300 if device == "cuda" else 40
        layout, rng, reqs = preset_requests(preset, seed, 7, n)
        reqs.append([])
        hbs = layout.hash_block_size
        stores_ = []
        for _ in range(E):
            keys: set = set()
            for r in reqs:
                if rng.random() < 0.8:
                    keys |= saved_keys(
                        layout, r, layout.align(rng.randint(0, len(r)) * hbs)
                    )
            stores_.append(keys)
        fleets = [
            fleet_of(stores_, device, "triton"),
            fleet_of(stores_, "cpu", "torch"),
        ]
        gone = rng.sample(range(E), min(2, E - 1))
        for e in gone:
            for fleet in fleets:
                fleet.remove_engine(e)
            stores_[e] = set()
        lens = [max(len(r) * hbs - rng.randint(0, 20), 0) for r in reqs]
        fleets_agree(fleets, layout, reqs, stores_, lens, device)

    run_examples(
        device,
        test,
        st.sampled_from(["llama", "dsv4-flash"]),
        st.sampled_from([1, 3, 64, 65, 130]),
        st.integers(0, 2**32 - 1),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_fleet_parity_every_kind(device, kind):
    # A Triton FleetIndex on ``device`` for every kind (hybrid layouts:
    # kernels/fleet_triton.hybrid_hits, one launch family, no per-engine
    # loop) against the CPU torch fleet (and, on the CPU, the reference per
    # engine): fleet_hits (both EAGLE settings) and fleet_lookup; engines
    # past one 64-engine word on CUDA, each a random thinning of a drawn
    # store, one removed.
    def test(data, apply_eagle, E, seed):
        with triton_fleets_on(device):
            check(data, apply_eagle, E, seed)

    def check(data, apply_eagle, E, seed):
        layout, reqs, exists, lens = data
        rng = random.Random(seed)
        keys = sorted(exists)
        stores_ = [exists] + [
            {k for k in keys if rng.random() < rng.choice([0.5, 0.9, 1.0])}
            for _ in range(E - 1)
        ]
        fleets = [
            fleet_of(stores_, device, "triton"),
            fleet_of(stores_, "cpu", "torch"),
        ]
        if E > 1:
            for fleet in fleets:
                fleet.remove_engine(E - 1)
            stores_[E - 1] = set()
        fleets_agree(fleets, layout, reqs, stores_, lens, device, apply_eagle)

    # Fewer examples than the other tests on CUDA: the oracle, the CPU torch
    # fleet, scans engine by engine (up to 65 here).
    layouts_ = st.sampled_from(pool(kind, device))
    settings(max_examples=EXAMPLES[device] if device == "cpu" else 8, deadline=None)(
        given(
            case(layouts_, max_requests=6, max_hashes=max_hashes(device)),
            st.booleans(),
            st.sampled_from([1, 3] if device == "cpu" else [1, 3, 65]),
            st.integers(0, 2**32 - 1),
        )(test)
    )()
