"""A vLLM KV-event payload without its token ids, found by a numba scan.

The follower decodes ``BlockStored`` with ``token_ids`` as ``msgspec.Raw``
(``bindings/kv_events.py``), yet msgspec still walks every token id to find
where the field ends: 16 ids a block, the most of a large event's decode.
:func:`strip_token_ids` finds those ends itself, faster (a msgpack int's
size is in its first byte, and four walks run side by side: a walk is a
chain of dependent loads, see :func:`walk_ints`), and copies the payload
with each event's ``token_ids`` array replaced by an empty one; msgspec then
decodes the copy, and validates everything else in it as before.

Only a value this scan fully reads as an array of msgpack ints is replaced,
so the copy decodes to the same events (``token_ids`` is ``Raw``: its bytes
are not read) and is refused exactly where the payload is: anything the
scan does not follow (a payload that is not an array of at least two items
with an array second, a ``token_ids`` array holding a non-int, bytes past
the end) makes it hand back nothing, and the payload is decoded as it came.

Importing this module imports numba; ``bindings/kv_events.py`` imports it on
the first payload large enough to pay for the scan.
"""

from __future__ import annotations

import numba
import numpy as np

from kvhit.kernels.msgpack_numba import INT_SIZE, container, read_be
from kvhit.kernels.numba_cache import lock_cache_saves

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = ["strip_token_ids", "walk_ints", "warm_up"]

#: A side-by-side walk's step by a byte (see :func:`_chain`): the int's size,
#: or 1 where the byte starts no int.
_STEP = np.where(INT_SIZE == 0, 1, INT_SIZE)
#: The map key ``"token_ids"`` as msgpack writes it (a fixstr).
_KEY = np.frombuffer(b"\xa9token_ids", dtype=np.uint8).copy()
#: Bytes each of the four side-by-side walks covers per round.
_SPAN = 256
# Whether warm_up() ran in this process.
_warm = False


# Counts as int64 values, not literals: each literal count (Literal[int](1),
# Literal[int](2)) would compile _skip once more on a fresh machine.
_ONE = np.int64(1)
_TWO = np.int64(2)


@numba.njit(cache=True, nogil=True)
def _skip(buf, pos, count):
    """The position after ``count`` msgpack values from ``pos``, or -1 when
    they run past the end or hold a byte that starts no value (0xc1)."""
    L = len(buf)
    left = count
    while left > 0:
        if pos >= L:
            return -1
        b = np.int64(buf[pos])
        left -= 1
        if b <= 0x7F or b >= 0xE0:  # fixint
            pos += 1
        elif b <= 0x8F:  # fixmap
            left += 2 * (b & 0x0F)
            pos += 1
        elif b <= 0x9F:  # fixarray
            left += b & 0x0F
            pos += 1
        elif b <= 0xBF:  # fixstr
            pos += 1 + (b & 0x1F)
        elif b == 0xC1:
            return -1
        elif b <= 0xC3:  # nil, false, true
            pos += 1
        elif b <= 0xC6 or (0xD9 <= b <= 0xDB):  # bin / str 8, 16, 32
            w = 1 << ((b - 0xC4) if b <= 0xC6 else (b - 0xD9))
            if pos + 1 + w > L:
                return -1
            pos += 1 + w + read_be(buf, pos + 1, w)
        elif b <= 0xC9:  # ext 8, 16, 32: length, type, data
            w = 1 << (b - 0xC7)
            if pos + 1 + w > L:
                return -1
            pos += 2 + w + read_be(buf, pos + 1, w)
        elif b == 0xCA:  # float 32
            pos += 5
        elif b == 0xCB:  # float 64
            pos += 9
        elif b <= 0xD3:  # uint / int 8-64
            pos += INT_SIZE[b]
        elif b <= 0xD8:  # fixext 1-16: type, data
            pos += 2 + (1 << (b - 0xD4))
        else:  # array 16/32, map 16/32
            w = 2 if b == 0xDC or b == 0xDE else 4
            if pos + 1 + w > L:
                return -1
            n = read_be(buf, pos + 1, w)
            left += n if b <= 0xDD else 2 * n
            pos += 1 + w
    return pos if pos <= L else -1


@numba.njit(inline="always", cache=True, nogil=True)
def _ints_from(buf, p, n, stop):
    """Walk msgpack ints from ``p``: ``n`` of them at most, until ``p >=
    stop``. ``(p, ints walked)``, or ``(-1, 0)`` on a non-int or past the
    end of ``buf``."""
    L = len(buf)
    c = 0
    while c < n and p < stop:
        if p >= L:
            return -1, 0
        s = INT_SIZE[buf[p]]
        if s == 0:
            return -1, 0
        p += s
        c += 1
    if p > L:
        return -1, 0
    return p, c


@numba.njit(inline="always", cache=True, nogil=True)
def _chain(buf, q, stop, c, bad):
    """One step of a side-by-side walk (``q`` < ``stop`` in bounds):
    ``(q, count, bad)`` after it. A byte that starts no int is stepped over
    as one byte and its position kept in ``bad``: a walk that starts inside
    an int often lands on such a byte before it falls in step with the true
    walk (a payload byte of a uint 16 is 0x80-0xcb a quarter of the time),
    and stopping there sent the span to the one-by-one walk; the walk's
    count is used only from a meeting point past ``bad`` (:func:`walk_ints`)."""
    if q < stop:
        x = buf[q]
        if INT_SIZE[x] == 0:
            bad = q
        return q + _STEP[x], c + 1, bad
    return q, c, bad


@numba.njit(inline="always", cache=True, nogil=True)
def _meet(buf, a, b, limit):
    """Walk ints from ``a`` (the true walk) and, as :func:`_chain` steps,
    from ``b`` until both stand on one position: ``(it, steps from a, steps
    from b)``; ``(-1, 0, 0)`` past ``limit`` (in bounds) or on a non-int of
    the true walk. From there the two walks are one."""
    ca = 0
    cb = 0
    while a != b:
        if a > limit or b > limit:
            return -1, 0, 0
        if a < b:
            s = INT_SIZE[buf[a]]
            if s == 0:
                return -1, 0, 0
            a += s
            ca += 1
        else:
            b += _STEP[buf[b]]
            cb += 1
    return a, ca, cb


@numba.njit(cache=True, nogil=True)
def walk_ints(buf, p, n):
    """The position after ``n`` msgpack ints from ``p``, or -1 when one is
    not an int or they run past the end.

    Each round walks four spans of ``_SPAN`` bytes at once: the first from
    ``p`` (where an int starts), the others from the span's first byte,
    which may fall inside an int. Where the walk from the previous span's
    true end meets a span's own walk (a few ints in, :func:`_meet`) past
    every byte the span's walk stepped over as a non-int (:func:`_chain`),
    the two are one from there, so that walk's count is exact; where they
    do not meet soon, or meet before such a byte (a non-int of the array,
    or the array's end), the span is walked again from its true start. The
    span where the ``n``-th int ends is walked again exactly."""
    L = len(buf)
    done = 0
    while done < n:
        left = n - done
        if left < 64 or p + 4 * _SPAN + 16 > L:
            q, c = _ints_from(buf, p, left, L + 1)
            return q if q >= 0 and c == left else -1
        s1 = p + _SPAN
        s2 = s1 + _SPAN
        s3 = s2 + _SPAN
        s4 = s3 + _SPAN
        q0, q1, q2, q3 = p, s1, s2, s3
        c0 = c1 = c2 = c3 = 0
        b0 = b1 = b2 = b3 = -1
        while q0 < s1 or q1 < s2 or q2 < s3 or q3 < s4:
            q0, c0, b0 = _chain(buf, q0, s1, c0, b0)
            q1, c1, b1 = _chain(buf, q1, s2, c1, b1)
            q2, c2, b2 = _chain(buf, q2, s3, c2, b2)
            q3, c3, b3 = _chain(buf, q3, s4, c3, b3)
        if b0 >= 0 or c0 >= left:
            # A non-int in the first span, or the array ends in it.
            q, c = _ints_from(buf, p, left, L + 1)
            return q if q >= 0 and c == left else -1
        cur = q0
        total = c0
        for k in range(1, 4):
            if k == 1:
                start, end, cnt, bad = s1, q1, c1, b1
            elif k == 2:
                start, end, cnt, bad = s2, q2, c2, b2
            else:
                start, end, cnt, bad = s3, q3, c3, b3
            add = -1
            nxt = -1
            m, ca, cb = _meet(buf, cur, start, start + 64)
            if m > bad and cb <= cnt:
                add = ca + cnt - cb
                nxt = end
            if add < 0:
                nxt, add = _ints_from(buf, cur, left - total, start + _SPAN)
                if nxt < 0:
                    return -1
            if total + add >= left:
                q, c = _ints_from(buf, cur, left - total, L + 1)
                return q if q >= 0 and c == left - total else -1
            total += add
            cur = nxt
        done += total
        p = cur
    return p


@numba.njit(cache=True, nogil=True)
def _token_ranges(buf, key):
    """``(spans, found)``: the ``(start, end)`` of every event's
    ``token_ids`` value that is an array of ints in ``spans[:found]`` (int64
    ``[E, 2]``); ``found`` -1 where the payload is not followed to its last
    byte."""
    L = buf.shape[0]
    spans = np.empty((0, 2), dtype=np.int64)
    n_top, pos = container(buf, 0, 0x90, 0xDC)
    if n_top < 2:
        return spans, -1
    pos = _skip(buf, pos, _ONE)  # ts
    if pos < 0:
        return spans, -1
    n_ev, pos = container(buf, pos, 0x90, 0xDC)
    # (An event takes at least a byte: more cannot be there.)
    if n_ev < 0 or n_ev > L:
        return spans, -1
    spans = np.empty((n_ev, 2), dtype=np.int64)
    found = 0
    for _ in range(n_ev):
        n_keys, after = container(buf, pos, 0x80, 0xDE)
        if n_keys < 0:  # not a map: msgspec refuses it
            pos = _skip(buf, pos, _ONE)
            if pos < 0:
                return spans, -1
            continue
        pos = after
        for _ in range(n_keys):
            is_key = pos + 10 <= L
            j = 0
            while is_key and j < 10:
                is_key = buf[pos + j] == key[j]
                j += 1
            if is_key:
                pos += 10
                n_ints, first = container(buf, pos, 0x90, 0xDC)
                if n_ints >= 0:
                    end = walk_ints(buf, first, n_ints)
                    if end >= 0:
                        spans[found, 0] = pos
                        spans[found, 1] = end
                        found += 1
                        pos = end
                        continue
                pos = _skip(buf, pos, _ONE)
            else:
                pos = _skip(buf, pos, _TWO)
            if pos < 0:
                return spans, -1
    pos = _skip(buf, pos, n_top - 2)
    return spans, (found if pos == L else -1)


@numba.njit(cache=True, nogil=True)
def _strip(buf, out):
    """Write :func:`strip_token_ids`' copy of ``buf`` into ``out`` (uint8,
    as long as ``buf``); its length, or -1 when there is nothing to replace
    or the scan stopped."""
    spans, found = _token_ranges(buf, _KEY)
    if found <= 0:
        return -1
    src = 0
    dst = 0
    for i in range(found):
        a = spans[i, 0]
        out[dst : dst + a - src] = buf[src:a]
        dst += a - src
        out[dst] = 0x90  # an empty array
        dst += 1
        src = spans[i, 1]
    out[dst : dst + buf.shape[0] - src] = buf[src:]
    return dst + buf.shape[0] - src


def strip_token_ids(payload: bytes | bytearray | memoryview) -> np.ndarray | None:
    """``payload`` (a msgpack ``KVEventBatch``) with every event's
    ``token_ids`` array of ints replaced by an empty array: uint8 ``[m]``,
    which msgspec decodes as it decodes bytes; None when no such array was
    found or the scan did not follow the payload to its end (decode the
    payload itself: it is refused there, or has nothing to drop)."""
    buf = np.frombuffer(payload, dtype=np.uint8)
    # Made here, not in the kernel: a numba array handed back costs more.
    out = np.empty(buf.shape[0], dtype=np.uint8)
    m = _strip(buf, out)
    return out[:m] if m >= 0 else None


def warm_up() -> None:
    """Load (or compile) the scan, so that the first large event of a
    process does not pay for it. Once per process."""
    global _warm
    if _warm:
        return
    # [ts, [{"token_ids": [1, 2]}]]
    strip_token_ids(b"\x92\x00\x91\x81\xa9token_ids\x92\x01\x02")
    _warm = True
