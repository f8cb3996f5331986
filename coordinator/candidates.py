"""The store worker's candidate keys for a batch: what it asks the store.

vLLM's ``MooncakeStoreWorker.lookup`` asks the store only about some keys
(``ReferenceCoordinator.lookup_candidates`` spells the rule per request);
:func:`worker_candidates` lists the same keys for a whole batch from its CSR
offsets, without a Python loop over requests, with the torch family's
candidate rule (:mod:`kvhit.kernels.candidates_torch`, which the torch scanner
uses too). The engine's ``lookup_candidates`` and ``bindings/store_sync.py`` (the
keys it sends to a real store) call it.

All tensors are int64 on one device unless said otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from kvhit.coordinator.plan import ScanPlan, plan_tensors
from kvhit.kernels.candidates_torch import candidate_units

__all__ = [
    "first_occurrences",
    "format_keys",
    "host_worker_candidates",
    "worker_candidates",
]


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
        owner, unit = candidate_units(
            plan.candidates, plan.params, lengths, token_lens, cp.group_id
        )
        rows.append(starts[owner] + unit)
        gids.append(torch.full_like(owner, cp.group_id))
    return torch.cat(gids), torch.cat(rows)


# -- the host (numba) family, for a store binding (imported on first use) --------


def host_worker_candidates(
    plan: ScanPlan, offsets: np.ndarray, num_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`worker_candidates` on host arrays through the numba family
    (``kernels/candidates_numba.py``), plus each key's request:
    ``(group_ids, rows, request)`` int64 ``[K]``. ``offsets`` int64
    ``[B + 1]``, ``num_tokens`` int64 ``[B]`` (>= 0)."""
    from kvhit.kernels.candidates_numba import worker_candidates_nb

    return worker_candidates_nb(
        np.ascontiguousarray(offsets, dtype=np.int64),
        np.ascontiguousarray(num_tokens, dtype=np.int64),
        plan_tensors(plan, "cpu")[1].numpy(),
        bool(plan.partial),
        int(plan.hash_block_size),
        int(plan.alignment),
    )


def first_occurrences(
    gids: np.ndarray, rows: np.ndarray, hashes: np.ndarray
) -> np.ndarray:
    """Indices (int64 ``[U]``, in order) of the first occurrence of each
    distinct key ``(gids[i], hashes[rows[i]])``: ``gids``, ``rows`` int64
    ``[K]``, ``hashes`` int64 ``[N, W]`` (numba; keys compared word by word)."""
    from kvhit.kernels.candidates_numba import first_occurrences_nb

    return first_occurrences_nb(gids, rows, hashes)


def format_keys(
    words: np.ndarray,
    gids: np.ndarray,
    hash_bytes: int,
    pref_blob: np.ndarray,
    pref_offs: np.ndarray,
    group_pref: np.ndarray,
) -> np.ndarray:
    """Store key bytes ``prefix + hash.hex()`` for each key and each prefix of
    its group, ``\\n``-separated: uint8 ``[L]`` (numba,
    ``kernels/format_keys_numba.py``, whose docstring gives the arguments)."""
    from kvhit.kernels.format_keys_numba import format_keys_nb

    return format_keys_nb(words, gids, hash_bytes, pref_blob, pref_offs, group_pref)
