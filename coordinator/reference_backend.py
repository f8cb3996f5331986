"""The reference backend of the LookupEngine: the scalar oracle, per request.

Loops :class:`ReferenceCoordinator` over the requests with the index's keys as
a Python set, and answers in the ``Backend`` protocol's terms (load masks as
``(length, lo, hi)`` mask spans), so the engine treats it like any other backend.
It is the baseline the others are measured against, not a fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvhit.coordinator.backend import FindQuery, ViewBackend
from kvhit.coordinator.packing import unpack_hashes
from kvhit.coordinator.plan import ScanPlan
from kvhit.coordinator.reference import ReferenceCoordinator

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import RaggedView

__all__ = ["ReferenceBackend", "index_keys", "mask_span"]


def mask_span(mask: Sequence[bool]) -> tuple[int, int, int]:
    """A load mask as ``(length, lo, hi)``: ``length`` entries, True exactly on
    ``[lo, hi)``; ``(length, 0, 0)`` when none is True.

    Raises:
        ValueError: the True entries are not one contiguous run (no backend
            could describe such a mask; the reference never returns one).
    """
    length = len(mask)
    lo = -1
    hi = 0
    for i, m in enumerate(mask):
        if m:
            if lo < 0:
                lo = i
            elif hi != i:
                raise ValueError(
                    f"mask {list(mask)} is not one contiguous run of True entries"
                )
            hi = i + 1
    if lo < 0:
        return length, 0, 0
    return length, lo, hi


def index_keys(index: KeyIndex) -> set[tuple[int, bytes]]:
    """The index's keys as a set of ``(group_id, hash bytes)``, each hash as
    its ``8 * W`` packed bytes (the zero padding included)."""
    gids, hashes = index.keys()
    return set(
        zip(
            gids.cpu().tolist(),
            unpack_hashes(hashes.cpu(), 8 * index.W),
            strict=True,
        )
    )


class ReferenceBackend(ViewBackend):
    """:class:`ReferenceCoordinator` per request (the ``Backend`` protocol of
    ``coordinator/backend.py``), on any device that holds data (answers are
    made on the CPU and moved to ``device``)."""

    name = "reference"

    def __init__(self, plan: ScanPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.reference = ReferenceCoordinator(plan.layout)

    def warm_up(self) -> None:
        """Nothing to load ahead: plain Python (``BatchBackend.warm_up``)."""

    def _requests(self, view: RaggedView) -> list[list[bytes]]:
        # Whole words: the index's keys are unpacked the same way, and the
        # zero padding keeps equal hashes equal.
        hash_bytes = view.rows.shape[1] * 8
        flat = unpack_hashes(view.rows.cpu(), hash_bytes)
        offs = view.offsets.cpu().tolist()
        lengths = view.lengths.cpu().tolist()
        return [flat[o : o + n] for o, n in zip(offs, lengths, strict=True)]

    def find_view(self, query: FindQuery) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``ViewBackend.find_view``: ``ReferenceCoordinator.
        find_longest_cache_hit`` per request.

        Raises:
            ValueError: where the reference raises (a scan past the hashes).
        """
        view, max_lengths, index, apply_eagle = query
        ref = self.reference
        exists = None if index is None else index_keys(index)
        requests = self._requests(view)
        token_lens = None if view.token_lens is None else view.token_lens.tolist()
        n_groups = self.plan.num_groups
        hits: list[int] = []
        mask_spans: list[list[tuple[int, int, int]]] = []
        for r, (hl, m) in enumerate(zip(requests, max_lengths.tolist(), strict=True)):
            present = exists
            if token_lens is not None:
                # Only the keys the store worker asks about count (its present
                # set holds values: ReferenceCoordinator.lookup).
                asked = set(ref.lookup_candidates(token_lens[r], hl))
                present = asked if exists is None else asked & exists
            masks, hit = ref.find_longest_cache_hit(hl, m, present, apply_eagle)
            hits.append(hit)
            mask_spans.append([mask_span(masks[g]) for g in range(n_groups)])
        hit_t = torch.tensor(hits, dtype=torch.int64)
        spans_t = torch.tensor(mask_spans, dtype=torch.int64).reshape(
            len(hits), n_groups, 3
        )
        return hit_t.to(self.device), spans_t.to(self.device)

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """See ``Backend.lookup``: ``ReferenceCoordinator.lookup`` per request.

        Raises:
            ValueError: where the reference raises (vLLM's worker would fail).
        """
        exists = index_keys(index)
        hits = [
            self.reference.lookup(n, hl, exists)
            for hl, n in zip(self._requests(view), num_tokens.tolist(), strict=True)
        ]
        return torch.tensor(hits, dtype=torch.int64).to(self.device)
