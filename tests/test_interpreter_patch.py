"""The interpreter speed-up the suite and the CPU runs of the GPU checks use
(``bench/gpu_common.patch_lang_once_per_launch``): inside a launch, a
``@triton.jit`` helper's call no longer walks ``triton.language`` again, and
nothing else changes: the answers, and the language restored after the
launch. Run under the newest Triton here and under the floor (3.6.0) by the
device twin (``.ci/device-twin``)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

from kvhit.bench.gpu_common import patch_lang_once_per_launch

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
