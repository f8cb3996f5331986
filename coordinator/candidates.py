"""The store worker's candidate keys for a batch: what it asks the store.

vLLM's ``MooncakeStoreWorker.lookup`` asks the store only about some keys
(``ReferenceCoordinator.lookup_candidates`` spells the rule per request);
:func:`worker_candidates` lists the same keys for a whole batch from its CSR
offsets, without a Python loop over requests, with the torch family's
candidate rule (:mod:`kvhit.kernels.candidates_torch`, which the torch scanner
uses too). The engine's ``lookup_candidates`` and ``bindings/mooncake.py`` (the
keys it sends to a real store) call it.

All tensors are int64 on one device unless said otherwise.
"""

from __future__ import annotations

import torch

from kvhit.coordinator.plan import ScanPlan
from kvhit.kernels.candidates_torch import candidate_units

__all__ = ["worker_candidates"]


def worker_candidates(
    plan: ScanPlan, offsets: torch.Tensor, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``(group, hash row)`` the store worker asks the store about for a
    batch: ``(group_ids, rows)``, each int64 [K], grouped by group, then
    request; duplicates kept. ``offsets`` int64 [B + 1] (CSR), ``num_tokens``
    int64 [B]. Needs only the offsets, not the hashes."""
    align = plan.alignment
    starts = offsets[:-1]
    lengths = offsets[1:] - offsets[:-1]
    token_lens = torch.div(num_tokens, align, rounding_mode="floor") * align
    gids, rows = [], []
    for cp in plan.candidates:
        if not cp.cacheable:
            continue
        owner, unit = candidate_units(plan, lengths, token_lens, cp.group_id)
        rows.append(starts[owner] + unit)
        gids.append(torch.full_like(owner, cp.group_id))
    return torch.cat(gids), torch.cat(rows)
