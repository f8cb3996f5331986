"""vLLM 0.33.0 KV-cache events: the wire schema, and applying them to a KeyIndex.

vLLM publishes what enters and leaves its KV caches (GPU block pool, host
pools, the Mooncake store connector) through ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py``). This module decodes that stream with its
own msgspec structs (no vLLM import); :func:`apply` makes a KeyIndex equal to
the set of ``(group_id, block_hash)`` keys the chosen tier holds. The ZMQ
follower that reads the stream lives in ``bindings/events.py``; it reads a
payload of stored blocks with one numba scan (``bindings/kv_event_scan.py``)
and anything else with :func:`decode_keys` (:class:`StoredKeys`/
:class:`RemovedKeys`), which leaves ``block_hashes`` in msgpack for
:func:`raw_hash_words` to read as one numpy view and skips the token ids, so
no Python object is made per block (``bench/bench_events.py`` times each
stage).

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

import array
import contextlib
import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

try:
    import msgspec
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvhit.bindings.kv_events needs msgspec (and pyzmq for EventFollower): "
        "pip install 'kvhit[events]'"
    ) from exc

import numpy as np
import torch

from kvhit.coordinator.event_payload import strip_token_ids
from kvhit.coordinator.fleet_index import EngineView
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import num_words
from kvhit.kernels.checks import check_bool, check_int

#: The names ``bindings/events.py`` re-exports beside ``EventFollower``: the
#: wire schema and :func:`apply` (written once, here).
FOLLOWER_EXPORTS = (
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
    "KVCacheEvent",
    "KVEventBatch",
    "MalformedPayload",
    "apply",
    "decode_batch",
    "encode_batch",
    "hash_to_bytes",
)
__all__ = [
    *FOLLOWER_EXPORTS,
    "FOLLOWER_EXPORTS",
    "INT64_LIMIT",
    "EventPlan",
    "KeyEventBatch",
    "LE_INT64",
    "STRIP_FROM_BYTES",
    "PlanKeys",
    "RemovedKeys",
    "StoredKeys",
    "commit_plan",
    "decode_keys",
    "decode_keys_whole",
    "event_words",
    "hash_words",
    "index_hash_bytes",
    "media_set",
    "plan_events",
    "plan_keys",
    "raw_hash_words",
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


# --- what the follower decodes: the same schema with the bulky fields left
# in msgpack. ``block_hashes`` is converted to packed keys straight from its
# bytes (``raw_hash_words``), ``token_ids`` (16 ints a block) is skipped, and
# ``extra_keys``/``lookahead_token_ids`` are ignored; every other field is
# decoded and type-checked as in ``KVEventBatch``, required ones required.
# Each such struct is made from vLLM's (one list of fields, in its order).


def _keys_struct(
    full: type[msgspec.Struct], name: str, raw: tuple[str, ...], drop: tuple[str, ...]
) -> Any:
    """``full``'s wire schema (same tag, fields in the same order, the same
    types and defaults) with the fields ``raw`` kept as ``msgspec.Raw`` and
    the fields ``drop`` left out (skipped as unknown when decoded)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(full):
        if f.name in drop:
            continue
        typ = msgspec.Raw if f.name in raw else f.type
        fields.append((f.name, typ) if f.required else (f.name, typ, f.default))
    struct = msgspec.defstruct(
        name,
        fields,
        tag=full.__struct_config__.tag,
        omit_defaults=True,
        gc=False,
        module=__name__,
    )
    struct.__doc__ = (
        f"A ``{full.__name__}`` as the follower decodes it (hashes still msgpack)."
    )
    return struct


StoredKeys = _keys_struct(
    BlockStored,
    "StoredKeys",
    raw=("block_hashes", "token_ids"),
    drop=("extra_keys", "lookahead_token_ids"),
)
RemovedKeys = _keys_struct(BlockRemoved, "RemovedKeys", raw=("block_hashes",), drop=())


class KeyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A ``KVEventBatch`` as the follower decodes it (:func:`decode_keys`)."""

    ts: float
    events: list[StoredKeys | RemovedKeys | AllBlocksCleared]
    data_parallel_rank: int | None = None


class MalformedPayload(ValueError):
    """A payload that is not a vLLM 0.33.0 ``KVEventBatch``."""


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_KEYS_DECODER = msgspec.msgpack.Decoder(KeyEventBatch)
_ENCODER = msgspec.msgpack.Encoder()

#: Packed hash words are little-endian int64 (coordinator/packing.py).
LE_INT64 = np.dtype("<i8")


#: Payloads from this many bytes on are decoded from a copy without their
#: token ids (``kernels/event_scan_numba.py``): msgspec walks every id of a
#: ``Raw`` field to find its end, the scan finds it faster. Below, the
#: scan's call costs more than the walk it saves.
STRIP_FROM_BYTES = 1536


def decode_keys(payload: bytes | bytearray | memoryview) -> KeyEventBatch:
    """Decode one payload for :func:`plan_events` without its token ids;
    raises :class:`MalformedPayload` on any defect ``decode_batch`` would
    refuse, but for the contents of ``block_hashes`` (found when planned)
    and of the skipped fields."""
    data: Any = payload
    if len(payload) >= STRIP_FROM_BYTES:
        stripped = strip_token_ids(payload)
        if stripped is not None:
            data = stripped
    try:
        return _KEYS_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        if data is not payload:
            return decode_keys_whole(payload)  # refused as it came
        raise MalformedPayload(f"not a KVEventBatch: {exc}") from None


def decode_keys_whole(payload: bytes | bytearray | memoryview) -> KeyEventBatch:
    """:func:`decode_keys` with the token ids walked by msgspec, whatever
    the payload's size (the reference the scan is tested against)."""
    try:
        return _KEYS_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedPayload(f"not a KVEventBatch: {exc}") from None


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
class EventPlan:
    """Net effect of events applied in order to a set of keys.

    For a set, the state of a key after a sequence of adds/removes is decided by
    the last of them, and a clear erases everything before it. So any run of
    events is exactly: optionally clear, then remove the keys whose last event
    is a remove, then add the keys whose last event is an add. ``parts`` keeps
    the events' keys in order, one ``(is_add, group_id, words)`` per event
    (``words`` int64 ``[n, W]``, packed as ``coordinator/packing.py`` packs
    hashes); :func:`plan_keys` reduces them to the two disjoint key sets, so
    the index sees at most three calls however the events interleave, and an
    add then remove of one key ends removed.
    """

    clear: bool = False
    parts: list[tuple[bool, int, np.ndarray]] = field(default_factory=list)
    events: int = 0  # events that passed the filter
    skipped: int = 0  # events filtered out (medium, or ignored clears)

    def merge(self, later: EventPlan) -> None:
        """Append ``later`` (which happened after ``self``)."""
        if later.clear:
            self.clear = True
            self.parts = later.parts
        else:
            self.parts.extend(later.parts)  # later parts win, as in sequence
        self.events += later.events
        self.skipped += later.skipped

    @property
    def empty(self) -> bool:
        """True when committing the plan would not touch the index."""
        return not (self.clear or self.parts)


INT64_LIMIT = 1 << 63


def media_set(
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


def _words_of_bytes(joined: bytes, n: int, hash_bytes: int) -> np.ndarray:
    """``n`` hashes of ``hash_bytes`` bytes, concatenated, as packed words:
    int64 ``[n, W]``, little-endian, last word zero-padded (pack_hashes)."""
    w = num_words(hash_bytes)
    raw = np.frombuffer(joined, dtype=np.uint8, count=n * hash_bytes)
    if hash_bytes == 8 * w:
        out = raw.view(LE_INT64).reshape(n, w).copy()
    else:
        padded = np.zeros((n, 8 * w), dtype=np.uint8)
        padded[:, :hash_bytes] = raw.reshape(n, hash_bytes)
        out = padded.view(LE_INT64)
    return out.astype(np.int64, copy=False)  # native order for torch


def _words_of_ints(hashes: list[Any], hash_bytes: int) -> np.ndarray | None:
    """vLLM's int hashes (the low 64 bits read big-endian) as packed words,
    or None when one is not an int in ``[0, 2**64)`` (the caller names it).

    The key is ``h.to_bytes(8, "big")``, so its packed little-endian word is
    ``h`` byte-swapped: no per-hash Python."""
    if hash_bytes != 8:
        return None  # narrower indexes take the per-hash path
    # Exactly int, as hash_to_bytes takes: no bool, no numpy integer.
    if not all(type(h) is int for h in hashes):
        return None
    try:
        arr = np.frombuffer(array.array("Q", hashes), dtype=np.uint64)
    except OverflowError:
        return None  # negative or too large: named by the per-hash path
    return arr.byteswap().view(np.int64).reshape(-1, 1)


def hash_words(hashes: Any, hash_bytes: int, where: str) -> np.ndarray:
    """An event's ``block_hashes`` (a list of bytes, or of vLLM's ints) as
    packed words, int64 ``[n, W]``; TypeError/ValueError naming ``where``
    and the position of a bad hash (see :func:`hash_to_bytes`)."""
    if not isinstance(hashes, list | tuple):
        raise TypeError(
            f"{where}: block_hashes must be a list, got {type(hashes).__name__}"
        )
    n = len(hashes)
    if n == 0:
        return np.empty((0, num_words(hash_bytes)), dtype=np.int64)
    if type(hashes[0]) is bytes:
        try:
            joined = b"".join(hashes)
        except TypeError:
            joined = None
        # Equal total and minimum widths: every hash has the width.
        if (
            joined is not None
            and len(joined) == n * hash_bytes
            and min(map(len, hashes)) == hash_bytes
        ):
            return _words_of_bytes(joined, n, hash_bytes)
    else:
        words = _words_of_ints(list(hashes), hash_bytes)
        if words is not None:
            return words
    # The per-hash path: names the first bad hash, else converts them all.
    keys = []
    for j, h in enumerate(hashes):
        try:
            keys.append(hash_to_bytes(h, hash_bytes))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}, block_hashes[{j}]: {exc}") from None
    return _words_of_bytes(b"".join(keys), n, hash_bytes)


def _array_head(data: bytes) -> tuple[int, int] | None:
    """(items, offset of the first item) of the msgpack array in ``data``."""
    head = data[0] if data else -1
    if 0x90 <= head <= 0x9F:
        return head - 0x90, 1
    if head == 0xDC and len(data) >= 3:
        return int.from_bytes(data[1:3], "big"), 3
    if head == 0xDD and len(data) >= 5:
        return int.from_bytes(data[1:5], "big"), 5
    return None


def raw_hash_words(raw: msgspec.Raw, hash_bytes: int) -> np.ndarray | None:
    """``block_hashes`` still in msgpack, as packed words without making a
    Python object per hash: int64 ``[n, W]``, or None for any layout but the
    two vLLM's encoder writes (then :func:`hash_words` decides).

    - every hash a ``bin 8`` of ``hash_bytes`` bytes (``0xc4, hash_bytes``,
      the bytes): the key is the bytes;
    - ``hash_bytes == 8`` and every hash a ``uint 64`` (``0xcf``, 8 bytes
      big-endian, what msgpack writes for ints >= 2**32): the key is
      ``h.to_bytes(8, "big")``, i.e. exactly the 8 bytes on the wire.

    Either way the words are a strided view of the bytes, copied once.
    """
    data = bytes(raw)
    first = data[0] if data else -1
    # (vLLM's lists of 16..65535 hashes and of 0..15 first: one test each.)
    if first == 0xDC and len(data) >= 3:
        n, off = (data[1] << 8) | data[2], 3
    elif 0x90 <= first <= 0x9F:
        n, off = first - 0x90, 1
    else:
        head = _array_head(data)
        if head is None:
            return None
        n, off = head
    w = num_words(hash_bytes)
    if n == 0:
        return np.empty((0, w), dtype=np.int64)
    size = len(data) - off
    if hash_bytes == 8 and size == 9 * n:
        if data[off::9] != b"\xcf" * n:
            return None
        skip, stride = 1, 9
    elif hash_bytes < 256 and size == (2 + hash_bytes) * n:
        stride = 2 + hash_bytes
        if (
            data[off::stride] != b"\xc4" * n
            or data[off + 1 :: stride] != bytes((hash_bytes,)) * n
        ):
            return None
        if hash_bytes != 8 * w:  # a padded last word: the general packing
            keys = np.ndarray(
                (n, hash_bytes), np.uint8, data, off + 2, (stride, 1)
            ).tobytes()
            return _words_of_bytes(keys, n, hash_bytes)
        skip = 2
    else:
        return None
    view = np.ndarray((n, w), LE_INT64, data, off + skip, (stride, 8))
    return view.astype(np.int64)  # a contiguous, native-order copy


_HASHES_DECODER = msgspec.msgpack.Decoder(list[ExternalBlockHash])


def event_words(hashes: Any, hash_bytes: int, where: str) -> np.ndarray:
    """:func:`hash_words` for a decoded list, or for the raw msgpack of a
    :class:`StoredKeys`/:class:`RemovedKeys` (fast layouts first); raises
    :class:`MalformedPayload` when the raw field is not a list of hashes."""
    if isinstance(hashes, msgspec.Raw):
        words = raw_hash_words(hashes, hash_bytes)
        if words is not None:
            return words
        try:
            hashes = _HASHES_DECODER.decode(hashes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedPayload(f"{where}: block_hashes: {exc}") from None
    return hash_words(hashes, hash_bytes, where)


_STORES = (BlockStored, StoredKeys)
_REMOVES = (BlockRemoved, RemovedKeys)


def _where(pos: int, ev: Any) -> str:
    """How an error names event ``pos`` of a batch (made only on an error)."""
    return f"event {pos} ({ev.__struct_config__.tag})"


def plan_events(
    events: Iterable[KVCacheEvent],
    hash_bytes: int,
    media: frozenset[str] | None,
    honor_clears: bool,
    default_group_id: int,
) -> EventPlan:
    """Reduce ``events`` to a :class:`EventPlan`, validating every field first.

    ``events``: vLLM's events (:class:`BlockStored`, :class:`BlockRemoved`,
    :class:`AllBlocksCleared`) or the follower's :class:`StoredKeys` /
    :class:`RemovedKeys`. Nothing is mutated: a bad event raises
    TypeError/ValueError naming its position in ``events``, the field and
    (for a hash) its position in ``block_hashes``, so the caller applies all
    of a batch or none of it. Each event's hashes are converted at once
    (:func:`event_words`), never one Python object per hash on vLLM's
    encodings.
    """
    plan = EventPlan()
    parts = plan.parts
    for pos, ev in enumerate(events):
        kind = type(ev)
        if kind in _STORES or kind in _REMOVES:
            medium = ev.medium
            if medium is not None and type(medium) is not str:
                if not isinstance(medium, str):
                    raise TypeError(
                        f"{_where(pos, ev)}: medium must be a str or None, got "
                        f"{type(medium).__name__}"
                    )
            if media is not None and medium not in media:
                plan.skipped += 1
                continue
            # Events without group_idx come from single-group publishers.
            gid = default_group_id if ev.group_idx is None else ev.group_idx
            if type(gid) is not int:
                if isinstance(gid, bool) or not isinstance(gid, int):
                    raise TypeError(
                        f"{_where(pos, ev)}: group_idx must be an int, got "
                        f"{type(gid).__name__}"
                    )
            # KeyIndex reserves negative ids as slot sentinels; ids are int64.
            if not 0 <= gid < INT64_LIMIT:
                raise ValueError(
                    f"{_where(pos, ev)}: group_idx {gid} is not in [0, 2**63)"
                )
            hashes = ev.block_hashes
            # vLLM's two encodings straight from the msgpack; anything else
            # (and every error, named by event and position) by event_words.
            words = (
                raw_hash_words(hashes, hash_bytes)
                if type(hashes) is msgspec.Raw
                else None
            )
            if words is None:
                words = event_words(hashes, hash_bytes, _where(pos, ev))
            if words.shape[0]:
                parts.append((kind in _STORES, gid, words))
            plan.events += 1
        elif kind is AllBlocksCleared:
            if honor_clears:
                plan.clear = True
                parts.clear()
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


def index_hash_bytes(index: Any) -> int:
    hb = getattr(index, "hash_bytes", None)
    if isinstance(hb, bool) or not isinstance(hb, int):
        raise TypeError("index must expose an int `hash_bytes` (a kvhit KeyIndex)")
    return hb


@dataclass
class PlanKeys:
    """A plan's keys as the KeyIndex takes them: (group ids int64 ``[N]``,
    hashes int64 ``[N, W]``), C-contiguous numpy arrays for a CPU index (what
    the host store paths read: no tensor is made) or tensors on the index's
    device, or None when empty. ``removes`` and ``adds`` are disjoint; either
    may repeat a key."""

    removes: tuple[Any, Any] | None
    adds: tuple[Any, Any] | None

    @property
    def n_adds(self) -> int:
        return 0 if self.adds is None else self.adds[0].shape[0]


def _rows(parts: list[tuple[bool, int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The parts' keys in order: group ids int64 ``[N]``, words ``[N, W]``."""
    if len(parts) == 1:
        _, gid, words = parts[0]
        gids = np.empty(words.shape[0], dtype=np.int64)
        gids.fill(gid)  # (np.full costs twice as much at a request's size)
        return gids, words
    gids = np.repeat(
        np.array([p[1] for p in parts], dtype=np.int64),
        [p[2].shape[0] for p in parts],
    )
    return gids, np.concatenate([p[2] for p in parts])


def _net_effect(
    parts: list[tuple[bool, int, np.ndarray]],
) -> tuple[tuple[np.ndarray, np.ndarray] | None, tuple[np.ndarray, np.ndarray] | None]:
    """(removes, adds): each key under its last operation, in numpy."""
    adds = [p for p in parts if p[0]]
    if len(adds) in (0, len(parts)):
        # One kind of operation: repeats are harmless (add and remove are
        # idempotent), so no reduction is needed.
        keys = _rows(parts)
        return (None, keys) if adds else (keys, None)
    gids, words = _rows(parts)
    ops = np.repeat(
        np.array([p[0] for p in parts], dtype=bool), [p[2].shape[0] for p in parts]
    )
    rows = np.concatenate([gids[:, None], words], axis=1)[::-1]
    # The first occurrence in reversed order is each key's last operation.
    _, first = np.unique(rows, axis=0, return_index=True)
    last_rows, last_ops = rows[first], ops[::-1][first]
    out = []
    for want in (False, True):
        sel = last_rows[last_ops == want]
        out.append(
            (np.ascontiguousarray(sel[:, 0]), np.ascontiguousarray(sel[:, 1:]))
            if sel.shape[0]
            else None
        )
    return out[0], out[1]


def plan_keys(plan: EventPlan, hash_bytes: int, device: Any) -> PlanKeys:
    """Pack the plan's keys (validated by ``plan_events``) before any mutation:
    the removes and adds of its net effect, numpy for a CPU ``device``, else
    tensors on ``device`` (see :class:`PlanKeys`). ``hash_bytes``: the
    index's width (the words already have it)."""
    return _plan_keys(plan, device, _device_type(device) == "cpu")


def _plan_keys(plan: EventPlan, device: Any, cpu: bool) -> PlanKeys:
    if not plan.parts:
        return PlanKeys(None, None)
    removes, adds = _net_effect(plan.parts)
    if cpu:
        return PlanKeys(removes, adds)

    def tensors(keys: tuple[np.ndarray, np.ndarray] | None) -> Any:
        if keys is None:
            return None
        return (
            torch.from_numpy(keys[0]).to(device),
            torch.from_numpy(keys[1]).to(device),
        )

    return PlanKeys(tensors(removes), tensors(adds))


def _new_keys(index: KeyIndex, plan: EventPlan, keys: PlanKeys) -> int | None:
    """How many keys committing ``plan`` adds to ``index`` when that makes
    ``index.add`` rehash; None when the table has room.

    Mirrors the growth rule of :meth:`KeyIndex.add`: a rehash happens when
    ``live + tombstones + new keys`` exceeds ``floor(max_load * capacity)``
    (removes turn live keys into tombstones, so they do not change the sum).
    The exact count of new keys costs one probe, paid only near the limit.
    """
    if keys.adds is None:
        return None
    if not plan.clear and keys.n_adds <= index.room():
        return None  # the usual case: one test, no probe
    limit = math.floor(index.max_load * index.capacity)
    if plan.clear:
        return keys.n_adds if keys.n_adds > limit else None
    used = len(index) + index.tombstones
    new = int((~index.contains(*keys.adds)).sum().item())
    return new if used + new > limit else None


def _grown_copy(
    index: KeyIndex, plan: EventPlan, keys: PlanKeys, n_new: int
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


def _device_type(device: Any) -> str:
    if type(device) is torch.device:
        return device.type
    return "cpu" if device == "cpu" else torch.device(device).type


#: The lock of a commit made without one (a nullcontext may be re-entered).
_NO_LOCK = contextlib.nullcontext()


def commit_plan(
    index: Any, plan: EventPlan, lock: Any = None, sync: bool = False
) -> ApplyStats:
    """Apply a validated plan: at most one clear, one remove and one add.

    Everything that can fail on input (packing the keys) happens before the
    index is touched. When the adds would grow the table, the grown table is
    built *outside* ``lock`` (``index`` is only read; the caller must be its
    only writer meanwhile) and swapped in under it, so readers holding the
    lock wait O(1), not a rehash, and a failure while building (out of
    memory, a fixed-capacity index) leaves ``index`` as it was.
    """
    lock = lock if lock is not None else _NO_LOCK
    parts = plan.parts
    if len(parts) == 1 and not plan.clear and parts[0][0]:
        # One event's stores (a router's usual commit): its words and group
        # id as they are, in one call, into a host KeyIndex with room or an
        # engine of a host fleet (FleetIndex.add's one-kernel form; a fleet
        # grows under the lock, as on the general path below).
        _, gid, words = parts[0]
        kind = type(index)
        if kind is KeyIndex:
            if index.host_table is not None and words.shape[0] <= index.room():
                with lock:
                    added = index.add_trusted(gid, words)
                return ApplyStats(plan.events, plan.skipped, added, 0, False)
        elif kind is EngineView and index.fleet.host_table is not None:
            with lock:
                added = index.add(gid, words)
            return ApplyStats(plan.events, plan.skipped, added, 0, False)
    device = getattr(index, "device", "cpu")
    device_type = _device_type(device)
    keys = _plan_keys(plan, device, device_type == "cpu")
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
                # kvhit packed these keys itself: a KeyIndex takes them
                # unchecked (unless a subclass hooks ``add``).
                trusted = (
                    isinstance(index, KeyIndex) and type(index).add is KeyIndex.add
                )
                add = index.add_trusted if trusted else index.add
                added = add(*keys.adds)
        if sync and device_type == "cuda":
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
    ``EventPlan``) before the index is touched; it then gets at most one clear,
    one remove and one add call. A bad argument or event (wrong hash width,
    int hash on a >8-byte index, a group id outside ``[0, 2**63)``, a
    non-string medium) raises ``TypeError``/``ValueError`` naming the event's
    position and field, and leaves the index exactly as it was.
    """
    hash_bytes = index_hash_bytes(index)
    media = media_set(medium)
    check_bool(honor_clears, "honor_clears")
    check_int(default_group_id, "default_group_id", 0, INT64_LIMIT)
    if isinstance(events, EventBatch):
        events = events.events
    if isinstance(events, KVCacheEvent) or not isinstance(events, Iterable):
        raise TypeError(
            "events must be a KVEventBatch or an iterable of KV cache events, "
            f"got {type(events).__name__}"
        )
    plan = plan_events(events, hash_bytes, media, honor_clears, default_group_id)
    return commit_plan(index, plan)
