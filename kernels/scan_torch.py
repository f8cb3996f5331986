"""The torch scan kernels: the reference's hit rules, vectorised over a batch.

The torch member of the scan kernel family, beside the Triton
(:mod:`kvhit.kernels.scan`) and numba (:mod:`kvhit.kernels.scan_numba`) ones;
``coordinator/torch_backend.py`` is its glue. It runs on any device torch runs
on.

No Python loop runs over requests. Each scan works on the set of requests still
undecided and probes only what the scalar rule would need, in rounds whose
windows grow geometrically, so a batch costs a bounded number of tensor ops
(logarithmic in the prompt length) however large it is:

* leading runs (full attention, chunked local, the short-run fallback of a
  sliding window) probe ``[pos, pos + K)`` blocks per round until a miss;
* rightmost searches (sliding-window runs ending on an aligned block, Mamba
  states, the fine-grained tail of full attention) probe the next ``K``
  candidate boundaries below the bound per round, highest first.

A hash that lies past a request's hashes counts as a miss (the reference raises
there, as vLLM would with an ``IndexError``). See :mod:`kvhit.coordinator.plan`
for the closed forms these scans implement.

A plan comes as the numba and Triton kernels take it: its rows
(``ScanPlan.as_rows()`` and ``candidates_as_rows()``, decoded once by
:func:`torch_plan`) and its :class:`~kvhit.kernels.contract.PlanParams`. A
batch is read by its four tensors (``rows`` int64 ``[T, W]``, ``offsets`` and
``lengths`` int64 ``[R]``, ``token_lens`` None or int64 ``[R]``: a
``RaggedView``'s fields, copied into a :class:`Ragged` on entry), and
``probe`` is the key membership test the backend binds to a KeyIndex table.
Nothing here calls back into coordinator/. Imports neither triton nor numba.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kvhit.kernels.candidates_torch import (
    asked,
    candidate_rows,
    candidate_units,
    has_candidates,
    in_lookup_mask,
)
from kvhit.kernels.contract import (
    KIND_FULL,
    KIND_MAMBA,
    KIND_SWA,
    CandRow,
    PlanParams,
    SpecGroupRow,
    cdiv,
)

__all__ = [
    "Prober",
    "Ragged",
    "SpecGroupRow",
    "TorchPlan",
    "TorchScanner",
    "torch_plan",
    "worker_lookup",
]

# probe(group_ids int64 [N], rows int64 [N]) -> bool [N]: is (group, hashes[row])
# in the store?
Prober = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_FIRST_WINDOW = 8
# A bound down to which no scan answer is known to hold.
_NEVER = 1 << 62
_GROWTH = 2
_MAX_WINDOW = 4096


class TorchPlan(NamedTuple):
    """A plan as the torch scan reads it: its rows, decoded once
    (:func:`torch_plan`), and its scalar parameters."""

    spec_groups: tuple[SpecGroupRow, ...]
    candidates: tuple[CandRow, ...]
    params: PlanParams


def torch_plan(sg_rows: Any, cand_rows: Any, params: PlanParams) -> TorchPlan:
    """Decode a plan's rows (int64 ``sg_rows [S, SG_MEMBERS + M]`` and
    ``cand_rows [G, CAND_WIDTH]``, as tensors, numpy arrays or lists: what
    ``coordinator/plan.py`` builds, trusted) for :class:`TorchScanner`."""
    rows = sg_rows.tolist() if hasattr(sg_rows, "tolist") else sg_rows
    sgs = tuple(SpecGroupRow.from_row(r) for r in rows)
    return TorchPlan(sgs, candidate_rows(cand_rows), params)


class Ragged(NamedTuple):
    """A batch's four tensors (a ``RaggedView``'s fields): ``rows`` int64
    ``[T, W]``, ``offsets`` and ``lengths`` int64 ``[R]``, ``token_lens``
    None or int64 ``[R]`` (the store worker's lookup length)."""

    rows: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    token_lens: torch.Tensor | None


def _ragged(view: Any) -> Ragged:
    return Ragged(view.rows, view.offsets, view.lengths, view.token_lens)


def _select(batch: Ragged, req: torch.Tensor) -> Ragged:
    """Requests ``req`` (int64 ``[R']``) of ``batch``."""
    tl = batch.token_lens
    return Ragged(batch.rows, batch.offsets[req], batch.lengths[req],
                  None if tl is None else tl[req])  # fmt: skip


class TorchScanner:
    """Runs a plan (a :class:`TorchPlan`) over a batch with a prober."""

    def __init__(self, plan: TorchPlan, probe: Prober) -> None:
        self.plan = plan
        self.params = plan.params
        self.probe = probe

    # -- probing ----------------------------------------------------------

    def _is_candidate(
        self, batch: Any, gid: int, req: torch.Tensor, unit: torch.Tensor
    ) -> torch.Tensor:
        """Whether the store worker asks about hash unit ``unit`` of request
        ``req`` for group ``gid`` (positions only; see ``_dup_candidate``)."""
        params = self.params
        assert batch.token_lens is not None
        cp = self.plan.candidates[gid]
        limit = asked(cp, params, batch.lengths[req], batch.token_lens[req])
        if params.partial:
            return unit < limit
        scale = cp.scale
        chunk = (unit + 1) // scale - 1
        ok = ((unit + 1) % scale == 0) & (chunk >= 0) & (chunk < limit)
        if cp.sparse:
            ok &= in_lookup_mask(cp, chunk)
        return ok

    def _dup_candidate(
        self, batch: Any, gid: int, req: torch.Tensor, unit: torch.Tensor
    ) -> torch.Tensor:
        """For probes at positions the worker does not ask about: whether the
        same hash value stands at a position it does ask about (the worker's
        exists set holds hash values, not positions). Only duplicated hashes
        inside one request make it True."""
        n = req.numel()
        found = torch.zeros(n, dtype=torch.bool, device=req.device)
        if n == 0:
            return found
        assert batch.token_lens is not None
        owner, v = candidate_units(
            self.plan.candidates, self.params, batch.lengths[req],
            batch.token_lens[req], gid,
        )  # fmt: skip
        base = batch.offsets[req]
        probe_rows = base + unit
        same = (batch.rows[base[owner] + v] == batch.rows[probe_rows[owner]]).all(dim=1)
        found[owner[same]] = True
        return found

    def _probe_units(
        self, batch: Any, sg: Any, req: torch.Tensor, unit: torch.Tensor
    ) -> torch.Tensor:
        """bool [N]: is hash unit ``unit`` of request ``req`` present for every
        member group of ``sg``?"""
        n = req.numel()
        dev = req.device
        if n == 0:
            return torch.zeros(0, dtype=torch.bool, device=dev)
        live = ((unit >= 0) & (unit < batch.lengths[req])).nonzero().squeeze(1)
        r, u = req.index_select(0, live), unit.index_select(0, live)
        rows = batch.offsets.index_select(0, r) + u
        m, k = len(sg.group_ids), live.numel()
        # Every member group in one probe call: calls, not keys, dominate.
        gids = torch.tensor(sg.group_ids, dtype=torch.int64, device=dev)
        present = self.probe(gids.repeat_interleave(k), rows.repeat(m)).view(m, k)
        if batch.token_lens is not None and k:
            for i, g in enumerate(sg.group_ids):
                at = present[i].nonzero().squeeze(1)
                if at.numel() == 0:
                    continue
                cand = self._is_candidate(batch, g, r[at], u[at])
                if not bool(cand.all()):
                    odd = at[~cand]
                    cand[~cand] = self._dup_candidate(batch, g, r[odd], u[odd])
                    present[i, at] = cand
        out = torch.zeros(n, dtype=torch.bool, device=dev)
        out[live] = present.all(dim=0)
        return out

    def _probe_blocks(
        self,
        batch: Any,
        sg: Any,
        req: torch.Tensor,
        blk: torch.Tensor,
        scale: int,
    ) -> torch.Tensor:
        """bool [N]: block ``blk`` (``scale`` hash units each) of ``req`` hits."""
        return self._probe_units(batch, sg, req, (blk + 1) * scale - 1)

    # -- scan primitives ----------------------------------------------------

    def _leading_run(
        self,
        batch: Any,
        sg: Any,
        req: torch.Tensor,
        start: torch.Tensor,
        end: torch.Tensor,
        scale: int,
    ) -> torch.Tensor:
        """int64 [R]: how many consecutive blocks from ``start`` (below ``end``)
        hit."""
        count = torch.zeros_like(start)
        pending = (end > start).nonzero().squeeze(1)
        window = _FIRST_WINDOW
        while pending.numel():
            r = req[pending]
            pos = start[pending] + count[pending]
            offs = torch.arange(window, device=req.device)
            blk = pos[:, None] + offs[None, :]
            inside = blk < end[pending][:, None]
            flat = inside.view(-1).nonzero().squeeze(1)
            hit = torch.zeros(inside.numel(), dtype=torch.bool, device=req.device)
            hit[flat] = self._probe_blocks(
                batch, sg, r[flat // window], blk.view(-1)[flat], scale
            )
            hit = hit.view_as(inside)
            stop = ~hit
            any_stop = stop.any(dim=1)
            lead = torch.where(
                any_stop,
                stop.to(torch.int8).argmax(dim=1),
                torch.full_like(pos, window),
            )
            count[pending] += lead
            # A window with no miss and no end inside it goes on.
            pending = pending[~any_stop]
            window = min(window * _GROWTH, _MAX_WINDOW)
        return count

    def _rightmost(
        self,
        batch: Any,
        sg: Any,
        req: torch.Tensor,
        top: torch.Tensor,
        low: torch.Tensor,
        period: int,
        resid: torch.Tensor,
        need: torch.Tensor,
        scale: int,
    ) -> torch.Tensor:
        """int64 [R]: the largest block ``j <= top`` with ``j >= low``,
        ``j % period == resid`` and ``need`` hit blocks ending at ``j`` (-1:
        none)."""
        found = torch.full_like(top, -1)
        # The highest candidate at or below top.
        first = top - torch.remainder(top - resid, period)
        low = torch.maximum(low, need - 1)
        k0 = torch.zeros_like(top)
        pending = (first >= low).nonzero().squeeze(1)
        n_cand = _FIRST_WINDOW // 8 or 1
        max_need = int(need.max().item()) if need.numel() else 1
        while pending.numel():
            r = req[pending]
            # This round's candidate end blocks, highest first.
            ends = (
                first[pending][:, None]
                - (
                    k0[pending][:, None]
                    + torch.arange(n_cand, device=req.device)[None, :]
                )
                * period
            )
            live = ends >= low[pending][:, None]
            d = torch.arange(max_need, device=req.device)
            blk = ends[:, :, None] - d[None, None, :]
            use = live[:, :, None] & (d[None, None, :] < need[pending][:, None, None])
            flat = use.view(-1).nonzero().squeeze(1)
            hit = torch.zeros(use.numel(), dtype=torch.bool, device=req.device)
            if flat.numel():
                hit[flat] = self._probe_blocks(
                    batch,
                    sg,
                    r[flat // (n_cand * max_need)],
                    blk.reshape(-1)[flat],
                    scale,
                )
            hit = hit.view_as(use)
            ok = (hit | ~use).all(dim=2) & live
            any_ok = ok.any(dim=1)
            first_ok = ok.to(torch.int8).argmax(dim=1)
            sel = any_ok.nonzero().squeeze(1)
            found[pending[sel]] = ends[sel, first_ok[sel]]
            exhausted = ~live[:, -1]
            k0[pending] += n_cand
            pending = pending[~any_ok & ~exhausted]
            n_cand = min(n_cand * _GROWTH, _MAX_WINDOW)
        return found

    # -- per-kind scans -----------------------------------------------------

    def scan(
        self,
        batch: Any,
        sg: Any,
        req: torch.Tensor,
        bound: torch.Tensor,
        drop: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Scan SpecGroup ``sg`` for requests ``req`` up to ``bound`` tokens.

        Returns ``(hit, length, lo, hi, keep)``, each int64 [R]: the hit length
        in tokens, the load-mask span of every member group, and the least
        bound under which a scan with the same EAGLE drop is known to give the
        same answer (any bound in ``[keep, bound]``; ``_NEVER`` when unknown).
        """
        if sg.kind == KIND_FULL:
            return self._scan_full(batch, sg, req, bound, drop)
        if sg.kind == KIND_SWA:
            return self._scan_swa(batch, sg, req, bound, drop)
        if sg.kind == KIND_MAMBA:
            return self._scan_mamba(batch, sg, req, bound)
        return self._scan_chunked(batch, sg, req, bound)

    def _scan_full(self, batch, sg, req, bound, drop):
        bs, align = sg.block_size, self.params.alignment
        lengths = batch.lengths[req]
        # Fine-grained scans run with the hash unit as alignment, so a block
        # is `scale` alignment units either way.
        scale = sg.scale
        end = torch.minimum(bound // bs, lengths // scale)
        n = self._leading_run(batch, sg, req, torch.zeros_like(end), end, scale)
        blocks = n.clone()
        hit = n * bs
        if sg.fine:
            first = n * scale
            max_partial = torch.minimum(
                torch.minimum(first + scale - 1, bound // align), lengths
            )
            top = max_partial - 1
            ones = torch.ones_like(top)
            u = self._rightmost(
                batch, sg, req, top, first, 1, torch.zeros_like(top), ones, 1
            )
            got = u >= 0
            blocks = blocks + got.to(blocks.dtype)
            hit = torch.where(got, (u + 1) * align, hit)
        hit = torch.where(drop & (hit > 0), hit - min(align, bs), hit)
        hit = hit - torch.remainder(hit, align)
        blocks = torch.minimum(blocks, cdiv(hit, bs))
        never = torch.full_like(hit, _NEVER)
        return hit, blocks, torch.zeros_like(blocks), blocks, never

    def _scan_swa(self, batch, sg, req, bound, drop):
        bs, period = sg.block_size, sg.period
        m = bound // bs
        need = sg.need + drop.to(torch.int64)
        need_eff = torch.clamp(need, min=1)
        resid = torch.where(drop, torch.zeros_like(m), torch.full_like(m, period - 1))
        j = self._rightmost(
            batch, sg, req, m - 1, torch.zeros_like(m), period, resid, need_eff,
            sg.scale,
        )  # fmt: skip
        matched = j >= 0
        length = torch.where(drop, j, j + 1)
        lo = j - need_eff + 1
        hi = length.clone()
        # A matched run ending at block j stays the best under any bound that
        # keeps j below it; so does a short run from token 0 without the drop.
        keep = (j + 1) * bs
        # No run of `need` blocks: the leading run (shorter than need - 1
        # blocks) still hits, re-aligned, then EAGLE-popped.
        miss = (~matched).nonzero().squeeze(1)
        if miss.numel():
            cap = torch.minimum(m[miss], need_eff[miss] - 1)
            p = self._leading_run(
                batch, sg, req[miss], torch.zeros_like(cap), cap, sg.scale
            )
            r = resid[miss]
            j0 = (p - 1) - torch.remainder(p - 1 - r, period)
            run = torch.where(j0 >= 0, j0 + 1, torch.zeros_like(j0))
            run = run - torch.remainder(run, period)
            d = drop[miss] & (run > 0)
            run = torch.where(d, run - 1, run)
            run = run - torch.remainder(run, period)
            length[miss] = run
            lo[miss] = 0
            hi[miss] = run
            keep[miss] = torch.where(drop[miss], _NEVER, run * bs)
        return length * bs, length, lo, hi, keep

    def _scan_mamba(self, batch, sg, req, bound):
        bs = sg.block_size
        if sg.fine:
            align = self.params.alignment
            scale = bs // align
            top = torch.minimum(bound // align, batch.lengths[req]) - 1
            ones = torch.ones_like(top)
            u = self._rightmost(
                batch, sg, req, top, torch.zeros_like(top), 1,
                torch.zeros_like(top), ones, 1,
            )  # fmt: skip
            got = u >= 0
            length = torch.where(got, u // scale + 1, torch.zeros_like(u))
            hit = torch.where(got, (u + 1) * align, torch.zeros_like(u))
            # The rightmost stored state below the bound stays the rightmost.
            return hit, length, length - got.to(length.dtype), length, hit
        period = sg.period
        top = bound // bs - 1
        ones = torch.ones_like(top)
        i = self._rightmost(
            batch, sg, req, top, torch.zeros_like(top), period,
            torch.full_like(top, period - 1), ones, sg.scale,
        )  # fmt: skip
        got = i >= 0
        length = torch.where(got, i + 1, torch.zeros_like(i))
        hit = length * bs
        return hit, length, length - got.to(length.dtype), length, hit

    def _scan_chunked(self, batch, sg, req, bound):
        bs, chunk = sg.block_size, sg.chunk
        start_tok = torch.where(
            bound > 0, bound // chunk * chunk, torch.zeros_like(bound)
        )
        start_block = start_tok // bs
        m = bound // bs
        run = self._leading_run(
            batch, sg, req, start_block, torch.maximum(m, start_block), sg.scale
        )
        length = start_block + run
        hit = length * bs
        return hit, length, start_block, length, torch.full_like(hit, _NEVER)

    # -- the coordinator ------------------------------------------------------

    def find(
        self,
        batch: Any,
        max_lengths: torch.Tensor,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(hit int64 [B], mask_spans int64 [B, G, 3])``: the hit
        lengths and each group's load-mask span ``(length, lo, hi)`` (zeros
        for groups outside every SpecGroup)."""
        params = self.params
        batch = _ragged(batch)
        dev = max_lengths.device
        n_req = max_lengths.numel()
        sgs = self.plan.spec_groups
        mask_spans = torch.zeros(
            n_req, params.num_groups, 3, dtype=torch.int64, device=dev
        )
        all_req = torch.arange(n_req, device=dev)
        hbs = params.hash_block_size

        def record(sg, req, length, lo, hi):
            gids = torch.tensor(sg.group_ids, dtype=torch.int64, device=dev)
            vals = torch.stack([length, lo, hi], dim=1)[:, None, :]
            mask_spans[req[:, None], gids[None, :]] = vals.expand(-1, gids.numel(), -1)

        if len(sgs) == 1:
            sg = sgs[0]
            drop = torch.full((n_req,), apply_eagle and sg.use_eagle, device=dev)
            hit, length, lo, hi, _ = self.scan(batch, sg, all_req, max_lengths, drop)
            record(sg, all_req, length, lo, hi)
            return hit, mask_spans

        n_sg = len(sgs)
        hit_length = max_lengths.clone()
        len_by_sg = torch.zeros(n_req, n_sg, dtype=torch.int64, device=dev)
        verified = torch.zeros(n_req, n_sg, dtype=torch.bool, device=dev)
        # A SpecGroup's last scan of each request: with which EAGLE drop, and
        # down to which bound its answer holds. Bounds only shrink as the loop
        # goes on, so the confirming rounds rescan only what can change.
        last_drop = torch.zeros(n_req, n_sg, dtype=torch.bool, device=dev)
        keep_above = torch.full((n_req, n_sg), _NEVER, dtype=torch.int64, device=dev)
        full_done = False
        active = all_req
        while active.numel():
            curr = hit_length[active]
            for idx, sg in enumerate(sgs):
                if sg.kind == KIND_FULL and full_done:
                    curr = torch.minimum(curr, len_by_sg[active, idx])
                    continue
                if apply_eagle and sg.use_eagle:
                    drop = ~verified[active, idx]
                else:
                    drop = torch.zeros_like(active, dtype=torch.bool)
                bound = curr
                if sg.margin:
                    # EAGLE peeks one proof margin past the hit, then drops it.
                    peek = torch.minimum(curr + sg.margin, batch.lengths[active] * hbs)
                    bound = torch.where(drop, peek, curr)
                new_len = len_by_sg[active, idx]
                if full_done and sg.kind in (KIND_SWA, KIND_MAMBA):
                    was_drop, keep = last_drop[active, idx], keep_above[active, idx]
                    same = (drop == was_drop) & (bound >= keep)
                    # An EAGLE run ending at j (hit j*bs) once verified: the
                    # plain scan under a bound in [j*bs, (j+1)*bs) finds the run
                    # ending at j - 1, inside it: the same hit and, when the
                    # plain run is not empty (need >= 1), the same mask.
                    verified_run = (
                        torch.full_like(drop, sg.kind == KIND_SWA and sg.need >= 1)
                        & ~drop
                        & was_drop
                        & (keep != _NEVER)
                        & (bound >= keep - sg.block_size)
                        & (bound < keep)
                    )
                    redo = ~(same | verified_run)
                else:
                    redo = torch.ones_like(drop)
                sel = redo.nonzero().squeeze(1)
                if sel.numel():
                    req = active[sel]
                    got, length, lo, hi, keep = self.scan(
                        batch, sg, req, bound[sel], drop[sel]
                    )
                    new_len = new_len.clone()
                    new_len[sel] = got
                    len_by_sg[req, idx] = got
                    last_drop[req, idx] = drop[sel]
                    keep_above[req, idx] = keep
                    record(sg, req, length, lo, hi)
                shrunk = ~drop & (new_len < curr)
                v = verified[active]
                v[:, idx] |= drop
                v[shrunk] = False
                verified[active] = v
                curr = new_len
            full_done = True
            going = curr < hit_length[active]
            hit_length[active[going]] = curr[going]
            if params.simple_hybrid:
                break
            active = active[going]

        for sg in sgs:
            if sg.kind != KIND_FULL:
                continue
            cap = cdiv(hit_length, sg.block_size)
            for gid in sg.group_ids:
                n = torch.minimum(mask_spans[:, gid, 0], cap)
                mask_spans[:, gid, 0] = n
                mask_spans[:, gid, 2] = n
        return hit_length, mask_spans


def worker_lookup(
    plan: TorchPlan, view: Any, num_tokens: torch.Tensor, probe: Prober
) -> torch.Tensor:
    """The store worker's rule (``MooncakeStoreWorker.lookup``, as
    ``ReferenceCoordinator.lookup``) for a batch: int64 ``[R]`` tokens to load
    for prompts of ``num_tokens`` (int64 ``[R]``) tokens.

    ``plan`` from :func:`torch_plan`; ``view`` a batch's four tensors (a
    ``RaggedView``'s fields, ``token_lens`` None); ``probe`` answers for keys
    of ``view.rows``.
    """
    out = torch.zeros_like(num_tokens)
    batch = _ragged(view)
    if batch.offsets.shape[0] == 0:
        return out
    a = plan.params.alignment
    token_lens = torch.div(num_tokens, a, rounding_mode="floor") * a
    ok = (
        (batch.lengths > 0)
        & (token_lens > 0)
        & has_candidates(plan.candidates, plan.params, batch.lengths, token_lens)
    )
    first = ok.nonzero().squeeze(1)
    if first.numel() == 0:
        return out
    restricted = batch._replace(token_lens=token_lens)
    scanner = TorchScanner(plan, probe)

    def sub_find(req: torch.Tensor, max_lengths: torch.Tensor) -> torch.Tensor:
        hit, _ = scanner.find(_select(restricted, req), max_lengths, True)
        return hit

    hit = sub_find(first, token_lens[first])
    out[first] = hit
    # A hit covering the whole prompt is re-derived at num_tokens - 1 with
    # the candidate restriction still at the original token_lens.
    redo = first[hit >= num_tokens[first]]
    if redo.numel():
        usable = torch.div(num_tokens[redo] - 1, a, rounding_mode="floor") * a
        out[redo] = 0
        pos = usable > 0
        again = redo[pos]
        if again.numel():
            out[again] = sub_find(again, usable[pos])
    return out
