"""The LookupEngine's Triton kernel: every request's longest cache hit, in one launch.

One program per request runs the whole scalar rule of vLLM 0.33.0's
``MooncakeStoreCoordinator.find_longest_cache_hit`` for that request: the
per-kind scans (full attention, sliding window, Mamba, chunked local), the
multi-SpecGroup convergence loop with its ``eagle_verified`` bookkeeping, the
EAGLE proof margin (never for Mamba), the simple-hybrid early exit and the final
full-attention truncation. Key membership is decided inside the kernel by
probing the KeyIndex table, so a batch costs one launch and no host round trip
however many requests it has.

This module imports nothing from ``coordinator/``; the layout arrives as two
small int64 tables built by ``coordinator/triton_backend.py`` from a
``ScanPlan`` (see ``SG_*`` and ``CAND_*`` below for their columns). The closed
forms of the per-kind rules are documented in ``coordinator/plan.py``.

Design (why it looks like this):

* **One program per request, scalar control flow.** The reference's scans are
  data-dependent loops that stop early (full attention at the first miss, the
  sliding window at the first run of ``need`` blocks from the right, Mamba at
  the rightmost aligned state). Per-request programs follow those stops
  exactly and probe almost nothing the scalar rule would not; the convergence
  loop's rounds are a ``while`` in the program, so the launch count does not
  grow with the batch or with the number of rounds.
* **Probes are vectorised across positions, not requests.** Each step probes a
  block of ``BLOCK`` positions with ``tl.arange``: a leading run probes
  ``BLOCK`` consecutive blocks and keeps the leading hits; a rightmost search
  probes ``BLOCK`` aligned candidates (``need == 1``: Mamba, fine-grained
  tails) or a run window of up to ``BLOCK`` blocks, skipping past the highest
  miss in the window (no later candidate can contain it). ``BLOCK`` lanes share
  the latency of one probe chain, which on a GPU is a few dependent global
  loads (column 0, then the ``W`` words); probing a little past a stop costs
  bandwidth, not latency. ``num_warps=1`` keeps a program to one warp so
  ``BLOCK = 32`` gives one lane per thread.
* **State lives in registers.** Per-SpecGroup results (hit length, mask triple,
  ``eagle_verified``) are ``S_PAD``-wide vectors updated with ``tl.where``; the
  load-mask triples are written to ``tri`` once, at the end, so nothing is
  read back from global memory within a program (scalar stores and loads by
  different threads of a CTA would need a barrier).
* **The plan is runtime data, loop over SpecGroups at run time.** The kernel
  is specialised only on ``W``, the presence of an index / of the store
  worker's candidate restriction, ``apply_eagle``, ``BLOCK`` and the table
  widths, so the compile count per layout is bounded (a handful of variants),
  while kinds and sizes are uniform scalar branches within a program.
* **Own table probe.** ``_table_has`` follows the layout contract of
  ``coordinator/key_index.py`` with the slot hash of
  ``kvhit.kernels.hash_index`` (``hash_init``/``hash_mix``/``hash_finish``),
  but reads column 0 with plain loads instead of ``find_slots``' acquire
  loads: a scan is stream-ordered after the inserts it must see, and an
  acquire per probe step would sit on the latency-bound critical path. Lanes
  of later SpecGroup members probe only where earlier members hit (an AND).
* **The store worker's candidate restriction** (``token_len``): a present key
  counts only at a position the worker asks about, or when the same hash value
  stands at such a position in the request (the worker's set holds values).
  The position test is closed-form; the value test (``_dup_candidate``) runs
  only for lanes present but not at a candidate, and enumerates the group's
  candidate positions directly rather than the whole prompt, because an EAGLE
  peek past the lookup length often lands on such a key (a longer prompt with
  the same prefix was stored before).
* **Interpreter quirk.** Under ``TRITON_INTERPRET=1`` a bool scalar combined
  with a bool vector by ``&`` / ``|`` comes out int64 (not a valid mask);
  scalars are broadcast (``zeros + x``) before they meet vectors.
* **Integer division.** Triton's ``//`` and ``%`` truncate toward zero on a
  GPU but floor under the interpreter; every ``//`` here has non-negative
  operands and every possibly negative remainder goes through ``_fmod``.

Probes past a request's hashes are misses (the reference raises there).
Preconditions the launcher cannot check without a device sync: for every
request ``r``, ``offsets[r] + lens[r] <= hashes.shape[0]``; member group ids
index ``cand_rows``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvhit.kernels.hash_index import hash_finish, hash_init, hash_mix

__all__ = ["CAND_COLS", "SG_COLS", "scan_hits"]

# Kinds, as in coordinator/plan.py (KIND_*).
_FULL: tl.constexpr = tl.constexpr(0)
_SWA: tl.constexpr = tl.constexpr(1)
_MAMBA: tl.constexpr = tl.constexpr(2)

# Columns of a SpecGroup row (ScanPlan.as_rows()); member group ids follow.
SG_COLS = (
    "kind",
    "block_size",
    "scale",
    "use_eagle",
    "margin",
    "need",
    "q",
    "fine",
    "chunk",
    "n_members",
)
_MEM0: tl.constexpr = tl.constexpr(len(SG_COLS))
# Columns of a per-group candidate row (ScanPlan.candidates, in group order).
CAND_COLS = (
    "cacheable",
    "block_size",
    "scale",
    "sparse",
    "per_segment",
    "need",
    "shift",
    "group_id",
)


@triton.jit
def _fmod(a, b):
    """Floor remainder of ``a`` by ``b > 0`` (never negative), whatever the
    sign convention of ``%`` on the target."""
    r = a % b
    return tl.where(r < 0, r + b, r)


_EMPTY: tl.constexpr = tl.constexpr(-1)  # KeyIndex column-0 sentinel


@triton.jit
def _table_has(table_ptr, cap_mask, gids, hashes_ptr, rows, mask, W: tl.constexpr):
    """int1 [N]: is key ``(gids, hashes[rows])`` in the KeyIndex table?

    The table layout contract of ``coordinator/key_index.py``: home slot
    ``hash_finish(fold(hash_mix, hash_init(gid), words)) & cap_mask``, linear
    probing; a hit needs column 0 equal to the group id and every word equal;
    an EMPTY slot ends the probe; TOMBSTONE / BUSY slots are passed over.
    Column 0 is read with a plain load: lookups are stream-ordered after the
    inserts they must see (no insert runs concurrently with a scan).
    """
    h = hash_init(gids)
    for j in tl.static_range(W):
        w = tl.load(hashes_ptr + rows * W + j, mask=mask, other=0)
        h = hash_mix(h, w)
    pos = hash_finish(h) & cap_mask
    found = mask & (gids < gids)
    active = mask
    # A vector step count: lanes stop independently.
    steps = tl.zeros_like(gids)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        slot = table_ptr + pos * (W + 1)
        g = tl.load(slot, mask=active, other=_EMPTY)
        hit = active & (g == gids)
        for j in tl.static_range(W):
            t = tl.load(slot + 1 + j, mask=hit, other=0)
            k = tl.load(hashes_ptr + rows * W + j, mask=hit, other=0)
            hit = hit & (t == k)
        found = found | hit
        steps += 1
        # The step bound only matters for a corrupt table with no EMPTY slot.
        active = active & ~hit & (g != _EMPTY) & (steps <= cap_mask)
        pos = (pos + 1) & cap_mask
    return found


@triton.jit
def _is_candidate(
    units, lens, tok_len, gid, cand_ptr, partial, hbs, CAND_W: tl.constexpr
):
    """int1 [N]: does the store worker ask about hash unit ``units`` (int64 [N])
    for group ``gid`` in a lookup of ``tok_len`` tokens (by position only)?"""
    row = cand_ptr + gid * CAND_W
    bs = tl.load(row + 1)
    s = tl.load(row + 2)
    sparse = tl.load(row + 3)
    per = tl.load(row + 4)
    need = tl.load(row + 5)
    shift = tl.load(row + 6)
    in_partial = units < tl.minimum(lens, tok_len // hbs)
    u1 = tl.maximum(units + 1, 0)
    c = u1 // s - 1
    ok = (u1 % s == 0) & (c >= 0)
    ok = ok & (c < tl.minimum(lens // s, (tok_len + bs - 1) // bs))
    # The SWA lookup mask keeps the last `need` chunks of each segment.
    in_seg = _fmod(c - shift, tl.maximum(per, 1)) >= per - need
    sp = (c < tok_len // bs) & (c >= shift) & in_seg
    # Broadcast before mixing with vectors: the interpreter types a bool
    # scalar-vector & / | as int64.
    ok = ok & (((units * 0 + sparse) == 0) | sp)
    return tl.where(partial != 0, in_partial, ok)


@triton.jit
def _dup_candidate(
    units,
    odd,
    off,
    lens,
    tok_len,
    gid,
    hashes_ptr,
    cand_ptr,
    partial,
    hbs,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    CAND_W: tl.constexpr,
):
    """int1 [BLOCK]: for lanes ``odd`` (present, not a candidate position),
    whether the same hash value stands at a candidate position of the request.

    Only entered when some lane is odd. That is rare for duplicates but not
    for the probe itself: an EAGLE peek past the lookup length lands on a
    stored key the worker did not ask about (multi-turn prefixes), so this
    must not walk the whole prompt. It enumerates the group's candidate
    positions directly (the SWA lookup mask keeps ``need`` chunks per
    segment: ``c = shift + m * per + per - need + t``), ``4 * BLOCK`` per step,
    one odd lane at a time, comparing against the lane's words as scalars.
    """
    lane = tl.arange(0, BLOCK)
    kl = tl.arange(0, 4 * BLOCK).to(tl.int64)
    row = cand_ptr + gid * CAND_W
    bs = tl.load(row + 1)
    s = tl.load(row + 2)
    sparse = tl.load(row + 3) != 0
    per = tl.load(row + 4)
    need = tl.load(row + 5)
    shift = tl.load(row + 6)
    zero = lens * 0
    is_partial = partial != 0
    sp = ~is_partial & sparse
    # Candidates are the chunks c < limit (hash units, with partial hits) that
    # the mask keeps, enumerated in increasing order of c by k = 0, 1, ...
    limit = tl.minimum(lens // s, (tok_len + bs - 1) // bs)
    limit = tl.where(sparse, tl.minimum(limit, tok_len // bs), limit)
    limit = tl.where(is_partial, tl.minimum(lens, tok_len // hbs), limit)
    limit = tl.where(sp & (need <= 0), zero, limit)
    nd = tl.maximum(need, 1)
    scale = tl.where(is_partial, zero + 1, s)
    first_c = tl.where(sp, shift + per - nd, zero)

    found = lane < 0
    todo = odd
    i = tl.min(tl.where(todo, lane, BLOCK), axis=0)
    while i < BLOCK:
        u = tl.sum(tl.where(lane == i, units, 0), axis=0)
        k0 = zero
        hit = zero > 0
        going = first_c < limit
        while going:
            k = k0 + kl
            c = tl.where(sp, shift + (k // nd) * per + (per - nd) + k % nd, k)
            valid = c < limit
            eq = valid
            for j in tl.static_range(W):
                a = tl.load(hashes_ptr + (off + u) * W + j)
                v = off + (c + 1) * scale - 1
                b = tl.load(hashes_ptr + v * W + j, mask=valid, other=0)
                eq = eq & (b == a)
            hit = tl.max(eq.to(tl.int32), axis=0) > 0
            k0 += 4 * BLOCK
            c_next = tl.where(sp, shift + (k0 // nd) * per + (per - nd) + k0 % nd, k0)
            going = ~hit & (c_next < limit)
        # Broadcast before mixing with vectors (interpreter quirk, see above).
        hit_v = (tl.zeros([BLOCK], tl.int32) + hit.to(tl.int32)) != 0
        found = found | ((lane == i) & hit_v)
        todo = todo & (lane != i)
        i = tl.min(tl.where(todo, lane, BLOCK), axis=0)
    return found


@triton.jit
def _probe(
    units,
    mask,
    sg_row,
    n_mem,
    off,
    lens,
    tok_len,
    hashes_ptr,
    table_ptr,
    cap_mask,
    cand_ptr,
    partial,
    hbs,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
    CAND_W: tl.constexpr,
):
    """int1 [BLOCK]: is hash unit ``units`` (int64 [BLOCK]) of the request
    present for every member group of the SpecGroup at ``sg_row``? Lanes
    outside ``mask`` or the request's hashes are misses."""
    valid = mask & (units >= 0) & (units < lens)
    rows = off + tl.where(valid, units, 0)
    hit = valid
    for k in range(n_mem):
        gid = tl.load(sg_row + _MEM0 + k)
        if HAS_INDEX:
            # Only lanes every earlier member holds: the result is an AND.
            gids = tl.zeros([BLOCK], tl.int64) + gid
            present = _table_has(table_ptr, cap_mask, gids, hashes_ptr, rows, hit, W)
        else:
            present = hit
        if HAS_TL:
            cand = _is_candidate(
                units, lens, tok_len, gid, cand_ptr, partial, hbs, CAND_W
            )
            odd = present & ~cand
            if tl.max(odd.to(tl.int32), axis=0) > 0:
                dup = _dup_candidate(
                    units, odd, off, lens, tok_len, gid, hashes_ptr, cand_ptr,
                    partial, hbs, W, BLOCK, CAND_W,
                )  # fmt: skip
                cand = cand | dup
            present = present & cand
        hit = hit & present
    return hit


@triton.jit
def _leading_run(
    start,
    end,
    scale,
    sg_row,
    n_mem,
    off,
    lens,
    tok_len,
    hashes_ptr,
    table_ptr,
    cap_mask,
    cand_ptr,
    partial,
    hbs,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
    CAND_W: tl.constexpr,
):
    """How many consecutive blocks from ``start`` (below ``end``) hit; block
    ``i`` is keyed by hash unit ``(i + 1) * scale - 1``. ``BLOCK`` blocks per
    step."""
    lane = tl.arange(0, BLOCK)
    count = start * 0
    going = end > start
    while going:
        blk = start + count + lane
        hit = _probe(
            (blk + 1) * scale - 1, blk < end, sg_row, n_mem, off, lens, tok_len,
            hashes_ptr, table_ptr, cap_mask, cand_ptr, partial, hbs,
            W, HAS_INDEX, HAS_TL, BLOCK, CAND_W,
        )  # fmt: skip
        lead = tl.min(tl.where(hit, BLOCK, lane), axis=0)
        count += lead
        going = (lead == BLOCK) & (start + count < end)
    return count


@triton.jit
def _rightmost(
    top,
    low,
    q,
    resid,
    need,
    scale,
    sg_row,
    n_mem,
    off,
    lens,
    tok_len,
    hashes_ptr,
    table_ptr,
    cap_mask,
    cand_ptr,
    partial,
    hbs,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
    CAND_W: tl.constexpr,
):
    """The largest block ``j`` with ``low <= j <= top``, ``j % q == resid`` and
    ``need >= 1`` hit blocks ending at ``j``; -1 when there is none."""
    lane = tl.arange(0, BLOCK)
    low = tl.maximum(low, need - 1)
    j = top - _fmod(top - resid, q)
    found = top * 0 - 1
    going = j >= low
    if need == 1:
        # BLOCK candidates per step, highest first.
        while going:
            cand = j - lane * q
            hit = _probe(
                (cand + 1) * scale - 1, cand >= low, sg_row, n_mem, off, lens,
                tok_len, hashes_ptr, table_ptr, cap_mask, cand_ptr, partial, hbs,
                W, HAS_INDEX, HAS_TL, BLOCK, CAND_W,
            )  # fmt: skip
            k = tl.min(tl.where(hit, lane, BLOCK), axis=0)
            found = tl.where(k < BLOCK, j - k * q, found)
            j = j - BLOCK * q
            going = (k == BLOCK) & (j >= low)
    else:
        # Check the window [j - need + 1, j] from its top; on a miss at m no
        # candidate >= m can succeed (its window holds m): go below m.
        while going:
            miss = top * 0 - 1
            d0 = j * 0
            checking = d0 < need
            while checking:
                d = d0 + lane
                use = d < need
                hit = _probe(
                    (j - d + 1) * scale - 1, use, sg_row, n_mem, off, lens,
                    tok_len, hashes_ptr, table_ptr, cap_mask, cand_ptr, partial,
                    hbs, W, HAS_INDEX, HAS_TL, BLOCK, CAND_W,
                )  # fmt: skip
                k = tl.min(tl.where(use & ~hit, lane, BLOCK), axis=0)
                miss = tl.where(k < BLOCK, j - d0 - k, miss)
                d0 += BLOCK
                checking = (k == BLOCK) & (d0 < need)
            found = tl.where(miss < 0, j, found)
            j = (miss - 1) - _fmod(miss - 1 - resid, q)
            going = (miss >= 0) & (j >= low)
    return found


@triton.jit
def _scan_sg(
    sg_row,
    bound,
    drop,
    align,
    off,
    lens,
    tok_len,
    hashes_ptr,
    table_ptr,
    cap_mask,
    cand_ptr,
    partial,
    hbs,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
    CAND_W: tl.constexpr,
):
    """Scan one SpecGroup up to ``bound`` tokens (``drop``: the EAGLE drop).

    Returns ``(hit, length, lo, hi)``, int64 scalars: the hit in tokens and the
    members' load-mask triple. Every kind is one leading run (full attention,
    chunked local), then one rightmost search (full attention's fine-grained
    tail, sliding window, Mamba), then one more leading run (the sliding
    window's short-run fallback); a kind that needs no phase gives it an empty
    range. Three call sites instead of one per kind keep the inlined code small.
    """
    kind = tl.load(sg_row + 0)
    bs = tl.load(sg_row + 1)
    scale = tl.load(sg_row + 2)
    need_sg = tl.load(sg_row + 5)
    q = tl.load(sg_row + 6)
    fine = tl.load(sg_row + 7) != 0
    chunk = tl.maximum(tl.load(sg_row + 8), 1)
    n_mem = tl.load(sg_row + 9)
    is_full = kind == _FULL
    is_swa = kind == _SWA
    is_mamba = kind == _MAMBA
    is_chunk = ~(is_full | is_swa | is_mamba)
    zero = bound * 0

    m = bound // bs
    # Fine-grained (align < bs): the full view has bs // align units per block.
    fscale = tl.where(fine, bs // align, scale)
    start_tok = tl.where(bound > 0, bound // chunk * chunk, zero)
    sb = start_tok // bs

    # Phase A: full attention's leading run; chunked local's run after the
    # null blocks before the last attention chunk.
    a_start = tl.where(is_chunk, sb, zero)
    a_end = tl.where(
        is_full,
        tl.minimum(m, lens // fscale),
        tl.where(is_chunk, tl.maximum(m, sb), zero),
    )
    a_scale = tl.where(is_full, fscale, scale)
    n = _leading_run(
        a_start, a_end, a_scale, sg_row, n_mem, off, lens, tok_len, hashes_ptr,
        table_ptr, cap_mask, cand_ptr, partial, hbs,
        W, HAS_INDEX, HAS_TL, BLOCK, CAND_W,
    )  # fmt: skip

    # Phase B: the rightmost search.
    need_eff = tl.maximum(need_sg + drop, 1)
    swa_resid = tl.where(drop != 0, zero, q - 1)
    # Full, fine-grained: the highest hit hash unit inside the next block.
    first = n * fscale
    f_top = tl.minimum(tl.minimum(first + fscale - 1, bound // align), lens) - 1
    f_top = tl.where(fine, f_top, zero - 1)
    # Mamba: the rightmost aligned state (fine-grained: hash unit).
    mf_top = tl.minimum(bound // align, lens) - 1
    b_top = tl.where(
        is_full,
        f_top,
        tl.where(
            is_swa | (is_mamba & ~fine), m - 1, tl.where(is_mamba, mf_top, zero - 1)
        ),
    )
    unit_level = fine & (is_full | is_mamba)
    b_low = tl.where(is_full, first, zero)
    b_q = tl.where(unit_level, zero + 1, q)
    b_resid = tl.where(unit_level, zero, tl.where(is_swa, swa_resid, q - 1))
    b_need = tl.where(is_swa, need_eff, zero + 1)
    b_scale = tl.where(unit_level, zero + 1, scale)
    j = _rightmost(
        b_top, b_low, b_q, b_resid, b_need, b_scale, sg_row, n_mem, off, lens,
        tok_len, hashes_ptr, table_ptr, cap_mask, cand_ptr, partial, hbs,
        W, HAS_INDEX, HAS_TL, BLOCK, CAND_W,
    )  # fmt: skip
    got = j >= 0

    # Phase C: a sliding window with no run of `need` blocks still hits with
    # the leading run (shorter than need - 1 blocks).
    c_end = tl.where(is_swa & ~got, tl.minimum(m, need_eff - 1), zero)
    p = _leading_run(
        zero, c_end, scale, sg_row, n_mem, off, lens, tok_len, hashes_ptr,
        table_ptr, cap_mask, cand_ptr, partial, hbs,
        W, HAS_INDEX, HAS_TL, BLOCK, CAND_W,
    )  # fmt: skip

    # Full attention.
    f_tail = fine & got
    f_blocks = n + f_tail.to(tl.int64)
    f_hit = tl.where(f_tail, (j + 1) * align, n * bs)
    f_hit = tl.where((drop != 0) & (f_hit > 0), f_hit - tl.minimum(align, bs), f_hit)
    f_hit = f_hit - f_hit % align
    f_blocks = tl.minimum(f_blocks, (f_hit + bs - 1) // bs)
    # Sliding window.
    s_len = tl.where(drop != 0, j, j + 1)
    s_lo = j - need_eff + 1
    j0 = (p - 1) - _fmod(p - 1 - swa_resid, q)
    run = tl.where(j0 >= 0, j0 + 1, zero)
    run = run - run % q
    run = tl.where((drop != 0) & (run > 0), run - 1, run)
    run = run - run % q
    s_len = tl.where(got, s_len, run)
    s_lo = tl.where(got, s_lo, zero)
    # Mamba.
    jj = tl.maximum(j, 0)
    m_len = tl.where(got, tl.where(fine, jj // fscale + 1, jj + 1), zero)
    m_hit = tl.where(got, tl.where(fine, (jj + 1) * align, (jj + 1) * bs), zero)
    m_lo = m_len - got.to(tl.int64)
    # Chunked local.
    c_len = sb + n

    hit = tl.where(
        is_full,
        f_hit,
        tl.where(is_swa, s_len * bs, tl.where(is_mamba, m_hit, c_len * bs)),
    )
    length = tl.where(
        is_full, f_blocks, tl.where(is_swa, s_len, tl.where(is_mamba, m_len, c_len))
    )
    lo = tl.where(is_full, zero, tl.where(is_swa, s_lo, tl.where(is_mamba, m_lo, sb)))
    hi = length
    return hit, length, lo, hi


@triton.jit
def _scan_kernel(
    hashes_ptr,
    offsets_ptr,
    lens_ptr,
    max_len_ptr,
    tok_len_ptr,
    table_ptr,
    cap_mask,
    sg_ptr,
    cand_ptr,
    hit_ptr,
    tri_ptr,
    n_sg,
    n_groups,
    hbs,
    align,
    partial,
    simple_hybrid,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    APPLY_EAGLE: tl.constexpr,
    BLOCK: tl.constexpr,
    S_PAD: tl.constexpr,
    SG_W: tl.constexpr,
    CAND_W: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    off = tl.load(offsets_ptr + r)
    lens = tl.load(lens_ptr + r)
    max_len = tl.load(max_len_ptr + r)
    if HAS_TL:
        tok_len = tl.load(tok_len_ptr + r)
    else:
        tok_len = lens * 0
    zero = lens * 0
    # Scalar arguments as tensors: Triton specialises ints equal to 1 into
    # constexprs, on which `~` would be Python's bitwise not.
    multi = (zero + n_sg) > 1
    partial = zero + partial
    simple_hybrid = zero + simple_hybrid
    sidx = tl.arange(0, S_PAD)
    zs = tl.zeros([S_PAD], tl.int64)
    # Per SpecGroup: hit in tokens, load-mask triple, eagle_verified.
    sg_hit = zs
    sg_len = zs
    sg_lo = zs
    sg_hi = zs
    verified = zs

    hit_length = max_len
    full_done = zero
    active = max_len >= 0
    while active:
        curr = hit_length
        for idx in range(n_sg):
            row = sg_ptr + idx * SG_W
            kind = tl.load(row + 0)
            sel = sidx == idx
            if (kind == _FULL) & (full_done != 0):
                # Full attention is scanned once; later rounds only clip it.
                curr = tl.minimum(curr, tl.sum(tl.where(sel, sg_hit, 0), axis=0))
            else:
                use_eagle = tl.load(row + 3)
                margin = tl.load(row + 4)
                was_verified = tl.sum(tl.where(sel, verified, 0), axis=0)
                drop = zero
                if APPLY_EAGLE:
                    if multi:
                        drop = ((use_eagle != 0) & (was_verified == 0)).to(tl.int64)
                    else:
                        drop = (use_eagle != 0).to(tl.int64)
                # EAGLE peeks one proof margin past the hit, then drops it
                # (margin is 0 for Mamba); a lone SpecGroup scans max_length.
                bound = curr
                if multi & (margin > 0) & (drop != 0):
                    bound = tl.minimum(curr + margin, lens * hbs)
                new_hit, length, lo, hi = _scan_sg(
                    row, bound, drop, align, off, lens, tok_len, hashes_ptr,
                    table_ptr, cap_mask, cand_ptr, partial, hbs,
                    W, HAS_INDEX, HAS_TL, BLOCK, CAND_W,
                )  # fmt: skip
                shrunk = (drop == 0) & (new_hit < curr)
                verified = tl.where(sel & ((zs + drop) != 0), zs + 1, verified)
                verified = tl.where(shrunk, zs, verified)
                curr = new_hit
                sg_hit = tl.where(sel, new_hit, sg_hit)
                sg_len = tl.where(sel, length, sg_len)
                sg_lo = tl.where(sel, lo, sg_lo)
                sg_hi = tl.where(sel, hi, sg_hi)
        full_done = zero + 1
        # A lone SpecGroup's scan is the answer; several converge while the
        # common hit shrinks (a simple hybrid stops after one shrink).
        shrank = curr < hit_length
        hit_length = tl.where(shrank | ~multi, curr, hit_length)
        active = shrank & multi & (simple_hybrid == 0)

    for idx in range(n_sg):
        row = sg_ptr + idx * SG_W
        kind = tl.load(row + 0)
        bs = tl.load(row + 1)
        n_mem = tl.load(row + 9)
        sel = sidx == idx
        length = tl.sum(tl.where(sel, sg_len, 0), axis=0)
        lo = tl.sum(tl.where(sel, sg_lo, 0), axis=0)
        hi = tl.sum(tl.where(sel, sg_hi, 0), axis=0)
        if multi & (kind == _FULL):
            # Full attention keeps only the blocks of the common hit.
            length = tl.minimum(length, (hit_length + bs - 1) // bs)
            hi = length
        for k in range(n_mem):
            gid = tl.load(row + _MEM0 + k)
            out = tri_ptr + (r * n_groups + gid) * 3
            tl.store(out + 0, length)
            tl.store(out + 1, lo)
            tl.store(out + 2, hi)
    tl.store(hit_ptr + r, hit_length)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(
    name: str,
    t: object,
    dim: int,
    device: torch.device,
    shape: tuple[int | None, ...] | None = None,
) -> torch.Tensor:
    """Validate one tensor argument (int64, contiguous, ``dim`` dims, on
    ``device``, sizes equal to ``shape`` where not None)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got {list(t.shape)}")
    if shape is not None:
        for want, got in zip(shape, t.shape, strict=True):
            if want is not None and want != got:
                raise ValueError(
                    f"{name} must have shape {[s if s is not None else '*' for s in shape]}, "
                    f"got {list(t.shape)}"
                )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but hashes is on {device}")
    return t


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def scan_hits(
    hashes: torch.Tensor,
    offsets: torch.Tensor,
    lens: torch.Tensor,
    max_lengths: torch.Tensor,
    sg_rows: torch.Tensor,
    cand_rows: torch.Tensor,
    *,
    table: torch.Tensor | None,
    token_len: torch.Tensor | None,
    hash_block_size: int,
    alignment: int,
    partial: bool,
    simple_hybrid: bool,
    num_groups: int,
    apply_eagle: bool,
    block: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest cache hit and load-mask triples of every request, one launch.

    Args:
        hashes: int64 ``[T, W]``, all requests' hash words.
        offsets: int64 ``[R]``, first row of each request in ``hashes``.
        lens: int64 ``[R]``, hash units of each request.
        max_lengths: int64 ``[R]``, the most tokens each hit may cover (>= 0).
        sg_rows: int64 ``[S, 10 + M]``, one row per SpecGroup in
            ``ScanPlan.as_rows()`` order (columns ``SG_COLS``, then M member
            group ids padded with -1); full-attention SpecGroups first.
        cand_rows: int64 ``[G, 8]``, one row per group (columns ``CAND_COLS``).
        table: the KeyIndex table, int64 ``[capacity, W + 1]`` (capacity a
            power of two), or None: every key present.
        token_len: int64 ``[R]``, the store worker's lookup length per request
            (restricts presence to the keys it asks about), or None.
        hash_block_size, alignment: tokens per hash / the hit alignment.
        partial, simple_hybrid: ``ScanPlan.partial`` / ``.simple_hybrid``.
        num_groups: G, the number of KV-cache groups.
        apply_eagle: apply the EAGLE last-block drop.
        block: positions probed per step (a power of two).

    Returns:
        ``(hit int64 [R], tri int64 [R, G, 3])``: hits in tokens and each
        group's load-mask triple ``(length, lo, hi)`` (zeros for groups outside
        every SpecGroup).

    Raises:
        TypeError / ValueError: naming the argument that is not an int64,
            contiguous tensor of the right shape on ``hashes``' device.
    """
    if not isinstance(hashes, torch.Tensor):
        raise TypeError(f"hashes must be a torch.Tensor, got {type(hashes).__name__}")
    device = hashes.device
    _check("hashes", hashes, 2, device)
    W = hashes.shape[1]
    if W < 1:
        raise ValueError(f"hashes must have at least one word per hash, got {W}")
    _check("offsets", offsets, 1, device)
    n_req = offsets.shape[0]
    _check("lens", lens, 1, device, (n_req,))
    _check("max_lengths", max_lengths, 1, device, (n_req,))
    if token_len is not None:
        _check("token_len", token_len, 1, device, (n_req,))
    _check("sg_rows", sg_rows, 2, device)
    n_sg, sg_w = sg_rows.shape
    if n_sg < 1 or sg_w < len(SG_COLS) + 1:
        raise ValueError(
            f"sg_rows must have shape [S >= 1, >= {len(SG_COLS) + 1}], got "
            f"{list(sg_rows.shape)}"
        )
    if (
        isinstance(num_groups, bool)
        or not isinstance(num_groups, int)
        or num_groups < 1
    ):
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    _check("cand_rows", cand_rows, 2, device, (num_groups, len(CAND_COLS)))
    if table is not None:
        _check("table", table, 2, device, (None, W + 1))
        cap = table.shape[0]
        if cap < 1 or cap & (cap - 1):
            raise ValueError(f"table capacity must be a power of two, got {cap}")
    for name, v in (("hash_block_size", hash_block_size), ("alignment", alignment)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if (
        isinstance(block, bool)
        or not isinstance(block, int)
        or block < 2
        or block & (block - 1)
    ):
        raise ValueError(f"block must be a power of two >= 2, got {block!r}")
    if device.type == "cpu" and not _interpreting():
        raise ValueError(
            "hashes is on the CPU: the Triton kernels need a GPU, or "
            "TRITON_INTERPRET=1 set before triton is imported"
        )

    hit = torch.zeros(n_req, dtype=torch.int64, device=device)
    tri = torch.zeros(n_req, num_groups, 3, dtype=torch.int64, device=device)
    if n_req == 0:
        return hit, tri
    # Unused pointer arguments still need a tensor on the device.
    table_arg = table if table is not None else hashes
    tok_arg = token_len if token_len is not None else lens
    _scan_kernel[(n_req,)](
        hashes,
        offsets,
        lens,
        max_lengths,
        tok_arg,
        table_arg,
        (table.shape[0] - 1) if table is not None else 0,
        sg_rows,
        cand_rows,
        hit,
        tri,
        n_sg,
        num_groups,
        hash_block_size,
        alignment,
        int(partial),
        int(simple_hybrid),
        W=W,
        HAS_INDEX=table is not None,
        HAS_TL=token_len is not None,
        APPLY_EAGLE=bool(apply_eagle),
        BLOCK=block,
        S_PAD=_pow2(n_sg),
        SG_W=sg_w,
        CAND_W=len(CAND_COLS),
        num_warps=1,
    )
    return hit, tri
