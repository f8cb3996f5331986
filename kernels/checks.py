"""The one set of tensor argument checks for the kernel launchers in kernels/.

Launchers validate every tensor and name the argument; the kernels then assume
valid input (ARCHITECTURE.md, "Where input is validated"). ``kernels/`` may not import ``coordinator/``, so its
launchers share these helpers rather than ``coordinator/checks.py``. Both
read metadata only (no host sync). Imports no triton or numba.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_int64", "check_keys", "check_table", "table_capacity"]


def check_int64(
    t: object,
    name: str,
    *,
    dim: int | None = None,
    device: torch.device | None = None,
    device_of: str = "table",
) -> torch.Tensor:
    """``t`` itself once it is a contiguous int64 ``torch.Tensor`` (TypeError
    for the type and the dtype, ValueError for the rest, each naming
    ``name``), with ``dim`` dimensions when given and on ``device`` when given
    (``"<name> is on X but <device_of> is on Y"``). Checked in that order; the
    first failure is the one reported."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but {device_of} is on {device}")
    return t


def check_table(table: object, W: object) -> int:
    """Capacity of a hash-index table: ``W`` a positive int, ``table`` a
    contiguous int64 ``[capacity, W + 1]`` tensor, ``capacity`` a power of
    two; ValueError (TypeError for the tensor's type or dtype) otherwise."""
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ValueError(f"W must be a positive int, got {W!r}")
    return table_capacity(check_int64(table, "table").shape, W)


def table_capacity(shape: Sequence[int], W: int, name: str = "table") -> int:
    """Capacity of a hash-index table of ``shape`` (a tensor's or a numpy
    array's): ``[capacity, W + 1]``, ``capacity`` a power of two; ValueError
    naming ``name`` otherwise. The probes read a slot's ``W`` key words
    unchecked, so a narrower table would be read past its slots."""
    if len(shape) != 2 or shape[1] != W + 1:
        raise ValueError(
            f"{name} must have shape [capacity, {W + 1}], got {list(shape)}"
        )
    cap = shape[0]
    if cap < 1 or cap & (cap - 1):
        raise ValueError(f"{name} capacity must be a power of two, got {cap}")
    return cap


def check_keys(group_ids: object, hashes: object, W: int, device: torch.device) -> int:
    """Number of keys ``N`` of a probe batch: ``group_ids`` int64 ``[N]`` and
    ``hashes`` int64 ``[N, W]``, both contiguous on ``device`` (the table's);
    errors as :func:`check_int64`, ValueError for the shapes."""
    group_ids = check_int64(group_ids, "group_ids", device=device)
    hashes = check_int64(hashes, "hashes", device=device)
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must have shape [N], got {list(group_ids.shape)}")
    if hashes.dim() != 2 or hashes.shape[1] != W:
        raise ValueError(f"hashes must have shape [N, {W}], got {list(hashes.shape)}")
    if hashes.shape[0] != group_ids.shape[0]:
        raise ValueError(
            f"group_ids has {group_ids.shape[0]} entries but hashes has "
            f"{hashes.shape[0]} rows"
        )
    return hashes.shape[0]
