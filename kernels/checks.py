"""The one set of tensor argument checks for the kernel launchers in kernels/.

Launchers validate every tensor and name the argument; the kernels then assume
valid input (ARCHITECTURE.md, "Where input is validated"). ``kernels/`` may not import ``coordinator/``, so its
launchers share these helpers rather than ``coordinator/checks.py``. The
tensor checks read metadata only (no host sync); :func:`check_plan_rows`
reads the values of a plan's rows, host arrays. Imports no triton or numba.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvhit.kernels import contract as kc

__all__ = [
    "check_int64",
    "check_keys",
    "check_plan_rows",
    "check_size",
    "check_table",
    "table_capacity",
]


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


def check_size(name: str, v: object) -> int:
    """``v`` as an int, when it is an int >= 1 (a Python or numpy integer):
    TypeError naming ``name`` and the type for anything else (a bool, a
    float, a tensor), ValueError for one below 1. The launchers' sizes
    (``hash_block_size``, ``alignment``, ``num_groups``) divide or index."""
    if not isinstance(v, int | np.integer) or isinstance(v, bool | np.bool_):
        raise TypeError(f"{name} must be an int >= 1, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return int(v)


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


# The values a plan's row may hold where the kernels divide by a column, index
# with it, or branch on it as a flag: (column, least value, or None for a flag).
_SG_RULES = (
    (kc.SG_BLOCK_SIZE, 1),
    (kc.SG_SCALE, 1),
    (kc.SG_USE_EAGLE, None),
    (kc.SG_MARGIN, 0),
    (kc.SG_NEED, 0),
    (kc.SG_PERIOD, 1),
    (kc.SG_FINE, None),
    (kc.SG_CHUNK, 0),
)
_CAND_RULES = (
    (kc.CAND_CACHEABLE, None),
    (kc.CAND_BLOCK_SIZE, 1),
    (kc.CAND_SCALE, 1),
    (kc.CAND_SPARSE, None),
    (kc.CAND_NEED, 0),
    (kc.CAND_SHIFT, 0),
)
_KINDS = (kc.KIND_FULL, kc.KIND_SWA, kc.KIND_MAMBA, kc.KIND_CHUNKED)


# Row contents (and alignment) found good: a launcher called per engine or per
# step with the same plan checks it once (the check costs ~100 us, a lookup of
# its bytes ~1 us). Bounded; a miss only checks again.
_GOOD_ROWS: set[tuple[bytes, tuple[int, ...], bytes, tuple[int, ...], int]] = set()


def check_plan_rows(sg_rows: np.ndarray, cand_rows: np.ndarray, alignment: int) -> None:
    """The values of a plan's rows (``ScanPlan.as_rows()`` and
    ``candidates_as_rows()``), whose shapes the caller checked: int64 numpy
    ``sg_rows [S, SG_MEMBERS + M]`` and ``cand_rows [G, CAND_WIDTH]``.

    The kernels read them unchecked: a member group id indexes the candidate
    rows and per-group scratch (one past ``G`` reads past them), sizes divide
    (a zero period or scale raises in one loop and answers zeros in another),
    and a kind they do not know falls through to a wrong rule. ValueError
    naming the row and column (``sg_rows[1, period]``) of the first bad value.
    """
    key = (sg_rows.tobytes(), sg_rows.shape, cand_rows.tobytes(), cand_rows.shape,
           alignment)  # fmt: skip
    if key in _GOOD_ROWS:
        return
    _check_plan_values(sg_rows, cand_rows, alignment)
    if len(_GOOD_ROWS) >= 256:
        _GOOD_ROWS.clear()
    _GOOD_ROWS.add(key)


def _check_plan_values(
    sg_rows: np.ndarray, cand_rows: np.ndarray, alignment: int
) -> None:
    n_groups = cand_rows.shape[0]
    width = sg_rows.shape[1] - kc.SG_MEMBERS

    def bad(name: str, cols: tuple[str, ...], i: int, c: int, want: str) -> ValueError:
        value = int((sg_rows if name == "sg_rows" else cand_rows)[i, c])
        return ValueError(f"{name}[{i}, {cols[c]}] must be {want}, got {value}")

    def first(mask: np.ndarray) -> int:
        return int(np.argmax(mask))

    kinds = sg_rows[:, kc.SG_KIND]
    wrong = ~np.isin(kinds, _KINDS)
    if wrong.any():
        i = first(wrong)
        raise bad("sg_rows", kc.SG_COLS, i, kc.SG_KIND, f"one of {list(_KINDS)}")
    for name, cols, rows, rules in (
        ("sg_rows", kc.SG_COLS, sg_rows, _SG_RULES),
        ("cand_rows", kc.CAND_COLS, cand_rows, _CAND_RULES),
    ):
        for c, least in rules:
            col = rows[:, c]
            wrong = (col != 0) & (col != 1) if least is None else col < least
            if wrong.any():
                want = "0 or 1" if least is None else f">= {least}"
                raise bad(name, cols, first(wrong), c, want)
    fine = (sg_rows[:, kc.SG_FINE] != 0) & (sg_rows[:, kc.SG_BLOCK_SIZE] < alignment)
    if fine.any():
        # A fine-grained scan steps block_size // alignment hash units a block.
        raise bad("sg_rows", kc.SG_COLS, first(fine), kc.SG_FINE,
                  f"0 where block_size < alignment ({alignment})")  # fmt: skip
    n = sg_rows[:, kc.SG_N_MEMBERS]
    wrong = (n < 1) | (n > width)
    if wrong.any():
        i = first(wrong)
        raise ValueError(
            f"sg_rows[{i}, n_members] must be in [1, {width}], got {int(n[i])}"
        )
    for i in range(sg_rows.shape[0]):
        for k in range(int(n[i])):
            gid = int(sg_rows[i, kc.SG_MEMBERS + k])
            if not 0 <= gid < n_groups:
                raise ValueError(
                    f"sg_rows[{i}, member {k}] must be a group id in "
                    f"[0, {n_groups}) (cand_rows has {n_groups} rows), got {gid}"
                )
    sparse = cand_rows[:, kc.CAND_SPARSE] != 0
    wrong = sparse & (cand_rows[:, kc.CAND_PER_SEGMENT] < 1)
    if wrong.any():
        raise bad("cand_rows", kc.CAND_COLS, first(wrong), kc.CAND_PER_SEGMENT,
                  ">= 1 in a sparse row")  # fmt: skip
    ids = cand_rows[:, kc.CAND_GROUP_ID]
    wrong = ids != np.arange(n_groups)
    if wrong.any():
        g = first(wrong)
        raise bad("cand_rows", kc.CAND_COLS, g, kc.CAND_GROUP_ID, f"its row number {g}")
