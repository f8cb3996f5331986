"""A layout flattened into the numbers the batched backends scan with.

Every batched backend works from a :class:`ScanPlan` (the torch kernels read
it by attribute, the Triton and numba kernels its rows, :func:`plan_tensors`):
small integer tables, one row per SpecGroup and one per KV-cache group, derived
once from a :class:`CacheLayout`. Every rule of the scalar reference that the
backends need is expressed here in closed form (see the per-kind notes below),
so the backends cannot drift apart in how they read the layout. What is
particular to a kind (its code, its own fields) comes from the spec-kind
registry, :mod:`kvhit.coordinator.kinds`; the mask and limit formulas from
:mod:`kvhit.kernels.masks`.

Per-kind scan rules, with ``bs`` the block size, ``A`` the hit alignment and
``period = A / gcd(bs, A)`` (a block count ``L`` is aligned iff
``L % period == 0``):

* full: the leading run of hit blocks, then (fine-grained, ``A < bs``) the
  highest hit hash unit inside the next block; EAGLE drops ``min(A, bs)`` tokens.
* sliding window: the largest block ``j`` below the bound with ``j + 1`` (``j``
  under EAGLE) a multiple of ``period`` and ``need`` hit blocks ending at ``j``
  (``need = masks.sliding_window_need(window, bs, eagle)``, at least 1);
  failing that, the leading run below ``need - 1`` blocks, re-aligned and
  EAGLE-popped.
* mamba: the rightmost hit block ``i`` with ``i + 1`` a multiple of ``period``
  (fine-grained: the rightmost hit hash unit); never an EAGLE margin.
* chunked local: null blocks up to the start of the last attention chunk, then
  the leading run of hit blocks.

A group's load mask is described by its *mask span*, three numbers
``(length, lo, hi)``: the mask has ``length`` entries and ``mask[c]`` is True
iff ``lo <= c < hi``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd

import torch

from kvhit.coordinator.kinds import kind_of
from kvhit.coordinator.specs import CacheLayout, SpecGroup
from kvhit.kernels.contract import CandRow, PlanParams, SpecGroupRow
from kvhit.kernels.masks import IntLike, asked_chunks

__all__ = [
    "CandidatePlan",
    "ScanPlan",
    "SpecGroupPlan",
    "plan_tensors",
]


class SpecGroupPlan(SpecGroupRow):
    """One SpecGroup, as numbers: a :class:`~kvhit.kernels.contract.SpecGroupRow`
    (its fields in row order, :meth:`as_row` the row kernels read).

    ``kind`` is the kind's code (``SpecKind.code``); ``scale`` the hash units
    per block; ``need`` the sliding-window run without EAGLE
    (``masks.sliding_window_need``); ``margin`` the EAGLE proof margin in
    tokens (0 for Mamba or non-EAGLE); ``period`` the hit-alignment period in
    blocks (a block count ``L`` is aligned iff ``L % period == 0``;
    ``contract.SG_PERIOD``); ``fine`` whether
    the scan probes hash units inside a block (full attention and Mamba with
    ``A < bs``); ``chunk`` the chunked-local attention chunk in tokens.
    """

    __slots__ = ()


class CandidatePlan(CandRow):
    """Which chunks of a group the store worker asks about in ``lookup``: a
    :class:`~kvhit.kernels.contract.CandRow` (its fields in row order,
    :meth:`as_row` the row kernels read).

    Without partial hash hits, chunk ``c`` of the group is asked iff
    ``c < masks.asked_chunks(...)`` (:meth:`ScanPlan.asked_chunks`) and, when
    ``sparse``, ``masks.sparse_window_mask(c, per_segment, need, shift)`` (the
    SWA lookup mask). With partial hash hits every hash unit below
    ``token_len // hash_block_size`` is asked for every prefix-cacheable group.
    """

    __slots__ = ()


def _spec_group_plan(layout: CacheLayout, sg: SpecGroup) -> SpecGroupPlan:
    """One SpecGroup flattened: the fields every kind derives alike, then the
    kind's own (``SpecKind.plan_fields``)."""
    kind = kind_of(sg.spec)
    block_size = sg.block_size
    hit_alignment = layout.alignment
    own = {"need": 0, "chunk": 0, **kind.plan_fields(sg.spec)}
    return SpecGroupPlan(
        kind=kind.code,
        block_size=block_size,
        scale=block_size // layout.hash_block_size,
        group_ids=sg.group_ids,
        use_eagle=sg.use_eagle,
        # Only EAGLE SpecGroups of kinds that take a margin have one.
        margin=layout.proof_margins.get(sg.group_ids[0], 0),
        period=hit_alignment // gcd(block_size, hit_alignment),
        fine=kind.fine_grained and hit_alignment < block_size,
        **own,
    )


def _candidate_plan(layout: CacheLayout, group_id: int) -> CandidatePlan:
    """Group ``group_id``'s lookup-candidate rule: dense unless its kind says
    otherwise (``SpecKind.candidate_fields``)."""
    spec = layout.coverage_specs[group_id]
    block_size = spec.block_size
    own = {
        "sparse": False,
        "per_segment": 0,
        "need": 0,
        "shift": 0,
        **kind_of(spec).candidate_fields(
            spec, layout.scheduler_block_size, group_id in layout.eagle_group_ids
        ),
    }
    return CandidatePlan(
        group_id=group_id,
        cacheable=layout.groups[group_id].prefix_cacheable,
        block_size=block_size,
        scale=max(block_size // layout.hash_block_size, 1),
        **own,
    )


@dataclass(frozen=True)
class ScanPlan:
    """A :class:`CacheLayout` flattened for the batched backends."""

    layout: CacheLayout
    spec_groups: tuple[SpecGroupPlan, ...]
    candidates: tuple[CandidatePlan, ...]
    num_groups: int
    hash_block_size: int
    alignment: int
    partial: bool
    simple_hybrid: bool

    @staticmethod
    def from_layout(layout: CacheLayout) -> ScanPlan:
        """Flatten ``layout`` (its SpecGroups, in order, and every group's
        lookup-candidate rule)."""
        return ScanPlan(
            layout=layout,
            spec_groups=tuple(
                _spec_group_plan(layout, sg) for sg in layout.spec_groups
            ),
            candidates=tuple(
                _candidate_plan(layout, gid) for gid in range(layout.num_groups)
            ),
            num_groups=layout.num_groups,
            hash_block_size=layout.hash_block_size,
            alignment=layout.alignment,
            partial=layout.partial_hash_hits,
            simple_hybrid=layout.is_simple_hybrid,
        )

    @property
    def params(self) -> PlanParams:
        """The plan's scalar parameters, as every scan family takes them
        beside the rows (:func:`plan_tensors`)."""
        return PlanParams(
            num_groups=self.num_groups,
            hash_block_size=self.hash_block_size,
            alignment=self.alignment,
            partial=self.partial,
            simple_hybrid=self.simple_hybrid,
        )

    def as_rows(self) -> list[list[int]]:
        """One int row per SpecGroup for kernels: kind, block_size, scale,
        use_eagle, margin, need, period, fine, chunk, n_members, members... (padded
        with -1 to the largest SpecGroup)."""
        width = max(len(sg.group_ids) for sg in self.spec_groups)
        return [sg.as_row(width) for sg in self.spec_groups]

    def candidates_as_rows(self) -> list[list[int]]:
        """One int row per group for kernels (``CandidatePlan.as_row``):
        cacheable, block_size, scale, sparse, per_segment, need, shift,
        group_id."""
        return [cp.as_row() for cp in self.candidates]

    def asked_chunks(
        self, cp: CandidatePlan, num_hashes: IntLike, token_len: IntLike
    ) -> IntLike:
        """How many leading chunks of group ``cp`` (with partial hash hits:
        hash units) the store worker's loop walks for prompts of
        ``num_hashes`` hashes looked up at ``token_len`` tokens (ints, or int64
        tensors of one shape): :func:`kvhit.kernels.masks.asked_chunks`
        with this plan's numbers."""
        if self.partial:
            return asked_chunks(num_hashes, token_len, self.hash_block_size, 1, False)
        return asked_chunks(num_hashes, token_len, cp.block_size, cp.scale, cp.sparse)


@lru_cache(maxsize=64)
def _plan_tensors_cached(
    plan: ScanPlan, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    sg_rows = torch.tensor(plan.as_rows(), dtype=torch.int64, device=device)
    cand_rows = torch.tensor(
        plan.candidates_as_rows(), dtype=torch.int64, device=device
    )
    return sg_rows, cand_rows


def plan_tensors(
    plan: ScanPlan, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan as the Triton and numba kernels read it: ``sg_rows`` int64
    ``[S, SG_MEMBERS + M]`` (``plan.as_rows()``) and ``cand_rows`` int64
    ``[G, CAND_WIDTH]`` (``plan.candidates_as_rows()``: one row per group,
    columns ``kernels/contract.py``'s ``CAND_COLS``). Cached per (plan,
    device), so a steady stream of batches copies nothing to the device but
    the batch itself."""
    return _plan_tensors_cached(plan, torch.device(device))
