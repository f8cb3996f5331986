"""FleetFollower: N vLLM event streams into one FleetIndex
(bindings/fleet_events.py), with the publisher of tests/test_events.py."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("msgspec", exc_type=ImportError)
zmq_mod = pytest.importorskip("zmq", exc_type=ImportError)

from helpers import block_stored, wait_until  # noqa: E402
from test_events import TOPIC, Publisher  # noqa: E402

from kvhit import FleetIndex, HashBatch, LookupEngine, ReferenceCoordinator  # noqa: E402
from kvhit.bench.workloads import make_layout  # noqa: E402
from kvhit.bindings import events as ev  # noqa: E402
from kvhit.bindings.fleet_events import EngineStream, FleetFollower  # noqa: E402

WAIT_S = 10.0
K = [bytes([i + 1]) * 16 for i in range(40)]
CHAIN = K[:8]  # one request's block hashes (full attention, hash 16)


@pytest.fixture
def publishers():
    pubs = [Publisher(zmq_mod) for _ in range(3)]
    yield pubs
    for p in pubs:
        p.close()


def _stored(pub: Publisher, keys: list[bytes], ts: float, **kw: Any) -> int:
    payload = ev.encode_batch(ev.KVEventBatch(ts, [block_stored(keys)]))
    return pub.publish(payload, **kw)


def _start(pubs: list[Publisher], fleet: FleetIndex, engine_ids=(0, 1, 2)):
    streams = [
        EngineStream(e, p.endpoint, p.replay_endpoint, TOPIC)
        for e, p in zip(engine_ids, pubs, strict=True)
    ]
    ff = FleetFollower(fleet, streams, replay_timeout_s=2.0).start()
    for e, p in zip(engine_ids, pubs, strict=True):
        p.wait_subscriber()
        assert ff.wait_for_seq(e, -1, WAIT_S)  # start-up catch-up replay done
    return ff


def _expected(stores: list[set]) -> list[list[int]]:
    ref = ReferenceCoordinator(make_layout("llama"))
    return [[ref.lookup(128, CHAIN, s) for s in stores]]


@contextlib.contextmanager
def _following_llama(
    pubs: list[Publisher], engines: int
) -> Iterator[tuple[FleetFollower, FleetIndex, LookupEngine, HashBatch]]:
    """A started follower of ``pubs`` (:func:`_start`) into an empty fleet of
    ``engines`` (16-byte keys); yields it, the fleet, a llama engine and the
    one-request batch of CHAIN."""
    fleet = FleetIndex(engines, 16)
    engine = LookupEngine(make_layout("llama"))
    batch = HashBatch.from_bytes([CHAIN], 16)
    with _start(pubs, fleet) as ff:
        yield ff, fleet, engine, batch


def test_three_streams_three_columns(publishers):
    with _following_llama(publishers, 4) as (ff, fleet, engine, batch):
        a, b, c = publishers
        _stored(a, CHAIN[:6], 1.0)
        _stored(b, CHAIN[:2], 1.0)
        _stored(b, CHAIN[2:3], 2.0)
        _stored(c, K[20:24], 1.0)
        assert ff.wait_for_seq(0, 0, WAIT_S) and ff.wait_for_seq(1, 1, WAIT_S)
        assert ff.wait_for_seq(2, 0, WAIT_S)
        stores = [{(0, k) for k in s} for s in (CHAIN[:6], CHAIN[:3], K[20:24], [])]
        hits = ff.fleet_lookup(engine, batch, [128])
        assert hits.tolist() == _expected(stores) == [[96, 48, 0, 0]]
        assert fleet.engine_sizes().tolist() == [6, 3, 4, 0]
        assert ff.stale_engines() == [] and ff.stale_mask().tolist() == [False] * 4
        assert set(ff.counters()) == {0, 1, 2}


def test_gap_repair_per_engine(publishers):
    with _following_llama(publishers, 3) as (ff, fleet, engine, batch):
        a, b, _ = publishers
        for i in range(5):  # engine 0 loses batches 2 and 3 live
            _stored(a, [CHAIN[i]], float(i), drop=i in (2, 3))
        _stored(b, CHAIN[:2], 1.0)
        assert ff.wait_for_seq(0, 4, WAIT_S) and ff.wait_for_seq(1, 0, WAIT_S)
        f0 = ff.followers[0]
        assert f0.gaps_recovered == 1 and not f0.stale
        assert ff.fleet_lookup(engine, batch, [128]).tolist() == [[80, 32, 0]]


def test_a_stale_engine_serves_zeros_the_others_keep_serving(publishers):
    with _following_llama(publishers, 3) as (ff, fleet, engine, batch):
        a, b, c = publishers
        _stored(a, CHAIN[:4], 0.0)
        _stored(b, CHAIN[:5], 0.0)
        # Engine 1 loses a batch that is no longer replayable: stale.
        _stored(b, CHAIN[5:6], 1.0, drop=True, keep=False)
        _stored(b, CHAIN[6:7], 2.0)
        _stored(c, CHAIN[:2], 0.0)
        assert ff.wait_for_seq(0, 0, WAIT_S) and ff.wait_for_seq(2, 0, WAIT_S)
        assert wait_until(lambda: ff.followers[1].stale, WAIT_S)
        assert ff.stale_engines() == [1]
        assert ff.stale_mask().tolist() == [False, True, False]
        assert ff.fleet_lookup(engine, batch, [128]).tolist() == [[64, 0, 32]]
        assert ff.fleet_hits(engine, batch, [128]).tolist() == [[64, 0, 32]]
        # The fleet itself still holds engine 1's keys; only reads are guarded.
        assert engine.fleet_lookup(batch, [128], fleet)[0, 1] > 0
        ff.clear_stale(1)
        assert ff.fleet_lookup(engine, batch, [128])[0, 1] > 0


def test_a_restarted_engine_is_rebuilt_alone(publishers):
    fleet = FleetIndex(3, 16)
    with _start(publishers, fleet) as ff:
        a, b, _ = publishers
        for i in range(3):
            _stored(a, [K[i]], 1.0 + i)
        _stored(b, [K[30]], 1.0)
        assert ff.wait_for_seq(0, 2, WAIT_S) and ff.wait_for_seq(1, 0, WAIT_S)
        a.reset()  # engine 0 restarted: seq 0, empty replay buffer
        _stored(a, [K[20]], 10.0)
        assert wait_until(lambda: ff.followers[0].rebuilds == 1, WAIT_S)
        assert ff.wait_for_seq(0, 0, WAIT_S)
        with ff.lock:
            g, h = fleet.engine_keys(0)
            assert [bytes(x) for x in h.numpy().view("u1").reshape(-1, 16)] == [K[20]]
            assert fleet.contains(1, 0, [K[30]]).tolist() == [True]
        assert ff.stale_engines() == []


def test_remove_engine_with_events_in_flight(publishers):
    fleet = FleetIndex(3, 16)
    with _start(publishers, fleet) as ff:
        a, b, _ = publishers
        _stored(a, K[:3], 1.0)
        _stored(b, K[10:14], 1.0)
        assert ff.wait_for_seq(0, 0, WAIT_S) and ff.wait_for_seq(1, 0, WAIT_S)
        for i in range(20):  # still queued when the engine goes
            _stored(b, [K[14 + i]], 2.0 + i)
        held = ff.remove_engine(1)
        assert 4 <= held <= 24
        assert ff.running and set(ff.followers) == {0, 2}
        _stored(a, K[3:4], 2.0)
        assert ff.wait_for_seq(0, 1, WAIT_S)
        time.sleep(0.1)  # nothing in flight may land in the removed column
        with ff.lock:
            assert fleet.engine_sizes().tolist() == [4, 0, 0]
            assert fleet.active.tolist() == [True, False, True]
            assert len(fleet) == 4
        with pytest.raises(ValueError, match="engine_id"):
            ff.remove_engine(1)  # no stream any more
        assert ff.stale_engines() == []


def test_validation(publishers):
    fleet = FleetIndex(2, 16)
    p = publishers[0]
    with pytest.raises(TypeError, match="fleet"):
        FleetFollower(object(), [])
    with pytest.raises(ValueError, match="engine_id"):
        FleetFollower(fleet, [EngineStream(2, p.endpoint)])
    with pytest.raises(ValueError, match="distinct"):
        FleetFollower(fleet, [(0, p.endpoint), (0, p.endpoint)])
    with pytest.raises(TypeError, match="streams"):
        FleetFollower(fleet, [object()])
    with pytest.raises(ValueError, match="endpoint"):
        FleetFollower(fleet, [(0, "nowhere")])
    hits = torch.ones((2, 2), dtype=torch.int64)
    ff = FleetFollower(fleet, [(0, p.endpoint, p.replay_endpoint)])
    assert ff.guard_hits(hits).tolist() == [[1, 1], [1, 1]]
    ff.followers[0].stale = True
    assert ff.guard_hits(hits).tolist() == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="engine_id"):
        ff.clear_stale(1)
