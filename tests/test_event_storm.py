"""Event storms for the fleet (issue 34 item 3).

64 publishers speak vLLM 0.33.0's KV-event ZMQ format (XPUB stream of
``(topic, seq, payload)``, ROUTER replay answering ``[b"", start_seq]`` with
every buffered batch then the end marker) into one FleetFollower, with:
drops (not sent live, kept for replay), reorders, duplicates, publishers
restarting with a new sequence, slow consumers (a sleeping commit hook and a
small send queue, so ZMQ itself drops), and engines removed while their
events are in flight. Afterwards every engine's column equals a set replay
of its publisher's batches (the current incarnation's): no lost key, no
phantom key; removed engines hold nothing; replay requests stay within a
bound set by the faults injected (and the settle probes, four at most a
connection).

``test_event_storm`` is the CI version (< 30 s; ``KVHIT_STORM_SEED`` picks
another storm of its shape). ``test_event_storm_soak``
(slow) repeats storms for ``KVHIT_STORM_SOAK_S`` seconds (600 by default)
and checks that threads, file descriptors and RSS stay flat.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("msgspec", exc_type=ImportError)
zmq = pytest.importorskip("zmq", exc_type=ImportError)

from helpers import bind_retrying, wait_until  # noqa: E402

from kvhit import FleetIndex  # noqa: E402
from kvhit.bindings import events  # noqa: E402
from kvhit.bindings import kv_events as kv  # noqa: E402
from kvhit.bindings.fleet_events import EngineStream, FleetFollower  # noqa: E402
from kvhit.coordinator.packing import unpack_hashes  # noqa: E402

TOPIC = "kv"
WAIT_S = 20.0
HASH_BYTES = 8  # vLLM's default int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
UNIVERSE = 48  # keys per engine: stores and removes keep meeting


class StormPublisher:
    """One vLLM ``ZmqEventPublisher`` as the wire sees it, driven by the test.

    XPUB (to wait for the subscription) with a small send queue, so a slow
    subscriber makes ZMQ drop messages as vLLM's PUB would; a ROUTER that
    answers replays like ``ZmqEventPublisher._service_replay`` (served by
    :class:`ReplayServer`). ``reset`` is a new publisher process: seq 0 and
    an empty replay buffer.
    """

    def __init__(
        self, ctx: Any, sndhwm: int = 1000, buffer_steps: int = 10_000
    ) -> None:
        self.ctx = ctx
        self.topic = TOPIC.encode()
        self.sndhwm = sndhwm
        self.pub = self._pub_socket()
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self._router_socket()
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        #: Set by :meth:`restart_sockets`; the ReplayServer rebinds the ROUTER.
        self.router_restart = threading.Event()
        self.lock = threading.Lock()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replay_requests = 0
        self.held: list[list[bytes]] = []  # frames sent late (reorders)
        #: This incarnation's batches applied to a set (the buffer may wrap).
        self.truth: set[tuple[int, bytes]] = set()
        #: seq -> how many more replays leave it out: the loss of a ROUTER
        #: past its send high-water mark (it drops, silently, as vLLM's does).
        self.lose_in_replay: dict[int, int] = {}
        #: Replay requests are read and counted, never answered (a sick
        #: publisher's replay thread).
        self.mute_replays = False

    def _pub_socket(self) -> Any:
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.sndhwm)
        return sock

    def _router_socket(self) -> Any:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def restart_sockets(self) -> None:
        """A new publisher process on the same ports: the subscriber's
        connection drops and ZMQ reconnects it; seq 0, empty buffer. What is
        published before it reconnects is lost live (replayable)."""
        self.pub.close(linger=0)
        self.pub = self._pub_socket()
        bind_retrying(self.pub, self.endpoint, WAIT_S)
        self.reset()
        self.router_restart.set()

    def rebind_router(self) -> Any:
        """Called by the ReplayServer's thread: a new ROUTER on the port."""
        self.router.close(linger=0)
        self.router = self._router_socket()
        bind_retrying(self.router, self.replay_endpoint, WAIT_S)
        self.router_restart.clear()
        return self.router

    def wait_subscriber(self) -> None:
        assert self.pub.poll(int(WAIT_S * 1000)), "no subscriber"
        assert self.pub.recv() == b"\x01" + self.topic

    def publish(self, payload: bytes, fault: str = "") -> None:
        seq, self.seq = self.seq, self.seq + 1
        _apply_to_set(self.truth, payload)
        with self.lock:
            self.buffer.append((seq, payload))
        frames = [self.topic, seq.to_bytes(8, "big"), payload]
        if fault == "drop":
            return
        if fault == "reorder":
            self.held.append(frames)  # goes out after the next batch
            return
        self._send(frames)
        if fault == "duplicate":
            self._send(frames)
        for late in self.held:
            self._send(late)
            if fault == "duplicate":
                self._send(late)
        self.held.clear()

    def _send(self, frames: list[bytes]) -> None:
        try:
            self.pub.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the subscriber's queue is full: dropped, as PUB does

    def reset(self) -> None:
        with self.lock:
            self.buffer.clear()
        self.truth = set()
        self.seq = 0
        self.held.clear()

    def serve(self) -> None:
        """Answer every replay request queued on the ROUTER."""
        while self.router.poll(0):
            frame = self.router.recv_multipart()
            self.replay_requests += 1
            if len(frame) != 3:
                continue
            client, _, start_b = frame
            if self.mute_replays:
                continue
            start = int.from_bytes(start_b, "big")
            with self.lock:
                buffered = [(s, p) for s, p in self.buffer if s >= start]
            for seq, payload in buffered:
                if self.lose_in_replay.get(seq, 0) > 0:
                    self.lose_in_replay[seq] -= 1
                    continue
                self.router.send_multipart(
                    [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
            self.router.send_multipart([client, b"", b"", kv.END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


class ReplayServer:
    """One thread serving every publisher's ROUTER (64 threads would be
    64 more schedulers' worth of noise on a 2-core host)."""

    def __init__(self, pubs: list[StormPublisher]) -> None:
        self.pubs = pubs
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket = {}
        for p in self.pubs:
            poller.register(p.router, zmq.POLLIN)
            by_socket[p.router] = p
        while not self.stop.is_set():
            for sock, _ in poller.poll(20):
                by_socket[sock].serve()
            for p in self.pubs:
                if p.router_restart.is_set():
                    poller.unregister(p.router)
                    del by_socket[p.router]
                    sock = p.rebind_router()
                    poller.register(sock, zmq.POLLIN)
                    by_socket[sock] = p

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)


class _LockHolder:
    """A slow reader: holds ``lock`` 20 ms of every 50 ms, on its own thread."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.03):
            with self.lock:
                time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)


def _hash(engine: int, i: int) -> int:
    # >= 2**32 so msgpack writes uint 64: the follower's fast path. A few
    # small ones (i % 7 == 0) take msgpack's short forms: its other path.
    if i % 7 == 0:
        return engine * 1000 + i
    return (0x9E3779B97F4A7C15 * (engine * 1000 + i + 1)) & ((1 << 64) - 1) | (1 << 40)


def _batch(rng: random.Random, engine: int, ts: float) -> bytes:
    events: list[Any] = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        hashes = [
            _hash(engine, rng.randrange(UNIVERSE)) for _ in range(rng.randint(1, 6))
        ]
        gid = rng.randrange(2)
        if r < 0.6:
            events.append(
                kv.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=list(range(16 * len(hashes))),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=gid,
                )
            )
        elif r < 0.97:
            events.append(
                kv.BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=gid)
            )
        else:
            events.append(kv.AllBlocksCleared())
    return kv.encode_batch(kv.KVEventBatch(ts, events))


def _apply_to_set(state: set[tuple[int, bytes]], payload: bytes) -> None:
    """One batch applied to a Python set of keys, by the definition."""
    for e in kv.decode_batch(payload).events:
        if isinstance(e, kv.AllBlocksCleared):
            state.clear()
            continue
        keys = {(e.group_idx, kv.hash_to_bytes(h, HASH_BYTES)) for h in e.block_hashes}
        if isinstance(e, kv.BlockStored):
            state |= keys
        else:
            state -= keys


def _replay_set(payloads: list[bytes]) -> set[tuple[int, bytes]]:
    """The truth: the batches applied in order to a Python set."""
    state: set[tuple[int, bytes]] = set()
    for payload in payloads:
        _apply_to_set(state, payload)
    return state


def _column(fleet: FleetIndex, engine: int) -> set[tuple[int, bytes]]:
    g, h = fleet.engine_keys(engine)
    return set(zip(g.tolist(), unpack_hashes(h, HASH_BYTES), strict=True))


class Storm:
    """N publishers, one FleetFollower, one storm of ``rounds`` batches each."""

    def __init__(
        self,
        n: int,
        seed: int,
        slow: tuple[int, ...] = (0, 1),
        buffer_steps: int = 10_000,
    ) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.ctx = zmq.Context()
        self.slow = slow
        self.pubs = [
            StormPublisher(self.ctx, 8 if e in slow else 1000, buffer_steps)
            for e in range(n)
        ]
        self.replays = ReplayServer(self.pubs)
        self.fleet = FleetIndex(n, HASH_BYTES, capacity=1024)
        streams = [
            EngineStream(e, p.endpoint, p.replay_endpoint, TOPIC)
            for e, p in enumerate(self.pubs)
        ]
        self.ff = FleetFollower(self.fleet, streams, replay_timeout_s=5.0)
        for e in slow:  # slow consumers: every commit takes 20 ms
            self.ff.followers[e].on_commit = lambda stats: time.sleep(0.02)
            self.ff.followers[e].rcvhwm = 4
        self.ff.start()
        for p in self.pubs:
            p.wait_subscriber()
        for e in range(n):
            assert self.ff.wait_for_seq(e, -1, WAIT_S)
        # Every first connection's settle probes run out while the publishers
        # are quiet (the last 3.0 s after it): a probe still in flight when
        # the storm starts delays its follower, which may then drain a
        # restarted publisher's only batch with the reconnection's report
        # (not applied: right, but the restart is not seen; see test_event_storm).
        followers = list(self.ff.followers.values())
        assert wait_until(
            lambda: all(f.settle_probes >= events._SETTLE_PROBES for f in followers),
            WAIT_S,
        )
        self.faults = [dict.fromkeys(("drop", "reorder", "duplicate", "restart"), 0)
                       for _ in range(n)]  # fmt: skip
        self.removed: set[int] = set()
        #: Removed from the fleet directly: their followers still run.
        self.unfollowed: set[int] = set()
        #: Engines settle() gave up on -> seconds it had waited in all.
        self.late: dict[int, float] = {}
        self.ts = time.time()

    def run(self, rounds: int, restarts: int, removals: int, flood: int = 1500) -> None:
        """``rounds`` batches from every live publisher, with faults.

        ``restarts`` publishers restart once (every third one closing and
        rebinding its sockets, the others resetting their sequence behind
        the same sockets); ``removals`` engines are removed mid-storm right
        after publishing (every other one behind the follower's back,
        through ``FleetIndex.remove_engine``). A reader holds the fleet's
        lock 20 ms of every 50; the slow engines get 4 batches a round and,
        half-way, a flood of ``flood`` more, so their small queues overflow
        and ZMQ drops batches itself (repaired by replay like any gap).
        """
        rng = self.rng
        live = [e for e in range(self.n) if e not in self.removed]
        restart_at = {e: rng.randrange(1, rounds) for e in rng.sample(live, restarts)}
        candidates = [e for e in live if e not in restart_at and e not in self.slow]
        remove_at = {
            e: rng.randrange(1, rounds) for e in rng.sample(candidates, removals)
        }
        reader = _LockHolder(self.ff.lock)
        try:
            for r in range(rounds):
                for e in live:
                    if e in self.removed:
                        continue
                    pub = self.pubs[e]
                    if restart_at.get(e) == r:
                        if self.faults[e]["restart"] % 3 == 2 or e % 3 == 0:
                            pub.restart_sockets()
                        else:
                            pub.reset()
                        self.faults[e]["restart"] += 1
                    if e in self.slow and r == rounds // 2:
                        for _ in range(flood):  # no faults but ZMQ's own
                            self.ts += 1e-3
                            pub.publish(_batch(rng, e, self.ts))
                    burst = 4 if e in self.slow else 1
                    for _ in range(burst):
                        x = rng.random()
                        fault = (
                            "drop" if x < 0.05 else
                            "reorder" if x < 0.10 else
                            "duplicate" if x < 0.15 else ""
                        )  # fmt: skip
                        if fault:
                            self.faults[e][fault] += 1
                        self.ts += 1e-3  # every batch's bytes differ, as vLLM's do
                        pub.publish(_batch(rng, e, self.ts), fault)
                    if remove_at.get(e) == r:
                        # Its events are still in flight: queued, held, dropped.
                        if len(self.removed) % 2 == 0:
                            self.ff.remove_engine(e)
                        else:
                            with self.ff.lock:
                                self.fleet.remove_engine(e)
                            self.unfollowed.add(e)
                        self.removed.add(e)
        finally:
            reader.close()
        # One clean batch each: a drop or reorder at the very end is noticed
        # at the next batch (vLLM's stream has no heartbeat).
        for e in live:
            if e not in self.removed:
                self.ts += 1e-3
                self.pubs[e].publish(_batch(rng, e, self.ts))

    def settle(self) -> None:
        """Wait (bounded) until every followed engine has applied its
        publisher's last batch and its column equals the publisher's state.

        A seq alone cannot say it: a publisher restarted behind new sockets
        starts again from 0, and what it sends before the subscriber has
        reconnected is lost live; the follower learns of it when ZMQ
        reconnects (its socket monitor), then rebuilds from the replay.
        A short quiet period follows, so a late straggler would show.
        """
        self.late = {}
        deadline = time.monotonic() + WAIT_S
        for e in range(self.n):
            if e in self.removed:
                continue
            pub, f = self.pubs[e], self.ff.followers[e]
            while True:
                with self.ff.lock:
                    done = f.committed_seq == pub.seq and (
                        _column(self.fleet, e) == pub.truth
                    )
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            if not done:
                # Named in check()'s message: a wrong state the follower
                # believes right, or only a late one (the deadline is shared)?
                self.late[e] = round(time.monotonic() - deadline + WAIT_S, 2)
        time.sleep(0.2)

    def check(self) -> dict[str, int]:
        """The fleet equals the replay of what each publisher delivered."""
        totals = dict.fromkeys(
            ("replays", "retries", "probes", "gaps", "restarts", "faults"), 0
        )
        union: set[tuple[int, bytes]] = set()
        for e in range(self.n):
            if e in self.removed:
                assert not bool(self.fleet.active[e])
                assert int(self.fleet.engine_sizes()[e]) == 0
                continue
            pub = self.pubs[e]
            want = pub.truth
            f = self.ff.followers[e]
            with self.ff.lock:
                got = _column(self.fleet, e)
            # A string message: pytest would cut a long dict's repr short.
            assert got == want, (
                f"engine {e}: {len(got - want)} phantom, {len(want - got)} lost "
                f"keys; publisher seq {pub.seq}, restarts {self.faults[e]}, "
                f"settle gave up on {self.late}; follower {f.counters()}"
            )
            assert not f.stale, f"engine {e}: stale; follower {f.counters()}"
            union |= {(g, h) for g, h in want}
            n_faults = sum(self.faults[e].values())
            # Replays: the start-up catch-up, then at most two per fault (a
            # gap's repair; a restart's failed anchor check plus its
            # rebuild), one more per restart (what was held across the
            # rebuild), one per gap ZMQ itself made for a slow consumer,
            # and the settle probes: at most _SETTLE_PROBES a connection
            # (the first, and each reconnection), while it brought nothing.
            probes = f.settle_probes
            assert probes <= events._SETTLE_PROBES * (1 + f.reconnects), (
                e,
                f.counters(),
            )
            bound = 1 + probes + 2 * n_faults + self.faults[e]["restart"]
            bound += f.gaps_detected if e in self.slow else 0
            # ... and the asks again after a replay that lost batches (a
            # slow engine's long replay past the ROUTER's high-water mark).
            assert f.replay_retries == 0 or e in self.slow, (e, f.counters())
            bound += f.replay_retries
            # (A request sent as a ROUTER is rebound is lost: <=, not ==.)
            assert pub.replay_requests <= f.replays_requested <= bound, (
                e,
                pub.replay_requests,
                self.faults[e],
                f.counters(),
            )
            totals["replays"] += pub.replay_requests
            totals["retries"] += f.replay_retries
            totals["probes"] += probes
            totals["gaps"] += f.gaps_detected
            totals["restarts"] += f.publisher_restarts
            totals["faults"] += n_faults
        with self.ff.lock:
            assert len(self.fleet) == len(union)  # no key without a holder
        return totals

    def close(self) -> None:
        self.ff.stop()
        self.replays.close()
        for p in self.pubs:
            p.close()
        self.ctx.term()


def test_event_storm():
    # KVHIT_STORM_SEED: other storms of the same shape, to loop it by hand.
    seed = int(os.environ.get("KVHIT_STORM_SEED", "34"))
    storm = Storm(64, seed=seed)
    try:
        storm.run(rounds=24, restarts=6, removals=3)
        storm.settle()
        totals = storm.check()
        # Seed 34 sees all 6. Another storm may restart a publisher whose
        # only batch so far (seq 0) never reached the follower: with nothing
        # applied there is no old stream to tell apart, so the new one is
        # followed from seq 0, right but not counted (seeds 9 and 16).
        assert totals["restarts"] >= (6 if seed == 34 else 4) and totals["gaps"] > 0
        print("storm", totals)
    finally:
        storm.close()


def _resources() -> dict[str, int]:
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
    return {
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss,
    }


@pytest.mark.slow
def test_event_storm_soak():
    """Storm after storm on the same fleet and followers for
    KVHIT_STORM_SOAK_S seconds (600 by default): correct after each storm,
    and threads, file descriptors and RSS flat from the first quarter on
    (the followers' bounded windows fill during it). Publishers keep 512
    batches for replay, as a busy vLLM's buffer wraps."""
    duration = float(os.environ.get("KVHIT_STORM_SOAK_S", "600"))
    storm = Storm(64, seed=3400, buffer_steps=512)
    samples = []
    start = time.monotonic()
    try:
        while time.monotonic() < start + duration:
            storm.run(rounds=12, restarts=4, removals=0, flood=200)
            storm.settle()
            totals = storm.check()
            samples.append(
                {
                    "storm": len(samples) + 1,
                    "t_s": round(time.monotonic() - start, 1),
                    **_resources(),
                    **totals,
                }
            )
            print("soak", samples[-1], flush=True)
    finally:
        storm.close()
    warm = [x for x in samples if x["t_s"] >= duration / 4]
    first, last = warm[0], samples[-1]
    print("soak first", first, "\nsoak last", last, flush=True)
    assert last["threads"] == first["threads"]
    assert last["fds"] <= first["fds"] + 4
    assert last["rss_kib"] <= first["rss_kib"] * 1.10 + 16 * 1024


def _key_set(index: Any) -> set[tuple[int, bytes]]:
    g, h = index.keys()
    return set(zip(g.tolist(), unpack_hashes(h, HASH_BYTES), strict=True))


def stores(engine: int, i: int, ts: float) -> bytes:
    """A batch storing three keys of ``engine`` (block ``i``'s)."""
    hashes = [_hash(engine, 3 * i + j) for j in range(3)]
    event = kv.BlockStored(hashes, None, [], 16, None, "GPU", None, group_idx=0)
    return kv.encode_batch(kv.KVEventBatch(ts, [event]))


@contextlib.contextmanager
def _one_follower(**kwargs: Any) -> Iterator[tuple[StormPublisher, Any, Any]]:
    """A started EventFollower (``kwargs`` to it) on a fresh StormPublisher and
    its replay server, into an empty KeyIndex: ``(publisher, index,
    follower)``, all closed on exit."""
    from kvhit import KeyIndex
    from kvhit.bindings import events as events_mod

    ctx = zmq.Context()
    pub = StormPublisher(ctx)
    server = ReplayServer([pub])
    index = KeyIndex(HASH_BYTES, capacity=64)
    f = events_mod.EventFollower(
        pub.endpoint, pub.replay_endpoint, index, topic=TOPIC, **kwargs
    )
    try:
        f.start()
        pub.wait_subscriber()
        assert f.wait_for_seq(-1, WAIT_S)
        yield pub, index, f
    finally:
        f.stop()
        server.close()
        pub.close()
        ctx.term()


def _held_commit() -> tuple[list[bool], threading.Event, threading.Event, Any]:
    """A commit hook that holds the follower thread once: set ``hold[0]``,
    and the next commit sets ``entered`` and waits for ``release``."""
    entered, release = threading.Event(), threading.Event()
    hold = [False]

    def on_commit(stats: Any) -> None:
        if hold[0]:
            hold[0] = False
            entered.set()
            release.wait(WAIT_S)

    return hold, entered, release, on_commit


def test_held_batch_of_replaced_publisher_never_applied():
    """The storm's first find: a batch held for a reorder when its publisher
    was replaced used to be applied as the new publisher's after the rebuild
    (a phantom key; in the storm, its hole reported as unrecoverable)."""
    old = [stores(1, i, 1.0 + i) for i in range(3)]
    new = [stores(2, i, 10.0 + i) for i in range(2)]
    # The reorder wait outlasts the test: only the restart can touch seq 2.
    with _one_follower(reorder_wait_s=30.0) as (pub, index, f):
        pub.publish(old[0])
        pub.publish(old[1], "drop")
        pub.publish(old[2])  # held: seq 1 is missing
        assert f.wait_for_seq(0, WAIT_S)
        pub.reset()  # a new publisher before the hole is repaired
        pub.publish(new[0])
        pub.publish(new[1])
        assert f.wait_for_seq(1, WAIT_S)
        assert _key_set(index) == _replay_set(new)
        assert not f.stale and f.rebuilds == 1 and f.gaps_unrecovered == 0


def test_stragglers_of_replaced_publisher_are_foreign():
    """Old batches arriving after the rebuild (below and beyond the new
    publisher's last seq) are dropped after one short replay each, with no
    second rebuild and nothing applied."""
    old = [stores(1, i, 1.0 + i) for i in range(3)]
    new = [stores(2, i, 10.0 + i) for i in range(2)]
    with _one_follower(reorder_wait_s=0.05) as (pub, index, f):
        for payload in old:
            pub.publish(payload)
        assert f.wait_for_seq(2, WAIT_S)
        pub.reset()
        pub.publish(new[0])
        assert wait_until(lambda: f.rebuilds == 1, WAIT_S, poll_s=0.002)
        replays = f.replays_requested
        frames = [[pub.topic, s.to_bytes(8, "big"), old[s]] for s in (0, 2)]
        for fr in frames:  # stragglers: seq 0 (applied), seq 2 (beyond)
            pub._send(fr)
        assert wait_until(lambda: f.foreign >= 2, WAIT_S, poll_s=0.002)
        pub.publish(new[1])
        assert f.wait_for_seq(1, WAIT_S)
        assert _key_set(index) == _replay_set(new)
        assert not f.stale and f.rebuilds == 1 and f.publisher_restarts == 1
        assert f.replays_requested - replays <= 2


def test_old_copies_cost_one_replay_and_remembered_conflicts_are_checked(monkeypatch):
    """Live copies older than what the follower remembers cost one replay per
    _CHECK_INTERVAL_S, not one each; a batch that differs from one it
    remembers is checked every time (a restart shows there)."""
    from kvhit.bindings import event_order
    from kvhit.bindings import events as events_mod

    monkeypatch.setattr(events_mod, "_RECENT", 4)
    monkeypatch.setattr(event_order, "_CHECK_INTERVAL_S", 5.0)
    batches = [stores(1, i, 1.0 + i) for i in range(10)]
    with _one_follower() as (pub, index, f):
        for payload in batches:
            pub.publish(payload)
        assert f.wait_for_seq(9, WAIT_S)
        replays = f.replays_requested

        def copy(seq: int, payload: bytes) -> None:
            pub._send([pub.topic, seq.to_bytes(8, "big"), payload])

        for seq in (2, 1, 3, 0):  # forgotten: only the first one is checked
            copy(seq, batches[seq])
        assert wait_until(lambda: f.foreign == 4, WAIT_S, poll_s=0.002)
        assert f.replays_requested == replays + 1
        copy(8, stores(3, 0, 99.0))  # differs from a remembered batch
        assert wait_until(lambda: f.foreign == 5, WAIT_S, poll_s=0.002)
        assert f.replays_requested == replays + 2
        assert _key_set(index) == _replay_set(batches)
        assert not f.stale and f.publisher_restarts == 0


def test_next_publishers_batches_drained_with_the_old_ones_are_not_applied():
    """The storm's find under load (issue 34 item 3): a follower thread that
    falls behind drains, together, the first batches of the reconnected
    SUB socket and the events reporting the reconnection. The new
    publisher's first batches were lost live (sent before the subscription
    reached it), so its first batch received has exactly the seq the
    follower expects: it used to be applied as the old stream's next one
    (phantom keys of the old publisher, lost keys of the new one), and the
    reconnection's check, anchored on it, passed: wrong and not stale.

    Deterministic: the follower thread is held in a commit hook while the
    publisher restarts (so it reads no connection event), and the new XPUB
    inverts its matching, so it sends to the reconnected SUB before the
    held thread has resent its subscription."""
    old = [stores(1, i, 1.0 + i) for i in range(3)]
    new = [stores(2, i, 10.0 + i) for i in range(5)]
    hold, entered, release, on_commit = _held_commit()

    with _one_follower(on_commit=on_commit) as (pub, index, f):
        pub.publish(old[0])
        pub.publish(old[1])
        assert f.wait_for_seq(1, WAIT_S)
        hold[0] = True
        pub.publish(old[2])
        assert entered.wait(WAIT_S)  # the follower thread is held from here
        pub.pub.close(linger=0)  # a new publisher on the same port
        pub.pub = pub._pub_socket()
        pub.pub.setsockopt(zmq.INVERT_MATCHING, 1)  # sends to the unsubscribed
        monitor = pub.pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        bind_retrying(pub.pub, pub.endpoint, WAIT_S)
        pub.reset()
        try:
            assert monitor.poll(int(WAIT_S * 1000)), "the SUB did not reconnect"
        finally:
            pub.pub.disable_monitor()
            monitor.close(linger=0)
        for payload in new[:3]:  # lost live, kept for replay
            pub.publish(payload, "drop")
        time.sleep(0.05)  # the XPUB attaches the new connection at its next send
        pub.publish(new[3])  # seq 3: the old stream's next one
        pub.publish(new[4])
        time.sleep(0.3)  # both queued behind the held thread
        release.set()
        assert f.wait_for_seq(4, WAIT_S)
        assert wait_until(lambda: f.reconnects == 1, WAIT_S)
        with f.lock:
            assert _key_set(index) == _replay_set(new), f.counters()
        assert not f.stale and f.rebuilds == 1, f.counters()


def test_stragglers_queued_behind_a_rebuild_are_not_applied():
    """Found by the restart-heavy storm loop (seed 7, 40 restarts a storm,
    storm 42, before the fix): a publisher reset
    behind the same sockets while the follower waits out a reorder. The
    gap's replay shows the restart and the index is rebuilt from the new
    publisher's buffer (seqs 0..7), but the old publisher's batches 8 and 9,
    sent before the reset and still queued in the SUB socket, arrive next
    with exactly the seqs the rebuilt stream expects: they used to be
    applied (phantom keys), and the new publisher's seq 8 and 9 would later
    have passed for duplicates. Deterministic: the follower is held in a commit hook
    while the old batches queue and the publisher restarts."""
    old = [stores(1, i, 1.0 + i) for i in range(10)]
    new = [stores(2, i, 20.0 + i) for i in range(8)]
    hold, entered, release, on_commit = _held_commit()

    with _one_follower(on_commit=on_commit, reorder_wait_s=0.2) as (pub, index, f):
        for payload in old[:5]:
            pub.publish(payload)
        assert f.wait_for_seq(4, WAIT_S)
        hold[0] = True
        pub.publish(old[5], "reorder")  # sent after seq 7
        pub.publish(old[6], "drop")
        pub.publish(old[7])  # held by the follower: seq 6 is missing
        assert entered.wait(WAIT_S)  # held in seq 5's commit
        pub.publish(old[8])  # queued behind the held thread
        pub.publish(old[9])
        pub.reset()  # a new publisher behind the same sockets
        for payload in new:
            pub.publish(payload)
        time.sleep(0.4)  # past reorder_wait_s: the gap's replay comes first
        release.set()
        assert wait_until(lambda: f.rebuilds == 1, WAIT_S)
        assert f.wait_for_seq(7, WAIT_S)
        time.sleep(0.2)  # the queued batches are handled
        with f.lock:
            assert _key_set(index) == _replay_set(new), f.counters()
        assert not f.stale and f.next_seq == 8, f.counters()


def test_batch_lost_from_a_replay_is_asked_again():
    """The storm's flake (one CI run in four): a slow engine's gap replay of
    ~1500 batches came back without one of them, as a ROUTER past its send
    high-water mark drops messages silently (vLLM's does too), and the
    follower went stale ("gap 1303..1303 not covered by replay", its keys
    right by luck) though the publisher still held the batch. The
    publisher's buffer has no holes, so a hole inside a replay's answer is
    the transport's: the follower asks again from the hole (a bounded
    number of times), and only then goes stale."""
    batches = [stores(1, i, 1.0 + i) for i in range(8)]
    with _one_follower(reorder_wait_s=0.05) as (pub, index, f):
        pub.publish(batches[0])
        pub.publish(batches[1])
        assert f.wait_for_seq(1, WAIT_S)
        replays = f.replays_requested
        pub.lose_in_replay = {3: 1}
        pub.publish(batches[2], "drop")
        pub.publish(batches[3], "drop")
        pub.publish(batches[4])  # held: 2 and 3 are missing
        assert f.wait_for_seq(4, WAIT_S)
        for payload in batches[5:]:
            pub.publish(payload)
        assert f.wait_for_seq(7, WAIT_S)
        with f.lock:
            assert _key_set(index) == _replay_set(batches), f.counters()
        assert not f.stale, f.counters()
        assert (f.gaps_recovered, f.gaps_unrecovered, f.replay_retries) == (1, 0, 1)
        assert f.replays_requested - replays == 2  # the gap's, then from seq 3
        assert pub.lose_in_replay == {3: 0}


def _gap_replays_lose_seq_3(
    pub: StormPublisher, f: Any, batches: list[bytes], times: int
) -> int:
    """Seqs 0 and 1 applied, 2 and 3 lost live, 4 and 5 live; the replays
    leave seq 3 out ``times`` times. Returns the replays asked before."""
    pub.publish(batches[0])
    pub.publish(batches[1])
    assert f.wait_for_seq(1, WAIT_S)
    replays = f.replays_requested
    pub.lose_in_replay = {3: times}
    pub.publish(batches[2], "drop")
    pub.publish(batches[3], "drop")
    pub.publish(batches[4])  # held: 2 and 3 are missing
    assert f.wait_for_seq(4, WAIT_S)
    pub.publish(batches[5])
    assert f.wait_for_seq(5, WAIT_S)
    return replays


def test_batch_a_replay_never_brings_goes_stale_after_bounded_asks(monkeypatch):
    """The same hole, lost from every answer: the follower asks
    ``_REPLAY_RETRIES`` more times, then goes stale naming the gap and goes
    on with what it has (never a loop of replays; the repair, which would
    ask again later, is put off past the test)."""
    from kvhit.bindings import event_order

    monkeypatch.setattr(event_order, "_REPAIR_S", 60.0)
    retries = event_order._REPLAY_RETRIES
    batches = [stores(1, i, 1.0 + i) for i in range(6)]
    with _one_follower(reorder_wait_s=0.05) as (pub, index, f):
        replays = _gap_replays_lose_seq_3(pub, f, batches, 1000)
        assert f.replays_requested - replays == 1 + retries, f.counters()
        assert f.replay_retries == retries
        assert f.stale and f.gaps_unrecovered == 1, f.counters()
        assert f.last_error == "gap 3..3 not covered by replay"
        want = _replay_set(batches[:3] + batches[4:])  # all but the lost one
        with f.lock:
            assert _key_set(index) == want, f.counters()
        assert f.gaps_repaired == 0


def test_gap_left_stale_is_repaired_once_the_replay_brings_it(caplog):
    """A gap no ask filled (lost from all four answers) leaves the index
    stale, with a batch missing and later ones applied. Half a second on,
    the follower asks again from the last batch applied before the gap;
    the publisher still holds them all, so they are applied again on top
    and the index equals the publisher's state: the flag clears by itself
    (it used to stay set until someone called clear_stale)."""
    caplog.set_level(logging.INFO, logger="kvhit.bindings.events")
    batches = [stores(1, i, 1.0 + i) for i in range(6)]
    with _one_follower(reorder_wait_s=0.05) as (pub, index, f):
        replays = _gap_replays_lose_seq_3(pub, f, batches, 4)
        assert f.gaps_unrecovered == 1, f.counters()
        assert wait_until(lambda: f.gaps_repaired == 1, WAIT_S), f.counters()
        with f.lock:
            assert _key_set(index) == _replay_set(batches), f.counters()
        assert not f.stale, f.counters()
        assert f.replays_requested - replays == 5  # 4 asks, then the repair
        assert f.last_error == "the gap after seq 2 was repaired"
        # Both changes logged once, with their cause (an operator's view).
        said = [
            (r.levelname, r.getMessage())
            for r in caplog.records
            if r.name == "kvhit.bindings.events"
        ]
        assert said == [
            ("WARNING", f"KV-event follower of {pub.endpoint} is stale (serves no "
                        "hits): gap 3..3 not covered by replay"),
            ("INFO", f"KV-event follower of {pub.endpoint} serves again: the gap "
                     "after seq 2 was repaired"),
        ]  # fmt: skip
        pub.publish(stores(1, 6, 7.0))  # and the stream goes on
        assert f.wait_for_seq(6, WAIT_S) and not f.stale


def test_silent_replay_endpoint_then_back_repairs_the_gap():
    """The replay endpoint stops answering (a sick publisher) during a gap:
    the follower goes on stale (the replay timed out). Once it answers
    again, the repair fills the gap and clears the flag."""
    batches = [stores(1, i, 1.0 + i) for i in range(4)]
    with _one_follower(reorder_wait_s=0.05, replay_timeout_s=0.2) as (pub, index, f):
        pub.publish(batches[0])
        pub.publish(batches[1])
        assert f.wait_for_seq(1, WAIT_S)
        pub.mute_replays = True
        pub.publish(batches[2], "drop")
        pub.publish(batches[3])
        assert f.wait_for_seq(3, WAIT_S)
        assert f.stale and f.gaps_unrecovered == 1, f.counters()
        assert f.last_error == "replay for 2.. timed out or unavailable"
        time.sleep(1.0)  # repairs asked meanwhile go unanswered too
        assert f.stale and f.gaps_repaired == 0, f.counters()
        pub.mute_replays = False
        assert wait_until(lambda: f.gaps_repaired == 1, WAIT_S), f.counters()
        with f.lock:
            assert _key_set(index) == _replay_set(batches), f.counters()
        assert not f.stale, f.counters()


def test_repair_that_meets_a_new_publisher_rebuilds(monkeypatch):
    """While stale from a gap the publisher restarts, and everything the new
    one sends is lost live: the repair's replay differs at its anchor, so
    it is a restart, and the index is rebuilt from the new publisher's
    buffer (not stale, its state exactly)."""
    from kvhit.bindings import event_order

    monkeypatch.setattr(event_order, "_REPAIR_S", 0.3)
    old = [stores(1, i, 1.0 + i) for i in range(6)]
    new = [stores(2, i, 20.0 + i) for i in range(3)]
    with _one_follower(reorder_wait_s=0.05) as (pub, index, f):
        _gap_replays_lose_seq_3(pub, f, old, 4)
        assert f.stale and f.gaps_repaired == 0, f.counters()
        pub.reset()
        for payload in new:
            pub.publish(payload, "drop")  # only the repair's replay sees them
        assert wait_until(lambda: f.rebuilds == 1, WAIT_S), f.counters()
        with f.lock:
            assert _key_set(index) == _replay_set(new), f.counters()
        assert not f.stale and f.publisher_restarts == 1, f.counters()


def test_long_replay_read_late_arrives_whole():
    """A replay answer of 20,000 batches of 2 KB that the follower reads only
    after the ROUTER sent all of it (a slow follower; vLLM buffers 10,000
    batches) arrives whole, end marker included: the DEALER takes it all.
    With ZMQ's default receive limit the ROUTER dropped all but ~3,000 and
    the end marker, and the follower went stale on the timeout. (A ROUTER
    sending faster than its I/O thread moves the bytes still drops: the
    follower then asks again, see test_batch_lost_from_a_replay_is_asked_again.)"""
    from kvhit.bindings.event_stream import StreamMsg, request_replay

    n = 20_000
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    sent = threading.Event()

    def serve() -> None:
        assert router.poll(int(WAIT_S * 1000))
        client, _, start_b = router.recv_multipart()
        for seq in range(int.from_bytes(start_b, "big"), n):
            frames = [client, b"", b"kv", seq.to_bytes(8, "big"), b"p" * 2000]
            router.send_multipart(frames)
            if seq % 200 == 199:
                # Paced, so ZMQ's I/O thread keeps up on a loaded host: what
                # is lost is then lost to the reader's limit, not the ROUTER's.
                time.sleep(0.002)
        router.send_multipart([client, b"", b"", kv.END_SEQ, b""])
        sent.set()

    def parse(frames: list[bytes]) -> StreamMsg:
        sent.wait(WAIT_S)  # the first frame waits until all was sent
        return StreamMsg(int.from_bytes(frames[2], "big"), frames[3])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        msgs = request_replay(ctx, endpoint, 0, None, WAIT_S, threading.Event(), parse)
        assert sent.is_set()
        assert msgs is not None, "no end marker"
        # All of it, but for what a ROUTER whose own I/O thread fell behind
        # on a loaded host dropped itself (a few hundred in one run under
        # xdist; the follower asks again for those): the reader's limit
        # alone kept ~3,000 and no end marker.
        seqs = [m.seq for m in msgs]
        assert len(seqs) >= 0.9 * n and seqs == sorted(set(seqs)), len(seqs)
    finally:
        server.join(WAIT_S)
        router.close(linger=0)
        ctx.term()
