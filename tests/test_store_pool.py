"""StoreCallPool (bindings/mooncake_store.py): a stuck store call blocks
nothing after it while a slot is free, every slot stuck refuses at once with
a rate-limited line and a counter, and in-flight calls never exceed the
pool's size however long the store hangs (issue 34, items 1 and 2)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvhit.bindings.mooncake_store import StoreBusy, StoreCallPool, StoreError


class Hanging:
    """``batch_is_exist`` that hangs while ``gate`` is clear (every call,
    or only the first ``only_first`` calls)."""

    def __init__(self, only_first: int | None = None) -> None:
        self.gate = threading.Event()
        self.only_first = only_first
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, keys: list[str]) -> list[int]:
        with self.lock:
            self.calls += 1
            n = self.calls
        if self.only_first is None or n <= self.only_first:
            self.gate.wait(30)
        return [1] * len(keys)


def wait_idle(pool: StoreCallPool, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while pool.in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pool.in_flight == 0


def wait_threads(count: int, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while threading.active_count() > count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert threading.active_count() <= count


def test_a_stuck_call_blocks_nothing_after_it():
    pool = StoreCallPool(3)
    store = Hanging(only_first=1)
    try:
        with pytest.raises(StoreError, match="within 0.05 s"):
            pool.call(store, ["a"], 0.05)
        assert pool.in_flight == 1
        # The next call answers at once on a free slot, the first still stuck.
        t0 = time.perf_counter()
        assert pool.call(store, ["a", "b"], 1.0) == [1, 1]
        assert time.perf_counter() - t0 < 0.5
        assert pool.in_flight == 1
    finally:
        store.gate.set()
    wait_idle(pool)
    st = pool.stats()
    assert (st.calls, st.timeouts, st.late, st.busy) == (2, 1, 1, 0)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_in_flight_never_exceeds_the_size_however_long_the_store_hangs(size):
    pool = StoreCallPool(size, busy_log_s=60)
    store = Hanging()
    threads_before = threading.active_count()
    seen = []
    refused = []
    try:
        # Callers in 4 threads, 40 calls each, against a store that never
        # answers meanwhile.
        def caller() -> None:
            for _ in range(40):
                try:
                    pool.call(store, ["k"], 0.01)
                except StoreBusy:
                    refused.append(1)
                except StoreError:
                    pass
                seen.append((pool.in_flight, threading.active_count()))

        callers = [threading.Thread(target=caller) for _ in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(30)
        assert max(n for n, _ in seen) <= size
        # Store threads beyond the callers: at most ``size``.
        assert max(a for _, a in seen) <= threads_before + 4 + size
        assert store.calls == size and len(refused) == 160 - size
    finally:
        store.gate.set()
    wait_idle(pool)
    st = pool.stats()
    assert st.max_in_flight == size and st.late == size and st.busy == 160 - size
    # The workers of the returned calls wait for the next ones: still at
    # most ``size`` store threads.
    assert threading.active_count() <= threads_before + size
    assert pool.idle_workers == size
    # Recovered: the next call is asked and answered, on a kept worker.
    assert pool.call(store, ["k"], 1.0) == [1]
    assert threading.active_count() <= threads_before + size
    pool.close()  # the idle workers end at once
    wait_threads(threads_before)


def test_every_slot_stuck_refuses_at_once_with_one_line_per_interval(caplog):
    pool = StoreCallPool(2, busy_log_s=0.4)
    store = Hanging()
    caplog.set_level(logging.WARNING, logger="kvhit.bindings.mooncake_store")
    try:
        for _ in range(2):
            with pytest.raises(StoreError, match="timeout_s"):
                pool.call(store, ["k"], 0.02)
        t0 = time.perf_counter()
        for _ in range(50):
            with pytest.raises(StoreBusy, match="all 2 store calls are stuck"):
                pool.call(store, ["k"], 1.0)
        assert time.perf_counter() - t0 < 0.5  # never waits for a slot
        lines = [r for r in caplog.records if "store calls are stuck" in r.message]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING
        time.sleep(0.45)
        for _ in range(10):
            with pytest.raises(StoreBusy):
                pool.call(store, ["k"], 1.0)
        lines = [r for r in caplog.records if "store calls are stuck" in r.message]
        assert len(lines) == 2
        assert "(51 refused so far" in lines[1].getMessage()
        assert pool.stats().busy == 60 and store.calls == 2
    finally:
        store.gate.set()
    wait_idle(pool)
    assert pool.call(store, ["k"], 1.0) == [1]


def test_store_exceptions_are_store_errors_with_their_cause():
    pool = StoreCallPool(2)

    def broken(keys):
        raise ConnectionError("master gone")

    with pytest.raises(StoreError, match="master gone") as err:
        pool.call(broken, ["k"], 1.0)
    assert isinstance(err.value.__cause__, ConnectionError)
    assert pool.in_flight == 0 and pool.stats().calls == 1


@pytest.mark.parametrize(
    "kw, exc",
    [
        ({"size": 0}, ValueError),
        ({"size": 2.0}, TypeError),
        ({"size": True}, TypeError),
        ({"busy_log_s": 0}, ValueError),
        ({"busy_log_s": float("nan")}, ValueError),
        ({"busy_log_s": "1"}, TypeError),
        ({"idle_s": 0}, ValueError),
        ({"idle_s": float("inf")}, ValueError),
    ],
)
def test_bad_arguments_are_refused(kw, exc):
    with pytest.raises(exc, match=next(iter(kw))):
        StoreCallPool(**kw)


def test_workers_are_kept_between_calls_and_end_when_idle_or_closed():
    """A call goes to the worker the last one ran on (no thread started per
    call); an idle worker ends after ``idle_s``; ``close`` ends idle ones at
    once, and a call after it still runs, on a worker that ends with it."""
    pool = StoreCallPool(3, idle_s=0.3)
    seen: list[threading.Thread] = []

    def store(keys: list[str]) -> list[int]:
        seen.append(threading.current_thread())
        return [1] * len(keys)

    for _ in range(20):
        assert pool.call(store, ["k"], 1.0) == [1]
    assert len(set(seen)) == 1 and pool.idle_workers == 1
    # Join the pool's own worker rather than wait on the process's thread
    # count: a thread another test left behind may end meanwhile and bring
    # the count down while this worker still waits (CI saw exactly that).
    seen[-1].join(5.0)  # idle past idle_s: ended
    assert not seen[-1].is_alive() and pool.idle_workers == 0
    assert pool.call(store, ["k"], 1.0) == [1]  # a new worker
    assert len(set(seen)) == 2 and pool.idle_workers == 1
    pool.close()
    seen[-1].join(5.0)
    assert not seen[-1].is_alive()
    assert pool.call(store, ["k"], 1.0) == [1]
    seen[-1].join(5.0)
    assert len(set(seen)) == 3 and not seen[-1].is_alive()
    assert pool.idle_workers == 0 and pool.in_flight == 0
    assert pool.stats().calls == 22


def test_a_stuck_worker_is_not_reused_until_it_returns():
    """A worker whose call was abandoned takes no new call while it hangs;
    once it returns it waits for the next one (threads <= size)."""
    pool = StoreCallPool(2, idle_s=5)
    store = Hanging(only_first=1)
    threads_before = threading.active_count()
    try:
        with pytest.raises(StoreError, match="timeout_s"):
            pool.call(store, ["a"], 0.02)
        for _ in range(5):
            assert pool.call(store, ["a"], 1.0) == [1]
        assert pool.in_flight == 1 and pool.idle_workers == 1
        # <=: another test's thread may end meanwhile.
        assert threading.active_count() <= threads_before + 2
    finally:
        store.gate.set()
    wait_idle(pool)
    assert pool.idle_workers == 2 and store.calls == 6
    assert pool.stats().late == 1
    pool.close()
    wait_threads(threads_before)
