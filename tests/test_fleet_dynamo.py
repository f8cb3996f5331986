"""Side by side with NVIDIA Dynamo's KV router index: on full attention, each
engine's fleet hit in blocks equals Dynamo's ``RadixTree.find_matches`` score
for that worker (skipped where ``ai-dynamo-runtime`` is not installed)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("dynamo._core", exc_type=ImportError)

from kvhit.bench.bench_fleet import (  # noqa: E402
    build_workload,
    dynamo_scores,
    dynamo_tree,
    fill_fleet,
    pack,
)
from kvhit.coordinator.engine import LookupEngine  # noqa: E402
from kvhit.coordinator.packing import HashBatch  # noqa: E402


@pytest.mark.parametrize(("engines", "warm"), [(1, 48), (8, 96), (64, 160)])
def test_fleet_hits_equal_dynamo_scores(engines, warm):
    wl = build_workload("llama", engines, warm, 24)
    engine = LookupEngine(wl.layout)
    fleet = fill_fleet(engine, wl)
    bs = wl.layout.spec_groups[0].block_size
    a = wl.layout.alignment
    tree = dynamo_tree(wl, lambda i: int(wl.served_tokens[i]) // a * a // bs)
    hits = engine.fleet_hits(pack(wl.words), wl.tokens, fleet).numpy()
    dyn = dynamo_scores(tree, wl.words, engines)
    assert (dyn > 0).any()  # the comparison is not vacuous
    np.testing.assert_array_equal(hits // bs, dyn)
    assert not (hits % bs).any()


@pytest.mark.parametrize("engines", [1, 8, 64])
def test_raw_trace_ids_fleet_hits_equal_dynamo_scores(engines):
    # What a router reads from the trace: raw ids (0 and 1 in nearly every
    # request) as Python lists, one key per 512-token trace block.
    wl = build_workload("unused", engines, 160, 24, ids="raw")
    assert any(0 in r for r in wl.lists) and all(type(r) is list for r in wl.lists)
    engine = LookupEngine(wl.layout)
    fleet = fill_fleet(engine, wl)
    tree = dynamo_tree(wl, lambda i: int(wl.served_tokens[i]) // 512)
    hits = engine.fleet_hits(HashBatch.from_ints(wl.lists), wl.token_list, fleet)
    dyn = dynamo_scores(tree, wl.words, engines)
    assert (dyn > 1).any()  # more than the shared first block
    np.testing.assert_array_equal(hits.numpy() // 512, dyn)


def test_bad_ids_are_refused():
    with pytest.raises(ValueError, match="ids"):
        build_workload("llama", 1, 4, 4, ids="cooked")
    with pytest.raises(ValueError, match="hash_bytes"):
        build_workload("llama", 1, 4, 4, hash_bytes=16, ids="raw")
