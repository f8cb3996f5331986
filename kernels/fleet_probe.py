"""The fleet's probe of a tile of keys, one a lane (``kernels/fleet_triton.py``'s
joint scan ``_fleet_kernel`` and ``kernels/fleet_triton_hybrid.py``'s
``class_kernel``, one helper with the scan's cut as a constexpr switch):
every lane's slot in the FleetIndex's key table, the KeyIndex layout of
``coordinator/key_index.py``, with a tile's latency in mind (issue 32).
Device functions only (``@triton.jit``), no launcher."""

from __future__ import annotations

import triton
import triton.language as tl

from kvhit.kernels.contract import EMPTY
from kvhit.kernels.hash_index import hash_finish, hash_init, hash_mix

__all__ = ["bit_and", "bit_or", "probe_slots", "visit_slot"]

_EMPTY_C: tl.constexpr = tl.constexpr(EMPTY)


# The combine functions of the fleet kernels' tl.reduce over engine-set words
# (the interpreter runs them in numpy: bench/gpu_common.speed_up_interpreter).
@triton.jit
def bit_and(a, b):
    return a & b


@triton.jit
def bit_or(a, b):
    return a | b


@triton.jit
def visit_slot(keys_ptr, pos, gids, words, active, W: tl.constexpr):
    """One probe step at slot ``pos`` for lanes ``active``: ``(hit, open)``,
    whether the slot holds key ``(gids, words)`` and whether it is not EMPTY
    (the probe goes on past it). The slot's group id and words are loaded
    together (one round trip), compared once all are in."""
    row = keys_ptr + pos * (W + 1)
    g = tl.load(row, mask=active, other=_EMPTY_C)
    same = active & (g == gids)
    for j in tl.static_range(W):
        same = same & (tl.load(row + 1 + j, mask=active, other=0) == words[j])
    return same, g != _EMPTY_C


@triton.jit
def probe_slots(keys_ptr, cap_mask, gids, rows_ptr, units, probe, blk_of,
                W: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr,
                CUT: tl.constexpr):  # fmt: skip
    """Each lane's slot of key ``(gids, rows_ptr[units])`` in the fleet's key
    table (the KeyIndex layout of ``coordinator/key_index.py``: home slot
    ``slot_hash & cap_mask``, linear probing, an EMPTY slot ends a probe,
    TOMBSTONE and BUSY slots passed over; plain reads, stream-ordered after
    the mutations): int64 [N], -1 for an absent key or a lane off ``probe``
    (bool [N]; ``gids``, ``units`` int64 [N]).

    ``hash_index.find_slots`` with three changes for the latency of a tile
    (issue 32): the key's hash words are loaded once, all W at once, and
    held for the home slot and every compare; a slot's group id and words
    are loaded together; after the home slot each step visits the next
    ``SPAN`` slots at once.

    ``CUT`` (the joint scan, ``fleet_triton._fleet_kernel``): a block absent
    from the table (a lane of any member whose probe ended without the key)
    is a miss for every engine, so the run of no engine passes it: lanes of
    later blocks (``blk_of``, int64 [N], below ``BLOCK``) stop probing and
    read -1, and every lane of an earlier block is exact. The scan's first
    misses are therefore the same. Without it (the engine classes,
    ``fleet_triton_hybrid.class_kernel``, which need every key's engine set,
    not a leading run's) every lane is exact and ``blk_of`` is unused."""
    words = ()
    for j in tl.static_range(W):
        words = words + (tl.load(rows_ptr + units * W + j, mask=probe, other=0),)
    h = hash_init(gids)
    for j in tl.static_range(W):
        h = hash_mix(h, words[j])
    pos = hash_finish(h) & cap_mask
    found, opened = visit_slot(keys_ptr, pos, gids, words, probe, W)
    slot = tl.where(found, pos, -1)
    # Every slot visited counts, BUSY and TOMBSTONE ones too: on a table with
    # no EMPTY slot the probe still ends after `capacity` visits (a vector:
    # the interpreter types a bool scalar & vector as int64).
    steps = gids * 0 + 1
    active = probe & ~found & opened & (steps <= cap_mask)
    if CUT:
        cut = tl.min(tl.where(probe & ~found & ~active, blk_of, BLOCK), axis=0)
        active = active & (blk_of < cut)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # The SPAN slots' loads wait only on `active`: one round trip.
        on = active
        for _s in tl.static_range(SPAN):
            pos = (pos + 1) & cap_mask
            hit, open_s = visit_slot(keys_ptr, pos, gids, words, active, W)
            hit = on & hit
            slot = tl.where(hit, pos, slot)
            steps += 1
            on = on & ~hit & open_s & (steps <= cap_mask)
        active = on
        if CUT:
            gone = probe & (slot < 0) & ~active
            cut = tl.minimum(cut, tl.min(tl.where(gone, blk_of, BLOCK), axis=0))
            active = active & (blk_of < cut)
    return slot
