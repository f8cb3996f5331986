"""``LookupEngine.find_hit_list``: a router's step from its Python lists.

Its answer is ``find_longest_cache_hit(HashBatch.from_ints(...)).hit_list(
block_size)``'s, on every backend; on the numba backend a list of lists of
ints takes the lists runner (``kernels/scan_numba_lists.py``), which must
give that answer bit for bit and refuse, for the general path to name,
everything that path refuses.
"""

from __future__ import annotations

import enum
import os

import numpy as np
import pytest
import torch
from helpers import (
    BAD_INT_LENGTHS,
    BAD_INT_REQUESTS,
    LENGTH_FORMS,
    full_mamba_eagle_layout,
    merged_swa_eagle_layout,
    raised,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import HashBatch, KeyIndex, LookupEngine
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.backend import RUN_FIND, RUN_FIND_EAGLE
from kvhit.kernels import scan_numba_lists
from kvhit.kernels.scan_numba_lists import ONE, REFUSED, lists_hits

EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "40"))

_LAYOUTS = [
    full_mamba_eagle_layout,
    merged_swa_eagle_layout,
    lambda: make_layout("gemma3"),
    lambda: make_layout("llama"),
]
# Hash ids as a router reads them: raw trace ids (0 and 1 included), and
# 64-bit hashes of either sign, with collisions between requests.
_IDS = st.one_of(st.integers(0, 40), st.integers(-(2**63), 2**63 - 1))


def _general(engine, reqs, lens, index, eagle, block_size):
    """The documented equivalent, through the general path (from_bytes)."""
    batch = HashBatch.from_bytes(
        [[v.to_bytes(8, "little", signed=True) for v in r] for r in reqs], 8
    )
    return engine.find_longest_cache_hit(batch, lens, index, eagle).hit_list(block_size)


def _runner(engine, index):
    """The backend's lists runner for ``index`` (the protocol's method)."""
    return engine.impl.lists_runner(index)


@pytest.mark.parametrize("layout_fn", _LAYOUTS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data())
def test_steps_equal_the_general_path(layout_fn, data) -> None:
    layout = layout_fn()
    bs = layout.hash_block_size
    engine = LookupEngine(layout, backend="numba")
    reference = LookupEngine(layout, backend="reference")
    index = KeyIndex(8, capacity=4)  # grows (a new table) as keys come
    stored = data.draw(st.lists(_IDS, max_size=40))
    for step in range(3):
        reqs = data.draw(st.lists(st.lists(_IDS, max_size=30), max_size=7))
        lens = [data.draw(st.integers(0, bs * (len(r) + 2))) for r in reqs]
        eagle = data.draw(st.booleans())
        block_size = data.draw(st.sampled_from([1, 2, bs, 3 * bs + 1, 2**63 - 1]))
        want = _general(engine, reqs, lens, index, eagle, block_size)
        assert reference.find_hit_list(reqs, lens, index, eagle, block_size) == want
        for form in LENGTH_FORMS:
            got = engine.find_hit_list(reqs, form(lens), index, eagle, block_size)
            assert got == want and all(type(h) is int for h in got)
        # The runner took the step itself (not the general path after it).
        mode = RUN_FIND_EAGLE if eagle else RUN_FIND
        run = _runner(engine, index)
        assert run(reqs, lens, index.table_view, mode, block_size) == want
        for g in range(layout.num_groups):
            index.add(g, HashBatch.from_ints([stored[: 12 * (step + 1)]]))


@pytest.mark.parametrize("threads", [True, False, None])
def test_threads_setting_and_every_store(threads) -> None:
    layout = merged_swa_eagle_layout()
    engine = LookupEngine(layout, backend="numba")
    engine.impl.parallel = threads
    reqs = [list(range(k, k + 40)) for k in range(0, 30, 3)] + [[], [7]]
    lens = [16 * len(r) for r in reqs]
    empty = KeyIndex(8)
    full = KeyIndex(8)
    for g in range(layout.num_groups):
        full.add(g, HashBatch.from_ints(reqs))
    for index in (empty, full):
        want = _general(engine, reqs, lens, index, True, 16)
        assert engine.find_hit_list(reqs, lens, index, block_size=16) == want
        assert engine.find_hit_list(reqs, lens, index, block_size=16) == want
    assert engine.find_hit_list([], [], full) == []
    assert engine.find_hit_list([], np.zeros(0, np.int64), full) == []
    assert engine.find_hit_list([[]], [0], full) == [0]
    with pytest.raises(ValueError, match="max_lengths"):
        engine.find_hit_list([], [16], full)


def test_threads_by_keys_not_by_message_bytes() -> None:
    # 64-bit hashes take 9 bytes each: a message past PARALLEL_MIN_HASHES
    # bytes with fewer keys is still one serial call (the runner's), and
    # a step the launcher would thread goes the general way (where numba
    # has threads).
    import numba

    from kvhit.kernels import scan_numba

    engine = LookupEngine(make_layout("llama"), backend="numba")
    index = KeyIndex(8)
    assert engine.find_hit_list([[1]], [16], index) == [0]
    runner = _runner(engine, index)
    n = scan_numba.PARALLEL_MIN_HASHES // 8
    big = [[(1 << 62) + k for k in range(n)], [(1 << 61) + k for k in range(n)]]
    lens = [16 * n, 16 * n]
    assert runner(big, lens, index.table_view, RUN_FIND, 1) == [0, 0]
    huge = big * 5
    got = runner(huge, lens * 5, index.table_view, RUN_FIND, 1)
    assert (got is None) == (numba.config.NUMBA_NUM_THREADS > 1)
    assert engine.find_hit_list(huge, lens * 5, index) == [0] * 10


def test_other_forms_take_the_general_path() -> None:
    layout = full_mamba_eagle_layout()
    engine = LookupEngine(layout, backend="numba")
    index = KeyIndex(8)
    for g in range(layout.num_groups):
        index.add(g, HashBatch.from_ints([[1, 2, 3, 0]]))
    lens = [64, 64]
    reqs = [[1, 2, 3, 0, 9], [5]]
    want = _general(engine, reqs, lens, index, True, 1)
    assert want[0] > 0

    class Small(enum.IntEnum):
        ONE = 1

    for form in (
        reqs,
        [np.array(r, np.int64) for r in reqs],
        [np.array(r, np.uint32) for r in reqs],
        [torch.tensor(r) for r in reqs],
        [tuple(r) for r in reqs],
        [[np.int64(v) for v in r] for r in reqs],
        (reqs[0], reqs[1]),
        HashBatch.from_ints(reqs),
    ):
        assert engine.find_hit_list(form, lens, index) == want, form
    # Lengths the runner leaves to host_lengths: numpy ints, an IntEnum.
    assert engine.find_hit_list(reqs, [np.int64(64), 64], index) == want
    assert engine.find_hit_list(reqs[1:], [Small.ONE], index) == [0]
    # A 16-byte index: the general path packs with its width.
    wide = KeyIndex(16)
    wide.add(0, HashBatch.from_ints([[1, 2, 3, 0]], 16))
    wide.add(1, HashBatch.from_ints([[1, 2, 3, 0]], 16))
    got = engine.find_longest_cache_hit(HashBatch.from_ints(reqs, 16), lens, wide)
    assert engine.find_hit_list(reqs, lens, wide, block_size=16) == got.hit_list(16)
    assert got.hit_list()[0] > 0
    # Every other backend: the general path.
    for backend in ("torch", "reference"):
        other = LookupEngine(layout, backend=backend)
        assert other.find_hit_list(reqs, lens, index) == want


def test_apply_eagle_is_read_as_the_general_path_reads_it() -> None:
    engine = LookupEngine(full_mamba_eagle_layout(), backend="numba")
    index = KeyIndex(8)
    for g in range(2):
        index.add(g, HashBatch.from_ints([[1, 2, 3, 4]]))
    engine.find_hit_list([[1, 2]], [32], index)  # the runner held from here
    assert _runner(engine, index) is not None
    reqs, lens = [[1, 2, 3, 4, 5]], [80]
    for eagle in (1, 0, np.bool_(True), [], [0]):
        want = _general(engine, reqs, lens, index, bool(eagle), 1)
        assert engine.find_hit_list(reqs, lens, index, eagle) == want
    # A value whose truth raises: the bad request is named first, as
    # from_ints names it before find_longest_cache_hit reads apply_eagle.
    with pytest.raises(TypeError, match="request 0, position 1"):
        engine.find_hit_list([[1, "x"]], lens, index, np.array([1, 2]))


def test_a_cold_engine_makes_its_runner_on_the_first_step() -> None:
    engine = LookupEngine(make_layout("llama"), backend="numba", warm=False)
    index = KeyIndex(8, warm=False)
    index.add(0, HashBatch.from_ints([[5, 6, 7]]))
    want = _general(engine, [[5, 6, 9]], [48], index, True, 16)
    assert engine.find_hit_list([[5, 6, 9]], [48], index, True, 16) == want
    run = _runner(engine, index)
    assert run is not None
    assert run([[5, 6, 9]], [48], index.table_view, RUN_FIND_EAGLE, 16) == want


@pytest.mark.parametrize("block_size", [0, -1, 1 << 63, 2.0, True, None, "4"])
def test_a_bad_block_size_is_named_before_any_work(block_size) -> None:
    engine = LookupEngine(full_mamba_eagle_layout(), backend="numba")
    index = KeyIndex(8)
    with pytest.raises((TypeError, ValueError), match="block_size"):
        engine.find_hit_list([[1]], [16], index, block_size=block_size)
    # Even with requests that would be refused: the block size first.
    with pytest.raises((TypeError, ValueError), match="block_size"):
        engine.find_hit_list([[True]], [16], index, block_size=block_size)
    assert engine.find_hit_list([[1]], [16], index, block_size=np.int64(4)) == [0]


@pytest.mark.parametrize("bad", BAD_INT_REQUESTS, ids=repr)
def test_bad_requests_raise_what_the_general_path_raises(bad) -> None:
    engine = LookupEngine(full_mamba_eagle_layout(), backend="numba")
    index = KeyIndex(8)
    # A first good step: the engine holds the index's runner from here on.
    assert engine.find_hit_list([[1, 2]], [32], index) == [0]
    assert _runner(engine, index) is not None
    lens = [32] * (len(bad) if isinstance(bad, list) else 1)

    def general():
        batch = HashBatch.from_ints(bad)
        return engine.find_longest_cache_hit(batch, lens, index).hit_list()

    assert raised(lambda: engine.find_hit_list(bad, lens, index)) == raised(general)


@pytest.mark.parametrize("bad", BAD_INT_LENGTHS, ids=repr)
def test_bad_lengths_raise_what_the_general_path_raises(bad) -> None:
    engine = LookupEngine(full_mamba_eagle_layout(), backend="numba")
    index = KeyIndex(8)
    assert engine.find_hit_list([[1, 2]], [32], index) == [0]
    one = [[1, 2, 3]]

    def general():
        batch = HashBatch.from_ints(one)
        return engine.find_longest_cache_hit(batch, bad, index).hit_list()

    got = raised(lambda: engine.find_hit_list(one, bad, index))
    assert got == raised(general)
    assert "max_lengths" in got[1]


def test_the_index_is_checked() -> None:
    engine = LookupEngine(full_mamba_eagle_layout(), backend="numba")
    index = KeyIndex(8)
    assert engine.find_hit_list([[1]], [16], index) == [0]

    class Narrow:
        hash_bytes = 4

    # The index is named before the requests (from_ints would read its
    # width), whatever else is wrong.
    for bad in ({1: 2}, None, Narrow()):
        for reqs in ([[1]], [[1, "x"]], [[1 << 40]]):
            with pytest.raises(TypeError, match="index must be a KeyIndex"):
                engine.find_hit_list(reqs, [16], bad)
    # A new table (the index grew) is checked again, then answered.
    for g in range(2):
        index.add(g, HashBatch.from_ints([list(range(1, 200))]))
    assert engine.find_hit_list([[1, 2, 3]], [48], index) == [32]


# -- the kernel itself ---------------------------------------------------------


def _plan():
    from kvhit.coordinator.plan import ScanPlan, plan_tensors
    from kvhit.kernels.scan_numba import prepare_scan

    plan = ScanPlan.from_layout(make_layout("llama"))
    sg, cand = plan_tensors(plan, "cpu")
    return prepare_scan(sg.numpy(), cand.numpy(), plan.params).one


@pytest.mark.parametrize(
    "msg",
    [
        b"",  # nothing
        b"\x91\x90",  # one list: no lengths list
        b"\x92\x91\x01\x92\x10\x10",  # two lengths for one request
        b"\x92\x91\x01\x90",  # no length for one request
        b"\x92\x91\x01\x91\xff",  # a negative length
        b"\x92\x91\xc3\x91\x10",  # a bool as a key
        b"\x92\x91\x01\x91\xc2",  # a bool as a length
        b"\x92\x91\xcf\x80\x00\x00\x00\x00\x00\x00\x00\x91\x10",  # past int64
        b"\x92\x91\x01\x91\x10\x00",  # a byte past the end
        b"\x92\x91\x01\x91",  # cut short
        b"\x93\x91\x01\x91\x10\x91\x10",  # three lists for one request
    ],
)
def test_the_kernel_refuses_what_it_does_not_take(msg) -> None:
    table = np.full((8, 2), -1, np.int64)
    hit = np.full(1, 99, np.int64)
    assert lists_hits(msg, table, _plan(), 0, 1, hit) == REFUSED


def test_the_kernel_answers_a_step() -> None:
    plan = _plan()
    index = KeyIndex(8)
    index.add(0, HashBatch.from_ints([[0, 1, 2]]))
    table = index.table_view
    # [[0, 1, 2, 3], [1], []] at [64, 16, 0], then the lengths.
    msg = b"\x94\x94\x00\x01\x02\x03\x91\x01\x90\x93\x40\x10\x00"
    hit = np.empty(3, np.int64)
    assert lists_hits(msg, table, plan, 0, 1, hit) == 3
    assert hit.tolist() == [48, 16, 0]
    assert lists_hits(msg, table, plan, 0, 16, hit) == 3
    assert hit.tolist() == [3, 1, 0]
    # A step of one request, its hit returned ([[0, 1, 2, 3]] at 64).
    one = b"\x92\x94\x00\x01\x02\x03\x91\x40"
    assert lists_hits(one, table, plan, 0, 1, ONE) == 48
    assert lists_hits(one, table, plan, 0, 16, ONE) == 3
    assert lists_hits(msg, table, plan, 0, 1, ONE) == REFUSED  # three requests
    assert ONE.shape == (0,)


def test_warm_up_loads_the_kernel() -> None:
    scan_numba_lists.warm_up(_plan())
    assert lists_hits.signatures
    assert scan_numba_lists.lists_entry() is not lists_hits
