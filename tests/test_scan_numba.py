"""The numba kernels (kernels/scan_numba.py) and backend against the reference.

Compiled code is what runs here (never ``NUMBA_DISABLE_JIT``). Every test
forces threads over requests off and on (``parallel=False`` / ``True``), and the
large-batch tests also let the launcher choose. The engine-level parity matrix
(find, lookup, load masks, seed regressions) runs the numba backend in
``test_engine.py``; here the kernel and backend are checked directly,
load-mask triples included.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import helpers
import numpy as np
import pytest
import torch
from helpers import key_index, merged_swa_eagle_layout
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import case, chained_hashes, saved_keys

from kvhit import (
    CacheLayout,
    FullAttention,
    Group,
    HashBatch,
    KeyIndex,
    LookupEngine,
    ReferenceCoordinator,
)
from kvhit.bench.workloads import TrafficConfig, generate, make_layout
from kvhit.coordinator.numba_backend import NumbaBackend
from kvhit.coordinator.plan import ScanPlan, plan_tensors
from kvhit.coordinator.reference_backend import ReferenceBackend, mask_span
from kvhit.kernels import scan_numba
from kvhit.kernels.contract import SG_MEMBERS, SG_PERIOD, PlanParams
from kvhit.kernels.scan_numba import PARALLEL_MIN_REQUESTS

EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "150"))
THREADS = [False, True]


@contextlib.contextmanager
def _prefetching(on: bool):
    """Force the scans' prefetching on (every batch and table size) or leave
    the launcher's rule: small hypothesis batches never reach it."""
    saved = scan_numba.PREFETCH_MIN_REQUESTS, scan_numba.PREFETCH_MIN_TABLE_BYTES
    if on:
        scan_numba.PREFETCH_MIN_REQUESTS = 0
        scan_numba.PREFETCH_MIN_TABLE_BYTES = 0
    try:
        yield
    finally:
        scan_numba.PREFETCH_MIN_REQUESTS, scan_numba.PREFETCH_MIN_TABLE_BYTES = saved


def _masks(tri: torch.Tensor) -> list[list[list[bool]]]:
    """Triples ``[R, G, 3]`` as the masks they describe."""
    return [
        [[lo <= c < hi for c in range(length)] for length, lo, hi in req]
        for req in tri.tolist()
    ]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("parallel", THREADS)
@settings(max_examples=EXAMPLES)
@given(
    data=case(max_requests=6),
    apply_eagle=st.booleans(),
    restrict=st.booleans(),
    with_index=st.booleans(),
)
def test_find_triples_match_the_reference_backend(
    parallel, prefetch, data, apply_eagle, restrict, with_index
):
    """Hits and load-mask triples, with and without an index and the store
    worker's candidate restriction (token_lens), equal the reference's."""
    layout, requests, exists, lens = data
    plan = ScanPlan.from_layout(layout)
    cpu = torch.device("cpu")
    numba_b = NumbaBackend(plan, cpu)
    numba_b.parallel = parallel
    ref_b = ReferenceBackend(plan, cpu)
    batch = HashBatch.from_bytes(requests, 8, "cpu")
    index = key_index(exists) if with_index else None
    token_lens = None
    if restrict:
        token_lens = torch.tensor([layout.align(n) for n in lens], dtype=torch.int64)
    view = batch.view(token_lens)
    max_lengths = torch.tensor(lens, dtype=torch.int64)
    if token_lens is not None:
        # The worker searches at most its own lookup length.
        max_lengths = token_lens.clone()
    try:
        want_hit, want_tri = ref_b.find(view, max_lengths, index, apply_eagle)
    except ValueError:
        return  # the reference refuses (a scan past the hashes)
    with _prefetching(prefetch):
        hit, tri = numba_b.find(view, max_lengths, index, apply_eagle)
    assert hit.dtype == tri.dtype == torch.int64
    assert hit.tolist() == want_hit.tolist()
    assert _masks(tri) == _masks(want_tri)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("parallel", THREADS)
@settings(max_examples=EXAMPLES)
@given(data=case(max_requests=6))
def test_lookup_matches_the_reference(parallel, prefetch, data):
    layout, requests, exists, lens = data
    backend = NumbaBackend(ScanPlan.from_layout(layout), torch.device("cpu"))
    backend.parallel = parallel
    batch = HashBatch.from_bytes(requests, 8, "cpu")
    with _prefetching(prefetch):
        got = backend.lookup(
            batch.view(), torch.tensor(lens, dtype=torch.int64), key_index(exists)
        )
    ref = ReferenceCoordinator(layout)
    want = [ref.lookup(n, hl, exists) for hl, n in zip(requests, lens, strict=True)]
    assert got.tolist() == want


@pytest.mark.parametrize("parallel", [False, True, None])
@pytest.mark.parametrize(
    "preset", ["dsv4-flash", "qwen3-next", "gemma3", "llama", "dsv4-longhit"]
)
def test_workload_batches_match_the_reference(preset, parallel):
    """A serving-like batch (shared prefixes, multi-turn growth, evictions) of
    more requests than the threading threshold, and a permutation of it."""
    # More requests than the launcher's threading threshold when it chooses.
    wl = generate(
        preset,
        TrafficConfig(
            num_requests=PARALLEL_MIN_REQUESTS + 8 if parallel is None else 96,
            max_tokens=3000 if parallel is not None else 1500,
            hash_bytes=16,
            seed=3,
        ),
    )
    engine = LookupEngine(wl.layout, backend="numba")
    engine.impl.parallel = parallel
    index = wl.key_index()
    got = engine.lookup(wl.hash_batch(), list(wl.num_tokens), index).tolist()
    assert got == wl.reference_lookup()
    assert any(got)
    perm = np.random.default_rng(0).permutation(len(wl)).tolist()
    batch_p = HashBatch.from_bytes([wl.hash_lists[i] for i in perm], 16, "cpu")
    got_p = engine.lookup(batch_p, [wl.num_tokens[i] for i in perm], index).tolist()
    assert got_p == [got[i] for i in perm]


@pytest.mark.parametrize("parallel", THREADS)
def test_table_is_read_again_after_a_rehash(parallel):
    """The backend reads ``index.table`` on every call: a table that grew
    (a new tensor) answers the next lookup."""
    layout = make_layout("dsv4-flash")
    engine = LookupEngine(layout, backend="numba")
    engine.impl.parallel = parallel
    hashes = chained_hashes(40, 400)
    batch = HashBatch.from_bytes([hashes], 8, "cpu")
    index = key_index(set())
    assert engine.lookup(batch, [1600], index).tolist() == [0]
    keys = saved_keys(layout, hashes, 1600)
    before = index.table
    index.add([g for g, _ in keys], [h for _, h in keys])
    assert index.table is not before
    want = ReferenceCoordinator(layout).lookup(1600, hashes, keys)
    assert want > 0
    assert engine.lookup(batch, [1600], index).tolist() == [want]


@pytest.mark.parametrize("preset", ["dsv4-flash", "llama"])
def test_lean_b1_path_answers_fresh_arrays(preset):
    """The host path of one request (scan_prepared on per-engine state): the
    same hits as the checked launchers, a result the next call does not
    overwrite, and a strided caller tensor read correctly."""
    wl = generate(preset, TrafficConfig(num_requests=24, max_tokens=2000, seed=5))
    engine = LookupEngine(wl.layout, backend="numba")
    index = wl.key_index()
    want = wl.reference_lookup()
    firsts = []
    for i in range(len(wl)):
        batch = HashBatch.from_bytes([wl.hash_lists[i]], wl.hash_bytes, "cpu")
        got = engine.lookup(batch, [wl.num_tokens[i]], index)
        assert got.tolist() == [want[i]]
        hit = engine.find_longest_cache_hit(batch, [wl.num_tokens[i]], index)
        firsts.append((got, hit.hit_lengths))
    # Each call's tensors are its own: later calls left them alone.
    assert [g.item() for g, _ in firsts] == want
    for i, (_, h) in enumerate(firsts):
        batch = HashBatch.from_bytes([wl.hash_lists[i]], wl.hash_bytes, "cpu")
        assert (
            h.tolist()
            == engine.find_longest_cache_hit(
                batch, [wl.num_tokens[i]], index
            ).hit_lengths.tolist()
        )
    strided = torch.tensor([[n, -1] for n in wl.num_tokens], dtype=torch.int64)[:, 0]
    assert not strided.is_contiguous()
    assert engine.lookup(wl.hash_batch(), strided, index).tolist() == want
    assert any(want)


def _prepared_case(data):
    """``(prep, table, rows, starts, lengths)`` of a ``case``: the layout's
    prepared plan (its programs loaded), the store's table view and the
    requests' host arrays."""
    layout, requests, exists, _ = data
    plan = ScanPlan.from_layout(layout)
    sg_rows, cand_rows = plan_tensors(plan, torch.device("cpu"))
    prep = scan_numba.prepare_scan(sg_rows.numpy(), cand_rows.numpy(), plan.params)
    scan_numba.warm_up(prep)
    table = key_index(exists).table_view
    rows, starts, lengths = HashBatch.from_bytes(requests, 8, "cpu").host_arrays()
    return prep, table, rows, starts, lengths


@pytest.mark.parametrize("prefetch", [False, True])
@settings(max_examples=EXAMPLES)
@given(data=case(max_requests=4))
def test_scan_one_answers_as_the_batch_launcher(prefetch, data):
    # The one-request program (called through numba's compiled wrapper, no
    # dispatcher) gives each request's batch-launcher answer in every mode,
    # prefetching too (forced: one request never reaches it by the rule).
    prep, table, rows, starts, lengths = _prepared_case(data)
    lens = data[3]
    with _prefetching(prefetch):
        for mode in (scan_numba.FIND, scan_numba.FIND_EAGLE, scan_numba.LOOKUP):
            want = scan_numba.scan_prepared(
                prep, rows, starts, lengths, np.array(lens, dtype=np.int64),
                table, mode, False,
            )[0].tolist()  # fmt: skip
            for b, n in enumerate(lens):
                one = rows[starts[b] : starts[b] + lengths[b]]
                got = scan_numba.scan_one(prep, one, n, table, mode)
                assert type(got) is int and got == want[b], (mode, b)
                # What a caller holding one_entry calls: the rows' words 1-D,
                # the plan packed in prep.one, 2 * mode + prefetch.
                entry = scan_numba.one_entry(prep)
                pf = scan_numba.prefetching(1, table)
                k = 2 * mode + pf
                assert entry(one.reshape(-1), n, table, prep.one, k) == want[b]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("parallel", [False, True, None])
@settings(max_examples=EXAMPLES)
@given(data=case(min_requests=0, max_requests=9))
def test_scan_hits_answers_as_the_batch_launcher(prefetch, parallel, data):
    # The hits-only batch program (called through numba's compiled wrapper,
    # its scratch made in numba) gives the batch launcher's hits in every
    # mode, prefetching or not, serial or threaded (through scan_prepared),
    # for empty and one-request batches too; each call a fresh array.
    prep, table, rows, starts, lengths = _prepared_case(data)
    lens = data[3]
    tl = np.array(lens, dtype=np.int64)
    with _prefetching(prefetch):
        for mode in (scan_numba.FIND, scan_numba.FIND_EAGLE, scan_numba.LOOKUP):
            want = scan_numba.scan_prepared(
                prep, rows, starts, lengths, tl, table, mode, parallel
            )[0]
            got = scan_numba.scan_prepared_hits(
                prep, rows, starts, lengths, tl, table, mode, parallel
            )
            assert got.dtype == np.int64 and got.tolist() == want.tolist(), mode
            again = scan_numba.scan_prepared_hits(
                prep, rows, starts, lengths, tl, table, mode, parallel
            )
            assert again is not got and again.tolist() == got.tolist()


def test_read_only_lengths_compile_nothing_new():
    # numba types a read-only array apart: a caller's read-only lengths
    # (np.frombuffer, setflags) once compiled the batch loops again on the
    # first call with masks or on threads (seconds). They are copied now,
    # and every path answers as with a writeable array.
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=16))],
        scheduler_block_size=16,
        hash_block_size=16,
    )
    engine = LookupEngine(layout, backend="numba")
    reqs = [list(range(10 * b + 1, 10 * b + 6)) for b in range(3)]
    index = KeyIndex(8)
    index.add(0, HashBatch.from_ints([r[:3] for r in reqs]).hashes)
    batch = HashBatch.from_ints(reqs)
    lens = np.array([80, 64, 32])
    ro = lens.copy()
    ro.setflags(write=False)
    want = engine.find_longest_cache_hit(batch, lens, index, with_masks=True)
    before = {f: len(f.signatures) for f in (scan_numba._batch_serial,
                                               scan_numba._batch_parallel)}  # fmt: skip
    got = engine.find_longest_cache_hit(batch, ro, index, with_masks=True)
    assert got.hit_list() == want.hit_list() == [48, 48, 32]
    assert got.mask_lists() == want.mask_lists()
    assert (
        engine.lookup(batch, ro, index).tolist()
        == engine.lookup(batch, lens, index).tolist()
    )
    prep = engine.impl._prep()[1]
    rows, starts, lengths = batch.host_arrays()
    table = index.table_view
    for parallel in (False, True):
        hit, _ = scan_numba.scan_prepared(prep, rows, starts, lengths, ro, table,
                                          scan_numba.FIND, parallel)  # fmt: skip
        assert hit.tolist() == [48, 48, 32]
    assert before == {f: len(f.signatures) for f in before}


def test_scan_preps_packed_plan_holds_its_rows_and_parameters():
    plan = ScanPlan.from_layout(merged_swa_eagle_layout())
    sg_rows, cand_rows = plan_tensors(plan, torch.device("cpu"))
    prep = scan_numba.prepare_scan(sg_rows.numpy(), cand_rows.numpy(), plan.params)
    sg, cand, one = prep.sg, prep.cand, prep.one
    assert one.dtype == np.int64 and one.flags.c_contiguous
    head = [sg.shape[0], sg.shape[1], cand.shape[0], cand.shape[1], prep.n_homes]
    assert one[:5].tolist() == head
    at = 5 + sg.size
    assert one[5:at].tolist() == sg.ravel().tolist()
    assert one[at : at + cand.size].tolist() == cand.ravel().tolist()
    vectors = one[at + cand.size :].reshape(6, -1)
    for mode in range(3):
        for pf in (0, 1):
            assert vectors[2 * mode + pf].tolist() == prep.prm[mode][pf].tolist()


def test_prepare_scan_checks_the_rows_once():
    with pytest.raises(ValueError, match="cand_rows"):
        scan_numba.prepare_scan(
            np.zeros((1, 20), np.int64), np.zeros((1, 1), np.int64),
            hash_block_size=16, alignment=16, partial=False, simple_hybrid=False,
        )  # fmt: skip


def test_mask_span():
    assert mask_span([]) == (0, 0, 0)
    assert mask_span([False, False]) == (2, 0, 0)
    assert mask_span([False, True, True, False]) == (4, 1, 3)
    assert mask_span([True] * 3) == (3, 0, 3)
    with pytest.raises(ValueError, match="contiguous"):
        mask_span([True, False, True])


def test_numba_backend_refuses_other_devices():
    plan = ScanPlan.from_layout(make_layout("llama"))
    with pytest.raises(ValueError, match="device"):
        NumbaBackend(plan, torch.device("meta"))


def test_numba_is_imported_only_by_its_first_use():
    """``import kvhit``, building the layout and importing the numba backend's
    module never import numba; neither does a numba engine or index built
    with ``warm=False``, whose first call does; a warm engine (the default)
    imports it at construction."""
    script = (
        "import sys\n"
        "import kvhit\n"
        "from kvhit.bench.workloads import make_layout\n"
        "import kvhit.coordinator.numba_backend\n"
        "import kvhit.coordinator.engine\n"
        "e = kvhit.LookupEngine(make_layout('llama'), backend='torch')\n"
        "assert 'numba' not in sys.modules, 'numba imported early'\n"
        "assert 'triton' not in sys.modules, 'triton imported early'\n"
        "e = kvhit.LookupEngine(make_layout('llama'), warm=False)\n"
        "assert e.backend == 'numba' and 'numba' not in sys.modules\n"
        "b = kvhit.HashBatch.from_bytes([[b'x' * 8]], 8)\n"
        "index = kvhit.KeyIndex(8, capacity=16, warm=False)\n"
        "assert 'numba' not in sys.modules\n"
        "e.lookup(b, [16], index)\n"
        "assert 'numba' in sys.modules\n"
    )
    warm = (
        "import sys\n"
        "import kvhit\n"
        "from kvhit.bench.workloads import make_layout\n"
        "kvhit.LookupEngine(make_layout('llama'))\n"
        "assert 'numba' in sys.modules, 'a warm engine loads its kernels'\n"
    )
    for code in (script, warm):
        helpers.run_python(code, 300)


def _count(layout, requests, lens, exists):
    from kvhit.coordinator.plan import plan_tensors
    from kvhit.kernels.scan_numba import count_probes

    plan = ScanPlan.from_layout(layout)
    sg, cand = plan_tensors(plan, torch.device("cpu"))
    view = HashBatch.from_bytes(requests, 8, "cpu").view()
    return count_probes(
        view.rows.numpy(), view.offsets.numpy(), view.lengths.numpy(),
        np.asarray(lens, dtype=np.int64), sg.numpy(), cand.numpy(),
        table=key_index(exists).table.numpy(), params=plan.params,
    )  # fmt: skip


def test_count_probes_counts_a_full_attention_run():
    """Full attention over 10 blocks with the first 6 stored: 6 hits and the
    miss that ends the run, each a probe of at least one slot and line."""
    from kvhit.kernels.probe_numba import (
        C_HITS,
        C_LINES,
        C_PROBES,
        C_SLOTS,
        COUNT_COLS,
    )

    layout = make_layout("llama")
    hashes = [bytes([i + 1]) * 8 for i in range(10)]
    hit, counts = _count(layout, [hashes], [160], {(0, h) for h in hashes[:6]})
    assert hit.tolist() == [96]
    assert counts[0, C_PROBES] == 7 and counts[0, C_HITS] == 6
    assert counts[0, C_SLOTS] >= 7 and counts[0, C_LINES] >= 7
    assert counts.shape == (1, COUNT_COLS + 1) and counts[0, COUNT_COLS] == 7


def test_count_probes_answers_as_the_lookup_and_meets_the_floor():
    from kvhit.bench.probe_count import probe_floor
    from kvhit.kernels.probe_numba import C_PROBES, COUNT_COLS

    wl = generate("dsv4-longhit", TrafficConfig(num_requests=24, max_tokens=2048))
    requests = [list(h) for h in wl.hash_lists]
    short = [[h[:8] for h in hl] for hl in requests]
    exists = {(g, h[:8]) for g, h in wl.store_keys}
    hit, counts = _count(wl.layout, short, list(wl.num_tokens), exists)
    ref = ReferenceCoordinator(wl.layout)
    want = [
        ref.lookup(n, hl, exists) for hl, n in zip(short, wl.num_tokens, strict=True)
    ]
    assert hit.tolist() == want and any(want)
    # Per SpecGroup columns add up to the probes.
    assert (counts[:, COUNT_COLS:].sum(axis=1) == counts[:, C_PROBES]).all()
    floor = probe_floor(wl, want)
    assert all(c >= f for c, f in zip(counts[:, C_PROBES].tolist(), floor, strict=True))


def test_probe_count_table():
    """bench/probe_count.py's table: per-request means that add up."""
    from kvhit.bench.probe_count import main, measure

    wl = generate("dsv4-longhit", TrafficConfig(num_requests=16, max_tokens=2048))
    t = measure(wl, repeats=2)
    assert t.requests == 16
    assert t.probes == pytest.approx(t.hits + t.misses)
    assert t.probes == pytest.approx(sum(t.probes_by_group))
    assert t.probes >= t.floor > 0
    assert len(t.floor_by_group) == len(wl.layout.spec_groups)
    assert t.slots_per_probe >= 1 and t.lines_per_probe >= 1
    assert t.fixed_call_us > 0
    assert t.cold_us > 0 and t.warm_us >= 0
    assert main(["--requests", "4", "--preset", "llama"]) == 0


@pytest.mark.parametrize("n, big_table, on", [(64, True, False), (128, True, True),
                                             (4096, False, False)])  # fmt: skip
def test_probe_count_split_times_one_prefetch_setting(n, big_table, on):
    """kernel_split's warm call asks 4x the requests: at 32 <= R < 128 it
    crossed PREFETCH_MIN_REQUESTS and compared the prefetching scan with the
    plain one. Inside same_prefetch both calls make the batch's choice."""
    from kvhit.bench.probe_count import same_prefetch

    saved = scan_numba.PREFETCH_MIN_REQUESTS, scan_numba.PREFETCH_MIN_TABLE_BYTES
    nbytes = 2 * saved[1] if big_table else max(saved[1] // 2, 8)
    table = np.zeros(nbytes // 8, np.int64)
    seen = []
    with same_prefetch(n, table) as chosen:
        for r in (n, 4 * n, 1):
            seen.append(scan_numba.prefetching(r, table))
    assert chosen is on and seen == [on] * 3
    assert (
        scan_numba.PREFETCH_MIN_REQUESTS,
        scan_numba.PREFETCH_MIN_TABLE_BYTES,
    ) == saved


def test_probe_count_table_of_no_request():
    """An empty batch (``--requests 0``): zeros per SpecGroup, one column
    each, not a crash on the mean of no rows."""
    from kvhit.bench.probe_count import main, measure

    wl = generate("dsv4-flash", TrafficConfig(num_requests=0, max_tokens=2048))
    t = measure(wl, repeats=1)
    n_sg = len(wl.layout.spec_groups)
    assert t.requests == 0 and t.probes == 0 and t.floor == 0
    assert t.probes_by_group == t.floor_by_group == (0.0,) * n_sg
    assert main(["--requests", "0", "--preset", "llama"]) == 0


def test_count_probes_counts_nothing_for_a_request_that_asks_nothing():
    """A request with no hashes, or one shorter than the alignment, makes no
    probe: its counter row is zeros (not what the scratch held)."""
    from kvhit.kernels.probe_numba import COUNT_COLS

    layout = make_layout("dsv4-flash")
    hashes = chained_hashes(41, 300)
    keys = saved_keys(layout, hashes, 1200)
    for _ in range(3):  # fresh scratch each call: garbage would show
        hit, counts = _count(
            layout, [[], hashes[:2], hashes], [0, 8, 1200], {k for k in keys}
        )
        assert hit[:2].tolist() == [0, 0] and hit[2] > 0
        assert (counts[:2] == 0).all()
        assert counts.shape == (3, COUNT_COLS + len(layout.spec_groups))
        assert counts[2, 0] > 0


@pytest.mark.parametrize("parallel", THREADS)
@pytest.mark.parametrize("preset", ["dsv4-longhit", "dsv4-flash"])
def test_prefetching_scans_answer_as_the_plain_ones(preset, parallel):
    """Long prompts with prefetching forced on (the run stretches and the
    rows fetched ahead, the windows fetched once full attention answers)
    and off: the same hits as the reference, in both lookup and find."""
    wl = generate(
        preset,
        TrafficConfig(num_requests=40, max_tokens=6000, hash_bytes=16, seed=11),
    )
    engine = LookupEngine(wl.layout, backend="numba")
    engine.impl.parallel = parallel
    index = wl.key_index()
    batch = wl.hash_batch()
    want = wl.reference_lookup()
    found = {}
    for on in (False, True):
        with _prefetching(on):
            assert engine.lookup(batch, list(wl.num_tokens), index).tolist() == want
            found[on] = engine.find_longest_cache_hit(
                batch, list(wl.num_tokens), index, with_masks=True
            )
    assert any(want)
    assert found[True].hit_lengths.tolist() == found[False].hit_lengths.tolist()
    assert [m.tolist() for m in found[True].masks] == [
        m.tolist() for m in found[False].masks
    ]


@pytest.mark.parametrize(
    "name", ["KVHIT_NUMBA_PREFETCH_MIN", "KVHIT_NUMBA_PREFETCH_MIN_BYTES"]
)
def test_a_bad_tuning_variable_is_named(name: str) -> None:
    env = {**os.environ, name: "-3"}
    run = subprocess.run(
        [sys.executable, "-c", "import kvhit.kernels.scan_numba"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and f"{name} must be a non-negative int" in run.stderr


def test_count_probes_of_no_request_is_a_pair():
    """An empty batch: ``(hit [0], counts [0, COUNT_COLS + S])`` as for any
    other batch, not the bare hit array."""
    from kvhit.kernels.probe_numba import COUNT_COLS

    layout = make_layout("dsv4-flash")
    hit, counts = _count(layout, [], [], set())
    assert hit.shape == (0,)
    assert counts.shape == (0, COUNT_COLS + len(layout.spec_groups))


@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("parallel", THREADS)
@settings(max_examples=max(EXAMPLES // 3, 10))
@given(data=st.data(), apply_eagle=st.booleans(), restrict=st.booleans())
def test_wide_keys_with_prefetching_match_the_reference(
    width, parallel, data, apply_eagle, restrict
):
    """Multi-word keys (2 words, and 4: the unrolled slot hash) with the
    prefetching forced on: the probes start from the home slots kept in the
    limits row, which one-word keys never do. Find (with and without the
    candidate restriction) and lookup equal the reference; empty batches
    included."""
    layout, requests, exists, lens = data.draw(
        case(width=width, min_requests=0, max_requests=6)
    )
    plan = ScanPlan.from_layout(layout)
    cpu = torch.device("cpu")
    backend = NumbaBackend(plan, cpu)
    backend.parallel = parallel
    batch = HashBatch.from_bytes(requests, width, "cpu")
    index = key_index(exists, width=width)
    with _prefetching(True):
        got = backend.lookup(batch.view(), torch.tensor(lens, dtype=torch.int64), index)
    ref = ReferenceCoordinator(layout)
    want = [ref.lookup(n, hl, exists) for hl, n in zip(requests, lens, strict=True)]
    assert got.tolist() == want
    token_lens = None
    max_lengths = torch.tensor(lens, dtype=torch.int64)
    if restrict:
        token_lens = torch.tensor([layout.align(n) for n in lens], dtype=torch.int64)
        max_lengths = token_lens.clone()
    view = batch.view(token_lens)
    try:
        want_hit, want_tri = ReferenceBackend(plan, cpu).find(
            view, max_lengths, index, apply_eagle
        )
    except ValueError:
        return  # the reference refuses (a scan past the hashes)
    with _prefetching(True):
        hit, tri = backend.find(view, max_lengths, index, apply_eagle)
    assert hit.tolist() == want_hit.tolist()
    assert _masks(tri) == _masks(want_tri)


@pytest.mark.parametrize("fn", ["find_hits", "lookup_hits", "count_probes"])
@pytest.mark.parametrize("shape", [(16, 2), (16, 4), (12, 3), (0, 3), (16,)])
def test_launchers_refuse_a_table_of_the_wrong_shape(fn, shape):
    """A table that is not ``[C, W + 1]`` with ``C`` a power of two is an
    error naming it: one of 8-byte keys under 16-byte hashes read the next
    slot's group id as the key's second word (a hit no key gave)."""
    from kvhit.coordinator.plan import plan_tensors
    from kvhit.kernels.contract import EMPTY
    from kvhit.kernels.probe_numba import key_slot_hash

    layout = make_layout("llama")
    plan = ScanPlan.from_layout(layout)
    sg, cand = plan_tensors(plan, torch.device("cpu"))
    rows = np.array([[11, 22]], dtype=np.int64)
    table = np.full(shape, EMPTY, dtype=np.int64)
    if shape == (16, 2):
        # The key's first word at its home slot, its second where the next
        # slot's group id is.
        home = int(key_slot_hash(0, rows, 0) & 15)
        table[home] = [0, 11]
        table[(home + 1) % 16, 0] = 22
    kw = dict(table=table, params=plan.params)
    if fn == "find_hits":
        kw.update(token_lens=None, apply_eagle=False)
    one = np.array([0], np.int64), np.array([1], np.int64)
    tokens = np.array([layout.scheduler_block_size], np.int64)
    with pytest.raises(ValueError, match="table"):
        getattr(scan_numba, fn)(rows, *one, tokens, sg.numpy(), cand.numpy(), **kw)


def _launch(fn, *, lengths=None, tokens=None, token_lens=None, offsets=None,
            rows=None, edit_rows=None, **sizes):  # fmt: skip
    """``fn`` of scan_numba on two llama requests (4 and 2 hashes, every key
    stored), with the arrays or sizes given replacing the good ones (a size
    named as a PlanParams field replaces that field of the plan's params;
    ``edit_rows(sg, cand)`` edits copies of the plan's rows in place)."""
    from kvhit.coordinator.plan import plan_tensors

    layout = make_layout("llama")
    plan = ScanPlan.from_layout(layout)
    sg, cand = plan_tensors(plan, torch.device("cpu"))
    if edit_rows is not None:
        sg, cand = sg.clone(), cand.clone()
        edit_rows(sg.numpy(), cand.numpy())
    good_rows = np.arange(1, 7, dtype=np.int64).reshape(-1, 1)
    exists = {(0, int(v).to_bytes(8, "little")) for v in good_rows[:, 0]}
    fields = {k: sizes.pop(k) for k in list(sizes) if k in PlanParams._fields}
    kw = dict(
        table=key_index(exists).table.numpy(), params=plan.params._replace(**fields)
    )
    kw.update(sizes)
    if fn == "find_hits":
        kw.update(token_lens=token_lens, apply_eagle=False)
    return getattr(scan_numba, fn)(
        good_rows if rows is None else rows,
        np.array([0, 4], np.int64) if offsets is None else offsets,
        np.array([4, 2], np.int64) if lengths is None else lengths,
        np.array([64, 32], np.int64) if tokens is None else tokens,
        sg.numpy(), cand.numpy(), **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "sizes",
    [
        {},
        dict(hash_block_size=np.int64(16), alignment=np.int32(16), partial=np.bool_(0)),
    ],
)
def test_launch_helper_answers(sizes):
    """The plan's own params, and the same values as numpy scalars (read from
    an array), answer alike."""
    for fn in ("find_hits", "lookup_hits", "count_probes"):
        got = _launch(fn, **sizes)
        hit = got if fn == "lookup_hits" else got[0]
        # lookup: a hit of the whole prompt is re-derived one token short.
        assert hit.tolist() == ([64, 32] if fn == "find_hits" else [48, 16])


# A request array one entry short, read past its end: the entry after it in
# memory is huge (a view of a longer array), so the kernel scanned a request
# of 10**9 hashes or tokens.
_HUGE = np.array([4, 2, 10**9], np.int64)


# count_probes is serial: no parallel argument.
_LAUNCHERS = [("find_hits", False), ("find_hits", True), ("lookup_hits", False),
              ("lookup_hits", True), ("count_probes", None)]  # fmt: skip


@pytest.mark.parametrize("fn, parallel", _LAUNCHERS)
@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (dict(lengths=_HUGE[:1]), ValueError, "lengths must have shape"),
        (dict(tokens=_HUGE[:1]), ValueError, "(max_lengths|num_tokens) must have"),
        (dict(tokens=np.array([64.9, 32.5])), TypeError, "max_lengths|num_tokens"),
        (dict(lengths=[4, 2]), TypeError, "lengths"),
        (dict(offsets=np.zeros((2, 1), np.int64)), ValueError, "offsets"),
        (dict(rows=np.arange(6, dtype=np.int64)), ValueError, "rows"),
        (dict(hash_block_size=0), ValueError, "hash_block_size"),
        (dict(alignment=0), ValueError, "alignment"),
        (dict(alignment=-16), ValueError, "alignment"),
        (dict(alignment=True), TypeError, "alignment must be an int >= 1, got bool"),
        (dict(hash_block_size=16.0), TypeError, "hash_block_size"),
        (
            dict(params=(1, 16, 16, False, False)),
            TypeError,
            "params must be a PlanParams",
        ),
    ],
)
def test_launchers_refuse_bad_request_arrays_and_sizes(fn, parallel, bad, exc, match):
    """Every per-request array is ``[R]`` integers and the sizes are ints
    >= 1, or the call is an error naming the argument: a short array was
    read past its end, a float one truncated, and a zero alignment raised
    ZeroDivisionError in the serial loop but answered zeros in the threaded
    one."""
    if parallel is not None:
        bad = {**bad, "parallel": parallel}
    with pytest.raises(exc, match=match):
        _launch(fn, **bad)


def _member_past_the_groups(sg, cand):
    sg[0, SG_MEMBERS] = cand.shape[0]


def _zero_period(sg, cand):
    sg[0, SG_PERIOD] = 0


@pytest.mark.parametrize("fn, parallel", _LAUNCHERS)
@pytest.mark.parametrize(
    "edit, match",
    [
        (_member_past_the_groups, r"sg_rows\[0, member 0\] must be a group id"),
        (_zero_period, r"sg_rows\[0, period\] must be >= 1, got 0"),
    ],
)
def test_launchers_refuse_bad_plan_rows(fn, parallel, edit, match):
    """A plan row's values are checked before the kernel reads them: a member
    group id one past the groups indexed the candidate rows and the scratch
    past the groups, and a zero period raised ZeroDivisionError in one loop
    and answered zeros in the threaded one."""
    kw = {} if parallel is None else {"parallel": parallel}
    with pytest.raises(ValueError, match=match):
        _launch(fn, edit_rows=edit, **kw)
    sg, cand = (r.clone() for r in _llama_rows())
    edit(sg.numpy(), cand.numpy())
    with pytest.raises(ValueError, match=match):
        scan_numba.prepare_scan(
            sg.numpy(), cand.numpy(), hash_block_size=16, alignment=16,
            partial=False, simple_hybrid=False,
        )  # fmt: skip


def _llama_rows():
    from kvhit.coordinator.plan import plan_tensors

    return plan_tensors(ScanPlan.from_layout(make_layout("llama")), torch.device("cpu"))


def test_find_hits_refuses_short_token_lens():
    with pytest.raises(ValueError, match="token_lens must have shape"):
        _launch("find_hits", token_lens=_HUGE[:1])


def test_prepare_scan_refuses_bad_sizes():
    plan = ScanPlan.from_layout(make_layout("llama"))
    from kvhit.coordinator.plan import plan_tensors

    sg, cand = plan_tensors(plan, torch.device("cpu"))
    for hbs, align in [(0, 16), (16, 0), (16, -16)]:
        with pytest.raises(ValueError, match="hash_block_size|alignment"):
            scan_numba.prepare_scan(
                sg.numpy(), cand.numpy(), hash_block_size=hbs, alignment=align,
                partial=False, simple_hybrid=False,
            )  # fmt: skip


# -- threads by work ---------------------------------------------------------------


def test_threads_are_picked_by_work_not_request_count():
    hashes = scan_numba.PARALLEL_MIN_HASHES
    on = scan_numba.numba.config.NUMBA_NUM_THREADS > 1
    assert scan_numba.threaded(64, hashes, None) is on
    assert scan_numba.threaded(2, hashes, None) is on
    if PARALLEL_MIN_REQUESTS > 64:
        assert scan_numba.threaded(64, hashes - 1, None) is False
    assert scan_numba.threaded(PARALLEL_MIN_REQUESTS, 0, None) is on
    # One request never waits for a second thread; forcing wins both ways.
    assert scan_numba.threaded(1, 10 * hashes, None) is False
    assert scan_numba.threaded(1, 0, True) is True
    assert scan_numba.threaded(10**6, 10**9, False) is False


@settings(max_examples=EXAMPLES)
@given(
    lengths=st.lists(
        st.one_of(st.integers(0, 3), st.integers(0, 10**12)), min_size=1, max_size=70
    ),
    threads=st.sampled_from([1, 2, 3, 16, 64]),
)
def test_threaded_runs_take_every_request_once(lengths, threads):
    # The cut alone, as _batch_parallel makes it with 4 runs per thread:
    # each request in exactly one run, and within a run the requests that
    # belong to it follow those before it and precede those past it (the
    # kernel's early break).
    side = scan_numba.run_side.py_func
    n = len(lengths)
    k = min(n, 4 * threads)
    total = sum(lengths) + n
    runs_of = [[] for _ in range(n)]
    for c in range(k):
        before, sides = 0, []
        for length in lengths:
            sides.append(side(before, length, c, k, total))
            before += length + 1
        assert sides == sorted(sides)
        for r, s in enumerate(sides):
            if s == 0:
                runs_of[r].append(c)
    assert all(len(runs) == 1 for runs in runs_of), runs_of


@pytest.mark.parametrize(
    "lengths",
    [
        [0, 0],
        [5, 0, 0, 0, 0, 0, 0, 0, 0],  # more requests than runs, one with work
        [300] + [1] * 40,  # one long request among short ones
        [1] * 40 + [300],
        [7, 300, 2, 300, 0, 90, 1],  # fewer requests than runs
        list(range(33)),
        [64] * 17,
    ],
)
def test_threads_answer_every_request_once(lengths):
    # The threaded batch cuts the requests into runs by where each one's
    # work is centred; every key is stored, so a request no run took would
    # answer 0, not its full length.
    layout = CacheLayout([Group(FullAttention(16))], 16, 16)
    rng = np.random.default_rng(len(lengths))
    reqs = [
        [bytes(rng.integers(0, 256, 8, np.uint8)) for _ in range(n)] for n in lengths
    ]
    index = helpers.key_index({(0, h) for r in reqs for h in r})
    batch = HashBatch.from_bytes(reqs, 8, "cpu")
    tokens = torch.tensor([16 * n + 1 for n in lengths], dtype=torch.int64)
    got = {}
    for parallel in (False, True):
        backend = NumbaBackend(ScanPlan.from_layout(layout), torch.device("cpu"))
        backend.parallel = parallel
        got[parallel] = backend.lookup(batch.view(), tokens, index).tolist()
    assert got[True] == got[False] == [16 * n for n in lengths]


@pytest.mark.parametrize("value", ["-1", "many"])
def test_parallel_min_hashes_is_checked_naming_the_variable(value):
    res = subprocess.run(
        [sys.executable, "-c", "import kvhit.kernels.scan_numba"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KVHIT_NUMBA_PARALLEL_MIN_HASHES": value},
    )
    assert res.returncode != 0
    assert "KVHIT_NUMBA_PARALLEL_MIN_HASHES" in res.stderr


@pytest.mark.parametrize("long_at", [0, 5, 39])
def test_threaded_runs_of_equal_work_answer_every_request(long_at):
    # One long request among short and empty ones: the runs of equal work
    # are uneven in requests (one run may hold a single request, another
    # dozens); every request is answered as the serial loop answers it.
    layout = make_layout("llama")
    rng = np.random.default_rng(long_at)
    pool = [bytes(rng.integers(0, 256, 8, dtype=np.uint8)) for _ in range(400)]
    requests = [pool[: int(rng.integers(0, 6))] for _ in range(40)]
    requests[long_at] = pool
    batch = HashBatch.from_bytes(requests, 8)
    index = KeyIndex(8, capacity=1024)
    index.add(0, pool[:350])
    lens = [16 * len(r) + 8 for r in requests]
    engine = LookupEngine(layout)
    got = []
    for parallel in (False, True):
        engine.impl.parallel = parallel
        got.append(engine.lookup(batch, lens, index))
        got.append(engine.find_longest_cache_hit(batch, lens, index).hit_lengths)
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[3])
    assert int(got[0][long_at]) > 0
