"""The numba scan of one SpecGroup and its probes, from
:mod:`kvhit.kernels.scan_numba` (which holds the request rule, the batch
loops and the launchers): the store worker's candidate test and its presence
probes, the prefetches, the leading run and the rightmost-run search, and
:func:`scan_sg`, one SpecGroup's hit search. Every function here is a numba
kernel called from scan_numba's compiled code, never from Python.
"""

from __future__ import annotations

import numba

from kvhit.kernels.contract import (
    CAND_BLOCK_SIZE,
    CAND_CACHEABLE,
    CAND_NEED,
    CAND_PER_SEGMENT,
    CAND_SCALE,
    CAND_SHIFT,
    CAND_SPARSE,
    KIND_CHUNKED,
    KIND_FULL,
    KIND_MAMBA,
    KIND_SWA,
    SG_BLOCK_SIZE,
    SG_CHUNK,
    SG_FINE,
    SG_KIND,
    SG_MARGIN,
    SG_MEMBERS,
    SG_N_MEMBERS,
    SG_NEED,
    SG_PERIOD,
    SG_SCALE,
    SG_USE_EAGLE,
)
from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.probe_numba import (
    COUNT_COLS,
    key_slot_hash,
    prefetch_cell,
    prefetch_row,
    table_find,
    table_find_counted,
    table_find_from,
)

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = [
    "COUNTING_BIT",
    "JIT",
    "NEVER",
    "PREFETCH_BIT",
    "RUN_STRETCH",
    "any_candidate",
    "candidate_limits",
    "jit_cdiv",
    "leading_run",
    "prefetch_blocks",
    "prefetch_windows",
    "probe_block",
    "rightmost_run",
    "scan_sg",
]

# A bound no scan answer is known to hold down to.
NEVER = 1 << 62

# No reference counting (numba's ``_nrt`` flag off): no kernel here allocates
# or returns an array, and every array it is given outlives the call, so the
# atomic count updates numba would place around each array it passes or
# slices (a view per request, a dozen arrays per call) only cost time: 1.04-
# 1.09x on long-hit lookups. The threaded loop keeps it (its scheduler may
# allocate).
JIT = {"cache": True, "nogil": True, "_nrt": False}

RUN_STRETCH = 8

# Bits of a scan's ``has_index`` (bit 1: probe the index): prefetch, and
# count every probe (count_probes: ``glim``'s columns past the limits are
# counters, not kept home slots).
PREFETCH_BIT = 2
COUNTING_BIT = 4


@numba.njit(**JIT)
def jit_cdiv(a, b):
    # Mirrors masks.cdiv (kernels/contract.py), compiled.
    return -((-a) // b)


# -- presence -------------------------------------------------------------------


@numba.njit(**JIT)
def candidate_limits(n_units, token_len, cand, partial, hbs, glim):
    """Per group, how many chunks (hash units, with partial hash hits) the
    store worker's loop walks for a lookup of ``token_len`` tokens, into
    ``glim`` (int64 ``[G]``); computed once per request so that a probe's
    position test costs one division. Mirrors the loop bounds of
    ``ReferenceCoordinator.lookup_candidates``."""
    # The limit is coordinator.masks.asked_chunks (ScanPlan.asked_chunks).
    for gid in range(cand.shape[0]):
        if partial:
            glim[gid] = min(n_units, token_len // hbs)
            continue
        bs = cand[gid, CAND_BLOCK_SIZE]
        lim = min(n_units // cand[gid, CAND_SCALE], jit_cdiv(token_len, bs))
        if cand[gid, CAND_SPARSE] != 0:
            # The SWA lookup mask has token_len // bs entries.
            lim = min(lim, token_len // bs)
        glim[gid] = lim


@numba.njit(**JIT)
def any_candidate(glim, cand, partial):
    """Whether the store worker asks about any key at all (its
    ``lookup_candidates`` is not empty), from the limits
    :func:`candidate_limits` wrote into ``glim``."""
    for gid in range(cand.shape[0]):
        if cand[gid, CAND_CACHEABLE] == 0:
            continue
        asked = glim[gid]
        if partial or cand[gid, CAND_SPARSE] == 0:
            if asked > 0:
                return True
            continue
        need = cand[gid, CAND_NEED]
        # The lowest chunk a sparse lookup mask keeps
        # (masks.sparse_window_chunk(0, per_segment, need, shift)).
        if need > 0 and asked > (
            cand[gid, CAND_SHIFT] + cand[gid, CAND_PER_SEGMENT] - need
        ):
            return True
    return False


@numba.njit(inline="always", **JIT)
def _is_candidate(u, blk, bscale, glim, cand, gid, partial):
    """Does the store worker ask about hash unit ``u`` (block ``blk`` at
    hash-unit scale ``bscale``: ``u = (blk + 1) * bscale - 1``) for group
    ``gid`` (by position; ``glim`` from :func:`candidate_limits`)? Mirrors
    ``ReferenceCoordinator.lookup_candidates``."""
    if cand[gid, CAND_CACHEABLE] == 0:
        return False
    if partial:
        return u < glim[gid]
    s = cand[gid, CAND_SCALE]
    u1 = u + 1
    if s == bscale:
        # The scan's own blocks (the common case): chunk ``blk``, no division.
        c = blk
    elif s == 1:
        c = u
    else:
        c = u1 // s - 1
        if (c + 1) * s != u1:
            return False
    if c >= glim[gid]:
        return False
    if cand[gid, CAND_SPARSE] != 0:
        # The SWA lookup mask (``reference.sliding_window_reachable_mask``
        # without retention): the last `need` chunks of each scheduler
        # segment; mirrors ``masks.sparse_window_mask``.
        shift = cand[gid, CAND_SHIFT]
        per = cand[gid, CAND_PER_SEGMENT]
        if c < shift or (c - shift) % per < per - cand[gid, CAND_NEED]:
            return False
    return True


@numba.njit(**JIT)
def _same_hash(rows, a, b):
    for j in range(rows.shape[1]):
        if rows[a, j] != rows[b, j]:
            return False
    return True


@numba.njit(**JIT)
def _dup_candidate(u, off, glim, rows, cand, gid, partial):
    """Whether the hash at unit ``u`` (not a candidate position) also stands at
    a candidate position of the request: the worker's present set holds hash
    values, not positions (``ReferenceCoordinator.lookup``'s ``present``).
    Enumerates the candidate positions directly, as the Triton kernel does."""
    if cand[gid, CAND_CACHEABLE] == 0:
        return False
    me = off + u
    lim = glim[gid]
    if partial:
        for v in range(lim):
            if _same_hash(rows, off + v, me):
                return True
        return False
    s = cand[gid, CAND_SCALE]
    if cand[gid, CAND_SPARSE] == 0:
        for c in range(lim):
            if _same_hash(rows, off + (c + 1) * s - 1, me):
                return True
        return False
    shift = cand[gid, CAND_SHIFT]
    per = cand[gid, CAND_PER_SEGMENT]
    need = cand[gid, CAND_NEED]
    if need <= 0:
        return False
    # Kept chunks: c = shift + m * per + (per - need) + t, 0 <= t < need
    # (``masks.sparse_window_chunk`` of k = m * need + t).
    base = shift + per - need
    while base < lim:
        for t in range(need):
            c = base + t
            if c >= lim:
                break
            if _same_hash(rows, off + (c + 1) * s - 1, me):
                return True
        base += per
    return False


@numba.njit(inline="always", **JIT)
def probe_block(blk, bscale, sg, sgi, off, n_units, glim, has_tl, rows, table, has_index,
           cand, partial, hbs, hb):  # fmt: skip
    """Is block ``blk`` (hash unit ``u = (blk + 1) * bscale - 1``) of the
    request present for every member group of SpecGroup ``sgi``? A merged
    SpecGroup hits only when every member holds the hash (reference
    ``_Pool.hit``). Units past the hashes are misses."""
    u = (blk + 1) * bscale - 1
    if u < 0 or u >= n_units:
        return False
    row = off + u
    nm = sg[sgi, SG_N_MEMBERS]
    for k in range(nm):
        gid = sg[sgi, SG_MEMBERS + k]
        # Cheapest test first: the position rule, then the table, then (only
        # for a present key at a position the worker does not ask) the value.
        odd = has_tl and not _is_candidate(u, blk, bscale, glim, cand, gid, partial)
        if has_index:
            # count_probes: ``glim``'s columns past the limits are counters.
            if has_index >= COUNTING_BIT:
                # Per SpecGroup too: column COUNT_COLS + sgi past the limits.
                glim[cand.shape[0] + COUNT_COLS + sgi] += 1
                slot = table_find_counted(table, gid, rows, row, glim, cand.shape[0])
            elif hb >= 0:
                # The home slot prefetch_blocks hashed already.
                slot = table_find_from(
                    table, glim[cand.shape[0] + (blk - hb) * nm + k], gid, rows, row
                )
            else:
                slot = table_find(table, gid, rows, row)
            if slot < 0:
                return False
        if odd and not _dup_candidate(u, off, glim, rows, cand, gid, partial):
            return False
    return True


# -- prefetching --------------------------------------------------------------------


@numba.njit(inline="always", **JIT)
def prefetch_blocks(first, last, scale, sg, sgi, off, n_units, rows, table, glim,
                     base):  # fmt: skip
    """Start the loads of probing blocks ``first..last`` (either order) of
    SpecGroup ``sgi``: their hash rows, then every member's home slot.

    On a table far past the caches a probe is two dependent misses (its hash
    row, then its slot), and a scan's probes follow each other; blocks a scan
    will probe as a group (a sliding window, the next stretch of a leading
    run) are fetched together instead, so their misses overlap. The rows
    first, all of them: the slot hashes then wait for one row miss, not one
    each. Both ends of a home slot: a 40-byte slot straddles two 64-byte
    lines half the time, and its key words are read right after its group
    id. Hints only: no effect on results.

    The home slots are kept in ``glim`` from column ``base`` on (per block
    and member from block ``min(first, last)``; ``base`` -1: not kept) when
    they fit, so that the probes of these
    blocks do not hash their keys again: returns that first block, or -1
    when they were not kept (long-hit lookups 1.0-1.13x). Not for one-word
    keys, whose hash is cheaper than keeping it (the trace's full
    attention: 0.90x kept, 0.96x not)."""
    lo = max(min(first, last), 0)
    hi = max(first, last)
    # Only blocks keyed inside the request: block i reads hash unit
    # (i + 1) * scale - 1.
    hi = min(hi, n_units // scale - 1)
    for i in range(lo, hi + 1):
        prefetch_row(rows, off + (i + 1) * scale - 1)
    mask = table.shape[0] - 1
    last = table.shape[1] - 1
    nm = sg[sgi, SG_N_MEMBERS]
    keep = (
        base >= 0 and rows.shape[1] > 1 and (hi - lo + 1) * nm <= glim.shape[0] - base
    )
    for i in range(lo, hi + 1):
        r = off + (i + 1) * scale - 1
        for k in range(nm):
            home = key_slot_hash(sg[sgi, SG_MEMBERS + k], rows, r) & mask
            prefetch_cell(table, home, 0)
            prefetch_cell(table, home, last)
            if keep:
                glim[base + (i - lo) * nm + k] = home
    return lo if keep else -1


@numba.njit(inline="always", **JIT)
def _prefetch_rows(first, last, scale, off, n_units, rows):
    """Start the loads of the hash rows of probing blocks ``first..last``
    only (no slot hashing: cheap enough to spend on blocks a scan may not
    reach). Hints only: no effect on results."""
    hi = min(last, n_units // scale - 1)
    for i in range(max(first, 0), hi + 1):
        prefetch_row(rows, off + (i + 1) * scale - 1)


@numba.njit(**JIT)
def prefetch_windows(start, curr, apply_eagle, sg, off, n_units, rows, hbs):
    """After full attention's first scan: start the row loads of the window
    each sliding-window SpecGroup from ``start`` on will search first, as
    ``_find_one``'s first round goes if those windows hit (its bound carried
    along from ``curr``, the EAGLE margin included), so their slot hashes
    need not wait a round trip for the rows. Hints only."""
    multi = sg.shape[0] > 1
    for idx in range(start, sg.shape[0]):
        if sg[idx, SG_KIND] != KIND_SWA:
            break
        bs = sg[idx, SG_BLOCK_SIZE]
        q = sg[idx, SG_PERIOD]
        drop = apply_eagle and sg[idx, SG_USE_EAGLE] != 0
        bound = curr
        if multi and drop:
            bound = min(curr + sg[idx, SG_MARGIN], n_units * hbs)
        need = max(sg[idx, SG_NEED] + (1 if drop else 0), 1)
        top = bound // bs - 1
        if top < need - 1:
            break
        j = top - (top - (0 if drop else q - 1)) % q
        if j < need - 1:
            break
        _prefetch_rows(j - need + 1, j, sg[idx, SG_SCALE], off, n_units, rows)
        curr = (j if drop else j + 1) * bs


@numba.njit(inline="always", **JIT)
def _homes_base(has_index, cand):
    # Where prefetch_blocks keeps home slots in ``glim``: past the limits,
    # unless those columns are count_probes' counters.
    return -1 if has_index >= COUNTING_BIT else cand.shape[0]


# -- scan primitives -------------------------------------------------------------


@numba.njit(inline="always", **JIT)
def leading_run(start, end, scale, sg, sgi, off, n_units, glim, has_tl, rows,
                 table, has_index, cand, partial, hbs):  # fmt: skip
    """How many consecutive blocks from ``start`` (below ``end``) hit; block
    ``i`` is keyed by hash unit ``(i + 1) * scale - 1`` (reference ``_View``)."""
    count = 0
    hb = -1
    for i in range(start, end):
        if has_index & PREFETCH_BIT and (i - start) % RUN_STRETCH == 0:
            hb = prefetch_blocks(i, min(i + RUN_STRETCH, end) - 1, scale, sg,
                                  sgi, off, n_units, rows, table, glim,
                                  _homes_base(has_index, cand))  # fmt: skip
            _prefetch_rows(i + RUN_STRETCH, min(i + 2 * RUN_STRETCH, end) - 1,
                           scale, off, n_units, rows)  # fmt: skip
        if not probe_block(i, scale, sg, sgi, off, n_units, glim, has_tl, rows, table,
                      has_index, cand, partial, hbs, hb):  # fmt: skip
            break
        count += 1
    return count


@numba.njit(inline="always", **JIT)
def rightmost_run(top, low, q, resid, need, scale, sg, sgi, off, n_units, glim,
               has_tl, rows, table, has_index, cand, partial, hbs):  # fmt: skip
    """The largest block ``j`` with ``low <= j <= top``, ``j % q == resid`` and
    ``need >= 1`` hit blocks ending at ``j``; -1 when there is none. A miss at
    block ``m`` rules out every candidate whose window holds ``m``."""
    low = max(low, need - 1)
    j = top - (top - resid) % q
    while j >= low:
        hb = -1
        if has_index & PREFETCH_BIT and need > 1:
            hb = prefetch_blocks(j, j - need + 1, scale, sg, sgi, off, n_units,
                                  rows, table, glim,
                                  _homes_base(has_index, cand))  # fmt: skip
        miss = -1
        for d in range(need):
            b = j - d
            if not probe_block(b, scale, sg, sgi, off, n_units, glim, has_tl, rows,
                          table, has_index, cand, partial, hbs, hb):  # fmt: skip
                miss = b
                break
        if miss < 0:
            return j
        j = (miss - 1) - (miss - 1 - resid) % q
    return -1


# -- one SpecGroup -------------------------------------------------------------------


@numba.njit(**JIT)
def scan_sg(sgi, bound, drop, sg, off, n_units, glim, has_tl, rows, table,
             has_index, cand, partial, hbs, align):  # fmt: skip
    """Scan SpecGroup ``sgi`` up to ``bound`` tokens (``drop``: the EAGLE
    drop). Returns ``(hit, length, lo, keep)``: the hit in tokens, the members'
    load mask as ``length`` entries, True on ``[lo, length)``, and the least
    bound down to which a scan with the same drop gives the same answer
    (``NEVER``: unknown).

    As in the Triton kernel, every kind is at most three phases: (0) a leading
    run (full attention; chunked local after its null blocks), (1) a
    rightmost search (full attention's fine-grained tail, the sliding-window
    run, the Mamba state), (2) a leading run again (the sliding window's
    short-run fallback). One call site per primitive keeps the compiled code
    (and the cold compile) small.
    """
    kind = sg[sgi, SG_KIND]
    bs = sg[sgi, SG_BLOCK_SIZE]
    scale = sg[sgi, SG_SCALE]
    q = sg[sgi, SG_PERIOD]
    fine = sg[sgi, SG_FINE] != 0
    m = bound // bs
    # Fine-grained (align < bs): a block is bs // align hash units.
    fscale = bs // align if fine else scale
    chunk = max(sg[sgi, SG_CHUNK], 1)
    start_tok = bound // chunk * chunk if bound > 0 else 0
    sb = start_tok // bs
    # SG_NEED is ``masks.sliding_window_need`` without EAGLE; the drop is its
    # ``eagle`` term.
    need = max(sg[sgi, SG_NEED] + (1 if drop else 0), 1)
    swa_resid = 0 if drop else q - 1
    n = 0  # phase 0's run
    j = -1  # phase 1's block / hash unit
    p = 0  # phase 2's run
    for phase in range(3):
        if phase == 1:
            if kind == KIND_FULL:
                if not fine:
                    continue
                # ``reference.full_attention_hit``: the highest hit hash unit inside
                # the first block past the run.
                first = n * fscale
                top = min(first + fscale - 1, bound // align, n_units) - 1
                low, bq, resid, bneed, bscale = first, 1, 0, 1, 1
            elif kind == KIND_SWA:
                # ``reference.sliding_window_hit``: the rightmost run of `need` hit
                # blocks whose top leaves an aligned hit after the EAGLE pop.
                top, low, bq, resid, bneed, bscale = m - 1, 0, q, swa_resid, need, scale
            elif kind == KIND_MAMBA:
                # ``reference.mamba_hit``: the rightmost stored state (fine:
                # hash unit) on an aligned boundary.
                if fine:
                    top = min(bound // align, n_units) - 1
                    low, bq, resid, bneed, bscale = 0, 1, 0, 1, 1
                else:
                    top, low, bq, resid, bneed, bscale = m - 1, 0, q, q - 1, 1, scale
            else:
                continue
            j = rightmost_run(top, low, bq, resid, bneed, bscale, sg, sgi, off,
                           n_units, glim, has_tl, rows, table, has_index,
                           cand, partial, hbs)  # fmt: skip
            continue
        if phase == 0:
            if kind == KIND_FULL:
                # ``reference.full_attention_hit``: the leading run of hit blocks.
                start, end, lscale = 0, min(m, n_units // fscale), fscale
            elif kind == KIND_CHUNKED:
                # ``reference.chunked_local_hit``: null blocks up to the last
                # attention chunk, then the leading run.
                start, end, lscale = sb, max(m, sb), scale
            else:
                continue
        else:
            if kind != KIND_SWA or j >= 0:
                continue
            # No run of `need` blocks: the run from block 0 (shorter than
            # the window) still hits.
            start, end, lscale = 0, min(m, need - 1), scale
        run = leading_run(start, end, lscale, sg, sgi, off, n_units, glim,
                           has_tl, rows, table, has_index, cand, partial,
                           hbs)  # fmt: skip
        if phase == 0:
            n = run
        else:
            p = run

    if kind == KIND_FULL:
        blocks = n
        hit = n * bs
        if j >= 0:
            blocks += 1
            hit = (j + 1) * align
        if drop and hit > 0:
            hit -= min(align, bs)
        hit -= hit % align
        return hit, min(blocks, jit_cdiv(hit, bs)), 0, NEVER
    if kind == KIND_SWA:
        if j >= 0:
            # The largest run under a bound stays the largest under any
            # smaller bound that keeps it.
            length = j if drop else j + 1
            return length * bs, length, j - need + 1, (j + 1) * bs
        # Re-aligned, then EAGLE-popped and re-aligned.
        j0 = (p - 1) - (p - 1 - swa_resid) % q
        run = j0 + 1 if j0 >= 0 else 0
        run -= run % q
        if drop and run > 0:
            run -= 1
            run -= run % q
        return run * bs, run, 0, NEVER
    if kind == KIND_MAMBA:
        # Never an EAGLE drop. The rightmost stored state below a bound stays
        # the rightmost under any smaller bound that keeps it.
        if j < 0:
            return 0, 0, 0, 0
        if fine:
            length = j // fscale + 1
            hit = (j + 1) * align
        else:
            length = j + 1
            hit = (j + 1) * bs
        return hit, length, length - 1, hit
    length = sb + n
    return length * bs, length, sb, NEVER
