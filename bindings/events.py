"""Follow vLLM 0.33.0 KV-cache events into a :class:`~kvhit.KeyIndex`.

:class:`EventFollower` subscribes to vLLM's ``ZmqEventPublisher`` (PUB
stream plus ROUTER replay), orders and repairs the stream, and commits each
drained run of batches to the index. The wire schema, its decoding and
:func:`apply` live in ``bindings/kv_events.py`` (see its docstring for the
wire format); their public names are re-exported here, so
``from kvhit.bindings.events import EventFollower, MEDIUM_MOONCAKE_STORE``
and ``events.apply`` keep working.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import torch

from kvhit.bindings.event_order import StreamOrder
from kvhit.bindings.event_stream import RecentBatches, StopOnExit, StreamMsg
from kvhit.bindings.kv_event_scan import warm_up_decoder

# The wire schema and apply() are re-exported (kv_events.FOLLOWER_EXPORTS).
from kvhit.bindings.kv_events import *  # noqa: F403
from kvhit.bindings.kv_events import (
    FOLLOWER_EXPORTS,
    INT64_LIMIT,
    ApplyStats,
    index_hash_bytes,
    media_set,
)
from kvhit.kernels.checks import check_bool, check_int, check_seconds

__all__ = ["EventFollower", "StopOnExit", *FOLLOWER_EXPORTS]

logger = logging.getLogger(__name__)


# --- the follower.

#: How many applied batches the follower remembers, byte for byte, to tell an
#: exact duplicate (dropped) from a batch of a restarted publisher (same seq,
#: other bytes: every vLLM batch carries its creation time). Comparing the
#: payloads kept (ZMQ's own bytes objects, no copy) costs nothing on the
#: in-order path, where a digest cost ~60 ns a block. A seq older than what
#: is remembered is a conflict like any other: checked by replay.
_RECENT = 1024
#: ... and at most this many payload bytes (64 followers: 64 MiB at most).
_RECENT_BYTES = 1 << 20
#: A subscription is active only once it reached the publisher, some time
#: after its connection: a batch sent in between is delivered neither live
#: nor by a replay answered before it. The first live batch over the
#: connection proves the subscription active (anything missed before it shows
#: as a gap); while none came (a quiet publisher), settle probes (replays)
#: fetch such batches, the first this many seconds after the connection...
_SETTLE_S = 0.2
#: ... then each after twice the previous wait, at most this many a
#: connection: 0.2, 0.6, 1.4 and 3.0 s after it. Nothing from the SUB side
#: shows when the subscription arrives (vLLM's PUB sends no welcome), so a
#: subscription late by more than the last one still loses a batch sent
#: in between until the next live batch (or ``idle_probe_s``).
_SETTLE_PROBES = 4


class EventFollower(StreamOrder, StopOnExit):
    """Subscribe to a vLLM ``ZmqEventPublisher`` and keep ``index`` current.

    A daemon thread reads the PUB stream, applies batches in sequence order and
    repairs gaps through the replay endpoint before applying anything newer.
    Messages already queued are drained together (up to ``max_drain``) and
    committed as one plan, so a GPU index sees a few large updates rather than
    one per event. The follower must be the index's only writer while it runs
    (or other writers hold :attr:`lock` and accept that a growth commit made
    meanwhile falls back to rehashing under the lock).

    **Reading.** :meth:`lookup` is the safe way to read: it holds the lock and
    answers zero hits while the index is :attr:`stale`::

        hits = follower.lookup(engine, batch, num_tokens)   # int64 [B]

    By hand: ``with follower.lock:`` around the lookups, then
    :meth:`guard_hits` (zeroes them when stale). The index is only mutated
    while holding :attr:`lock` (an ``RLock``, or the one passed in), for O(1)
    even when it grows: a grown table is built outside the lock and swapped in
    under it. Decoding and replay happen outside the lock.

    **Stream integrity.** Every batch is identified by its sequence number and
    its bytes:

    - an exact duplicate (same seq, same bytes) is dropped silently;
    - a batch ahead of the next expected one is held in a reorder buffer
      (``reorder_window`` batches, ``reorder_wait_s``); if the missing ones
      arrive they are applied in order, otherwise the gap is repaired from
      the replay endpoint, or the index marked stale;
    - a replay must start with the last batch applied, byte for byte, so a
      new publisher is never taken for the old one with a gap;
    - a batch that conflicts with what was applied or held (same seq, other
      bytes) is checked against the replay endpoint: while the replay still
      continues the stream, the replay's batches are the publisher's and the
      conflicting live one is a straggler of a publisher already replaced
      (``foreign``, dropped), as is a held batch beyond the publisher's last;
    - a publisher restart (a replay that does not continue the stream, a
      conflict with no replay to check it, or a reconnection of the SUB
      socket seen through pyzmq's socket monitor) makes the follower rebuild
      the index from the new publisher's replay buffer when that reaches
      back to its first batch (seq 0): cleared and refilled in one commit,
      equal to the new publisher's state; batches held for a reorder are
      dropped with the old publisher (the new one's come back by replay).
      Live batches after the rebuild are held, not applied, until the new
      publisher's own live copy of a rebuilt batch or a replay shows the
      stream is its: the old publisher's stragglers, still queued behind the
      same sockets, are dropped. Otherwise (no replay endpoint, buffer
      wrapped) the index is marked stale;
    - frames drained before a reported reconnection are not applied when
      the new connection may have brought some of them (see
      ``_on_monitor``): the reconnection's check and replay bring them back.

    - a batch the publisher sent after the SUB connected (or after it
      answered that connection's replay) but before the subscription reached
      it is neither replayed nor delivered live: the next live batch shows
      it as a gap; until one comes over the connection (a quiet publisher),
      settle probes replay it, 0.2, 0.6, 1.4 and 3.0 s after the connection
      (``_SETTLE_S``, ``_SETTLE_PROBES``; ``settle_probes``).

    Replays are bounded by the faults: one at start-up, one per gap, at most
    three per conflict or restart (the check, the rebuild, and one for what
    was held across it), never one per batch; and at most four settle
    probes a connection (the first, and each reconnection), none after its
    first live batch; a replay whose answer came back with a hole (its
    ROUTER dropped batches past its send high-water mark) is asked again
    from the hole, ``_REPLAY_RETRIES`` times at most (``replay_retries``),
    and a stale index's repair asks at most once per wait, the waits
    doubling to 30 s (``repair_replays``). ``tests/test_event_storm.py``
    holds 64 publishers to that.

    **Staleness.** :attr:`stale` becomes True when the index may differ from
    the publisher's state: a gap replay could not cover (``gaps_unrecovered``),
    a payload that did not decode (``malformed``), a batch that could not be
    applied (``apply_errors``), or a restart that could not be rebuilt. The
    flag stays set until :meth:`clear_stale` (or a successful rebuild); a
    stale index must not serve hits (:meth:`lookup` enforces it). Errors
    never stop the thread. A gap is repaired, though: when the only cause
    is a gap no replay filled (or a check the replay endpoint did not
    answer: a reconnection's, or one of batches held across a rebuild), the
    follower asks for it again 0.5 s later, then after twice each wait (to
    30 s); once the publisher answers with every batch from the last one
    applied before the gap (from seq 0 if none is remembered), and each
    batch applied since is its own byte for byte (else: a restart,
    rebuilt), they are all applied again (a batch sets each key it names,
    so the index becomes the publisher's state) and the flag clears
    (``gaps_repaired``). Batches applied again count again in
    ``batches_applied`` and the like, and ``on_commit`` sees their commit.
    A rebuild clears the flag only once it is committed; a restart that
    could not be rebuilt (no answer) is rebuilt the same way once the
    endpoint answers. While the flag is clear, the index is the publisher's
    state up to :attr:`committed_seq` (``tests/test_event_repair.py``).

    ``start_seq``: the first sequence expected (0: everything since the
    publisher started, replayed at start-up if a replay endpoint is given);
    ``None`` adopts whatever arrives first (an index seeded elsewhere).

    Every argument is validated here (TypeError/ValueError naming it).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        index: Any,
        topic: str = "",
        medium: str | Collection[str] | None = None,
        *,
        honor_clears: bool = True,
        default_group_id: int = 0,
        start_seq: int | None = 0,
        lock: threading.RLock | threading.Lock | None = None,
        replay_timeout_s: float = 2.0,
        idle_probe_s: float | None = None,
        max_drain: int = 1024,
        rcvhwm: int = 100_000,
        poll_ms: int = 50,
        on_commit: Callable[[ApplyStats], None] | None = None,
        reorder_window: int = 64,
        reorder_wait_s: float = 0.02,
    ) -> None:
        for name, value in (
            ("endpoint", endpoint),
            ("replay_endpoint", replay_endpoint),
        ):
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
            if "://" not in value:
                raise ValueError(
                    f"{name} must be a ZMQ endpoint like tcp://host:port, got {value!r}"
                )
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        media = media_set(medium)
        check_bool(honor_clears, "honor_clears")
        check_int(default_group_id, "default_group_id", 0, INT64_LIMIT)
        if start_seq is not None:
            check_int(start_seq, "start_seq", 0, 1 << 64)
        if lock is not None and not (
            callable(getattr(lock, "__enter__", None))
            and callable(getattr(lock, "__exit__", None))
        ):
            raise TypeError(
                f"lock must be a lock (a context manager), got {type(lock).__name__}"
            )
        check_seconds(replay_timeout_s, "replay_timeout_s")
        check_seconds(idle_probe_s, "idle_probe_s", optional=True)
        check_int(max_drain, "max_drain", 1)
        check_int(rcvhwm, "rcvhwm", 0, 1 << 31)  # ZMQ: 0 = no limit
        # poll_ms bounds how fast stop() returns (its default timeout is 5 s);
        # 0 would spin, < 0 block forever.
        check_int(poll_ms, "poll_ms", 1, 1001)
        if on_commit is not None and not callable(on_commit):
            raise TypeError(
                f"on_commit must be callable, got {type(on_commit).__name__}"
            )
        check_int(reorder_window, "reorder_window", 0)
        check_seconds(reorder_wait_s, "reorder_wait_s", zero=True)
        self._hash_bytes = index_hash_bytes(index)
        warm_up_decoder()  # the scans loaded: no event of the stream compiles one

        import zmq  # imported here so apply() works without pyzmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._media = media
        self._honor_clears = honor_clears
        self._default_group_id = default_group_id
        self.lock = lock if lock is not None else threading.RLock()
        # Timing and socket settings, as checked above.
        self.replay_timeout_s, self.idle_probe_s = float(replay_timeout_s), idle_probe_s
        self.max_drain, self.rcvhwm, self.poll_ms = max_drain, rcvhwm, poll_ms
        self.on_commit = on_commit
        self.reorder_window, self.reorder_wait_s = reorder_window, float(reorder_wait_s)

        # Sequence state (follower thread only).
        self._start_seq = start_seq
        self.next_seq: int | None = start_seq
        #: Sequence after the last batch whose effects are in the index.
        self.committed_seq: int | None = None
        self._recent = RecentBatches(_RECENT, _RECENT_BYTES)
        self._verified_until = -math.inf  # see _CHECK_INTERVAL_S
        self._ahead: dict[int, StreamMsg] = {}  # the reorder buffer
        self._ahead_since: float | None = None
        self._disconnected = False
        #: After a rebuild: live batches may still be the old publisher's
        #: (queued behind the SUB socket before the restart), until a live
        #: batch is seen to be the new one's (see _accept).
        self._suspect = False
        #: When to run the next settle probe (see _SETTLE_S); None: none due.
        self._settle_at: float | None = None
        self._settle_left = 0  # ... and how many more this connection
        #: A live frame came over the current connection: its subscription
        #: is active (see _SETTLE_S).
        self._confirmed = False

        #: Stale from a gap: (seq, payload) of the last batch applied before
        #: it (or event_order's _FROM_START / _REBUILD), and when to ask for
        #: it again (see StreamOrder._repair).
        self._hole: tuple[int, bytes] | None = None
        self._repair_at = self._repair_wait = 0.0
        self._repair_wrapped = 0  # answers that started past the anchor

        # Counters, read by anyone (plain ints: atomic enough under the GIL).
        self.stale = False
        self.batches_applied = 0
        self.events_applied = 0
        self.events_skipped = 0
        self.keys_added = 0
        self.keys_removed = 0
        self.commits = 0
        self.malformed = 0
        self.duplicates = 0
        self.reordered = 0
        self.foreign = 0
        self.ignored_topic = 0
        self.gaps_detected = 0
        self.gaps_recovered = 0
        self.gaps_unrecovered = 0
        self.gaps_repaired = 0
        self.repair_replays = 0
        self.replays_requested = 0
        self.replay_retries = 0
        self.settle_probes = 0
        self.publisher_restarts = 0
        self.rebuilds = 0
        self.disconnects = 0
        self.reconnects = 0
        self.apply_errors = 0
        self.last_error: str | None = None

        self._ctx: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._progress = threading.Condition()
        self._seq_waiters = 0  # threads in wait_for_seq (under _progress)

    # -- lifecycle

    def start(self, timeout_s: float = 5.0) -> EventFollower:
        """Start the thread; returns once its SUB socket is connected."""
        check_seconds(timeout_s, "timeout_s")
        if self._thread is not None:
            raise RuntimeError("EventFollower already started")
        self._ctx = self._zmq.Context()
        self._stop.clear()
        self._ready.clear()
        self._thread = threading.Thread(
            target=self._run, name="kvhit-event-follower", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout_s) or not self._thread.is_alive():
            error = self.last_error
            self.stop()
            raise RuntimeError(f"follower did not start: {error or 'timeout'}")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (bounded join) and release the sockets."""
        check_seconds(timeout_s, "timeout_s")
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            # The loop polls every poll_ms and replays check the stop flag, so
            # this returns within about max(poll_ms, one replay poll).
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("event follower did not stop within %s s", timeout_s)
                return  # leave the context: its sockets are still in use
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> EventFollower:
        # ``with EventFollower(...).start() as f`` is fine too.
        return self if self._thread is not None else self.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- reader helpers

    def guard_hits(self, hits: torch.Tensor) -> torch.Tensor:
        """``hits`` zeroed in place when the index is stale (a stale index
        never serves a hit); call it while holding :attr:`lock`."""
        return hits.zero_() if self.stale else hits

    def lookup(self, engine: Any, batch: Any, num_tokens: Any) -> torch.Tensor:
        """``engine.lookup(batch, num_tokens, index)`` under :attr:`lock`,
        zero hits while :attr:`stale`: int64 ``[B]``, tokens to load."""
        with self.lock:
            # Checked after the lookup: staleness found meanwhile still counts.
            return self.guard_hits(engine.lookup(batch, num_tokens, self.index))

    def clear_stale(self) -> None:
        """Declare the index trustworthy again (e.g. after rebuilding it)."""
        self.stale = False

    def counters(self) -> dict[str, Any]:
        """A snapshot of the counters, for metrics."""
        names = (
            "stale next_seq committed_seq batches_applied events_applied "
            "events_skipped keys_added keys_removed commits malformed duplicates "
            "reordered foreign ignored_topic gaps_detected gaps_recovered "
            "gaps_unrecovered gaps_repaired repair_replays replays_requested "
            "replay_retries settle_probes publisher_restarts rebuilds "
            "disconnects reconnects apply_errors last_error"
        ).split()
        return {n: getattr(self, n) for n in names}

    def wait_for_seq(self, seq: int, timeout_s: float) -> bool:
        """Block until batch ``seq`` has been applied (or skipped); bounded."""
        check_int(seq, "seq", -1)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise TypeError(
                f"timeout_s must be a number, got {type(timeout_s).__name__}"
            )
        deadline = time.monotonic() + timeout_s
        with self._progress:
            self._seq_waiters += 1  # counted, then the seq read: see _flush
            try:
                while self.committed_seq is None or self.committed_seq <= seq:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._progress.wait(left)
            finally:
                self._seq_waiters -= 1
        return True

    # -- the thread

    def _run(self) -> None:
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        monitor = None
        try:
            try:
                sub.setsockopt(zmq.LINGER, 0)
                # Bounded memory if we fall behind; what ZMQ then drops shows up
                # as a sequence gap and is replayed.
                sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
                sub.setsockopt(zmq.SUBSCRIBE, self._topic_bytes)
                # Connection events: a reconnection may be to a new publisher.
                monitor = sub.get_monitor_socket(
                    zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                )
                sub.connect(self.endpoint)
            except zmq.ZMQError as exc:
                self.last_error = f"cannot connect to {self.endpoint}: {exc}"
                return
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            self._ready.set()
            if self.next_seq is not None and self.replay_endpoint is not None:
                self._safely(self._catch_up, "start-up")  # what came before us
            # Settle probes start with the connection (its monitor event), not
            # here: a publisher not up yet may come up long after this replay.
            last_msg = time.monotonic()
            while not self._stop.is_set():
                timeout = self.poll_ms
                for due in (
                    None
                    if self._ahead_since is None
                    else self._ahead_since + self.reorder_wait_s,
                    self._settle_at,
                    None if self._hole is None else self._repair_at,
                ):
                    if due is not None:
                        left = math.ceil((due - time.monotonic()) * 1000)
                        timeout = max(0, min(timeout, left))
                ready = dict(poller.poll(timeout))
                frames = self._drain(sub, self.max_drain) if sub in ready else []
                if frames:
                    last_msg = time.monotonic()
                reconnects = self.reconnects
                # Connection events are read after the drain: see _on_monitor.
                if monitor in ready or (frames and monitor.poll(0)):
                    self._safely(self._on_monitor, monitor, sub, frames)
                elif frames:
                    self._safely(self._handle_live, frames)
                if frames and self.reconnects == reconnects and not self._disconnected:
                    # Live batches over the current connection: its
                    # subscription is active, and a batch sent before it
                    # reached the publisher is now a gap (see _SETTLE_S).
                    self._confirmed = True
                    self._settle_at = None
                elif (
                    self._settle_at is not None and time.monotonic() >= self._settle_at
                ):
                    self._settle_left -= 1
                    self.settle_probes += 1
                    self._safely(self._catch_up, "settle probe")
                    # Timed from the answer: a slow replay is no probe lost.
                    # Each wait twice the previous: _SETTLE_S, then 0.4, 0.8,
                    # 1.6 s as the probes done grow.
                    done = _SETTLE_PROBES - self._settle_left
                    self._settle_at = (
                        time.monotonic() + _SETTLE_S * 2**done
                        if self._settle_left > 0
                        else None
                    )
                if self._ahead_since is not None and (
                    time.monotonic() >= self._ahead_since + self.reorder_wait_s
                    or len(self._ahead) > self.reorder_window
                ):
                    since = self._ahead_since
                    self._safely(self._catch_up, "gap")
                    if self._ahead and self._ahead_since == since:
                        # The gap's catch-up failed (counted, stale): never
                        # spin on it (the repair asks again on its schedule).
                        self._ahead.clear()
                        self._ahead_since = None
                if self._hole is not None and time.monotonic() >= self._repair_at:
                    self._safely(self._repair)
                if not ready:
                    idle = self.idle_probe_s
                    if (
                        idle is not None
                        and self.replay_endpoint is not None
                        and self.next_seq is not None
                        and time.monotonic() - last_msg >= idle
                    ):
                        self._safely(self._catch_up, "idle probe")
                        last_msg = time.monotonic()
        finally:
            self._ready.set()
            if monitor is not None:
                with contextlib.suppress(Exception):
                    sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)

    def _drain(self, sub: Any, limit: int | None) -> list[list[bytes]]:
        frames_list = []
        while limit is None or len(frames_list) < limit:
            try:
                frames_list.append(sub.recv_multipart(self._zmq.NOBLOCK))
            except self._zmq.Again:
                break
        return frames_list

    def _on_monitor(
        self, monitor: Any, sub: Any, queued: list[list[bytes]] | None = None
    ) -> None:
        """Handle the connection events reported so far; ``queued``: live
        frames drained (not yet applied) before they were read.

        Frames drained before ZMQ reported a reconnection came over the old
        connection, and are applied before anything the next one brings. But
        a thread that falls behind (a loaded host) may drain the next
        connection's first batches with them, before it reads the events
        that reported it: batches of a new publisher, one of which may have
        exactly the seq the follower expects, and be taken for the old
        stream (phantom keys from the old publisher, lost keys of the new
        one, the reconnection's check then anchored on a batch of the new
        publisher, so passed). Which frame came over which connection cannot
        be told, so when a reconnection was reported by the end of the
        drain none of them is applied: the check that follows anchors on
        the last batch of the old connection, and its replay (the same
        publisher) or rebuild (a new one) brings back every batch dropped.
        """
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        events: list[int] = []
        while True:
            while monitor.poll(0):
                events.append(recv_monitor_message(monitor)["event"])
            if queued:
                disconnected, reconnected = self._disconnected, False
                for event in events:
                    if event == zmq.EVENT_DISCONNECTED:
                        disconnected = True
                    elif event == zmq.EVENT_CONNECTED and disconnected:
                        reconnected = True
                if not reconnected:
                    self._handle_live(queued)
                queued = None
            if not events:
                return
            event = events.pop(0)
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                queued = self._drain(sub, None)  # applied (or not) above
                self._disconnected = True
                self._confirmed = False
            elif event == zmq.EVENT_CONNECTED and self._disconnected:
                self._disconnected = False
                self.reconnects += 1
                self._on_reconnect()
            elif event == zmq.EVENT_CONNECTED and not self._confirmed:
                # The first connection (at start-up, or whenever the
                # publisher came up): what it sends before the subscription
                # reaches it is lost live and, past the start-up replay,
                # not replayed either.
                self._arm_settle()

    def _on_reconnect(self) -> None:
        """The SUB socket reconnected: a network blip or a new publisher."""
        if not self._recent:
            # Nothing applied: nothing to mistake for the new stream. What
            # _on_monitor dropped with the reconnection comes back as at
            # start-up.
            self._catch_up("reconnect")
            self._arm_settle()
            return
        if self.replay_endpoint is None:
            # Cannot tell a restart from a blip, nor replay what was missed.
            self.stale = True
            self.last_error = "reconnected without a replay endpoint"
            return
        self._catch_up("reconnect", must_verify=True)
        # A new connection brings nothing of the old publisher's.
        self._suspect = False
        self._arm_settle()

    def _arm_settle(self) -> None:
        """A connection was just made whose subscription may not have reached
        the publisher yet: until a live batch comes over it, probe after
        ``_SETTLE_S``, then after twice each previous wait,
        ``_SETTLE_PROBES`` times at most."""
        self._confirmed = False
        if self.replay_endpoint is not None:
            self._settle_left = _SETTLE_PROBES
            self._settle_at = time.monotonic() + _SETTLE_S

    def _safely(self, fn: Callable[..., None], *args: Any) -> None:
        """Run one step; an unexpected error is counted, never fatal. A step
        that makes the index stale, or serve again, is logged (WARNING,
        INFO) with its cause: every step of the thread comes through here."""
        was_stale = self.stale
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the thread must survive
            logger.exception("event follower step failed")
            self.apply_errors += 1
            self.stale = True
            self.last_error = repr(exc)
        if self.stale != was_stale:
            logger.log(
                logging.WARNING if self.stale else logging.INFO,
                "KV-event follower of %s %s: %s",
                self.endpoint,
                "is stale (serves no hits)" if self.stale else "serves again",
                self.last_error,
            )
