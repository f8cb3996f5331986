"""The store worker's candidate rule for the torch kernel family.

vLLM's ``MooncakeStoreWorker.lookup`` asks the store only about some keys
(``ReferenceCoordinator.lookup_candidates`` spells the rule per request); these
functions give the same keys for a whole batch of requests, without a Python
loop over them. The torch scanner (:mod:`kvhit.kernels.scan_torch`) restricts
its probes with them, and ``coordinator/candidates.worker_candidates`` lists
the keys the engine and the Mooncake binding send to a store. The numba family
spells the rule in ``kernels/candidates_numba.py`` and ``kernels/scan_numba.py``,
the Triton family in ``kernels/scan.py``.

``plan`` is a ``ScanPlan`` (``coordinator/plan.py``) read by attribute
(``candidates``, ``partial``, ``asked_chunks``): kernels/ never imports
coordinator/. All tensors are int64 on one device unless said otherwise.
Imports neither triton nor numba.
"""

from __future__ import annotations

from typing import Any

import torch

from kvhit.kernels.masks import sparse_window_chunk, sparse_window_mask

__all__ = ["candidate_units", "has_candidates", "in_lookup_mask"]


def in_lookup_mask(cp: Any, chunks: torch.Tensor) -> torch.Tensor:
    """bool, shaped as ``chunks``: whether each chunk (int64) of a sparse
    (sliding-window) group is in its lookup mask: the ``need`` blocks before
    each scheduler boundary, shifted by one block for EAGLE
    (``masks.sparse_window_mask`` with ``cp``'s numbers)."""
    return sparse_window_mask(chunks, cp.per_segment, cp.need, cp.shift)


def candidate_units(
    plan: Any, lengths: torch.Tensor, token_lens: torch.Tensor, gid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every hash unit the store worker asks about for group ``gid`` in
    requests of ``lengths`` hashes (int64 [R]) looked up at ``token_lens`` tokens
    (int64 [R], aligned): ``(owner, unit)``, each int64 [M], ``owner`` a
    request index in ``[0, R)``, ``unit`` a hash position in it."""
    cp = plan.candidates[gid]
    dev = lengths.device
    count = torch.clamp(plan.asked_chunks(cp, lengths, token_lens), min=0)
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), count)
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


def has_candidates(
    plan: Any, lengths: torch.Tensor, token_lens: torch.Tensor
) -> torch.Tensor:
    """bool [R]: whether the store worker asks about any key at all, for
    requests of ``lengths`` hashes looked up at ``token_lens`` tokens (int64
    [R]). No host sync."""
    anyc = torch.zeros_like(token_lens, dtype=torch.bool)
    for cp in plan.candidates:
        if not cp.cacheable:
            continue
        asked = plan.asked_chunks(cp, lengths, token_lens)
        if plan.partial or not cp.sparse:
            anyc |= asked > 0
        elif cp.need > 0:
            # Something is asked iff the lowest chunk of the sparse lookup
            # mask is below the limit.
            anyc |= asked > sparse_window_chunk(0, cp.per_segment, cp.need, cp.shift)
    return anyc
