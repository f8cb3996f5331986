"""vLLM KVCacheGroupSpec -> CacheLayout (bindings/vllm.py).

Stand-in spec classes carry vLLM's class names and fields (the binding duck
types on names); one test uses the real vLLM 0.33.0 classes and vLLM's own
``MooncakeStoreCoordinator`` when vLLM is importable, and skips otherwise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pytest

from kvhit.bindings.vllm import layout_from_vllm, spec_kind, vllm_key_group_ids
from kvhit.coordinator.reference import ReferenceCoordinator
from kvhit.coordinator.specs import FullAttention, Mamba, SlidingWindow

# -- stand-ins named like vLLM 0.33.0's classes (v1/kv_cache_interface.py) ----


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    is_draft: bool = field(default=False, kw_only=True, compare=False)

    @property
    def prefix_cacheable(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 64
    dtype: str = "bfloat16"


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str | None = None


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    rswa_window: int = 8


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int
    extra_retained_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    bounded_replay: bool = False

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    @property
    def prefix_cacheable(self) -> bool:
        return False


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    shapes: tuple = ((4, 8),)
    dtypes: tuple = ("float32",)
    mamba_cache_mode: str = "none"


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    kv_cache_specs: dict = field(default_factory=dict)

    @property
    def prefix_cacheable(self) -> bool:
        return all(s.prefix_cacheable for s in self.kv_cache_specs.values())


@dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    enable_kv_transfer: bool = True


def grp(spec, eagle=False, name="layer"):
    return KVCacheGroupSpec([name], spec, is_eagle_group=eagle)


def dsv4_groups():
    """DeepSeek-V4-Flash-like: MLA full 256, SWA-MLA 64/w128 (plain and the
    MTP group), SWA 4/w8, SWA 8/w128."""
    return [
        grp(MLAAttentionSpec(block_size=256, head_size=576)),
        grp(SlidingWindowMLASpec(block_size=64, sliding_window=128)),
        grp(SlidingWindowMLASpec(block_size=64, sliding_window=128), eagle=True),
        grp(SlidingWindowSpec(block_size=4, sliding_window=8)),
        grp(SlidingWindowSpec(block_size=8, sliding_window=128, head_size=128)),
    ]


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()[:8]


# -- tests ---------------------------------------------------------------------


def test_dsv4_layout_merges_and_flags_eagle():
    layout = layout_from_vllm(dsv4_groups(), 256, 4, use_eagle=True)
    assert [type(g.spec) for g in layout.groups] == [
        FullAttention,
        SlidingWindow,
        SlidingWindow,
        SlidingWindow,
        SlidingWindow,
    ]
    assert [g.eagle for g in layout.groups] == [False, False, True, False, False]
    assert [sg.group_ids for sg in layout.spec_groups] == [(0,), (1, 2), (3,), (4,)]
    assert layout.eagle_group_ids == frozenset({1, 2})
    assert layout.groups[1].spec.sliding_window == 128
    assert layout.groups[0].name.startswith("MLAAttentionSpec")


def test_dsv4_seed_regression_through_binding():
    # DESIGN seed 3: store what store_mask(768) keeps, look up 768 -> 512.
    layout = layout_from_vllm(dsv4_groups(), 256, 4, use_eagle=True)
    ref = ReferenceCoordinator(layout)
    hashes = [h(i) for i in range(768 // 4)]
    masks = ref.store_mask(768)
    exists = set()
    for g, mask in enumerate(masks):
        bs = layout.groups[g].spec.block_size
        scale = bs // 4
        for c in range(768 // bs):
            if mask is None or mask[c]:
                exists.add((g, hashes[(c + 1) * scale - 1]))
    assert ref.lookup(768, hashes, exists) == 512


def test_swa_merge_follows_coverage_window():
    # vLLM merges coverage specs: window + extra_retained_tokens.
    a = SlidingWindowSpec(block_size=16, sliding_window=32, extra_retained_tokens=16)
    b = SlidingWindowSpec(block_size=16, sliding_window=48)
    c = SlidingWindowSpec(block_size=16, sliding_window=32)
    layout = layout_from_vllm([grp(a), grp(b), grp(c)], 64, 16)
    assert [sg.group_ids for sg in layout.spec_groups] == [(0, 1), (2,)]
    assert layout.spec_groups[0].spec.sliding_window == 48
    assert layout.groups[0].spec.extra_retained_tokens == 16


def test_unmodelled_fields_keep_groups_apart():
    full = FullAttentionSpec(block_size=16)
    groups = [
        grp(full),
        grp(FullAttentionSpec(block_size=16)),  # equal: merges with 0
        grp(MLAAttentionSpec(block_size=16)),  # MLA vs MHA: apart
        grp(FullAttentionSpec(block_size=16, num_kv_heads=8)),  # heads: apart
        grp(FullAttentionSpec(block_size=16, is_draft=True)),  # compare=False
    ]
    layout = layout_from_vllm(groups, 16, 16)
    assert [sg.group_ids for sg in layout.spec_groups] == [(0, 1, 4), (2,), (3,)]


def test_uniform_type_specs_unwrap_first_inner_spec():
    inner = SlidingWindowSpec(block_size=16, sliding_window=32)
    other = SlidingWindowSpec(block_size=16, sliding_window=32, head_size=128)
    uni = UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"a": inner, "b": other}
    )
    layout = layout_from_vllm([grp(uni), grp(inner)], 16, 16)
    # vLLM's _unwrap_spec compares only the first inner spec: they merge.
    assert [sg.group_ids for sg in layout.spec_groups] == [(0, 1)]
    assert isinstance(layout.groups[0].spec, SlidingWindow)


def test_not_prefix_cacheable_groups_are_skipped():
    groups = [
        grp(FullAttentionSpec(block_size=16)),
        grp(CircularBufferSpec(block_size=5)),  # ring: size needs no alignment
        grp(SlidingWindowMLASpec(block_size=16, sliding_window=8, bounded_replay=True)),
        KVCacheGroupSpec(["x"], MambaSpec(block_size=16), enable_kv_transfer=False),
        grp(
            UniformTypeKVCacheSpecs(
                block_size=7, kv_cache_specs={"r": CircularBufferSpec(block_size=7)}
            )
        ),
    ]
    layout = layout_from_vllm(groups, 16, 16)
    assert [g.prefix_cacheable for g in layout.groups] == [
        True,
        False,
        False,
        False,
        False,
    ]
    assert [sg.group_ids for sg in layout.spec_groups] == [(0,)]
    assert vllm_key_group_ids(layout) == (0, None, None, None, None)


def test_mamba_and_chunked_local_and_mro_subclass():
    @dataclass(frozen=True, kw_only=True)
    class MyVendorFullSpec(FullAttentionSpec):  # a platform subclass
        extra: int = 0

    groups = [
        grp(MyVendorFullSpec(block_size=16)),
        grp(MambaSpec(block_size=16)),
        grp(ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64)),
    ]
    layout = layout_from_vllm(groups, 16, 16)
    assert isinstance(layout.groups[0].spec, FullAttention)
    assert isinstance(layout.groups[1].spec, Mamba)
    assert layout.groups[2].spec.attention_chunk_size == 64
    assert spec_kind(MyVendorFullSpec(block_size=1)) == "full"


def test_unknown_spec_class_is_named():
    @dataclass(frozen=True)
    class FancyNewSpec:
        block_size: int

    with pytest.raises(ValueError, match="FancyNewSpec"):
        layout_from_vllm([grp(FancyNewSpec(16))], 16, 16)
    # Known to vLLM, prefix cacheable, but served by a manager kvhit lacks.
    with pytest.raises(ValueError, match="RSWASpec"):
        layout_from_vllm([grp(RSWASpec(block_size=16))], 16, 16)


@pytest.mark.parametrize("groups", [None, 5, "full", iter(())])
def test_groups_that_are_not_a_sequence_are_named(groups):
    with pytest.raises(TypeError, match="kv_cache_groups"):
        layout_from_vllm(groups, 16, 16)


def test_layout_errors_pass_through():
    # vLLM asserts on chunked local + EAGLE; kvhit refuses at build time.
    spec = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64)
    with pytest.raises(ValueError, match="chunked local"):
        layout_from_vllm([grp(spec)], 16, 16, use_eagle=True)
    with pytest.raises(ValueError, match="kv_cache_spec"):
        layout_from_vllm([object()], 16, 16)


# -- the real classes ------------------------------------------------------------


def test_real_vllm_classes_match_vllm_coordinator():
    """The real vLLM 0.33.0 spec classes, and vLLM's own merge/eagle decisions."""
    iface = pytest.importorskip(
        "vllm.v1.kv_cache_interface", reason="vLLM is not importable here"
    )
    import torch

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (  # noqa: E501
            MooncakeStoreCoordinator,
        )
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM's Mooncake store coordinator is not importable: {exc}")

    bf16 = torch.bfloat16
    mla = iface.MLAAttentionSpec(
        block_size=256, num_kv_heads=1, head_size=576, dtype=bf16
    )
    swa_mla = iface.SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=512, dtype=bf16, sliding_window=128
    )
    swa4 = iface.SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=128, dtype=bf16, sliding_window=8
    )
    swa8 = iface.SlidingWindowSpec(
        block_size=8, num_kv_heads=1, head_size=128, dtype=bf16, sliding_window=128
    )
    # Coverage window 64 + 64 == 128: vLLM's _coverage_spec makes it equal to
    # swa8, so the two merge.
    swa_ert = iface.SlidingWindowSpec(
        block_size=8,
        num_kv_heads=1,
        head_size=128,
        dtype=bf16,
        sliding_window=64,
        extra_retained_tokens=64,
    )
    ring = iface.CircularBufferSpec(
        block_size=8, num_kv_heads=1, head_size=128, dtype=bf16
    )
    G = iface.KVCacheGroupSpec
    groups = [
        G(["l0"], mla),
        G(["l1"], swa_mla),
        G(["l2"], swa_mla, is_eagle_group=True),
        G(["l3"], swa4),
        G(["l4"], swa8),
        G(["l5"], swa_ert),
        G(
            ["l6"],
            iface.UniformTypeKVCacheSpecs(block_size=8, kv_cache_specs={"a": swa8}),
        ),
        G(["l7"], ring),
    ]
    layout = layout_from_vllm(groups, 256, 4, use_eagle=True)
    assert not layout.groups[7].prefix_cacheable

    cacheable = [g for g in groups if g.kv_cache_spec.prefix_cacheable]
    coord = MooncakeStoreCoordinator(cacheable, 256, 4, use_eagle=True)
    # Group ids of the cacheable groups coincide (the ring is last).
    theirs = [(tuple(sg.group_ids), sg.use_eagle) for sg in coord.attention_groups]
    ours = [(sg.group_ids, sg.use_eagle) for sg in layout.spec_groups]
    assert ours == theirs
    assert set(layout.eagle_group_ids) == set(coord.eagle_group_ids)
    # swa8, the extra-retained one and the uniform wrapper all merge.
    assert (4, 5, 6) in [sg.group_ids for sg in layout.spec_groups]
