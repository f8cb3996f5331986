"""A vLLM KV-event payload of stored blocks read straight into packed keys.

The follower's general path decodes a payload with msgspec
(``bindings/kv_events.decode_keys``), then reads each event's hashes from
their msgpack (``raw_hash_words``) and checks each field in Python
(``plan_events``): about 4.8 us an event, most of it the interpreter, and
vLLM's Mooncake store connector sends one event a block.
:func:`scan_stored` reads a payload of ``BlockStored`` events in one pass
instead: every field's msgpack type is checked against a spec the caller
builds from vLLM's struct (``bindings/kv_event_scan.stored_spec``), each
event's hashes are written as packed words, events of a medium not taken
are counted and dropped, and consecutive taken events of one group become
one run of keys.

It is a fast path, never a second judge: it accepts only what it reads in
full and knows msgspec accepts with the same values, and gives up on
everything else, which then takes the general path and is taken or refused
there exactly as before. So it gives up, besides on any malformed byte, on:
an event that is not a map tagged ``BlockStored``; a key that is not a
fixstr of the schema, or is repeated; a missing required field; a string
that is not ASCII (msgspec checks UTF-8); a float ``ts`` that is not a
float 64; ``token_ids`` that is not an array of ints; a dropped field
(``extra_keys``, ``lookahead_token_ids``) that is not nil; hashes in
neither of vLLM's two uniform layouts (``raw_hash_words``' rule); a
``group_idx`` outside ``[0, 2**63)`` or in a signed form; a batch of more
than three items; and bytes after the batch.

Importing this module imports numba; ``coordinator/event_payload.py`` reaches
it for the bindings.
"""

from __future__ import annotations

import numba
import numpy as np

from kvhit.kernels.event_scan_numba import walk_ints
from kvhit.kernels.msgpack_numba import INT_SIZE, container, read_be
from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.numba_views import byte_at, load_le64, unowned

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = ["FIELD_KINDS", "scan_stored", "warm_up"]

#: What a schema field's value may be, by code (``kinds`` of
#: :func:`scan_stored`): the tag, the hashes, a hash or nil (bin 8 of any
#: length, an int, nil), an array of ints, an int, an int or nil, a string
#: or nil, nil alone (a field the follower drops), the group id (an int in
#: ``[0, 2**63)`` or nil).
FIELD_KINDS = {
    "tag": 0,
    "hashes": 1,
    "hash_or_nil": 2,
    "ints": 3,
    "int": 4,
    "int_or_nil": 5,
    "str_or_nil": 6,
    "nil": 7,
    "group": 8,
}
_TAG, _HASHES, _HASH_OR_NIL, _INTS, _INT, _INT_OR_NIL, _STR_OR_NIL, _NIL, _GROUP = (
    range(9)
)
# Whether warm_up() ran in this process.
_warm = False
#: What :func:`scan_stored` returns where it gives up.
_GAVE_UP = (-1, 0, 0, 0, 0, 0)


@numba.njit(inline="always", cache=True, nogil=True)
def _int_end(buf, pos):
    """The position after the msgpack int at ``pos``, or -1."""
    if pos >= len(buf):
        return -1
    s = INT_SIZE[byte_at(buf, pos)]
    if s == 0 or pos + s > len(buf):
        return -1
    return pos + s


@numba.njit(inline="always", cache=True, nogil=True)
def _str_at(buf, pos):
    """``(start, length, end)`` of the ASCII string at ``pos`` (fixstr, str
    8/16/32); ``(0, -1, pos + 1)`` for nil; ``(0, -1, -1)`` otherwise."""
    L = len(buf)
    if pos >= L:
        return 0, -1, -1
    b = byte_at(buf, pos)
    if b == 0xC0:
        return 0, -1, pos + 1
    if 0xA0 <= b <= 0xBF:
        start, n = pos + 1, b - 0xA0
    elif 0xD9 <= b <= 0xDB:
        w = 1 << (b - 0xD9)
        if pos + 1 + w > L:
            return 0, -1, -1
        start, n = pos + 1 + w, read_be(buf, pos + 1, w)
    else:
        return 0, -1, -1
    if start + n > L:
        return 0, -1, -1
    for j in range(start, start + n):
        if buf[j] >= 0x80:  # UTF-8 past ASCII: msgspec's check decides
            return 0, -1, -1
    return start, n, start + n


@numba.njit(inline="always", cache=True, nogil=True)
def _hashes(buf, pos, hash_bytes, words, row):
    """Read the ``block_hashes`` array at ``pos`` into ``words[row:]``:
    ``(end, rows)``, or ``(-1, 0)`` unless it is one of
    ``raw_hash_words``' layouts (every hash a uint 64 for 8-byte keys, or
    every hash a bin 8 of ``hash_bytes``), fitting ``words``."""
    L = len(buf)
    n, p = container(buf, pos, 0x90, 0xDC)
    if n < 0 or row + n > words.shape[0]:
        return -1, 0
    if n == 0:
        return p, 0
    w = words.shape[1]
    if hash_bytes == 8 and p < L and buf[p] == 0xCF:
        if p + 9 * n > L:
            return -1, 0
        for i in range(n):
            q = p + 9 * i
            if byte_at(buf, q) != 0xCF:
                return -1, 0
            words[row + i, 0] = load_le64(buf, q + 1)
        return p + 9 * n, n
    stride = 2 + hash_bytes
    if p + stride * n > L:
        return -1, 0
    for i in range(n):
        q = p + stride * i
        if buf[q] != 0xC4 or buf[q + 1] != hash_bytes:
            return -1, 0
        for k in range(w):
            words[row + i, k] = load_le64(buf, q + 2 + 8 * k)
    return p + stride * n, n


@numba.njit(inline="always", cache=True, nogil=True)
def _bytes_equal(buf, pos, spec, row, n):
    """Whether ``buf[pos:pos + n]`` (in bounds) is the string of ``spec``'s
    ``row`` (``n`` bytes as little-endian words from column 3, zero-padded),
    compared a word at a time where the payload has 8 bytes to read."""
    if pos + n + 8 > len(buf):  # its last bytes: a byte at a time
        for j in range(n):
            w = spec[row, 3 + (j >> 3)]
            if np.int64(buf[pos + j]) != (w >> (8 * (j & 7))) & 0xFF:
                return False
        return True
    k = 0
    while k < n:
        w = load_le64(buf, pos + k)
        if n - k < 8:
            w &= (np.int64(1) << (8 * (n - k))) - 1
        if w != spec[row, 3 + (k >> 3)]:
            return False
        k += 8
    return True


@numba.njit(inline="always", cache=True, nogil=True)
def _key_equal(buf, pos, spec, row):
    """Whether the ``spec[row, 0]`` bytes at ``pos`` (in bounds) are the
    name of field ``row``: four words compared under the row's masks (from
    column ``3 + spec[0, 4]``) with one branch, where the payload has 32
    bytes to read (a key, its value and the next key or the end of the
    batch follow it almost always); byte by byte otherwise."""
    if pos + 32 > len(buf):
        return _bytes_equal(buf, pos, spec, row, spec[row, 0])
    m = 3 + spec[0, 4]
    d = (load_le64(buf, pos) & spec[row, m]) ^ spec[row, 3]
    d |= (load_le64(buf, pos + 8) & spec[row, m + 1]) ^ spec[row, 4]
    d |= (load_le64(buf, pos + 16) & spec[row, m + 2]) ^ spec[row, 5]
    d |= (load_le64(buf, pos + 24) & spec[row, m + 3]) ^ spec[row, 6]
    return d == 0


@numba.njit(inline="always", cache=True, nogil=True)
def _value(buf, pos, kind, spec):
    """The position after the value at ``pos`` of a field of ``kind``
    (other than the hashes), or -1 where it is not of that kind; the group
    id (or -1 for nil) is the second item for a group field."""
    L = len(buf)
    if pos >= L:
        return -1, -1
    b = byte_at(buf, pos)
    nil = b == 0xC0
    if kind == _TAG:
        # Exactly the tag's fixstr (spec row 1): any other event goes the
        # general way.
        n = spec[1, 0]
        if (
            b != 0xA0 + n
            or pos + 1 + n > L
            or not _bytes_equal(buf, pos + 1, spec, 1, n)
        ):
            return -1, -1
        return pos + 1 + n, -1
    if kind == _NIL:
        return (pos + 1 if nil else -1), -1
    if kind == _INT:
        return _int_end(buf, pos), -1
    if kind == _INT_OR_NIL:
        return (pos + 1 if nil else _int_end(buf, pos)), -1
    if kind == _HASH_OR_NIL:
        if nil:
            return pos + 1, -1
        if b == 0xC4:
            if pos + 2 > L:
                return -1, -1
            end = pos + 2 + np.int64(buf[pos + 1])
            return (end if end <= L else -1), -1
        return _int_end(buf, pos), -1
    if kind == _STR_OR_NIL:
        return _str_at(buf, pos)[2], -1
    if kind == _INTS:
        n, p = container(buf, pos, 0x90, 0xDC)
        if n < 0:
            return -1, -1
        if n >= 64:
            return walk_ints(buf, p, n), -1
        # A few ints (a block's, from vLLM's store connector): one by one,
        # each int's size from its first byte by arithmetic, not a table.
        for _ in range(n):
            if p >= L:
                return -1, -1
            c = byte_at(buf, p)
            if c <= 0x7F or c >= 0xE0:
                p += 1
            elif 0xCC <= c <= 0xD3:
                p += 1 + (np.int64(1) << (c & 3))
            else:
                return -1, -1
        return (p if p <= L else -1), -1
    if kind == _GROUP:
        if nil:
            return pos + 1, -1
        end = _int_end(buf, pos)
        if end < 0 or b >= 0xD0 or (b == 0xCF and buf[pos + 1] >= 0x80):
            # Signed forms (negative fixints, int 8-64) and past int64:
            # plan_events decides.
            return -1, -1
        return end, (b if b <= 0x7F else read_be(buf, pos + 1, end - pos - 1))
    return -1, -1


@numba.njit(cache=True, nogil=True)
def scan_stored(buf, spec, hash_bytes, default_gid, out):
    """Read a msgpack ``KVEventBatch`` of ``BlockStored`` events into runs of
    packed keys.

    Args:
        buf: the payload, bytes or uint8 ``[L]``.
        spec: int64 ``[2 + F + M, 3 + K + 4]``, ``K >= 4``
            (``bindings/kv_event_scan.stored_spec``): row 0 ``F``, ``M``
            (-1: every medium taken), the field index of ``medium``, the
            bit mask of the fields msgspec requires, ``K``; row 1 the tag
            (``BlockStored``): its length, 0, 0, the name; rows ``2..F +
            1`` a schema field each: its name's length, its
            :data:`FIELD_KINDS` code, 0, the name, then four words masking
            the name's bytes (:func:`_key_equal`); rows after them a medium
            taken each: its length, 0, 0, the name. A name is its bytes as
            ``K`` little-endian int64 words, zero-padded.
        hash_bytes: the index's key width (a multiple of 8).
        default_gid: the group id of an event without ``group_idx``.
        out: int64 ``[R + X, W]``, C-contiguous, ``R = L // 9 + 1`` (no
            hash takes less than 9 bytes), ``W = hash_bytes // 8``: rows
            ``:R`` get the hashes taken, as packed words; rows ``R:``, read
            flat, the events taken, the events skipped (their medium not
            taken), then the runs of stores, each a group id and its rows
            of the words (``lo, hi``). Consecutive taken events of one group
            are one run, as adding them in order is adding their keys at
            once. ``X`` rows hold ``(X W - 2) // 3`` runs (more events go the
            general way).

    Returns ``(runs, taken, skipped, gid, lo, hi)``, the last three the
    first run's (anything when there is none); ``runs`` -1 where the
    payload is not read in full (the caller takes the general path; ``out``
    is partly written then).
    """
    # Views counting no references (kernels/numba_views.py): the caller
    # holds the arguments for the call.
    buf = unowned(buf)
    spec = unowned(spec)
    out = unowned(out)
    L = len(buf)
    F = spec[0, 0]
    M = spec[0, 1]
    medium = spec[0, 2]
    required = spec[0, 3]
    R = L // 9 + 1
    words = out[:R]
    runs = out[R:].reshape(-1)
    n_top, pos = container(buf, 0, 0x90, 0xDC)
    if n_top < 2 or n_top > 3 or pos + 9 > L or buf[pos] != 0xCB:
        return _GAVE_UP
    pos += 9
    n_ev, pos = container(buf, pos, 0x90, 0xDC)
    if n_ev < 0 or 2 + 3 * n_ev > runs.shape[0]:
        return _GAVE_UP
    row = 0
    n_runs = 0
    taken = 0
    skipped = 0
    for _ in range(n_ev):
        n_keys, pos = container(buf, pos, 0x80, 0xDE)
        if n_keys < 0 or n_keys > F:
            return _GAVE_UP
        seen = 0
        last = -1
        gid = default_gid
        at = 0
        size = -1
        lo = row
        for _ in range(n_keys):
            # The key: a fixstr naming a field not seen yet in this event.
            if pos >= L:
                return _GAVE_UP
            b = byte_at(buf, pos)
            if b < 0xA0 or b > 0xBF:
                return _GAVE_UP
            n = b - 0xA0
            pos += 1
            if pos + n > L:
                return _GAVE_UP
            # vLLM writes the fields in the schema's order, leaving out
            # those at their defaults: the search starts after the last one.
            f = -1
            for k in range(F):
                c = last + 1 + k
                if c >= F:
                    c -= F
                if spec[2 + c, 0] == n and _key_equal(buf, pos, spec, 2 + c):
                    f = c
                    break
            last = f
            if f < 0 or (seen >> f) & 1:
                return _GAVE_UP
            seen |= 1 << f
            pos += n
            kind = spec[2 + f, 1]
            if kind == _HASHES:
                pos, got = _hashes(buf, pos, hash_bytes, words, row)
                row += got
            elif f == medium:
                at, size, pos = _str_at(buf, pos)
            else:
                pos, g = _value(buf, pos, kind, spec)
                if kind == _GROUP and g >= 0:
                    gid = g
            if pos < 0:
                return _GAVE_UP
        if seen & required != required:
            return _GAVE_UP
        take = M < 0
        if size >= 0:
            for m in range(M):
                r = 2 + F + m
                if spec[r, 0] == size and _bytes_equal(buf, at, spec, r, size):
                    take = True
                    break
        if not take:
            skipped += 1
            row = lo  # its hashes are dropped
            continue
        taken += 1
        if row > lo:
            last_run = 3 * n_runs - 1  # the previous run's gid at [+0]
            if n_runs and runs[last_run] == gid and runs[last_run + 2] == lo:
                runs[last_run + 2] = row
            else:
                at_run = 2 + 3 * n_runs
                runs[at_run] = gid
                runs[at_run + 1] = lo
                runs[at_run + 2] = row
                n_runs += 1
    if n_top == 3:
        # data_parallel_rank: int or nil.
        if pos < L and buf[pos] == 0xC0:
            pos += 1
        else:
            pos = _int_end(buf, pos)
    if pos != L:
        return _GAVE_UP
    runs[0] = taken
    runs[1] = skipped
    return n_runs, taken, skipped, runs[2], runs[3], runs[4]


def warm_up(spec: np.ndarray) -> None:
    """Load (or compile) :func:`scan_stored` for bytes and a spec
    (``bindings/kv_event_scan.stored_spec``), once per process."""
    global _warm
    if _warm:
        return
    payload = b"\x92\xcb" + bytes(8) + b"\x90"
    if scan_stored(payload, spec, 8, 0, np.empty((8, 1), dtype=np.int64))[0] != 0:
        raise AssertionError("event_plan_numba.scan_stored failed its warm-up")
    _warm = True
