"""KeyIndex: parity of torch and triton backends with a Python set.

Triton runs under the interpreter on CPU (conftest sets TRITON_INTERPRET), so
triton cases stay at a few hundred keys and few hypothesis examples.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import compile_outside_interpreter
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.coordinator.key_index import (
    _HASH_CONSTANTS,
    EMPTY,
    TOMBSTONE,
    KeyIndex,
    find_slots,
    new_table,
    probe_table,
    slot_hash,
)
from kvhit.coordinator.packing import num_words, pack_hashes, unpack_hashes
from kvhit.kernels import hash_index  # tests may import triton; coordinator/ may not

BACKENDS = ["torch", "triton"]
WIDTHS = [8, 12, 16, 32]

Key = tuple[int, bytes]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def _kernels():
    return hash_index


def _rand_keys(
    rng: np.random.Generator, n: int, hash_bytes: int, groups: int = 4
) -> list[Key]:
    return [(int(rng.integers(groups)), rng.bytes(hash_bytes)) for _ in range(n)]


def _split(
    keys: list[Key], hash_bytes: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.tensor([k[0] for k in keys], dtype=torch.int64, device=device)
    h = pack_hashes([k[1] for k in keys], hash_bytes).to(device)
    return g, h


def _adversarial(rng: np.random.Generator, hash_bytes: int) -> list[Key]:
    """Keys that differ in as little as possible from each other."""
    base = bytearray(rng.bytes(hash_bytes))
    keys: list[Key] = [(0, bytes(base))]
    # Differ only in the group.
    keys += [(g, bytes(base)) for g in (1, 2, 7, (1 << 62) + 3)]
    # Differ only in the last byte (the partially used word for odd widths).
    for delta in (1, 2, 0x80, 0xFF):
        v = bytearray(base)
        v[-1] ^= delta
        keys.append((0, bytes(v)))
    # Differ only in the first byte (low bits of word 0).
    v = bytearray(base)
    v[0] ^= 1
    keys.append((0, bytes(v)))
    # Equal trailing words, differing only in the sign bit of word 0.
    if hash_bytes >= 16:
        v = bytearray(base)
        v[7] ^= 0x80
        keys.append((0, bytes(v)))
    # All zeros / all ones, which equal the words of EMPTY slots.
    keys += [(0, bytes(hash_bytes)), (1, bytes(hash_bytes)), (0, b"\xff" * hash_bytes)]
    return keys


def _colliding(hash_bytes: int, capacity: int, n: int, seed: int = 0) -> list[Key]:
    """n distinct keys with the same home slot in a table of ``capacity``."""
    rng = np.random.default_rng(seed)
    cand = _rand_keys(rng, 64 * capacity, hash_bytes, groups=2)
    g, h = _split(cand, hash_bytes, "cpu")
    home = slot_hash(g, h) & (capacity - 1)
    target = int(torch.bincount(home).argmax())
    picked = [cand[i] for i in (home == target).nonzero().squeeze(1).tolist()]
    picked = list(dict.fromkeys(picked))
    assert len(picked) >= n
    return picked[:n]


def _check_against(index: KeyIndex, universe: list[Key], present: set[Key]) -> None:
    got = index.contains(*_split(universe, index.hash_bytes, index.device))
    assert got.dtype == torch.bool and got.device == index.device
    assert got.tolist() == [k in present for k in universe]
    assert len(index) == len(present)
    assert index._size + index.tombstones <= index.max_load * index.capacity
    # The stored key set is exactly the reference set.
    g, h = index.keys()
    stored = set(zip(g.tolist(), unpack_hashes(h, index.hash_bytes), strict=True))
    assert stored == present
    assert g.numel() == len(present)  # no key stored twice


@triton.jit
def _hash_kernel(gid_ptr, key_ptr, out_ptr, n, W: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
    # Another kernel calling the exported device function, as the engine will.
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n
    gids = tl.load(gid_ptr + rows, mask=valid, other=0)
    tl.store(
        out_ptr + rows, hash_index.slot_hash(gids, key_ptr, rows, valid, W), mask=valid
    )


@triton.jit
def _probe_via_device_fn(
    table_ptr,
    cap_mask,
    gid_ptr,
    key_ptr,
    out_ptr,
    n,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):  # noqa: N803
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n
    gids = tl.load(gid_ptr + rows, mask=valid, other=0)
    hit = hash_index.probe_keys(table_ptr, cap_mask, gids, key_ptr, rows, valid, W)
    tl.store(out_ptr + rows, hit.to(tl.int8), mask=valid)


# -- slot hash --------------------------------------------------------------


def test_hash_constants_match_kernels() -> None:
    assert _kernels().HASH_CONSTANTS == _HASH_CONSTANTS


@pytest.mark.parametrize("W", [1, 2, 4, 5])
def test_slot_hash_bit_identical_torch_triton(W: int, device: str) -> None:  # noqa: N803
    gen = torch.Generator().manual_seed(W)
    n = 300
    g = torch.randint(0, 1 << 62, (n,), generator=gen)
    g[:8] = torch.tensor([0, 1, 2, 3, (1 << 63) - 1, 0, 0, 0])
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, W), generator=gen)
    h[5:8] = torch.tensor([0, -1, -(1 << 63)])[:, None]
    g, h = g.to(device), h.to(device)
    out = torch.empty(n, dtype=torch.int64, device=device)
    _hash_kernel[(triton.cdiv(n, 128),)](g, h, out, n, W=W, BLOCK=128)
    expected = slot_hash(g, h)
    assert torch.equal(out, expected)
    # Spot-check the torch hash against a pure-Python int evaluation.
    c = _HASH_CONSTANTS
    m64 = (1 << 64) - 1

    def py_hash(gid: int, words: list[int]) -> int:
        x = ((gid ^ c["SEED"]) * c["M1"]) & m64
        for w in words:
            x = ((x ^ (w & m64)) * c["M2"]) & m64
            x ^= x >> 31
        x ^= x >> 29
        x = (x * c["M3"]) & m64
        x ^= x >> 31
        return x - (1 << 64) if x >> 63 else x

    for i in (0, 4, 5, 6, 7, 100):
        assert py_hash(int(g[i]), h[i].tolist()) == int(expected[i])


def test_probe_keys_device_function(device: str) -> None:
    keys = _rand_keys(np.random.default_rng(21), 150, 12)
    index = KeyIndex(12, capacity=64, device=device)
    index.add(*_split(keys[:100], 12, device))
    g, h = _split(keys, 12, device)
    out = torch.empty(len(keys), dtype=torch.int8, device=device)
    _probe_via_device_fn[(triton.cdiv(len(keys), 64),)](
        index.table, index.capacity - 1, g, h, out, len(keys), W=index.W, BLOCK=64
    )
    assert out.tolist() == [1] * 100 + [0] * 50


def test_slot_hash_spreads_keys() -> None:
    # Sequential keys differing in one byte must not pile up in few slots.
    hashes = [i.to_bytes(32, "little") for i in range(4096)]
    g = torch.zeros(4096, dtype=torch.int64)
    home = slot_hash(g, pack_hashes(hashes, 32)) & 8191
    assert torch.unique(home).numel() > 3000


# -- parity with a Python set (hypothesis) -----------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "contains"]),
        st.lists(st.integers(0, 39), max_size=24),
    ),
    min_size=1,
    max_size=8,
)


def _run_ops(backend: str, device: str, hash_bytes: int, ops, seed: int) -> KeyIndex:
    rng = np.random.default_rng(seed)
    universe = _adversarial(rng, hash_bytes)
    universe += _rand_keys(rng, 40 - len(universe), hash_bytes)
    index = KeyIndex(hash_bytes, capacity=2, device=device, backend=backend)
    present: set[Key] = set()
    for op, picks in ops:
        keys = [universe[i] for i in picks]
        g, h = _split(keys, hash_bytes, device)
        if op == "add":
            n_new = index.add(g, h)
            assert n_new == len(set(keys) - present)
            present |= set(keys)
        elif op == "remove":
            n_gone = index.remove(g, h)
            assert n_gone == len(set(keys) & present)
            present -= set(keys)
        else:
            assert index.contains(g, h).tolist() == [k in present for k in keys]
        _check_against(index, universe, present)
    return index


@settings(max_examples=50)
@given(hash_bytes=st.sampled_from(WIDTHS), ops=_OPS, seed=st.integers(0, 2**16))
def test_torch_matches_python_set(device: str, hash_bytes: int, ops, seed: int) -> None:
    _run_ops("torch", device, hash_bytes, ops, seed)


@settings(max_examples=12)
@given(hash_bytes=st.sampled_from(WIDTHS), ops=_OPS, seed=st.integers(0, 2**16))
def test_triton_matches_python_set_and_torch(
    device: str, hash_bytes: int, ops, seed: int
) -> None:
    tri = _run_ops("triton", device, hash_bytes, ops, seed)
    tor = _run_ops("torch", device, hash_bytes, ops, seed)
    assert len(tri) == len(tor) and tri.capacity == tor.capacity
    # Cross-backend: each table answers through the other backend's probe.
    rng = np.random.default_rng(seed)
    universe = _adversarial(rng, hash_bytes)
    universe += _rand_keys(rng, 40 - len(universe), hash_bytes)
    g, h = _split(universe, hash_bytes, device)
    expect = tor.contains(g, h)
    assert torch.equal(_kernels().probe(tor.table, tor.W, g, h), expect)
    assert torch.equal(probe_table(tri.table, tri.W, g, h), expect)


# -- targeted cases ---------------------------------------------------------


@pytest.mark.parametrize("hash_bytes", WIDTHS)
def test_adversarial_keys_told_apart(
    backend: str, device: str, hash_bytes: int
) -> None:
    rng = np.random.default_rng(1)
    keys = _adversarial(rng, hash_bytes)
    assert len(set(keys)) == len(keys)
    index = KeyIndex(hash_bytes, capacity=4, device=device, backend=backend)
    # Insert every other key: each absent key has a present near-twin.
    present = set(keys[::2])
    index.add(*_split(keys[::2], hash_bytes, device))
    _check_against(index, keys, present)
    index.add(*_split(keys[1::2], hash_bytes, device))
    _check_against(index, keys, set(keys))
    index.remove(*_split(keys[::3], hash_bytes, device))
    _check_against(index, keys, set(keys) - set(keys[::3]))


def test_keys_with_equal_home_slot_form_a_chain(backend: str, device: str) -> None:
    cap = 64
    keys = _colliding(32, cap, 12)
    index = KeyIndex(32, capacity=cap, device=device, backend=backend)
    index.add(*_split(keys, 32, device))
    assert index.capacity == cap
    g, h = _split(keys, 32, device)
    slots = find_slots(index.table, index.W, g, h)
    home = int(slot_hash(g[:1], h[:1]) & (cap - 1))
    # All in one run of consecutive slots starting at the shared home slot.
    assert sorted(((slots - home) % cap).tolist()) == list(range(12))
    _check_against(index, keys, set(keys))


def test_remove_then_probe_past_tombstones(backend: str, device: str) -> None:
    cap = 64
    keys = _colliding(16, cap, 10, seed=3)
    index = KeyIndex(16, capacity=cap, device=device, backend=backend)
    for k in keys:  # one at a time: key i sits i slots past the home slot
        index.add(k[0], [k[1]])
    present = set(keys)
    for victim in (keys[0], keys[4], keys[5], keys[8]):
        assert index.remove(victim[0], [victim[1]]) == 1
        present.discard(victim)
        _check_against(index, keys, present)
    assert index.tombstones == 4
    assert int((index.table[:, 0] == TOMBSTONE).sum()) == 4
    # Removing again is a no-op; re-adding does not resurrect a tombstone slot
    # twice or duplicate the key.
    assert index.remove(keys[4][0], [keys[4][1]]) == 0
    assert index.add(keys[4][0], [keys[4][1]]) == 1
    present.add(keys[4])
    _check_against(index, keys, present)
    assert index.add(*_split(keys, 16, device)) == 3
    _check_against(index, keys, set(keys))


@pytest.mark.parametrize("hash_bytes", [8, 12])
def test_growth_from_tiny_capacity(backend: str, device: str, hash_bytes: int) -> None:
    rng = np.random.default_rng(7)
    keys = _rand_keys(rng, 300, hash_bytes)
    index = KeyIndex(hash_bytes, capacity=1, device=device, backend=backend)
    assert index.capacity == 1
    seen: set[Key] = set()
    caps = []
    for lo in range(0, 300, 37):
        chunk = keys[lo : lo + 37]
        index.add(*_split(chunk, hash_bytes, device))
        seen |= set(chunk)
        caps.append(index.capacity)
        assert len(index) <= index.max_load * index.capacity
    assert caps == sorted(caps) and caps[-1] >= 600
    assert index.capacity == 1024  # smallest power of two with 300 <= 0.5 * cap
    _check_against(index, keys, seen)


def test_growth_counts_only_new_keys(device: str) -> None:
    rng = np.random.default_rng(9)
    keys = _rand_keys(rng, 100, 32)
    index = KeyIndex(32, capacity=256, device=device)
    g, h = _split(keys, 32, device)
    assert index.add(g, h) == 100
    # Re-adding the same keys (even many times over) must not grow the table.
    assert index.add(g.repeat(5), h.repeat(5, 1)) == 0
    assert index.capacity == 256
    # A batch of duplicates of one new key counts once.
    assert index.add(torch.full((200,), 3, device=device), h[:1].repeat(200, 1)) == 1
    assert index.capacity == 256 and len(index) == 101


def test_tombstones_are_purged_not_grown(device: str) -> None:
    rng = np.random.default_rng(11)
    index = KeyIndex(16, capacity=64, device=device, max_load=0.5)
    for round_ in range(12):
        keys = _rand_keys(rng, 20, 16)
        g, h = _split(keys, 16, device)
        assert index.add(g, h) == 20
        assert index.remove(g, h) == 20
        assert len(index) == 0
        assert index.tombstones + len(index) <= 32, round_
    assert index.capacity == 64


def test_duplicate_keys_in_one_batch(backend: str, device: str) -> None:
    rng = np.random.default_rng(5)
    keys = _rand_keys(rng, 30, 32)
    batch = keys * 4 + keys[:3] * 20
    index = KeyIndex(32, capacity=256, device=device, backend=backend)
    assert index.add(*_split(batch, 32, device)) == 30
    _check_against(index, keys, set(keys))
    assert index.remove(*_split(batch, 32, device)) == 30
    _check_against(index, keys, set())


def test_triton_insert_kernel_stores_repeats_once(device: str) -> None:
    # The raw kernel, without the KeyIndex dedupe: many lanes insert one key.
    k = _kernels()
    table = new_table(64, 4, device)
    keys = _rand_keys(np.random.default_rng(2), 3, 32)
    g, h = _split(keys * 50, 32, device)
    stored = k.insert(table, 4, g, h)
    assert int(stored.sum()) == 3
    assert int((table[:, 0] >= 0).sum()) == 3
    assert k.probe(table, 4, g, h).all()
    removed = k.erase(table, 4, g, h)
    assert int(removed.sum()) == 3 and not k.probe(table, 4, g, h).any()


def test_empty_inputs(backend: str, device: str) -> None:
    index = KeyIndex(16, capacity=8, device=device, backend=backend)
    empty_h = torch.empty(0, 2, dtype=torch.int64, device=device)
    empty_g = torch.empty(0, dtype=torch.int64, device=device)
    assert index.add(empty_g, empty_h) == 0
    assert index.add(5, []) == 0
    assert index.remove([], []) == 0
    out = index.contains(empty_g, empty_h)
    assert out.shape == (0,) and out.dtype == torch.bool
    assert len(index) == 0
    # An empty index answers False for everything.
    keys = _rand_keys(np.random.default_rng(0), 20, 16)
    assert not index.contains(*_split(keys, 16, device)).any()
    assert index.remove(*_split(keys, 16, device)) == 0


def test_argument_forms_agree(device: str) -> None:
    keys = _rand_keys(np.random.default_rng(4), 10, 12)
    a = KeyIndex(12, device=device)
    b = KeyIndex(12, device=device)
    c = KeyIndex(12, device=device)
    a.add(*_split(keys, 12, device))
    b.add([k[0] for k in keys], [k[1] for k in keys])
    for gid in range(4):
        sub = [k[1] for k in keys if k[0] == gid]
        c.add(gid, sub)  # a Python int broadcast over the hashes
    g, h = _split(keys, 12, device)
    for idx in (a, b, c):
        assert idx.contains(g, h).all() and len(idx) == 10
    d = KeyIndex(12, device=device)
    d.add(np.int64(2), [k[1] for k in keys])  # numpy integers are ints too
    d.add([np.int32(k[0]) for k in keys], [k[1] for k in keys])
    assert len(d) == 10 + sum(k[0] != 2 for k in keys)
    assert d.contains(*_split(keys, 12, device)).all()
    assert keys[0] in a and (keys[0][0] + 1, keys[0][1]) not in a
    assert a.contains(torch.tensor(keys[0][0], device=device), [keys[0][1]]).item()


def test_clear_and_memory(backend: str, device: str) -> None:
    index = KeyIndex(32, capacity=100, device=device, backend=backend)
    assert index.capacity == 128
    assert index.memory_bytes() == 128 * 5 * 8
    keys = _rand_keys(np.random.default_rng(6), 64, 32)
    index.add(*_split(keys, 32, device))
    assert index.capacity == 128
    # Per key: (W + 1) * 8 / load bytes, here exactly at the bound.
    assert index.memory_bytes() / len(index) <= (index.W + 1) * 8 / index.load
    index.clear()
    assert len(index) == 0 and index.capacity == 128
    assert bool((index.table[:, 0] == EMPTY).all()) and not index.table[:, 1:].any()
    assert not index.contains(*_split(keys, 32, device)).any()


# -- state_dict / cross-backend ------------------------------------------------


def test_state_dict_round_trip(backend: str, device: str) -> None:
    rng = np.random.default_rng(8)
    keys = _rand_keys(rng, 120, 12)
    index = KeyIndex(12, capacity=16, device=device, backend=backend)
    index.add(*_split(keys, 12, device))
    index.remove(*_split(keys[:30], 12, device))
    state = index.state_dict()
    other_backend = "torch" if backend == "triton" else "triton"
    for be in (backend, other_backend):
        clone = KeyIndex.from_state_dict(state, backend=be)
        assert clone.backend == be
        assert len(clone) == 90 and clone.tombstones == 30
        assert clone.capacity == index.capacity and clone.hash_bytes == 12
        assert torch.equal(clone.table, index.table)
        assert clone.table.data_ptr() != index.table.data_ptr()  # a copy
        _check_against(clone, keys, set(keys[30:]))
        # Mutating the clone leaves the original alone.
        clone.add(*_split(keys[:30], 12, device))
        _check_against(clone, keys, set(keys))
        _check_against(index, keys, set(keys[30:]))


def test_state_dict_rejects_corrupt_tables(device: str) -> None:
    keys = _rand_keys(np.random.default_rng(10), 20, 16)
    index = KeyIndex(16, capacity=64, device=device)
    index.add(*_split(keys, 16, device))
    good = index.state_dict()

    def bad(**changes):
        state = dict(good)
        state["table"] = good["table"].clone()
        for k, v in changes.items():
            if callable(v):
                v(state["table"])
            else:
                state[k] = v
        return state

    slot = int((good["table"][:, 0] >= 0).nonzero()[0])
    empty = int((good["table"][:, 0] == EMPTY).nonzero()[0])

    def busy(t):
        t[slot, 0] = -3

    def moved(t):  # a key copied into a slot off its probe path
        t[empty] = t[slot]

    def tweaked_count(t):
        t[empty, 0] = TOMBSTONE

    with pytest.raises(ValueError, match="BUSY"):
        KeyIndex.from_state_dict(bad(table=busy))
    with pytest.raises(ValueError, match="inconsistent|holds"):
        KeyIndex.from_state_dict(bad(table=moved, size=21))
    with pytest.raises(ValueError, match="tombstones"):
        KeyIndex.from_state_dict(bad(table=tweaked_count))
    with pytest.raises(ValueError, match="size|holds"):
        KeyIndex.from_state_dict(bad(size=3))
    with pytest.raises(ValueError, match="table"):
        KeyIndex.from_state_dict(bad(hash_bytes=32))
    with pytest.raises(ValueError, match="missing"):
        KeyIndex.from_state_dict({"table": good["table"]})
    # The good state still loads.
    assert len(KeyIndex.from_state_dict(good)) == 20


def test_mixed_backends_on_one_table(device: str) -> None:
    rng = np.random.default_rng(12)
    keys = _rand_keys(rng, 200, 32)
    tor = KeyIndex(32, capacity=8, device=device, backend="torch")
    tor.add(*_split(keys[:100], 32, device))
    tri = KeyIndex.from_state_dict(tor.state_dict(), backend="triton")
    tri.add(*_split(keys[100:], 32, device))  # triton inserts into a torch table
    tri.remove(*_split(keys[:50], 32, device))
    back = KeyIndex.from_state_dict(tri.state_dict(), backend="torch")
    _check_against(back, keys, set(keys[50:]))
    back.remove(*_split(keys[150:], 32, device))  # torch erases in a triton table
    again = KeyIndex.from_state_dict(back.state_dict(), backend="triton")
    _check_against(again, keys, set(keys[50:150]))


def test_to_device(device: str) -> None:
    index = KeyIndex(8, device="cpu")
    keys = _rand_keys(np.random.default_rng(13), 10, 8)
    index.add(*_split(keys, 8, "cpu"))
    assert index.to("cpu") is index
    assert index.backend == "torch"
    index.to(device)
    assert index.device.type == torch.device(device).type
    _check_against(index, keys, set(keys))


# -- bad input ------------------------------------------------------------------


def _bad_inputs(device: str):
    g = torch.tensor([0, 1], device=device)
    h = pack_hashes([b"a" * 16, b"b" * 16], 16).to(device)
    pad = pack_hashes([b"a" * 12, b"b" * 12], 12).to(device)
    pad[1, 1] |= 1 << 50
    return (
        [
            (
                "hashes",
                ValueError,
                lambda: (g, h[:, :1]),
            ),  # width 8 for a 16-byte index
            ("hashes", ValueError, lambda: (g, [b"a" * 16, b"b" * 15])),
            ("hashes", TypeError, lambda: (g, h.to(torch.int32))),
            ("hashes", TypeError, lambda: (g, b"a" * 16)),
            ("group_ids", ValueError, lambda: (g[:1], h)),
            (
                "group_ids",
                ValueError,
                lambda: (torch.tensor([0, -1], device=device), h),
            ),
            ("group_ids", ValueError, lambda: (-2, h)),
            ("group_ids", ValueError, lambda: ([0, -5], h)),
            ("group_ids", TypeError, lambda: (g.to(torch.int32), h)),
            ("group_ids", TypeError, lambda: (g.float(), h)),
            ("group_ids", TypeError, lambda: (True, h)),
            ("group_ids", TypeError, lambda: ([0, 1.5], h)),
            ("group_ids", ValueError, lambda: (g[:, None], h)),
        ],
        pad,
    )


@pytest.mark.parametrize("op", ["add", "remove", "contains"])
def test_bad_input_raises_and_leaves_index_unchanged(
    backend: str, device: str, op: str
) -> None:
    keys = _rand_keys(np.random.default_rng(14), 5, 16)
    index = KeyIndex(16, capacity=8, device=device, backend=backend)
    index.add(*_split(keys, 16, device))
    before = (index.table.clone(), len(index), index.tombstones, index.capacity)
    cases, _ = _bad_inputs(device)
    for name, exc, make in cases:
        with pytest.raises(exc, match=name):
            getattr(index, op)(*make())
        assert torch.equal(index.table, before[0]), name
        assert (len(index), index.tombstones, index.capacity) == before[1:]
    # A near-full index must not grow when the batch is rejected.
    many = pack_hashes([bytes([i]) * 16 for i in range(100)], 16).to(device)
    with pytest.raises(ValueError, match="group_ids"):
        getattr(index, op)(torch.arange(99, device=device), many)
    assert index.capacity == before[3] and torch.equal(index.table, before[0])


def test_bad_padding_and_other_device(device: str) -> None:
    index = KeyIndex(12, device=device)
    _, pad = _bad_inputs(device)
    with pytest.raises(ValueError, match="padding"):
        index.add(0, pad)
    assert len(index) == 0 and not (index.table[:, 0] >= 0).any()
    if device != "cpu":
        with pytest.raises(ValueError, match="hashes"):
            index.add(0, pad.cpu())
        with pytest.raises(ValueError, match="group_ids"):
            index.add(torch.zeros(2, dtype=torch.int64), pad)
    else:
        meta = torch.zeros(2, 2, dtype=torch.int64, device="meta")
        with pytest.raises(ValueError, match="hashes"):
            index.add(0, meta)
        good = pack_hashes([b"a" * 12, b"b" * 12], 12)
        with pytest.raises(ValueError, match="group_ids"):
            index.add(torch.zeros(2, dtype=torch.int64, device="meta"), good)


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="max_load"):
        KeyIndex(32, max_load=1.0)
    with pytest.raises(ValueError, match="max_load"):
        KeyIndex(32, max_load=0)
    with pytest.raises(ValueError, match="backend"):
        KeyIndex(32, backend="cuda")
    with pytest.raises(ValueError, match="capacity"):
        KeyIndex(32, capacity=0)
    with pytest.raises(ValueError, match="hash_bytes"):
        KeyIndex(0)
    assert KeyIndex(12).W == num_words(12) == 2
    assert KeyIndex(32, capacity=1000).capacity == 1024


def test_kernel_launchers_validate(device: str) -> None:
    k = _kernels()
    table = new_table(16, 2, device)
    g = torch.zeros(3, dtype=torch.int64, device=device)
    h = torch.zeros(3, 2, dtype=torch.int64, device=device)
    for fn in (k.probe, k.insert, k.erase):
        with pytest.raises(TypeError, match="table"):
            fn(table.to(torch.int32), 2, g, h)
        with pytest.raises(ValueError, match="table"):
            fn(new_table(12, 2, device), 2, g, h)  # not a power of two
        with pytest.raises(ValueError, match="table"):
            fn(table, 3, g, torch.zeros(3, 3, dtype=torch.int64, device=device))
        with pytest.raises(TypeError, match="group_ids"):
            fn(table, 2, g.to(torch.int32), h)
        with pytest.raises(ValueError, match="group_ids"):
            fn(table, 2, g[:2], h)
        with pytest.raises(ValueError, match="hashes"):
            fn(table, 2, g, torch.zeros(3, 4, dtype=torch.int64, device=device)[:, ::2])
        with pytest.raises(ValueError, match="hashes"):
            fn(table, 2, g, h[:, :1].contiguous())
    assert not bool((table[:, 0] != EMPTY).any())


def test_coordinator_does_not_import_triton() -> None:
    code = (
        "import sys, torch\n"
        "import kvhit.coordinator.packing, kvhit.coordinator.key_index as k\n"
        "i = k.KeyIndex(16); i.add(1, [b'a' * 16]); assert i.contains(1, [b'a' * 16])\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


_COMPILE_FOR_GPU = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvhit.kernels import hash_index as k

sig = {"table_ptr": "*i64", "cap_mask": "i64", "gid_ptr": "*i64", "key_ptr": "*i64",
       "out_ptr": "*i8", "n": "i32", "W": "constexpr", "BLOCK": "constexpr"}
for kern in (k._probe_kernel, k._insert_kernel, k._erase_kernel):
    src = ASTSource(fn=kern, signature=sig, constexprs={"W": 4, "BLOCK": 128})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(kern.fn.__name__, " ".join(sorted(set(re.findall(r"(?:atom|fence)\.[\w.]+", ptx)))))
"""


def test_kernels_compile_for_gpu_with_memory_ordering() -> None:
    # No GPU needed: compile to PTX/cubin for sm_90 with triton's bundled ptxas,
    # outside the interpreter, and check the ordering the protocol relies on.
    stdout = compile_outside_interpreter(_COMPILE_FOR_GPU)
    ops = dict(line.split(" ", 1) for line in stdout.strip().splitlines())
    # Probe: acquire on the group column pairs with the inserter's release.
    assert "fence.acquire.gpu" in ops["_probe_kernel"]
    # Insert: CAS claim (acq_rel) and release publish of the group id.
    assert "atom.global.acq_rel.gpu.cas.b64" in ops["_insert_kernel"]
    assert "release.exch.b64" in ops["_insert_kernel"]
    assert "atom.global.acq_rel.gpu.cas.b64" in ops["_erase_kernel"]


def test_torch_probe_throughput() -> None:
    # ~10^6 probes must take well under a second on CPU; a loose guard here,
    # the real figures come from bench/bench_key_index.py.
    import time

    n = 1 << 18
    gen = torch.Generator().manual_seed(0)
    g = torch.randint(0, 4, (n,), generator=gen)
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, 4), generator=gen)
    index = KeyIndex(32, capacity=2 * n)
    index.add(g, h)
    assert probe_table(index.table, 4, g, h).all()
    # Best of three: the machine is shared, a single run can be preempted.
    elapsed = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        probe_table(index.table, 4, g, h)
        elapsed = min(elapsed, time.perf_counter() - t0)
    assert elapsed < 1.0, f"{n} probes took {elapsed:.2f} s"


@pytest.mark.gpu
def test_concurrent_inserts_of_one_key(device: str) -> None:
    # Many programs race to insert the same few keys; each must land once.
    k = _kernels()
    table = new_table(1 << 16, 4, device)
    keys = _rand_keys(np.random.default_rng(15), 4, 32)
    g, h = _split(keys * 50_000, 32, device)
    perm = torch.randperm(g.numel(), device=device)
    g, h = g[perm].contiguous(), h[perm].contiguous()
    stored = k.insert(table, 4, g, h)
    assert int(stored.sum()) == 4
    assert int((table[:, 0] >= 0).sum()) == 4
    assert bool(k.probe(table, 4, g, h).all())
    # And racing inserts of many distinct keys with repeats.
    keys = _rand_keys(np.random.default_rng(16), 20_000, 32)
    g, h = _split(keys * 3, 32, device)
    stored = k.insert(table, 4, g, h)
    assert int(stored.sum()) == len(set(keys))
    assert int((table[:, 0] >= 0).sum()) == 4 + len(set(keys))


def test_group_ids_out_of_range_and_numpy_arrays():
    import numpy as np

    index = KeyIndex(8, capacity=16)
    with pytest.raises(ValueError, match="group_ids"):
        index.add([1 << 63], [b"a" * 8])
    with pytest.raises(TypeError, match="group_ids"):
        index.add(np.array([0.5]), [b"a" * 8])
    assert len(index) == 0
    index.add(np.array([0, 1], dtype=np.int32), [b"a" * 8, b"b" * 8])
    assert index.contains([0, 1, 1], [b"a" * 8, b"b" * 8, b"a" * 8]).tolist() == [
        True,
        True,
        False,
    ]
