"""The store worker's candidate keys and their dedup, in numba.

The numba family's candidate rule (vLLM's ``MooncakeStoreWorker.lookup``
asks the store only about some keys; ``ReferenceCoordinator.lookup_candidates``
spells the rule per request), written once here:

* :func:`asked_chunks_nb` / :func:`in_lookup_mask_nb`: how many leading chunks
  the worker walks, and whether a sparse group's chunk is in its lookup mask
  (``kernels/masks.py``'s ``asked_chunks`` and ``sparse_window_mask``);
* :func:`worker_candidates_nb` mirrors
  ``coordinator/candidates.py::worker_candidates`` (every ``(group, hash row)``
  the store worker asks about, grouped by group, then request, duplicates
  kept) in two passes over the requests, no ``[K]`` temporaries;
* :func:`first_occurrences_nb`: the first occurrence of each distinct
  ``(group, hash words)`` among them, through an open-addressing table keyed
  by the KeyIndex slot hash (``kernels/probe_numba.py``), equal keys compared
  word by word, never on the hash alone.

The plan arrives as the contract's candidate rows (int64 ``[G, CAND_WIDTH]``,
columns ``kernels/contract.py``'s ``CAND_COLS``, ``ScanPlan.candidates_as_rows``,
the rows the Triton and numba scans read), so each kernel compiles once
whatever the layout. Importing this module imports numba (its callers import
it lazily).
"""

from __future__ import annotations

import numba
import numpy as np

from kvhit.kernels.contract import (
    CAND_BLOCK_SIZE,
    CAND_CACHEABLE,
    CAND_GROUP_ID,
    CAND_NEED,
    CAND_PER_SEGMENT,
    CAND_SCALE,
    CAND_SHIFT,
    CAND_SPARSE,
)
from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.probe_numba import key_slot_hash

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = [
    "asked_chunks_nb",
    "first_occurrences_nb",
    "in_lookup_mask_nb",
    "worker_candidates_nb",
]


@numba.njit(inline="always", cache=True, nogil=True)
def asked_chunks_nb(partial, hbs, block_size, scale, sparse, num_hashes, token_len):
    """How many leading chunks (hash units, with partial hash hits) the store
    worker walks for a prompt of ``num_hashes`` hashes looked up at
    ``token_len`` tokens: ``kernels/masks.py::asked_chunks``, clamped at 0 as
    ``kernels/candidates_torch.py::candidate_units``."""
    if partial:
        lim = min(num_hashes, token_len // hbs)
    else:
        lim = min(num_hashes // scale, -((-token_len) // block_size))
        if sparse:
            lim = min(lim, token_len // block_size)
    return max(lim, 0)


@numba.njit(inline="always", cache=True, nogil=True)
def in_lookup_mask_nb(c, per_segment, need, shift):
    """Whether chunk ``c`` of a sparse (sliding-window) group is in its lookup
    mask: ``kernels/masks.py::sparse_window_mask``."""
    return c >= shift and (c - shift) % per_segment >= per_segment - need


@numba.njit(inline="always", cache=True, nogil=True)
def _asked(plan, q, num_hashes, num_tokens, partial, hbs, align):
    # asked_chunks_nb for candidate row q, at num_tokens aligned down.
    token_len = (num_tokens // align) * align
    return asked_chunks_nb(
        partial, hbs, plan[q, CAND_BLOCK_SIZE], plan[q, CAND_SCALE],
        plan[q, CAND_SPARSE] != 0, num_hashes, token_len,
    )  # fmt: skip


@numba.njit(inline="always", cache=True, nogil=True)
def _in_mask(plan, q, c):
    # in_lookup_mask_nb with candidate row q's numbers.
    return in_lookup_mask_nb(
        c, plan[q, CAND_PER_SEGMENT], plan[q, CAND_NEED], plan[q, CAND_SHIFT]
    )


@numba.njit(cache=True, nogil=True)
def worker_candidates_nb(offsets, num_tokens, plan, partial, hbs, align):
    """``coordinator/candidates.py::worker_candidates`` for one batch.

    Args:
        offsets: int64 ``[B + 1]`` CSR offsets.
        num_tokens: int64 ``[B]``, >= 0.
        plan: int64 ``[G, CAND_WIDTH]``, every group's candidate row
            (contract ``CAND_COLS``); groups not prefix cacheable are skipped.
        partial: partial hash hits (every hash unit below the aligned length
            is asked, no mask).
        hbs: hash block size; align: the layout's alignment.

    Returns:
        ``(group_ids, rows, request)``, int64 ``[K]`` each, grouped by group
        then request, as ``worker_candidates`` (``request`` owns each row).
    """
    B = num_tokens.shape[0]
    G = plan.shape[0]
    total = 0
    for q in range(G):
        if plan[q, CAND_CACHEABLE] == 0:
            continue
        sp = plan[q, CAND_SPARSE] != 0
        for b in range(B):
            cnt = _asked(
                plan, q, offsets[b + 1] - offsets[b], num_tokens[b], partial, hbs, align
            )
            if partial or not sp:
                total += cnt
            else:
                for c in range(cnt):
                    if _in_mask(plan, q, c):
                        total += 1
    gids = np.empty(total, dtype=np.int64)
    rows = np.empty(total, dtype=np.int64)
    req = np.empty(total, dtype=np.int64)
    k = 0
    for q in range(G):
        if plan[q, CAND_CACHEABLE] == 0:
            continue
        g, sc = plan[q, CAND_GROUP_ID], plan[q, CAND_SCALE]
        sp = plan[q, CAND_SPARSE] != 0
        for b in range(B):
            start = offsets[b]
            cnt = _asked(
                plan, q, offsets[b + 1] - start, num_tokens[b], partial, hbs, align
            )
            for c in range(cnt):
                if partial:
                    unit = c
                elif sp and not _in_mask(plan, q, c):
                    continue
                else:
                    unit = (c + 1) * sc - 1
                gids[k] = g
                rows[k] = start + unit
                req[k] = b
                k += 1
    return gids, rows, req


@numba.njit(cache=True, nogil=True)
def first_occurrences_nb(gids, rows, hashes):
    """Positions ``i`` (int64 ``[U]``, increasing) of the first occurrence of
    each distinct ``(gids[i], hashes[rows[i], :])``; ``gids``/``rows`` int64
    ``[K]``, ``hashes`` int64 ``[T, W]``."""
    K = gids.shape[0]
    W = hashes.shape[1]
    cap = 16
    while cap < 2 * K:
        cap *= 2
    mask = cap - 1
    table = np.full(cap, -1, dtype=np.int64)
    out = np.empty(K, dtype=np.int64)
    u = 0
    for i in range(K):
        g, r = gids[i], rows[i]
        s = key_slot_hash(g, hashes, r) & mask
        while True:
            j = table[s]
            if j < 0:
                table[s] = i
                out[u] = i
                u += 1
                break
            if gids[j] == g:
                rj = rows[j]
                same = True
                for w in range(W):
                    if hashes[rj, w] != hashes[r, w]:
                        same = False
                        break
                if same:
                    break
            s = (s + 1) & mask
    return out[:u]
