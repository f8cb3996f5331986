"""The torch backend: glue between the LookupEngine and the torch kernels.

:class:`TorchBackend` binds the KeyIndex table to a prober
(:func:`kvhit.kernels.hash_index_torch.probe`) and runs the torch scanner
(:mod:`kvhit.kernels.scan_torch`) over the engine's validated batch, with
torch's CPU threads set for the call. It runs on any device torch runs on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from kvhit.coordinator.backend import FindQuery, ViewBackend
from kvhit.coordinator.plan import ScanPlan
from kvhit.kernels import hash_index_torch
from kvhit.kernels.scan_torch import Prober, TorchScanner, torch_plan, worker_lookup

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import RaggedView

__all__ = ["TorchBackend"]


class TorchBackend(ViewBackend):
    """The torch backend of :class:`~kvhit.coordinator.engine.LookupEngine`
    (the ``Backend`` protocol of ``coordinator/backend.py``): :class:`TorchScanner`
    over the batch, probing the KeyIndex table with torch ops, on any device.

    Attributes:
        cpu_threads: intra-op threads torch may use on the CPU while a call
            runs (restored afterwards; None leaves torch's setting alone). The
            scans are hundreds of small tensor ops, where extra threads only
            add barrier waits.
    """

    name = "torch"

    def __init__(self, plan: ScanPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.cpu_threads: int | None = 1
        # The plan as the numba and Triton kernels take it: rows and params.
        self._rows = torch_plan(plan.as_rows(), plan.candidates_as_rows(), plan.params)

    def warm_up(self) -> None:
        """Nothing to load ahead: torch ops (``BatchBackend.warm_up``)."""

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        with torch.inference_mode():
            if self.cpu_threads is None or self.device.type != "cpu":
                yield
                return
            before = torch.get_num_threads()
            torch.set_num_threads(self.cpu_threads)
            try:
                yield
            finally:
                torch.set_num_threads(before)

    @staticmethod
    def _prober(index: KeyIndex | None, hashes: torch.Tensor) -> Prober:
        if index is None:

            def everything(g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                return torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)

            return everything
        table, W = index.table, index.W

        def probe(g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            if rows.numel() == 0:
                return torch.zeros(0, dtype=torch.bool, device=rows.device)
            return hash_index_torch.probe(table, W, g, hashes.index_select(0, rows))

        return probe

    def find_view(self, query: FindQuery) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``ViewBackend.find_view``: :class:`TorchScanner` over the view."""
        view, max_lengths, index, apply_eagle = query
        if len(view) == 0:
            return self.empty_find()
        with self._threads():
            hit, mask_spans = TorchScanner(
                self._rows, self._prober(index, view.rows)
            ).find(view, max_lengths, apply_eagle)
        return hit.clone(), mask_spans.clone()

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """See ``Backend.lookup``: int64 ``[R]`` tokens to load."""
        with self._threads():
            out = worker_lookup(
                self._rows, view, num_tokens, self._prober(index, view.rows)
            )
        return out.clone()
