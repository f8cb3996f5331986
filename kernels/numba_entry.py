"""numba's compiled wrapper of one signature, for callers that skip the
dispatcher.

A call through a numba dispatcher types every argument first, to pick the
compiled overload. Where a caller hands a kernel only arrays kvhit built, of
one signature it knows, the overload's ``entry_point`` (the compiled
wrapper that unboxes the arguments and runs the machine code) does the same
work without that typing. On a router's step, with caches cold, the typing
is several microseconds of a call: the fleet's router kernel 89 -> 76 us,
the list decoder 34 -> 26, a ``KeyIndex.add`` of 25 keys 40 -> 35
(``bench/RESULTS.md``, "eighth pass").

The wrapper trusts its arguments: one of another type, layout or alignment
is read as if it were of the signature's, not refused. Only callers whose
arguments cannot be anything else use it (each says why at its call).
Importing this module imports numba.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba

from kvhit.kernels.numba_cache import lock_cache_saves

# As every module that imports numba (it compiles nothing itself).
lock_cache_saves()

__all__ = ["compiled_entry"]


def compiled_entry(dispatcher: Any, *like: Any) -> Callable[..., Any]:
    """``dispatcher``'s compiled wrapper for the signature of the example
    arguments ``like`` (values of exactly the types the caller will pass),
    or ``dispatcher`` itself while that signature is neither compiled nor
    loaded, or where ``dispatcher`` is not a numba dispatcher (a test's
    stand-in)."""
    overloads = getattr(dispatcher, "overloads", None)
    if not overloads:
        return dispatcher
    got = overloads.get(tuple(numba.typeof(a) for a in like))
    return getattr(got, "entry_point", None) or dispatcher
