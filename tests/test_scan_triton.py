"""Parity of the triton backend (``kvhit.kernels.scan``) with the scalar
reference (``ReferenceCoordinator``), the one oracle.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest.py),
which is slow: sizes stay small (prompts of at most ~40 hash units, batches of
at most 5) and example counts are modest. ``block=2`` runs make the kernel's
multi-step loops (leading runs, rightmost searches, run windows, the duplicate
search) go round many times on these short prompts.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import (
    chunked_swa_layout,
    key_index,
    mamba_partial_layout,
    swa_eagle_layout,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    ALL_KINDS,
    case,
    chained_hashes,
    layouts,
    saved_keys,
)

from kvhit import (
    CacheLayout,
    FullAttention,
    Group,
    HashBatch,
    KeyIndex,
    LookupEngine,
    Mamba,
    ReferenceCoordinator,
    SlidingWindow,
)
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.plan import ScanPlan, plan_tensors
from kvhit.coordinator.triton_backend import TritonBackend
from kvhit.kernels import contract

MAX_HASHES = 40


def _mask_lists(tri: torch.Tensor) -> list[tuple[list[bool], ...]]:
    """Triples ``[R, G, 3]`` ``(length, lo, hi)`` as the reference's masks."""
    return [
        tuple([lo <= c < hi for c in range(n)] for n, lo, hi in row)
        for row in tri.tolist()
    ]


def _check_all(layout, requests, exists, lens, device, apply_eagle=True) -> None:
    """find_longest_cache_hit (hits and masks), lookup and load_masks of the
    triton backend, through the engine, equal the reference's."""
    ref = ReferenceCoordinator(layout)
    tri = LookupEngine(layout, backend="triton", device=device)
    index = key_index(exists, device)
    batch = HashBatch.from_bytes(requests, 8, device)

    want = [
        ref.find_longest_cache_hit(hl, n, exists, apply_eagle)
        for hl, n in zip(requests, lens, strict=True)
    ]
    res = tri.find_longest_cache_hit(
        batch, lens, index, apply_eagle=apply_eagle, with_masks=True
    )
    got = list(zip(res.hit_lengths.tolist(), res.mask_lists(), strict=True))
    assert got == [(h, tuple(m)) for m, h in want], layout

    got_lk = tri.lookup(batch, lens, index).tolist()
    want_lk = [ref.lookup(n, hl, exists) for hl, n in zip(requests, lens, strict=True)]
    assert got_lk == want_lk, layout

    hits = [h for _, h in want]
    lm = tri.load_masks(batch, hits).mask_lists()
    want_lm = [
        tuple(ref.load_mask(hl, h)) for hl, h in zip(requests, hits, strict=True)
    ]
    assert lm == want_lm, layout


def _launch(
    layout: CacheLayout,
    requests: list[list[bytes]],
    lens: list[int],
    width: int,
    device: str,
    block: int,
) -> tuple[tuple[torch.Tensor, ...], dict]:
    """The launchers' arguments for ``requests`` (``width``-byte hashes) at
    ``lens``: the positional ``(rows, offsets, lengths, max_lengths, sg_rows,
    cand_rows)`` on ``device`` and the plan's scalars with ``block``."""
    plan = ScanPlan.from_layout(layout)
    view = HashBatch.from_bytes(requests, width, device).view()
    sg_rows, cand_rows = plan_tensors(plan, device)
    ml = torch.tensor(lens, dtype=torch.int64, device=device)
    kw = dict(params=plan.params, block=block)
    return (view.rows, view.offsets, view.lengths, ml, sg_rows, cand_rows), kw


def _kernel_parity(layout, requests, exists, lens, device, apply_eagle) -> None:
    """The launchers with a tiny block equal the reference: ``scan_hits`` with
    and without an index and with the store worker's restriction (the
    reference over the keys the worker asks), and ``worker_lookup``."""
    from kvhit.kernels.scan import scan_hits, worker_lookup

    ref = ReferenceCoordinator(layout)
    args, kw = _launch(layout, requests, lens, 8, device, block=2)
    index = key_index(exists, device)
    a = layout.alignment
    tok = torch.tensor([n // a * a for n in lens], dtype=torch.int64, device=device)
    for table, token_len in ((index.table, None), (None, None), (index.table, tok)):
        hit, tri = scan_hits(
            *args, table=table, token_len=token_len, apply_eagle=apply_eagle, **kw
        )
        want = []
        for hl, n in zip(requests, lens, strict=True):
            present = exists if table is not None else None
            if token_len is not None:
                asked = ref.lookup_candidates(n, hl)
                present = {c for c in asked if c in exists}
            want.append(ref.find_longest_cache_hit(hl, n, present, apply_eagle))
        assert hit.tolist() == [h for _, h in want], (layout, token_len)
        assert _mask_lists(tri) == [tuple(m) for m, _ in want], layout
    got = worker_lookup(*args, table=index.table, **kw)
    want_lk = [ref.lookup(n, hl, exists) for hl, n in zip(requests, lens, strict=True)]
    assert got.tolist() == want_lk, layout


# ---------------------------------------------------------------------------
# Random parity
# ---------------------------------------------------------------------------


# Under the interpreter an example costs ~1.5 s, so the default run takes a
# sixth of KVHIT_PARITY_EXAMPLES here (25, ~40 s of a CPU suite meant to stay
# under ten minutes) and a parity run at scale (KVHIT_PARITY_EXAMPLES=2000)
# its share.
EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "150"))


@settings(max_examples=EXAMPLES // 6)
@given(data=case(max_hashes=MAX_HASHES, max_requests=5), apply_eagle=st.booleans())
def test_random_parity(device, data, apply_eagle):
    layout, requests, exists, lens = data
    _check_all(layout, requests, exists, lens, device, apply_eagle)


@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=max(6, EXAMPLES // 25))
@given(data=st.data())
def test_random_parity_per_kind(device, kind, data):
    layout, requests, exists, lens = data.draw(
        case(layouts(kinds=(kind,)), max_hashes=32, max_requests=3)
    )
    _check_all(layout, requests, exists, lens, device, data.draw(st.booleans()))


@settings(max_examples=max(10, EXAMPLES // 15))
@given(data=case(max_hashes=24, max_requests=4), apply_eagle=st.booleans())
def test_small_block_matches_reference(device, data, apply_eagle):
    layout, requests, exists, lens = data
    _kernel_parity(layout, requests, exists, lens, device, apply_eagle)


# ---------------------------------------------------------------------------
# Edge cases (the ARCHITECTURE.md seed regressions run through every backend in
# test_engine.py)
# ---------------------------------------------------------------------------


def _edge_layouts() -> list[CacheLayout]:
    return [
        CacheLayout([Group(FullAttention(4))], 4, 2),
        swa_eagle_layout(),
        mamba_partial_layout(),
        chunked_swa_layout(),
    ]


@pytest.mark.parametrize("layout", _edge_layouts(), ids=lambda _: "")
def test_edge_batches(device, layout):
    """Empty batch; a zero-length request among non-power-of-two ones; a single
    request; all-hit, all-miss and holed stores."""
    engine = LookupEngine(layout, backend="triton", device=device)
    empty = HashBatch.from_bytes([], 8, device)
    index = key_index(set(), device)
    res = engine.find_longest_cache_hit(empty, [], index, with_masks=True)
    assert res.hit_lengths.shape == (0,)
    assert engine.lookup(empty, [], index).shape == (0,)

    hbs = layout.hash_block_size
    requests = [chained_hashes(s, n) for s, n in [(0, 7), (1, 13), (2, 0), (0, 31)]]
    requests.append(requests[1][:5])
    everything = {(g, h) for g in range(layout.num_groups) for r in requests for h in r}
    holed = {k for i, k in enumerate(sorted(everything)) if i % 5 != 3}
    lens = [len(r) * hbs + (i % 3) for i, r in enumerate(requests)]
    lens[2] = 0
    for exists in (everything, set(), holed):
        _check_all(layout, requests, exists, lens, device)
        _check_all(layout, requests[3:4], exists, lens[3:4], device, False)
    # A zero-length request with a positive length (full attention bounds it).
    if any(sg.kind == "full" for sg in layout.spec_groups):
        _check_all(layout, [[], requests[0]], everything, [2 * hbs, 5], device)


def test_store_mask_round_trips_with_evictions(device):
    """Prompts saved through store_mask (chunked prefill, replay boundaries),
    then evicted at random, looked up at several lengths."""
    rng = random.Random(11)
    layouts_ = [
        CacheLayout(
            [
                Group(FullAttention(8)),
                Group(SlidingWindow(4, 5)),
                Group(SlidingWindow(4, 5), eagle=True),
                Group(Mamba(8)),
            ],
            8,
            2,
            use_eagle=True,
            retention_interval=16,
        ),
        CacheLayout(
            [Group(FullAttention(16)), Group(SlidingWindow(4, 8)), Group(Mamba(8))],
            16,
            4,
            use_eagle=True,
            retention_interval=0,
        ),
    ]
    for layout in layouts_:
        hbs = layout.hash_block_size
        requests = [chained_hashes(s, n) for s, n in [(5, 30), (6, 17), (7, 38)]]
        requests.append(chained_hashes(8, 9, prefix=requests[0][:25]))
        exists: set = set()
        for hl in requests[:3]:
            n_tok = len(hl) * hbs
            exists |= saved_keys(layout, hl, n_tok // 2, num_prompt_tokens=n_tok)
            exists |= saved_keys(
                layout, hl, n_tok, num_prompt_tokens=n_tok, start_token=n_tok // 2
            )
        exists = {k for k in sorted(exists) if rng.random() > 0.1}
        lens = [len(r) * hbs - rng.choice([0, 1, hbs]) for r in requests]
        _check_all(layout, requests, exists, lens, device)


def test_lookup_counts_duplicate_hash_at_a_candidate(device):
    """The store worker's exists set holds hash values: an EAGLE peek past the
    lookup length finds a key present because the same hash stands at a
    position the worker asked about."""
    layout = CacheLayout(
        [Group(FullAttention(4)), Group(SlidingWindow(4, 5), eagle=True)],
        4,
        4,
        use_eagle=True,
    )
    plain = chained_hashes(21, 6)
    dup = list(plain)
    dup[4] = dup[1]
    ref = ReferenceCoordinator(layout)
    engine = LookupEngine(layout, backend="triton", device=device)
    out = []
    for hl in (plain, dup):
        exists = {(g, h) for g in (0, 1) for h in hl}
        want = ref.lookup(17, hl, exists)
        batch = HashBatch.from_bytes([hl], 8, device)
        assert engine.lookup(batch, [17], key_index(exists, device)).tolist() == [want]
        out.append(want)
    # The duplicate really changes the answer (the peek to unit 4 hits).
    assert out == [12, 16]


def test_probe_ends_on_a_table_of_busy_slots(device):
    """A table with no EMPTY slot (every slot BUSY, as a dead insert could
    leave it) still ends the scan's probe: BUSY counts toward the bound, and
    nothing is found."""
    layout = CacheLayout(
        [Group(FullAttention(4)), Group(SlidingWindow(4, 5), eagle=True)],
        4,
        4,
        use_eagle=True,
    )
    hl = chained_hashes(3, 9)
    index = key_index({(g, h) for g in (0, 1) for h in hl}, device)
    index.table[:, 0] = contract.BUSY
    backend = TritonBackend(ScanPlan.from_layout(layout), device)
    view = HashBatch.from_bytes([hl, hl[:4]], 8, device).view()
    n = torch.tensor([36, 16], dtype=torch.int64, device=device)
    hit, _ = backend.find(view, n, index, True)
    assert hit.tolist() == [0, 0]
    assert backend.lookup(view, n, index).tolist() == [0, 0]


# ---------------------------------------------------------------------------
# Launches, launcher contract, imports
# ---------------------------------------------------------------------------


def test_one_launch_per_batch(device, monkeypatch):
    import kvhit.kernels.scan as scan

    calls = []
    kernel = scan._scan_kernel

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(scan, "_scan_kernel", Counting())
    layout = make_layout("dsv4-flash")
    engine = LookupEngine(layout, backend="triton", device=device)
    hl = chained_hashes(4, 130)
    exists = saved_keys(layout, hl, 512)
    index = key_index(exists, device)
    ref = ReferenceCoordinator(layout)
    for n_req in (1, 6):
        calls.clear()
        batch = HashBatch.from_bytes([hl] * n_req, 8, device)
        res = engine.find_longest_cache_hit(batch, [520] * n_req, index)
        assert len(calls) == 1 and calls[0] == (n_req,)
        assert res.hit_lengths.tolist() == [256] * n_req
        calls.clear()
        # 512 tokens hit the whole prompt: the second search runs in-kernel.
        got = engine.lookup(batch, [512] * n_req, index)
        assert len(calls) == 1 and calls[0] == (n_req,)
        assert got.tolist() == [ref.lookup(512, hl, exists)] * n_req


def _launch_args(device):
    layout = CacheLayout([Group(FullAttention(4)), Group(Mamba(4))], 4, 2)
    plan = ScanPlan.from_layout(layout)
    sg_rows, cand_rows = plan_tensors(plan, device)
    i64 = dict(dtype=torch.int64, device=device)
    args = dict(
        hashes=torch.zeros(6, 1, **i64),
        offsets=torch.tensor([0, 3], **i64),
        n_units=torch.tensor([3, 3], **i64),
        max_lengths=torch.tensor([6, 4], **i64),
        sg_rows=sg_rows,
        cand_rows=cand_rows,
    )
    kw = dict(
        table=KeyIndex(8, capacity=16, device=device).table,
        token_len=None,
        params=contract.PlanParams(
            num_groups=2,
            hash_block_size=2,
            alignment=4,
            partial=False,
            simple_hybrid=True,
        ),
        apply_eagle=True,
    )
    return args, kw


@pytest.mark.parametrize(
    "name,bad,exc",
    [
        ("hashes", lambda t: t.to(torch.int32), TypeError),
        ("offsets", lambda t: t.to(torch.int32), TypeError),
        ("n_units", lambda t: t[:1], ValueError),
        ("max_lengths", lambda t: torch.stack([t, t], 1)[:, 0], ValueError),
        ("max_lengths", lambda t: t.tolist(), TypeError),
        ("sg_rows", lambda t: t[:, :5].contiguous(), ValueError),
        ("cand_rows", lambda t: t.to(torch.float32), TypeError),
        ("table", lambda t: t[:, :1].contiguous(), ValueError),
        ("table", lambda t: t[:12].contiguous(), ValueError),
        ("token_len", lambda t: torch.zeros(3, dtype=torch.int64), ValueError),
        ("n_units", lambda t: t.to("meta"), ValueError),
        ("block", lambda t: 3, ValueError),
        ("hash_block_size", lambda t: 0, ValueError),
        ("hash_block_size", lambda t: 2.0, TypeError),
        ("alignment", lambda t: True, TypeError),
        ("num_groups", lambda t: -1, ValueError),
        ("params", lambda p: tuple(p), TypeError),
        ("params", lambda p: None, TypeError),
    ],
)
def test_launcher_validates_arguments(device, name, bad, exc):
    from kvhit.kernels.scan import scan_hits, worker_lookup

    args, kw = _launch_args(device)
    if name in args:
        args[name] = bad(args[name])
    elif name in contract.PlanParams._fields:
        # The plan's scalars travel as one PlanParams; errors name the field.
        kw["params"] = kw["params"]._replace(**{name: bad(None)})
    else:
        kw[name] = bad(kw.get(name) if kw.get(name) is not None else args["n_units"])
    with pytest.raises(exc, match=name):
        scan_hits(*args.values(), **kw)
    if name not in ("token_len", "max_lengths"):
        kw.pop("token_len")
        kw.pop("apply_eagle")
        with pytest.raises(exc, match=name):
            worker_lookup(*args.values(), **kw)


def test_launchers_check_plan_row_values_and_see_later_writes(device):
    """A member group id past the groups (read past the candidate rows) is
    refused, naming the row; the check is remembered per rows tensor, so a
    good call and then an in-place write to the same tensor is refused too."""
    from kvhit.kernels.scan import scan_hits, worker_lookup

    args, kw = _launch_args(device)
    # Copies: plan_tensors caches the plan's own tensors.
    args["sg_rows"], args["cand_rows"] = (
        args["sg_rows"].clone(),
        args["cand_rows"].clone(),
    )
    scan_hits(*args.values(), **kw)  # checked and remembered
    args["sg_rows"][0, contract.SG_MEMBERS] = 2
    match = r"sg_rows\[0, member 0\] must be a group id in \[0, 2\)"
    with pytest.raises(ValueError, match=match):
        scan_hits(*args.values(), **kw)
    kw.pop("token_len")
    kw.pop("apply_eagle")
    with pytest.raises(ValueError, match=match):
        worker_lookup(*args.values(), **kw)
    args["sg_rows"][0, contract.SG_MEMBERS] = 0
    args["cand_rows"][1, contract.CAND_SCALE] = 0
    with pytest.raises(ValueError, match=r"cand_rows\[1, scale\] must be >= 1"):
        worker_lookup(*args.values(), **kw)


def test_launcher_runs_with_valid_arguments(device):
    from kvhit.kernels.scan import scan_hits, worker_lookup

    args, kw = _launch_args(device)
    hit, tri = scan_hits(*args.values(), **kw)
    assert hit.tolist() == [0, 0] and tri.shape == (2, 2, 3)
    # Sizes as numpy integers (a plan's numbers read from an array) are ints.
    kw["params"] = kw["params"]._replace(
        hash_block_size=np.int64(2), alignment=np.int64(4), num_groups=np.int32(2)
    )
    hit2, tri2 = scan_hits(*args.values(), **kw)
    assert hit2.tolist() == hit.tolist() and torch.equal(tri2, tri)
    del kw["token_len"], kw["apply_eagle"]
    assert worker_lookup(*args.values(), **kw).tolist() == [0, 0]


def test_coordinator_does_not_import_triton():
    code = (
        "import sys, kvhit.coordinator.triton_backend, kvhit.coordinator.engine\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------
# Wide tiles (issue 31): long leading runs across several LEAD-wide tiles,
# near-miss keys (one word or the group id differs), every block width
# ---------------------------------------------------------------------------


def _near_miss(h: bytes, word: int) -> bytes:
    """``h`` with one byte of its ``word``-th 8-byte word flipped."""
    b = bytearray(h)
    b[8 * word] ^= 0x5A
    return bytes(b)


@settings(max_examples=max(6, EXAMPLES // 25), deadline=None)
@given(
    data=st.data(),
    run=st.integers(0, 300),
    kind=st.sampled_from(["full", "hybrid"]),
    block=st.sampled_from([2, 8, 32]),
)
def test_long_leading_runs_with_near_miss_keys(device, data, run, kind, block):
    """A leading run of ``run`` stored blocks (crossing tiles of LEAD_FACTOR *
    block blocks, with the next tile's home slots loaded ahead), then a block
    whose key is stored only as a near miss: the same words under another
    group, or one word off under the same group, then more stored blocks.
    32-byte hashes (4 words compared per slot). Hits and masks of
    ``scan_hits`` and ``worker_lookup`` equal the reference's."""
    from kvhit.kernels.scan import scan_hits, worker_lookup

    groups = [Group(FullAttention(4))]
    if kind == "hybrid":
        groups.append(Group(SlidingWindow(4, 8)))
    layout = CacheLayout(groups, 4, 4)
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    n_units = run + 1 + data.draw(st.integers(0, 20))
    hashes = [rng.randbytes(32) for _ in range(n_units)]
    gids = range(len(groups))
    exists = {(g, h) for g in gids for i, h in enumerate(hashes) if i != run}
    if run < n_units:
        how = data.draw(st.sampled_from(["group", "word0", "word3", "absent"]))
        h = hashes[run]
        if how == "group":
            exists.add((len(groups), h))  # a group the layout does not have
        elif how != "absent":
            word = 0 if how == "word0" else 3
            exists |= {(g, _near_miss(h, word)) for g in gids}
    n_tok = n_units * 4 - data.draw(st.integers(0, 3))
    ref = ReferenceCoordinator(layout)
    args, kw = _launch(layout, [hashes], [n_tok], 32, device, block)
    index = key_index(exists, device, width=32)
    hit, tri = scan_hits(
        *args, table=index.table, token_len=None, apply_eagle=True, **kw
    )
    mask, want = ref.find_longest_cache_hit(hashes, n_tok, exists, True)
    # The case is what it says: the hit runs up to the near miss.
    assert 4 * run - 4 <= want <= 4 * run
    assert hit.tolist() == [want]
    assert _mask_lists(tri) == [tuple(mask)]
    got = worker_lookup(*args, table=index.table, **kw)
    assert got.tolist() == [ref.lookup(n_tok, hashes, exists)]


@pytest.mark.parametrize("block", [2, 32])
def test_leading_runs_at_the_first_tiles_edges(device, block):
    """The leading run's first tile is half as wide as the others (FIRST =
    LEAD / 2): runs ending just before, at and after its edge and the next
    tile's, in one batch, with every request's keys in one crowded table
    (distractor keys of other groups: the wide tile's probe chains, which
    reload their words at each step, are walked). Hits, masks and the
    worker's lookup equal the reference's."""
    from kvhit.kernels.scan import LEAD_FACTOR, scan_hits, worker_lookup

    lead = block * LEAD_FACTOR
    first = lead // 2
    runs = sorted({0, 1, first - 1, first, first + 1, first + lead - 1,
                   first + lead, first + lead + 1})  # fmt: skip
    layout = CacheLayout([Group(FullAttention(4))], 4, 4)
    rng = random.Random(block)
    requests, exists = [], set()
    for run in runs:
        hashes = [rng.randbytes(32) for _ in range(run + 1 + rng.randint(0, 9))]
        requests.append(hashes)
        exists |= {(0, h) for i, h in enumerate(hashes) if i != run}
        exists |= {(1 + rng.randint(0, 2), h) for h in hashes}
    lens = [len(r) * 4 - rng.randint(0, 3) for r in requests]
    ref = ReferenceCoordinator(layout)
    args, kw = _launch(layout, requests, lens, 32, device, block)
    index = key_index(exists, device, width=32)
    hit, tri = scan_hits(
        *args, table=index.table, token_len=None, apply_eagle=True, **kw
    )
    want = [
        ref.find_longest_cache_hit(r, n, exists, True)
        for r, n in zip(requests, lens, strict=True)
    ]
    assert hit.tolist() == [h for _, h in want]
    assert [h // 4 for h in hit.tolist()] == runs  # the cases are what they say
    assert _mask_lists(tri) == [tuple(m) for m, _ in want]
    got = worker_lookup(*args, table=index.table, **kw)
    assert got.tolist() == [
        ref.lookup(n, r, exists) for r, n in zip(requests, lens, strict=True)
    ]
