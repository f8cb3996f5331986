"""A soak of the kvhit connector inside vLLM 0.33.0's real ``Scheduler``
(slow: run by hand, ``-m slow -s``).

10,000 steps with random arrivals (requests sharing system prompts; at most
MAX_LIVE in the scheduler, so the queue stays bounded), aborts,
preemptions (a small block pool) and saves (keys added to the store as
requests finish), and a store fault every ~1,000 steps, rotating: a hung
store (1.5 s), a store slower than its timeout, a store raising, answers
that are not ints, the server's loop failing, the store emptied. Checked:

- every answer on a healthy step (no fault active, no store error or
  timeout during it) equals vLLM's own ``MooncakeStoreWorker.lookup`` on the
  same store: 0 mismatches;
- every answer on a faulty step is a miss (no hit the store did not confirm);
- no ``schedule()`` waits longer than ``kvhit_lookup_timeout_s`` (1 s) plus
  slack;
- threads, open fds, sockets and RSS at the start (after a warm-up) and at
  the end: flat.

It prints the start/end table.
"""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest
from test_vllm_connector import prompts

from kvhit.bindings.mooncake_store import DEFAULT_POOL_SIZE

# Bounds of about a second: never beside another test process.
pytestmark = pytest.mark.timing

STEPS = int(__import__("os").environ.get("KVHIT_SOAK_STEPS", 10_000))
#: The step whose resources are the baseline (after a warm-up; a short run
#: takes its fifth of the way).
WARM_STEP = min(500, STEPS // 5)
FAULT_EVERY = 1_000
#: requests in the scheduler (waiting, running, preempted) at most: arrivals
#: beyond it are dropped, as a loaded frontend would hold them back
MAX_LIVE = 48
BOUND_S = 1.0
SLACK_S = 0.5


def save(h, rng, store, worker, tokens) -> None:
    """Keys as a save of ``tokens`` leaves them (every group's full blocks),
    up to a random length."""
    hashes = h.make_request("x", tokens, worker.hash_block_size, 1).block_hashes
    keep = rng.randrange(0, len(hashes) + 1)
    for db, prefixes in zip(worker.token_dbs, worker._lookup_key_prefixes, strict=True):
        per_block = db.block_size // worker.hash_block_size
        for i in range(keep):
            if (i + 1) % per_block == 0:
                store.keys.update(f"{p}@{bytes(hashes[i]).hex()}" for p in prefixes)


@pytest.mark.slow
def test_soak(sched_harness):
    h = sched_harness

    rng = random.Random(2026)
    store = h.FaultStore()
    side = h.build_side("kvhit", h.LAYOUTS[1], store, {"load_async": False},
                        num_blocks=64, max_num_seqs=16, max_num_batched_tokens=512)  # fmt: skip
    worker = side.worker
    server = side.servers[-1]
    d = h.Driver(side)
    client = d.client
    pool = prompts(rng, 200)
    for t in rng.sample(pool, 60):
        save(h, rng, store, worker, t)
    crash = h.crash_lookups(server)  # raises h.Boom while crash["left"]
    faults = ["hang", "slow", "raise", "strings", "crash", "empty"]
    fault_log = []
    active: str | None = None
    fault_until = 0
    gate: threading.Event | None = None
    healthy = faulty = compared = hits_served = 0
    mismatches: list[str] = []
    unconfirmed: list[str] = []
    worst = 0.0
    worst_at: tuple = ()
    rss: list = []
    preempted = aborted = 0
    start = None
    n = 0
    next_fault = FAULT_EVERY + rng.randrange(-100, 100)
    # What vLLM's EngineCore does once built (freeze_gc_heap): the start-up
    # heap is left out of every later collection.
    gc.collect()
    gc.freeze()
    try:
        for step in range(STEPS):
            if step == WARM_STEP:
                gc.collect()
                start = h.resources()
            if step % 1000 == 0:
                # The store keeps every saved key: its growth is expected RSS
                # growth; the live requests should stay under MAX_LIVE.
                rss.append((step, h.resources()["rss_kib"] // 1024, len(store.keys),
                            len(d.sched.requests)))  # fmt: skip
            # A fault every ~FAULT_EVERY steps, rotating.
            if step == next_fault:
                next_fault += FAULT_EVERY + rng.randrange(-100, 100)
                active = faults[len(fault_log) % len(faults)]
                fault_log.append((step, active))
                if active == "hang":
                    gate = threading.Event()
                    store.gate = gate
                    fault_until = time.monotonic() + 1.5
                elif active == "slow":
                    store.delay_s = 0.7
                    fault_until = step + 15
                elif active == "raise":
                    store.fail = ConnectionError("master gone")
                    fault_until = step + 50
                elif active == "strings":
                    store.answer = lambda got: [str(x) for x in got]
                    fault_until = step + 20
                elif active == "crash":
                    crash["left"] = 1
                    fault_until = step + 1
                else:  # the store emptied: not a fault of kvhit's, truth holds
                    store.keys.clear()
                    active = None
            # Arrivals (0.95 a step on average) outrun what 64 blocks serve
            # (~0.5 a step): uncapped, the waiting queue grew without end
            # (220 -> 586 requests, steps 500 -> 1500), and with it RSS,
            # ~6 MiB a 1000 steps of live Request objects. A server at
            # capacity queues a bounded number; so does this one.
            k = rng.choices((0, 1, 2, 3), (35, 40, 20, 5))[0]
            for _ in range(min(k, MAX_LIVE - len(d.sched.requests))):
                d.add(f"q{n}", rng.choice(pool), rng.randrange(2, 24))
                n += 1
            live = list(d.sched.requests)
            if live and rng.random() < 0.08:
                gone = rng.sample(live, min(len(live), rng.randrange(1, 3)))
                d.abort(gone)
                aborted += len(gone)
            if step % 25 == 0:
                save(h, rng, store, worker, rng.choice(pool))
            err0 = server.last_error
            c0 = (client.num_timeouts, client.num_skipped)
            rec = d.step()
            if rec.wait_s > worst:
                worst, worst_at = rec.wait_s, (step, round(rec.lookup_s, 3), active)
            preempted += len(rec.out.preempted_req_ids or ())
            clean = (
                active is None
                and server.last_error is err0
                and (client.num_timeouts, client.num_skipped) == c0
            )
            if clean:
                healthy += 1
                bad = d.truth(rec)
                mismatches += [f"step {step}: {b}" for b in bad]
                compared += sum(a[3] is not None for a in rec.answers)
                hits_served += sum(
                    a[3] is not None and a[3].hit_length > 0 for a in rec.answers
                )
            else:
                faulty += 1
                unconfirmed += [
                    f"step {step} {active}: {a[0]} {a[3]}"
                    for a in rec.answers
                    if active is not None and a[3] is not None and a[3].hit_length
                ]
            if active is not None:
                over = (
                    time.monotonic() >= fault_until
                    if active == "hang"
                    else step + 1 >= fault_until
                )
                if over:
                    store.heal()
                    gate = None
                    active = None
        # Let parked store calls return before measuring.
        store.heal()
        time.sleep(1.0)
        gc.collect()
        end = h.resources()
    finally:
        side.close()
        gc.unfreeze()
    rows = [
        f"{'':10} {'start':>10} {'end':>10}",
        *(f"{k:10} {start[k]:>10} {end[k]:>10}" for k in start),
    ]
    print(
        "\n[soak] steps {}, healthy {} ({} answers compared, {} hits), faulty {}, "
        "mismatches {}, unconfirmed hits {}, worst schedule() {:.3f} s "
        "(step, lookup s, fault: {}), preemptions {}, aborts {}, requests {}\n"
        "  faults: {}\n  (step, RSS MiB, store keys, live requests): {}\n  {}".format(
            STEPS, healthy, compared, hits_served, faulty, len(mismatches),
            len(unconfirmed), worst, worst_at, preempted, aborted, n, fault_log,
            rss, "\n  ".join(rows),
        )
    )  # fmt: skip
    assert mismatches == [], "\n".join(mismatches[:10])
    assert unconfirmed == [], "\n".join(unconfirmed[:10])
    assert worst < BOUND_S + SLACK_S
    # One fault every ~FAULT_EVERY steps (9 in 10,000; 2 in 3,000).
    assert len(fault_log) >= STEPS // FAULT_EVERY - 1
    assert preempted and aborted and hits_served
    # The store pool's workers are kept between calls (at most its size).
    assert end["store_threads"] <= DEFAULT_POOL_SIZE
    assert (
        end["threads"] - end["store_threads"]
        <= start["threads"] - start["store_threads"] + 1
    )
    assert end["fds"] <= start["fds"] + 2 and end["sockets"] <= start["sockets"]
    # Absolute, not relative: 25% of ~700 MiB let the unbounded queue's
    # ~6 MiB per 1000 steps pass. Capped, 10,000 steps grew 6.7 MiB (the
    # store's keys, a few one-off caches); the Python heap (tracemalloc)
    # levels off at ~0.8 MiB above step 500.
    assert end["rss_kib"] - start["rss_kib"] < 16 * 1024


#: The hanging-store soak's length (issue 34.2: 10 minutes), its period and
#: the hang at the start of each period.
HANG_SOAK_S = float(__import__("os").environ.get("KVHIT_HANG_SOAK_S", 600))
HANG_PERIOD_S = 60.0
HANG_S = 30.0


@pytest.mark.slow
def test_soak_store_hanging_half_of_every_minute(sched_harness):
    """A store that hangs 30 s of every minute (every call waits until the
    hang ends), steps back to back for ``KVHIT_HANG_SOAK_S`` seconds: no
    step lost (each ``schedule()`` returns within the bound, every request
    looked up gets an answer), misses only while it hangs, vLLM's answers
    when it does not, in-flight store calls never above the pool's size,
    and threads, fds, sockets and RSS flat from the first minute to the
    last. Prints a row a period."""
    h = sched_harness
    rng = random.Random(34)
    store = h.FaultStore()
    store.max_hang_s = HANG_S + 5
    side = h.build_side("kvhit", h.LAYOUTS[1], store, {"load_async": False},
                        num_blocks=64, max_num_seqs=16, max_num_batched_tokens=512)  # fmt: skip
    worker, server = side.worker, side.servers[-1]
    d = h.Driver(side)
    pool = prompts(rng, 200)
    for t in rng.sample(pool, 60):
        save(h, rng, store, worker, t)
    size = server.store_pool.size
    rows: list[tuple] = []
    worst = 0.0
    steps = unanswered = mismatches = hits_served = unconfirmed = max_in_flight = 0
    n = 0
    gc.collect()
    gc.freeze()
    t0 = time.monotonic()
    gate: threading.Event | None = None
    period = -1
    try:
        while (now := time.monotonic() - t0) < HANG_SOAK_S:
            p, into = int(now // HANG_PERIOD_S), now % HANG_PERIOD_S
            if p != period:  # a new period: a row, then the hang starts
                period = p
                gc.collect()
                rows.append((p, steps, server.store_stats(), h.resources()))
                gate = threading.Event()
                store.gate = gate
            hanging = gate is not None
            if hanging and into >= HANG_S:
                store.heal()  # the stuck calls return; answers discarded
                gate = None
                hanging = False
            k = rng.choices((0, 1, 2, 3), (35, 40, 20, 5))[0]
            for _ in range(min(k, MAX_LIVE - len(d.sched.requests))):
                d.add(f"q{n}", rng.choice(pool), rng.randrange(2, 24))
                n += 1
            if steps % 25 == 0:
                save(h, rng, store, worker, rng.choice(pool))
            err0 = server.last_error
            rec = d.step()
            steps += 1
            worst = max(worst, rec.wait_s)
            max_in_flight = max(max_in_flight, server.store_pool.in_flight)
            unanswered += sum(a[3] is None for a in rec.answers)
            if hanging:
                unconfirmed += sum(
                    a[3] is not None and a[3].hit_length > 0 for a in rec.answers
                )
            elif server.last_error is err0:
                mismatches += len(d.truth(rec))
                hits_served += sum(
                    a[3] is not None and a[3].hit_length > 0 for a in rec.answers
                )
        store.heal()
        time.sleep(0.5)
        gc.collect()
        rows.append(("end", steps, server.store_stats(), h.resources()))
    finally:
        side.close()
        gc.unfreeze()
    print(f"\n[hanging-store soak] {HANG_SOAK_S:.0f} s, {steps} steps, worst "
          f"schedule() {worst:.3f} s, max in flight {max_in_flight}/{size}, "
          f"hits served {hits_served}, mismatches {mismatches}")  # fmt: skip
    print(f"  {'period':>6} {'steps':>6} {'threads':>7} {'fds':>4} {'socks':>5} "
          f"{'RSS MiB':>7} {'calls':>6} {'timeouts':>8} {'late':>5} {'busy':>6}")  # fmt: skip
    for p, s, st, r in rows:
        print(f"  {p!s:>6} {s:>6} {r['threads']:>7} {r['fds']:>4} "
              f"{r['sockets']:>5} {r['rss_kib'] // 1024:>7} {st.calls:>6} "
              f"{st.timeouts:>8} {st.late:>5} {st.busy:>6}")  # fmt: skip
    first, last = rows[1][3] if len(rows) > 2 else rows[0][3], rows[-1][3]
    assert worst < BOUND_S + SLACK_S
    assert max_in_flight <= size and unanswered == 0
    assert mismatches == 0 and unconfirmed == 0 and hits_served
    assert rows[-1][2].busy > 0, "no step met every slot stuck: proves nothing"
    assert last["store_threads"] <= size
    assert (
        last["threads"] - last["store_threads"]
        <= first["threads"] - first["store_threads"] + 1
    )
    assert last["fds"] <= first["fds"] + 2 and last["sockets"] <= first["sockets"]
    assert last["rss_kib"] - first["rss_kib"] < 16 * 1024
