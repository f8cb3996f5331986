"""Public request traces in the Mooncake FAST'25 format, and their hashes.

A trace is JSON Lines (plain or gzipped), one request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, ...]}

``hash_ids`` holds one id per ``trace_block_size``-token block of the prompt
(512 in the Mooncake traces; the last block may be partial); equal ids at
equal positions mean the same prefix up to and including that block. The
conversation trace of the Mooncake project ships in ``bench/data/`` with its
attribution (``bench/data/README.md``).

A kvhit layout hashes prompts in blocks of ``hash_block_size`` tokens, which
is not the trace's block size, so each trace block is expanded into hash
blocks deterministically: hash block ``k`` (tokens ``[k*h, (k+1)*h)``) gets a
hash mixed from the id of the trace block holding its last token and from
``k``. Two prompts whose trace ids agree up to that block therefore agree on
every hash block up to it (prefix-consistent, as vLLM's chained hashes are),
and only whole hash blocks of ``input_length`` get a hash, as vLLM hashes
only full blocks.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "SHIPPED_TRACE",
    "TRACE_BLOCK_SIZE",
    "TraceRequest",
    "hash_block_ids",
    "hash_words",
    "load_trace",
]

#: The Mooncake FAST'25 conversation trace shipped with kvhit.
SHIPPED_TRACE = (
    Path(__file__).resolve().parent / "data" / ("mooncake_conversation_trace.jsonl.gz")
)
#: Tokens per ``hash_ids`` entry in the Mooncake traces.
TRACE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceRequest:
    """One trace line. ``hash_ids``: int64 ``[ceil(input_length / trace block)]``."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: np.ndarray


def _lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        yield from f


def _int_field(obj: dict, key: str, where: str, minimum: int) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {key!r} must be an int, got {v!r}")
    if v < minimum:
        raise ValueError(f"{where}: {key!r} must be >= {minimum}, got {v}")
    return v


def load_trace(
    path: str | Path = SHIPPED_TRACE,
    limit: int | None = None,
    trace_block_size: int = TRACE_BLOCK_SIZE,
) -> list[TraceRequest]:
    """Read a Mooncake-format trace (``.jsonl`` or ``.jsonl.gz``).

    Args:
        path: the trace file; the shipped conversation trace by default.
        limit: read at most this many requests (None: all).
        trace_block_size: tokens per ``hash_ids`` entry; each line must carry
            ``ceil(input_length / trace_block_size)`` ids or more.

    Returns the requests in file order. Raises ``ValueError`` naming the file
    and line of the first malformed request, ``FileNotFoundError`` when
    ``path`` does not exist.
    """
    if isinstance(trace_block_size, bool) or not isinstance(trace_block_size, int):
        raise TypeError("trace_block_size must be an int")
    if trace_block_size <= 0:
        raise ValueError(f"trace_block_size must be positive, got {trace_block_size}")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
    ):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    out: list[TraceRequest] = []
    for lineno, line in enumerate(_lines(path), 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: a request must be a JSON object")
        ts = _int_field(obj, "timestamp", where, 0)
        n_in = _int_field(obj, "input_length", where, 0)
        n_out = (
            _int_field(obj, "output_length", where, 0) if "output_length" in obj else 0
        )
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise ValueError(f"{where}: 'hash_ids' must be a list of ints")
        need = -(-n_in // trace_block_size)
        if len(ids) < need:
            raise ValueError(
                f"{where}: {len(ids)} hash_ids for input_length {n_in} "
                f"(needs {need} at trace_block_size {trace_block_size})"
            )
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{where}: a hash_id does not fit in int64") from None
        out.append(TraceRequest(ts, n_in, n_out, arr))
    return out


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def hash_block_ids(
    request: TraceRequest,
    hash_block_size: int,
    trace_block_size: int = TRACE_BLOCK_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """The trace id and position behind each whole hash block of ``request``.

    Returns ``(ids, positions)``, both int64 ``[input_length // hash_block_size]``:
    hash block ``k`` ends in trace block ``((k + 1) * hash_block_size - 1) //
    trace_block_size``, whose id is ``ids[k]``; ``positions[k] == k``.
    """
    n = request.input_length // hash_block_size
    positions = np.arange(n, dtype=np.int64)
    last_token = (positions + 1) * hash_block_size - 1
    return request.hash_ids[last_token // trace_block_size], positions


def hash_words(ids: np.ndarray, positions: np.ndarray, num_words: int) -> np.ndarray:
    """Deterministic block hashes from ``(trace id, position)`` pairs.

    Args:
        ids, positions: int64 ``[n]`` (``hash_block_ids``' output).
        num_words: int64 words per hash (1 for 8-byte keys, 4 for 32-byte).

    Returns int64 ``[n, num_words]``: word ``w`` is splitmix64 of the pair's
    mix and ``w``, so equal pairs give equal keys and distinct pairs collide
    with probability ~2^-64 per word.
    """
    base = _splitmix64(_splitmix64(ids.astype(np.uint64)) ^ positions.astype(np.uint64))
    words = np.empty((len(ids), num_words), dtype=np.uint64)
    for w in range(num_words):
        words[:, w] = _splitmix64(base + np.uint64((w * int(_M1)) % (1 << 64)))
    return words.view(np.int64)
