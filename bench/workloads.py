"""Synthetic serving traffic for kvhit's CLI, benchmarks and tests.

A workload is what a scheduler sees at one step: a batch of requests (chained
block hashes plus prompt lengths) and an external store that earlier traffic
filled the way vLLM's saving worker does, then partly evicted.

Traffic model (all draws from one ``random.Random(seed)``, so a seed fixes the
workload bit for bit, independent of ``PYTHONHASHSEED``):

* a pool of system prompts, chosen per conversation with Zipf weights;
* conversations: a system prompt followed by conversation-unique content; each
  turn's prompt is a prefix of the conversation's token stream, so a later
  turn extends the earlier one (multi-turn growth);
* prompt lengths drawn from a configurable distribution (log-uniform by
  default) between ``min_tokens`` and ``max_tokens``.

Tokens are never materialised: every ``hash_block_size`` tokens of a stream are
one *chunk id* (an int naming their content), and block hash ``i`` is
``sha256(hash[i-1] || chunk_id[i])`` truncated to ``hash_bytes``, so equal prefixes give equal hashes and
any difference changes every later hash, as with vLLM's chained hashes.

The store is filled from the first ``history`` requests of the stream ("served
earlier"): for each, the keys ``ReferenceCoordinator.store_mask`` keeps, as
``(group, block_hashes[(c + 1) * block_size // hash_block_size - 1])`` per kept
chunk ``c``, plus Mamba states at scheduler-block boundaries (store masks never
include Mamba, the connector saves those states separately). Eviction then
punches holes: whole suffixes of some served prompts while serving (LRU-like,
so popular prefixes are re-stored later) and a random fraction of all keys at
the end. The batch is the next ``num_requests`` requests of the same stream.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvhit.bench.names import PRESET_DESCRIPTIONS
from kvhit.coordinator.reference import ReferenceCoordinator
from kvhit.coordinator.specs import (
    CacheLayout,
    FullAttention,
    Group,
    Mamba,
    SlidingWindow,
)

if TYPE_CHECKING:  # pragma: no cover - only for annotations
    import torch

    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch

Key = tuple[int, bytes]
#: ``progress(stage, done, total)``; called at most ~100 times per stage.
ProgressFn = Callable[[str, int, int], None]

# ---------------------------------------------------------------------------
# Layout presets
# ---------------------------------------------------------------------------


def _dsv4_flash() -> CacheLayout:
    # DeepSeek-V4-Flash: MLA full attention plus four sliding-window groups,
    # one of which holds the MTP (EAGLE) draft layers.
    return CacheLayout(
        groups=[
            Group(FullAttention(block_size=256), name="full_mla"),
            Group(SlidingWindow(block_size=64, sliding_window=128), name="swa"),
            Group(
                SlidingWindow(block_size=64, sliding_window=128),
                eagle=True,
                name="swa_mtp",
            ),
            Group(SlidingWindow(block_size=4, sliding_window=8), name="swa_idx"),
            Group(SlidingWindow(block_size=8, sliding_window=128), name="swa_c"),
        ],
        scheduler_block_size=256,
        hash_block_size=4,
        use_eagle=True,
    )


def _qwen3_next() -> CacheLayout:
    # Hybrid full attention + linear attention (Mamba-like state); hits may
    # land on any 16-token hash unit.
    return CacheLayout(
        groups=[
            Group(FullAttention(block_size=64), name="full"),
            Group(Mamba(block_size=64), name="linear"),
        ],
        scheduler_block_size=64,
        hash_block_size=16,
        partial_hash_hits=True,
    )


def _gemma3() -> CacheLayout:
    # Interleaved global and 1024-token local attention layers.
    return CacheLayout(
        groups=[
            Group(FullAttention(block_size=16), name="global"),
            Group(SlidingWindow(block_size=16, sliding_window=1024), name="local"),
        ],
        scheduler_block_size=16,
        hash_block_size=16,
    )


def _llama() -> CacheLayout:
    return CacheLayout(
        groups=[Group(FullAttention(block_size=16), name="full")],
        scheduler_block_size=16,
        hash_block_size=16,
    )


@dataclass(frozen=True)
class Preset:
    """A named cache layout the benchmarks and the CLI know, and the traffic
    shape its workloads take (``"serving"``: the multi-turn model of the
    module docstring; ``"long-hit"``: :func:`generate_long_hit`)."""

    name: str
    description: str
    factory: Callable[[], CacheLayout] = field(repr=False)
    traffic: Literal["serving", "long-hit"] = "serving"

    def layout(self) -> CacheLayout:
        return self.factory()


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("dsv4-flash", PRESET_DESCRIPTIONS["dsv4-flash"], _dsv4_flash),
        Preset("qwen3-next", PRESET_DESCRIPTIONS["qwen3-next"], _qwen3_next),
        Preset("gemma3", PRESET_DESCRIPTIONS["gemma3"], _gemma3),
        Preset("llama", PRESET_DESCRIPTIONS["llama"], _llama),
        Preset(
            "dsv4-longhit",
            PRESET_DESCRIPTIONS["dsv4-longhit"],
            _dsv4_flash,
            traffic="long-hit",
        ),
    )
}


def make_layout(preset: str) -> CacheLayout:
    """The :class:`CacheLayout` of a preset name (see :data:`PRESETS`)."""
    try:
        return PRESETS[preset].layout()
    except KeyError:
        raise ValueError(
            f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}"
        ) from None


# ---------------------------------------------------------------------------
# Traffic configuration
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrafficConfig:
    """Knobs of the traffic generator. Every field has a serving-like default.

    Attributes:
        num_requests: requests in the looked-up batch.
        min_tokens, max_tokens: prompt length bounds (tokens).
        length_dist: ``"log-uniform"`` (many short, some very long prompts) or
            ``"uniform"``.
        hash_bytes: width of a block hash (8, 16 or 32; vLLM uses 32 for
            sha256, 16 for xxhash128).
        num_system_prompts: size of the system-prompt pool.
        zipf_s: Zipf exponent over the pool (a few prompts dominate).
        system_tokens: (min, max) system-prompt length, log-uniform, capped at
            half of ``max_tokens``.
        multi_turn_prob: probability that a request continues an open
            conversation instead of starting a new one.
        open_conversations: how many recent conversations may be continued.
        turn_growth_tokens: (min, max) tokens a turn adds (answer + new
            message), log-uniform.
        history: requests served (and stored) before the batch, as a multiple
            of ``num_requests``.
        suffix_evict_prob: per served request, probability of evicting the
            tail of an older served prompt (from a random point).
        random_evict_fraction: fraction of the final store's keys removed at
            random.
        seed: fixes everything.
    """

    num_requests: int = 1024
    min_tokens: int = 256
    max_tokens: int = 16384
    length_dist: Literal["log-uniform", "uniform"] = "log-uniform"
    hash_bytes: int = 32
    num_system_prompts: int = 32
    zipf_s: float = 1.1
    system_tokens: tuple[int, int] = (256, 4096)
    multi_turn_prob: float = 0.5
    open_conversations: int = 256
    turn_growth_tokens: tuple[int, int] = (32, 2048)
    history: float = 1.0
    suffix_evict_prob: float = 0.1
    random_evict_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {self.num_requests}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"need 1 <= min_tokens ({self.min_tokens}) <= max_tokens "
                f"({self.max_tokens})"
            )
        if self.length_dist not in ("log-uniform", "uniform"):
            raise ValueError(
                f"length_dist must be 'log-uniform' or 'uniform', got "
                f"{self.length_dist!r}"
            )
        if self.hash_bytes not in (8, 16, 32):
            raise ValueError(f"hash_bytes must be 8, 16 or 32, got {self.hash_bytes}")
        if self.num_system_prompts < 1:
            raise ValueError("num_system_prompts must be >= 1")
        for name in ("multi_turn_prob", "suffix_evict_prob", "random_evict_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.history < 0:
            raise ValueError(f"history must be >= 0, got {self.history}")
        for name in ("system_tokens", "turn_growth_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi")


# ---------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadStats:
    """How the store came to be (for reports and tests)."""

    history_requests: int
    keys_stored: int
    keys_suffix_evicted: int
    keys_random_evicted: int
    seconds: float


@dataclass(frozen=True, eq=False)
class Workload:
    """A batch of requests and the store they are looked up against.

    ``hash_lists[i]`` are request ``i``'s chained block hashes (one per
    ``layout.hash_block_size`` tokens, ``num_tokens[i] // hash_block_size`` of
    them); ``store_keys`` the ``(group_id, hash)`` keys present in the store.
    Lists are shared with other workloads made by :meth:`take`: don't mutate.
    """

    preset: str
    layout: CacheLayout
    config: TrafficConfig
    hash_lists: tuple[list[bytes], ...]
    num_tokens: tuple[int, ...]
    store_keys: frozenset[Key]
    stats: WorkloadStats

    @property
    def hash_bytes(self) -> int:
        return self.config.hash_bytes

    def __len__(self) -> int:
        return len(self.hash_lists)

    @property
    def total_hashes(self) -> int:
        return sum(len(h) for h in self.hash_lists)

    def take(self, n: int) -> Workload:
        """The first ``n`` requests against the same store (for batch sweeps)."""
        if not 0 <= n <= len(self):
            raise ValueError(f"take({n}) out of range for {len(self)} requests")
        return Workload(
            self.preset,
            self.layout,
            self.config,
            self.hash_lists[:n],
            self.num_tokens[:n],
            self.store_keys,
            self.stats,
        )

    # -- engine-side views ------------------------------------------------

    def hash_batch(self, device: str | torch.device = "cpu") -> HashBatch:
        """The batch packed as a :class:`~kvhit.coordinator.packing.HashBatch`."""
        from kvhit.coordinator.packing import HashBatch

        return HashBatch.from_bytes(list(self.hash_lists), self.hash_bytes, device)

    def num_tokens_tensor(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """``num_tokens`` as an int64 tensor ``[B]``."""
        import torch

        return torch.tensor(self.num_tokens, dtype=torch.int64, device=device)

    def key_index(
        self, device: str | torch.device = "cpu", backend: str = "auto"
    ) -> KeyIndex:
        """A :class:`~kvhit.coordinator.key_index.KeyIndex` holding ``store_keys``.

        Capacity is twice the key count (rounded up to a power of two) so the
        table runs at most half full.
        """
        import torch

        from kvhit.coordinator.key_index import KeyIndex
        from kvhit.coordinator.packing import pack_hashes

        keys = list(self.store_keys)
        capacity = 1 << max(10, (2 * len(keys) - 1).bit_length())
        index = KeyIndex(self.hash_bytes, capacity, device=device, backend=backend)
        if keys:
            gids = torch.tensor([g for g, _ in keys], dtype=torch.int64)
            packed = pack_hashes([h for _, h in keys], self.hash_bytes)
            index.add(gids.to(device), packed.to(device))
        return index

    # -- the oracle -------------------------------------------------------

    def reference(self) -> ReferenceCoordinator:
        return ReferenceCoordinator(self.layout)

    def reference_lookup(
        self,
        indices: Sequence[int] | None = None,
        ref: ReferenceCoordinator | None = None,
    ) -> list[int]:
        """The store worker's hit (``ReferenceCoordinator.lookup``) per request."""
        ref = ref or self.reference()
        idx = range(len(self)) if indices is None else indices
        exists = self.store_keys
        return [ref.lookup(self.num_tokens[i], self.hash_lists[i], exists) for i in idx]


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


class _Hasher:
    """Chained block hashes over chunk ids (see the module docstring).

    sha256, as vLLM's default block hash (and the fastest digest in CPython on
    CPUs with SHA extensions), truncated to ``hash_bytes``.
    """

    __slots__ = ("digest_size", "root", "next_id")

    def __init__(self, hash_bytes: int, seed: int) -> None:
        self.digest_size = hash_bytes
        # A seed-specific root: different seeds never share a hash.
        self.root = hashlib.sha256(f"kvhit-root-{seed}".encode()).digest()[:hash_bytes]
        self.next_id = 0  # chunk ids are handed out in order: deterministic

    def extend(self, hashes: list[bytes], count: int) -> None:
        """Appends ``count`` hashes of fresh (never seen) chunks."""
        prev = hashes[-1] if hashes else self.root
        first = self.next_id
        self.next_id += count
        sha, pack, append = hashlib.sha256, _PACK_ID, hashes.append
        if self.digest_size == 32:
            for cid in range(first, first + count):
                prev = sha(prev + pack(cid)).digest()
                append(prev)
        else:
            ds = self.digest_size
            for cid in range(first, first + count):
                prev = sha(prev + pack(cid)).digest()[:ds]
                append(prev)


_PACK_ID = struct.Struct("<Q").pack


class _Stream:
    """A token stream in units of ``hash_block_size`` tokens, hashed lazily.

    A conversation's stream starts with its system prompt's units (sharing the
    very same hash objects) and continues with fresh chunk ids.
    """

    __slots__ = ("hashes", "hasher")

    def __init__(self, hasher: _Hasher, prefix: list[bytes] | None = None) -> None:
        self.hasher = hasher
        self.hashes: list[bytes] = list(prefix) if prefix else []

    def ensure(self, units: int) -> list[bytes]:
        missing = units - len(self.hashes)
        if missing > 0:
            self.hasher.extend(self.hashes, missing)
        return self.hashes


@dataclass
class _Conversation:
    stream: _Stream
    tokens: int  # length of the latest turn's prompt
    stored_tokens: int = 0  # tokens already written to the store


def _draw_length(rng: random.Random, lo: int, hi: int, dist: str) -> int:
    if lo == hi:
        return lo
    if dist == "uniform":
        return rng.randint(lo, hi)
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


class _Progress:
    """Throttles a progress callback to ~100 calls per stage."""

    def __init__(self, fn: ProgressFn | None, stage: str, total: int) -> None:
        self.fn, self.stage, self.total = fn, stage, total
        self.step = max(1, total // 100)
        if fn is not None:
            fn(stage, 0, total)

    def __call__(self, done: int) -> None:
        if self.fn is not None and (done % self.step == 0 or done == self.total):
            self.fn(self.stage, done, self.total)


def _store_request(
    ref: ReferenceCoordinator,
    layout: CacheLayout,
    store: dict[Key, None],
    hashes: list[bytes],
    num_tokens: int,
    start_token: int,
) -> int:
    """Writes what the saving worker would for one served prompt; returns the
    aligned length now stored."""
    hbs = layout.hash_block_size
    aligned = layout.align(num_tokens)
    if aligned <= start_token:
        return start_token
    masks = ref.store_mask(
        aligned, start_token=start_token, num_prompt_tokens=num_tokens
    )
    for gid, group in enumerate(layout.groups):
        if not group.prefix_cacheable:
            continue
        bs = group.spec.block_size
        scale = bs // hbs
        end_chunk = aligned // bs
        if isinstance(group.spec, Mamba):
            # Store masks exclude Mamba; the connector saves the recurrent state
            # at scheduler-block boundaries (and, with partial hash hits, at the
            # prompt's aligned end).
            sbs = layout.scheduler_block_size
            first = start_token // sbs + 1
            for k in range(first, aligned // sbs + 1):
                store[(gid, hashes[k * sbs // hbs - 1])] = None
            if layout.partial_hash_hits:
                store[(gid, hashes[aligned // hbs - 1])] = None
            continue
        start_chunk = min(end_chunk, -(-start_token // bs))
        mask = masks[gid]
        for c in range(start_chunk, end_chunk):
            if mask is None or mask[c - start_chunk]:
                store[(gid, hashes[(c + 1) * scale - 1])] = None
        if (
            layout.partial_hash_hits
            and isinstance(group.spec, FullAttention)
            and aligned % bs
        ):
            # The partial last block, keyed by its last complete hash unit:
            # what makes fine-grained (partial) hits possible.
            store[(gid, hashes[aligned // hbs - 1])] = None
    return aligned


def _evict_suffix(
    layout: CacheLayout, store: dict[Key, None], hashes: list[bytes], cut_unit: int
) -> int:
    gids = [g for g, grp in enumerate(layout.groups) if grp.prefix_cacheable]
    removed = 0
    for u in range(cut_unit, len(hashes)):
        h = hashes[u]
        for g in gids:
            if store.pop((g, h), 0) is None:
                removed += 1
    return removed


def generate(
    preset: str | CacheLayout,
    config: TrafficConfig | None = None,
    progress: ProgressFn | None = None,
    preset_name: str | None = None,
) -> Workload:
    """Builds a deterministic workload for ``preset`` (a name or a layout).

    Args:
        preset: a key of :data:`PRESETS` or a :class:`CacheLayout`.
        config: traffic knobs; defaults to :class:`TrafficConfig()`.
        progress: ``progress(stage, done, total)`` for stages ``"traffic"``
            and ``"store"``.
        preset_name: label recorded when ``preset`` is a layout.
    """
    cfg = config or TrafficConfig()
    t0 = time.perf_counter()
    if isinstance(preset, CacheLayout):
        layout, name = preset, preset_name or "custom"
    else:
        layout, name = make_layout(preset), preset
        if PRESETS[preset].traffic == "long-hit":
            return generate_long_hit(layout, cfg, progress, name)
    hbs = layout.hash_block_size
    rng = random.Random(cfg.seed)
    hasher = _Hasher(cfg.hash_bytes, cfg.seed)

    # System prompts, lengths log-uniform, never more than half a long prompt.
    sys_hi = max(1, min(cfg.system_tokens[1], cfg.max_tokens // 2))
    sys_lo = min(cfg.system_tokens[0], sys_hi)
    sys_tokens = [
        _draw_length(rng, sys_lo, sys_hi, "log-uniform")
        for _ in range(cfg.num_system_prompts)
    ]
    sys_streams = [_Stream(hasher) for _ in sys_tokens]
    zipf_cum = list(
        itertools.accumulate(
            1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.num_system_prompts)
        )
    )

    n_hist = round(cfg.history * cfg.num_requests)
    total = n_hist + cfg.num_requests
    open_convs: list[_Conversation] = []
    turns: list[tuple[_Conversation, int]] = []
    tick = _Progress(progress, "traffic", total)
    for r in range(total):
        conv: _Conversation | None = None
        if open_convs and rng.random() < cfg.multi_turn_prob:
            cand = open_convs[rng.randrange(len(open_convs))]
            grown = cand.tokens + _draw_length(
                rng, *cfg.turn_growth_tokens, "log-uniform"
            )
            if grown <= cfg.max_tokens:
                conv, cand.tokens = cand, grown
            else:
                open_convs.remove(cand)  # the conversation hit the context limit
        if conv is None:
            k = bisect.bisect_left(zipf_cum, rng.random() * zipf_cum[-1])
            s_units = sys_tokens[k] // hbs
            # A unit straddling the end of the system prompt holds user tokens
            # too, so only whole system units are shared.
            prefix = sys_streams[k].ensure(s_units)[:s_units]
            length = _draw_length(rng, cfg.min_tokens, cfg.max_tokens, cfg.length_dist)
            conv = _Conversation(_Stream(hasher, prefix), length)
            open_convs.append(conv)
            if len(open_convs) > cfg.open_conversations:
                open_convs.pop(0)
        conv.stream.ensure(conv.tokens // hbs)
        turns.append((conv, conv.tokens))
        tick(r + 1)

    # Serve the history: store as the saving worker would, evicting as we go.
    ref = ReferenceCoordinator(layout)
    store: dict[Key, None] = {}
    served: list[tuple[_Conversation, int]] = []
    suffix_evicted = 0
    tick = _Progress(progress, "store", n_hist)
    for r in range(n_hist):
        conv, tokens = turns[r]
        hashes = conv.stream.hashes
        conv.stored_tokens = _store_request(
            ref, layout, store, hashes, tokens, conv.stored_tokens
        )
        served.append((conv, tokens // hbs))
        if len(served) > 1 and rng.random() < cfg.suffix_evict_prob:
            # LRU-like: the victim is among the older half of what was served.
            victim, v_units = served[rng.randrange(max(1, len(served) // 2))]
            if v_units:
                cut = rng.randrange(v_units)
                suffix_evicted += _evict_suffix(
                    layout, store, victim.stream.hashes[:v_units], cut
                )
                # Its next turn misses from the cut on, recomputes and
                # re-stores from there.
                victim.stored_tokens = min(
                    victim.stored_tokens, layout.align(cut * hbs)
                )
        tick(r + 1)
    keys_stored = len(store) + suffix_evicted
    n_random = int(len(store) * cfg.random_evict_fraction)
    if n_random:
        for key in rng.sample(list(store), n_random):
            del store[key]

    batch = turns[n_hist:]
    return Workload(
        preset=name,
        layout=layout,
        config=cfg,
        hash_lists=tuple(c.stream.hashes[: t // hbs] for c, t in batch),
        num_tokens=tuple(t for _, t in batch),
        store_keys=frozenset(store),
        stats=WorkloadStats(
            history_requests=n_hist,
            keys_stored=keys_stored,
            keys_suffix_evicted=suffix_evicted,
            keys_random_evicted=n_random,
            seconds=time.perf_counter() - t0,
        ),
    )


@dataclass(frozen=True)
class LongHitShape:
    """The long-hit traffic shape (issue 20), in fractions of the config's
    ``max_tokens`` so that one shape serves every prompt scale (16,384 tokens,
    the CLI's default, gives the issue's numbers).

    Attributes:
        num_system_prompts: system prompts of ``max_tokens`` tokens each.
        zipf_s: Zipf exponent of the system-prompt choice.
        min_fraction: shortest prompt as a fraction of ``max_tokens`` (prompt
            lengths are uniform in ``[max(min_tokens, max_tokens *
            min_fraction), max_tokens]``).
        shared_fractions: a request shares one of these fractions (uniformly
            chosen) of its prompt with its system prompt; the rest is unique.
        stored_fraction: fraction of the batch's requests whose
            ``store_mask`` keys the store holds (served earlier).
        random_evict_fraction: fraction of the store's keys then removed at
            random.
    """

    num_system_prompts: int = 16
    zipf_s: float = 1.0
    min_fraction: float = 0.125
    shared_fractions: tuple[float, ...] = (0.25, 0.5, 0.9, 1.0)
    stored_fraction: float = 0.5
    random_evict_fraction: float = 0.02


LONG_HIT = LongHitShape()


def generate_long_hit(
    layout: CacheLayout,
    config: TrafficConfig | None = None,
    progress: ProgressFn | None = None,
    preset_name: str = "long-hit",
    shape: LongHitShape = LONG_HIT,
) -> Workload:
    """A long-hit workload: long prompts that mostly repeat one of a few long
    system prompts, against a large store (hits are long, the table is far
    past the caches).

    Of ``config`` only ``num_requests``, ``min_tokens``, ``max_tokens``,
    ``hash_bytes`` and ``seed`` apply; the rest of the shape is ``shape``.
    The store holds what ``ReferenceCoordinator.store_mask`` keeps (plus Mamba
    states, as :func:`generate`) for a random ``stored_fraction`` of the
    batch's own requests, minus ``random_evict_fraction`` of its keys.
    At the defaults and 4096 requests of dsv4-flash's layout that is ~600K
    keys, the shape of issue 20.
    """
    cfg = config or TrafficConfig()
    t0 = time.perf_counter()
    hbs = layout.hash_block_size
    rng = random.Random(cfg.seed)
    hasher = _Hasher(cfg.hash_bytes, cfg.seed)
    hi = cfg.max_tokens
    lo = min(hi, max(cfg.min_tokens, int(hi * shape.min_fraction)))
    sys_units = hi // hbs
    sys_streams = [_Stream(hasher) for _ in range(shape.num_system_prompts)]
    zipf_cum = list(
        itertools.accumulate(
            1.0 / (k + 1) ** shape.zipf_s for k in range(shape.num_system_prompts)
        )
    )
    hash_lists: list[list[bytes]] = []
    num_tokens: list[int] = []
    tick = _Progress(progress, "traffic", cfg.num_requests)
    for r in range(cfg.num_requests):
        k = bisect.bisect_left(zipf_cum, rng.random() * zipf_cum[-1])
        length = rng.randint(lo, hi)
        frac = shape.shared_fractions[rng.randrange(len(shape.shared_fractions))]
        units = length // hbs
        # Whole hash units only: a unit straddling the shared part holds
        # unique tokens too.
        shared = min(units, int(length * frac) // hbs)
        prefix = sys_streams[k].ensure(sys_units)[:shared]
        hash_lists.append(_Stream(hasher, prefix).ensure(units))
        num_tokens.append(length)
        tick(r + 1)
    ref = ReferenceCoordinator(layout)
    store: dict[Key, None] = {}
    n_stored = round(cfg.num_requests * shape.stored_fraction)
    served = sorted(rng.sample(range(cfg.num_requests), n_stored))
    tick = _Progress(progress, "store", n_stored)
    for i, r in enumerate(served):
        _store_request(ref, layout, store, hash_lists[r], num_tokens[r], 0)
        tick(i + 1)
    keys_stored = len(store)
    n_random = int(len(store) * shape.random_evict_fraction)
    if n_random:
        for key in rng.sample(list(store), n_random):
            del store[key]
    return Workload(
        preset=preset_name,
        layout=layout,
        config=cfg,
        hash_lists=tuple(hash_lists),
        num_tokens=tuple(num_tokens),
        store_keys=frozenset(store),
        stats=WorkloadStats(
            history_requests=n_stored,
            keys_stored=keys_stored,
            keys_suffix_evicted=0,
            keys_random_evicted=n_random,
            seconds=time.perf_counter() - t0,
        ),
    )


def environment_info() -> dict[str, str]:
    """Machine, Python, torch, triton, numba and GPU versions, for benchmark
    reports."""
    import os
    import platform

    info = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(
                (
                    ln.split(":", 1)[1].strip()
                    for ln in fh
                    if ln.startswith("model name")
                ),
                None,
            )
        if model:
            info["machine"] = f"{model} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = str(torch.version.cuda)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        info["torch"] = "missing"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "missing"
    from importlib.metadata import PackageNotFoundError, version

    try:  # by its metadata: importing numba takes a second
        info["numba"] = version("numba")
    except PackageNotFoundError:
        info["numba"] = "missing"
    # numba's thread pool (its prange loops) follows this variable.
    info["numba_threads"] = os.environ.get("NUMBA_NUM_THREADS", "default")
    return info
