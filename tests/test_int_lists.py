"""from_ints' decoder of a batch of lists (coordinator/int_lists.py, the
kernel kernels/msgpack_numba.unpack_int_lists), compiled: it reads exactly
what msgspec writes for lists of ints in int64, and refuses (-1, then None)
everything else, never reading past the bytes it is given."""

from __future__ import annotations

import enum
import os
import sys
from itertools import accumulate

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from kvhit.coordinator import int_lists as il  # noqa: E402
from kvhit.kernels import msgpack_numba as mn  # noqa: E402

#: Every msgpack int width's edges, both signs, and int64's ends.
EDGES = [
    0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
]  # fmt: skip
INT64 = st.one_of(st.sampled_from(EDGES), st.integers(-(2**63), 2**63 - 1))
# KVHIT_PARITY_EXAMPLES=N: N examples of the property below (a large run).
EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "200"))


@pytest.fixture(autouse=True, scope="module")
def _loaded() -> None:
    mn.warm_up()
    assert mn.loaded() and il.decoder_ready()


def _want(reqs: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    lengths = list(map(len, reqs))
    return [0, *accumulate(lengths)], lengths, [v for r in reqs for v in r]


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    # Short requests (many headers) and longer ones.
    reqs=st.sampled_from([3, 40]).flatmap(
        lambda n: st.lists(st.lists(INT64, max_size=n), max_size=40)
    )
)
def test_every_batch_of_int64_lists_reads_back_exactly(reqs) -> None:
    got = il.int_lists(reqs)
    assert got is not None
    assert tuple(a.tolist() for a in got) == _want(reqs)
    assert all(a.dtype == np.int64 for a in got)


@pytest.mark.parametrize("b", [0, 1, 15, 16, 65535, 65536])
def test_outer_and_inner_array_headers_of_every_width(b) -> None:
    # fixarray below 16, array 16 up to 65535, array 32 past it.
    reqs = [[i % 300 - 40] * (i % 3) for i in range(b)]
    if b:
        reqs[0] = [7] * 70_000  # an inner array 32
    got = il.int_lists(reqs)
    assert got is not None and tuple(a.tolist() for a in got) == _want(reqs)


class _Color(enum.IntEnum):
    RED = 5


@pytest.mark.parametrize(
    "bad",
    [True, False, 1.0, None, "1", b"1", [1], (1,), {1: 2}, 2**63, 2**64 - 1, 2**64,
     -(2**63) - 1, np.int64(3), np.True_, torch.tensor(3), torch.tensor(True)],
    ids=repr,
)  # fmt: skip
@pytest.mark.parametrize("at", [0, 5])
def test_anything_but_an_int64_int_is_refused(bad, at) -> None:
    reqs = [[0, 1, 2], [], [3, 4, 5, 6, 7, 8]]
    reqs[2][at] = bad
    assert il.int_lists(reqs) is None


@settings(max_examples=EXAMPLES, deadline=None)
@given(values=st.lists(INT64, max_size=300))
def test_one_list_reads_back_as_its_values(values) -> None:
    # int_list: the batch of one list, its values alone, a fresh array.
    got = il.int_list(values)
    assert got is not None and got.dtype == np.int64 and got.tolist() == values
    again = il.int_list(values)
    assert again is not None and not np.shares_memory(got, again)


@pytest.mark.parametrize("bad", [True, 1.5, None, 2**63, np.int64(3)], ids=repr)
def test_one_list_with_anything_but_an_int64_int_is_none(bad, monkeypatch) -> None:
    values = list(range(30))
    values[17] = bad
    assert il.int_list(values) is None
    # And from_ints, taking that path for a list this long, names the item.
    from kvhit.coordinator.packing import HashBatch

    if isinstance(bad, np.integer):
        assert HashBatch.from_ints([values]).hashes[17, 0].item() == 3
    else:
        error = ValueError if type(bad) is int else TypeError
        with pytest.raises(error, match="request 0, position 17: "):
            HashBatch.from_ints([values])
    # Not loaded (the Triton path): None, and from_ints packs without it.
    monkeypatch.setattr(il, "_unpack", None)
    monkeypatch.setattr(mn, "_warm", False)
    assert il.int_list(list(range(30))) is None
    got = HashBatch.from_ints([list(range(30))])
    assert got.hashes[:, 0].tolist() == list(range(30))


def test_int_subclasses_are_taken_by_value() -> None:
    got = il.int_lists([[1, _Color.RED], [2]])
    assert got is not None and got[2].tolist() == [1, 5, 2]


def test_cut_padded_or_corrupt_bytes_never_read_past_the_end() -> None:
    reqs = [[0, 1, -1, 200, -200, 70_000, -(2**40), 2**63 - 1], [], [5, 6]]
    msg = msgspec.msgpack.encode(reqs)
    out = np.full(64, -7, dtype=np.int64)
    assert mn.unpack_int_lists(msg, out) == 10
    for cut in range(len(msg)):
        assert mn.unpack_int_lists(msg[:cut], np.empty(64, np.int64)) == -1, cut
    assert mn.unpack_int_lists(msg + b"\x00", np.empty(64, np.int64)) == -1
    # Each byte replaced by each value: -1 or a count, never a crash; and a
    # count only where the bytes still read as an array of arrays of ints.
    rng = np.random.default_rng(0)
    for pos in range(len(msg)):
        for v in rng.integers(0, 256, 24).tolist():
            bent = bytearray(msg)
            bent[pos] = v
            out = np.empty(64, np.int64)
            n = mn.unpack_int_lists(bytes(bent), out)
            if n >= 0:
                again = msgspec.msgpack.decode(bytes(bent))
                assert all(type(x) is int for r in again for x in r)
                want = _want(again)
                b = len(again)
                assert out[: b + 1].tolist() == want[0]
                assert out[2 * b + 1 : 2 * b + 1 + n].tolist() == want[2]


def test_an_output_too_small_is_refused_not_overrun() -> None:
    msg = msgspec.msgpack.encode([[1, 2, 3], [4]])
    buf = np.full(16, -9, dtype=np.int64)
    # 2 * 2 + 1 = 5 slots of offsets and lengths, then 4 values.
    assert mn.unpack_int_lists(msg, buf[:8]) == -1
    assert (buf[8:] == -9).all()
    assert mn.unpack_int_lists(msg, buf[:9]) == 4
    assert buf[:9].tolist() == [0, 3, 4, 3, 1, 1, 2, 3, 4]


def test_uint64_is_taken_below_two_to_the_63_only() -> None:
    out = np.empty(8, np.int64)
    top = b"\x91\x91\xcf" + (2**63 - 1).to_bytes(8, "big")
    assert mn.unpack_int_lists(top, out) == 1 and out[3] == 2**63 - 1
    past = b"\x91\x91\xcf" + (2**63).to_bytes(8, "big")
    assert mn.unpack_int_lists(past, out) == -1


def test_not_loaded_means_none(monkeypatch) -> None:
    # A process whose numba kernels were never warmed (the Triton path):
    # int_lists answers None, so from_ints takes its struct path.
    monkeypatch.setattr(il, "_unpack", None)
    monkeypatch.setattr(mn, "_warm", False)
    assert not il.decoder_ready() and il.int_lists([[1], [2]]) is None
    mn.warm_up()
    assert il.decoder_ready() and il.int_lists([[1], [2]]) is not None


def test_the_loaded_decoder_is_the_compiled_entry() -> None:
    # int_lists calls numba's compiled wrapper of the one signature (bytes,
    # a C int64 array), not the dispatcher; it reads what the dispatcher
    # reads, refusals included.
    entry = mn.unpack_entry()
    assert entry is not mn.unpack_int_lists
    assert type(entry).__name__ != "CPUDispatcher"
    assert il._unpack is entry
    for msg in (b"\x92\x92\x00\x01\x90", b"\x91\x92\x01\xc3", b"\x91\x91\xcb"):
        a, b = np.zeros(16, np.int64), np.zeros(16, np.int64)
        assert entry(msg, a) == mn.unpack_int_lists(msg, b)
        assert a.tolist() == b.tolist()


def test_without_msgspec_the_struct_path_packs(monkeypatch) -> None:
    # The GPU machine's bare checkout: numba, no msgspec.
    monkeypatch.setitem(sys.modules, "msgspec", None)  # import raises
    monkeypatch.setattr(il, "_unpack", None)
    monkeypatch.setattr(il, "_no_msgspec", False)
    assert not il.decoder_ready() and il.int_lists([[1], [2]]) is None
    assert il._no_msgspec  # the failed import is not tried on every step
    from kvhit.coordinator.packing import HashBatch

    got = HashBatch.from_ints([[0, 1], [2], [True - 0, 5]])
    assert got.hashes[:, 0].tolist() == [0, 1, 2, 1, 5]


@pytest.mark.parametrize("tail", range(10))
def test_every_width_reads_the_same_by_word_and_near_the_end(tail) -> None:
    # An int is read as one 8-byte load where 9 bytes are left from it, and
    # byte by byte among the last 8: each width, both signs, each distance
    # from the end (``tail`` fixints after it), reads back the same.
    for v in EDGES:
        reqs = [[v, *range(tail)]]
        got = il.int_lists(reqs)
        assert got is not None and tuple(a.tolist() for a in got) == _want(reqs), v
    # A uint64 past int64, and nil (not an int), are refused on both paths.
    for bad in (2**63, 2**64 - 1, None):
        assert il.int_lists([[bad, *range(tail)]]) is None


def test_a_uint8_array_reads_as_its_bytes() -> None:
    # The 8-byte load takes a C-contiguous uint8 array (writable or not) as
    # it takes bytes: the same data pointer.
    reqs = [[0, 1, -1, 200, -200, 70_000, -(2**40), 2**63 - 1], [], [5, 6]]
    msg = msgspec.msgpack.encode(reqs)
    want = np.zeros(64, np.int64)
    assert mn.unpack_int_lists(msg, want) == 10
    arr = np.frombuffer(msg, dtype=np.uint8)
    for buf in (arr, arr.copy()):
        out = np.zeros(64, np.int64)
        assert mn.unpack_int_lists(buf, out) == 10
        assert out.tolist() == want.tolist()
