"""The Triton backend of the LookupEngine: glue between a ScanPlan and the kernel.

:class:`TritonBackend` implements the :class:`~kvhit.coordinator.backend.Backend`
protocol over a :class:`~kvhit.coordinator.packing.RaggedView`: ``find`` is one
launch of :func:`kvhit.kernels.scan.scan_hits` and ``lookup`` one launch of
:func:`kvhit.kernels.scan.worker_lookup` (one program per request; the
convergence loop and the store worker's two searches run inside the kernel).
Neither makes a host sync, so both can be captured in a CUDA graph; ``lookup``
runs one torch op besides the launch (its output allocation), ``find`` two.

Launch parameters (``BLOCK``, ``NUM_WARPS``, ``MAXNREG``) are chosen once, with
their reasons, at the top of ``kernels/scan.py``.

Importing this module does not import triton (coordinator/ never does at
import time); the kernel module is imported on the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvhit.coordinator.plan import ScanPlan, plan_tensors

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import RaggedView

__all__ = ["TritonBackend"]


class TritonBackend:
    """The GPU backend (CPU only under ``TRITON_INTERPRET=1``, for tests).

    Args:
        plan: the layout's :class:`ScanPlan`.
        device: where views, lengths and indexes live.
    """

    name = "triton"

    def __init__(self, plan: ScanPlan, device: torch.device | str) -> None:
        if not isinstance(plan, ScanPlan):
            raise TypeError(f"plan must be a ScanPlan, got {type(plan).__name__}")
        self.plan = plan
        self.device = torch.device(device)

    def _table(self, index: KeyIndex | None, view: RaggedView) -> torch.Tensor | None:
        if index is None:
            return None
        if index.W != view.rows.shape[1]:
            raise ValueError(
                f"index has {index.W} words per hash, the batch {view.rows.shape[1]}"
            )
        return index.table

    def _plan_kwargs(self) -> dict:
        plan = self.plan
        return dict(
            hash_block_size=plan.hash_block_size,
            alignment=plan.alignment,
            partial=plan.partial,
            simple_hybrid=plan.simple_hybrid,
            num_groups=plan.num_groups,
        )

    def find(
        self,
        view: RaggedView,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hits and load-mask triples, as :meth:`Backend.find`: ``(hit int64
        [R], triples int64 [R, G, 3])``, one launch, no host sync."""
        from kvhit.kernels.scan import scan_hits

        sg_rows, cand_rows = plan_tensors(self.plan, view.device)
        return scan_hits(
            view.rows,
            view.offsets,
            view.lengths,
            max_lengths,
            sg_rows,
            cand_rows,
            table=self._table(index, view),
            token_len=view.token_lens,
            apply_eagle=apply_eagle,
            **self._plan_kwargs(),
        )

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """The store worker's rule, as :meth:`Backend.lookup`: int64 ``[R]``,
        one launch (both searches of the ``num_tokens - 1`` rule inside it),
        no host sync, one torch op (the output) besides the launch."""
        from kvhit.kernels.scan import worker_lookup

        if view.token_lens is not None:
            raise ValueError("lookup derives token_lens itself: view.token_lens set")
        sg_rows, cand_rows = plan_tensors(self.plan, view.device)
        return worker_lookup(
            view.rows,
            view.offsets,
            view.lengths,
            num_tokens,
            sg_rows,
            cand_rows,
            table=self._table(index, view),
            **self._plan_kwargs(),
        )
