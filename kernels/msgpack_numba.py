"""msgpack read by numba kernels: the headers and ints the event scan walks,
and a batch of lists of ints read back into int64 arrays.

:func:`unpack_int_lists` is ``HashBatch.from_ints``' fast path for a batch of
lists of Python ints (``coordinator/int_lists.py``): msgspec writes the batch
as msgpack in one C pass (~4 ns per int), each item as what it is, so a bool
is msgpack's true or false and never an int, and a float, None or a string
is its own kind; this kernel reads the bytes back as the batch's offsets,
lengths and values, and refuses (returns -1) anything that is not exactly
an array of arrays of ints in int64. It replaces a type scan (or struct's
conversion plus a search for the 0s and 1s a bool could be) by one pass over
a few bytes per int.

Importing this module imports numba; the numba kernel families' warm-ups
(``scan_numba``, ``hash_index_numba``) load it with their own kernels, and
the coordinator then finds it loaded.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.numba_entry import compiled_entry
from kvhit.kernels.numba_views import byte_at, load_be64

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = [
    "INT_SIZE",
    "container",
    "loaded",
    "read_be",
    "unpack_entry",
    "unpack_int_lists",
    "unpack_step",
    "warm_up",
]

#: Bytes of a msgpack int by its first byte; 0 where the byte starts
#: anything else (positive and negative fixint 1, uint/int 8-64 2-9).
INT_SIZE = np.zeros(256, dtype=np.int64)
INT_SIZE[:0x80] = 1
INT_SIZE[0xE0:] = 1
for _head, _size in ((0xCC, 2), (0xCD, 3), (0xCE, 5), (0xCF, 9)):
    INT_SIZE[_head] = INT_SIZE[_head + 4] = _size  # uint N and int N
#: By a msgpack int's first byte, how far right :func:`unpack_int_lists`
#: shifts the big-endian word read at its value's bytes (at the int for a
#: fixint, one byte past it otherwise) to leave the value: 64 less its bits.
_SHIFT = np.zeros(256, dtype=np.int64)
#: And the mask that shift's sign extension is cut to: the value's bits for
#: uint 8-32, all bits for the signed kinds (fixints, int 8-64), whose
#: arithmetic shift is the sign extension, and for uint 64 (past int64 it
#: reads negative, and is refused).
_MASK = np.full(256, -1, dtype=np.int64)
_SHIFT[:0x80] = _SHIFT[0xE0:] = 56
for _head, _bits in ((0xCC, 8), (0xCD, 16), (0xCE, 32), (0xCF, 64)):
    _SHIFT[_head] = _SHIFT[_head + 4] = 64 - _bits
    if _bits < 64:
        _MASK[_head] = (1 << _bits) - 1
# Whether warm_up() ran in this process.
_warm = False


@numba.njit(inline="always", cache=True, nogil=True)
def read_be(buf, pos, width):
    """The big-endian unsigned int of ``width`` bytes at ``pos`` (in bounds),
    as int64 (8 bytes wrap to the two's-complement value)."""
    v = 0
    for j in range(width):
        v = (v << 8) | np.int64(buf[pos + j])
    return v


@numba.njit(inline="always", cache=True, nogil=True)
def container(buf, pos, fix, w16):
    """``(items, position of the first)`` of the array (``fix`` 0x90,
    ``w16`` 0xdc) or map (0x80, 0xde) header at ``pos``, or ``(-1, -1)``.
    ``buf``: uint8 array or bytes."""
    L = len(buf)
    if pos >= L:
        return -1, -1
    b = np.int64(buf[pos])
    if fix <= b <= fix + 0x0F:
        return b - fix, pos + 1
    if b == w16 or b == w16 + 1:
        w = 2 if b == w16 else 4
        if pos + 1 + w > L:
            return -1, -1
        return read_be(buf, pos + 1, w), pos + 1 + w
    return -1, -1


@numba.njit(inline="always", cache=True, nogil=True)
def _int_near_end(msg, p, L):
    """``(value, size)`` of the msgpack int at ``p`` (``p < L``) read byte by
    byte, for the last ints of ``msg``, where ``numba_views.load_be64``
    would read past its end; ``(0, -1)`` for anything but an int in int64
    or an int cut short."""
    c = byte_at(msg, p)
    s = INT_SIZE[c]
    if s == 1:
        # Positive fixint 0-127, negative fixint 0xe0-0xff: -32..-1.
        return (c if c <= 0x7F else c - 256), 1
    if s == 0 or p + s > L or (c == 0xCF and byte_at(msg, p + 1) >= 0x80):
        # Not an int, cut short, or a uint64 past int64.
        return 0, -1
    v = read_be(msg, p + 1, s - 1)
    if c >= 0xD0:
        # int 8-32: sign-extend (int 64's 8 bytes already are).
        sh = 72 - 8 * s
        v = (v << sh) >> sh
    return v, s


@numba.njit(cache=True, nogil=True)
def unpack_int_lists(msg, out):
    """Read ``msg`` (bytes: msgpack of an array of ``B`` arrays of ints) into
    ``out`` (int64 ``[2 B + 1 + n']``, ``n' >= n``): ``out[:B + 1]`` the CSR
    offsets, ``out[B + 1:2 B + 1]`` the lengths, ``out[2 B + 1:][:n]`` the
    ``n`` values in order. Returns ``n``, or -1 when ``msg`` is anything
    else: an item that is not an int (a bool, float, nil, string, array,
    map, ext), a uint64 past int64, a header or int running past the end,
    bytes after the last array, or more values than ``out`` holds. ``out``
    is partly written then; the caller reads nothing of it."""
    L = len(msg)
    b, p = container(msg, 0, 0x90, 0xDC)
    base = 2 * b + 1
    cap = out.shape[0]
    if b < 0 or base > cap:
        return -1
    k = base
    out[0] = 0
    for i in range(b):
        m, p = container(msg, p, 0x90, 0xDC)
        if m < 0 or k + m > cap:
            return -1
        for _ in range(m):
            if p + 9 <= L:
                # Every int's value is one 8-byte big-endian load, shifted
                # and masked by its first byte's entries: no branch on the
                # int's width, which varies from int to int (a trace's
                # block ids, 0 to about a million, are 3 or 5 bytes about
                # equally often: a branch per width mispredicts).
                c = byte_at(msg, p)
                s = INT_SIZE[c]
                if s == 0:
                    return -1  # not an int
                v = (load_be64(msg, p + 1 if s > 1 else p) >> _SHIFT[c]) & _MASK[c]
                if v < 0 and c == 0xCF:
                    return -1  # a uint64 past int64
            elif p < L:
                v, s = _int_near_end(msg, p, L)
                if s < 0:
                    return -1
            else:
                return -1
            # k < cap (checked for the list): no wraparound either.
            out[np.uint64(k)] = v
            k += 1
            p += s
        out[1 + i] = k - base
        out[b + 1 + i] = m
    if p != L:
        return -1
    return k - base


@numba.njit(inline="always", cache=True, nogil=True)
def unpack_step(msg, extra):
    """A router's step read back: ``msg`` the msgpack of ``B + 1`` lists of
    ints, ``B`` requests' keys then their ``B`` lengths (what
    ``coordinator/int_lists.encode_step`` writes), into one new int64 array
    ``out`` of ``2 (B + 1) + 1 + len(msg) + extra`` items in
    :func:`unpack_int_lists`' layout for ``B + 1`` lists (``extra`` spare
    items at its end): the requests' offsets ``out[:B]`` and lengths
    ``out[B + 2 : 2 B + 2]``, their ``t = out[B]`` keys from ``out[2 B +
    3]`` on, then the ``B`` lengths. Returns ``(B, out)``, or ``(-1, out)``
    (nothing in ``out`` to read) for any other message: not a list of lists
    of ints in int64, a last list of another length than ``B``, or a
    negative length. The one reading of the message for
    ``kernels/scan_numba_lists.lists_hits`` and
    ``kernels/fleet_numba.full_lists_hits``."""
    nb, _ = container(msg, 0, 0x90, 0xDC)
    if nb < 1:
        return -1, np.empty(extra, dtype=np.int64)
    base = 2 * nb + 1
    # Every msgpack int takes a byte at least: len(msg) values always fit.
    end = base + len(msg)
    out = np.empty(end + extra, dtype=np.int64)
    if unpack_int_lists(msg, out[:end]) < 0:
        return -1, out
    b = nb - 1
    t = out[b]
    if out[nb] - t != b:
        return -1, out
    for i in range(base + t, base + t + b):
        if out[i] < 0:
            return -1, out
    return b, out


def warm_up() -> None:
    """Load (or compile) :func:`unpack_int_lists` for bytes, so that the
    first batch of a process does not pay for it. Once per process."""
    global _warm
    if _warm:
        return
    out = np.empty(8, dtype=np.int64)
    # [[1, -1]]
    if unpack_int_lists(b"\x91\x92\x01\xff", out) != 2:
        raise AssertionError("msgpack_numba.unpack_int_lists failed its warm-up")
    _warm = True


def loaded() -> bool:
    """Whether :func:`warm_up` ran in this process (the decoder is loaded)."""
    return _warm


def unpack_entry() -> Callable[[bytes, np.ndarray], int]:
    """:func:`unpack_int_lists`' compiled wrapper for ``bytes`` and a
    C-contiguous int64 array (``numba_entry.compiled_entry``), for
    ``coordinator/int_lists.py``, which hands it only msgspec's bytes and an
    array it made."""
    return compiled_entry(unpack_int_lists, b"", np.empty(1, dtype=np.int64))
