"""The sequence logic of :class:`~kvhit.bindings.events.EventFollower`.

Which batch is applied, held for a reorder, dropped as a duplicate or a
straggler, fetched by replay or rebuilt from: the **Stream integrity** rules
of the follower's docstring. :class:`StreamOrder` is the follower's base
class. It owns the reorder buffer, the replays and the commits; the follower
owns the thread, the sockets, the connection events and the public API, and
sets every attribute used here in its ``__init__``.
"""

from __future__ import annotations

import functools
import math
import time

from kvhit.bindings.event_stream import (
    PendingCommit,
    PublisherRestart,
    StreamMsg,
    request_replay,
    unbroken,
)
from kvhit.bindings.kv_event_scan import plan_payload
from kvhit.bindings.kv_events import (
    EventPlan,
    MalformedPayload,
    commit_plan,
)

__all__ = ["StreamOrder"]

#: After a replay proved the stream continues, batches older than what is
#: remembered (nothing to compare them with) that arrive in the next this
#: many seconds are stragglers without another replay: a flood of them (live
#: copies of a long replay) costs at most one replay per interval. A batch
#: that differs from one remembered is always checked.
_CHECK_INTERVAL_S = 0.1
#: A replay whose answer has a hole (lost on the way, see ``_catch_up``) is
#: asked again from the hole at most this many times before the gap counts
#: as unrecovered (stale).
_REPLAY_RETRIES = 3
#: A gap no replay filled is asked for again (see ``_repair``) this many
#: seconds after, then after twice each previous wait, up to the second.
_REPAIR_S = 0.5
_REPAIR_MAX_S = 30.0
#: A repair's anchor seq when no batch applied is remembered (the gap came
#: before any, e.g. at start-up): every batch from seq 0 is applied again...
_FROM_START = -1
#: ... and when a restart could not be rebuilt: rebuilt once it can be.
_REBUILD = -2


class StreamOrder:
    """Places each batch of the stream (see the module docstring)."""

    @property
    def stale(self) -> bool:
        """True while the index may differ from the publisher's state (see
        the follower's **Staleness**); a stale index serves no hits."""
        return self._stale

    @stale.setter
    def stale(self, value: bool) -> None:
        # Set or cleared for any cause, it ends a gap's repair: only
        # _mark_hole (a gap, and nothing else wrong) starts one.
        self._stale = value
        self._hole = None

    def _mark_hole(self) -> None:
        """Stale from a gap no replay filled (``next_seq`` on is missing):
        keep the last batch applied before it (none remembered: from seq
        0), so :meth:`_repair` can fill the gap once the publisher answers."""
        hole, was_stale = self._hole, self.stale
        anchor = self._recent.get(self.next_seq - 1)
        self.stale = True
        if was_stale:
            self._hole = hole  # an earlier gap's repair covers this one
        elif anchor is not None:
            self._schedule_repair((self.next_seq - 1, anchor))
        else:
            self._schedule_repair((_FROM_START, b""))

    def _schedule_repair(self, hole: tuple[int, bytes]) -> None:
        """Stale, with ``hole`` to repair first ``_REPAIR_S`` from now (with
        a replay endpoint; without one, stale until cleared)."""
        if self.replay_endpoint is not None:
            self._hole = hole
            self._repair_wait = _REPAIR_S
            self._repair_at = time.monotonic() + _REPAIR_S
            self._repair_wrapped = 0

    def _repair(self) -> None:
        """Fill the gap that left the index stale (see :meth:`_mark_hole`),
        or rebuild a restart that could not be rebuilt (``_REBUILD``).

        Replays from the last batch applied before the gap (from seq 0 for
        ``_FROM_START``). When the publisher still holds every batch from
        there (no hole on the way) and each batch applied since is the
        publisher's, byte for byte, all of them are applied again on top of
        the index, and :attr:`stale` clears (``gaps_repaired``). That is
        exact: a batch sets each key it names (stored, removed or cleared),
        so after the run every key is as its last batch left it, whatever
        the index held before, and a key no batch of the run names was right
        already. Every batch applied since must be checked, not just the
        ends: a straggler of another publisher applied meanwhile holds keys
        the run does not name.

        No answer, or one with a hole: asked again later (twice the wait, to
        ``_REPAIR_MAX_S``). A batch applied that is not the publisher's (its
        bytes differ, or it holds none at that seq): a restart (rebuilt from
        its seq 0, or stale and a rebuild asked for later). An answer that
        starts past the anchor three times (the buffer wrapped), or more
        batches applied since than are remembered to check: stale for good
        (until a rebuild or :meth:`clear_stale`).
        """
        assert self._hole is not None
        anchor_seq, anchor = self._hole
        self.repair_replays += 1
        if anchor_seq == _REBUILD:
            msgs, wrapped = self._whole_life()
            if msgs is not None:
                self._rebuild(msgs, "a restart rebuilt on repair")
            else:
                self._repair_later(_REBUILD, wrapped, "its buffer wrapped")
            return
        assert self.next_seq is not None
        start = max(anchor_seq, 0)
        msgs = self._replay(start, None)
        if msgs == [] or (
            msgs and msgs[0].seq == anchor_seq and msgs[0].payload != anchor
        ):
            self._restart(f"repair: the replay does not continue at seq {start}")
            return
        if self._recent.last_evicted > anchor_seq:
            self._give_up(anchor_seq, "more batches were applied since than are kept")
            return
        span = self.next_seq - start  # msgs[:span]: start to the last applied
        if msgs is None or not unbroken(msgs, start):
            # No answer, a wrapped buffer, or a hole on the way.
            wrapped = bool(msgs) and msgs[0].seq > start
            self._repair_later(anchor_seq, wrapped, "the buffer no longer holds it")
            return
        if len(msgs) < span:
            # Its buffer ends before the last batch applied, which is then
            # not its own (a straggler of another publisher).
            self._restart(f"repair: no batch at seq {start + len(msgs)}, applied")
            return
        again = msgs[anchor_seq + 1 - start : span]  # what is applied again
        for m in again:
            mine = self._recent.get(m.seq)
            if mine is not None and mine != m.payload:
                self._restart(f"repair: the batch applied at seq {m.seq} differs")
                return
        hole, pending = self._hole, PendingCommit()
        self.next_seq = anchor_seq + 1
        for m in again:
            self._absorb(pending, m)
        self._take_replay(msgs[span:], self.next_seq)
        self._drain_ahead(pending)
        self._flush(pending)
        if self._hole is hole and not self._ahead:  # nothing failed meanwhile
            self.stale = False
            self.gaps_repaired += 1
            self.last_error = f"the gap after seq {anchor_seq} was repaired"

    def _repair_later(self, anchor_seq: int, wrapped: bool, why: str) -> None:
        """Ask again after twice the last wait; after the third answer that
        starts past where it should, give up."""
        if wrapped:
            self._repair_wrapped += 1
            if self._repair_wrapped >= 3:
                self._give_up(anchor_seq, why)
                return
        self._repair_wait = min(2 * self._repair_wait, _REPAIR_MAX_S)
        self._repair_at = time.monotonic() + self._repair_wait

    def _give_up(self, anchor_seq: int, why: str) -> None:
        """No repair of the gap after ``anchor_seq`` (or rebuild): stale
        until a rebuild or :meth:`clear_stale`."""
        self._hole = None
        what = (
            "the index cannot be rebuilt"
            if anchor_seq == _REBUILD
            else f"the gap after seq {anchor_seq} cannot be repaired"
        )
        self.last_error = f"{what}: {why}"

    def _parse(self, frames: list[bytes], live: bool) -> StreamMsg | None:
        """Frames -> message; None (counted) for anything not a batch."""
        if live:
            if len(frames) != 3:
                self.malformed += 1
                return None
            topic, seq_b, payload = frames
        else:
            if len(frames) != 4 or frames[0] != b"":
                self.malformed += 1
                return None
            _, topic, seq_b, payload = frames
        if len(seq_b) != 8:
            self.malformed += 1
            return None
        # SUB filtering is by prefix; a named topic must match exactly.
        if self._topic_bytes and topic != self._topic_bytes:
            self.ignored_topic += 1
            return None
        return StreamMsg(int.from_bytes(seq_b, "big"), payload)

    def _handle_live(self, frames_list: list[list[bytes]]) -> None:
        pending = PendingCommit()
        for frames in frames_list:
            msg = self._parse(frames, live=True)
            if msg is not None:
                pending = self._accept(msg, pending)
        self._flush(pending, reuse=False)

    def _accept(
        self, msg: StreamMsg, pending: PendingCommit, retry: bool = True
    ) -> PendingCommit:
        """Place one live message: apply, hold, drop, or detect a restart.

        Returns the pending commit (a new one after a restart flushed it).
        """
        seq = msg.seq
        restarts_before = self.publisher_restarts
        if self.next_seq is None:
            self.next_seq = seq
        if seq < self.next_seq:
            if self._recent.get(seq) == msg.payload:
                self.duplicates += 1  # exact duplicate (or replayed already)
                if self._suspect:
                    # The new publisher's own live copy of a rebuilt batch:
                    # the stream (one connection, in order) is its from here.
                    # What was held before it may be the old one's: the
                    # replay decides, before anything after it is applied;
                    # without an answer they are applied stale, for the
                    # repair to check.
                    self._suspect = False
                    if self._ahead:
                        self._flush(pending)
                        self._catch_up("check (held across a rebuild)", True)
                        return PendingCommit()
                return pending
            reason = f"seq {seq} differs from the batch applied at that seq"
        elif seq > self.next_seq:
            held = self._ahead.get(seq)
            if held is None:
                self._ahead[seq] = msg
                if self._ahead_since is None:
                    self._ahead_since = time.monotonic()
                return pending
            if held.payload == msg.payload:
                self.duplicates += 1
                return pending
            reason = f"two different batches with seq {seq}"
        elif self._suspect:
            # Exactly the seq the rebuilt stream expects, but maybe a
            # straggler of the old publisher: held, so the gap's replay
            # decides (or the new publisher's next live copy drops it).
            self._ahead[seq] = msg
            if self._ahead_since is None:
                self._ahead_since = time.monotonic()
            return pending
        else:
            self._absorb(pending, msg)
            self._drain_ahead(pending)
            return pending
        if not retry:
            # Neither the old nor the rebuilt stream: a straggler from the
            # publisher that is gone (or junk). The index is already rebuilt.
            self.foreign += 1
            return pending
        if seq not in self._recent and time.monotonic() < self._verified_until:
            # Older than what is remembered, so no evidence either way, and
            # the stream was proved moments ago. A mismatch with a batch
            # remembered is always checked: that is how a restart shows.
            self.foreign += 1
            return pending
        self._flush(pending)
        # A straggler of a publisher already replaced (still queued, or held
        # in the reorder buffer), or a new publisher? The replay endpoint
        # knows: if it still continues our stream the message is foreign and
        # one short replay settles it, instead of a full rebuild per
        # straggler. Without an answer, assume a restart.
        if self._catch_up(f"check ({reason})") == "verified":
            self._verified_until = time.monotonic() + _CHECK_INTERVAL_S
        elif self.publisher_restarts == restarts_before:
            self._restart(reason)
        return self._accept(msg, PendingCommit(), retry=False)

    def _drain_ahead(self, pending: PendingCommit) -> None:
        """Apply held batches that are now in order."""
        ahead = self._ahead
        if not ahead:  # the usual case: nothing held
            self._ahead_since = None
            return
        while ahead and self.next_seq in ahead:
            self._absorb(pending, ahead.pop(self.next_seq))
            self.reordered += 1
        for seq in [s for s in ahead if s < self.next_seq]:
            del ahead[seq]
        if not ahead:
            self._ahead_since = None

    def _absorb(self, pending: PendingCommit, msg: StreamMsg) -> None:
        """Decode one in-order batch into ``pending``."""
        self.next_seq = msg.seq + 1
        self._recent.remember(msg)
        try:
            plan = plan_payload(
                msg.payload,
                self._hash_bytes,
                self._media,
                self._honor_clears,
                self._default_group_id,
            )
        except MalformedPayload as exc:
            # The batch is lost for good (a replay returns the same bytes).
            self.malformed += 1
            self.stale = True
            self.last_error = f"seq {msg.seq}: {exc}"
            return
        except (TypeError, ValueError) as exc:
            self.apply_errors += 1
            self.stale = True
            self.last_error = f"seq {msg.seq}: {exc}"
            return
        held = pending.plan
        if held is not None and (pending.batches or not held.empty or held.skipped):
            held.merge(plan)
        else:
            pending.plan = plan  # the first batch of a drain: nothing to merge
        pending.batches += 1

    def _flush(self, pending: PendingCommit, reuse: bool = True) -> None:
        """Commit ``pending`` (O(1) under the lock, see ``commit_plan``),
        emptied for more batches unless ``reuse`` is False (the caller drops
        it).

        Also publishes ``next_seq`` as committed, for :meth:`wait_for_seq`.
        """
        plan = pending.plan
        if plan is not None and (pending.batches or not plan.empty or plan.skipped):
            try:
                stats = commit_plan(self.index, plan, self.lock, sync=True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory
                self.apply_errors += 1
                self.stale = True
                self.last_error = f"commit failed: {exc!r}"
                stats = None
            if stats is not None:
                self.batches_applied += pending.batches
                self.events_applied += stats.events
                self.events_skipped += stats.skipped
                self.keys_added += stats.keys_added
                self.keys_removed += stats.keys_removed
                self.commits += 1
                if self.on_commit is not None:
                    self.on_commit(stats)
        if reuse:
            pending.plan, pending.batches = None, 0
        # The seq, then the waiters (wait_for_seq counts itself, then reads
        # the seq): the lock is taken only when someone waits.
        self.committed_seq = self.next_seq
        if self._seq_waiters:
            with self._progress:
                self._progress.notify_all()

    def _replay(self, start: int, stop: int | None) -> list[StreamMsg] | None:
        """Batches ``start..stop-1`` from the replay endpoint (see
        :func:`~kvhit.bindings.event_stream.request_replay`), counted."""
        self.replays_requested += 1
        return request_replay(
            self._ctx,
            self.replay_endpoint,
            start,
            stop,
            self.replay_timeout_s,
            self._stop,
            functools.partial(self._parse, live=False),
        )

    def _verified_replay(self, stop: int | None) -> list[StreamMsg] | None:
        """Replay from ``next_seq`` (to ``stop``), proving continuity.

        The request starts one batch early, at the last batch applied: the
        publisher must answer it with the same bytes, or it is not the
        publisher whose batches are in the index (raises :class:`PublisherRestart`).
        Returns the batches from ``next_seq`` on, or None on no answer.
        """
        assert self.next_seq is not None
        anchor_seq = self.next_seq - 1
        anchor = self._recent.get(anchor_seq)
        start = anchor_seq if anchor is not None else self.next_seq
        msgs = self._replay(start, stop)
        if msgs is None or anchor is None:
            return msgs
        if not msgs or msgs[0].seq != anchor_seq or msgs[0].payload != anchor:
            raise PublisherRestart(
                f"the replay does not continue the stream at seq {anchor_seq}"
            )
        return msgs[1:]

    def _catch_up(self, why: str, must_verify: bool = False) -> str:
        """Fill what is missing before the reorder buffer (or, with nothing
        held, after ``next_seq``) from the replay endpoint, in order.

        The replay is the authority on what the publisher sent: it is read
        after the publisher buffered every batch it sent, and its first batch
        proves it continues our stream (``_verified_replay``). So a held live
        batch that differs from the replay's, or lies beyond the publisher's
        last batch, is a straggler from a publisher already replaced: it is
        dropped (``foreign``), never applied.

        ``must_verify``: no answer marks the index stale (after a
        reconnection, silence cannot tell a restart from a blip; batches
        held across a rebuild may be the old publisher's).

        Returns ``"verified"`` (the replay answered and continues the
        stream), ``"restart"`` (it did not: handled by :meth:`_restart`) or
        ``"silent"`` (no replay endpoint, no answer, nothing to ask, or no
        batch applied to prove continuity with).
        """
        if self.next_seq is None:
            return "silent"
        held = bool(self._ahead)
        stop = max(self._ahead) + 1 if held else None
        if held:
            self.gaps_detected += 1
        # Without the last batch applied there is nothing to prove with.
        anchored = self._recent.get(self.next_seq - 1) is not None
        msgs = None
        if self.replay_endpoint is not None:
            try:
                msgs = self._verified_replay(stop)
            except PublisherRestart as exc:
                self._restart(f"{why}: {exc}")
                return "restart"
        # No answer, where one was needed: after a reconnection, or for
        # batches held across a rebuild (maybe the old publisher's: applied
        # below, unchecked). Stale from the last batch applied before them,
        # so the repair checks them.
        unverified = msgs is None and (must_verify or (held and self._suspect))
        if unverified:
            self._mark_hole()
            self.last_error = f"{why}: the replay endpoint did not answer"
        if msgs is None and not held:
            return "silent"  # a probe without an answer: nothing learned
        # The answer covers the seqs from its anchor's next on (from its
        # first batch without an anchor: a wrapped buffer starts later).
        lo = self.next_seq if anchored or not msgs else msgs[0].seq
        if msgs is not None:
            self._take_replay(msgs, lo)
        pending = PendingCommit()
        start = self.next_seq
        self._drain_ahead(pending)
        # The publisher's buffer has no holes, so one inside the answer (a
        # batch missing where the replay brought others before and after
        # it) is the transport's: a ROUTER past its send high-water mark
        # drops silently (a long replay to a slow follower). Ask again from
        # the hole, a bounded number of times.
        first = msgs[0].seq if msgs else None
        for _ in range(_REPLAY_RETRIES):
            if not (msgs and self._ahead and self.next_seq < msgs[-1].seq):
                break
            if not anchored and self.next_seq <= first:
                break  # a wrapped buffer starts past next_seq: not a loss
            self._flush(pending)
            self.replay_retries += 1
            try:
                msgs = self._verified_replay(stop)
            except PublisherRestart as exc:
                self._restart(f"{why}: {exc}")
                return "restart"
            if msgs is not None:
                self._take_replay(msgs, self.next_seq)  # anchored: see above
                self._drain_ahead(pending)
        if self._ahead:
            # A hole the replay could not fill: go on, stale, from what we have.
            if not held:
                self.gaps_detected += 1
            self.gaps_unrecovered += 1
            self._mark_hole()
            self.last_error = (
                f"gap {self.next_seq}..{min(self._ahead) - 1} not covered by replay"
                if msgs is not None
                else f"replay for {start}.. timed out or unavailable"
            )
            while self._ahead:
                self.next_seq = min(self._ahead)
                self._drain_ahead(pending)
        elif held and not unverified:
            self.gaps_recovered += 1
        self._flush(pending)
        return "verified" if msgs is not None and anchored else "silent"

    def _take_replay(self, msgs: list[StreamMsg], lo: int) -> None:
        """Put a replay's batches (in seq order) in the reorder buffer: the
        replay's batch wins over a live one that differs (``foreign``), and a
        held batch past the publisher's last is a straggler (``foreign``).
        The answer covers ``lo`` (its anchor's next, or its first batch) to
        its last batch."""
        # The publisher's buffer is contiguous: nothing after its last batch
        # (or after our anchor, when it has nothing newer) exists.
        last = msgs[-1].seq if msgs else self.next_seq - 1
        for seq in [s for s in self._ahead if s > last]:
            del self._ahead[seq]
            self.foreign += 1
        # A held batch inside the answer's range that the answer lacks (lost
        # on the way) is unchecked, and may be a straggler (found by review:
        # one was applied as the new publisher's): dropped, so the hole is
        # asked for again.
        answered = {m.seq for m in msgs}
        for seq in [s for s in self._ahead if lo <= s and s not in answered]:
            del self._ahead[seq]
        for m in msgs:
            live = self._ahead.get(m.seq)
            if live is not None and live.payload != m.payload:
                self.foreign += 1  # the replay's batch replaces it below
            elif live is not None:
                self._suspect = False  # a live batch of this publisher
            if m.seq >= self.next_seq:
                self._ahead[m.seq] = m

    def _whole_life(self) -> tuple[list[StreamMsg] | None, bool]:
        """``(msgs, wrapped)``: the publisher's replay from seq 0 when it
        holds every batch since, else None (no endpoint, no answer, or an
        answer starting past seq 0: ``wrapped``). An answer with a hole
        inside (lost on the way) is asked again, ``_REPLAY_RETRIES`` times
        at most."""
        for ask in range(1 + _REPLAY_RETRIES if self.replay_endpoint else 0):
            if ask:
                self.replay_retries += 1
            msgs = self._replay(0, None)
            if msgs is None or (msgs and msgs[0].seq != 0):
                return None, msgs is not None
            if unbroken(msgs, 0):
                return msgs, False
        return None, False

    def _rebuild(self, msgs: list[StreamMsg], reason: str) -> None:
        """The index becomes the state of the publisher whose whole life is
        ``msgs`` (its replay from seq 0): cleared and refilled in one
        commit. A stale index stays so until that commit: readers see the
        old state as stale."""
        self._recent.forget()
        self.next_seq = 0
        errors = self.malformed + self.apply_errors
        pending = PendingCommit(EventPlan(clear=True))
        for m in msgs:
            self._absorb(pending, m)
        # Held live batches may be the old publisher's (held for a reorder
        # when it was replaced): drop them all. The new publisher's come back
        # through the next gap's replay.
        self.foreign += len(self._ahead)
        self._ahead.clear()
        self._ahead_since = None
        self._suspect = True
        self._flush(pending)
        if self.malformed + self.apply_errors == errors:
            self.stale = False
        self.rebuilds += 1
        self.last_error = f"{reason}; index rebuilt"

    def _restart(self, reason: str) -> None:
        """The stream now comes from a new publisher: rebuild or go stale."""
        self.publisher_restarts += 1
        self._verified_until = -math.inf  # what was proved was the old stream
        msgs, _ = self._whole_life()
        if msgs is not None:
            self._rebuild(msgs, f"publisher restarted ({reason})")
            return
        self._recent.forget()
        self.stale = True
        self._schedule_repair((_REBUILD, b""))  # it may answer later
        self.last_error = (
            f"publisher restarted ({reason}); its replay did not bring every "
            "batch from seq 0 (its buffer wrapped, or no answer), so the index "
            "cannot be rebuilt yet"
        )
        # Go on, stale, with the new stream: held live batches first, else
        # adopt whatever comes next.
        self.next_seq = min(self._ahead) if self._ahead else None
        pending = PendingCommit()
        if self._ahead:
            self._drain_ahead(pending)
            self._ahead.clear()
            self._ahead_since = None
        self._flush(pending)
