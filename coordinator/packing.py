"""Packing of block hashes into int64 tensors.

A block hash is a ``bytes`` object of a fixed width ``hash_bytes`` (32 for
sha256, 16 for xxhash128, 8 in tests). It is stored as ``W = ceil(hash_bytes /
8)`` little-endian int64 words; when ``hash_bytes % 8 != 0`` the bytes past the
hash in the last word are zero, so two packings of the same bytes are always
bit-identical and a key compares equal exactly when its bytes do.

A batch of requests is ragged: the hashes of all requests concatenated,
``hashes [total, W]`` int64, plus CSR ``offsets [B + 1]`` int64 (request ``i``
owns rows ``offsets[i]:offsets[i + 1]``), both on one device.

Packing goes through one ``bytearray().join`` and ``numpy.frombuffer``; per-hash
Python work is limited to C-level ``map(len, ...)`` / ``list.extend`` calls, so a
1024 x 4000-hash batch packs in well under a second.

Integer hashes (vLLM's KV events, Dynamo, request traces: one int64 per block)
go in through :meth:`HashBatch.from_ints`: the int is the key's first
little-endian word, i.e. the same key as ``from_bytes`` of its 8 little-endian
two's-complement bytes followed by zero bytes up to ``hash_bytes``.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate, chain, compress
from operator import attrgetter, iadd, index, itemgetter
from typing import Any, ClassVar

import numpy as np
import torch

from kvhit.coordinator.hash_words import (
    BytesLike,
    as_list,
    join_hashes,
    num_words,
    pack_hashes,
    pack_joined,
    padding_mask,
    unpack_hashes,
)
from kvhit.coordinator.int_lists import decoder_ready, int_list, int_lists
from kvhit.kernels.checks import (
    ARRAY_INT_CODES,
    TORCH_INT_DTYPES,
    check_device,
    check_hash_array,
    check_hash_buffer,
    check_hash_tensor,
    check_hash_widths,
    check_tensor,
)

__all__ = [
    "HashBatch",
    "RaggedView",
    "check_device",
    "check_hash_array",
    "check_hash_buffer",
    "check_hash_tensor",
    "int_rows",
    "num_words",
    "pack_hashes",
    "padding_mask",
    "unpack_hashes",
]

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

# check_device's answers, by argument: a device argument is parsed (and a
# tensor made on it) once per process, not on every batch (~3 us a call).
_CHECKED_DEVICES: dict[Any, torch.device] = {}
_CPU = torch.device("cpu")
_DTYPE = attrgetter("dtype")
_TYPECODE = attrgetter("typecode")
#: The item types a list of ints may hold for a fast path (a type scan with
#: ``issuperset`` builds no set: half the time of ``set(map(type, ...))``).
_INTS = frozenset({int})
_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
_TWO = np.uint64(2)  # a numpy scalar: comparing with a Python int costs more
#: Up to this many ints, _list_batch looks at every item's type rather than
#: finding the 0s and 1s with numpy (~2 us of calls however short).
_SCAN_MAX = 64
#: The request types from_ints takes a batch of lists of Python ints for.
_LISTS = frozenset({list})
#: The array kinds from_ints takes a whole batch of in one concatenation
#: (torch tensors have their own path, :func:`_tensor_batch`).
_ARRAY_KINDS = frozenset({np.ndarray, array})
#: The request type of from_ints' path for a batch of torch tensors.
_TENSORS = frozenset({torch.Tensor})
#: From this many ints on, from_ints converts a list with struct (one pass)
#: rather than a type scan and np.array (two): the crossover measured here
#: is ~150.
_STRUCT_MIN = 256
#: From this many ints on, from_ints packs one list of Python ints with the
#: msgpack decoder (int_lists.int_list) rather than a type scan and np.array
#: (side by side: 1.61 -> 1.44 us at 23 ints, 3.27 -> 1.84 at 64; 0.91 ->
#: 1.25 at 8).
_DECODE_MIN_ONE = 20
#: Below this many ints in all, from_ints packs a batch of several lists of
#: Python ints as it does one (one type scan and one np.array): measured
#: ahead up to ~110 ints, behind from ~200 (_lists_batch).
_SMALL_MAX = 128
#: ... and at most this many requests: a longer step holds more ints, not
#: delayed by counting them (B = 8 conversation: 14.3 -> 15.2 us with it).
_SMALL_B = 4


def _device(device: Any) -> torch.device:
    """``check_device(device)``, remembered for the valid (hashable) ones."""
    try:
        return _CHECKED_DEVICES[device]
    except (KeyError, TypeError):
        dev = check_device(device)
        if dev == _CPU:
            dev = _CPU  # one object, so a hot path can test ``is _CPU``
        if isinstance(device, str | torch.device) and len(_CHECKED_DEVICES) < 64:
            _CHECKED_DEVICES[device] = dev
        return dev


def _bad_int(v: Any, where: str) -> Exception | None:
    """Why ``v`` cannot be an int64 hash (None if it can): an integer is what
    ``operator.index`` takes (ints, numpy integers), bools excepted (a torch
    bool scalar too: its ``__index__`` answers 0 or 1)."""
    if isinstance(v, bool | np.bool_) or (
        isinstance(v, torch.Tensor) and v.dtype == torch.bool
    ):
        return TypeError(f"{where}: expected an int hash, got {type(v).__name__}")
    try:
        i = index(v)
    except TypeError:
        return TypeError(f"{where}: expected an int hash, got {type(v).__name__}")
    if not _INT64_MIN <= i <= _INT64_MAX:
        return ValueError(f"{where}: {i} is outside int64 [-2**63, 2**63)")
    return None


def _short_ints(flat: list[Any]) -> np.ndarray | None:
    """A short list of Python ints as int64 ``[n]``, or None when any item is
    not exactly an int or is outside int64: one type scan (bools refused by
    their type) and np.array (numpy would truncate a float: the scan refuses
    one)."""
    if _INTS.issuperset(map(type, flat)):
        try:
            return np.array(flat, dtype=np.int64)
        except OverflowError:
            pass
    return None


def _long_ints(flat: list[Any], n: int) -> np.ndarray | None:
    """A long list of ``n`` ints as int64 ``[n]``, or None when an item is not
    an integer, is outside int64, or is a 0 or a 1 that is not an int.

    One pass converts and checks at once: struct takes what
    ``operator.index`` takes and refuses floats, str, None and values outside
    int64, half the cost of a type scan plus np.array (the few numpy calls
    after it cost ~2 us, which a short list does not win back). struct also
    takes bools (a torch bool scalar too) as 0 and 1, so the items whose
    value is 0 or 1, and only those, are looked at by their type: a trace's
    ids start at 0, so most batches hold a few.
    """
    buf = bytearray(8 * n)
    try:
        # Native byte order, as numpy reads the buffer back.
        struct.pack_into(f"={n}q", buf, 0, *flat)
    except (struct.error, TypeError, ValueError, OverflowError):
        return None
    values = np.frombuffer(buf, dtype=np.int64)
    small = np.flatnonzero(values.view(np.uint64) < 2).tolist()
    if small and not set(map(type, map(flat.__getitem__, small))) <= {int}:
        return None
    return values


def _request_position(offsets: np.ndarray, k: int) -> str:
    """Flat item ``k`` of a batch of CSR ``offsets``, named by request and
    position."""
    i = int(np.searchsorted(offsets, k, side="right")) - 1
    return f"request {i}, position {k - int(offsets[i])}"


def _int_words(
    values: np.ndarray, hash_bytes: int, w: int, offsets: np.ndarray | str
) -> np.ndarray:
    """Integer hashes (int64 ``[n]``, each in int64) as key rows int64 ``[n,
    w]``: the int the key's first little-endian word, later words zero; with
    ``hash_bytes < 8`` each must fit in that many bytes (ValueError naming
    the first that does not: by request and position in a batch of CSR
    ``offsets``, or as ``offsets``' name and position)."""
    if hash_bytes < 8 and values.size:
        bad = (values < 0) | (values >= (1 << (8 * hash_bytes)))
        if bad.any():
            k = int(np.argmax(bad))
            where = (
                f"{offsets}, position {k}"
                if isinstance(offsets, str)
                else _request_position(offsets, k)
            )
            raise ValueError(
                f"{where}: {int(values[k])} does not fit in hash_bytes="
                f"{hash_bytes} bytes (need 0 <= v < 2**{8 * hash_bytes})"
            )
    if w == 1:
        return values.reshape(-1, 1)
    words = np.zeros((values.shape[0], w), dtype=np.int64)
    words[:, 0] = values
    return words


def int_rows(values: Sequence[Any], hash_bytes: int, name: str) -> np.ndarray:
    """One sequence of integer hashes, as :meth:`HashBatch.from_ints` takes
    one request's (integers, bools refused; each in int64 and, with
    ``hash_bytes < 8``, fitting in that many bytes), as key rows int64 ``[n,
    ceil(hash_bytes / 8)]`` (a new array). A bad item raises TypeError or
    ValueError naming ``name`` and its position. ``hash_bytes`` is trusted
    (the caller's index's)."""
    flat = values if type(values) is list else list(values)
    n = len(flat)
    ints = _short_ints(flat) if n < _STRUCT_MIN else _long_ints(flat, n)
    if ints is None:
        # A bad item (named), or integer-likes (numpy scalars) one by one.
        for pos, v in enumerate(flat):
            exc = _bad_int(v, f"{name}, position {pos}")
            if exc is not None:
                raise exc
        ints = np.array([index(v) for v in flat], dtype=np.int64)
    return _int_words(ints, hash_bytes, num_words(hash_bytes), name)


def _list_batch(
    requests: list[list[Any]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A batch of lists of Python ints (0 and 1 included) as ``(offsets
    int64 [B + 1], lengths int64 [B], values int64 [total])``, views of one
    array, or None when an item is not an integer, is outside int64, or is
    a 0 or a 1 that is not an int (the slow path then names it or converts
    it).

    One struct pass converts and checks the offsets, the lengths and the
    values at once (see :func:`_long_ints`), rather than np.array and
    np.cumsum (~3 us per batch). Its arguments are built as one list, the
    requests appended by ``list +=`` (``reduce(iadd)``: a third of
    ``chain.from_iterable``'s cost per int) after the format, the buffer
    and the offsets: ``pack_into(*args)`` then copies the list once, where
    ``pack_into(fmt, buf, 0, *flat)`` copies the items twice more.
    """
    lengths = list(map(len, requests))
    b = len(lengths)
    n = sum(lengths)
    size = 2 * b + 1 + n
    buf = bytearray(8 * size)
    # Native byte order, as numpy reads the buffer back.
    head = [f"={size}q", buf, 0, 0, *accumulate(lengths), *lengths]
    at = len(head)  # args[at + k] is value k
    args = reduce(iadd, requests, head)
    try:
        struct.pack_into(*args)
    except (struct.error, TypeError, ValueError, OverflowError):
        return None
    arr = np.frombuffer(buf, dtype=np.int64)
    values = arr[2 * b + 1 :]
    # struct takes bools as 0 and 1: the items of those values, and only
    # those, are looked at by their type; a short batch's items all (a type
    # scan costs less than the numpy calls that find the 0s and 1s).
    if n < _SCAN_MAX:
        if not _INTS.issuperset(map(type, args[at:])):
            return None
    else:
        small = ((values.view(_UINT64) < _TWO).nonzero()[0] + at).tolist()
        if len(small) > 1:
            if not _INTS.issuperset(map(type, itemgetter(*small)(args))):
                return None
        elif small and type(args[small[0]]) is not int:
            return None
    return arr[: b + 1], arr[b + 1 : 2 * b + 1], values


def _lists_batch(cls: type[HashBatch], requests: list[Any]) -> HashBatch | None:
    """A CPU batch of 8-byte keys from ``requests``, a list of ``B != 1``
    lists of Python ints, its host arrays views of one array; None for
    anything else, which the general path takes or refuses. With the decoder
    loaded (``coordinator/int_lists.py``), any ``B`` (64 conversation
    requests: 54 us cold, 20 warm); without, 2 to :data:`_SMALL_B` lists of
    fewer than :data:`_SMALL_MAX` ints: one type scan (bools refused by
    type) and one np.array of a list of offsets, lengths and values (per
    step against the struct pass: 7.7 -> 6.5 us at B = 2, 12.2 -> 9.8 at 4).
    """
    ready = decoder_ready()
    # Without the decoder a longer batch is refused before any type scan.
    if not ready and not 2 <= len(requests) <= _SMALL_B:
        return None
    if not _LISTS.issuperset(map(type, requests)):
        return None
    if ready:
        got = int_lists(requests)
        if got is None:
            return None
        offsets, lengths, values = got
        words, starts = values.reshape(-1, 1), offsets[:-1]
    else:
        lens = list(map(len, requests))
        b = len(lens)
        if sum(lens) >= _SMALL_MAX:
            return None
        # [0, offsets[1:]..., lengths..., values...]: list += per request.
        args = reduce(iadd, requests, [0, *accumulate(lens), *lens])
        if not _INTS.issuperset(map(type, args)):
            return None
        try:
            arr = np.array(args, _INT64)
        except OverflowError:
            return None
        words, offsets = arr[2 * b + 1 :].reshape(-1, 1), arr[: b + 1]
        starts, lengths = arr[:b], arr[b + 1 : 2 * b + 1]
    batch = object.__new__(cls)
    batch.__dict__.update(
        hash_bytes=8, _lazy=(words, offsets), _host=(words, starts, lengths)
    )
    return batch


def _ints_of_list(
    parts: list[Any], requests: list[Any], lengths: list[int], first: int
) -> np.ndarray:
    """The items of ``parts`` (sequences: the requests from ``first`` on, in
    order, or one list of their items) as int64 ``[n]``; on a bad item, raise
    naming its request and position. The common case (integers, all in
    range) is C-level loops only, whatever the values: 0 and 1 included."""
    flat = parts[0] if len(parts) == 1 else list(chain.from_iterable(parts))
    n = len(flat)
    values = _short_ints(flat) if n < _STRUCT_MIN else _long_ints(flat, n)
    if values is not None:
        return values
    # Slow path, on error or integer-likes (numpy scalars): find the first
    # bad item, or convert them one by one.
    k, i = 0, first
    while k < n:
        for pos in range(lengths[i]):
            exc = _bad_int(flat[k], f"request {i}, position {pos}")
            if exc is not None:
                raise exc
            k += 1
        i += 1
    return np.array([index(v) for v in flat], dtype=np.int64)


def _offsets(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``offsets`` int64 ``[B + 1]`` and ``lengths`` int64 ``[B]`` of a
    batch's request lengths."""
    if len(lengths) == 1:
        offsets = np.array((0, lengths[0]), dtype=np.int64)
        return offsets, offsets[1:]  # a view, no conversion
    host_lengths = np.array(lengths, dtype=np.int64)
    if len(lengths) < 64:
        # accumulate + one array: np.cumsum costs ~3 us however short.
        offsets = np.array([0, *accumulate(lengths)], dtype=np.int64)
    else:
        offsets = np.empty(len(lengths) + 1, dtype=np.int64)
        offsets[0] = 0
        np.cumsum(host_lengths, out=offsets[1:])
    return offsets, host_lengths


def _host_ints(req: Any, i: int) -> np.ndarray | None:
    """Request ``i`` as int64 ``[n]`` when it is an array (numpy, torch or
    ``array.array``), checked; None for anything else (a sequence)."""
    if isinstance(req, np.ndarray):
        return check_hash_array(req, i)
    if isinstance(req, torch.Tensor):
        return check_hash_tensor(req, i)
    if isinstance(req, array):
        return check_hash_buffer(req, i)
    return None


def _ints_of_mixed(requests: list[Any]) -> tuple[list[int], np.ndarray]:
    """:meth:`HashBatch.from_ints`' values of requests of mixed forms (or
    arrays of mixed dtypes, or a bad one): ``(lengths, int64 values
    [total])``, errors naming request and position."""
    parts: list[np.ndarray] = []
    flat: list[Any] = []
    first = 0  # the request flat's items start at
    lengths = [0] * len(requests)
    own = True  # whether every part was made here (not a caller's memory)
    # Python-int requests are gathered in one list and converted by one
    # struct pass; array requests are checked by dtype and concatenated.
    # The int list is flushed before each array, so values stay in
    # request order.
    for i, req in enumerate(requests):
        arr = _host_ints(req, i)
        if arr is not None:
            if flat:
                parts.append(_ints_of_list([flat], requests, lengths, first))
                flat = []
            parts.append(arr)
            own = False
            lengths[i] = arr.shape[0]
            first = i + 1
            continue
        if not isinstance(req, list | tuple):
            req = as_list(req, f"requests[{i}] (request {i})", "a sequence of ints")
        flat.extend(req)
        lengths[i] = len(req)
    if flat or not parts:
        parts.append(_ints_of_list([flat], requests, lengths, first))
    if len(parts) > 1:
        values = np.concatenate(parts)
    elif own:
        values = parts[0]  # made here from Python ints
    else:
        values = parts[0].copy()  # a caller's memory: never alias it
    return lengths, values


def _tensor_batch(
    requests: list[Any],
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A batch of torch tensors (exactly ``torch.Tensor``) of one integer
    dtype, 1-D, as ``(offsets int64 [B + 1], lengths int64 [B], values
    int64 [total])``, the values a new array (never the caller's memory);
    None when anything is off (type, dtype, shape, a meta or sparse tensor,
    a uint64 past int64), for the general path to name it. A tensor's
    metadata costs ~70 ns a Python call, cat ~130 ns a tensor: the batch is
    walked in four passes (types, dtypes, lengths, one cat), nothing more.
    """
    if not _TENSORS.issuperset(map(type, requests)):
        return None
    dtypes = set(map(_DTYPE, requests))
    if len(dtypes) != 1 or not dtypes <= TORCH_INT_DTYPES:
        return None
    lengths = list(map(torch.Tensor.numel, requests))
    parts = requests
    if 0 in lengths:
        # cat takes a slow path as soon as one input is empty (64 tensors of
        # the synthetic trace, 24 of them empty: 41 us, 6.7 without them):
        # the empty ones are left out, checked here as cat and numpy() would
        # (1-D, dense, holding data); anything else goes on to be named.
        for t in compress(requests, map((0).__eq__, lengths)):
            if t.dim() != 1 or t.layout is not torch.strided or t.is_meta:
                return None
        parts = list(compress(requests, lengths))
    # The lengths with a 0 in front: their cumsum is the offsets.
    head = np.fromiter(chain((0,), lengths), _INT64, len(lengths) + 1)
    if not parts:
        return head.cumsum(), head[1:], np.zeros(0, dtype=np.int64)
    try:
        # One cat (dense, one device; a sparse or meta tensor fails here or
        # at numpy()). cat refuses 0-d tensors and mixed dimensions; all 2-D
        # ones give a 2-D result: the shape is checked once, after it.
        joined = torch.cat(parts)
        if joined.dim() != 1:
            return None
        try:
            values = joined.numpy()
        except TypeError:  # on an accelerator: one host copy
            values = joined.cpu().numpy()
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    if values.dtype == _UINT64 and values.size:
        if (values > np.uint64(_INT64_MAX)).any():
            return None  # a value past int64: named by the slow path
    return head.cumsum(), head[1:], values.astype(np.int64, copy=False)


def _ints_of_same(
    requests: list[Any], kind: type
) -> tuple[list[int], np.ndarray] | None:
    """The batch's values when every request is an array of one ``kind``
    (numpy or ``array.array``) and one integer dtype, 1-D, values in
    int64: ``(lengths, int64 values [total])``, concatenated in one call
    (a new array: the caller's memory is never aliased). None when anything
    is off, for :func:`_ints_of_mixed` to name it."""
    if kind is np.ndarray:
        if len({(r.dtype, r.ndim) for r in requests}) != 1:
            return None
        dtype = requests[0].dtype
        if requests[0].ndim != 1 or dtype.kind not in "iu":
            return None
        lengths = list(map(len, requests))
        values = np.concatenate(requests)
    else:
        codes = set(map(_TYPECODE, requests))
        if len(codes) != 1 or not codes <= ARRAY_INT_CODES:
            return None
        lengths = list(map(len, requests))
        values = np.frombuffer(bytearray().join(requests), dtype=requests[0].typecode)
        dtype = values.dtype
    if dtype.kind == "u" and dtype.itemsize == 8 and values.size:
        if (values > np.uint64(_INT64_MAX)).any():
            return None  # a value past int64: named by the slow path
    return lengths, values.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False)
class RaggedView:
    """A batch of requests' hashes as the backends read it; built in one
    place, :meth:`HashBatch.view`, and not validated again.

    Attributes:
        rows: int64 ``[T, W]``, every request's hashes concatenated (contiguous).
        offsets: int64 ``[R]``, the first row of each request.
        lengths: int64 ``[R]``, each request's number of hashes.
        token_lens: None, or int64 ``[R]``: the store worker's lookup length,
            when only the keys the worker asks about count as present.

    All on one device. A subset of a batch's requests is a view too
    (:meth:`select`); rows are shared, never copied.
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    token_lens: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.offsets.shape[0]

    @property
    def device(self) -> torch.device:
        """Device of every tensor of the view."""
        return self.rows.device

    def select(self, requests: torch.Tensor) -> RaggedView:
        """The requests ``requests`` (int64 ``[R']`` indices) as a view."""
        return RaggedView(
            rows=self.rows,
            offsets=self.offsets[requests],
            lengths=self.lengths[requests],
            token_lens=None if self.token_lens is None else self.token_lens[requests],
        )

    def with_token_lens(self, token_lens: torch.Tensor | None) -> RaggedView:
        """The same requests with another worker restriction (int64 ``[R]``)."""
        return RaggedView(self.rows, self.offsets, self.lengths, token_lens)


@dataclass(frozen=True, eq=False)
class HashBatch:
    """A ragged batch of requests' block hashes, packed on one device.

    Attributes:
        hashes: int64 ``[total, W]``, the hashes of every request concatenated;
            little-endian words, last word zero-padded (padding bits must be 0).
        offsets: int64 ``[B + 1]``, CSR: request ``i`` owns rows
            ``offsets[i]:offsets[i + 1]``; ``offsets[0] == 0``, non-decreasing,
            ``offsets[-1] == total``.
        hash_bytes: width in bytes of every hash.

    The constructor validates shapes, dtypes, devices and offsets (this costs
    one host sync); use :meth:`from_bytes` to build one from Python bytes.
    """

    hashes: torch.Tensor
    offsets: torch.Tensor
    hash_bytes: int
    #: The values of a batch that :meth:`from_ints` built on its path for
    #: one list of Python ints (one request, 8-byte keys, on the CPU):
    #: int64 ``[n]`` (``hashes[:, 0]``), C-contiguous, sharing the batch's
    #: memory; None for every other batch (a class default: a plain
    #: attribute read, a third of a method call's cost). A scheduler step's
    #: lookup of one request reads it with no other test of the batch; like
    #: :meth:`host_single`, it assumes the batch's tensors are not modified
    #: in place.
    one_values: ClassVar[np.ndarray | None] = None

    def __post_init__(self) -> None:
        h = check_tensor(self.hashes, "hashes")
        o = check_tensor(self.offsets, "offsets")
        w = num_words(self.hash_bytes)
        if h.dim() != 2 or h.shape[1] != w:
            raise ValueError(
                f"hashes must have shape [total, {w}] for hash_bytes="
                f"{self.hash_bytes}, got {list(h.shape)}"
            )
        if o.dim() != 1 or o.numel() < 1:
            raise ValueError(f"offsets must have shape [B + 1], got {list(o.shape)}")
        if o.device != h.device:
            raise ValueError(
                f"offsets is on {o.device} but hashes is on {h.device}; "
                "both must be on one device"
            )
        oc = o.cpu()
        if oc[0].item() != 0 or oc[-1].item() != h.shape[0]:
            raise ValueError(
                f"offsets must start at 0 and end at total={h.shape[0]}, got "
                f"{oc[0].item()}..{oc[-1].item()}"
            )
        if bool((oc[1:] < oc[:-1]).any()):
            raise ValueError("offsets must be non-decreasing")
        pad = padding_mask(self.hash_bytes)
        if pad and h.shape[0] and bool(((h[:, -1] & pad) != 0).any()):
            raise ValueError(
                f"hashes: padding bytes past hash_bytes={self.hash_bytes} in "
                "the last word must be zero"
            )
        # Contiguity is part of the contract for the kernels reading rows.
        if not h.is_contiguous():
            object.__setattr__(self, "hashes", h.contiguous())
        if not o.is_contiguous():
            object.__setattr__(self, "offsets", o.contiguous())

    @classmethod
    def from_bytes(
        cls,
        requests: Sequence[Sequence[BytesLike]],
        hash_bytes: int,
        device: torch.device | str = "cpu",
    ) -> HashBatch:
        """Pack ``requests[i][j]`` (bytes of width ``hash_bytes``) into a batch.

        Raises ValueError naming the request and position of a hash whose
        length is not ``hash_bytes``.
        """
        w = num_words(hash_bytes)
        device = _device(device)
        requests = as_list(requests, "requests", "a sequence of sequences of bytes")
        flat: list[BytesLike] = []
        lengths = np.zeros(len(requests), dtype=np.int64)
        for i, req in enumerate(requests):
            req = as_list(req, f"requests[{i}] (request {i})", "a sequence of bytes")
            check_hash_widths(req, hash_bytes, f"request {i}")
            lengths[i] = len(req)
            # One flat list and one join: join over a chained iterator first
            # materialises it much more slowly.
            flat.extend(req)
        offsets = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        if total:

            def where(k: int) -> str:
                return _request_position(offsets, k)

            joined = join_hashes(flat, where, hash_bytes)
            words = torch.from_numpy(pack_joined(joined, total, hash_bytes))
        else:
            words = torch.empty((0, w), dtype=torch.int64)
        return cls.from_trusted(
            words.to(device), torch.from_numpy(offsets).to(device), hash_bytes
        )

    @classmethod
    def from_ints(
        cls,
        requests: Sequence[Sequence[int] | np.ndarray],
        hash_bytes: int = 8,
        device: torch.device | str = "cpu",
    ) -> HashBatch:
        """Pack per-request integer hashes (one int64 per block) into a batch.

        Args:
            requests: ``B`` requests, each a sequence of Python ints (or numpy
                integers: whatever ``operator.index`` takes; bools refused by
                their type, 0 and 1 taken) or a 1-D array of an integer dtype
                (numpy, torch on any device, ``array.array``), every value in
                ``[-2**63, 2**63)``. A batch of lists, or of arrays of one
                kind and dtype, converts in a few C-level passes (~10-20 ns
                per int; lists via ``coordinator/int_lists.py`` once numba is
                warm); mixed forms go request by request.
            hash_bytes: key width. The int is the key's first little-endian
                word: ``from_ints([[v]], n)`` is the same key as
                ``from_bytes([[v.to_bytes(8, "little", signed=True) +
                bytes(n - 8)]], n)`` for ``n >= 8`` (later words zero). With
                ``n < 8`` a value must fit in ``n`` bytes, ``0 <= v <
                2**(8 * n)``, so no bit of it is lost.
            device: where the batch is built.

        Returns the batch, ``hashes`` int64 ``[total, ceil(hash_bytes / 8)]``.

        Raises TypeError (an item that is not an integer, bools included; a
        request that is not a sequence) or ValueError (a value outside int64 or
        not fitting ``hash_bytes``), naming the request and position.
        """
        if (
            type(requests) is list
            and type(hash_bytes) is int
            and hash_bytes == 8
            and type(device) is str
            and device == "cpu"
        ):
            if len(requests) != 1:
                # A batch of lists; None sends anything else on.
                batch = _lists_batch(cls, requests)
                if batch is not None:
                    return batch
            # A scheduler step of one list of Python ints, 8-byte keys on the
            # CPU: from _DECODE_MIN_ONE ints on, the msgpack decoder's
            # int_list (it refuses a bool, a float, a value past int64);
            # shorter, one type scan (bools refused by their type) and one
            # np.array call (numpy would truncate a float: the scan refuses
            # one); nothing else. Its offsets, host arrays and tensors are
            # made on first use (the numba backend reads one_values alone).
            # Anything else, or a value past int64, takes the general path
            # below, which takes or refuses it.
            elif type(flat := requests[0]) is list:
                words = int_list(flat) if len(flat) >= _DECODE_MIN_ONE else None
                if (
                    words is None
                    and len(flat) < _STRUCT_MIN
                    and _INTS.issuperset(map(type, flat))
                ):
                    try:
                        # 1-D: its [n, 1] view is made on first use
                        # (one_values hands the numba backend the values).
                        words = np.array(flat, _INT64)
                    except OverflowError:
                        pass
                if words is not None:
                    batch = object.__new__(cls)
                    d = batch.__dict__
                    d["hash_bytes"] = 8
                    d["one_values"] = words
                    return batch
        w = 1 if type(hash_bytes) is int and hash_bytes == 8 else num_words(hash_bytes)
        device = _device(device)
        if type(requests) is not list:
            requests = as_list(requests, "requests", "a sequence of sequences of ints")
        same = packed = None
        # issuperset builds no set: the common case tested first.
        if _LISTS.issuperset(map(type, requests)):
            # All lists of Python ints (0 and 1 included), C-level loops only.
            if requests:
                packed = int_lists(requests) or _list_batch(requests)
            if packed is None:
                lengths = list(map(len, requests))
                same = lengths, _ints_of_list(requests, requests, lengths, 0)
        elif type(requests[0]) is torch.Tensor and (packed := _tensor_batch(requests)):
            pass  # a router holding torch tensors of one integer dtype
        elif len(kinds := set(map(type, requests))) == 1 and kinds <= _ARRAY_KINDS:
            # All arrays of one kind (a router holding numpy hashes or
            # array('q')): one check of the dtypes and one concatenation
            # for the whole batch.
            (kind,) = kinds
            same = _ints_of_same(requests, kind)
        if packed is not None:
            offsets, host_lengths, values = packed
        else:
            # Anything else (mixed forms, tuples, a bad request) request by
            # request, naming the first bad one.
            lengths, values = same if same is not None else _ints_of_mixed(requests)
            offsets, host_lengths = _offsets(lengths)
        words = _int_words(values, hash_bytes, w, offsets)
        if device is not _CPU and device.type != "cpu":
            return cls.from_trusted(
                torch.from_numpy(words).to(device),
                torch.from_numpy(offsets).to(device),
                hash_bytes,
            )
        # The numba backend's host view from the arrays in hand (no torch
        # round trip). The public tensors are made on first access
        # (__getattr__): a step on the numba host path never pays the two
        # torch.from_numpy calls (~0.9 us). One __dict__ update costs a
        # fraction of frozen-dataclass setattrs.
        batch = object.__new__(cls)
        batch.__dict__.update(
            hash_bytes=hash_bytes,
            _lazy=(words, offsets),
            _host=(words, offsets[:-1], host_lengths),
        )
        return batch

    def __getattr__(self, name: str) -> Any:
        # Reached only when ``name`` is not set: the tensors of a CPU batch
        # from_ints built lazily, made once from the numpy arrays they share
        # memory with.
        if name in ("hashes", "offsets"):
            d = self.__dict__
            lazy = d.get("_lazy") or self._one_lazy()
            if lazy is not None:
                d["hashes"] = torch.from_numpy(lazy[0])
                d["offsets"] = torch.from_numpy(lazy[1])
                return d[name]
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
        )

    @classmethod
    def from_trusted(
        cls, hashes: torch.Tensor, offsets: torch.Tensor, hash_bytes: int
    ) -> HashBatch:
        """Build a batch with **no validation** (no host sync).

        For tensors another kvhit module has just produced under the
        invariants the constructor checks (``hashes`` int64 ``[total, W]``,
        ``offsets`` int64 ``[B + 1]`` CSR, both contiguous on one device, zero
        padding bits). Anything else gives wrong answers, not errors: use the
        constructor for outside input.
        """
        obj = object.__new__(cls)
        object.__setattr__(obj, "hashes", hashes)
        object.__setattr__(obj, "offsets", offsets)
        object.__setattr__(obj, "hash_bytes", hash_bytes)
        return obj

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A CPU batch as numpy arrays sharing its memory, built once per
        batch: ``(rows int64 [total, W], starts int64 [B], lengths int64
        [B])`` (``starts[i] = offsets[i]``, ``lengths[i] = offsets[i + 1] -
        offsets[i]``). What the numba backend reads; like :meth:`view`, it
        assumes the batch's tensors are not modified in place.

        Raises ValueError when the batch is not on the CPU.
        """
        host = self.__dict__.get("_host")
        if host is None:
            lazy = self._one_lazy()
            if lazy is not None:
                words, offsets = lazy
                host = (words, offsets[:1], offsets[1:])
                # Set once (a thread that built its own returns the same).
                return self.__dict__.setdefault("_host", host)
            if self.hashes.device.type != "cpu":
                raise ValueError(
                    f"host_arrays: the batch is on {self.hashes.device}, not the CPU"
                )
            # C-contiguous int64, whatever a trusted caller built the
            # tensors as: the numba backend's compiled entries read these
            # with no type test (a copy only for such a batch).
            on = np.ascontiguousarray(self.offsets.numpy(), dtype=_INT64)
            rows = np.ascontiguousarray(self.hashes.numpy(), dtype=_INT64)
            host = (rows, on[:-1], np.diff(on))
            object.__setattr__(self, "_host", host)
        return host

    def _one_lazy(self) -> tuple[np.ndarray, np.ndarray] | None:
        """A one-request batch of from_ints' short path: ``(words int64
        [n, 1], offsets int64 [2])``, made once (None for any other batch)."""
        d = self.__dict__
        if "one_values" not in d:
            return None
        lazy = d.get("_lazy")
        if lazy is None:
            offsets = np.array((0, d["one_values"].shape[0]), dtype=np.int64)
            lazy = d.setdefault("_lazy", (self.host_single(), offsets))
        return lazy

    def host_single(self) -> np.ndarray | None:
        """A one-request CPU batch's rows: int64 ``[n, W]``, sharing its
        memory (the request owns every row: ``offsets`` is ``[0, n]``); None
        for a batch of any other size. What the numba backend reads for a
        step of one request; like :meth:`host_arrays`, it assumes the
        batch's tensors are not modified in place. Raises ValueError when
        the batch is not on the CPU."""
        d = self.__dict__
        if "one_values" in d:
            # The rows alone, made once: no offsets array (cold 41 -> 19 us).
            rows = d.get("_rows")
            if rows is None:
                rows = d.setdefault("_rows", d["one_values"].reshape(-1, 1))
            return rows
        if len(self) != 1:
            return None
        return self.host_arrays()[0]

    def view(self, token_lens: torch.Tensor | None = None) -> RaggedView:
        """The batch as every backend reads it (see :class:`RaggedView`).

        Args:
            token_lens: None, or int64 ``[B]`` on the batch's device: the store
                worker's lookup length per request (restricts the keys that
                count as present to those the worker asks about).
        """
        o = self.offsets
        if o.device.type == "cpu":
            # Through numpy on the CPU: at a batch of one, a third of the time
            # of the torch ops (the numba backend's fixed cost per call).
            on = o.numpy()
            return RaggedView(
                rows=self.hashes,
                offsets=torch.from_numpy(on[:-1]),
                lengths=torch.from_numpy(on[1:] - on[:-1]),
                token_lens=token_lens,
            )
        return RaggedView(
            rows=self.hashes,
            offsets=o[:-1].contiguous(),
            lengths=(o[1:] - o[:-1]).contiguous(),
            token_lens=token_lens,
        )

    @property
    def W(self) -> int:
        """Number of int64 words per hash."""
        return self.hashes.shape[1]

    @property
    def device(self) -> torch.device:
        """Device holding ``hashes`` and ``offsets``."""
        h = self.__dict__.get("hashes")
        # Only a CPU batch's tensors are made lazily.
        return _CPU if h is None else h.device

    @property
    def lengths(self) -> torch.Tensor:
        """Number of hashes per request, int64 ``[B]`` on ``device``."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def total(self) -> int:
        """Total number of hashes over all requests."""
        return self.hashes.shape[0]

    def __len__(self) -> int:
        d = self.__dict__
        o = d.get("offsets")
        if o is None:
            if "one_values" in d:
                return 1
            return d["_lazy"][1].shape[0] - 1
        return o.shape[0] - 1

    def _request_index(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            raise TypeError(f"i (request index) must be an int, got {type(i).__name__}")
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"request index {i} out of range for batch of {n}")
        return int(i) % n

    def num_hashes(self, i: int) -> int:
        """Number of hashes of request ``i``."""
        i = self._request_index(i)
        return int(self.offsets[i + 1].item() - self.offsets[i].item())

    def request(self, i: int) -> torch.Tensor:
        """Hashes of request ``i``: int64 ``[num_hashes(i), W]`` (a view)."""
        i = self._request_index(i)
        lo, hi = int(self.offsets[i].item()), int(self.offsets[i + 1].item())
        return self.hashes[lo:hi]

    def to(self, device: torch.device | str) -> HashBatch:
        """The same batch on ``device`` (``self`` if already there)."""
        device = check_device(device)
        if device == self.device:
            return self
        return HashBatch.from_trusted(
            self.hashes.to(device), self.offsets.to(device), self.hash_bytes
        )

    def to_bytes(self) -> list[list[bytes]]:
        """Unpack back to ``list[list[bytes]]`` (exact inverse of from_bytes)."""
        flat = unpack_hashes(self.hashes, self.hash_bytes)
        offs = self.offsets.cpu().tolist()
        return [flat[offs[i] : offs[i + 1]] for i in range(len(self))]

    def __repr__(self) -> str:
        return (
            f"HashBatch(B={len(self)}, total={self.total}, "
            f"hash_bytes={self.hash_bytes}, device={self.device})"
        )
