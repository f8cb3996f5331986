"""The store worker's candidate keys, their dedup and their key bytes, in numba.

One host step of ``KvhitLookupServer`` (``bindings/mooncake.py``) on the CPU:

* :func:`worker_candidates_nb` mirrors
  ``coordinator/candidates.py::worker_candidates`` (every ``(group, hash row)``
  the store worker asks about, grouped by group, then request, duplicates
  kept) in two passes over the requests, no ``[K]`` temporaries;
* :func:`first_occurrences_nb`: the first occurrence of each distinct
  ``(group, hash words)`` among them, through an open-addressing table keyed
  by the KeyIndex slot hash (``kernels/probe_numba.py``), equal keys compared
  word by word, never on the hash alone;
* :func:`key_blob_nb`: ``prefix + hash.hex()`` for each distinct pair and
  each of its group's prefixes, written as one ``\\n``-separated byte string
  (one ``decode`` + ``split`` gives the key strings).

The plan arrives as int64 arrays (one row per cacheable group, columns
:data:`CAND_PLAN_COLS`), so each kernel compiles once whatever the layout.
Importing this module imports numba (its callers import it lazily).
"""

from __future__ import annotations

import numba
import numpy as np

from kvhit.kernels.probe_numba import key_slot_hash

__all__ = [
    "CAND_PLAN_COLS",
    "first_occurrences_nb",
    "key_blob_nb",
    "worker_candidates_nb",
]

#: Columns of the per-group plan rows :func:`worker_candidates_nb` reads
#: (``CandidatePlan`` fields of the prefix-cacheable groups, in plan order).
CAND_PLAN_COLS = (
    "group_id",
    "block_size",
    "scale",
    "sparse",
    "per_segment",
    "need",
    "shift",
)

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@numba.njit(inline="always", cache=True, nogil=True)
def _asked(partial, hbs, block_size, scale, sparse, n, tl):
    # coordinator/candidates.py::asked_chunks, clamped at 0 as candidate_units.
    if partial:
        lim = min(n, tl // hbs)
    else:
        lim = min(n // scale, -((-tl) // block_size))
        if sparse:
            lim = min(lim, tl // block_size)
    return max(lim, 0)


@numba.njit(inline="always", cache=True, nogil=True)
def _in_mask(c, per_segment, need, shift):
    # coordinator/candidates.py::in_lookup_mask (c - shift >= 0 when tested).
    return c >= shift and (c - shift) % per_segment >= per_segment - need


@numba.njit(cache=True, nogil=True)
def worker_candidates_nb(offsets, num_tokens, plan, partial, hbs, align):
    """``coordinator/candidates.py::worker_candidates`` for one batch.

    Args:
        offsets: int64 ``[B + 1]`` CSR offsets.
        num_tokens: int64 ``[B]``, >= 0.
        plan: int64 ``[C, len(CAND_PLAN_COLS)]``, the cacheable groups.
        partial: partial hash hits (every hash unit below the aligned length
            is asked, no mask).
        hbs: hash block size; align: the layout's alignment.

    Returns:
        ``(group_ids, rows, request)``, int64 ``[K]`` each, grouped by group
        then request, as ``worker_candidates`` (``request`` owns each row).
    """
    B = num_tokens.shape[0]
    C = plan.shape[0]
    total = 0
    for q in range(C):
        bs, sc, sp = plan[q, 1], plan[q, 2], plan[q, 3] != 0
        p, need, shift = plan[q, 4], plan[q, 5], plan[q, 6]
        for b in range(B):
            tl = (num_tokens[b] // align) * align
            cnt = _asked(partial, hbs, bs, sc, sp, offsets[b + 1] - offsets[b], tl)
            if partial or not sp:
                total += cnt
            else:
                for c in range(cnt):
                    if _in_mask(c, p, need, shift):
                        total += 1
    gids = np.empty(total, dtype=np.int64)
    rows = np.empty(total, dtype=np.int64)
    req = np.empty(total, dtype=np.int64)
    k = 0
    for q in range(C):
        g, bs, sc, sp = plan[q, 0], plan[q, 1], plan[q, 2], plan[q, 3] != 0
        p, need, shift = plan[q, 4], plan[q, 5], plan[q, 6]
        for b in range(B):
            start = offsets[b]
            tl = (num_tokens[b] // align) * align
            cnt = _asked(partial, hbs, bs, sc, sp, offsets[b + 1] - start, tl)
            for c in range(cnt):
                if partial:
                    unit = c
                elif sp and not _in_mask(c, p, need, shift):
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


@numba.njit(cache=True, nogil=True)
def key_blob_nb(words, gids, hash_bytes, pref_blob, pref_offs, group_pref):
    """The key strings' bytes: for each pair ``i`` (``words`` int64 ``[N, W]``
    little-endian hash words, ``gids`` int64 ``[N]``) and each prefix ``p`` of
    its group (``pref_blob[pref_offs[p]:pref_offs[p + 1]]``, ``p`` in
    ``group_pref[g]:group_pref[g + 1]``), ``prefix + hex(hash bytes)``, keys
    separated by ``\n`` (none after the last): uint8 ``[L]``."""
    N = words.shape[0]
    size = 0
    for i in range(N):
        g = gids[i]
        for p in range(group_pref[g], group_pref[g + 1]):
            size += pref_offs[p + 1] - pref_offs[p] + 2 * hash_bytes + 1
    out = np.empty(max(size - 1, 0), dtype=np.uint8)
    hexd = _HEX
    # Each hash's hex once, copied under each of its group's prefixes.
    hx = np.empty(2 * hash_bytes, dtype=np.uint8)
    k = 0
    for i in range(N):
        g = gids[i]
        for byte in range(hash_bytes):
            v = (words[i, byte >> 3] >> ((byte & 7) * 8)) & 0xFF
            hx[2 * byte] = hexd[v >> 4]
            hx[2 * byte + 1] = hexd[v & 15]
        for p in range(group_pref[g], group_pref[g + 1]):
            if k:
                out[k] = 10
                k += 1
            a, b = pref_offs[p], pref_offs[p + 1]
            out[k : k + b - a] = pref_blob[a:b]
            k += b - a
            out[k : k + 2 * hash_bytes] = hx
            k += 2 * hash_bytes
    return out
