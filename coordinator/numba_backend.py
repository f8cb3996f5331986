"""The numba backend of the LookupEngine: the CPU default.

Glue between a :class:`ScanPlan` and the compiled per-request programs of
:mod:`kvhit.kernels.scan_numba`: the batch's hash rows, the KeyIndex table and
the plan's rows go in as zero-copy numpy views of the torch tensors, and one
compiled call answers the whole batch (both searches of the store worker's
``lookup`` included).

Importing this module does not import numba (``coordinator/`` never does at
import time); the kernel module, and numba with it, is imported on the first
call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvhit.coordinator.plan import ScanPlan, plan_tensors

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import RaggedView

__all__ = ["NumbaBackend"]


def _np(t: torch.Tensor) -> np.ndarray:
    # A CPU tensor's numpy view shares its memory (integer tensors never
    # require grad); the launcher copies only what is not contiguous.
    return t.numpy()


def _c(t: torch.Tensor | np.ndarray) -> np.ndarray:
    # An int64 CPU tensor (kvhit's own, or a length tensor the engine checked)
    # as C-contiguous numpy: a view when it already is one (the usual case),
    # else a copy. All scan_prepared needs beyond what the engine checked.
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.int64)


def _table(index: KeyIndex) -> np.ndarray:
    table = index.table
    if isinstance(table, torch.Tensor):
        return _np(table)
    return np.asarray(table)


class NumbaBackend:
    """Compiled CPU per-request programs (the ``Backend`` protocol of
    ``coordinator/backend.py``).

    Args:
        plan: the layout's ScanPlan.
        device: must be the CPU.

    Attributes:
        parallel: threads over requests (True), a serial loop (False), or by
            batch size (None, the default: threads from
            ``kvhit.kernels.scan_numba.PARALLEL_MIN_REQUESTS`` requests on).

    Raises:
        ValueError: ``device`` is not the CPU.
    """

    name = "numba"

    def __init__(self, plan: ScanPlan, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cpu":
            raise ValueError(
                f"device {str(device)!r}: the numba backend runs on the CPU "
                "(use backend='triton' on CUDA)"
            )
        self.plan = plan
        self.device = device
        self.parallel: bool | None = None
        sg_rows, cand_rows = plan_tensors(plan, device)
        self._sg = _np(sg_rows)
        self._cand = _np(cand_rows)
        self._prep_cache = None

    def _prep(self) -> tuple[Any, Any]:
        """``(scan_numba module, ScanPrep)``: the plan's rows and parameter
        vectors checked and built once (the kernel module, and numba with
        it, imported on the first call)."""
        if self._prep_cache is None:
            from kvhit.kernels import scan_numba as sn

            plan = self.plan
            prep = sn.prepare_scan(
                self._sg, self._cand, hash_block_size=plan.hash_block_size,
                alignment=plan.alignment, partial=plan.partial,
                simple_hybrid=plan.simple_hybrid,
            )  # fmt: skip
            self._prep_cache = (sn, prep)
        return self._prep_cache

    def find(
        self,
        view: RaggedView,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``Backend.find``: ``(hit int64 [R], mask_spans int64 [R, G, 3])``."""
        if index is not None and view.token_lens is None:
            # The common case on the prepared launcher: the view's arrays are
            # kvhit's own (int64; contiguous once through _c).
            sn, prep = self._prep()
            hit, mask_spans = sn.scan_prepared(
                prep, _c(view.rows), _c(view.offsets), _c(view.lengths),
                _c(max_lengths), _c(_table(index)),
                sn.FIND_EAGLE if apply_eagle else sn.FIND, self.parallel,
            )  # fmt: skip
            return torch.from_numpy(hit), torch.from_numpy(mask_spans)
        from kvhit.kernels.scan_numba import find_hits

        plan = self.plan
        hit, mask_spans = find_hits(
            _np(view.rows),
            _np(view.offsets),
            _np(view.lengths),
            _np(max_lengths),
            self._sg,
            self._cand,
            table=None if index is None else _table(index),
            token_lens=None if view.token_lens is None else _np(view.token_lens),
            hash_block_size=plan.hash_block_size,
            alignment=plan.alignment,
            partial=plan.partial,
            simple_hybrid=plan.simple_hybrid,
            apply_eagle=apply_eagle,
            parallel=self.parallel,
        )
        return torch.from_numpy(hit), torch.from_numpy(mask_spans)

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """See ``Backend.lookup``: int64 ``[R]`` tokens to load."""
        sn, prep = self._prep()
        out, _ = sn.scan_prepared(
            prep, _c(view.rows), _c(view.offsets), _c(view.lengths),
            _c(num_tokens), _c(_table(index)), sn.LOOKUP, self.parallel,
        )  # fmt: skip
        return torch.from_numpy(out)
