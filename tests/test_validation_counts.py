"""A warm lookup makes one validation pass per argument (issue 36).

``validation_counts.count`` profiles the calls of kvhit's check functions
while one warm ``LookupEngine.lookup`` runs: the batch and the index are
checked in one pass (``engine._check_batch``), ``num_tokens`` in one
(``kernels/checks.host_lengths``, reached from the backend's ``lengths``),
whatever form the lengths come in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from validation_counts import count, scenarios

ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.fixture(scope="module")
def warm() -> dict:
    return scenarios(ROOT)


#: The length checks a warm lookup may make (``host_lengths_or_int`` is the
#: numba backend's, which hands every form but one request's on to
#: ``host_lengths``).
LENGTH_CHECKS = {
    "checks.host_lengths",
    "checks.host_lengths_or_int",
    "checks.check_lengths",
    "checks._check_values",
}


@pytest.mark.parametrize("form", ["list", "numpy", "tensor"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_one_validation_pass_per_argument(warm, backend, form):
    calls, passes = count(warm[f"lookup[{backend}, {form} num_tokens]"], ROOT)
    # Two arguments checked (the batch with its index, num_tokens), once each.
    assert passes == 2, calls
    assert calls["engine._check_batch"] == 1
    assert calls["checks.host_lengths"] == 1
    # Nothing else re-checks: no launcher, no backend, no second length check.
    assert set(calls) <= {"engine._check_batch"} | LENGTH_CHECKS, calls
    assert all(n == 1 for n in calls.values()), calls


@pytest.mark.parametrize("form", ["list", "numpy", "tensor"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_one_request_one_validation_pass_per_argument(warm, backend, form):
    # A step of one request: the numba backend reads its length as an int,
    # checked once by host_lengths_or_int (no array made, no second check).
    calls, passes = count(
        warm[f"find[{backend}, one request, {form} max_lengths]"], ROOT
    )
    assert passes == 2, calls
    assert calls["engine._check_batch"] == 1
    assert set(calls) <= {"engine._check_batch"} | LENGTH_CHECKS, calls
    assert all(n == 1 for n in calls.values()), calls
    if backend == "numba":
        assert calls["checks.host_lengths_or_int"] == 1, calls
        assert "checks.host_lengths" not in calls, calls


def test_the_counter_sees_a_nested_check(warm):
    # A check called from inside another is a call, not a pass.
    calls, passes = count(warm["lookup[torch, numpy num_tokens]"], ROOT)
    assert calls["checks.check_lengths"] == 1 and calls["checks.host_lengths"] == 1
    assert sum(calls.values()) > passes == 2


@pytest.mark.parametrize("form", ["list", "numpy", "tensor"])
def test_triton_one_validation_pass_per_argument(warm, form):
    key = f"lookup[triton, {form} num_tokens]"
    if key not in warm:
        pytest.skip("no Triton here")
    calls, passes = count(warm[key], ROOT)
    assert passes == 2, calls
    assert calls["engine._check_batch"] == 1
    # A device tensor's values are the kernel's to check, read back with the
    # answer (check_answer); any other form is checked on the host, and the
    # answer is then not checked again.
    lengths = (
        {"triton_backend.check_answer"} if form == "tensor" else {"checks.host_lengths"}
    )
    assert lengths <= set(calls), calls
    assert ("triton_backend.check_answer" in calls) == (form == "tensor"), calls
    assert all(n == 1 for n in calls.values()), calls
