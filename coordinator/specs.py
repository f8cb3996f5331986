"""The cache-layout model: KV-cache groups and the merged layout.

The spec classes are defined in :mod:`kvhit.coordinator.spec_types` (below the
spec-kind registry, which the layout reads) and exported from here too, where
callers build layouts from them.

Mirrors how vLLM 0.33.0's ``MooncakeStoreCoordinator`` sees a model's KV cache:
groups with equal (coverage) specs merge into one :class:`SpecGroup`, which hits
only where every member group holds the hash; full-attention SpecGroups come
first; the EAGLE bit of any member promotes the whole SpecGroup. Everything the
lookup needs is derived once, at construction, and every layout vLLM would
``assert`` on at lookup time is refused here with a ``ValueError`` that names the
group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import FrozenInstanceError, dataclass, replace
from types import MappingProxyType

from kvhit.coordinator.kinds import SpecKind, kind_of
from kvhit.coordinator.spec_types import (
    SPEC_TYPES,
    ChunkedLocal,
    FullAttention,
    Mamba,
    SlidingWindow,
    Spec,
)

__all__ = [
    "CacheLayout",
    "ChunkedLocal",
    "FullAttention",
    "Group",
    "GroupIds",
    "Mamba",
    "SlidingWindow",
    "Spec",
    "SpecGroup",
    "coverage_spec",
    "eagle_proof_margin",
]


@dataclass(frozen=True)
class Group:
    """One KV-cache group: a spec, whether it holds EAGLE/MTP draft layers, and
    whether it takes part in prefix caching (scratch groups do not)."""

    spec: Spec
    eagle: bool = False
    prefix_cacheable: bool = True
    name: str | None = None


class GroupIds(tuple):
    """Group ids of a SpecGroup: a tuple that also equals the list with the
    same ids (vLLM keeps them in a list; both spellings compare equal)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return list(self) == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


@dataclass(frozen=True)
class SpecGroup:
    """Groups sharing one coverage spec, looked up jointly.

    ``spec`` is the coverage spec (a sliding window already widened by
    ``extra_retained_tokens``); ``group_ids`` index ``CacheLayout.groups``;
    ``use_eagle`` is True when any member (or the layout-wide ``use_eagle``
    fallback) makes the whole SpecGroup drop its last hit block.
    """

    spec: Spec
    group_ids: tuple[int, ...]
    use_eagle: bool

    @property
    def kind(self) -> str:
        """The spec's kind: "full", "sliding_window", "mamba", "chunked_local"."""
        return self.spec.kind

    @property
    def spec_kind(self) -> SpecKind:
        """The spec's entry in the spec-kind registry (``coordinator/kinds.py``)."""
        return kind_of(self.spec)

    @property
    def block_size(self) -> int:
        """Tokens per block of the member groups."""
        return self.spec.block_size

    @property
    def supports_fine_grained(self) -> bool:
        """Whether vLLM's manager for this spec probes hash-unit boundaries
        inside a block when partial hash hits are on (full attention, Mamba)."""
        return kind_of(self.spec).fine_grained


def coverage_spec(spec: Spec) -> Spec:
    """The spec whose window covers every block an external hit restores: a
    sliding window widened by ``extra_retained_tokens`` (vLLM's
    ``_coverage_spec``). Equal coverage specs merge."""
    if isinstance(spec, SlidingWindow) and spec.extra_retained_tokens:
        return replace(
            spec,
            sliding_window=spec.sliding_window + spec.extra_retained_tokens,
            extra_retained_tokens=0,
        )
    return spec


def eagle_proof_margin(
    block_size: int, hash_block_size: int, fine_grained_lookup: bool
) -> int:
    """Tokens an EAGLE group matches past a cache hit before dropping them:
    one hash unit for fine-grained lookups, else one cache block."""
    if fine_grained_lookup and block_size > hash_block_size:
        return hash_block_size
    return block_size


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _group_label(idx: int, group: Group) -> str:
    name = f" ({group.name!r})" if group.name else ""
    return f"group {idx}{name} [{type(group.spec).__name__}]"


class CacheLayout:
    """A model's KV-cache groups and the store's hashing parameters.

    Args:
        groups: the KV-cache groups, in vLLM's group order (group ids are
            positions in this list).
        scheduler_block_size: the scheduler's block size in tokens (vLLM's LCM
            block size); hits are multiples of it unless ``partial_hash_hits``.
        hash_block_size: tokens per block hash.
        use_eagle: speculative decoding with EAGLE/MTP; with no group flagged,
            every group drops its last hit block.
        retention_interval: vLLM's ``prefix_cache_retention_interval`` (sparse
            SWA tails / Mamba states in store masks); ``None`` is dense.
        partial_hash_hits: hits may land on any hash unit, not only on
            ``scheduler_block_size`` boundaries.

    Raises:
        TypeError: ``groups`` is not a sequence of :class:`Group`.
        ValueError: naming the group and the rule, for every layout vLLM 0.33.0
            would refuse or assert on at lookup time.
    """

    def __init__(
        self,
        groups: Sequence[Group],
        scheduler_block_size: int,
        hash_block_size: int,
        use_eagle: bool = False,
        retention_interval: int | None = None,
        partial_hash_hits: bool = False,
    ) -> None:
        if isinstance(groups, str | bytes) or not isinstance(groups, Iterable):
            raise TypeError(
                "groups must be a sequence of Group, got " + type(groups).__name__
            )
        groups = tuple(groups)
        self.groups: tuple[Group, ...] = groups
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.use_eagle = bool(use_eagle)
        self.retention_interval = retention_interval
        self.partial_hash_hits = bool(partial_hash_hits)
        self._validate()

        self.coverage_specs: tuple[Spec, ...] = tuple(
            coverage_spec(g.spec) for g in groups
        )
        self.spec_groups: tuple[SpecGroup, ...] = self._merge()
        self.eagle_group_ids: frozenset[int] = frozenset(
            gid for sg in self.spec_groups if sg.use_eagle for gid in sg.group_ids
        )
        # The alignment every hit length and lookup/store length is a multiple of.
        self.alignment: int = (
            hash_block_size if self.partial_hash_hits else scheduler_block_size
        )
        margins = {
            gid: eagle_proof_margin(
                sg.block_size,
                hash_block_size,
                self.partial_hash_hits and sg.supports_fine_grained,
            )
            for sg in self.spec_groups
            if sg.use_eagle and sg.spec_kind.takes_proof_margin
            for gid in sg.group_ids
        }
        # Read-only: the layout is a cache key (plans, compiled kernels).
        self.proof_margins: Mapping[int, int] = MappingProxyType(margins)
        self.mamba_group_ids: frozenset[int] = frozenset(
            i for i, g in enumerate(groups) if isinstance(g.spec, Mamba)
        )
        self.is_simple_hybrid: bool = (
            len(self.spec_groups) == 2
            and self.spec_groups[0].spec_kind.is_full_attention
        )
        self._validate_merged()
        # A layout is used as a cache key, so it is immutable: its hash is
        # computed once, here, and setting any attribute raises.
        self._hash = hash(self._key())
        self._frozen = True

    def __setattr__(self, name: str, value: object) -> None:
        if self.__dict__.get("_frozen", False):
            raise FrozenInstanceError(f"CacheLayout is immutable: cannot set {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"CacheLayout is immutable: cannot delete {name!r}")

    def __reduce__(self) -> tuple:
        # Rebuilt through __init__ (pickle, copy): validated, frozen again.
        return (CacheLayout, self._key())

    # -- construction -----------------------------------------------------

    def _validate(self) -> None:
        hbs, sbs = self.hash_block_size, self.scheduler_block_size
        if not _is_positive_int(hbs):
            raise ValueError(f"hash_block_size must be a positive int, got {hbs!r}")
        if not _is_positive_int(sbs):
            raise ValueError(
                f"scheduler_block_size must be a positive int, got {sbs!r}"
            )
        if sbs % hbs:
            raise ValueError(
                f"scheduler_block_size ({sbs}) must be a multiple of "
                f"hash_block_size ({hbs})"
            )
        ri = self.retention_interval
        if ri is not None and (
            not isinstance(ri, int) or isinstance(ri, bool) or ri < 0 or ri % sbs
        ):
            raise ValueError(
                f"retention_interval ({ri!r}) must be None or a non-negative "
                f"multiple of scheduler_block_size ({sbs})"
            )
        if not self.groups:
            raise ValueError("a CacheLayout needs at least one group, got none")
        for i, g in enumerate(self.groups):
            if not isinstance(g, Group):
                raise TypeError(f"groups[{i}] must be a Group, got {type(g).__name__}")
            label = _group_label(i, g)
            spec = g.spec
            if not isinstance(spec, SPEC_TYPES):
                raise TypeError(
                    f"{label}: spec must be one of FullAttention, SlidingWindow, "
                    f"Mamba, ChunkedLocal; got {type(spec).__name__}"
                )
            try:
                hash(spec)
            except TypeError as exc:
                raise ValueError(f"{label}: spec tag must be hashable") from exc
            if not _is_positive_int(spec.block_size):
                raise ValueError(
                    f"{label}: block_size must be a positive int, "
                    f"got {spec.block_size!r}"
                )
            if isinstance(spec, SlidingWindow):
                if not _is_positive_int(spec.sliding_window):
                    raise ValueError(
                        f"{label}: sliding_window must be a positive int, "
                        f"got {spec.sliding_window!r}"
                    )
                ert = spec.extra_retained_tokens
                if not isinstance(ert, int) or isinstance(ert, bool) or ert < 0:
                    raise ValueError(
                        f"{label}: extra_retained_tokens must be a non-negative "
                        f"int, got {ert!r}"
                    )
            if isinstance(spec, ChunkedLocal) and not _is_positive_int(
                spec.attention_chunk_size
            ):
                raise ValueError(
                    f"{label}: attention_chunk_size must be a positive int, "
                    f"got {spec.attention_chunk_size!r}"
                )
            if not g.prefix_cacheable:
                # Never probed for hits, so vLLM does not constrain its size.
                continue
            if spec.block_size % hbs:
                raise ValueError(
                    f"{label}: block_size ({spec.block_size}) must be a multiple "
                    f"of hash_block_size ({hbs})"
                )
            if sbs % spec.block_size:
                raise ValueError(
                    f"{label}: scheduler_block_size ({sbs}) must be a multiple "
                    f"of the group's block_size ({spec.block_size})"
                )
        if not any(g.prefix_cacheable for g in self.groups):
            raise ValueError(
                "a CacheLayout needs at least one prefix-cacheable group; "
                "every group has prefix_cacheable=False"
            )

    def _merge(self) -> tuple[SpecGroup, ...]:
        merged: list[tuple[Spec, list[int], list[bool]]] = []
        for i, g in enumerate(self.groups):
            if not g.prefix_cacheable:
                continue
            spec = self.coverage_specs[i]
            for m_spec, m_ids, m_eagle in merged:
                if m_spec == spec:
                    m_ids.append(i)
                    # One EAGLE member makes the whole SpecGroup EAGLE (missed
                    # by vLLM's Mooncake store: vllm-project/vllm PR #49069).
                    m_eagle[0] = m_eagle[0] or bool(g.eagle)
                    break
            else:
                merged.append((spec, [i], [bool(g.eagle)]))
        # Stable: full attention first, the rest in group order.
        merged.sort(key=lambda e: not kind_of(e[0]).is_full_attention)
        all_eagle = self.use_eagle and not any(e[2][0] for e in merged)
        return tuple(
            SpecGroup(spec, GroupIds(ids), all_eagle or eagle[0])
            for spec, ids, eagle in merged
        )

    def _validate_merged(self) -> None:
        for sg in self.spec_groups:
            if not isinstance(sg.spec, ChunkedLocal):
                continue
            label = _group_label(sg.group_ids[0], self.groups[sg.group_ids[0]])
            if sg.use_eagle:
                raise ValueError(
                    f"{label}: chunked local attention cannot be an EAGLE group "
                    "(vLLM does not support eagle + chunked local attention); "
                    "flag another group as the EAGLE group or turn use_eagle off"
                )
            if sg.block_size != self.alignment:
                raise ValueError(
                    f"{label}: chunked local attention needs block_size "
                    f"({sg.block_size}) equal to the hit alignment "
                    f"({self.alignment}: "
                    + (
                        "hash_block_size, partial hash hits are on)"
                        if self.partial_hash_hits
                        else "scheduler_block_size)"
                    )
                )

    # -- conveniences -----------------------------------------------------

    @property
    def num_groups(self) -> int:
        """How many KV-cache groups the layout has (prefix cacheable or not)."""
        return len(self.groups)

    def align(self, length: int) -> int:
        """``length`` rounded down to the hit alignment."""
        return length // self.alignment * self.alignment

    def __repr__(self) -> str:
        return (
            f"CacheLayout(groups={list(self.groups)!r}, "
            f"scheduler_block_size={self.scheduler_block_size}, "
            f"hash_block_size={self.hash_block_size}, use_eagle={self.use_eagle}, "
            f"retention_interval={self.retention_interval}, "
            f"partial_hash_hits={self.partial_hash_hits})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheLayout):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return self._hash

    def _key(self) -> tuple:
        return (
            self.groups,
            self.scheduler_block_size,
            self.hash_block_size,
            self.use_eagle,
            self.retention_interval,
            self.partial_hash_hits,
        )
