"""The per-kind manager ports of the scalar reference, in pure Python.

vLLM 0.33.0 keeps each KV-cache manager kind apart from the coordinator
(``vllm/v1/core/single_type_kv_cache_manager.py`` beside
``kv_cache_coordinator.py``); kvhit does the same. This module holds each
kind's ``find_longest_cache_hit`` port (full attention, sliding window, Mamba,
chunked local), its ``reachable_block_mask`` port, and the hash view they read
(``resolve_block_hashes``, ``BlockHashListWithBlockSize``). The spec-kind
registry (:mod:`kvhit.coordinator.kinds`) says which kind uses which function;
:class:`~kvhit.coordinator.reference.ReferenceCoordinator` (the coordinator of
the reference) calls them through the registry. Together the two modules are
the oracle every backend is checked against. The mask formulas they share with
the batched backends are in :mod:`kvhit.kernels.masks`.

A loaded block is represented by ``True`` and vLLM's null block by ``False``, so
a group's load mask is exactly its list of hit blocks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvhit.coordinator.spec_types import (
    ChunkedLocal,
    FullAttention,
    Mamba,
    SlidingWindow,
    Spec,
)
from kvhit.kernels.contract import cdiv
from kvhit.kernels.masks import (
    mamba_replay_mask,
    mamba_segment_mask,
    sliding_window_need,
    sparse_window_chunk,
    swa_replay_mask,
    swa_segment_chunks,
)

__all__ = [
    "BlockHash",
    "HashesTooShort",
    "ScanResult",
    "StorePool",
    "chunked_local_hit",
    "every_block_reachable",
    "full_attention_hit",
    "mamba_hit",
    "mamba_reachable_mask",
    "no_block_stored",
    "sliding_window_hit",
    "sliding_window_reachable_mask",
]

BlockHash = bytes

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
    before each segment end (:func:`~kvhit.kernels.masks.sparse_window_mask`,
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
