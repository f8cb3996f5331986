"""``HashBatch.from_ints``' path for a batch of lists of Python ints, once a
numba engine or index has loaded its kernels.

msgspec writes the batch as msgpack in one C pass, each item as what it is
(a bool as true or false, never as an int), and the numba kernel
``kernels/msgpack_numba.unpack_int_lists`` reads the bytes back as int64
offsets, lengths and values, refusing anything but ints in int64. Cold, as
a router meets a step, this touches a fraction of the code the struct path
does (struct, then numpy's search for the 0s and 1s a bool could be): a
step of 64 conversation requests (1,512 ints) packs in 54 us against
116 us cold (caches evicted), 20 against 43 warm; 3 requests in 3 us
against 8, 1,024 in 264 against 476.

:func:`int_list` reads one request's list the same way (``from_ints`` of
one list of 20 ints or more; a shorter one, or one where the decoder is not
loaded, takes a type scan and ``np.array``).

Where it does not apply (the kernel not loaded, a batch msgspec cannot
write, a numpy integer or a value past int64 in it), :func:`int_lists`
answers None and ``from_ints`` takes its struct path, which converts or
names the bad item as before. Everything msgspec writes as an int is taken
by its value, as ``operator.index`` takes it: ints, int subclasses
(``IntEnum``), and also an ``Enum`` member whose value is an int (msgspec
writes enums by value), which the struct path refuses.

The decoder is used once a numba kernel family has loaded it with its own
kernels (``warm_up`` of ``kernels/scan_numba.py`` and
``kernels/hash_index_numba.py``: a numba ``LookupEngine`` or ``KeyIndex``
built with ``warm=True``, the default): this module never imports numba,
and a process that runs only the Triton path never loads it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["decoder_ready", "encode_lists", "encode_step", "int_list", "int_lists"]

_INT64 = np.dtype(np.int64)
# The item types encode_step takes (a frozenset's issuperset over map(type)
# is one C pass).
_LISTS = frozenset((list,))
_INTS = frozenset((int,))
# msgspec's encoder, imported with the decoder: the GPU machine's bare
# checkout has neither msgspec nor numba, and packs through struct.
_encode: Callable[[Any], bytes] | None = None
#: The kernels module, as numba loaded it (see :func:`int_lists`).
_MODULE = "kvhit.kernels.msgpack_numba"
# Its unpack_int_lists once a warm-up loaded it; None until then.
_unpack: Callable[[bytes, np.ndarray], int] | None = None
# Whether msgspec failed to import (the decoder then stays unused).
_no_msgspec = False


def _loaded() -> Callable[[bytes, np.ndarray], int] | None:
    """The decoder, once a numba kernel family's warm-up (the scan's, the
    KeyIndex's) has loaded it with its own kernels; None until then: one
    dict lookup, no import and no compile on a step."""
    global _encode, _unpack, _no_msgspec
    mod = sys.modules.get(_MODULE)
    if mod is not None and mod.loaded() and not _no_msgspec:
        try:
            import msgspec
        except ImportError:
            # Once: a failed import costs tens of us, on every step.
            _no_msgspec = True
            return None
        _encode = msgspec.msgpack.Encoder().encode
        # The compiled entry: kvhit hands it only bytes and its own array.
        _unpack = mod.unpack_entry()
    return _unpack


def decoder_ready() -> bool:
    """Whether :func:`int_lists` has its decoder (see :func:`_loaded`). The
    first call after a kernel family loaded it imports msgspec (5-8 ms cold),
    so the numba warm-ups of ``LookupEngine`` and ``KeyIndex`` (a
    ``FleetIndex``'s entry index among them) call it too: no step pays that
    import."""
    return (_unpack or _loaded()) is not None


def int_lists(requests: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``requests`` (a list of ``B`` lists) as ``(offsets int64 [B + 1],
    lengths int64 [B], values int64 [n])``, views of one new array; None
    when the decoder is not loaded or an item is not an int in int64 (the
    caller's struct path then converts the batch or names the item)."""
    unpack = _unpack or _loaded()
    if unpack is None:
        return None
    try:
        msg = _encode(requests)  # type: ignore[misc]  # set with _unpack
    except Exception:  # noqa: BLE001
        # TypeError (a numpy integer, a tensor), OverflowError (past
        # 2**64), msgspec.EncodeError, RecursionError: the struct path
        # converts or names each.
        return None
    b = len(requests)
    base = 2 * b + 1
    # Sized exactly (len(msg) would bound it, but a 64-bit hash takes 9
    # bytes there: 9x the memory): the kernel refuses more ints than fit.
    out = np.empty(base + sum(map(len, requests)), _INT64)
    n = unpack(msg, out)
    if n < 0:
        return None
    return out[: b + 1], out[b + 1 : base], out[base : base + n]


def int_list(values: list[Any]) -> np.ndarray | None:
    """One request's list of ints as int64 ``[n]`` (a new array), or None
    as :func:`int_lists` answers None: the batch of that one list, with no
    offsets or lengths handed back. From ~20 ints on this is cheaper than a
    type scan and an ``np.array`` (1.44 against 1.61 us at 23 ints, 1.84
    against 3.27 at 64, 2.40 against 5.79 at 128)."""
    unpack = _unpack or _loaded()
    if unpack is None:
        return None
    try:
        msg = _encode((values,))  # type: ignore[misc]  # set with _unpack
    except Exception:  # noqa: BLE001  # as int_lists
        return None
    out = np.empty(3 + len(values), _INT64)
    n = unpack(msg, out)
    if n < 0:
        return None
    return out[3 : 3 + n]


def encode_lists(lists: list[Any]) -> bytes | None:
    """``lists`` as msgpack, msgspec writing each item as what it is (the
    bytes ``kernels/msgpack_numba.unpack_int_lists`` and the kernels built
    on it read), or None when the decoder is not loaded or msgspec cannot
    write an item (a numpy integer, a value past 2**64 or below -2**63):
    the caller then takes its general path."""
    if (_unpack or _loaded()) is None:
        return None
    try:
        return _encode(lists)  # type: ignore[misc]  # set with _unpack
    except Exception:  # noqa: BLE001  # as int_lists
        return None


def encode_step(requests: list[Any], lengths: Any) -> bytes | None:
    """A router's step as one msgpack message, the lists its compiled calls
    read (``kernels/scan_numba_lists.lists_hits``,
    ``kernels/fleet_numba.full_lists_hits``): ``requests`` (``B`` lists),
    then ``lengths`` as one more list. None, nothing encoded, unless
    ``requests`` and every request in it is a ``list`` (msgspec writes a
    set too, in set order, which ``from_ints`` refuses by name) and
    ``lengths`` is a list of exactly ``int`` items (a bool is refused by its
    type, as the general path's check does) or a 1-D integer numpy array;
    and as :func:`encode_lists` answers None. What is encoded is still
    checked by the kernel that reads it (ints in int64, ``B`` lengths, none
    negative)."""
    if type(requests) is not list or (
        not (len(requests) == 1 and type(requests[0]) is list)
        and not _LISTS.issuperset(map(type, requests))
    ):
        # One request tested inline: the type scan costs ~0.15 us.
        return None
    t = type(lengths)
    if t is list:
        if not (len(lengths) == 1 and type(lengths[0]) is int) and not (
            _INTS.issuperset(map(type, lengths))
        ):
            return None
    elif t is np.ndarray and lengths.ndim == 1 and lengths.dtype.kind in "iu":
        # Python ints: past int64 msgspec writes a uint64, which the kernel
        # refuses.
        lengths = lengths.tolist()
    else:
        return None
    return encode_lists(requests + [lengths])
