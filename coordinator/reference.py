"""The scalar reference: vLLM 0.33.0's external-store hit semantics, in pure Python.

This is the oracle every backend is checked against. :class:`ReferenceCoordinator`
follows, rule for rule, ``MooncakeStoreCoordinator`` (find_longest_cache_hit,
load/store/lookup masks), ``eagle_proof_margin``, ``replay_boundaries`` and the
Mooncake store worker's ``lookup``. The per-manager ``find_longest_cache_hit`` /
``reachable_block_mask`` ports (full attention, sliding window, Mamba, chunked
local) live in :mod:`kvhit.coordinator.managers`, as vLLM keeps
``single_type_kv_cache_manager.py`` apart from its coordinator; the coordinator
looks each SpecGroup's up in the spec-kind registry (:mod:`kvhit.coordinator.kinds`)
and never branches on a spec type. It needs neither torch nor vLLM.

A loaded block is represented by ``True`` and vLLM's null block by ``False``, so
a group's load mask is exactly its list of hit blocks.

Where vLLM would fail with an ``IndexError`` (a ``max_length`` that reaches past
the block hashes a sliding-window, Mamba or chunked-local scan must index), the
reference raises ``ValueError`` instead of returning a number vLLM never would.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvhit.coordinator.kinds import SpecKind, kind_of
from kvhit.coordinator.managers import BlockHash, HashesTooShort, ScanResult, StorePool
from kvhit.coordinator.specs import CacheLayout
from kvhit.kernels.contract import cdiv
from kvhit.kernels.masks import asked_chunks

__all__ = [
    "Masks",
    "OptMasks",
    "ReferenceCoordinator",
    "replay_boundaries",
]

Masks = tuple[list[bool], ...]
OptMasks = tuple["list[bool] | None", ...]


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Positions a later request replaying a prompt can resume at (vLLM's
    ``replay_boundaries``)."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


class _Convergence:
    """What the multi-group convergence loop carries from round to round."""

    __slots__ = ("blocks_by_group", "length_by_group", "eagle_verified")

    def __init__(self, num_groups: int) -> None:
        self.blocks_by_group: list[list[bool] | None] = [None] * num_groups
        self.length_by_group = [0] * num_groups
        # SpecGroups whose EAGLE drop has been applied at the current hit.
        self.eagle_verified: set[int] = set()

    def record(
        self, group_ids: Sequence[int], blocks: list[list[bool]], length: int
    ) -> None:
        for gid, blk in zip(group_ids, blocks, strict=True):
            self.blocks_by_group[gid] = blk
            self.length_by_group[gid] = length


class ReferenceCoordinator:
    """vLLM 0.33.0's ``MooncakeStoreCoordinator`` plus the store worker's
    ``lookup`` rule, scalar and in pure Python.

    ``block_hashes`` are ``bytes`` (one per ``hash_block_size`` tokens, chained);
    ``exists`` is a collection of ``(group_id, hash)`` keys present in the store,
    or ``None`` for "every key is present".
    """

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.hash_block_size = layout.hash_block_size
        self.scheduler_block_size = layout.scheduler_block_size
        self.alignment = layout.alignment
        self._sg_kinds: tuple[SpecKind, ...] = tuple(
            kind_of(sg.spec) for sg in layout.spec_groups
        )
        self._group_kinds: tuple[SpecKind, ...] = tuple(
            kind_of(spec) for spec in layout.coverage_specs
        )

    # -- hit search -------------------------------------------------------

    def align_lookup_length(self, length: int) -> int:
        """``length`` rounded down to the hit alignment."""
        return length // self.alignment * self.alignment

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        exists: Collection[tuple[int, bytes]] | None,
        apply_eagle: bool = True,
    ) -> tuple[Masks, int]:
        """Returns ``(load_mask_per_group, hit_length)``.

        ``mask[g][i]`` is True iff group ``g`` loads its chunk ``i`` (sliding
        window and Mamba load only their tail); groups that are not prefix
        cacheable get an empty mask. ``apply_eagle=False`` skips the EAGLE
        last-block drop (the load path, whose length is already pruned).

        Raises:
            ValueError: ``max_length`` is negative, or reaches past the hashes a scan must
                index (vLLM raises ``IndexError`` there).
        """
        if max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {max_length}")
        try:
            return self._find(
                list(block_hashes), max_length, StorePool(exists), apply_eagle
            )
        except HashesTooShort:
            raise ValueError(
                f"max_length ({max_length}) needs more block hashes than the "
                f"{len(block_hashes)} given (hash_block_size "
                f"{self.hash_block_size})"
            ) from None

    def _scan(
        self,
        idx: int,
        raw: list[BlockHash],
        max_length: int,
        pool: StorePool,
        drop_eagle: bool,
    ) -> ScanResult:
        """SpecGroup ``idx``'s manager scan, as its kind's registry entry says."""
        sg = self.layout.spec_groups[idx]
        return self._sg_kinds[idx].scan(
            raw, max_length, sg.group_ids, pool, sg.spec, self.hash_block_size,
            drop_eagle, self.alignment,
        )  # fmt: skip

    def _find(
        self,
        raw: list[BlockHash],
        max_length: int,
        pool: StorePool,
        apply_eagle: bool,
    ) -> tuple[Masks, int]:
        layout = self.layout
        if len(layout.spec_groups) == 1:
            sg = layout.spec_groups[0]
            blocks, hit_length = self._scan(
                0, raw, max_length, pool, apply_eagle and sg.use_eagle
            )
            out: list[list[bool]] = [[] for _ in range(layout.num_groups)]
            for gid, blk in zip(sg.group_ids, blocks, strict=True):
                out[gid] = blk
            return tuple(out), hit_length
        state, hit_length = self._converge(raw, max_length, pool, apply_eagle)
        self._trim_full_attention(state, hit_length)
        blocks_by_group = state.blocks_by_group
        return tuple(b if b is not None else [] for b in blocks_by_group), hit_length

    def _converge(
        self,
        raw: list[BlockHash],
        max_length: int,
        pool: StorePool,
        apply_eagle: bool,
    ) -> tuple[_Convergence, int]:
        """vLLM's multi-group loop: rounds over every SpecGroup until the
        common hit stops shrinking (one round for a simple hybrid)."""
        state = _Convergence(self.layout.num_groups)
        hit_length = max_length
        while True:
            curr = self._round(state, raw, hit_length, pool, apply_eagle)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.layout.is_simple_hybrid:
                break
        return state, hit_length

    def _round(
        self,
        state: _Convergence,
        raw: list[BlockHash],
        curr: int,
        pool: StorePool,
        apply_eagle: bool,
    ) -> int:
        """One pass over the SpecGroups, each shrinking the hit ``curr``."""
        layout = self.layout
        for idx, sg in enumerate(layout.spec_groups):
            kind = self._sg_kinds[idx]
            first = sg.group_ids[0]
            if kind.is_full_attention and state.blocks_by_group[first] is not None:
                # Full attention is scanned once; later rounds only clip it.
                curr = min(curr, state.length_by_group[first])
                continue
            # The EAGLE drop applies once per hit, not again on every retry
            # (re-applying it spiralled hits down: vllm-project/vllm #32802).
            drop_eagle = (
                apply_eagle and sg.use_eagle and idx not in state.eagle_verified
            )
            bound = curr
            # EAGLE may peek one proof margin past the hit and drop back;
            # never a Mamba group, whose state there would be unverified
            # (an unsafe Mamba hit: vllm-project/vllm PR #45614).
            if drop_eagle and kind.takes_proof_margin:
                margin = layout.proof_margins[first]
                bound = min(curr + margin, len(raw) * self.hash_block_size)
            blocks, new_len = self._scan(idx, raw, bound, pool, drop_eagle)
            if drop_eagle:
                state.eagle_verified.add(idx)
            elif new_len < curr:
                state.eagle_verified.clear()
            curr = new_len
            state.record(sg.group_ids, blocks, new_len)
        return curr

    def _trim_full_attention(self, state: _Convergence, hit_length: int) -> None:
        """Full-attention masks end at the final hit (scanned once, they may
        hold blocks past it)."""
        for idx, sg in enumerate(self.layout.spec_groups):
            if not self._sg_kinds[idx].is_full_attention:
                continue
            num_blocks = cdiv(hit_length, sg.block_size)
            for gid in sg.group_ids:
                blk = state.blocks_by_group[gid]
                assert blk is not None
                del blk[num_blocks:]

    def load_mask(self, block_hashes: Sequence[BlockHash], token_len: int) -> Masks:
        """Per-group load masks at ``token_len`` (an already EAGLE-pruned hit
        length): the masks of a lookup over a store holding every key, with no
        EAGLE drop."""
        masks, _ = self.find_longest_cache_hit(
            block_hashes, token_len, None, apply_eagle=False
        )
        return masks

    # -- masks ------------------------------------------------------------

    def store_mask(
        self,
        aligned_len: int,
        start_token: int = 0,
        num_prompt_tokens: int | None = None,
    ) -> OptMasks:
        """Per-group masks of the chunks after ``start_token`` to write to the
        store (``None``: all of them). Mamba groups are always all-False."""
        return self._reachable_masks(
            aligned_len,
            start_token,
            retention_interval=self.layout.retention_interval,
            num_prompt_tokens=num_prompt_tokens,
            store=True,
        )

    def lookup_mask(self, aligned_len: int) -> OptMasks:
        """Per-group masks of the chunks to probe as aligned hit boundaries
        (``None``: all of them)."""
        return self._reachable_masks(
            aligned_len, 0, retention_interval=None, num_prompt_tokens=None
        )

    def _reachable_masks(
        self,
        aligned_len: int,
        start_token: int,
        *,
        retention_interval: int | None,
        num_prompt_tokens: int | None,
        store: bool = False,
    ) -> OptMasks:
        layout = self.layout
        if aligned_len % self.alignment:
            raise ValueError(
                f"aligned_len ({aligned_len}) must be a multiple of the hit "
                f"alignment ({self.alignment})"
            )
        boundaries: tuple[int, ...] = (
            ()
            if num_prompt_tokens is None
            else replay_boundaries(
                num_prompt_tokens,
                self.scheduler_block_size,
                use_eagle=bool(layout.eagle_group_ids),
            )
        )
        masks: list[list[bool] | None] = []
        for g_idx, spec in enumerate(layout.coverage_specs):
            kind = self._group_kinds[g_idx]
            end_chunk = aligned_len // spec.block_size
            start_chunk = min(end_chunk, max(0, cdiv(start_token, spec.block_size)))
            mask_fn = kind.store_mask if store else kind.reachable_mask
            masks.append(
                mask_fn(
                    spec,
                    start_chunk,
                    end_chunk,
                    self.scheduler_block_size,
                    g_idx in layout.eagle_group_ids,
                    retention_interval,
                    boundaries,
                )  # fmt: skip
            )
        return tuple(masks)

    # -- the store worker's rule -------------------------------------------

    def lookup_candidates(
        self, num_tokens: int, block_hashes: Sequence[BlockHash]
    ) -> list[tuple[int, bytes]]:
        """The ``(group, hash)`` keys the store worker asks the store about for
        a lookup of ``num_tokens`` tokens, in its order (duplicates kept)."""
        token_len = self.align_lookup_length(num_tokens)
        if not block_hashes or token_len <= 0:
            return []
        layout = self.layout
        hbs = self.hash_block_size
        n_hashes = len(block_hashes)
        out: list[tuple[int, bytes]] = []
        if layout.partial_hash_hits:
            units = asked_chunks(n_hashes, token_len, hbs, 1, sparse=False)
            for g_idx, g in enumerate(layout.groups):
                if g.prefix_cacheable:
                    out.extend((g_idx, bytes(block_hashes[u])) for u in range(units))
            return out
        masks = self.lookup_mask(token_len)
        for g_idx, g in enumerate(layout.groups):
            if not g.prefix_cacheable:
                continue
            block_size = g.spec.block_size
            hashes_per_block = block_size // hbs
            mask = masks[g_idx]
            limit = asked_chunks(
                n_hashes, token_len, block_size, hashes_per_block, mask is not None
            )
            for c in range(limit):
                if mask is None or mask[c]:
                    key = bytes(block_hashes[(c + 1) * hashes_per_block - 1])
                    out.append((g_idx, key))
        return out

    def lookup(
        self,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        exists: Collection[tuple[int, bytes]] | None,
    ) -> int:
        """The store worker's ``lookup``: tokens of a ``num_tokens``-token
        prompt to load from the store.

        The worker only learns about the keys it asks (``lookup_candidates``),
        so the hit is computed over those; a hit covering the whole prompt is
        re-derived at ``num_tokens - 1`` so the last token is recomputed.

        Raises:
            ValueError: where vLLM's worker raises ``IndexError``: a scan that
                reaches past the hashes, or a hit whose boundary hash is past
                them.
        """
        token_len = self.align_lookup_length(num_tokens)
        if not block_hashes or token_len <= 0:
            return 0
        candidates = self.lookup_candidates(num_tokens, block_hashes)
        if not candidates:
            return 0
        if exists is None:
            present = set(candidates)
        else:
            present = {c for c in candidates if c in exists}
        _, hit = self.find_longest_cache_hit(block_hashes, token_len, present)
        if hit >= num_tokens:
            usable = self.align_lookup_length(num_tokens - 1)
            if usable <= 0:
                return 0
            _, hit = self.find_longest_cache_hit(block_hashes, usable, present)
        if hit > 0 and hit // self.hash_block_size > len(block_hashes):
            # The worker then reads the hash at the hit boundary to name each
            # group's tail key: vLLM raises IndexError (chunked local attention
            # counts blocks before its window as hit without reading a hash).
            raise ValueError(
                f"the hit ({hit} tokens) reaches past the {len(block_hashes)} block "
                f"hashes given; vLLM's store worker fails here"
            )
        return hit
