"""The follower's stored-block scan (kernels/event_plan_numba.py) against
the general path: ``plan_payload`` makes the plan ``plan_events(decode_keys
(payload))`` makes (the same keys in the same order, events and skips), or
raises the same error, on vLLM's encodings, on every field's other types,
on hand-made maps (keys out of order, repeated, unknown, missing), and on
damaged bytes; and the scan does take vLLM's usual payloads."""

from __future__ import annotations

import os
import random

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec", exc_type=ImportError)

from kvhit.bindings import kv_event_scan as ks  # noqa: E402
from kvhit.bindings import kv_events as kv  # noqa: E402
from kvhit.coordinator import event_payload  # noqa: E402

# KVHIT_PARITY_EXAMPLES=N runs N examples per parity test (a large random run).
EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "300"))
MEDIA = [None, frozenset({"cpu"}), frozenset({"GPU", "cpu"}), frozenset({"é"})]

int_hash = st.one_of(
    st.integers(2**32, 2**64 - 1),  # uint 64 on the wire: the scan's layout
    st.integers(0, 2**64 - 1),
    st.integers(-(2**63), -1),
)
text = st.one_of(st.none(), st.sampled_from(["cpu", "GPU", "", "é", "a" * 40]))


@st.composite
def hashes(draw):
    """A ``block_hashes`` list: ints, bytes of one width, or a mix."""
    form = draw(st.sampled_from(["int", "int", "bytes", "bytes", "mixed"]))
    n = draw(st.integers(0, 5))
    width = draw(st.sampled_from([8, 16, 32, 7]))
    if form == "int":
        return [draw(int_hash) for _ in range(n)]
    if form == "bytes":
        return [draw(st.binary(min_size=width, max_size=width)) for _ in range(n)]
    return [draw(st.one_of(int_hash, st.binary(max_size=33))) for _ in range(n)]


@st.composite
def events(draw):
    kind = draw(st.sampled_from(["stored"] * 5 + ["removed", "cleared"]))
    if kind == "cleared":
        return kv.AllBlocksCleared()
    if kind == "removed":
        return kv.BlockRemoved(
            block_hashes=draw(hashes()), medium=draw(text), group_idx=1
        )
    return _stored_event(
        draw,
        draw(hashes()),
        text,
        tokens=40,
        groups=st.one_of(st.none(), st.integers(0, 2**63 - 1), st.integers(-5, -1)),
        extras=st.one_of(st.none(), st.just([None]), st.just([(1, "x")])),
        lookahead=st.one_of(st.none(), st.just([[1, 2]])),
    )


def _stored_event(draw, block_hashes, text, tokens, groups, extras, lookahead):
    """A ``BlockStored`` of ``block_hashes``, every other field drawn: its
    strings from ``text``, up to ``tokens`` token ids, ``group_idx`` from
    ``groups``, ``extra_keys`` and ``lookahead_token_ids`` from theirs."""
    return kv.BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=draw(st.one_of(st.none(), int_hash, st.binary(max_size=40))),
        token_ids=draw(st.lists(st.integers(-(2**63), 2**64 - 1), max_size=tokens)),
        block_size=draw(st.integers(-(2**63), 2**64 - 1)),
        lora_id=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        medium=draw(text),
        lora_name=draw(text),
        extra_keys=draw(extras),
        group_idx=draw(groups),
        kv_cache_spec_kind=draw(text),
        kv_cache_spec_sliding_window=draw(st.one_of(st.none(), st.integers(0, 9))),
        locality=draw(text),
        ownership=draw(text),
        session_id=draw(text),
        lookahead_token_ids=draw(lookahead),
    )


def _keys(plan):
    """The plan as the index meets it: every key in order, with the counts."""
    rows = [
        (is_add, gid, tuple(row))
        for is_add, gid, words in plan.parts
        for row in np.asarray(words).tolist()
    ]
    return plan.clear, plan.events, plan.skipped, rows


def _outcome(fn, payload, hash_bytes, media, gid=7):
    try:
        return "ok", _keys(fn(payload, hash_bytes, media, True, gid))
    except (TypeError, ValueError) as exc:  # MalformedPayload is a ValueError
        return type(exc).__name__, str(exc)


def _general(payload, hash_bytes, media, honor_clears, default_gid):
    return kv.plan_events(
        kv.decode_keys(payload).events, hash_bytes, media, honor_clears, default_gid
    )


def _scanned(payload, hash_bytes, media):
    """Whether the scan read ``payload`` itself (no fallback)."""
    spec = ks.stored_spec(media)
    return event_payload.scan_stored(payload, spec, hash_bytes, 7) is not None


def check(payload, hash_bytes=8, media=frozenset({"cpu"})):
    want = _outcome(_general, payload, hash_bytes, media)
    assert _outcome(ks.plan_payload, payload, hash_bytes, media) == want
    if _scanned(payload, hash_bytes, media):
        assert want[0] == "ok"  # the scan never takes what msgspec refuses
    return want


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(events(), max_size=5),
    st.one_of(st.none(), st.integers(0, 3)),
    st.sampled_from([8, 16, 32]),
    st.sampled_from(MEDIA),
)
def test_plan_equals_the_general_path(evs, rank, hash_bytes, media):
    payload = kv.encode_batch(kv.KVEventBatch(1.5, evs, rank))
    check(payload, hash_bytes, media)


ascii_text = st.one_of(st.none(), st.sampled_from(["cpu", "GPU", "", "x" * 40]))


@st.composite
def scannable(draw, hash_bytes):
    """A ``BlockStored`` in the forms the scan reads (ASCII strings, one hash
    layout, no extra keys): ``(event, whether it fits hash_bytes)``."""
    n = draw(st.integers(0, 4))
    width = draw(st.sampled_from([hash_bytes, hash_bytes, 8, 32, 16]))
    ints = width == 8 and draw(st.booleans())
    hashes = [
        draw(st.integers(2**32, 2**64 - 1))
        if ints
        else draw(st.binary(min_size=width, max_size=width))
        for _ in range(n)
    ]
    # Past 63 token ids the scan walks them four spans at a time.
    event = _stored_event(
        draw,
        hashes,
        ascii_text,
        tokens=100,
        groups=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        extras=st.none(),
        lookahead=st.none(),
    )
    return event, not n or width == hash_bytes


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.sampled_from([8, 16, 32]), st.sampled_from(MEDIA[:3]), st.data())
def test_the_scan_takes_what_it_reads(hash_bytes, media, data):
    # Events in the scan's forms: scanned exactly when every hash fits the
    # index, and then the plan is the general path's.
    drawn = data.draw(st.lists(scannable(hash_bytes), max_size=5))
    rank = data.draw(st.one_of(st.none(), st.integers(0, 3)))
    payload = kv.encode_batch(kv.KVEventBatch(1.5, [e for e, _ in drawn], rank))
    fits = all(ok for _, ok in drawn)
    assert _scanned(payload, hash_bytes, media) == fits
    outcome = check(payload, hash_bytes, media)[0]
    # (A misfit is refused unless the media filter skips it first.)
    assert outcome in (("ok",) if fits else ("ok", "ValueError"))


@settings(max_examples=max(EXAMPLES // 3, 20), deadline=None)
@given(st.sampled_from([8, 32]), st.sampled_from(MEDIA[:2]), st.data())
def test_damaged_scannable_payloads_as_the_general_path(hash_bytes, media, data):
    drawn = data.draw(st.lists(scannable(hash_bytes), min_size=1, max_size=3))
    payload = kv.encode_batch(kv.KVEventBatch(1.5, [e for e, _ in drawn]))
    damaged = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        damaged[data.draw(st.integers(0, len(payload) - 1))] = data.draw(
            st.integers(0, 255)
        )
    cut = data.draw(st.integers(0, len(payload) - 1))
    for p in (payload[:cut], bytes(damaged), payload + b"\x00"):
        check(p, hash_bytes, media)


def test_arguments_the_scan_leaves_to_the_general_path():
    payload = kv.encode_batch(kv.KVEventBatch(1.5, _stored(3)))
    calls = [
        (0, None, 0),
        (-8, None, 0),
        (12, None, 0),
        (True, None, 0),
        (8, None, -1),
        (8, None, 2**63),
        (8, None, True),
        (8, None, 1.0),
        (8, {"cpu"}, 0),
        (8, frozenset({b"cpu"}), 0),
        (8, ["cpu"], 0),
    ]
    for hash_bytes, media, gid in calls:
        got, want = (
            _outcome(fn, payload, hash_bytes, media, gid)
            for fn in (ks.plan_payload, _general)
        )
        assert got == want, (hash_bytes, media, gid)


@settings(max_examples=max(EXAMPLES // 3, 20), deadline=None)
@given(st.lists(events(), min_size=1, max_size=3), st.data())
def test_damaged_payloads_as_the_general_path(evs, data):
    payload = kv.encode_batch(kv.KVEventBatch(1.5, evs))
    cut = data.draw(st.integers(0, len(payload) - 1))
    damaged = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 3))):
        damaged[data.draw(st.integers(0, len(payload) - 1))] = data.draw(
            st.integers(0, 255)
        )
    for p in (payload[:cut], bytes(damaged), payload + b"\x00", payload + b"\xc0"):
        check(p)


def _stored(n, gid=0, medium="cpu", width=8, tokens=16, seed=0):
    """vLLM's Mooncake store connector's events: one block each."""
    rng = random.Random(seed)
    return [
        kv.BlockStored(
            block_hashes=[
                rng.getrandbits(64) | 1 << 63 if width == 8 else rng.randbytes(width)
            ],
            parent_block_hash=rng.getrandbits(64) if i else None,
            token_ids=[rng.randrange(128_256) for _ in range(tokens)],
            block_size=16,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=gid,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("width", [8, 16, 32])
@pytest.mark.parametrize("n", [0, 1, 25, 300])
def test_the_store_connectors_payloads_are_scanned(width, n):
    evs = _stored(n, width=width)
    payload = kv.encode_batch(kv.KVEventBatch(1.5, evs))
    assert _scanned(payload, width, frozenset({"cpu"}))
    got = check(payload, width)
    assert got[0] == "ok" and len(got[1][3]) == n and got[1][1] == n
    # One group, every event taken: the keys come as one part.
    plan = ks.plan_payload(payload, width, frozenset({"cpu"}), True, 0)
    assert len(plan.parts) == (1 if n else 0)


def test_runs_of_a_group_and_skipped_media():
    evs = [
        *_stored(3, gid=1),
        *_stored(2, gid=2, seed=1),
        *_stored(1, gid=2, medium="GPU", seed=2),
        *_stored(2, gid=2, seed=3),
        *_stored(1, gid=1, seed=4),
    ]
    payload = kv.encode_batch(kv.KVEventBatch(1.5, evs, 0))
    assert _scanned(payload, 8, frozenset({"cpu"}))
    got = check(payload)
    assert got[1][1:3] == (8, 1)
    plan = ks.plan_payload(payload, 8, frozenset({"cpu"}), True, 0)
    # The skipped event between two of group 2 leaves them one run.
    assert [(gid, len(w)) for _, gid, w in plan.parts] == [(1, 3), (2, 4), (1, 1)]
    check(payload, media=None)
    assert len(ks.plan_payload(payload, 8, None, True, 0).parts) == 3


def _event_map(**over):
    ev = {
        "type": "BlockStored",
        "block_hashes": [2**63 + 1, 2**63 + 2],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 16,
        "lora_id": None,
        "medium": "cpu",
        "lora_name": None,
    }
    for k, v in over.items():
        if v is KeyError:
            ev.pop(k)
        else:
            ev[k] = v
    return ev


def _batch(*evs, ts=1.5, tail=()):
    return msgspec.msgpack.encode([ts, list(evs), *tail])


@pytest.mark.parametrize(
    "payload, scanned",
    [
        (_batch(_event_map()), True),
        (_batch(_event_map(), tail=(None,)), True),
        (_batch(_event_map(), tail=(3,)), True),
        (_batch(_event_map(group_idx=5, locality="x")), True),
        # Keys in another order (msgspec takes them): the search wraps.
        (_batch(dict(reversed(_event_map().items()))), True),
        # What the scan leaves to msgspec, taken or refused there.
        (_batch(_event_map(), tail=(3, 4)), False),
        (_batch(_event_map(), ts=2), False),
        # A float 32 time stamp (msgspec writes float 64).
        (b"\x92\xca\x3f\xc0\x00\x00" + _batch(_event_map())[10:], False),
        (_batch(_event_map(medium="é")), False),
        (_batch(_event_map(lora_name=b"x")), False),
        (_batch(_event_map(block_size=1.5)), False),
        (_batch(_event_map(block_size=True)), False),
        (_batch(_event_map(block_size=KeyError)), False),
        (_batch(_event_map(type="BlockRemoved")), False),
        (_batch(_event_map(type=KeyError)), False),
        (_batch(_event_map(unknown=1)), False),
        (_batch(_event_map(extra_keys=[None])), False),
        (_batch(_event_map(extra_keys=None)), True),
        (_batch(_event_map(token_ids=[1, "x"])), False),
        (_batch(_event_map(token_ids=7)), False),
        (_batch(_event_map(group_idx=-1)), False),
        (_batch(_event_map(group_idx=2**63)), False),
        (_batch(_event_map(block_hashes=[1, 2])), False),
        (_batch(_event_map(block_hashes=[2**63, b"\0" * 8])), False),
        (_batch(_event_map(block_hashes=[b"\0" * 8, b"\1" * 8])), True),
        (_batch(_event_map(block_hashes=[])), True),
        (_batch(_event_map(parent_block_hash=b"\1" * 40)), True),
        (_batch(_event_map(parent_block_hash="x")), False),
        (_batch(_event_map(), [1]), False),
        (_batch(), True),
    ],
)
def test_hand_made_payloads(payload, scanned):
    check(payload)
    assert _scanned(payload, 8, frozenset({"cpu"})) == scanned


def test_a_repeated_key_is_left_to_msgspec():
    one = msgspec.msgpack.encode(_event_map())
    # Append "medium": "GPU" to the map (msgspec keeps the last).
    head = one[0]
    assert 0x80 <= head <= 0x8E
    dup = bytes([head + 1]) + one[1:] + msgspec.msgpack.encode("medium")
    dup += msgspec.msgpack.encode("GPU")
    payload = b"\x92\xcb" + msgspec.msgpack.encode(1.5)[1:] + b"\x91" + dup
    assert not _scanned(payload, 8, frozenset({"cpu"}))
    assert check(payload)[1][1:3] == (0, 1)  # GPU: skipped


def test_follower_payloads_take_the_scan(monkeypatch):
    # The follower plans every payload with plan_payload, which scans.
    from kvhit.bindings.events import EventFollower
    from kvhit.coordinator.key_index import KeyIndex

    calls = []
    real = event_payload.scan_stored

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(ks, "scan_stored", spy)
    index = KeyIndex(8, capacity=1 << 10)
    follower = EventFollower("tcp://127.0.0.1:1", None, index, topic="kv", medium="cpu")
    payload = kv.encode_batch(kv.KVEventBatch(1.5, _stored(25, gid=2)))
    follower._handle_live([[b"kv", (0).to_bytes(8, "big"), payload]])
    assert calls == [True] and follower.batches_applied == 1 and len(index) == 25


def test_vllms_own_payloads():
    # The fixtures' bytes are vLLM 0.33.0's (tests/make_event_fixtures.py).
    from pathlib import Path

    data = Path(__file__).parent / "data" / "kv_events_vllm_0_33_0.live.msgpack"
    payloads = [frames[2] for frames in msgspec.msgpack.decode(data.read_bytes())]
    for payload in payloads:
        for hash_bytes in (8, 32):
            for media in (None, frozenset({"cpu"})):
                check(payload, hash_bytes, media)
    # Two BlockStored of 32-byte digests, as vLLM wrote them: scanned.
    assert _scanned(payloads[0], 32, None)
    assert len(ks.plan_payload(payloads[0], 32, None, True, 0).parts) == 2


@pytest.mark.parametrize("width", [8, 32])
def test_the_kernel_reads_a_uint8_array_as_bytes(width):
    # scan_stored takes bytes or a uint8 array (its docstring); the word
    # loads and the unowned views are written for either: the same result
    # and words, on a whole payload and on cut ones (the byte-by-byte ends).
    from kvhit.kernels.event_plan_numba import scan_stored

    spec = ks.stored_spec(frozenset({"cpu"}))
    payload = kv.encode_batch(kv.KVEventBatch(1.5, _stored(5, width=width)))
    for p in (payload, payload[:-3], payload[: len(payload) // 2]):
        got = []
        for buf in (p, np.frombuffer(p, np.uint8), np.array(bytearray(p))):
            out = np.zeros((len(p) // 9 + 40, width // 8), np.int64)
            got.append((scan_stored(buf, spec, width, 0, out), out.tolist()))
        assert got[0] == got[1] == got[2]
        assert (got[0][0][0] >= 0) == (p is payload)
