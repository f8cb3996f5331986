"""The interpreter speed-ups the suite and the CPU runs of the GPU checks use
(``bench/gpu_common.speed_up_interpreter``): inside a launch, a
``@triton.jit`` helper's call no longer walks ``triton.language`` again, and
a ``tl.reduce`` by ``bit_and``/``bit_or`` runs in numpy; nothing else
changes: the answers, and the language restored after the launch. Run under
the newest Triton here and under the floor (3.6.0) by the device twin
(``.ci/device-twin``)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

from kvhit.bench.gpu_common import patch_lang_once_per_launch
from kvhit.kernels.fleet_probe import bit_and, bit_or

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's own patching"
)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    acc = x
    for _ in tl.static_range(CALLS):
        acc = _twice(acc) - x  # a helper of this module
    # tl.sum: a helper of triton.language.standard (it sees tl.core).
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0) + tl.max(x, axis=0))


def _walks_and_answer(calls: int, unpatched: bool = False) -> tuple[int, list[int]]:
    """How many modules ``_patch_builtin`` walked during one launch of two
    programs whose helpers run ``calls`` times each, and its answer; with
    ``unpatched``, under the interpreter's own ``_patch_lang``."""
    from triton.runtime import interpreter

    real = interpreter._patch_builtin
    walked: list[object] = []

    def counting(pkg, *args):
        walked.append(pkg)
        return real(pkg, *args)

    own = interpreter._patch_lang
    x = torch.arange(1, 9, dtype=torch.int64)
    out = torch.zeros(2, dtype=torch.int64)
    with (
        mock.patch.object(interpreter, "_patch_builtin", counting),
        mock.patch.object(
            interpreter, "_patch_lang", own.__wrapped__ if unpatched else own
        ),
    ):
        _helpers_kernel[(2,)](x, out, N=8, CALLS=calls)
    return len(walked), out.tolist()


def test_a_launch_walks_the_language_once_however_many_helper_calls():
    from triton.runtime import interpreter

    patch_lang_once_per_launch()  # idempotent: conftest installed it
    assert getattr(interpreter._patch_lang, "kvhit_once", False)
    few, answer_few = _walks_and_answer(2)
    many, answer_many = _walks_and_answer(9)
    before, answer_before = _walks_and_answer(9, unpatched=True)
    # acc stays x after each (2 acc - x): the sum of 1..8 plus max 8.
    assert answer_few == answer_many == answer_before == [44, 44]
    # The launch's walk and tl.core's once (3-4 modules each), not 3-4 more
    # per helper call: 2 programs x (9 + 2) calls walked each time before.
    assert few <= 10 and many <= 10
    assert before >= 2 * (9 + 2) * 3


def test_the_language_is_restored_after_a_launch_and_after_a_failed_one():
    load = tl.load
    _walks_and_answer(3)
    assert tl.load is load

    @triton.jit
    def failing(x_ptr, n: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, n), tl.load(x_ptr + tl.arange(0, 2 * n)))

    with pytest.raises(Exception, match="shape"):  # the interpreter's own error type
        failing[(1,)](torch.ones(2, dtype=torch.int64), 2)
    assert tl.load is load
    # A launch after the failed one patches afresh and answers right.
    assert _walks_and_answer(2)[1] == [44, 44]


@triton.jit
def _bits_kernel(
    x_ptr,
    out_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    AXIS: tl.constexpr,
    N: tl.constexpr,
):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + offs)
    a = tl.reduce(x, AXIS, bit_and)
    o = tl.reduce(x, AXIS, bit_or)
    tl.store(out_ptr + tl.arange(0, N), a)  # N: the lanes left (R or C)
    tl.store(out_ptr + N + tl.arange(0, N), o)
    # And over every word (a 1-D reduction to a scalar).
    tl.store(out_ptr + 2 * N, tl.reduce(tl.reshape(x, (R * C,)), 0, bit_and))


@pytest.mark.parametrize("axis", [0, 1])
def test_bitwise_reductions_run_in_numpy_with_the_generic_paths_answer(axis):
    """``bit_and``/``bit_or`` reductions (the fleet kernels') answer as the
    interpreter's generic per-element path does, on words with the sign bit
    set, and never call their combine function."""
    from triton.runtime import interpreter

    from kvhit.bench.gpu_common import speed_up_interpreter

    speed_up_interpreter()  # idempotent: conftest installed it
    rng = torch.Generator().manual_seed(3)
    x = torch.randint(-(2**63), 2**63 - 1, (4, 8), dtype=torch.int64, generator=rng)
    x[0, 0] = -1
    n = 4 if axis == 1 else 8
    fast = torch.zeros(2 * n + 1, dtype=torch.int64)
    generic = torch.zeros_like(fast)
    own = interpreter.ReduceOps.apply_impl
    with mock.patch.object(interpreter.ReduceOps, "generic_reduce") as slow:
        _bits_kernel[(1,)](x, fast, R=4, C=8, AXIS=axis, N=n)
    assert not slow.called
    with mock.patch.object(interpreter.ReduceOps, "apply_impl", own.__wrapped__):
        _bits_kernel[(1,)](x, generic, R=4, C=8, AXIS=axis, N=n)
    assert fast.tolist() == generic.tolist()
    rows = x.tolist()
    cols = [list(c) for c in zip(*rows, strict=True)]
    lanes = rows if axis == 1 else cols
    expect_and, expect_or = [], []
    for lane in lanes:
        a, o = -1, 0
        for v in lane:
            a, o = a & v, o | v
        expect_and.append(a)
        expect_or.append(o)
    total = -1
    for v in sum(rows, []):
        total &= v
    assert fast.tolist() == expect_and + expect_or + [total]
