"""The Triton backend of the LookupEngine: glue between a ScanPlan and the kernel.

:func:`find_hits` answers exactly what
``TorchScanner(plan, prober).find(batch, max_lengths, apply_eagle)`` answers,
in one launch of :func:`kvhit.kernels.scan.scan_hits` (one program per
request; the whole convergence loop runs inside the kernel).

Importing this module does not import triton (coordinator/ never does at
import time); the kernel module is imported on the first call.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from kvhit.coordinator.plan import ScanPlan

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import RaggedView
    from kvhit.coordinator.torch_backend import _Batch

__all__ = ["TritonBackend", "find_hits", "plan_tensors"]


@lru_cache(maxsize=64)
def _plan_tensors_cached(
    plan: ScanPlan, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    sg_rows = torch.tensor(plan.as_rows(), dtype=torch.int64, device=device)
    cand_rows = torch.tensor(
        [
            [
                int(cp.cacheable),
                cp.block_size,
                cp.scale,
                int(cp.sparse),
                cp.per_segment,
                cp.need,
                cp.shift,
                cp.group_id,
            ]
            for cp in plan.candidates
        ],
        dtype=torch.int64,
        device=device,
    )
    return sg_rows, cand_rows


def plan_tensors(
    plan: ScanPlan, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan as the kernel reads it: ``sg_rows`` int64 ``[S, 10 + M]``
    (``plan.as_rows()``) and ``cand_rows`` int64 ``[G, 8]`` (one row per group:
    cacheable, block_size, scale, sparse, per_segment, need, shift, group_id).
    Cached per (plan, device), so a steady stream of batches copies nothing to
    the device but the batch itself."""
    return _plan_tensors_cached(plan, torch.device(device))


def _i64(t: torch.Tensor) -> torch.Tensor:
    # Batch fields are often views (offsets[:-1], fancy-indexed lengths); the
    # kernel wants dense int64.
    return t.contiguous()


def find_hits(
    plan: ScanPlan,
    batch: _Batch,
    max_lengths: torch.Tensor,
    index: KeyIndex | None,
    apply_eagle: bool,
    *,
    block: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hits and load-mask triples of every request, on the batch's device.

    Args:
        plan: the layout's :class:`ScanPlan`.
        batch: ``hashes`` int64 ``[T, W]``, ``offsets`` / ``lens`` int64
            ``[R]``, ``token_len`` None or int64 ``[R]`` (the store worker's
            candidate restriction).
        max_lengths: int64 ``[R]``.
        index: the store's keys, or None (every key present).
        apply_eagle: apply the EAGLE last-block drop.
        block: positions the kernel probes per step (a power of two; results
            do not depend on it).

    Returns:
        ``(hit int64 [R], tri int64 [R, G, 3])`` as ``TorchScanner.find``.
    """
    from kvhit.kernels.scan import scan_hits

    hashes = _i64(batch.hashes)
    table = None
    if index is not None:
        table = index.table
        if index.W != hashes.shape[1]:
            raise ValueError(
                f"index has {index.W} words per hash, the batch {hashes.shape[1]}"
            )
    sg_rows, cand_rows = plan_tensors(plan, hashes.device)
    return scan_hits(
        hashes,
        _i64(batch.offsets),
        _i64(batch.lens),
        _i64(max_lengths),
        sg_rows,
        cand_rows,
        table=table,
        token_len=None if batch.token_len is None else _i64(batch.token_len),
        hash_block_size=plan.hash_block_size,
        alignment=plan.alignment,
        partial=plan.partial,
        simple_hybrid=plan.simple_hybrid,
        num_groups=plan.num_groups,
        apply_eagle=apply_eagle,
        block=block,
    )


class TritonBackend:
    """The Triton backend (the ``Backend`` protocol of ``coordinator/backend.py``):
    :func:`find_hits` over a RaggedView, and the store worker's two searches
    over the whole batch with no host sync (so a CUDA graph can capture them).
    CUDA, or the CPU under ``TRITON_INTERPRET=1``."""

    name = "triton"

    def __init__(self, plan: ScanPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = torch.device(device)

    @staticmethod
    def _batch(view: RaggedView) -> SimpleNamespace:
        return SimpleNamespace(
            hashes=view.rows,
            offsets=view.offsets,
            lens=view.lengths,
            token_len=view.token_lens,
        )

    def find(
        self,
        view: RaggedView,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``Backend.find``."""
        return find_hits(self.plan, self._batch(view), max_lengths, index, apply_eagle)

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """See ``Backend.lookup``. Requests not taking part get a zero bound and
        ``torch.where`` picks the answers; a program's answer does not depend
        on the other requests."""
        from kvhit.coordinator.candidates import has_candidates

        plan = self.plan
        a = plan.alignment
        zero = torch.zeros_like(num_tokens)
        token_len = torch.div(num_tokens, a, rounding_mode="floor") * a
        ok = (
            (view.lengths > 0)
            & (token_len > 0)
            & has_candidates(plan, view.lengths, token_len)
        )
        batch = self._batch(view.with_token_lens(token_len))
        first, _ = find_hits(plan, batch, torch.where(ok, token_len, zero), index, True)
        first = torch.where(ok, first, zero)
        # A hit covering the whole prompt is re-derived at num_tokens - 1 with
        # the candidate restriction still at the original token_len.
        redo = ok & (first >= num_tokens)
        usable = torch.div(num_tokens - 1, a, rounding_mode="floor") * a
        again = redo & (usable > 0)
        second, _ = find_hits(
            plan, batch, torch.where(again, usable, zero), index, True
        )
        return torch.where(redo, torch.where(again, second, zero), first)
