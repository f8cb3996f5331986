"""LookupEngine: one call per scheduler step answers every request in a batch.

The engine validates every input and keeps the public API; the work is done by
one backend object chosen at construction (the ``Backend`` protocol of
:mod:`kvhit.coordinator.backend`). Backends, with identical results on every
input (parity tests prove it):

* ``"numba"``: compiled per-request programs on the CPU
  (:mod:`kvhit.coordinator.numba_backend`). The default on the CPU.
* ``"triton"``: per-request programs in :mod:`kvhit.kernels.scan` that probe
  the table from inside the kernel (CUDA; the CPU only under
  ``TRITON_INTERPRET=1``). The default on CUDA.
* ``"torch"``: :mod:`kvhit.coordinator.torch_backend`, vectorised torch ops
  over the batch; runs on any torch device, the default on devices that are
  neither the CPU nor CUDA (``mps``, ``xpu``, ...).
* ``"reference"``: loops :class:`ReferenceCoordinator` over the requests, with
  the index's keys as a Python set. The baseline.

Past a request's hashes, the batched backends count a probe as a miss; the
reference raises ``ValueError`` there (vLLM raises ``IndexError``), so the
backends agree wherever the reference answers.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhit.coordinator.backend import (
    RUN_FIND,
    RUN_FIND_EAGLE,
    RUN_LOOKUP,
    BatchBackend,
    resolve_backend,
)
from kvhit.coordinator.candidates import worker_candidates
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.kinds import kind_of
from kvhit.coordinator.packing import HashBatch
from kvhit.coordinator.plan import ScanPlan
from kvhit.coordinator.specs import CacheLayout
from kvhit.kernels.checks import (
    INT64_MAX,
    check_device,
    check_int,
    check_lengths,
    check_mask_size,
)
from kvhit.kernels.contract import cdiv

# Backend name -> "module:class", imported when an engine first asks for it (so
# neither numba nor triton is imported by building another backend).
BACKEND_CLASSES: dict[str, str] = {
    "numba": "kvhit.coordinator.numba_backend:NumbaBackend",
    "triton": "kvhit.coordinator.triton_backend:TritonBackend",
    "torch": "kvhit.coordinator.torch_backend:TorchBackend",
    "reference": "kvhit.coordinator.reference_backend:ReferenceBackend",
}
BACKENDS = ("auto", *BACKEND_CLASSES)
#: Per-request lengths in any form the engine takes (``kernels/checks.py``).
Lengths = torch.Tensor | Sequence[int]


_new = object.__new__
# The fewest hits LookupResult.hit_list divides into blocks in numpy (below
# it, a comprehension over the ints is cheaper: 0.5 against 0.75 us at 8).
_NUMPY_DIVIDE_MIN = 16


def _nothing() -> None:
    """A dead weak reference: what the engine remembers before any check."""
    return None


def backend_class(name: str) -> type[BatchBackend]:
    """The class registered as backend ``name`` (imports its module)."""
    module, _, cls = BACKEND_CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def _hit_tensor(hits: np.ndarray | int) -> torch.Tensor:
    """A host backend's hits (int64 numpy ``[B]``, or one request's int) as
    the int64 ``[B]`` CPU tensor ``LookupResult.hit_lengths`` holds (the
    numpy array's memory shared)."""
    if type(hits) is int:
        hits = np.array((hits,), dtype=np.int64)
    return torch.from_numpy(hits)


@dataclass(frozen=True)
class LookupResult:
    """What :meth:`LookupEngine.find_longest_cache_hit` returns.

    ``hit_lengths``: int64 ``[B]``, tokens hit per request. With
    ``with_masks=True``, ``masks[g]`` is bool ``[B, C_g]`` (``C_g`` the longest
    mask of group ``g`` in the batch) and ``mask_lengths[g]`` int64 ``[B]``:
    request ``b``'s mask for group ``g`` is ``masks[g][b, :mask_lengths[g][b]]``,
    equal to the reference's list; entries past the length are False.

    :meth:`hit_list` and :meth:`hit_array` give the same hits as a list of
    ints and a numpy array: on the CPU (the numba backend) without a torch
    op, where a router's ``(hits.hit_lengths // bs).tolist()`` on a
    one-request tensor costs 2-4 us. The numba backend's answers make
    ``hit_lengths`` on first use; every form reads the same hits.
    """

    hit_lengths: torch.Tensor
    masks: tuple[torch.Tensor, ...] | None = None
    mask_lengths: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def of_hits(cls, hits: torch.Tensor | np.ndarray | int) -> LookupResult:
        """A result of hits alone (no masks): an int64 ``[B]`` tensor, or a
        host backend's int64 numpy ``[B]`` or one request's int, kept as
        they are until :attr:`hit_lengths` is first read."""
        # The frozen dataclass's __init__ sets all three fields through
        # object.__setattr__; the hit alone is a third of that (masks
        # default to None on the class).
        result = object.__new__(cls)
        if type(hits) is torch.Tensor:
            result.__dict__["hit_lengths"] = hits
        else:
            result.__dict__["_hits"] = hits
        return result

    def __getattr__(self, name: str) -> Any:
        # Reached only for an attribute not set: hit_lengths of a result
        # built from host hits (of_hits), made once. setdefault: two
        # threads reading it first get one tensor.
        if name == "hit_lengths":
            d = self.__dict__
            if "_hits" in d:
                return d.setdefault("hit_lengths", _hit_tensor(d["_hits"]))
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
        )

    def hit_list(self, block_size: int = 1) -> list[int]:
        """``hit_lengths`` as a list of ``B`` Python ints (what
        ``hit_lengths.tolist()`` gives), with no torch op for host hits;
        with ``block_size``, each hit in whole blocks of that many tokens
        (``hit // block_size``: a router's answer in blocks, divided in
        numpy where a list comprehension over the ints costs 2.5x that at
        B = 64 and 3x at 1024).

        Raises TypeError / ValueError naming ``block_size`` unless it is an
        int in ``[1, 2**63)``."""
        if type(block_size) is not int or not 1 <= block_size <= INT64_MAX:
            # In int64: a tensor's or numpy's division would wrap a larger one.
            block_size = check_int(block_size, "block_size", 1, INT64_MAX + 1)
        d = self.__dict__
        hits = d.get("_hits")
        if hits is None or "hit_lengths" in d:
            # A tensor (any device), or one made and maybe changed since.
            hits = self.hit_lengths
            if block_size == 1:
                return hits.tolist()
            return torch.div(hits, block_size, rounding_mode="floor").tolist()
        if type(hits) is int:
            return [hits // block_size]
        if block_size == 1:
            return hits.tolist()
        if hits.shape[0] < _NUMPY_DIVIDE_MIN:
            # numpy's division costs ~0.7 us before its first item.
            return [h // block_size for h in hits.tolist()]
        return (hits // block_size).tolist()

    def hit_array(self) -> np.ndarray:
        """``hit_lengths`` as int64 numpy ``[B]`` on the host: a new array
        (a result's hits are never aliased by a later call, nor this array
        by the result)."""
        d = self.__dict__
        hits = d.get("_hits")
        if hits is None or "hit_lengths" in d:
            return self.hit_lengths.cpu().numpy().copy()
        if type(hits) is int:
            return np.array((hits,), dtype=np.int64)
        return hits.copy()

    def mask_lists(self) -> list[tuple[list[bool], ...]]:
        """The masks as the reference returns them, one tuple per request."""
        if self.masks is None or self.mask_lengths is None:
            raise ValueError("no masks: call with with_masks=True")
        out = []
        cols = [m.cpu().tolist() for m in self.masks]
        lens = [n.cpu().tolist() for n in self.mask_lengths]
        for b in range(self.hit_lengths.numel()):
            out.append(tuple(c[b][: n[b]] for c, n in zip(cols, lens, strict=True)))
        return out


@dataclass(frozen=True)
class MaskBatch:
    """Per-group masks for a batch: ``masks[g]`` bool ``[B, C_g]`` and
    ``lengths[g]`` int64 ``[B]``; ``dense[g]`` is True where the reference
    returns ``None`` (every chunk), in which case ``masks[g]`` is all True up
    to each length."""

    masks: tuple[torch.Tensor, ...]
    lengths: tuple[torch.Tensor, ...]
    dense: tuple[bool, ...]

    def mask_lists(self) -> list[tuple[list[bool] | None, ...]]:
        """The masks as the reference returns them (``None`` for dense)."""
        cols = [m.cpu().tolist() for m in self.masks]
        lens = [n.cpu().tolist() for n in self.lengths]
        n_req = self.lengths[0].numel() if self.lengths else 0
        return [
            tuple(
                None if d else c[b][: n[b]]
                for c, n, d in zip(cols, lens, self.dense, strict=True)
            )
            for b in range(n_req)
        ]


def _expand_mask_spans(
    mask_spans: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``mask_spans`` int64 ``[B, G, 3]`` (length, lo, hi: chunks ``[lo, hi)``
    of ``length`` are in the mask) -> bool masks ``[B, C_g]`` and int64
    lengths ``[B]``, one of each per group."""
    masks, lengths = [], []
    for g in range(mask_spans.shape[1]):
        length = mask_spans[:, g, 0]
        lo, hi = mask_spans[:, g, 1], mask_spans[:, g, 2]
        width = int(length.max().item()) if length.numel() else 0
        chunks = torch.arange(width, device=mask_spans.device)[None, :]
        masks.append(
            (chunks >= lo[:, None])
            & (chunks < hi[:, None])
            & (chunks < length[:, None])
        )
        lengths.append(length.clone())
    return tuple(masks), tuple(lengths)


class LookupEngine:
    """Batched longest-prefix lookup over a :class:`KeyIndex`.

    Args:
        layout: the model's cache layout.
        backend: ``"auto"`` (triton on CUDA, numba on the CPU, torch on any
            other device), ``"numba"``, ``"triton"``, ``"torch"`` or
            ``"reference"``.
        device: where batches and indexes live; defaults to the CPU.
        cpu_threads: intra-op threads torch may use while the torch backend
            runs on the CPU (restored afterwards; ``None`` leaves torch's
            setting alone). Only the torch backend reads it.
        warm: load or compile the backend's kernels now
            (``impl.warm_up()``), so that the first lookup of a serving
            process costs what later ones do; ``False`` defers that to the
            first call (e.g. an engine built only to be inspected).

    Attributes:
        backend: the backend's name (``"auto"`` resolved).
        impl: the backend object (``BatchBackend`` protocol); the numba backend's
            ``impl.parallel`` forces threads over requests on or off.

    Raises:
        TypeError / ValueError: naming the argument: an unknown backend, a
            device that is not available or holds no data (``"meta"``), a
            backend that does not run on the device.
    """

    def __init__(
        self,
        layout: CacheLayout,
        backend: str = "auto",
        device: torch.device | str | None = None,
        cpu_threads: int | None = 1,
        warm: bool = True,
    ) -> None:
        if not isinstance(layout, CacheLayout):
            raise TypeError(
                f"layout must be a CacheLayout, got {type(layout).__name__}"
            )
        if cpu_threads is not None:
            check_int(cpu_threads, "cpu_threads", 1)
        if not isinstance(warm, bool):
            raise TypeError(f"warm must be a bool, got {type(warm).__name__}")
        device = check_device(device if device is not None else "cpu")
        backend = resolve_backend(backend, device, BACKENDS, cpu_interpreter=True)
        self.layout = layout
        self.device = device
        self.backend = backend
        self.cpu_threads = cpu_threads
        self.plan = ScanPlan.from_layout(layout)
        self._min_block_size = min(s.block_size for s in layout.coverage_specs)
        self.impl: BatchBackend = backend_class(backend)(self.plan, device)
        # The last index _check_batch accepted, its table then, its width,
        # the backend's one-request runner for it and the table's host view
        # then (weak references: the engine must not keep a dropped table
        # alive), its batch runner and its lists runner, set as one tuple,
        # so a thread never reads half of another's update.
        self._checked: tuple[
            Callable[[], Any], Callable[[], Any], int, Any, Callable[[], Any], Any, Any
        ] = (_nothing, _nothing, 0, None, _nothing, None, None)
        if hasattr(self.impl, "cpu_threads"):
            self.impl.cpu_threads = cpu_threads
        if warm:
            self.impl.warm_up()

    # -- validation ---------------------------------------------------------

    def _check_batch(
        self, batch: Any, index: KeyIndex | None, need_index: bool = True
    ) -> None:
        checked_index, checked_table, checked_width = self._checked[:3]
        if (
            type(index) is KeyIndex
            and type(batch) is HashBatch
            and index is checked_index()
            and index.table is checked_table()
            and batch.hash_bytes == checked_width
            and batch.device == self.device
        ):
            # The index passed every test below with this very table (a
            # table moved or grown is another tensor, tested again), and the
            # batch matches it: a step's warm lookup tests no more.
            return
        if not isinstance(batch, HashBatch):
            raise TypeError(f"batch must be a HashBatch, got {type(batch).__name__}")
        if batch.device != self.device:
            raise ValueError(f"batch is on {batch.device}, the engine on {self.device}")
        if index is None:
            if need_index:
                raise TypeError("index must be a KeyIndex, got None")
            return
        if not isinstance(index, KeyIndex):
            raise TypeError(f"index must be a KeyIndex, got {type(index).__name__}")
        if index.device != self.device:
            raise ValueError(f"index is on {index.device}, the engine on {self.device}")
        if index.hash_bytes != batch.hash_bytes:
            raise ValueError(
                f"batch hash width ({batch.hash_bytes} bytes) differs from the "
                f"index's ({index.hash_bytes} bytes)"
            )
        if type(index) is KeyIndex:
            run = self.impl.one_runner(index)
            view = index.table_view
            self._checked = (
                weakref.ref(index),
                weakref.ref(index.table),
                index.hash_bytes,
                run,
                # A host view is made once per table tensor: the same view,
                # the same table (a runner exists only where there is one).
                weakref.ref(view) if run is not None else _nothing,
                self.impl.batch_runner(index) if run is not None else None,
                self.impl.lists_runner(index) if run is not None else None,
            )

    def _run_checked(
        self, batch: Any, lengths: Any, index: Any, mode: int
    ) -> np.ndarray | int | None:
        """A step answered by the backend's runners (``mode`` of
        ``backend.RUN_MODES``), or None where they do not take it: a
        HashBatch against the index checked last, with the table it had
        then (its host view is made once per table; the runners exist only
        for 8-byte keys on the backend's host path), either from_ints' batch
        of one list or one holding its host arrays. Nothing else is tested
        here; the runners check the lengths."""
        checked_index, _, _, run, checked_view, run_many, _ = self._checked
        if run is None or type(batch) is not HashBatch or index is not checked_index():
            return None
        view = index.table_view
        if view is not checked_view() or view is None:
            return None
        rows = batch.one_values
        if rows is not None:
            # A scheduler step of one request (from_ints' short path).
            return run(rows, lengths, view, mode)
        d = batch.__dict__
        host = d.get("_host")
        if host is not None and d.get("hash_bytes") == 8:
            # A CPU batch holding its host arrays (from_ints' batch of
            # lists, or one read on the host before).
            return run_many(host, lengths, view, mode)
        return None

    def _lengths(self, value: Any, name: str, n: int | None) -> torch.Tensor:
        """``value`` (per-request lengths, any form ``kernels/checks.py``
        takes) as an int64 ``[n]`` tensor on the engine's device."""
        return check_lengths(value, name, n, self.device)

    def _empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.zeros(0, dtype=torch.int64, device=self.device),
            torch.zeros(0, self.plan.num_groups, 3, dtype=torch.int64,
                        device=self.device),
        )  # fmt: skip

    def _find(
        self,
        batch: HashBatch,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(batch) == 0:
            return self._empty()
        return self.impl.find(batch.view(), max_lengths, index, bool(apply_eagle))

    # -- public API -----------------------------------------------------------

    def find_longest_cache_hit(
        self,
        batch: HashBatch,
        max_lengths: torch.Tensor | Sequence[int],
        index: KeyIndex,
        apply_eagle: bool = True,
        with_masks: bool = False,
    ) -> LookupResult:
        """The longest cache hit of every request.

        Args:
            batch: ``B`` requests' block hashes (``hashes [total, W]`` int64,
                ``offsets [B + 1]`` int64).
            max_lengths: int64 ``[B]``, the most tokens each hit may cover.
            index: the store's keys.
            apply_eagle: apply the EAGLE last-block drop (lookups want it).
            with_masks: also return each group's load mask.

        Returns:
            :class:`LookupResult` with ``hit_lengths`` int64 ``[B]``.
        """
        if not with_masks:
            hits = self._run_checked(
                batch, max_lengths, index, RUN_FIND_EAGLE if apply_eagle else RUN_FIND
            )
            if hits is not None:
                result = _new(LookupResult)
                result.__dict__["_hits"] = hits
                return result
        self._check_batch(batch, index)
        impl = self.impl
        max_lengths = impl.lengths(max_lengths, "max_lengths", len(batch))
        hit, mask_spans = impl.find_batch(
            batch, max_lengths, index, bool(apply_eagle), with_masks
        )
        if mask_spans is None or not with_masks:
            return LookupResult.of_hits(hit)
        masks, lengths = _expand_mask_spans(mask_spans)
        if type(hit) is not torch.Tensor:
            hit = _hit_tensor(hit)
        return LookupResult(hit, masks, lengths)

    def find_hit_list(
        self,
        requests: HashBatch | Sequence[Sequence[int] | np.ndarray],
        max_lengths: torch.Tensor | np.ndarray | Sequence[int],
        index: KeyIndex,
        apply_eagle: bool = True,
        block_size: int = 1,
    ) -> list[int]:
        """A router's step in one call: every request's longest cache hit as
        Python ints, in blocks of ``block_size`` tokens. For a
        :class:`KeyIndex`, the answer of ``find_longest_cache_hit(
        HashBatch.from_ints(requests, index.hash_bytes, engine.device),
        max_lengths, index, apply_eagle).hit_list(block_size)``, its errors
        too (``block_size`` checked first, then ``index``).

        Args:
            requests: ``B`` requests' block hashes in any form
                :meth:`HashBatch.from_ints` takes (a list of lists of Python
                ints is the fast one), or a :class:`HashBatch`.
            max_lengths: ``B`` lengths, the most tokens each hit may cover
                (a list of ints, an integer numpy array, a tensor: any form
                :meth:`find_longest_cache_hit` takes).
            index: the store's keys.
            apply_eagle: apply the EAGLE last-block drop.
            block_size: tokens per block of the answer (``hit //
                block_size``), an int in ``[1, 2**63)``.

        Returns ``B`` Python ints. Where the backend has a lists runner
        (numba, 8-byte keys, an index this engine checked before with the
        table it holds now), a list of lists of ints, lengths as a list of
        ints or an integer numpy array and ``apply_eagle`` a bool take it:
        one encode and one compiled call, none of the batch's, the result's
        or the lengths' Python objects. Anything it does not take (other
        forms, a bad item, a step large enough for the scan's threads) goes
        the general way.

        Raises TypeError / ValueError naming the argument, as the general
        way does (``requests`` by request and position, ``block_size``,
        ``index`` when it is not a KeyIndex).
        """
        if type(block_size) is not int or not 0 < block_size <= INT64_MAX:
            # Checked before any work (an int from here on: hit_list's own
            # test then passes at once).
            block_size = check_int(block_size, "block_size", 1, INT64_MAX + 1)
        if type(requests) is list and type(apply_eagle) is bool:
            checked_index, _, _, _, checked_view, _, lists = self._checked
            if lists is not None and index is checked_index():
                view = index.table_view
                if view is checked_view() and view is not None:
                    mode = RUN_FIND_EAGLE if apply_eagle else RUN_FIND
                    hits = lists(requests, max_lengths, view, mode, block_size)
                    if hits is not None:
                        return hits
        if not isinstance(index, KeyIndex):
            # Before from_ints, which would read its width.
            raise TypeError(f"index must be a KeyIndex, got {type(index).__name__}")
        if not isinstance(requests, HashBatch):
            requests = HashBatch.from_ints(requests, index.hash_bytes, self.device)
        return self.find_longest_cache_hit(
            requests, max_lengths, index, bool(apply_eagle)
        ).hit_list(block_size)

    def load_masks(
        self, batch: HashBatch, token_lens: torch.Tensor | Sequence[int]
    ) -> LookupResult:
        """Per-group load masks at ``token_lens`` (int64 ``[B]``, already
        EAGLE-pruned hit lengths): a store holding every key, no EAGLE drop."""
        self._check_batch(batch, None, need_index=False)
        token_lens = self._lengths(token_lens, "token_lens", len(batch))
        hit, mask_spans = self._find(batch, token_lens, None, False)
        masks, lengths = _expand_mask_spans(mask_spans)
        return LookupResult(hit, masks, lengths)

    def align(self, lengths: torch.Tensor) -> torch.Tensor:
        """``lengths`` (int64) rounded down to the hit alignment."""
        a = self.plan.alignment
        return torch.div(lengths, a, rounding_mode="floor") * a

    def lookup(
        self,
        batch: HashBatch,
        num_tokens: torch.Tensor | Sequence[int],
        index: KeyIndex,
    ) -> torch.Tensor:
        """The store worker's rule, batched: tokens of each prompt to load.

        Args:
            batch: ``B`` prompts' block hashes.
            num_tokens: int64 ``[B]``, each prompt's length in tokens.
            index: the store's keys.

        Returns:
            int64 ``[B]``. Only the keys the worker would ask about count as
            present; a hit covering the whole prompt is re-derived at
            ``num_tokens - 1`` so the last token is recomputed.
        """
        hits = self._run_checked(batch, num_tokens, index, RUN_LOOKUP)
        if hits is not None:
            return _hit_tensor(hits)
        self._check_batch(batch, index)
        impl = self.impl
        num_tokens = impl.lengths(num_tokens, "num_tokens", len(batch))
        return impl.lookup_batch(batch, num_tokens, index)

    def lookup_unchecked(
        self, batch: HashBatch, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """:meth:`lookup` without input validation, on this engine's backend,
        for callers that have checked their inputs (``num_tokens`` int64
        ``[B]`` >= 0 on the engine's device) and must not sync with the host
        (torch custom ops, captured CUDA graphs). The triton backend makes no
        host sync; numba and the reference run on the host anyway; the torch
        backend sizes its rounds from the data and syncs."""
        if len(batch) == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return self.impl.lookup(batch.view(), num_tokens, index)

    def lookup_candidates(
        self, batch: HashBatch, num_tokens: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(group, hash)`` keys the store worker asks about, for the whole
        batch: ``(group_ids int64 [K], rows int64 [K])`` with ``rows`` indexing
        ``batch.hashes``. Not deduplicated; grouped by group, then request."""
        self._check_batch(batch, None, need_index=False)
        num_tokens = self._lengths(num_tokens, "num_tokens", len(batch))
        if len(batch) == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return empty, empty
        with torch.inference_mode():
            gids, rows = worker_candidates(self.plan, batch.offsets, num_tokens)
        return gids.clone(), rows.clone()

    def store_masks(
        self,
        aligned_lens: torch.Tensor | Sequence[int],
        start_tokens: torch.Tensor | Sequence[int] | None = None,
        num_prompt_tokens: torch.Tensor | Sequence[int] | None = None,
    ) -> MaskBatch:
        """Per-group store masks, batched: equal to the reference's
        ``store_mask(aligned_lens[b], start_tokens[b], num_prompt_tokens[b])``
        for every request ``b`` (all int64 ``[B]``)."""
        aligned = check_lengths(aligned_lens, "aligned_lens", None, self.device,
                                multiple_of=self.plan.alignment)  # fmt: skip
        n = aligned.shape[0]
        check_mask_size(aligned, self._min_block_size, "aligned_lens")
        start = (
            torch.zeros_like(aligned)
            if start_tokens is None
            else self._lengths(start_tokens, "start_tokens", n)
        )
        prompt = (
            None
            if num_prompt_tokens is None
            else self._lengths(num_prompt_tokens, "num_prompt_tokens", n)
        )
        return self._reachable(
            aligned, start, prompt, self.layout.retention_interval, store=True
        )

    def lookup_masks(self, aligned_lens: torch.Tensor | Sequence[int]) -> MaskBatch:
        """Per-group lookup masks, batched (the reference's ``lookup_mask``)."""
        aligned = check_lengths(aligned_lens, "aligned_lens", None, self.device,
                                multiple_of=self.plan.alignment)  # fmt: skip
        check_mask_size(aligned, self._min_block_size, "aligned_lens")
        return self._reachable(
            aligned, torch.zeros_like(aligned), None, None, store=False
        )

    def _reachable(
        self,
        aligned: torch.Tensor,
        start: torch.Tensor,
        prompt: torch.Tensor | None,
        retention: int | None,
        store: bool,
    ) -> MaskBatch:
        """Each group's store (``store``) or lookup mask over the chunks from
        ``cdiv(start, block_size)`` up to ``aligned // block_size``, by the
        group's kind (``SpecKind.batched_store_mask`` /
        ``batched_reachable_mask``)."""
        layout = self.layout
        sched = layout.scheduler_block_size
        # reference.replay_boundaries per request, batched; a boundary listed
        # twice only ORs the same chunks in again, so no deduplication.
        boundaries: list[torch.Tensor] = []
        if prompt is not None:
            if layout.eagle_group_ids:
                resend = (prompt - 1) // sched * sched
                ext = prompt // sched * sched
                boundaries = [
                    torch.clamp(resend - sched, min=0),
                    torch.clamp(ext - sched, min=0),
                ]
            else:
                boundaries = [prompt - 1]
        masks, lengths, dense = [], [], []
        for g_idx, spec in enumerate(layout.coverage_specs):
            block_size = spec.block_size
            end = torch.div(aligned, block_size, rounding_mode="floor")
            first = torch.clamp(cdiv(start, block_size), min=0)
            first = torch.minimum(end, first)
            length = end - first
            width = int(length.max().item()) if length.numel() else 0
            chunks = first[:, None] + torch.arange(width, device=self.device)[None, :]
            inside = chunks < end[:, None]
            kind = kind_of(spec)
            mask_fn = kind.batched_store_mask if store else kind.batched_reachable_mask
            mask, is_dense = mask_fn(
                spec, chunks, inside, sched, g_idx in layout.eagle_group_ids,
                retention, boundaries,
            )  # fmt: skip
            if is_dense:
                mask = inside.clone()
            masks.append(mask & inside)
            lengths.append(length)
            dense.append(is_dense)
        return MaskBatch(tuple(masks), tuple(lengths), tuple(dense))

    # -- fleets of engines (coordinator/fleet_index.py) ---------------------------

    def fleet_hits(
        self,
        batch: HashBatch,
        max_lengths: Lengths,
        fleet: Any,
        apply_eagle: bool = True,
    ) -> torch.Tensor:
        """:meth:`find_longest_cache_hit` of every request against every
        engine of ``fleet`` (a :class:`~kvhit.coordinator.fleet_index.FleetIndex`),
        one call: int64 ``[B, E]``, entry ``[b, e]`` the hit against engine
        ``e``'s keys alone (0 for an engine removed from the fleet).
        ``max_lengths``: int64 ``[B]``. See ``coordinator/fleet_scoring.py``
        for the cost per layout."""
        return self._fleet_hits(batch, max_lengths, "max_lengths", fleet,
                                bool(apply_eagle), False)  # fmt: skip

    def fleet_lookup(
        self,
        batch: HashBatch,
        num_tokens: torch.Tensor | Sequence[int],
        fleet: Any,
    ) -> torch.Tensor:
        """:meth:`lookup` (the store worker's rule, ``num_tokens - 1`` for a
        whole-prompt hit) of every request against every engine of ``fleet``:
        int64 ``[B, E]``; ``num_tokens`` int64 ``[B]``."""
        return self._fleet_hits(batch, num_tokens, "num_tokens", fleet, True, True)

    def fleet_hit_array(
        self,
        requests: HashBatch | Sequence[Sequence[int] | np.ndarray],
        max_lengths: torch.Tensor | np.ndarray | Sequence[int],
        fleet: Any,
        apply_eagle: bool = True,
        block_size: int = 1,
    ) -> np.ndarray:
        """A router's fleet step in one call: every request's hit against
        every engine of ``fleet``, in blocks of ``block_size`` tokens, as
        numpy. The answer of ``fleet_hits(HashBatch.from_ints(requests,
        fleet.hash_bytes, engine.device), max_lengths, fleet,
        apply_eagle).cpu().numpy() // block_size``, its errors too
        (``block_size`` checked first, then ``fleet``).

        Args:
            requests: ``B`` requests' block hashes in any form
                :meth:`HashBatch.from_ints` takes (a list of lists of Python
                ints is the fast one), or a :class:`HashBatch`.
            max_lengths: ``B`` lengths, the most tokens each hit may cover
                (a list of ints, an integer numpy array, a tensor: any form
                :meth:`fleet_hits` takes).
            fleet: a :class:`~kvhit.coordinator.fleet_index.FleetIndex`.
            apply_eagle: apply the EAGLE last-block drop.
            block_size: tokens per block of the answer, an int in ``[1,
                2**63)``.

        Returns int64 numpy ``[B, E]`` (a new array; 0 for an engine
        removed from the fleet). Where the fleet's family has a lists kernel
        (numba, 8-byte keys, a layout whose one SpecGroup is full attention,
        not fine-grained, a CPU engine), a list of lists of ints with
        lengths as a list of ints or an integer numpy array and
        ``apply_eagle`` a bool take it: one encode and one compiled call,
        none of the batch's, the tensor's or the lengths' Python objects
        (``FleetIndex.router_lists``). Anything it does not take goes the
        general way.

        Raises TypeError / ValueError naming the argument, as the general
        way does.
        """
        if type(block_size) is not int or not 0 < block_size <= INT64_MAX:
            block_size = check_int(block_size, "block_size", 1, INT64_MAX + 1)
        router = getattr(fleet, "router_lists", None)
        if router is not None and type(requests) is list and type(apply_eagle) is bool:
            hits = router(self, requests, max_lengths, apply_eagle, block_size)
            if hits is not None:
                return hits
        if router is None:
            # Before from_ints, which would read its width.
            raise TypeError(f"fleet must be a FleetIndex, got {type(fleet).__name__}")
        if not isinstance(requests, HashBatch):
            requests = HashBatch.from_ints(requests, fleet.hash_bytes, self.device)
        out = self.fleet_hits(requests, max_lengths, fleet, bool(apply_eagle))
        out = out.cpu().numpy()
        return out // block_size if block_size != 1 else out

    def _fleet_hits(
        self, batch: Any, lens: Any, name: str, fleet: Any, apply_eagle: bool,
        lookup: bool,
    ) -> torch.Tensor:  # fmt: skip
        # The fleet does the work through three methods, so that this module
        # imports no fleet module (they import it): ``router_hits`` (a
        # router's call, checked cheaply and answered in one kernel dispatch,
        # or None), ``check_batch`` and the trusted ``hits_unchecked``.
        router = getattr(fleet, "router_hits", None)
        if router is not None:
            hit = router(self, batch, lens, apply_eagle, lookup)
            if hit is not None:
                return hit
        self._check_batch(batch, None, need_index=False)
        if router is None:
            raise TypeError(f"fleet must be a FleetIndex, got {type(fleet).__name__}")
        fleet.check_batch(batch, self.device)
        lens = self._lengths(lens, name, len(batch))
        return fleet.hits_unchecked(self, batch, lens, apply_eagle, lookup)


__all__ = [
    "BACKENDS",
    "BACKEND_CLASSES",
    "LookupEngine",
    "LookupResult",
    "MaskBatch",
    "backend_class",
]
