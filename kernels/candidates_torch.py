"""The store worker's candidate rule for the torch kernel family.

vLLM's ``MooncakeStoreWorker.lookup`` asks the store only about some keys
(``ReferenceCoordinator.lookup_candidates`` spells the rule per request); these
functions give the same keys for a whole batch of requests, without a Python
loop over them. The torch scanner (:mod:`kvhit.kernels.scan_torch`) restricts
its probes with them, and ``coordinator/candidates.worker_candidates`` lists
the keys the engine and the Mooncake binding send to a store. The numba family
spells the rule in ``kernels/candidates_numba.py`` and ``kernels/scan_numba_sg.py``,
the Triton family in ``kernels/scan.py``.

A plan comes as its candidate rows (:func:`candidate_rows` decodes
``ScanPlan.candidates_as_rows()``, columns ``contract.CAND_COLS``) and its
:class:`~kvhit.kernels.contract.PlanParams`, as the numba and Triton kernels
take it: nothing here calls back into coordinator/. All tensors are int64 on
one device unless said otherwise. Imports neither triton nor numba.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvhit.kernels.contract import CandRow, PlanParams
from kvhit.kernels.masks import asked_chunks, sparse_window_chunk, sparse_window_mask

__all__ = [
    "CandRow",
    "asked",
    "candidate_rows",
    "candidate_units",
    "has_candidates",
    "in_lookup_mask",
]


def candidate_rows(cand_rows: Any) -> tuple[CandRow, ...]:
    """``cand_rows`` (int64 ``[G, CAND_WIDTH]``: a tensor, a numpy array or
    lists) as one :class:`CandRow` per group."""
    rows = cand_rows.tolist() if hasattr(cand_rows, "tolist") else cand_rows
    return tuple(CandRow.from_row(r) for r in rows)


def asked(cp: Any, params: PlanParams, num_hashes: Any, token_len: Any) -> Any:
    """How many leading chunks of group ``cp`` (a :class:`CandRow`; with
    partial hash hits: hash units) the store worker's loop walks for
    prompts of ``num_hashes`` hashes looked up at ``token_len`` tokens (ints,
    or int64 tensors of one shape): :func:`kvhit.kernels.masks.asked_chunks`
    with the plan's numbers."""
    if params.partial:
        return asked_chunks(num_hashes, token_len, params.hash_block_size, 1, False)
    return asked_chunks(num_hashes, token_len, cp.block_size, cp.scale, cp.sparse)


def in_lookup_mask(cp: Any, chunks: torch.Tensor) -> torch.Tensor:
    """bool, shaped as ``chunks``: whether each chunk (int64) of a sparse
    (sliding-window) group is in its lookup mask: the ``need`` blocks before
    each scheduler boundary, shifted by one block for EAGLE
    (``masks.sparse_window_mask`` with ``cp``'s numbers)."""
    return sparse_window_mask(chunks, cp.per_segment, cp.need, cp.shift)


def candidate_units(
    cands: Sequence[Any],
    params: PlanParams,
    lengths: torch.Tensor,
    token_lens: torch.Tensor,
    gid: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every hash unit the store worker asks about for group ``gid`` in
    requests of ``lengths`` hashes (int64 [R]) looked up at ``token_lens`` tokens
    (int64 [R], aligned): ``(owner, unit)``, each int64 [M], ``owner`` a
    request index in ``[0, R)``, ``unit`` a hash position in it. ``cands``:
    one :class:`CandRow` per group (:func:`candidate_rows`)."""
    cp = cands[gid]
    dev = lengths.device
    count = torch.clamp(asked(cp, params, lengths, token_lens), min=0)
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), count)
    chunks = (
        torch.arange(owner.numel(), device=dev)
        - (torch.cumsum(count, 0) - count)[owner]
    )
    if params.partial:
        return owner, chunks
    if cp.sparse:
        keep = in_lookup_mask(cp, chunks)
        owner, chunks = owner[keep], chunks[keep]
    return owner, (chunks + 1) * cp.scale - 1


def has_candidates(
    cands: Sequence[Any],
    params: PlanParams,
    lengths: torch.Tensor,
    token_lens: torch.Tensor,
) -> torch.Tensor:
    """bool [R]: whether the store worker asks about any key at all, for
    requests of ``lengths`` hashes looked up at ``token_lens`` tokens (int64
    [R]). ``cands`` as :func:`candidate_units`. No host sync."""
    anyc = torch.zeros_like(token_lens, dtype=torch.bool)
    for cp in cands:
        if not cp.cacheable:
            continue
        n = asked(cp, params, lengths, token_lens)
        if params.partial or not cp.sparse:
            anyc |= n > 0
        elif cp.need > 0:
            # Something is asked iff the lowest chunk of the sparse lookup
            # mask is below the limit.
            anyc |= n > sparse_window_chunk(0, cp.per_segment, cp.need, cp.shift)
    return anyc
