"""Hypothesis strategies shared by the reference tests and the backend parity tests.

Import them as ``from strategies import case, layouts, ...`` (pytest puts
``tests/`` on ``sys.path``; there is no ``tests/__init__.py``).

Every strategy builds *valid* inputs directly rather than filtering: layouts
always construct, lengths never ask a scan for hashes a request does not have,
and stores are sets of ``(group_id, hash)`` keys. Sizes are kept small (at most
~64 hash units per request, scheduler blocks of at most 256 tokens) so that one
example costs microseconds in the reference.

Public API:

- ``layouts(...)``: random valid :class:`CacheLayout`.
- ``hash_lists(...)``: one request's chained-looking block hashes.
- ``hash_batches(...)``: several requests sharing prefixes / duplicates.
- ``stores(layout, requests, ...)``: store contents (a ``set`` of keys).
- ``lengths(layout, n_hashes, ...)``: one ``max_length`` / ``num_tokens``.
- ``case(...)``: ``(layout, requests, exists, lengths)``.
- ``store_from_masks(layout, block_hashes, aligned_len, masks, start_token=0)``:
  the keys a saving worker writes for given store masks (plain function).
- ``saved_keys(layout, block_hashes, num_prompt_tokens, ...)``: store_mask then
  store_from_masks (plain function).
- ``chained_hashes(seed, n, width=8, prefix=())``: deterministic hash chain.
- ``fleet_case(layout_strategy=None)``: ``case()`` with 1-4 engines' stores.
- ``preset_requests(preset, seed, n_requests, max_hashes, seeds=3)``: a
  preset's layout and chained requests of random lengths (plain function).
- ``full_fleet_case()``: ``fleet_case()`` of full-attention-only layouts.
- ``merged_group_case(n_requests, engines=70)``: a fixed fleet case of two
  merged full-attention groups (plain function).
- ``edge_fleet_batch(layout, sizes, hit)``: a fixed all-hit or all-miss
  batch for the fleet edge tests (plain function).
- ``has_full_attention(layout)``, ``max_valid_length(layout, n_hashes)``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from helpers import merged_full_layout
from hypothesis import strategies as st

from kvhit import CacheLayout, ChunkedLocal, FullAttention, Group, Mamba, SlidingWindow
from kvhit.bench.workloads import make_layout
from kvhit.coordinator.reference import ReferenceCoordinator
from kvhit.coordinator.specs import Spec

Key = tuple[int, bytes]

HASH_BLOCK_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)
# scheduler_block_size = hash_block_size * k. Non powers of two (3, 6, 12) give
# LCM-style layouts (e.g. block sizes 2h and 3h under a 6h scheduler block).
SCHEDULER_FACTORS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
ALL_KINDS: tuple[str, ...] = ("full", "sliding_window", "mamba", "chunked_local")
MAX_SCHEDULER_BLOCK = 256
MAX_HASHES = 64

# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


@st.composite
def _fresh_spec(
    draw: st.DrawFn,
    kind: str,
    hbs: int,
    factor: int,
    alignment: int,
) -> Spec:
    """A spec of ``kind`` whose block size is valid for a prefix-cacheable group:
    a multiple of ``hbs`` dividing ``hbs * factor`` (chunked local: exactly the
    hit alignment, the only block size vLLM serves)."""
    divisors = [d for d in range(1, factor + 1) if factor % d == 0]
    bs = hbs * draw(st.sampled_from(divisors))
    tag = draw(st.sampled_from([None, None, None, "mla"]))
    if kind == "full":
        return FullAttention(bs, tag=tag)
    if kind == "mamba":
        return Mamba(bs, tag=tag)
    if kind == "sliding_window":
        window = draw(
            st.one_of(
                st.integers(1, 4 * bs + 1),
                st.sampled_from([bs, 2 * bs, 2 * bs + 1, 8 * bs]),
            )
        )
        extra = draw(st.sampled_from([0, 0, 0, 1, bs, max(1, window // 2)]))
        return SlidingWindow(bs, window, extra_retained_tokens=extra, tag=tag)
    chunk = draw(st.one_of(st.sampled_from([alignment, 2 * alignment, 4 * alignment]),
                           st.integers(1, 64)))  # fmt: skip
    return ChunkedLocal(alignment, chunk, tag=tag)


@st.composite
def _twin_spec(draw: st.DrawFn, spec: Spec) -> Spec:
    """A spec that merges with ``spec`` (equal, or an SWA with the same coverage
    window split differently between ``sliding_window`` and
    ``extra_retained_tokens``), or one kept apart only by its tag."""
    choice = draw(st.integers(0, 2))
    if choice == 1 and isinstance(spec, SlidingWindow):
        cover = spec.sliding_window + spec.extra_retained_tokens
        if cover > 1:
            extra = draw(st.integers(0, cover - 1))
            return SlidingWindow(spec.block_size, cover - extra, extra, tag=spec.tag)
    if choice == 2:
        # Equal except the tag: must NOT merge.
        return type(spec)(
            **{
                f: getattr(spec, f)
                for f in spec.__dataclass_fields__
                if f not in ("kind", "tag")
            },
            tag=("other", spec.tag),
        )
    return spec


@st.composite
def _scratch_spec(draw: st.DrawFn) -> Spec:
    """A spec for a group that is not prefix cacheable: any positive block size
    (vLLM does not constrain groups it never probes)."""
    bs = draw(st.integers(1, 48))
    kind = draw(st.sampled_from(ALL_KINDS))
    if kind == "full":
        return FullAttention(bs)
    if kind == "mamba":
        return Mamba(bs)
    if kind == "sliding_window":
        return SlidingWindow(bs, draw(st.integers(1, 64)))
    return ChunkedLocal(bs, draw(st.integers(1, 64)))


@st.composite
def layouts(
    draw: st.DrawFn,
    *,
    min_groups: int = 1,
    max_groups: int = 5,
    kinds: Sequence[str] = ALL_KINDS,
    hash_block_sizes: Sequence[int] = HASH_BLOCK_SIZES,
    max_scheduler_block_size: int = MAX_SCHEDULER_BLOCK,
    allow_scratch_groups: bool = True,
    use_eagle: bool | None = None,
    partial_hash_hits: bool | None = None,
    retention: bool = True,
) -> CacheLayout:
    """Random valid :class:`CacheLayout`.

    ``min_groups..max_groups`` groups whose prefix-cacheable specs are drawn
    from ``kinds``; about one group in three reuses an earlier spec (an equal
    spec that merges, an SWA coverage twin that merges, or a spec equal but for
    its tag that must not). Block sizes are ``hash_block_size`` times a divisor
    of the scheduler factor; chunked local attention gets ``block_size ==
    alignment`` and is never put in an EAGLE SpecGroup (with ``use_eagle`` some
    other group is flagged, else ``use_eagle`` is dropped). Scratch groups
    (``prefix_cacheable=False``, arbitrary block sizes) appear when
    ``allow_scratch_groups``. ``use_eagle`` / ``partial_hash_hits`` force those
    flags when not None; ``retention=False`` keeps ``retention_interval=None``.
    """
    hbs = draw(st.sampled_from(list(hash_block_sizes)))
    factors = [k for k in SCHEDULER_FACTORS if hbs * k <= max_scheduler_block_size]
    factor = draw(st.sampled_from(factors))
    sbs = hbs * factor
    partial = draw(st.booleans()) if partial_hash_hits is None else partial_hash_hits
    alignment = hbs if partial else sbs
    eagle_on = draw(st.booleans()) if use_eagle is None else use_eagle
    retention_interval = (
        draw(st.sampled_from([None, None, 0, sbs, 2 * sbs, 3 * sbs]))
        if retention
        else None
    )

    n = draw(st.integers(min_groups, max_groups))
    prefix_flags = [
        (not allow_scratch_groups) or draw(st.integers(0, 5)) > 0 for _ in range(n)
    ]
    if not any(prefix_flags):
        prefix_flags[draw(st.integers(0, n - 1))] = True

    groups: list[Group] = []
    for prefix in prefix_flags:
        if not prefix:
            groups.append(
                Group(draw(_scratch_spec()), eagle=draw(st.booleans()),
                      prefix_cacheable=False)
            )  # fmt: skip
            continue
        previous = [g.spec for g in groups if g.prefix_cacheable]
        if previous and draw(st.integers(0, 2)) == 0:
            spec = draw(_twin_spec(draw(st.sampled_from(previous))))
        else:
            spec = draw(_fresh_spec(draw(st.sampled_from(list(kinds))), hbs, factor,
                                    alignment))  # fmt: skip
        eagle = not isinstance(spec, ChunkedLocal) and draw(st.integers(0, 3)) == 0
        groups.append(Group(spec, eagle=eagle, name=draw(st.sampled_from([None, "g"]))))

    if eagle_on and _needs_flag(groups):
        # Otherwise the use_eagle fallback would promote the chunked group too.
        candidates = [
            i for i, g in enumerate(groups)
            if g.prefix_cacheable and not isinstance(g.spec, ChunkedLocal)
        ]  # fmt: skip
        if candidates:
            i = draw(st.sampled_from(candidates))
            groups[i] = Group(groups[i].spec, eagle=True, name=groups[i].name)
        else:
            eagle_on = False
    return CacheLayout(
        groups,
        scheduler_block_size=sbs,
        hash_block_size=hbs,
        use_eagle=eagle_on,
        retention_interval=retention_interval,
        partial_hash_hits=partial,
    )


def _needs_flag(groups: Sequence[Group]) -> bool:
    """use_eagle with no prefix-cacheable group flagged would promote every
    SpecGroup, chunked local included."""
    return any(
        g.prefix_cacheable and isinstance(g.spec, ChunkedLocal) for g in groups
    ) and not any(g.prefix_cacheable and g.eagle for g in groups)


# ---------------------------------------------------------------------------
# Block hashes
# ---------------------------------------------------------------------------


def chained_hashes(
    seed: int | bytes, n: int, width: int = 8, prefix: Sequence[bytes] = ()
) -> list[bytes]:
    """``prefix`` followed by ``n`` deterministic chained hashes: hash ``i``
    folds in hash ``i - 1`` and ``seed``, so equal seeds over an equal prefix
    give equal chains (two requests with the same prompt) and different seeds
    diverge at the first new position."""
    seed_b = seed if isinstance(seed, bytes) else int(seed).to_bytes(8, "little")
    out = [bytes(h) for h in prefix]
    prev = out[-1] if out else b"root"
    for i in range(len(out), len(out) + n):
        d = hashlib.blake2b(prev + seed_b + i.to_bytes(4, "little"), digest_size=32)
        prev = d.digest()[:width]
        out.append(prev)
    return out


@st.composite
def hash_lists(
    draw: st.DrawFn,
    width: int = 8,
    min_size: int = 0,
    max_size: int = MAX_HASHES,
    *,
    prefix: Sequence[bytes] = (),
    collisions: bool = True,
) -> list[bytes]:
    """One request's block hashes: ``prefix`` then ``min_size..max_size`` new
    chained hashes (total capped at ``max_size``), ``width`` bytes each.

    Seeds come from a pool of 4, so independent draws often produce the same
    chain (identical prompts across requests). With ``collisions``, sometimes
    up to 3 positions are overwritten with the bytes of another position (the
    same hash at several positions: impossible for a real chain, but a backend
    must still treat keys purely by value).
    """
    prefix = list(prefix)[:max_size]
    lo = max(0, min_size - len(prefix))
    hi = max(lo, max_size - len(prefix))
    n = draw(st.integers(lo, hi))
    seed = draw(st.integers(0, 3))
    out = chained_hashes(seed, n, width, prefix)
    if collisions and len(out) >= 2 and draw(st.integers(0, 4)) == 0:
        for _ in range(draw(st.integers(1, 3))):
            dst = draw(st.integers(0, len(out) - 1))
            src = draw(st.integers(0, len(out) - 1))
            out[dst] = out[src]
    return out


@st.composite
def hash_batches(
    draw: st.DrawFn,
    width: int = 8,
    min_requests: int = 1,
    max_requests: int = 4,
    min_size: int = 0,
    max_size: int = MAX_HASHES,
) -> list[list[bytes]]:
    """Several requests' hash lists. After the first, each request is fresh, an
    exact duplicate of an earlier one, a prefix of one, or an earlier request's
    prefix extended by a new continuation (multi-turn growth / shared system
    prompt)."""
    n = draw(st.integers(min_requests, max_requests))
    out: list[list[bytes]] = []
    for _ in range(n):
        how = draw(st.integers(0, 3)) if out else 0
        if how == 0:
            out.append(draw(hash_lists(width, min_size, max_size)))
            continue
        base = draw(st.sampled_from(out))
        if how == 1:
            out.append(list(base))
        elif how == 2:
            cut = draw(st.integers(min(min_size, len(base)), len(base)))
            out.append(list(base[:cut]))
        else:
            cut = draw(st.integers(0, len(base)))
            out.append(
                draw(hash_lists(width, min_size, max_size, prefix=base[:cut],
                                collisions=False))
            )  # fmt: skip
    return out


# ---------------------------------------------------------------------------
# Stores
# ---------------------------------------------------------------------------


def store_from_masks(
    layout: CacheLayout,
    block_hashes: Sequence[bytes],
    aligned_len: int,
    masks: Sequence[Sequence[bool] | None],
    start_token: int = 0,
) -> set[Key]:
    """The ``(group, hash)`` keys a saving worker writes for ``masks`` (as
    returned by ``ReferenceCoordinator.store_mask(aligned_len, start_token,
    ...)``).

    Chunk ``c`` of a group with block size ``bs`` is keyed by
    ``block_hashes[(c + 1) * bs // hash_block_size - 1]`` (the last hash unit in
    the chunk); a ``None`` mask writes every chunk in ``[cdiv(start_token, bs),
    aligned_len // bs)``; mask entry ``i`` is chunk ``cdiv(start_token, bs) + i``.
    Mamba groups come out all-False from ``store_mask`` and so write nothing.
    Groups that are not prefix cacheable are never saved (vLLM builds the
    connector from the prefix-cacheable groups only), so they are skipped.
    """
    hbs = layout.hash_block_size
    keys: set[Key] = set()
    for g, (group, mask) in enumerate(zip(layout.groups, masks, strict=True)):
        if not group.prefix_cacheable:
            continue
        bs = group.spec.block_size
        end = aligned_len // bs
        start = min(end, max(0, -(-start_token // bs)))
        if mask is not None and len(mask) != end - start:
            raise ValueError(
                f"group {g}: mask has {len(mask)} entries, chunks "
                f"[{start}, {end}) need {end - start}"
            )
        for c in range(start, end):
            if mask is None or mask[c - start]:
                idx = (c + 1) * bs // hbs - 1
                if idx >= len(block_hashes):
                    raise ValueError(
                        f"group {g}: chunk {c} needs hash {idx}, only "
                        f"{len(block_hashes)} given"
                    )
                keys.add((g, bytes(block_hashes[idx])))
    return keys


def saved_keys(
    layout: CacheLayout,
    block_hashes: Sequence[bytes],
    saved_tokens: int,
    *,
    num_prompt_tokens: int | None = None,
    start_token: int = 0,
) -> set[Key]:
    """What a worker writes when it saves ``block_hashes`` up to
    ``layout.align(saved_tokens)`` tokens (from ``start_token``): the
    reference's ``store_mask`` turned into keys by :func:`store_from_masks`."""
    ref = ReferenceCoordinator(layout)
    aligned = layout.align(
        min(saved_tokens, len(block_hashes) * layout.hash_block_size)
    )
    masks = ref.store_mask(aligned, start_token=start_token,
                           num_prompt_tokens=num_prompt_tokens)  # fmt: skip
    return store_from_masks(layout, block_hashes, aligned, masks, start_token)


def preset_requests(
    preset: str, seed: int, n_requests: int, max_hashes: int, seeds: int = 3
) -> tuple[CacheLayout, random.Random, list[list[bytes]]]:
    """``(layout, rng, requests)``: the ``preset``'s layout, the
    ``random.Random(seed)`` the requests were drawn from (for the caller to
    draw on) and ``n_requests`` chained requests of 0 to ``max_hashes``
    hashes, request ``i`` on chain ``i % seeds`` (so requests share
    prefixes)."""
    rng = random.Random(seed)
    return make_layout(preset), rng, random_chains(rng, n_requests, max_hashes, seeds)


def random_chains(
    rng: random.Random, n_requests: int, max_hashes: int, seeds: int = 3
) -> list[list[bytes]]:
    """``n_requests`` chained requests of 0 to ``max_hashes`` hashes (lengths
    drawn from ``rng``), request ``i`` on chain ``i % seeds``."""
    return [
        chained_hashes(i % seeds, rng.randint(0, max_hashes)) for i in range(n_requests)
    ]


def merged_group_case(
    n_requests: int, engines: int = 70
) -> tuple[CacheLayout, list[list[bytes]], list[set[Key]], list[int]]:
    """``(layout, requests, stores_, lens)`` for :func:`helpers.merged_full_layout`
    (two merged full-attention groups, 0 and 1): ``n_requests`` chained
    requests of 0-20 hashes; per engine and request, group 0 holds a random
    prefix of the hashes and group 1 a random prefix of that, so a block is
    whole (both keys present) only up to the shorter one; each length is the
    whole prompt. Deterministic (seed 11)."""
    layout = merged_full_layout()
    rng = random.Random(11)
    requests = random_chains(rng, n_requests, 20)
    stores_ = []
    for _ in range(engines):
        keys: set[Key] = set()
        for r in requests:
            cut = rng.randint(0, len(r))
            for g in (0, 1):
                keys |= {(g, h) for h in r[: cut if g == 0 else rng.randint(0, cut)]}
        stores_.append(keys)
    lens = [len(r) * layout.hash_block_size for r in requests]
    return layout, requests, stores_, lens


def edge_fleet_batch(
    layout: CacheLayout, sizes: Sequence[int], hit: str, engines: int = 3
) -> tuple[list[list[bytes]], list[set[Key]], list[int]]:
    """``(requests, stores_, lens)``: five chained requests of ``sizes``
    hashes (seeds 0-4; ``sizes[1]`` is 0: an empty request); ``engines``
    stores each holding every saved key (``hit == "all"``) or nothing
    (``"none"``); lengths: the whole first prompt, 0, one hash block, 0, and
    past the last prompt (all-hit: full attention bounds the scan) or its
    whole length."""
    hbs = layout.hash_block_size
    requests = [chained_hashes(i, n) for i, n in enumerate(sizes)]
    full: set[Key] = set()
    for r in requests:
        full |= saved_keys(layout, r, layout.align(len(r) * hbs))
    stores_ = [full if hit == "all" else set()] * engines
    last = 10**9 if hit == "all" else sizes[-1] * hbs
    return requests, stores_, [sizes[0] * hbs, 0, hbs, 0, last]


def _universe(layout: CacheLayout, requests: Sequence[Sequence[bytes]]) -> list[Key]:
    """Every (group, hash unit) key the requests could touch, in a stable order."""
    hashes = list(dict.fromkeys(bytes(h) for r in requests for h in r))
    return [(g, h) for g in range(layout.num_groups) for h in hashes]


STORE_MODES: tuple[str, ...] = ("none", "all", "random", "prefix", "saved", "mixed")


@st.composite
def stores(
    draw: st.DrawFn,
    layout: CacheLayout,
    requests: Sequence[Sequence[bytes]],
    *,
    modes: Sequence[str] = STORE_MODES,
) -> set[Key]:
    """Store contents for ``requests`` under ``layout``, as a ``set`` of keys.

    Modes: ``none`` (empty); ``all`` (every group x every hash unit);
    ``random`` (each key of that universe kept with probability 0.1/0.5/0.9);
    ``prefix`` (per group and request, the keys of a random-length prefix, then
    random evictions: long hits with holes); ``saved`` (one or more requests
    saved by a worker through ``store_mask``, in 1-3 chunked-prefill steps,
    with or without ``num_prompt_tokens``, then random evictions); ``mixed``
    (``saved`` plus a sparse ``random``).
    """
    mode = draw(st.sampled_from(list(modes)))
    universe = _universe(layout, requests)
    rnd = draw(st.randoms(use_true_random=False))
    if mode == "none":
        return set()
    if mode == "all":
        return set(universe)
    if mode == "random":
        p = draw(st.sampled_from([0.1, 0.5, 0.9]))
        return {k for k in universe if rnd.random() < p}
    keys: set[Key] = set()
    if mode == "prefix":
        for g in range(layout.num_groups):
            for r in requests:
                cut = draw(st.integers(0, len(r)))
                keys.update((g, bytes(h)) for h in r[:cut])
    else:
        keys = draw(_saved_store(layout, requests))
        if mode == "mixed":
            keys.update(k for k in universe if rnd.random() < 0.1)
    evict = draw(st.sampled_from([0.0, 0.0, 0.05, 0.3]))
    if evict:
        keys = {k for k in sorted(keys) if rnd.random() >= evict}
    return keys


@st.composite
def _saved_store(
    draw: st.DrawFn, layout: CacheLayout, requests: Sequence[Sequence[bytes]]
) -> set[Key]:
    hbs = layout.hash_block_size
    keys: set[Key] = set()
    if not requests:
        return keys
    savers = draw(st.lists(st.integers(0, len(requests) - 1), min_size=1, max_size=3))
    for i in savers:
        r = requests[i]
        n_tok = len(r) * hbs
        num_prompt = draw(st.one_of(st.none(), st.integers(0, n_tok + hbs - 1)))
        # Chunked prefill: save [0, c1), then [c1, c2) ... with start_token.
        cuts = sorted(draw(st.lists(st.integers(0, n_tok), min_size=1, max_size=3)))
        start = 0
        for cut in cuts:
            aligned = layout.align(cut)
            if num_prompt is not None and draw(st.booleans()):
                aligned = layout.align(min(aligned, num_prompt))
            keys |= saved_keys(layout, r, aligned, num_prompt_tokens=num_prompt,
                               start_token=min(start, aligned))  # fmt: skip
            start = aligned if draw(st.booleans()) else draw(st.integers(0, aligned))
    return keys


# ---------------------------------------------------------------------------
# Lengths and whole cases
# ---------------------------------------------------------------------------


def has_full_attention(layout: CacheLayout) -> bool:
    """Whether a full-attention SpecGroup bounds every scan (then no length,
    however far past the hashes, makes a scan index beyond them)."""
    return any(sg.kind == "full" for sg in layout.spec_groups)


def max_valid_length(layout: CacheLayout, n_hashes: int) -> int | None:
    """The largest ``max_length`` / ``num_tokens`` safe for every layout with
    ``n_hashes`` hashes (``None``: unbounded, see :func:`has_full_attention`).

    Up to ``n_hashes * hash_block_size + hash_block_size - 1`` (a prompt whose
    last partial hash block has no hash) every scan stays inside the hashes,
    since block sizes and the alignment are multiples of the hash size."""
    if has_full_attention(layout):
        return None
    return n_hashes * layout.hash_block_size + layout.hash_block_size - 1


@st.composite
def lengths(draw: st.DrawFn, layout: CacheLayout, n_hashes: int) -> int:
    """One ``max_length`` / ``num_tokens`` for a request with ``n_hashes``
    hashes: 0, the whole prompt, aligned, unaligned, one token into the last
    partial hash block, or (only with a full-attention SpecGroup) past the
    hashes."""
    n_tok = n_hashes * layout.hash_block_size
    top = n_tok + layout.hash_block_size - 1
    options = [
        st.just(0),
        st.just(n_tok),
        st.integers(0, top),
        st.integers(0, top).map(layout.align),
        st.integers(0, top)
        .map(lambda x: layout.align(x) + 1)
        .filter(lambda x: x <= top),
    ]
    if has_full_attention(layout):
        options.append(st.integers(n_tok + 1, n_tok + 3 * layout.scheduler_block_size))
    return draw(st.one_of(options))


@st.composite
def case(
    draw: st.DrawFn,
    layout_strategy: st.SearchStrategy[CacheLayout] | None = None,
    *,
    width: int = 8,
    min_requests: int = 1,
    max_requests: int = 4,
    max_hashes: int = MAX_HASHES,
    store_modes: Sequence[str] = STORE_MODES,
) -> tuple[CacheLayout, list[list[bytes]], set[Key], list[int]]:
    """``(layout, requests, exists, lens)``: a layout (from ``layout_strategy``,
    default :func:`layouts`), a batch of requests' hash lists
    (:func:`hash_batches`), a store (:func:`stores`) and one length per request
    (:func:`lengths`), valid both as ``max_length`` for
    ``find_longest_cache_hit`` and as ``num_tokens`` for ``lookup``."""
    layout = draw(layout_strategy if layout_strategy is not None else layouts())
    requests = draw(
        hash_batches(width, min_requests, max_requests, max_size=max_hashes)
    )
    exists = draw(stores(layout, requests, modes=store_modes))
    lens = [draw(lengths(layout, len(r))) for r in requests]
    return layout, requests, exists, lens


@st.composite
def fleet_case(
    draw: st.DrawFn, layout_strategy: st.SearchStrategy[CacheLayout] | None = None
) -> tuple[CacheLayout, list[list[bytes]], list[set[Key]], list[int]]:
    """``case(layout_strategy)`` plus 0-3 more engines' stores (:func:`stores`
    of the same requests: none, all, random, prefix, saved, mixed):
    ``(layout, requests, stores_, lens)``, engine 0's store the case's."""
    layout, requests, exists, lens = draw(case(layout_strategy))
    more = draw(st.integers(0, 3))
    stores_ = [exists] + [draw(stores(layout, requests)) for _ in range(more)]
    return layout, requests, stores_, lens


def full_fleet_case() -> st.SearchStrategy[
    tuple[CacheLayout, list[list[bytes]], list[set[Key]], list[int]]
]:
    """:func:`fleet_case` over full-attention-only layouts without scratch
    groups: mostly one non-fine SpecGroup, the joint bitset scan's case."""
    return fleet_case(layouts(kinds=("full",), allow_scratch_groups=False))
