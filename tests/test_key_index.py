"""KeyIndex: parity of the numba, torch and triton backends with a Python set.

Triton runs under the interpreter on CPU (conftest sets TRITON_INTERPRET), so
triton cases stay at a few hundred keys and few hypothesis examples. numba is
tested compiled (the kernels are ``cache=True`` njit functions; a test checks
that the JIT is on).
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
    MAX_CAPACITY,
    CapacityError,
    KeyIndex,
    ReadOnlyIndexError,
    normalize_keys,
    resolve_backend,
)
from kvhit.coordinator.packing import (
    HashBatch,
    num_words,
    pack_hashes,
    unpack_hashes,
)
from kvhit.kernels import (
    contract,
    hash_index,  # tests may import triton; coordinator/ may not
    probe_numba,
)
from kvhit.kernels import hash_index_numba as hnb
from kvhit.kernels.contract import BUSY, EMPTY, TOMBSTONE
from kvhit.kernels.hash_index_torch import find as find_slots
from kvhit.kernels.hash_index_torch import new_table, slot_hash
from kvhit.kernels.hash_index_torch import probe as probe_table

BACKENDS = ["numba", "torch", "triton"]
WIDTHS = [8, 12, 16, 32]

Key = tuple[int, bytes]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def _on_device(backend: str, device: str) -> str:
    """``backend``, or a skip where it cannot run on ``device`` (numba runs
    on the CPU only)."""
    if backend == "numba" and device != "cpu":
        pytest.skip("numba runs on the CPU")
    return backend


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


def _with_tombstones(
    keys: list[Key],
    hash_bytes: int,
    capacity: int,
    device: str,
    backend: str,
    *,
    added: int,
    removed: int,
) -> KeyIndex:
    """A KeyIndex that was given ``keys[:added]``, then lost ``keys[:removed]``
    again (their slots left as tombstones)."""
    index = KeyIndex(hash_bytes, capacity=capacity, device=device, backend=backend)
    index.add(*_split(keys[:added], hash_bytes, device))
    index.remove(*_split(keys[:removed], hash_bytes, device))
    return index


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
    rows, valid, gids = hash_index.program_lanes(gid_ptr, n, BLOCK)
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
    rows, valid, gids = hash_index.program_lanes(gid_ptr, n, BLOCK)
    hit = hash_index.probe_keys(table_ptr, cap_mask, gids, key_ptr, rows, valid, W)
    tl.store(out_ptr + rows, hit.to(tl.int8), mask=valid)


# -- slot hash --------------------------------------------------------------


def test_hash_constants_come_from_the_contract() -> None:
    # One definition: the Triton constexprs wrap kernels/contract.py's numbers
    # and no copy of them is left in key_index or hash_index.
    k = _kernels()
    for name in ("SEED", "M1", "M2", "M3", "LOW33", "LOW35"):
        assert getattr(k, "_" + name).value == getattr(contract, name), name
    assert (k.EMPTY, k.TOMBSTONE, k.BUSY) == (
        contract.EMPTY,
        contract.TOMBSTONE,
        contract.BUSY,
    )
    assert (EMPTY, TOMBSTONE, BUSY) == (
        contract.EMPTY,
        contract.TOMBSTONE,
        contract.BUSY,
    )
    import kvhit.coordinator.key_index as ki

    for mod in (ki, k):
        assert not hasattr(mod, "HASH_CONSTANTS"), mod.__name__
        assert not hasattr(mod, "_HASH_CONSTANTS"), mod.__name__


@pytest.mark.parametrize("W", [1, 2, 4, 5])
def test_slot_hash_torch_numba_match_contract(W: int) -> None:  # noqa: N803
    gen = torch.Generator().manual_seed(100 + W)
    n = 200
    g = torch.randint(0, 1 << 62, (n,), generator=gen)
    g[:4] = torch.tensor([0, 1, (1 << 63) - 1, 2])
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, W), generator=gen)
    h[4:7] = torch.tensor([0, -1, -(1 << 63)])[:, None]
    expect = [contract.slot_hash(int(g[i]), h[i].tolist()) for i in range(n)]
    assert slot_hash(g, h).tolist() == expect
    assert _numba_hashes(g.numpy(), h.numpy()).tolist() == expect


def _numba_hashes(g: np.ndarray, h: np.ndarray) -> np.ndarray:
    import numba

    @numba.njit
    def run(g, h, out):
        for r in range(g.shape[0]):
            out[r] = probe_numba.key_slot_hash(g[r], h, r)

    out = np.empty(g.shape[0], dtype=np.int64)
    run(g, h, out)
    return out


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
    for i in (0, 4, 5, 6, 7, 100):
        assert contract.slot_hash(int(g[i]), h[i].cpu().tolist()) == int(expected[i])


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


@settings(max_examples=50)
@given(hash_bytes=st.sampled_from(WIDTHS), ops=_OPS, seed=st.integers(0, 2**16))
def test_numba_matches_python_set_and_torch(hash_bytes: int, ops, seed: int) -> None:
    nb = _run_ops("numba", "cpu", hash_bytes, ops, seed)
    tor = _run_ops("torch", "cpu", hash_bytes, ops, seed)
    assert len(nb) == len(tor) and nb.capacity == tor.capacity
    # Both tables hold the same keys and answer through each other's probe.
    rng = np.random.default_rng(seed)
    universe = _adversarial(rng, hash_bytes)
    universe += _rand_keys(rng, 40 - len(universe), hash_bytes)
    g, h = _split(universe, hash_bytes, "cpu")
    expect = tor.contains(g, h)
    assert torch.equal(hnb.probe(tor.table, tor.W, g, h), expect)
    assert torch.equal(probe_table(nb.table, nb.W, g, h), expect)


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
    if device == "cpu":
        assert torch.equal(hnb.probe(tri.table, tri.W, g, h), expect)
        assert torch.equal(
            _kernels().find(tri.table, tri.W, g, h), hnb.find(tri.table, tri.W, g, h)
        )


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


@pytest.mark.parametrize("capacity", [1, 8, 1 << 16])
def test_new_host_tables_are_empty(capacity: int) -> None:
    """A CPU table and a fleet's joint one, first touched by numpy on this
    thread (torch's fill of a fresh table: 2**21 slots 22 vs 5-6 ms on 2
    cores): int64, contiguous, column 0 EMPTY and every other column zero,
    at any size."""
    from kvhit.kernels.fleet_numba import FleetOps
    from kvhit.kernels.hash_index_torch import new_table

    fleet = FleetOps.new_tables(capacity, 3, 2, torch.device("cpu"))
    assert fleet[0].shape == (capacity, 6) and fleet[2].shape == (capacity, 2)
    for table in (new_table(capacity, 3, "cpu"), fleet[0]):
        assert table.dtype == torch.int64 and table.is_contiguous()
        assert bool((table[:, 0] == EMPTY).all()) and not table[:, 1:].any()


# -- state_dict / cross-backend ------------------------------------------------


def test_state_dict_round_trip(backend: str, device: str) -> None:
    rng = np.random.default_rng(8)
    keys = _rand_keys(rng, 120, 12)
    index = KeyIndex(12, capacity=16, device=device, backend=backend)
    index.add(*_split(keys, 12, device))
    index.remove(*_split(keys[:30], 12, device))
    state = index.state_dict()
    assert isinstance(state["checksum"], str)
    for be in BACKENDS if device == "cpu" else ("torch", "triton"):
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


def _signed(table: torch.Tensor, hash_bytes: int) -> dict:
    """A state dict whose checksum matches ``table`` (corrupt or not): what a
    writer with a bug, rather than a flipped bit, would save."""
    return KeyIndex.from_table(table, hash_bytes).state_dict()


def test_state_dict_rejects_corrupt_tables(device: str) -> None:
    keys = _rand_keys(np.random.default_rng(10), 20, 16)
    index = KeyIndex(16, capacity=64, device=device, backend="torch")
    index.add(*_split(keys, 16, device))
    index.remove(*_split(keys[:2], 16, device))
    good = index.state_dict()
    snapshot = good["table"].clone()
    live = (good["table"][:, 0] >= 0).nonzero().squeeze(1).tolist()
    slot = live[0]
    empty = int((good["table"][:, 0] == EMPTY).nonzero()[0])

    def corrupt(fn) -> torch.Tensor:
        t = good["table"].clone()
        fn(t)
        return t

    def bad(**changes) -> dict:
        state = dict(good)
        state.update(changes)
        return state

    # A flipped bit anywhere: the checksum catches it, even where the
    # structure would still look right (a never-stored key becomes present).
    for row, col, bit in ((slot, 1, 0), (slot, 2, 63), (slot, 0, 1), (empty, 2, 5)):

        def flip(t, row=row, col=col, bit=bit):
            t[row, col] ^= 1 << bit if bit < 63 else -(1 << 63)

        with pytest.raises(ValueError, match="checksum"):
            KeyIndex.from_state_dict(bad(table=corrupt(flip)))
    with pytest.raises(ValueError, match="checksum"):
        KeyIndex.from_state_dict(bad(size=19))  # counts are signed too
    with pytest.raises(ValueError, match="checksum"):
        KeyIndex.from_state_dict(bad(checksum="0" * 32))
    with pytest.raises(ValueError, match="missing"):
        KeyIndex.from_state_dict({k: v for k, v in good.items() if k != "checksum"})
    with pytest.raises(ValueError, match="version"):
        KeyIndex.from_state_dict(bad(version=1))
    with pytest.raises(ValueError, match="missing"):
        KeyIndex.from_state_dict({"table": good["table"]})
    with pytest.raises(ValueError, match="table"):
        KeyIndex.from_state_dict(bad(hash_bytes=32))
    with pytest.raises(TypeError, match="size"):
        KeyIndex.from_state_dict(bad(size=18.0))
    with pytest.raises(ValueError, match="max_load"):
        KeyIndex.from_state_dict(bad(max_load=1e-9))
    with pytest.raises(TypeError, match="state"):
        KeyIndex.from_state_dict([("table", good["table"])])

    # Correctly signed, structurally wrong tables: the invariants catch them.
    def busy(t):
        t[slot, 0] = BUSY

    def moved(t):  # a key copied into a slot off its probe path
        t[empty] = t[slot]

    def unknown(t):
        t[slot, 0] = -7

    def dirty_empty(t):
        t[empty, 2] = 5

    def full(t):  # no EMPTY slot left
        t[t[:, 0] == EMPTY, 0] = TOMBSTONE

    for fn, match in (
        (busy, "BUSY"),
        (unknown, "unknown"),
        (moved, "inconsistent|reachable"),
        (dirty_empty, "EMPTY"),
        (full, "EMPTY"),
    ):
        with pytest.raises(ValueError, match=match):
            KeyIndex.from_state_dict(_signed(corrupt(fn), 16))
    # A key displaced from its home slot (a colliding pair), then the slot
    # before it emptied: signed, counted right, but unreachable.
    cap = 64
    pair = _colliding(16, cap, 2, seed=1)
    two = KeyIndex(16, capacity=cap, device=device, backend="torch")
    for k in pair:
        two.add(k[0], [k[1]])
    t = two.table.clone()
    g, h = _split(pair[:1], 16, device)
    home = int(slot_hash(g, h)[0]) & (cap - 1)
    assert int(t[(home + 1) % cap, 0]) >= 0  # the second key sits behind it
    t[home] = torch.tensor([EMPTY, 0, 0], device=t.device)
    with pytest.raises(ValueError, match="reachable"):
        KeyIndex.from_state_dict(_signed(t, 16))
    # Nothing above touched the saved table; the good state still loads.
    assert torch.equal(good["table"], snapshot)
    assert len(KeyIndex.from_state_dict(good)) == 18


def test_state_dict_devices_are_checked() -> None:
    index = KeyIndex(16, capacity=16)
    index.add(0, [b"a" * 16])
    state = index.state_dict()
    with pytest.raises(ValueError, match="device"):
        KeyIndex.from_state_dict(state, device="meta")
    with pytest.raises(ValueError, match="table.*meta"):
        KeyIndex.from_state_dict(dict(state, table=state["table"].to("meta")))
    with pytest.raises(TypeError, match="table"):
        KeyIndex.from_state_dict(dict(state, table=state["table"].numpy()))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available here"):
            KeyIndex.from_state_dict(state, device="cuda")
    with pytest.raises(ValueError, match="backend"):
        KeyIndex.from_state_dict(state, backend="cuda")
    assert len(KeyIndex.from_state_dict(state, backend="numba")) == 1


def test_state_dict_saved_at_higher_load_is_rehashed() -> None:
    keys = _rand_keys(np.random.default_rng(30), 40, 8)
    index = KeyIndex(8, capacity=64, max_load=0.9)
    index.add(*_split(keys, 8, "cpu"))
    state = dict(index.state_dict())
    assert index.capacity == 64
    state = KeyIndex.from_table(index.table, 8, max_load=0.9).state_dict()
    state["max_load"] = 0.5  # not signed: a policy, not data
    clone = KeyIndex.from_state_dict(state)
    assert clone.capacity == 128 and clone.max_load == 0.5
    _check_against(clone, keys, set(keys))


@pytest.mark.parametrize(
    "chain", [("torch", "triton"), ("numba", "triton"), ("numba", "torch")]
)
def test_mixed_backends_on_one_table(device: str, chain) -> None:
    if "numba" in chain and device != "cpu":
        pytest.skip("numba runs on the CPU")
    first, second = chain
    rng = np.random.default_rng(12)
    keys = _rand_keys(rng, 200, 32)
    tor = KeyIndex(32, capacity=8, device=device, backend=first)
    tor.add(*_split(keys[:100], 32, device))
    tri = KeyIndex.from_state_dict(tor.state_dict(), backend=second)
    tri.add(*_split(keys[100:], 32, device))  # inserts into the other's table
    tri.remove(*_split(keys[:50], 32, device))
    back = KeyIndex.from_state_dict(tri.state_dict(), backend=first)
    _check_against(back, keys, set(keys[50:]))
    back.remove(*_split(keys[150:], 32, device))  # erases in the other's table
    again = KeyIndex.from_state_dict(back.state_dict(), backend=second)
    _check_against(again, keys, set(keys[50:150]))
    # Growth (a rehash) by one backend, probes by every other.
    again.add(*_split(_rand_keys(rng, 300, 32), 32, device))
    g, h = _split(keys, 32, device)
    expect = torch.tensor([50 <= i < 150 for i in range(200)], device=device)
    assert torch.equal(probe_table(again.table, again.W, g, h), expect)
    assert torch.equal(_kernels().probe(again.table, again.W, g, h), expect)
    if device == "cpu":
        assert torch.equal(hnb.probe(again.table, again.W, g, h), expect)


def test_to_device(device: str) -> None:
    index = KeyIndex(8, device="cpu")
    keys = _rand_keys(np.random.default_rng(13), 10, 8)
    index.add(*_split(keys, 8, "cpu"))
    assert index.to("cpu") is index
    assert index.backend == "numba"  # auto on the CPU
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
            ("group_ids", TypeError, lambda: ([0, "1"], h)),
            ("group_ids", TypeError, lambda: (None, h)),
            ("group_ids", ValueError, lambda: ([0, 1 << 63], h)),
            ("group_ids", ValueError, lambda: (g.to("meta"), h)),
            ("hashes", TypeError, lambda: (g, None)),
            ("hashes", TypeError, lambda: (g, h.cpu().numpy().astype(np.int32))),
            ("hashes", ValueError, lambda: (g, h.cpu().numpy().reshape(-1))),
            ("hashes", ValueError, lambda: (g, h.to("meta"))),
            (
                "hashes",
                ValueError,
                lambda: (g, HashBatch.from_bytes([[b"a" * 8]], hash_bytes=8)),
            ),
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
    for bad in (1.0, 0, 1e-9, 0.04, 0.96, float("nan"), -0.5):
        with pytest.raises(ValueError, match="max_load"):
            KeyIndex(32, max_load=bad)
    with pytest.raises(TypeError, match="max_load"):
        KeyIndex(32, max_load="0.5")
    assert KeyIndex(32, max_load=0.05).max_load == 0.05
    assert KeyIndex(32, max_load=0.95).max_load == 0.95
    with pytest.raises(ValueError, match="capacity"):
        KeyIndex(32, capacity=MAX_CAPACITY + 1)
    with pytest.raises(TypeError, match="growable"):
        KeyIndex(32, growable=1)
    with pytest.raises(ValueError, match="meta"):
        KeyIndex(32, device="meta", backend="numba")
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
        "i = k.KeyIndex(16, backend='torch'); i.add(1, [b'a' * 16])\n"
        "assert i.contains(1, [b'a' * 16])\n"
        "assert 'numba' not in sys.modules, 'numba imported by the torch backend'\n"
        "i = k.KeyIndex(16); i.add(1, [b'a' * 16]); assert i.contains(1, [b'a' * 16])\n"
        "assert i.backend == 'numba' and 'numba' in sys.modules\n"
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
# Each kernel variant as its launcher builds it: (name, kernel, constexprs, out).
for name, kern, extra, out in (
    ("probe", k._probe_kernel, {"ACQUIRE": False, "MODE": k._PROBE}, "*i8"),
    ("find", k._probe_kernel, {"ACQUIRE": False, "MODE": k._FIND}, "*i64"),
    ("insert", k._insert_kernel, {"WAITS": k.BUSY_WAIT_LIMIT}, "*i8"),
    ("erase", k._probe_kernel, {"ACQUIRE": False, "MODE": k._ERASE}, "*i8"),
):
    s = dict(sig, out_ptr=out, **dict.fromkeys(extra, "constexpr"))
    src = ASTSource(fn=kern, signature=s, constexprs={"W": 4, "BLOCK": 128, **extra})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(name, " ".join(sorted(set(re.findall(r"(?:atom|fence)\.[\w.]+", ptx)))))
"""


def test_kernels_compile_for_gpu_with_memory_ordering() -> None:
    # No GPU needed: compile to PTX/cubin for sm_90 with triton's bundled ptxas,
    # outside the interpreter, and check the ordering the protocol relies on.
    stdout = compile_outside_interpreter(_COMPILE_FOR_GPU)
    ops = dict(line.split(" ", 1) for line in stdout.strip().splitlines())
    # Probe and find: plain loads, stream-ordered after the inserts (Triton
    # 3.6 has no atomic_load; find_slots(ACQUIRE=True) is the concurrent
    # reader's acquire read, tests/test_gpu_faults.py), no RMW on the table.
    assert "atom" not in ops["probe"] + ops["find"]
    # Insert: CAS claim (acq_rel) and release publish of the group id.
    assert "atom.global.acq_rel.gpu.cas.b64" in ops["insert"]
    assert "release.exch.b64" in ops["insert"]
    # Erase: a masked atomic min (no CAS: a CAS cannot be masked, and the
    # not-found lanes would all hit slot 0).
    assert "acq_rel.min.s64" in ops["erase"]
    assert "cas" not in ops["erase"]


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
    assert elapsed < 3.0, f"{n} probes took {elapsed:.2f} s"


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


# -- backends, devices -------------------------------------------------------


def test_numba_kernels_are_compiled() -> None:
    import numba

    assert not numba.config.DISABLE_JIT
    table = new_table(16, 1, "cpu")
    g, h = torch.zeros(1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.int64)
    hnb.insert(table, 1, g, h)
    assert hnb.probe(table, 1, g, h).all()
    for kern in (hnb._insert_kernel, hnb._probe_kernel):
        assert kern.signatures, kern  # dispatched to machine code
    for kern in (
        hnb._find_kernel,
        hnb._probe_kernel,
        hnb._insert_kernel,
        hnb._erase_kernel,
        hnb._rehash_kernel,
    ):
        # nogil: an event follower and the scheduler keep running meanwhile;
        # cache: only the first process on a machine compiles.
        assert kern.targetoptions.get("nogil") is True, kern
        assert kern._cache.__class__.__name__ != "NullCache", kern


def test_auto_backend_by_device() -> None:
    assert KeyIndex(8).backend == "numba"
    assert KeyIndex(8, backend="torch").backend == "torch"
    # Devices that no kernel family serves get torch, never triton (issue 12).
    for dev, expect in (("cpu", "numba"), ("cuda", "triton"), ("mps", "torch")):
        assert resolve_backend("auto", torch.device(dev)) == expect
    assert resolve_backend("auto", torch.device("xpu")) == "torch"
    with pytest.raises(ValueError, match="numba"):
        resolve_backend("numba", torch.device("cuda"))
    with pytest.raises(ValueError, match="triton"):
        resolve_backend("triton", torch.device("mps"))


def test_devices_that_cannot_hold_a_table() -> None:
    with pytest.raises(ValueError, match="device 'meta'"):
        KeyIndex(16, device="meta")
    with pytest.raises(ValueError, match="device"):
        KeyIndex(16, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available here"):
            KeyIndex(16, device="cuda")
    index = KeyIndex(16)
    with pytest.raises(ValueError, match="device 'meta'"):
        index.to("meta")
    assert index.device.type == "cpu"


# -- argument normalisation ----------------------------------------------------


def test_normalize_keys_forms() -> None:
    keys = _rand_keys(np.random.default_rng(40), 6, 12)
    g, h = _split(keys, 12, "cpu")
    for gid_form in (g, g.numpy(), g.tolist(), [np.int32(x) for x in g.tolist()]):
        for hash_form in (
            h,
            h.numpy(),
            h.numpy().view(np.uint64),
            [k[1] for k in keys],
        ):
            gg, hh = normalize_keys(gid_form, hash_form, 12, "cpu")
            assert gg.dtype == hh.dtype == torch.int64
            assert torch.equal(gg, g) and torch.equal(hh, h)
            assert gg.is_contiguous() and hh.is_contiguous()
    gg, hh = normalize_keys(3, h.numpy()[::-1], 12, "cpu")  # a strided array
    assert gg.tolist() == [3] * 6 and torch.equal(hh, h.flip(0))
    index = KeyIndex(12)
    assert all(
        torch.equal(a, b)
        for a, b in zip(index.normalize_keys(g, h), (g, h), strict=True)
    )
    with pytest.raises(ValueError, match="device"):
        normalize_keys(g, h, 12, "meta")


def test_numpy_hashes_accepted_or_named(backend: str, device: str) -> None:
    keys = _rand_keys(np.random.default_rng(41), 8, 32)
    g, h = _split(keys, 32, "cpu")
    index = KeyIndex(32, device=device, backend=backend)
    assert index.add(g.numpy(), h.numpy()) == 8  # issue 12: used to fail
    assert index.contains(g.tolist(), h.numpy()).all()
    before = index.table.clone()
    for bad, exc in (
        (h.numpy().reshape(-1), ValueError),  # [32]: not [N, 4]
        (h.numpy()[:, :2], ValueError),
        (h.numpy().astype(np.int32), TypeError),
        (h.numpy().astype(np.float64), TypeError),
        (np.array([k[1] for k in keys], dtype=object), TypeError),
    ):
        with pytest.raises(exc, match="hashes"):
            index.add(g.numpy(), bad)
    assert torch.equal(index.table, before) and len(index) == 8


# -- capacity, growth -------------------------------------------------------------


def test_tiny_max_load_does_not_allocate_absurd_tables() -> None:
    # max_load=1e-9 used to ask for 43 GB on the first add; it is refused now,
    # and the smallest accepted bound sizes tables sensibly.
    index = KeyIndex(32, capacity=1, max_load=0.05)
    index.add(0, [bytes([i]) * 32 for i in range(100)])
    assert index.capacity == 2048  # 100 <= 0.05 * 2048
    assert index.memory_bytes() == 2048 * 5 * 8


def test_growth_past_max_capacity_is_refused(backend: str) -> None:
    index = KeyIndex(8, capacity=8, backend=backend)
    index.add(0, [b"a" * 8])
    before = (index.table.clone(), len(index), index.capacity)
    for call in (
        lambda: index.reserve(MAX_CAPACITY),
        lambda: index.grown_for(1 << 40),
    ):
        with pytest.raises(ValueError, match="MAX_CAPACITY"):
            call()
        assert torch.equal(index.table, before[0])
        assert (len(index), index.capacity) == before[1:]
    for bad, exc in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="extra_keys"):
            index.reserve(bad)
        with pytest.raises(exc, match="extra_keys"):
            index.has_room_for(bad)


def test_fixed_capacity_refuses_growth_and_keeps_its_table(backend: str) -> None:
    keys = _rand_keys(np.random.default_rng(42), 80, 16)
    index = KeyIndex(16, capacity=64, backend=backend, growable=False)
    assert not index.growable
    table, ptr = index.table, index.table.data_ptr()
    assert index.add(*_split(keys[:32], 16, "cpu")) == 32  # exactly at the bound
    before = (index.table.clone(), len(index), index.tombstones)
    with pytest.raises(CapacityError, match=r"capacity 64.*33 keys need capacity 128"):
        index.add(*_split(keys[31:33], 16, "cpu"))
    assert torch.equal(index.table, before[0])
    assert (len(index), index.tombstones) == before[1:]
    assert index.add(*_split(keys[:32], 16, "cpu")) == 0  # known keys still fine
    with pytest.raises(CapacityError, match="capacity 64"):
        index.grown_for(1)
    with pytest.raises(CapacityError, match="capacity 64"):
        index.reserve(1)
    # Tombstones are purged in place: same tensor, same storage.
    for lo in range(0, 80, 8):
        index.remove(*_split(keys[max(0, lo - 24) : lo], 16, "cpu"))
        index.add(*_split(keys[lo : lo + 8], 16, "cpu"))
        assert index.table is table and index.table.data_ptr() == ptr
        assert len(index) + index.tombstones <= 32
    _check_against(index, keys, set(keys[72:80]))
    assert index.tombstones < 72  # purged (in place) along the way
    assert index.to("cpu") is index
    if torch.cuda.is_available():
        with pytest.raises(CapacityError, match="move"):
            index.to("cuda")
    index.clear()
    assert index.table is table and len(index) == 0


def test_freeze_after_reserve(backend: str) -> None:
    keys = _rand_keys(np.random.default_rng(43), 200, 8)
    index = KeyIndex(8, capacity=1, backend=backend)
    index.reserve(200)
    assert index.has_room_for(200) and not index.has_room_for(index.capacity)
    assert index.freeze() is index and not index.growable
    ptr = index.table.data_ptr()
    assert index.add(*_split(keys, 8, "cpu")) == 200
    assert index.table.data_ptr() == ptr
    _check_against(index, keys, set(keys))


def test_grown_for_then_adopt(backend: str, device: str) -> None:
    backend = _on_device(backend, device)
    keys = _rand_keys(np.random.default_rng(44), 300, 32)
    index = _with_tombstones(keys, 32, 16, device, backend, added=8, removed=2)
    old_table = index.table.clone()
    assert not index.has_room_for(292)
    grown = index.grown_for(292)
    # The live index is untouched; the copy has room and no tombstones.
    assert torch.equal(index.table, old_table) and index.capacity == 16
    assert grown.capacity == 1024 and grown.tombstones == 0 and len(grown) == 6
    assert grown.has_room_for(292)
    _check_against(grown, keys, set(keys[2:8]))
    new_table_ = grown.table
    old_tensor = index.table
    index.adopt(grown)  # O(1): the tensor is taken over, not copied
    assert index.table is new_table_ and index.capacity == 1024
    assert len(index) == 6 and index.tombstones == 0
    # The old table is handed back (read-only) so it is freed when the
    # caller drops it, outside any lock.
    assert grown.read_only and grown.table is old_tensor
    cap = index.capacity
    index.add(*_split(keys[8:], 32, device))
    assert index.capacity == cap  # no rehash under the caller's lock
    _check_against(index, keys, set(keys[2:]))
    # A copy built before a change would lose it: refused.
    stale = index.grown_for(10)
    index.remove(*_split(keys[2:3], 32, device))
    before = index.table.clone()
    with pytest.raises(ValueError, match="grown"):
        index.adopt(stale)
    with pytest.raises(ValueError, match="grown"):
        index.adopt(KeyIndex(32, device=device))  # not from grown_for
    with pytest.raises(ValueError, match="grown"):
        index.adopt(grown)  # already adopted
    with pytest.raises(TypeError, match="grown"):
        index.adopt(index.state_dict())
    assert torch.equal(index.table, before) and len(index) == 297
    # A copy may take the batch itself before the swap.
    more = _rand_keys(np.random.default_rng(45), 400, 32)
    grown = index.grown_for(400)
    grown.add(*_split(more, 32, device))
    index.adopt(grown)
    _check_against(index, keys + more, set(keys[3:]) | set(more))


# -- read-only views ----------------------------------------------------------------


def test_from_table_read_only_view(backend: str, device: str) -> None:
    backend = _on_device(backend, device)
    keys = _rand_keys(np.random.default_rng(46), 40, 12)
    owner = _with_tombstones(keys, 12, 128, device, backend, added=30, removed=5)
    view = KeyIndex.from_table(owner.table, 12, backend=backend)
    assert view.read_only and view.table is owner.table  # no copy
    assert len(view) == 25 and view.tombstones == 5 and view.W == 2
    g, h = _split(keys, 12, device)
    assert view.contains(g, h).tolist() == [5 <= i < 30 for i in range(40)]
    before = owner.table.clone()
    for name, call in (
        ("add", lambda: view.add(g, h)),
        ("remove", lambda: view.remove(g, h)),
        ("clear", view.clear),
        ("reserve", lambda: view.reserve(1000)),
        ("freeze", view.freeze),
        ("grown_for", lambda: view.grown_for(1)),
        ("adopt", lambda: view.adopt(owner.grown_for(1))),
    ):
        with pytest.raises(ReadOnlyIndexError, match=f"{name}.*read-only"):
            call()
        assert torch.equal(owner.table, before), name
    assert isinstance(ReadOnlyIndexError("x"), TypeError)
    # The view follows writes into the shared tensor (no growth here).
    owner.add(*_split(keys[30:], 12, device))
    assert (
        owner.table is view.table
        and len(view) == 35
        and view.contains(g[30:], h[30:]).all()
    )
    # Bad tables are named.
    with pytest.raises(TypeError, match="table"):
        KeyIndex.from_table(owner.table.int(), 12)
    with pytest.raises(ValueError, match="table"):
        KeyIndex.from_table(owner.table[:96], 12)
    with pytest.raises(ValueError, match="table"):
        KeyIndex.from_table(owner.table, 32)
    with pytest.raises(ValueError, match="meta"):
        KeyIndex.from_table(owner.table.to("meta"), 12)
    with pytest.raises(ValueError, match="contiguous"):
        KeyIndex.from_table(torch.cat([owner.table] * 2, 1)[:, :3], 12)


def test_from_table_owning() -> None:
    keys = _rand_keys(np.random.default_rng(47), 20, 8)
    src = KeyIndex(8, capacity=32)
    src.add(*_split(keys, 8, "cpu"))
    src.remove(*_split(keys[:4], 8, "cpu"))
    table = src.table.clone()
    own = KeyIndex.from_table(table, 8, read_only=False)
    assert not own.read_only and own.table is table
    assert len(own) == 16 and own.tombstones == 4
    own.add(*_split(keys[:4], 8, "cpu"))
    _check_against(own, keys, set(keys))
    busy = table.clone()
    busy[int((busy[:, 0] >= 0).nonzero()[0]), 0] = BUSY
    with pytest.raises(ValueError, match="BUSY"):
        KeyIndex.from_table(busy, 8, read_only=False)


# -- kernels: BUSY slots, masked erase -----------------------------------------------


def _busy_chain(device: str):
    """A table where a key's probe chain passes a slot left BUSY."""
    cap = 64
    keys = _colliding(32, cap, 3, seed=5)
    table = new_table(cap, 4, device)
    for k in keys:
        hash_index.insert(table, 4, *_split([k], 32, device))
    slots = find_slots(table, 4, *_split(keys, 32, device))
    table[int(slots[1]), 0] = BUSY  # stuck: a writer died mid-insert
    return table, keys, slots


def test_probe_passes_over_busy_slots(device: str) -> None:
    table, keys, slots = _busy_chain(device)
    g, h = _split(keys, 32, device)
    expect = [True, False, True]
    assert hash_index.probe(table, 4, g, h).tolist() == expect
    assert probe_table(table, 4, g, h).tolist() == expect
    if device == "cpu":
        assert hnb.probe(table, 4, g, h).tolist() == expect


def test_insert_behind_a_stuck_busy_slot_terminates(device: str) -> None:
    table, keys, _ = _busy_chain(device)
    before = table.clone()
    other = [k for k in _colliding(32, 64, 6, seed=5) if k not in keys][:1]
    g, h = _split(keys[1:2] + other, 32, device)
    # Waiting on BUSY counts toward the probe bound: the kernel gives up
    # (after BUSY_WAIT_LIMIT rounds) instead of spinning forever.
    with pytest.raises(RuntimeError, match="BUSY for 8 rounds"):
        hash_index.insert(table, 4, g, h, busy_wait_limit=8)
    changed = (table != before).any(1).nonzero().squeeze(1).tolist()
    assert len(changed) <= 1  # at most the other key landed past the chain


def test_insert_into_a_table_of_busy_slots_terminates(device: str) -> None:
    table = new_table(8, 1, device)
    table[:, 0] = BUSY
    g = torch.zeros(3, dtype=torch.int64, device=device)
    h = torch.arange(3, device=device)[:, None]
    with pytest.raises(RuntimeError, match="free slot"):
        hash_index.insert(table, 1, g, h, busy_wait_limit=8)
    assert bool((table[:, 0] == BUSY).all())
    with pytest.raises(ValueError, match="busy_wait_limit"):
        hash_index.insert(table, 1, g, h, busy_wait_limit=0)
    assert not hash_index.probe(table, 1, g, h).any()


def test_erase_of_absent_keys_leaves_slot_0_untouched(
    backend: str, device: str
) -> None:
    backend = _on_device(backend, device)
    index = KeyIndex(8, capacity=16, device=device, backend=backend)
    # Plant the compare value the old erase sent every not-found lane's CAS
    # to slot 0 with: an unmasked CAS would overwrite it with TOMBSTONE.
    index.table[0, 0] = contract.NEVER
    index.table[0, 1] = 12345
    before = index.table.clone()
    keys = _rand_keys(np.random.default_rng(48), 50, 8)
    assert index.remove(*_split(keys, 8, device)) == 0
    assert torch.equal(index.table, before)
    assert int(index.table[0, 0]) == contract.NEVER
    # Found lanes still erase, each key counted once however often repeated.
    index.table[0] = torch.tensor([EMPTY, 0], device=device)
    index.add(*_split(keys[:5], 8, device))
    assert index.remove(*_split(keys[:5] * 3 + keys[5:], 8, device)) == 5
    assert len(index) == 0 and index.tombstones == 5


# -- larger parity, adversarial ---------------------------------------------------------


def test_numba_torch_parity_many_keys() -> None:
    # Thousands of keys through growth from capacity 1, removes and re-adds;
    # both tables hold the same keys and answer through each other.
    gen = torch.Generator().manual_seed(49)
    n = 20_000
    g = torch.randint(0, 3, (n,), generator=gen)
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, 4), generator=gen)
    h[n // 2 :, :3] = h[: n // 2, :3]  # pairs differing only in the last word
    g[-100:] = g[-200:-100] + 1  # and pairs differing only in the group
    h[-100:] = h[-200:-100]
    nb = KeyIndex(32, capacity=1, backend="numba")
    tor = KeyIndex(32, capacity=1, backend="torch")
    for idx in (nb, tor):
        for lo in range(0, n, 3000):
            idx.add(g[lo : lo + 3000], h[lo : lo + 3000])
        assert idx.remove(g[::3], h[::3]) == len(range(0, n, 3))
        assert idx.add(g[::6], h[::6]) == len(range(0, n, 6))
    assert nb.capacity == tor.capacity and len(nb) == len(tor)
    keep = torch.ones(n, dtype=torch.bool)
    keep[::3] = False
    keep[::6] = True
    assert torch.equal(nb.contains(g, h), keep)
    assert torch.equal(tor.contains(g, h), keep)
    assert torch.equal(hnb.probe(tor.table, 4, g, h), keep)
    assert torch.equal(probe_table(nb.table, 4, g, h), keep)
    miss = h.clone()
    miss[:, 3] ^= 1
    assert not nb.contains(g, miss).any()


def test_numba_insert_dedups_within_a_batch() -> None:
    keys = _rand_keys(np.random.default_rng(50), 10, 16)
    table = new_table(64, 2, "cpu")
    g, h = _split(keys * 7, 16, "cpu")
    stored = hnb.insert(table, 2, g, h)
    assert stored[:10].all() and not stored[10:].any()
    assert int((table[:, 0] >= 0).sum()) == 10
    assert hnb.erase(table, 2, g, h).sum() == 10
    assert int((table[:, 0] == TOMBSTONE).sum()) == 10


def test_numba_launchers_validate() -> None:
    table = new_table(16, 2, "cpu")
    g = torch.zeros(3, dtype=torch.int64)
    h = torch.zeros(3, 2, dtype=torch.int64)
    for fn in (hnb.probe, hnb.find, hnb.insert, hnb.erase):
        with pytest.raises(TypeError, match="table"):
            fn(table.int(), 2, g, h)
        with pytest.raises(ValueError, match="table"):
            fn(new_table(12, 2, "cpu"), 2, g, h)
        with pytest.raises(ValueError, match="table"):
            fn(table.to("meta"), 2, g, h)
        with pytest.raises(TypeError, match="group_ids"):
            fn(table, 2, g.int(), h)
        with pytest.raises(ValueError, match="group_ids"):
            fn(table, 2, g[:2], h)
        with pytest.raises(ValueError, match="hashes"):
            fn(table, 2, g, torch.zeros(3, 4, dtype=torch.int64)[:, ::2])
    full = new_table(4, 2, "cpu")
    full[:, 0] = 7
    with pytest.raises(RuntimeError, match="free slot"):
        hnb.insert(full, 2, g[:1], h[:1])
    src = KeyIndex(16, capacity=64)
    src.add(0, [bytes([i]) * 16 for i in range(10)])
    with pytest.raises(RuntimeError, match="free slot"):
        hnb.rehash(src.table, 2, new_table(8, 2, "cpu"))
    assert hnb.rehash(src.table, 2, new_table(32, 2, "cpu")) == 10
    assert not bool((table[:, 0] != EMPTY).any())


def test_numba_probe_throughput() -> None:
    # A loose guard (the machine is shared); the figures come from the
    # benchmark: >= 10 M probes/s and >= 5 M inserts/s on one thread.
    import time

    n = 1 << 17
    gen = torch.Generator().manual_seed(0)
    g = torch.randint(0, 4, (n,), generator=gen)
    h = torch.randint(-(1 << 63), (1 << 63) - 1, (n, 4), generator=gen)
    index = KeyIndex(32, capacity=2 * n, backend="numba")
    index.add(g, h)
    elapsed = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        assert hnb.probe(index.table, 4, g, h).all()
        elapsed = min(elapsed, time.perf_counter() - t0)
    assert elapsed < 0.25, f"{n} numba probes took {elapsed:.3f} s"


def _check_host_table(ix: KeyIndex, keys: list[Key], present: set[Key]) -> None:
    t = ix.table
    assert t.dtype == torch.int64 and t.is_contiguous()
    assert t.device.type == "cpu" and t.shape == (ix.capacity, ix.W + 1)
    _check_against(ix, keys, present)
    # A torch-allocated copy of the same bytes answers identically.
    twin = KeyIndex.from_table(t.clone(), ix.hash_bytes, backend=ix.backend)
    g, h = _split(keys, ix.hash_bytes, "cpu")
    assert torch.equal(ix.contains(g, h), twin.contains(g, h))


@pytest.mark.parametrize("cpu_backend", ["numba", "torch"])
def test_host_tables_are_plain_int64_and_exact(cpu_backend: str) -> None:
    """Every CPU table KeyIndex makes (constructor, growth in add, reserve,
    grown_for/adopt, from_state_dict) has numpy-allocated memory (for huge
    pages) yet is a contiguous int64 tensor whose answers equal a Python set's
    and those of a torch-allocated copy of the same table."""
    hash_bytes = 32
    keys = _rand_keys(np.random.default_rng(20), 3000, hash_bytes)
    stored = keys[:2000]  # keys[2000:] are never added
    present: set[Key] = set()
    index = KeyIndex(hash_bytes, capacity=64, backend=cpu_backend)
    _check_host_table(index, keys, present)
    assert (index.table[:, 0] == EMPTY).all() and (index.table[:, 1:] == 0).all()
    caps = [index.capacity]
    for lo in range(0, 1000, 250):  # grows from 64 slots
        index.add(*_split(stored[lo : lo + 250], hash_bytes, "cpu"))
        present |= set(stored[lo : lo + 250])
        caps.append(index.capacity)
        _check_host_table(index, keys, present)
    assert caps[-1] > caps[0]
    index.reserve(5000)
    _check_host_table(index, keys, present)
    index.add(*_split(stored[1000:1500], hash_bytes, "cpu"))
    present |= set(stored[1000:1500])
    index.adopt(index.grown_for(20000))
    _check_host_table(index, keys, present)
    index.add(*_split(stored[1500:], hash_bytes, "cpu"))
    present |= set(stored[1500:])
    restored = KeyIndex.from_state_dict(index.state_dict(), backend=cpu_backend)
    assert restored.table.data_ptr() != index.table.data_ptr()
    _check_host_table(restored, keys, present)


def test_add_of_aligned_numpy_rows_calls_the_compiled_entry() -> None:
    # KeyIndex.add's numpy path calls insert_checked's compiled wrapper (no
    # dispatcher typing) for C-contiguous aligned rows, and the dispatcher
    # for unaligned ones (the wrapper's loads assume the alignment of its one
    # signature). Both store exactly the new keys.
    ix = KeyIndex(8, 64)
    assert ix.add(0, np.arange(5, dtype=np.int64).reshape(-1, 1)) == 5
    plan = ix._store
    assert plan[8] is hnb.insert_entry() and plan[8] is not hnb.insert_checked
    assert plan[5] is hnb.insert_checked
    calls = []

    def record(name, fn):
        # An aligned copy for the dispatcher: no unaligned signature compiled.
        return lambda t, g, c, h, p: calls.append(name) or fn(t, g, c, h.copy(), p)

    ix._store = plan[:5] + (record("dispatcher", plan[5]),) + plan[6:8]
    ix._store += (record("entry", plan[8]), *plan[9:])
    assert ix.add(0, np.arange(3, 8, dtype=np.int64).reshape(-1, 1)) == 3
    unaligned = np.zeros(33, dtype=np.uint8)[1:].view(np.int64).reshape(-1, 1)
    unaligned[:, 0] = [20, 21, 3, 22]
    assert unaligned.flags.c_contiguous and not unaligned.flags.aligned
    assert ix.add(0, unaligned) == 3
    assert calls == ["entry", "dispatcher"]
    assert ix.contains(0, np.array([[20], [21], [22], [7], [9]])).tolist() == [
        True, True, True, True, False,
    ]  # fmt: skip
