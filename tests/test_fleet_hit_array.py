"""``LookupEngine.fleet_hit_array``: a router's fleet step from its Python lists.

Its answer is ``fleet_hits(HashBatch.from_ints(...)).numpy() // block_size``
on every backend; on a numba fleet a list of lists of ints takes the lists
kernel (``kernels/fleet_numba.full_lists_hits``, through
``FleetIndex.router_lists``), which must give that answer bit for bit and
refuse, for the general path to name, everything that path refuses.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import (
    BAD_INT_LENGTHS,
    BAD_INT_REQUESTS,
    LENGTH_FORMS,
    make_fleet,
    merged_full_layout,
    raised,
)
from helpers import fleet_expected as expected
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import fleet_case, full_fleet_case

from kvhit import CacheLayout, FleetIndex, FullAttention, Group, HashBatch, LookupEngine
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.fleet_index import state_checksum
from kvhit.kernels.contract import EMPTY
from kvhit.kernels.fleet_numba import LISTS_REFUSED, full_lists_hits

EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "40"))


def _ints(requests):
    """8-byte hashes as the ints ``from_ints`` packs into them."""
    return [[int.from_bytes(h, "little", signed=True) for h in r] for r in requests]


def _check(data, block_size, apply_eagle, fast):
    layout, requests, stores_, lens = data
    engine = LookupEngine(layout, backend="numba")
    fleet = make_fleet(stores_)
    want = np.array(
        expected(layout, requests, stores_, lens, apply_eagle), dtype=np.int64
    ).reshape(len(requests), len(stores_))
    want //= block_size
    reqs = _ints(requests)
    for form in LENGTH_FORMS:
        got = engine.fleet_hit_array(reqs, form(lens), fleet, apply_eagle, block_size)
        assert got.dtype == np.int64 and np.array_equal(got, want)
    direct = fleet.router_lists(engine, reqs, lens, apply_eagle, block_size)
    if fast:
        # The kernel took the step itself (not the general path after it).
        assert direct is not None
    if direct is not None:
        assert np.array_equal(direct, want)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    data=full_fleet_case(),
    eagle=st.booleans(),
    block_size=st.sampled_from([1, 2, 16, 49, 2**63 - 1]),
)
def test_full_attention_equals_the_reference(data, eagle, block_size):
    # Mostly the lists kernel (one non-fine full SpecGroup).
    _check(data, block_size, eagle, fast=False)


@settings(max_examples=max(EXAMPLES // 2, 10), deadline=None)
@given(data=fleet_case(), eagle=st.booleans(), block_size=st.sampled_from([1, 3]))
def test_every_layout_equals_the_reference(data, eagle, block_size):
    # Hybrid layouts: the general path, the same answer.
    _check(data, block_size, eagle, fast=False)


@pytest.mark.parametrize("num_engines", [1, 3, 64, 70])
def test_the_kernel_answers_full_attention(num_engines):
    layout = make_layout("llama")  # Full 16, hash 16
    rng = np.random.default_rng(num_engines)
    # Chains sharing prefixes, with raw ids 0 and 1 and both signs.
    reqs = [[0, 1, *rng.integers(-(2**63), 2**63 - 1, k).tolist()] for k in range(9)]
    reqs += [[], [5], reqs[8][:4] + [7]]
    stores_ = [
        {(0, v.to_bytes(8, "little", signed=True)) for r in reqs[e % 9 :: 3] for v in r}
        for e in range(num_engines)
    ]
    lens = [16 * len(r) + int(rng.integers(0, 20)) for r in reqs]
    requests = [[v.to_bytes(8, "little", signed=True) for v in r] for r in reqs]
    for eagle in (True, False):
        for bs in (1, 16):
            _check((layout, requests, stores_, lens), bs, eagle, fast=True)
    # A merged full SpecGroup (two member groups) takes the kernel too.
    merged = merged_full_layout()
    stores_ = [{(g, h) for _, h in s for g in (0, 1)} for s in stores_]
    _check((merged, requests, stores_, lens), 1, True, fast=True)


def test_other_forms_and_fleets_take_the_general_path():
    layout = make_layout("llama")
    engine = LookupEngine(layout, backend="numba")
    stores_ = [{(0, v.to_bytes(8, "little", signed=True)) for v in (1, 2, 3, 0)}, set()]
    fleet = make_fleet(stores_)
    reqs, lens = [[1, 2, 3, 0, 9], [5]], [64, 64]
    want = np.array([[64, 0], [0, 0]])
    assert np.array_equal(engine.fleet_hit_array(reqs, lens, fleet, False), want)
    for form in (
        [np.array(r, np.int64) for r in reqs],
        [torch.tensor(r) for r in reqs],
        [tuple(r) for r in reqs],
        [[np.int64(v) for v in r] for r in reqs],
        (reqs[0], reqs[1]),
        HashBatch.from_ints(reqs),
    ):
        got = engine.fleet_hit_array(form, lens, fleet, False)
        assert np.array_equal(got, want), form
        assert fleet.router_lists(engine, form, lens, False, 1) is None
    assert fleet.router_lists(engine, reqs, [np.int64(64), 64], False, 1) is None
    assert np.array_equal(
        engine.fleet_hit_array(reqs, [np.int64(64), 64], fleet, False), want
    )
    # A 16-byte fleet packs with its width; a torch fleet has no lists kernel.
    wide = FleetIndex(2, 16)
    wide.add(0, [0] * 4, [v.to_bytes(16, "little", signed=True) for v in (1, 2, 3, 0)])
    torch_fleet = make_fleet(stores_, backend="torch")
    for other in (wide, torch_fleet):
        assert other.router_lists(engine, reqs, lens, False, 1) is None
        assert np.array_equal(engine.fleet_hit_array(reqs, lens, other, False), want)
    # A hybrid layout: the general path, whatever the fleet.
    hybrid = LookupEngine(make_layout("gemma3"), backend="numba")
    assert fleet.router_lists(hybrid, reqs, lens, True, 1) is None
    got = hybrid.fleet_hit_array(reqs, lens, fleet)
    assert np.array_equal(
        got, hybrid.fleet_hits(HashBatch.from_ints(reqs), lens, fleet)
    )
    # No request; every engine removed.
    assert engine.fleet_hit_array([], [], fleet).shape == (0, 2)
    fleet.remove_engine(0)
    assert not engine.fleet_hit_array(reqs, lens, fleet).any()
    # Other engine backends answer alike.
    for backend in ("torch", "reference"):
        other = LookupEngine(layout, backend=backend)
        assert not other.fleet_hit_array(reqs, lens, fleet).any()


def _fleet_and_engine():
    engine = LookupEngine(make_layout("llama"), backend="numba")
    fleet = make_fleet([{(0, (1).to_bytes(8, "little"))}, set()])
    # A first good step: the compiled call is held from here on.
    assert np.array_equal(engine.fleet_hit_array([[1, 2]], [32], fleet), [[16, 0]])
    return engine, fleet


@pytest.mark.parametrize("bad", BAD_INT_REQUESTS, ids=repr)
def test_bad_requests_raise_what_the_general_path_raises(bad):
    engine, fleet = _fleet_and_engine()
    before = state_checksum(fleet.state_dict())
    lens = [32] * (len(bad) if isinstance(bad, list) else 1)

    def general():
        return engine.fleet_hits(HashBatch.from_ints(bad), lens, fleet)

    assert raised(lambda: engine.fleet_hit_array(bad, lens, fleet)) == raised(general)
    assert state_checksum(fleet.state_dict()) == before


@pytest.mark.parametrize("bad", BAD_INT_LENGTHS, ids=repr)
def test_bad_lengths_raise_what_the_general_path_raises(bad):
    engine, fleet = _fleet_and_engine()
    one = [[1, 2, 3]]

    def general():
        return engine.fleet_hits(HashBatch.from_ints(one), bad, fleet)

    got = raised(lambda: engine.fleet_hit_array(one, bad, fleet))
    assert got == raised(general)
    assert "max_lengths" in got[1]


@pytest.mark.parametrize("block_size", [0, -1, 1 << 63, 2.0, True, None, "4"])
def test_a_bad_block_size_or_fleet_is_named_before_any_work(block_size):
    engine, fleet = _fleet_and_engine()
    for reqs in ([[1]], [[True]]):
        with pytest.raises((TypeError, ValueError), match="block_size"):
            engine.fleet_hit_array(reqs, [16], fleet, block_size=block_size)
    got = engine.fleet_hit_array([[1]], [16], fleet, block_size=np.int64(4))
    assert np.array_equal(got, [[4, 0]])
    for bad in (None, object(), engine):
        with pytest.raises(TypeError, match="fleet must be a FleetIndex"):
            engine.fleet_hit_array([[True]], [16], bad)


def test_apply_eagle_is_read_as_the_general_path_reads_it():
    layout = make_layout("llama")
    engine = LookupEngine(layout, backend="numba")
    keys = [(0, v.to_bytes(8, "little")) for v in (1, 2, 3)]
    fleet = make_fleet([keys])
    eagle = LookupEngine(
        CacheLayout([Group(FullAttention(16))], 16, 16, use_eagle=True),
        backend="numba",
    )
    reqs, lens = [[1, 2, 3, 4]], [64]
    for value in (1, 0, np.bool_(True), [], [0]):
        want = eagle.fleet_hits(HashBatch.from_ints(reqs), lens, fleet, bool(value))
        got = eagle.fleet_hit_array(reqs, lens, fleet, value)
        assert np.array_equal(got, want.numpy())
    assert engine.fleet_hit_array(reqs, lens, fleet)[0, 0] == 48


def _params(num_engines=1):
    params = np.array([1, 1, 16, 16, 0, 0, num_engines], dtype=np.int64)
    params.flags.writeable = False
    members = np.zeros(1, dtype=np.int64)
    members.flags.writeable = False
    return members, params


@pytest.mark.parametrize(
    "msg",
    [
        b"",
        b"\x90",  # no lengths list
        b"\x92\x91\xc3\x91\x10",  # a bool key
        b"\x92\x91\x01\x91\xca\x00\x00\x00\x00",  # a float length
        b"\x92\x91\x01\x92\x10\x10",  # two lengths for one request
        b"\x92\x91\x01\x91\xff",  # a negative length
        b"\x92\x91\xcf\x80\x00\x00\x00\x00\x00\x00\x00\x91\x10",  # past int64
        b"\x92\x01\x91\x10",  # a request that is not a list
    ],
)
def test_the_kernel_refuses_what_it_does_not_take(msg):
    table = np.zeros((4, 3), dtype=np.int64)
    table[:, 0] = EMPTY
    members, params = _params()
    b, out = full_lists_hits(msg, table, members, np.ones(1, np.int64), params, 1)
    assert b == LISTS_REFUSED and out.shape == (0, 0)


def test_a_cold_fleet_loads_the_kernel_on_its_first_step():
    engine = LookupEngine(make_layout("llama"), backend="numba", warm=False)
    fleet = FleetIndex(2, 8, warm=False)
    fleet.add(1, [0, 0], [(5).to_bytes(8, "little"), (6).to_bytes(8, "little")])
    got = engine.fleet_hit_array([[5, 6, 9]], [48], fleet, True, 16)
    assert np.array_equal(got, [[0, 2]])
    assert fleet.router_lists(engine, [[5, 6, 9]], [48], True, 16) is not None
