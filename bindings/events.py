"""Follow vLLM 0.33.0 KV-cache events into a :class:`~kvhit.KeyIndex`.

vLLM publishes what enters and leaves its KV caches (GPU block pool, host
pools, the Mooncake store connector) through ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py``). This module decodes that stream with its
own msgspec structs (no vLLM import) and keeps a KeyIndex equal to the set of
``(group_id, block_hash)`` keys the chosen tier holds.

Wire format (vLLM 0.33.0, read from the source):

- PUB socket, multipart ``(topic, seq, payload)``: ``topic`` the configured
  UTF-8 topic (default ``""``), ``seq`` an 8-byte big-endian unsigned counter
  starting at 0 per publisher process, ``payload`` a msgpack ``KVEventBatch``.
- ``KVEventBatch`` is ``array_like``: ``[ts, events]`` or
  ``[ts, events, data_parallel_rank]`` (``omit_defaults``). Each event is a
  msgpack *map* tagged ``{"type": "BlockStored" | "BlockRemoved" |
  "AllBlocksCleared", ...}`` with default-valued optional fields omitted.
- Block hashes are ``bytes`` or ``int``: with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
  set (**the default, 1**) ``maybe_convert_block_hash`` publishes
  ``int.from_bytes(hash, "big") & (2**64 - 1)``, i.e. only the *last 8 bytes*
  of the hash read big-endian. That is invertible only for hashes of at most 8
  bytes (``int.to_bytes(width, "big")``); a 16- or 32-byte index cannot be
  keyed from it without fingerprint matching, which kvhit forbids, so
  :func:`apply` raises ``ValueError`` and vLLM must run with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` to publish full hashes.
- ``medium``: ``"GPU"`` (block pool), ``"CPU"`` (host pools), and the Mooncake
  store connector publishes ``"cpu"`` (lower case, ``store/worker.py``) for
  the external store. Matching is exact, so ``medium="cpu"`` follows the store
  and not the host pools. The store connector emits only ``BlockStored`` in
  0.33.0: store evictions are *not* published.
- ``AllBlocksCleared`` carries no medium; in 0.33.0 only block pools emit it
  (``reset_prefix_cache``). Honouring it can only lose hits, never invent them,
  so it clears by default (``honor_clears=False`` keeps a store index across
  GPU prefix-cache resets).
- Replay: a ROUTER socket. The client sends ``[b"", start_seq]`` (8-byte
  big-endian) from a DEALER (a REQ socket would accept only the first of the
  many replies); the ROUTER answers ``[b"", topic, seq, payload]`` for every
  buffered batch with ``seq >= start_seq`` (the last ``buffer_steps``, 10 000
  by default), then the end marker ``[b"", b"", (-1).to_bytes(8, signed),
  b""]``. There is no heartbeat, so a lost *last* batch is only noticed at the
  next batch or by an idle probe (``idle_probe_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

try:
    import msgspec
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvhit.bindings.events needs msgspec (and pyzmq for EventFollower): "
        "pip install 'kvhit[events]'"
    ) from exc

import torch

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_MOONCAKE_STORE",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "ApplyStats",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventFollower",
    "KVCacheEvent",
    "KVEventBatch",
    "MalformedPayload",
    "apply",
    "decode_batch",
    "encode_batch",
    "hash_to_bytes",
]

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
#: What vLLM 0.33.0's Mooncake store connector puts in ``BlockStored.medium``.
MEDIUM_MOONCAKE_STORE = "cpu"

#: Sequence frame of the replay end marker (``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# vLLM's ExternalBlockHash: sha256/xxhash digest bytes, or the int form.
ExternalBlockHash = bytes | int


# --- event structs: field names, order, types and options mirror vLLM 0.33.0
# exactly, so decode(payload) re-encodes to the same bytes (tested).


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events as published; ``array_like`` = a msgpack array."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the event union; the tag is ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    """Blocks now cached in ``medium``; one key per hash in ``block_hashes``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached in ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher's prefix cache was dropped."""


class KVEventBatch(EventBatch):
    """The payload type of every PUB message and replay reply."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class MalformedPayload(ValueError):
    """A payload that is not a vLLM 0.33.0 ``KVEventBatch``."""


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode one payload; raises :class:`MalformedPayload` on any defect."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedPayload(f"not a KVEventBatch: {exc}") from None


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch exactly as vLLM's publisher does (for tests and tools)."""
    return _ENCODER.encode(batch)


def hash_to_bytes(block_hash: ExternalBlockHash, hash_bytes: int) -> bytes:
    """Turn a published block hash into the index's ``hash_bytes``-wide key.

    ``bytes`` must already have the width. An ``int`` is vLLM's
    ``int.from_bytes(hash, "big") & (2**64 - 1)``: the last 8 bytes of the
    hash, so it is inverted with ``to_bytes(hash_bytes, "big")`` when
    ``hash_bytes <= 8`` and is a ``ValueError`` otherwise (the other bytes are
    gone, and matching on a 64-bit fingerprint could load the wrong KV).
    """
    if isinstance(block_hash, bytes | bytearray | memoryview):
        block_hash = bytes(block_hash)
        if len(block_hash) != hash_bytes:
            raise ValueError(
                f"block hash has {len(block_hash)} bytes, index expects "
                f"hash_bytes={hash_bytes}"
            )
        return block_hash
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        if hash_bytes > 8:
            raise ValueError(
                f"int block hash {block_hash:#x} is the low 64 bits of the hash "
                f"(vLLM VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default); it "
                f"cannot be widened to hash_bytes={hash_bytes}. Run vLLM with "
                f"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 to publish full hashes."
            )
        if block_hash < 0:
            raise ValueError(f"int block hash {block_hash} is negative")
        try:
            return block_hash.to_bytes(hash_bytes, "big")
        except OverflowError:
            raise ValueError(
                f"int block hash {block_hash:#x} does not fit hash_bytes={hash_bytes}"
            ) from None
    raise ValueError(f"block hash of type {type(block_hash).__name__}")


# --- planning: a run of events reduced to its net effect on a set.


@dataclass
class _Plan:
    """Net effect of events applied in order to a set of keys.

    For a set, the state of a key after a sequence of adds/removes is decided by
    the last of them, and a clear erases everything before it. So any run of
    events is exactly: optionally clear, then remove the keys whose last event
    is a remove, then add the keys whose last event is an add. The two key sets
    are disjoint, so the KeyIndex sees at most three calls however the events
    interleave, and an add then remove of one key ends removed.
    """

    clear: bool = False
    ops: dict[tuple[int, bytes], bool] = field(default_factory=dict)  # True = add
    events: int = 0  # events that passed the filter
    skipped: int = 0  # events filtered out (medium, or ignored clears)

    def merge(self, later: _Plan) -> None:
        """Append ``later`` (which happened after ``self``)."""
        if later.clear:
            self.clear = True
            self.ops = later.ops
        else:
            self.ops.update(later.ops)  # later ops win, as in sequence
        self.events += later.events
        self.skipped += later.skipped


def _media(medium: str | Collection[str] | None) -> frozenset[str] | None:
    if medium is None:
        return None
    if isinstance(medium, str):
        return frozenset((medium,))
    return frozenset(medium)


def _plan(
    events: Iterable[KVCacheEvent],
    hash_bytes: int,
    media: frozenset[str] | None,
    honor_clears: bool,
    default_group_id: int,
) -> _Plan:
    """Reduce ``events`` to a :class:`_Plan`; raises ValueError before any change."""
    plan = _Plan()
    ops = plan.ops
    for ev in events:
        kind = type(ev)
        if kind is BlockStored or kind is BlockRemoved:
            if media is not None and ev.medium not in media:
                plan.skipped += 1
                continue
            # Events without group_idx come from single-group publishers.
            gid = default_group_id if ev.group_idx is None else ev.group_idx
            if gid < 0:  # KeyIndex reserves negative ids as slot sentinels
                raise ValueError(f"negative group_idx {gid}")
            op = kind is BlockStored
            for h in ev.block_hashes:
                # Fast path: vLLM's bytes hashes are already keys.
                if type(h) is not bytes or len(h) != hash_bytes:
                    h = hash_to_bytes(h, hash_bytes)
                ops[(gid, h)] = op
            plan.events += 1
        elif kind is AllBlocksCleared:
            if honor_clears:
                plan.clear = True
                ops.clear()
                plan.events += 1
            else:
                plan.skipped += 1
        else:
            raise ValueError(f"not a KV cache event: {kind.__name__}")
    return plan


@dataclass
class ApplyStats:
    """What one :func:`apply` (or one follower commit) did."""

    events: int = 0
    skipped: int = 0
    keys_added: int = 0
    keys_removed: int = 0
    cleared: bool = False


def _index_hash_bytes(index: Any) -> int:
    hb = getattr(index, "hash_bytes", None)
    if not isinstance(hb, int):
        raise TypeError("index must expose an int `hash_bytes` (a kvhit KeyIndex)")
    return hb


def _commit(index: Any, plan: _Plan) -> ApplyStats:
    """Apply a plan with at most one clear, one remove and one add call."""
    device = getattr(index, "device", "cpu")
    if plan.clear:
        index.clear()
    removes = [k for k, add in plan.ops.items() if not add]
    adds = [k for k, add in plan.ops.items() if add]
    # Removes first: the index never needs room for keys about to leave.
    for keys, call in ((removes, index.remove), (adds, index.add)):
        if keys:
            gids, hashes = zip(*keys, strict=True)
            call(torch.tensor(gids, dtype=torch.int64, device=device), list(hashes))
    return ApplyStats(plan.events, plan.skipped, len(adds), len(removes), plan.clear)


def apply(
    index: Any,
    events: Iterable[KVCacheEvent] | KVEventBatch,
    medium: str | Collection[str] | None = None,
    *,
    honor_clears: bool = True,
    default_group_id: int = 0,
) -> ApplyStats:
    """Apply events, in order, to ``index`` (a KeyIndex or the same API).

    Stores add ``(group_idx, hash)`` keys, removes remove them, clears clear.
    ``medium`` keeps only events of that tier (a string or a collection; exact
    match, ``None`` = all). ``group_idx=None`` maps to ``default_group_id``.
    The events are first reduced to their net effect (see ``_Plan``) so the
    index gets at most one clear, one remove and one add call. A hash that
    cannot become a key (wrong width, int form on a >8-byte index) raises
    ``ValueError`` before the index is touched.
    """
    if isinstance(events, EventBatch):
        events = events.events
    plan = _plan(
        events, _index_hash_bytes(index), _media(medium), honor_clears, default_group_id
    )
    return _commit(index, plan)


# --- the follower.


@dataclass
class _Msg:
    seq: int
    payload: bytes


class EventFollower:
    """Subscribe to a vLLM ``ZmqEventPublisher`` and keep ``index`` current.

    A daemon thread reads the PUB stream, applies batches in sequence order and
    repairs gaps through the replay endpoint before applying anything newer.
    Messages already queued are drained together (up to ``max_drain``) and
    committed as one plan, so a GPU index sees a few large updates rather than
    one per event.

    **Locking.** The index is only mutated while holding :attr:`lock` (an
    ``RLock``, or the one passed in). A reader that must not see a half-applied
    commit (e.g. between the remove and the add call) takes it around its
    lookups::

        with follower.lock:
            hits = engine.lookup(batch, num_tokens, index)

    Decoding and replay happen outside the lock; the lock is held for the
    index calls only (plus a stream sync on CUDA, so kernels queued on another
    stream see the committed table).

    **Staleness.** :attr:`stale` becomes True when the index may differ from
    the publisher's state: a gap replay could not cover (``gaps_unrecovered``),
    a payload that did not decode (``malformed``), a batch that could not be
    applied (``apply_errors``), or a publisher restart (sequence went back).
    The flag stays set until :meth:`clear_stale`; a scheduler should then stop
    trusting hits (treat as misses) or rebuild the index. Errors never stop the
    thread.

    ``start_seq``: the first sequence expected (0: everything since the
    publisher started, replayed at start-up if a replay endpoint is given);
    ``None`` adopts whatever arrives first (an index seeded elsewhere).
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
    ) -> None:
        import zmq  # imported here so apply() works without pyzmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.topic = topic
        self._topic_bytes = topic.encode("utf-8")
        self._media = _media(medium)
        self._honor_clears = honor_clears
        self._default_group_id = default_group_id
        self._hash_bytes = _index_hash_bytes(index)
        self.lock = lock if lock is not None else threading.RLock()
        self.replay_timeout_s = replay_timeout_s
        self.idle_probe_s = idle_probe_s
        self.max_drain = max_drain
        self.rcvhwm = rcvhwm
        self.poll_ms = poll_ms
        self.on_commit = on_commit
        self._cuda = torch.device(getattr(index, "device", "cpu")).type == "cuda"

        # Sequence state (follower thread only).
        self.next_seq: int | None = start_seq
        #: Sequence after the last batch whose effects are in the index.
        self.committed_seq: int | None = None
        self._last_live_seq: int | None = None

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
        self.ignored_topic = 0
        self.gaps_detected = 0
        self.gaps_recovered = 0
        self.gaps_unrecovered = 0
        self.replays_requested = 0
        self.publisher_restarts = 0
        self.apply_errors = 0
        self.last_error: str | None = None

        self._ctx: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._progress = threading.Condition()

    # -- lifecycle

    def start(self, timeout_s: float = 5.0) -> EventFollower:
        """Start the thread; returns once its SUB socket is connected."""
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- reader helpers

    def clear_stale(self) -> None:
        """Declare the index trustworthy again (e.g. after rebuilding it)."""
        self.stale = False

    def counters(self) -> dict[str, Any]:
        """A snapshot of the counters, for metrics."""
        names = (
            "stale next_seq committed_seq batches_applied events_applied events_skipped "
            "keys_added keys_removed commits malformed duplicates ignored_topic "
            "gaps_detected gaps_recovered gaps_unrecovered replays_requested "
            "publisher_restarts apply_errors last_error"
        ).split()
        return {n: getattr(self, n) for n in names}

    def wait_for_seq(self, seq: int, timeout_s: float) -> bool:
        """Block until batch ``seq`` has been applied (or skipped); bounded."""
        deadline = time.monotonic() + timeout_s
        with self._progress:
            while self.committed_seq is None or self.committed_seq <= seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._progress.wait(left)
        return True

    # -- the thread

    def _run(self) -> None:
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        try:
            try:
                sub.setsockopt(zmq.LINGER, 0)
                # Bounded memory if we fall behind; what ZMQ then drops shows up
                # as a sequence gap and is replayed.
                sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
                sub.setsockopt(zmq.SUBSCRIBE, self._topic_bytes)
                sub.connect(self.endpoint)
            except zmq.ZMQError as exc:
                self.last_error = f"cannot connect to {self.endpoint}: {exc}"
                return
            self._ready.set()
            if self.next_seq is not None and self.replay_endpoint is not None:
                self._safely(self._probe)  # catch up on what was published before
            last_msg = time.monotonic()
            while not self._stop.is_set():
                if not sub.poll(self.poll_ms):
                    idle = self.idle_probe_s
                    if (
                        idle is not None
                        and self.replay_endpoint is not None
                        and self.next_seq is not None
                        and time.monotonic() - last_msg >= idle
                    ):
                        self._safely(self._probe)
                        last_msg = time.monotonic()
                    continue
                last_msg = time.monotonic()
                frames_list = []
                for _ in range(self.max_drain):
                    try:
                        frames_list.append(sub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                self._safely(self._handle_live, frames_list)
        finally:
            self._ready.set()
            sub.close(linger=0)

    def _safely(self, fn: Callable[..., None], *args: Any) -> None:
        """Run one step; an unexpected error is counted, never fatal."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the thread must survive
            logger.exception("event follower step failed")
            self.apply_errors += 1
            self.stale = True
            self.last_error = repr(exc)

    def _parse(self, frames: list[bytes], live: bool) -> _Msg | None:
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
        return _Msg(int.from_bytes(seq_b, "big"), payload)

    def _handle_live(self, frames_list: list[list[bytes]]) -> None:
        pending = _Plan()
        batches = 0
        for frames in frames_list:
            msg = self._parse(frames, live=True)
            if msg is None:
                continue
            seq = msg.seq
            if self._last_live_seq is not None and seq <= self._last_live_seq:
                # The live stream of one publisher only goes up: it restarted
                # (and what it did before dying may never have been published).
                self.publisher_restarts += 1
                self.stale = True
                self.last_error = f"publisher restarted at seq {seq}"
                batches = self._flush(pending, batches)
                pending = _Plan()
                self.next_seq = seq
            self._last_live_seq = seq
            if self.next_seq is None:
                self.next_seq = seq
            if seq < self.next_seq:
                self.duplicates += 1  # already applied through a replay
                continue
            if seq > self.next_seq:
                # Apply everything older first: order is the whole point.
                batches = self._flush(pending, batches)
                pending = _Plan()
                self.gaps_detected += 1
                self._repair(self.next_seq, seq)
            batches += self._absorb(pending, msg)
        self._flush(pending, batches)

    def _absorb(self, pending: _Plan, msg: _Msg) -> int:
        """Decode one in-order batch into ``pending``; 1 if it counted as a batch."""
        self.next_seq = msg.seq + 1
        try:
            batch = decode_batch(msg.payload)
        except MalformedPayload as exc:
            # The batch is lost for good (a replay returns the same bytes).
            self.malformed += 1
            self.stale = True
            self.last_error = f"seq {msg.seq}: {exc}"
            return 0
        try:
            plan = _plan(
                batch.events,
                self._hash_bytes,
                self._media,
                self._honor_clears,
                self._default_group_id,
            )
        except ValueError as exc:
            self.apply_errors += 1
            self.stale = True
            self.last_error = f"seq {msg.seq}: {exc}"
            return 0
        pending.merge(plan)
        return 1

    def _flush(self, pending: _Plan, batches: int) -> int:
        """Commit ``pending`` under the lock; returns 0 (the new batch count).

        Also publishes ``next_seq`` as committed, for :meth:`wait_for_seq`.
        """
        if batches or pending.clear or pending.ops or pending.skipped:
            with self.lock:
                try:
                    stats = _commit(self.index, pending)
                    if self._cuda:
                        torch.cuda.current_stream(self.index.device).synchronize()
                except Exception as exc:  # noqa: BLE001 - e.g. index full
                    self.apply_errors += 1
                    self.stale = True
                    self.last_error = f"commit failed: {exc!r}"
                    stats = None
            if stats is not None:
                self.batches_applied += batches
                self.events_applied += stats.events
                self.events_skipped += stats.skipped
                self.keys_added += stats.keys_added
                self.keys_removed += stats.keys_removed
                self.commits += 1
                if self.on_commit is not None:
                    self.on_commit(stats)
        with self._progress:
            self.committed_seq = self.next_seq
            self._progress.notify_all()
        return 0

    def _replay(self, start: int, stop: int | None) -> list[_Msg] | None:
        """Ask the ROUTER for batches ``start..stop-1`` (all if ``stop`` is None).

        Returns the in-range messages received, or None if the end marker did
        not arrive in time. A fresh DEALER per request keeps a late answer to
        an abandoned request from being read as the answer to this one.
        """
        zmq = self._zmq
        self.replays_requested += 1
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[_Msg] = []
            deadline = time.monotonic() + self.replay_timeout_s
            while not self._stop.is_set():
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not dealer.poll(min(left_ms, 100)):
                    if left_ms <= 0:
                        return None
                    continue
                frames = dealer.recv_multipart()
                if len(frames) == 4 and frames[2] == END_SEQ:
                    return out
                msg = self._parse(frames, live=False)
                if msg is None or msg.seq < start:
                    continue
                if stop is not None and msg.seq >= stop:
                    return out  # the rest will come (or came) live
                out.append(msg)
            return None
        finally:
            dealer.close(linger=0)

    def _repair(self, start: int, stop: int) -> None:
        """Fill the gap ``start..stop-1`` from the replay endpoint, in order."""
        msgs = self._replay(start, stop) if self.replay_endpoint else None
        complete = False
        if msgs is not None:
            complete = self._apply_replayed(msgs, start) and self.next_seq == stop
        if complete:
            self.gaps_recovered += 1
        else:
            self.gaps_unrecovered += 1
            self.stale = True
            self.last_error = (
                f"gap {self.next_seq}..{stop - 1} not covered by replay"
                if msgs is not None
                else f"replay for {start}..{stop - 1} timed out or unavailable"
            )
            self.next_seq = stop  # go on from the live stream

    def _probe(self) -> None:
        """Replay from ``next_seq`` to catch up when no live batch shows a gap."""
        start = self.next_seq
        assert start is not None
        msgs = self._replay(start, None)
        if msgs is None:
            return  # no answer: nothing learned, the live stream still rules
        if not self._apply_replayed(msgs, start):
            # The publisher's buffer no longer reaches back to ``start``.
            self.gaps_detected += 1
            self.gaps_unrecovered += 1
            self.stale = True
            self.last_error = f"batches from {start} no longer all in the replay buffer"

    def _apply_replayed(self, msgs: list[_Msg], start: int) -> bool:
        """Apply replayed messages in order from ``start``; False if any is missing.

        Batches after a hole are still applied: the index is stale either way,
        and newer state is the better approximation.
        """
        pending = _Plan()
        batches = 0
        expected = start
        complete = True
        for msg in sorted(msgs, key=lambda m: m.seq):
            if msg.seq < expected:
                continue
            if msg.seq > expected:
                complete = False
            batches += self._absorb(pending, msg)
            expected = msg.seq + 1
        self._flush(pending, batches)
        return complete
