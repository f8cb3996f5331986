"""HashBatch / pack_hashes / unpack_hashes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhit.coordinator.packing import (
    HashBatch,
    num_words,
    pack_hashes,
    padding_mask,
    unpack_hashes,
)

WIDTHS = [1, 8, 12, 16, 31, 32, 33]


def _words_le(h: bytes) -> list[int]:
    """Reference packing, one hash at a time, with Python ints."""
    w = num_words(len(h))
    padded = h + bytes(8 * w - len(h))
    return [
        int.from_bytes(padded[8 * j : 8 * j + 8], "little", signed=True)
        for j in range(w)
    ]


@pytest.mark.parametrize("hash_bytes", WIDTHS)
def test_pack_matches_scalar_reference_and_round_trips(hash_bytes: int) -> None:
    rng = np.random.default_rng(hash_bytes)
    hashes = [rng.bytes(hash_bytes) for _ in range(50)]
    hashes += [b"\xff" * hash_bytes, b"\x00" * hash_bytes, b"\x80" * hash_bytes]
    packed = pack_hashes(hashes, hash_bytes)
    assert packed.dtype == torch.int64
    assert packed.shape == (len(hashes), num_words(hash_bytes))
    assert packed.tolist() == [_words_le(h) for h in hashes]
    assert unpack_hashes(packed, hash_bytes) == hashes


def test_little_endian_word_order() -> None:
    packed = pack_hashes([bytes(range(1, 13))], 12)
    assert packed.tolist() == [[0x0807060504030201, 0x0C0B0A09]]


def test_padding_mask() -> None:
    assert padding_mask(8) == 0 and padding_mask(32) == 0
    assert padding_mask(12) == -(1 << 32)  # high 4 bytes of the last word
    assert padding_mask(1) == -256
    assert pack_hashes([b"\xff" * 12], 12)[0, 1].item() & padding_mask(12) == 0


@settings(max_examples=40)
@given(
    hash_bytes=st.sampled_from(WIDTHS),
    lengths=st.lists(st.integers(0, 6), max_size=6),
    data=st.data(),
)
def test_from_bytes_round_trip(hash_bytes: int, lengths: list[int], data) -> None:
    reqs = [
        [
            data.draw(st.binary(min_size=hash_bytes, max_size=hash_bytes))
            for _ in range(n)
        ]
        for n in lengths
    ]
    batch = HashBatch.from_bytes(reqs, hash_bytes)
    assert len(batch) == len(reqs)
    assert batch.W == num_words(hash_bytes)
    assert batch.hash_bytes == hash_bytes
    assert batch.offsets.dtype == torch.int64 and batch.hashes.dtype == torch.int64
    assert batch.offsets.tolist() == [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
    assert batch.lengths.tolist() == lengths
    assert [batch.num_hashes(i) for i in range(len(reqs))] == lengths
    assert batch.to_bytes() == reqs
    for i, req in enumerate(reqs):
        assert unpack_hashes(batch.request(i), hash_bytes) == req


def test_empty_batches() -> None:
    b = HashBatch.from_bytes([], 32)
    assert len(b) == 0 and b.hashes.shape == (0, 4) and b.offsets.tolist() == [0]
    b = HashBatch.from_bytes([[], []], 16)
    assert len(b) == 2 and b.hashes.shape == (0, 2) and b.offsets.tolist() == [0, 0, 0]
    assert b.to_bytes() == [[], []]
    assert pack_hashes([], 12).shape == (0, 2)
    assert unpack_hashes(torch.empty(0, 2, dtype=torch.int64), 12) == []


def test_wrong_width_names_request_and_position() -> None:
    good = b"x" * 16
    with pytest.raises(ValueError, match=r"request 2, position 1: hash has 15 bytes"):
        HashBatch.from_bytes([[good], [], [good, b"y" * 15, good]], 16)
    with pytest.raises(ValueError, match=r"position 0: hash has 17 bytes"):
        pack_hashes([b"z" * 17], 16)
    # Compensating errors (15 + 17 bytes) are still caught.
    with pytest.raises(ValueError, match="request 0, position 0"):
        HashBatch.from_bytes([[b"a" * 15, b"b" * 17]], 16)
    with pytest.raises(TypeError, match="request 0, position 1: expected bytes"):
        HashBatch.from_bytes([[good, "not bytes" * 2]], 16)
    with pytest.raises(TypeError):
        HashBatch.from_bytes([[good, "s" * 16]], 16)  # right length, wrong type
    with pytest.raises(TypeError):
        HashBatch.from_bytes([good], 16)  # a request must be a list of hashes
    with pytest.raises(ValueError, match="hash_bytes"):
        HashBatch.from_bytes([[good]], 0)


def test_constructor_validates() -> None:
    h = pack_hashes([b"a" * 8, b"b" * 8, b"c" * 8], 8)
    offs = torch.tensor([0, 1, 3])
    b = HashBatch(h, offs, 8)
    assert b.lengths.tolist() == [1, 2] and b.total == 3
    with pytest.raises(TypeError, match="hashes"):
        HashBatch(h.to(torch.int32), offs, 8)
    with pytest.raises(TypeError, match="offsets"):
        HashBatch(h, offs.to(torch.int32), 8)
    with pytest.raises(ValueError, match="hashes"):
        HashBatch(h, offs, 16)  # W mismatch
    with pytest.raises(ValueError, match="offsets"):
        HashBatch(h, torch.tensor([0, 2, 1, 3]), 8)  # decreasing
    with pytest.raises(ValueError, match="offsets"):
        HashBatch(h, torch.tensor([0, 1, 2]), 8)  # does not end at total
    with pytest.raises(ValueError, match="offsets"):
        HashBatch(h, torch.tensor([1, 3]), 8)
    bad_pad = pack_hashes([b"a" * 12], 12)
    bad_pad[0, 1] |= 1 << 40
    with pytest.raises(ValueError, match="padding"):
        HashBatch(bad_pad, torch.tensor([0, 1]), 12)
    with pytest.raises(IndexError):
        b.num_hashes(2)
    assert b.num_hashes(-1) == 2


def test_non_contiguous_hashes_are_made_contiguous() -> None:
    h = pack_hashes([bytes([i]) * 16 for i in range(4)], 16)
    view = torch.cat([h, h], 1)[:, :2]  # row stride 4, not contiguous
    assert not view.is_contiguous()
    b = HashBatch(view, torch.tensor([0, 4]), 16)
    assert b.hashes.is_contiguous()
    assert torch.equal(b.hashes, h)


def test_to_device(device: str) -> None:
    b = HashBatch.from_bytes([[b"q" * 32]], 32)
    assert b.to("cpu") is b
    moved = b.to(device)
    assert moved.device.type == torch.device(device).type
    assert moved.to_bytes() == b.to_bytes()
    on_dev = HashBatch.from_bytes([[b"q" * 32]], 32, device=device)
    assert on_dev.offsets.device == on_dev.hashes.device == moved.device


def test_packing_large_batch_is_fast() -> None:
    # 1024 requests x 4000 32-byte hashes: must not go through per-hash ints.
    blob = os.urandom(4000 * 32)
    one = [blob[i : i + 32] for i in range(0, len(blob), 32)]
    reqs = [one] * 1024
    # CPU time: a loaded box (5.24 s of wall time beside other work) must
    # not fail it.
    t0 = time.process_time()
    b = HashBatch.from_bytes(reqs, 32)
    elapsed = time.process_time() - t0
    assert b.total == 1024 * 4000
    assert torch.equal(b.hashes[:4000], b.hashes[-4000:])
    assert unpack_hashes(b.hashes[4000 * 7 + 5 : 4000 * 7 + 6], 32) == [one[5]]
    assert elapsed < 5.0, f"packing took {elapsed:.2f} s"


def test_non_bytes_hash_is_named_by_request_and_position():
    with pytest.raises(TypeError, match="request 1, position 1"):
        HashBatch.from_bytes([[b"a" * 8], [b"b" * 8, "c" * 8]], 8)
    with pytest.raises(TypeError, match="hashes, position 0"):
        pack_hashes(["x" * 8], 8)


# --- bad input: refused before anything is built, the argument named


def test_numpy_arrays_as_hashes_are_refused_by_position() -> None:
    words = np.arange(4, dtype=np.int64)  # len() 4, but 32 bytes
    # Before: hash_bytes=4 passed the width check and died in numpy
    # ("cannot reshape array of size 32 into shape (1,4)").
    with pytest.raises(TypeError, match=r"request 1, position 0: expected bytes"):
        HashBatch.from_bytes([[b"a" * 4], [words]], 4)
    with pytest.raises(TypeError, match=r"hashes, position 1: expected bytes.*ndarray"):
        pack_hashes([b"a" * 4, words], 4)
    with pytest.raises(TypeError, match=r"position 0: expected bytes, got memoryview"):
        pack_hashes([memoryview(words)], 4)
    with pytest.raises(TypeError, match=r"request 0, position 0"):
        HashBatch.from_bytes([words], 32)  # a request that is one array of words
    # A 1-D byte buffer is a hash, whatever holds it.
    raw = bytes(range(8))
    assert pack_hashes([memoryview(raw)], 8).tolist() == pack_hashes([raw], 8).tolist()
    as_u8 = np.frombuffer(raw, dtype=np.uint8)
    assert pack_hashes([as_u8], 8).tolist() == pack_hashes([raw], 8).tolist()


def test_none_where_a_sequence_is_expected_names_the_argument() -> None:
    with pytest.raises(TypeError, match=r"requests must be a sequence.*NoneType"):
        HashBatch.from_bytes(None, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"requests\[1\] \(request 1\).*NoneType"):
        HashBatch.from_bytes([[b"a" * 8], None], 8)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"hashes must be a sequence.*NoneType"):
        pack_hashes(None, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"hashes must be a sequence.*int"):
        pack_hashes(5, 8)  # type: ignore[arg-type]


def test_meta_and_missing_devices_are_refused() -> None:
    h = torch.zeros(1, 1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="hashes is a meta tensor"):
        HashBatch(h, torch.tensor([0, 1], device="meta"), 8)
    with pytest.raises(ValueError, match="offsets is a meta tensor"):
        HashBatch(
            torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0, 1]).to("meta"), 8
        )
    with pytest.raises(ValueError, match="device=meta"):
        HashBatch.from_bytes([[b"a" * 8]], 8, device="meta")
    with pytest.raises(ValueError, match="device='nowhere'"):
        HashBatch.from_bytes([[b"a" * 8]], 8, device="nowhere")
    with pytest.raises(TypeError, match="device must be"):
        HashBatch.from_bytes([[b"a" * 8]], 8, device=3)  # type: ignore[arg-type]
    b = HashBatch.from_bytes([[b"a" * 8]], 8)
    with pytest.raises(ValueError, match="device=meta"):
        b.to("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda.*not available"):
            HashBatch.from_bytes([[b"a" * 8]], 8, device="cuda")
    with pytest.raises(TypeError, match="request index"):
        b.num_hashes("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request index"):
        b.request(1.0)  # type: ignore[arg-type]
    assert b.to_bytes() == [[b"a" * 8]]


def test_from_trusted_is_public_and_unchecked() -> None:
    h = pack_hashes([b"a" * 8, b"b" * 8], 8)
    offs = torch.tensor([0, 2])
    b = HashBatch.from_trusted(h, offs, 8)
    assert (
        b.hashes is h and b.offsets is offs and b.to_bytes() == [[b"a" * 8, b"b" * 8]]
    )


# -- from_ints of a batch of lists: one struct pass (offsets and lengths in it)


def _ints_reference(requests: list[list[int]]) -> tuple[list[int], list[int]]:
    """The values and CSR offsets of a batch of int lists, by Python."""
    values = [v for r in requests for v in r]
    offsets = [0]
    for r in requests:
        offsets.append(offsets[-1] + len(r))
    return values, offsets


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=2, max_size=9),
    data=st.data(),
)
def test_from_ints_of_lists_equals_python_on_both_sides_of_the_scan_bound(
    lengths: list[int], data
) -> None:
    # Totals below and above _SCAN_MAX (64): the short batch's type scan and
    # the long one's numpy search for 0s and 1s; values of every size, 0, 1
    # and the int64 bounds among them.
    ints = st.one_of(
        st.sampled_from([0, 1, -1, 2, (1 << 63) - 1, -(1 << 63)]),
        st.integers(-(1 << 63), (1 << 63) - 1),
    )
    reqs = [data.draw(st.lists(ints, min_size=n, max_size=n)) for n in lengths]
    batch = HashBatch.from_ints(reqs)
    values, offsets = _ints_reference(reqs)
    assert batch.hashes.shape == (len(values), 1)
    assert batch.hashes[:, 0].tolist() == values
    assert batch.offsets.tolist() == offsets
    rows, starts, lens = batch.host_arrays()
    assert rows[:, 0].tolist() == values and rows.flags.c_contiguous
    assert starts.tolist() == offsets[:-1] and lens.tolist() == lengths
    assert len(batch) == len(reqs)
    # The same keys as from_bytes of each int's 8 little-endian bytes.
    as_bytes = [[v.to_bytes(8, "little", signed=True) for v in r] for r in reqs]
    assert torch.equal(batch.hashes, HashBatch.from_bytes(as_bytes, 8).hashes)


@pytest.mark.parametrize("total", [5, 63, 64, 65, 300])
@pytest.mark.parametrize("bad", [True, False])
def test_from_ints_refuses_a_bool_by_its_type_in_any_batch(total: int, bad) -> None:
    # bools are 0 and 1 to struct: refused by their type, named by request
    # and position, whether the batch is short (type scan) or long.
    reqs = [list(range(2, 2 + total // 2)), [0, 1] + list(range(total - total // 2))]
    assert HashBatch.from_ints(reqs).hashes[:, 0].tolist() == reqs[0] + reqs[1]
    reqs[1][1] = bad
    with pytest.raises(TypeError, match="request 1, position 1: .*bool"):
        HashBatch.from_ints(reqs)
    reqs[1][1] = np.int64(int(bad))  # integer-likes are taken as their value
    assert HashBatch.from_ints(reqs).hashes[total // 2 + 1, 0].item() == int(bad)


@pytest.mark.parametrize("total", [3, 200])
def test_from_ints_of_lists_names_a_bad_item(total: int) -> None:
    for bad, exc, what in [
        (2.0, TypeError, "float"),
        (None, TypeError, "NoneType"),
        (1 << 63, ValueError, "outside int64"),
        (-(1 << 63) - 1, ValueError, "outside int64"),
    ]:
        reqs = [list(range(total)), [5, 6, bad]]
        with pytest.raises(exc, match=f"request 1, position 2: .*{what}"):
            HashBatch.from_ints(reqs)


def test_from_ints_of_lists_with_empty_requests_and_narrow_keys() -> None:
    batch = HashBatch.from_ints([[], [7], [], [0, 1, 2]])
    assert batch.offsets.tolist() == [0, 0, 1, 1, 4]
    assert batch.hashes[:, 0].tolist() == [7, 0, 1, 2]
    assert HashBatch.from_ints([[], []]).hashes.shape == (0, 1)
    narrow = HashBatch.from_ints([[1, 255], [3]], hash_bytes=1)
    assert narrow.hashes[:, 0].tolist() == [1, 255, 3]
    with pytest.raises(ValueError, match="request 1, position 0: 256 does not fit"):
        HashBatch.from_ints([[1], [256]], hash_bytes=1)
    wide = HashBatch.from_ints([[-1], [2, 3]], hash_bytes=16)
    assert wide.hashes.tolist() == [[-1, 0], [2, 0], [3, 0]]


# list_path's state is the same for every example.
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=0, max_size=7),
    data=st.data(),
)
@pytest.mark.usefixtures("list_path")
def test_a_small_batch_equals_the_general_path(lengths: list[int], data) -> None:
    # Batches of a few short lists (under _SMALL_MAX = 128 ints in all take
    # one type scan and one np.array, as a batch of one): the same values,
    # offsets, lengths and host arrays as the general path (a torch.device
    # argument goes around the short paths), on both sides of the bound.
    ints = st.one_of(
        st.sampled_from([0, 1, -1, 2, (1 << 63) - 1, -(1 << 63)]),
        st.integers(-(1 << 63), (1 << 63) - 1),
    )
    reqs = [data.draw(st.lists(ints, min_size=n, max_size=n)) for n in lengths]
    fast = HashBatch.from_ints(reqs)
    slow = HashBatch.from_ints(reqs, device=torch.device("cpu"))
    values, offsets = _ints_reference(reqs)
    assert len(fast) == len(reqs) == len(slow)
    assert fast.hashes[:, 0].tolist() == values == slow.hashes[:, 0].tolist()
    assert fast.offsets.tolist() == offsets == slow.offsets.tolist()
    assert fast.hashes.shape == (len(values), 1) and fast.hash_bytes == 8
    rows, starts, lens = fast.host_arrays()
    assert rows.shape == (len(values), 1) and rows.flags.c_contiguous
    assert rows[:, 0].tolist() == values
    assert starts.tolist() == offsets[:-1] and lens.tolist() == lengths
    assert fast.lengths.tolist() == lengths
    if len(reqs) != 1:
        assert fast.host_single() is None and fast.one_values is None


@pytest.mark.parametrize("sizes", [[1, 1], [3, 0, 4], [30, 30, 30, 30]])
@pytest.mark.usefixtures("list_path")
def test_a_small_batch_names_a_bad_item_and_refuses_bools(sizes) -> None:
    for bad, exc, what in [
        (True, TypeError, "bool"),
        (False, TypeError, "bool"),
        (2.0, TypeError, "float"),
        ("7", TypeError, "str"),
        (None, TypeError, "NoneType"),
        (1 << 63, ValueError, "outside int64"),
        (-(1 << 63) - 1, ValueError, "outside int64"),
    ]:
        reqs = [list(range(n)) for n in sizes]
        reqs[-1].append(bad)
        pos = sizes[-1]
        with pytest.raises(
            exc, match=f"request {len(sizes) - 1}, position {pos}: .*{what}"
        ):
            HashBatch.from_ints(reqs)
    # Integer-likes are taken as their value (the general path converts them).
    reqs = [[0, np.int64(1)], [np.uint8(2)]]
    assert HashBatch.from_ints(reqs).hashes[:, 0].tolist() == [0, 1, 2]
    # A request that is not a list (a tuple) goes the general way too.
    assert HashBatch.from_ints([(0, 1), [2]]).offsets.tolist() == [0, 2, 3]


def test_one_values_of_a_one_request_batch() -> None:
    # from_ints' path for one short list of ints: its values, 1-D, shared
    # with the batch's [n, 1] rows; None for every other batch.
    one = HashBatch.from_ints([[5, 0, 1, -7]])
    values = one.one_values
    assert values.dtype == np.int64 and values.shape == (4,)
    assert values.flags.c_contiguous and values.tolist() == [5, 0, 1, -7]
    rows = one.host_single()
    assert rows.shape == (4, 1) and np.shares_memory(rows, values)
    # The rows alone: a store of one request's blocks makes no offsets.
    assert "_lazy" not in one.__dict__ and len(one) == 1
    assert one.host_single() is rows and one.host_arrays()[0] is rows
    assert one.offsets.tolist() == [0, 4] and one.host_arrays()[2].tolist() == [4]
    assert np.shares_memory(one.hashes.numpy(), values)
    assert HashBatch.from_ints([[]]).one_values.shape == (0,)
    for other in (
        HashBatch.from_ints([[1], [2]]),
        HashBatch.from_ints([np.array([1, 2])]),
        HashBatch.from_ints([[1, 2]], hash_bytes=16),
        HashBatch.from_ints([[1, True]][:0] + [[1, np.int64(2)]]),
        HashBatch.from_bytes([[bytes(8)]], 8),
    ):
        assert other.one_values is None
    with pytest.raises(TypeError, match="request 0, position 1: .*bool"):
        HashBatch.from_ints([[1, True]])
