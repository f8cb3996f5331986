"""The token-id scan of a vLLM KV-event payload, for ``bindings/kv_events``.

``kernels/event_scan_numba.py`` holds the scan (see its docstring); this
module reaches it for the bindings, importing numba on first use: the
coordinator never imports it at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["strip_token_ids", "warm_up"]

_strip: Callable[[Any], Any] | None = None


def _kernel() -> Callable[[Any], Any]:
    global _strip
    from kvhit.kernels.event_scan_numba import strip_token_ids as strip

    _strip = strip
    return strip


def strip_token_ids(payload: bytes | bytearray | memoryview) -> Any:
    """``payload`` (a msgpack ``KVEventBatch``) with every event's
    ``token_ids`` array of ints replaced by an empty one: a uint8 numpy
    array ``[m]`` msgspec decodes as bytes; None when there is none or the
    scan did not follow the payload to its end (then decode ``payload``
    itself). See ``kernels/event_scan_numba.strip_token_ids``."""
    return (_strip or _kernel())(payload)


def warm_up() -> None:
    """Import and load (or compile) the scan now, once per process."""
    from kvhit.kernels.event_scan_numba import warm_up as warm

    warm()
    _kernel()
