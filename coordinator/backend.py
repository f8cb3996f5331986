"""The protocols every LookupEngine backend implements, and the one rule of
which backend runs on which device (:func:`auto_backend`,
:func:`check_runs_on`, :func:`resolve_backend`), used by LookupEngine,
KeyIndex and FleetIndex alike.

:class:`~kvhit.coordinator.engine.LookupEngine` validates the batch and the
index, asks its backend for the lengths in the backend's own form
(:meth:`BatchBackend.lengths`, one validation pass from
``kernels/checks.py``), then hands them over with the batch
(:meth:`BatchBackend.find_batch`, :meth:`BatchBackend.lookup_batch`); it never
names a backend. Each backend owns its fast path: the numba one reads the
batch's host arrays and numpy lengths, the others a :class:`RaggedView` of
torch tensors (:class:`ViewBackend`). A backend never validates again.
Backends give identical answers on every input (the parity tests prove it
against the reference).

A backend is built as ``cls(plan, device)`` and must not import triton or numba
before its first call that needs them (``coordinator/`` never imports them at
module import time).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from kvhit.kernels.checks import check_lengths

if TYPE_CHECKING:
    from kvhit.coordinator.packing import HashBatch, RaggedView
    from kvhit.coordinator.plan import ScanPlan

__all__ = [
    "RUNS_ON",
    "RUN_FIND",
    "RUN_FIND_EAGLE",
    "RUN_LOOKUP",
    "RUN_MODES",
    "Backend",
    "BatchBackend",
    "FindQuery",
    "ViewBackend",
    "auto_backend",
    "check_runs_on",
    "resolve_backend",
]

#: Where each backend runs: a test of the device, and the devices named when
#: a backend is refused. torch's ops (and the reference, which answers on the
#: CPU and moves its answers) run anywhere. Triton also runs on the CPU under
#: its interpreter where a caller allows it (:func:`check_runs_on`).
RUNS_ON: Mapping[str, tuple[Callable[[torch.device], bool], str]] = {
    "numba": (lambda device: device.type == "cpu", "the CPU"),
    "triton": (lambda device: device.type == "cuda", "CUDA"),
    "torch": (lambda device: True, "any device"),
    "reference": (lambda device: True, "any device"),
}


def auto_backend(device: torch.device) -> str:
    """The backend ``backend="auto"`` picks on ``device``, for a KeyIndex, a
    FleetIndex and a LookupEngine alike: triton on CUDA, numba on the CPU
    (torch where numba is not installed: the GPU machine may have none),
    torch on any other device (MPS, XPU: its torch ops run anywhere; no
    compiled kernel family of ours does, and triton must never be picked
    there)."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        # find_spec imports nothing: numba is paid for only where it runs.
        return "numba" if importlib.util.find_spec("numba") is not None else "torch"
    return "torch"


def check_runs_on(
    backend: str, device: torch.device, cpu_interpreter: bool = False
) -> None:
    """ValueError (``"backend 'numba' runs on the CPU only, device is
    cuda:0"``) unless ``backend`` (a known name) runs on ``device``. With
    ``cpu_interpreter``, triton is also accepted on the CPU, where it runs
    under ``TRITON_INTERPRET=1`` (the KeyIndex's and the engine's kernels are
    tested so; the fleet's are not)."""
    if cpu_interpreter and backend == "triton" and device.type == "cpu":
        return
    runs, where = RUNS_ON[backend]
    if not runs(device):
        raise ValueError(
            f"backend {backend!r} runs on {where} only, device is {device}"
        )


def resolve_backend(
    backend: Any,
    device: torch.device,
    choices: Sequence[str],
    cpu_interpreter: bool = False,
) -> str:
    """``backend`` (one of ``choices``, ``"auto"`` among them) resolved for
    ``device``: ``"auto"`` is :func:`auto_backend`'s pick, an explicit name
    is returned once :func:`check_runs_on` accepts it. ValueError naming
    ``backend`` otherwise."""
    if not isinstance(backend, str) or backend not in choices:
        raise ValueError(f"backend must be one of {tuple(choices)}, got {backend!r}")
    if backend == "auto":
        return auto_backend(device)
    check_runs_on(backend, device, cpu_interpreter)
    return backend


@runtime_checkable
class Backend(Protocol):
    """What a LookupEngine backend does on a :class:`RaggedView` (the batch as
    torch tensors), the form every backend reads.

    Attributes:
        name: the name ``LookupEngine(backend=...)`` selects it by.
    """

    name: str

    def __init__(self, plan: ScanPlan, device: torch.device) -> None: ...

    def find(
        self,
        view: RaggedView,
        max_lengths: torch.Tensor,
        index: Any,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's longest cache hit and its load-mask spans.

        Args:
            view: ``R`` requests; with ``view.token_lens`` set, only keys the
                store worker asks about at that length count as present.
            max_lengths: int64 ``[R]``, >= 0.
            index: the store's keys (a KeyIndex), or None (every key present).
            apply_eagle: apply the EAGLE last-block drop.

        Returns:
            ``(hit int64 [R], mask_spans int64 [R, G, 3])``: per group ``g`` the
            load mask as ``(length, lo, hi)``, ``mask[c] = lo <= c < hi`` for
            ``c < length`` (see ``coordinator/plan.py``).
        """
        ...

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: Any
    ) -> torch.Tensor:
        """The store worker's rule (``MooncakeStoreWorker.lookup``): int64
        ``[R]`` tokens to load for prompts of ``num_tokens`` (int64 ``[R]``)
        tokens; ``view.token_lens`` is None (the backend derives it)."""
        ...


#: The runners' modes (:meth:`BatchBackend.one_runner`): the longest hit, the
#: same with the EAGLE drop, and the store worker's lookup.
RUN_FIND, RUN_FIND_EAGLE, RUN_LOOKUP = 0, 1, 2
RUN_MODES = (RUN_FIND, RUN_FIND_EAGLE, RUN_LOOKUP)


@runtime_checkable
class BatchBackend(Backend, Protocol):
    """A :class:`Backend` that also takes a whole :class:`HashBatch` and the
    caller's lengths: the engine's public calls go through these three
    methods, so each backend owns its fast path (the numba one never builds
    a view or a torch tensor of lengths)."""

    def warm_up(self) -> None:
        """Load or compile the kernels a lookup runs, so that the first call
        of a serving process does not pay for it (a no-op where nothing is
        compiled ahead). :class:`~kvhit.coordinator.engine.LookupEngine`
        calls it at construction unless built with ``warm=False``."""
        ...

    def one_runner(self, index: Any) -> Callable[[Any, Any, Any, int], Any] | None:
        """A callable answering a scheduler step of one request against
        ``index`` (a KeyIndex the engine checked, with the table it holds
        now), or None where the backend has none: ``run(rows, lengths,
        table, mode)``, ``rows`` a batch's ``HashBatch.one_values`` (int64
        ``[n]``, 8-byte keys), ``table`` the index's ``table_view`` (the
        same table), ``mode`` one of :data:`RUN_MODES`, ``lengths`` as the
        caller gave them (checked by ``run``, naming ``max_lengths``, or
        ``num_tokens`` in lookup mode), returning the hit (or the tokens to
        load) as ``find_batch`` (``lookup_batch``) reads it, with no spans.
        The engine holds it until the index or its table changes."""
        ...

    def batch_runner(self, index: Any) -> Callable[[Any, Any, Any, int], Any] | None:
        """As :meth:`one_runner`, for a step of any number of requests whose
        host arrays the batch already holds: ``run(host, lengths, table,
        mode)``, ``host`` the batch's ``host_arrays()`` triple (8-byte keys),
        the answers as an int64 array ``[B]`` on the host. None where the
        backend has none."""
        ...

    def lists_runner(
        self, index: Any
    ) -> Callable[[list, Any, Any, int, int], list[int] | None] | None:
        """As :meth:`one_runner`, for a step as a router holds it: ``run(requests,
        lengths, table, mode, block_size)``, ``requests`` the caller's list of
        ``B`` requests (8-byte keys as ints), ``lengths`` as the caller gave
        them, ``block_size`` an int in ``[1, 2**63)``: the answers floor-divided
        by it as ``B`` Python ints, or None where ``run`` does not take the
        step (an item it does not read, a form of the lengths it has no way
        for): the engine then packs the batch and takes the general path,
        which names what is wrong. None where the backend has none."""
        ...

    def lengths(self, value: Any, name: str, n: int) -> Any:
        """``value`` (``n`` per-request lengths in any form a caller holds
        them) checked once (``kernels/checks.py``) and in the form this
        backend's ``find_batch``/``lookup_batch`` read. TypeError/ValueError
        naming ``name`` and the position."""
        ...

    def find_batch(
        self,
        batch: HashBatch,
        max_lengths: Any,
        index: Any,
        apply_eagle: bool,
        spans: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`Backend.find` of a checked batch (empty too) and lengths
        from :meth:`lengths`: ``(hit, mask_spans int64 [B, G, 3])``;
        ``mask_spans`` may be None when ``spans`` is False (not asked for).
        ``hit`` is int64 ``[B]``: a tensor on the device, or, from a backend
        that answers on the host, a numpy array or (one request, no spans)
        an int, which :class:`~kvhit.coordinator.engine.LookupResult` turns
        into its tensor only when ``hit_lengths`` is read."""
        ...

    def lookup_batch(
        self, batch: HashBatch, num_tokens: Any, index: Any
    ) -> torch.Tensor:
        """:meth:`Backend.lookup` of a checked batch (empty too) and lengths
        from :meth:`lengths`: int64 ``[B]``."""
        ...


#: One :meth:`Backend.find` call, as :meth:`ViewBackend.find` hands it to
#: :meth:`ViewBackend.find_view`: ``(view, max_lengths, index, apply_eagle)``,
#: the protocol's arguments (see :meth:`Backend.find` for each), written once.
#: A plain tuple: a NamedTuple's constructor costs ~0.5 us per call, on the
#: engine's find path.
FindQuery = tuple["RaggedView", torch.Tensor, Any, bool]


class ViewBackend:
    """The :class:`BatchBackend` methods of a backend that reads views: the
    lengths as an int64 tensor on its device, the batch as its
    :class:`RaggedView`. Subclasses set ``plan`` and ``device`` and implement
    :meth:`find_view` and :meth:`Backend.lookup`."""

    plan: ScanPlan
    device: torch.device

    def find(
        self, view: RaggedView, max_lengths: torch.Tensor, index: Any, apply_eagle: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.find`: the call as one :data:`FindQuery`, answered
        by the backend's :meth:`find_view`."""
        return self.find_view((view, max_lengths, index, apply_eagle))

    def find_view(self, query: FindQuery) -> tuple[torch.Tensor, torch.Tensor]:
        """The backend's own :meth:`Backend.find` of ``query``: ``(hit int64
        [R], mask_spans int64 [R, G, 3])``."""
        raise NotImplementedError

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: Any
    ) -> torch.Tensor:
        raise NotImplementedError

    def empty_find(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Backend.find` of no request: int64 ``[0]`` and int64
        ``[0, G, 3]`` on the device."""
        return (
            torch.zeros(0, dtype=torch.int64, device=self.device),
            torch.zeros(0, self.plan.num_groups, 3, dtype=torch.int64,
                        device=self.device),
        )  # fmt: skip

    def one_runner(self, index: Any) -> None:
        """See :meth:`BatchBackend.one_runner`: none (every step goes
        through :meth:`find_batch`)."""
        return None

    def batch_runner(self, index: Any) -> None:
        """See :meth:`BatchBackend.batch_runner`: none."""
        return None

    def lists_runner(self, index: Any) -> None:
        """See :meth:`BatchBackend.lists_runner`: none."""
        return None

    def lengths(self, value: Any, name: str, n: int) -> torch.Tensor:
        """See :meth:`BatchBackend.lengths`: int64 ``[n]`` on the device."""
        return check_lengths(value, name, n, self.device)

    def find_batch(
        self,
        batch: HashBatch,
        max_lengths: torch.Tensor,
        index: Any,
        apply_eagle: bool,
        spans: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See :meth:`BatchBackend.find_batch` (the spans always come)."""
        if len(batch) == 0:
            return self.empty_find()
        return self.find(batch.view(), max_lengths, index, apply_eagle)

    def lookup_batch(
        self, batch: HashBatch, num_tokens: torch.Tensor, index: Any
    ) -> torch.Tensor:
        """See :meth:`BatchBackend.lookup_batch`."""
        if len(batch) == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return self.lookup(batch.view(), num_tokens, index)
