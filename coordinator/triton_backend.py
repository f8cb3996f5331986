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

The engine's validated calls (``lookup_batch`` / ``find_batch``, issue 31) make
one launch and at most one host sync, the copy of the answer: a tensor of
lengths on the device is not read before the launch (the kernel flags a
negative length, :data:`kvhit.kernels.scan.LENGTH_FLAG`, and the copy raises
the ValueError ``kernels/checks.py`` words); a list of lengths is checked on
the host and sent through a reused pinned buffer (:class:`PinnedLengths`),
no sync at all. The batch's view and the plan's tensors and keywords are
built once, a warm lookup variant launches through the scan's
``LookupLaunch`` (its constexprs, plain ints and key built once: 33-37 ->
17-21 us of Python a call here), and the kernel is launched past Triton's
per-call binder (``kernels/launch.py``'s ``DirectLauncher``): once warm,
straight to the compiled kernel the ``LookupLaunch`` keeps
(``DirectLauncher.run``, 1.4 us of Python here against ``launch``'s 5.5). :meth:`TritonBackend.warm_up`
compiles or loads the lookup variant at construction, so no scheduler step
pays the compile; ``coordinator/graph_runner.py`` replays lookups from CUDA
graphs.

Launch parameters (``BLOCK``, ``NUM_WARPS``, ``MAXNREG``) are chosen once, with
their reasons, at the top of ``kernels/scan.py``.

Importing this module does not import triton (coordinator/ never does at
import time); the kernel module is imported on the first call.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvhit.coordinator.backend import FindQuery, ViewBackend
from kvhit.coordinator.plan import ScanPlan, plan_tensors
from kvhit.kernels import contract as kc
from kvhit.kernels.checks import check_lengths, host_lengths

if TYPE_CHECKING:
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch, RaggedView

__all__ = ["PinnedLengths", "TritonBackend", "stream_capturing"]

#: Lengths as :meth:`TritonBackend.lengths` gives them to ``find_batch`` /
#: ``lookup_batch``: the int64 ``[B]`` tensor on the device, and the
#: caller's value with its argument name when the values are still to be
#: checked (by the kernel: a negative length's hit is ``scan.LENGTH_FLAG``),
#: or None when they were checked on the host.
Lengths = tuple[torch.Tensor, tuple[Any, str] | None]


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device``'s kind is capturing a graph
    (CUDA graphs; False where the device kind has no such notion)."""
    module = getattr(torch, device.type, None)
    capturing = getattr(module, "is_current_stream_capturing", None)
    return bool(capturing is not None and capturing())


class PinnedLengths:
    """Host int64 lengths onto a CUDA device through reused pinned buffers:
    one asynchronous copy, no pageable staging and no allocation of pinned
    memory per call. Two buffers in turn, each reused only once the copy
    that last read it has finished (an event, normally long done), so a
    call never waits on its own copy.

    Args:
        device: the CUDA device the lengths go to.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # [buffer, event of the copy that last read it (None: none yet)].
        self._bufs: list[list[Any]] = [[None, None], [None, None]]
        self._turn = 0
        self._lock = threading.Lock()

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` (int64 ``[n]``, checked) as a new int64 ``[n]`` tensor on
        the device, copied on the current stream."""
        n = arr.shape[0]
        with self._lock:
            slot = self._bufs[self._turn]
            self._turn ^= 1
            buf, done = slot
            if buf is None or buf.shape[0] < n:
                # Torch's pinned allocator keeps a replaced buffer alive until
                # the copies that read it have finished.
                size = max(64, 1 << max(n - 1, 0).bit_length())
                buf = slot[0] = torch.empty(size, dtype=torch.int64, pin_memory=True)
                if done is None:
                    done = slot[1] = torch.cuda.Event()
            # The copy that last read this buffer (a no-op before any).
            done.synchronize()
            buf.numpy()[:n] = arr
            out = torch.empty(n, dtype=torch.int64, device=self.device)
            out.copy_(buf[:n], non_blocking=True)
            done.record(torch.cuda.current_stream(self.device))
        return out


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
        # PlanParams' fields are the launcher's keywords; built once.
        self._kwargs = dict(self.plan.params._asdict())
        # HashBatch -> (offsets' version, its view): a scheduler asking twice
        # about one batch builds the view (and its subtraction kernel) once.
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # (device, hash words) -> the scan's LookupLaunch of a warm lookup
        # variant: built after its first call (which compiles it, and which
        # a graph capture must not be).
        self._lookups: dict[tuple[torch.device, int], Any] = {}
        self._pinned = (
            PinnedLengths(self.device) if self.device.type == "cuda" else None
        )

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

    # -- the engine's host path (BatchBackend) ---------------------------------

    def view(self, batch: HashBatch) -> RaggedView:
        """``batch.view()``, built once per batch (rebuilt when its offsets
        are written in place)."""
        offsets = batch.offsets
        seen = self._views.get(batch)
        if seen is not None and seen[0] is offsets and seen[1] == offsets._version:
            return seen[2]
        view = batch.view()
        self._views[batch] = (offsets, offsets._version, view)
        return view

    def lengths(self, value: Any, name: str, n: int) -> Lengths:
        """See :meth:`BatchBackend.lengths`. An int64, 1-D, contiguous tensor
        of ``n`` entries on the device is taken as it is: its values are
        checked by the kernel and the answer's copy (:meth:`check_answer`),
        not by a host sync before the launch. A list, tuple or numpy array
        is checked on the host and goes to a CUDA device through a reused
        pinned buffer (:class:`PinnedLengths`). Everything else goes through
        ``checks.check_lengths`` (the errors it raises)."""
        if (
            type(value) is torch.Tensor
            and value.dtype is torch.int64
            and value.device == self.device
            and value.dim() == 1
            and value.shape[0] == n
            and value.layout is torch.strided
            and value.is_contiguous()
        ):
            return value, (value, name)
        if self._pinned is not None and not isinstance(value, torch.Tensor):
            return self._pinned.to_device(host_lengths(value, name, n)), None
        return check_lengths(value, name, n, self.device).contiguous(), None

    def check_answer(self, hit: torch.Tensor, lens: Lengths) -> None:
        """Raise the lengths' ValueError (naming the argument and position)
        where the kernel flagged a negative length: one copy of the answer
        ``hit`` (int64 ``[B]``) to the host, none when the lengths were
        checked there."""
        n = hit.shape[0]
        if lens[1] is None or not n:
            return
        # The same one copy either way; a short answer's least entry is
        # read through a list (0.5 us here at B = 1, 2.0 at 64), a long
        # one's through numpy (2.6 us at any size, a fifth of a list's at
        # 4096).
        if n <= 64:
            bad = min(hit.tolist()) < 0
        else:
            bad = np.minimum.reduce(hit.cpu().numpy()) < 0
        if bad:
            value, name = lens[1]
            check_lengths(value, name, hit.shape[0], self.device)
            raise AssertionError(f"the kernel flagged {name}, checks.py did not")

    def find_batch(
        self,
        batch: HashBatch,
        max_lengths: Lengths,
        index: KeyIndex | None,
        apply_eagle: bool,
        spans: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See :meth:`BatchBackend.find_batch`: one launch, and one copy of
        the hits when the lengths' values are the kernel's to check."""
        if len(batch) == 0:
            return self.empty_find()
        hit, mask_spans = self.find_view(
            (self.view(batch), max_lengths[0], index, apply_eagle)
        )
        if max_lengths[1] is not None:  # else checked on the host already
            self.check_answer(hit, max_lengths)
        return hit, mask_spans

    def lookup_batch(
        self, batch: HashBatch, num_tokens: Lengths, index: KeyIndex
    ) -> torch.Tensor:
        """See :meth:`BatchBackend.lookup_batch`: one launch, and one copy of
        the answer when the lengths' values are the kernel's to check."""
        if len(batch) == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        hit = self.lookup(self.view(batch), num_tokens[0], index)
        if num_tokens[1] is not None:  # else checked on the host already
            self.check_answer(hit, num_tokens)
        return hit

    # -- warm start ----------------------------------------------------------------

    #: Hash widths (int64 words) whose lookup variant :meth:`warm_up`
    #: compiles or loads: 32-byte keys (vLLM's sha256 block hashes).
    warm_hash_words: tuple[int, ...] = (4,)

    def warm_up(self) -> None:
        """Compile (or load from Triton's cache) the lookup kernel variant of
        this layout for each of :attr:`warm_hash_words`, on a one-request
        batch against an empty table, so that no scheduler step pays the
        compile. Under the interpreter (a CPU device) there is nothing to
        compile: a no-op."""
        if self.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return
        from kvhit.kernels.scan import launch_scan

        sg_rows, cand_rows = self._rows(self.device)
        ones = torch.ones(1, dtype=torch.int64, device=self.device)
        zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
        for w in self.warm_hash_words:
            hashes = torch.zeros(1, w, dtype=torch.int64, device=self.device)
            table = torch.full(
                (16, w + 1), kc.EMPTY, dtype=torch.int64, device=self.device
            )
            launch_scan(hashes, zeros, ones, ones, None, table, sg_rows, cand_rows,
                        apply_eagle=True, lookup=True, **self._kwargs)  # fmt: skip
            self._warm.add(("lookup", w))
        torch.cuda.synchronize(self.device)

    def find_view(self, query: FindQuery) -> tuple[torch.Tensor, torch.Tensor]:
        """Hits and load-mask spans, as :meth:`ViewBackend.find_view`: ``(hit
        int64 [R], mask_spans int64 [R, G, 3])``, one launch, no host sync."""
        from kvhit.kernels.scan import launch_scan

        view, max_lengths, index, apply_eagle = query

        sg_rows, cand_rows = self._rows(view.device)
        variant = (
            "find",
            view.rows.shape[1],
            index is None,
            view.token_lens is None,
            bool(apply_eagle),
        )
        self._warm_up(view.device, variant)
        out = launch_scan(
            view.rows,
            view.offsets,
            view.lengths,
            max_lengths,
            view.token_lens,
            self._table(index),
            sg_rows,
            cand_rows,
            apply_eagle=bool(apply_eagle),
            lookup=False,
            **self._kwargs,
        )
        self._warm.add(variant)
        return out

    def lookup(
        self, view: RaggedView, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """The store worker's rule, as :meth:`Backend.lookup`: int64 ``[R]``,
        one launch (both searches of the ``num_tokens - 1`` rule inside it),
        no host sync, one torch op (the output) besides the launch."""
        if view.token_lens is not None:
            raise ValueError("lookup derives token_lens itself: view.token_lens set")
        rows = view.rows
        fast = self._lookups.get((rows.device, rows.shape[1]))
        if fast is not None and index is not None:
            # A warm variant: launch_scan's work done once (LookupLaunch).
            return fast(rows, view.offsets, view.lengths, num_tokens, index.table)
        from kvhit.kernels.scan import LookupLaunch, launch_scan

        sg_rows, cand_rows = self._rows(view.device)
        variant = ("lookup", view.rows.shape[1])
        self._warm_up(view.device, variant)
        out, _ = launch_scan(
            view.rows,
            view.offsets,
            view.lengths,
            num_tokens,
            None,
            self._table(index),
            sg_rows,
            cand_rows,
            apply_eagle=True,
            lookup=True,
            **self._kwargs,
        )
        self._warm.add(variant)
        if index is not None:
            self._lookups[(rows.device, rows.shape[1])] = LookupLaunch(
                sg_rows, cand_rows, rows.shape[1], self._kwargs
            )
        return out
