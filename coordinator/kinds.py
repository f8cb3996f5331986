"""The spec-kind registry: every KV-cache manager kind kvhit models, declared once.

vLLM dispatches each merged group to the manager registered for its spec class
(``single_type_kv_cache_manager.spec_manager_map``); kvhit does the same with
this table. A :class:`SpecKind` says everything the rest of kvhit needs to know
about one kind: its name (``spec.kind``), its kernel code (``KIND_*`` of
:mod:`kvhit.kernels.contract`), its spec class, the vLLM spec classes that map
to it, its reference scan and masks (the oracle's manager ports in
:mod:`kvhit.coordinator.managers`), the kind-specific numbers
:class:`~kvhit.coordinator.plan.ScanPlan` derives for it, and the few flags
vLLM's coordinator branches on. The reference, the plan and the vLLM binding
look kinds up here (:func:`kind_of`, :data:`KINDS_BY_NAME`) and never branch on
a spec type.

The vectorised scans (the torch, Triton and numba kernels) branch
on ``SpecKind.code``; a new kind needs its closed form there too (see
CONTRIBUTING.md, "Adding a spec type"). The engine's batched store and lookup
masks are entries here too (``batched_store_mask``,
``batched_reachable_mask``), built on :mod:`kvhit.kernels.masks`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvhit.coordinator import managers
from kvhit.coordinator.spec_types import (
    ChunkedLocal,
    FullAttention,
    Mamba,
    SlidingWindow,
    Spec,
)
from kvhit.kernels import masks
from kvhit.kernels.contract import KIND_CHUNKED, KIND_FULL, KIND_MAMBA, KIND_SWA

__all__ = [
    "KINDS",
    "KINDS_BY_NAME",
    "BatchedMaskFn",
    "MaskFn",
    "ScanFn",
    "SpecKind",
    "kind_of",
]

#: ``scan(raw, max_length, group_ids, pool, spec, hash_block_size, drop_eagle,
#: hit_alignment) -> (blocks per member group, hit length)``: the kind's
#: ``find_longest_cache_hit`` port (see :func:`managers.full_attention_hit`).
ScanFn = Callable[..., managers.ScanResult]
#: ``mask(spec, start_block, end_block, scheduler_block_size, use_eagle,
#: retention_interval, boundaries) -> list[bool] | None`` (``None``: every
#: block): the kind's ``reachable_block_mask`` port.
MaskFn = Callable[..., "list[bool] | None"]
#: ``batched_mask(spec, chunks, inside, scheduler_block_size, use_eagle,
#: retention_interval, boundaries) -> (mask, dense)``: :data:`MaskFn` for a
#: batch of requests (``LookupEngine.store_masks`` / ``lookup_masks``).
#: ``chunks`` int64 ``[B, W]`` is the chunk each column stands for, ``inside``
#: bool ``[B, W]`` the columns inside each request's range, ``boundaries`` a
#: list of int64 ``[B]`` replay boundaries (tokens); ``mask`` is bool
#: ``[B, W]`` (read only where ``inside``) and ``dense`` is True where the
#: reference returns ``None`` (every block). Only tensor operators and methods:
#: the registry imports no torch.
BatchedMaskFn = Callable[..., "tuple[Any, bool]"]
#: ``plan_fields(spec) -> {field: value}``: the kind's own ``SpecGroupPlan``
#: fields (``need``, ``chunk``); the rest are derived alike for every kind.
PlanFieldsFn = Callable[[Spec], Mapping[str, int]]
#: ``candidate_fields(spec, scheduler_block_size, eagle) -> {field: value}``:
#: the kind's own ``CandidatePlan`` fields (``sparse``, ``per_segment``,
#: ``need``, ``shift``: a sparse lookup mask); empty for a dense one.
CandidateFieldsFn = Callable[[Spec, int, bool], Mapping[str, int | bool]]


def _no_fields(spec: Spec, *_: object) -> Mapping[str, int]:
    return {}


def _every_chunk_batched(
    spec: Spec, chunks: Any, inside: Any, *_: object
) -> tuple[Any, bool]:
    """:data:`BatchedMaskFn` of ``managers.every_block_reachable``."""
    return inside.clone(), True


@dataclass(frozen=True)
class SpecKind:
    """One KV-cache manager kind.

    The defaults are the common case, so that each entry of :data:`KINDS`
    states only what sets its kind apart: every block reachable, stored where
    reachable, no kind-specific plan fields, no flags but the proof margin.

    Attributes:
        name: ``spec.kind`` / ``SpecGroup.kind`` (``"full"``, ...): the spec
            class's ``kind``, not given.
        code: the ``KIND_*`` code kernels read in ``ScanPlan.as_rows()``.
        spec_type: the kvhit spec class.
        vllm_names: vLLM 0.33.0 spec class names whose manager this kind
            reproduces (``bindings/vllm.py`` maps them).
        scan: the reference ``find_longest_cache_hit`` (:data:`ScanFn`).
        reachable_mask: the reference lookup/reachable mask (:data:`MaskFn`).
        store_mask: the reference store mask (:data:`MaskFn`); None (the
            default) is ``reachable_mask``.
        batched_reachable_mask: ``reachable_mask`` for a batch
            (:data:`BatchedMaskFn`).
        batched_store_mask: ``store_mask`` for a batch (:data:`BatchedMaskFn`);
            None (the default) is ``batched_reachable_mask``.
        plan_fields: its ``SpecGroupPlan`` fields (:data:`PlanFieldsFn`).
        candidate_fields: its ``CandidatePlan`` fields
            (:data:`CandidateFieldsFn`).
        fine_grained: vLLM's manager probes hash-unit boundaries inside a block
            when partial hash hits are on (``resolve_block_hashes``).
        is_full_attention: vLLM's coordinator orders these SpecGroups first,
            scans them once in the convergence loop (later rounds only clip
            them) and trims their masks to the final hit; one of them plus one
            other SpecGroup is a "simple hybrid" (one round).
        takes_proof_margin: an EAGLE SpecGroup of this kind may look one proof
            margin past the current hit (Mamba may not: its state there would
            be unverified; vllm-project/vllm PR #45614).
    """

    name: str = dataclasses.field(init=False)
    code: int
    spec_type: type
    vllm_names: tuple[str, ...]
    scan: ScanFn
    reachable_mask: MaskFn = managers.every_block_reachable
    store_mask: MaskFn = None  # type: ignore[assignment]  # see __post_init__
    batched_reachable_mask: BatchedMaskFn = _every_chunk_batched
    batched_store_mask: BatchedMaskFn = None  # type: ignore[assignment]
    plan_fields: PlanFieldsFn = _no_fields
    candidate_fields: CandidateFieldsFn = _no_fields
    fine_grained: bool = False
    is_full_attention: bool = False
    takes_proof_margin: bool = True

    def __post_init__(self) -> None:
        # Frozen: the derived fields are set once, here.
        object.__setattr__(self, "name", self.spec_type.kind)
        if self.store_mask is None:
            object.__setattr__(self, "store_mask", self.reachable_mask)
        if self.batched_store_mask is None:
            object.__setattr__(self, "batched_store_mask", self.batched_reachable_mask)

    @property
    def spec_fields(self) -> frozenset[str]:
        """The spec class's own fields (``block_size`` and the kind's sizes),
        without ``tag``: what a vLLM spec maps onto."""
        return frozenset(
            f.name
            for f in dataclasses.fields(self.spec_type)
            if f.init and f.name != "tag"
        )


def _swa_plan_fields(spec: SlidingWindow) -> Mapping[str, int]:
    # The run without EAGLE; the scans add the per-request EAGLE drop.
    return {"need": masks.sliding_window_need(spec.sliding_window, spec.block_size)}


def _chunked_plan_fields(spec: ChunkedLocal) -> Mapping[str, int]:
    return {"chunk": spec.attention_chunk_size}


def _swa_candidate_fields(
    spec: SlidingWindow, scheduler_block_size: int, eagle: bool
) -> Mapping[str, int | bool]:
    """The sliding window's lookup mask (``managers.
    sliding_window_reachable_mask`` without retention) as numbers."""
    block_size = spec.block_size
    if scheduler_block_size % block_size:
        return {}
    need = masks.sliding_window_need(spec.sliding_window, block_size, eagle)
    per_segment = masks.swa_segment_chunks(None, scheduler_block_size, block_size)
    return {
        "sparse": need < per_segment,
        "per_segment": per_segment,
        "need": need,
        "shift": 1 if eagle else 0,
    }


def _no_chunk_batched(
    spec: Spec, chunks: Any, inside: Any, *_: object
) -> tuple[Any, bool]:
    """:data:`BatchedMaskFn` of ``managers.no_block_stored``."""
    return inside.new_zeros(inside.shape), False


def _swa_batched_mask(
    spec: SlidingWindow,
    chunks: Any,
    inside: Any,
    scheduler_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    boundaries: Sequence[Any],
) -> tuple[Any, bool]:
    """:data:`BatchedMaskFn` of ``managers.sliding_window_reachable_mask``."""
    block_size = spec.block_size
    if scheduler_block_size % block_size:
        return inside.clone(), True
    shift = 1 if use_eagle else 0
    need = masks.sliding_window_need(spec.sliding_window, block_size, shift)
    mask = inside.new_zeros(inside.shape)
    per_segment = masks.swa_segment_chunks(
        retention_interval, scheduler_block_size, block_size
    )
    if per_segment is not None:
        if need >= per_segment:
            return inside.clone(), True
        mask |= masks.sparse_window_mask(chunks, per_segment, need, shift)
    if retention_interval is not None:
        for boundary in boundaries:
            mask |= masks.swa_replay_mask(
                chunks, boundary[:, None], scheduler_block_size, block_size,
                need, shift,
            )  # fmt: skip
    return mask, False


def _mamba_batched_mask(
    spec: Mamba,
    chunks: Any,
    inside: Any,
    scheduler_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    boundaries: Sequence[Any],
) -> tuple[Any, bool]:
    """:data:`BatchedMaskFn` of ``managers.mamba_reachable_mask``."""
    if retention_interval is None:
        return inside.clone(), True
    block_size = spec.block_size
    mask = inside.new_zeros(inside.shape)
    if retention_interval != 0:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return inside.clone(), True
        mask |= masks.mamba_segment_mask(chunks, per_segment)
    for boundary in boundaries:
        mask |= masks.mamba_replay_mask(
            chunks, boundary[:, None], scheduler_block_size, block_size
        )
    return mask, False


#: Every kind, in code order.
KINDS: tuple[SpecKind, ...] = (
    SpecKind(
        code=KIND_FULL,
        spec_type=FullAttention,
        vllm_names=("FullAttentionSpec", "MLAAttentionSpec", "HiddenStateCacheSpec"),
        scan=managers.full_attention_hit,
        fine_grained=True,
        is_full_attention=True,
    ),
    SpecKind(
        code=KIND_SWA,
        spec_type=SlidingWindow,
        vllm_names=("SlidingWindowSpec", "SlidingWindowMLASpec"),
        scan=managers.sliding_window_hit,
        reachable_mask=managers.sliding_window_reachable_mask,
        batched_reachable_mask=_swa_batched_mask,
        plan_fields=_swa_plan_fields,
        candidate_fields=_swa_candidate_fields,
    ),
    SpecKind(
        code=KIND_MAMBA,
        spec_type=Mamba,
        vllm_names=("MambaSpec",),
        scan=managers.mamba_hit,
        reachable_mask=managers.mamba_reachable_mask,
        store_mask=managers.no_block_stored,
        batched_reachable_mask=_mamba_batched_mask,
        batched_store_mask=_no_chunk_batched,
        fine_grained=True,
        takes_proof_margin=False,
    ),
    SpecKind(
        code=KIND_CHUNKED,
        spec_type=ChunkedLocal,
        vllm_names=("ChunkedLocalAttentionSpec",),
        scan=managers.chunked_local_hit,
        plan_fields=_chunked_plan_fields,
    ),
)

#: ``name -> SpecKind``.
KINDS_BY_NAME: Mapping[str, SpecKind] = MappingProxyType({k.name: k for k in KINDS})
_BY_TYPE: dict[type, SpecKind] = {k.spec_type: k for k in KINDS}


def _check_table(kinds: Sequence[SpecKind]) -> None:
    names = [k.name for k in kinds]
    codes = [k.code for k in kinds]
    vllm = [n for k in kinds for n in k.vllm_names]
    for what, values in (("name", names), ("code", codes), ("vLLM name", vllm)):
        if len(set(values)) != len(values):
            raise AssertionError(f"duplicate spec-kind {what} in {values}")


_check_table(KINDS)


def kind_of(spec: Spec) -> SpecKind:
    """The registry entry of ``spec`` (a kvhit spec instance, or a subclass of
    one: the most derived registered class in its MRO wins).

    Raises:
        TypeError: ``spec`` is not a kvhit spec.
    """
    for cls in type(spec).__mro__:
        kind = _BY_TYPE.get(cls)
        if kind is not None:
            return kind
    known = ", ".join(k.spec_type.__name__ for k in KINDS)
    raise TypeError(f"spec must be one of {known}; got {type(spec).__name__}")
