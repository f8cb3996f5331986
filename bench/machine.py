"""What the memory system gives a benchmark while it runs: dependent-load latency.

On the shared 2-core VM kvhit is measured on, the same lookup kernel answered
the same 1024 long-hit requests in 1.3-1.6 ms on 2026-12-01 and in
5-10.2 ms on 2026-12-02, while the Python reference loop went from ~0.53 s
to 1.1-1.8 s: the last-level cache (32 MB) and the memory are shared with other
tenants, and a kernel whose table and hash rows are tens of MB runs at the
speed of the cache it is left. Every ``kvhit bench`` run records this figure
at its start and end, so that a ratio comes with the state it was taken in.

:func:`dependent_load_ns` chases pointers through a random cycle of 64-byte
lines (each load's address is the previous load's value, so no two overlap):
one full cycle to warm up, then the timed loads, over buffers of a few
sizes. A buffer the caches hold costs tens of nanoseconds a load (1 MB:
20-50 ns here); one they do not, a trip to memory (64 MB: 200-250 ns here).
When 8 MB, a quarter of the L3, costs nearly what 64 MB does, other tenants
hold the L3 (2026-12-02: 177-187 ns against 207-219 ns). The chase is
compiled by numba (imported lazily); without numba there is no figure.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from kvhit.kernels.checks import check_size

__all__ = ["DEFAULT_SIZES_MB", "dependent_load_ns", "describe", "memory_state", "ring"]

#: Buffer sizes (MiB) the chase walks: in L2, a quarter of the L3, past it.
DEFAULT_SIZES_MB: tuple[int, ...] = (1, 8, 64)

_LINE_WORDS = 8  # int64 words per 64-byte line
_chase = None


def _chase_py(nxt, start, steps):
    p = start
    for _ in range(steps):
        p = nxt[p]
    return p


def _chase_fn():
    # Compiled on first use (cached beside this file), so that importing the
    # bench needs no numba.
    global _chase
    if _chase is None:
        import numba

        from kvhit.kernels.numba_cache import lock_cache_saves

        lock_cache_saves()
        _chase = numba.njit(cache=True, nogil=True)(_chase_py)
    return _chase


def dependent_load_ns(
    sizes_mb: Sequence[int] = DEFAULT_SIZES_MB, steps: int = 100_000, seed: int = 0
) -> dict[int, float] | None:
    """Nanoseconds per dependent load over a buffer of each size in
    ``sizes_mb`` (MiB, each an int >= 1), ``steps`` loads each (an int >= 1)
    after one warm-up walk of the whole buffer; ``None`` when numba is not
    importable. TypeError or ValueError naming the argument otherwise.

    Takes one load latency for each of the buffers' lines and ``steps`` more
    per buffer, plus their set-up (~0.4 s at the defaults with a busy L3);
    allocates the largest buffer (64 MiB at the defaults) for the duration
    of its own chase only."""
    steps = check_size("steps", steps)
    sizes = tuple(check_size("sizes_mb", s) for s in sizes_mb)
    if not sizes:
        raise ValueError("sizes_mb must name at least one size (MiB), got none")
    try:
        chase = _chase_fn()
    except ImportError:
        return None
    rng = np.random.default_rng(seed)
    out: dict[int, float] = {}
    for mb in sizes:
        lines = (mb << 20) // (_LINE_WORDS * 8)
        buf, start = ring(lines, rng)
        # One whole cycle first (back at ``start``), so that the timed loads
        # find the buffer wherever the caches keep it; timing right after a
        # warm-up of ``steps`` loads would walk those same lines again, and
        # every buffer would look ``steps`` lines big.
        start = chase(buf, start, lines)
        t0 = time.perf_counter()
        chase(buf, start, steps)
        out[mb] = (time.perf_counter() - t0) / steps * 1e9
    return out


def ring(lines: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """One cycle through ``lines`` 64-byte lines in random order: an int64
    buffer of ``lines * 8`` words whose word 0 of each line holds the index of
    the next line's word 0, and the index to start from."""
    order = rng.permutation(lines) * _LINE_WORDS
    buf = np.zeros(lines * _LINE_WORDS, dtype=np.int64)
    buf[order] = np.roll(order, -1)
    return buf, int(order[0])


def describe(ns: Mapping[int, float] | None) -> str:
    """``ns`` (from :func:`dependent_load_ns`) as one line, e.g. ``"1 MB 31 ns,
    8 MB 182 ns, 64 MB 207 ns"``; ``"n/a (no numba)"`` for ``None``."""
    if ns is None:
        return "n/a (no numba)"
    return ", ".join(f"{mb} MB {v:.0f} ns" for mb, v in ns.items())


def memory_state() -> str:
    """:func:`describe` of :func:`dependent_load_ns` at the defaults, for a
    benchmark's header: a side figure, so a chase that cannot run (numba
    failing to compile, memory refused) gives ``"n/a (<why>)"`` instead of
    ending the benchmark."""
    try:
        return describe(dependent_load_ns())
    except Exception as exc:  # noqa: BLE001 - any failure only loses the figure
        return f"n/a ({type(exc).__name__}: {exc})"
