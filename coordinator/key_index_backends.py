"""Which hash-index kernel family a KeyIndex runs (``BACKENDS``,
``KERNEL_MODULES``) and the rule that picks it for a device. Split from
``coordinator/key_index.py``, which re-exports these names.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType

import torch

from kvhit.coordinator.backend import resolve_backend as resolve_any_backend

__all__ = ["BACKENDS", "KERNEL_MODULES", "hash_kernels", "resolve_backend"]

#: Backend -> its hash-index kernel module (the same launchers in each:
#: ``find``, ``probe``, ``insert``, ``erase``, ``rehash``), imported when an
#: index first binds it: coordinator/ never imports triton or numba before.
KERNEL_MODULES: Mapping[str, str] = {
    "numba": "kvhit.kernels.hash_index_numba",
    "torch": "kvhit.kernels.hash_index_torch",
    "triton": "kvhit.kernels.hash_index",
}
#: Backends a KeyIndex accepts.
BACKENDS = ("auto", *sorted(KERNEL_MODULES))


def resolve_backend(backend: str, device: torch.device) -> str:
    """The KeyIndex backend that runs on ``device`` for ``backend`` (one of
    :data:`BACKENDS`), by the one rule of ``coordinator/backend.py``: "auto"
    is :func:`~kvhit.coordinator.backend.auto_backend` (numba on the CPU,
    triton on CUDA, torch elsewhere: MPS, XPU, where no kernel family of ours
    runs and triton must never be picked). An explicit backend is returned as
    is, or ValueError where it cannot run (numba off the CPU, triton off CUDA
    and the CPU interpreter)."""
    return resolve_any_backend(backend, device, BACKENDS, cpu_interpreter=True)


def hash_kernels(backend: str) -> ModuleType:
    """The hash-index kernel module of a resolved ``backend`` ("numba",
    "torch" or "triton"; see :data:`KERNEL_MODULES`), imported now."""
    return importlib.import_module(KERNEL_MODULES[backend])
