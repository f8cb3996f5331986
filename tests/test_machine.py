"""bench/machine.py: the dependent-load figure every ``kvhit bench`` run records."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvhit.bench import machine

pytest.importorskip("numba")


def test_the_ring_visits_every_line_once_then_closes() -> None:
    lines = 1000
    buf, start = machine.ring(lines, np.random.default_rng(5))
    assert buf.shape == (lines * 8,) and buf.dtype == np.int64
    seen, p = set(), start
    for _ in range(lines):
        assert p % 8 == 0 and p not in seen
        seen.add(p)
        p = int(buf[p])
    assert p == start and len(seen) == lines
    # Only word 0 of a line is a link; the rest stay zero.
    assert not buf.reshape(lines, 8)[:, 1:].any()


def test_dependent_load_ns_gives_a_figure_per_size() -> None:
    ns = machine.dependent_load_ns((1, 2), steps=2000)
    assert ns is not None and list(ns) == [1, 2]
    # At least a cycle (0.2 ns) a load, and under a millisecond.
    assert all(0.2 < v < 1e6 for v in ns.values()), ns
    text = machine.describe(ns)
    assert text.startswith("1 MB ") and ", 2 MB " in text and text.endswith(" ns")


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"steps": 0}, ValueError, "steps"),
        ({"steps": True}, TypeError, "steps"),
        ({"steps": 1.5}, TypeError, "steps"),
        ({"sizes_mb": ()}, ValueError, "sizes_mb"),
        ({"sizes_mb": (0,)}, ValueError, "sizes_mb"),
        ({"sizes_mb": (1, 2.0)}, TypeError, "sizes_mb"),
    ],
)
def test_bad_arguments_name_themselves(
    kwargs: dict, error: type[Exception], name: str
) -> None:
    # The launchers' size check (kernels/checks.check_size): TypeError for a
    # type, ValueError for a value.
    with pytest.raises(error, match=name):
        machine.dependent_load_ns(**kwargs)


def test_a_failing_chase_costs_the_figure_not_the_benchmark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise MemoryError("no 64 MB today")

    monkeypatch.setattr(machine, "dependent_load_ns", broken)
    assert machine.memory_state() == "n/a (MemoryError: no 64 MB today)"


def test_no_numba_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU box running from a source tree may lack numba: the bench still runs.
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setattr(machine, "_chase", None)
    assert machine.dependent_load_ns((1,), steps=10) is None
    assert machine.describe(None) == "n/a (no numba)"
