"""The host store path of KeyIndex.add / add_trusted (numba, numpy views):
the same table, counts and errors as the general path (the torch backend on
the same keys), for every input form it takes and every one it hands back."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.coordinator.fleet_index import FleetIndex
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import HashBatch, num_words


def words(n: int, hash_bytes: int, seed: int, pool: int | None = None) -> np.ndarray:
    """``n`` packed hashes (padding bits zero); drawn from ``pool`` distinct
    ones when given, so that batches repeat keys."""
    rng = np.random.default_rng(seed)
    W = num_words(hash_bytes)
    src = rng.integers(-(2**63), 2**63 - 1, size=(pool or n, W), dtype=np.int64)
    if hash_bytes % 8:
        src[:, -1] &= (1 << (8 * (hash_bytes % 8))) - 1
    return np.ascontiguousarray(src[rng.integers(0, len(src), n)] if pool else src)


def pair(hash_bytes: int, capacity: int) -> tuple[KeyIndex, KeyIndex]:
    return (
        KeyIndex(hash_bytes, capacity=capacity, backend="numba"),
        KeyIndex(hash_bytes, capacity=capacity, backend="torch"),
    )


def key_set(index: KeyIndex) -> set[tuple[int, ...]]:
    g, h = index.keys()
    return {(int(x), *map(int, row)) for x, row in zip(g, h, strict=True)}


def same(a: KeyIndex, b: KeyIndex) -> None:
    # The same keys and counts; slots may differ where keys collide (the
    # torch insert resolves a batch's collisions in another order).
    assert (len(a), a.tombstones, a.capacity) == (len(b), b.tombstones, b.capacity)
    assert key_set(a) == key_set(b)


@settings(max_examples=40, deadline=None)
@given(
    hash_bytes=st.sampled_from([8, 12, 32]),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    pool=st.integers(1, 30),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_host_path_matches_the_general_path(hash_bytes, sizes, pool, groups, seed):
    # Repeats inside a batch and across batches (forced by a small pool),
    # growth (capacity 1 to start), several groups, empty batches.
    fast, ref = pair(hash_bytes, 1)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(sizes):
        h = words(n, hash_bytes, seed + i, pool)
        g = rng.integers(0, groups, n).astype(np.int64)
        forms = [
            (g, h),
            (torch.from_numpy(g), torch.from_numpy(h)),
            (int(g[0]) if n else 0, h.view(np.uint64)),
            (g.tolist(), h),
        ]
        gf, hf = forms[i % len(forms)]
        if i % len(forms) == 2:
            g = np.full(n, gf, dtype=np.int64)
        assert fast.add(gf, hf) == ref.add(g, h)
        same(fast, ref)
        assert fast.add_trusted(torch.from_numpy(g), torch.from_numpy(h)) == 0
        assert fast.add_trusted(g, h) == 0  # numpy on the CPU too
        same(fast, ref)
        assert fast.room() == fast._limit(fast.capacity) - len(fast) - fast.tombstones
        assert fast.has_room_for(fast.room()) and not fast.has_room_for(fast.room() + 1)
    # remove_trusted takes numpy too, and agrees with remove.
    g, h = ref.keys()
    assert fast.remove_trusted(g.numpy(), h.numpy()) == ref.remove(g, h) == len(g)
    same(fast, ref)


def test_host_path_takes_a_hash_batch_slice():
    batch = HashBatch.from_ints([list(range(25)), list(range(100, 130))])
    fast, ref = pair(batch.hash_bytes, 64)
    rows = batch.hashes[25:]
    assert fast.add(7, rows) == ref.add(7, rows) == 30
    assert fast.add(7, batch) == ref.add(7, batch) == 25
    same(fast, ref)


def test_host_path_takes_a_from_ints_batch_without_its_tensors():
    # README's form: a list of group ids and a HashBatch from from_ints. The
    # host path reads the batch's numpy rows; its tensors are never made.
    batch = HashBatch.from_ints([[11, 12, 0, 1]])
    fast, ref = pair(8, 64)
    assert fast.host_keys([0, 1, 0, 1], batch) is not None
    assert fast.add([0, 1, 0, 1], batch) == 4
    assert "hashes" not in vars(batch)
    assert ref.add([0, 1, 0, 1], batch.hashes) == 4
    same(fast, ref)
    # A list of group ids that is not all ints in range goes to the general
    # path, which refuses it naming the argument.
    for bad, error in (([0, True, 0, 0], TypeError), ([0, -1, 0, 0], ValueError)):
        assert fast.host_keys(bad, batch) is None
        with pytest.raises(error, match="group_ids"):
            fast.add(bad, batch)
    same(fast, ref)


@pytest.mark.parametrize(
    ("group_ids", "hashes", "error", "match"),
    [
        (-1, None, ValueError, "group_ids"),
        (True, None, TypeError, "group_ids"),
        (np.array([0, -3]), None, ValueError, "group_ids"),
        (torch.tensor([0, -3]), None, ValueError, "group_ids"),
        (np.array([0, 1, 2]), None, ValueError, "group_ids"),
        (np.array([0.0, 1.0]), None, TypeError, "group_ids"),
        (0, np.zeros((2, 3), dtype=np.int64), ValueError, "hashes"),
        (0, np.zeros((2, 2), dtype=np.int32), TypeError, "hashes"),
        (0, torch.zeros((2, 2), dtype=torch.int32), TypeError, "hashes"),
        (0, np.full((2, 2), -1, dtype=np.int64), ValueError, "padding"),
    ],
)
def test_bad_keys_are_refused_naming_the_argument(group_ids, hashes, error, match):
    index = KeyIndex(12, capacity=16, backend="numba")
    if hashes is None:
        hashes = words(2, 12, 0)
    table = index.table.clone()
    with pytest.raises(error, match=match):
        index.add(group_ids, hashes)
    assert len(index) == 0 and torch.equal(index.table, table)


def test_non_contiguous_keys_take_the_general_path():
    h = words(20, 32, 1)
    fast, ref = pair(32, 64)
    g = np.arange(40, dtype=np.int64)[::2]
    assert fast.add(g, h[::-1]) == ref.add(g.copy(), h[::-1].copy()) == 20
    column_major = torch.from_numpy(h[::-1].copy()).t().contiguous().t()
    assert not column_major.is_contiguous()
    assert fast.add(torch.from_numpy(g), column_major) == 0
    same(fast, ref)


@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))]
)
def test_a_copy_stores_into_its_own_table(clone):
    index = KeyIndex(32, capacity=64, backend="numba")
    index.add(0, words(5, 32, 2))
    other = clone(index)
    other.add(0, words(5, 32, 3))
    assert len(index) == 5 and int((index.table[:, 0] >= 0).sum()) == 5
    assert len(other) == 10 and int((other.table[:, 0] >= 0).sum()) == 10


def test_fleet_store_matches_a_key_index_per_engine():
    fleet = FleetIndex(3, 32, capacity=1)
    per = [KeyIndex(32, capacity=1, backend="torch") for _ in range(3)]
    rng = np.random.default_rng(5)
    for step in range(12):
        n = int(rng.integers(0, 30))
        h = words(n, 32, step, pool=40)
        g = rng.integers(0, 2, n).astype(np.int64)
        e = rng.integers(0, 3, n).astype(np.int64)
        new = sum(per[k].add(g[e == k], h[e == k]) for k in range(3))
        assert fleet.add(e, g, h) == new
        assert fleet.engine_sizes().tolist() == [len(x) for x in per]
    for k in range(3):
        gk, hk = per[k].keys()
        assert bool(fleet.contains(k, gk, hk).all())


def _group_forms(g: np.ndarray) -> list:
    forms = [g, torch.from_numpy(g), g.tolist()]
    if g.shape[0] and (g == g[0]).all():
        forms.append(int(g[0]))
    return forms


def _hash_forms(h: np.ndarray, hash_bytes: int) -> list:
    forms = [h, h.view(np.uint64), torch.from_numpy(h)]
    if hash_bytes == 8:
        forms.append(HashBatch.from_ints([h[:, 0].tolist()]))
    return forms


@pytest.mark.parametrize("hash_bytes", [8, 12, 32])
@pytest.mark.parametrize("uniform", [True, False])
def test_every_input_form_pair_stores_alike(hash_bytes, uniform):
    # Each group-id form with each hash form (tensors read where they lie,
    # numpy arrays, lists, one int for all), repeats forced by a small pool,
    # non-power-of-two sizes: the same keys and counts as the torch backend.
    rng = np.random.default_rng(hash_bytes + uniform)
    for n in (1, 7, 25):
        h = words(n, hash_bytes, n, pool=max(1, n // 2))
        g = (
            np.full(n, 3, dtype=np.int64)
            if uniform
            else rng.integers(0, 3, n).astype(np.int64)
        )
        for gf in _group_forms(g):
            for hf in _hash_forms(h, hash_bytes):
                fast, ref = pair(hash_bytes, 256)
                assert fast.add(gf, hf) == ref.add(g, h) == len(key_set(ref))
                same(fast, ref)
                assert fast.add(gf, hf) == 0  # all present now
                same(fast, ref)


@pytest.mark.parametrize(
    ("group_ids", "hashes", "error", "match"),
    [
        (torch.tensor([0, -3]), "tensor", ValueError, "group_ids"),
        (torch.tensor([0, -3]), "numpy", ValueError, "group_ids"),
        (np.array([-1, 0]), "tensor", ValueError, "group_ids"),
        ([0, -1], "tensor", ValueError, "group_ids"),
        (torch.tensor([0, 1, 2]), "tensor", ValueError, "group_ids"),
        (torch.tensor([0, 1], dtype=torch.int32), "tensor", TypeError, "group_ids"),
        (0, "tensor padded", ValueError, "padding"),
        (torch.tensor([0, 1]), "tensor padded", ValueError, "padding"),
        (np.array([0, 1]), "tensor padded", ValueError, "padding"),
        (torch.tensor([0, 1]), "numpy padded", ValueError, "padding"),
    ],
)
def test_bad_values_in_tensors_are_refused_naming_the_argument(
    group_ids, hashes, error, match
):
    # The checked kernel reads the values before it stores anything: a bad
    # one leaves the table as it was and the general path names it.
    index = KeyIndex(12, capacity=16, backend="numba")
    index.add(5, words(3, 12, 9))
    h = words(2, 12, 0)
    if hashes.endswith("padded"):
        h[1, -1] |= 1 << 40  # a bit past the hash's 12 bytes
    hf = torch.from_numpy(h) if hashes.startswith("tensor") else h
    table, size = index.table.clone(), len(index)
    with pytest.raises(error, match=match):
        index.add(group_ids, hf)
    assert len(index) == size and torch.equal(index.table, table)


def test_a_tensor_view_with_an_offset_is_read_where_it_lies():
    # data_ptr() of a row slice points past the storage's start.
    h = torch.from_numpy(words(30, 32, 4))
    g = torch.arange(30, dtype=torch.int64)
    fast, ref = pair(32, 128)
    assert fast.add(g[10:], h[10:]) == ref.add(g[10:].clone(), h[10:].clone()) == 20
    assert fast.add(7, h[3:5]) == ref.add(7, h[3:5].clone()) == 2
    same(fast, ref)
