"""The numba scans of a vLLM KV-event payload, for ``bindings/kv_events``.

``kernels/event_scan_numba.py`` holds the token-id scan and
``kernels/event_plan_numba.py`` the read of stored blocks into keys (see
their docstrings); this module reaches them for the bindings, importing
numba on first use: the coordinator never imports it at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["field_kinds", "scan_stored", "strip_token_ids", "warm_up"]

_strip: Callable[[Any], Any] | None = None
_stored: Callable[..., tuple[int, ...]] | None = None
#: Payload bytes per run :func:`scan_stored` makes room for: an event
#: holding the schema's required fields takes over 100 bytes, so a payload
#: of more events than that (refused by msgspec) goes the general way.
_EVENT_BYTES = 64


def _kernel() -> Callable[[Any], Any]:
    global _strip
    from kvhit.kernels.event_scan_numba import strip_token_ids as strip

    _strip = strip
    return strip


def strip_token_ids(payload: bytes | bytearray | memoryview) -> Any:
    """``payload`` (a msgpack ``KVEventBatch``) with every event's
    ``token_ids`` array of ints replaced by an empty one: a uint8 numpy
    array ``[m]`` msgspec decodes as bytes; None when there is none or the
    scan did not follow the payload to its end (then decode ``payload``
    itself). See ``kernels/event_scan_numba.strip_token_ids``."""
    return (_strip or _kernel())(payload)


def _stored_kernel(spec: np.ndarray) -> Callable[..., tuple[int, ...]]:
    global _stored
    from kvhit.kernels.event_plan_numba import scan_stored as scan
    from kvhit.kernels.event_plan_numba import warm_up as warm
    from kvhit.kernels.numba_entry import compiled_entry

    warm(spec)  # loaded (or compiled) first: only then is there an entry

    # The compiled wrapper, past the dispatcher's typing: this module hands
    # it only bytes (the caller checks), a spec kvhit built, two ints and
    # the array it makes.
    like = np.zeros((1, 4), dtype=np.int64)
    _stored = compiled_entry(scan, b"", like, 8, 0, like)
    return _stored


def field_kinds() -> dict[str, int]:
    """The codes of what a spec's field may hold, by name
    (``kernels/event_plan_numba.FIELD_KINDS``)."""
    from kvhit.kernels.event_plan_numba import FIELD_KINDS

    return FIELD_KINDS


def scan_stored(
    payload: bytes, spec: np.ndarray, hash_bytes: int, default_gid: int
) -> tuple[int, int, list[tuple[int, np.ndarray]]] | None:
    """Read ``payload`` (msgpack ``KVEventBatch`` bytes) as ``BlockStored``
    events of ``spec`` (``bindings/kv_event_scan.stored_spec``: the schema and
    the media taken) into packed keys of ``hash_bytes`` (a multiple of 8)
    bytes, events without a group in ``default_gid``.

    Returns ``(taken, skipped, runs)``: the events taken and skipped (their
    medium not taken), and the stores as runs in order, each ``(group id,
    words int64 [n, hash_bytes // 8])``; None where the payload is not
    read in full (then decode it with msgspec). See
    ``kernels/event_plan_numba.scan_stored``."""
    n = len(payload)
    w = hash_bytes >> 3
    rows = n // 9 + 1
    # Then room for the counts and a run an event (see the kernel).
    out = np.empty((rows + (3 * (n // _EVENT_BYTES) + 4 + w) // w, w), np.int64)
    count, taken, skipped, gid, lo, hi = (_stored or _stored_kernel(spec))(
        payload, spec, hash_bytes, default_gid, out
    )
    if count == 1:  # one run: vLLM's usual batch (one request, one group)
        return taken, skipped, [(gid, out[lo:hi])]
    if count < 0:
        return None
    runs = out[rows:].reshape(-1)[2 : 2 + 3 * count].tolist()
    return (
        taken,
        skipped,
        [(runs[k], out[runs[k + 1] : runs[k + 2]]) for k in range(0, 3 * count, 3)],
    )


def warm_up(spec: np.ndarray | None = None) -> None:
    """Import and load (or compile) the scans now, once per process (the
    stored-block read too where ``spec`` is given)."""
    from kvhit.kernels.event_scan_numba import warm_up as warm

    warm()
    _kernel()
    if spec is not None:
        _stored_kernel(spec)
