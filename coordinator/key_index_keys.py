"""The keys a KeyIndex (and a FleetIndex) is given, brought to the form every
table kernel reads: :func:`normalize_keys` (the public entry point, which
resolves the device) and :func:`keys_on_device` (a resolved device, what
``KeyIndex.normalize_keys`` calls). Split from ``coordinator/key_index.py``,
which re-exports :func:`normalize_keys`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvhit.coordinator.packing import HashBatch, num_words, pack_hashes, padding_mask
from kvhit.kernels.checks import check_tensor, is_int, resolve_device

__all__ = ["keys_on_device", "normalize_keys"]


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
        return pack_hashes(hashes, hash_bytes).to(device)
    raise TypeError(
        "hashes must be an int64 tensor [N, W], a HashBatch or a sequence of "
        f"bytes, got {type(hashes).__name__}"
    )


def _normalize_group_ids(group_ids: Any, n: int, device: torch.device) -> torch.Tensor:
    """``group_ids`` for ``n`` keys as a contiguous int64 ``[n]`` tensor on
    ``device``, every id in ``[0, 2**63)``."""
    if isinstance(group_ids, bool | np.bool_):
        raise TypeError("group_ids must be int64, not bool")
    if is_int(group_ids):
        gid = int(group_ids)
        if gid < 0:
            raise ValueError(f"group_ids must be >= 0, got {gid}")
        if gid >= 1 << 63:
            raise ValueError(f"group_ids must fit in int64, got {gid}")
        return torch.full((n,), gid, dtype=torch.int64, device=device)
    if isinstance(group_ids, np.ndarray):
        if group_ids.dtype.kind not in "iu":
            raise TypeError(
                f"group_ids must hold integers, got dtype {group_ids.dtype}"
            )
        if group_ids.dtype == np.uint64 and group_ids.size:
            if int(group_ids.max()) >= 1 << 63:
                raise ValueError("group_ids must fit in int64")
        group_ids = torch.from_numpy(group_ids.astype(np.int64)).to(device)
    if isinstance(group_ids, torch.Tensor):
        check_tensor(
            group_ids, "group_ids", device=device, device_of="index", holds_data=False
        )
        if group_ids.dim() == 0:
            group_ids = group_ids.expand(n)
    elif isinstance(group_ids, Sequence) and not isinstance(group_ids, str | bytes):
        bad = next((i for i, g in enumerate(group_ids) if not is_int(g)), None)
        if bad is not None:
            raise TypeError(
                f"group_ids must be a sequence of ints, got "
                f"{type(group_ids[bad]).__name__} at position {bad}"
            )
        try:
            group_ids = torch.tensor([int(g) for g in group_ids], dtype=torch.int64)
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise ValueError(f"group_ids must fit in int64 ({exc})") from None
        group_ids = group_ids.to(device)
    else:
        raise TypeError(
            "group_ids must be an int, a sequence of ints or an int64 tensor, "
            f"got {type(group_ids).__name__}"
        )
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must have shape [N], got {list(group_ids.shape)}")
    if group_ids.shape[0] != n:
        raise ValueError(
            f"group_ids has {group_ids.shape[0]} entries but hashes has {n} keys"
        )
    if n and bool((group_ids < 0).any()):
        raise ValueError("group_ids must be >= 0 (negative values are sentinels)")
    return group_ids.contiguous()


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
    return _normalize_group_ids(group_ids, words.shape[0], device), words
