"""What a router computes from a fleet's keys: :func:`prefix_blocks`, the
overlap score of a router that counts cached blocks (Dynamo's, say), and
:func:`route`, an engine per request from ``[B, E]`` hits
(``LookupEngine.fleet_hits`` / ``fleet_lookup``) under Dynamo's cost model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from kvhit.coordinator.fleet_index import FleetIndex, check_fleet
from kvhit.coordinator.packing import HashBatch
from kvhit.kernels.checks import check_int, check_tensor, is_int

__all__ = ["prefix_blocks", "route"]


def prefix_blocks(
    batch: HashBatch,
    fleet: FleetIndex,
    group_ids: Sequence[int],
    scale: int,
    max_blocks: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """How many leading blocks of each request every engine holds, counting
    only the keys of ``group_ids`` (a block needs its key in each): int64
    ``[B, E]`` (0 for inactive engines). This is the overlap score of a router
    that counts cached blocks of one attention type, e.g. Dynamo's
    ``find_matches`` over full-attention events; it is not vLLM's hit (no
    alignment, EAGLE drop, sliding-window or Mamba rule).

    Args:
        batch: ``B`` requests' hashes (on the fleet's device, its hash width).
        fleet: the engines' keys.
        group_ids: the groups whose keys count (non-empty, each >= 0).
        scale: hash units per block (block ``i`` is keyed by hash unit
            ``(i + 1) * scale - 1``), >= 1.
        max_blocks: int64 ``[B]``, the most blocks counted per request, or
            None (every whole block of the request).
    """
    if not isinstance(batch, HashBatch):
        raise TypeError(f"batch must be a HashBatch, got {type(batch).__name__}")
    check_fleet(fleet, batch, batch.device)
    scale = check_int(scale, "scale", 1)
    if isinstance(group_ids, str | bytes) or not isinstance(group_ids, Iterable):
        raise TypeError(
            f"group_ids must be a sequence of ints, got {type(group_ids).__name__}"
        )
    gids = [check_int(g, "group_ids", 0) for g in group_ids]
    if not gids:
        raise ValueError("group_ids must name at least one group")
    B, E = len(batch), fleet.num_engines
    view = batch.view()
    n_units = view.lengths.cpu().numpy()
    if max_blocks is None:
        ends = n_units // scale
    else:
        ends = _max_blocks(max_blocks, B)
    members = np.array(gids, dtype=np.int64)
    if B == 0:
        return torch.zeros((0, E), dtype=torch.int64, device=fleet.device)
    return fleet.ops.full_runs(
        fleet.table, fleet.keys, fleet.bits, view.rows, view.offsets, view.lengths,
        ends, scale, members, fleet.live, fleet.active_mask, E,
    )  # fmt: skip


def _max_blocks(value: Any, B: int) -> np.ndarray:
    """:func:`prefix_blocks`' ``max_blocks`` as int64 ``[B]`` (a copy),
    each an integer in ``[0, 2**63)``; TypeError/ValueError naming it (a
    float or bool is refused, not truncated)."""
    if isinstance(value, torch.Tensor):
        arr = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        bad = next((i for i, v in enumerate(value) if not is_int(v)), None)
        if bad is not None:
            raise TypeError(
                f"max_blocks[{bad}] must be an int, got {type(value[bad]).__name__}"
            )
        if any(not 0 <= v < 1 << 63 for v in value):
            raise ValueError(f"max_blocks must be [{B}] ints in [0, 2**63)")
        arr = np.array([int(v) for v in value], dtype=np.int64)
    else:
        raise TypeError(
            "max_blocks must be an int64 tensor, an integer array or a sequence "
            f"of ints, got {type(value).__name__}"
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(f"max_blocks must hold integers, got dtype {arr.dtype}")
    if arr.shape != (B,):
        raise ValueError(f"max_blocks must have shape [{B}], got {list(arr.shape)}")
    if B and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 63):
        raise ValueError(f"max_blocks must be [{B}] ints in [0, 2**63)")
    return arr.astype(np.int64)


def route(
    hits: torch.Tensor,
    loads: torch.Tensor | Sequence[float] | None = None,
    *,
    prompt_tokens: torch.Tensor | Sequence[int] | None = None,
    block_size: int = 1,
    overlap_weight: float = 1.0,
    update_loads: bool = True,
) -> torch.Tensor:
    """Pick one engine per request, in one call: int64 ``[B]``.

    Cost model: Dynamo's KV router ("Routing Concepts", Cost Calculation,
    docs.nvidia.com/dynamo/dev/components/router/routing-concepts: ``cost =
    overlap_score_weight * prefill_blocks + decode_blocks``, prefill blocks the
    prompt tokens not cached on the worker over the block size, decode blocks
    the worker's active blocks), per request ``b`` and engine ``e``::

        prefill_blocks[b, e] = (prompt_tokens[b] - hits[b, e]) / block_size
        decode_blocks[e]     = loads[e]
        cost[b, e]           = overlap_weight * prefill_blocks[b, e] + loads[e]

    and the request goes to the engine of least cost. ``prompt_tokens``
    defaults to the row's largest hit (only the differences between engines
    matter, so the choice is the same for any prompt length). With
    ``update_loads`` (default) requests are placed in batch order and each
    placement adds its prompt's blocks (``prompt_tokens[b] / block_size``, or
    the row's largest hit in blocks) to the chosen engine's load before the
    next request is placed, as a router that sees them one at a time would.

    Ties: among engines of equal least cost, the one with the longest hit,
    then the least load, then the lowest engine id (deterministic; callers
    wanting random spreading permute engine ids themselves).

    Args:
        hits: int64 ``[B, E]``, tokens each engine would load
            (``LookupEngine.fleet_hits`` / ``fleet_lookup``); a negative
            entry marks an engine that may not take the request.
        loads: float or int ``[E]`` (decode blocks in flight per engine), or
            None (all 0).
        prompt_tokens: int ``[B]`` >= every hit of its row, or None.
        block_size: tokens per block (> 0) for the prefill term.
        overlap_weight: the prefill weight (>= 0).
        update_loads: add each placed request's blocks to its engine's load.

    Returns:
        int64 ``[B]`` on ``hits``' device; -1 for a request no engine may take.
    """
    check_tensor(hits, "hits", dim=2)
    B, E = hits.shape
    if E < 1:
        raise ValueError("hits must have at least one engine column")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
    ):
        raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
    if not isinstance(overlap_weight, int | float) or not overlap_weight >= 0:
        raise ValueError(f"overlap_weight must be >= 0, got {overlap_weight!r}")
    h = hits.detach().cpu().numpy().astype(np.float64)
    if loads is None:
        load = np.zeros(E, dtype=np.float64)
    else:
        load = np.asarray(
            loads.detach().cpu().numpy() if isinstance(loads, torch.Tensor) else loads,
            dtype=np.float64,
        )
        if load.shape != (E,) or not np.isfinite(load).all():
            raise ValueError(
                f"loads must be {E} finite numbers, got shape {load.shape}"
            )
        load = load.copy()
    allowed = h >= 0
    best = np.where(allowed, h, 0).max(axis=1) if E else np.zeros(B)
    if prompt_tokens is None:
        prompt = best
    else:
        prompt = np.asarray(
            prompt_tokens.detach().cpu().numpy()
            if isinstance(prompt_tokens, torch.Tensor)
            else prompt_tokens,
            dtype=np.float64,
        )
        if prompt.shape != (B,) or bool((prompt < best).any()):
            raise ValueError(
                f"prompt_tokens must be [{B}] with each >= its row's largest hit"
            )
    prefill = (prompt[:, None] - h) / block_size
    out = np.full(B, -1, dtype=np.int64)
    for b in range(B):
        if not allowed[b].any():
            continue
        cost = overlap_weight * prefill[b] + load
        cost = np.where(allowed[b], cost, np.inf)
        # Lexicographic: cost, then longer hit, then lower load, then lower id.
        order = np.lexsort((np.arange(E), load, -h[b], cost))
        e = int(order[0])
        out[b] = e
        if update_loads:
            load[e] += prompt[b] / block_size
    return torch.from_numpy(out).to(hits.device)
