"""The one set of device and tensor argument checks for coordinator/ and bindings/.

Every public entry point validates its input before changing anything and
raises an error naming the argument (ARCHITECTURE.md, "Where input is
validated"). These helpers are that validation, written once:

- :func:`check_device`: a device argument as the ``torch.device`` tensors made
  there report, refusing devices that hold no data (``meta``) or that this
  machine does not have.
- :func:`check_tensor`: a tensor argument's metadata (type, data, dtype, number
  of dimensions, device), never its values: no host sync, so it is usable
  inside a custom op or a CUDA graph capture.
- :func:`check_mask_size`: a batch of mask lengths whose masks would need more
  memory than :data:`MAX_MASK_ENTRIES` allows, refused before allocating.

Kernel launchers in ``kernels/`` may not import ``coordinator/``; they share
``kernels/checks.py`` instead.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MAX_MASK_ENTRIES", "check_device", "check_mask_size", "check_tensor"]

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
            f"than MAX_MASK_ENTRIES = 2**28 (coordinator/checks.py)"
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
