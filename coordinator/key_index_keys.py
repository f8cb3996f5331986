"""The keys a KeyIndex (and a FleetIndex) is given, brought to the form every
table kernel reads: :func:`normalize_keys` (the public entry point, which
resolves the device) and :func:`keys_on_device` (a resolved device, what
``KeyIndex.normalize_keys`` calls), and :func:`normalize_ids` (per-key ids:
group ids here, a FleetIndex's engine ids). Split from ``coordinator/key_index.py``,
which re-exports :func:`normalize_keys`.
"""

from __future__ import annotations

import numbers
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvhit.coordinator.packing import (
    HashBatch,
    int_rows,
    num_words,
    pack_hashes,
    padding_mask,
)
from kvhit.kernels.checks import check_tensor, is_int, resolve_device

__all__ = [
    "host_int64",
    "NO_IDS",
    "cpu_int64_data",
    "host_ids",
    "host_key_arrays",
    "insert_host_forms",
    "host_rows",
    "keys_on_device",
    "normalize_ids",
    "normalize_keys",
]

_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
#: The group ids a host store passes its kernel when one id is every key's
#: (the kernel reads none): int64 ``[0]``.
NO_IDS = np.empty(0, dtype=_INT64)


def _normalize_hashes(
    hashes: Any, hash_bytes: int, device: torch.device
) -> torch.Tensor:
    """``hashes`` as a contiguous int64 ``[N, W]`` tensor on ``device``."""
    W = num_words(hash_bytes)
    if isinstance(hashes, HashBatch):
        if hashes.hash_bytes != hash_bytes:
            raise ValueError(
                f"hashes: HashBatch has hash_bytes={hashes.hash_bytes}, "
                f"index has hash_bytes={hash_bytes}"
            )
        hashes = hashes.hashes
    if isinstance(hashes, np.ndarray):
        # Words are bit patterns: uint64 is the same data as int64.
        if hashes.dtype not in (np.int64, np.uint64):
            raise TypeError(
                f"hashes: a numpy array must be int64 [N, {W}] words, got dtype "
                f"{hashes.dtype} (pass bytes as a sequence of bytes objects)"
            )
        if hashes.ndim != 2 or hashes.shape[1] != W:
            raise ValueError(
                f"hashes must have shape [N, {W}] for hash_bytes={hash_bytes}, "
                f"got numpy shape {list(hashes.shape)}"
            )
        words = np.ascontiguousarray(hashes).view(np.int64)
        hashes = torch.from_numpy(words.copy()).to(device)
    if isinstance(hashes, torch.Tensor):
        check_tensor(
            hashes, "hashes", device=device, device_of="index", holds_data=False
        )
        if hashes.dim() != 2 or hashes.shape[1] != W:
            raise ValueError(
                f"hashes must have shape [N, {W}] for hash_bytes={hash_bytes}, "
                f"got {list(hashes.shape)}"
            )
        pad = padding_mask(hash_bytes)
        if pad and hashes.shape[0] and bool(((hashes[:, -1] & pad) != 0).any()):
            raise ValueError(
                f"hashes: padding bits past hash_bytes={hash_bytes} in the last "
                "word must be zero"
            )
        return hashes.contiguous()
    if isinstance(hashes, bytes | bytearray | memoryview | str):
        raise TypeError(
            "hashes must be an int64 tensor [N, W] or a sequence of bytes, "
            f"not a single {type(hashes).__name__}"
        )
    if isinstance(hashes, Sequence):
        if len(hashes) and isinstance(hashes[0], numbers.Integral):
            # Integer hashes (bools among them, refused by name), as
            # from_ints reads a request's (a router's lists): the first item
            # decides; a later bytes item is named.
            return torch.from_numpy(int_rows(hashes, hash_bytes, "hashes")).to(device)
        return pack_hashes(hashes, hash_bytes).to(device)
    raise TypeError(
        "hashes must be an int64 tensor [N, W], a HashBatch or a sequence of "
        f"bytes or of ints, got {type(hashes).__name__}"
    )


def normalize_ids(
    ids: Any,
    name: str,
    n: int,
    device: torch.device,
    bound: int | None = None,
    holds_data: bool = False,
) -> torch.Tensor:
    """Per-key ids (a FleetIndex's engine ids, every table's group ids) for
    ``n`` keys as a contiguous int64 ``[n]`` tensor on ``device``, each in
    ``[0, bound)`` (``[0, 2**63)`` without ``bound``).

    Args:
        ids: an int (broadcast to every key), a sequence of ints, an integer
            numpy array ``[n]`` or an int64 tensor ``[n]`` (or 0-d,
            broadcast) on ``device``.
        name: the argument's name, in every error.
        holds_data: refuse a meta tensor (see ``checks.check_tensor``).

    Raises TypeError/ValueError naming ``name``.
    """
    if isinstance(ids, bool | np.bool_):
        raise TypeError(f"{name} must be int64, not bool")
    if is_int(ids):
        value = int(ids)
        if value >= 1 << 63:
            raise ValueError(f"{name} must fit in int64, got {value}")
        if value < 0 or (bound is not None and value >= bound):
            span = ">= 0" if bound is None else f"in [0, {bound})"
            raise ValueError(f"{name} must be {span}, got {value}")
        return torch.full((n,), value, dtype=torch.int64, device=device)
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {ids.dtype}")
        # Any byte order (a big-endian uint64 is not == np.uint64).
        if (
            ids.dtype.kind == "u"
            and ids.dtype.itemsize == 8
            and ids.size
            and int(ids.max()) >= 1 << 63
        ):
            raise ValueError(f"{name} must fit in int64")
        ids = torch.from_numpy(ids.astype(np.int64)).to(device)
    if isinstance(ids, torch.Tensor):
        check_tensor(ids, name, device=device, device_of="index", holds_data=holds_data)
        if ids.dim() == 0:
            ids = ids.expand(n)
    elif isinstance(ids, Sequence) and not isinstance(ids, str | bytes):
        bad = next((i for i, v in enumerate(ids) if not is_int(v)), None)
        if bad is not None:
            raise TypeError(
                f"{name} must be a sequence of ints, got "
                f"{type(ids[bad]).__name__} at position {bad}"
            )
        try:
            ids = torch.tensor([int(v) for v in ids], dtype=torch.int64)
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{name} must fit in int64 ({exc})") from None
        ids = ids.to(device)
    else:
        raise TypeError(
            f"{name} must be an int, a sequence of ints or an int64 tensor, "
            f"got {type(ids).__name__}"
        )
    if ids.dim() != 1:
        raise ValueError(f"{name} must have shape [N], got {list(ids.shape)}")
    if ids.shape[0] != n:
        raise ValueError(f"{name} has {ids.shape[0]} entries but hashes has {n} keys")
    if bound is None:
        if n and bool((ids < 0).any()):
            raise ValueError(f"{name} must be >= 0 (negative values are sentinels)")
    elif n and bool(((ids < 0) | (ids >= bound)).any()):
        raise ValueError(f"{name} must be in [0, {bound})")
    return ids.contiguous()


def normalize_keys(
    group_ids: Any,
    hashes: Any,
    hash_bytes: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate keys and bring them to the form every table kernel reads.

    Args:
        group_ids: the keys' group ids: an int (broadcast to every key), a
            sequence of ints, an integer numpy array ``[N]`` or an int64 tensor
            ``[N]`` (or 0-d, broadcast) on ``device``; each in ``[0, 2**63)``.
        hashes: the keys' block hashes: an int64 tensor ``[N, W]`` on
            ``device`` (words packed as in ``coordinator/packing.py``, padding
            bits zero), an int64/uint64 numpy array ``[N, W]``, a
            :class:`HashBatch` of width ``hash_bytes``, or a sequence of
            ``bytes`` of width ``hash_bytes``.
        hash_bytes: the hash width in bytes; ``W = ceil(hash_bytes / 8)``.
        device: the device of the table the keys are for.

    Returns:
        ``(gids, words)``: int64 ``[N]`` and int64 ``[N, W]``, contiguous, on
        ``device``.

    Raises TypeError/ValueError naming the argument; reads nothing but its
    arguments and changes nothing.
    """
    return keys_on_device(group_ids, hashes, hash_bytes, resolve_device(device))


def keys_on_device(
    group_ids: Any, hashes: Any, hash_bytes: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`normalize_keys` for a resolved ``device``: ``(int64 [N], int64
    [N, W])``, contiguous, on ``device``."""
    words = _normalize_hashes(hashes, hash_bytes, device)
    return normalize_ids(group_ids, "group_ids", words.shape[0], device), words


# The host store path's forms (KeyIndex.add, FleetIndex.add on the CPU):
# taken as they are, no copy, or None for the general path above.


_TORCH_INT64 = torch.int64
_STRIDED = torch.strided


def cpu_int64_data(t: torch.Tensor) -> bool:
    """Whether tensor ``t`` (any shape) can be read where it lies as
    C-contiguous int64 data: CPU and strided (tested before
    ``is_contiguous``, which a sparse tensor lacks); ``KeyIndex.add``'s
    inline check, the shape being the caller's."""
    return (
        t.dtype is _TORCH_INT64
        and t.is_cpu
        and t.layout is _STRIDED
        and t.is_contiguous()
    )


def _cpu_int64(t: torch.Tensor, shape_ok: Any) -> bool:
    """Whether tensor ``t`` is CPU int64 rows read where they lie: strided
    (tested first: a sparse tensor has no ``is_contiguous``), contiguous,
    ``shape_ok(t.shape)``. (An int64 tensor never requires grad.)"""
    return (
        t.dtype is torch.int64
        and t.is_cpu
        and t.layout is torch.strided
        and shape_ok(t.shape)
        and t.is_contiguous()
    )


def host_rows(hashes: Any, hash_bytes: int, W: int) -> np.ndarray | torch.Tensor | None:
    """``hashes`` as C-contiguous int64 rows ``[N, W]`` with no copy: an
    int64 (or uint64, viewed) numpy array, a CPU HashBatch's numpy rows, or a
    CPU int64 tensor itself; None for any other form. Padding bits are the
    caller's to check."""
    if type(hashes) is torch.Tensor:
        ok = _cpu_int64(hashes, lambda s: len(s) == 2 and s[1] == W)
        return hashes if ok else None
    if type(hashes) is np.ndarray:
        h = hashes
    elif isinstance(hashes, HashBatch):
        if hashes.hash_bytes != hash_bytes or hashes.device.type != "cpu":
            return None
        h = hashes.host_arrays()[0]  # (from_ints makes no tensor for them)
    else:
        return None
    dt = h.dtype
    if dt != _INT64:
        if dt != _UINT64:
            return None
        h = h.view(_INT64)
    if h.ndim != 2 or h.shape[1] != W or not h.flags.c_contiguous:
        return None
    return h


def host_ids(group_ids: Any, n: int) -> tuple[int, Any] | None:
    """Group ids for ``n`` keys as ``(gconst, ids)``: an int in ``[0,
    2**63)`` is ``(it, None)``, every key's; a C-contiguous int64 ``[n]``
    numpy array or CPU tensor, or a list of exactly ints (as an int64
    array), is ``(-1, ids)`` with the signs still to check; None for any
    other form."""
    tg = type(group_ids)
    if tg is int:
        return (group_ids, None) if 0 <= group_ids < 1 << 63 else None
    if tg is torch.Tensor:
        return (-1, group_ids) if _cpu_int64(group_ids, (n,).__eq__) else None
    if tg is np.ndarray:
        if (
            group_ids.dtype == _INT64
            and group_ids.shape == (n,)
            and group_ids.flags.c_contiguous
        ):
            return -1, group_ids
        return None
    if tg is list and len(group_ids) == n:
        # Exactly ints (bools refused by type); array('q') refuses any past
        # int64.
        if set(map(type, group_ids)) <= {int}:
            try:
                return -1, np.frombuffer(array("q", group_ids), dtype=_INT64)
            except OverflowError:
                return None
    return None


def insert_host_forms(
    plan: tuple[Any, ...], room: int, group_ids: Any, hashes: Any
) -> int | None:
    """One checked numba insert of keys in :func:`host_rows`' and
    :func:`host_ids`' forms (tensors read where they lie), or of a list of
    int hashes (8-byte keys or fewer) for one group id converted by
    :func:`~kvhit.coordinator.packing.int_rows` (``KeyIndex.add`` first
    hands such a list to the index's ``int_list_entry()`` itself), for the
    host store path of ``KeyIndex.add``. ``plan``: the index's ``(table, W,
    pad, limit, insert_checked_at, insert_checked, REFUSED, hash_bytes,
    insert_entry(), int_list_entry(), NOT_READ)`` (``KeyIndex._store_plan``);
    ``room``: the new keys that fit without a rehash. The kernel's return (keys newly stored; ``REFUSED`` when a
    value is refused, nothing stored; ``-1 - r`` when row ``r`` found no
    free slot), or None, nothing done, for any other form, no key, or more
    than ``room`` keys."""
    (table, W, pad, _, insert_at, insert_arrays, _, hash_bytes, rows_at, _,
     _) = plan  # fmt: skip
    if (
        type(hashes) is list
        and W == 1
        and type(group_ids) is int
        and 0 <= group_ids < 1 << 63
        and hashes
        and type(hashes[0]) is int
    ):
        # A router's int hashes (as from_ints reads them) for one group that
        # KeyIndex.add's one compiled call did not take (a bad item, too
        # many keys, a padding bit, no decoder): converted here, a bad one
        # named (the group id is good and nothing is changed yet: the
        # general path's error).
        h = int_rows(hashes, hash_bytes, "hashes")
        if h.shape[0] > room:
            return None
        # The compiled entry's loads assume aligned rows (struct's buffer).
        insert = rows_at if h.flags.aligned else insert_arrays
        return insert(table, NO_IDS, group_ids, h, pad)
    h = host_rows(hashes, hash_bytes, W)
    if h is None:
        return None
    n = h.shape[0]
    if n == 0 or n > room:
        return None
    ids = host_ids(group_ids, n)
    if ids is None:
        return None
    gconst, g = ids
    if type(h) is torch.Tensor and type(g) is not np.ndarray:
        return insert_at(
            table, 0 if g is None else g.data_ptr(), gconst, h.data_ptr(), n, pad
        )
    if type(h) is torch.Tensor:
        h = h.numpy()
    if g is None:
        g = NO_IDS
    elif type(g) is torch.Tensor:
        g = g.numpy()
    return insert_arrays(table, g, gconst, h, pad)


def host_key_arrays(
    group_ids: Any, hashes: Any, hash_bytes: int, W: int, pad: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The keys in :func:`host_rows`' and :func:`host_ids`' forms, checked
    as :func:`normalize_keys` checks them, as numpy arrays (int64 ``[N]``,
    int64 ``[N, W]``, C-contiguous); None when a form or a value is not
    taken (the caller's general path converts or names it). ``pad``: the
    padding bits of a last word (``packing.padding_mask(hash_bytes)``)."""
    h = host_rows(hashes, hash_bytes, W)
    if h is None:
        return None
    if type(h) is torch.Tensor:
        h = h.numpy()
    n = h.shape[0]
    if pad and n and (h[:, -1] & pad).any():
        return None
    ids = host_ids(group_ids, n)
    if ids is None:
        return None
    gconst, g = ids
    if g is None:
        g = np.empty(n, dtype=_INT64)
        g.fill(gconst)  # (np.full costs several times as much)
        return g, h
    if type(g) is torch.Tensor:
        g = g.numpy()
    if n and g.item(g.argmin()) < 0:  # argmin: no reduction set-up
        return None
    return g, h


def host_int64(value: Any, unsigned_ok: bool = False) -> np.ndarray | None:
    """``value`` as an int64 numpy array, without a copy, when it already is
    one in memory: a dense CPU int64 tensor that needs no grad, or an int64
    numpy array (uint64 too with ``unsigned_ok``, viewed as int64); None for
    anything else, which the caller sends down its general, checking path.
    The shape and the values are the caller's to check."""
    if isinstance(value, torch.Tensor):
        if (
            value.dtype != torch.int64
            or not value.is_cpu  # (device.type costs ten times as much)
            or value.requires_grad
            or value.layout is not torch.strided
        ):
            return None
        return value.numpy()
    if isinstance(value, np.ndarray) and (
        value.dtype == np.int64 or (unsigned_ok and value.dtype == np.uint64)
    ):
        return value.view(np.int64)
    return None
