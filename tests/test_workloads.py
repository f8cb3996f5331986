"""The benchmark workload generator: deterministic, valid, realistic enough."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import run_python

from kvhit.bench.workloads import (
    LONG_HIT,
    PRESETS,
    TrafficConfig,
    Workload,
    environment_info,
    generate,
    generate_long_hit,
    make_layout,
)
from kvhit.coordinator.packing import pack_hashes
from kvhit.coordinator.reference import ReferenceCoordinator
from kvhit.coordinator.specs import CacheLayout, Mamba

SMALL = TrafficConfig(num_requests=96, min_tokens=64, max_tokens=2048, seed=7)


@pytest.fixture(scope="module", params=sorted(PRESETS))
def workload(request: pytest.FixtureRequest) -> Workload:
    return generate(request.param, SMALL)


def test_presets_are_valid_layouts() -> None:
    for name in PRESETS:
        layout = make_layout(name)
        assert isinstance(layout, CacheLayout)
        assert layout.spec_groups
    dsv4 = make_layout("dsv4-flash")
    assert dsv4.hash_block_size == 4 and dsv4.scheduler_block_size == 256
    assert dsv4.use_eagle and dsv4.eagle_group_ids == frozenset({1, 2})
    qwen = make_layout("qwen3-next")
    assert qwen.partial_hash_hits and qwen.mamba_group_ids == frozenset({1})
    with pytest.raises(ValueError, match="unknown preset"):
        make_layout("nope")


def test_dsv4_seed_regression_3_holds_on_the_preset() -> None:
    # ARCHITECTURE.md seed regression 3, built from the preset: guards the preset.
    layout = make_layout("dsv4-flash")
    ref = ReferenceCoordinator(layout)
    hashes = [i.to_bytes(8, "little") for i in range(768 // 4)]
    store = set()
    for gid, mask in enumerate(ref.store_mask(768)):
        bs = layout.groups[gid].spec.block_size
        for c in range(768 // bs):
            if mask is None or mask[c]:
                store.add((gid, hashes[(c + 1) * bs // 4 - 1]))
    _, hit = ref.find_longest_cache_hit(hashes, 768, store)
    assert hit == 512


def test_deterministic_for_a_seed() -> None:
    a = generate("dsv4-flash", SMALL)
    b = generate("dsv4-flash", SMALL)
    assert a.hash_lists == b.hash_lists
    assert a.num_tokens == b.num_tokens
    assert a.store_keys == b.store_keys
    c = generate("dsv4-flash", TrafficConfig(**{**SMALL.__dict__, "seed": 8}))
    assert c.hash_lists != a.hash_lists


def test_deterministic_across_hash_seeds() -> None:
    # Set iteration order depends on PYTHONHASHSEED; the workload must not.
    code = (
        "from kvhit.bench.workloads import generate, TrafficConfig;"
        "import hashlib;"
        "w = generate('gemma3', TrafficConfig(num_requests=32, max_tokens=1024));"
        "print(hashlib.sha256(repr((w.hash_lists, w.num_tokens, "
        "sorted(w.store_keys))).encode()).hexdigest())"
    )
    outs = {
        run_python(code, env={"PYTHONHASHSEED": seed, "PATH": ""})
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_shapes_and_widths(workload: Workload) -> None:
    hbs = workload.layout.hash_block_size
    assert len(workload) == SMALL.num_requests
    for hashes, n in zip(workload.hash_lists, workload.num_tokens, strict=True):
        assert SMALL.min_tokens <= n <= SMALL.max_tokens
        assert len(hashes) == n // hbs
        assert all(len(h) == SMALL.hash_bytes for h in hashes)
    groups = range(workload.layout.num_groups)
    assert all(
        g in groups and len(h) == SMALL.hash_bytes for g, h in workload.store_keys
    )


@pytest.mark.parametrize("hash_bytes", [8, 16, 32])
def test_hash_width_is_configurable(hash_bytes: int) -> None:
    cfg = TrafficConfig(num_requests=8, max_tokens=512, hash_bytes=hash_bytes)
    w = generate("llama", cfg)
    assert {len(h) for hs in w.hash_lists for h in hs} == {hash_bytes}


def _long_hit(preset: str) -> bool:
    return PRESETS[preset].traffic == "long-hit"


def test_store_is_non_empty_and_has_holes(workload: Workload) -> None:
    st = workload.stats
    assert workload.store_keys
    # Long-hit traffic evicts at random only (no suffix eviction).
    assert st.keys_suffix_evicted > 0 or _long_hit(workload.preset)
    assert st.keys_random_evicted > 0
    assert len(workload.store_keys) < st.keys_stored
    # Holes are visible to lookups: some hits shrink once evictions happen.
    if _long_hit(workload.preset):
        full = generate_long_hit(
            workload.layout,
            SMALL,
            preset_name=workload.preset,
            shape=replace(LONG_HIT, random_evict_fraction=0.0),
        )
    else:
        full = generate(
            workload.preset,
            TrafficConfig(
                **{
                    **SMALL.__dict__,
                    "suffix_evict_prob": 0.0,
                    "random_evict_fraction": 0.0,
                }
            ),
        )
    assert full.hash_lists == workload.hash_lists
    assert workload.store_keys < full.store_keys
    holed = workload.reference_lookup()
    intact = full.reference_lookup()
    assert all(h <= i for h, i in zip(holed, intact, strict=True))
    assert sum(holed) < sum(intact)
    assert any(intact)


def test_shared_prefixes_share_hashes(workload: Workload) -> None:
    hl = workload.hash_lists
    # Some pairs of requests share a first hash (same system prompt) ...
    firsts = [h[0] for h in hl if h]
    assert len(set(firsts)) < len(firsts)
    # ... and a shared hash at position i implies the whole prefix is shared
    # (chained hashes), while prefixes diverge forever after a difference.
    by_first: dict[bytes, list[bytes]] = {}
    for h in hl:
        if not h:
            continue
        other = by_first.setdefault(h[0], h)
        n = min(len(h), len(other))
        common = next((i for i in range(n) if h[i] != other[i]), n)
        assert set(h[common:n]).isdisjoint(other[common:n])


def test_multi_turn_extends_earlier_prompts(workload: Workload) -> None:
    hl = sorted((h for h in workload.hash_lists if h), key=len)
    prefixes = {tuple(h) for h in hl}
    extended = sum(
        1
        for h in hl
        if any(tuple(h[:k]) in prefixes for k in range(1, len(h)) if k > len(h) // 2)
    )
    assert extended > 0


def test_mamba_states_are_stored() -> None:
    w = generate("qwen3-next", SMALL)
    mamba = next(iter(w.layout.mamba_group_ids))
    assert any(g == mamba for g, _ in w.store_keys)
    hits = w.reference_lookup()
    assert any(h % w.layout.scheduler_block_size for h in hits), "partial hits"


def test_progress_callback_and_take() -> None:
    seen: list[tuple[str, int, int]] = []
    w = generate(
        "llama",
        TrafficConfig(num_requests=50, max_tokens=512),
        progress=lambda *a: seen.append(a),
    )
    stages = {s for s, _, _ in seen}
    assert stages == {"traffic", "store"}
    assert ("traffic", 100, 100) in seen
    sub = w.take(10)
    assert len(sub) == 10 and sub.store_keys is w.store_keys
    with pytest.raises(ValueError):
        w.take(51)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="hash_bytes"):
        TrafficConfig(hash_bytes=12)
    with pytest.raises(ValueError, match="min_tokens"):
        TrafficConfig(min_tokens=10, max_tokens=5)


def test_mamba_excluded_from_store_masks_but_present() -> None:
    layout = make_layout("qwen3-next")
    ref = ReferenceCoordinator(layout)
    masks = ref.store_mask(256, num_prompt_tokens=256)
    mamba = next(iter(layout.mamba_group_ids))
    assert isinstance(layout.groups[mamba].spec, Mamba)
    assert masks[mamba] is not None and not any(masks[mamba])


def test_engine_views_build() -> None:
    w = generate("llama", TrafficConfig(num_requests=8, max_tokens=512))
    batch = w.hash_batch("cpu")
    assert len(batch) == 8 and batch.total == w.total_hashes
    assert batch.to_bytes() == [list(h) for h in w.hash_lists]
    assert w.num_tokens_tensor().tolist() == list(w.num_tokens)
    index = w.key_index("cpu")
    assert len(index) == len(w.store_keys)
    # Every stored key is present, and only those: the first hash of every
    # request under a group id no layout has is not.
    gids, hashes = zip(*sorted(w.store_keys), strict=True)
    packed = pack_hashes(list(hashes), w.hash_bytes)
    assert bool(index.contains(torch.tensor(gids), packed).all())
    firsts = pack_hashes([h[0] for h in w.hash_lists], w.hash_bytes)
    assert not bool(index.contains(torch.full((8,), 99), firsts).any())


def test_environment_info_names_the_versions() -> None:
    info = environment_info()
    for key in ("date", "machine", "python", "torch", "triton", "numba"):
        assert info[key], key


def test_long_hit_shape() -> None:
    # Issue 20's shape at a small scale: dsv4-flash's layout, prompts
    # max/8..max tokens sharing 25/50/90/100 % with one of 16 system prompts
    # of max tokens, the store from half the requests, 2 % evicted.
    cfg = TrafficConfig(num_requests=200, max_tokens=4096, seed=3)
    w = generate("dsv4-longhit", cfg)
    assert w.preset == "dsv4-longhit"
    assert w.layout == make_layout("dsv4-flash")
    hbs = w.layout.hash_block_size
    assert all(512 <= n <= 4096 for n in w.num_tokens)
    assert len(set(w.num_tokens)) > 100  # uniform, not a few values
    assert w.stats.history_requests == 100
    assert w.stats.keys_random_evicted == int(w.stats.keys_stored * 0.02)
    # Requests on one system prompt agree on a prefix of one of the four
    # fractions; none shares more than its fraction allows.
    firsts: dict[bytes, list[int]] = {}
    for i, h in enumerate(w.hash_lists):
        firsts.setdefault(h[0], []).append(i)
    assert 1 < len(firsts) <= 16
    # Zipf(1): the most popular system prompt carries the most requests.
    sizes = sorted((len(v) for v in firsts.values()), reverse=True)
    assert sizes[0] > 3 * sizes[-1]
    fractions = set()
    for members in firsts.values():
        ref = max(members, key=lambda i: w.num_tokens[i])
        for i in members:
            if i == ref:
                continue
            a, b = w.hash_lists[i], w.hash_lists[ref]
            n = min(len(a), len(b))
            common = next((k for k in range(n) if a[k] != b[k]), n)
            fractions.add(round(common * hbs / w.num_tokens[i], 2))
    assert {0.25, 0.5, 0.9, 1.0} & fractions
    # Long hits: most stored requests' answers cover most of their prompt.
    hits = w.reference_lookup()
    assert sum(hits) > 0.4 * sum(w.num_tokens)


def test_long_hit_is_deterministic_and_listed() -> None:
    cfg = TrafficConfig(num_requests=40, max_tokens=2048, seed=5)
    a, b = generate("dsv4-longhit", cfg), generate("dsv4-longhit", cfg)
    assert a.hash_lists == b.hash_lists and a.store_keys == b.store_keys
    assert PRESETS["dsv4-longhit"].traffic == "long-hit"
    assert PRESETS["dsv4-flash"].traffic == "serving"
