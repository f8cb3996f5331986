"""vLLM KV-cache groups -> a kvhit :class:`CacheLayout`, without importing vLLM.

vLLM 0.33.0's Mooncake store coordinator (``MooncakeStoreCoordinator``) sees a
model's KV cache as a list of ``KVCacheGroupSpec`` (``layer_names``,
``kv_cache_spec``, ``is_eagle_group``, ``enable_kv_transfer``). It unwraps
``UniformTypeKVCacheSpecs`` to their first inner spec, widens sliding windows by
``extra_retained_tokens`` (``_coverage_spec``), merges groups whose coverage specs
compare equal (dataclass equality: same class, every ``compare=True`` field
equal) and dispatches each merged group to the manager registered for the
spec's class (walking the MRO).

This module reproduces that mapping by duck typing: spec classes are recognised
by the names in their MRO, fields are read as attributes, so the vLLM classes,
pickled copies of them and small stand-ins all work, and kvhit never imports
vLLM. Fields of the vLLM spec that kvhit does not model (head counts, dtypes,
MLA-ness, ...) go into the kvhit spec's ``tag``, so two kvhit groups merge
exactly when vLLM's coverage specs are equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from kvhit.coordinator.kinds import KINDS, KINDS_BY_NAME, SpecKind
from kvhit.coordinator.specs import CacheLayout, FullAttention, Group, Spec

__all__ = ["layout_from_vllm", "spec_kind", "spec_tag", "vllm_key_group_ids"]

# vLLM 0.33.0's KVCacheSpecRegistry (register_all_kvcache_specs), by class name:
# the manager each registered spec class is looked up with, as a kvhit kind.
# The modelled classes come from the spec-kind registry (SpecKind.vllm_names).
# ``None``: registered with a manager kvhit does not model (R-SWA, attention
# sinks, cross attention, HiSparse, ring buffers), or not registered at all
# (encoder-only) -- vLLM's store coordinator cannot serve it as a prefix-cache
# group either.
UNMODELLED_VLLM_SPECS: tuple[str, ...] = (
    "RSWASpec",
    "SinkFullAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "CircularBufferSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
)
_KIND_BY_CLASS_NAME: dict[str, SpecKind | None] = {
    **{name: kind for kind in KINDS for name in kind.vllm_names},
    **dict.fromkeys(UNMODELLED_VLLM_SPECS),
}
_UNIFORM = "UniformTypeKVCacheSpecs"


def _mro_names(obj: object) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__]


def unwrap_spec(spec: Any) -> Any:
    """vLLM's ``_unwrap_spec``: the first inner spec of a
    ``UniformTypeKVCacheSpecs``, else the spec itself."""
    if _UNIFORM in _mro_names(spec):
        inner = getattr(spec, "kv_cache_specs", None)
        if not inner:
            raise ValueError(f"{type(spec).__name__} has no inner kv_cache_specs")
        return next(iter(inner.values()))
    return spec


def _registry_kind(spec: Any) -> SpecKind | None:
    """The registry entry for an (unwrapped) vLLM spec, found the way vLLM's
    registry finds a manager: the most derived registered class in the MRO;
    ``None`` for a class vLLM knows but kvhit does not model.

    Raises:
        ValueError: no class in the MRO is a vLLM spec class kvhit knows of.
    """
    for name in _mro_names(spec):
        if name in _KIND_BY_CLASS_NAME:
            return _KIND_BY_CLASS_NAME[name]
    raise ValueError(
        f"unknown vLLM KV-cache spec class {type(spec).__qualname__!r} "
        f"(MRO: {', '.join(_mro_names(spec))}); kvhit maps only "
        f"{', '.join(k for k, v in _KIND_BY_CLASS_NAME.items() if v)}"
    )


def spec_kind(spec: Any) -> str | None:
    """The kvhit kind of an (unwrapped) vLLM spec, found the way vLLM's
    registry finds a manager: the most derived registered class in the MRO.

    Returns ``"full"``, ``"sliding_window"``, ``"mamba"``, ``"chunked_local"``
    (a ``SpecKind.name``), or ``None`` for a class vLLM knows but kvhit does
    not model.

    Raises:
        ValueError: no class in the MRO is a vLLM spec class kvhit knows of.
    """
    kind = _registry_kind(spec)
    return None if kind is None else kind.name


def _freeze(value: Any) -> Hashable:
    """A hashable stand-in that compares equal exactly when ``value`` does
    (for the containers dataclass fields hold); ``repr`` as a last resort."""
    if isinstance(value, dict):
        return ("dict", tuple((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, set | frozenset):
        return ("set", frozenset(_freeze(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _compared_fields(spec: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of the fields vLLM's dataclass ``__eq__`` compares."""
    if dataclasses.is_dataclass(spec):
        return [
            (f.name, getattr(spec, f.name))
            for f in dataclasses.fields(spec)
            if f.compare
        ]
    # A plain-object stand-in: every public instance attribute.
    return sorted((k, v) for k, v in vars(spec).items() if not k.startswith("_"))


def spec_tag(spec: Any, kind: str | None = None) -> Hashable:
    """The tag of the kvhit spec built from the (unwrapped) vLLM ``spec``.

    It holds the spec's class and every compared field kvhit does not model,
    so kvhit specs are equal exactly when vLLM's are. For sliding windows,
    ``sliding_window`` and ``extra_retained_tokens`` are left out: kvhit keeps
    them as fields and widens the window itself, so two SWA groups whose
    windows differ but whose coverage windows (``sliding_window +
    extra_retained_tokens``) agree merge, as vLLM's ``_coverage_spec`` makes
    them.
    """
    if kind is None:
        kind = spec_kind(spec)
    registered = KINDS_BY_NAME.get(kind or "")
    mapped = registered.spec_fields if registered else frozenset({"block_size"})
    cls = type(spec)
    return (
        f"{cls.__module__}.{cls.__qualname__}",
        tuple(
            (name, _freeze(value))
            for name, value in _compared_fields(spec)
            if name not in mapped
        ),
    )


def _positive_int(value: Any, what: str, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{label}: {what} must be a positive int, got {value!r}")
    return value


def _to_kvhit_spec(spec: Any, kind: SpecKind, label: str) -> Spec:
    """The kvhit spec of ``kind`` built from the vLLM ``spec``: each of the
    kind's own fields read from the attribute of the same name (its default,
    or ``None`` for the spec to refuse, when the attribute is missing), the
    rest in the tag."""
    tag = spec_tag(spec, kind.name)
    block_size = _positive_int(getattr(spec, "block_size", None), "block_size", label)
    sizes = {
        f.name: getattr(
            spec, f.name, None if f.default is dataclasses.MISSING else f.default
        )
        for f in dataclasses.fields(kind.spec_type)
        if f.name in kind.spec_fields and f.name != "block_size"
    }
    return kind.spec_type(block_size=block_size, tag=tag, **sizes)


def _group_name(group: Any, spec: Any) -> str:
    layers = getattr(group, "layer_names", None) or ()
    first = f" {layers[0]}" if layers else ""
    more = f" (+{len(layers) - 1} layers)" if len(layers) > 1 else ""
    return f"{type(spec).__name__}{first}{more}"


def _to_kvhit_group(i: int, group: Any) -> Group:
    """kvhit group ``i`` from vLLM's ``KVCacheGroupSpec`` ``group``."""
    raw = getattr(group, "kv_cache_spec", None)
    if raw is None:
        raise ValueError(
            f"kv_cache_groups[{i}] ({type(group).__name__}) has no kv_cache_spec"
        )
    spec = unwrap_spec(raw)
    label = f"kv_cache_groups[{i}] ({type(raw).__name__})"
    eagle = bool(getattr(group, "is_eagle_group", False))
    name = _group_name(group, spec)
    # vLLM reads prefix_cacheable from the group's own spec (a uniform wrapper
    # is cacheable only if every inner spec is).
    cacheable = bool(getattr(raw, "prefix_cacheable", True)) and bool(
        getattr(group, "enable_kv_transfer", True)
    )
    if not cacheable:
        return _scratch_group(i, spec, label, eagle, name)
    kind = _registry_kind(spec)
    if kind is None:
        raise ValueError(
            f"{label}: spec class {type(spec).__name__!r} is prefix cacheable "
            "but vLLM serves it with a manager kvhit does not model (kvhit "
            f"models {', '.join(k.name for k in KINDS)})"
        )
    return Group(_to_kvhit_spec(spec, kind, label), eagle=eagle, name=name)


def _scratch_group(i: int, spec: Any, label: str, eagle: bool, name: str) -> Group:
    """A group vLLM never probes, stores or merges: its spec only has to carry
    a block size and keep the group apart from every other one."""
    try:
        kind = spec_kind(spec)
    except ValueError:
        kind = None
    block_size = _positive_int(getattr(spec, "block_size", None), "block_size", label)
    return Group(
        FullAttention(block_size, tag=("not_prefix_cacheable", i)),
        eagle=eagle,
        prefix_cacheable=False,
        name=name if kind is None else f"{name} [{kind}]",
    )


def layout_from_vllm(
    kv_cache_groups: Sequence[Any],
    scheduler_block_size: int,
    hash_block_size: int,
    use_eagle: bool = False,
    retention_interval: int | None = None,
    partial_hash_hits: bool = False,
) -> CacheLayout:
    """Build a :class:`CacheLayout` from vLLM ``KVCacheGroupSpec`` objects.

    Args:
        kv_cache_groups: vLLM's groups, in order (kvhit group ``i`` is
            ``kv_cache_groups[i]``). Pass the specs the store coordinator sees:
            DCP-resolved (``resolve_dcp_kv_cache_spec``). vLLM's connector only
            keeps ``kv_cache_config.prefix_cacheable_groups``; passing every
            group is fine (the others become non-prefix-cacheable kvhit
            groups), but then see :func:`vllm_key_group_ids` for the group ids
            in the store keys.
        scheduler_block_size: vLLM's scheduler block size (LCM of the groups).
        hash_block_size: tokens per block hash.
        use_eagle: ``speculative_config.use_eagle_block_drop()``.
        retention_interval: ``kv_cache_config.prefix_cache_retention_interval``.
        partial_hash_hits: ``cache_hit_alignment_tokens < scheduler_block_size``.

    Each group's spec is unwrapped (``UniformTypeKVCacheSpecs`` -> first inner
    spec) and mapped by class name; a group whose spec is not
    ``prefix_cacheable`` (``CircularBufferSpec``, bounded-replay SWA MLA, ...)
    or that has ``enable_kv_transfer=False`` becomes a
    ``Group(..., prefix_cacheable=False)``; ``is_eagle_group`` becomes
    ``Group.eagle``.

    Raises:
        TypeError: ``kv_cache_groups`` is not a sequence of groups.
        ValueError: an unknown spec class (named), a prefix-cacheable spec
            whose vLLM manager kvhit does not model, or any layout
            :class:`CacheLayout` refuses.
    """
    if isinstance(kv_cache_groups, str | bytes) or not isinstance(
        kv_cache_groups, Sequence
    ):
        raise TypeError(
            "kv_cache_groups must be a sequence of vLLM KVCacheGroupSpec, got "
            f"{type(kv_cache_groups).__name__}"
        )
    groups = [_to_kvhit_group(i, g) for i, g in enumerate(kv_cache_groups)]
    return CacheLayout(
        groups,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        use_eagle=use_eagle,
        retention_interval=retention_interval,
        partial_hash_hits=partial_hash_hits,
    )


def vllm_key_group_ids(layout: CacheLayout) -> tuple[int | None, ...]:
    """The ``@group:G`` number vLLM's Mooncake connector puts in each group's
    store keys: its index among the prefix-cacheable groups (the connector is
    built from ``kv_cache_config.prefix_cacheable_groups``), ``None`` for a
    group that is never stored. Identity when every group is cacheable."""
    out: list[int | None] = []
    n = 0
    for g in layout.groups:
        if g.prefix_cacheable:
            out.append(n)
            n += 1
        else:
            out.append(None)
    return tuple(out)
