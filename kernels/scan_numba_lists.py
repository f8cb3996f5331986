"""A router's step from its Python lists in one compiled call: the msgpack of
its requests' block ids and their lengths read back and scanned.

``LookupEngine.find_hit_list`` on the numba backend: msgspec writes the
step (``B`` lists of ints, then the list of their ``B`` lengths) as msgpack
in one C pass, and :func:`lists_hits` reads it back
(``msgpack_numba.unpack_step``, which refuses anything but ints in int64
and a negative or missing length) and runs the serial batch scan
(``scan_numba.batch_hits``) on it, the hits divided by the caller's block
size. A step of one request then
costs one encode and one compiled call, where ``HashBatch.from_ints``, the
engine's checks and ``hit_list`` cost a compiled call each and several
Python objects (``find_hit_list`` against ``from_ints`` + ``find_longest_
cache_hit`` + ``hit_list``, the conversation trace, warm, one thread: B = 1
4.25 -> 2.64 us, B = 2 8.44 -> 3.39, B = 8 12.82 -> 6.89, B = 64 33.0 ->
25.7, B = 1024 504 -> 488).

Nothing here names a bad item: :func:`lists_hits` answers -1 for anything it
does not take, and the caller then takes the general path, which names it.

Importing this module imports numba.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from kvhit.kernels.contract import EMPTY
from kvhit.kernels.msgpack_numba import unpack_step
from kvhit.kernels.msgpack_numba import warm_up as msgpack_warm_up
from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.numba_entry import compiled_entry
from kvhit.kernels.scan_numba import batch_hits

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = ["ONE", "REFUSED", "lists_entry", "lists_hits", "warm_up"]

#: What :func:`lists_hits` answers for a message it does not take.
REFUSED = -1
#: The ``hit`` argument of a step of one request (no item: never written,
#: so every thread may pass it).
ONE = np.empty(0, np.int64)

# _ENTRY holds lists_hits' compiled wrapper once numba has it (see
# lists_entry); _warm whether warm_up ran in this process.
_ENTRY: list[Any] = []
_warm = False


@numba.njit(cache=True, nogil=True)
def lists_hits(msg, table, plan, k, div, hit):  # fmt: skip
    """Scan the step ``msg`` into ``hit`` (int64 ``[B]``): each request's hit
    (or, in lookup mode, its tokens to load) floor-divided by ``div`` (>= 1).

    ``msg`` is the msgpack of a list of ``B + 1`` lists of ints: ``B``
    requests' 8-byte keys (one int each), then their ``B`` lengths (the
    max lengths, or the prompts' tokens in lookup mode). ``table``, ``plan``
    (``ScanPrep.one``) and ``k`` (2 * mode + prefetch) are
    ``scan_numba.batch_hits``' and are trusted. Returns ``B``, or
    :data:`REFUSED` (``hit`` then holds nothing to read) when ``msg`` is
    anything else: not ``B + 1`` lists, an item that is not an int in int64
    (a bool, float, nil, a uint64 past int64), a last list of another length
    than ``B``, or a negative length.

    ``hit`` of no item (:data:`ONE`) asks for a step of one request
    (``B`` = 1) whose answer is returned instead (>= 0, or
    :data:`REFUSED`): Python then makes and reads no array (~0.2 us of a
    ~3 us step)."""
    one = hit.shape[0] == 0
    b = 1 if one else hit.shape[0]
    # One more word past the message's values holds the hit of a step of one
    # request.
    got, out = unpack_step(msg, 1)
    if got != b:
        return REFUSED
    nb = b + 1
    base = 2 * nb + 1
    if one:
        hit = out[out.shape[0] - 1 :]
    t = out[b]  # the requests' keys; the lengths list follows them
    token_lengths = out[base + t : base + t + b]
    # Unit-step slices of one C array: batch_hits' one signature.
    rows = out[base : base + t].reshape((t, 1))
    batch_hits(rows, out[:b], out[nb + 1 : nb + 1 + b], token_lengths, table, plan,
               k, hit)  # fmt: skip
    if div != 1:
        for i in range(b):
            hit[i] //= div
    return hit[0] if one else b


def lists_entry() -> Callable[
    [bytes, np.ndarray, np.ndarray, int, int, np.ndarray], int
]:
    """:func:`lists_hits`' compiled wrapper for its one signature (bytes,
    C-contiguous int64 arrays, int64 scalars: ``numba_entry.compiled_entry``),
    or the dispatcher until that is loaded: the callers hand it only
    msgspec's bytes and kvhit's own arrays."""
    if _ENTRY:
        return _ENTRY[0]
    a1, a2 = np.empty(1, np.int64), np.empty((1, 1), np.int64)
    entry = compiled_entry(lists_hits, b"", a2, a1, 0, 1, a1)
    if entry is not lists_hits:
        _ENTRY.append(entry)
    return entry


def warm_up(plan: np.ndarray) -> None:
    """Load (or compile, on a cold numba cache) :func:`lists_hits` for
    ``plan`` (a ``ScanPrep.one``), on a step of one request with no keys
    and an empty table, and the msgpack decoder (whose warm-up is what
    ``coordinator/int_lists.py`` waits for before it encodes): a serving
    process's first step then costs what every later one does. Once per
    process."""
    global _warm
    if _warm:
        return
    msgpack_warm_up()
    table = np.zeros((2, 2), np.int64)
    table[:, 0] = EMPTY
    hit = np.empty(1, np.int64)
    # [[], [0]]: one request with no keys, at max length 0 (both ways).
    if (
        lists_hits(b"\x92\x90\x91\x00", table, plan, 0, 1, hit) != 1
        or hit[0] != 0
        or lists_hits(b"\x92\x90\x91\x00", table, plan, 0, 1, ONE) != 0
    ):
        raise AssertionError("scan_numba_lists.lists_hits failed its warm-up")
    lists_entry()
    _warm = True
