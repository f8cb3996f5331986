"""Unusual input forms at the public entry points, held against the plain form.

Every int-array argument (per-request lengths, hashes, group and engine ids)
is given in each form a caller may hold it in: lists and tuples of ints
(numpy scalars and ``IntEnum`` members among them), numpy arrays of every
integer dtype in both byte orders (strided, reversed, read-only, unaligned),
``array.array`` of every integer type code, memoryviews and torch tensors
(strided, offset, transposed). The oracle is the same values as a plain list
of Python ints: a form must give the same answer, or be refused with
TypeError/ValueError naming the argument, and a refused store must leave the
index as it was.

Six bugs this probe found are fixed, each test saying what it once did:
an item whose ``__index__`` raises in a lengths list (7df11dc), a block size
past int64 in ``hit_list`` (392daaa), a strided byte buffer as a hash, a set
or dict as a request, a reversed one-item lengths array, a huge
``hash_bytes``.
"""

from __future__ import annotations

import enum
import re
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import (
    CacheLayout,
    FleetIndex,
    FullAttention,
    Group,
    HashBatch,
    KeyIndex,
    LookupEngine,
    LookupResult,
)
from kvhit.coordinator import packing
from kvhit.coordinator.key_index import CapacityError
from kvhit.kernels.checks import check_lengths, host_lengths, host_lengths_or_int

# check_lengths hands torch.from_numpy a read-only array as it is (kvhit
# never writes it); torch warns once that writing would be undefined.
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

CPU = torch.device("cpu")
LAYOUT = CacheLayout(
    groups=[Group(FullAttention(block_size=16))],
    scheduler_block_size=16,
    hash_block_size=16,
)
# Five requests of 8-byte integer hashes and the prefix of each the store
# holds: their hits differ (48, 32, 16, 0, 48 tokens at these lengths).
REQUESTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41], [51, 52, 53]]
STORED = [[11, 12, 13], [21, 22, 23], [31], [], [51, 52, 53]]
# Lengths that fit every integer dtype (int8 included), so every numpy form
# below can hold them.
MAX_LENGTHS = [64, 40, 80, 16, 50]
BACKENDS = ["numba", "torch", "reference"]
# The integer dtypes of numpy, by type code, and the byte orders.
INT_CODES = "bBhHiIlLqQ"
ORDERS = "<>"


# -- the forms ---------------------------------------------------------------


def _unaligned(a: np.ndarray, writable: bool) -> np.ndarray:
    """``a``'s values in an array one byte off its natural alignment
    (read-only from ``bytes``, writable from a ``bytearray``)."""
    raw = b"x" + a.tobytes()
    buf = bytearray(raw) if writable else raw
    return np.frombuffer(buf, dtype=a.dtype, offset=1)


def _read_only(a: np.ndarray) -> np.ndarray:
    b = a.copy()
    b.setflags(write=False)
    return b


def numpy_forms(values: list[int]) -> Iterator[tuple[str, Any]]:
    """``values`` as numpy arrays of each integer dtype that holds them, in
    both byte orders, each in several memory layouts: contiguous, strided,
    reversed (a negative stride), read-only, over ``bytes``, unaligned."""
    for order in ORDERS:
        for code in INT_CODES:
            dt = np.dtype(code).newbyteorder(order)
            info = np.iinfo(dt)
            if values and not info.min <= min(values) <= max(values) <= info.max:
                continue
            a = np.array(values, dtype=dt)
            name = f"{order}{code}"
            yield f"numpy {name}", a
            yield f"numpy {name} strided", np.repeat(a, 2)[::2]
            yield f"numpy {name} reversed", np.array(values[::-1], dtype=dt)[::-1]
            yield f"numpy {name} read-only", _read_only(a)
            yield f"numpy {name} frombuffer", np.frombuffer(a.tobytes(), dtype=dt)
            yield f"numpy {name} unaligned", _unaligned(a, writable=False)
            yield f"numpy {name} unaligned writable", _unaligned(a, writable=True)
    a64 = np.array([values, values], dtype=np.int64)
    yield "numpy transposed column", a64.T[:, 0]
    yield "numpy fortran row", np.asfortranarray(a64)[0]


def tensor_forms(values: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """``values`` as int64 tensors: plain, strided, with a storage offset,
    a column of a transposed matrix, a row of an expanded one."""
    t = torch.tensor(values, dtype=torch.int64)
    yield "tensor", t
    yield "tensor strided", t.repeat_interleave(2)[::2]
    yield "tensor offset", torch.cat([torch.tensor([9]), t])[1:]
    yield "tensor transposed column", torch.stack([t, t], 1)[:, 0]
    yield "tensor expanded row", t[None].expand(3, -1)[1]


def sequence_forms(values: list[int]) -> Iterator[tuple[str, Any]]:
    """``values`` as Python sequences: of ints, numpy scalars, IntEnum
    members; ``array.array`` of every integer code; a memoryview."""
    yield "list", list(values)
    yield "tuple", tuple(values)
    yield "list of np.int64", [np.int64(v) for v in values]
    yield "list of np.uint16", [np.uint16(v) for v in values]
    members = enum.IntEnum("Members", {f"V{v}": v for v in sorted(set(values))})
    yield "list of IntEnum", [members(v) for v in values]
    for code in INT_CODES:
        if values and max(values) >= 1 << (8 * array(code).itemsize - 1):
            continue
        yield f"array('{code}')", array(code, values)
    yield "memoryview of array('q')", memoryview(array("q", values))


def length_forms(values: list[int]) -> list[tuple[str, Any]]:
    """Every form of per-request lengths ``values`` (>= 0, < 128)."""
    return [
        *sequence_forms(values),
        *numpy_forms(values),
        *tensor_forms(values),
    ]


def _ids(forms: list[tuple[str, Any]]) -> list[str]:
    return [name for name, _ in forms]


def _reversed_8_byte(name: str) -> bool:
    """Whether form ``name`` is a reversed native int64/uint64 array, which
    host_lengths hands back as it is (a bug when it holds one length: see
    test_one_reversed_length_*; a narrower or big-endian one is converted)."""
    return name in {f"numpy <{code} reversed" for code in "lLqQ"}


def assert_refused(
    case: Any, pattern: str, call: Callable[..., Any], *args: Any
) -> None:
    """``call(*args)`` raises TypeError or ValueError whose message matches
    ``pattern`` (the argument's name); ``case`` says which input failed.
    Any other exception propagates, failing the test with its traceback."""
    try:
        call(*args)
    except (TypeError, ValueError) as exc:
        assert re.search(pattern, str(exc)), f"{case}: {exc!r} names no {pattern}"
    else:
        pytest.fail(f"{case}: accepted")


# -- shared objects (built once: the numba kernels load at construction) ----


@pytest.fixture(scope="module")
def index() -> KeyIndex:
    """The store: ``STORED``'s keys in group 0 (a numba index, which also
    loads from_ints' list decoder)."""
    idx = KeyIndex(8, capacity=64, backend="numba")
    for keys in STORED:
        if keys:
            idx.add(0, np.array(keys, dtype=np.int64).reshape(-1, 1))
    return idx


@pytest.fixture(scope="module")
def engines() -> dict[str, LookupEngine]:
    return {b: LookupEngine(LAYOUT, backend=b) for b in BACKENDS}


@pytest.fixture(scope="module")
def fleet() -> FleetIndex:
    """Three engines: 0 holds ``STORED``, 1 the first key of each request,
    2 request 3's one key."""
    f = FleetIndex(3, 8, capacity=64, backend="numba")
    for keys in STORED:
        if keys:
            f.add(0, 0, np.array(keys, dtype=np.int64).reshape(-1, 1))
            f.add(1, 0, np.array(keys[:1], dtype=np.int64).reshape(-1, 1))
    f.add(2, 0, np.array([[41]], dtype=np.int64))
    return f


# -- per-request lengths: kernels/checks.py ----------------------------------

FIVE = length_forms(MAX_LENGTHS)
ONE = length_forms([64])


@pytest.mark.parametrize(("name", "form"), FIVE, ids=_ids(FIVE))
def test_host_lengths_reads_every_form_as_its_list(name: str, form: Any) -> None:
    got = host_lengths(form, "max_lengths", len(MAX_LENGTHS))
    assert got.dtype == np.int64 and got.flags.c_contiguous, name
    assert got.tolist() == MAX_LENGTHS, name
    t = check_lengths(form, "max_lengths", len(MAX_LENGTHS), CPU)
    assert t.dtype == torch.int64 and t.tolist() == MAX_LENGTHS, name


@pytest.mark.parametrize(("name", "form"), ONE, ids=_ids(ONE))
def test_host_lengths_or_int_reads_one_length_in_every_form(name: str, form: Any):
    got = host_lengths_or_int(form, "max_lengths", 1)
    # One request's length comes back as an int or an int64 [1] array.
    assert (got if type(got) is int else got.tolist()) in (64, [64]), name


def _bad_lengths() -> list[tuple[str, Any]]:
    """Lengths that must be refused, in several forms."""
    ok = [16] * 4
    return [
        ("negative in a list", [*ok, -1]),
        ("past int64 in a list", [*ok, 2**63]),
        ("a bool in a list", [*ok, True]),
        ("a float in a list", [*ok, 16.0]),
        ("a str in a list", [*ok, "16"]),
        ("None in a list", [*ok, None]),
        ("uint64 past int64", np.array([*ok, 2**63], dtype=np.uint64)),
        ("big-endian uint64 past int64", np.array([*ok, 2**63], dtype=">u8")),
        ("big-endian negative", np.array([*ok, -5], dtype=">i8")),
        ("int8 negative", np.array([*ok, -5], dtype=np.int8)),
        ("bool array", np.ones(5, dtype=bool)),
        ("float array", np.ones(5)),
        ("object array", np.array([16] * 5, dtype=object)),
        ("0-d array", np.array(16)),
        ("2-D array", np.array([[16] * 5])),
        ("too few", ok),
        ("too many", [*ok, 16, 16]),
        ("negative tensor", torch.tensor([*ok, -1])),
        ("0-d tensor", torch.tensor(16)),
        ("int32 tensor", torch.tensor([16] * 5, dtype=torch.int32)),
        ("float tensor", torch.ones(5)),
        ("meta tensor", torch.zeros(5, dtype=torch.int64, device="meta")),
        ("sparse tensor", torch.tensor([16] * 5).to_sparse()),
        ("None", None),
        ("an int", 16),
        ("a str", "16"),
        ("bytes", b"\x10" * 5),
        ("array('q') negative", array("q", [*ok, -1])),
        ("array('Q') past int64", array("Q", [*ok, 2**63])),
        ("array('d')", array("d", [16.0] * 5)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_lengths_are_refused_by_name(
    backend: str, engines: dict[str, LookupEngine], index: KeyIndex
) -> None:
    engine = engines[backend]
    batch = HashBatch.from_ints(REQUESTS)
    for name, bad in _bad_lengths():
        find = engine.find_longest_cache_hit
        assert_refused(name, "max_lengths", find, batch, bad, index)
        assert_refused(name, "num_tokens", engine.lookup, batch, bad, index)
        assert_refused(name, "token_lens", engine.load_masks, batch, bad)


# -- LookupEngine: every form of lengths, every backend, against the list ----


def _answers(
    engine: LookupEngine, batch: HashBatch, lens: Any, index: KeyIndex
) -> list[Any]:
    """Every answer of ``engine`` that reads per-request lengths ``lens``."""
    found = engine.find_longest_cache_hit(batch, lens, index)
    plain = engine.find_longest_cache_hit(batch, lens, index, apply_eagle=False)
    masked = engine.find_longest_cache_hit(batch, lens, index, with_masks=True)
    loaded = engine.load_masks(batch, lens)
    return [
        found.hit_list(),
        found.hit_array().tolist(),
        plain.hit_list(16),
        masked.hit_list(),
        masked.mask_lists(),
        engine.lookup(batch, lens, index).tolist(),
        loaded.hit_list(),
        loaded.mask_lists(),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [5, 1])
def test_engine_answers_every_length_form_as_its_list(
    backend: str,
    size: int,
    engines: dict[str, LookupEngine],
    index: KeyIndex,
) -> None:
    # One request also takes the numba backend's one-request runner (a batch
    # from one list of ints) and its host path (a batch from an array, which
    # the other backends read as they read any batch).
    requests = REQUESTS[:size]
    values = MAX_LENGTHS[:size]
    batches = [HashBatch.from_ints(requests)]
    if backend == "numba":
        batches.append(HashBatch.from_ints([np.array(r) for r in requests]))
    engine = engines[backend]
    for batch in batches:
        want = _answers(engines["reference"], batch, values, index)
        for name, form in length_forms(values):
            if size == 1 and _reversed_8_byte(name):
                continue  # a bug of its own: see test_one_reversed_length_*
            assert _answers(engine, batch, form, index) == want, (backend, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_calls_read_every_aligned_length_form(
    backend: str, engines: dict[str, LookupEngine]
) -> None:
    aligned = [64, 32, 80, 16, 48]  # multiples of the alignment (16)
    engine = engines[backend]
    want_store = engine.store_masks(aligned, aligned, aligned).mask_lists()
    want_lookup = engine.lookup_masks(aligned).mask_lists()
    want_candidates = [t.tolist() for t in engine.lookup_candidates(
        HashBatch.from_ints(REQUESTS), aligned)]  # fmt: skip
    for name, form in length_forms(aligned):
        got = engine.store_masks(form, form, form).mask_lists()
        assert got == want_store, (backend, name)
        assert engine.lookup_masks(form).mask_lists() == want_lookup, (backend, name)
        got_c = engine.lookup_candidates(HashBatch.from_ints(REQUESTS), form)
        assert [t.tolist() for t in got_c] == want_candidates, (backend, name)


def test_engine_results_do_not_alias_the_callers_lengths(
    engines: dict[str, LookupEngine], index: KeyIndex
) -> None:
    # host_lengths hands an int64 array back as itself: no answer may keep it.
    batch = HashBatch.from_ints(REQUESTS)
    for backend, engine in engines.items():
        for make in (np.array, torch.tensor):
            lens = make(MAX_LENGTHS)
            found = engine.find_longest_cache_hit(batch, lens, index)
            looked = engine.lookup(batch, lens, index)
            before = (found.hit_list(), looked.tolist())
            lens[...] = 7
            assert (found.hit_list(), looked.tolist()) == before, backend


# -- LookupResult.hit_list / hit_array --------------------------------------


def _results(
    engines: dict[str, LookupEngine], index: KeyIndex
) -> list[tuple[str, LookupResult]]:
    """One result of each form a result's hits may take: an int (numba, one
    request), a numpy array (numba, under and over hit_list's numpy bound
    of 16 hits), a tensor (torch, reference, masks)."""
    many = HashBatch.from_ints(REQUESTS * 4)
    out: list[tuple[str, LookupResult]] = []
    for backend, engine in engines.items():
        for b in (1, 5, 20):
            batch = HashBatch.from_ints((REQUESTS * 4)[:b])
            lens = (MAX_LENGTHS * 4)[:b]
            result = engine.find_longest_cache_hit(batch, lens, index)
            out.append((f"{backend} B={b}", result))
    out.append(("masks", engines["numba"].find_longest_cache_hit(
        many, MAX_LENGTHS * 4, index, with_masks=True)))  # fmt: skip
    return out


def test_hit_list_takes_every_int_form_of_block_size(
    engines: dict[str, LookupEngine], index: KeyIndex
) -> None:
    size = enum.IntEnum("Size", {"BLOCK": 16})
    for name, result in _results(engines, index):
        # hit_array first: reading hit_lengths would make a host result's
        # tensor, and hit_list would then divide that instead of its own.
        hits = result.hit_array().tolist()
        for bs in (16, np.int64(16), np.uint8(16), size.BLOCK, 2**62, 2**63 - 1):
            assert result.hit_list(bs) == [h // int(bs) for h in hits], (name, bs)
        for bad in (True, 0, -16, 16.0, np.array(16), torch.tensor(16), None):
            with pytest.raises((TypeError, ValueError), match="block_size"):
                result.hit_list(bad)
        assert result.hit_list() == hits == result.hit_lengths.tolist(), name
        assert result.hit_list(16) == [h // 16 for h in hits], name  # the tensor's


@pytest.mark.parametrize("block_size", [2**63, 2**64, np.uint64(2**63)])
def test_hit_list_of_a_huge_block_size_is_zero_blocks_or_refused(
    block_size: Any, engines: dict[str, LookupEngine], index: KeyIndex
) -> None:
    # Found by this probe, fixed in 392daaa: 2**63 wrapped to -2**63 in
    # torch.div (tensor hits: -1 blocks each) and overflowed numpy's //
    # (OverflowError from 16 host hits on); an int or a short list said 0.
    for name, result in _results(engines, index):
        hits = result.hit_array().tolist()  # (not hit_lengths: see above)
        try:
            got = result.hit_list(block_size)
        except (TypeError, ValueError) as exc:
            assert "block_size" in str(exc), name
        else:
            assert got == [0] * len(hits), name


# -- HashBatch.from_ints -----------------------------------------------------


def _batch_state(batch: HashBatch) -> tuple[Any, ...]:
    """Everything a backend reads of a batch: its tensors and host arrays."""
    rows, starts, lengths = batch.host_arrays()
    single = batch.host_single()
    return (
        len(batch),
        batch.hashes.tolist(),
        batch.offsets.tolist(),
        batch.hashes.dtype,
        batch.hashes.is_contiguous(),
        rows.tolist(),
        starts.tolist(),
        lengths.tolist(),
        None if single is None else single.tolist(),
    )


SMALL = [[5, 0, 1, 100], [7], [], [1, 0]]  # fits every dtype, 0 and 1 included
WIDE = [[2**63 - 1, -(2**63), -1, 0, 1, 2**32, -(2**31) - 1], [255, 256]]


def request_forms(requests: list[list[int]]) -> list[tuple[str, list[Any]]]:
    """``requests`` as batches of each request form: every form of
    :func:`numpy_forms` and :func:`tensor_forms` (per request, and mixed
    with lists), sequences, ``array.array``."""
    out: list[tuple[str, list[Any]]] = [
        ("tuples", [tuple(r) for r in requests]),
        ("lists of np.int64", [[np.int64(v) for v in r] for r in requests]),
    ]
    per_request = [dict(numpy_forms(r)) for r in requests]
    for name in per_request[0]:
        if all(name in f for f in per_request):
            out.append((name, [f[name] for f in per_request]))
            mixed = [f[name] if i % 2 else list(r)
                     for i, (f, r) in enumerate(zip(per_request, requests, strict=True))]  # fmt: skip
            out.append((f"{name} mixed with lists", mixed))
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                  torch.uint16, torch.uint32, torch.uint64):  # fmt: skip
        try:
            ts = [torch.tensor(r, dtype=dtype) for r in requests]
        except (RuntimeError, OverflowError):
            continue
        if [t.tolist() for t in ts] != requests:
            continue
        out.append((f"{dtype}", ts))
        out.append((f"{dtype} strided", [t.repeat_interleave(2)[::2] for t in ts]))
        out.append((f"{dtype} offset", [torch.cat([t[:1], t])[1:] for t in ts]))
    for code in INT_CODES:
        info = np.iinfo(np.dtype(code))
        if all(info.min <= v <= info.max for r in requests for v in r):
            out.append((f"array('{code}')", [array(code, r) for r in requests]))
    return out


@pytest.fixture(params=["decoder", "struct"])
def list_path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, index: KeyIndex
) -> str:
    """from_ints' two paths for lists of ints: the numba msgpack decoder (the
    index fixture loaded it) and the struct path (the decoder switched off)."""
    if request.param == "struct":
        monkeypatch.setattr(packing, "int_lists", lambda requests: None)
        monkeypatch.setattr(packing, "int_list", lambda values: None)
        monkeypatch.setattr(packing, "decoder_ready", lambda: False)
    return request.param


@pytest.mark.parametrize("hash_bytes", [8, 16, 4])
@pytest.mark.parametrize("requests", [SMALL, WIDE, [[3, 4]], [list(range(300))]],
                         ids=["small", "wide", "one", "long"])  # fmt: skip
def test_from_ints_reads_every_request_form_as_its_lists(
    requests: list[list[int]], hash_bytes: int, list_path: str
) -> None:
    if hash_bytes < 8 and any(v < 0 or v >= 1 << 32 for r in requests for v in r):
        pytest.skip("values past 4 bytes are refused at hash_bytes=4")
    want = _batch_state(HashBatch.from_ints(requests, hash_bytes))
    for name, form in request_forms(requests):
        got = _batch_state(HashBatch.from_ints(form, hash_bytes))
        assert got == want, (list_path, name)
    # The requests' container in other forms too.
    assert _batch_state(HashBatch.from_ints(tuple(requests), hash_bytes)) == want
    members = enum.IntEnum("Hashes", {f"H{i}": v for i, v in enumerate(
        sorted({v for r in requests for v in r}))})  # fmt: skip
    as_members = [[members(v) for v in r] for r in requests]
    assert _batch_state(HashBatch.from_ints(as_members, hash_bytes)) == want


def test_from_ints_copies_the_callers_arrays() -> None:
    values = [5, 6, 7]
    for form in (np.array(values), torch.tensor(values), array("q", values)):
        batch = HashBatch.from_ints([form])
        form[0] = 99
        assert batch.hashes[:, 0].tolist() == values, type(form).__name__


def test_from_ints_refuses_bad_items_by_request_and_position() -> None:
    for bad in (True, np.True_, 3.0, np.float64(3), "3", None, 2**63, -(2**63) - 1,
                np.uint64(2**63), torch.tensor(True)):  # fmt: skip
        for requests in ([[7, bad]], [[1, 2], [7, bad]], [[7] * 30 + [bad]]):
            assert_refused(repr(bad), "request", HashBatch.from_ints, requests)
    for bad_req in (np.ones(2, dtype=bool), np.ones(2), np.array([[1, 2]]),
                    np.array(5), np.array([2**63], dtype=">u8"), torch.ones(2),
                    torch.tensor([[1, 2]]), torch.tensor(5), array("d", [1.0]),
                    b"\x01\x02", "12", 5, None):  # fmt: skip
        for requests in ([bad_req], [bad_req, [1, 2]], [[1, 2], bad_req]):
            assert_refused(repr(bad_req), "request", HashBatch.from_ints, requests)


# -- HashBatch.from_bytes ----------------------------------------------------

HASHES = [bytes(range(i, i + 8)) for i in range(0, 40, 8)]


def byte_forms(h: bytes) -> dict[str, Any]:
    """One hash as each 1-D contiguous buffer of single bytes."""
    return {
        "bytes": h,
        "bytearray": bytearray(h),
        "memoryview": memoryview(h),
        "memoryview 'c'": memoryview(h).cast("c"),
        "uint8 array": np.frombuffer(h, dtype=np.uint8),
        "int8 array": np.frombuffer(h, dtype=np.int8),
        "array('B')": array("B", h),
        "array('b')": array("b", h),
    }


@pytest.mark.parametrize("form", sorted(byte_forms(b"")))
def test_from_bytes_reads_every_contiguous_byte_buffer(form: str) -> None:
    want = _batch_state(HashBatch.from_bytes([HASHES[:2], HASHES[2:]], 8))
    items = [byte_forms(h)[form] for h in HASHES]
    got = _batch_state(HashBatch.from_bytes([items[:2], items[2:]], 8))
    assert got == want
    rows = np.frombuffer(b"".join(HASHES), dtype=np.uint8).reshape(-1, 8)
    assert _batch_state(HashBatch.from_bytes([rows[:2], rows[2:]], 8)) == want


def _strided_hashes() -> list[Any]:
    """One 8-byte hash in 1-D byte buffers that are not contiguous: a
    memoryview slice with a step, a reversed one, a row of a column-major
    uint8 matrix (as ``np.asfortranarray`` or a transpose gives)."""
    h = HASHES[0]
    doubled = bytes(b for b in h for _ in range(2))
    rows = np.asfortranarray(np.frombuffer(b"".join(HASHES), np.uint8).reshape(-1, 8))
    return [
        pytest.param(memoryview(doubled)[::2], id="memoryview[::2]"),
        pytest.param(memoryview(h[::-1])[::-1], id="memoryview[::-1]"),
        pytest.param(rows[0], id="fortran uint8 row"),
    ]


# Once a bug: hash_words.join_hashes: why_not_bytes accepts a non-contiguous
# 1-D byte buffer, bytearray().join refuses it, and the scan finds nothing to
# name: AssertionError('unreachable: every item holds hash_bytes bytes')


@pytest.mark.parametrize("item", _strided_hashes())
def test_from_bytes_packs_or_names_a_strided_byte_buffer(item: Any) -> None:
    try:
        got = HashBatch.from_bytes([[item]], 8)
    except (TypeError, ValueError) as exc:
        assert "request 0, position 0" in str(exc)
    else:
        assert (
            got.hashes.tolist()
            == HashBatch.from_bytes([[HASHES[0]]], 8).hashes.tolist()
        )


@pytest.mark.parametrize("item", _strided_hashes())
def test_key_index_add_packs_or_names_a_strided_byte_buffer(item: Any) -> None:
    idx = KeyIndex(8, capacity=16)
    try:
        idx.add(0, [item])
    except (TypeError, ValueError) as exc:
        assert "hashes" in str(exc) and len(idx) == 0
    else:
        assert idx.contains(0, [HASHES[0]]).tolist() == [True]


# Once a bug: hash_words.as_list takes any sized iterable (a set, a dict),
# though its docstring refuses what is not a sequence: a set of hashes is
# packed in its iteration order, silently (from_ints([{100, 3, 2**40, 7}]) ->
# [2**40, 3, 100, 7]); KeyIndex.add refuses a set


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: HashBatch.from_ints([{100, 3, 2**40, 7}]), id="ints"),
        pytest.param(lambda: HashBatch.from_bytes([set(HASHES[:3])], 8), id="bytes"),
        pytest.param(lambda: HashBatch.from_ints({(1, 2)}), id="set of requests"),
    ],
)
def test_unordered_requests_are_refused(call: Callable[[], HashBatch]) -> None:
    # A request is a chain of block hashes: its order is its meaning.
    with pytest.raises(TypeError, match="request"):
        call()


# Once a bug: num_words bounded hash_bytes below only, and 2**70 failed in
# numpy ('Maximum allowed dimension exceeded'; 2**40 a MemoryError) without
# naming hash_bytes.
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda: HashBatch.from_ints([[1]], hash_bytes=2**70), id="from_ints"
        ),
        pytest.param(lambda: KeyIndex(2**70, capacity=2), id="KeyIndex"),
    ],
)
def test_a_huge_hash_width_is_refused_by_name(call: Callable[[], Any]) -> None:
    with pytest.raises((TypeError, ValueError), match="hash_bytes"):
        call()


# -- KeyIndex.add ------------------------------------------------------------

WORDS = [5, -7, 2**63 - 1, -(2**63), 0, 1]
GROUPS = [0, 3, 1, 0, 2, 1]


def _keys(idx: KeyIndex) -> list[tuple[int, tuple[int, ...]]]:
    g, h = idx.keys()
    return sorted(zip(g.tolist(), map(tuple, h.tolist()), strict=True))


def _as_bytes(words: list[int]) -> list[bytes]:
    return [w.to_bytes(8, "little", signed=True) for w in words]


def hash_forms(words: list[int]) -> list[tuple[str, Any]]:
    """8-byte hashes ``words`` in every documented form of ``hashes``."""
    a = np.array(words, dtype=np.int64).reshape(-1, 1)
    t = torch.tensor(words, dtype=torch.int64).reshape(-1, 1)
    return [
        ("int64 array", a),
        ("uint64 array", a.view(np.uint64)),
        ("strided array", np.repeat(a, 2, axis=0)[::2]),
        ("column of a fortran matrix", np.asfortranarray(np.hstack([a, a]))[:, :1]),
        ("read-only array", _read_only(a)),
        ("unaligned array", _unaligned(a, writable=False).reshape(-1, 1)),
        ("unaligned writable array", _unaligned(a, writable=True).reshape(-1, 1)),
        ("tensor", t),
        ("strided tensor", t.repeat_interleave(2, dim=0)[::2]),
        ("offset tensor", torch.cat([t[:1], t])[1:]),
        ("HashBatch", HashBatch.from_ints([words])),
        ("HashBatch of two", HashBatch.from_ints([words[:2], words[2:]])),
        ("list of bytes", _as_bytes(words)),
        ("tuple of bytes", tuple(_as_bytes(words))),
        ("list of memoryviews", [memoryview(b) for b in _as_bytes(words)]),
    ]


def id_forms(values: list[int]) -> list[tuple[str, Any]]:
    """Per-key ids ``values`` in every documented form (tensors int64)."""
    return [*sequence_forms(values), *numpy_forms(values), *tensor_forms(values)]


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_key_index_add_takes_every_form_as_its_lists(backend: str) -> None:
    def added(group_ids: Any, hashes: Any) -> list[Any]:
        idx = KeyIndex(8, capacity=64, backend=backend)
        n = idx.add(group_ids, hashes)
        return [n, len(idx), _keys(idx)]

    want = added(GROUPS, _as_bytes(WORDS))
    for hname, hashes in hash_forms(WORDS):
        assert added(GROUPS, hashes) == want, hname
    for gname, gids in id_forms(GROUPS):
        for hname, hashes in hash_forms(WORDS)[::4]:
            assert added(gids, hashes) == want, (gname, hname)
    # One group for every key: an int in any integer form.
    want_one = added([2] * len(WORDS), _as_bytes(WORDS))
    two = enum.IntEnum("Two", {"G": 2}).G
    for one in (2, np.int64(2), np.uint8(2), np.array(2), torch.tensor(2), two):
        for hname, hashes in hash_forms(WORDS):
            assert added(one, hashes) == want_one, (type(one).__name__, hname)


def _bad_keys(hash_bytes: int) -> list[tuple[str, Any, Any]]:
    """``(case, group_ids, hashes)`` that must be refused, at ``hash_bytes``."""
    w = (hash_bytes + 7) // 8
    good = np.arange(1, 4 * w + 1, dtype=np.int64).reshape(4, w)
    cases: list[tuple[str, Any, Any]] = [
        ("negative group in a list", [0, 1, -1, 2], good),
        ("negative group array", np.array([0, 1, -1, 2]), good),
        ("negative group tensor", torch.tensor([0, 1, -1, 2]), good),
        ("negative group int", -1, good),
        ("group past int64", [0, 1, 2**63, 2], good),
        ("uint64 group past int64", np.array([0, 1, 2**63, 2], dtype=np.uint64), good),
        (
            "big-endian uint64 group past int64",
            np.array([0, 1, 2**63, 2], dtype=">u8"),
            good,
        ),  # fmt: skip
        ("bool group", True, good),
        ("bool in the groups", [0, True, 1, 2], good),
        ("bool group array", np.ones(4, dtype=bool), good),
        ("float group", 1.0, good),
        ("float group array", np.ones(4), good),
        ("int32 group tensor", torch.zeros(4, dtype=torch.int32), good),
        ("too few groups", [0, 1, 2], good),
        ("2-D groups", np.zeros((1, 4), dtype=np.int64), good),
        ("an array in the groups", [0, 1, np.array([2]), 3], good),
        ("1-D hashes", 0, good[:, 0].copy()),
        ("3-D hashes", 0, good[None]),
        ("hashes one word too wide", 0, np.zeros((4, w + 1), dtype=np.int64)),
        ("float hashes", 0, good.astype(float)),
        ("int32 hashes", 0, good.astype(np.int32)),
        ("int32 hash tensor", 0, torch.from_numpy(good).int()),
        ("a hash a byte too long", 0, [b"x" * hash_bytes, b"y" * (hash_bytes + 1)]),
        ("one bytes object", 0, b"x" * hash_bytes),
        ("a set of bytes", 0, {b"x" * hash_bytes}),
        # A list of ints is one group's int hashes (from_ints' reading);
        # a bad item in one is named.
        ("a bool among int hashes", 0, [1, True, 3]),
        ("a float among int hashes", 0, [1, 2.0]),
        ("bytes among int hashes", 0, [1, b"x" * hash_bytes]),
        ("an int hash past int64", 0, [1, 1 << 63]),
        ("a HashBatch of another width", 0, HashBatch.from_ints([[1]], hash_bytes + 8)),
    ]
    if hash_bytes % 8:
        # A word's bytes past hash_bytes must be zero.
        padded = good.copy()
        padded[2, -1] |= np.int64(-1) << np.int64(8 * (hash_bytes % 8))
        cases += [
            ("padding bits", 0, padded),
            ("padding bits, uint64", 0, padded.view(np.uint64)),
            ("padding bits, tensor", 0, torch.from_numpy(padded)),
            ("padding bits, group list", [0] * 4, padded),
        ]
    return cases


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("hash_bytes", [8, 12])
def test_key_index_refusals_name_the_argument_and_change_nothing(
    backend: str, hash_bytes: int
) -> None:
    idx = KeyIndex(hash_bytes, capacity=64, backend=backend)
    idx.add(0, np.full((2, idx.W), 99, dtype=np.int64))
    before = (_keys(idx), len(idx), idx.tombstones)
    for case, group_ids, hashes in _bad_keys(hash_bytes):
        assert_refused(case, "group_ids|hashes|request", idx.add, group_ids, hashes)
        assert (_keys(idx), len(idx), idx.tombstones) == before, case


# -- FleetIndex.add and LookupEngine.fleet_hits ------------------------------

ENGINES = [0, 2, 1, 1, 0, 2]


def _fleet_state(f: FleetIndex) -> list[Any]:
    per_engine = []
    for e in range(f.num_engines):
        g, h = f.engine_keys(e)
        per_engine.append(sorted(zip(g.tolist(), map(tuple, h.tolist()), strict=True)))
    return [per_engine, len(f), f.engine_sizes().tolist()]


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_fleet_add_takes_every_form_as_its_lists(backend: str) -> None:
    def added(engine_ids: Any, group_ids: Any, hashes: Any) -> list[Any]:
        f = FleetIndex(3, 8, capacity=64, backend=backend)
        return [f.add(engine_ids, group_ids, hashes), *_fleet_state(f)]

    want = added(ENGINES, GROUPS, _as_bytes(WORDS))
    for hname, hashes in hash_forms(WORDS)[::5]:
        for name, ids in id_forms(ENGINES):
            assert added(ids, GROUPS, hashes) == want, ("engine_ids", name, hname)
        for name, ids in id_forms(GROUPS)[::3]:
            assert added(ENGINES, ids, hashes) == want, ("group_ids", name, hname)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_fleet_refusals_name_the_argument_and_change_nothing(backend: str) -> None:
    f = FleetIndex(3, 8, capacity=64, backend=backend)
    f.add(0, 0, np.array([[77]], dtype=np.int64))
    f.remove_engine(2)
    before = _fleet_state(f)
    hashes = np.array(WORDS, dtype=np.int64).reshape(-1, 1)
    for engine_ids, group_ids in [
        ([0, 1, 3, 0, 0, 0], GROUPS),  # engine 3 of 3
        ([0, 1, -1, 0, 0, 0], GROUPS),
        (3, GROUPS),
        (np.array([0, 1, 2**63, 0, 0, 0], dtype=">u8"), GROUPS),
        (True, GROUPS),
        ([0, 1, 2, 0, 0, 0], GROUPS),  # engine 2 was removed
        ([0, 1, np.array([1]), 0, 0, 0], GROUPS),
        (ENGINES[:3], GROUPS),
        (ENGINES, [0, 0, -1, 0, 0, 0]),
        (0, [0, 0, 2**62, 0, 0, 0]),  # past max_group_id: group * E + engine
    ]:
        for h in (hashes, torch.from_numpy(hashes), _as_bytes(WORDS)):
            case = (engine_ids, group_ids, type(h).__name__)
            assert_refused(
                case, "engine_ids|group_ids", f.add, engine_ids, group_ids, h
            )
            assert _fleet_state(f) == before, case


def _fleet_oracle(
    engine: LookupEngine, batch: HashBatch, values: list[int], fleet: FleetIndex
) -> list[list[list[int]]]:
    """``[fleet_hits, fleet_lookup]`` as int64 ``[B, E]`` lists, from one
    KeyIndex per engine (``fleet.key_index``) on the reference backend."""
    hits, looked = [], []
    for e in range(fleet.num_engines):
        idx = fleet.key_index(e)
        hits.append(engine.find_longest_cache_hit(batch, values, idx).hit_list())
        looked.append(engine.lookup(batch, values, idx).tolist())
    return [[list(row) for row in zip(*cols, strict=True)] for cols in (hits, looked)]


@pytest.mark.parametrize("size", [5, 1])
def test_fleet_hits_read_every_length_form_as_its_list(
    size: int, engines: dict[str, LookupEngine], fleet: FleetIndex
) -> None:
    # The router's host path (FleetIndex.router_hits) takes a list or tuple,
    # an int64 array or a CPU int64 tensor; every other form goes on to the
    # general path (checks.host_lengths, then fleet_scoring.fleet_find).
    batch = HashBatch.from_ints(REQUESTS[:size])
    values = MAX_LENGTHS[:size]
    want = _fleet_oracle(engines["reference"], batch, values, fleet)
    for backend in ("numba", "torch"):
        engine = engines[backend]
        for name, form in length_forms(values):
            if size == 1 and _reversed_8_byte(name):
                continue  # see test_one_reversed_length_*
            got = [
                engine.fleet_hits(batch, form, fleet).tolist(),
                engine.fleet_lookup(batch, form, fleet).tolist(),
            ]
            assert got == want, (backend, name)
        if size == 5:
            for name, bad in _bad_lengths():
                assert_refused(
                    name, "max_lengths", engine.fleet_hits, batch, bad, fleet
                )


# -- bugs: lengths -----------------------------------------------------------


@pytest.mark.parametrize(
    "item",
    [
        pytest.param(np.array([16]), id="numpy [1]"),
        pytest.param(np.array(16.0), id="numpy 0-d float"),
        pytest.param(torch.tensor([16, 2]), id="tensor [2]"),
    ],
)
@pytest.mark.parametrize("where", ["host_lengths", "numba", "torch", "fleet"])
def test_an_array_among_listed_lengths_is_named(
    item: Any,
    where: str,
    engines: dict[str, LookupEngine],
    index: KeyIndex,
    fleet: FleetIndex,
) -> None:
    # Found by this probe, fixed in 7df11dc: the list fast path (struct's
    # pack_into) caught struct.error only, and an item whose own __index__
    # raises TypeError escaped with numpy's or torch's message.
    lens = [16, 16, 16, 16, item]
    with pytest.raises(TypeError, match=r"max_lengths\[4\]"):
        if where == "host_lengths":
            host_lengths(lens, "max_lengths", 5)
        elif where == "fleet":
            engines["numba"].fleet_hits(HashBatch.from_ints(REQUESTS), lens, fleet)
        else:
            engines[where].find_longest_cache_hit(
                HashBatch.from_ints(REQUESTS), lens, index
            )


# Once a bug: checks.host_lengths: an int64 or uint64 array of one length (or
# none) with a negative stride (a[::-1]) is flagged C-contiguous by numpy and
# handed back as it is; check_lengths' torch.from_numpy then refuses it with
# an unnamed ValueError ('At least one stride in the given numpy array is
# negative')


def _one_reversed(dtype: str) -> np.ndarray:
    a = np.array([64], dtype=dtype)[::-1]
    assert a.strides == (-a.itemsize,) and a.flags.c_contiguous
    return a


@pytest.mark.parametrize("dtype", ["<i8", "<u8"])
def test_one_reversed_length_is_checked_by_check_lengths(dtype: str) -> None:
    assert check_lengths(_one_reversed(dtype), "max_lengths", 1, CPU).tolist() == [64]


@pytest.mark.parametrize("dtype", ["<i8", "<u8"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_one_reversed_length_is_read_by_find(
    dtype: str, backend: str, engines: dict[str, LookupEngine], index: KeyIndex
) -> None:
    batch = HashBatch.from_ints(REQUESTS[:1])
    want = engines[backend].find_longest_cache_hit(batch, [64], index).hit_list()
    got = engines[backend].find_longest_cache_hit(batch, _one_reversed(dtype), index)
    assert got.hit_list() == want


@pytest.mark.parametrize("call", ["load_masks", "lookup_masks", "store_masks"])
def test_one_reversed_length_is_read_by_the_numba_mask_calls(
    call: str, engines: dict[str, LookupEngine]
) -> None:
    engine = engines["numba"]
    batch = HashBatch.from_ints(REQUESTS[:1])
    lens = _one_reversed("<i8")
    if call == "load_masks":
        got, want = engine.load_masks(batch, lens), engine.load_masks(batch, [64])
        assert got.mask_lists() == want.mask_lists()
    else:
        fn = getattr(engine, call)
        assert fn(lens).mask_lists() == fn([64]).mask_lists()


def test_one_length_in_other_odd_layouts_is_read(
    engines: dict[str, LookupEngine], index: KeyIndex
) -> None:
    # The reversed case above alone fails: a positive odd stride, an offset,
    # a 0-stride broadcast are read.
    batch = HashBatch.from_ints(REQUESTS[:1])
    want = engines["reference"].find_longest_cache_hit(batch, [64], index).hit_list()
    base = np.arange(0, 640, 64, dtype=np.int64)
    forms = [base[1:2], base[1::5][:1], np.broadcast_to(np.int64(64), (1,)),
             np.lib.stride_tricks.as_strided(base[1:], (1,), (40,))]  # fmt: skip
    for backend, engine in engines.items():
        for form in forms:
            assert (
                engine.find_longest_cache_hit(batch, form, index).hit_list() == want
            ), (
                backend,
                form.strides,
            )


@pytest.mark.parametrize("order", ["<", ">"])
def test_a_uint64_group_past_int64_is_named_as_such_in_either_byte_order(
    order: str,
) -> None:
    # A big-endian uint64 id past int64 once read as "must be >= 0": its
    # dtype is not == np.uint64, so the int64 bound was not tested first.
    idx = KeyIndex(8, capacity=16)
    ids = np.array([0, 2**63], dtype=order + "u8")
    with pytest.raises(ValueError, match="group_ids must fit in int64"):
        idx.add(ids, np.array([[1], [2]]))
    assert len(idx) == 0


# A list of ints is one group's int hashes, read as HashBatch.from_ints reads
# a request's (a router stores from the lists it looked up with): the same
# keys as the rows from_ints packs, on the host path (numba, one group id)
# and the general one (torch, per-key ids), for every width.
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("hash_bytes", [4, 8, 16])
@settings(max_examples=30, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300),
    probe=st.lists(st.integers(0, 2**31 - 1), max_size=20),
)
def test_key_index_takes_int_hashes_as_from_ints_reads_them(
    backend: str, hash_bytes: int, ids: list[int], probe: list[int]
) -> None:
    by_list = KeyIndex(hash_bytes, capacity=4, backend=backend)
    by_rows = KeyIndex(hash_bytes, capacity=4, backend=backend)
    rows = HashBatch.from_ints([ids], hash_bytes).hashes
    assert by_list.add(0, ids) == by_rows.add(0, rows)
    assert by_list.add([1] * len(ids), ids) == by_rows.add([1] * len(ids), rows)
    assert by_list.add(0, ids) == 0  # idempotent, from the list too
    both = ids[: len(ids) // 2] + probe
    want = by_rows.contains(0, HashBatch.from_ints([both], hash_bytes).hashes)
    assert by_list.contains(0, both).tolist() == want.tolist()
    assert torch.equal(by_list.table, by_rows.table)
    assert by_list.remove(1, ids[:3]) == by_rows.remove(1, rows[:3])
    assert len(by_list) == len(by_rows)


def test_int_hashes_past_a_fixed_capacity_change_nothing() -> None:
    idx = KeyIndex(8, capacity=8, growable=False)
    idx.add(0, [1, 2])
    before = idx.table.clone()
    with pytest.raises(CapacityError):
        idx.add(0, list(range(100, 200)))
    assert torch.equal(idx.table, before) and len(idx) == 2
    with pytest.raises(TypeError, match=r"hashes, position 2: expected an int hash"):
        idx.add(0, [7, 8, np.float64(3.0)])
    assert torch.equal(idx.table, before)


def test_add_inserts_a_list_of_int_hashes_itself(monkeypatch) -> None:
    # KeyIndex.add hands a list of ints for one group to the compiled insert
    # itself; only what that refuses reaches insert_host_forms, which names
    # a bad item (or converts a list the insert cannot take).
    import kvhit.coordinator.key_index as key_index

    reached = []
    host_forms = key_index.insert_host_forms

    def record(*args):
        reached.append(args[3])
        return host_forms(*args)

    monkeypatch.setattr(key_index, "insert_host_forms", record)
    idx = KeyIndex(8, capacity=64)
    assert idx.add(0, [1, 2, 3]) == 3 and idx.add(2, [3, 4]) == 2
    assert reached == []
    with pytest.raises(TypeError, match=r"hashes, position 1"):
        idx.add(0, [5, True])
    assert reached == [[5, True]] and len(idx) == 5
    # A numpy int msgspec cannot write: converted by insert_host_forms.
    assert idx.add(0, [6, np.int64(7)]) == 2
    assert reached[-1] == [6, 7] and len(idx) == 7
    assert idx.contains(2, [3, 4, 1]).tolist() == [True, True, False]


def test_fleet_takes_int_hashes_too() -> None:
    fleet = FleetIndex(2, 8)
    assert fleet.add(0, 0, [1, 2, 3]) == 3
    assert fleet.add(1, 0, [3, 4]) == 2
    rows = HashBatch.from_ints([[1, 2, 3, 4]]).hashes
    other = FleetIndex(2, 8)
    other.add(0, 0, rows[:3])
    other.add(1, 0, rows[2:])
    assert len(fleet) == len(other)
    with pytest.raises(TypeError, match=r"hashes, position 1"):
        fleet.add(0, 0, [5, True])


def test_int_hashes_that_do_not_fit_a_narrow_index_change_nothing() -> None:
    idx = KeyIndex(4, capacity=16)
    idx.add(0, [5, 6])
    before = idx.table.clone()
    for bad in ([7, 1 << 40], [7, -1]):
        with pytest.raises(ValueError, match=r"hashes, position 1: .* does not fit"):
            idx.add(0, bad)
        assert torch.equal(idx.table, before)


@pytest.mark.parametrize(
    "msg",
    [
        b"",
        b"\x90",  # no list
        b"\x92\x91\x01\x91\x02",  # two lists
        b"\x91\x92\x01\xc3",  # a bool
        b"\x91\x92\x01\xcb\x00\x00\x00\x00\x00\x00\x00\x00",  # a float
        b"\x91\x91\xcf\x80\x00\x00\x00\x00\x00\x00\x00",  # past int64
        b"\x91\x93\x01\x02\x03",  # more keys than room (2)
    ],
)
def test_the_int_list_insert_reads_only_what_it_takes(msg: bytes) -> None:
    from kvhit.kernels import hash_index_numba as hn

    table = np.full((8, 2), -1, dtype=np.int64)
    before = table.copy()
    assert hn.insert_int_list(table, 0, msg, 0, 2) == hn.NOT_READ
    assert np.array_equal(table, before)
    assert hn.insert_int_list(table, 0, b"\x91\x92\x01\x02", 0, 2) == 2
    assert hn.insert_int_list(table, 0, b"\x91\x92\x01\x02", 0, 2) == 0
