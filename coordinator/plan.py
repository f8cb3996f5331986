"""A layout flattened into the numbers the batched backends scan with.

The torch backend and the Triton kernels both work from a :class:`ScanPlan`:
small integer tables, one row per SpecGroup and one per KV-cache group, derived
once from a :class:`CacheLayout`. Every rule of the scalar reference that the
backends need is expressed here in closed form (see the per-kind notes below),
so the two backends cannot drift apart in how they read the layout.

Per-kind scan rules, with ``bs`` the block size, ``A`` the hit alignment and
``q = A / gcd(bs, A)`` (a block count ``L`` is aligned iff ``L % q == 0``):

* full: the leading run of hit blocks, then (fine-grained, ``A < bs``) the
  highest hit hash unit inside the next block; EAGLE drops ``min(A, bs)`` tokens.
* sliding window: the largest block ``j`` below the bound with ``j + 1`` (``j``
  under EAGLE) a multiple of ``q`` and ``need`` hit blocks ending at ``j``
  (``need = cdiv(window - 1, bs)``, +1 under EAGLE, at least 1); failing that,
  the leading run below ``need - 1`` blocks, re-aligned and EAGLE-popped.
* mamba: the rightmost hit block ``i`` with ``i + 1`` a multiple of ``q``
  (fine-grained: the rightmost hit hash unit); never an EAGLE margin.
* chunked local: null blocks up to the start of the last attention chunk, then
  the leading run of hit blocks.

A group's load mask is described by three numbers ``(length, lo, hi)``: the
mask has ``length`` entries and ``mask[c]`` is True iff ``lo <= c < hi``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvhit.coordinator.specs import CacheLayout, ChunkedLocal, SlidingWindow

KIND_FULL = 0
KIND_SWA = 1
KIND_MAMBA = 2
KIND_CHUNKED = 3
_KIND_CODE = {
    "full": KIND_FULL,
    "sliding_window": KIND_SWA,
    "mamba": KIND_MAMBA,
    "chunked_local": KIND_CHUNKED,
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (``b > 0``)."""
    return -(a // -b)


@dataclass(frozen=True)
class SpecGroupPlan:
    """One SpecGroup, as numbers.

    ``need`` is the sliding-window run without EAGLE (``cdiv(window - 1, bs)``);
    ``margin`` the EAGLE proof margin in tokens (0 for Mamba or non-EAGLE);
    ``q`` the alignment period in blocks; ``fine`` whether the scan probes
    hash units inside a block (full attention and Mamba with ``A < bs``).
    """

    kind: int
    block_size: int
    scale: int
    group_ids: tuple[int, ...]
    use_eagle: bool
    margin: int
    need: int
    q: int
    fine: bool
    chunk: int


@dataclass(frozen=True)
class CandidatePlan:
    """Which chunks of a group the store worker asks about in ``lookup``.

    Without partial hash hits, chunk ``c`` of the group is asked iff
    ``c < min(n_chunks, cdiv(token_len, bs))`` and, when ``sparse``, also
    ``c < token_len // bs``, ``c >= shift`` and
    ``(c - shift) % per_segment >= per_segment - need`` (the SWA lookup mask).
    With partial hash hits every hash unit below ``token_len // hash_block_size``
    is asked for every prefix-cacheable group.
    """

    group_id: int
    cacheable: bool
    block_size: int
    scale: int
    sparse: bool
    per_segment: int
    need: int
    shift: int


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
        hbs, align = layout.hash_block_size, layout.alignment
        sgs = []
        for sg in layout.spec_groups:
            spec = sg.spec
            bs = spec.block_size
            kind = _KIND_CODE[sg.kind]
            need = (
                cdiv(spec.sliding_window - 1, bs)
                if isinstance(spec, SlidingWindow)
                else 0
            )
            margin = (
                layout.proof_margins[sg.group_ids[0]]
                if sg.use_eagle and kind != KIND_MAMBA
                else 0
            )
            sgs.append(
                SpecGroupPlan(
                    kind=kind,
                    block_size=bs,
                    scale=bs // hbs,
                    group_ids=sg.group_ids,
                    use_eagle=sg.use_eagle,
                    margin=margin,
                    need=need,
                    q=align // gcd(bs, align),
                    fine=kind in (KIND_FULL, KIND_MAMBA) and align < bs,
                    chunk=spec.attention_chunk_size
                    if isinstance(spec, ChunkedLocal)
                    else 0,
                )
            )
        cands = []
        sched = layout.scheduler_block_size
        for gid, g in enumerate(layout.groups):
            spec = layout.coverage_specs[gid]
            bs = spec.block_size
            sparse = False
            per_segment = need = shift = 0
            if isinstance(spec, SlidingWindow) and sched % bs == 0:
                eagle = gid in layout.eagle_group_ids
                need = cdiv(spec.sliding_window - 1, bs) + (1 if eagle else 0)
                per_segment = sched // bs
                shift = 1 if eagle else 0
                sparse = need < per_segment
            cands.append(
                CandidatePlan(
                    group_id=gid,
                    cacheable=g.prefix_cacheable,
                    block_size=bs,
                    scale=max(bs // hbs, 1),
                    sparse=sparse,
                    per_segment=per_segment,
                    need=need,
                    shift=shift,
                )
            )
        return ScanPlan(
            layout=layout,
            spec_groups=tuple(sgs),
            candidates=tuple(cands),
            num_groups=layout.num_groups,
            hash_block_size=hbs,
            alignment=align,
            partial=layout.partial_hash_hits,
            simple_hybrid=layout.is_simple_hybrid,
        )

    def as_rows(self) -> list[list[int]]:
        """One int row per SpecGroup for kernels: kind, block_size, scale,
        use_eagle, margin, need, q, fine, chunk, n_members, members... (padded
        with -1 to the largest SpecGroup)."""
        width = max(len(sg.group_ids) for sg in self.spec_groups)
        rows = []
        for sg in self.spec_groups:
            members = list(sg.group_ids) + [-1] * (width - len(sg.group_ids))
            rows.append(
                [
                    sg.kind,
                    sg.block_size,
                    sg.scale,
                    int(sg.use_eagle),
                    sg.margin,
                    sg.need,
                    sg.q,
                    int(sg.fine),
                    sg.chunk,
                    len(sg.group_ids),
                    *members,
                ]
            )
        return rows
