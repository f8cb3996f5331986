"""The Triton device code of one SpecGroup, from :mod:`kvhit.kernels.scan`
(which holds the convergence loop ``converge``, the store worker's rule, the
scan kernel and its launchers): the kernel contract as constexprs, the
request context ``ctx``'s fields, 32-bit position arithmetic, the probes
(the table lookup, the worker's candidate test, the duplicate-value search),
the leading run and rightmost-run searches and one SpecGroup's shape, searches
and result. Every function here is ``@triton.jit`` device code called from
scan.py's kernels, never launched on its own; the design notes are scan.py's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvhit.kernels import contract as kc
from kvhit.kernels.hash_index import hash_finish, hash_init, hash_mix
from kvhit.kernels.launch import fix_interpreter

__all__ = [
    "CAND_BLOCK_SIZE",
    "CAND_CACHEABLE",
    "CAND_NEED",
    "CAND_PER_SEGMENT",
    "CAND_SCALE",
    "CAND_SHIFT",
    "CAND_SPARSE",
    "CAND_WIDTH",
    "C_ALIGN",
    "C_CANDS",
    "C_CAP_MASK",
    "C_HASHES",
    "C_HBS",
    "C_LENS",
    "C_N_SG",
    "C_OFF",
    "C_PARTIAL",
    "C_SGS",
    "C_SIMPLE",
    "C_TABLE",
    "C_TOK_LEN",
    "DUP_LANES",
    "DUP_STEP",
    "EMPTY",
    "KIND_FULL",
    "KIND_MAMBA",
    "KIND_SWA",
    "SG_BLOCK_SIZE",
    "SG_CHUNK",
    "SG_FINE",
    "SG_KIND",
    "SG_MARGIN",
    "SG_MEMBERS",
    "SG_NEED",
    "SG_N_MEMBERS",
    "SG_PERIOD",
    "SG_SCALE",
    "SG_USE_EAGLE",
    "dup_candidate",
    "eagle_drop",
    "home_slots",
    "idiv",
    "ifmod",
    "irem",
    "load_keys",
    "sg_result",
    "sg_searches",
    "table_has",
]

# Triton 3.6's interpreter cannot range() over a runtime scalar (launch.py);
# once at import, as kernels/scan.py.
fix_interpreter()

# Candidate positions the duplicate-value search (dup_candidate) compares per
# step, as a multiple of 32. That search walks a group's candidates for each
# present-but-not-asked lane (EAGLE peeks make those common), so wider is
# faster, but each step's vectors cost registers: the lookup variant needs 116
# registers at 1, 120 at 2, 124 at 4 on sm_90 (the budget is 128).
DUP_STEP = 2

# -- the kernel contract, as constexprs (kernels/contract.py) ---------------------
EMPTY: tl.constexpr = tl.constexpr(kc.EMPTY)
KIND_FULL: tl.constexpr = tl.constexpr(kc.KIND_FULL)
KIND_SWA: tl.constexpr = tl.constexpr(kc.KIND_SWA)
KIND_MAMBA: tl.constexpr = tl.constexpr(kc.KIND_MAMBA)
SG_KIND: tl.constexpr = tl.constexpr(kc.SG_KIND)
SG_BLOCK_SIZE: tl.constexpr = tl.constexpr(kc.SG_BLOCK_SIZE)
SG_SCALE: tl.constexpr = tl.constexpr(kc.SG_SCALE)
SG_USE_EAGLE: tl.constexpr = tl.constexpr(kc.SG_USE_EAGLE)
SG_MARGIN: tl.constexpr = tl.constexpr(kc.SG_MARGIN)
SG_NEED: tl.constexpr = tl.constexpr(kc.SG_NEED)
SG_PERIOD: tl.constexpr = tl.constexpr(kc.SG_PERIOD)
SG_FINE: tl.constexpr = tl.constexpr(kc.SG_FINE)
SG_CHUNK: tl.constexpr = tl.constexpr(kc.SG_CHUNK)
SG_N_MEMBERS: tl.constexpr = tl.constexpr(kc.SG_N_MEMBERS)
SG_MEMBERS: tl.constexpr = tl.constexpr(kc.SG_MEMBERS)
CAND_CACHEABLE: tl.constexpr = tl.constexpr(kc.CAND_CACHEABLE)
CAND_BLOCK_SIZE: tl.constexpr = tl.constexpr(kc.CAND_BLOCK_SIZE)
CAND_SCALE: tl.constexpr = tl.constexpr(kc.CAND_SCALE)
CAND_SPARSE: tl.constexpr = tl.constexpr(kc.CAND_SPARSE)
CAND_PER_SEGMENT: tl.constexpr = tl.constexpr(kc.CAND_PER_SEGMENT)
CAND_NEED: tl.constexpr = tl.constexpr(kc.CAND_NEED)
CAND_SHIFT: tl.constexpr = tl.constexpr(kc.CAND_SHIFT)
CAND_WIDTH: tl.constexpr = tl.constexpr(kc.CAND_WIDTH)
# Fixed, not a multiple of the caller's width: the leading run's wide tiles
# would otherwise widen these vectors too.
DUP_LANES: tl.constexpr = tl.constexpr(DUP_STEP * 32)
# -- the request context ``ctx``: one tuple, these fields -------------------------
C_OFF: tl.constexpr = tl.constexpr(0)  # first row of the request in hashes
C_LENS: tl.constexpr = tl.constexpr(1)  # its number of hash units
C_TOK_LEN: tl.constexpr = tl.constexpr(2)  # the worker's lookup length (HAS_TL)
C_HASHES: tl.constexpr = tl.constexpr(3)  # hashes_ptr, int64 [T, W]
C_TABLE: tl.constexpr = tl.constexpr(4)  # table_ptr, int64 [cap, W + 1]
C_CAP_MASK: tl.constexpr = tl.constexpr(5)  # capacity - 1
C_CANDS: tl.constexpr = tl.constexpr(6)  # cand_ptr, int64 [G, CAND_WIDTH]
C_PARTIAL: tl.constexpr = tl.constexpr(7)  # ScanPlan.partial
C_HBS: tl.constexpr = tl.constexpr(8)  # hash_block_size
C_ALIGN: tl.constexpr = tl.constexpr(9)  # the hit alignment
C_SGS: tl.constexpr = tl.constexpr(10)  # sg_ptr, int64 [S, SG_W]
C_N_SG: tl.constexpr = tl.constexpr(11)  # S
C_SIMPLE: tl.constexpr = tl.constexpr(12)  # ScanPlan.simple_hybrid


@triton.jit
def ifmod(a, b):
    """Floor remainder of ``a`` by ``b > 0`` (never negative), whatever the
    sign convention of ``%`` on the target."""
    r = (a.to(tl.int32) % b.to(tl.int32)).to(tl.int64)
    return tl.where(r < 0, r + b, r)


@triton.jit
def idiv(a, b):
    """``a // b`` for ``a >= 0``, ``b > 0`` below 2**31, computed in 32 bits:
    a 64-bit division is a subroutine call on the GPU, whose calling
    convention spills live registers to local memory around it."""
    return (a.to(tl.int32) // b.to(tl.int32)).to(tl.int64)


@triton.jit
def irem(a, b):
    """``a % b`` for ``a >= 0``, ``b > 0`` below 2**31 (32 bits, as idiv)."""
    return (a.to(tl.int32) % b.to(tl.int32)).to(tl.int64)


@triton.jit
def load_keys(ctx, units, mask, W: tl.constexpr):
    """The request's hash words at hash units ``units`` (int64 [N]), a tuple
    of ``W`` int64 [N] vectors (the W loads do not wait on each other: one
    round trip); lanes outside ``mask`` or the request hold zeros. Loaded
    once per probe and held: the home slot and every compare of the probe
    use them (loading them again per step doubled the hash-row bytes)."""
    valid = mask & (units >= 0) & (units < ctx[C_LENS])
    rows = ctx[C_OFF] + tl.where(valid, units, 0)
    hashes_ptr = ctx[C_HASHES]
    keys = ()
    for j in tl.static_range(W):
        keys = keys + (tl.load(hashes_ptr + rows * W + j, mask=valid, other=0),)
    return keys


@triton.jit
def home_slots(ctx, gids, keys, W: tl.constexpr, HAS_INDEX: tl.constexpr):
    """int64 [N]: the home slot of key ``(gids, keys)`` in the KeyIndex table
    (``hash_index.slot_hash & cap_mask`` of the words :func:`load_keys`
    gave); zeros without an index."""
    pos = gids * 0
    if HAS_INDEX:
        h = hash_init(gids)
        for j in tl.static_range(W):
            h = hash_mix(h, keys[j])
        pos = hash_finish(h) & ctx[C_CAP_MASK]
    return pos


@triton.jit
def _visit(ctx, gids, keys, pos, active, W: tl.constexpr):
    """One probe step at slot ``pos`` for lanes ``active``: ``(hit, open)``,
    whether the slot holds the key and whether it is not EMPTY (the probe
    goes on past it). The slot's group id and words are loaded at once: the
    words are compared only where the group id matches, but loading them
    regardless costs bandwidth the step has to spare, not latency."""
    slot = ctx[C_TABLE] + pos * (W + 1)
    g = tl.load(slot, mask=active, other=EMPTY)
    same = active
    for j in tl.static_range(W):
        same = same & (tl.load(slot + 1 + j, mask=active, other=0) == keys[j])
    return active & (g == gids) & same, g != EMPTY


@triton.jit
def table_has(
    ctx,
    gids,
    keys,
    units,
    pos,
    mask,
    W: tl.constexpr,
    SPAN: tl.constexpr,
    FIRST_MISS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """int1 [N]: is key ``(gids, keys)`` in the KeyIndex table? ``keys`` are
    the words :func:`load_keys` gave for hash units ``units``, ``pos`` the
    home slot (:func:`home_slots`).

    The table layout contract of ``coordinator/key_index.py``: home slot
    ``slot_hash & cap_mask``, linear probing; a hit needs column 0 equal to the
    group id and every word equal; an EMPTY slot ends the probe; TOMBSTONE and
    BUSY slots are passed over. Column 0 is read with a plain load: lookups
    are stream-ordered after the inserts they must see.

    The first step visits the home slot alone (most present keys are there);
    every later step visits the next ``SPAN`` slots at once, so a chain of
    ``L`` slots (an absent key's walk to an EMPTY slot, the longest in a
    step's lanes) costs ``1 + ceil((L - 1) / SPAN)`` round trips, not ``L``.
    The slots past the one that ends a lane's chain are loaded for nothing:
    the scan takes 2 (``bench/gpu_model.py``: 4 saved at most one critical
    round trip at 4096 x 16K long-hit and moved more bytes on every
    workload).

    ``FIRST_MISS`` (0, 1 or 2): the caller takes only the first lane that is
    not a hit (a leading run, a run window), so lanes above the lowest lane
    known absent (its chain ended, or it was masked off) do not matter:
    their chains stop after the home slot's step (1: the wide tile, whose
    registers allow no more) or after every step (2). Those lanes then read
    as misses; every lane below them is exact.
    """
    cap_mask = ctx[C_CAP_MASK]
    found, open0 = _visit(ctx, gids, keys, pos, mask, W)
    # Every slot visited counts, BUSY and TOMBSTONE ones too: on a table
    # with no EMPTY slot (corrupt, or BUSY slots left by a dead insert) the
    # probe still ends after `capacity` visits. Active lanes have all made
    # the same number of visits (a vector: the interpreter types a bool
    # scalar & vector as int64).
    steps = gids * 0 + 1
    active = mask & ~found & open0 & (steps <= cap_mask)
    if FIRST_MISS:
        lane = tl.arange(0, BLOCK)
        cut = tl.min(tl.where(~found & ~active, lane, BLOCK), axis=0)
        active = active & (lane < cut)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # The SPAN slots' loads wait only on `active`: one round trip. The
        # wide tile (FIRST_MISS 1) reloads its active lanes' words with them
        # (an L1 hit, in the same round trip) rather than holding four lanes'
        # words a thread through the loop, which spills at one warp.
        words = keys
        if FIRST_MISS == 1:
            words = load_keys(ctx, units, active, W)
        on = active
        for _s in tl.static_range(SPAN):
            pos = (pos + 1) & cap_mask
            hit, open_s = _visit(ctx, gids, words, pos, active, W)
            hit = on & hit
            found = found | hit
            steps += 1
            on = on & ~hit & open_s & (steps <= cap_mask)
        active = on
        if FIRST_MISS > 1:
            # Only the lanes below the first known miss count (the caller
            # takes the first miss): the others' chains stop here.
            lane = tl.arange(0, BLOCK)
            cut = tl.min(tl.where(~found & ~active, lane, BLOCK), axis=0)
            active = active & (lane < cut)
    return found


@triton.jit
def _is_candidate(ctx, units, gid):
    """int1 [N]: does the store worker ask about hash unit ``units`` (int64 [N])
    for group ``gid`` in a lookup of ``token_len`` tokens (by position only)?
    Mirrors ``ReferenceCoordinator.lookup_candidates``."""
    n_units = ctx[C_LENS]
    token_len = ctx[C_TOK_LEN]
    row = ctx[C_CANDS] + gid * CAND_WIDTH
    bs = tl.load(row + CAND_BLOCK_SIZE)
    s = tl.load(row + CAND_SCALE)
    sparse = tl.load(row + CAND_SPARSE)
    per_segment = tl.load(row + CAND_PER_SEGMENT)
    need = tl.load(row + CAND_NEED)
    shift = tl.load(row + CAND_SHIFT)
    # The limits are ``masks.asked_chunks`` (``ScanPlan.asked_chunks``): with
    # partial hash hits, then dense (the sparse one is in ``sparse_ok``).
    in_partial = units < tl.minimum(n_units, idiv(token_len, ctx[C_HBS]))
    u1 = tl.maximum(units + 1, 0)
    c = idiv(u1, s) - 1
    ok = (irem(u1, s) == 0) & (c >= 0)
    ok = ok & (c < tl.minimum(idiv(n_units, s), idiv(token_len + bs - 1, bs)))
    # The SWA lookup mask keeps the last `need` chunks of each segment
    # (``masks.sparse_window_mask``).
    in_seg = ifmod(c - shift, tl.maximum(per_segment, 1)) >= per_segment - need
    sparse_ok = (c < idiv(token_len, bs)) & (c >= shift) & in_seg
    # Broadcast before mixing with vectors: the interpreter types a bool
    # scalar-vector & / | as int64.
    ok = ok & (((units * 0 + sparse) == 0) | sparse_ok)
    return tl.where(ctx[C_PARTIAL] != 0, in_partial, ok)


@triton.jit
def _candidate_chunk(k, sparse_ok, shift, per_segment, need_chunks):
    """The ``k``-th candidate chunk (in increasing order) of a group: every
    chunk, or with a sparse lookup mask the ``need_chunks`` last of each segment."""
    # The sparse branch is ``masks.sparse_window_chunk``.
    return tl.where(
        sparse_ok,
        shift
        + idiv(k, need_chunks) * per_segment
        + (per_segment - need_chunks)
        + irem(k, need_chunks),
        k,
    )


@triton.jit
def dup_candidate(ctx, units, odd, gid, W: tl.constexpr, BLOCK: tl.constexpr):
    """int1 [BLOCK]: for lanes ``odd`` (present, not a candidate position),
    whether the same hash value stands at a candidate position of the request.

    Only entered when some lane is odd. That is rare for duplicates but not
    for the probe itself: an EAGLE peek past the lookup length lands on a
    stored key the worker did not ask about (multi-turn prefixes), so this
    must not walk the whole prompt. It enumerates the group's candidate
    positions directly (the SWA lookup mask keeps ``need`` chunks per
    segment), ``DUP_LANES`` per step, one odd lane at a time.
    """
    off = ctx[C_OFF]
    n_units = ctx[C_LENS]
    token_len = ctx[C_TOK_LEN]
    hashes_ptr = ctx[C_HASHES]
    lane = tl.arange(0, BLOCK)
    kl = tl.arange(0, DUP_LANES).to(tl.int64)
    row = ctx[C_CANDS] + gid * CAND_WIDTH
    bs = tl.load(row + CAND_BLOCK_SIZE)
    s = tl.load(row + CAND_SCALE)
    sparse = tl.load(row + CAND_SPARSE) != 0
    per_segment = tl.load(row + CAND_PER_SEGMENT)
    need = tl.load(row + CAND_NEED)
    shift = tl.load(row + CAND_SHIFT)
    zero = n_units * 0
    is_partial = ctx[C_PARTIAL] != 0
    sparse_ok = ~is_partial & sparse
    # Candidates are the chunks c < limit (hash units, with partial hits) that
    # the mask keeps, enumerated in increasing order of c by k = 0, 1, ...;
    # ``limit`` is ``masks.asked_chunks`` (``ScanPlan.asked_chunks``).
    limit = tl.minimum(idiv(n_units, s), idiv(token_len + bs - 1, bs))
    limit = tl.where(sparse, tl.minimum(limit, idiv(token_len, bs)), limit)
    limit = tl.where(
        is_partial, tl.minimum(n_units, idiv(token_len, ctx[C_HBS])), limit
    )
    limit = tl.where(sparse_ok & (need <= 0), zero, limit)
    need_chunks = tl.maximum(need, 1)
    scale = tl.where(is_partial, zero + 1, s)

    found = lane < 0
    todo = odd
    i = tl.min(tl.where(todo, lane, BLOCK), axis=0)
    while i < BLOCK:
        u = tl.sum(tl.where(lane == i, units, 0), axis=0)
        k0 = zero
        going = _candidate_chunk(k0, sparse_ok, shift, per_segment, need_chunks) < limit
        hit = zero > 0
        while going:
            c = _candidate_chunk(k0 + kl, sparse_ok, shift, per_segment, need_chunks)
            eq = c < limit
            v = off + (c + 1) * scale - 1
            for j in tl.static_range(W):
                a = tl.load(hashes_ptr + (off + u) * W + j)
                b = tl.load(hashes_ptr + v * W + j, mask=eq, other=0)
                eq = eq & (b == a)
            hit = tl.max(eq.to(tl.int32), axis=0) > 0
            k0 += DUP_LANES
            going = ~hit & (
                _candidate_chunk(k0, sparse_ok, shift, per_segment, need_chunks) < limit
            )
        # Broadcast before mixing with vectors (interpreter quirk, see above).
        hit_v = (tl.zeros([BLOCK], tl.int32) + hit.to(tl.int32)) != 0
        found = found | ((lane == i) & hit_v)
        todo = todo & (lane != i)
        i = tl.min(tl.where(todo, lane, BLOCK), axis=0)
    return found


@triton.jit
def _probe(
    ctx,
    units,
    mask,
    sg_row,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
    FIRST_MISS: tl.constexpr,
):
    """int1 [BLOCK]: is hash unit ``units`` (int64 [BLOCK]) of the request
    present for every member group of the SpecGroup at ``sg_row``? Each
    member loads the keys' words once (:func:`load_keys`), for the lanes every
    earlier member holds; they are not held across members (the duplicate
    search between them needs the registers). Lanes outside ``mask`` or the
    request's hashes are misses. ``FIRST_MISS``: as :func:`table_has` (lanes
    above the first miss may read as misses)."""
    n_units = ctx[C_LENS]
    valid = mask & (units >= 0) & (units < n_units)
    hit = valid
    for k in range(tl.load(sg_row + SG_N_MEMBERS)):
        gid = tl.load(sg_row + SG_MEMBERS + k)
        if HAS_INDEX:
            # Only lanes every earlier member holds: the result is an AND.
            gids = tl.zeros([BLOCK], tl.int64) + gid
            keys = load_keys(ctx, units, hit, W)
            pos = home_slots(ctx, gids, keys, W, HAS_INDEX)
            present = table_has(
                ctx, gids, keys, units, pos, hit, W, 2, FIRST_MISS, BLOCK
            )
        else:
            present = hit
        if HAS_TL:
            cand = _is_candidate(ctx, units, gid)
            odd = present & ~cand
            if tl.max(odd.to(tl.int32), axis=0) > 0:
                cand = cand | dup_candidate(ctx, units, odd, gid, W, BLOCK)
            present = present & cand
        hit = hit & present
    return hit


@triton.jit
def _leading_run(
    ctx,
    sg_row,
    start,
    end,
    scale,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
    FIRST: tl.constexpr,
):
    """How many consecutive blocks from ``start`` (below ``end``) hit; block
    ``i`` is keyed by hash unit ``(i + 1) * scale - 1``. ``BLOCK`` blocks per
    step (the wide tile, ``LEAD`` for full attention's run), ``FIRST`` in the
    first (a run that ends there loads no more rows and slots than it must
    be wide for: half the wide tile's bytes for short hits, one step more
    for a few long ones); a step's keys and home slots are loaded and
    computed in it (carrying the next step's across the loop, one round trip
    less a step, breaks Triton 3.6's layout pass)."""
    lane = tl.arange(0, BLOCK)
    count = start * 0
    width = count + FIRST
    going = end > start
    while going:
        blk = start + count + lane
        units = (blk + 1) * scale - 1
        on = (blk < end) & (lane < width)
        hit = _probe(ctx, units, on, sg_row, W, HAS_INDEX, HAS_TL, BLOCK, 1)
        lead = tl.min(tl.where(hit, BLOCK, lane), axis=0)
        count += lead
        going = (lead == width) & (start + count < end)
        width = count * 0 + BLOCK
    return count


@triton.jit
def _rightmost(
    ctx,
    sg_row,
    search,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The largest block ``j`` with ``low <= j <= top``, ``j % q == resid`` and
    ``need >= 1`` hit blocks ending at ``j``; -1 when there is none.
    ``search`` is ``(top, low, q, resid, need, scale)``."""
    top, low, q, resid, need, scale = search
    lane = tl.arange(0, BLOCK)
    low = tl.maximum(low, need - 1)
    j = top - ifmod(top - resid, q)
    found = top * 0 - 1
    going = j >= low
    if need == 1:
        # BLOCK candidates per step, highest first.
        while going:
            cand = j - lane * q
            units = (cand + 1) * scale - 1
            hit = _probe(
                ctx, units, cand >= low, sg_row, W, HAS_INDEX, HAS_TL, BLOCK, 0
            )
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
                units = (j - d + 1) * scale - 1
                hit = _probe(ctx, units, use, sg_row, W, HAS_INDEX, HAS_TL, BLOCK, 2)
                k = tl.min(tl.where(use & ~hit, lane, BLOCK), axis=0)
                miss = tl.where(k < BLOCK, j - d0 - k, miss)
                d0 += BLOCK
                checking = (k == BLOCK) & (d0 < need)
            found = tl.where(miss < 0, j, found)
            j = (miss - 1) - ifmod(miss - 1 - resid, q)
            going = (miss >= 0) & (j >= low)
    return found


@triton.jit
def _sg_shape(ctx, sg_row, bound, drop):
    """The derived numbers of a SpecGroup scan up to ``bound`` tokens, as a
    tuple: ``(kind, bs, scale, q, fine, m, fscale, sb, need_eff, swa_resid)``.
    Called before the searches and again after them (recomputing beats
    holding ten values through the probe loops)."""
    align = ctx[C_ALIGN]
    kind = tl.load(sg_row + SG_KIND)
    bs = tl.load(sg_row + SG_BLOCK_SIZE)
    scale = tl.load(sg_row + SG_SCALE)
    q = tl.load(sg_row + SG_PERIOD)
    fine = tl.load(sg_row + SG_FINE) != 0
    chunk = tl.maximum(tl.load(sg_row + SG_CHUNK), 1)
    zero = bound * 0
    m = idiv(bound, bs)
    # Fine-grained (align < bs): the full view has bs // align units per block.
    fscale = tl.where(fine, idiv(bs, align), scale)
    sb = idiv(tl.where(bound > 0, idiv(bound, chunk) * chunk, zero), bs)
    # SG_NEED is ``masks.sliding_window_need`` without EAGLE; the drop is its
    # ``eagle`` term.
    need_eff = tl.maximum(tl.load(sg_row + SG_NEED) + drop, 1)
    swa_resid = tl.where(drop != 0, zero, q - 1)
    return kind, bs, scale, q, fine, m, fscale, sb, need_eff, swa_resid


@triton.jit
def sg_searches(
    ctx,
    sg_row,
    bound,
    drop,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    BLOCK: tl.constexpr,
    LEAD: tl.constexpr,
):
    """The three searches of a SpecGroup scan, ``(n, j, p)``.

    Every kind is one leading run ``n`` (full attention, chunked local), then
    one rightmost search ``j`` (full attention's fine-grained tail, sliding
    window, Mamba), then one more leading run ``p`` (the sliding window's
    short-run fallback); a kind that needs no phase gives it an empty range.
    Three call sites instead of one per kind keep the inlined code small.
    """
    align = ctx[C_ALIGN]
    n_units = ctx[C_LENS]
    shape = _sg_shape(ctx, sg_row, bound, drop)
    kind, bs, scale, q, fine, m, fscale, sb, need_eff, swa_resid = shape
    is_full = kind == KIND_FULL
    is_swa = kind == KIND_SWA
    is_mamba = kind == KIND_MAMBA
    is_chunk = ~(is_full | is_swa | is_mamba)
    zero = bound * 0

    # Each kind's scan mirrors its reference: ``reference.full_attention_hit``,
    # ``sliding_window_hit``, ``mamba_hit``, ``chunked_local_hit``.
    # Phase A: full attention's leading run; chunked local's run after the
    # null blocks before the last attention chunk.
    a_start = tl.where(is_chunk, sb, zero)
    a_end = tl.where(is_chunk, tl.maximum(m, sb), zero)
    a_end = tl.where(is_full, tl.minimum(m, idiv(n_units, fscale)), a_end)
    a_scale = tl.where(is_full, fscale, scale)
    n = _leading_run(
        ctx, sg_row, a_start, a_end, a_scale, W, HAS_INDEX, HAS_TL, LEAD, LEAD // 2
    )

    # Phase B: the rightmost search. Full, fine-grained: the highest hit hash
    # unit inside the next block; Mamba: the rightmost aligned state
    # (fine-grained: hash unit); sliding window: a run of need_eff blocks.
    first = n * fscale
    f_top = tl.minimum(tl.minimum(first + fscale - 1, idiv(bound, align)), n_units) - 1
    b_top = tl.where(is_mamba, tl.minimum(idiv(bound, align), n_units) - 1, zero - 1)
    b_top = tl.where(is_swa | (is_mamba & ~fine), m - 1, b_top)
    b_top = tl.where(is_full, tl.where(fine, f_top, zero - 1), b_top)
    unit_level = fine & (is_full | is_mamba)
    b_resid = tl.where(unit_level, zero, tl.where(is_swa, swa_resid, q - 1))
    search = (
        b_top,
        tl.where(is_full, first, zero),
        tl.where(unit_level, zero + 1, q),
        b_resid,
        tl.where(is_swa, need_eff, zero + 1),
        tl.where(unit_level, zero + 1, scale),
    )
    j = _rightmost(ctx, sg_row, search, W, HAS_INDEX, HAS_TL, BLOCK)

    # Phase C: a sliding window with no run of `need` blocks still hits with
    # the leading run (shorter than need - 1 blocks).
    c_end = tl.where(is_swa & (j < 0), tl.minimum(m, need_eff - 1), zero)
    p = _leading_run(
        ctx, sg_row, zero, c_end, scale, W, HAS_INDEX, HAS_TL, BLOCK, BLOCK
    )
    return n, j, p


@triton.jit
def sg_result(ctx, sg_row, bound, drop, n, j, p):
    """A SpecGroup scan's answer from its searches: ``(hit, length, lo, hi)``,
    the hit in tokens and the members' load-mask span."""
    align = ctx[C_ALIGN]
    shape = _sg_shape(ctx, sg_row, bound, drop)
    kind, bs, scale, q, fine, m, fscale, sb, need_eff, swa_resid = shape
    zero = bound * 0
    got = j >= 0
    dropping = drop != 0
    # Full attention (``reference.full_attention_hit``).
    f_tail = fine & got
    f_blocks = n + f_tail.to(tl.int64)
    f_hit = tl.where(f_tail, (j + 1) * align, n * bs)
    f_hit = tl.where(dropping & (f_hit > 0), f_hit - tl.minimum(align, bs), f_hit)
    f_hit = f_hit - irem(f_hit, align)
    f_blocks = tl.minimum(f_blocks, idiv(f_hit + bs - 1, bs))
    # Sliding window (``reference.sliding_window_hit``).
    s_len = tl.where(dropping, j, j + 1)
    s_lo = j - need_eff + 1
    j0 = (p - 1) - ifmod(p - 1 - swa_resid, q)
    run = tl.where(j0 >= 0, j0 + 1, zero)
    run = run - irem(run, q)
    run = tl.where(dropping & (run > 0), run - 1, run)
    run = run - irem(run, q)
    s_len = tl.where(got, s_len, run)
    s_lo = tl.where(got, s_lo, zero)
    # Mamba (``reference.mamba_hit``).
    j_pos = tl.maximum(j, 0)
    m_len = tl.where(got, tl.where(fine, idiv(j_pos, fscale) + 1, j_pos + 1), zero)
    m_hit = tl.where(got, tl.where(fine, (j_pos + 1) * align, (j_pos + 1) * bs), zero)
    m_lo = m_len - got.to(tl.int64)
    # Chunked local (``reference.chunked_local_hit``).
    c_len = sb + n

    is_full = kind == KIND_FULL
    is_swa = kind == KIND_SWA
    is_mamba = kind == KIND_MAMBA
    hit = tl.where(is_mamba, m_hit, c_len * bs)
    hit = tl.where(is_swa, s_len * bs, hit)
    hit = tl.where(is_full, f_hit, hit)
    length = tl.where(is_mamba, m_len, c_len)
    length = tl.where(is_swa, s_len, length)
    length = tl.where(is_full, f_blocks, length)
    lo = tl.where(is_mamba, m_lo, sb)
    lo = tl.where(is_swa, s_lo, lo)
    lo = tl.where(is_full, zero, lo)
    return hit, length, lo, length


@triton.jit
def eagle_drop(ctx, sg_row, verified, multi, APPLY_EAGLE: tl.constexpr):
    """1 where this SpecGroup's scan applies the EAGLE drop, else 0 (int64)."""
    zero = ctx[C_LENS] * 0
    drop = zero
    if APPLY_EAGLE:
        use_eagle = (zero + tl.load(sg_row + SG_USE_EAGLE)) != 0
        # Once verified, a SpecGroup of several converges without the drop.
        drop = (use_eagle & (~multi | (verified == 0))).to(tl.int64)
    return drop
