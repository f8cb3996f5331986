"""The scalar reference against hand-computed vLLM 0.33.0 behaviour.

Expected values are worked out from vLLM's code (manager classmethods in
``v1/core/single_type_kv_cache_manager.py``, the coordinator loop in
``.../mooncake/store/coordinator.py``, the worker's ``lookup``), not from the
reference; each test says which rule it pins down.
"""

from __future__ import annotations

import random

import pytest
from helpers import merged_swa_eagle_layout
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import case, chained_hashes, layouts, saved_keys, store_from_masks

from kvhit import CacheLayout, ChunkedLocal, FullAttention, Group, Mamba, SlidingWindow
from kvhit.coordinator.reference import ReferenceCoordinator, replay_boundaries
from kvhit.kernels.contract import cdiv

H = chained_hashes(7, 64)  # one shared prompt; tests slice it


def make(groups, sbs=4, hbs=4, **kw) -> CacheLayout:
    return CacheLayout(groups, scheduler_block_size=sbs, hash_block_size=hbs, **kw)


def keys(group: int, block_size: int, blocks, hbs: int = 4, hashes=H) -> set:
    """Store keys of ``blocks`` (chunk indices) of a group: each chunk is keyed
    by the last hash unit inside it."""
    scale = block_size // hbs
    return {(group, hashes[(b + 1) * scale - 1]) for b in blocks}


def units(group: int, idxs, hashes=H) -> set:
    """Store keys of raw hash units (fine-grained probes)."""
    return {(group, hashes[i]) for i in idxs}


def hit(layout, n_hashes, max_length, exists, apply_eagle=True):
    return ReferenceCoordinator(layout).find_longest_cache_hit(
        H[:n_hashes], max_length, exists, apply_eagle=apply_eagle
    )


# ---------------------------------------------------------------------------
# Seed regressions (ARCHITECTURE.md)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag_full", [False, True])
def test_seed1_mamba_gets_no_eagle_margin(flag_full):
    """Full(16) + Mamba(16), EAGLE, 4 hashes all present, max_length 64 -> 48.

    Full attention matches 64 and drops a block (48). A Mamba peek to 64 would
    find the state at 64, never drop it, and the loop would stop at 64 (#43559).
    """
    layout = make([Group(FullAttention(16), eagle=flag_full), Group(Mamba(16))],
                  sbs=16, hbs=16, use_eagle=True)  # fmt: skip
    hashes = H[:4]
    exists = {(g, h) for g in (0, 1) for h in hashes}
    masks, length = ReferenceCoordinator(layout).find_longest_cache_hit(
        hashes, 64, exists
    )
    assert length == 48
    assert masks == ([True] * 3, [False, False, True])


def test_seed2_merged_swa_eagle_store_then_lookup():
    layout = merged_swa_eagle_layout()
    assert layout.eagle_group_ids == frozenset({1, 2})
    ref = ReferenceCoordinator(layout)
    masks = ref.store_mask(128, num_prompt_tokens=130)
    assert masks[1] == masks[2]
    # Dense tails (retention None), EAGLE shift 1, need 3, 4 blocks per 64.
    assert masks == (None, [False, False, True, True, True, False, True, True],
                     [False, False, True, True, True, False, True, True])  # fmt: skip
    hashes = H[:8]
    exists = store_from_masks(layout, hashes, 128, masks)
    assert ref.find_longest_cache_hit(hashes, 128, exists)[1] == 64
    assert ref.lookup(128, hashes, exists) == 64


def test_seed3_deepseek_v4_flash_five_groups():
    layout = make(
        [Group(FullAttention(256)), Group(SlidingWindow(64, 128)),
         Group(SlidingWindow(64, 128), eagle=True), Group(SlidingWindow(4, 8)),
         Group(SlidingWindow(8, 128))],
        sbs=256, hbs=4, use_eagle=True,
    )  # fmt: skip
    ref = ReferenceCoordinator(layout)
    hashes = chained_hashes(3, 192)
    masks = ref.store_mask(768)
    exists = store_from_masks(layout, hashes, 768, masks)
    assert ref.lookup(768, hashes, exists) == 512
    assert ref.find_longest_cache_hit(hashes, 768, exists)[1] == 512


# ---------------------------------------------------------------------------
# Full attention
# ---------------------------------------------------------------------------


def test_full_first_miss_stops_the_run():
    layout = make([Group(FullAttention(4))])
    exists = keys(0, 4, [0, 1, 2, 4, 5, 6, 7])  # block 3 evicted
    masks, length = hit(layout, 8, 32, exists)
    assert (masks, length) == (([True] * 3,), 12)


def test_full_block_keyed_by_last_hash_unit():
    layout = make([Group(FullAttention(8))], sbs=8)
    assert hit(layout, 8, 32, units(0, [1, 3]))[1] == 16  # H[1], H[3]: blocks 0, 1
    assert hit(layout, 8, 32, units(0, [0, 2, 4, 6]))[1] == 0  # first units: no
    assert hit(layout, 8, 32, units(0, range(8)))[1] == 32


def test_full_fine_grained_tail_probe_longest_first():
    layout = make([Group(FullAttention(16))], sbs=16, partial_hash_hits=True)
    # Block 0 (H[3]) whole; block 1's key H[7] missing; interior H[4], H[5].
    exists = units(0, [3, 4, 5])
    masks, length = hit(layout, 8, 32, exists)
    assert (masks, length) == (([True, True],), 24)  # H[5] wins over H[4]
    # max_length 20 caps the probe at unit 4.
    assert hit(layout, 8, 20, exists)[1] == 20
    assert hit(layout, 8, 19, exists)[1] == 16
    # Interior units below a missing whole block never count.
    assert hit(layout, 8, 32, units(0, [0, 1, 2]))[1] == 12
    assert hit(layout, 8, 32, units(0, [5, 6]))[1] == 0


def test_full_fine_grained_probe_is_bounded_by_the_hashes():
    layout = make([Group(FullAttention(16))], sbs=16, partial_hash_hits=True)
    # 6 hashes: block 1 has only units 4, 5; max_length far beyond is fine.
    assert hit(layout, 6, 1000, units(0, [3, 4, 5]))[1] == 24


def test_full_eagle_drops_one_block():
    layout = make([Group(FullAttention(16))], sbs=16, hbs=16, use_eagle=True)
    exists = keys(0, 16, range(4), hbs=16)
    assert hit(layout, 4, 64, exists) == (([True] * 3,), 48)
    assert hit(layout, 4, 64, exists, apply_eagle=False)[1] == 64
    assert hit(layout, 4, 64, set()) == (([],), 0)  # nothing to drop


def test_full_eagle_fine_grained_drops_one_hash_unit():
    layout = make([Group(FullAttention(16))], sbs=16, use_eagle=True,
                  partial_hash_hits=True)  # fmt: skip
    masks, length = hit(layout, 8, 32, units(0, range(8)))
    assert (masks, length) == (([True, True],), 28)  # tail block kept: cdiv


def test_full_eagle_drop_then_realign_to_scheduler_block():
    # Drop min(alignment, block) = 16, then round 112 down to 64.
    layout = make([Group(FullAttention(16))], sbs=64, hbs=16, use_eagle=True)
    masks, length = hit(layout, 8, 128, keys(0, 16, range(8), hbs=16))
    assert (masks, length) == (([True] * 4,), 64)


def test_full_merged_group_needs_every_member():
    layout = make([Group(FullAttention(4)), Group(FullAttention(4))])
    exists = keys(0, 4, range(8)) | keys(1, 4, [0, 1, 3, 4])
    assert hit(layout, 8, 32, exists) == (([True] * 2, [True] * 2), 8)


# ---------------------------------------------------------------------------
# Sliding window
# ---------------------------------------------------------------------------


def test_swa_rightmost_run_of_window_blocks():
    # need = cdiv(8 - 1, 4) = 2; runs: 0-2, 5, 7-8 -> the run ending at 8.
    layout = make([Group(SlidingWindow(4, 8))])
    exists = keys(0, 4, [0, 1, 2, 5, 7, 8])
    masks, length = hit(layout, 10, 40, exists)
    assert length == 36
    assert masks == ([False] * 7 + [True, True],)


def test_swa_window_one_block_needs_one_block():
    # need = cdiv(5 - 1, 4) = 1.
    layout = make([Group(SlidingWindow(4, 5))])
    assert hit(layout, 10, 40, keys(0, 4, [0, 1, 2, 5, 8])) == (
        ([False] * 8 + [True],), 36)  # fmt: skip


def test_swa_short_run_from_token_zero():
    # need = cdiv(11, 4) = 3; no run of 3, but blocks 0-1 reach token 0.
    layout = make([Group(SlidingWindow(4, 12))])
    assert hit(layout, 10, 40, keys(0, 4, [0, 1, 5])) == (([True, True],), 8)
    assert hit(layout, 10, 40, keys(0, 4, [1, 2, 5]))[1] == 0


def test_swa_eagle_needs_one_more_block_then_pops_it():
    layout = make([Group(SlidingWindow(4, 8))], use_eagle=True)  # need 2 + 1
    masks, length = hit(layout, 10, 40, keys(0, 4, range(10)))
    assert (masks, length) == (([False] * 7 + [True, True],), 36)
    # Only a run of 2 at the right end: not enough under EAGLE.
    assert hit(layout, 10, 40, keys(0, 4, [0, 1, 2, 3, 4, 8, 9]))[1] == 16
    assert hit(layout, 10, 40, keys(0, 4, range(10)), apply_eagle=False)[1] == 40


def test_swa_alignment_skip_of_unaligned_rightmost_blocks():
    # Block 4, scheduler 8: a run may only end where (i + 1) * 4 % 8 == 0.
    layout = make([Group(SlidingWindow(4, 8))], sbs=8)
    masks, length = hit(layout, 10, 40, keys(0, 4, range(7)))
    assert length == 24  # block 6 (ends at 28) is skipped
    assert masks == ([False] * 4 + [True, True],)


def test_swa_eagle_alignment_skip_uses_post_pop_length():
    # Under EAGLE the check is on the length after the pop: i * 4 % 8 == 0.
    layout = make([Group(SlidingWindow(4, 8))], sbs=8, use_eagle=True)
    masks, length = hit(layout, 10, 40, keys(0, 4, range(10)))
    assert length == 32
    assert masks == ([False] * 6 + [True, True],)


def test_swa_eagle_pop_then_realign_on_short_run():
    # need = cdiv(23, 4) + 1 = 7. Run from 0 is 5 blocks (20 tokens): re-align
    # to 16, EAGLE pop to 12, re-align again to 8.
    layout = make([Group(SlidingWindow(4, 24))], sbs=8, use_eagle=True)
    assert hit(layout, 10, 40, keys(0, 4, range(5))) == (([True, True],), 8)
    # Without EAGLE (need 6) the same store gives the aligned run: 16.
    plain = make([Group(SlidingWindow(4, 24))], sbs=8)
    assert hit(plain, 10, 40, keys(0, 4, range(5)))[1] == 16


def test_swa_eagle_match_at_run_start():
    layout = make([Group(SlidingWindow(4, 16))], sbs=8, use_eagle=True)  # need 5
    assert hit(layout, 10, 40, keys(0, 4, range(5))) == (([True] * 4,), 16)


def test_swa_uses_block_view_never_fine_grained():
    # SWA(8) with hash 4 and partial hits: keyed by H[1], H[3], ...
    layout = make([Group(SlidingWindow(8, 9))], sbs=8, partial_hash_hits=True)
    assert hit(layout, 8, 32, units(0, [1, 3, 5, 7]))[1] == 32
    assert hit(layout, 8, 32, units(0, [0, 2, 4, 6]))[1] == 0


def test_swa_merged_members_all_needed():
    layout = make([Group(FullAttention(4)), Group(SlidingWindow(4, 8)),
                   Group(SlidingWindow(4, 8))])  # fmt: skip
    exists = keys(0, 4, range(10)) | keys(1, 4, range(10)) | keys(2, 4, range(9))
    masks, length = hit(layout, 10, 40, exists)
    assert length == 36  # group 2 lacks block 9
    assert masks[1] == masks[2] == [False] * 7 + [True, True]


def test_swa_too_few_hashes_is_a_value_error():
    layout = make([Group(SlidingWindow(4, 8))])
    with pytest.raises(ValueError, match="needs more block hashes"):
        hit(layout, 4, 20, None)
    with pytest.raises(ValueError, match="max_length must be >= 0"):
        hit(layout, 4, -1, None)


# ---------------------------------------------------------------------------
# Mamba
# ---------------------------------------------------------------------------


def test_mamba_rightmost_aligned_state():
    layout = make([Group(Mamba(4))], sbs=8)
    # States after 12, 24 and 28 tokens; 28 is not on the 8-token alignment.
    masks, length = hit(layout, 10, 40, keys(0, 4, [2, 5, 6]))
    assert (masks, length) == (([False] * 5 + [True],), 24)


def test_mamba_never_drops_a_block_even_under_eagle():
    for use_eagle in (False, True):
        layout = make([Group(Mamba(4))], sbs=8, use_eagle=use_eagle)
        assert hit(layout, 10, 40, keys(0, 4, [2, 5, 6]))[1] == 24


def test_mamba_fine_grained_any_hash_unit():
    layout = make([Group(Mamba(16))], sbs=16, partial_hash_hits=True)
    masks, length = hit(layout, 10, 40, units(0, [2, 5]))
    assert (masks, length) == (([False, True],), 24)
    assert hit(layout, 10, 23, units(0, [2, 5])) == (([True],), 12)


def test_mamba_not_ahead_of_attention_under_eagle():
    """No margin: full attention ends at 48 after its drop, and the only Mamba
    state (at 64) is unverified, so the hit is 0, not 64."""
    layout = make([Group(FullAttention(16)), Group(Mamba(16))],
                  sbs=16, hbs=16, use_eagle=True)  # fmt: skip
    exists = keys(0, 16, range(4), hbs=16) | keys(1, 16, [3], hbs=16)
    assert hit(layout, 4, 64, exists) == (([], []), 0)
    exists |= keys(1, 16, [1], hbs=16)  # a state at 32 is under 48
    assert hit(layout, 4, 64, exists) == (([True, True], [False, True]), 32)


# ---------------------------------------------------------------------------
# Chunked local
# ---------------------------------------------------------------------------


def test_chunked_local_null_prefix_then_run():
    # vLLM's docstring: chunk 8, block 4. max 15: blocks 0-1 are before the
    # chunk (null, computed), block 2 is probed.
    layout = make([Group(ChunkedLocal(4, 8))])
    assert hit(layout, 4, 15, keys(0, 4, [2])) == (([False, False, True],), 12)
    assert hit(layout, 4, 15, set()) == (([False, False],), 8)
    # max 16: the chunk boundary is at 16, so nothing needs to be present.
    assert hit(layout, 4, 16, set()) == (([False] * 4,), 16)
    assert hit(layout, 4, 0, set()) == (([],), 0)


def test_chunked_local_run_stops_at_first_miss():
    layout = make([Group(ChunkedLocal(4, 16))])
    assert hit(layout, 8, 28, keys(0, 4, [4, 6]))[1] == 20


# ---------------------------------------------------------------------------
# Convergence loop
# ---------------------------------------------------------------------------


def test_convergence_over_several_rounds():
    """Full(4) + SWA(4, w8) + Mamba(4): the Mamba state pulls the hit to 20,
    the SWA run at 20 is broken (block 4 missing) so SWA falls to 16, Mamba
    then to 8, and SWA/Mamba agree at 8 in the third round."""
    layout = make([Group(FullAttention(4)), Group(SlidingWindow(4, 8)),
                   Group(Mamba(4))])  # fmt: skip
    assert not layout.is_simple_hybrid
    exists = (keys(0, 4, range(10)) | keys(1, 4, [0, 1, 2, 3, 8, 9])
              | keys(2, 4, [1, 4]))  # fmt: skip
    masks, length = hit(layout, 10, 40, exists)
    assert length == 8
    assert masks == ([True, True], [True, True], [False, True])


def test_simple_hybrid_single_round():
    layout = make([Group(FullAttention(4)), Group(SlidingWindow(4, 8))])
    assert layout.is_simple_hybrid
    exists = keys(0, 4, range(6)) | keys(1, 4, [0, 1, 3, 4, 8, 9])
    # Full stops at 24; SWA at 24 finds the run 3-4 ending at 20.
    masks, length = hit(layout, 10, 40, exists)
    assert length == 20
    assert masks == ([True] * 5, [False, False, False, True, True])


def test_eagle_verified_cleared_when_a_later_group_shrinks_the_hit():
    """Full(4) + SWA(4, w4, EAGLE) + Mamba(4). Round 1: SWA peeks to 40 and
    drops to 36; Mamba (state at 28) shrinks the hit, which clears SWA's
    verification. Round 2: SWA must re-prove with a peek block at 28, which is
    missing, so it drops to 24; Mamba agrees at 24. (Keeping the verification
    would accept 28.)"""
    layout = make([Group(FullAttention(4)), Group(SlidingWindow(4, 4), eagle=True),
                   Group(Mamba(4))], use_eagle=True)  # fmt: skip
    assert layout.eagle_group_ids == frozenset({1})
    exists = (keys(0, 4, range(10)) | keys(1, 4, set(range(10)) - {7})
              | keys(2, 4, [5, 6]))  # fmt: skip
    masks, length = hit(layout, 10, 40, exists)
    assert length == 24
    assert masks == ([True] * 6, [False] * 5 + [True], [False] * 5 + [True])


def test_eagle_peek_bounded_by_hashes():
    # Full(4) non-EAGLE + SWA(4, w8) EAGLE: the peek past 32 needs block 8 but
    # only 8 hashes exist, so the bound is clipped to 32: 8 blocks, pop -> 28.
    layout = make([Group(FullAttention(4)), Group(SlidingWindow(4, 8), eagle=True)],
                  use_eagle=True)  # fmt: skip
    exists = keys(0, 4, range(8)) | keys(1, 4, range(8))
    assert hit(layout, 8, 32, exists)[1] == 28
    assert hit(layout, 9, 32, exists | keys(1, 4, [8]))[1] == 32


def test_non_prefix_cacheable_groups_get_empty_masks():
    layout = make([Group(FullAttention(4)), Group(Mamba(7), prefix_cacheable=False),
                   Group(SlidingWindow(4, 8))])  # fmt: skip
    exists = keys(0, 4, range(4)) | keys(2, 4, range(4))
    masks, length = hit(layout, 4, 16, exists)
    assert length == 16
    assert masks[1] == []
    single = make([Group(FullAttention(4)), Group(Mamba(7), prefix_cacheable=False)])
    assert hit(single, 4, 16, keys(0, 4, range(4))) == (([True] * 4, []), 16)


def test_exists_none_means_every_key_present():
    layout = make([Group(FullAttention(4)), Group(SlidingWindow(4, 8))], use_eagle=True)
    assert hit(layout, 8, 32, None)[1] == 28


# ---------------------------------------------------------------------------
# Store / lookup masks and replay boundaries
# ---------------------------------------------------------------------------


def test_replay_boundaries():
    assert replay_boundaries(130, 64, use_eagle=False) == (129,)
    assert replay_boundaries(130, 64, use_eagle=True) == (64,)
    # Block-aligned prompt: resend (127 -> 64 - 64) and extension (128 - 64).
    assert replay_boundaries(128, 64, use_eagle=True) == (0, 64)
    assert replay_boundaries(10, 64, use_eagle=True) == (0,)


SWA_LAYOUT = [Group(FullAttention(16)), Group(SlidingWindow(4, 8)), Group(Mamba(8))]


def test_store_mask_dense_retention_none():
    ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16))
    # need 2, 4 blocks per 16-token segment: the last 2 of each segment.
    assert ref.store_mask(32) == (None, [False, False, True, True] * 2, [False] * 4)


def test_store_mask_retention_zero_keeps_only_replay_boundaries():
    ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16, retention_interval=0))
    assert ref.store_mask(32) == (None, [False] * 8, [False] * 4)
    # Boundary 29 -> aligned 16 -> blocks [2, 4).
    assert ref.store_mask(32, num_prompt_tokens=30) == (
        None, [False, False, True, True] + [False] * 4, [False] * 4)  # fmt: skip


def test_store_mask_retention_interval_segments_plus_boundaries():
    ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16, retention_interval=32))
    expected = [False] * 16
    for i in (6, 7, 14, 15):  # last 2 blocks of each 32-token segment
        expected[i] = True
    assert ref.store_mask(64)[1] == expected
    # Boundary 59 -> aligned 48 -> blocks 10, 11.
    expected[10] = expected[11] = True
    assert ref.store_mask(64, num_prompt_tokens=60)[1] == expected


def test_store_mask_eagle_shift():
    ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16, use_eagle=True))
    # need 3, shift 1: blocks i >= 1 with (i - 1) % 4 >= 1.
    assert ref.store_mask(32)[1] == [False, False, True, True, True, False, True, True]


def test_store_mask_window_covering_a_segment_is_dense():
    ref = ReferenceCoordinator(make([Group(SlidingWindow(4, 32))], sbs=16))
    assert ref.store_mask(32) == (None,)  # need 8 >= 4 blocks per segment


def test_store_mask_start_token():
    ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16))
    assert ref.store_mask(32, start_token=16) == (None, [False, False, True, True],
                                                  [False, False])  # fmt: skip
    # cdiv: a partly saved block is saved again from its start.
    assert ref.store_mask(32, start_token=17) == (None, [False, True, True], [False])
    assert ref.store_mask(32, start_token=99) == (None, [], [])


def test_store_mask_mamba_all_false_even_with_retention():
    for ri in (None, 0, 16, 32):
        ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16, retention_interval=ri))
        assert ref.store_mask(32, num_prompt_tokens=31)[2] == [False] * 4


def test_store_mask_rejects_unaligned_length():
    ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16))
    with pytest.raises(ValueError, match="multiple of the hit alignment"):
        ref.store_mask(24)
    with pytest.raises(ValueError, match="multiple of the hit alignment"):
        ref.lookup_mask(8)


def test_lookup_mask_is_dense_and_ignores_retention():
    ref = ReferenceCoordinator(make(SWA_LAYOUT, sbs=16, retention_interval=0))
    # Mamba: every state is a candidate (None); SWA: the dense tails.
    assert ref.lookup_mask(32) == (None, [False, False, True, True] * 2, None)


def test_store_from_masks_keys():
    layout = make(SWA_LAYOUT, sbs=16)
    ref = ReferenceCoordinator(layout)
    got = store_from_masks(layout, H[:8], 32, ref.store_mask(32))
    assert got == keys(0, 16, [0, 1]) | keys(1, 4, [2, 3, 6, 7])
    got = store_from_masks(layout, H[:8], 32, ref.store_mask(32, start_token=16),
                           start_token=16)  # fmt: skip
    assert got == keys(0, 16, [1]) | keys(1, 4, [6, 7])


# ---------------------------------------------------------------------------
# The worker's lookup
# ---------------------------------------------------------------------------


def test_lookup_aligns_down():
    ref = ReferenceCoordinator(make([Group(FullAttention(16))], sbs=16, hbs=16))
    exists = keys(0, 16, range(4), hbs=16)
    assert ref.align_lookup_length(40) == 32
    assert ref.lookup(40, H[:4], exists) == 32


def test_lookup_rederives_below_the_last_token():
    ref = ReferenceCoordinator(make([Group(FullAttention(16))], sbs=16, hbs=16))
    exists = keys(0, 16, range(4), hbs=16)
    assert ref.lookup(64, H[:4], exists) == 48  # whole prompt -> 63 -> 48
    assert ref.lookup(65, H[:4], exists) == 64
    assert ref.lookup(16, H[:4], exists) == 0  # 15 aligns to 0
    assert ref.lookup(0, H[:4], exists) == 0
    assert ref.lookup(64, [], exists) == 0


def test_lookup_rederive_can_shrink_a_window_hit_to_zero():
    # SWA(4, w8), sbs 8: at 32 the run 6-7 hits, re-derived at 24 blocks 4-5
    # are missing, so the hit is 0 (the worker does not fall back to 32).
    ref = ReferenceCoordinator(make([Group(SlidingWindow(4, 8))], sbs=8))
    assert ref.lookup(32, H[:8], keys(0, 4, [6, 7])) == 0
    assert ref.lookup(32, H[:8], keys(0, 4, [4, 5, 6, 7])) == 24


def test_lookup_candidates_order_and_mask():
    layout = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8)),
                   Group(Mamba(16), prefix_cacheable=False)], sbs=16)  # fmt: skip
    ref = ReferenceCoordinator(layout)
    cands = ref.lookup_candidates(40, H[:10])
    expected = [(0, H[3]), (0, H[7])] + [(1, H[i]) for i in (2, 3, 6, 7)]
    assert cands == expected  # scratch group never probed


def test_lookup_candidates_partial_hits_are_every_unit_per_group():
    layout = make([Group(FullAttention(16)), Group(SlidingWindow(8, 9))], sbs=16,
                  partial_hash_hits=True)  # fmt: skip
    cands = ReferenceCoordinator(layout).lookup_candidates(22, H[:10])
    assert cands == [(g, H[i]) for g in (0, 1) for i in range(5)]


def test_lookup_ignores_store_keys_outside_the_candidates():
    """Full(16) + SWA(4, w8, EAGLE), sbs 16. ``find_longest_cache_hit`` at 32
    peeks at SWA block 8 (tokens 32-36) and gets 32; the worker only asks about
    chunks below cdiv(32, 4) = 8, so block 8 cannot help it: 16."""
    layout = make([Group(FullAttention(16)), Group(SlidingWindow(4, 8), eagle=True)],
                  sbs=16, use_eagle=True)  # fmt: skip
    ref = ReferenceCoordinator(layout)
    exists = keys(0, 16, range(3)) | keys(1, 4, range(9))
    assert ref.find_longest_cache_hit(H[:12], 32, exists)[1] == 32
    assert (1, H[8]) not in ref.lookup_candidates(33, H[:12])
    assert ref.lookup(33, H[:12], exists) == 16


def test_lookup_ignores_keys_masked_out_of_candidates():
    """A key inside the range but outside the lookup mask is never asked: with
    the store holding SWA blocks 4-5 only (mask False), the worker sees nothing.
    Even a direct hit search can not use them (the alignment skip), so both
    agree on 0: the mask drops only unreachable keys."""
    layout = make([Group(SlidingWindow(4, 8))], sbs=16)
    ref = ReferenceCoordinator(layout)
    exists = keys(0, 4, [4, 5])
    assert ref.lookup_mask(32) == ([False, False, True, True] * 2,)
    assert ref.lookup_candidates(33, H[:8]) == [(0, H[i]) for i in (2, 3, 6, 7)]
    assert ref.lookup(33, H[:8], exists) == 0
    assert ref.find_longest_cache_hit(H[:8], 32, exists)[1] == 0


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


def _mamba_state_token(layout: CacheLayout, gid: int, mask: list[bool]) -> int:
    """Tokens covered by the Mamba state block a load mask selects (its last)."""
    return len(mask) * layout.groups[gid].spec.block_size


@settings(max_examples=250)
@given(case())
def test_hit_bounded_aligned_and_mask_lengths_consistent(c):
    """For every case: 0 <= hit <= max_length (the EAGLE peek looks past the
    bound but its drop always brings the hit back under it), hit is a multiple
    of the alignment, every prefix-cacheable group's mask covers cdiv(hit, bs)
    chunks (a hit is a whole block for every non-full group), scratch groups
    get [], and each Mamba group's state is the one at exactly ``hit`` and is
    in the store (never ahead of the attention-verified prefix)."""
    layout, requests, exists, lens = c
    ref = ReferenceCoordinator(layout)
    hbs = layout.hash_block_size
    for hashes, max_length in zip(requests, lens, strict=True):
        for apply_eagle in (True, False):
            masks, length = ref.find_longest_cache_hit(hashes, max_length, exists,
                                                       apply_eagle=apply_eagle)  # fmt: skip
            assert 0 <= length <= max_length
            assert length % layout.alignment == 0
            assert length <= len(hashes) * hbs
            for gid, group in enumerate(layout.groups):
                if not group.prefix_cacheable:
                    assert masks[gid] == []
                    continue
                assert len(masks[gid]) == cdiv(length, group.spec.block_size)
                if isinstance(group.spec, Mamba) and length:
                    assert masks[gid].count(True) == 1 and masks[gid][-1]
                    assert (gid, hashes[length // hbs - 1]) in exists


@settings(max_examples=150)
@given(case(layouts(use_eagle=True)))
def test_mamba_never_ahead_of_attention_under_eagle(c):
    """Under EAGLE a Mamba group loads the state at exactly the hit, that state
    is in the store, and every full-attention group holds each whole block
    below the hit: the recurrent state never runs past the verified prefix."""
    layout, requests, exists, lens = c
    ref = ReferenceCoordinator(layout)
    hbs = layout.hash_block_size
    for hashes, max_length in zip(requests, lens, strict=True):
        masks, length = ref.find_longest_cache_hit(hashes, max_length, exists)
        for gid, group in enumerate(layout.groups):
            if not group.prefix_cacheable:
                continue
            bs = group.spec.block_size
            if isinstance(group.spec, Mamba):
                if length == 0:
                    assert masks[gid] == []
                    continue
                assert (
                    _mamba_state_token(layout, gid, masks[gid]) == cdiv(length, bs) * bs
                )
                assert masks[gid].index(True) == len(masks[gid]) - 1
                assert (gid, hashes[length // hbs - 1]) in exists
            elif isinstance(group.spec, FullAttention):
                for b in range(length // bs):
                    assert (gid, hashes[(b + 1) * bs // hbs - 1]) in exists


@settings(max_examples=200)
@given(case())
def test_find_masks_equal_load_mask_at_the_hit(c):
    """The recv side recomputes masks with ``load_mask(hashes, hit)``; for every
    non-chunked group they equal what the hit search selected. (Chunked local
    is excluded: its window start depends on ``max_length``, so load_mask at a
    shorter hit can select chunks the search never verified; so is a window of
    at most one token, cdiv(w - 1, bs) == 0, where the EAGLE search keeps no
    block but load_mask, needing 0 blocks, still takes the last one. vLLM does
    the same in both cases.)"""
    layout, requests, exists, lens = c
    ref = ReferenceCoordinator(layout)
    for hashes, max_length in zip(requests, lens, strict=True):
        masks, length = ref.find_longest_cache_hit(hashes, max_length, exists)
        load = ref.load_mask(hashes, length)
        for gid, spec in enumerate(layout.coverage_specs):
            if isinstance(spec, ChunkedLocal) or (
                isinstance(spec, SlidingWindow)
                and cdiv(spec.sliding_window - 1, spec.block_size) == 0
            ):
                continue
            assert load[gid] == masks[gid], gid


@settings(max_examples=200)
@given(case(), st.randoms(use_true_random=False))
def test_results_independent_of_exists_order_and_type(c, rnd: random.Random):
    """Same keys as a set built in another order, a frozenset and a list."""
    layout, requests, exists, lens = c
    ref = ReferenceCoordinator(layout)
    shuffled = list(exists)
    rnd.shuffle(shuffled)
    variants = [set(shuffled), frozenset(exists), shuffled, sorted(exists)]
    for hashes, n in zip(requests, lens, strict=True):
        want_find = ref.find_longest_cache_hit(hashes, n, exists)
        want_lookup = ref.lookup(n, hashes, exists)
        for v in variants:
            assert ref.find_longest_cache_hit(hashes, n, v) == want_find
            assert ref.lookup(n, hashes, v) == want_lookup


@settings(max_examples=200)
@given(case())
def test_lookup_is_below_the_prompt_and_a_restricted_find(c):
    """The worker's hit leaves the last token to compute, is aligned, and is
    never more than the hit search over the whole store at the aligned length
    for full-attention-only layouts (where fewer keys can only shorten a run)."""
    layout, requests, exists, lens = c
    ref = ReferenceCoordinator(layout)
    for hashes, n in zip(requests, lens, strict=True):
        got = ref.lookup(n, hashes, exists)
        assert got == 0 or got < n
        assert got % layout.alignment == 0
        assert got == ref.lookup(n, hashes, set(ref.lookup_candidates(n, hashes))
                                 & set(exists))  # fmt: skip
        if all(sg.kind == "full" for sg in layout.spec_groups):
            assert got <= ref.find_longest_cache_hit(hashes, layout.align(n),
                                                     exists)[1]  # fmt: skip


def _round_trip_can_hit(layout: CacheLayout, with_prompt: bool) -> bool:
    """When saving a prompt through store_mask guarantees a later lookup hits.

    Found by search, each exclusion has a counterexample:
    - a prefix-cacheable Mamba group: its states are never in store masks;
    - an SWA coverage window with cdiv(w - 1, bs) == 0 (w <= 1): the sparse
      mask keeps none of its blocks, and a verified scan still needs one;
    - sparse retention (not None) without num_prompt_tokens: no replay tail.
    """
    if any(sg.kind == "mamba" for sg in layout.spec_groups):
        return False
    if any(
        sg.kind == "sliding_window"
        and cdiv(sg.spec.sliding_window - 1, sg.block_size) == 0
        for sg in layout.spec_groups
    ):
        return False
    return layout.retention_interval is None or with_prompt


@settings(max_examples=300)
@given(layouts(), st.integers(0, 3), st.integers(2, 8), st.integers(0, 255),
       st.booleans())  # fmt: skip
def test_store_mask_round_trip_hits(layout, seed, n_blocks, extra, with_prompt):
    """Save a prompt of N tokens (store_mask of align(N), with or without
    num_prompt_tokens), then look the same prompt up: the hit is non-zero
    whenever N >= 2 scheduler blocks + the widest SWA coverage window and
    ``_round_trip_can_hit``. (Shorter prompts can lose everything: under EAGLE
    a window longer than the prompt re-aligns the run from token 0 before the
    pop and again after it.)"""
    sbs = layout.scheduler_block_size
    widest = max((sg.spec.sliding_window for sg in layout.spec_groups
                  if sg.kind == "sliding_window"), default=0)  # fmt: skip
    n_tokens = max(n_blocks * sbs + extra % sbs, 2 * sbs + widest)
    hashes = chained_hashes(seed, n_tokens // layout.hash_block_size)
    exists = saved_keys(layout, hashes, n_tokens,
                        num_prompt_tokens=n_tokens if with_prompt else None)  # fmt: skip
    got = ReferenceCoordinator(layout).lookup(n_tokens, hashes, exists)
    assert got < n_tokens
    if _round_trip_can_hit(layout, with_prompt):
        assert got > 0
    if any(sg.kind == "mamba" for sg in layout.spec_groups):
        assert got == 0  # no Mamba state is ever saved through store_mask


def test_round_trip_counterexample_short_prompt_under_eagle():
    """SWA(64, w512) EAGLE, sbs 256, retention 0, a 512-token prompt: the
    boundary tail (blocks 0-4) is saved, but the lookup's run from token 0 is
    re-aligned (5 -> 4 blocks) then popped (3) and re-aligned (0)."""
    layout = make([Group(SlidingWindow(64, 512), eagle=True)], sbs=256, hbs=16,
                  use_eagle=True, retention_interval=0)  # fmt: skip
    hashes = chained_hashes(1, 32)
    exists = saved_keys(layout, hashes, 512, num_prompt_tokens=512)
    assert exists == keys(0, 64, range(5), hbs=16, hashes=hashes)
    assert ReferenceCoordinator(layout).lookup(512, hashes, exists) == 0


def test_scans_are_dispatched_through_the_registry():
    """The coordinator finds each SpecGroup's scan in the spec-kind registry
    (kinds.kind_of walks the MRO), so a spec subclass scans as its base."""
    from dataclasses import dataclass

    from kvhit.coordinator import kinds

    @dataclass(frozen=True)
    class Window(SlidingWindow):
        pass

    base = make([Group(FullAttention(4)), Group(SlidingWindow(4, 8))], sbs=4)
    sub = make([Group(FullAttention(4)), Group(Window(4, 8))], sbs=4)
    assert (
        kinds.kind_of(sub.groups[1].spec).scan
        is kinds.KINDS_BY_NAME["sliding_window"].scan
    )
    exists = keys(0, 4, range(6)) | keys(1, 4, [0, 1, 4, 5])
    for n in range(0, 28, 4):
        want = ReferenceCoordinator(base).find_longest_cache_hit(H[:7], n, exists)
        got = ReferenceCoordinator(sub).find_longest_cache_hit(H[:7], n, exists)
        assert got == want
    assert ReferenceCoordinator(base).find_longest_cache_hit(H[:7], 24, exists)[1] == 24
