"""KV-cache events: vLLM 0.33.0's wire format -> KeyIndex (bindings/events.py).

The fixtures under tests/data/ were produced by vLLM's own ZmqEventPublisher
(tests/make_event_fixtures.py), so decoding them proves the format is vLLM's.
Socket tests run a publisher speaking the same format on 127.0.0.1 (random
ports); every wait is bounded in time.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import deque
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
import torch

msgspec = pytest.importorskip(
    "msgspec", reason="needs msgspec (pip install kvhit[events])", exc_type=ImportError
)

from helpers import bind_retrying, block_stored, wait_until  # noqa: E402

from kvhit.bindings import events as ev  # noqa: E402
from kvhit.coordinator.key_index import KeyIndex  # noqa: E402
from kvhit.coordinator.packing import unpack_hashes  # noqa: E402

DATA = Path(__file__).parent / "data"
PREFIX = "kv_events_vllm_0_33_0"
WAIT_S = 10.0  # upper bound for any wait; passing runs take milliseconds


def _load(name: str) -> Any:
    return msgspec.msgpack.decode((DATA / f"{PREFIX}.{name}.msgpack").read_bytes())


LIVE: list[list[bytes]] = _load("live")
REPLAY: list[list[bytes]] = _load("replay")
EXPECTED: dict[str, Any] = json.loads((DATA / f"{PREFIX}.expected.json").read_text())
TOPIC = EXPECTED["topic"]
PAYLOADS = [frames[2] for frames in LIVE]


@pytest.fixture
def zmq():
    return pytest.importorskip(
        "zmq", reason="needs pyzmq (pip install kvhit[events])", exc_type=ImportError
    )


# --- helpers


def _unhex(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"hex"}:
        return bytes.fromhex(value["hex"])
    if isinstance(value, list):
        return [_unhex(v) for v in value]
    return value


def _event_dict(event: ev.KVCacheEvent) -> dict[str, Any]:
    """Our decoded struct in the shape the generator wrote vLLM's objects."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        out[name] = json.loads(json.dumps(value, default=lambda b: {"hex": b.hex()}))
    return out


def _set_replay(
    batches: list[list[dict[str, Any]]],
    medium: str | None = None,
    honor_clears: bool = True,
    hash_bytes: int = 32,
) -> set[tuple[int, bytes]]:
    """Oracle: the events applied one by one to a Python set."""
    keys: set[tuple[int, bytes]] = set()
    for events in batches:
        for e in events:
            if e["type"] == "AllBlocksCleared":
                if honor_clears:
                    keys.clear()
                continue
            if medium is not None and e["medium"] != medium:
                continue
            gid = e.get("group_idx") or 0
            for h in _unhex(e["block_hashes"]):
                key = (gid, ev.hash_to_bytes(h, hash_bytes))
                (keys.add if e["type"] == "BlockStored" else keys.discard)(key)
    return keys


def _contents(index: KeyIndex) -> set[tuple[int, bytes]]:
    gids, words = index.keys()
    return set(zip(gids.tolist(), unpack_hashes(words, index.hash_bytes), strict=True))


def _expected_events(upto: int) -> list[list[dict[str, Any]]]:
    return [b["events"] for b in EXPECTED["batches"][:upto]]


class _CountingIndex(KeyIndex):
    """The real KeyIndex, counting calls, to check the batching claim."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []

    def add(self, group_ids: Any, hashes: Any) -> int:
        self.calls.append(("add", len(hashes)))
        return super().add(group_ids, hashes)

    def remove(self, group_ids: Any, hashes: Any) -> int:
        self.calls.append(("remove", len(hashes)))
        return super().remove(group_ids, hashes)

    def clear(self) -> None:
        self.calls.append(("clear", 0))
        super().clear()


def _removed(hashes: list[Any], gid: int | None = 0, medium: str | None = "cpu"):
    return ev.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=gid)


# --- decoding vLLM's bytes


def test_fixtures_decode_exactly_as_vllm_wrote_them():
    assert len(PAYLOADS) == len(EXPECTED["batches"]) == 5
    for frames, want in zip(LIVE, EXPECTED["batches"], strict=True):
        topic, seq, payload = frames
        assert topic == TOPIC.encode()
        assert int.from_bytes(seq, "big") == want["seq"]
        batch = ev.decode_batch(payload)
        assert batch.ts == want["ts"]
        assert batch.data_parallel_rank == want["data_parallel_rank"]
        assert [_event_dict(e) for e in batch.events] == want["events"]
        # Same fields, order and options as vLLM: re-encoding is byte-exact.
        assert ev.encode_batch(batch) == payload


def test_replay_fixture_protocol():
    assert bytes.fromhex(EXPECTED["end_seq_hex"]) == ev.END_SEQ
    *batches, end = REPLAY
    assert end == [b"", b"", ev.END_SEQ, b""]
    # vLLM replays every buffered batch with seq >= the requested start (1).
    assert [int.from_bytes(f[2], "big") for f in batches] == [1, 2, 3, 4]
    for frames in batches:
        assert frames[0] == b"" and frames[1] == TOPIC.encode()
        assert frames[3] == PAYLOADS[int.from_bytes(frames[2], "big")]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x00", b"garbage", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]])],
)
def test_malformed_payload_raises(payload):
    with pytest.raises(ev.MalformedPayload):
        ev.decode_batch(payload)


def test_int_hashes_follow_vllm_conversion():
    # vLLM: int.from_bytes(hash, "big") & (2**64 - 1) -- the last 8 bytes.
    h32 = sha256(b"x").digest()
    as_int = int.from_bytes(h32, "big") & ((1 << 64) - 1)
    assert ev.hash_to_bytes(as_int, 8) == h32[-8:]
    assert ev.hash_to_bytes(as_int & 0xFFFF, 2) == h32[-2:]
    for bad in ((as_int, 16), (as_int, 32), (1 << 40, 4), (-1, 8), (b"\x00" * 7, 8)):
        with pytest.raises(ValueError):
            ev.hash_to_bytes(*bad)
    with pytest.raises(ValueError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"):
        ev.hash_to_bytes(as_int, 32)


# --- apply()


def test_apply_fixture_batches_match_set_replay():
    batches = [ev.decode_batch(p) for p in PAYLOADS[:3]]
    for medium, honor in ((None, True), ("cpu", True), ("GPU", False), ("CPU", True)):
        index = KeyIndex(hash_bytes=32, capacity=64)
        for b in batches:
            ev.apply(index, b, medium=medium, honor_clears=honor)
        assert _contents(index) == _set_replay(_expected_events(3), medium, honor)
    # A sanity anchor independent of the oracle: GPU tier, clears ignored.
    h = [sha256(f"block{i}".encode()).digest() for i in range(8)]
    index = KeyIndex(hash_bytes=32, capacity=64)
    for b in batches:
        ev.apply(index, b, medium="GPU", honor_clears=False)
    assert _contents(index) == {(2, h[2]), (2, h[4])}


def test_apply_int_hash_batch():
    batch = ev.decode_batch(PAYLOADS[3])  # int hashes, as stock vLLM publishes
    wide = KeyIndex(hash_bytes=32, capacity=64)
    wide.add([9], [b"\x01" * 32])
    with pytest.raises(ValueError, match="cannot be widened"):
        ev.apply(wide, batch)
    assert _contents(wide) == {(9, b"\x01" * 32)}  # untouched: all-or-nothing
    narrow = KeyIndex(hash_bytes=8, capacity=64)
    stats = ev.apply(narrow, batch)
    short = [sha256(f"short{i}".encode()).digest()[:8] for i in range(3)]
    block7 = sha256(b"block7").digest()
    assert _contents(narrow) == {(0, block7[-8:]), (3, short[0]), (3, short[2])}
    # The removed key (short1) was never present: changes are counted, not asks.
    assert (stats.events, stats.keys_added, stats.keys_removed) == (3, 3, 0)


def test_apply_order_semantics_and_few_calls():
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    index = _CountingIndex(hash_bytes=16, capacity=64)
    index.add([0, 0], [b, c])
    index.calls.clear()
    events = [
        block_stored([a]),
        _removed([a]),  # add then remove: ends removed
        _removed([b]),
        block_stored([b]),  # remove then add: ends present
        block_stored([c], gid=1),  # other group: a different key
        _removed([c]),
        block_stored([a], medium="GPU"),  # filtered out below
    ]
    stats = ev.apply(index, events, medium="cpu")
    assert _contents(index) == {(0, b), (1, c)}
    assert stats.events == 6 and stats.skipped == 1
    assert [name for name, _ in index.calls] == ["remove", "add"]
    # A clear drops everything before it, in the same single pass.
    index.calls.clear()
    ev.apply(
        index, [block_stored([a]), ev.AllBlocksCleared(), block_stored([c], gid=None)]
    )
    assert _contents(index) == {(0, c)}
    assert [name for name, _ in index.calls] == ["clear", "add"]


def test_apply_random_sequences_match_sequential_set():
    rng = random.Random(7)
    pool = [(rng.randrange(3), rng.randbytes(16)) for _ in range(40)]
    for _ in range(30):
        index = KeyIndex(hash_bytes=16, capacity=16)
        oracle: set[tuple[int, bytes]] = set()
        for _ in range(4):
            events: list[Any] = []
            for _ in range(rng.randrange(60)):
                r = rng.random()
                if r < 0.03:
                    events.append(ev.AllBlocksCleared())
                    oracle.clear()
                    continue
                keys = rng.sample(pool, rng.randint(1, 3))
                gid = keys[0][0]
                hashes = [h for _, h in keys]
                if r < 0.6:
                    events.append(block_stored(hashes, gid))
                    oracle.update((gid, h) for h in hashes)
                else:
                    events.append(_removed(hashes, gid))
                    oracle.difference_update((gid, h) for h in hashes)
            ev.apply(
                index, ev.decode_batch(ev.encode_batch(ev.KVEventBatch(0.0, events)))
            )
            assert _contents(index) == oracle


# --- sockets


class Publisher:
    """vLLM's ZmqEventPublisher wire format, driven step by step by a test.

    XPUB instead of PUB only so the test can wait for the subscription (no
    slow-joiner sleeps); subscribers see the same messages. The ROUTER answers
    replays exactly like ``ZmqEventPublisher._service_replay``.
    """

    def __init__(
        self,
        zmq: Any,
        topic: str = TOPIC,
        buffer_steps: int = 10_000,
        manual: bool = False,
    ):
        self._zmq = zmq
        #: The subscription reaches the publisher only when the test says
        #: (:meth:`admit_subscriber`): a slow joiner, as late as wanted.
        self.manual = manual
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.replay_requests: list[list[bytes]] = []
        self.replays_served = 0  # answered to the end marker
        #: Cleared: replay requests wait (received, not yet answered).
        self.replay_gate = threading.Event()
        self.replay_gate.set()
        self.recorded_replay: list[list[bytes]] | None = None  # answer verbatim
        self._lock = threading.Lock()
        self.endpoint = self.replay_endpoint = ""
        self._open()

    def _open(self) -> None:
        """Bind (the same ports again after :meth:`restart`) and serve replays."""
        zmq = self._zmq
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        if self.manual:
            self.pub.setsockopt(zmq.XPUB_MANUAL, 1)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if self.endpoint:
            bind_retrying(self.pub, self.endpoint, WAIT_S, poll_s=0.01)
            bind_retrying(self.router, self.replay_endpoint, WAIT_S, poll_s=0.01)
        else:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
            port = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """A new publisher process behind the same sockets: seq 0, empty buffer."""
        with self._lock:
            self.buffer.clear()
        self.seq = 0

    def restart(self) -> None:
        """Kill the publisher and start a new one on the same ports: the
        subscriber's connection drops and ZMQ reconnects it."""
        self._close_sockets()
        self._open()

    def _close_sockets(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        self.pub.close(linger=0)
        self.router.close(linger=0)

    def wait_subscriber(self, timeout_s: float = WAIT_S) -> None:
        assert self.pub.poll(int(timeout_s * 1000)), "no subscriber"
        assert self.pub.recv() == b"\x01" + self.topic

    def admit_subscriber(self) -> None:
        """``manual``: the subscription received by :meth:`wait_subscriber`
        takes effect (XPUB_MANUAL: until now, nothing reached that SUB)."""
        self.pub.setsockopt(self._zmq.SUBSCRIBE, self.topic)

    def publish(self, payload: bytes, drop: bool = False, keep: bool = True) -> int:
        """Publish the next seq; ``drop``: not sent live; ``keep``: replayable."""
        seq, self.seq = self.seq, self.seq + 1
        if keep:
            with self._lock:
                self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            frame = self.router.recv_multipart()
            self.replay_requests.append(frame)
            if len(frame) != 3:
                continue
            client, _, start_b = frame
            start = int.from_bytes(start_b, "big")
            while not self.replay_gate.wait(0.02):
                if self._stop.is_set():
                    return
            if self.recorded_replay is not None:
                for frames in self.recorded_replay:
                    self.router.send_multipart([client, *frames])
                continue
            with self._lock:
                buffered = list(self.buffer)
            for seq, buf in buffered:
                if seq >= start:
                    self.router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), buf]
                    )
            self.router.send_multipart([client, b"", b"", ev.END_SEQ, b""])
            self.replays_served += 1

    def close(self) -> None:
        self._close_sockets()
        self.ctx.term()


@pytest.fixture
def publisher(zmq):
    pub = Publisher(zmq)
    yield pub
    pub.close()


def _follower(pub: Publisher, index: Any, **kw: Any) -> ev.EventFollower:
    kw.setdefault("replay_timeout_s", 2.0)
    f = ev.EventFollower(pub.endpoint, pub.replay_endpoint, index, topic=TOPIC, **kw)
    f.start()
    pub.wait_subscriber()
    if kw.get("start_seq", 0) is not None:
        assert f.wait_for_seq(-1, WAIT_S)  # the start-up catch-up replay is done
    return f


def test_ordered_delivery_of_vllm_payloads(publisher):
    index = KeyIndex(hash_bytes=32, capacity=64)
    with _follower(publisher, index) as f:
        for payload in PAYLOADS[:3]:
            publisher.publish(payload)
        assert f.wait_for_seq(2, WAIT_S)
        with f.lock:
            assert _contents(index) == _set_replay(_expected_events(3))
        assert f.batches_applied == 3 and f.events_applied == 8
        assert f.gaps_detected == 0 and not f.stale and f.malformed == 0
    assert not f.running


def test_dropped_batch_recovered_through_vllm_replay_bytes(publisher):
    """Seq 2 is lost live; the ROUTER answers with vLLM's recorded replay.

    The follower asks from seq 1, the last batch it applied (vLLM replays
    every buffered batch >= start): that batch must come back byte for byte,
    which proves the replay continues the stream the index holds.
    """
    index = KeyIndex(hash_bytes=32, capacity=64)
    with _follower(publisher, index, medium="GPU", honor_clears=False) as f:
        publisher.recorded_replay = REPLAY  # batches 1..4 + END, as vLLM sent them
        for seq, payload in enumerate(PAYLOADS):
            publisher.publish(payload, drop=seq == 2)
        assert f.wait_for_seq(4, WAIT_S)
        h = [sha256(f"block{i}".encode()).digest() for i in range(8)]
        with f.lock:
            assert _contents(index) == {(2, h[2]), (2, h[4])}
        assert (f.gaps_detected, f.gaps_recovered, f.gaps_unrecovered) == (1, 1, 0)
        assert f.batches_applied == 5 and not f.stale
    # The follower asked from the last batch it holds, as vLLM's protocol
    # spells it: [identity, b"", start(8 bytes big-endian)] at the ROUTER.
    gap_requests = [r for r in publisher.replay_requests if r[2] != bytes(8)]
    assert [r[1:] for r in gap_requests] == [[b"", (1).to_bytes(8, "big")]]


def test_dropped_batches_recovered_from_buffer(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    keys = [bytes([i]) * 16 for i in range(6)]
    with _follower(publisher, index) as f:
        for i, k in enumerate(keys):
            payload = ev.encode_batch(ev.KVEventBatch(float(i), [block_stored([k])]))
            publisher.publish(payload, drop=i in (2, 3))
        assert f.wait_for_seq(5, WAIT_S)
        assert _contents(index) == {(0, k) for k in keys}
        assert f.gaps_recovered == 1 and f.batches_applied == 6 and not f.stale


def test_unrecoverable_gap_marks_stale(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    with _follower(publisher, index) as f:
        publisher.publish(ev.encode_batch(ev.KVEventBatch(0.0, [block_stored([a])])))
        # Seq 1 (would remove a) is lost and already out of the replay buffer.
        publisher.publish(
            ev.encode_batch(ev.KVEventBatch(1.0, [_removed([a])])),
            drop=True,
            keep=False,
        )
        publisher.publish(ev.encode_batch(ev.KVEventBatch(2.0, [block_stored([b])])))
        assert f.wait_for_seq(2, WAIT_S)
        assert f.stale and f.gaps_unrecovered == 1 and f.gaps_recovered == 0
        assert "not covered" in f.last_error
        # The follower goes on with newer batches.
        publisher.publish(ev.encode_batch(ev.KVEventBatch(3.0, [block_stored([c])])))
        assert f.wait_for_seq(3, WAIT_S)
        assert _contents(index) == {(0, a), (0, b), (0, c)}
        f.clear_stale()
        assert not f.stale


def test_unreachable_replay_marks_stale(zmq, publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:
        port = silent.bind_to_random_port("tcp://127.0.0.1")  # never answers
        f = ev.EventFollower(
            publisher.endpoint,
            f"tcp://127.0.0.1:{port}",
            index,
            topic=TOPIC,
            start_seq=None,
            replay_timeout_s=0.3,
        )
        with f:
            publisher.wait_subscriber()
            for i in range(3):
                batch = ev.KVEventBatch(0.0, [block_stored([bytes([i]) * 16])])
                publisher.publish(ev.encode_batch(batch), drop=i == 1)
            assert f.wait_for_seq(2, WAIT_S)
            assert f.stale and f.gaps_unrecovered == 1
            assert len(index) == 2 and "timed out" in f.last_error
        silent.close(linger=0)


def test_catch_up_and_idle_probe(publisher):
    """Batches published before the follower starts, and a lost last batch."""
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys[:3]:  # nobody subscribed yet: only the replay buffer has them
        publisher.publish(ev.encode_batch(ev.KVEventBatch(0.0, [block_stored([k])])))
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index, idle_probe_s=0.1) as f:
        assert f.wait_for_seq(2, WAIT_S)
        publisher.publish(
            ev.encode_batch(ev.KVEventBatch(0.0, [block_stored([keys[3]])]))
        )
        # The newest batch is lost live: no later batch reveals the gap.
        publisher.publish(
            ev.encode_batch(ev.KVEventBatch(0.0, [block_stored([keys[4]])])), drop=True
        )
        assert f.wait_for_seq(4, WAIT_S)
        assert _contents(index) == {(0, k) for k in keys}
        assert not f.stale and f.gaps_unrecovered == 0


def test_malformed_payloads_counted_follower_continues(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    keys = [bytes([i]) * 16 for i in range(4)]
    topic = TOPIC.encode()
    with _follower(publisher, index) as f:
        publisher.publish(
            ev.encode_batch(ev.KVEventBatch(0.0, [block_stored([keys[0]])]))
        )
        # Unattributable junk: no sequence number, so nothing is known lost.
        publisher.send_raw([topic, b"short", b"x"])
        publisher.send_raw([topic, b"only two frames"])
        publisher.send_raw([topic + b"-other", (7).to_bytes(8, "big"), b"x"])
        publisher.publish(
            ev.encode_batch(ev.KVEventBatch(1.0, [block_stored([keys[1]])]))
        )
        assert f.wait_for_seq(1, WAIT_S)
        assert f.malformed == 2 and f.ignored_topic == 1 and not f.stale
        # A numbered batch that does not decode is lost for good: stale.
        publisher.publish(b"\xc1 not msgpack")
        publisher.publish(msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}]]))
        # Decodes, but an int hash cannot key a 16-byte index: apply error.
        publisher.publish(ev.encode_batch(ev.KVEventBatch(2.0, [block_stored([5])])))
        publisher.publish(
            ev.encode_batch(ev.KVEventBatch(3.0, [block_stored([keys[2]])]))
        )
        publisher.publish(
            ev.encode_batch(ev.KVEventBatch(4.0, [block_stored([keys[3]])]))
        )
        assert f.wait_for_seq(6, WAIT_S)
        assert f.malformed == 4 and f.apply_errors == 1 and f.stale
        assert _contents(index) == {(0, k) for k in keys}
        assert f.running and f.batches_applied == 4


# --- fault scenarios: drops, duplicates, reorders, publisher restarts. Each
# ends with the index equal to the publisher's state, or marked stale.


def _payload(ts: float, events: list[Any]) -> bytes:
    return ev.encode_batch(ev.KVEventBatch(ts, events, data_parallel_rank=0))


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [TOPIC.encode(), seq.to_bytes(8, "big"), payload]


K = [bytes([i]) * 16 for i in range(40)]


def test_exact_duplicates_are_dropped_silently(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        p0, p1 = (
            _payload(1.0, [block_stored([K[0]])]),
            _payload(2.0, [_removed([K[0]])]),
        )
        publisher.send_raw(_frames(0, p0))
        publisher.send_raw(_frames(0, p0))  # back to back
        publisher.send_raw(_frames(1, p1))
        publisher.send_raw(_frames(0, p0))  # an older one again
        publisher.send_raw(_frames(2, _payload(3.0, [block_stored([K[1]])])))
        assert f.wait_for_seq(2, WAIT_S)
        assert wait_until(lambda: f.duplicates == 2, WAIT_S)
        # Before: each duplicate counted as a publisher restart, index stale.
        assert not f.stale and f.publisher_restarts == 0 and f.batches_applied == 3
        assert _contents(index) == {(0, K[1])}


def test_reordered_batches_are_applied_in_order(zmq, publisher):
    """No replay endpoint: only the reorder buffer can put 2 after 1."""
    index = KeyIndex(hash_bytes=16, capacity=64)
    f = ev.EventFollower(
        publisher.endpoint, None, index, topic=TOPIC, reorder_wait_s=1.0
    )
    with f:
        publisher.wait_subscriber()
        batches = [
            _payload(0.0, [block_stored([K[0], K[1]])]),
            _payload(1.0, [block_stored([K[2]])]),
            _payload(2.0, [_removed([K[2], K[0]])]),  # must come after seq 1
            _payload(3.0, [block_stored([K[3]])]),
        ]
        for seq in (0, 2, 3, 1):
            publisher.send_raw(_frames(seq, batches[seq]))
        assert f.wait_for_seq(3, WAIT_S)
        assert _contents(index) == {(0, K[1]), (0, K[3])}
        assert not f.stale and f.reordered == 2 and f.gaps_detected == 0


def test_late_batch_after_a_replayed_gap_is_a_duplicate(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index, reorder_wait_s=0.0) as f:
        p = [_payload(float(i), [block_stored([K[i]])]) for i in range(4)]
        # vLLM's publisher buffers every batch it publishes, a live frame
        # that got lost included: buffered before 2 and 3 go out, so the
        # follower's replay request can never race ahead of it.
        publisher.buffer.extend((seq, p[seq]) for seq in range(4))
        publisher.seq = 4
        for seq in (0, 2, 3):  # seq 1 late: repaired from the replay buffer
            publisher.send_raw(_frames(seq, p[seq]))
        assert f.wait_for_seq(3, WAIT_S)
        publisher.send_raw(_frames(1, p[1]))  # arrives at last
        assert wait_until(lambda: f.duplicates == 1, WAIT_S)
        assert _contents(index) == {(0, k) for k in K[:4]}
        assert not f.stale and f.gaps_recovered == 1 and f.publisher_restarts == 0


def test_reorder_beyond_the_window_without_replay_marks_stale(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    f = ev.EventFollower(publisher.endpoint, None, index, topic=TOPIC, reorder_window=2)
    with f:
        publisher.wait_subscriber()
        for seq in (0, 2, 3, 4):  # seq 1 never comes in time
            publisher.send_raw(
                _frames(seq, _payload(float(seq), [block_stored([K[seq]])]))
            )
        assert f.wait_for_seq(4, WAIT_S)
        assert f.stale and f.gaps_unrecovered == 1
        assert _contents(index) == {(0, K[i]) for i in (0, 2, 3, 4)}


def _publish_keys(pub: Publisher, keys: list[bytes], ts: float, **kw: Any) -> int:
    return pub.publish(_payload(ts, [block_stored(keys)]), **kw)


def _three_batches_applied(pub: Publisher, f: Any) -> None:
    """Publish seq 0..2 (keys K[0], K[1], K[2]) and wait until ``f`` has
    applied them: the old publisher's stream before a restart."""
    for i in range(3):
        _publish_keys(pub, [K[i]], ts=1.0 + i)
    assert f.wait_for_seq(2, WAIT_S)


def test_restart_with_fewer_batches_is_rebuilt(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        _three_batches_applied(publisher, f)
        publisher.reset()  # a new vLLM: seq 0, an empty replay buffer
        _publish_keys(publisher, [K[20]], ts=10.0)
        assert wait_until(lambda: f.rebuilds == 1, WAIT_S)
        assert f.wait_for_seq(0, WAIT_S)
        with f.lock:
            assert _contents(index) == {(0, K[20])}  # the new publisher's state
        assert not f.stale and f.publisher_restarts == 1


def test_restart_with_more_batches_is_not_taken_for_a_gap(publisher):
    """The new publisher sent more batches than the old one before the
    subscriber saw any: before, the replay "recovered" a gap and the index
    kept the old engine's keys, not stale."""
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        _three_batches_applied(publisher, f)
        publisher.reset()
        for i in range(6):  # lost live (nobody heard them), kept for replay
            _publish_keys(publisher, [K[20 + i]], ts=10.0 + i, drop=True)
        _publish_keys(publisher, [K[30]], ts=20.0)  # seq 6: looks like a gap
        assert f.wait_for_seq(6, WAIT_S)
        with f.lock:
            assert _contents(index) == {(0, k) for k in [*K[20:26], K[30]]}
        assert not f.stale and f.rebuilds == 1 and f.gaps_recovered == 0


def test_restart_with_the_same_count_is_caught_by_the_reconnection(publisher):
    """Sequence numbers alone cannot see this one: the new publisher's next
    live batch has exactly the seq the follower expects. The SUB socket's
    monitor reports the reconnection; the replay then fails to continue the
    old stream, and the index is rebuilt from the new publisher's buffer."""
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        _three_batches_applied(publisher, f)
        publisher.restart()
        for i in range(3):  # before the subscriber is back: lost live
            _publish_keys(publisher, [K[20 + i]], ts=10.0 + i)
        publisher.wait_subscriber()
        _publish_keys(publisher, [K[30]], ts=20.0)  # seq 3 == next_seq
        assert f.wait_for_seq(3, WAIT_S)
        assert wait_until(lambda: f.rebuilds == 1, WAIT_S)
        with f.lock:
            assert _contents(index) == {(0, k) for k in [*K[20:23], K[30]]}
        assert f.reconnects == 1 and not f.stale


def test_network_blip_with_the_same_publisher_is_a_gap_repair(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        _three_batches_applied(publisher, f)
        buffer, seq = list(publisher.buffer), publisher.seq
        publisher.restart()  # the connection drops, the publisher state stays
        publisher.buffer.extend(buffer)
        publisher.seq = seq
        _publish_keys(publisher, [K[3]], ts=4.0)  # lost live
        publisher.wait_subscriber()
        _publish_keys(publisher, [K[4]], ts=5.0)
        assert f.wait_for_seq(4, WAIT_S)
        with f.lock:
            assert _contents(index) == {(0, k) for k in K[:5]}
        assert not f.stale and f.rebuilds == 0 and f.publisher_restarts == 0


def test_batch_published_before_the_new_subscription_reached_the_publisher(
    publisher, monkeypatch
):
    """The window between a reconnection's replay and the new subscription:
    a batch the publisher sends after it answered the reconnection's check
    replay, but before the SUB's subscription reached it, is neither in
    that replay nor delivered live. Before the settle probe it stayed lost
    (keys missing, removals missed) for as long as the publisher was quiet:
    no later live batch showed the gap. Deterministic: the batch is
    published (kept for replay, ``drop``: not sent live, as a PUB without
    the subscription drops it) only once the check replay was answered."""
    monkeypatch.setattr(ev, "_SETTLE_S", 0.05)  # probes at 0.05 .. 0.75 s
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        _three_batches_applied(publisher, f)
        buffer, seq = list(publisher.buffer), publisher.seq
        served, replays = publisher.replays_served, f.replays_requested
        publisher.restart()  # a blip: the same publisher behind new sockets
        publisher.buffer.extend(buffer)
        publisher.seq = seq
        # The reconnection's check replay, answered with seqs 2.. (nothing new).
        assert wait_until(lambda: publisher.replays_served > served, WAIT_S)
        _publish_keys(publisher, [K[3]], ts=4.0, drop=True)  # in the window
        publisher.wait_subscriber()  # the subscription arrives after it
        # The publisher stays quiet: only the follower can find seq 3.
        assert f.wait_for_seq(3, WAIT_S)
        with f.lock:
            assert _contents(index) == {(0, k) for k in K[:4]}
        assert not f.stale and f.reconnects == 1 and f.rebuilds == 0
        # The check, and the settle probes: four at most a connection.
        assert wait_until(lambda: f.settle_probes == ev._SETTLE_PROBES, WAIT_S)
        time.sleep(4 * ev._SETTLE_S)
        assert f.replays_requested == replays + 1 + ev._SETTLE_PROBES
        assert f.settle_probes == ev._SETTLE_PROBES


@pytest.fixture
def slow_joiner(zmq):
    """A publisher whose XPUB applies a subscription only when the test
    admits it (XPUB_MANUAL): until then it drops every batch for that SUB,
    as a PUB the subscription has not reached yet does."""
    pub = Publisher(zmq, manual=True)
    yield pub
    pub.close()


def test_subscription_later_than_the_first_settle_probe(slow_joiner, monkeypatch):
    """The race left after the first settle probe (issue 34 item 3): the
    subscription reaches the publisher after the probe's replay was
    answered; a batch sent in between was neither in that replay nor
    delivered, and with a quiet publisher it stayed lost (one probe only).
    Deterministic: the XPUB really drops it (subscription not admitted)."""
    monkeypatch.setattr(ev, "_SETTLE_S", 0.1)  # probes at 0.1, 0.3, 0.7, 1.5 s
    pub = slow_joiner
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(pub, index) as f:
        pub.admit_subscriber()
        _three_batches_applied(pub, f)
        buffer, seq = list(pub.buffer), pub.seq
        replays = f.replays_requested
        pub.restart()  # a blip: the same publisher behind new sockets
        # Read once the old replay thread is joined, before the SUB is back
        # (ZMQ waits its 100 ms reconnect interval).
        served = pub.replays_served
        pub.buffer.extend(buffer)
        pub.seq = seq
        pub.wait_subscriber()  # received by the XPUB, not admitted
        # The reconnection's check and the first settle probe are answered.
        assert wait_until(lambda: f.settle_probes >= 1, WAIT_S, poll_s=0.002)
        assert wait_until(lambda: pub.replays_served >= served + 2, WAIT_S)
        _publish_keys(pub, [K[3]], ts=4.0)  # sent, and dropped by the XPUB
        pub.admit_subscriber()  # the subscription arrives after it
        # The publisher stays quiet: only a later probe can find seq 3.
        assert f.wait_for_seq(3, WAIT_S), f.counters()
        with f.lock:
            assert _contents(index) == {(0, k) for k in K[:4]}
        assert not f.stale and f.reconnects == 1 and f.rebuilds == 0
        assert wait_until(lambda: f.settle_probes == ev._SETTLE_PROBES, WAIT_S)
        time.sleep(0.5)
        assert f.replays_requested == replays + 1 + ev._SETTLE_PROBES
        # A live batch now: delivered, nothing replayed.
        _publish_keys(pub, [K[4]], ts=5.0)
        assert f.wait_for_seq(4, WAIT_S)
        assert f.replays_requested == replays + 1 + ev._SETTLE_PROBES


def test_first_batch_of_a_publisher_up_after_the_follower(zmq):
    """A follower started before its publisher (a router up before its
    engine): the start-up replay finds nobody; the publisher comes up, and
    its first batch, sent before the subscription reached it, is lost live.
    It stayed lost while the publisher was quiet (the settle probe had run
    at start-up). Settle probes now follow the connection."""
    pub = Publisher(zmq, manual=True)
    pub._close_sockets()  # the ports are known; nothing listens yet
    index = KeyIndex(hash_bytes=16, capacity=64)
    f = ev.EventFollower(
        pub.endpoint, pub.replay_endpoint, index, topic=TOPIC, replay_timeout_s=0.3
    )
    try:
        with f:
            assert wait_until(lambda: f.replays_requested >= 1, WAIT_S)
            time.sleep(1.0)  # the start-up replay times out; no connection yet
            assert not f.stale
            pub._open()  # the publisher comes up on its ports
            pub.wait_subscriber()  # connected; the subscription not admitted
            _publish_keys(pub, [K[0]], ts=1.0)  # dropped by the XPUB
            pub.admit_subscriber()
            assert f.wait_for_seq(0, WAIT_S), f.counters()
            with f.lock:
                assert _contents(index) == {(0, K[0])}
            assert not f.stale and 1 <= f.settle_probes <= ev._SETTLE_PROBES
            _publish_keys(pub, [K[1]], ts=2.0)  # live from here
            assert f.wait_for_seq(1, WAIT_S)
            assert _contents(index) == {(0, K[0]), (0, K[1])}
    finally:
        pub.close()


def test_live_batches_queued_during_the_reconnection_replay_apply_once(publisher):
    """The other order: the new subscription is active before the
    reconnection's replay is answered, so batches sent meanwhile come both
    in the replay and live. Each is applied once, in seq order (the live
    copies, drained after the replay, are duplicates), and nothing live is
    applied before the replayed batches it follows."""
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        _three_batches_applied(publisher, f)
        buffer, seq = list(publisher.buffer), publisher.seq
        asked, applied = len(publisher.replay_requests), f.batches_applied
        publisher.replay_gate.clear()  # the check replay waits
        publisher.restart()
        publisher.buffer.extend(buffer)
        publisher.seq = seq
        assert wait_until(lambda: len(publisher.replay_requests) > asked, WAIT_S)
        publisher.wait_subscriber()  # active before the replay is answered
        _publish_keys(publisher, [K[3]], ts=4.0, drop=True)  # replay only
        _publish_keys(publisher, [K[4]], ts=5.0)  # replay and live
        _publish_keys(publisher, [K[5]], ts=6.0)  # replay and live
        assert f.batches_applied == applied  # held behind the replay
        publisher.replay_gate.set()
        assert f.wait_for_seq(5, WAIT_S)
        assert wait_until(lambda: f.duplicates == 2, WAIT_S)
        with f.lock:
            assert _contents(index) == {(0, k) for k in K[:6]}
        assert f.batches_applied == applied + 3
        assert not f.stale and f.rebuilds == 0 and f.gaps_detected == 0


def test_live_batch_after_a_reconnection_needs_no_settle_probe(publisher, monkeypatch):
    """A live batch after the reconnection proves the subscription active
    (what came before it is a gap, repaired as one): no settle probe."""
    monkeypatch.setattr(ev, "_SETTLE_S", 0.05)
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        _three_batches_applied(publisher, f)
        buffer, seq = list(publisher.buffer), publisher.seq
        replays = f.replays_requested
        publisher.restart()
        publisher.buffer.extend(buffer)
        publisher.seq = seq
        publisher.wait_subscriber()
        assert wait_until(lambda: f.reconnects == 1, WAIT_S)
        _publish_keys(publisher, [K[3]], ts=4.0)
        assert f.wait_for_seq(3, WAIT_S)
        time.sleep(0.2)  # four settle windows
        assert f.settle_probes == 0 and f.replays_requested == replays + 1
        with f.lock:
            assert _contents(index) == {(0, k) for k in K[:4]}


def test_restart_without_replay_endpoint_marks_stale(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    f = ev.EventFollower(publisher.endpoint, None, index, topic=TOPIC)
    with f:
        publisher.wait_subscriber()
        _three_batches_applied(publisher, f)
        publisher.restart()
        for i in range(3):
            _publish_keys(publisher, [K[20 + i]], ts=10.0 + i)
        publisher.wait_subscriber()
        # Seq 3 is sent once the follower has handled the reconnection: a
        # frame drained together with the reconnection's event is dropped on
        # purpose (_on_monitor), and with no replay endpoint nothing brings it
        # back, so a loaded host could otherwise leave seq 3 unapplied.
        assert wait_until(lambda: f.reconnects == 1, WAIT_S)
        _publish_keys(publisher, [K[30]], ts=20.0)
        assert f.wait_for_seq(3, WAIT_S)
        assert wait_until(lambda: f.stale, WAIT_S)
        assert f.reconnects == 1 and "reconnected" in f.last_error


@pytest.mark.timing  # the start-up replay must answer within 0.3 s
def test_reconnect_with_a_silent_replay_marks_stale(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index, replay_timeout_s=0.3) as f:
        _three_batches_applied(publisher, f)
        publisher.restart()
        publisher.recorded_replay = []  # the new ROUTER never answers
        publisher.wait_subscriber()
        assert wait_until(lambda: f.stale, WAIT_S)
        assert f.reconnects == 1 and "did not answer" in f.last_error


def test_restart_whose_buffer_wrapped_marks_stale(zmq):
    pub = Publisher(zmq, buffer_steps=2)
    try:
        index = KeyIndex(hash_bytes=16, capacity=64)
        with _follower(pub, index) as f:
            for i in range(3):
                _publish_keys(pub, [K[i]], ts=1.0 + i)
            assert f.wait_for_seq(2, WAIT_S)
            pub.reset()
            for i in range(5):  # seq 0..4, the buffer keeps 3 and 4 only
                _publish_keys(pub, [K[20 + i]], ts=10.0 + i, drop=True)
            _publish_keys(pub, [K[30]], ts=20.0)
            assert f.wait_for_seq(5, WAIT_S)
            assert f.stale and f.publisher_restarts == 1 and f.rebuilds == 0
            assert "cannot be rebuilt" in f.last_error
    finally:
        pub.close()


class _OnesEngine:
    """Stands in for LookupEngine: every request hits 16 tokens."""

    def lookup(self, batch: Any, num_tokens: Any, index: Any) -> torch.Tensor:
        return torch.full((len(batch),), 16, dtype=torch.int64)


def test_a_stale_index_never_serves_a_hit(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    from kvhit.coordinator.packing import HashBatch

    batch = HashBatch.from_bytes([[K[0]], [K[1]]], 16)
    with _follower(publisher, index) as f:
        assert f.lookup(_OnesEngine(), batch, [16, 16]).tolist() == [16, 16]
        f.stale = True
        assert f.lookup(_OnesEngine(), batch, [16, 16]).tolist() == [0, 0]
        with f.lock:
            assert f.guard_hits(torch.ones(2, dtype=torch.int64)).tolist() == [0, 0]
        f.clear_stale()
        assert f.lookup(_OnesEngine(), batch, [16, 16]).tolist() == [16, 16]


def test_readers_holding_the_lock_see_no_commit(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    with _follower(publisher, index) as f:
        with f.lock:
            publisher.publish(
                ev.encode_batch(ev.KVEventBatch(0.0, [block_stored([b"k" * 16])]))
            )
            assert not f.wait_for_seq(0, 0.2)  # decoded, but waiting for the lock
            assert len(index) == 0
        assert f.wait_for_seq(0, WAIT_S) and len(index) == 1


def test_stop_is_bounded_and_restartable(publisher):
    index = KeyIndex(hash_bytes=16, capacity=64)
    f = ev.EventFollower(publisher.endpoint, publisher.replay_endpoint, index)
    for _ in range(2):
        f.start()
        assert f.running
        t0 = time.monotonic()
        f.stop(timeout_s=WAIT_S)
        assert not f.running and time.monotonic() - t0 < 2.0
    f.stop()  # idempotent


def _random_batches(
    rng: random.Random, n_events: int, per_batch: int, hash_bytes: int
) -> tuple[list[bytes], list[list[Any]]]:
    """Mooncake-like traffic: stores, evictions, rare clears, a key pool."""
    pool = [(rng.randrange(4), rng.randbytes(hash_bytes)) for _ in range(20_000)]
    batches: list[list[Any]] = []
    for start in range(0, n_events, per_batch):
        events: list[Any] = []
        for _ in range(min(per_batch, n_events - start)):
            r = rng.random()
            gid, h = pool[rng.randrange(len(pool))]
            if r < 0.0001:
                events.append(ev.AllBlocksCleared())
            elif r < 0.62:
                events.append(block_stored([h], gid))
            elif r < 0.64:  # block-pool style: several hashes in one event
                extra = [pool[rng.randrange(len(pool))][1] for _ in range(3)]
                events.append(block_stored([h, *extra], gid))
            elif r < 0.99:
                events.append(_removed([h], gid))
            else:
                events.append(_removed([h], gid, medium="GPU"))  # filtered out
        batches.append(events)
    payloads = [
        ev.encode_batch(ev.KVEventBatch(float(i), b)) for i, b in enumerate(batches)
    ]
    return payloads, batches


def _oracle(batches: list[list[Any]]) -> set[tuple[int, bytes]]:
    keys: set[tuple[int, bytes]] = set()
    for events in batches:
        for e in events:
            if isinstance(e, ev.AllBlocksCleared):
                keys.clear()
            elif e.medium == "cpu":
                op = keys.add if isinstance(e, ev.BlockStored) else keys.discard
                for h in e.block_hashes:
                    op((e.group_idx, h))
    return keys


def test_100k_events_through_sockets_match_set_replay(publisher):
    rng = random.Random(2024)
    n_events = 100_000
    payloads, batches = _random_batches(rng, n_events, 500, 16)
    want = _oracle(batches)

    # apply() alone (decode + plan + KeyIndex), the follower's inner loop.
    index = KeyIndex(hash_bytes=16, capacity=1 << 15)
    t0 = time.perf_counter()
    for p in payloads:
        ev.apply(index, ev.decode_batch(p), medium="cpu")
    apply_s = time.perf_counter() - t0
    assert _contents(index) == want

    # End to end: PUB -> follower thread -> KeyIndex, ~1 in 50 batches lost.
    index = KeyIndex(hash_bytes=16, capacity=1 << 15)
    with _follower(publisher, index, medium="cpu") as f:
        t0 = time.perf_counter()
        for i, p in enumerate(payloads):
            publisher.publish(p, drop=i % 50 == 7)
        assert f.wait_for_seq(len(payloads) - 1, 4 * WAIT_S)
        e2e_s = time.perf_counter() - t0
        with f.lock:
            assert _contents(index) == want
            # Membership through the lookup path, over every key ever named.
            touched = sorted(
                {
                    (e.group_idx, h)
                    for events in batches
                    for e in events
                    if not isinstance(e, ev.AllBlocksCleared)
                    for h in e.block_hashes
                }
            )
            gids = torch.tensor([g for g, _ in touched])
            hit = index.contains(gids, [h for _, h in touched]).tolist()
            assert {k for k, x in zip(touched, hit, strict=True) if x} == want
        assert not f.stale and f.gaps_recovered == f.gaps_detected > 0
        assert f.batches_applied == len(payloads)
        assert f.commits < len(payloads)  # drained batches share commits
    print(
        f"\nevents/s: apply {n_events / apply_s:,.0f}; "
        f"end-to-end {n_events / e2e_s:,.0f} ({f.commits} commits, "
        f"{f.gaps_recovered} gaps replayed)"
    )


# --- bad input: all or nothing, the argument named


def test_apply_is_atomic_on_a_bad_event():
    a, b = b"a" * 16, b"b" * 16
    index = KeyIndex(hash_bytes=16, capacity=64)
    index.add([0, 0], [a, b])
    before = _contents(index)
    bad_batches = [
        # Before: the remove was applied, then OverflowError from torch.
        (
            [_removed([a]), block_stored([b], gid=2**63)],
            ValueError,
            r"event 1 .*group_idx",
        ),
        (
            [_removed([a]), block_stored([b], gid=-1)],
            ValueError,
            r"event 1 .*group_idx",
        ),
        (
            [_removed([a]), block_stored([b], gid="0")],
            TypeError,
            r"event 1 .*group_idx",
        ),
        (
            [_removed([a]), block_stored([b, b"x" * 15])],
            ValueError,
            r"block_hashes\[1\]",
        ),
        ([_removed([a]), block_stored([b, "s" * 16])], TypeError, r"block_hashes\[1\]"),
        ([_removed([a]), block_stored([b], medium=5)], TypeError, r"event 1 .*medium"),
        ([_removed([a]), "not an event"], TypeError, r"events, position 1"),
    ]
    for events, exc, match in bad_batches:
        with pytest.raises(exc, match=match):
            ev.apply(index, events)
        assert _contents(index) == before and index.tombstones == 0
    for kwargs, exc, match in [
        ({"medium": 5}, TypeError, "medium"),
        ({"medium": ["cpu", 5]}, TypeError, "medium, position 1"),
        ({"default_group_id": -1}, ValueError, "default_group_id"),
        ({"honor_clears": "yes"}, TypeError, "honor_clears"),
    ]:
        with pytest.raises(exc, match=match):
            ev.apply(index, [_removed([a])], **kwargs)
        assert _contents(index) == before
    with pytest.raises(TypeError, match="events must be"):
        ev.apply(index, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="index must expose"):
        ev.apply(object(), [_removed([a])])


def test_apply_stats_count_changes_not_requests():
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    index = KeyIndex(hash_bytes=16, capacity=64)
    index.add([0], [a])
    stats = ev.apply(index, [block_stored([a, b]), _removed([c])])
    assert (stats.keys_added, stats.keys_removed) == (1, 0)  # a was there, c not
    stats = ev.apply(index, [ev.AllBlocksCleared(), block_stored([c])])
    assert (stats.keys_added, stats.keys_removed, stats.cleared) == (1, 2, True)
    assert _contents(index) == {(0, c)}


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"max_drain": 0}, ValueError, "max_drain"),  # spun a core
        ({"poll_ms": -1}, ValueError, "poll_ms"),  # stop() left the thread
        ({"poll_ms": 0}, ValueError, "poll_ms"),
        ({"start_seq": -1}, ValueError, "start_seq"),  # every batch failed
        ({"default_group_id": -1}, ValueError, "default_group_id"),  # accepted
        ({"topic": 5}, TypeError, "topic"),  # AttributeError inside
        ({"medium": 5}, TypeError, "medium"),
        ({"rcvhwm": -5}, ValueError, "rcvhwm"),  # RuntimeError inside
        ({"replay_timeout_s": 0}, ValueError, "replay_timeout_s"),
        ({"idle_probe_s": -1.0}, ValueError, "idle_probe_s"),
        ({"honor_clears": 1}, TypeError, "honor_clears"),
        ({"lock": 5}, TypeError, "lock"),
        ({"on_commit": 5}, TypeError, "on_commit"),
        ({"reorder_window": -1}, ValueError, "reorder_window"),
        ({"reorder_wait_s": float("nan")}, ValueError, "reorder_wait_s"),
        ({"endpoint": 5}, TypeError, "endpoint"),
        ({"endpoint": "localhost:5557"}, ValueError, "endpoint"),
        ({"replay_endpoint": b"tcp://x:1"}, TypeError, "replay_endpoint"),
        ({"index": object()}, TypeError, "index"),
    ],
)
def test_follower_validates_every_argument(zmq, kwargs, exc, name):
    index = KeyIndex(hash_bytes=16, capacity=64)
    args = {"endpoint": "tcp://127.0.0.1:1", "replay_endpoint": None, "index": index}
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        ev.EventFollower(**args)


class _GrowthRecorder(KeyIndex):
    """Records, for every rehash of the live index, whether the lock was held."""

    lock: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grew_under_lock: list[bool] = []

    def add(self, group_ids: Any, hashes: Any) -> int:
        cap = self.capacity
        out = super().add(group_ids, hashes)
        if self.capacity != cap and self.lock is not None:
            self.grew_under_lock.append(self.lock.locked())
        return out


def test_growth_is_built_outside_the_lock(publisher):
    index = _GrowthRecorder(hash_bytes=16, capacity=16)
    lock = threading.Lock()  # .locked() tells whether a commit holds it
    index.lock = lock
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(600)]
    with _follower(publisher, index, lock=lock) as f:
        publisher.publish(_payload(1.0, [block_stored(keys[:5])]))
        assert f.wait_for_seq(0, WAIT_S)
        publisher.publish(_payload(2.0, [block_stored(keys[5:]), _removed(keys[:2])]))
        assert f.wait_for_seq(1, WAIT_S)
        with f.lock:
            assert _contents(index) == {(0, k) for k in keys[2:]}
            assert index.capacity >= 2048 and len(index) == 598
        assert f.keys_added == 600 and f.keys_removed == 2 and not f.stale
    # Before: the live index rehashed inside the commit, holding the lock.
    assert True not in index.grew_under_lock
    # The same index object is still the one readers use.
    assert f.index is index and index.contains([0], [keys[-1]]).tolist() == [True]


def test_a_commit_wakes_a_waiter_at_once_and_none_is_left_counted():
    # _flush takes the condition's lock only when wait_for_seq counted a
    # waiter; a waiter counted must be woken by the commit, not its timeout.
    index = KeyIndex(8, capacity=64)
    f = ev.EventFollower("tcp://127.0.0.1:1", None, index, topic=TOPIC, medium="cpu")
    got: list[tuple[bool, float]] = []

    def wait() -> None:
        t0 = time.monotonic()
        got.append((f.wait_for_seq(0, WAIT_S), time.monotonic() - t0))

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_until(lambda: f._seq_waiters == 1, WAIT_S)
    payload = _payload(1.0, [block_stored([1 << 63 | 5])])
    f._handle_live([[TOPIC.encode(), (0).to_bytes(8, "big"), payload]])
    waiter.join(WAIT_S)
    assert got and got[0][0] and got[0][1] < WAIT_S / 2
    assert f._seq_waiters == 0 and len(index) == 1
    # A wait that times out leaves no waiter counted either.
    assert not f.wait_for_seq(5, 0.01) and f._seq_waiters == 0
