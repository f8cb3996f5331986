"""The one protocol every LookupEngine backend implements, and the one
"auto" rule (:func:`auto_backend`) that KeyIndex, LookupEngine and the
bindings resolve ``backend="auto"`` with.

:class:`~kvhit.coordinator.engine.LookupEngine` validates every input, then
hands the backend it chose at construction a :class:`RaggedView` and int64
length tensors on the engine's device; a backend never validates again and
never sees a ``HashBatch``. Backends give identical answers on every input
(the parity tests prove it against the reference).

A backend is built as ``cls(plan, device)`` and must not import triton or numba
before its first call that needs them (``coordinator/`` never imports them at
module import time).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import RaggedView
    from kvhit.coordinator.plan import ScanPlan

__all__ = ["Backend", "auto_backend"]


def auto_backend(device: torch.device) -> str:
    """The backend ``backend="auto"`` picks on ``device``, for a KeyIndex and
    a LookupEngine alike: triton on CUDA, numba on the CPU (torch where numba
    is not installed: the GPU machine may have none), torch on any other
    device (MPS, XPU: its torch ops run anywhere; no compiled kernel family of
    ours does, and triton must never be picked there)."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        # find_spec imports nothing: numba is paid for only where it runs.
        return "numba" if importlib.util.find_spec("numba") is not None else "torch"
    return "torch"


@runtime_checkable
class Backend(Protocol):
    """What a LookupEngine backend does.

    Attributes:
        name: the name ``LookupEngine(backend=...)`` selects it by.
    """

    name: str

    def __init__(self, plan: ScanPlan, device: torch.device) -> None: ...

    def find(
        self,
        view: RaggedView,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's longest cache hit and its load-mask spans.

        Args:
            view: ``R`` requests; with ``view.token_lens`` set, only keys the
                store worker asks about at that length count as present.
            max_lengths: int64 ``[R]``, >= 0.
            index: the store's keys, or None (every key present).
            apply_eagle: apply the EAGLE last-block drop.

        Returns:
            ``(hit int64 [R], mask_spans int64 [R, G, 3])``: per group ``g`` the
            load mask as ``(length, lo, hi)``, ``mask[c] = lo <= c < hi`` for
            ``c < length`` (see ``coordinator/plan.py``).
        """
        ...

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """The store worker's rule (``MooncakeStoreWorker.lookup``): int64
        ``[R]`` tokens to load for prompts of ``num_tokens`` (int64 ``[R]``)
        tokens; ``view.token_lens`` is None (the backend derives it)."""
        ...
