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
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from kvhit.bench.names import SHIPPED_TRACE, TRACE_BLOCK_SIZE

__all__ = [
    "SHIPPED_TRACE",
    "TRACE_BLOCK_SIZE",
    "TraceLine",
    "TraceRequest",
    "hash_block_ids",
    "hash_words",
    "load_trace",
]


@dataclass(frozen=True)
class TraceRequest:
    """One trace line. ``hash_ids``: int64 ``[ceil(input_length / trace block)]``."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: np.ndarray


_Count = Annotated[int, msgspec.Meta(ge=0)]
_Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class TraceLine(msgspec.Struct):
    """The schema of one trace line (JSON object; other keys are ignored).

    ``timestamp`` (ms) and ``input_length`` are required non-negative ints,
    ``output_length`` an optional one (0), ``hash_ids`` a list of int64 ids.
    A line that breaks it is reported with the field msgspec names.
    """

    timestamp: _Count
    input_length: _Count
    hash_ids: list[_Int64]
    output_length: _Count = 0


_DECODER = msgspec.json.Decoder(TraceLine)
# msgspec says where a value broke the schema as "... - at `$.field[i]`".
_AT = re.compile(r"^(?P<what>.*) - at `\$\.(?P<field>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _schema_error(where: str, exc: msgspec.ValidationError) -> ValueError:
    """``exc`` as a ValueError naming the file, the line and the field."""
    text = str(exc)
    at = _AT.match(text)
    if at:
        return ValueError(f"{where}: {at['field']!r}: {at['what']}")
    missing = _MISSING.search(text)
    if missing:
        return ValueError(f"{where}: {missing['field']!r} is missing")
    return ValueError(f"{where}: a request must be a JSON object ({text})")


def _lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        yield from f


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
    and line (and the field, from :class:`TraceLine`) of the first malformed
    request, or naming the file when it is a corrupt or truncated gzip file or
    holds no request (with ``limit`` not 0); ``FileNotFoundError`` when
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
    try:
        _read(path, limit, trace_block_size, out)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        # A gzip stream cut short (EOFError) or damaged (zlib.error, a bad
        # header): the file is the problem, not a line of it.
        raise ValueError(f"{path}: a corrupt or truncated gzip file ({exc})") from None
    if not out and limit != 0:
        raise ValueError(f"{path}: the trace holds no request")
    return out


def _read(
    path: Path, limit: int | None, trace_block_size: int, out: list[TraceRequest]
) -> None:
    for lineno, line in enumerate(_lines(path), 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            req = _DECODER.decode(line)
        except msgspec.ValidationError as exc:
            raise _schema_error(where, exc) from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        need = -(-req.input_length // trace_block_size)
        if len(req.hash_ids) < need:
            raise ValueError(
                f"{where}: 'hash_ids': {len(req.hash_ids)} ids for input_length "
                f"{req.input_length} (needs {need} at trace_block_size "
                f"{trace_block_size})"
            )
        ids = np.asarray(req.hash_ids, dtype=np.int64)
        out.append(
            TraceRequest(req.timestamp, req.input_length, req.output_length, ids)
        )


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
