"""FleetIndex and LookupEngine.fleet_hits / fleet_lookup: every request against
every engine, checked against a per-engine loop of the scalar reference."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from helpers import fleet_expected as expected
from helpers import key_index, make_fleet
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import (
    case,
    chained_hashes,
    fleet_case,
    full_fleet_case,
    layouts,
    merged_group_case,
    preset_requests,
    saved_keys,
)

from kvhit import (
    FleetIndex,
    HashBatch,
    KeyIndex,
    LookupEngine,
    route,
)
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.fleet_index import state_checksum
from kvhit.kernels import contract

EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "60"))


def _check(layout, requests, stores_, lens, engine_backend="numba",
           fleet_backend="auto", apply_eagle=True):  # fmt: skip
    engine = LookupEngine(layout, backend=engine_backend)
    fleet = make_fleet(stores_, backend=fleet_backend)
    batch = HashBatch.from_bytes(requests, 8)
    got = engine.fleet_hits(batch, lens, fleet, apply_eagle=apply_eagle)
    assert got.dtype == torch.int64 and list(got.shape) == [len(requests), len(stores_)]
    assert got.tolist() == expected(layout, requests, stores_, lens, apply_eagle)
    got = engine.fleet_lookup(batch, lens, fleet)
    assert got.tolist() == expected(layout, requests, stores_, lens, lookup=True)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=fleet_case(), apply_eagle=st.booleans())
def test_fleet_parity_every_layout(data, apply_eagle):
    layout, requests, stores_, lens = data
    _check(layout, requests, stores_, lens, apply_eagle=apply_eagle)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=full_fleet_case(), apply_eagle=st.booleans())
def test_fleet_parity_full_attention(data, apply_eagle):
    # Mostly the joint bitset scan (one non-fine full SpecGroup).
    layout, requests, stores_, lens = data
    _check(layout, requests, stores_, lens, apply_eagle=apply_eagle)


@settings(
    max_examples=max(EXAMPLES // 2, 10),
    deadline=None,
    # The patch is the same for every example.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_engine_classes_share_scans_exactly(data, monkeypatch):
    # Hybrid layouts past CLASS_MIN_ENGINES engines scan one engine per class
    # of engines that must answer alike. Forced on here at any E, with
    # engines that repeat another's store (real classes) and engines that
    # differ from it by one key, as saved by the worker or at random.
    from kvhit.coordinator import fleet_scoring as fleet_module

    monkeypatch.setattr(fleet_module, "CLASS_MIN_ENGINES", 1)
    layout, requests, stores_, lens = data.draw(fleet_case())
    n_more = data.draw(st.integers(1, 5))
    for _ in range(n_more):
        base = set(stores_[data.draw(st.integers(0, len(stores_) - 1))])
        if base and data.draw(st.booleans()):
            base.discard(data.draw(st.sampled_from(sorted(base))))
        stores_.append(base)
    _check(layout, requests, stores_, lens, apply_eagle=data.draw(st.booleans()))


@pytest.mark.parametrize("engine_backend", ["torch", "reference"])
@pytest.mark.parametrize("full", [False, True])
@settings(max_examples=max(EXAMPLES // 4, 10), deadline=None)
@given(data=st.data())
def test_fleet_parity_other_backends(engine_backend, full, data):
    # The torch table operations (what runs off the CPU): the joint
    # full-attention scan as torch ops (full) and the per-engine path through
    # other engine backends.
    layouts_ = layouts(kinds=("full",), allow_scratch_groups=False) if full else None
    layout, requests, stores_, lens = data.draw(fleet_case(layouts_))
    _check(layout, requests, stores_, lens, engine_backend, fleet_backend="torch")


def test_joint_scan_is_taken_for_full_attention(monkeypatch):
    from kvhit.kernels import fleet_numba

    # Loaded first: a process's first fleet warms its kernels with one call.
    fleet_numba.warm_up()
    calls = []
    real = fleet_numba.full_hits_checked
    monkeypatch.setattr(
        fleet_numba,
        "full_hits_checked",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )
    layout = make_layout("llama")
    reqs = [chained_hashes(1, 8), chained_hashes(2, 5)]
    _check(layout, reqs, [{(0, h) for h in reqs[0][:5]}, set()], [128, 80])
    assert len(calls) == 2


@pytest.mark.parametrize("num_engines", [14, 70])
def test_long_runs_cross_the_kernel_tiles(num_engines):
    # The fused kernel loads blocks in tiles of 16, 32, 64, 64, ... and the
    # next request's first tile early: runs ending on each side of every
    # tile boundary, past the last one, at the prompt's end, and requests
    # of no blocks or one between long ones.
    layout = make_layout("llama")
    engine = LookupEngine(layout)
    reqs = [chained_hashes(7, 300), [], chained_hashes(7, 1), chained_hashes(8, 200)]
    cuts = [0, 1, 15, 16, 17, 47, 48, 49, 111, 112, 113, 175, 176, 177, 299, 300]
    stores_ = [{(0, h) for h in reqs[0][: cuts[e % len(cuts)]]}
               | {(0, h) for h in reqs[3][: cuts[-1 - e % len(cuts)]]}
               for e in range(num_engines)]  # fmt: skip
    fleet = make_fleet(stores_, capacity=1024)
    batch = HashBatch.from_bytes(reqs, 8)
    for lens in ([300 * 16, 0, 16, 200 * 16], [177 * 16 + 5, 16, 0, 49 * 16]):
        got = engine.fleet_hits(batch, np.array(lens), fleet)
        assert got.tolist() == expected(layout, reqs, stores_, lens)
        got = engine.fleet_lookup(batch, np.array(lens), fleet)
        assert got.tolist() == expected(layout, reqs, stores_, lens, lookup=True)


def fleet_table(fleet):
    """A copy of the numba fleet's joint table (keys, then engine sets)."""
    return torch.cat([fleet.keys, fleet.bits], dim=1).numpy()


def test_fused_kernel_entry_points_agree():
    # full_hits (the launcher with its output passed in) and full_hits_checked
    # (the router path's single dispatch) are one kernel; the latter refuses
    # a negative length before reading anything.
    from kvhit.kernels import fleet_numba

    reqs = [chained_hashes(3, 70), chained_hashes(4, 3), []]
    fleet = make_fleet([{(0, h) for h in reqs[0][:40]}, {(0, h) for h in reqs[1]}])
    rows, offsets, lengths = HashBatch.from_bytes(reqs, 8).host_arrays()
    # Read-only, as the router passes them: the kernel's one compiled form.
    members = np.array([0], dtype=np.int64)
    members.flags.writeable = False
    live = fleet.live_words()
    for lookup in (0, 1):
        params = np.array([1, 1, 16, 16, 1, lookup, 2], dtype=np.int64)
        params.flags.writeable = False
        lens = np.array([70 * 16, 48, 0], dtype=np.int64)
        want = fleet_numba.full_hits(
            fleet_table(fleet), rows, offsets, lengths, lens, members, live,
            params[:6], 2,
        )  # fmt: skip
        bad, got = fleet_numba.full_hits_checked(
            fleet_table(fleet), rows, offsets, lengths, lens, members, live, params
        )
        assert bad == -1 and np.array_equal(got, want)
        assert want[0].tolist() == [40 * 16 - 16, 0]  # the EAGLE drop
        bad, got = fleet_numba.full_hits_checked(
            fleet_table(fleet), rows, offsets, lengths, np.array([5, -2, -1]),
            members, live, params,
        )  # fmt: skip
        assert bad == 1 and got.size == 0


def _router_case(numpy_ints: bool = False):
    """The router-path tests' case: llama, four requests (one empty) against
    three engines, a from_ints batch of the requests' ints (lists, or numpy
    arrays), lengths as a list: (layout, engine, reqs, stores, fleet, batch,
    lens)."""
    layout = make_layout("llama")
    reqs = [chained_hashes(1, 9), chained_hashes(2, 5), [], chained_hashes(1, 3)]
    stores_ = [{(0, h) for h in reqs[0][:6]}, {(0, h) for h in reqs[1]}, set()]
    ints = [[int.from_bytes(h, "little", signed=True) for h in r] for r in reqs]
    if numpy_ints:
        ints = [np.array(i, dtype=np.int64) for i in ints]
    batch = HashBatch.from_ints(ints, 8)
    lens = [144, 80, 16, 33]
    return layout, LookupEngine(layout), reqs, stores_, make_fleet(stores_), batch, lens


def test_router_path_takes_numpy_and_tensor_lengths():
    # A router's call: a from_ints batch and int64 numpy or tensor lengths
    # go straight to the fused kernel (lengths checked inside it), lists
    # too (test_router_path_takes_list_lengths); other forms the general
    # path takes. All answer alike; a negative length is refused
    # naming the argument, whichever path saw it.
    layout, engine, reqs, stores_, fleet, batch, lens = _router_case(numpy_ints=True)
    want = expected(layout, reqs, stores_, lens)
    want_lookup = expected(layout, reqs, stores_, lens, lookup=True)
    strided = np.repeat(np.array(lens, dtype=np.int64), 2)[::2]
    read_only = np.array(lens, dtype=np.int64)
    read_only.flags.writeable = False
    from kvhit.kernels import fleet_numba

    seen = None
    for value in (np.array(lens), np.array(lens, dtype=np.int32), strided,
                  read_only, torch.tensor(lens), lens):  # fmt: skip
        assert engine.fleet_hits(batch, value, fleet).tolist() == want
        assert engine.fleet_lookup(batch, value, fleet).tolist() == want_lookup
        if type(value) is np.ndarray and value.dtype == np.int64:
            # One compiled form for every int64 lens (a strided or read-only
            # one is copied): each other form was a ~15 s compile.
            sigs = set(fleet_numba.full_hits_checked.signatures)
            seen = sigs if seen is None else seen
            assert sigs == seen, sigs - seen
    for bad in (np.array([144, -1, 16, 33]), torch.tensor([144, 80, 16, -5])):
        with pytest.raises(ValueError, match="max_lengths"):
            engine.fleet_hits(batch, bad, fleet)
        with pytest.raises(ValueError, match="num_tokens"):
            engine.fleet_lookup(batch, bad, fleet)
    with pytest.raises(ValueError, match="max_lengths"):
        engine.fleet_hits(batch, np.array(lens[:3]), fleet)
    with pytest.raises(ValueError, match="hash width"):
        engine.fleet_hits(batch, np.array(lens), FleetIndex(3, 16))


def test_router_path_takes_list_lengths(monkeypatch):
    # Lengths as a router holds them (a list or tuple of ints) take the
    # router path too (the general path is never reached), bad ones refused
    # there naming the argument, by the general path's own check.
    layout, engine, reqs, stores_, fleet, batch, lens = _router_case()
    want = expected(layout, reqs, stores_, lens)
    want_lookup = expected(layout, reqs, stores_, lens, lookup=True)

    def general(*args):
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(fleet, "hits_unchecked", general)
    from kvhit.kernels import fleet_numba

    # The kernel takes the list as an array('q') (no numpy array made):
    # one compiled form, which building the fleet loaded (warm_up).
    sigs = set(fleet_numba.full_hits_checked.signatures)
    for value in (lens, tuple(lens)):
        assert engine.fleet_hits(batch, value, fleet).tolist() == want
        assert engine.fleet_lookup(batch, value, fleet).tolist() == want_lookup
    assert set(fleet_numba.full_hits_checked.signatures) == sigs
    # Lengths of 0 and 1 (below the list check's quick bound) answer alike.
    small = [0, 1, 16, 144]
    assert engine.fleet_hits(batch, small, fleet).tolist() == expected(
        layout, reqs, stores_, small
    )
    bad = [
        (ValueError, [144, -1, 16, 33]),
        (ValueError, [144, 80, 16]),
        (ValueError, [144, 80, 16, 2**63]),
        (TypeError, [144, 80, 16, 33.0]),
        (TypeError, [144, True, 16, 33]),
        (TypeError, [144, "80", 16, 33]),
        (TypeError, (144, None, 16, 33)),
    ]
    for exc, value in bad:
        with pytest.raises(exc, match="max_lengths"):
            engine.fleet_hits(batch, value, fleet)
        with pytest.raises(exc, match="num_tokens"):
            engine.fleet_lookup(batch, value, fleet)


def test_router_path_calls_the_compiled_wrappers_of_its_own_kernel():
    # Once the router kernel has compiled (or loaded) the signature of the
    # arguments fleet_full_host passes, it calls numba's compiled wrapper of
    # that signature (no dispatcher typing), one per lens form, and answers
    # as before; a kernel swapped in on a fleet (a bench capturing its
    # arguments) is what runs there, with each lens form.
    from kvhit.coordinator import fleet_scoring

    layout, engine, reqs, stores_, fleet, batch, lens = _router_case()
    kernel = fleet.host_kernel
    want = expected(layout, reqs, stores_, lens)
    for value in (lens, np.array(lens), torch.tensor(lens), lens, np.array(lens)):
        assert engine.fleet_hits(batch, value, fleet).tolist() == want
    calls = [fleet_scoring._KERNEL_CALLS[(kernel, q)] for q in (False, True)]
    assert all(type(c).__name__ != "CPUDispatcher" for c in calls)
    assert calls[0] is not calls[1] and kernel not in calls
    seen = []
    fleet.host_kernel = lambda *a: seen.append(type(a[4]).__name__) or kernel(*a)
    for value in (lens, np.array(lens)):
        assert engine.fleet_hits(batch, value, fleet).tolist() == want
    assert seen == ["array", "ndarray"]


@pytest.mark.parametrize("preset", ["llama", "dsv4-flash", "qwen3-next", "gemma3"])
@pytest.mark.parametrize("num_engines", [1, 3, 70, 130])
def test_presets_many_engines(preset, num_engines):
    # More than 64 engines: several bitset words; engines holding saved
    # prefixes of shared-prefix requests, some evicted keys, some empty.
    layout = make_layout(preset)
    rng = random.Random(num_engines)
    hbs = layout.hash_block_size
    scale = max(1, 64 // hbs)
    reqs = []
    for i in range(9):
        base = chained_hashes(i % 3, rng.randint(0, 6) * scale)
        reqs.append(chained_hashes(10 + i, rng.randint(0, 6) * scale, prefix=base))
    stores_ = []
    for _ in range(num_engines):
        keys = set()
        for r in reqs:
            if rng.random() < 0.3:
                cut = layout.align(rng.randint(0, len(r) * hbs))
                keys |= {k for k in saved_keys(layout, r, cut) if rng.random() > 0.05}
        stores_.append(keys)
    lens = [len(r) * hbs for r in reqs]
    lens[0] = layout.align(lens[0])
    _check(layout, reqs, stores_, lens)


@pytest.mark.parametrize("preset", ["llama", "dsv4-flash", "qwen3-next"])
@pytest.mark.parametrize("engine_backend", ["numba", "torch", "reference"])
def test_one_engine_equals_find_longest_cache_hit(preset, engine_backend):
    layout, rng, reqs = preset_requests(preset, 7, 6, 40, seeds=2)
    reqs.append([])
    hbs = layout.hash_block_size
    keys = set()
    for r in reqs[:4]:
        keys |= saved_keys(layout, r, layout.align(len(r) * hbs))
    keys = {k for k in sorted(keys) if rng.random() > 0.1}
    engine = LookupEngine(layout, backend=engine_backend)
    batch = HashBatch.from_bytes(reqs, 8)
    lens = [len(r) * hbs for r in reqs]
    fleet = make_fleet([keys])
    index = key_index(keys)
    single = engine.find_longest_cache_hit(batch, lens, index).hit_lengths
    assert engine.fleet_hits(batch, lens, fleet)[:, 0].tolist() == single.tolist()
    single = engine.lookup(batch, lens, index)
    assert engine.fleet_lookup(batch, lens, fleet)[:, 0].tolist() == single.tolist()
    # The engine's keys as a KeyIndex give the same answers.
    assert fleet.key_index(0).contains(*index.keys()).all()
    assert len(fleet.key_index(0)) == len(index) == len(keys)


def test_empty_batch_and_empty_fleet():
    layout = make_layout("llama")
    engine = LookupEngine(layout)
    fleet = FleetIndex(3, 8)
    empty = HashBatch.from_bytes([], 8)
    assert list(engine.fleet_hits(empty, [], fleet).shape) == [0, 3]
    batch = HashBatch.from_bytes([chained_hashes(0, 4), []], 8)
    assert engine.fleet_hits(batch, [64, 0], fleet).tolist() == [[0, 0, 0]] * 2
    assert engine.fleet_lookup(batch, [64, 0], fleet).tolist() == [[0, 0, 0]] * 2


# -- mutation: engines and keys coming and going -----------------------------------


def _snapshot(fleet):
    return (
        fleet.keys.clone(),
        fleet.bits.clone(),
        fleet.active,
        len(fleet),
        fleet.tombstones,
        fleet.engine_sizes(),
    )


def _same(a, b):
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("seed", range(4))
def test_mid_stream_against_a_model(backend, seed):
    rng = random.Random(seed)
    layout = make_layout("dsv4-flash" if seed % 2 else "llama")
    hbs = layout.hash_block_size
    E = [3, 9, 66, 5][seed]
    reqs = [chained_hashes(i % 3, rng.randint(1, 80), prefix=chained_hashes(
        i % 2, rng.randint(0, 40))) for i in range(6)]  # fmt: skip
    universe = sorted({(g, h) for r in reqs for h in r
                       for g in range(layout.num_groups)})  # fmt: skip
    model = [set() for _ in range(E)]
    active = [True] * E
    fleet = FleetIndex(E, 8, capacity=4, backend=backend)
    engine = LookupEngine(layout)
    batch = HashBatch.from_bytes(reqs, 8)
    lens = [len(r) * hbs for r in reqs]
    for step in range(40):
        op = rng.choice(["add", "add", "add", "remove", "clear", "leave", "join"])
        e = rng.randrange(E)
        if op == "add" and active[e]:
            if rng.random() < 0.5:
                r = rng.choice(reqs)
                ks = sorted(
                    saved_keys(layout, r, layout.align(rng.randint(0, len(r) * hbs)))
                )
            else:
                ks = rng.sample(universe, rng.randint(0, 30))
            ks = ks + ks[: len(ks) // 3]  # repeats inside a batch
            n = fleet.add(e, [g for g, _ in ks], [h for _, h in ks])
            assert n == len(set(ks) - model[e])
            model[e] |= set(ks)
        elif op == "add":
            before = _snapshot(fleet)
            with pytest.raises(ValueError, match="engine_ids"):
                fleet.add(e, [0], [reqs[0][0]] if reqs[0] else [b"\0" * 8])
            assert _same(before, _snapshot(fleet))
        elif op == "remove":
            ks = rng.sample(universe, rng.randint(0, 40))
            n = fleet.remove(e, [g for g, _ in ks], [h for _, h in ks])
            assert n == len(set(ks) & model[e])
            model[e] -= set(ks)
        elif op == "clear":
            assert fleet.clear_engine(e) == len(model[e])
            model[e] = set()
        elif op == "leave":
            assert fleet.remove_engine(e) == len(model[e])
            model[e] = set()
            active[e] = False
        else:
            fleet.add_engine(e)
            active[e] = True
        assert fleet.active.tolist() == active
        assert fleet.engine_sizes().tolist() == [len(m) for m in model]
        assert len(fleet) == len(set().union(*model))
        if step % 8 == 7:
            want = expected(layout, reqs, model, lens)
            want = [[w if active[e] else 0 for e, w in enumerate(row)] for row in want]
            assert engine.fleet_hits(batch, lens, fleet).tolist() == want
            g = [k[0] for k in universe]
            h = [k[1] for k in universe]
            held = fleet.holders(g, h)
            assert held.tolist() == [[k in m for m in model] for k in universe]
            e = rng.randrange(E)
            assert fleet.contains(e, g, h).tolist() == [k in model[e] for k in universe]
            eg, eh = fleet.engine_keys(e)
            assert len(eg) == len(model[e])
    # The state survives a round trip, and the copy answers the same.
    copy = FleetIndex.from_state_dict(fleet.state_dict(), backend=backend)
    assert _same(_snapshot(copy), _snapshot(fleet))
    assert torch.equal(
        engine.fleet_hits(batch, lens, copy), engine.fleet_hits(batch, lens, fleet)
    )


def test_growth_keeps_every_key():
    rng = np.random.default_rng(0)
    fleet = FleetIndex(70, 16, capacity=1)
    words = rng.integers(-(2**63), 2**63, size=(3000, 2), dtype=np.int64)
    engines = rng.integers(0, 70, size=3000)
    pairs = set(zip(engines.tolist(), map(tuple, words.tolist()), strict=True))
    assert fleet.add(engines, 0, words) == len(pairs)
    assert fleet.capacity >= 2 * len(fleet)
    assert fleet.contains(engines, 0, words).all()
    # Re-adding known keys never grows the table.
    cap = fleet.capacity
    assert fleet.add(engines, 0, words) == 0
    assert fleet.capacity == cap


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_clear_drops_every_key_and_the_fleet_works_after(backend):
    rng = np.random.default_rng(4)
    fleet = FleetIndex(70, 16, capacity=64, backend=backend)
    words = rng.integers(-(2**63), 2**63, size=(500, 2), dtype=np.int64)
    engines = rng.integers(0, 70, size=500)
    fleet.add(engines, 0, words)
    fleet.remove(engines[:50], 0, words[:50])  # tombstones too
    fleet.remove_engine(5)
    cap, table = fleet.capacity, fleet.keys.data_ptr()
    fleet.clear()
    assert len(fleet) == 0 and fleet.tombstones == 0
    assert fleet.capacity == cap and fleet.keys.data_ptr() == table  # kept
    assert not fleet.engine_sizes().any() and not fleet.bits.any()
    assert bool((fleet.keys[:, 0] == contract.EMPTY).all())
    assert not fleet.keys[:, 1:].any()
    assert not fleet.contains(engines, 0, words).any()
    assert fleet.active.tolist() == [e != 5 for e in range(70)]  # engines stay
    live = engines != 5
    pairs = set(
        zip(engines[live].tolist(), map(tuple, words[live].tolist()), strict=True)
    )
    assert fleet.add(engines[live], 0, words[live]) == len(pairs)
    assert fleet.contains(engines[live], 0, words[live]).all()


@pytest.mark.parametrize("E", [3, 70])
def test_one_pass_growth_equals_the_rebuild_by_insert_and_find(E):
    # The numba family grows by moving each live row of its joint table
    # whole (FleetOps.rehash_rows); without it a fleet gathers the keys,
    # inserts and finds them, and scatters the engine sets. Fed the same
    # stores, removes (tombstones to purge), a removed engine and growth
    # from one slot, both leave the same table: same slots, same engine
    # sets (70 engines: two engine-set words), same counts.
    rng = np.random.default_rng(E)
    words = rng.integers(-(2**63), 2**63, size=(1500, 1), dtype=np.int64)
    # Engine E - 1 is removed after the third chunk: no store names it later.
    adders = [rng.integers(0, E if lo <= 600 else E - 1, size=300)
              for lo in range(0, 1500, 300)]  # fmt: skip
    removers = [rng.integers(0, E, size=100) for _ in adders]
    fleets = [FleetIndex(E, 8, capacity=1, backend="numba") for _ in range(2)]
    fleets[1].ops.rehash_rows = None  # this fleet's ops only: the rebuild
    grown = []
    for f in fleets:
        caps = []
        for k, lo in enumerate(range(0, 1500, 300)):
            chunk = words[lo : lo + 300]
            f.add(adders[k], 0, chunk)
            f.remove(removers[k], 0, chunk[:100])
            caps.append(f.capacity)
            if lo == 600:
                f.remove_engine(E - 1)
        grown.append(caps)
    assert grown[0] == grown[1] and grown[0][-1] >= 1024
    assert _same(_snapshot(fleets[0]), _snapshot(fleets[1]))
    held = fleets[0].holders(0, words)
    assert torch.equal(held, fleets[1].holders(0, words))
    assert held.any() and not held.all()


# -- bad input: refused, nothing changed --------------------------------------------


def test_bad_inputs_change_nothing():
    h = chained_hashes(0, 4)
    fleet = make_fleet([{(0, h[0]), (1, h[1])}, {(0, h[2])}])
    before = _snapshot(fleet)
    cases = [
        (ValueError, "engine_ids", lambda: fleet.add(2, [0], [h[0]])),
        (ValueError, "engine_ids", lambda: fleet.add([0, -1], [0, 0], h[:2])),
        (ValueError, "engine_ids", lambda: fleet.add(np.array([0, 5]), 0, h[:2])),
        (ValueError, "engine_ids", lambda: fleet.remove(torch.tensor([3]), 0, h[:1])),
        (
            TypeError,
            "engine_ids",
            lambda: fleet.add(torch.tensor([0], dtype=torch.int32), 0, h[:1]),
        ),  # noqa: E501
        (TypeError, "engine_ids", lambda: fleet.add(np.array([0.0]), 0, h[:1])),
        (TypeError, "engine_ids", lambda: fleet.add([0.5], 0, h[:1])),
        (TypeError, "engine_ids", lambda: fleet.add(True, 0, h[:1])),
        (ValueError, "engine_ids", lambda: fleet.add([0, 1, 0], 0, h[:2])),
        (TypeError, "group_ids", lambda: fleet.add(0, torch.tensor([0.0]), h[:1])),
        (ValueError, "group_ids", lambda: fleet.add(0, [-1], h[:1])),
        (ValueError, "hash", lambda: fleet.add(0, 0, [b"short"])),
        (TypeError, "hashes", lambda: fleet.add(0, 0, np.zeros((1, 1), np.float32))),
        (ValueError, "engine", lambda: fleet.clear_engine(2)),
        (TypeError, "engine", lambda: fleet.remove_engine("0")),
        (ValueError, "engine", lambda: fleet.add_engine(-1)),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()
        assert _same(before, _snapshot(fleet)), match
    with pytest.raises(ValueError, match="group_ids"):
        fleet.add(0, [fleet.max_group_id + 1], h[:1])
    assert _same(before, _snapshot(fleet))
    with pytest.raises(ValueError, match="num_engines"):
        FleetIndex(0, 8)
    with pytest.raises(ValueError, match="backend 'triton' runs on CUDA only"):
        FleetIndex(2, 8, backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        FleetIndex(2, 8, backend="cuda")
    with pytest.raises(ValueError, match="max_load"):
        FleetIndex(2, 8, max_load=1.0)


def _entry_snapshot(fleet):
    return (*_snapshot(fleet), len(fleet.entries), fleet.entries.table.clone())


def test_host_store_matches_the_general_path_and_refuses_alike():
    # FleetIndex.add's host store (numpy or tensor keys: one checked kernel
    # pass, entries prefetched ahead) against the general path (the same
    # keys as bytes): the same keys, engine sets, entries and counts, for
    # engines given as an int (broadcast), an array and a tensor, stores
    # longer than the prefetch distance, and re-adds. Bad engines and group
    # ids are refused naming the argument, nothing stored.
    rng = np.random.default_rng(5)
    E = 70
    fast, slow = FleetIndex(E, 8, capacity=4096), FleetIndex(E, 8, capacity=4096)
    for fleet in (fast, slow):
        fleet.remove_engine(9)
    prev = np.zeros((0, 1), dtype=np.int64)

    def general(*args, **kwargs):
        raise AssertionError("the general path was taken")

    fast._entries = general  # every valid store below takes the host store
    for step in range(40):
        n = int(rng.integers(0, 60))
        words = rng.integers(-(2**63), 2**63 - 1, size=(n, 1), dtype=np.int64)
        if step % 3 == 0:
            k = min(n // 2, prev.shape[0])
            words[:k] = prev[:k]  # re-added keys
        groups = rng.integers(0, 3, size=n, dtype=np.int64)
        garg = groups
        if step % 4 == 1:
            # One group for every key, as an int (a KV event's form: the
            # kernel broadcasts a 1-element array of it).
            garg = int(rng.integers(0, 3))
            groups = np.full(n, garg, dtype=np.int64)
        form = step % 3
        if form == 0:
            engines = int(rng.choice([e for e in range(E) if e != 9]))
            arg = engines
        else:
            engines = rng.choice([e for e in range(E) if e != 9], size=n)
            arg = engines if form == 1 else torch.from_numpy(engines)
        got = fast.add(arg, garg, words)
        as_bytes = [w.tobytes() for w in words[:, 0]]
        want = slow.add(
            np.broadcast_to(np.asarray(engines), (n,)).copy(), groups.tolist(), as_bytes
        )
        assert got == want, step
        assert _same(_snapshot(fast), _snapshot(slow)), step
        assert len(fast.entries) == len(slow.entries), step
        prev = words
    del fast._entries
    before = _entry_snapshot(fast)
    h = np.arange(1, 4, dtype=np.int64).reshape(-1, 1)
    bad = [
        (ValueError, "engine_ids", lambda: fast.add(9, 0, h)),
        (ValueError, "engine_ids", lambda: fast.add(E, 0, h)),
        (ValueError, "engine_ids", lambda: fast.add(np.array([0, 9, 1]), 0, h)),
        (ValueError, "engine_ids", lambda: fast.add(np.array([0, -1, 1]), 0, h)),
        (ValueError, "engine_ids", lambda: fast.add(torch.tensor([0, 1, E]), 0, h)),
        (ValueError, "engine_ids", lambda: fast.add(np.array([0, 1]), 0, h)),
        (ValueError, "group_ids", lambda: fast.add(
            0, np.array([0, fast.max_group_id + 1, 0]), h)),
        (ValueError, "group_ids", lambda: fast.add(0, np.array([0, -1, 0]), h)),
        (ValueError, "group_ids", lambda: fast.add(0, fast.max_group_id + 1, h)),
        (ValueError, "group_ids", lambda: fast.add(0, -1, h)),
        (ValueError, "group_ids", lambda: fast.add(0, 2**63, h)),
        (ValueError, "engine_ids", lambda: fast.add(9, 2, h)),
    ]  # fmt: skip
    for exc, match, fn in bad:
        with pytest.raises(exc, match=match):
            fn()
        after = _entry_snapshot(fast)
        assert _same(before[:-1], after[:-1]) and torch.equal(before[-1], after[-1])


def _entry_pairs(fleet):
    g, h = fleet.entries.keys()
    return sorted(zip(g.tolist(), h[:, 0].tolist(), strict=True))


@pytest.mark.parametrize("seed", range(3))
def test_entry_index_built_from_the_bits_when_first_read(seed):
    # A numba fleet's stores leave the entry index out until it is first
    # read (one cache miss a key, not two); then it is built from the bits
    # and kept by every mutation. Against a fleet whose index was read (so
    # kept) from the start: the same ops, the same entry pairs, both before
    # the first read (built then) and after (kept), and every hybrid hit.
    rng = np.random.default_rng(seed)
    E = [5, 70, 1][seed]
    lazy = FleetIndex(E, 8, capacity=64)
    kept = FleetIndex(E, 8, capacity=64, lazy_entries=False)
    assert lazy._entries_lazy and not kept._entries_lazy
    pool = rng.integers(-(2**63), 2**63 - 1, size=(300, 1), dtype=np.int64)
    for phase in range(2):
        for step in range(30):
            op = rng.choice(["host", "host", "general", "remove", "clear", "cycle"])
            e = int(rng.integers(0, E))
            words = pool[rng.integers(0, 300, size=int(rng.integers(0, 90)))]
            for fleet in (lazy, kept):
                if op == "cycle":
                    fleet.remove_engine(e)
                    fleet.add_engine(e)
                elif op == "clear":
                    fleet.clear_engine(e)
                elif op == "remove":
                    fleet.remove(e, 1, words)
                elif op == "general":
                    fleet.add(e, [1] * len(words), [w.tobytes() for w in words[:, 0]])
                else:
                    fleet.add(e, 1, np.ascontiguousarray(words))
            assert _same(_snapshot(lazy), _snapshot(kept)), (phase, step)
            # Before the first read nothing is stored in it.
            assert lazy._entries_lazy == (phase == 0)
        assert _entry_pairs(lazy) == _entry_pairs(kept), phase
        assert len(lazy.entries) == int(lazy.engine_sizes().sum())
    layout = make_layout("dsv4-flash")
    engine = LookupEngine(layout)
    batch = HashBatch.from_ints([pool[:40, 0], pool[20:90, 0]], 8)
    lens = [40 * layout.hash_block_size, 70 * layout.hash_block_size]
    assert torch.equal(engine.fleet_hits(batch, lens, lazy),
                       engine.fleet_hits(batch, lens, kept))  # fmt: skip
    copy = FleetIndex.from_state_dict(lazy.state_dict())
    assert _entry_pairs(copy) == _entry_pairs(kept)


def test_lazy_entries_flag_is_checked_and_the_late_build_is_said(caplog):
    with pytest.raises(TypeError, match="lazy_entries"):
        FleetIndex(4, 8, lazy_entries=1)
    # An empty fleet's first read builds nothing and says nothing; one
    # holding pairs says how many and how to keep the index from the start.
    quiet, held = FleetIndex(4, 8), FleetIndex(4, 8)
    held.add(2, 1, np.arange(7, dtype=np.int64).reshape(7, 1))
    with caplog.at_level("WARNING", logger="kvhit.coordinator.fleet_index"):
        assert len(quiet.entries) == 0
        assert not caplog.records
        assert len(held.entries) == 7
    (record,) = caplog.records
    assert "7 (engine, key) pairs" in record.getMessage()
    assert "lazy_entries=False" in record.getMessage()


def test_lookup_bad_inputs():
    layout = make_layout("llama")
    engine = LookupEngine(layout)
    fleet = FleetIndex(2, 8)
    batch = HashBatch.from_bytes([chained_hashes(0, 2)], 8)
    with pytest.raises(TypeError, match="fleet"):
        engine.fleet_hits(batch, [32], key_index([]))
    with pytest.raises(ValueError, match="hash width"):
        engine.fleet_hits(batch, [32], FleetIndex(2, 16))
    with pytest.raises(ValueError, match="max_lengths"):
        engine.fleet_hits(batch, [-1], fleet)
    with pytest.raises(TypeError, match="num_tokens"):
        engine.fleet_lookup(batch, [1.5], fleet)
    with pytest.raises(TypeError, match="batch"):
        engine.fleet_hits([[b"\0" * 8]], [32], fleet)


# -- persistence ----------------------------------------------------------------------


def test_state_dict_round_trip_and_corruption():
    rng = random.Random(3)
    h = chained_hashes(0, 60)
    fleet = FleetIndex(67, 8, capacity=8)
    for e in range(67):
        ks = rng.sample(h, 10)
        fleet.add(e, rng.randrange(3), ks)
    fleet.remove(5, 0, h)
    fleet.remove_engine(66)
    good = fleet.state_dict()
    copy = FleetIndex.from_state_dict(good)
    assert _same(_snapshot(copy), _snapshot(fleet))
    assert copy.keys.data_ptr() != fleet.keys.data_ptr()

    def signed(**changes):
        state = dict(good)
        state.update(changes)
        state["checksum"] = state_checksum(state)
        return state

    live = (good["keys"][:, 0] >= 0).nonzero().squeeze(1)
    empty = (good["keys"][:, 0] == -1).nonzero().squeeze(1)
    s0 = int(live[0])

    def edit(name, fn):
        t = good[name].clone()
        fn(t)
        return t

    # A flipped bit anywhere is caught by the checksum.
    with pytest.raises(ValueError, match="checksum"):
        FleetIndex.from_state_dict(
            {
                **good,
                "bits": edit("bits", lambda t: t.__setitem__((s0, 0), t[s0, 0] ^ 4)),
            }
        )  # noqa: E501
    with pytest.raises(ValueError, match="checksum"):
        FleetIndex.from_state_dict({**good, "size": good["size"] + 1})
    with pytest.raises(ValueError, match="missing"):
        FleetIndex.from_state_dict({k: v for k, v in good.items() if k != "checksum"})
    # A writer with a bug: signed, but structurally wrong.
    bad_states = {
        "no engine": signed(bits=edit("bits", lambda t: t[s0].zero_())),
        "past num_engines": signed(
            bits=edit("bits", lambda t: t.__setitem__((s0, 1), t[s0, 1] | (1 << 40)))
        ),  # noqa: E501
        "inactive": signed(
            bits=edit("bits", lambda t: t.__setitem__((s0, 1), t[s0, 1] | 4))
        ),  # noqa: E501
        "EMPTY": signed(
            bits=edit("bits", lambda t: t.__setitem__((int(empty[0]), 0), 1))
        ),  # noqa: E501
        "reachable": signed(
            keys=edit("keys", lambda t: t.__setitem__((s0, 1), t[s0, 1] ^ 1))
        ),  # noqa: E501
        "fields say": signed(size=good["size"] - 1),
        "sentinels": signed(keys=edit("keys", lambda t: t.__setitem__((s0, 0), -7))),
        "shape": signed(bits=good["bits"][:, :1].contiguous()),
    }
    other = FleetIndex(67, 8)
    other.add(0, 0, h[:3])
    bad_states["does not hold exactly"] = signed(entries=other.state_dict()["entries"])
    for match, state in bad_states.items():
        with pytest.raises(ValueError, match=match):
            FleetIndex.from_state_dict(state)
    with pytest.raises(TypeError, match="bits"):
        FleetIndex.from_state_dict(signed(bits=good["bits"].to(torch.int32)))


# -- routing ------------------------------------------------------------------------------


def test_numba_engine_sets_lie_beside_their_keys_and_survive_torch_save():
    # The numba layout: each slot's engine set in its key's row (one table,
    # keys and bits its column views), through growth and a save/load cycle
    # (state_dict hands out the views; torch.save keeps what they show).
    import io

    rng = random.Random(5)
    h = chained_hashes(7, 400)
    fleet = FleetIndex(70, 8, capacity=4)
    for e in range(70):
        fleet.add(e, rng.randrange(2), rng.sample(h, 30))
    row = fleet.keys.stride(0)
    assert row == fleet.bits.stride(0) == fleet.W + 1 + fleet.NW
    assert fleet.bits.data_ptr() == fleet.keys.data_ptr() + (fleet.W + 1) * 8
    buf = io.BytesIO()
    torch.save(fleet.state_dict(), buf)
    buf.seek(0)
    copy = FleetIndex.from_state_dict(torch.load(buf))
    assert _same(_snapshot(copy), _snapshot(fleet))
    assert copy.bits.data_ptr() == copy.keys.data_ptr() + (copy.W + 1) * 8
    layout = make_layout("llama")
    engine = LookupEngine(layout)
    batch = HashBatch.from_bytes([h[:40], h[100:180], []], 8)
    lens = [640, 1280, 0]
    assert torch.equal(
        engine.fleet_hits(batch, lens, copy), engine.fleet_hits(batch, lens, fleet)
    )


def test_route_cost_model_and_ties():
    hits = torch.tensor([[0, 64, 64], [32, 32, 32], [0, 0, 0], [-1, -1, 16]])
    # Longest hit wins; a tie in cost goes to the longer hit, then the lower
    # load, then the lower id.
    got = route(hits, block_size=16, update_loads=False)
    assert got.tolist() == [1, 0, 0, 2]
    # Load counts against the overlap: engine 1 is 4 blocks busier.
    got = route(hits[:1], loads=[0.0, 5.0, 4.0], block_size=16, update_loads=False)
    assert got.tolist() == [2]
    got = route(hits[:1], loads=[0.0, 5.0, 4.0], block_size=16, overlap_weight=2.0,
                update_loads=False)  # fmt: skip
    assert got.tolist() == [2]
    got = route(hits[:1], loads=[0.0, 5.0, 5.0], block_size=16, overlap_weight=0.0,
                update_loads=False)  # fmt: skip
    assert got.tolist() == [0]
    # Placements add load: identical all-miss requests spread out.
    got = route(torch.zeros((3, 3), dtype=torch.int64), prompt_tokens=[32] * 3,
                block_size=16)  # fmt: skip
    assert got.tolist() == [0, 1, 2]
    assert route(torch.full((1, 2), -1)).tolist() == [-1]
    with pytest.raises(TypeError, match="hits"):
        route(torch.zeros((1, 2), dtype=torch.int32))
    with pytest.raises(ValueError, match="loads"):
        route(hits, loads=[0.0])
    with pytest.raises(ValueError, match="prompt_tokens"):
        route(hits, prompt_tokens=[0, 0, 0, 0])


def test_key_index_of_an_engine_is_a_plain_key_index():
    fleet = make_fleet([{(0, b"a" * 8)}, {(1, b"b" * 8)}])
    idx = fleet.key_index(1)
    assert isinstance(idx, KeyIndex)
    assert (1, b"b" * 8) in idx and (0, b"a" * 8) not in idx


def test_fine_grained_hit_inside_the_first_block():
    # Partial hash hits: an engine holding only hash unit 1 of block 0 hits
    # 32 tokens (the fine tail); one holding nothing of block 0 hits 0 even
    # with later blocks stored.
    from kvhit import CacheLayout, FullAttention, Group, Mamba

    h = chained_hashes(5, 12)
    for groups in ([Group(FullAttention(64))],
                   [Group(FullAttention(64)), Group(Mamba(64))]):  # fmt: skip
        layout = CacheLayout(groups, 64, 16, partial_hash_hits=True)
        stores_ = [
            {(g, h[1]) for g in range(len(groups))},
            {(g, x) for g in range(len(groups)) for x in h[4:]},
            {(g, x) for g in range(len(groups)) for x in h[:7]},
        ]
        _check(layout, [h, h[:3]], stores_, [192, 48])
        engine = LookupEngine(layout)
        got = engine.fleet_hits(
            HashBatch.from_bytes([h], 8), [192], make_fleet(stores_)
        )
        assert got.tolist() == [[32, 0, 112]]


@pytest.mark.parametrize("preset", ["llama", "dsv4-flash"])
def test_torch_fleet_behind_the_triton_backend(preset):
    # What runs on CUDA (torch table operations; llama: the joint scan as
    # torch ops, dsv4-flash: the per-engine path through the Triton backend),
    # here under TRITON_INTERPRET=1 at a small size.
    layout, _, reqs = preset_requests(preset, 0, 4, 80, seeds=2)
    hbs = layout.hash_block_size
    stores_ = [saved_keys(layout, r, layout.align(len(r) * hbs)) for r in reqs[:3]]
    _check(layout, reqs, stores_, [len(r) * hbs for r in reqs], "triton", "torch")


def test_merged_full_attention_groups_past_64_engines():
    # Two equal full-attention groups merge into one SpecGroup: a block needs
    # its key in both; 70 engines take two engine-set words.
    layout, reqs, stores_, lens = merged_group_case(6)
    assert len(layout.spec_groups) == 1
    _check(layout, reqs, stores_, lens)


@st.composite
def eagle_hybrids(draw):
    """A full-attention group and 1-3 later groups of other kinds or block
    sizes (often larger than the first's: an EAGLE SpecGroup is scanned one
    of its blocks past the hit the full-attention run left), EAGLE flags at
    random."""
    from kvhit import CacheLayout, FullAttention, Group, Mamba, SlidingWindow

    hbs = draw(st.sampled_from([1, 4, 16]))
    factor = draw(st.sampled_from([2, 4, 6, 8]))
    divs = [d for d in range(1, factor + 1) if factor % d == 0]
    groups = [Group(FullAttention(hbs * draw(st.sampled_from(divs[:-1]))),
                    eagle=draw(st.booleans()))]  # fmt: skip
    for i in range(draw(st.integers(1, 3))):
        bs = hbs * draw(st.sampled_from(divs))
        spec = draw(st.sampled_from([
            SlidingWindow(bs, draw(st.integers(1, 2 * bs))), Mamba(bs),
            FullAttention(bs, tag=i)]))  # fmt: skip
        groups.append(Group(spec, eagle=draw(st.booleans())))
    try:
        return CacheLayout(groups, hbs * factor, hbs, use_eagle=True,
                           partial_hash_hits=draw(st.booleans()))  # fmt: skip
    except ValueError:
        assume(False)


@st.composite
def near_runs(draw):
    """A case whose engines hold, per group, a prefix of each request cut a
    few hash units either side of engine 0's cut (so they share the first
    SpecGroup's run and differ in keys just above or below it, in any
    group), some with one key more or less anywhere; half the time an EAGLE
    hybrid layout (later SpecGroups scanned a proof margin past the hit)."""
    layout, requests, _, lens = draw(st.one_of(case(), case(eagle_hybrids())))
    if draw(st.booleans()):
        # Whole prompts: hits bounded by the keys, not by the lengths.
        lens = [len(r) * layout.hash_block_size for r in requests]
    G = layout.num_groups
    longest = max(len(r) for r in requests)
    # Groups cut near one another (within two scheduler blocks): a later
    # group's keys around the first's run are the ones a scan may read.
    f = layout.scheduler_block_size // layout.hash_block_size
    cut = draw(st.integers(0, longest))
    cuts0 = [max(0, cut + draw(st.integers(-2 * f, 2 * f))) for _ in range(G)]
    universe = sorted({(g, h) for r in requests for h in r for g in range(G)})
    stores_ = []
    for e in range(draw(st.integers(2, 9))):
        delta = [0] * G if e == 0 else [draw(st.integers(-2, 3)) for _ in range(G)]
        keys = {(g, h) for r in requests for g in range(G)
                for h in r[: max(0, cuts0[g] + delta[g])]}  # fmt: skip
        if e and universe and draw(st.integers(0, 3)) == 0:
            keys ^= {draw(st.sampled_from(universe))}
        stores_.append(keys)
    return layout, requests, stores_, lens


@settings(
    max_examples=max(EXAMPLES // 2, 10),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=near_runs(), apply_eagle=st.booleans())
def test_engine_classes_engines_near_one_run(data, apply_eagle, monkeypatch):
    # Engine classes forced on (any E) where they are hardest: engines that
    # share the first SpecGroup's run and differ in a key near it. A key a
    # scan reads but the classes did not split on shows as a mismatch.
    from kvhit.coordinator import fleet_scoring as fleet_module

    monkeypatch.setattr(fleet_module, "CLASS_MIN_ENGINES", 1)
    layout, requests, stores_, lens = data
    _check(layout, requests, stores_, lens, apply_eagle=apply_eagle)


@pytest.mark.parametrize("later", ["sliding_window", "full", "fine"])
def test_engine_classes_see_a_later_groups_eagle_margin(later, monkeypatch):
    # A later SpecGroup under EAGLE is scanned one proof margin (its block)
    # past the hit the full-attention run left, so it reads a hash row past
    # the run's window. Engines 0 and 1 share the run and every key below
    # the window and differ in that key: they must not share a scan.
    # sliding_window: blocks of 16 then 32 tokens, the run 2 blocks (32
    # tokens), the window rows 0-2, row 3 read; full: blocks of 4 then 16
    # tokens (another tag: another SpecGroup), the run 4 blocks (16 tokens),
    # the window rows 0-4, row 7 read; fine: partial hash hits, blocks of 32
    # then 64 tokens, the run 2 blocks and a hash unit (80 tokens), the
    # window rows 0-5, row 7 read.
    from kvhit import CacheLayout, FullAttention, Group, SlidingWindow
    from kvhit.coordinator import fleet_scoring as fleet_module

    monkeypatch.setattr(fleet_module, "CLASS_MIN_ENGINES", 1)
    h = chained_hashes(1, 8)
    if later == "sliding_window":
        layout = CacheLayout(
            [Group(FullAttention(16)), Group(SlidingWindow(32, 16), eagle=True)],
            32, 16, use_eagle=True,
        )  # fmt: skip
        base = {(0, h[0]), (0, h[1]), (1, h[1])}
        extra, lens, want = (1, h[3]), [128], [[32, 0]]
    elif later == "fine":
        layout = CacheLayout(
            [Group(FullAttention(32)), Group(SlidingWindow(64, 64), eagle=True)],
            64, 16, use_eagle=True, partial_hash_hits=True,
        )  # fmt: skip
        base = {(0, x) for x in h[:5]} | {(1, h[3])}
        extra, lens, want = (1, h[7]), [128], [[64, 0]]
    else:
        layout = CacheLayout(
            [Group(FullAttention(4)), Group(FullAttention(16, tag=0)),
             Group(FullAttention(16, tag=1), eagle=True)],
            16, 4, use_eagle=True,
        )  # fmt: skip
        base = {(0, x) for x in h[:4]} | {(1, h[3]), (1, h[7]), (2, h[3])}
        extra, lens, want = (2, h[7]), [32], [[16, 0]]
    stores_ = [base | {extra}, base]
    _check(layout, [h], stores_, lens)
    engine = LookupEngine(layout)
    got = engine.fleet_hits(HashBatch.from_bytes([h], 8), lens, make_fleet(stores_))
    assert got.tolist() == want


def test_engine_classes_more_groups_than_a_tile():
    # Engine classes probe keys in tiles of 64 (group, row) pairs: a layout
    # of more groups than that (one full-attention group and 64 sliding-
    # window groups merged) must still make progress (it looped forever) and
    # answer exactly. In a child process, so that a hang fails the test.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        from test_fleet import _check, chained_hashes
        from kvhit import CacheLayout, FullAttention, Group, SlidingWindow
        from kvhit.coordinator import fleet_scoring as fleet_module

        layout = CacheLayout(
            [Group(FullAttention(16))] + [Group(SlidingWindow(16, 32))] * 64, 16, 16
        )
        h = chained_hashes(2, 6)
        E = fleet_module.CLASS_MIN_ENGINES + 2
        stores_ = [
            {(0, x) for x in h[: 2 + e % 3]}
            | {(g, x) for g in range(1, 65) for x in h[: 1 + e % 4]}
            for e in range(E)
        ]
        _check(layout, [h, h[:3]], stores_, [96, 48])
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=here, timeout=240, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": here},  # PYTHONSAFEPATH=1: no cwd
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_prefix_blocks_refuses_lengths_it_would_truncate():
    # max_blocks of floats or bools were cast to int64 (2.9 -> 2 blocks, True
    # -> 1): a wrong score instead of an error naming the argument.
    from kvhit.coordinator.routing import prefix_blocks

    h = chained_hashes(1, 6)
    fleet = make_fleet([{(0, x) for x in h}, set()])
    batch = HashBatch.from_bytes([h, h[:2]], 8)
    assert prefix_blocks(batch, fleet, [0], 1, [3, 5]).tolist() == [[3, 0], [2, 0]]
    assert prefix_blocks(batch, fleet, np.array([0]), 1,
                         np.array([4, 1], np.uint8)).tolist() == [[4, 0], [1, 0]]  # fmt: skip
    bad = [
        (TypeError, [2.9, 1]),
        (TypeError, [True, 1]),
        (TypeError, np.array([2.9, 1.0])),
        (TypeError, torch.tensor([2.5, 1.0])),
        (TypeError, torch.tensor([True, False])),
        (TypeError, "ab"),
        (TypeError, 3),
        (ValueError, [2**70, 1]),
        (ValueError, [-1, 1]),
        (ValueError, np.array([1, 2, 3])),
        (ValueError, np.array([2**64 - 1, 0], dtype=np.uint64)),
    ]
    for exc, value in bad:
        with pytest.raises(exc, match="max_blocks"):
            prefix_blocks(batch, fleet, [0], 1, value)
    with pytest.raises(TypeError, match="group_ids"):
        prefix_blocks(batch, fleet, 0, 1)


def test_router_path_refuses_what_the_general_path_refuses():
    # The router path (fleet_full_host: type tests, lengths checked inside
    # the kernel) and the general path answer alike and refuse alike: every
    # bad input raises naming the argument, the fleet unchanged; odd but
    # valid inputs (int32, uint64, big-endian, read-only, strided, another
    # backend, removed engines, 70 engines) give the general path's answer.
    layout = make_layout("llama")
    engine = LookupEngine(layout)
    reqs = [chained_hashes(1, 9), chained_hashes(2, 5), [], chained_hashes(1, 3)]
    stores_ = [{(0, h) for h in reqs[(e % 2)][: e % 7]} for e in range(70)]
    fleet = make_fleet(stores_)
    fleet.remove_engine(5)
    ints = [np.array([int.from_bytes(h, "little", signed=True) for h in r],
                     dtype=np.int64) for r in reqs]  # fmt: skip
    batch = HashBatch.from_ints(ints, 8)
    lens = [144, 80, 16, 33]
    before = _snapshot(fleet)
    read_only = np.array(lens)
    read_only.flags.writeable = False
    other = make_fleet(stores_, backend="torch")
    other.remove_engine(5)
    for method, name in ((engine.fleet_hits, "max_lengths"),
                         (engine.fleet_lookup, "num_tokens")):  # fmt: skip
        want = method(batch, lens, fleet).tolist()
        assert not any(row[5] for row in want) and any(row[1] for row in want)
        for value in (np.array(lens, np.int32), np.array(lens, np.uint64),
                      np.array(lens, ">i8"), read_only,
                      np.repeat(np.array(lens), 2)[::2],
                      torch.tensor(np.repeat(np.array(lens), 2))[::2]):  # fmt: skip
            assert method(batch, value, fleet).tolist() == want
        assert method(batch, np.array(lens), other).tolist() == want
        empty = HashBatch.from_ints([], 8)
        assert list(method(empty, np.zeros(0, np.int64), fleet).shape) == [0, 70]
        bad = [
            (ValueError, name, batch, np.array([144, -1, 16, 33]), fleet),
            (ValueError, name, batch, torch.tensor([144, 80, 16, -5]), fleet),
            (ValueError, name, batch, np.array(lens[:3]), fleet),
            (ValueError, name, batch, np.array(lens)[:, None], fleet),
            (ValueError, name, empty, np.zeros(1, np.int64), fleet),
            (TypeError, name, batch, np.array(lens, float), fleet),
            (TypeError, name, batch, np.ones(4, bool), fleet),
            (TypeError, name, batch, [True] * 4, fleet),
            (TypeError, name, batch, torch.tensor(lens, dtype=torch.int32), fleet),
            (TypeError, name, batch, torch.tensor(lens, dtype=torch.float64), fleet),
            (ValueError, name, batch, torch.zeros(4, dtype=torch.int64,
                                                  device="meta"), fleet),
            (TypeError, name, batch, torch.tensor(lens).to_sparse(), fleet),
            (ValueError, name, batch, np.array([2**64 - 1, 0, 0, 0], np.uint64),
             fleet),
            (ValueError, "hash width", batch, np.array(lens), FleetIndex(70, 16)),
            (TypeError, "fleet", batch, np.array(lens), None),
            (TypeError, "batch", reqs, np.array(lens), fleet),
        ]  # fmt: skip
        for exc, match, b, value, f in bad:
            with pytest.raises(exc, match=match):
                method(b, value, f)
            assert _same(before, _snapshot(fleet)), match


def test_router_path_plan_cache_survives_engines_coming_and_going():
    # fleet_full_host caches each plan's kernel parameters by id(plan),
    # holding the plan: engines of two layouts (block 16 / block 32) made
    # and dropped, more than the cache holds, each answering its own rule.
    import gc

    from kvhit import CacheLayout, FullAttention, Group

    h = chained_hashes(3, 8)
    stores_ = [{(0, x) for x in h[:5]}, {(0, x) for x in h}]
    fleet = make_fleet(stores_)
    ints = [np.array([int.from_bytes(x, "little", signed=True) for x in h])]
    batch = HashBatch.from_ints(ints, 8)
    for i in range(70):
        bs = 16 * (1 + i % 2)
        layout = CacheLayout([Group(FullAttention(bs))], bs, 16)
        engine = LookupEngine(layout)
        got = engine.fleet_hits(batch, np.array([128]), fleet).tolist()
        assert got == expected(layout, [h], stores_, [128]), i
        del engine, layout
        if i % 16 == 0:
            gc.collect()
