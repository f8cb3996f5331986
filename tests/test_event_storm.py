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

import os
import random
import threading
import time
from typing import Any

import pytest

pytest.importorskip("msgspec", exc_type=ImportError)
zmq = pytest.importorskip("zmq", exc_type=ImportError)

from event_harness import (  # noqa: E402
    HASH_BYTES,
    TOPIC,
    WAIT_S,
    ReplayServer,
    StormPublisher,
    held_commit,
    key_hash,
    key_set,
    one_follower,
    replay_set,
    stores,
)
from helpers import bind_retrying, wait_until  # noqa: E402

from kvhit import FleetIndex  # noqa: E402
from kvhit.bindings import events  # noqa: E402
from kvhit.bindings import kv_events as kv  # noqa: E402
from kvhit.bindings.fleet_events import EngineStream, FleetFollower  # noqa: E402
from kvhit.coordinator.packing import unpack_hashes  # noqa: E402

UNIVERSE = 48  # keys per engine: stores and removes keep meeting


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


def _batch(rng: random.Random, engine: int, ts: float) -> bytes:
    events: list[Any] = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        hashes = [
            key_hash(engine, rng.randrange(UNIVERSE)) for _ in range(rng.randint(1, 6))
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
            # slow engine's long replay past the ROUTER's high-water mark),
            # and the repairs of a gap left stale (test_event_repair.py).
            assert f.replay_retries == 0 or e in self.slow, (e, f.counters())
            bound += f.replay_retries + f.repair_replays
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


def test_held_batch_of_replaced_publisher_never_applied():
    """The storm's first find: a batch held for a reorder when its publisher
    was replaced used to be applied as the new publisher's after the rebuild
    (a phantom key; in the storm, its hole reported as unrecoverable)."""
    old = [stores(1, i, 1.0 + i) for i in range(3)]
    new = [stores(2, i, 10.0 + i) for i in range(2)]
    # The reorder wait outlasts the test: only the restart can touch seq 2.
    with one_follower(reorder_wait_s=30.0) as (pub, index, f):
        pub.publish(old[0])
        pub.publish(old[1], "drop")
        pub.publish(old[2])  # held: seq 1 is missing
        assert f.wait_for_seq(0, WAIT_S)
        pub.reset()  # a new publisher before the hole is repaired
        pub.publish(new[0])
        pub.publish(new[1])
        assert f.wait_for_seq(1, WAIT_S)
        assert key_set(index) == replay_set(new)
        assert not f.stale and f.rebuilds == 1 and f.gaps_unrecovered == 0


def test_stragglers_of_replaced_publisher_are_foreign():
    """Old batches arriving after the rebuild (below and beyond the new
    publisher's last seq) are dropped after one short replay each, with no
    second rebuild and nothing applied."""
    old = [stores(1, i, 1.0 + i) for i in range(3)]
    new = [stores(2, i, 10.0 + i) for i in range(2)]
    with one_follower(reorder_wait_s=0.05) as (pub, index, f):
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
        assert key_set(index) == replay_set(new)
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
    with one_follower() as (pub, index, f):
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
        assert key_set(index) == replay_set(batches)
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
    hold, entered, release, on_commit = held_commit()

    with one_follower(on_commit=on_commit) as (pub, index, f):
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
            assert key_set(index) == replay_set(new), f.counters()
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
    hold, entered, release, on_commit = held_commit()

    with one_follower(on_commit=on_commit, reorder_wait_s=0.2) as (pub, index, f):
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
            assert key_set(index) == replay_set(new), f.counters()
        assert not f.stale and f.next_seq == 8, f.counters()
