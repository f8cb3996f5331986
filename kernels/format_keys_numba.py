"""Store key strings, formatted in numba: ``prefix + hash.hex()``.

A generic kernel for a store binding that names keys by a per-group prefix
and the block hash in hex (the Mooncake binding, ``bindings/store_sync.py``,
builds vLLM's ``MooncakeStoreWorker`` key strings with it). Compiled because
a scheduler step of a thousand long prompts formats hundreds of thousands of
keys: one pass writes them all as one ``\\n``-separated byte string, and one
``decode`` + ``split`` gives the strings (one object per key).

Importing this module imports numba (its callers import it lazily).
"""

from __future__ import annotations

import numba
import numpy as np

from kvhit.kernels.numba_cache import lock_cache_saves

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = ["format_keys_nb"]

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@numba.njit(cache=True, nogil=True)
def format_keys_nb(words, gids, hash_bytes, pref_blob, pref_offs, group_pref):
    """The key strings' bytes: for each pair ``i`` (``words`` int64 ``[N, W]``
    little-endian hash words, ``gids`` int64 ``[N]``) and each prefix ``p`` of
    its group (``pref_blob[pref_offs[p]:pref_offs[p + 1]]``, ``p`` in
    ``group_pref[g]:group_pref[g + 1]``), ``prefix + hex(hash bytes)``, keys
    separated by ``\n`` (none after the last): uint8 ``[L]``."""
    N = words.shape[0]
    size = 0
    for i in range(N):
        g = gids[i]
        for p in range(group_pref[g], group_pref[g + 1]):
            size += pref_offs[p + 1] - pref_offs[p] + 2 * hash_bytes + 1
    out = np.empty(max(size - 1, 0), dtype=np.uint8)
    hexd = _HEX
    # Each hash's hex once, copied under each of its group's prefixes.
    hx = np.empty(2 * hash_bytes, dtype=np.uint8)
    k = 0
    for i in range(N):
        g = gids[i]
        for byte in range(hash_bytes):
            v = (words[i, byte >> 3] >> ((byte & 7) * 8)) & 0xFF
            hx[2 * byte] = hexd[v >> 4]
            hx[2 * byte + 1] = hexd[v & 15]
        for p in range(group_pref[g], group_pref[g + 1]):
            if k:
                out[k] = 10
                k += 1
            a, b = pref_offs[p], pref_offs[p + 1]
            out[k : k + b - a] = pref_blob[a:b]
            k += b - a
            out[k : k + 2 * hash_bytes] = hx
            k += 2 * hash_bytes
    return out
