"""The Triton backend of the LookupEngine: glue between a ScanPlan and the kernel.

:class:`TritonBackend` implements the :class:`~kvhit.coordinator.backend.Backend`
protocol over a :class:`~kvhit.coordinator.packing.RaggedView`: ``find`` is one
launch of :func:`kvhit.kernels.scan.scan_hits` and ``lookup`` one launch of
:func:`kvhit.kernels.scan.worker_lookup` (one program per request; the
convergence loop and the store worker's two searches run inside the kernel).
Neither makes a host sync, so both can be captured in a CUDA graph; ``lookup``
runs one torch op besides the launch (its output allocation), ``find`` two.
The plan's device tensors are built with the backend (the engine), never on
a call: building them inside a CUDA-graph capture is illegal, so a call on
another device than the backend's during a capture is refused with a clear
error instead.

Launch parameters (``BLOCK``, ``NUM_WARPS``, ``MAXNREG``) are chosen once, with
their reasons, at the top of ``kernels/scan.py``.

Importing this module does not import triton (coordinator/ never does at
import time); the kernel module is imported on the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvhit.coordinator.backend import ViewBackend
from kvhit.coordinator.plan import ScanPlan, plan_tensors

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import RaggedView

__all__ = ["TritonBackend", "stream_capturing"]


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device``'s kind is capturing a graph
    (CUDA graphs; False where the device kind has no such notion)."""
    module = getattr(torch, device.type, None)
    capturing = getattr(module, "is_current_stream_capturing", None)
    return bool(capturing is not None and capturing())


class TritonBackend(ViewBackend):
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
        sg_rows, cand_rows = plan_tensors(plan, self.device)
        # Keyed by the device the tensors report ("cuda" -> "cuda:<n>"), the
        # spelling views report too.
        self._plan_rows = {sg_rows.device: (sg_rows, cand_rows)}
        # Kernel variants called at least once (compiled and loaded).
        self._warm: set[tuple] = set()

    def warm_up(self) -> None:
        """``BatchBackend.warm_up``: a stub for now (the Triton kernels still
        compile on their first call)."""

    def _warm_up(self, device: torch.device, variant: tuple) -> None:
        """Refuse the first call of a kernel variant during a graph capture:
        that call compiles and loads the kernel, which cannot be captured."""
        if variant not in self._warm and stream_capturing(device):
            raise RuntimeError(
                f"TritonBackend: the first {variant[0]} call of this kernel "
                "variant is inside a CUDA-graph capture; it compiles and loads "
                "the kernel, which cannot be captured. Call it once before "
                "capturing (a warm-up)"
            )

    def _rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's tensors on ``device``: built with the backend; built
        here for another device, except during a graph capture (illegal)."""
        rows = self._plan_rows.get(device)
        if rows is None:
            if stream_capturing(device):
                raise RuntimeError(
                    f"TritonBackend: a call on {device} during a CUDA-graph "
                    f"capture, but the backend was built for {self.device}: the "
                    "plan's device tensors would be built inside the capture "
                    f"(illegal). Build the engine on {device}, or call it once "
                    "on that device before capturing"
                )
            rows = self._plan_rows[device] = plan_tensors(self.plan, device)
        return rows

    @staticmethod
    def _table(index: KeyIndex | None) -> torch.Tensor | None:
        # The engine checked the index's hash width against the batch's.
        return None if index is None else index.table

    def _plan_kwargs(self) -> dict:
        # PlanParams' fields are the launchers' keywords.
        return self.plan.params._asdict()

    def find(
        self,
        view: RaggedView,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hits and load-mask spans, as :meth:`Backend.find`: ``(hit int64
        [R], mask_spans int64 [R, G, 3])``, one launch, no host sync."""
        from kvhit.kernels.scan import scan_hits

        sg_rows, cand_rows = self._rows(view.device)
        variant = (
            "find",
            view.rows.shape[1],
            index is None,
            view.token_lens is None,
            bool(apply_eagle),
        )
        self._warm_up(view.device, variant)
        out = scan_hits(
            view.rows,
            view.offsets,
            view.lengths,
            max_lengths,
            sg_rows,
            cand_rows,
            table=self._table(index),
            token_len=view.token_lens,
            apply_eagle=apply_eagle,
            **self._plan_kwargs(),
        )
        self._warm.add(variant)
        return out

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """The store worker's rule, as :meth:`Backend.lookup`: int64 ``[R]``,
        one launch (both searches of the ``num_tokens - 1`` rule inside it),
        no host sync, one torch op (the output) besides the launch."""
        from kvhit.kernels.scan import worker_lookup

        if view.token_lens is not None:
            raise ValueError("lookup derives token_lens itself: view.token_lens set")
        sg_rows, cand_rows = self._rows(view.device)
        variant = ("lookup", view.rows.shape[1])
        self._warm_up(view.device, variant)
        out = worker_lookup(
            view.rows,
            view.offsets,
            view.lengths,
            num_tokens,
            sg_rows,
            cand_rows,
            table=self._table(index),
            **self._plan_kwargs(),
        )
        self._warm.add(variant)
        return out
