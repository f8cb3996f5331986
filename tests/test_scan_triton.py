"""Parity of the triton backend (``kvhit.kernels.scan``) with the reference and
the torch backend.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest.py),
which is slow: sizes stay small (prompts of at most ~40 hash units, batches of
at most 6) and example counts are modest. ``block=2`` runs make the kernel's
multi-step loops (leading runs, rightmost searches, run windows) go round many
times on these short prompts.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import compile_outside_interpreter
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
    ChunkedLocal,
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
from kvhit.coordinator.plan import ScanPlan
from kvhit.coordinator.torch_backend import TorchScanner, _Batch
from kvhit.coordinator.triton_backend import find_hits, plan_tensors

MAX_HASHES = 40


def _index(keys, device, width: int = 8) -> KeyIndex:
    index = KeyIndex(width, capacity=16, device=device)
    keys = sorted(keys)
    if keys:
        index.add([g for g, _ in keys], [h for _, h in keys])
    return index


def _check_all(layout, requests, exists, lens, device, apply_eagle=True) -> None:
    """find_longest_cache_hit (hits and masks), lookup and load_masks of the
    triton backend equal the reference's and the torch backend's."""
    ref = ReferenceCoordinator(layout)
    tri = LookupEngine(layout, backend="triton", device=device)
    tor = LookupEngine(layout, backend="torch", device=device)
    index = _index(exists, device)
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
    res_t = tor.find_longest_cache_hit(
        batch, lens, index, apply_eagle=apply_eagle, with_masks=True
    )
    assert torch.equal(res.hit_lengths, res_t.hit_lengths)
    assert res.mask_lists() == res_t.mask_lists()

    got_lk = tri.lookup(batch, lens, index).tolist()
    want_lk = [ref.lookup(n, hl, exists) for hl, n in zip(requests, lens, strict=True)]
    assert got_lk == want_lk, layout
    assert tor.lookup(batch, lens, index).tolist() == got_lk

    hits = [h for _, h in want]
    lm = tri.load_masks(batch, hits).mask_lists()
    want_lm = [
        tuple(ref.load_mask(hl, h)) for hl, h in zip(requests, hits, strict=True)
    ]
    assert lm == want_lm, layout


def _scanner_parity(layout, requests, exists, lens, device, apply_eagle, token_len):
    """find_hits with a tiny block equals TorchScanner.find, with and without
    the store worker's candidate restriction."""
    plan = ScanPlan.from_layout(layout)
    batch = HashBatch.from_bytes(requests, 8, device)
    offsets = batch.offsets
    internal = _Batch(
        hashes=batch.hashes,
        offsets=offsets[:-1],
        lens=offsets[1:] - offsets[:-1],
        token_len=token_len,
    )
    ml = torch.tensor(lens, dtype=torch.int64, device=device)
    index = _index(exists, device)
    table, W = index.table, index.W

    def probe(g, rows):
        from kvhit.coordinator.key_index import probe_table

        return probe_table(table, W, g, batch.hashes[rows])

    for idx, prober in ((index, probe), (None, _all_present)):
        want_hit, want_tri = TorchScanner(plan, prober).find(internal, ml, apply_eagle)
        hit, tri = find_hits(plan, internal, ml, idx, apply_eagle, block=2)
        assert torch.equal(hit, want_hit), layout
        assert torch.equal(tri, want_tri), layout


def _all_present(g, rows):
    return torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)


# ---------------------------------------------------------------------------
# Random parity
# ---------------------------------------------------------------------------


@settings(max_examples=int(os.environ.get("KVHIT_PARITY_EXAMPLES", "150")) // 3)
@given(data=case(max_hashes=MAX_HASHES, max_requests=5), apply_eagle=st.booleans())
def test_random_parity(device, data, apply_eagle):
    layout, requests, exists, lens = data
    _check_all(layout, requests, exists, lens, device, apply_eagle)


@pytest.mark.parametrize("kind", ALL_KINDS)
@settings(max_examples=10)
@given(data=st.data())
def test_random_parity_per_kind(device, kind, data):
    layout, requests, exists, lens = data.draw(
        case(layouts(kinds=(kind,)), max_hashes=32, max_requests=3)
    )
    _check_all(layout, requests, exists, lens, device, data.draw(st.booleans()))


@settings(max_examples=25)
@given(
    data=case(max_hashes=24, max_requests=4),
    apply_eagle=st.booleans(),
    restrict=st.booleans(),
)
def test_small_block_matches_torch_scanner(device, data, apply_eagle, restrict):
    layout, requests, exists, lens = data
    token_len = None
    if restrict:
        a = layout.alignment
        token_len = torch.tensor(
            [n // a * a for n in lens], dtype=torch.int64, device=device
        )
    _scanner_parity(layout, requests, exists, lens, device, apply_eagle, token_len)


# ---------------------------------------------------------------------------
# The seed regressions of DESIGN.md
# ---------------------------------------------------------------------------


# The DESIGN.md seed regressions run through every backend in test_engine.py.


def _edge_layouts() -> list[CacheLayout]:
    return [
        CacheLayout([Group(FullAttention(4))], 4, 2),
        CacheLayout(
            [Group(FullAttention(12)), Group(SlidingWindow(6, 7), eagle=True)],
            12,
            3,
            use_eagle=True,
        ),
        CacheLayout(
            [Group(FullAttention(6)), Group(Mamba(6)), Group(SlidingWindow(3, 5))],
            6,
            3,
            use_eagle=True,
            partial_hash_hits=True,
        ),
        CacheLayout([Group(ChunkedLocal(4, 12)), Group(SlidingWindow(2, 3))], 4, 2),
    ]


@pytest.mark.parametrize("layout", _edge_layouts(), ids=lambda _: "")
def test_edge_batches(device, layout):
    """Empty batch; a zero-length request among non-power-of-two ones; a single
    request; all-hit, all-miss and holed stores."""
    engine = LookupEngine(layout, backend="triton", device=device)
    empty = HashBatch.from_bytes([], 8, device)
    index = _index(set(), device)
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
        assert engine.lookup(batch, [17], _index(exists, device)).tolist() == [want]
        out.append(want)
    # The duplicate really changes the answer (the peek to unit 4 hits).
    assert out == [12, 16]


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
    index = _index(exists, device)
    for n_req in (1, 6):
        calls.clear()
        batch = HashBatch.from_bytes([hl] * n_req, 8, device)
        res = engine.find_longest_cache_hit(batch, [520] * n_req, index)
        assert len(calls) == 1 and calls[0] == (n_req,)
        assert res.hit_lengths.tolist() == [256] * n_req


def _launch_args(device):
    layout = CacheLayout([Group(FullAttention(4)), Group(Mamba(4))], 4, 2)
    plan = ScanPlan.from_layout(layout)
    sg_rows, cand_rows = plan_tensors(plan, device)
    i64 = dict(dtype=torch.int64, device=device)
    args = dict(
        hashes=torch.zeros(6, 1, **i64),
        offsets=torch.tensor([0, 3], **i64),
        lens=torch.tensor([3, 3], **i64),
        max_lengths=torch.tensor([6, 4], **i64),
        sg_rows=sg_rows,
        cand_rows=cand_rows,
    )
    kw = dict(
        table=KeyIndex(8, capacity=16, device=device).table,
        token_len=None,
        hash_block_size=2,
        alignment=4,
        partial=False,
        simple_hybrid=True,
        num_groups=2,
        apply_eagle=True,
    )
    return args, kw


@pytest.mark.parametrize(
    "name,bad,exc",
    [
        ("hashes", lambda t: t.to(torch.int32), TypeError),
        ("offsets", lambda t: t.to(torch.int32), TypeError),
        ("lens", lambda t: t[:1], ValueError),
        ("max_lengths", lambda t: torch.stack([t, t], 1)[:, 0], ValueError),
        ("max_lengths", lambda t: t.tolist(), TypeError),
        ("sg_rows", lambda t: t[:, :5].contiguous(), ValueError),
        ("cand_rows", lambda t: t.to(torch.float32), TypeError),
        ("table", lambda t: t[:, :1].contiguous(), ValueError),
        ("table", lambda t: t[:12].contiguous(), ValueError),
        ("token_len", lambda t: torch.zeros(3, dtype=torch.int64), ValueError),
        ("lens", lambda t: t.to("meta"), ValueError),
    ],
)
def test_launcher_validates_arguments(device, name, bad, exc):
    from kvhit.kernels.scan import scan_hits

    args, kw = _launch_args(device)
    if name in args:
        args[name] = bad(args[name])
    else:
        kw[name] = bad(kw[name] if kw[name] is not None else args["lens"])
    with pytest.raises(exc, match=name):
        scan_hits(*args.values(), **kw)


def test_launcher_runs_with_valid_arguments(device):
    from kvhit.kernels.scan import scan_hits

    args, kw = _launch_args(device)
    hit, tri = scan_hits(*args.values(), **kw)
    assert hit.tolist() == [0, 0] and tri.shape == (2, 2, 3)


def test_coordinator_does_not_import_triton():
    code = (
        "import sys, kvhit.coordinator.triton_backend, kvhit.coordinator.engine\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


_COMPILE_FOR_GPU = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvhit.kernels import scan

ptrs = ["hashes_ptr", "offsets_ptr", "lens_ptr", "max_len_ptr", "tok_len_ptr",
        "table_ptr", "sg_ptr", "cand_ptr", "hit_ptr", "tri_ptr"]
sig = {n: "*i64" for n in ptrs}
sig.update({"cap_mask": "i64", "n_sg": "i32", "n_groups": "i32", "hbs": "i32",
            "align": "i32", "partial": "i32", "simple_hybrid": "i32"})
consts = ["W", "HAS_INDEX", "HAS_TL", "APPLY_EAGLE", "BLOCK", "S_PAD", "SG_W", "CAND_W"]
sig.update({n: "constexpr" for n in consts})
# The engine's variants: find (eagle on/off), load masks, lookup.
for has_index, has_tl, eagle in [(1, 0, 1), (1, 0, 0), (0, 0, 0), (1, 1, 1)]:
    cx = dict(W=4, HAS_INDEX=bool(has_index), HAS_TL=bool(has_tl),
              APPLY_EAGLE=bool(eagle), BLOCK=32, S_PAD=4, SG_W=12, CAND_W=8)
    src = ASTSource(fn=scan._scan_kernel, signature=sig, constexprs=cx)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 1})
    assert out.asm["cubin"], "no cubin"
    print(has_index, has_tl, eagle, "ok")
"""


def test_kernel_compiles_for_gpu():
    """Outside the interpreter, the kernel lowers to sm_90 code (with
    triton's bundled ptxas; no GPU needed): catches what the interpreter does
    not check, such as loop-carried type changes."""
    stdout = compile_outside_interpreter(_COMPILE_FOR_GPU)
    assert stdout.count("ok") == 4
