"""The one validation module: every argument check of kvhit, written once.

Every public entry point validates its input once, from here, before it
changes anything, and raises an error naming the argument (ARCHITECTURE.md,
"Where input is validated"); what kvhit built itself is trusted and never
checked again. ``kernels/`` may not import ``coordinator/``, so the checks live
here, where the launchers, the coordinator and the bindings all reach them:

- scalars: :func:`is_int`, :func:`check_int`, :func:`check_bool`,
  :func:`check_seconds`, :func:`check_size`, :func:`check_max_load`,
  :func:`check_plan_params` (a plan's scalars, one ``PlanParams``);
- devices: :func:`check_device` (a ``torch.device`` or str) and
  :func:`resolve_device` (also a CUDA ordinal);
- tensors, by metadata only (no host sync): :func:`check_tensor`,
  :func:`check_int64`, :func:`check_keys`, :func:`check_table`;
- per-request lengths (``num_tokens``, ``max_lengths``, ...):
  :func:`host_lengths` and :func:`check_lengths`, one validator for every
  form a caller holds them in (list, tuple, numpy array of any integer
  dtype, torch tensor), each form on its own fast path;
- values: :func:`check_mask_size`, :func:`check_plan_rows` (a plan's rows,
  host arrays).

Imports no triton or numba.
"""

from __future__ import annotations

import math
import numbers
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvhit.kernels import contract as kc

__all__ = [
    "INT64_MAX",
    "MAX_MASK_ENTRIES",
    "check_bool",
    "check_device",
    "check_int",
    "check_int64",
    "check_keys",
    "check_lengths",
    "check_mask_size",
    "check_max_load",
    "ARRAY_INT_CODES",
    "TORCH_INT_DTYPES",
    "check_hash_array",
    "check_hash_buffer",
    "check_hash_tensor",
    "check_hash_widths",
    "check_host_requests",
    "why_not_bytes",
    "check_int_array",
    "check_plan_params",
    "check_plan_rows",
    "check_plan_shapes",
    "check_probe_args",
    "check_seconds",
    "check_size",
    "check_table",
    "check_table_tensor",
    "check_tensor",
    "host_lengths",
    "host_lengths_or_int",
    "is_int",
    "resolve_device",
    "table_capacity",
]

#: The largest int64; lengths and ids live in ``[0, INT64_MAX]``.
INT64_MAX = (1 << 63) - 1


# -- scalars -----------------------------------------------------------------


def is_int(x: Any) -> bool:
    """Whether ``x`` is an integer (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi)`` (``hi`` None: no upper bound), a
    Python or numpy integer, not a bool; TypeError for the type, ValueError
    for the value, each naming ``name``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool; TypeError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_seconds(
    value: Any, name: str, optional: bool = False, zero: bool = False
) -> float | None:
    """``value`` as a positive finite float of seconds (None passes when
    ``optional``, 0 when ``zero``); TypeError for the type, ValueError for
    the value."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{name} must be a number of seconds, got {type(value).__name__}"
        )
    if not ((value > 0 or (zero and value == 0)) and math.isfinite(value)):
        least = ">= 0" if zero else "positive"
        raise ValueError(f"{name} must be a {least} finite number, got {value}")
    return float(value)


def check_max_load(
    max_load: Any, bounds: tuple[float, float], name: str = "max_load"
) -> float:
    """``max_load`` as a float in ``bounds`` (inclusive): TypeError for a
    non-number or a bool, ValueError outside them (NaN included)."""
    if isinstance(max_load, bool) or not isinstance(max_load, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(max_load).__name__}")
    lo, hi = bounds
    if not lo <= max_load <= hi:  # also rejects NaN
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {max_load}")
    return float(max_load)


# -- devices -----------------------------------------------------------------


def resolve_device(device: Any, name: str = "device") -> torch.device:
    """:func:`check_device`, also taking a CUDA ordinal (an int, as
    ``torch.device`` does): TypeError for anything else that is not a
    device, ValueError for a device string torch does not know or a device
    that holds no data or is not here."""
    if is_int(device):
        try:
            device = torch.device(int(device))
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{name}={device!r} is not a device ({exc})") from None
    return check_device(device, name)


#: The most entries (requests x chunks of the widest group) one batched mask
#: may have: 2**28, i.e. 256 MiB of bool mask and 2 GiB of the int64 chunk
#: indices built beside it. A real batch stays far below (4096 requests of
#: 128K tokens at block size 16 is 2**25); a length past it is a unit mix-up
#: (bytes for tokens) or garbage, and would otherwise fail deep inside torch
#: or exhaust the host's memory.
MAX_MASK_ENTRIES = 1 << 28


def check_mask_size(lengths: torch.Tensor, block_size: int, name: str) -> None:
    """Refuse (ValueError naming ``name``) mask lengths whose batched masks
    would hold more than :data:`MAX_MASK_ENTRIES` entries: ``lengths`` int64
    ``[B]`` tokens, ``block_size`` the smallest block size (the widest
    mask). Reads ``lengths.max()`` once (a host sync)."""
    if lengths.numel() == 0:
        return
    widest = int(lengths.max().item()) // block_size
    entries = widest * lengths.numel()
    if entries > MAX_MASK_ENTRIES:
        raise ValueError(
            f"{name}: masks of {lengths.numel()} requests up to "
            f"{int(lengths.max().item())} tokens need {entries} entries, more "
            f"than MAX_MASK_ENTRIES = 2**28 (kernels/checks.py)"
        )


def check_device(device: Any, name: str = "device") -> torch.device:
    """``device`` (a ``torch.device`` or a str) as the device tensors made
    there report (``"cuda"`` -> ``cuda:<n>``), or an error naming ``name``:
    TypeError for a non-device, ValueError for an unknown device string, a
    ``meta`` device (no data to look up) or a device this machine does not
    have (e.g. ``"cuda"`` without CUDA)."""
    if not isinstance(device, torch.device | str):
        raise TypeError(
            f"{name} must be a torch.device or str, got {type(device).__name__}"
        )
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{name}={device!r} is not a device ({exc})") from None
    # Each message names the device both as given and as parsed: callers and
    # their tests know it by either spelling.
    if dev.type == "meta":
        raise ValueError(
            f"{name} {device!r} holds no data ({name}={dev}: meta tensors hold "
            "no data); a real device (cpu, cuda, ...) is needed"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{name} {device!r} is not available here ({name}={dev}: CUDA is "
            "not available on this machine)"
        )
    try:
        return torch.empty(0, device=dev).device
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(
            f"{name} {device!r} is not available here ({name}={dev}: {exc})"
        ) from None


def check_tensor(
    t: Any,
    name: str,
    *,
    dtype: torch.dtype = torch.int64,
    dim: int | None = None,
    device: torch.device | None = None,
    device_of: str = "expected",
    holds_data: bool = True,
) -> torch.Tensor:
    """``t`` itself once its metadata passes, in this order (the first failure
    is the one reported), each error naming ``name``:

    - a ``torch.Tensor`` (TypeError);
    - with ``holds_data``, not a meta tensor (ValueError); custom ops pass
      False because their fake implementations run on data-less tensors;
    - of ``dtype`` (TypeError);
    - dense, not sparse (TypeError);
    - with ``dim``, exactly that many dimensions (ValueError); callers with a
      shape that depends on other arguments check it themselves, after this;
    - with ``device``, on that device (ValueError ``"<name> is on X,
      <device_of> is on Y"``).

    No value is read.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if holds_data and t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: it holds no data")
    if t.dtype != dtype:
        raise TypeError(
            f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}"
        )
    if t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {t.layout}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, {device_of} is on {device}")
    return t


# -- per-request lengths -------------------------------------------------------
#
# One validator for num_tokens, max_lengths, token_lens, aligned_lens, ...
# Each form a caller holds lengths in has its own fast path, since a
# scheduler step checks them on every call (issue 33: <= 1 us at B <= 64):
# a list or tuple of plain ints, an integer numpy array, a CPU int64 tensor.
# Anything the fast path does not accept goes to the exact path, which either
# converts it or raises naming the argument and the position.

_INT64 = np.dtype(np.int64)
_CPU = torch.device("cpu")
_INTS = frozenset({int})
# Up to this many lengths in a list or tuple, host_lengths checks them in
# Python (a type scan and min()) rather than with a struct (side by side:
# 0.71 against 1.21 us at 2, 1.12 against 1.29 at 8, 1.63 against 1.38 at 16).
_FEW_LENGTHS = 8


def _position_error(name: str, i: int, v: Any) -> ValueError:
    return ValueError(f"{name}[{i}] ({v}) must be an int in [0, 2**63) (int64, >= 0)")


def _bad_value(name: str, i: int, v: int, multiple_of: int) -> ValueError:
    if v < 0:
        return ValueError(f"{name}[{i}] must be >= 0, got {v}")
    return ValueError(
        f"{name}[{i}] ({v}) must be a multiple of the hit alignment ({multiple_of})"
    )


# struct.Struct packers of n int64s (native order, as numpy's int64 reads
# them), one per batch size seen; cleared past _INT64S_MAX sizes, so that a
# router cycling through every size keeps a few hundred small objects.
_INT64S: dict[int, struct.Struct] = {}
_INT64S_MAX = 512


def _int64s(n: int) -> struct.Struct:
    """The packer of ``n`` native int64s (made once per ``n``)."""
    s = _INT64S.get(n)
    if s is None:
        if len(_INT64S) >= _INT64S_MAX:
            _INT64S.clear()
        s = _INT64S[n] = struct.Struct(f"={n}q")
    return s


def _least(arr: np.ndarray) -> int:
    """The least entry of a non-empty int64 array. ``argmin`` skips the
    ufunc reduction's set-up: ~0.2 us where ``arr.min()`` costs ~1 us."""
    return arr.item(arr.argmin())


def _check_values(arr: np.ndarray, name: str, multiple_of: int) -> np.ndarray:
    """``arr`` (int64 ``[n]``) once every entry is >= 0 and a multiple of
    ``multiple_of``; ValueError naming the first entry that is not."""
    if not arr.shape[0]:
        return arr
    if multiple_of == 1:
        if _least(arr) >= 0:
            return arr
        bad = arr < 0
    else:
        bad = (arr < 0) | (arr % multiple_of != 0)
        if not bad.any():
            return arr
    i = int(np.argmax(bad))
    raise _bad_value(name, i, int(arr[i]), multiple_of)


def _count(value: Any, name: str, n: int | None) -> int:
    """How many entries a length argument has, checked against ``n`` (one
    per request) when given."""
    if isinstance(value, torch.Tensor | np.ndarray):
        got = int(value.shape[0]) if value.ndim == 1 else -1
        if n is None and got >= 0:
            return got
        if got != n:
            raise ValueError(
                f"{name} must have shape [{n if n is not None else 'B'}] (one "
                f"per request), got {list(value.shape)}"
            )
        return got
    if (
        value is None
        or isinstance(value, str | bytes)
        or not isinstance(value, Sequence)
    ):
        raise TypeError(
            f"{name} must be an int64 tensor or a sequence of ints, got "
            f"{type(value).__name__}"
        )
    if n is not None and len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} requests")
    return len(value)


def _exact_sequence(value: Sequence[Any], name: str) -> np.ndarray:
    """A sequence of ints as an int64 array, each entry's type and range
    checked; raises naming the first bad position."""
    for i, v in enumerate(value):
        if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__}")
        if not 0 <= int(v) <= INT64_MAX:
            raise _position_error(name, i, v)
    return np.array([int(v) for v in value], dtype=np.int64)


def host_lengths(
    value: Any, name: str, n: int | None = None, multiple_of: int = 1
) -> np.ndarray:
    """``value`` (``n`` per-request lengths) as a C-contiguous int64 numpy
    array ``[n]`` on the host, every entry in ``[0, 2**63)`` and a multiple
    of ``multiple_of``; ``n`` None takes the count ``value`` has.

    ``value``: a list or tuple of ints, a numpy array of any integer dtype,
    or a CPU int64 tensor (its memory shared where it is contiguous).

    Raises:
        TypeError: naming ``name``: not one of those forms, a tensor of
            another dtype or device kind, a non-int (a bool too) at a position.
        ValueError: naming ``name`` and the position: a wrong count, a value
            below 0, past int64, or not a multiple of ``multiple_of``.
    """
    tv = type(value)
    if tv is list or tv is tuple:
        if len(value) == 1 and (n is None or n == 1):
            # One request (a scheduler step's usual batch): one check.
            v = value[0]
            if type(v) is int and 0 <= v <= INT64_MAX and not v % multiple_of:
                return np.array(value, dtype=_INT64)
        elif (n is None or len(value) == n) and len(value) <= _FEW_LENGTHS:
            # A few: a type scan (bools refused by type), min() and one
            # np.array (which refuses a value past int64): 0.7 against 1.2 us
            # the struct path below costs at 2 lengths.
            if _INTS.issuperset(map(type, value)) and (not value or min(value) >= 0):
                try:
                    arr = np.array(value, dtype=_INT64)
                except OverflowError:
                    arr = None
                if arr is not None:
                    return (
                        arr
                        if multiple_of == 1
                        else _check_values(arr, name, multiple_of)
                    )
        elif n is None or len(value) == n:
            # Fast path: a struct of n int64s refuses every non-int and every
            # int past int64, so anything it takes is exact (it packs in half
            # array('q')'s time: 0.9 against 1.9 us for 64 ints, 9 against
            # 21 for 1024); then the least entry (numpy's argmin: a third of
            # min() over the list) is >= 2: no negative, no bool (bools are
            # 0 and 1, which the struct takes).
            arr = np.empty(len(value), dtype=_INT64)
            try:
                _int64s(len(value)).pack_into(arr, 0, *value)
            except (struct.error, TypeError):
                # TypeError: an item's own __index__ refused (a numpy array).
                arr = None
            if arr is not None and (not value or _least(arr) >= 2):
                return (
                    arr if multiple_of == 1 else _check_values(arr, name, multiple_of)
                )
    elif tv is np.ndarray:
        if value.ndim == 1 and (n is None or value.shape[0] == n):
            dt = value.dtype
            if dt is _INT64 or dt == _INT64:
                arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)
            elif dt.kind == "i" or (dt.kind == "u" and dt.itemsize < 8):
                # Every value of a narrower integer dtype fits in int64.
                arr = value.astype(_INT64)
            elif (
                dt.kind == "u"
                and dt.itemsize == 8
                # The other byte order goes the exact path, which converts
                # it: viewed as int64 it would read byte-swapped.
                and dt.isnative
                and value.flags.c_contiguous
            ):
                # uint64 as int64 (a view, as an int64 array is taken as
                # itself): a value past int64 reads as negative, which the
                # check below refuses (by the exact path, naming it).
                arr = value.view(_INT64)
                if not arr.shape[0] or _least(arr) >= 0:
                    return (
                        arr
                        if multiple_of == 1
                        else _check_values(arr, name, multiple_of)
                    )
                return _host_lengths_exact(value, name, n, multiple_of)
            else:
                return _host_lengths_exact(value, name, n, multiple_of)
            if multiple_of == 1 and (not arr.shape[0] or _least(arr) >= 0):
                return arr
            return _check_values(arr, name, multiple_of)
    elif tv is torch.Tensor and value.dtype is torch.int64:
        # A CPU tensor's numpy view (metadata read once, by numpy); a tensor
        # numpy cannot view (another device, sparse, meta) takes the exact path.
        try:
            arr = value.numpy()
        except (TypeError, RuntimeError):
            return _host_lengths_exact(value, name, n, multiple_of)
        if arr.ndim == 1 and (n is None or arr.shape[0] == n):
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            if multiple_of == 1 and (not arr.shape[0] or _least(arr) >= 0):
                return arr
            return _check_values(arr, name, multiple_of)
    return _host_lengths_exact(value, name, n, multiple_of)


def host_lengths_or_int(value: Any, name: str, n: int) -> np.ndarray | int:
    """:func:`host_lengths` of ``n`` lengths, except that one request's
    length in ``[0, 2**63)`` comes back as an int when it is given as a
    one-item list or tuple of an int, a numpy integer array ``[1]`` or a CPU
    int64 tensor ``[1]``: a step of one request then makes no array (the
    numba backend's one-request path reads an int). Anything else, and every
    error, is :func:`host_lengths`'."""
    if n == 1:
        tv = type(value)
        if tv is list or tv is tuple:
            if len(value) == 1:
                v = value[0]
                if type(v) is int and 0 <= v <= INT64_MAX:
                    return v
        elif tv is np.ndarray:
            # item() of an integer array is an int, of a bool array a bool.
            if value.shape == (1,) and value.dtype.kind in "iu":
                v = value.item(0)
                if 0 <= v <= INT64_MAX:
                    return v
        elif tv is torch.Tensor:
            if value.dtype is torch.int64 and value.is_cpu and value.numel() == 1:
                # tolist() reads a one-item tensor in a third of item()'s
                # time, and tells its shape: [v] for [1] alone (a 0-d one
                # gives an int, a [1, 1] one a list in a list); a tensor
                # with no storage (sparse) raises, for host_lengths to name.
                try:
                    lst = value.tolist()
                except RuntimeError:
                    lst = None
                if type(lst) is list and type(v := lst[0]) is int and v >= 0:
                    return v
    return host_lengths(value, name, n)


def _host_lengths_exact(
    value: Any, name: str, n: int | None, multiple_of: int
) -> np.ndarray:
    """:func:`host_lengths` for every form, each property checked in turn."""
    if isinstance(value, torch.Tensor):
        check_tensor(value, name, device=_CPU, device_of="the host")
        _count(value, name, n)
        arr = np.ascontiguousarray(value.detach().numpy())
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        n = _count(value, name, n)
        if value.dtype.kind == "u" and n and int(value.max()) > INT64_MAX:
            i = int(np.argmax(value > INT64_MAX))
            raise _position_error(name, i, int(value[i]))
        arr = np.ascontiguousarray(value, dtype=np.int64)
    elif _count(value, name, n) and set(map(type, value)) <= {int}:
        try:
            arr = np.array(value, dtype=np.int64)
        except OverflowError:
            arr = _exact_sequence(value, name)
    else:
        arr = _exact_sequence(value, name)
    return _check_values(arr, name, multiple_of)


def _tensor_of(arr: np.ndarray) -> torch.Tensor:
    """``arr`` (host_lengths') as a CPU tensor sharing its memory, or a copy
    where torch refuses its negative stride (numpy calls a reversed one-item
    or empty slice C-contiguous and keeps its stride)."""
    try:
        return torch.from_numpy(arr)
    except ValueError:
        return torch.from_numpy(arr.copy())


def check_lengths(
    value: Any,
    name: str,
    n: int | None,
    device: torch.device,
    multiple_of: int = 1,
) -> torch.Tensor:
    """:func:`host_lengths` as an int64 ``[n]`` tensor on ``device`` (the
    engine's). A tensor must be int64 and on ``device`` already; one on an
    accelerator is checked there (one host sync for its values); every other
    form is checked on the host before it moves.

    Raises:
        TypeError / ValueError: as :func:`host_lengths`; a tensor on another
            device is a ValueError (``"<name> is on X, the engine is on Y"``).
    """
    if isinstance(value, torch.Tensor) and not value.is_cpu:
        check_tensor(value, name, device=device, device_of="the engine",
                     holds_data=False)  # fmt: skip
        n = _count(value, name, n)
        if not n:
            return value
        bad = value < 0
        if multiple_of > 1:
            bad |= torch.remainder(value, multiple_of) != 0
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise _bad_value(name, i, int(value[i]), multiple_of)
        return value
    if device.type != "cpu":
        if isinstance(value, torch.Tensor):
            check_tensor(value, name, device=device, device_of="the engine",
                         holds_data=False)  # fmt: skip
        return _tensor_of(host_lengths(value, name, n, multiple_of)).to(device)
    if type(value) is torch.Tensor:
        # The caller's own tensor, whose values the host path read in place.
        host_lengths(value, name, n, multiple_of)
        return value
    return _tensor_of(host_lengths(value, name, n, multiple_of))


# -- kernel launchers' tensors ------------------------------------------------


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


def check_plan_params(params: object) -> kc.PlanParams:
    """``params`` as the launchers read it: a :class:`~kvhit.kernels.contract.PlanParams`
    (TypeError naming ``params`` otherwise) whose sizes pass :func:`check_size`,
    each named ``params.<field>`` (``params.hash_block_size``, ...). Returns it
    with the sizes as Python ints; ``partial`` and ``simple_hybrid`` are read
    as truth values."""
    if not isinstance(params, kc.PlanParams):
        raise TypeError(f"params must be a PlanParams, got {type(params).__name__}")
    g, hbs, align, partial, simple = params
    # A plan's own params (ints and bools) pass as they are: the checked numba
    # launchers run once per engine in fleet scoring.
    if type(g) is type(hbs) is type(align) is int and min(g, hbs, align) >= 1:
        if type(partial) is type(simple) is bool:
            return params
    return kc.PlanParams(
        check_size("params.num_groups", params.num_groups),
        check_size("params.hash_block_size", params.hash_block_size),
        check_size("params.alignment", params.alignment),
        bool(params.partial),
        bool(params.simple_hybrid),
    )


def check_table(table: object, W: object) -> int:
    """Capacity of a hash-index table: ``W`` a positive int, ``table`` a
    contiguous int64 ``[capacity, W + 1]`` tensor, ``capacity`` a power of
    two; ValueError (TypeError for the tensor's type or dtype) otherwise."""
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ValueError(f"W must be a positive int, got {W!r}")
    return table_capacity(check_int64(table, "table").shape, W)


def check_table_tensor(table: Any, W: int, name: str, max_capacity: int) -> int:
    """Capacity of a KeyIndex table tensor given by a caller (a state dict,
    ``KeyIndex.from_table``): :func:`check_tensor` (int64, dense, holding
    data), shape ``[2**k, W + 1]`` and at most ``max_capacity`` slots;
    ValueError naming ``name`` otherwise. No value is read."""
    check_tensor(table, name)
    cap = table.shape[0] if table.dim() == 2 else 0
    if table.dim() != 2 or table.shape[1] != W + 1 or cap < 1 or cap & (cap - 1):
        raise ValueError(
            f"{name} must have shape [2**k, {W + 1}], got {list(table.shape)}"
        )
    if cap > max_capacity:
        raise ValueError(f"{name} has {cap} slots, more than MAX_CAPACITY")
    return cap


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


def check_probe_args(
    table: object,
    W: object,
    group_ids: object,
    hashes: object,
    device_type: str | None = None,
) -> int:
    """Capacity of a hash-index launcher's ``table`` once it and the keys
    pass :func:`check_table` and :func:`check_keys` (``group_ids`` None: a
    table alone); with ``device_type``, the table must be on a device of
    that type (ValueError)."""
    cap = check_table(table, W)
    if device_type is not None and table.device.type != device_type:  # type: ignore[attr-defined]
        raise ValueError(
            f"table must be on the {device_type.upper()}, got {table.device}"  # type: ignore[attr-defined]
        )
    if group_ids is not None:
        check_keys(group_ids, hashes, W, table.device)  # type: ignore[arg-type, attr-defined]
    return cap


def check_plan_shapes(sg_rows: np.ndarray, cand_rows: np.ndarray) -> None:
    """The shapes of a plan's rows (numpy): ``sg_rows [S >= 1, SG_MEMBERS +
    M]``, ``cand_rows [G, kc.CAND_WIDTH]``; ValueError naming the array."""
    if sg_rows.ndim != 2 or sg_rows.shape[0] < 1 or sg_rows.shape[1] <= len(kc.SG_COLS):
        raise ValueError(
            f"sg_rows must have shape [S >= 1, > {len(kc.SG_COLS)}], got "
            f"{list(sg_rows.shape)}"
        )
    if cand_rows.ndim != 2 or cand_rows.shape[1] != kc.CAND_WIDTH:
        raise ValueError(
            f"cand_rows must have shape [G, {kc.CAND_WIDTH}], got {list(cand_rows.shape)}"
        )


def check_int_array(name: str, a: object, shape: tuple[int, ...] | None = None) -> None:
    """``a`` an integer numpy array (TypeError naming ``name``), of ``shape``
    when given (ValueError)."""
    # _c64 converts what it is given: an integer array converts exactly, a
    # float one would be truncated without a word.
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
        what = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise TypeError(f"{name} must be an integer numpy array, got {what}")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(a.shape)}")


def check_host_requests(
    rows: Any,
    offsets: Any,
    per_request: Sequence[tuple[str, Any]],
    params: object,
) -> kc.PlanParams:
    """The request arrays' shapes and dtypes and the plan's scalars
    (:func:`check_plan_params`, which it returns): the kernel reads
    ``per_request`` arrays at every index of ``offsets`` unchecked (a shorter
    one is read past its end) and divides by the sizes (a zero raised in the
    serial loop but answered zeros in the threaded one)."""
    check_int_array("rows", rows)
    if rows.ndim != 2 or rows.shape[1] < 1:
        raise ValueError(f"rows must have shape [T, W >= 1], got {list(rows.shape)}")
    check_int_array("offsets", offsets)
    if offsets.ndim != 1:
        raise ValueError(f"offsets must have shape [R], got {list(offsets.shape)}")
    for name, a in per_request:
        check_int_array(name, a, offsets.shape)
    return check_plan_params(params)


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


# -- hashes handed in by a caller (HashBatch.from_bytes / from_ints) ---------


def why_not_bytes(h: Any) -> str | None:
    """Why ``h`` cannot be a hash (None if it can): it must be a 1-D buffer of
    single bytes (bytes, bytearray, a byte memoryview or uint8 array).

    ``len()`` of a numpy int64 array or of a non-byte memoryview is not its
    size in bytes, so accepting them would pack the wrong bytes (or fail deep
    inside numpy).
    """
    if isinstance(h, bytes | bytearray):
        return None
    name = type(h).__name__
    try:
        view = memoryview(h)
    except TypeError:
        return name
    if view.ndim == 1 and view.itemsize == 1:
        return None
    return (
        f"{name} of {view.itemsize}-byte items, shape {list(view.shape)} (need "
        "the hash as bytes, e.g. .tobytes(); packed int64 words go in as a "
        "torch.Tensor [N, W])"
    )


def check_hash_widths(hashes: Sequence[Any], hash_bytes: int, where: str) -> None:
    """Raise TypeError/ValueError naming the first item of ``hashes`` whose
    ``len()`` is not ``hash_bytes`` (or that has no length). Items whose
    ``len()`` is not their size in bytes are caught after the join
    (``hash_words.join_hashes``), at no cost when there are none."""
    # map(len) runs in C; the slow scan only happens on an error.
    try:
        lengths = set(map(len, hashes))
    except TypeError:
        lengths = None
    if lengths is None or (lengths and lengths != {hash_bytes}):
        for pos, h in enumerate(hashes):
            why = why_not_bytes(h)
            if why is not None:
                raise TypeError(f"{where}, position {pos}: expected bytes, got {why}")
            if len(h) != hash_bytes:
                raise ValueError(
                    f"{where}, position {pos}: hash has {len(h)} bytes, "
                    f"expected hash_bytes={hash_bytes}"
                )


#: ``array.array`` type codes of integers, all of which numpy reads by the
#: same code.
ARRAY_INT_CODES = frozenset("bBhHiIlLqQ")
#: torch integer dtypes (bool refused: its values are not hashes).
TORCH_INT_DTYPES = frozenset(
    {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
    | {getattr(torch, f"uint{b}") for b in (16, 32, 64) if hasattr(torch, f"uint{b}")}
)


def check_hash_array(req: np.ndarray, i: int) -> np.ndarray:
    """A numpy request as int64 ``[n]`` (the array itself when it is already
    native int64); raise naming request ``i`` unless it is 1-D with integer
    values inside int64.
    """
    if req.ndim != 1:
        raise ValueError(
            f"request {i}: an array of hashes must be 1-D, got shape {list(req.shape)}"
        )
    if req.dtype.kind not in "iu":
        raise TypeError(
            f"request {i}: expected integer hashes, got an array of dtype {req.dtype}"
        )
    if req.dtype.kind == "u" and req.dtype.itemsize == 8 and req.size:
        big = req > np.uint64(INT64_MAX)
        if big.any():
            pos = int(np.argmax(big))
            raise ValueError(
                f"request {i}, position {pos}: {int(req[pos])} is outside int64 "
                "[-2**63, 2**63) (reinterpret uint64 hashes with .view(np.int64))"
            )
    return req.astype(np.int64, copy=False)


def check_hash_tensor(req: torch.Tensor, i: int) -> np.ndarray:
    """A torch request (1-D, dense, an integer dtype, on any device holding
    data) as int64 ``[n]`` on the host; raise naming request ``i`` otherwise.
    The result may share memory with ``req`` (the caller copies).
    """
    if req.dtype not in TORCH_INT_DTYPES:
        at = ", position 0" if req.numel() else ""
        raise TypeError(
            f"request {i}{at}: expected integer hashes, got a tensor of dtype "
            f"{req.dtype}"
        )
    if req.layout is not torch.strided:
        raise TypeError(f"request {i}: expected a dense tensor, got {req.layout}")
    if req.device.type == "meta":
        raise ValueError(f"request {i} is a meta tensor: it holds no data")
    if req.dim() != 1:
        raise ValueError(
            f"request {i}: a tensor of hashes must be 1-D, got shape {list(req.shape)}"
        )
    return check_hash_array(req.detach().cpu().numpy(), i)


def check_hash_buffer(req: array, i: int) -> np.ndarray:
    """An ``array.array`` request of an integer type code as int64 ``[n]``
    (a view of its buffer when the code is 8-byte signed; the caller copies);
    raise naming request ``i`` otherwise.
    """
    if req.typecode not in ARRAY_INT_CODES:
        raise TypeError(
            f"request {i}: expected integer hashes, got an array of type code "
            f"{req.typecode!r}"
        )
    return check_hash_array(np.frombuffer(req, dtype=req.typecode), i)
