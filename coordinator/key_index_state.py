"""A KeyIndex's persistence helpers (``KeyIndex.state_dict`` /
``from_state_dict``): the state's version, its checksum and what a restored
table must satisfy. Split from ``coordinator/key_index.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvhit.coordinator.packing import num_words, padding_mask
from kvhit.kernels.checks import check_int, check_max_load, check_table_tensor
from kvhit.kernels.contract import EMPTY, TOMBSTONE

__all__ = [
    "capturing",
    "next_pow2",
    "refuse_growth_in_capture",
    "STATE_VERSION",
    "checksum_culprit",
    "state_fields",
    "verify_checksum",
    "table_checksum",
    "verify_reachable",
    "verify_slots",
    "verify_structure",
]

#: The layout version ``state_dict`` writes and ``from_state_dict`` reads.
STATE_VERSION = 2


def table_checksum(table: torch.Tensor, hash_bytes: int, size: int, tombs: int) -> str:
    """blake2b of the table bytes and the counts (hex); what state_dict signs."""
    data = table.detach().to("cpu").contiguous().numpy()
    h = hashlib.blake2b(digest_size=16)
    h.update(
        f"kvhit.KeyIndex/{STATE_VERSION}/{hash_bytes}/{list(data.shape)}/{size}/"
        f"{tombs}/".encode()
    )
    h.update(memoryview(data).cast("B"))
    return h.hexdigest()


def state_fields(
    state: Any, max_load_range: tuple[float, float], max_capacity: int
) -> tuple[int, float, int, int, torch.Tensor, int]:
    """The fields of a ``KeyIndex.state_dict`` checked, in the order
    ``from_state_dict`` checks them: ``(hash_bytes, max_load, size,
    tombstones, table, capacity)``; the checksum is not read here
    (:func:`verify_checksum`). Raises ValueError/TypeError naming the
    field."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    fields = ("version", "hash_bytes", "max_load", "size", "tombstones", "table")
    for field in (*fields, "checksum"):
        if field not in state:
            raise ValueError(f"state: missing field {field!r}")
    version = state["version"]
    if type(version) is not int or version != STATE_VERSION:
        # Only the layout this code writes is read: a table saved under
        # another version may hash or pack keys differently.
        raise ValueError(
            f"state: unknown version {version!r} (this kvhit reads version "
            f"{STATE_VERSION} only)"
        )
    hash_bytes = state["hash_bytes"]
    W = num_words(hash_bytes)
    max_load = check_max_load(state["max_load"], max_load_range, "state['max_load']")
    size = check_int(state["size"], "state['size']", 0)
    tombs = check_int(state["tombstones"], "state['tombstones']", 0)
    table = state["table"]
    cap = check_table_tensor(table, W, "state['table']", max_capacity)
    return hash_bytes, max_load, size, tombs, table, cap


def verify_checksum(
    state: Mapping[str, Any],
    table: torch.Tensor,
    hash_bytes: int,
    size: int,
    tombs: int,
) -> None:
    """Raise ValueError, naming what changed, unless ``state["checksum"]``
    signs ``table`` (int64 ``[C, W + 1]``) and the counts."""
    if state["checksum"] != table_checksum(table, hash_bytes, size, tombs):
        raise ValueError(
            f"state: checksum mismatch: {checksum_culprit(state, table)} "
            "changed or corrupted after state_dict()"
        )


def checksum_culprit(state: Mapping[str, Any], table: torch.Tensor) -> str:
    """Which part of a state whose checksum failed disagrees. The checksum
    signs the table bytes and the counts together, so the counts the table
    itself holds are tried in place of the fields: a field that differs from
    them is named, and is the whole story when the table's own counts sign it;
    otherwise the table's bytes (or the checksum itself: one signature cannot
    tell the two apart) changed."""
    col = table[:, 0]
    held = {
        "size": int((col >= 0).sum().item()),
        "tombstones": int((col == TOMBSTONE).sum().item()),
    }
    wrong = [
        f"state[{field!r}] ({state[field]}; the table holds {n})"
        for field, n in held.items()
        if state[field] != n
    ]
    signed = table_checksum(
        table, state["hash_bytes"], held["size"], held["tombstones"]
    )
    if wrong and state["checksum"] == signed:
        return " and ".join(wrong) + " was"
    table_part = "state['table'] (its bytes, shape or hash_bytes) or state['checksum']"
    return " and ".join([*wrong, table_part]) + " was"


def verify_slots(keys: torch.Tensor, name: str, size: int, tombs: int) -> torch.Tensor:
    """The slot states of a restored table (ValueError naming ``state[name]``):
    ``keys`` int64 ``[C, 1 + W]``, column 0 a group id or a sentinel, holds
    ``size`` keys and ``tombs`` tombstones, an EMPTY slot, zero words in EMPTY
    slots. Returns the live slots: bool ``[C]``. A KeyIndex's table and a
    FleetIndex's keys are checked alike."""
    col = keys[:, 0]
    if bool((col < TOMBSTONE).any()):
        raise ValueError(f"state[{name!r}] holds BUSY or unknown sentinels")
    live_mask = col >= 0
    n_live = int(live_mask.sum().item())
    n_tombs = int((col == TOMBSTONE).sum().item())
    if n_live != size or n_tombs != tombs:
        raise ValueError(
            f"state: state[{name!r}] holds {n_live} keys and {n_tombs} "
            f"tombstones, fields say {size} and {tombs}"
        )
    if n_live + n_tombs >= keys.shape[0]:
        raise ValueError(f"state[{name!r}] has no EMPTY slot")
    if bool((keys[col == EMPTY, 1:] != 0).any()):
        raise ValueError(f"state[{name!r}] has nonzero words in EMPTY slots")
    return live_mask


def verify_reachable(
    keys: torch.Tensor,
    name: str,
    hash_bytes: int,
    live_mask: torch.Tensor,
    find: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """The live keys of a restored table (``keys`` and ``live_mask`` as
    :func:`verify_slots` takes and gives them): zero padding bits, and each
    found by ``find(gids int64 [N], words int64 [N, W]) -> slots int64 [N]``
    at its own slot, once. ValueError naming ``state[name]``."""
    live_slots = live_mask.nonzero().squeeze(1)
    live = keys.index_select(0, live_slots)
    pad = padding_mask(hash_bytes)
    if pad and bool(((live[:, -1] & pad) != 0).any()):
        raise ValueError(f"state[{name!r}] has nonzero padding bits")
    found = find(live[:, 0].contiguous(), live[:, 1:].contiguous())
    if not torch.equal(found.to(live_slots.device), live_slots):
        raise ValueError(
            f"state[{name!r}] is inconsistent: some keys are not reachable "
            "from their home slot along the probe sequence (or appear twice)"
        )


def verify_structure(
    table: torch.Tensor,
    hash_bytes: int,
    find: Callable[..., torch.Tensor],
    size: int,
    tombs: int,
) -> None:
    """The layout invariants of a restored table (ValueError naming
    state['table']): ``table`` int64 ``[C, W + 1]``, ``find`` its backend's
    ``find(table, W, gids, words)`` launcher (int64 ``[N]`` slots)."""
    live_mask = verify_slots(table, "table", size, tombs)
    W = table.shape[1] - 1
    verify_reachable(
        table, "table", hash_bytes, live_mask, lambda g, h: find(table, W, g, h)
    )


# Table sizes and CUDA-graph captures, for KeyIndex and FleetIndex alike.


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on a
    build or host without CUDA, where torch's query raises)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):
        return False


def refuse_growth_in_capture(what: str, n: int, room: int) -> None:
    """RuntimeError when a growth (``n`` keys that may be new, room for
    ``room``) would run inside a CUDA-graph capture: counting the new keys
    syncs the host and a rehash allocates, neither allowed in a capture, so
    the caller refuses before it changes anything."""
    if capturing():
        raise RuntimeError(
            f"{what}: {n} keys may need a table growth (room for {room} more) "
            "during a CUDA graph capture, which cannot allocate or sync; "
            "reserve() the capacity before capturing"
        )
