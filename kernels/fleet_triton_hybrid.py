"""The hybrid-layout kernel of :mod:`kvhit.kernels.fleet_triton`: vLLM's whole
rule (sliding window, Mamba, chunked local, several SpecGroups, EAGLE,
fine-grained hits) for every (request, engine) pair, one launch. Its launcher
is :func:`kvhit.kernels.fleet_triton.hybrid_hits` (the FleetIndex's
``FleetOps.hybrid_hits``), which checks the arguments; this module holds the
device code only.

* **One program per (request, engine), the engine's own rule.** The program
  runs :mod:`kvhit.kernels.scan`'s jitted rule (``converge``, the
  convergence loop of ``ReferenceCoordinator._find`` / ``_round`` with every
  kind's scan; in LOOKUP mode ``ReferenceCoordinator.lookup`` around it)
  over the FleetIndex's entry index, a KeyIndex of ``(g * E + e, hash)``,
  with plan rows whose member groups are renamed ``g * E + e`` (engine
  ``e``'s SpecGroup rows start at row ``e * S``). The rule is spelled once,
  in scan.py; this module only gives it a per-engine context.
* **The joint scan first.** When the first SpecGroup is full attention and
  not fine-grained, ``fleet_triton``'s joint scan (engines across lanes)
  leaves each pair's leading run, and a program whose engine lacks the
  request's first block stops after two loads (its output stays 0): on a
  router's traffic most engines hold none of a request, so most programs
  stop there. Two launches, no host sync, whatever E.
* **Engine classes, engines across lanes (issue 32).** From
  ``CLASS_MIN_ENGINES`` engines on (``fleet_triton``), a third launch between
  the two, :func:`class_kernel`, splits each request's engines into classes
  that must answer alike (``kernels/fleet_numba.engine_classes``' rule: the
  same window of keys the rule may read, the same of those keys held), one
  probe per key for all engines (its engine-set word, 64 engines across
  lanes). Only the lowest engine of a class runs the rule; it writes the
  answer of its whole class, and the others stop after their class test.
  On a router's traffic (one engine holding a request's long prefix, the
  others a shared system prompt) a request's E programs become two.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvhit.kernels import scan as scan_rules
from kvhit.kernels.contract import (
    SG_FINE,
    SG_MARGIN,
    SG_MEMBERS,
    SG_N_MEMBERS,
    SG_SCALE,
)
from kvhit.kernels.fleet_probe import bit_and, bit_or, probe_slots
from kvhit.kernels.launch import fix_interpreter

__all__ = ["class_kernel", "hybrid_kernel"]

# Triton 3.6's interpreter cannot range() over a runtime scalar (launch.py);
# once at import, as kernels/scan.py.
fix_interpreter()

# Longest length the rule distinguishes, in tokens (kernels/scan.py divides
# positions in 32 bits: longer lengths mean the same).
_MAX_LEN: tl.constexpr = tl.constexpr((1 << 30) - 1)
_SG_FINE: tl.constexpr = tl.constexpr(SG_FINE)
_SG_MARGIN: tl.constexpr = tl.constexpr(SG_MARGIN)
_SG_MEMBERS: tl.constexpr = tl.constexpr(SG_MEMBERS)
_SG_N_MEMBERS: tl.constexpr = tl.constexpr(SG_N_MEMBERS)
_SG_SCALE: tl.constexpr = tl.constexpr(SG_SCALE)
# Slots a class probe's later steps visit at once (fleet_triton.SPAN).
_SPAN: tl.constexpr = tl.constexpr(2)


@triton.jit
def _reach(sg_ptr, n_sg, hbs, SG_W: tl.constexpr):
    """How many hash units past the first SpecGroup's run a later SpecGroup's
    scan may read: the largest EAGLE proof margin, in hash units
    (``fleet_scoring._class_groups``' ``reach``; the first SpecGroup is not
    fine-grained here). ``sg_ptr``: any engine's ``n_sg`` plan rows."""
    reach = tl.zeros([], tl.int64)
    for k in range(n_sg):
        margin = tl.load(sg_ptr + k * SG_W + _SG_MARGIN)
        reach = tl.maximum(reach, (margin + hbs - 1) // hbs)
    return reach


@triton.jit
def _windows(runs_ptr, live_ptr, r, t, half, n_eng, n_units, first_scale, reach,
             LANES: tl.constexpr):  # fmt: skip
    """Engines ``t * 64 + half + [0, LANES)`` of request ``r``: ``(e, may,
    win)``, whether each may hit (live, a leading run of at least one
    block: ``runs_ptr`` holds the joint scan's rows, ``end - first miss``)
    and the hash units below which the rule reads keys
    (``fleet_numba.engine_classes``' ``W``)."""
    lane = tl.arange(0, LANES)
    e = t * 64 + half + lane
    em = e < n_eng
    end = n_units // first_scale
    run = end - tl.load(runs_ptr + r * n_eng + e, mask=em, other=end)
    live = (tl.load(live_ptr + t) >> (half + lane)) & 1
    may = em & (live == 1) & (run > 0)
    win = tl.maximum((run + 1) * first_scale, run * first_scale + reach)
    return e, may, tl.minimum(win, n_units)


@triton.jit
def _class_of(cls_ptr, runs_ptr, live_ptr, sg_ptr, r, e, n_eng, n_sg, n_units,
              first_scale, hbs, SG_W: tl.constexpr):  # fmt: skip
    """Engine ``e``'s class for request ``r`` within its 64-engine word, as
    a bit set (int64; bit ``i``: engine ``e // 64 * 64 + i``): the engines
    that may hit with ``e``'s window and hold the same of its keys
    (``class_kernel``'s rows, final after its launch). Empty when ``e``
    may not hit."""
    t = e // 64
    reach = _reach(sg_ptr, n_sg, hbs, SG_W)
    lane = tl.arange(0, 64)
    _e, may, win = _windows(runs_ptr, live_ptr, r, t, 0, n_eng, n_units,
                            first_scale, reach, 64)  # fmt: skip
    me = lane == e % 64
    my_win = tl.sum(tl.where(me, win, 0), axis=0)
    my_may = tl.max(tl.where(me, may, 0).to(tl.int32), axis=0)
    same = tl.reduce(tl.where(may & (win == my_win), tl.full([64], 1, tl.int64) << lane, 0),
                     0, bit_or)  # fmt: skip
    return tl.where(my_may == 1, same & tl.load(cls_ptr + r * n_eng + e), 0)


@triton.jit(do_not_specialize=["split"])
def class_kernel(
    keys_ptr,
    cap_mask,
    bits_ptr,
    rows_ptr,
    off_ptr,
    len_ptr,
    runs_ptr,
    live_ptr,
    sg_ptr,
    cls_ptr,
    n_eng,
    nw,
    n_sg,
    first_scale,
    hbs,
    split,
    W: tl.constexpr,
    SG_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, s): the keys of request ``r`` the rule may read, in tiles
    ``s, s + split, ...`` of ``BLOCK`` keys a group. For every engine ``e``
    its row ``cls[r, e]`` (int64, a set of the engines of its word, all
    ones before the launch) is ANDed down to the engines of its word that hold
    exactly the keys ``e`` holds among those below ``e``'s window (an atomic
    AND: the programs of a request run in any order). Engines with the same
    window and row answer alike (``fleet_numba.engine_classes``): a scan of
    ``(r, e)`` reads keys ``(g, row)`` only below the window, and only
    whether the engine holds them matters.

    The keys: every member group ``g`` of every SpecGroup (engine 0's plan
    rows, members ``g * E``) at every ``step``-th hash unit (its blocks'
    last units: the SpecGroup's scale, 1 when fine-grained), below the
    request's largest window. One exact probe a key (``probe_slots`` without its cut), its
    engine set shared by every engine: E adds words, not probes."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    off = tl.load(off_ptr + r)
    n_units = tl.load(len_ptr + r)
    reach = _reach(sg_ptr, n_sg, hbs, SG_W)
    lane64 = tl.arange(0, 64)
    i = tl.arange(0, BLOCK).to(tl.int64)
    # The request's largest window: no key at or past it is read.
    top = n_units * 0
    for t in range(nw):
        for hq in tl.static_range(2):
            _e, may, win = _windows(runs_ptr, live_ptr, r, t, hq * 32, n_eng, n_units,
                                    first_scale, reach, 32)  # fmt: skip
            top = tl.maximum(top, tl.max(tl.where(may, win, 0), axis=0))
    for k in range(n_sg):
        row = sg_ptr + k * SG_W
        fine = tl.load(row + _SG_FINE) != 0
        step = tl.where(fine, 1, tl.load(row + _SG_SCALE))
        for m in range(tl.load(row + _SG_N_MEMBERS)):
            gid = tl.load(row + _SG_MEMBERS + m) // n_eng
            gids = tl.zeros([BLOCK], tl.int64) + gid
            i0 = s * BLOCK
            while (i0 + 1) * step - 1 < top:
                unit = (i0 + i + 1) * step - 1
                probe = unit < top
                slots = probe_slots(keys_ptr, cap_mask, gids, rows_ptr, off + unit,
                                    probe, i, W, _SPAN, BLOCK, False)  # fmt: skip
                for t in range(nw):
                    w = tl.load(bits_ptr + tl.where(slots >= 0, slots, 0) * nw + t,
                                mask=slots >= 0, other=0)  # fmt: skip
                    e, may, win = _windows(runs_ptr, live_ptr, r, t, 0, n_eng, n_units,
                                           first_scale, reach, 64)  # fmt: skip
                    # One engine of the word at a time (a [BLOCK, 64] matrix
                    # spills): its row, ANDed over the tile's keys below its
                    # window, where it holds a key the engines holding it,
                    # where it lacks one those lacking it.
                    acc = tl.full([64], -1, tl.int64)
                    for j in range(64):
                        held = ((w >> j) & 1) != 0
                        my_win = tl.sum(tl.where(lane64 == j, win, 0), axis=0)
                        agree = tl.where(held, w, ~w)
                        agree = tl.where(probe & (unit < my_win), agree, -1)
                        acc = tl.where(lane64 == j, tl.reduce(agree, 0, bit_and), acc)
                    tl.atomic_and(cls_ptr + r * n_eng + e, acc, mask=may & (acc != -1),
                                  sem="relaxed")  # fmt: skip
                i0 += split * BLOCK


@triton.jit
def hybrid_kernel(
    hashes_ptr,
    offsets_ptr,
    n_units_ptr,
    len_ptr,
    tok_len_ptr,
    table_ptr,
    cap_mask,
    sg_ptr,
    cand_ptr,
    plan_cand_ptr,
    live_ptr,
    runs_ptr,
    cls_ptr,
    first_scale,
    out_ptr,
    n_eng,
    n_sg,
    n_groups,
    hbs,
    align,
    partial,
    simple_hybrid,
    W: tl.constexpr,
    HAS_RUNS: tl.constexpr,
    HAS_CLASS: tl.constexpr,
    HAS_TL: tl.constexpr,
    APPLY_EAGLE: tl.constexpr,
    LOOKUP: tl.constexpr,
    BLOCK: tl.constexpr,
    LEAD: tl.constexpr,
    S_PAD: tl.constexpr,
    SG_W: tl.constexpr,
):
    """Program ``p``: request ``p // E`` against engine ``p % E`` (a live
    one; dead engines keep the zeroed output), ``out[r, e]``. The engine's
    keys are the entry index's ``(g * E + e, hash)``: the program runs the
    LookupEngine's own rule (:mod:`kvhit.kernels.scan`'s convergence loop,
    ``ReferenceCoordinator._find``, and, ``LOOKUP``, the store worker's
    ``ReferenceCoordinator.lookup``) over plan rows whose member groups are
    renamed ``g * E + e`` (``sg_ptr``: engine ``e``'s ``n_sg`` rows at row
    ``e * n_sg``; ``cand_ptr``: one candidate row per renamed group,
    ``plan_cand_ptr`` the plan's own ``n_groups`` rows).

    ``HAS_RUNS``: the first SpecGroup is full attention, not fine-grained,
    and ``runs_ptr`` holds ``_fleet_kernel``'s rows for it (``end - first
    miss``, ``end = n_units // first_scale``): a pair whose engine lacks the
    request's first block hits 0 (its leading run is 0, and the convergence
    loop never raises a hit above the full-attention run:
    ``ReferenceCoordinator._round``), so its program stops after one load.

    ``HAS_CLASS`` (with ``HAS_RUNS``): ``cls_ptr`` holds
    :func:`class_kernel`'s rows. Only the lowest engine of each class runs
    the rule, and stores its hit for its whole class (a 64-lane store); the
    others store nothing."""
    p = tl.program_id(0).to(tl.int64)
    r = p // n_eng
    e = p % n_eng
    live = (tl.load(live_ptr + e // 64) >> (e % 64)) & 1
    n_units = tl.load(n_units_ptr + r)
    if HAS_RUNS:
        live = tl.where(n_units // first_scale - tl.load(runs_ptr + p) > 0, live, 0)
    if HAS_CLASS:
        # The rule runs for the lowest engine of the class only (its own
        # bit is the lowest set: engines below it hold other keys). A pair
        # already out (dead, or a run of 0) reads no class row.
        if live == 1:
            mine = _class_of(cls_ptr, runs_ptr, live_ptr, sg_ptr, r, e, n_eng, n_sg,
                             n_units, first_scale, hbs, SG_W)  # fmt: skip
            below = mine & ((tl.full([], 1, tl.int64) << (e % 64)) - 1)
            live = tl.where(below == 0, live, 0)
    if live == 1:
        length = tl.minimum(tl.load(len_ptr + r), _MAX_LEN)
        zero = n_units * 0
        if LOOKUP:
            token_len = length // align * align
        elif HAS_TL:
            token_len = tl.load(tok_len_ptr + r)
        else:
            token_len = zero
        # Engine e's SpecGroup rows; the worker's test below reads the
        # plan's own candidate rows (plain), the rule engine e's (ctx).
        offset = tl.load(offsets_ptr + r)
        rows = sg_ptr + e * n_sg * SG_W
        ctx = scan_rules.request_ctx(offset, n_units, token_len, hashes_ptr,
                                     table_ptr, cap_mask, cand_ptr, partial, hbs,
                                     align, rows, n_sg, simple_hybrid)  # fmt: skip
        if LOOKUP:
            # ReferenceCoordinator.lookup, as scan._worker_lookup: whether the
            # worker asks any key depends on the plan only (its own candidate
            # rows, not the E-fold renamed ones), then the search at the
            # aligned length and, when it covers the whole prompt, again at
            # align(num_tokens - 1) (bounded below num_tokens: two at most).
            plain = scan_rules.request_ctx(offset, n_units, token_len, hashes_ptr,
                                           table_ptr, cap_mask, plan_cand_ptr,
                                           partial, hbs, align, rows, n_sg,
                                           simple_hybrid)  # fmt: skip
            asks = scan_rules.asks_any(plain, n_groups)
            ok = (n_units > 0) & (token_len > 0) & asks
            usable = tl.maximum(length - 1, 0) // align * align
            bound = tl.where(ok, token_len, zero - 1)
            hit = zero
            searching = ok
            while searching:
                got, _l, _lo, _hi = scan_rules.converge(
                    ctx, bound, W, True, True, True, BLOCK, LEAD, S_PAD, SG_W, False
                )
                whole = got >= length
                hit = tl.where(whole, zero, got)
                bound = usable
                searching = whole & (usable > 0)
        else:
            hit, _l, _lo, _hi = scan_rules.converge(
                ctx,
                length,
                W,
                True,
                HAS_TL,
                APPLY_EAGLE,
                BLOCK,
                LEAD,
                S_PAD,
                SG_W,
                False,
            )
        if HAS_CLASS:
            # The class again (its rows reloaded: cheaper than holding them
            # through the rule, whose registers are at the ceiling).
            mine = _class_of(cls_ptr, runs_ptr, live_ptr, sg_ptr, r, e, n_eng,
                             n_sg, n_units, first_scale, hbs, SG_W)  # fmt: skip
            lane = tl.arange(0, 64)
            base = r * n_eng + e // 64 * 64
            tl.store(out_ptr + base + lane, tl.zeros([64], tl.int64) + hit,
                     mask=((mine >> lane) & 1) == 1)  # fmt: skip
        else:
            tl.store(out_ptr + p, hit)
