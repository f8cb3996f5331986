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
