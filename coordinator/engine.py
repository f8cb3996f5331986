"""LookupEngine: one call per scheduler step answers every request in a batch.

Backends (identical results on every input; parity tests prove it):

* ``"reference"``: loops :class:`ReferenceCoordinator` over the requests, with
  the index's keys as a Python set. The baseline.
* ``"torch"``: :mod:`kvhit.coordinator.torch_backend`, vectorised over the
  batch, probing the :class:`KeyIndex` table directly. The CPU default.
* ``"triton"``: per-request programs in :mod:`kvhit.kernels.scan` that probe
  the table from inside the kernel (CUDA; the CPU only under
  ``TRITON_INTERPRET=1``). The default on CUDA.

Past a request's hashes, the batched backends count a probe as a miss; the
reference raises ``ValueError`` there (vLLM raises ``IndexError``), so the
backends agree wherever the reference answers.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhit.coordinator.key_index import KeyIndex, probe_table
from kvhit.coordinator.packing import HashBatch, unpack_hashes
from kvhit.coordinator.plan import ScanPlan, cdiv
from kvhit.coordinator.reference import ReferenceCoordinator
from kvhit.coordinator.specs import CacheLayout, Mamba, SlidingWindow
from kvhit.coordinator.torch_backend import (
    TorchScanner,
    _Batch,
    asked_chunks,
    worker_candidates,
)

BACKENDS = ("auto", "torch", "triton", "reference")


@dataclass(frozen=True)
class LookupResult:
    """What :meth:`LookupEngine.find_longest_cache_hit` returns.

    ``hit_lengths``: int64 ``[B]``, tokens hit per request. With
    ``with_masks=True``, ``masks[g]`` is bool ``[B, C_g]`` (``C_g`` the longest
    mask of group ``g`` in the batch) and ``mask_lengths[g]`` int64 ``[B]``:
    request ``b``'s mask for group ``g`` is ``masks[g][b, :mask_lengths[g][b]]``,
    equal to the reference's list; entries past the length are False.
    """

    hit_lengths: torch.Tensor
    masks: tuple[torch.Tensor, ...] | None = None
    mask_lengths: tuple[torch.Tensor, ...] | None = None

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


def _expand_tri(
    tri: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``tri [B, G, 3]`` (length, lo, hi) -> bool masks ``[B, C_g]`` and lengths."""
    masks, lengths = [], []
    for g in range(tri.shape[1]):
        length, lo, hi = tri[:, g, 0], tri[:, g, 1], tri[:, g, 2]
        width = int(length.max().item()) if length.numel() else 0
        c = torch.arange(width, device=tri.device)[None, :]
        masks.append((c >= lo[:, None]) & (c < hi[:, None]) & (c < length[:, None]))
        lengths.append(length.clone())
    return tuple(masks), tuple(lengths)


def _canonical_device(device: torch.device | str) -> torch.device:
    """The device tensors made on ``device`` report: ``"cuda"`` becomes
    ``cuda:<current>``, ``"cpu:0"`` becomes ``cpu``, so that comparing it with
    a tensor's device is exact."""
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(f"device {device!r} is not available here ({exc})") from None


class LookupEngine:
    """Batched longest-prefix lookup over a :class:`KeyIndex`.

    Args:
        layout: the model's cache layout.
        backend: ``"auto"`` (triton on CUDA, torch elsewhere), ``"torch"``,
            ``"triton"`` or ``"reference"``.
        device: where batches and indexes live; defaults to the CPU.
        cpu_threads: intra-op threads torch may use while the torch backend
            runs on the CPU (restored afterwards; ``None`` leaves torch's
            setting alone). The scans are hundreds of small tensor ops, where
            extra threads only add barrier waits: on the 2-core CI machine
            under load, 1 thread took 25 ms for a batch that 2 threads took
            2.2 s for.
    """

    def __init__(
        self,
        layout: CacheLayout,
        backend: str = "auto",
        device: torch.device | str | None = None,
        cpu_threads: int | None = 1,
    ) -> None:
        if not isinstance(layout, CacheLayout):
            raise TypeError(
                f"layout must be a CacheLayout, got {type(layout).__name__}"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.layout = layout
        self.device = _canonical_device(device if device is not None else "cpu")
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.backend = backend
        if cpu_threads is not None and (
            isinstance(cpu_threads, bool)
            or not isinstance(cpu_threads, int)
            or cpu_threads < 1
        ):
            raise ValueError(f"cpu_threads must be None or >= 1, got {cpu_threads!r}")
        self.cpu_threads = cpu_threads
        self.plan = ScanPlan.from_layout(layout)
        self.reference = ReferenceCoordinator(layout)

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """Inference mode (no autograd bookkeeping: about 10% of a CPU batch),
        and on the CPU ``cpu_threads`` intra-op threads. Tensors made inside
        are inference tensors: public methods return clones of them."""
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

    # -- validation ---------------------------------------------------------

    def _check_batch(
        self, batch: Any, index: KeyIndex | None, need_index: bool = True
    ) -> None:
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

    def _lengths(self, value: Any, name: str, n: int) -> torch.Tensor:
        """``value`` as an int64 ``[n]`` tensor on the engine's device."""
        if isinstance(value, torch.Tensor):
            if value.dtype != torch.int64:
                raise TypeError(f"{name} must be int64, got {value.dtype}")
            if value.device != self.device:
                raise ValueError(
                    f"{name} is on {value.device}, the engine on {self.device}"
                )
            if value.dim() != 1 or value.numel() != n:
                raise ValueError(
                    f"{name} must have shape [{n}] (one per request), got "
                    f"{list(value.shape)}"
                )
            t = value
        elif isinstance(value, np.ndarray):
            if value.dtype.kind not in "iu":
                raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
            if value.ndim != 1 or value.shape[0] != n:
                raise ValueError(
                    f"{name} must have shape [{n}] (one per request), got "
                    f"{list(value.shape)}"
                )
            t = torch.from_numpy(value.astype(np.int64)).to(self.device)
        else:
            if isinstance(value, int | bool) or not isinstance(value, Sequence):
                raise TypeError(
                    f"{name} must be an int64 tensor or a sequence of ints, got "
                    f"{type(value).__name__}"
                )
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} requests")
            for v in value:
                if isinstance(v, bool | np.bool_) or not isinstance(
                    v, numbers.Integral
                ):
                    raise TypeError(f"{name} must hold ints, got {type(v).__name__}")
            t = torch.tensor(
                [int(v) for v in value], dtype=torch.int64, device=self.device
            )
        if t.numel() and int(t.min().item()) < 0:
            raise ValueError(f"{name} must be >= 0, got {int(t.min().item())}")
        return t

    def _internal(
        self, batch: HashBatch, token_len: torch.Tensor | None = None
    ) -> _Batch:
        offsets = batch.offsets
        return _Batch(
            hashes=batch.hashes,
            offsets=offsets[:-1],
            lens=offsets[1:] - offsets[:-1],
            token_len=token_len,
        )

    # -- probing --------------------------------------------------------------

    @staticmethod
    def _index_prober(index: KeyIndex, hashes: torch.Tensor):
        table, W = index.table, index.W

        def probe(g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            if rows.numel() == 0:
                return torch.zeros(0, dtype=torch.bool, device=rows.device)
            return probe_table(table, W, g, hashes.index_select(0, rows))

        return probe

    @staticmethod
    def _all_present(g: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)

    def _run(
        self,
        batch: HashBatch,
        max_lengths: torch.Tensor,
        index: KeyIndex | None,
        apply_eagle: bool,
        token_len: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hits and mask triples ``(int64 [B], int64 [B, G, 3])``."""
        n = len(batch)
        if n == 0:
            return (
                torch.zeros(0, dtype=torch.int64, device=self.device),
                torch.zeros(
                    0, self.plan.num_groups, 3, dtype=torch.int64, device=self.device
                ),
            )
        internal = self._internal(batch, token_len)
        with self._threads():
            if self.backend == "triton":
                from kvhit.coordinator.triton_backend import TritonBackend

                hit, tri = TritonBackend(self.plan, self.device).find(
                    batch.view(token_len), max_lengths, index, apply_eagle
                )
            else:
                probe = (
                    self._all_present
                    if index is None
                    else self._index_prober(index, batch.hashes)
                )
                hit, tri = TorchScanner(self.plan, probe).find(
                    internal, max_lengths, apply_eagle
                )
        return hit.clone(), tri.clone()

    # -- reference backend --------------------------------------------------------

    @staticmethod
    def _index_set(index: KeyIndex) -> set[tuple[int, bytes]]:
        gids, hashes = index.keys()
        return set(
            zip(
                gids.cpu().tolist(),
                unpack_hashes(hashes.cpu(), index.hash_bytes),
                strict=True,
            )
        )

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
        self._check_batch(batch, index)
        max_lengths = self._lengths(max_lengths, "max_lengths", len(batch))
        if self.backend == "reference":
            exists = self._index_set(index)
            lists = batch.to_bytes()
            hits, all_masks = [], []
            for hl, m in zip(lists, max_lengths.tolist(), strict=True):
                masks, hit = self.reference.find_longest_cache_hit(
                    hl, m, exists, apply_eagle
                )
                hits.append(hit)
                all_masks.append(masks)
            hit_t = torch.tensor(hits, dtype=torch.int64, device=self.device)
            if not with_masks:
                return LookupResult(hit_t)
            return LookupResult(hit_t, *self._lists_to_masks(all_masks))
        hit, tri = self._run(batch, max_lengths, index, apply_eagle, None)
        if not with_masks:
            return LookupResult(hit)
        masks, lengths = _expand_tri(tri)
        return LookupResult(hit, masks, lengths)

    def _lists_to_masks(
        self, all_masks: list[tuple[list[bool], ...]]
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        masks, lengths = [], []
        for g in range(self.plan.num_groups):
            col = [m[g] for m in all_masks]
            width = max((len(c) for c in col), default=0)
            t = torch.zeros(len(col), width, dtype=torch.bool)
            for b, c in enumerate(col):
                if c:
                    t[b, : len(c)] = torch.tensor(c, dtype=torch.bool)
            masks.append(t.to(self.device))
            lengths.append(
                torch.tensor(
                    [len(c) for c in col], dtype=torch.int64, device=self.device
                )
            )
        return tuple(masks), tuple(lengths)

    def load_masks(
        self, batch: HashBatch, token_lens: torch.Tensor | Sequence[int]
    ) -> LookupResult:
        """Per-group load masks at ``token_lens`` (int64 ``[B]``, already
        EAGLE-pruned hit lengths): a store holding every key, no EAGLE drop."""
        self._check_batch(batch, None, need_index=False)
        token_lens = self._lengths(token_lens, "token_lens", len(batch))
        if self.backend == "reference":
            # The load mask is a lookup over a store holding every key, without
            # the EAGLE drop; its hit is reported as the batched backends do.
            found = [
                self.reference.find_longest_cache_hit(hl, t, None, apply_eagle=False)
                for hl, t in zip(batch.to_bytes(), token_lens.tolist(), strict=True)
            ]
            hits = torch.tensor(
                [h for _, h in found], dtype=torch.int64, device=self.device
            )
            return LookupResult(hits, *self._lists_to_masks([m for m, _ in found]))
        hit, tri = self._run(batch, token_lens, None, False, None)
        masks, lengths = _expand_tri(tri)
        return LookupResult(hit, masks, lengths)

    def align(self, lengths: torch.Tensor) -> torch.Tensor:
        """``lengths`` rounded down to the hit alignment."""
        a = self.plan.alignment
        return torch.div(lengths, a, rounding_mode="floor") * a

    def _has_candidates(self, batch: _Batch, token_len: torch.Tensor) -> torch.Tensor:
        """bool [B]: whether the store worker asks about any key at all."""
        plan = self.plan
        anyc = torch.zeros_like(token_len, dtype=torch.bool)
        for cp in plan.candidates:
            if not cp.cacheable:
                continue
            asked = asked_chunks(plan, cp, batch.lens, token_len)
            if plan.partial or not cp.sparse:
                anyc |= asked > 0
            elif cp.need > 0:
                # The lowest chunk in a sparse lookup mask.
                anyc |= asked > cp.shift + cp.per_segment - cp.need
        return anyc

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
        self._check_batch(batch, index)
        num_tokens = self._lengths(num_tokens, "num_tokens", len(batch))
        if self.backend == "reference":
            exists = self._index_set(index)
            return torch.tensor(
                [
                    self.reference.lookup(n, hl, exists)
                    for hl, n in zip(batch.to_bytes(), num_tokens.tolist(), strict=True)
                ],
                dtype=torch.int64,
                device=self.device,
            )
        with self._threads():
            out = self._lookup(batch, num_tokens, index)
        return out.clone()

    def _lookup(
        self, batch: HashBatch, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        if self.backend == "triton":
            from kvhit.coordinator.triton_backend import TritonBackend

            return TritonBackend(self.plan, self.device).lookup(
                batch.view(), num_tokens, index
            )
        out = torch.zeros_like(num_tokens)
        if len(batch) == 0:
            return out
        token_len = self.align(num_tokens)
        internal = self._internal(batch, token_len)
        ok = (
            (internal.lens > 0)
            & (token_len > 0)
            & self._has_candidates(internal, token_len)
        )
        first = ok.nonzero().squeeze(1)
        if first.numel() == 0:
            return out
        probe = self._index_prober(index, batch.hashes)
        hit = self._sub_find(batch, first, token_len[first], token_len, index, probe)
        out[first] = hit
        redo = first[hit >= num_tokens[first]]
        if redo.numel():
            usable = self.align(num_tokens[redo] - 1)
            out[redo] = 0
            pos = usable > 0
            again = redo[pos]
            if again.numel():
                out[again] = self._sub_find(
                    batch, again, usable[pos], token_len, index, probe
                )
        return out

    def lookup_unchecked(
        self, batch: HashBatch, num_tokens: torch.Tensor, index: KeyIndex
    ) -> torch.Tensor:
        """:meth:`lookup` without input validation, for callers that have
        checked their inputs and must not sync with the host (torch custom
        ops, captured CUDA graphs). On the triton backend it makes no host
        sync; the torch backend sizes its rounds from the data and syncs."""
        with self._threads():
            out = self._lookup(batch, num_tokens, index)
        return out.clone()

    def _sub_find(
        self,
        batch: HashBatch,
        req: torch.Tensor,
        max_lengths: torch.Tensor,
        token_len: torch.Tensor,
        index: KeyIndex,
        probe,
    ) -> torch.Tensor:
        """Hits of the requests ``req`` (int64 [R]) with the worker's candidate
        restriction at ``token_len`` (int64 [B])."""
        offsets = batch.offsets
        internal = _Batch(
            hashes=batch.hashes,
            offsets=offsets[:-1][req],
            lens=(offsets[1:] - offsets[:-1])[req],
            token_len=token_len[req],
        )
        hit, _ = TorchScanner(self.plan, probe).find(internal, max_lengths, True)
        return hit

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
        with self._threads():
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
        n = len(aligned_lens)
        aligned = self._lengths(aligned_lens, "aligned_lens", n)
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
        bad = torch.remainder(aligned, self.plan.alignment) != 0
        if bad.any():
            i = int(bad.nonzero()[0].item())
            raise ValueError(
                f"aligned_lens[{i}] ({int(aligned[i])}) must be a multiple of the hit "
                f"alignment ({self.plan.alignment})"
            )
        return self._reachable(
            aligned, start, prompt, self.layout.retention_interval, True
        )

    def lookup_masks(self, aligned_lens: torch.Tensor | Sequence[int]) -> MaskBatch:
        """Per-group lookup masks, batched (the reference's ``lookup_mask``)."""
        n = len(aligned_lens)
        aligned = self._lengths(aligned_lens, "aligned_lens", n)
        if (torch.remainder(aligned, self.plan.alignment) != 0).any():
            raise ValueError(
                f"aligned_lens must be multiples of the hit alignment ({self.plan.alignment})"
            )
        return self._reachable(aligned, torch.zeros_like(aligned), None, None, False)

    def _reachable(
        self,
        aligned: torch.Tensor,
        start: torch.Tensor,
        prompt: torch.Tensor | None,
        retention: int | None,
        exclude_mamba: bool,
    ) -> MaskBatch:
        layout = self.layout
        sched = layout.scheduler_block_size
        use_eagle = bool(layout.eagle_group_ids)
        bounds: list[torch.Tensor] = []
        if prompt is not None:
            if use_eagle:
                resend = (prompt - 1) // sched * sched
                ext = prompt // sched * sched
                bounds = [
                    torch.clamp(resend - sched, min=0),
                    torch.clamp(ext - sched, min=0),
                ]
            else:
                bounds = [prompt - 1]
        masks, lengths, dense = [], [], []
        for g_idx, spec in enumerate(layout.coverage_specs):
            bs = spec.block_size
            end = torch.div(aligned, bs, rounding_mode="floor")
            st = torch.clamp(-((-start) // bs), min=0)
            st = torch.minimum(end, st)
            length = end - st
            width = int(length.max().item()) if length.numel() else 0
            c = st[:, None] + torch.arange(width, device=self.device)[None, :]
            inside = c < end[:, None]
            is_dense = False
            if isinstance(spec, Mamba):
                if exclude_mamba:
                    m = torch.zeros_like(inside)
                else:
                    m, is_dense = self._mamba_mask(c, inside, bs, retention, bounds)
            elif isinstance(spec, SlidingWindow):
                m, is_dense = self._swa_mask(
                    c, inside, spec, g_idx in layout.eagle_group_ids, retention, bounds
                )
            else:
                m, is_dense = inside.clone(), True
            if is_dense:
                m = inside.clone()
            masks.append(m & inside)
            lengths.append(length)
            dense.append(is_dense)
        return MaskBatch(tuple(masks), tuple(lengths), tuple(dense))

    def _swa_mask(self, c, inside, spec, use_eagle, retention, bounds):
        sched = self.layout.scheduler_block_size
        bs = spec.block_size
        if sched % bs:
            return inside.clone(), True
        need = cdiv(spec.sliding_window - 1, bs) + (1 if use_eagle else 0)
        shift = 1 if use_eagle else 0
        m = torch.zeros_like(inside)
        segment = (
            sched if retention is None else (None if retention == 0 else retention)
        )
        if segment is not None:
            per = segment // bs
            if need >= per:
                return inside.clone(), True
            m |= (c >= shift) & (torch.remainder(c - shift, per) >= per - need)
        if retention is not None:
            for b in bounds:
                aligned = b // sched * sched
                e = (aligned // bs + shift)[:, None]
                m |= (c >= e - need) & (c < e)
        return m, False

    def _mamba_mask(self, c, inside, bs, retention, bounds):
        if retention is None:
            return inside.clone(), True
        sched = self.layout.scheduler_block_size
        m = torch.zeros_like(inside)
        if retention != 0:
            per = retention // bs
            if per <= 1:
                return inside.clone(), True
            m |= torch.remainder(c + 1, per) == 0
        for b in bounds:
            aligned = b // sched * sched
            m |= c == (aligned // bs - 1)[:, None]
        return m, False


__all__ = ["BACKENDS", "LookupEngine", "LookupResult", "MaskBatch"]
