"""KeyIndex.add's inline host path (the forms a router stores, checked in
``add`` itself) against the torch backend, which never takes it: the same
counts and the same keys for every form, and every refusal still raised
naming the argument, with the index unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.coordinator.key_index import KeyIndex, ReadOnlyIndexError
from kvhit.coordinator.packing import HashBatch


def _keys(index: KeyIndex) -> set[tuple[int, tuple[int, ...]]]:
    g, h = index.keys()
    return {(int(a), tuple(int(x) for x in b)) for a, b in zip(g, h, strict=True)}


def _forms(g: np.ndarray, h: np.ndarray, one: int | None) -> list[tuple]:
    """Every form of the same keys (``one``: the group id of every key, or
    None when they differ)."""
    ht = torch.from_numpy(h.copy())
    out = [
        (torch.from_numpy(g.copy()), ht),
        (g.copy(), h.copy()),
        (torch.from_numpy(g.copy()), h.copy()),
        (g.copy(), ht),
        (g.tolist(), ht),
        (g.tolist(), h.copy()),
        (g.copy(), h.view(np.uint64)),
    ]
    if one is not None:
        out += [(one, ht), (one, h.copy())]
    return out


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    W=st.sampled_from([1, 4]),
    same=st.booleans(),
    reuse=st.integers(0, 40),
    seed=st.integers(0, 2**31),
)
def test_inline_forms_match_torch(n, W, same, reuse, seed) -> None:  # noqa: N803
    """Batches with repeats inside and keys already present, in every form,
    at sizes around the growth limit (capacity 64: some batches must rehash,
    which the inline path leaves to the general one)."""
    rng = np.random.default_rng(seed)
    hash_bytes = 8 * W
    ref = KeyIndex(hash_bytes, capacity=64, backend="torch")
    idx = {k: KeyIndex(hash_bytes, capacity=64) for k in range(9)}
    pool_h = rng.integers(-(2**63), 2**63 - 1, size=(n + reuse, W), dtype=np.int64)
    pool_g = rng.integers(0, 3, size=n + reuse, dtype=np.int64)
    for step in range(3):
        pick = rng.integers(0, n + reuse, size=n)
        h, g = pool_h[pick], pool_g[pick]
        if same:
            g = np.full(n, step, dtype=np.int64)
        want = ref.add(torch.from_numpy(g.copy()), torch.from_numpy(h.copy()))
        for k, (fg, fh) in enumerate(_forms(g, h, step if same else None)):
            assert idx[k].add(fg, fh) == want, (step, k)
            assert len(idx[k]) == len(ref)
    for k in range(len(_forms(g, h, 0 if same else None))):
        assert _keys(idx[k]) == _keys(ref)


@pytest.mark.parametrize("form", ["tensor", "numpy", "int-tensor", "int-numpy"])
def test_inline_refusals_change_nothing(form: str) -> None:
    """A negative group id, a set padding bit, a bool, a float tensor, a
    non-contiguous tensor or array: refused as before (or converted), the
    index unchanged where refused."""
    idx = KeyIndex(5, capacity=64)  # hash_bytes 5: 24 padding bits
    h = np.arange(1, 5, dtype=np.int64).reshape(4, 1)
    g = np.zeros(4, dtype=np.int64)

    def call(gv, hv):
        if form == "tensor":
            return idx.add(torch.from_numpy(np.array(gv)), torch.from_numpy(hv))
        if form == "numpy":
            return idx.add(np.array(gv), hv)
        if form == "int-tensor":
            return idx.add(int(gv[0]), torch.from_numpy(hv))
        return idx.add(int(gv[0]), hv)

    with pytest.raises(ValueError, match="group_ids"):
        call(g - 1, h)
    bad = h.copy()
    bad[2, 0] |= 1 << 50
    with pytest.raises(ValueError, match="padding"):
        call(g, bad)
    assert len(idx) == 0 and int((idx.table[:, 0] >= 0).sum()) == 0
    with pytest.raises(TypeError, match="group_ids"):
        idx.add(True, torch.from_numpy(h))
    with pytest.raises(TypeError, match="hashes"):
        idx.add(0, torch.from_numpy(h).double())
    assert len(idx) == 0
    # Non-contiguous rows are read as their values, not their memory.
    wide = np.zeros((4, 2), dtype=np.int64)
    wide[:, 0] = h[:, 0]
    assert call(g, wide[:, :1]) == 4
    assert _keys(idx) == {(0, (v,)) for v in range(1, 5)}


def test_inline_plan_follows_the_table() -> None:
    """Growth, adopt(), clear(), a fixed table's purge and to() replace or
    keep the table: each add after them writes into the live one."""
    idx = KeyIndex(8, capacity=16)
    rows = torch.arange(1, 200, dtype=torch.int64).reshape(-1, 1)
    assert idx.add(0, rows[:5]) == 5
    assert idx.add(torch.zeros(100, dtype=torch.int64), rows[:100]) == 95  # grows
    grown = idx.grown_for(500)
    idx.adopt(grown)
    assert idx.add(0, rows[100:150].numpy()) == 50
    assert len(idx) == 150 and idx.contains(0, rows[:150]).all()
    with pytest.raises(ReadOnlyIndexError):
        grown.add(0, rows[:1])
    idx.clear()
    assert idx.add(0, rows[:10]) == 10 and len(idx) == 10
    fixed = KeyIndex(8, capacity=32, growable=False)
    fixed.add(0, rows[:16])
    fixed.remove(0, rows[:8])
    assert fixed.add(0, rows[16:24]) == 8  # purges tombstones in place
    assert fixed.contains(0, rows[8:24]).all() and len(fixed) == 16
    ro = KeyIndex.from_table(idx.table, 8)
    with pytest.raises(ReadOnlyIndexError):
        ro.add(0, rows[:1])
    t = KeyIndex(8, capacity=16, backend="torch")
    assert t.add(0, rows[:3]) == 3


def test_inline_hash_batch_and_single_key() -> None:
    """A HashBatch's rows and one key take the host forms too."""
    idx = KeyIndex(8)
    batch = HashBatch.from_ints([[5, 6, 7]])
    assert idx.add(0, batch) == 3
    assert idx.add(torch.zeros(1, dtype=torch.int64), torch.tensor([[5]])) == 0
    assert idx.add(1, np.array([[5]], dtype=np.int64)) == 1
    assert len(idx) == 4
