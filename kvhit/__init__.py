"""kvhit: batched external KV-cache hit lookup for LLM serving schedulers.

The public names are re-exported lazily so that ``import kvhit`` stays cheap
and never imports triton (only the kernels module does, on first use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "FullAttention": "kvhit.coordinator.specs",
    "SlidingWindow": "kvhit.coordinator.specs",
    "Mamba": "kvhit.coordinator.specs",
    "ChunkedLocal": "kvhit.coordinator.specs",
    "Group": "kvhit.coordinator.specs",
    "CacheLayout": "kvhit.coordinator.specs",
    "SpecGroup": "kvhit.coordinator.specs",
    "ReferenceCoordinator": "kvhit.coordinator.reference",
    "HashBatch": "kvhit.coordinator.packing",
    "KeyIndex": "kvhit.coordinator.key_index",
    "LookupEngine": "kvhit.coordinator.engine",
    "LookupResult": "kvhit.coordinator.engine",
    "FleetIndex": "kvhit.coordinator.fleet_index",
    "route": "kvhit.coordinator.routing",
}

__all__ = [
    "CacheLayout",
    "ChunkedLocal",
    "FleetIndex",
    "FullAttention",
    "Group",
    "HashBatch",
    "KeyIndex",
    "LookupEngine",
    "LookupResult",
    "Mamba",
    "ReferenceCoordinator",
    "SlidingWindow",
    "SpecGroup",
    "route",
]

if TYPE_CHECKING:  # pragma: no cover
    from kvhit.coordinator.engine import LookupEngine, LookupResult
    from kvhit.coordinator.fleet_index import FleetIndex
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch
    from kvhit.coordinator.reference import ReferenceCoordinator
    from kvhit.coordinator.routing import route
    from kvhit.coordinator.specs import (
        CacheLayout,
        ChunkedLocal,
        FullAttention,
        Group,
        Mamba,
        SlidingWindow,
        SpecGroup,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvhit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
