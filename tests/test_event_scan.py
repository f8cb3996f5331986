"""The follower's token-id scan (kernels/event_scan_numba.py): a payload
decoded from the scan's copy equals the payload decoded as it came, in
every field but the dropped ``token_ids``, and is refused exactly where the
payload is; the side-by-side int walk equals a one-by-one walk."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", exc_type=ImportError)

from kvhit.bindings import kv_events as kv  # noqa: E402
from kvhit.kernels import event_scan_numba as es  # noqa: E402

#: Token ids of every msgpack int width, both signs.
token = st.one_of(
    st.integers(0, 127),
    st.integers(128, 70_000),
    st.integers(0, 160_000),
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-40, -1),
)
extra = st.one_of(
    st.none(),
    st.lists(
        st.one_of(
            st.none(),
            st.tuples(
                st.text(max_size=3), st.floats(allow_nan=False), st.binary(max_size=3)
            ),
        ),
        max_size=3,
    ),
)


@st.composite
def events(draw):
    kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
    hashes = draw(st.lists(st.integers(0, 2**64 - 1), max_size=6))
    if kind == "cleared":
        return kv.AllBlocksCleared()
    if kind == "removed":
        return kv.BlockRemoved(block_hashes=hashes, medium="cpu", group_idx=1)
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        token_ids=draw(st.lists(token, max_size=300)),
        block_size=16,
        lora_id=draw(st.one_of(st.none(), st.integers(0, 9))),
        medium=draw(st.sampled_from([None, "cpu", "GPU"])),
        lora_name=None,
        extra_keys=draw(extra),
        group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
        lookahead_token_ids=draw(
            st.one_of(st.none(), st.lists(st.lists(token, max_size=3), max_size=2))
        ),
    )


def _fields(batch):
    """Every decoded field but token_ids (a Raw the follower never reads)."""
    out = [batch.ts, batch.data_parallel_rank]
    for ev in batch.events:
        d = msgspec.structs.asdict(ev)
        d.pop("token_ids", None)
        out.append(
            (
                type(ev),
                {
                    k: bytes(v) if isinstance(v, msgspec.Raw) else v
                    for k, v in d.items()
                },
            )
        )
    return out


def _decode(payload):
    """decode_keys with the scan at every size."""
    keep, kv.STRIP_FROM_BYTES = kv.STRIP_FROM_BYTES, 0
    try:
        return "ok", _fields(kv.decode_keys(payload))
    except kv.MalformedPayload as exc:
        return "refused", str(exc)
    finally:
        kv.STRIP_FROM_BYTES = keep


def _whole(payload):
    try:
        return "ok", _fields(kv.decode_keys_whole(payload))
    except kv.MalformedPayload as exc:
        return "refused", str(exc)


@settings(max_examples=150, deadline=None)
@given(st.lists(events(), max_size=4), st.one_of(st.none(), st.integers(0, 3)))
def test_stripped_payload_decodes_alike(evs, rank):
    payload = kv.encode_batch(kv.KVEventBatch(1.5, evs, rank))
    stripped = es.strip_token_ids(payload)
    stored = [e for e in evs if isinstance(e, kv.BlockStored)]
    assert (stripped is None) == (not stored)
    if stripped is not None:
        # Every token_ids array went, nothing else.
        removed = len(payload) - stripped.shape[0]
        want = sum(len(msgspec.msgpack.encode(e.token_ids)) - 1 for e in stored)
        assert removed == want
    assert _decode(payload) == _whole(payload)


@settings(max_examples=40, deadline=None)
@given(st.lists(events(), min_size=1, max_size=3), st.data())
def test_damaged_payloads_are_refused_as_they_came(evs, data):
    payload = kv.encode_batch(kv.KVEventBatch(1.5, evs))
    cut = data.draw(st.integers(0, len(payload) - 1))
    flip = data.draw(st.integers(0, len(payload) - 1))
    byte = data.draw(st.integers(0, 255))
    damaged = bytearray(payload)
    damaged[flip] = byte
    for p in (payload[:cut], bytes(damaged), payload + b"\x00", payload + b"\xc1"):
        assert _decode(p) == _whole(p)


def test_token_ids_that_are_not_all_ints_are_left_in():
    ev = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": toks, "block_size": 16, "lora_id": None, "medium": "cpu",
         "lora_name": None}
        for toks in ([1, "x", 2], [1.5], [[1]], 7, [2, 3])
    ]  # fmt: skip
    payload = msgspec.msgpack.encode([1.0, ev])
    stripped = es.strip_token_ids(payload)
    assert stripped is not None  # the last event's ints are dropped
    assert len(payload) - stripped.shape[0] == 2
    assert _decode(payload) == _whole(payload)
    # Not a batch at all, or trailing bytes: nothing to strip.
    for junk in (b"", b"\x91", msgspec.msgpack.encode({"a": 1}), payload + b"\x00"):
        assert es.strip_token_ids(junk) is None


def _walk_reference(buf, p, n):
    for _ in range(n):
        if p >= len(buf) or es.INT_SIZE[buf[p]] == 0:
            return -1
        p += int(es.INT_SIZE[buf[p]])
    return p if p <= len(buf) else -1


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 130, 600, 5000])
@pytest.mark.parametrize("mix", ["narrow", "wide", "all"])
def test_side_by_side_walk_equals_one_by_one(n, mix):
    # Arrays long enough for the four-span rounds, every width mix, a
    # non-int at the start, in a later span and past the end, and cut short.
    rng = np.random.default_rng(n)
    hi = {"narrow": 300, "wide": 2**40, "all": 2**63}[mix]
    toks = [int(x) for x in rng.integers(-50 if mix == "all" else 0, hi, n)]
    data = msgspec.msgpack.encode(toks)
    first = len(msgspec.msgpack.encode([0] * n)) - n  # the header's bytes
    tails = [b"", b"\xa3abc" * 300, b"\xcd" * 50]
    for tail in tails:
        buf = np.frombuffer(data + tail, dtype=np.uint8)
        assert es.walk_ints(buf, first, n) == _walk_reference(buf, first, n)
        assert es.walk_ints(buf, first, n) == len(data)
        # One more than there are: the walk runs into the tail.
        got = es.walk_ints(buf, first, n + 1)
        assert got == _walk_reference(buf, first, n + 1)
    for at in {0, n // 2, n - 1} if n else ():
        bad = list(toks)
        bad[at] = "s"
        b = msgspec.msgpack.encode(bad)
        buf = np.frombuffer(b + b"\x00" * 600, dtype=np.uint8)
        assert es.walk_ints(buf, first, n) == -1
    buf = np.frombuffer(data[:-1], dtype=np.uint8)
    assert es.walk_ints(buf, first, n) == (
        _walk_reference(buf, first, n) if n else first
    )


def test_a_follower_warms_the_scan_when_built():
    # The first large event of a follower process must not compile the scan.
    pytest.importorskip("zmq")
    from kvhit import KeyIndex
    from kvhit.bindings.events import EventFollower

    EventFollower("tcp://127.0.0.1:1", None, KeyIndex(8, capacity=16))
    assert es._warm
    assert es._strip.signatures  # loaded for the payload's array type


@settings(max_examples=150, deadline=None)
@given(
    widths=st.lists(
        st.sampled_from([1, 2, 3, 5, 9, -1, -2, -3, -5, -9]), min_size=64, max_size=900
    ),
    seed=st.integers(0, 2**32 - 1),
    damage=st.lists(
        st.tuples(st.floats(0, 1), st.sampled_from([0xC1, 0x90, 0x9C, 0xA3, 0xC4])),
        max_size=3,
    ),
    extra=st.integers(-3, 3),
)
def test_walk_steps_over_non_ints_only_before_it_meets(widths, seed, damage, extra):
    # The side-by-side walks step over bytes that start no int (they start
    # inside ints whose payload bytes are 0x80-0xcb); a non-int of the array
    # itself, anywhere, must still end the walk, and counts stay exact.
    rnd = random.Random(seed)
    # Each msgpack int width, non-negative (fixint, uint 8-64) and negative
    # (negative fixint, int 8-64): the bounds of each.
    span = {1: (0, 127), 2: (128, 255), 3: (256, 65535), 5: (65536, 2**32 - 1),
            9: (2**32, 2**64 - 1), -1: (-32, -1), -2: (-128, -33),
            -3: (-32768, -129), -5: (-(2**31), -32769),
            -9: (-(2**63), -(2**31) - 1)}  # fmt: skip
    toks = [rnd.randint(*span[w]) for w in widths]
    data = bytearray(msgspec.msgpack.encode(toks))
    first = len(msgspec.msgpack.encode([0] * len(toks))) - len(toks)
    for where, byte in damage:
        data[first + int(where * (len(data) - first - 1))] = byte
    buf = np.frombuffer(bytes(data) + b"\xa3abc" * 200, dtype=np.uint8)
    n = max(0, len(toks) + extra)
    assert es.walk_ints(buf, first, n) == _walk_reference(buf, first, n)
