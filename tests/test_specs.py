"""The layout model: one test per validation rule and per derived attribute.

vLLM 0.33.0 asserts on some of these only at lookup time (e.g. chunked local
attention with EAGLE, ``ChunkedLocalAttentionManager.find_longest_cache_hit``);
kvhit refuses them when the layout is built, naming the group.
"""

from __future__ import annotations

import pytest
from helpers import merged_swa_eagle_layout
from hypothesis import given, settings
from strategies import layouts

from kvhit import CacheLayout, ChunkedLocal, FullAttention, Group, Mamba, SlidingWindow
from kvhit.coordinator.specs import coverage_spec, eagle_proof_margin


def make(groups, sbs=16, hbs=4, **kw) -> CacheLayout:
    return CacheLayout(groups, scheduler_block_size=sbs, hash_block_size=hbs, **kw)


# ---------------------------------------------------------------------------
# Validation rules
# ---------------------------------------------------------------------------


def test_block_size_not_multiple_of_hash_size_names_group():
    with pytest.raises(ValueError, match=r"group 1 \('swa'\).*block_size \(6\)"):
        make([Group(FullAttention(8)), Group(SlidingWindow(6, 8), name="swa")],
             sbs=24, hbs=4)  # fmt: skip


def test_scheduler_not_multiple_of_hash_size():
    with pytest.raises(ValueError, match=r"scheduler_block_size \(6\).*hash_block_size \(4\)"):  # fmt: skip
        make([Group(FullAttention(4))], sbs=6, hbs=4)


def test_scheduler_not_multiple_of_group_block_size_names_group():
    # 8 divides by the hash size 4, but the scheduler block 12 is not a multiple.
    with pytest.raises(ValueError, match=r"group 0 .*scheduler_block_size \(12\).*\(8\)"):  # fmt: skip
        make([Group(FullAttention(8))], sbs=12, hbs=4)


@pytest.mark.parametrize("hbs", [0, -4, True, 4.0])
def test_non_positive_or_non_int_hash_block_size(hbs):
    with pytest.raises(ValueError, match="hash_block_size"):
        make([Group(FullAttention(4))], sbs=4, hbs=hbs)


@pytest.mark.parametrize("sbs", [0, -16, 16.0])
def test_non_positive_scheduler_block_size(sbs):
    with pytest.raises(ValueError, match="scheduler_block_size"):
        make([Group(FullAttention(4))], sbs=sbs, hbs=4)


@pytest.mark.parametrize(
    "spec, field",
    [
        (FullAttention(0), "block_size"),
        (Mamba(-4), "block_size"),
        (SlidingWindow(4, 0), "sliding_window"),
        (SlidingWindow(4, 8, extra_retained_tokens=-1), "extra_retained_tokens"),
        (ChunkedLocal(16, 0), "attention_chunk_size"),
    ],
)
def test_non_positive_spec_sizes_name_group(spec, field):
    with pytest.raises(ValueError, match=rf"group 1 .*{field}"):
        make([Group(FullAttention(16)), Group(spec)])


def test_non_positive_block_size_checked_even_for_scratch_groups():
    # Exempt from the divisibility rules, not from being a positive int.
    with pytest.raises(ValueError, match="group 1 .*block_size"):
        make(
            [Group(FullAttention(16)), Group(FullAttention(0), prefix_cacheable=False)]
        )


def test_chunked_local_flagged_eagle_names_group():
    with pytest.raises(ValueError, match=r"group 1 .*ChunkedLocal.*EAGLE"):
        make([Group(FullAttention(16)), Group(ChunkedLocal(16, 32), eagle=True)])


def test_chunked_local_promoted_by_merged_eagle_member():
    # Group 2 is flagged; it merges with group 1, so the SpecGroup is EAGLE.
    with pytest.raises(ValueError, match=r"group 1 .*EAGLE"):
        make([Group(FullAttention(16)), Group(ChunkedLocal(16, 32)),
              Group(ChunkedLocal(16, 32), eagle=True)])  # fmt: skip


def test_chunked_local_via_use_eagle_fallback():
    # use_eagle with no group flagged promotes every SpecGroup.
    with pytest.raises(ValueError, match=r"group 1 .*EAGLE"):
        make([Group(FullAttention(16)), Group(ChunkedLocal(16, 32))], use_eagle=True)


def test_chunked_local_fine_when_another_group_is_the_eagle_group():
    layout = make(
        [Group(FullAttention(16), eagle=True), Group(ChunkedLocal(16, 32))],
        use_eagle=True,
    )
    assert layout.eagle_group_ids == frozenset({0})


def test_chunked_local_block_size_must_equal_scheduler_alignment():
    with pytest.raises(ValueError, match=r"group 1 .*block_size \(8\).*alignment \(16"):
        make([Group(FullAttention(16)), Group(ChunkedLocal(8, 32))])


def test_chunked_local_block_size_must_equal_hash_alignment_with_partial_hits():
    with pytest.raises(ValueError, match=r"group 1 .*alignment \(4: hash_block_size"):
        make([Group(FullAttention(16)), Group(ChunkedLocal(16, 32))],
             partial_hash_hits=True)  # fmt: skip
    ok = make([Group(FullAttention(16)), Group(ChunkedLocal(4, 32))],
              partial_hash_hits=True)  # fmt: skip
    assert ok.alignment == 4


def test_scratch_chunked_local_is_exempt_from_chunked_rules():
    layout = make(
        [Group(FullAttention(16)),
         Group(ChunkedLocal(7, 32), eagle=True, prefix_cacheable=False)],
        use_eagle=True,
    )  # fmt: skip
    assert [sg.group_ids for sg in layout.spec_groups] == [(0,)]


def test_empty_layout():
    with pytest.raises(ValueError, match="at least one group"):
        make([])


def test_no_prefix_cacheable_group():
    with pytest.raises(ValueError, match="prefix-cacheable"):
        make([Group(FullAttention(16), prefix_cacheable=False)])


@pytest.mark.parametrize("ri", [-16, 8, 24, 16.0, True, "32"])
def test_bad_retention_interval(ri):
    with pytest.raises(ValueError, match="retention_interval"):
        make([Group(FullAttention(16))], retention_interval=ri)


@pytest.mark.parametrize("ri", [None, 0, 16, 48])
def test_good_retention_interval(ri):
    assert (
        make([Group(FullAttention(16))], retention_interval=ri).retention_interval == ri
    )


@pytest.mark.parametrize("bad", ["full", FullAttention, None, 16])
def test_wrong_spec_type_names_group(bad):
    # TypeError (a wrong Python type), still naming the group.
    with pytest.raises(TypeError, match=r"group 1 .*spec must be one of"):
        make([Group(FullAttention(16)), Group(bad)])


def test_non_group_entry():
    with pytest.raises(TypeError, match=r"groups\[0\] must be a Group"):
        make([FullAttention(16)])


def test_unhashable_tag_names_group():
    with pytest.raises(ValueError, match="group 0 .*tag"):
        make([Group(FullAttention(16, tag=["mla"]))])


# ---------------------------------------------------------------------------
# Derived attributes
# ---------------------------------------------------------------------------


def test_equal_specs_merge_into_one_spec_group():
    layout = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8)),
                   Group(FullAttention(16))])  # fmt: skip
    assert [sg.group_ids for sg in layout.spec_groups] == [(0, 2), (1,)]


def test_coverage_spec_widens_window_by_extra_retained_tokens():
    spec = SlidingWindow(16, 100, extra_retained_tokens=28)
    assert coverage_spec(spec) == SlidingWindow(16, 128)
    assert coverage_spec(FullAttention(16)) == FullAttention(16)
    assert coverage_spec(SlidingWindow(16, 128)) == SlidingWindow(16, 128)


def test_coverage_equal_sliding_windows_merge():
    layout = make(
        [Group(FullAttention(16)),
         Group(SlidingWindow(16, 100, extra_retained_tokens=28)),
         Group(SlidingWindow(16, 128))],
    )  # fmt: skip
    assert len(layout.spec_groups) == 2
    sg = layout.spec_groups[1]
    assert sg.group_ids == (1, 2)
    assert sg.spec == SlidingWindow(16, 128)  # the coverage spec, extra folded in
    assert layout.coverage_specs[1] == SlidingWindow(16, 128)


def test_different_coverage_windows_do_not_merge():
    layout = make([Group(SlidingWindow(16, 100, extra_retained_tokens=27)),
                   Group(SlidingWindow(16, 128))])  # fmt: skip
    assert [sg.group_ids for sg in layout.spec_groups] == [(0,), (1,)]


def test_tags_keep_equal_specs_apart():
    layout = make([Group(FullAttention(16, tag="mla")), Group(FullAttention(16, tag="mha")),
                   Group(FullAttention(16, tag="mla"))])  # fmt: skip
    assert [sg.group_ids for sg in layout.spec_groups] == [(0, 2), (1,)]


def test_full_attention_spec_groups_come_first_rest_in_group_order():
    layout = make(
        [Group(SlidingWindow(4, 8)), Group(Mamba(16)), Group(FullAttention(16)),
         Group(SlidingWindow(8, 8)), Group(FullAttention(8))],
    )  # fmt: skip
    assert [sg.group_ids for sg in layout.spec_groups] == [(2,), (4,), (0,), (1,), (3,)]
    assert [sg.kind for sg in layout.spec_groups] == [
        "full", "full", "sliding_window", "mamba", "sliding_window",
    ]  # fmt: skip


def test_eagle_bit_of_any_member_promotes_the_merged_group():
    layout = merged_swa_eagle_layout()
    full, swa = layout.spec_groups
    assert swa.group_ids == (1, 2) and swa.use_eagle
    # A group is flagged, so the use_eagle fallback does not touch full attention.
    assert not full.use_eagle
    assert layout.eagle_group_ids == frozenset({1, 2})


def test_eagle_flag_counts_without_layout_use_eagle():
    # vLLM takes is_eagle_group per group regardless of the layout-wide flag.
    layout = make([Group(FullAttention(16), eagle=True), Group(SlidingWindow(4, 8))])
    assert layout.eagle_group_ids == frozenset({0})


def test_use_eagle_fallback_flags_every_spec_group():
    layout = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8)),
                   Group(Mamba(16))], use_eagle=True)  # fmt: skip
    assert all(sg.use_eagle for sg in layout.spec_groups)
    assert layout.eagle_group_ids == frozenset({0, 1, 2})


def test_no_eagle_without_flag_or_use_eagle():
    layout = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8))])
    assert layout.eagle_group_ids == frozenset()
    assert layout.proof_margins == {}


def test_scratch_group_flag_does_not_suppress_use_eagle_fallback():
    # Scratch groups are skipped before merging, so their flag is invisible.
    layout = make(
        [Group(FullAttention(16)), Group(SlidingWindow(4, 8)),
         Group(FullAttention(3), eagle=True, prefix_cacheable=False)],
        use_eagle=True,
    )  # fmt: skip
    assert layout.eagle_group_ids == frozenset({0, 1})


def test_proof_margins():
    layout = make(
        [Group(FullAttention(16)), Group(SlidingWindow(8, 32)), Group(Mamba(16)),
         Group(FullAttention(4, tag="b"))],
        use_eagle=True, partial_hash_hits=True,
    )  # fmt: skip
    # Full attention probes hash units when partial hits are on: one hash unit.
    # SWA is never fine-grained: one block. Block == hash unit: one block.
    # Mamba never peeks, so it has no margin at all.
    assert layout.proof_margins == {0: 4, 1: 8, 3: 4}
    assert 2 not in layout.proof_margins and 2 in layout.eagle_group_ids


def test_proof_margins_without_partial_hits_are_one_block():
    layout = make([Group(FullAttention(16)), Group(Mamba(8))], use_eagle=True)
    assert layout.proof_margins == {0: 16}


def test_eagle_proof_margin_function():
    assert eagle_proof_margin(16, 4, True) == 4
    assert eagle_proof_margin(16, 4, False) == 16
    assert eagle_proof_margin(4, 4, True) == 4


def test_alignment_and_align():
    assert make([Group(FullAttention(16))]).alignment == 16
    partial = make([Group(FullAttention(16))], partial_hash_hits=True)
    assert partial.alignment == 4
    assert partial.align(23) == 20
    assert make([Group(FullAttention(16))]).align(47) == 32


def test_is_simple_hybrid():
    assert make([Group(SlidingWindow(4, 8)), Group(FullAttention(16))]).is_simple_hybrid
    assert make([Group(FullAttention(16)), Group(Mamba(16))]).is_simple_hybrid
    assert not make([Group(SlidingWindow(4, 8)), Group(Mamba(16))]).is_simple_hybrid
    assert not make([Group(FullAttention(16))]).is_simple_hybrid
    assert not make([Group(FullAttention(16)), Group(Mamba(16)),
                     Group(SlidingWindow(4, 8))]).is_simple_hybrid  # fmt: skip


def test_scratch_groups_skipped_and_exempt_from_size_rules():
    # Block size 7 divides neither the hash size nor the scheduler block.
    layout = make(
        [Group(Mamba(7), prefix_cacheable=False), Group(FullAttention(16)),
         Group(SlidingWindow(7, 9), prefix_cacheable=False)],
    )  # fmt: skip
    assert [sg.group_ids for sg in layout.spec_groups] == [(1,)]
    assert layout.num_groups == 3
    # mamba_group_ids lists every Mamba group (vLLM: all kv_cache_groups).
    assert layout.mamba_group_ids == frozenset({0})


def test_layout_equality_and_hash():
    a = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8))], use_eagle=True)
    b = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8))], use_eagle=True)
    c = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8))])
    assert a == b and hash(a) == hash(b)
    assert a != c


@settings(max_examples=300)
@given(layouts())
def test_strategy_layouts_are_valid_and_varied(layout: CacheLayout):
    """layouts() builds valid layouts directly: the invariants the model
    enforces hold on every one of them."""
    hbs, sbs = layout.hash_block_size, layout.scheduler_block_size
    assert sbs % hbs == 0 and sbs <= 256
    assert 1 <= layout.num_groups <= 5
    for sg in layout.spec_groups:
        assert sg.block_size % hbs == 0 and sbs % sg.block_size == 0
        if sg.kind == "chunked_local":
            assert not sg.use_eagle and sg.block_size == layout.alignment
        # Members of a SpecGroup share one coverage spec.
        assert {layout.coverage_specs[g] for g in sg.group_ids} == {sg.spec}
    # A SpecGroup is EAGLE iff a member is flagged or the fallback applies.
    flagged = any(layout.groups[g].eagle for sg in layout.spec_groups
                  for g in sg.group_ids)  # fmt: skip
    for sg in layout.spec_groups:
        member = any(layout.groups[g].eagle for g in sg.group_ids)
        assert sg.use_eagle == (member or (layout.use_eagle and not flagged))


def test_spec_group_ids_compare_equal_to_lists_and_tuples():
    """vLLM keeps a SpecGroup's group ids in a list; either spelling matches."""
    layout = merged_swa_eagle_layout()
    ids = [sg.group_ids for sg in layout.spec_groups]
    assert ids == [[0], [1, 2]]
    assert ids == [(0,), (1, 2)]
    assert ids != [[0], [2, 1]]
    assert {layout.spec_groups[1].group_ids} == {(1, 2)}


def test_spec_group_kind_comes_from_the_registry():
    from kvhit.coordinator.kinds import KINDS_BY_NAME

    layout = make(
        [
            Group(Mamba(16)),
            Group(SlidingWindow(4, 8), eagle=True),
            Group(FullAttention(16)),
            Group(ChunkedLocal(4, 32)),
        ],
        hbs=4,
        partial_hash_hits=True,
        use_eagle=True,
    )
    for sg in layout.spec_groups:
        assert sg.spec_kind is KINDS_BY_NAME[sg.kind]
        assert sg.supports_fine_grained == sg.spec_kind.fine_grained
    # Full attention first (is_full_attention), then group order.
    assert [sg.kind for sg in layout.spec_groups] == [
        "full",
        "mamba",
        "sliding_window",
        "chunked_local",
    ]
    # Mamba takes no proof margin even in an EAGLE layout.
    assert 0 not in layout.proof_margins and 1 in layout.proof_margins


def test_layout_is_immutable_and_hash_stable():
    import copy
    import dataclasses
    import pickle

    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=16)), Group(Mamba(block_size=16))],
        scheduler_block_size=16,
        hash_block_size=16,
        use_eagle=True,
    )
    before = hash(layout)
    cache = {layout: "plan"}
    for name, value in (
        ("use_eagle", False),
        ("hash_block_size", 4),
        ("groups", ()),
        ("spec_groups", ()),
        ("new_attribute", 1),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError, match=name):
            setattr(layout, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError, match="use_eagle"):
        del layout.use_eagle
    with pytest.raises(TypeError):
        layout.proof_margins[0] = 99  # derived values are read-only too
    assert layout.use_eagle and hash(layout) == before and cache[layout] == "plan"
    for clone in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout)):
        assert clone == layout and hash(clone) == before
        with pytest.raises(dataclasses.FrozenInstanceError):
            clone.use_eagle = False
