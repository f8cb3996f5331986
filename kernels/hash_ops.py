"""The launcher signature the three hash-index kernel families share.

``kernels/hash_index.py`` (Triton), ``kernels/hash_index_numba.py`` and
``kernels/hash_index_torch.py`` each export ``find``, ``probe``, ``insert``
and ``erase`` with one signature, ``op(table, W, group_ids, hashes,
trusted)``, so that a KeyIndex calls the family its backend names without
knowing which. :func:`key_op` writes that signature once; a family gives it
the function that does the operation's work. Imports neither triton nor
numba.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["KeyOp", "key_op"]

#: A family's launcher: ``op(table, W, group_ids, hashes, trusted=...)``,
#: table int64 ``[capacity, W + 1]`` (a KeyIndex table), group_ids int64
#: ``[N]``, hashes int64 ``[N, W]``, all contiguous on one device; returns a
#: tensor ``[N]``, one entry per key (see each launcher).
KeyOp = Callable[..., torch.Tensor]


def key_op(
    name: str, doc: str, work: KeyOp, *, trusted_by_default: bool = False
) -> KeyOp:
    """The launcher ``name`` of a family (documented by ``doc``): the shared
    signature, calling ``work(table, W, group_ids, hashes, trusted)``.

    ``trusted`` (default ``trusted_by_default``): the caller built the
    arguments so (a KeyIndex's own table and normalized keys), and nothing
    is checked. The launcher reports ``work``'s module as its own."""

    def op(
        table: torch.Tensor,
        W: int,
        group_ids: torch.Tensor,
        hashes: torch.Tensor,
        trusted: bool = trusted_by_default,
    ) -> torch.Tensor:
        return work(table, W, group_ids, hashes, trusted)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    # A functools.partial of the family's function names no module itself.
    op.__module__ = getattr(work, "func", work).__module__
    return op
