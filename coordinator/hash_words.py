"""Block hashes as int64 words: the packing of ``bytes`` hashes.

A block hash of ``hash_bytes`` bytes is ``W = ceil(hash_bytes / 8)``
little-endian int64 words, the bytes past the hash in the last word zero
(:func:`padding_mask`), so two packings of the same bytes are bit-identical.
:func:`pack_hashes` and :func:`unpack_hashes` convert a flat list;
``coordinator/packing.py``'s ``HashBatch.from_bytes`` packs a batch with
:func:`join_hashes` and :func:`pack_joined`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set, Sized
from typing import Any

import numpy as np
import torch

from kvhit.kernels.checks import check_hash_widths, check_tensor, why_not_bytes

__all__ = [
    "BytesLike",
    "MAX_HASH_BYTES",
    "as_list",
    "join_hashes",
    "num_words",
    "pack_hashes",
    "pack_joined",
    "padding_mask",
    "unpack_hashes",
]

#: The widest hash kvhit packs (vLLM's are 8 or 32 bytes; sha512's 64): a
#: width past it is refused by name before any array of it is sized.
MAX_HASH_BYTES = 4096
#: What one hash may be given as.
BytesLike = bytes | bytearray | memoryview


def num_words(hash_bytes: int) -> int:
    """Number of int64 words ``W = ceil(hash_bytes / 8)`` holding one hash."""
    if isinstance(hash_bytes, bool) or not isinstance(hash_bytes, int):
        raise TypeError(f"hash_bytes must be an int, got {type(hash_bytes).__name__}")
    if not 0 < hash_bytes <= MAX_HASH_BYTES:
        raise ValueError(
            f"hash_bytes must be in [1, {MAX_HASH_BYTES}], got {hash_bytes}"
        )
    return (hash_bytes + 7) // 8


def padding_mask(hash_bytes: int) -> int:
    """Bits of the last word that must be zero, as a signed int64 (0 if none).

    The last word holds ``hash_bytes % 8`` bytes in its low bits (little
    endian); the rest is padding.
    """
    rem = hash_bytes % 8
    if rem == 0:
        return 0
    mask = ((1 << 64) - 1) ^ ((1 << (8 * rem)) - 1)
    return mask - (1 << 64)  # as a signed int64


def as_list(items: Any, name: str, what: str) -> list[Any]:
    """``items`` as a list, or TypeError naming ``name`` when it is not a
    sequence (None, a single bytes object, a str, an int, ...) or has no
    order (a set, a dict: a request's hashes are a chain, in order)."""
    if isinstance(items, Set | Mapping):
        raise TypeError(
            f"{name} must be {what}, got {type(items).__name__} (which has no "
            "order: a request's hashes are a chain)"
        )
    if isinstance(items, bytes | bytearray | memoryview | str) or not (
        isinstance(items, Iterable) and isinstance(items, Sized)
    ):
        raise TypeError(f"{name} must be {what}, got {type(items).__name__}")
    return list(items)


def join_hashes(items: Sequence[BytesLike], where: Any, hash_bytes: int) -> bytearray:
    """Concatenate ``items`` (each already ``len() == hash_bytes``); on an
    item that is not a 1-D byte buffer, raise TypeError naming it (``where(k)``
    describes flat item ``k``). The scan only runs on error."""
    try:
        joined = bytearray().join(items)
    except TypeError:
        joined = None
    if joined is None or len(joined) != len(items) * hash_bytes:
        strided = False
        for k, h in enumerate(items):
            why = why_not_bytes(h)
            if why is not None:
                raise TypeError(f"{where(k)}: expected bytes, got {why}") from None
            view = memoryview(h)
            if view.nbytes != hash_bytes:
                raise TypeError(
                    f"{where(k)}: len() says {len(h)} bytes but it holds {view.nbytes}"
                )
            strided = strided or not view.c_contiguous
        if not strided:
            raise AssertionError("unreachable: every item holds hash_bytes bytes")
        # A 1-D byte buffer whose bytes are not adjacent (a strided
        # memoryview, a row of a column-major array), which join refuses:
        # its bytes in order.
        joined = bytearray().join(memoryview(h).tobytes() for h in items)
    return joined


def pack_joined(joined: bytearray, n: int, hash_bytes: int) -> np.ndarray:
    """Pack ``n`` concatenated hashes into a native int64 array ``[n, W]``.

    ``joined`` is a bytearray so that the common case (``hash_bytes % 8 == 0``
    on a little-endian host) is a zero-copy, writable view.
    """
    w = num_words(hash_bytes)
    raw = np.frombuffer(joined, dtype=np.uint8)
    if hash_bytes % 8 == 0:
        words = raw.view("<i8").reshape(n, w)
    else:
        padded = np.zeros((n, w * 8), dtype=np.uint8)
        padded[:, :hash_bytes] = raw.reshape(n, hash_bytes)
        words = padded.view("<i8").reshape(n, w)
    # A no-op on little-endian hosts, the byte swap on big-endian ones.
    return words.astype(np.int64, copy=False)


def pack_hashes(hashes: Sequence[BytesLike], hash_bytes: int) -> torch.Tensor:
    """Pack hashes of exactly ``hash_bytes`` bytes each.

    Returns int64 ``[N, W]`` on the CPU, ``W = ceil(hash_bytes / 8)``,
    little-endian words, last word zero-padded.
    """
    w = num_words(hash_bytes)
    hashes = as_list(hashes, "hashes", "a sequence of bytes objects")
    check_hash_widths(hashes, hash_bytes, "hashes")
    if not hashes:
        return torch.empty((0, w), dtype=torch.int64)
    joined = join_hashes(hashes, lambda k: f"hashes, position {k}", hash_bytes)
    arr = pack_joined(joined, len(hashes), hash_bytes)
    return torch.from_numpy(arr)


def unpack_hashes(hashes: torch.Tensor, hash_bytes: int) -> list[bytes]:
    """Inverse of :func:`pack_hashes`: int64 ``[N, W]`` -> ``N`` bytes objects."""
    w = num_words(hash_bytes)
    check_tensor(hashes, "hashes", holds_data=False)
    if hashes.dim() != 2 or hashes.shape[1] != w:
        raise ValueError(
            f"hashes must have shape [N, {w}] for hash_bytes={hash_bytes}, "
            f"got {list(hashes.shape)}"
        )
    n = hashes.shape[0]
    arr = hashes.detach().cpu().contiguous().numpy().astype("<i8", copy=False)
    raw = np.ascontiguousarray(arr.view(np.uint8).reshape(n, w * 8)[:, :hash_bytes])
    blob = raw.tobytes()
    return [blob[i : i + hash_bytes] for i in range(0, n * hash_bytes, hash_bytes)]
