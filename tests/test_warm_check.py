"""The engine's warm check (issue 33): a lookup with the index whose table
was checked before tests only the batch, and never lets a bad argument
through that the full check would refuse."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import HashBatch
from kvhit.coordinator.specs import CacheLayout, FullAttention, Group

BS = 16


@pytest.fixture(scope="module")
def engine() -> LookupEngine:
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=BS))],
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    return LookupEngine(layout, backend="numba")


def hits(engine: LookupEngine, batch: HashBatch, index: KeyIndex) -> list[int]:
    n = [BS * batch.num_hashes(i) for i in range(len(batch))]
    return engine.find_longest_cache_hit(batch, n, index).hit_lengths.tolist()


def test_a_warm_call_still_refuses_what_the_full_check_refuses(engine):
    index = KeyIndex(8, capacity=16)
    index.add(0, HashBatch.from_ints([[1, 2, 3]]))
    batch = HashBatch.from_ints([[1, 2, 3, 4]])
    assert hits(engine, batch, index) == [3 * BS]  # the index is now checked
    wide = HashBatch.from_bytes([[bytes(16)]], 16)
    with pytest.raises(ValueError, match="hash width"):
        hits(engine, wide, index)
    with pytest.raises(TypeError, match="batch"):
        engine.find_longest_cache_hit([[1]], [BS], index)
    with pytest.raises(TypeError, match="index"):
        engine.find_longest_cache_hit(batch, [4 * BS], {1, 2})
    with pytest.raises(ValueError, match="max_lengths"):
        engine.find_longest_cache_hit(batch, [-1], index)
    assert hits(engine, batch, index) == [3 * BS]


def test_a_grown_table_and_another_index_are_checked_and_answered(engine):
    index = KeyIndex(8, capacity=2)
    batch = HashBatch.from_ints([[5, 6, 7, 8, 9]])
    assert hits(engine, batch, index) == [0]
    table = index.table
    index.add(0, HashBatch.from_ints([[5, 6, 7, 8]]))  # grows: a new table
    assert index.table is not table
    assert hits(engine, batch, index) == [4 * BS]
    other = KeyIndex(8, capacity=64)
    other.add(0, HashBatch.from_ints([[5]]))
    assert hits(engine, batch, other) == [BS]
    assert hits(engine, batch, index) == [4 * BS]


def test_the_engine_keeps_no_table_alive(engine):
    index = KeyIndex(8, capacity=1 << 10)
    hits(engine, HashBatch.from_ints([[1]]), index)
    table = weakref.ref(index.table)
    del index
    gc.collect()
    assert table() is None


def test_two_indexes_over_one_table_are_told_apart(engine):
    # 12- and 16-byte keys both take two words: one table can back both
    # widths, so the table alone must not stand for the width checked.
    narrow = KeyIndex(12, capacity=16)
    wide = KeyIndex.from_table(narrow.table, 16)
    batch = HashBatch.from_bytes([[bytes(12)]], 12)
    assert hits(engine, batch, narrow) == [0]
    with pytest.raises(ValueError, match="hash width"):
        hits(engine, batch, wide)
