"""The store worker's candidate keys, batched in torch.

vLLM's ``MooncakeStoreWorker.lookup`` asks the store only about some keys
(``ReferenceCoordinator.lookup_candidates`` spells the rule per request); these
functions give the same keys for a whole batch from its CSR offsets, without
a Python loop over requests. The engine (``lookup_candidates``, the triton
backend's ``any candidate`` test) and ``bindings/mooncake.py`` (the keys it
sends to a real store) use them.

All tensors are int64 on one device unless said otherwise.
"""

from __future__ import annotations

import torch

from kvhit.coordinator.masks import sparse_window_chunk, sparse_window_mask
from kvhit.coordinator.plan import CandidatePlan, ScanPlan

__all__ = [
    "asked_chunks",
    "candidate_units",
    "has_candidates",
    "in_lookup_mask",
    "worker_candidates",
]


def asked_chunks(
    plan: ScanPlan, cp: CandidatePlan, lens: torch.Tensor, token_lens: torch.Tensor
) -> torch.Tensor:
    """int64 [R]: how many leading chunks of group ``cp`` (with partial hash
    hits: hash units) the store worker's loop walks, for requests of ``lens``
    hashes (int64 [R]) looked up at ``token_lens`` tokens (int64 [R], aligned
    to the hit alignment); sparse groups ask only the chunks
    :func:`in_lookup_mask` keeps among them. :meth:`ScanPlan.asked_chunks`
    (``masks.asked_chunks``) on tensors."""
    return plan.asked_chunks(cp, lens, token_lens)


def in_lookup_mask(cp: CandidatePlan, chunks: torch.Tensor) -> torch.Tensor:
    """bool, shaped as ``chunks``: whether each chunk (int64) of a sparse
    (sliding-window) group is in its lookup mask: the ``need`` blocks before
    each scheduler boundary, shifted by one block for EAGLE
    (``masks.sparse_window_mask`` with ``cp``'s numbers)."""
    return sparse_window_mask(chunks, cp.per_segment, cp.need, cp.shift)


def candidate_units(
    plan: ScanPlan, lens: torch.Tensor, token_lens: torch.Tensor, gid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every hash unit the store worker asks about for group ``gid`` in
    requests of ``lens`` hashes (int64 [R]) looked up at ``token_lens`` tokens
    (int64 [R], aligned): ``(owner, unit)``, each int64 [M], ``owner`` a
    request index in ``[0, R)``, ``unit`` a hash position in it."""
    cp = plan.candidates[gid]
    dev = lens.device
    count = torch.clamp(asked_chunks(plan, cp, lens, token_lens), min=0)
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), count)
    chunks = (
        torch.arange(owner.numel(), device=dev)
        - (torch.cumsum(count, 0) - count)[owner]
    )
    if plan.partial:
        return owner, chunks
    if cp.sparse:
        keep = in_lookup_mask(cp, chunks)
        owner, chunks = owner[keep], chunks[keep]
    return owner, (chunks + 1) * cp.scale - 1


def worker_candidates(
    plan: ScanPlan, offsets: torch.Tensor, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``(group, hash row)`` the store worker asks the store about for a
    batch: ``(group_ids, rows)``, each int64 [K], grouped by group, then
    request; duplicates kept. ``offsets`` int64 [B + 1] (CSR), ``num_tokens``
    int64 [B]. Needs only the offsets, not the hashes."""
    align = plan.alignment
    starts = offsets[:-1]
    lens = offsets[1:] - offsets[:-1]
    token_lens = torch.div(num_tokens, align, rounding_mode="floor") * align
    gids, rows = [], []
    for cp in plan.candidates:
        if not cp.cacheable:
            continue
        owner, unit = candidate_units(plan, lens, token_lens, cp.group_id)
        rows.append(starts[owner] + unit)
        gids.append(torch.full_like(owner, cp.group_id))
    return torch.cat(gids), torch.cat(rows)


def has_candidates(
    plan: ScanPlan, lens: torch.Tensor, token_lens: torch.Tensor
) -> torch.Tensor:
    """bool [R]: whether the store worker asks about any key at all, for
    requests of ``lens`` hashes looked up at ``token_lens`` tokens (int64
    [R]). No host sync."""
    anyc = torch.zeros_like(token_lens, dtype=torch.bool)
    for cp in plan.candidates:
        if not cp.cacheable:
            continue
        asked = asked_chunks(plan, cp, lens, token_lens)
        if plan.partial or not cp.sparse:
            anyc |= asked > 0
        elif cp.need > 0:
            # Something is asked iff the lowest chunk of the sparse lookup
            # mask is below the limit.
            anyc |= asked > sparse_window_chunk(0, cp.per_segment, cp.need, cp.shift)
    return anyc
