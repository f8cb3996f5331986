"""kernels/masks.py: each formula gives the same answer on Python ints and
on int64 torch tensors (the reference and the plan use the ints, the batched
backends the tensors), and matches the rule it is written from."""

from __future__ import annotations

import ast
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.kernels import contract, masks
from kvhit.kernels.contract import cdiv
from kvhit.kernels.masks import (
    asked_chunks,
    mamba_replay_mask,
    mamba_segment_mask,
    minimum,
    sliding_window_need,
    sparse_window_chunk,
    sparse_window_mask,
    swa_replay_mask,
    swa_segment_chunks,
)

CHUNKS = list(range(-3, 70))


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _elementwise(fn, columns: list[list[int]]) -> None:
    """``fn`` over tensors equals ``fn`` over each row of ints, and the tensor
    result has the broadcast shape."""
    got = fn(*[_t(c) for c in columns])
    want = [fn(*row) for row in zip(*columns, strict=True)]
    assert got.shape == (len(want),)
    assert got.tolist() == [int(w) if not isinstance(w, bool) else w for w in want]


def test_one_cdiv_everywhere():
    from kvhit.coordinator import managers, reference

    assert masks.cdiv is contract.cdiv
    assert managers.cdiv is contract.cdiv
    assert reference.cdiv is contract.cdiv
    # Nobody writes its own (the compiled kernels' spelled-out copies aside).
    root = Path(__file__).resolve().parent.parent
    defined = [
        str(path.relative_to(root))
        for folder in ("kvhit", "kernels", "coordinator", "bindings", "bench")
        for path in (root / folder).rglob("*.py")
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "cdiv"
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert defined == ["kernels/contract.py"]


@pytest.mark.parametrize("b", [1, 2, 3, 7, 64])
def test_cdiv_ints_and_tensors(b):
    a = list(range(-20, 200))
    assert [cdiv(x, b) for x in a] == [math.ceil(x / b) for x in a]
    assert cdiv(_t(a), b).tolist() == [cdiv(x, b) for x in a]


def test_minimum_ints_and_tensors():
    pairs = list(itertools.product(range(-5, 6), repeat=2))
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    assert [minimum(x, y) for x, y in pairs] == [min(x, y) for x, y in pairs]
    _elementwise(minimum, [a, b])
    # Mixed: a tensor and an int.
    assert minimum(_t(a), 0).tolist() == [min(x, 0) for x in a]
    assert minimum(0, _t(a)).tolist() == [min(0, x) for x in a]


def test_sliding_window_need():
    for w, bs, eagle in itertools.product(range(1, 70), (1, 2, 3, 4, 16), (0, 1)):
        want = math.ceil((w - 1) / bs) + eagle
        assert sliding_window_need(w, bs, eagle) == want
        assert sliding_window_need(w, bs, bool(eagle)) == want
    # The per-request EAGLE drop as a bool tensor (the batched scans).
    drop = torch.tensor([False, True, True, False])
    assert sliding_window_need(128, 64, drop).tolist() == [2, 3, 3, 2]
    assert sliding_window_need(_t([1, 2, 8, 9]), 4).tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("per_segment", [1, 2, 3, 4, 5, 8, 16])
def test_sparse_window_mask_ints_tensors_and_rule(per_segment, shift):
    for need in range(0, per_segment + 1):
        got = [sparse_window_mask(c, per_segment, need, shift) for c in CHUNKS]
        # The rule: the last `need` chunks of each segment, segments from `shift`.
        want = [
            c >= shift and (c - shift) % per_segment >= per_segment - need
            for c in CHUNKS
        ]
        assert got == want
        assert all(isinstance(g, bool) for g in got)
        tensor = sparse_window_mask(_t(CHUNKS), per_segment, need, shift)
        assert tensor.dtype == torch.bool
        assert tensor.tolist() == want


@settings(max_examples=200, deadline=None)
@given(
    per_segment=st.integers(1, 40),
    data=st.data(),
    shift=st.integers(0, 1),
)
def test_sparse_window_chunk_enumerates_the_mask(per_segment, data, shift):
    need = data.draw(st.integers(1, per_segment))
    top = 5 * per_segment + shift + 3
    kept = [c for c in range(top) if sparse_window_mask(c, per_segment, need, shift)]
    ks = list(range(len(kept)))
    assert [sparse_window_chunk(k, per_segment, need, shift) for k in ks] == kept
    assert sparse_window_chunk(_t(ks), per_segment, need, shift).tolist() == kept


def test_all_arguments_as_tensors():
    rows = list(itertools.product(range(-2, 20), (1, 3, 4), (0, 1, 2, 3), (0, 1)))
    cols = [list(c) for c in zip(*rows, strict=True)]
    _elementwise(sparse_window_mask, cols)
    valid = [r for r in rows if r[2] >= 1]
    _elementwise(sparse_window_chunk, [list(c) for c in zip(*valid, strict=True)])


def test_swa_replay_mask():
    for boundary, sched, bs, need, shift in itertools.product(
        (0, 1, 15, 16, 17, 47, 63, 64, 130), (16, 64), (4, 8, 16), (0, 1, 2, 5), (0, 1)
    ):
        end = boundary // sched * sched // bs + shift
        want = [end - need <= c < end for c in CHUNKS]
        got = [swa_replay_mask(c, boundary, sched, bs, need, shift) for c in CHUNKS]
        assert got == want
        tensor = swa_replay_mask(_t(CHUNKS), boundary, sched, bs, need, shift)
        assert tensor.tolist() == want
    # One boundary per request, as the batched store masks use it.
    b = _t([0, 16, 130])[:, None]
    grid = swa_replay_mask(_t(CHUNKS)[None, :], b, 16, 4, 2, 1)
    assert grid.shape == (3, len(CHUNKS))
    for i, bound in enumerate([0, 16, 130]):
        row = [swa_replay_mask(c, bound, 16, 4, 2, 1) for c in CHUNKS]
        assert grid[i].tolist() == row


def test_mamba_masks():
    for per in (1, 2, 3, 4, 7):
        want = [(c + 1) % per == 0 for c in CHUNKS]
        assert [mamba_segment_mask(c, per) for c in CHUNKS] == want
        assert mamba_segment_mask(_t(CHUNKS), per).tolist() == want
    for boundary, sched, bs in itertools.product(
        (0, 15, 16, 63, 64, 200), (16, 64), (4, 16)
    ):
        want = [c == boundary // sched * sched // bs - 1 for c in CHUNKS]
        got = [mamba_replay_mask(c, boundary, sched, bs) for c in CHUNKS]
        assert got == want
        assert mamba_replay_mask(_t(CHUNKS), boundary, sched, bs).tolist() == want


def test_swa_segment_chunks():
    assert swa_segment_chunks(None, 256, 64) == 4
    assert swa_segment_chunks(0, 256, 64) is None
    assert swa_segment_chunks(1024, 256, 64) == 16


@pytest.mark.parametrize("sparse", [False, True])
def test_asked_chunks_ints_tensors_and_rule(sparse):
    rows = list(
        itertools.product(range(0, 40), range(0, 200, 4), (4, 8, 12), (1, 2, 3))
    )
    for n, tl, bs, per_block in rows:
        want = min(n // per_block, math.ceil(tl / bs))
        if sparse:
            want = min(want, tl // bs)
        assert asked_chunks(n, tl, bs, per_block, sparse) == want
    cols = [list(c) for c in zip(*rows, strict=True)]
    got = asked_chunks(_t(cols[0]), _t(cols[1]), _t(cols[2]), _t(cols[3]), sparse)
    assert got.tolist() == [asked_chunks(*r, sparse) for r in rows]
    # Int sizes with tensor lengths, as the batched candidate code calls it.
    got = asked_chunks(_t(cols[0]), _t(cols[1]), 8, 2, sparse)
    assert got.tolist() == [asked_chunks(r[0], r[1], 8, 2, sparse) for r in rows]


def test_asked_chunks_partial_hash_hits_form():
    """With partial hash hits the worker walks min(hashes, token_len // hbs)
    units; token_len is then a multiple of hbs."""
    for n, units, hbs in itertools.product(range(0, 30), range(0, 30), (1, 4, 16)):
        tl = units * hbs
        assert asked_chunks(n, tl, hbs, 1, False) == min(n, tl // hbs)


def test_masks_module_needs_no_torch():
    code = (
        "import sys; import kvhit.kernels.masks, kvhit.coordinator.kinds, "
        "kvhit.coordinator.reference; "
        "sys.exit(int(any(m in sys.modules for m in ('torch', 'triton', 'numba'))))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
