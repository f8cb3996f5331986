"""The mask and limit formulas of the store rules, each written once.

Every function here uses only ``+``, ``-``, ``*``, ``//``, ``%``, comparisons
and ``&`` / ``|``, so the same function answers for Python ints (the scalar
reference, the plan) and for int64 torch tensors, element by element (the
batched backends): torch's ``//`` and ``%`` floor as Python's do, and a
comparison gives a bool tensor that ``&``, ``|`` and arithmetic accept. Mixed
arguments (a tensor of chunks, int sizes) broadcast as usual. Nothing here
imports torch.

It sits in ``kernels/`` beside the contract because every layer calls it: the
torch kernels (:mod:`kvhit.kernels.scan_torch`,
:mod:`kvhit.kernels.candidates_torch`) on tensors, the reference, the spec-kind
registry and the plan in ``coordinator/`` on ints. The compiled kernels
(Triton, numba) cannot call Python functions, so they keep their own
spelled-out copies; each copy cites the function here that it mirrors.

Names: a *chunk* is a block of the group (``block_size`` tokens; its key is
the last hash inside it); a *segment* is ``per_segment`` consecutive chunks
(a scheduler block, or a retention interval); ``need`` is how many blocks a
sliding-window hit finds in a row; ``shift`` is 1 for an EAGLE group (its
window ends one block later), else 0.
"""

from __future__ import annotations

from typing import Any

from kvhit.kernels.contract import cdiv

__all__ = [
    "IntLike",
    "asked_chunks",
    "mamba_replay_mask",
    "mamba_segment_mask",
    "minimum",
    "sliding_window_need",
    "sparse_window_chunk",
    "sparse_window_mask",
    "swa_replay_mask",
    "swa_segment_chunks",
]

# An int, or an int64 (bool where noted) torch tensor of any shape.
IntLike = Any


def minimum(a: IntLike, b: IntLike) -> IntLike:
    """The smaller of ``a`` and ``b`` (element by element for tensors), with
    arithmetic only: ``b + (a - b) * (a < b)``."""
    return b + (a - b) * (a < b)


def sliding_window_need(
    sliding_window: IntLike, block_size: IntLike, eagle: IntLike = 0
) -> IntLike:
    """Blocks a sliding-window hit must find in a row (vLLM's
    ``SlidingWindowManager``): ``cdiv(sliding_window - 1, block_size)``, plus
    one under EAGLE, whose extra block is matched and then dropped.

    ``eagle`` is 0/1 or a bool (an int or a tensor, e.g. the per-request EAGLE
    drop); the result is 0 for a window of one token without EAGLE.
    """
    return cdiv(sliding_window - 1, block_size) + eagle


def swa_segment_chunks(
    retention_interval: int | None, scheduler_block_size: int, block_size: int
) -> int | None:
    """Chunks per segment of a sliding window's sparse store/lookup mask: the
    scheduler block when ``retention_interval`` is ``None`` (lookup masks, and
    store masks with dense retention), the retention interval otherwise, and
    ``None`` for ``retention_interval == 0`` (only the replay boundaries are
    kept). Plain ints: this is layout configuration, not per request."""
    if retention_interval is None:
        return scheduler_block_size // block_size
    if retention_interval == 0:
        return None
    return retention_interval // block_size


def sparse_window_mask(
    chunk: IntLike, per_segment: IntLike, need: IntLike, shift: IntLike
) -> IntLike:
    """Whether ``chunk`` is in a sliding window's sparse store/lookup mask: the
    last ``need`` chunks of each segment of ``per_segment`` chunks, segments
    starting at chunk ``shift`` (vLLM's ``SlidingWindowManager.
    reachable_block_mask``). Only meaningful when ``need < per_segment``
    (otherwise the mask is dense). A bool, or a bool tensor shaped as the
    broadcast arguments."""
    return (chunk >= shift) & ((chunk - shift) % per_segment >= per_segment - need)


def sparse_window_chunk(
    k: IntLike, per_segment: IntLike, need: IntLike, shift: IntLike
) -> IntLike:
    """The ``k``-th chunk (from 0, in increasing order) that
    :func:`sparse_window_mask` keeps, for ``need >= 1``: the inverse that
    enumerates the mask's chunks without testing every chunk."""
    return shift + (k // need) * per_segment + (per_segment - need) + k % need


def swa_replay_mask(
    chunk: IntLike,
    boundary: IntLike,
    scheduler_block_size: IntLike,
    block_size: IntLike,
    need: IntLike,
    shift: IntLike,
) -> IntLike:
    """Whether ``chunk`` is one of the ``need`` sliding-window chunks a replay
    resuming at token ``boundary`` (``replay_boundaries``) needs: those ending
    at the boundary rounded down to a scheduler block, ``shift`` blocks
    later for EAGLE."""
    end = boundary // scheduler_block_size * scheduler_block_size // block_size
    end = end + shift
    return (chunk >= end - need) & (chunk < end)


def mamba_segment_mask(chunk: IntLike, per_segment: IntLike) -> IntLike:
    """Whether Mamba state ``chunk`` is kept by a sparse retention interval of
    ``per_segment`` chunks: the last state of each interval."""
    return (chunk + 1) % per_segment == 0


def mamba_replay_mask(
    chunk: IntLike,
    boundary: IntLike,
    scheduler_block_size: IntLike,
    block_size: IntLike,
) -> IntLike:
    """Whether Mamba state ``chunk`` is the one a replay resuming at token
    ``boundary`` needs: the state at the boundary rounded down to a scheduler
    block."""
    aligned = boundary // scheduler_block_size * scheduler_block_size
    return chunk == aligned // block_size - 1


def asked_chunks(
    num_hashes: IntLike,
    token_len: IntLike,
    block_size: IntLike,
    hashes_per_block: IntLike,
    sparse: bool,
) -> IntLike:
    """How many leading chunks of a group the Mooncake store worker's
    ``lookup`` loop walks for a prompt of ``num_hashes`` block hashes looked up
    at ``token_len`` tokens (aligned to the hit alignment).

    The loop stops at the last whole chunk the hashes name and at
    ``cdiv(token_len, block_size)``; a ``sparse`` group (a sliding window with
    a sparse lookup mask) also stops at the mask's length,
    ``token_len // block_size``, and asks only the chunks below the limit that
    :func:`sparse_window_mask` keeps.

    With partial hash hits the worker walks hash units of every group: pass
    ``block_size=hash_block_size``, ``hashes_per_block=1``, ``sparse=False``
    (``token_len`` is then a multiple of the hash block size, so this is
    ``min(num_hashes, token_len // hash_block_size)``).
    """
    limit = minimum(num_hashes // hashes_per_block, cdiv(token_len, block_size))
    if sparse:
        limit = minimum(limit, token_len // block_size)
    return limit
