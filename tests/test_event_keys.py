"""The follower's fast key conversion (bindings/kv_events.py): block hashes
read straight from msgpack, whole events at once, and the net effect of a
run of events, each equal to the per-hash definition (hash_to_bytes +
pack_hashes) and to a set replay."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", exc_type=ImportError)

from kvhit import KeyIndex  # noqa: E402
from kvhit.bindings import kv_events as kv  # noqa: E402
from kvhit.coordinator.fleet_index import EngineView, FleetIndex  # noqa: E402
from kvhit.coordinator.packing import pack_hashes, unpack_hashes  # noqa: E402


def _stored(hashes, gid=0, medium="cpu"):
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=gid,
    )


def _removed(hashes, gid=0, medium="cpu"):
    return kv.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=gid)


def _reference(hashes, hash_bytes):
    return pack_hashes([kv.hash_to_bytes(h, hash_bytes) for h in hashes], hash_bytes)


def _keys_of(payload):
    return kv.decode_keys(payload).events


ints64 = st.integers(0, (1 << 64) - 1)
# Small ints take msgpack's short encodings: the raw path must decline them.
mixed_ints = st.one_of(ints64, st.integers(0, 300), st.integers(1 << 31, 1 << 33))


@settings(max_examples=60, deadline=None)
@given(st.lists(mixed_ints, max_size=40))
def test_int_hashes_equal_per_hash_definition(hashes):
    want = _reference(hashes, 8)
    assert torch.equal(torch.from_numpy(kv.hash_words(hashes, 8, "e")), want)
    payload = kv.encode_batch(kv.KVEventBatch(0.0, [_stored(hashes)]))
    (event,) = _keys_of(payload)
    got = kv.event_words(event.block_hashes, 8, "e")
    assert got.dtype.name == "int64" and got.shape == (len(hashes), 1)
    assert torch.equal(torch.from_numpy(got), want)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 7, 8, 16, 20, 32]), st.data())
def test_bytes_hashes_equal_per_hash_definition(hash_bytes, data):
    hashes = data.draw(
        st.lists(st.binary(min_size=hash_bytes, max_size=hash_bytes), max_size=40)
    )
    want = _reference(hashes, hash_bytes)
    assert torch.equal(torch.from_numpy(kv.hash_words(hashes, hash_bytes, "e")), want)
    payload = kv.encode_batch(kv.KVEventBatch(0.0, [_removed(hashes)]))
    (event,) = _keys_of(payload)
    got = torch.from_numpy(kv.event_words(event.block_hashes, hash_bytes, "e"))
    assert torch.equal(got, want)
    assert unpack_hashes(got, hash_bytes) == hashes


def test_bad_hashes_named_on_every_path():
    good = b"\x01" * 16
    for hashes, err, match in [
        ([good, b"\x02" * 15], ValueError, r"e, block_hashes\[1\]: .*15 bytes"),
        ([good, b"\x02" * 17, b"\x03" * 15], ValueError, r"block_hashes\[1\]"),
        ([good, 5], ValueError, r"block_hashes\[1\]: int block hash"),
        ([good, "x"], TypeError, r"block_hashes\[1\]"),
    ]:
        with pytest.raises(err, match=match):
            kv.hash_words(hashes, 16, "e")
    for hashes, err, match in [
        ([1, -1], ValueError, r"block_hashes\[1\]: .*negative"),
        ([1, True], TypeError, r"block_hashes\[1\]"),
        ([1, 1 << 64], ValueError, r"block_hashes\[1\]"),
        ([1, b"\x00" * 7], ValueError, r"block_hashes\[1\]: .*7 bytes"),
        ([1, np.uint64(5)], TypeError, r"block_hashes\[1\]: .*uint64"),
        ([1, 2.0], TypeError, r"block_hashes\[1\]: .*float"),
    ]:
        with pytest.raises(err, match=match):
            kv.hash_words(hashes, 8, "e")
    # Raw msgpack that is not a list of hashes: malformed, named.
    payload = kv.encode_batch(kv.KVEventBatch(0.0, [_stored(["not a hash"])]))
    (event,) = _keys_of(payload)
    with pytest.raises(kv.MalformedPayload, match="e: block_hashes"):
        kv.event_words(event.block_hashes, 8, "e")


def test_decode_keys_refuses_what_decode_batch_refuses():
    good = kv.encode_batch(kv.KVEventBatch(0.0, [_stored([5]), kv.AllBlocksCleared()]))
    assert [type(e) for e in kv.decode_keys(good).events] == [
        kv.StoredKeys,
        kv.AllBlocksCleared,
    ]
    import msgspec

    for bad in (
        b"",
        b"junk",
        msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": []}]]),
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockRemoved", "block_hashes": [], "medium": 3}]]
        ),
    ):
        with pytest.raises(kv.MalformedPayload):
            kv.decode_batch(bad)
        with pytest.raises(kv.MalformedPayload):
            kv.decode_keys(bad)


op = st.tuples(
    st.sampled_from(["add", "remove", "clear"]),
    st.integers(0, 2),
    st.lists(st.integers(0, 5), max_size=6),
)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(op, max_size=12), st.sets(st.tuples(st.integers(0, 2), st.integers(0, 5)))
)
def test_plan_equals_set_replay(ops, seeded):
    """Mixed stores, removes and clears, repeats included, through the follower's
    decoding: one commit leaves the index equal to replaying them on a set."""
    hashes = [bytes([i + 1]) * 16 for i in range(6)]
    index = KeyIndex(16, capacity=16)
    state = set()
    for g, i in sorted(seeded):
        index.add([g], [hashes[i]])
        state.add((g, hashes[i]))
    events = []
    for kind, g, idx in ops:
        hs = [hashes[i] for i in idx]
        if kind == "clear":
            events.append(kv.AllBlocksCleared())
            state.clear()
        elif kind == "add":
            events.append(_stored(hs, g))
            state |= {(g, h) for h in hs}
        else:
            events.append(_removed(hs, g))
            state -= {(g, h) for h in hs}
    payload = kv.encode_batch(kv.KVEventBatch(0.0, events))
    plan = kv.plan_events(_keys_of(payload), 16, None, True, 0)
    before = len(index)
    stats = kv.commit_plan(index, plan)
    g, h = index.keys()
    got = set(zip(g.tolist(), unpack_hashes(h, 16), strict=True))
    assert got == state
    assert len(index) == len(state)
    assert before - stats.keys_removed + stats.keys_added == len(state)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("n", [1, 7, 25])
def test_one_event_commit_equals_the_general_path(backend, n):
    # One BlockStored into a KeyIndex: the host fast path (one kernel call,
    # the event's group id for every key) when the table has room, the
    # general path when it must grow (capacity 1) or is another backend;
    # the same keys and counts as a subclass, which takes the general path.
    class Hooked(KeyIndex):
        pass

    rng = np.random.default_rng(n)
    for capacity in (1, 256):
        fast = KeyIndex(8, capacity=capacity, backend=backend)
        ref = Hooked(8, capacity=capacity, backend="torch")
        for step in range(4):
            # Repeats across and inside events (a small pool).
            hashes = [int(x) for x in rng.integers(1 << 40, (1 << 40) + 2 * n, n)]
            payload = kv.encode_batch(kv.KVEventBatch(0.0, [_stored(hashes, step % 2)]))
            plan = kv.plan_events(_keys_of(payload), 8, None, True, 0)
            a = kv.commit_plan(fast, plan)
            b = kv.commit_plan(ref, kv.plan_events(_keys_of(payload), 8, None, True, 0))
            assert (a.keys_added, a.keys_removed) == (b.keys_added, b.keys_removed)
            assert len(fast) == len(ref) and fast.capacity == ref.capacity
            gf, hf = fast.keys()
            gr, hr = ref.keys()
            assert set(zip(gf.tolist(), hf[:, 0].tolist(), strict=True)) == set(
                zip(gr.tolist(), hr[:, 0].tolist(), strict=True)
            )


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_add_trusted_takes_one_group_id_for_every_key(backend):
    index = KeyIndex(8, capacity=1, backend=backend)
    h = np.arange(1, 41, dtype=np.int64).reshape(-1, 1)
    assert index.add_trusted(3, h[:25]) == 25  # grows from capacity 1
    assert index.add_trusted(3, torch.from_numpy(h)) == 15
    assert index.add_trusted(4, h[:5]) == 5
    assert len(index) == 45
    assert bool(index.contains(3, h).all()) and bool(index.contains(4, h[:5]).all())
    assert not bool(index.contains(4, h[5:]).any())


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("n", [1, 25])
def test_one_event_commit_into_an_engine_equals_the_general_path(backend, n):
    # One BlockStored into one engine of a fleet (a FleetFollower's commit):
    # the host fast path (FleetIndex.add with the event's group id as an int
    # and its words) against a subclass of EngineView, which takes the
    # general path; the same counts and holders, across growth (capacity 1)
    # and repeats.
    class Hooked(EngineView):
        pass

    rng = np.random.default_rng(n)
    calls = []
    add = EngineView.add

    def spy(view, group_ids, hashes):
        calls.append((type(view), type(group_ids)))
        return add(view, group_ids, hashes)

    for capacity in (1, 256):
        fleets = [FleetIndex(4, 8, capacity=capacity, backend=backend) for _ in "ab"]
        fast, ref = fleets[0].engine_view(2), Hooked(fleets[1], 2)
        for step in range(4):
            hashes = [int(x) for x in rng.integers(1 << 40, (1 << 40) + 2 * n, n)]
            payload = kv.encode_batch(kv.KVEventBatch(0.0, [_stored(hashes, step % 2)]))
            with mock.patch.object(EngineView, "add", spy):
                a, b = (
                    kv.commit_plan(
                        view, kv.plan_events(_keys_of(payload), 8, None, True, 0)
                    )
                    for view in (fast, ref)
                )
            assert a == b
            assert fleets[0].capacity == fleets[1].capacity
            sizes = [f.engine_sizes().tolist() for f in fleets]
            assert sizes[0] == sizes[1] and sizes[0][2] == len(fast) > 0
            g, h = fleets[1].engine_keys(2)
            assert bool(fleets[0].contains(2, g, h).all())
    # The fast path is the numba fleet's (a host table: one int group id);
    # torch's fleet, and the subclass, take the general path (an array).
    fast_kinds = {kind for view, kind in calls if view is EngineView}
    assert fast_kinds == ({int} if backend == "numba" else {np.ndarray})
    assert {kind for view, kind in calls if view is Hooked} == {np.ndarray}


def test_one_event_into_a_removed_engine_is_refused_and_changes_nothing():
    fleet = FleetIndex(4, 8, capacity=64)
    view = fleet.engine_view(1)
    fleet.remove_engine(1)
    payload = kv.encode_batch(kv.KVEventBatch(0.0, [_stored([1 << 40, 5 << 40])]))
    with pytest.raises(ValueError, match="engine_ids"):
        kv.commit_plan(view, kv.plan_events(_keys_of(payload), 8, None, True, 0))
    assert len(fleet) == 0 and fleet.engine_sizes().tolist() == [0, 0, 0, 0]
