"""The kvhit connector under faults, inside vLLM 0.33.0's real ``Scheduler``.

Each test runs the real Scheduler with ``KvhitMooncakeStoreConnector`` served
by ``KvhitLookupServer`` over vLLM's own ``MooncakeStoreWorker`` (see
tests/vllm_sched_harness.py) and a store that misbehaves on purpose
(``FaultStore``), and asserts what a user needs: no synchronous
``schedule()`` waits longer than ``kvhit_lookup_timeout_s``; a request whose
answer is late or failed gets a miss, never a hit the store did not confirm;
a late answer is never applied to a later step; hits come back when the store
does, equal to vLLM's own ``MooncakeStoreWorker.lookup``. The faults against a
real ``mooncake_master`` (SIGSTOP, kill and restart) are in
tests/test_vllm_worker_role.py; the long soak is ``test_soak`` (slow).

Each test prints its worst ``schedule()`` wait (``-s`` shows them).
"""

from __future__ import annotations

import gc
import logging
import random
import threading
import time

import pytest
from test_vllm_connector import fill_store, prompts

# Bounds of a fraction of a second: run alone, never beside another test
# process (make test's second pass).
pytestmark = pytest.mark.timing

#: The bound the tests configure (the default is 1 s; smaller keeps them fast).
BOUND_S = 0.6
STORE_S = 0.25
#: Slack over the bound for a loaded 2-core host (the Scheduler's own work).
SLACK_S = 0.25


@pytest.fixture
def h(sched_harness):
    return sched_harness


def setup(
    h, seed: int, n: int = 24, lookup_async: bool = False, max_num_seqs=16, **extra
):
    """A Driver over a kvhit Side whose store holds some of ``n`` prompts."""
    rng = random.Random(seed)
    case = h.LAYOUTS[1]  # full + sliding window
    store = h.FaultStore()
    cfg = {
        "load_async": False,
        "lookup_async": lookup_async,
        "kvhit_lookup_timeout_s": BOUND_S,
        "kvhit_store_timeout_s": STORE_S,
        **extra,
    }
    side = h.build_side("kvhit", case, store, cfg, num_blocks=400,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=512)  # fmt: skip
    reqs = prompts(rng, n)
    fill_store(h, rng, store, side.worker, reqs, side.hash_block_size)
    return h.Driver(side), store, reqs


def report(name: str, waits: list[float]) -> None:
    print(f"\n[{name}] steps {len(waits)}, worst schedule() {max(waits):.3f} s")


def hits(rec) -> list[int]:
    return [a[3].hit_length for a in rec.answers if a[3] is not None]


def fresh_steps(d, reqs, tag: str, n_steps: int, per_step: int = 3) -> list:
    """``n_steps`` steps, each after ``per_step`` new arrivals (so every step
    looks some request up)."""
    recs = []
    for s in range(n_steps):
        for j in range(per_step):
            k = s * per_step + j
            d.add(f"{tag}{k}", reqs[k % len(reqs)])
        recs.append(d.step())
    return recs


def test_slow_store_under_and_over_the_store_timeout(h):
    d, store, reqs = setup(h, 1)
    waits = []
    try:
        # Just under: the answers are the store's, the wait is the delay.
        store.delay_s = 0.8 * STORE_S
        for i in range(4):
            d.add(f"a{i}", reqs[i])
        rec = d.step()
        waits.append(rec.wait_s)
        assert rec.answers and d.truth(rec) == []
        assert any(hits(rec)), "nothing to hit: the test proves nothing"
        # Just over: misses, each step within the store timeout; a call
        # past its deadline blocks nothing, so each step asks the store again
        # on a free slot of the pool.
        store.delay_s = 1.3 * STORE_S
        c0 = store.faulty_calls
        recs = fresh_steps(d, reqs, "b", 3)
        waits += [r.wait_s for r in recs]
        assert all(r.answers for r in recs)
        assert all(x == 0 for r in recs for x in hits(r))
        assert store.faulty_calls - c0 == 3
        assert max(r.wait_s for r in recs) < STORE_S + SLACK_S
        st = d.side.servers[-1].store_stats()
        assert st.timeouts == 3 and st.busy == 0 and st.max_in_flight <= st.size
        # Healed: hits come back, equal to vLLM's worker.
        store.heal()
        time.sleep(1.3 * STORE_S)  # the parked call returns
        recs = fresh_steps(d, reqs, "c", 3)
        waits += [r.wait_s for r in recs]
        assert all(d.truth(r) == [] for r in recs)
        assert any(x for r in recs for x in hits(r))
    finally:
        d.side.close()
    assert max(waits) < BOUND_S + SLACK_S
    report("slow store", waits)


def test_hung_store_bounded_then_hits_return(h, caplog):
    """A store that stops answering (a frozen master) mid-run: every step
    within the bound, misses only; hits return after it resumes. The outage
    is logged once, not once per step."""
    d, store, reqs = setup(h, 2)
    waits = []
    caplog.set_level(logging.WARNING)
    try:
        for i in range(6):
            d.add(f"a{i}", reqs[i])
        rec = d.step()
        assert d.truth(rec) == [] and any(hits(rec))
        store.gate = threading.Event()
        t_end = time.monotonic() + 3 * STORE_S
        k = 6
        while time.monotonic() < t_end:
            d.add(f"b{k}", reqs[k % len(reqs)])
            k += 1
            rec = d.step()
            waits.append(rec.wait_s)
            assert all(x == 0 for x in hits(rec))
        store.heal()
        # The store answers again: the stuck calls return and free their
        # slots within a few ms (a step that starts before that answers
        # misses at once; vLLM, asking directly, would not: not a fault).
        time.sleep(0.05)
        deadline = time.monotonic() + 10
        back = False
        while not back and time.monotonic() < deadline:
            d.add(f"c{k}", reqs[k % len(reqs)])
            k += 1
            rec = d.step()
            waits.append(rec.wait_s)
            assert d.truth(rec) == []
            back = any(hits(rec))
        assert back, "no hit after the store resumed"
    finally:
        d.side.close()
    assert max(waits) < BOUND_S + SLACK_S
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("kvhit")]
    assert sum("store error, batch answered with misses" in m for m in msgs) == 1
    assert sum("answers again after" in m for m in msgs) == 1
    assert d.side.servers[-1].num_failed_batches > 1
    report("hung store", waits)


def test_late_reply_is_never_applied_to_a_later_step(h):
    """The server answers after the client's deadline (its store timeout is
    longer): the batch counts as misses; its late reply (hits) comes during
    the next step and is dropped, though it names requests still waiting."""
    d, store, reqs = setup(h, 3, max_num_seqs=4, kvhit_store_timeout_s=10.0)
    try:
        d.add("warm", reqs[0])
        assert d.step().answers
        for i in range(12):  # max_num_seqs=4: most stay waiting
            d.add(f"r{i}", reqs[i])
        store.delay_s = BOUND_S + 0.3
        rec = d.step()
        late_wait = rec.wait_s
        assert rec.wait_s < BOUND_S + SLACK_S
        assert rec.answers and all(x == 0 for x in hits(rec))
        assert d.client.num_timeouts == 1
        waiting = {r.request_id for r in d.sched.waiting}
        assert waiting, "nothing left waiting: the test proves nothing"
        # The store forgets everything, then the late reply (with hits) lands.
        store.heal()
        store.keys.clear()
        time.sleep(0.6)
        asked: set = set()
        for _ in range(20):  # until the running ones finish and more are asked
            rec = d.step()
            asked |= {a[0] for a in rec.answers}
            assert all(x == 0 for x in hits(rec)) and d.truth(rec) == []
            if asked & waiting:
                break
        assert asked & waiting
        assert d.client.num_late == 1 and d.client.overdue is None
    finally:
        d.side.close()
    report("late reply", [late_wait])


def test_server_loop_failure_restarts_then_falls_back(h, caplog):
    d, store, reqs = setup(h, 4)
    server = d.side.servers[-1]
    fails = h.crash_lookups(server, left=1)  # raises h.Boom
    waits = []
    try:
        with caplog.at_level(logging.ERROR):
            for i in range(4):
                d.add(f"a{i}", reqs[i])
            rec = d.step()
            waits.append(rec.wait_s)
            assert rec.answers and all(x == 0 for x in hits(rec))
            assert server.num_crashes == 1 and server.thread.is_alive()
            assert d.client.num_timeouts == 0  # the batch in hand was answered
            recs = fresh_steps(d, reqs, "b", 3)
            waits += [r.wait_s for r in recs]
            assert all(d.truth(r) == [] for r in recs)
            assert any(x for r in recs for x in hits(r))
            # Failing every time: restarted each time, the cause logged once,
            # then vLLM's own lookup answers.
            fails["left"] = 10**9
            for k in range(10, 24):
                d.add(f"c{k}", reqs[k])
                crashes = server.num_crashes
                rec = d.step()
                waits.append(rec.wait_s)
                if server.num_crashes > crashes:
                    assert all(x == 0 for x in hits(rec))
                else:  # vLLM's own lookup path now
                    assert server.fallback_reason and d.truth(rec) == []
                    recs.append(rec)
        assert server.fallback_reason and "Boom: injected" in server.fallback_reason
        assert server.num_crashes == 1 + 3
        msgs = [r.getMessage() for r in caplog.records]
        assert sum("serving loop failed (Boom: injected)" in m for m in msgs) == 1
        assert sum("batched lookup disabled" in m for m in msgs) == 1
        assert any(x for r in recs for x in hits(r))
    finally:
        d.side.close()
    assert max(waits) < BOUND_S + SLACK_S
    report("server loop failure", waits)


def test_async_lookup_never_waits(h):
    d, store, reqs = setup(h, 5, lookup_async=True)
    waits = []
    try:
        store.gate = threading.Event()  # hung from the first call
        for i in range(8):
            d.add(f"a{i}", reqs[i])
        t_end = time.monotonic() + BOUND_S + 0.4
        nones = 0
        while time.monotonic() < t_end:
            rec = d.step()
            waits.append(rec.wait_s)
            nones += sum(a[3] is None for a in rec.answers)
            assert all(x == 0 for x in hits(rec))
            time.sleep(0.02)
        assert nones > 0
        store.heal()
        for i in range(8, 16):
            d.add(f"b{i}", reqs[i])
        seen_hit = False
        for _ in range(40):
            rec = d.step()
            waits.append(rec.wait_s)
            assert d.truth(rec) == []
            seen_hit |= any(hits(rec))
            time.sleep(0.02)
        assert seen_hit
    finally:
        d.side.close()
    # Never the store's time: only the Scheduler's own work.
    assert max(waits) < 0.2, max(waits)
    report("async, hung store", waits)


def test_abort_and_preempt_while_batch_in_flight(h):
    """lookup_async with every batch slow (in flight across steps), aborts,
    and so few blocks that running requests are preempted and looked up
    again: every answer equals vLLM's worker, aborted requests are never
    answered after their abort, and tracking ends equal to the live set."""
    rng = random.Random(6)
    case = h.LAYOUTS[0]
    store = h.FaultStore()
    cfg = {"load_async": False, "lookup_async": True,
           "kvhit_lookup_timeout_s": BOUND_S, "kvhit_store_timeout_s": STORE_S}  # fmt: skip
    side = h.build_side("kvhit", case, store, cfg, num_blocks=40,
                        max_num_seqs=8, max_num_batched_tokens=256)  # fmt: skip
    reqs = prompts(rng, 40)
    fill_store(h, rng, store, side.worker, reqs, side.hash_block_size)
    store.delay_s = 0.03
    d = h.Driver(side)
    d.max_tokens = 24
    aborted: dict[str, int] = {}
    preempted = 0
    waits = []
    try:
        for step in range(120):
            if step < 40:
                d.add(f"r{step}", reqs[step])
            if step % 7 == 3:
                live = sorted(d.sched.requests)
                for rid in rng.sample(live, min(2, len(live))):
                    aborted[rid] = step
                d.abort([r for r, s in aborted.items() if s == step])
            rec = d.step()
            waits.append(rec.wait_s)
            preempted += len(rec.out.preempted_req_ids or ())
            assert d.truth(rec) == []
            for rid, *_ in rec.answers:
                assert rid not in aborted
            assert not set(d.client.results) & set(aborted)
            if step > 40 and not d.sched.has_requests():
                break
            time.sleep(0.005)
        assert preempted > 0, "no preemption happened"
        assert aborted
        assert set(d.client.tracked) == set(d.sched.requests)
    finally:
        side.close()
    assert max(waits) < 0.2
    report("abort/preempt in flight", waits)


def test_reused_and_duplicate_request_ids(h):
    """An id reused after its request ended is answered for the new prompt;
    tracking the same id twice keeps one entry (the newest request)."""
    d, store, reqs = setup(h, 7)
    try:
        d.add("same", reqs[0])
        first = d.step()
        assert first.answers[0][0] == "same"
        d.abort(["same"])
        d.step()
        assert "same" not in d.client.tracked
        d.add("same", reqs[5])
        rec = d.step()
        got = [a for a in rec.answers if a[0] == "same"]
        assert got and d.truth(rec) == []
        assert got[0][1] == len(reqs[5])
        # The client itself: a second request object under one id replaces
        # the first in tracking and in the batch.
        client = d.client
        r1 = h.make_request("dup", reqs[1], d.side.hash_block_size, 4)
        r2 = h.make_request("dup", reqs[2], d.side.hash_block_size, 4)
        client.track(r1)
        client.track(r2)
        items = client._batch("other", 0, [])
        dup = [item for rid, item in items if rid == "dup"]
        assert len(dup) == 1 and dup[0][0] == len(reqs[2])
        client.untrack("dup")
    finally:
        d.side.close()


def test_steps_with_0_and_4096_waiting(h):
    rng = random.Random(8)
    d, store, reqs = setup(h, 8, n=64, kvhit_lookup_timeout_s=1.0,
                           kvhit_store_timeout_s=0.5)  # fmt: skip
    try:
        m0, c0 = d.client.num_messages, store.calls
        rec = d.step()
        assert rec.answers == [] and d.client.num_messages == m0
        assert store.calls == c0
        # 4096 waiting requests (shared prefixes, so many hit): one message.
        for i in range(4096):
            base = reqs[i % len(reqs)]
            d.add(f"w{i}", base[: rng.randrange(min(16, len(base)), len(base) + 1)])
        # A full collection of the 4096 new requests' objects would land in
        # the step's first allocations (~1.5 s here): not the store's time.
        gc.collect()
        m0, c0 = d.client.num_messages, store.calls
        rec = d.step()
        wait_4096 = rec.wait_s
        assert d.client.num_messages - m0 == 1 and store.calls - c0 == 1
        assert d.client.num_timeouts == 0, "the 4096 batch missed the bound"
        assert d.truth(rec) == [] and any(hits(rec))
        # The lookup's share is within the bound; the rest is the Scheduler's
        # own work over 4096 requests.
        assert rec.lookup_s < 1.0 + SLACK_S
        print(f"\n[4096 waiting] schedule() {wait_4096:.3f} s, "
              f"of which kvhit lookups {rec.lookup_s:.3f} s")  # fmt: skip
    finally:
        d.side.close()


# -- a stuck store call blocks nothing after it (issue 34.1, 34.2) -------------------


def test_one_call_hung_for_long_then_the_next_step_grants_vllms_loads(h):
    """The issue's case: the store hangs for one call (8 s in the report)
    and answers at once again after it. That step is a miss within the
    bound; the next step asks on a free slot and grants exactly vLLM's
    worker answers, while the hung call is still in flight."""
    d, store, reqs = setup(h, 11)
    server = d.side.servers[-1]
    hang = threading.Event()
    try:
        for i in range(4):
            d.add(f"a{i}", reqs[i])
        assert any(hits(d.step()))
        store.max_hang_s = 8.0
        store.gate = hang  # the next call waits for it, up to 8 s
        d.add("b0", reqs[4])
        rec = d.step()
        assert rec.answers and all(x == 0 for x in hits(rec))
        assert rec.wait_s < STORE_S + SLACK_S
        store.gate = None  # the store answers again; the hung call does not
        recs = fresh_steps(d, reqs, "c", 1, per_step=6)
        assert server.store_pool.in_flight == 1, "the hung call returned early"
        assert all(d.truth(r) == [] for r in recs)
        assert any(hits(recs[0])), "the step after the hang granted no load"
        st = server.store_stats()
        assert (st.timeouts, st.busy, st.late) == (1, 0, 0)
    finally:
        hang.set()
        d.side.close()
    report("one call hung", [rec.wait_s, *[r.wait_s for r in recs]])


def test_every_slot_stuck_answers_misses_at_once_then_recovers_in_one_step(h):
    """A store that hangs every call: the first ``kvhit_store_pool`` steps
    wait out the store timeout, later ones answer misses at once (counted,
    one log line per ``kvhit_store_busy_log_s``); never more calls in flight
    than slots, however many steps; the first step after the store answers
    again grants exactly vLLM's worker answers."""
    log = logging.getLogger("kvhit.bindings.mooncake_store")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep(logging.WARNING)
    log.addHandler(keep)
    d, store, reqs = setup(h, 12, kvhit_store_pool=2, kvhit_store_busy_log_s=0.5)
    server = d.side.servers[-1]
    threads_before = threading.active_count()
    waits, busy_waits = [], []
    try:
        for i in range(4):
            d.add(f"a{i}", reqs[i])
        assert any(hits(d.step()))
        store.gate = threading.Event()
        k, t_busy = 4, None
        t_end = time.monotonic() + 1.6
        while time.monotonic() < t_end:
            d.add(f"b{k}", reqs[k % len(reqs)])
            k += 1
            busy = server.store_stats().busy
            rec = d.step()
            waits.append(rec.wait_s)
            assert rec.answers and all(x == 0 for x in hits(rec))
            assert server.store_pool.in_flight <= 2
            assert threading.active_count() <= threads_before + 2
            if server.store_stats().busy > busy:
                busy_waits.append(rec.wait_s)
                t_busy = t_busy or time.monotonic()
            time.sleep(0.01)
        st = server.store_stats()
        assert st.timeouts == 2 and st.calls - 1 == 2 and st.max_in_flight == 2
        assert st.busy == len(busy_waits) >= 10
        assert max(busy_waits) < SLACK_S  # at once: the store is not asked
        stuck = [m for m in lines if "all 2 store calls are stuck" in m]
        span = time.monotonic() - t_busy
        assert 1 <= len(stuck) <= 1 + int(span / 0.5), (len(stuck), span)
        # The store answers again: the stuck calls return, their answers
        # are discarded, and the next step is answered from the store.
        store.heal()
        time.sleep(0.05)
        recs = fresh_steps(d, reqs, "c", 1, per_step=6)
        waits += [r.wait_s for r in recs]
        assert d.truth(recs[0]) == [] and any(hits(recs[0]))
        st = server.store_stats()
        assert st.late == 2 and st.in_flight == 0 and st.max_in_flight == 2
    finally:
        log.removeHandler(keep)
        d.side.close()
    assert max(waits) < BOUND_S + SLACK_S
    report("every slot stuck", waits)
