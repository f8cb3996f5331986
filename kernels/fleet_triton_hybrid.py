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
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvhit.kernels import scan as scan_rules
from kvhit.kernels.launch import fix_interpreter

__all__ = ["hybrid_kernel"]

# Triton 3.6's interpreter cannot range() over a runtime scalar (launch.py);
# once at import, as kernels/scan.py.
fix_interpreter()

# Longest length the rule distinguishes, in tokens (kernels/scan.py divides
# positions in 32 bits: longer lengths mean the same).
_MAX_LEN: tl.constexpr = tl.constexpr((1 << 30) - 1)


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
    ``ReferenceCoordinator._round``), so its program stops after one load."""
    p = tl.program_id(0).to(tl.int64)
    r = p // n_eng
    e = p % n_eng
    live = (tl.load(live_ptr + e // 64) >> (e % 64)) & 1
    n_units = tl.load(n_units_ptr + r)
    if HAS_RUNS:
        live = tl.where(n_units // first_scale - tl.load(runs_ptr + p) > 0, live, 0)
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
        tl.store(out_ptr + p, hit)
