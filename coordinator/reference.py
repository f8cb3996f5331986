"""The scalar reference: vLLM 0.33.0's external-store hit semantics, in pure Python.

This is the oracle every backend is checked against. It follows, rule for rule,
``MooncakeStoreCoordinator`` (find_longest_cache_hit, load/store/lookup masks),
the per-manager ``find_longest_cache_hit`` / ``reachable_block_mask`` classmethods
(full attention, sliding window, Mamba, chunked local), ``resolve_block_hashes``,
``BlockHashListWithBlockSize``, ``eagle_proof_margin``, ``replay_boundaries`` and
the Mooncake store worker's ``lookup``. It needs neither torch nor vLLM.

A loaded block is represented by ``True`` and vLLM's null block by ``False``, so
a group's load mask is exactly its list of hit blocks.

Where vLLM would fail with an ``IndexError`` (a ``max_length`` that reaches past
the block hashes a sliding-window, Mamba or chunked-local scan must index), the
reference raises ``ValueError`` instead of returning a number vLLM never would.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvhit.coordinator.specs import (
    CacheLayout,
    ChunkedLocal,
    FullAttention,
    Mamba,
    SlidingWindow,
    Spec,
    SpecGroup,
)

BlockHash = bytes
Masks = tuple[list[bool], ...]
OptMasks = tuple["list[bool] | None", ...]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (``b > 0``), as vLLM's ``cdiv``."""
    return -(a // -b)


class _HashesTooShort(Exception):
    """A scan indexed past the end of the block hashes (vLLM: IndexError)."""


class _Pool:
    """The store's contents as vLLM's ``ExternalCachedBlockPool`` sees them."""

    __slots__ = ("exists",)

    def __init__(self, exists: Collection[tuple[int, bytes]] | None) -> None:
        self.exists = exists

    def hit(self, block_hash: BlockHash, group_ids: Sequence[int]) -> bool:
        # A merged SpecGroup hits only when every member group holds the hash.
        if self.exists is None:
            return True
        h = bytes(block_hash)
        return all((g, h) in self.exists for g in group_ids)


class _View:
    """``block_hashes`` seen at ``scale`` hash units per block: block ``i`` is
    keyed by the last hash unit inside it (``BlockHashListWithBlockSize``)."""

    __slots__ = ("raw", "scale")

    def __init__(self, raw: Sequence[BlockHash], scale: int) -> None:
        self.raw = raw
        self.scale = scale

    def __len__(self) -> int:
        return len(self.raw) // self.scale

    def __getitem__(self, idx: int) -> BlockHash:
        j = (idx + 1) * self.scale - 1
        if j >= len(self.raw):
            raise _HashesTooShort
        return self.raw[j]


def _raw_get(raw: Sequence[BlockHash], idx: int) -> BlockHash:
    if idx >= len(raw):
        raise _HashesTooShort
    return raw[idx]


def _resolve(
    raw: Sequence[BlockHash],
    hash_block_size: int,
    block_size: int,
    fine_grained_ok: bool,
    alignment: int,
) -> Sequence[BlockHash] | _View:
    """vLLM's ``resolve_block_hashes``: raw hashes when the sizes agree or when
    the manager probes hash-unit boundaries, else the per-block view."""
    if block_size == hash_block_size:
        return raw
    if fine_grained_ok and alignment < block_size and block_size % alignment == 0:
        return raw
    return _View(raw, block_size // hash_block_size)


def _get(view: Sequence[BlockHash] | _View, idx: int) -> BlockHash:
    if isinstance(view, _View):
        return view[idx]
    return _raw_get(view, idx)


# ---------------------------------------------------------------------------
# Per-manager scans. Each returns (blocks per member group, hit length).
# ---------------------------------------------------------------------------


def _full_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: _Pool,
    block_size: int,
    hash_block_size: int,
    drop_eagle: bool,
    alignment: int,
) -> tuple[list[list[bool]], int]:
    fine_grained = alignment < block_size and block_size % alignment == 0
    view = _resolve(raw, hash_block_size, block_size, True, alignment)
    if fine_grained:
        full = _View(raw, block_size // alignment)
    else:
        full = view
    n_full = len(full)
    n = 0
    # Phase 1: chained hashes, so the first miss ends the run.
    for i in range(min(max_length // block_size, n_full)):
        if not pool.hit(_get(full, i), group_ids):
            break
        n += 1
    blocks = n
    hit_length = n * block_size
    # Phase 2: the first non-full block's interior hash boundaries, longest first.
    if fine_grained:
        scale = block_size // alignment
        first = n * scale
        max_partial = min(first + scale - 1, max_length // alignment, len(raw))
        for fine_idx in range(max_partial - 1, first - 1, -1):
            if not pool.hit(raw[fine_idx], group_ids):
                continue
            blocks += 1
            hit_length = (fine_idx + 1) * alignment
            break
    if drop_eagle and hit_length > 0:
        hit_length -= min(alignment, block_size)
    hit_length -= hit_length % alignment
    blocks = min(blocks, cdiv(hit_length, block_size))
    return [[True] * blocks for _ in group_ids], hit_length


def _swa_contiguous_blocks(window: int, block_size: int, use_eagle: bool) -> int:
    # EAGLE: one more block is matched, then dropped.
    return cdiv(window - 1, block_size) + (1 if use_eagle else 0)


def _swa_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: _Pool,
    spec: SlidingWindow,
    hash_block_size: int,
    drop_eagle: bool,
    alignment: int,
) -> tuple[list[list[bool]], int]:
    block_size = spec.block_size
    view = _resolve(raw, hash_block_size, block_size, False, alignment)
    need = _swa_contiguous_blocks(spec.sliding_window, block_size, drop_eagle)
    max_num_blocks = max_length // block_size
    computed = [False] * max_num_blocks
    run = 0
    match_found = False
    # Right to left; the first run of `need` blocks wins.
    for i in range(max_num_blocks - 1, -1, -1):
        if pool.hit(_get(view, i), group_ids):
            if run == 0 and block_size != alignment:
                post_pop = i if drop_eagle else i + 1
                if (post_pop * block_size) % alignment != 0:
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
        while block_size != alignment and len(computed) * block_size % alignment:
            computed.pop()
    if drop_eagle and computed:
        computed.pop()
        while block_size != alignment and len(computed) * block_size % alignment:
            computed.pop()
    hit_length = len(computed) * block_size
    return [list(computed) for _ in group_ids], hit_length


def _mamba_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: _Pool,
    block_size: int,
    hash_block_size: int,
    alignment: int,
) -> tuple[list[list[bool]], int]:
    view = _resolve(raw, hash_block_size, block_size, True, alignment)
    if alignment < block_size and block_size % alignment == 0:
        # Fine-grained: the rightmost hash unit whose state is stored.
        scale = block_size // alignment
        for fine_idx in range(min(max_length // alignment, len(raw)) - 1, -1, -1):
            if pool.hit(raw[fine_idx], group_ids):
                mask = [False] * (fine_idx // scale) + [True]
                return [list(mask) for _ in group_ids], (fine_idx + 1) * alignment
        return [[] for _ in group_ids], 0
    for i in range(max_length // block_size - 1, -1, -1):
        if pool.hit(_get(view, i), group_ids):
            if block_size != alignment and (i + 1) * block_size % alignment:
                continue
            mask = [False] * i + [True]
            return [list(mask) for _ in group_ids], (i + 1) * block_size
    return [[] for _ in group_ids], 0


def _chunked_local_hit(
    raw: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    pool: _Pool,
    spec: ChunkedLocal,
    hash_block_size: int,
    alignment: int,
) -> tuple[list[list[bool]], int]:
    block_size = spec.block_size
    view = _resolve(raw, hash_block_size, block_size, False, alignment)
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
# Store/lookup masks (``reachable_block_mask``).
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


def _swa_reachable_mask(
    start_block: int,
    end_block: int,
    alignment: int,
    spec: SlidingWindow,
    use_eagle: bool,
    retention_interval: int | None,
    boundaries: Sequence[int],
) -> list[bool] | None:
    block_size = spec.block_size
    if alignment % block_size != 0:
        return None
    need = _swa_contiguous_blocks(spec.sliding_window, block_size, use_eagle)
    shift = 1 if use_eagle else 0
    mask = [False] * (end_block - start_block)
    if retention_interval is None:
        segment_tokens: int | None = alignment
    elif retention_interval == 0:
        segment_tokens = None
    else:
        segment_tokens = retention_interval
    if segment_tokens is not None:
        per_segment = segment_tokens // block_size
        if need >= per_segment:
            return None
        for i in range(start_block, end_block):
            if i >= shift and (i - shift) % per_segment >= per_segment - need:
                mask[i - start_block] = True
    if retention_interval is not None:
        for boundary in boundaries:
            aligned = boundary // alignment * alignment
            end = aligned // block_size + shift
            for j in range(max(start_block, end - need), min(end_block, end)):
                mask[j - start_block] = True
    return mask


def _mamba_reachable_mask(
    start_block: int,
    end_block: int,
    alignment: int,
    block_size: int,
    retention_interval: int | None,
    boundaries: Sequence[int],
) -> list[bool] | None:
    if retention_interval is None:
        return None
    mask = [False] * (end_block - start_block)
    if retention_interval != 0:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        first = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first - start_block, len(mask), per_segment):
            mask[i] = True
    for boundary in boundaries:
        aligned = boundary // alignment * alignment
        boundary_block = aligned // block_size - 1
        if start_block <= boundary_block < end_block:
            mask[boundary_block - start_block] = True
    return mask


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
        self.lcm_block_size = layout.scheduler_block_size
        self.alignment = layout.alignment

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
                list(block_hashes), max_length, _Pool(exists), apply_eagle
            )
        except _HashesTooShort:
            raise ValueError(
                f"max_length ({max_length}) needs more block hashes than the "
                f"{len(block_hashes)} given (hash_block_size "
                f"{self.hash_block_size})"
            ) from None

    def _scan(
        self,
        sg: SpecGroup,
        raw: list[BlockHash],
        max_length: int,
        pool: _Pool,
        drop_eagle: bool,
    ) -> tuple[list[list[bool]], int]:
        spec: Spec = sg.spec
        hbs, align = self.hash_block_size, self.alignment
        if isinstance(spec, FullAttention):
            return _full_hit(
                raw, max_length, sg.group_ids, pool, spec.block_size, hbs,
                drop_eagle, align,
            )  # fmt: skip
        if isinstance(spec, SlidingWindow):
            return _swa_hit(
                raw, max_length, sg.group_ids, pool, spec, hbs, drop_eagle, align
            )
        if isinstance(spec, Mamba):
            # The Mamba finder never drops a block, EAGLE or not.
            return _mamba_hit(
                raw, max_length, sg.group_ids, pool, spec.block_size, hbs, align
            )
        return _chunked_local_hit(raw, max_length, sg.group_ids, pool, spec, hbs, align)

    def _find(
        self,
        raw: list[BlockHash],
        max_length: int,
        pool: _Pool,
        apply_eagle: bool,
    ) -> tuple[Masks, int]:
        layout = self.layout
        num_groups = layout.num_groups
        spec_groups = layout.spec_groups
        if len(spec_groups) == 1:
            sg = spec_groups[0]
            blocks, hit_length = self._scan(
                sg, raw, max_length, pool, apply_eagle and sg.use_eagle
            )
            out: list[list[bool]] = [[] for _ in range(num_groups)]
            for gid, blk in zip(sg.group_ids, blocks, strict=True):
                out[gid] = blk
            return tuple(out), hit_length

        hit_length = max_length
        blocks_by_group: list[list[bool] | None] = [None] * num_groups
        length_by_group = [0] * num_groups
        eagle_verified: set[int] = set()
        while True:
            curr = hit_length
            for idx, sg in enumerate(spec_groups):
                first = sg.group_ids[0]
                if sg.kind == "full" and blocks_by_group[first] is not None:
                    # Full attention is scanned once; later rounds only clip it.
                    curr = min(curr, length_by_group[first])
                    continue
                drop_eagle = apply_eagle and sg.use_eagle and idx not in eagle_verified
                bound = curr
                # EAGLE may peek one proof margin past the hit and drop back;
                # never a Mamba group, whose state there would be unverified.
                if drop_eagle and sg.kind != "mamba":
                    margin = layout.proof_margins[first]
                    bound = min(curr + margin, len(raw) * self.hash_block_size)
                blocks, new_len = self._scan(sg, raw, bound, pool, drop_eagle)
                if drop_eagle:
                    eagle_verified.add(idx)
                elif new_len < curr:
                    eagle_verified.clear()
                curr = new_len
                for gid, blk in zip(sg.group_ids, blocks, strict=True):
                    blocks_by_group[gid] = blk
                    length_by_group[gid] = new_len
            if curr >= hit_length:
                break
            hit_length = curr
            if layout.is_simple_hybrid:
                break

        for sg in spec_groups:
            if sg.kind != "full":
                continue
            num_blocks = cdiv(hit_length, sg.block_size)
            for gid in sg.group_ids:
                blk = blocks_by_group[gid]
                assert blk is not None
                del blk[num_blocks:]
        return tuple(b if b is not None else [] for b in blocks_by_group), hit_length

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
            exclude_mamba=True,
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
        exclude_mamba: bool = False,
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
                self.lcm_block_size,
                use_eagle=bool(layout.eagle_group_ids),
            )
        )
        masks: list[list[bool] | None] = []
        for g_idx, spec in enumerate(layout.coverage_specs):
            end_chunk = aligned_len // spec.block_size
            start_chunk = min(end_chunk, max(0, cdiv(start_token, spec.block_size)))
            if isinstance(spec, Mamba):
                if exclude_mamba:
                    masks.append([False] * (end_chunk - start_chunk))
                    continue
                masks.append(
                    _mamba_reachable_mask(
                        start_chunk,
                        end_chunk,
                        self.lcm_block_size,
                        spec.block_size,
                        retention_interval,
                        boundaries,
                    )  # fmt: skip
                )
            elif isinstance(spec, SlidingWindow):
                masks.append(
                    _swa_reachable_mask(
                        start_chunk,
                        end_chunk,
                        self.lcm_block_size,
                        spec,
                        g_idx in layout.eagle_group_ids,
                        retention_interval,
                        boundaries,
                    )  # fmt: skip
                )
            else:
                masks.append(None)
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
        out: list[tuple[int, bytes]] = []
        if layout.partial_hash_hits:
            units = min(len(block_hashes), token_len // hbs)
            for g_idx, g in enumerate(layout.groups):
                if g.prefix_cacheable:
                    out.extend((g_idx, bytes(block_hashes[u])) for u in range(units))
            return out
        masks = self.lookup_mask(token_len)
        for g_idx, g in enumerate(layout.groups):
            if not g.prefix_cacheable:
                continue
            block_size = g.spec.block_size
            scale = block_size // hbs
            max_chunks = min(len(block_hashes) // scale, cdiv(token_len, block_size))
            mask = masks[g_idx]
            limit = max_chunks if mask is None else min(max_chunks, len(mask))
            for c in range(limit):
                if mask is None or mask[c]:
                    out.append((g_idx, bytes(block_hashes[(c + 1) * scale - 1])))
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
