"""The scalar reference: vLLM 0.33.0's external-store hit semantics, in pure Python.

This is the oracle every backend is checked against. It follows, rule for rule,
``MooncakeStoreCoordinator`` (find_longest_cache_hit, load/store/lookup masks),
the per-manager ``find_longest_cache_hit`` / ``reachable_block_mask`` classmethods
(full attention, sliding window, Mamba, chunked local), ``resolve_block_hashes``,
``BlockHashListWithBlockSize``, ``eagle_proof_margin``, ``replay_boundaries`` and
the Mooncake store worker's ``lookup``. It needs neither torch nor vLLM.

The per-manager functions below are the per-kind entries of
:mod:`kvhit.coordinator.kinds` (the registry says which kind uses which);
:class:`ReferenceCoordinator` looks them up there and never branches on a spec
type. The mask formulas they share with the batched backends are in
:mod:`kvhit.coordinator.masks`.

A loaded block is represented by ``True`` and vLLM's null block by ``False``, so
a group's load mask is exactly its list of hit blocks.

Where vLLM would fail with an ``IndexError`` (a ``max_length`` that reaches past
the block hashes a sliding-window, Mamba or chunked-local scan must index), the
reference raises ``ValueError`` instead of returning a number vLLM never would.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from kvhit.coordinator.masks import (
    asked_chunks,
    mamba_replay_mask,
    mamba_segment_mask,
    sliding_window_need,
    sparse_window_chunk,
    swa_replay_mask,
    swa_segment_chunks,
)
from kvhit.coordinator.specs import (
    CacheLayout,
    ChunkedLocal,
    FullAttention,
    Mamba,
    SlidingWindow,
    Spec,
)
from kvhit.kernels.contract import cdiv

if TYPE_CHECKING:
    from kvhit.coordinator.kinds import SpecKind

__all__ = [
    "BlockHash",
    "HashesTooShort",
    "Masks",
    "OptMasks",
    "ReferenceCoordinator",
    "StorePool",
    "cdiv",
    "chunked_local_hit",
    "every_block_reachable",
    "full_attention_hit",
    "mamba_hit",
    "mamba_reachable_mask",
    "no_block_stored",
    "replay_boundaries",
    "sliding_window_hit",
    "sliding_window_reachable_mask",
]

BlockHash = bytes
Masks = tuple[list[bool], ...]
OptMasks = tuple["list[bool] | None", ...]
# (blocks of each member group, hit length in tokens).
ScanResult = tuple[list[list[bool]], int]


class HashesTooShort(Exception):
    """A scan indexed past the end of the block hashes (vLLM: ``IndexError``).
    :meth:`ReferenceCoordinator.find_longest_cache_hit` turns it into a
    ``ValueError`` naming the lengths."""


class StorePool:
    """The store's contents as vLLM's ``ExternalCachedBlockPool`` sees them:
    ``exists`` holds ``(group_id, hash)`` keys, or is ``None`` for a store
    holding every key."""

    __slots__ = ("exists",)

    def __init__(self, exists: Collection[tuple[int, bytes]] | None) -> None:
        self.exists = exists

    def hit(self, block_hash: BlockHash, group_ids: Sequence[int]) -> bool:
        """Whether every member group holds ``block_hash`` (a merged SpecGroup
        hits only then)."""
        if self.exists is None:
            return True
        h = bytes(block_hash)
        return all((g, h) in self.exists for g in group_ids)


class _View:
    """``block_hashes`` seen at ``hashes_per_block`` hash units per block: block
    ``i`` is keyed by the last hash unit inside it
    (``BlockHashListWithBlockSize``)."""

    __slots__ = ("raw", "hashes_per_block")

    def __init__(self, raw: Sequence[BlockHash], hashes_per_block: int) -> None:
        self.raw = raw
        self.hashes_per_block = hashes_per_block

    def __len__(self) -> int:
        return len(self.raw) // self.hashes_per_block

    def __getitem__(self, idx: int) -> BlockHash:
        j = (idx + 1) * self.hashes_per_block - 1
        if j >= len(self.raw):
            raise HashesTooShort
        return self.raw[j]


def _raw_get(raw: Sequence[BlockHash], idx: int) -> BlockHash:
    if idx >= len(raw):
        raise HashesTooShort
    return raw[idx]


def _resolve(
    raw: Sequence[BlockHash],
    hash_block_size: int,
    block_size: int,
    fine_grained_ok: bool,
    hit_alignment: int,
) -> Sequence[BlockHash] | _View:
    """vLLM's ``resolve_block_hashes``: raw hashes when the sizes agree or when
    the manager probes hash-unit boundaries, else the per-block view."""
    if block_size == hash_block_size:
        return raw
    if (
        fine_grained_ok
        and hit_alignment < block_size
        and block_size % hit_alignment == 0
    ):
        return raw
    return _View(raw, block_size // hash_block_size)


def _get(view: Sequence[BlockHash] | _View, idx: int) -> BlockHash:
    if isinstance(view, _View):
        return view[idx]
    return _raw_get(view, idx)


# ---------------------------------------------------------------------------
# Per-manager scans (the registry's ``scan``): vLLM's ``find_longest_cache_hit``
# classmethods. All take the same arguments and return (blocks per member
# group, hit length); ``hit_alignment`` is the layout's hit alignment.
# ---------------------------------------------------------------------------


def full_attention_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: StorePool,
    spec: FullAttention,
    hash_block_size: int,
    drop_eagle: bool,
    hit_alignment: int,
) -> ScanResult:
    """``FullAttentionManager.find_longest_cache_hit``: the leading run of hit
    blocks, then (fine-grained) the longest hit hash boundary inside the next
    block; EAGLE drops one hit-alignment unit (at most a block)."""
    block_size = spec.block_size
    fine_grained = hit_alignment < block_size and block_size % hit_alignment == 0
    view = _resolve(raw, hash_block_size, block_size, True, hit_alignment)
    full = _View(raw, block_size // hit_alignment) if fine_grained else view
    n = 0
    # Phase 1: chained hashes, so the first miss ends the run.
    for i in range(min(max_length // block_size, len(full))):
        if not pool.hit(_get(full, i), group_ids):
            break
        n += 1
    blocks = n
    hit_length = n * block_size
    # Phase 2: the first non-full block's interior hash boundaries, longest first.
    if fine_grained:
        units_per_block = block_size // hit_alignment
        first = n * units_per_block
        max_partial = min(
            first + units_per_block - 1, max_length // hit_alignment, len(raw)
        )
        for fine_idx in range(max_partial - 1, first - 1, -1):
            if not pool.hit(raw[fine_idx], group_ids):
                continue
            blocks += 1
            hit_length = (fine_idx + 1) * hit_alignment
            break
    if drop_eagle and hit_length > 0:
        hit_length -= min(hit_alignment, block_size)
    hit_length -= hit_length % hit_alignment
    blocks = min(blocks, cdiv(hit_length, block_size))
    return [[True] * blocks for _ in group_ids], hit_length


def _drop_unaligned_tail(computed: list[bool], block_size: int, hit_alignment: int):
    # vLLM pops blocks until the hit is a multiple of the hit alignment.
    while block_size != hit_alignment and len(computed) * block_size % hit_alignment:
        computed.pop()


def sliding_window_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: StorePool,
    spec: SlidingWindow,
    hash_block_size: int,
    drop_eagle: bool,
    hit_alignment: int,
) -> ScanResult:
    """``SlidingWindowManager.find_longest_cache_hit``: right to left, the
    first run of ``need`` hit blocks ending on an aligned block wins; else a
    run reaching token 0; EAGLE then pops the last block."""
    block_size = spec.block_size
    view = _resolve(raw, hash_block_size, block_size, False, hit_alignment)
    need = sliding_window_need(spec.sliding_window, block_size, drop_eagle)
    max_num_blocks = max_length // block_size
    computed = [False] * max_num_blocks
    run = 0
    match_found = False
    for i in range(max_num_blocks - 1, -1, -1):
        if pool.hit(_get(view, i), group_ids):
            if run == 0 and block_size != hit_alignment:
                post_pop = i if drop_eagle else i + 1
                if (post_pop * block_size) % hit_alignment != 0:
                    continue
            computed[i] = True
            run += 1
            if run >= need:
                del computed[i + run :]
                match_found = True
                break
        else:
            run = 0
    if not match_found:
        # A run reaching token 0 is a hit even when shorter than the window.
        del computed[run:]
        _drop_unaligned_tail(computed, block_size, hit_alignment)
    if drop_eagle and computed:
        computed.pop()
        _drop_unaligned_tail(computed, block_size, hit_alignment)
    hit_length = len(computed) * block_size
    return [list(computed) for _ in group_ids], hit_length


def mamba_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: StorePool,
    spec: Mamba,
    hash_block_size: int,
    drop_eagle: bool,
    hit_alignment: int,
) -> ScanResult:
    """``MambaManager.find_longest_cache_hit``: the rightmost stored state on
    an aligned block (fine-grained: hash unit). It never drops a block, EAGLE
    or not, so ``drop_eagle`` is ignored."""
    block_size = spec.block_size
    view = _resolve(raw, hash_block_size, block_size, True, hit_alignment)
    if hit_alignment < block_size and block_size % hit_alignment == 0:
        # Fine-grained: the rightmost hash unit whose state is stored.
        units_per_block = block_size // hit_alignment
        top = min(max_length // hit_alignment, len(raw))
        for fine_idx in range(top - 1, -1, -1):
            if pool.hit(raw[fine_idx], group_ids):
                mask = [False] * (fine_idx // units_per_block) + [True]
                hit_length = (fine_idx + 1) * hit_alignment
                return [list(mask) for _ in group_ids], hit_length
        return [[] for _ in group_ids], 0
    for i in range(max_length // block_size - 1, -1, -1):
        if pool.hit(_get(view, i), group_ids):
            if block_size != hit_alignment and (i + 1) * block_size % hit_alignment:
                continue
            mask = [False] * i + [True]
            return [list(mask) for _ in group_ids], (i + 1) * block_size
    return [[] for _ in group_ids], 0


def chunked_local_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: StorePool,
    spec: ChunkedLocal,
    hash_block_size: int,
    drop_eagle: bool,
    hit_alignment: int,
) -> ScanResult:
    """``ChunkedLocalAttentionManager.find_longest_cache_hit``: null blocks up
    to the start of the last attention chunk, then the leading run of hit
    blocks. EAGLE is refused for this kind when the layout is built, so
    ``drop_eagle`` is never set."""
    block_size = spec.block_size
    view = _resolve(raw, hash_block_size, block_size, False, hit_alignment)
    max_num_blocks = max_length // block_size
    chunk = spec.attention_chunk_size
    start_idx = max_length // chunk * chunk if max_length > 0 else 0
    start_block = start_idx // block_size
    # Blocks wholly before the last chunk are never attended: null, yet computed.
    computed = [False] * start_block
    for i in range(start_block, max_num_blocks):
        if pool.hit(_get(view, i), group_ids):
            computed.append(True)
        else:
            break
    return [list(computed) for _ in group_ids], len(computed) * block_size


# ---------------------------------------------------------------------------
# Store/lookup masks (the registry's ``reachable_mask`` / ``store_mask``):
# vLLM's ``reachable_block_mask``. All take the same arguments and return the
# mask of chunks ``[start_block, end_block)``, or ``None`` for all of them.
# ---------------------------------------------------------------------------


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


def every_block_reachable(
    spec: Spec,
    start_block: int,
    end_block: int,
    scheduler_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    boundaries: Sequence[int],
) -> None:
    """Full and chunked-local attention: every block is reachable (``None``)."""
    return None


def no_block_stored(
    spec: Spec,
    start_block: int,
    end_block: int,
    scheduler_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    boundaries: Sequence[int],
) -> list[bool]:
    """Mamba store masks: the store worker never writes Mamba states."""
    return [False] * (end_block - start_block)


def sliding_window_reachable_mask(
    spec: SlidingWindow,
    start_block: int,
    end_block: int,
    scheduler_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    boundaries: Sequence[int],
) -> list[bool] | None:
    """``SlidingWindowManager.reachable_block_mask``: the ``need`` blocks
    before each segment end (:func:`~kvhit.coordinator.masks.sparse_window_mask`,
    enumerated with its inverse)
    and, with a retention interval, before each replay boundary; ``None`` when
    that keeps every block."""
    block_size = spec.block_size
    if scheduler_block_size % block_size != 0:
        return None
    need = sliding_window_need(spec.sliding_window, block_size, use_eagle)
    shift = 1 if use_eagle else 0
    per_segment = swa_segment_chunks(
        retention_interval, scheduler_block_size, block_size
    )
    if per_segment is not None and need >= per_segment:
        return None
    chunks = range(start_block, end_block)
    mask = [False] * len(chunks)
    if per_segment is not None and need > 0:
        # The kept chunks in increasing order (sparse_window_chunk enumerates
        # what sparse_window_mask keeps), from the segment holding start_block:
        # far fewer than all chunks (DeepSeek-V4's indexer keeps 2 in 64).
        k = max(0, (start_block - shift) // per_segment) * need
        while (c := sparse_window_chunk(k, per_segment, need, shift)) < end_block:
            if c >= start_block:
                mask[c - start_block] = True
            k += 1
    if retention_interval is not None:
        for boundary in boundaries:
            mask = [
                kept
                | swa_replay_mask(
                    c, boundary, scheduler_block_size, block_size, need, shift
                )
                for kept, c in zip(mask, chunks, strict=True)
            ]
    return mask


def mamba_reachable_mask(
    spec: Mamba,
    start_block: int,
    end_block: int,
    scheduler_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    boundaries: Sequence[int],
) -> list[bool] | None:
    """``MambaManager.reachable_block_mask``: with a retention interval, the
    last state of each interval and the state at each replay boundary;
    ``None`` (every state) without one."""
    if retention_interval is None:
        return None
    block_size = spec.block_size
    chunks = range(start_block, end_block)
    if retention_interval == 0:
        mask = [False] * len(chunks)
    else:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        mask = [mamba_segment_mask(c, per_segment) for c in chunks]
    for boundary in boundaries:
        mask = [
            kept | mamba_replay_mask(c, boundary, scheduler_block_size, block_size)
            for kept, c in zip(mask, chunks, strict=True)
        ]
    return mask


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
        # kinds imports this module (the registry points at its functions).
        from kvhit.coordinator.kinds import kind_of

        self.layout = layout
        self.hash_block_size = layout.hash_block_size
        self.scheduler_block_size = layout.scheduler_block_size
        #: vLLM's name for the scheduler block size (kept for callers).
        self.lcm_block_size = layout.scheduler_block_size
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
            drop_eagle = (
                apply_eagle and sg.use_eagle and idx not in state.eagle_verified
            )
            bound = curr
            # EAGLE may peek one proof margin past the hit and drop back;
            # never a Mamba group, whose state there would be unverified.
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
