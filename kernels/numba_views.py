"""Intrinsics the numba kernels share: array views that count no
references, one-load reads of 8 bytes, and unsigned byte reads.

numba counts every copy of an array it passes to an ``inline="always"``
helper (and every view it makes of one) with an atomic ``NRT_incref`` /
``NRT_decref`` pair, and its refcount pruning leaves many of those pairs
inside a kernel's loop. Measured on the shared 2-core box, they took more
of a KV-event scan's time than the scan itself (370 -> 160 ns an event
once gone), and most of a fleet call's (B = 64, E = 8, warm: 42-46 -> 12-19
us). A kernel takes :func:`unowned` views of the arrays its caller holds for
the whole call, and of nothing else.

Importing this module imports numba.
"""

from __future__ import annotations

import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kvhit.kernels.numba_cache import lock_cache_saves

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = ["byte_at", "load_be64", "load_le64", "unowned"]

# Whether this machine stores an int64 as its little-endian bytes (x86,
# aarch64): then a load is load_le64's word, and load_be64 swaps it.
_LITTLE_ENDIAN = sys.byteorder == "little"


def _bytes_like(buf: types.Type) -> bool:
    # bytes or a 1-D C-contiguous uint8 array: ``data + pos`` is its pos-th
    # byte.
    return (
        getattr(buf, "dtype", None) == types.uint8
        and getattr(buf, "layout", "") == "C"
        and getattr(buf, "ndim", 0) == 1
    )


def _load_word(context, builder, signature, args):  # noqa: ANN001, ANN202
    # The 8 bytes at data + pos as one unaligned int64 load.
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    at = context.cast(builder, args[1], signature.args[1], types.intp)
    word = builder.bitcast(builder.gep(data, [at]), ir.IntType(64).as_pointer())
    return builder.load(word, align=1)


def _loader(big_endian: bool):  # noqa: ANN202
    # The codegen of one load of 8 bytes, swapped where the machine's order
    # is not the one asked for.
    swap = big_endian == _LITTLE_ENDIAN

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
        got = _load_word(context, builder, signature, args)
        return builder.bswap(got) if swap else got

    return codegen


@intrinsic
def load_le64(typingctx, buf, pos):
    """The little-endian int64 of the 8 bytes at ``buf``'s ``pos`` (in
    bounds, the caller's to check), ``buf`` bytes or a 1-D C-contiguous
    uint8 array (any other layout does not compile): one unaligned load
    (and a byte swap on a big-endian machine). LLVM combines a loop of byte
    loads into such a load only in part (some stay 8 loads, shifted and
    or-ed)."""
    if not _bytes_like(buf):
        return None
    return types.int64(buf, pos), _loader(False)


@intrinsic
def load_be64(typingctx, buf, pos):
    """The big-endian int64 of the 8 bytes at ``buf``'s ``pos`` (as
    :func:`load_le64`): one unaligned load and a byte swap (movbe on x86),
    where a loop over a width known only at run time is loads, shifts and
    ors."""
    if not _bytes_like(buf):
        return None
    return types.int64(buf, pos), _loader(True)


@intrinsic
def unowned(typingctx, a):
    """``a`` (bytes, an array or an ``array.array``) as a view that holds no
    reference: the same struct with no meminfo (and no parent object), so
    the copies numba makes of it count no references.

    Only for an array the kernel's caller keeps alive for the whole call (an
    argument, or an array a launcher allocated and holds); the view is never
    returned or stored. An array the kernel allocates itself is freed after
    its last use in numba's IR, which a view does not count as one."""
    if not isinstance(a, types.Buffer):  # bytes and arrays are buffers
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ary.meminfo = ir.Constant(ary.meminfo.type, None)
        ary.parent = ir.Constant(ary.parent.type, None)
        return ary._getvalue()

    return a(a), codegen


@numba.njit(inline="always", cache=True, nogil=True)
def byte_at(buf, pos):
    """``buf[pos]`` as int64, ``pos`` in ``[0, len(buf))`` (checked by the
    caller, never negative): indexed unsigned, so numba adds no wraparound
    for a negative index, two instructions less on the chain of positions a
    byte stream is read along (a payload's token ids one after another)."""
    return np.int64(buf[np.uint64(pos)])
