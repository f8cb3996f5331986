"""The LookupEngine's Triton kernel: every request's longest cache hit, in one launch.

One program per request runs the whole scalar rule of vLLM 0.33.0's
``MooncakeStoreCoordinator.find_longest_cache_hit`` for that request: the
per-kind scans (full attention, sliding window, Mamba, chunked local), the
multi-SpecGroup convergence loop with its ``eagle_verified`` bookkeeping, the
EAGLE proof margin (never for Mamba), the simple-hybrid early exit and the final
full-attention truncation. Key membership is decided inside the kernel by
probing the KeyIndex table, so a batch costs one launch and no host round trip
however many requests it has. In ``LOOKUP`` mode the program also runs the
store worker's rule around it (``MooncakeStoreWorker.lookup``, mirrored from
``ReferenceCoordinator.lookup``): align the prompt length, give up when the
worker asks no key, search, and search again at ``num_tokens - 1`` when the hit
covers the whole prompt; both searches in the same program.

This module imports nothing from ``coordinator/``; the layout arrives as two
small int64 tables built by ``coordinator/triton_backend.py`` from a
``ScanPlan``, whose columns are named in ``kernels/contract.py`` (``SG_*``,
``CAND_*``). The closed forms of the per-kind rules are documented in
``coordinator/plan.py``.

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
  the latency of one probe chain; see :data:`BLOCK` and :data:`NUM_WARPS`.
* **Wide tiles for the long part (issue 31).** Full attention's leading run,
  where a long hit spends its time, is probed ``LEAD = LEAD_FACTOR * BLOCK``
  blocks at a time (the first tile half as wide), 4 lanes a thread of a
  one-warp program; the first miss is a min-reduction. A tile's probe
  chains reload the active lanes' words with each step's slots (an L1 hit in
  the same round trip) instead of holding 16 words a thread, which spills.
  (Loading the next tile's words before that reduction ends
  would save a round trip a step, but Triton 3.6's
  TritonGPURemoveLayoutConversions pass fails on that vector carried by a
  ``while`` loop, and in a ``for`` loop the two tiles' words spill; 3.6 is
  what the H200 machine has.) The short searches (sliding-window tails, Mamba
  states, EAGLE drops, the worker's second search) keep ``BLOCK`` lanes.
  ``bench/gpu_model.py`` counts the dependent round trips of each request
  under the interpreter (long-hit dsv4 16K at B = 1: 68 at a094dd7, 23 now).
* **State lives in registers, and little of it.** Per-SpecGroup results are
  ``S_PAD``-wide vectors updated with ``tl.where``; the load-mask spans are
  written to ``mask_spans`` once, at the end (scalar stores and loads by different
  threads of a CTA would need a barrier). Across the probe loops a SpecGroup
  scan keeps only its three search results and bound: the row's fields and
  what is derived from them are loaded and computed again where needed (an L1
  hit and a few integer ops, cheaper than registers held through the deepest
  loops); the worker lookup keeps no mask state at all. This is what keeps
  the lookup variant at or under 128 registers without spills on sm_90
  (``tests/test_scan_registers.py``).
* **One request context.** Every helper takes the request's runtime values as
  one tuple ``ctx`` (fields ``_C_*``), and only the specialisation constants
  (``W``, ``HAS_INDEX``, ``HAS_TL``, ``BLOCK``) besides; Triton cannot carry
  constexprs inside a tuple when it really compiles.
* **The plan is runtime data, loop over SpecGroups at run time.** The kernel
  is specialised only on ``W``, the presence of an index / of the store
  worker's candidate restriction, ``APPLY_EAGLE``, ``LOOKUP``, ``BLOCK`` and
  the table widths, so the compile count per layout is bounded, while kinds and
  sizes are uniform scalar branches within a program.
* **Own table probe.** ``table_has`` follows the layout contract of
  ``coordinator/key_index.py`` with the slot hash of
  ``kvhit.kernels.hash_index``, but reads column 0 with plain loads instead of
  ``find_slots``' acquire loads: a scan is stream-ordered after the inserts it
  must see, and an acquire per probe step would sit on the latency-bound
  critical path. A probe loads the key's words once (its home slot and
  every compare use them), and a probe step loads the slot's group id and
  words at once (no load waits on another's compare): one round trip per
  slot visited. Every slot visited counts toward the probe bound, BUSY ones
  included (the scan passes over BUSY, never waits on it), so a probe ends even
  on a table with no EMPTY slot. Lanes of later SpecGroup members probe only
  where earlier members hit (an AND).
* **The store worker's candidate restriction** (``token_len``): a present key
  counts only at a position the worker asks about, or when the same hash value
  stands at such a position in the request (the worker's set holds values).
  The position test is closed-form; the value test (``dup_candidate``) runs
  only for lanes present but not at a candidate, and enumerates the group's
  candidate positions directly rather than the whole prompt, because an EAGLE
  peek past the lookup length often lands on such a key.
* **Interpreter quirk.** Under ``TRITON_INTERPRET=1`` a bool scalar combined
  with a bool vector by ``&`` / ``|`` comes out int64 (not a valid mask);
  scalars are broadcast (``zeros + x``) before they meet vectors.
* **Integer division.** Triton's ``//`` and ``%`` truncate toward zero on a
  GPU but floor under the interpreter; every ``//`` here has non-negative
  operands and every possibly negative remainder goes through ``ifmod``.

Probes past a request's hashes are misses (the reference raises there).
A negative length is scanned as 0 and its hit is :data:`LENGTH_FLAG` (-1), so
a caller that did not check the lengths' values checks the answer it copies
anyway (issue 31: no host sync before the launch). Preconditions the launcher
cannot check without a device sync: for every request ``r``, ``offsets[r] +
n_units[r] <= hashes.shape[0]``. The plan rows' values (member group ids inside ``cand_rows``, sizes that
divide >= 1: ``checks.check_plan_rows``) are checked with one host copy per
rows tensor, remembered while the tensor is not written in place.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import triton
import triton.language as tl

from kvhit.kernels import contract as kc
from kvhit.kernels.checks import (
    check_int64,
    check_plan_params,
    check_plan_rows,
    table_capacity,
)
from kvhit.kernels.launch import (
    DirectLauncher,
    device_guard,
    fix_interpreter,
    interpreting,
)
from kvhit.kernels.scan_sg import (
    C_ALIGN,
    C_CANDS,
    C_HBS,
    C_LENS,
    C_N_SG,
    C_PARTIAL,
    C_SGS,
    C_SIMPLE,
    C_TOK_LEN,
    CAND_BLOCK_SIZE,
    CAND_CACHEABLE,
    CAND_NEED,
    CAND_PER_SEGMENT,
    CAND_SCALE,
    CAND_SHIFT,
    CAND_SPARSE,
    CAND_WIDTH,
    KIND_FULL,
    SG_BLOCK_SIZE,
    SG_KIND,
    SG_MARGIN,
    SG_MEMBERS,
    SG_N_MEMBERS,
    eagle_drop,
    idiv,
    sg_result,
    sg_searches,
)

__all__ = [
    "BLOCK",
    "LEAD_FACTOR",
    "LENGTH_FLAG",
    "LookupLaunch",
    "SCAN_LAUNCHER",
    "MAXNREG",
    "NUM_WARPS",
    "launch_scan",
    "request_ctx",
    "scan_hits",
    "worker_lookup",
]

# Triton 3.6's interpreter cannot range() over a runtime scalar (launch.py).
# Whether kernels are interpreted is fixed when triton decorates them, so
# once at import is enough; no launch pays for the check.
fix_interpreter()

# -- launch parameters: every choice in one place ---------------------------------
# Positions probed per step of the short searches (sliding-window tails,
# Mamba states, EAGLE drops, the worker's second search, the duplicate-value
# search). A probe step is one round trip per table slot visited (a slot's
# group id and words are loaded together), so 32 lanes cost the latency of one.
BLOCK = 32
# The leading full-attention run (the long part of a long hit) is probed in
# tiles of LEAD_FACTOR * BLOCK blocks (the first tile half as wide: a short
# run then loads half the hash rows and slots), the first miss found by a
# min-reduction across the lanes (bench/gpu_model.py: 128-block tiles take
# llama's longest 128K run from ~200 dependent steps to ~50).
LEAD_FACTOR = 4
# One warp per program: at 128 registers 16 programs fit an SM (2112 on an
# H200), twice as many as at two warps, and at 4096 requests the programs'
# round trips, not one request's, bound a call: bench/gpu_model.py models
# long-hit 4096 x 16K at 49 us (77 at two warps) and llama 4096 x 128K at
# 175 us (207). The wide tile is then 4 lanes a thread; its probe chains
# reload their words rather than hold them (scan_sg.table_has), which is
# what keeps it from spilling.
NUM_WARPS = 1
# The register ceiling given to ptxas (PTX ``.maxnreg``). Without it, ptxas
# aims a one-warp CTA at 64 registers (32 resident CTAs per SM) and spills the
# outer loops' state to local memory to get there (the find variants: 64
# registers, 104-148 bytes of spill stores on sm_90); with it they hold that
# state in registers (about 100-128; the lookup variant 110 under Triton
# 3.9, 128 under 3.6, no spills). 128 leaves 16 resident one-warp programs
# per SM.
MAXNREG = 128
# The one other choice, the duplicate-value search's width, is
# scan_sg.DUP_STEP (next to the search it sizes).

# The hit of a request whose length is negative (a flag, never a hit).
LENGTH_FLAG = -1
_LENGTH_FLAG: tl.constexpr = tl.constexpr(LENGTH_FLAG)
# The longest length the kernel distinguishes, in tokens (see idiv).
_MAX_LEN: tl.constexpr = tl.constexpr((1 << 30) - 1)


@triton.jit
def request_ctx(
    offset,
    n_units,
    token_len,
    hashes_ptr,
    table_ptr,
    cap_mask,
    cand_ptr,
    partial,
    hbs,
    align,
    sg_ptr,
    n_sg,
    simple_hybrid,
):
    """The request context ``ctx``: kernels/scan_sg.py's fields ``C_*``, in
    this order. Built the same way by the scan kernel and the fleet's hybrid
    kernel. Scalar arguments become tensors: Triton specialises ints equal
    to 1 into constexprs, which a tuple cannot carry and on which ``~`` is
    Python's."""
    zero = n_units * 0
    return (
        offset,
        n_units,
        token_len,
        hashes_ptr,
        table_ptr,
        zero + cap_mask,
        cand_ptr,
        zero + partial,
        zero + hbs,
        zero + align,
        sg_ptr,
        zero + n_sg,
        zero + simple_hybrid,
    )


@triton.jit
def converge(
    ctx,
    max_len,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    HAS_TL: tl.constexpr,
    APPLY_EAGLE: tl.constexpr,
    BLOCK: tl.constexpr,
    LEAD: tl.constexpr,
    S_PAD: tl.constexpr,
    SG_W: tl.constexpr,
    MASKS: tl.constexpr,
):
    """The multi-SpecGroup convergence loop up to ``max_len`` tokens (none when
    ``max_len < 0``, then the hit is ``max_len``): ``(hit, sg_len, sg_lo,
    sg_hi)``, the hit in tokens and, when ``MASKS``, each SpecGroup's mask
    span (``S_PAD``-wide vectors; zeros otherwise)."""
    n_units = ctx[C_LENS]
    n_sg = ctx[C_N_SG]
    zero = n_units * 0
    multi = n_sg > 1
    sidx = tl.arange(0, S_PAD)
    zs = tl.zeros([S_PAD], tl.int64)
    # Per SpecGroup: hit in tokens, eagle_verified, load-mask span.
    sg_hit = zs
    verified = zs
    sg_len = zs
    sg_lo = zs
    sg_hi = zs

    hit_length = max_len
    full_done = zero
    active = max_len >= 0
    while active:
        curr = hit_length
        for idx in range(n_sg):
            row = ctx[C_SGS] + idx * SG_W
            sel = sidx == idx
            if (tl.load(row + SG_KIND) == KIND_FULL) & (full_done != 0):
                # Full attention is scanned once; later rounds only clip it.
                curr = tl.minimum(curr, tl.sum(tl.where(sel, sg_hit, 0), axis=0))
            else:
                was_verified = tl.sum(tl.where(sel, verified, 0), axis=0)
                drop = eagle_drop(ctx, row, was_verified, multi, APPLY_EAGLE)
                # EAGLE peeks one proof margin past the hit, then drops it
                # (margin is 0 for Mamba); a lone SpecGroup scans max_length.
                margin = tl.load(row + SG_MARGIN)
                bound = curr
                if multi & (margin > 0) & (drop != 0):
                    bound = tl.minimum(curr + margin, n_units * ctx[C_HBS])
                n, j, p = sg_searches(
                    ctx, row, bound, drop, W, HAS_INDEX, HAS_TL, BLOCK, LEAD
                )
                new_hit, length, lo, hi = sg_result(ctx, row, bound, drop, n, j, p)
                shrunk = (drop == 0) & (new_hit < curr)
                verified = tl.where(sel & ((zs + drop) != 0), zs + 1, verified)
                verified = tl.where(shrunk, zs, verified)
                curr = new_hit
                sg_hit = tl.where(sel, new_hit, sg_hit)
                if MASKS:
                    sg_len = tl.where(sel, length, sg_len)
                    sg_lo = tl.where(sel, lo, sg_lo)
                    sg_hi = tl.where(sel, hi, sg_hi)
        full_done = zero + 1
        # A lone SpecGroup's scan is the answer; several converge while the
        # common hit shrinks (a simple hybrid stops after one shrink).
        shrank = curr < hit_length
        hit_length = tl.where(shrank | ~multi, curr, hit_length)
        active = shrank & multi & (ctx[C_SIMPLE] == 0)
    return hit_length, sg_len, sg_lo, sg_hi


@triton.jit
def _store_masks(
    ctx,
    mask_spans_ptr,
    r,
    n_groups,
    hit_length,
    masks,
    S_PAD: tl.constexpr,
    SG_W: tl.constexpr,
):
    """Write every member group's load-mask span to ``mask_spans[r]``; ``masks`` is
    ``(sg_len, sg_lo, sg_hi)`` from :func:`converge`."""
    sg_len, sg_lo, sg_hi = masks
    n_sg = ctx[C_N_SG]
    sidx = tl.arange(0, S_PAD)
    for idx in range(n_sg):
        row = ctx[C_SGS] + idx * SG_W
        bs = tl.load(row + SG_BLOCK_SIZE)
        sel = sidx == idx
        length = tl.sum(tl.where(sel, sg_len, 0), axis=0)
        lo = tl.sum(tl.where(sel, sg_lo, 0), axis=0)
        hi = tl.sum(tl.where(sel, sg_hi, 0), axis=0)
        if (n_sg > 1) & (tl.load(row + SG_KIND) == KIND_FULL):
            # Full attention keeps only the blocks of the common hit.
            length = tl.minimum(length, idiv(hit_length + bs - 1, bs))
            hi = length
        for k in range(tl.load(row + SG_N_MEMBERS)):
            gid = tl.load(row + SG_MEMBERS + k)
            out = mask_spans_ptr + (r * n_groups + gid) * 3
            tl.store(out + 0, length)
            tl.store(out + 1, lo)
            tl.store(out + 2, hi)


@triton.jit
def asks_any(ctx, n_groups):
    """Whether the store worker asks about any key at all (mirrors
    ``ReferenceCoordinator.lookup``'s ``if not candidates: return 0``): per
    prefix-cacheable group, the chunks it walks, and for a sparse lookup mask
    whether they reach its lowest kept chunk."""
    n_units = ctx[C_LENS]
    token_len = ctx[C_TOK_LEN]
    partial = ctx[C_PARTIAL] != 0
    anyc = n_units < 0
    for gid in range(n_groups):
        row = ctx[C_CANDS] + gid * CAND_WIDTH
        bs = tl.load(row + CAND_BLOCK_SIZE)
        sparse = tl.load(row + CAND_SPARSE) != 0
        need = tl.load(row + CAND_NEED)
        # ``masks.sparse_window_chunk(0, per_segment, need, shift)``.
        lowest = tl.load(row + CAND_SHIFT) + tl.load(row + CAND_PER_SEGMENT) - need
        # ``masks.asked_chunks`` (``ScanPlan.asked_chunks``).
        asked = tl.minimum(
            idiv(n_units, tl.load(row + CAND_SCALE)), idiv(token_len + bs - 1, bs)
        )
        asked = tl.where(sparse, tl.minimum(asked, idiv(token_len, bs)), asked)
        asked = tl.where(
            partial, tl.minimum(n_units, idiv(token_len, ctx[C_HBS])), asked
        )
        dense = partial | ~sparse
        here = tl.where(dense, asked > 0, (need > 0) & (asked > lowest))
        anyc = anyc | ((tl.load(row + CAND_CACHEABLE) != 0) & here)
    return anyc


@triton.jit
def _worker_lookup(
    ctx,
    num_tokens,
    n_groups,
    W: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
    LEAD: tl.constexpr,
    S_PAD: tl.constexpr,
    SG_W: tl.constexpr,
):
    """The store worker's answer for a prompt of ``num_tokens`` tokens, with
    the candidate restriction at ``ctx``'s ``token_len`` (the aligned length).
    Mirrors ``ReferenceCoordinator.lookup``: a hit covering the whole prompt
    is searched again at ``align(num_tokens - 1)``, still restricted to the
    keys asked at the original length. The second search reuses the loop, so
    the convergence code is inlined once."""
    align = ctx[C_ALIGN]
    token_len = ctx[C_TOK_LEN]
    zero = num_tokens * 0
    ok = (ctx[C_LENS] > 0) & (token_len > 0) & asks_any(ctx, n_groups)
    usable = idiv(tl.maximum(num_tokens - 1, 0), align) * align
    bound = tl.where(ok, token_len, zero - 1)
    out = zero
    searching = ok
    while searching:
        hit, _l, _lo, _hi = converge(
            ctx, bound, W, HAS_INDEX, True, True, BLOCK, LEAD, S_PAD, SG_W, False
        )
        # The second search is bounded by usable < num_tokens: it never
        # covers the whole prompt, so the loop runs at most twice.
        whole = hit >= num_tokens
        out = tl.where(whole, zero, hit)
        bound = usable
        searching = whole & (usable > 0)
    return out


# Plain ints are never specialised (issue 31, warm start): Triton would
# otherwise compile a variant per value class (== 1, divisible by 16) of the
# table's capacity and the layout's sizes, so a warm-up call would not load
# the variant a real call needs.
@triton.jit(
    do_not_specialize=[
        "cap_mask",
        "n_sg",
        "n_groups",
        "hbs",
        "align",
        "partial",
        "simple_hybrid",
    ]
)
def _scan_kernel(
    hashes_ptr,
    offsets_ptr,
    n_units_ptr,
    len_ptr,
    tok_len_ptr,
    table_ptr,
    cap_mask,
    sg_ptr,
    cand_ptr,
    hit_ptr,
    mask_spans_ptr,
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
    LOOKUP: tl.constexpr,
    BLOCK: tl.constexpr,
    LEAD: tl.constexpr,
    S_PAD: tl.constexpr,
    SG_W: tl.constexpr,
):
    """One program per request ``r``: ``hit[r]`` and (unless ``LOOKUP``) the
    mask spans ``mask_spans[r]``. ``len_ptr`` holds max_lengths, or with ``LOOKUP``
    the prompts' num_tokens (the worker's restriction is then derived here)."""
    r = tl.program_id(0).to(tl.int64)
    n_units = tl.load(n_units_ptr + r)
    # Positions are divided in 32 bits (idiv): lengths past _MAX_LEN tokens
    # mean the same as _MAX_LEN (no request has that many hashes' tokens).
    # A negative length is the caller's error, checked here rather than by a
    # host sync before the launch: the request is scanned as length 0 and its
    # hit is -1 (no hit is negative), which the host sees in the one copy of
    # the answer it makes anyway (``scan.LENGTH_FLAG``).
    raw = tl.load(len_ptr + r)
    bad = raw < 0
    length = tl.minimum(tl.maximum(raw, 0), _MAX_LEN)
    zero = n_units * 0
    if LOOKUP:
        token_len = idiv(length, align) * align
    elif HAS_TL:
        token_len = tl.load(tok_len_ptr + r)
    else:
        token_len = zero
    ctx = request_ctx(tl.load(offsets_ptr + r), n_units, token_len, hashes_ptr,
                      table_ptr, cap_mask, cand_ptr, partial, hbs, align, sg_ptr,
                      n_sg, simple_hybrid)  # fmt: skip
    if LOOKUP:
        hit = _worker_lookup(
            ctx, length, n_groups, W, HAS_INDEX, BLOCK, LEAD, S_PAD, SG_W
        )
    else:
        hit, sg_len, sg_lo, sg_hi = converge(
            ctx,
            length,
            W,
            HAS_INDEX,
            HAS_TL,
            APPLY_EAGLE,
            BLOCK,
            LEAD,
            S_PAD,
            SG_W,
            True,
        )
        masks = (sg_len, sg_lo, sg_hi)
        _store_masks(ctx, mask_spans_ptr, r, n_groups, hit, masks, S_PAD, SG_W)
    tl.store(hit_ptr + r, tl.where(bad, _LENGTH_FLAG, hit))


def _check(
    name: str,
    t: object,
    dim: int,
    device: torch.device,
    shape: tuple[int | None, ...] | None = None,
) -> torch.Tensor:
    """Validate one tensor argument (int64, contiguous, ``dim`` dims, on
    ``device``, sizes equal to ``shape`` where not None); metadata only."""
    t = check_int64(t, name, dim=dim, device=device, device_of="hashes")
    if shape is not None:
        for want, got in zip(shape, t.shape, strict=True):
            if want is not None and want != got:
                raise ValueError(
                    f"{name} must have shape {[s if s is not None else '*' for s in shape]}, "
                    f"got {list(t.shape)}"
                )
    return t


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Plan-row tensors whose values were checked: id -> (weakref to the tensor,
# the version counter torch bumps on every in-place write, the alignment).
# Checking values copies the rows to the host, a sync per call on a GPU; the
# backend passes the same cached tensors every call, so they are copied once.
_CHECKED_ROWS: dict[tuple[int, int], tuple[object, object, tuple[int, int, int]]] = {}
_CHECKED_LOCK = threading.Lock()


def _check_row_values(
    sg_rows: torch.Tensor, cand_rows: torch.Tensor, alignment: int
) -> None:
    """:func:`checks.check_plan_rows` on the rows' values, skipped for the
    same two tensors, unwritten since, at the same alignment."""
    key = (id(sg_rows), id(cand_rows))
    stamp = (sg_rows._version, cand_rows._version, alignment)
    with _CHECKED_LOCK:
        seen = _CHECKED_ROWS.get(key)
    if seen is not None and seen[0]() is sg_rows and seen[1]() is cand_rows:
        if seen[2] == stamp:
            return
    check_plan_rows(sg_rows.cpu().numpy(), cand_rows.cpu().numpy(), alignment)
    with _CHECKED_LOCK:
        if len(_CHECKED_ROWS) >= 64:
            _CHECKED_ROWS.clear()
        _CHECKED_ROWS[key] = (weakref.ref(sg_rows), weakref.ref(cand_rows), stamp)


def _validate(
    hashes: object,
    offsets: object,
    n_units: object,
    lengths: tuple[str, object],
    sg_rows: object,
    cand_rows: object,
    table: object,
    token_len: object,
    params: object,
    block: object,
) -> kc.PlanParams:
    """Every check both launchers make, before anything is allocated;
    returns ``params`` checked (``checks.check_plan_params``)."""
    if not isinstance(hashes, torch.Tensor):
        raise TypeError(f"hashes must be a torch.Tensor, got {type(hashes).__name__}")
    device = hashes.device
    _check("hashes", hashes, 2, device)
    W = hashes.shape[1]
    if W < 1:
        raise ValueError(f"hashes must have at least one word per hash, got {W}")
    n_req = _check("offsets", offsets, 1, device).shape[0]
    _check("n_units", n_units, 1, device, (n_req,))
    _check(lengths[0], lengths[1], 1, device, (n_req,))
    if token_len is not None:
        _check("token_len", token_len, 1, device, (n_req,))
    n_sg, sg_w = _check("sg_rows", sg_rows, 2, device).shape
    if n_sg < 1 or sg_w < kc.SG_MEMBERS + 1:
        raise ValueError(
            f"sg_rows must have shape [S >= 1, >= {kc.SG_MEMBERS + 1}], got "
            f"{list(sg_rows.shape)}"
        )
    params = check_plan_params(params)
    _check("cand_rows", cand_rows, 2, device, (params.num_groups, kc.CAND_WIDTH))
    if table is not None:
        table_capacity(_check("table", table, 2, device, (None, W + 1)).shape, W)
    _check_row_values(sg_rows, cand_rows, params.alignment)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ValueError(f"block must be a power of two >= 2, got {block!r}")
    if block & (block - 1):
        raise ValueError(f"block must be a power of two >= 2, got {block!r}")
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            "hashes is on the CPU: the Triton kernels need a GPU, or "
            "TRITON_INTERPRET=1 set before triton is imported"
        )
    return params


# The scan kernel's launch options, and its launcher past the binder.
_OPTIONS = {"num_warps": NUM_WARPS, "maxnreg": MAXNREG}
SCAN_LAUNCHER = DirectLauncher()


def launch_scan(
    hashes: torch.Tensor,
    offsets: torch.Tensor,
    n_units: torch.Tensor,
    lengths: torch.Tensor,
    token_len: torch.Tensor | None,
    table: torch.Tensor | None,
    sg_rows: torch.Tensor,
    cand_rows: torch.Tensor,
    *,
    hash_block_size: int,
    alignment: int,
    partial: bool,
    simple_hybrid: bool,
    num_groups: int,
    apply_eagle: bool,
    lookup: bool,
    block: int = BLOCK,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of :func:`_scan_kernel`, one program per request, for a
    trusted caller: nothing is checked (the backend built every argument
    itself, or checked it once through ``kernels/checks.py``). Arguments as
    :func:`scan_hits` (``lengths``: max_lengths, or with ``lookup`` the
    prompts' num_tokens, int64 ``[R]``, possibly negative: see below).

    Args:
        out: None, or int64 ``[R]`` contiguous on ``hashes``' device to hold
            the hits (a CUDA graph's static buffer): then no allocation in
            LOOKUP mode.

    Returns:
        ``(hit int64 [R], mask_spans int64 [R, G, 3])``; in LOOKUP mode
        ``mask_spans`` is ``hit`` itself (the kernel never writes mask spans
        there). ``hit[r]`` is :data:`LENGTH_FLAG` where ``lengths[r] < 0``
        (the request is scanned as length 0): the caller that has not checked
        the lengths' values checks the answer instead. No host sync.
    """
    n_req = offsets.shape[0]
    device = hashes.device
    hit = (
        out if out is not None else torch.empty(n_req, dtype=torch.int64, device=device)
    )
    if lookup:
        mask_spans = hit
    else:
        mask_spans = torch.zeros(n_req, num_groups, 3, dtype=torch.int64, device=device)
    if not n_req:
        return hit, mask_spans
    n_sg, sg_w = sg_rows.shape
    # Unused pointer arguments still need a tensor on the device.
    args = (
        hashes,
        offsets,
        n_units,
        lengths,
        token_len if token_len is not None else n_units,
        table if table is not None else hashes,
        (table.shape[0] - 1) if table is not None else 0,
        sg_rows,
        cand_rows,
        hit,
        mask_spans,
        n_sg,
        # Plain ints: a numpy integer passes the checks, and Triton
        # specialises on the argument's Python type.
        int(num_groups),
        int(hash_block_size),
        int(alignment),
        int(partial),
        int(simple_hybrid),
    )
    # In signature order (the direct launch passes them positionally).
    constexprs = {
        "W": hashes.shape[1],
        "HAS_INDEX": table is not None,
        "HAS_TL": lookup or token_len is not None,
        "APPLY_EAGLE": bool(apply_eagle) or lookup,
        "LOOKUP": lookup,
        "BLOCK": block,
        "LEAD": block * LEAD_FACTOR,
        "S_PAD": _pow2(n_sg),
        "SG_W": sg_w,
    }
    # The ints are never specialised (the kernel's do_not_specialize) but
    # their type is: i64 past 2**31.
    key = (tuple(constexprs.values()), tuple(a >= 2**31 for a in args[11:] + args[6:7]))
    # Triton launches on the current device, not the table's (launch.py).
    with device_guard(device):
        SCAN_LAUNCHER.launch(
            _scan_kernel, n_req, key, args, constexprs, _OPTIONS, device
        )
    return hit, mask_spans


class LookupLaunch:
    """:func:`launch_scan` in LOOKUP mode for one plan and hash width, with
    what does not change between calls (the constexprs, the plain ints, the
    variant's key) built once: a scheduler's warm call pays only for its
    output and the launch (issue 31's host path). A trusted caller's, like
    :func:`launch_scan`: nothing is checked.

    Args:
        sg_rows, cand_rows: the plan's rows on the device (int64).
        words: int64 words per hash (``hashes.shape[1]``).
        params: the plan's :class:`~kvhit.kernels.contract.PlanParams` as
            keywords (``hash_block_size``, ``alignment``, ``partial``,
            ``simple_hybrid``, ``num_groups``).
    """

    def __init__(self, sg_rows: torch.Tensor, cand_rows: torch.Tensor,
                 words: int, params: dict) -> None:  # fmt: skip
        self.device = sg_rows.device
        self.rows = (sg_rows, cand_rows)
        n_sg, sg_w = sg_rows.shape
        # launch_scan's plain ints and constexprs, in the same order, so the
        # variant's key is launch_scan's (a warm-up through it is this one's).
        self.ints = (n_sg, int(params["num_groups"]), int(params["hash_block_size"]),
                     int(params["alignment"]), int(params["partial"]),
                     int(params["simple_hybrid"]))  # fmt: skip
        self.constexprs = {
            "W": words, "HAS_INDEX": True, "HAS_TL": True, "APPLY_EAGLE": True,
            "LOOKUP": True, "BLOCK": BLOCK, "LEAD": BLOCK * LEAD_FACTOR,
            "S_PAD": _pow2(n_sg), "SG_W": sg_w,
        }  # fmt: skip
        self._cx = tuple(self.constexprs.values())
        self._int_key = tuple(a >= 2**31 for a in self.ints)
        # The direct path (issue 31's host path): the compiled variant per
        # "table capacity past int32", taken from SCAN_LAUNCHER after the
        # variant's first launch, for calls whose tensors are all 16-byte
        # aligned (the plan rows' alignment is fixed: read once). It skips
        # DirectLauncher.launch's key and per-tensor alignment tuple.
        self._direct: dict[bool, Any] = {}
        self._rows_aligned = not (sg_rows.data_ptr() | cand_rows.data_ptr()) & 15
        # A direct launch's arguments after the per-call ones, in order.
        self._tail = (*self.ints, *self._cx)

    def __call__(self, hashes: torch.Tensor, offsets: torch.Tensor,
                 n_units: torch.Tensor, num_tokens: torch.Tensor,
                 table: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:  # fmt: skip
        """The answers, int64 ``[R]`` (``out`` when given), as
        :func:`launch_scan`'s ``hit`` with ``lookup=True`` (``hashes`` int64
        ``[T, W]``, ``offsets``/``n_units``/``num_tokens`` int64 ``[R]``,
        ``table`` int64 ``[C + 1, W + 1]``, all on the rows' device)."""
        n_req = offsets.shape[0]
        hit = out
        if hit is None:
            hit = torch.empty(n_req, dtype=torch.int64, device=self.device)
        if not n_req:
            return hit
        cap = table.shape[0] - 1
        big = cap >= 2**31
        sg_rows, cand_rows = self.rows
        aligned = self._rows_aligned and not (
            hashes.data_ptr() | offsets.data_ptr() | n_units.data_ptr()
            | num_tokens.data_ptr() | table.data_ptr() | hit.data_ptr()
        ) & 15  # fmt: skip
        launcher = SCAN_LAUNCHER
        compiled = self._direct.get(big) if aligned and launcher.enabled else None
        if compiled is not None:
            every = (hashes, offsets, n_units, num_tokens, n_units, table, cap,
                     sg_rows, cand_rows, hit, hit) + self._tail  # fmt: skip
            with device_guard(self.device):
                if launcher.run(compiled, (n_req,), every, self.device):
                    return hit
        args = (hashes, offsets, n_units, num_tokens, n_units, table, cap,
                sg_rows, cand_rows, hit, hit, *self.ints)  # fmt: skip
        key = (self._cx, (*self._int_key, big))
        with device_guard(self.device):
            launcher.launch(_scan_kernel, n_req, key, args, self.constexprs,
                            _OPTIONS, self.device)  # fmt: skip
        if aligned:
            self._direct[big] = launcher.compiled(self.device, key, args)
        return hit


def _launch(
    tensors: tuple[torch.Tensor | None, ...],
    lengths_name: str,
    params: object,
    apply_eagle: bool,
    lookup: bool,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The public launchers' work: every check (:func:`_validate`, before
    anything is allocated), then :func:`launch_scan`. ``tensors`` are
    :func:`launch_scan`'s eight positional arguments (the lengths, int64
    ``[R]``, fourth, checked under the name ``lengths_name``); ``params``
    (a PlanParams, checked) become its keywords."""
    hashes, offsets, n_units, lengths, token_len, table, sg_rows, cand_rows = tensors
    params = _validate(
        hashes,
        offsets,
        n_units,
        (lengths_name, lengths),
        sg_rows,
        cand_rows,
        table,
        token_len,
        params,
        block,
    )
    return launch_scan(
        *tensors,
        apply_eagle=apply_eagle,
        lookup=lookup,
        block=block,
        **params._asdict(),
    )


def scan_hits(
    hashes: torch.Tensor,
    offsets: torch.Tensor,
    n_units: torch.Tensor,
    max_lengths: torch.Tensor,
    sg_rows: torch.Tensor,
    cand_rows: torch.Tensor,
    *,
    table: torch.Tensor | None,
    token_len: torch.Tensor | None,
    params: kc.PlanParams,
    apply_eagle: bool,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest cache hit and load-mask spans of every request, one launch.

    Args:
        hashes: int64 ``[T, W]``, all requests' hash words.
        offsets: int64 ``[R]``, first row of each request in ``hashes``.
        n_units: int64 ``[R]``, hash units of each request.
        max_lengths: int64 ``[R]``, the most tokens each hit may cover (>= 0).
        sg_rows: int64 ``[S, SG_MEMBERS + M]``, one row per SpecGroup in
            ``ScanPlan.as_rows()`` order (columns ``contract.SG_COLS``, then M
            member group ids padded with -1); full-attention SpecGroups first.
        cand_rows: int64 ``[G, CAND_WIDTH]``, one row per group (columns
            ``contract.CAND_COLS``).
        table: the KeyIndex table, int64 ``[capacity, W + 1]`` (capacity a
            power of two), or None: every key present.
        token_len: int64 ``[R]``, the store worker's lookup length per request
            (restricts presence to the keys it asks about), or None.
        params: the plan's scalar parameters (``ScanPlan.params``):
            ``num_groups`` is G; the sizes are checked, each error naming
            its field (``params.hash_block_size``).
        apply_eagle: apply the EAGLE last-block drop.
        block: positions probed per step (a power of two; results do not
            depend on it).

    Returns:
        ``(hit int64 [R], mask_spans int64 [R, G, 3])``: hits in tokens and each
        group's load-mask span ``(length, lo, hi)`` (zeros for groups outside
        every SpecGroup). Two allocations besides the launch; no host sync.

    Raises:
        TypeError / ValueError: naming the argument that is not an int64,
            contiguous tensor of the right shape on ``hashes``' device.

    Lengths above ``2**30 - 1`` tokens are read as ``2**30 - 1`` (the kernel
    divides positions in 32 bits); a request would need that many tokens of
    hashes for it to matter.
    """
    tensors = (
        hashes,
        offsets,
        n_units,
        max_lengths,
        token_len,
        table,
        sg_rows,
        cand_rows,
    )
    return _launch(tensors, "max_lengths", params, apply_eagle, False, block)


def worker_lookup(
    hashes: torch.Tensor,
    offsets: torch.Tensor,
    n_units: torch.Tensor,
    num_tokens: torch.Tensor,
    sg_rows: torch.Tensor,
    cand_rows: torch.Tensor,
    *,
    table: torch.Tensor,
    params: kc.PlanParams,
    block: int = BLOCK,
) -> torch.Tensor:
    """The store worker's lookup (``ReferenceCoordinator.lookup``) of every
    request, one launch, one allocation, no host sync.

    Args:
        num_tokens: int64 ``[R]``, each prompt's length in tokens (>= 0).
        table: the KeyIndex table, int64 ``[capacity, W + 1]``.
        others: as :func:`scan_hits`.

    Returns:
        int64 ``[R]``: tokens to load per request. Only keys the worker asks
        about at ``num_tokens`` aligned down count as present; a hit covering
        the whole prompt is searched again at ``num_tokens - 1`` aligned down.
    """
    if table is None:
        raise TypeError("table must be a KeyIndex table (a tensor), got None")
    tensors = (hashes, offsets, n_units, num_tokens, None, table, sg_rows, cand_rows)
    hit, _ = _launch(tensors, "num_tokens", params, True, True, block)
    return hit
