"""The KV-cache spec classes kvhit models (vLLM's ``kv_cache_interface``).

One class per KV-cache manager kind. A class's ``kind`` is its name in the
spec-kind registry (:mod:`kvhit.coordinator.kinds`, which checks that the two
agree); the registry, the layout (:mod:`kvhit.coordinator.specs`) and the
reference import the classes from here, so this module imports nothing of
kvhit's.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "SPEC_TYPES",
    "ChunkedLocal",
    "FullAttention",
    "Mamba",
    "SlidingWindow",
    "Spec",
]


@dataclass(frozen=True)
class FullAttention:
    """Full attention (MHA, MLA, ...): a hit is a contiguous run from token 0.

    ``tag`` keeps otherwise equal specs apart (vLLM does not merge e.g. an MLA
    group with an MHA group of the same block size).
    """

    kind: ClassVar[str] = "full"
    block_size: int
    tag: Hashable = None


@dataclass(frozen=True)
class SlidingWindow:
    """Sliding-window attention over the last ``sliding_window`` tokens.

    ``extra_retained_tokens`` widens the window that an external hit must
    restore (the multi-module MTP re-prefill tail below the window).
    """

    kind: ClassVar[str] = "sliding_window"
    block_size: int
    sliding_window: int
    extra_retained_tokens: int = 0
    tag: Hashable = None


@dataclass(frozen=True)
class Mamba:
    """A recurrent (Mamba/linear-attention) state: block ``p`` is the state
    after ``(p + 1) * block_size`` tokens."""

    kind: ClassVar[str] = "mamba"
    block_size: int
    tag: Hashable = None


@dataclass(frozen=True)
class ChunkedLocal:
    """Chunked local attention over ``attention_chunk_size``-token chunks."""

    kind: ClassVar[str] = "chunked_local"
    block_size: int
    attention_chunk_size: int
    tag: Hashable = None


Spec = FullAttention | SlidingWindow | Mamba | ChunkedLocal
SPEC_TYPES = (FullAttention, SlidingWindow, Mamba, ChunkedLocal)
