"""``BatchedLookup.lookup_with_tail_keys`` against vLLM 0.33.0's real
``MooncakeStoreWorker.lookup`` and ``_tail_key_boundaries`` (through
bench/vllm_oracle.py), on random layouts of every kind, partial hash hits
included, and random store contents: hits and tail key boundaries equal for
every request of a batch; where vLLM's ``_tail_key_boundaries`` asserts, kvhit
reports -1 (the connector answers a miss there).

Skips (saying why) only where vLLM's sources cannot be installed.
"""

from __future__ import annotations

import random

import pytest

from kvhit.bench import vllm_oracle as vo
from kvhit.bindings.mooncake_store import MooncakeKeys
from kvhit.bindings.store_sync import BatchedLookup, TailKeyLookup
from kvhit.coordinator.packing import HashBatch

HB = 8


class SetStore:
    """``batch_is_exist`` over ``(group, hash)`` pairs, keys as MooncakeKeys
    builds them with one namespace per group."""

    def __init__(self, keys: MooncakeKeys, pairs: set) -> None:
        self.present = {keys.key(g, h) for g, h in pairs}
        self.calls = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls += 1
        return [int(k in self.present) for k in keys]


@pytest.fixture(scope="module")
def mods():
    m, reason = vo.load_vllm()
    if m is None:
        pytest.skip(reason)
    return m


def _case(rng: random.Random):
    params = vo.random_layout(rng)
    try:
        layout = vo.kvhit_layout(params)
        oracle = vo.VllmOracle(params)
    except (ValueError, AssertionError):
        return None
    hbs = params.hash_block_size
    base = vo.random_hashes(rng, rng.randrange(1, 24), width=HB)
    reqs = []
    for _ in range(rng.randrange(1, 7)):
        n = rng.randrange(1, 26)
        reqs.append(
            vo.random_hashes(rng, n, base[: rng.randrange(0, len(base) + 1)], HB)
        )
    ntok = [max(0, len(r) * hbs - rng.randrange(0, 2 * hbs)) for r in reqs]
    cacheable = [g for g, grp in enumerate(layout.groups) if grp.prefix_cacheable]
    p = rng.choice((0.4, 0.7, 0.9, 1.0))
    pairs = {(g, h) for r in reqs for h in r for g in cacheable if rng.random() < p}
    return layout, oracle, reqs, ntok, pairs


def test_tail_key_boundaries_match_vllm(mods):
    rng = random.Random(1234)
    checked = partial_tails = vllm_asserts = batches = 0
    for _ in range(700):
        case = _case(rng)
        if case is None:
            continue
        layout, oracle, reqs, ntok, pairs = case
        keys = MooncakeKeys(
            "m",
            [[(0, 0, 0, 0)] if g.prefix_cacheable else [] for g in layout.groups],
        )
        store = SetStore(keys, pairs)
        bl = BatchedLookup(layout, store, keys, hash_bytes=HB)
        try:
            res = bl.lookup_with_tail_keys(HashBatch.from_bytes(reqs, HB), ntok)
        except ValueError:
            continue  # a length kvhit refuses up front (vLLM raises too)
        assert isinstance(res, TailKeyLookup)
        assert store.calls <= 1
        batches += 1
        for i, (r, n) in enumerate(zip(reqs, ntok, strict=True)):
            try:
                want_hit = oracle.lookup(n, r, pairs)
            except (AssertionError, IndexError):
                continue
            assert int(res.hit_lengths[i]) == want_hit, (i, n, layout)
            got = res.boundaries(i)
            if oracle.last_tail_key_error is not None:
                vllm_asserts += 1
                assert any(b < 0 for _, b in got), (i, got)
                continue
            want = tuple(
                (b.group_id, b.num_tokens) for b in oracle.last_tail_key_boundaries
            )
            assert got == want, (i, n, got, want, layout)
            checked += 1
            partial_tails += any(b != want_hit for _, b in want)
    assert batches > 150 and checked > 1000
    assert partial_tails >= 3, "no partial tail key was exercised"
    print(f"tail keys: {checked} requests, {partial_tails} partial, "
          f"{vllm_asserts} where vLLM asserts")  # fmt: skip


def test_tail_key_boundaries_read_only_asked_keys(mods):
    """A key another request asked about (present in the index) is not this
    request's tail key: vLLM's exists_set holds only its own candidates."""
    from kvhit.coordinator.specs import CacheLayout, FullAttention, Group, Mamba

    layout = CacheLayout(
        [Group(FullAttention(32)), Group(Mamba(32))],
        scheduler_block_size=32,
        hash_block_size=8,
        partial_hash_hits=True,
    )
    h = [bytes([i]) * HB for i in range(1, 13)]
    short, long_ = h[:6], h  # short asks hashes 0..5 only
    keys = MooncakeKeys("m", [[(0, 0, 0, 0)]] * 2)
    # Attention keyed at 3 and 6 (6 lies past the short prompt), Mamba at 3, 4.
    pairs = {(0, h[3]), (0, h[6]), (1, h[3]), (1, h[4])}
    bl = BatchedLookup(layout, SetStore(keys, pairs), keys, hash_bytes=HB)
    both = bl.lookup_with_tail_keys(HashBatch.from_bytes([short, long_], HB), [48, 96])
    alone = bl.lookup_with_tail_keys(HashBatch.from_bytes([short], HB), [48])
    oracle = vo.VllmOracle(vo.LayoutParams(
        groups=(vo.Group(vo.FullAttention(32)), vo.Group(vo.Mamba(32))),
        scheduler_block_size=32, hash_block_size=8, partial_hash_hits=True,
    ))  # fmt: skip
    for res, i, r, n in (
        (both, 0, short, 48),
        (both, 1, long_, 96),
        (alone, 0, short, 48),
    ):
        try:
            want_hit = oracle.lookup(n, r, pairs)
        except AssertionError:
            want_hit = None
        assert int(res.hit_lengths[i]) == want_hit
        if oracle.last_tail_key_error is not None:
            assert any(b < 0 for _, b in res.boundaries(i))
        else:
            want = tuple(
                (b.group_id, b.num_tokens) for b in oracle.last_tail_key_boundaries
            )
            assert res.boundaries(i) == want
    # The short prompt's answer does not depend on the long one in its batch.
    assert both.boundaries(0) == alone.boundaries(0)
    assert int(both.hit_lengths[1]) == 40
    assert both.boundaries(1) == ((0, 56), (1, 40))
