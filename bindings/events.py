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
  next batch or by an idle probe (``idle_probe_s``). The follower asks from
  the last batch it applied, which must come back byte for byte (batches
  carry their creation time, so a restarted publisher's batch of the same seq
  differs): that is how a restart is told from a gap.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
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

from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import pack_hashes

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
    raise TypeError(f"block hash must be bytes or int, got {type(block_hash).__name__}")


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


_INT64_LIMIT = 1 << 63


def _media(
    medium: str | Collection[str] | None, name: str = "medium"
) -> frozenset[str] | None:
    """``medium`` as a set of tier names; TypeError naming ``name`` otherwise."""
    if medium is None:
        return None
    if isinstance(medium, str):
        return frozenset((medium,))
    if isinstance(medium, bytes | bytearray) or not isinstance(medium, Iterable):
        raise TypeError(
            f"{name} must be None, a str or a collection of str, got "
            f"{type(medium).__name__}"
        )
    media = tuple(medium)
    for pos, m in enumerate(media):
        if not isinstance(m, str):
            raise TypeError(
                f"{name}, position {pos}: must be a str, got {type(m).__name__}"
            )
    return frozenset(media)


def _check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi)``; TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_seconds(value: Any, name: str, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{name} must be a number of seconds, got {type(value).__name__}"
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


def _plan(
    events: Iterable[KVCacheEvent],
    hash_bytes: int,
    media: frozenset[str] | None,
    honor_clears: bool,
    default_group_id: int,
) -> _Plan:
    """Reduce ``events`` to a :class:`_Plan`, validating every field first.

    Nothing is mutated: a bad event raises TypeError/ValueError naming its
    position in ``events``, the field and (for a hash) its position in
    ``block_hashes``, so the caller applies all of a batch or none of it.
    """
    plan = _Plan()
    ops = plan.ops
    for pos, ev in enumerate(events):
        kind = type(ev)
        if kind is BlockStored or kind is BlockRemoved:
            where = f"event {pos} ({kind.__name__})"
            medium = ev.medium
            if medium is not None and not isinstance(medium, str):
                raise TypeError(
                    f"{where}: medium must be a str or None, got {type(medium).__name__}"
                )
            if media is not None and medium not in media:
                plan.skipped += 1
                continue
            # Events without group_idx come from single-group publishers.
            gid = default_group_id if ev.group_idx is None else ev.group_idx
            if isinstance(gid, bool) or not isinstance(gid, int):
                raise TypeError(
                    f"{where}: group_idx must be an int, got {type(gid).__name__}"
                )
            # KeyIndex reserves negative ids as slot sentinels; ids are int64.
            if not 0 <= gid < _INT64_LIMIT:
                raise ValueError(f"{where}: group_idx {gid} is not in [0, 2**63)")
            hashes = ev.block_hashes
            if not isinstance(hashes, list | tuple):
                raise TypeError(
                    f"{where}: block_hashes must be a list, got {type(hashes).__name__}"
                )
            op = kind is BlockStored
            for j, h in enumerate(hashes):
                # Fast path: vLLM's bytes hashes are already keys.
                if type(h) is not bytes or len(h) != hash_bytes:
                    try:
                        h = hash_to_bytes(h, hash_bytes)
                    except (TypeError, ValueError) as exc:
                        raise type(exc)(f"{where}, block_hashes[{j}]: {exc}") from None
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
            raise TypeError(
                f"events, position {pos}: not a KV cache event: {kind.__name__}"
            )
    return plan


@dataclass
class ApplyStats:
    """What one :func:`apply` (or one follower commit) changed.

    ``keys_added`` / ``keys_removed`` count keys whose presence changed (a
    store of a key already present adds nothing; a clear removes every key
    that was present), not keys named by the events.
    """

    events: int = 0
    skipped: int = 0
    keys_added: int = 0
    keys_removed: int = 0
    cleared: bool = False


def _index_hash_bytes(index: Any) -> int:
    hb = getattr(index, "hash_bytes", None)
    if isinstance(hb, bool) or not isinstance(hb, int):
        raise TypeError("index must expose an int `hash_bytes` (a kvhit KeyIndex)")
    return hb


@dataclass
class _Keys:
    """A plan's keys as the KeyIndex takes them: int64 ``[N]`` and ``[N, W]``."""

    removes: tuple[torch.Tensor, torch.Tensor] | None
    adds: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def n_adds(self) -> int:
        return 0 if self.adds is None else self.adds[0].shape[0]


def _tensors(plan: _Plan, hash_bytes: int, device: Any) -> _Keys:
    """Pack the plan's keys (validated by ``_plan``) before any mutation."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for want in (False, True):
        keys = [k for k, add in plan.ops.items() if add is want]
        if not keys:
            out.append(None)
            continue
        gids, hashes = zip(*keys, strict=True)
        out.append(
            (
                torch.tensor(gids, dtype=torch.int64, device=device),
                pack_hashes(hashes, hash_bytes).to(device),
            )
        )
    return _Keys(out[0], out[1])


def _new_keys(index: KeyIndex, plan: _Plan, keys: _Keys) -> int | None:
    """How many keys committing ``plan`` adds to ``index`` when that makes
    ``index.add`` rehash; None when the table has room.

    Mirrors the growth rule of :meth:`KeyIndex.add`: a rehash happens when
    ``live + tombstones + new keys`` exceeds ``floor(max_load * capacity)``
    (removes turn live keys into tombstones, so they do not change the sum).
    The exact count of new keys costs one probe, paid only near the limit.
    """
    if keys.adds is None:
        return None
    limit = math.floor(index.max_load * index.capacity)
    if plan.clear:
        return keys.n_adds if keys.n_adds > limit else None
    used = len(index) + index.tombstones
    if used + keys.n_adds <= limit:
        return None
    new = int((~index.contains(*keys.adds)).sum().item())
    return new if used + new > limit else None


def _grown_copy(
    index: KeyIndex, plan: _Plan, keys: _Keys, n_new: int
) -> tuple[KeyIndex, int, int]:
    """A rehashed copy of ``index`` (``KeyIndex.grown_for``) with ``plan``
    applied; ``index`` is only read. Returns (copy, keys removed, keys added).
    A fixed-capacity index refuses (CapacityError): nothing changed."""
    grown = index.grown_for(n_new)
    if plan.clear:
        grown.clear()
    removed = grown.remove(*keys.removes) if keys.removes is not None else 0
    added = grown.add(*keys.adds) if keys.adds is not None else 0
    return grown, removed, added


def _adopt(index: KeyIndex, grown: KeyIndex) -> bool:
    """Make ``index`` hold ``grown``'s table in O(1), under the caller's lock
    (``KeyIndex.adopt``: the old table is handed back in ``grown`` and freed
    when the caller drops it, after the lock); False, nothing changed, if
    ``index`` changed since ``grown`` was built (keys would be lost)."""
    try:
        index.adopt(grown)
    except ValueError:
        return False
    return True


def _commit(
    index: Any, plan: _Plan, lock: Any = None, sync: bool = False
) -> ApplyStats:
    """Apply a validated plan: at most one clear, one remove and one add.

    Everything that can fail on input (packing the keys) happens before the
    index is touched. When the adds would grow the table, the grown table is
    built *outside* ``lock`` (``index`` is only read; the caller must be its
    only writer meanwhile) and swapped in under it, so readers holding the
    lock wait O(1), not a rehash, and a failure while building (out of
    memory, a fixed-capacity index) leaves ``index`` as it was.
    """
    lock = lock if lock is not None else contextlib.nullcontext()
    device = getattr(index, "device", "cpu")
    keys = _tensors(plan, _index_hash_bytes(index), device)
    grown = None
    if isinstance(index, KeyIndex):
        n_new = _new_keys(index, plan, keys)
        if n_new is not None:
            grown = _grown_copy(index, plan, keys, n_new)
    with lock:
        cleared = len(index) if plan.clear else 0
        if grown is not None and _adopt(index, grown[0]):
            removed, added = cleared + grown[1], grown[2]
        else:  # no growth, or another writer changed the index meanwhile
            removed = added = 0
            if plan.clear:
                removed = cleared
                index.clear()
            # Removes first: the index never needs room for keys about to leave.
            if keys.removes is not None:
                removed += index.remove(*keys.removes)
            if keys.adds is not None:
                added = index.add(*keys.adds)
        if sync and torch.device(device).type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    # The old table, handed back in ``grown`` by KeyIndex.adopt, is freed
    # here, after the lock: freeing a large table takes a while.
    del grown
    return ApplyStats(plan.events, plan.skipped, added, removed, plan.clear)


def apply(
    index: Any,
    events: Iterable[KVCacheEvent] | KVEventBatch,
    medium: str | Collection[str] | None = None,
    *,
    honor_clears: bool = True,
    default_group_id: int = 0,
) -> ApplyStats:
    """Apply events, in order, to ``index`` (a KeyIndex or the same API),
    atomically: all of them or, on any error, none.

    Stores add ``(group_idx, hash)`` keys, removes remove them, clears clear.
    ``medium`` keeps only events of that tier (a string or a collection; exact
    match, ``None`` = all). ``group_idx=None`` maps to ``default_group_id``.
    The whole batch is validated and reduced to its net effect (see
    ``_Plan``) before the index is touched; it then gets at most one clear,
    one remove and one add call. A bad argument or event (wrong hash width,
    int hash on a >8-byte index, a group id outside ``[0, 2**63)``, a
    non-string medium) raises ``TypeError``/``ValueError`` naming the event's
    position and field, and leaves the index exactly as it was.
    """
    hash_bytes = _index_hash_bytes(index)
    media = _media(medium)
    _check_bool(honor_clears, "honor_clears")
    _check_int(default_group_id, "default_group_id", 0, _INT64_LIMIT)
    if isinstance(events, EventBatch):
        events = events.events
    if isinstance(events, KVCacheEvent) or not isinstance(events, Iterable):
        raise TypeError(
            "events must be a KVEventBatch or an iterable of KV cache events, "
            f"got {type(events).__name__}"
        )
    plan = _plan(events, hash_bytes, media, honor_clears, default_group_id)
    return _commit(index, plan)


# --- the follower.

#: How many applied batches' digests the follower remembers, to tell an exact
#: duplicate (dropped) from a batch of a restarted publisher (same seq, other
#: bytes: every vLLM batch carries its creation time).
_RECENT = 16_384


@dataclass
class _Msg:
    seq: int
    payload: bytes
    _digest: bytes | None = None

    def digest(self) -> bytes:
        if self._digest is None:
            self._digest = hashlib.blake2b(self.payload, digest_size=16).digest()
        return self._digest


@dataclass
class _Pending:
    """Batches decoded in order but not yet committed."""

    plan: _Plan = field(default_factory=_Plan)
    batches: int = 0


class _Restart(Exception):
    """Raised inside the follower when the stream belongs to a new publisher."""


class EventFollower:
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
    a digest of its bytes:

    - an exact duplicate (same seq, same bytes) is dropped silently;
    - a batch ahead of the next expected one is held in a reorder buffer
      (``reorder_window`` batches, ``reorder_wait_s``); if the missing ones
      arrive they are applied in order, otherwise the gap is repaired from
      the replay endpoint, or the index marked stale;
    - a replay must start with the last batch applied, byte for byte, so a
      new publisher is never taken for the old one with a gap;
    - a publisher restart (a seq already applied with other bytes, a replay
      that does not continue the stream, or a reconnection of the SUB socket
      seen through pyzmq's socket monitor) makes the follower rebuild the
      index from the new publisher's replay buffer when that reaches back to
      its first batch (seq 0): cleared and refilled in one commit, equal to
      the new publisher's state. Otherwise (no replay endpoint, buffer
      wrapped) the index is marked stale.

    **Staleness.** :attr:`stale` becomes True when the index may differ from
    the publisher's state: a gap replay could not cover (``gaps_unrecovered``),
    a payload that did not decode (``malformed``), a batch that could not be
    applied (``apply_errors``), or a restart that could not be rebuilt. The
    flag stays set until :meth:`clear_stale` (or a successful rebuild); a
    stale index must not serve hits (:meth:`lookup` enforces it). Errors
    never stop the thread.

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
        media = _media(medium)
        _check_bool(honor_clears, "honor_clears")
        _check_int(default_group_id, "default_group_id", 0, _INT64_LIMIT)
        if start_seq is not None:
            _check_int(start_seq, "start_seq", 0, 1 << 64)
        if lock is not None and not (
            callable(getattr(lock, "__enter__", None))
            and callable(getattr(lock, "__exit__", None))
        ):
            raise TypeError(
                f"lock must be a lock (a context manager), got {type(lock).__name__}"
            )
        _check_seconds(replay_timeout_s, "replay_timeout_s")
        _check_seconds(idle_probe_s, "idle_probe_s", optional=True)
        _check_int(max_drain, "max_drain", 1)
        _check_int(rcvhwm, "rcvhwm", 0, 1 << 31)  # ZMQ: 0 = no limit
        # poll_ms bounds how fast stop() returns (its default timeout is 5 s);
        # 0 would spin, < 0 block forever.
        _check_int(poll_ms, "poll_ms", 1, 1001)
        if on_commit is not None and not callable(on_commit):
            raise TypeError(
                f"on_commit must be callable, got {type(on_commit).__name__}"
            )
        _check_int(reorder_window, "reorder_window", 0)
        if isinstance(reorder_wait_s, bool) or not isinstance(
            reorder_wait_s, int | float
        ):
            raise TypeError(
                f"reorder_wait_s must be a number, got {type(reorder_wait_s).__name__}"
            )
        if not (0 <= reorder_wait_s and math.isfinite(reorder_wait_s)):
            raise ValueError(
                f"reorder_wait_s must be >= 0 and finite, got {reorder_wait_s}"
            )
        self._hash_bytes = _index_hash_bytes(index)

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
        self.replay_timeout_s = float(replay_timeout_s)
        self.idle_probe_s = idle_probe_s
        self.max_drain = max_drain
        self.rcvhwm = rcvhwm
        self.poll_ms = poll_ms
        self.on_commit = on_commit
        self.reorder_window = reorder_window
        self.reorder_wait_s = float(reorder_wait_s)

        # Sequence state (follower thread only).
        self._start_seq = start_seq
        self.next_seq: int | None = start_seq
        #: Sequence after the last batch whose effects are in the index.
        self.committed_seq: int | None = None
        self._recent: OrderedDict[int, bytes] = OrderedDict()  # seq -> digest
        self._ahead: dict[int, _Msg] = {}  # the reorder buffer
        self._ahead_since: float | None = None
        self._disconnected = False

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
        self.replays_requested = 0
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

    # -- lifecycle

    def start(self, timeout_s: float = 5.0) -> EventFollower:
        """Start the thread; returns once its SUB socket is connected."""
        _check_seconds(timeout_s, "timeout_s")
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
        _check_seconds(timeout_s, "timeout_s")
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
            "stale next_seq committed_seq batches_applied events_applied events_skipped "
            "keys_added keys_removed commits malformed duplicates reordered foreign "
            "ignored_topic gaps_detected gaps_recovered gaps_unrecovered "
            "replays_requested publisher_restarts rebuilds disconnects reconnects "
            "apply_errors last_error"
        ).split()
        return {n: getattr(self, n) for n in names}

    def wait_for_seq(self, seq: int, timeout_s: float) -> bool:
        """Block until batch ``seq`` has been applied (or skipped); bounded."""
        _check_int(seq, "seq", -1)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise TypeError(
                f"timeout_s must be a number, got {type(timeout_s).__name__}"
            )
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
            last_msg = time.monotonic()
            while not self._stop.is_set():
                timeout = self.poll_ms
                if self._ahead_since is not None:
                    left = self._ahead_since + self.reorder_wait_s - time.monotonic()
                    timeout = max(0, min(timeout, math.ceil(left * 1000)))
                ready = dict(poller.poll(timeout))
                if monitor in ready:
                    self._safely(self._on_monitor, monitor, sub)
                if sub in ready:
                    last_msg = time.monotonic()
                    self._safely(self._handle_live, self._drain(sub, self.max_drain))
                if self._ahead_since is not None and (
                    time.monotonic() >= self._ahead_since + self.reorder_wait_s
                    or len(self._ahead) > self.reorder_window
                ):
                    since = self._ahead_since
                    self._safely(self._catch_up, "gap")
                    if self._ahead and self._ahead_since == since:
                        # The repair failed (counted, stale): never spin on it.
                        self._ahead.clear()
                        self._ahead_since = None
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

    def _on_monitor(self, monitor: Any, sub: Any) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                # Whatever is queued came over the old connection: apply it
                # before anything the next connection brings.
                self._handle_live(self._drain(sub, None))
                self._disconnected = True
            elif event == zmq.EVENT_CONNECTED and self._disconnected:
                self._disconnected = False
                self.reconnects += 1
                self._on_reconnect()

    def _on_reconnect(self) -> None:
        """The SUB socket reconnected: a network blip or a new publisher."""
        if not self._recent:
            return  # nothing applied: nothing to mistake for the new stream
        if self.replay_endpoint is None:
            # Cannot tell a restart from a blip, nor replay what was missed.
            self.stale = True
            self.last_error = "reconnected without a replay endpoint"
            return
        self._catch_up("reconnect", must_verify=True)

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
        pending = _Pending()
        for frames in frames_list:
            msg = self._parse(frames, live=True)
            if msg is not None:
                pending = self._accept(msg, pending)
        self._flush(pending)

    def _accept(self, msg: _Msg, pending: _Pending, retry: bool = True) -> _Pending:
        """Place one live message: apply, hold, drop, or detect a restart.

        Returns the pending commit (a new one after a restart flushed it).
        """
        seq = msg.seq
        if self.next_seq is None:
            self.next_seq = seq
        if seq < self.next_seq:
            if self._recent.get(seq) == msg.digest():
                self.duplicates += 1  # exact duplicate (or replayed already)
                return pending
            reason = f"seq {seq} differs from the batch applied at that seq"
        elif seq > self.next_seq:
            held = self._ahead.get(seq)
            if held is None:
                self._ahead[seq] = msg
                if self._ahead_since is None:
                    self._ahead_since = time.monotonic()
                return pending
            if held.digest() == msg.digest():
                self.duplicates += 1
                return pending
            reason = f"two different batches with seq {seq}"
        else:
            self._absorb(pending, msg)
            self._drain_ahead(pending)
            return pending
        if not retry:
            # Neither the old nor the rebuilt stream: a straggler from the
            # publisher that is gone (or junk). The index is already rebuilt.
            self.foreign += 1
            return pending
        self._flush(pending)
        self._restart(reason)
        return self._accept(msg, _Pending(), retry=False)

    def _drain_ahead(self, pending: _Pending) -> None:
        """Apply held batches that are now in order."""
        ahead = self._ahead
        while ahead and self.next_seq in ahead:
            self._absorb(pending, ahead.pop(self.next_seq))
            self.reordered += 1
        for seq in [s for s in ahead if s < self.next_seq]:
            del ahead[seq]
        if not ahead:
            self._ahead_since = None

    def _absorb(self, pending: _Pending, msg: _Msg) -> None:
        """Decode one in-order batch into ``pending``."""
        self.next_seq = msg.seq + 1
        recent = self._recent
        recent[msg.seq] = msg.digest()
        recent.move_to_end(msg.seq)
        if len(recent) > _RECENT:
            recent.popitem(last=False)
        try:
            batch = decode_batch(msg.payload)
        except MalformedPayload as exc:
            # The batch is lost for good (a replay returns the same bytes).
            self.malformed += 1
            self.stale = True
            self.last_error = f"seq {msg.seq}: {exc}"
            return
        try:
            plan = _plan(
                batch.events,
                self._hash_bytes,
                self._media,
                self._honor_clears,
                self._default_group_id,
            )
        except (TypeError, ValueError) as exc:
            self.apply_errors += 1
            self.stale = True
            self.last_error = f"seq {msg.seq}: {exc}"
            return
        pending.plan.merge(plan)
        pending.batches += 1

    def _flush(self, pending: _Pending) -> None:
        """Commit ``pending`` (O(1) under the lock, see ``_commit``).

        Also publishes ``next_seq`` as committed, for :meth:`wait_for_seq`.
        """
        plan = pending.plan
        if pending.batches or plan.clear or plan.ops or plan.skipped:
            try:
                stats = _commit(self.index, plan, self.lock, sync=True)
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
        pending.plan, pending.batches = _Plan(), 0
        with self._progress:
            self.committed_seq = self.next_seq
            self._progress.notify_all()

    def _replay(self, start: int, stop: int | None) -> list[_Msg] | None:
        """Ask the ROUTER for batches ``start..stop-1`` (all if ``stop`` is None).

        Returns the in-range messages received, sorted by seq, or None if the
        end marker did not arrive in time. A fresh DEALER per request keeps a
        late answer to an abandoned request from being read as the answer to
        this one.
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
                    break
                msg = self._parse(frames, live=False)
                if msg is None or msg.seq < start:
                    continue
                if stop is not None and msg.seq >= stop:
                    break  # the rest will come (or came) live
                out.append(msg)
            else:
                return None
            return sorted(out, key=lambda m: m.seq)
        finally:
            dealer.close(linger=0)

    def _verified_replay(self, stop: int | None) -> list[_Msg] | None:
        """Replay from ``next_seq`` (to ``stop``), proving continuity.

        The request starts one batch early, at the last batch applied: the
        publisher must answer it with the same bytes, or it is not the
        publisher whose batches are in the index (raises :class:`_Restart`).
        Returns the batches from ``next_seq`` on, or None on no answer.
        """
        assert self.next_seq is not None
        anchor_seq = self.next_seq - 1
        anchor = self._recent.get(anchor_seq)
        start = anchor_seq if anchor is not None else self.next_seq
        msgs = self._replay(start, stop)
        if msgs is None or anchor is None:
            return msgs
        if not msgs or msgs[0].seq != anchor_seq or msgs[0].digest() != anchor:
            raise _Restart(
                f"the replay does not continue the stream at seq {anchor_seq}"
            )
        return msgs[1:]

    def _catch_up(self, why: str, must_verify: bool = False) -> None:
        """Fill what is missing before the reorder buffer (or, with nothing
        held, after ``next_seq``) from the replay endpoint, in order.

        ``must_verify``: no answer marks the index stale (after a
        reconnection, silence cannot tell a restart from a blip).
        """
        if self.next_seq is None:
            return
        held = bool(self._ahead)
        stop = max(self._ahead) + 1 if held else None
        if held:
            self.gaps_detected += 1
        msgs = None
        if self.replay_endpoint is not None:
            try:
                msgs = self._verified_replay(stop)
            except _Restart as exc:
                self._restart(f"{why}: {exc}")
                return
        if msgs is None and not held:
            if must_verify:
                self.stale = True
                self.last_error = f"{why}: the replay endpoint did not answer"
            return  # a probe without an answer: nothing learned
        for m in msgs or ():
            live = self._ahead.get(m.seq)
            if live is not None and live.digest() != m.digest():
                self._restart(f"{why}: replay and live stream disagree at seq {m.seq}")
                return
            if m.seq >= self.next_seq:
                self._ahead[m.seq] = m
        pending = _Pending()
        start = self.next_seq
        self._drain_ahead(pending)
        if self._ahead:
            # A hole the replay could not fill: go on, stale, from what we have.
            if not held:
                self.gaps_detected += 1
            self.gaps_unrecovered += 1
            self.stale = True
            self.last_error = (
                f"gap {self.next_seq}..{min(self._ahead) - 1} not covered by replay"
                if msgs is not None
                else f"replay for {start}.. timed out or unavailable"
            )
            while self._ahead:
                self.next_seq = min(self._ahead)
                self._drain_ahead(pending)
        elif held:
            self.gaps_recovered += 1
        self._flush(pending)

    def _restart(self, reason: str) -> None:
        """The stream now comes from a new publisher: rebuild or go stale."""
        self.publisher_restarts += 1
        msgs = self._replay(0, None) if self.replay_endpoint is not None else None
        if msgs is not None and [m.seq for m in msgs] == list(range(len(msgs))):
            # Its whole life is in the buffer: the index becomes its state,
            # cleared and refilled in one commit.
            self._recent.clear()
            self.next_seq = 0
            self.stale = False
            pending = _Pending()
            pending.plan.clear = True
            for m in msgs:
                self._absorb(pending, m)
            # Held live batches newer than the replay are the new publisher's.
            self._drain_ahead(pending)
            self._flush(pending)
            self.rebuilds += 1
            self.last_error = f"publisher restarted ({reason}); index rebuilt"
            return
        self._recent.clear()
        self.stale = True
        self.last_error = (
            f"publisher restarted ({reason}); its replay buffer does not reach "
            "back to seq 0, so the index cannot be rebuilt"
        )
        # Go on, stale, with the new stream: held live batches first, else
        # adopt whatever comes next.
        self.next_seq = min(self._ahead) if self._ahead else None
        pending = _Pending()
        if self._ahead:
            self._drain_ahead(pending)
            self._ahead.clear()
            self._ahead_since = None
        self._flush(pending)
