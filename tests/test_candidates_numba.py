"""kernels/candidates_numba.py against the torch code it mirrors, compiled.

``worker_candidates_nb`` must give exactly
``coordinator/candidates.py::worker_candidates`` (same keys, same order) on
random layouts (tests/strategies.py), empty and single-request batches,
partial hash hits and non-power-of-two sizes; ``first_occurrences_nb`` exactly
the first occurrence of each distinct key, forced slot-hash collisions
included; ``format_keys_nb`` (kernels/format_keys_numba.py) exactly
``prefix + bytes.hex()``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import case, layouts

from kvhit.bindings.mooncake_store import MooncakeKeys
from kvhit.bindings.store_sync import compiled_candidates
from kvhit.coordinator.candidates import worker_candidates
from kvhit.coordinator.packing import HashBatch
from kvhit.coordinator.plan import ScanPlan

nb = pytest.importorskip("kvhit.kernels.candidates_numba")
fk = pytest.importorskip("kvhit.kernels.format_keys_numba")

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _torch_candidates(plan, offsets, ntok):
    g, r = worker_candidates(plan, torch.from_numpy(offsets), torch.from_numpy(ntok))
    return g.numpy(), r.numpy()


def _check(layout, lists, ntok):
    plan = ScanPlan.from_layout(layout)
    lens = np.array([len(h) for h in lists], dtype=np.int64)
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    ntok = np.asarray(ntok, dtype=np.int64)
    want_g, want_r = _torch_candidates(plan, offsets, ntok)
    got = compiled_candidates(plan, offsets, ntok)
    assert got is not None
    got_g, got_r, got_q = got
    np.testing.assert_array_equal(got_g, want_g)
    np.testing.assert_array_equal(got_r, want_r)
    np.testing.assert_array_equal(
        got_q, np.searchsorted(offsets, want_r, side="right") - 1
    )
    return got_g, got_r


@SETTINGS
@given(case(max_requests=6))
def test_worker_candidates_match_torch(c):
    layout, requests, _, lens = c
    _check(layout, requests, lens)


@SETTINGS
@given(layouts(partial_hash_hits=True), st.data())
def test_worker_candidates_match_torch_partial(layout, data):
    n = data.draw(st.integers(0, 5))
    sizes = data.draw(st.lists(st.integers(0, 37), min_size=n, max_size=n))
    ntok = [
        data.draw(st.integers(0, s * layout.hash_block_size + 2 * layout.alignment))
        for s in sizes
    ]
    _check(layout, [[b""] * s for s in sizes], ntok)


@SETTINGS
@given(layouts(), st.integers(1, 3000))
def test_worker_candidates_single_long_request(layout, n_hashes):
    ntok = [n_hashes * layout.hash_block_size + 1]
    _check(layout, [[b""] * n_hashes], ntok)


def test_empty_batch():
    from kvhit.coordinator.specs import CacheLayout  # noqa: F401

    @given(layouts())
    @settings(max_examples=10, deadline=None)
    def run(layout):
        g, r = _check(layout, [], [])
        assert g.shape == (0,) and r.shape == (0,)

    run()


def _first_ref(gids, rows, words):
    seen, out = set(), []
    for i, (g, r) in enumerate(zip(gids.tolist(), rows.tolist(), strict=True)):
        key = (g, tuple(words[r].tolist()))
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


@SETTINGS
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=300),
    st.integers(0, 2**32),
)
def test_first_occurrences_exact(width, pairs, seed):
    rng = np.random.default_rng(seed)
    # Few distinct words per column: many equal rows, and rows equal but in
    # one word.
    words = rng.integers(-2, 2, size=(41, width)).astype(np.int64)
    gids = np.array([g for g, _ in pairs], dtype=np.int64)
    rows = np.array([r for _, r in pairs], dtype=np.int64)
    got = nb.first_occurrences_nb(gids, rows, words)
    assert got.tolist() == _first_ref(gids, rows, words)


def test_first_occurrences_under_slot_collisions(monkeypatch):
    """Keys that share a table slot (a tiny table: every key collides with
    many) are still told apart word by word."""
    words = np.arange(64, dtype=np.int64).reshape(32, 2)
    words[16:] = words[:16]  # every row twice
    gids = np.repeat(np.arange(3, dtype=np.int64), 32)
    rows = np.tile(np.arange(32, dtype=np.int64), 3)
    got = nb.first_occurrences_nb(gids, rows, words)
    assert got.tolist() == _first_ref(gids, rows, words)
    assert len(got) == 48


@SETTINGS
@given(st.sampled_from([8, 16, 32]), st.integers(0, 50), st.integers(0, 2**32))
def test_format_keys_matches_key_strings(hash_bytes, n, seed):
    rng = np.random.default_rng(seed)
    words = rng.integers(-(2**63), 2**63 - 1, size=(n, hash_bytes // 8)).astype(
        np.int64
    )
    gids = np.sort(rng.integers(0, 3, size=n)).astype(np.int64)
    keys = MooncakeKeys("módel", [[(0, 0, 0, 0), (1, 0, 0, 0)], [(0, 0, 0, 0)], []])
    heads = [f"{p}@".encode() for g in range(3) for p in keys.prefixes(g)]
    po = np.zeros(len(heads) + 1, dtype=np.int64)
    np.cumsum([len(h) for h in heads], out=po[1:])
    gp = np.array([0, 2, 3, 3], dtype=np.int64)
    blob = np.frombuffer(b"".join(heads), dtype=np.uint8).copy()
    got = fk.format_keys_nb(words, gids, hash_bytes, blob, po, gp)
    want = []
    for i in range(n):
        for p in keys.prefixes(int(gids[i])):
            want.append(f"{p}@" + words[i].astype("<i8").tobytes()[:hash_bytes].hex())
    text = str(memoryview(got), "utf-8")
    assert (text.split("\n") if text else []) == want


def test_store_sync_asks_exactly_the_candidates_keys():
    """StoreSync's one call asks every namespace's key of each distinct
    candidate once, in pair-major, namespace order (vLLM's layout)."""
    from test_mooncake import dsv4_layout

    from kvhit.bindings.store_sync import StoreSync, candidate_rows
    from kvhit.coordinator.key_index import KeyIndex

    layout = dsv4_layout()
    keys = MooncakeKeys("m", [[(0, 0, 0, 0), (0, 1, 0, 0)]] * layout.num_groups)
    asked: list[list[str]] = []

    class Store:
        def batch_is_exist(self, ks):
            asked.append(list(ks))
            return [1] * len(ks)

    rng = np.random.default_rng(1)
    lists = [
        [bytes(rng.integers(0, 2, 32, dtype=np.uint8)) for _ in range(n)]
        for n in (300, 7, 301, 64)
    ]
    batch = HashBatch.from_bytes(lists, 32)
    ntok = [len(h) * layout.hash_block_size for h in lists]
    sync = StoreSync(Store(), keys, KeyIndex(32, 1 << 12, "cpu"), layout)
    st_ = sync.refresh(batch, ntok)
    g, r, _ = candidate_rows(layout, batch.offsets, ntok)
    flat = [h for hl in lists for h in hl]
    want, seen = [], set()
    for gi, ri in zip(g.tolist(), r.tolist(), strict=True):
        if (gi, flat[ri]) not in seen:
            seen.add((gi, flat[ri]))
            want += keys.keys(gi, flat[ri])
    assert len(want) > 0 and asked == [want]
    assert st_.num_unique == len(seen) and st_.num_keys_asked == len(want)
