"""kernels/numba_views.py: the one-load reads against Python's bytes, the
guards that keep other types out, and unowned views reading what the array
holds (the kernels that use them are tested on their own results)."""

from __future__ import annotations

import random

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from kvhit.kernels import numba_views as nv  # noqa: E402


@numba.njit(cache=False)
def _reads(buf, positions, out):
    for i in range(positions.shape[0]):
        p = positions[i]
        out[i, 0] = nv.load_le64(buf, p)
        out[i, 1] = nv.load_be64(buf, p)
        out[i, 2] = nv.byte_at(buf, p)


@numba.njit(cache=False)
def _le(buf, p):
    return nv.load_le64(buf, p)


@numba.njit(cache=False)
def _be(buf, p):
    return nv.load_be64(buf, p)


@numba.njit(cache=False)
def _sum_unowned(a):
    v = nv.unowned(a)
    total = 0
    for i in range(v.shape[0]):
        total += v[i]
    return total


def test_loads_match_python_on_bytes_and_uint8_arrays() -> None:
    rng = random.Random(5)
    data = bytes(rng.randrange(256) for _ in range(301))
    positions = np.array(list(range(len(data) - 7)), dtype=np.int64)
    want = [
        (
            int.from_bytes(data[p : p + 8], "little", signed=True),
            int.from_bytes(data[p : p + 8], "big", signed=True),
            data[p],
        )
        for p in positions.tolist()
    ]
    ro = np.frombuffer(data, dtype=np.uint8)  # read-only
    for buf in (data, ro, ro.copy()):
        out = np.zeros((positions.shape[0], 3), dtype=np.int64)
        _reads(buf, positions, out)
        assert [tuple(r) for r in out.tolist()] == want


@pytest.mark.parametrize("load", [_le, _be])
def test_loads_refuse_what_is_not_a_flat_byte_buffer(load) -> None:  # noqa: ANN001
    for bad in (
        np.zeros((2, 16), dtype=np.uint8),  # 2-D: data + pos is not byte pos
        np.zeros(16, dtype=np.int64),  # not bytes
        np.zeros(32, dtype=np.uint8)[::2],  # strided
    ):
        with pytest.raises(numba.core.errors.TypingError):
            load(bad, 0)
    assert load(bytes(8), 0) == 0


def test_unowned_views_read_the_array_and_refuse_scalars() -> None:
    a = np.arange(1000, dtype=np.int64)
    assert _sum_unowned(a) == int(a.sum())
    assert _sum_unowned(a[::3]) == int(a[::3].sum())  # a strided view's own
    with pytest.raises(numba.core.errors.TypingError):
        _sum_unowned(7)
