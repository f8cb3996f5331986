"""How the follower reads one vLLM KV-event payload into a plan.

:func:`plan_payload` makes what ``plan_events(decode_keys(payload).events)``
makes (``bindings/kv_events.py``): the same keys, or the same error. A
payload of ``BlockStored`` events, vLLM's usual stream, is read by one numba
scan (``kernels/event_plan_numba.py``) against a spec built here from
vLLM's struct (:func:`stored_spec`); anything the scan does not read in full
takes the general path, which takes it or refuses it as before.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import numpy as np

from kvhit.bindings.kv_events import (
    INT64_LIMIT,
    LE_INT64,
    BlockStored,
    EventPlan,
    ExternalBlockHash,
    StoredKeys,
    decode_keys,
    plan_events,
)
from kvhit.coordinator.event_payload import field_kinds, scan_stored
from kvhit.coordinator.event_payload import warm_up as warm_up_scans

__all__ = ["plan_payload", "stored_spec", "warm_up_decoder"]

#: What ``kernels/event_plan_numba`` reads each ``BlockStored`` field as,
#: by its type in vLLM's struct (fields of other types stop the build).
_FIELD_KIND_OF_TYPE: tuple[tuple[Any, str], ...] = (
    (list[ExternalBlockHash], "hashes"),
    (ExternalBlockHash | None, "hash_or_nil"),
    (list[int], "ints"),
    (int, "int"),
    (int | None, "int_or_nil"),
    (str | None, "str_or_nil"),
)
#: :func:`stored_spec` by the media taken (a follower's, a few per process).
_SPECS: dict[frozenset[str] | None, np.ndarray] = {}


@functools.cache
def _stored_fields() -> tuple[tuple[bytes, int, bool], ...]:
    """``BlockStored``'s wire schema: (name, ``FIELD_KINDS`` code, required)
    per field, the tag first, built once from the struct, so the scan reads
    the fields vLLM's struct has and no list of them is written twice.
    Fields the follower drops (:class:`StoredKeys`) are read as nil only
    (anything else in them takes the general path), ``group_idx`` as the
    group."""
    codes = field_kinds()
    kept = {f.name for f in msgspec.structs.fields(StoredKeys)}
    fields = [(BlockStored.__struct_config__.tag_field, "tag", True)]
    for f in msgspec.structs.fields(BlockStored):
        if f.name == "group_idx":
            kind = "group"
        elif f.name not in kept:
            kind = "nil"
        else:
            kind = next((k for t, k in _FIELD_KIND_OF_TYPE if f.type == t), None)
            if kind is None:  # a schema this scan cannot read: say which
                raise TypeError(f"BlockStored.{f.name}: no scan for {f.type}")
        fields.append((f.name, kind, f.required))
    return tuple((n.encode(), codes[k], r) for n, k, r in fields)


def stored_spec(media: frozenset[str] | None) -> np.ndarray | None:
    """``kernels/event_plan_numba.scan_stored``'s spec (int64, see there):
    ``BlockStored``'s schema, its tag, and the media taken (None: all);
    None where a medium is not a str (no event's medium can equal it)."""
    spec = _SPECS.get(media)
    if spec is not None:
        return spec
    if media is not None and any(type(m) is not str for m in media):
        return None
    fields = _stored_fields()
    taken = sorted(m.encode() for m in media) if media is not None else []
    tag = BlockStored.__struct_config__.tag.encode()
    rows = [(tag, 0, 0), *fields, *((m, 0, 0) for m in taken)]
    # Names as words (at least four: the scan compares a field's name as
    # four masked words), then each field's masks.
    width = max(4, -(-max(len(name) for name, _, _ in rows) // 8))
    spec = np.zeros((1 + len(rows), 3 + width + 4), dtype=np.int64)
    spec[0, :5] = (
        len(fields),
        -1 if media is None else len(taken),
        [name for name, _, _ in fields].index(b"medium"),
        sum(1 << f for f, (_, _, required) in enumerate(fields) if required),
        width,
    )
    for r, (name, kind, _) in enumerate(rows, 1):
        spec[r, :2] = len(name), kind
        padded = name.ljust(8 * width, b"\0")
        spec[r, 3 : 3 + width] = np.frombuffer(padded, dtype=LE_INT64)
        mask = (b"\xff" * len(name)).ljust(32, b"\0")[:32]
        spec[r, 3 + width :] = np.frombuffer(mask, dtype=LE_INT64)
    _SPECS[media] = spec
    return spec


def plan_payload(
    payload: bytes | bytearray | memoryview,
    hash_bytes: int,
    media: frozenset[str] | None,
    honor_clears: bool,
    default_group_id: int,
) -> EventPlan:
    """``plan_events(decode_keys(payload).events, ...)``, what the follower
    makes of one payload: the same keys, or the same error.

    A payload of vLLM's ``BlockStored`` events (the store connector's, a
    router's usual stream: one event a block), as ``bytes`` into an index
    of 8-byte multiples, is read by one numba scan
    (``kernels/event_plan_numba``): every field type-checked, hashes
    straight into packed words, consecutive events of one group as one part
    (adding them in order is adding their keys at once). The scan gives up
    on anything it does not read in full, and that payload takes the
    general path, which takes it or refuses it exactly as before.
    """
    if (
        type(payload) is bytes
        and type(hash_bytes) is int
        and 8 <= hash_bytes < 256
        and not hash_bytes & 7
        and type(default_group_id) is int
        and 0 <= default_group_id < INT64_LIMIT
        and (media is None or type(media) is frozenset)
    ):
        # (Other arguments, refused or not, are the general path's to judge.)
        spec = _SPECS.get(media)
        if spec is None:
            spec = stored_spec(media)
        got = (
            None
            if spec is None
            else scan_stored(payload, spec, hash_bytes, default_group_id)
        )
        if got is not None:
            taken, skipped, runs = got
            if len(runs) == 1:  # the usual batch: no comprehension's frame
                ((gid, words),) = runs
                return EventPlan(False, [(True, gid, words)], taken, skipped)
            return EventPlan(
                False, [(True, gid, words) for gid, words in runs], taken, skipped
            )
    return plan_events(
        decode_keys(payload).events, hash_bytes, media, honor_clears, default_group_id
    )


def warm_up_decoder() -> None:
    """Load (or compile) :func:`plan_payload`'s scans now, so that the
    first event of a follower does not pay for them (once per process)."""
    warm_up_scans(stored_spec(None))
