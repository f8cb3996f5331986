"""Differential test: kvhit's ReferenceCoordinator against vLLM 0.33.0 itself.

vLLM's real ``MooncakeStoreCoordinator`` and ``MooncakeStoreWorker.lookup`` run
on the CPU through ``kvhit.bench.vllm_oracle`` (bench/vllm_oracle.py) (install it with
``.ci/install-vllm-oracle``; without it these tests skip, saying why).

Every generated case is a random layout (1-5 groups of all four kinds, merged
twins, tags, EAGLE flags, ``use_eagle``, partial hash hits, retention
intervals, extra retained tokens, scratch groups, and now and then an invalid
block size or retention interval), two requests sharing a prefix with repeated
hash values, store contents (none, everything, random subsets, what
``store_mask`` keeps plus evictions) and a dozen calls of every coordinator
method with lengths from 0 to past the hashes, aligned or not. Results must be
equal exactly; where vLLM fails (``AssertionError`` / ``IndexError``) kvhit must
raise ``ValueError``, and a layout vLLM refuses at construction must be one
``CacheLayout`` refuses.

``KVHIT_DIFF_EXAMPLES=N`` runs N hypothesis examples (default 3000: ~5 s, plus
vLLM's import, ~5 s once compiled, ~15 s the first time). ``KVHIT_DIFF_STRICT_TAIL_KEYS=1`` also fails on inputs
where vLLM's worker asserts in ``_tail_key_boundaries`` after finding a hit
(see the oracle's module docs); by default those are only counted.
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.bench import vllm_oracle as vo

EXAMPLES = int(os.environ.get("KVHIT_DIFF_EXAMPLES", "3000"))
STRICT_TAIL_KEYS = os.environ.get("KVHIT_DIFF_STRICT_TAIL_KEYS", "") not in ("", "0")

_TALLY: Counter = Counter()
_EXAMPLES: dict[str, str] = {}


@pytest.fixture(scope="module")
def vllm_mods() -> vo.VllmModules:
    mods, reason = vo.load_vllm()
    if mods is None:
        pytest.skip(reason)
    return mods


@pytest.fixture(scope="module")
def make_ref(vllm_mods):
    make, why = vo.kvhit_factory()
    if make is None:
        pytest.skip(why)
    yield make
    if _TALLY:
        lines = [
            f"{v:7d}  {k}" for k, v in sorted(_TALLY.items(), key=lambda kv: -kv[1])
        ]
        sys.stderr.write("\nvLLM differential tally:\n" + "\n".join(lines) + "\n")


def test_oracle_runs_vllm_seed_regressions(vllm_mods):
    """The oracle itself reproduces ARCHITECTURE.md's seed regressions."""
    for name, got, want in vo.seed_checks(vllm_mods):
        assert got == want, name


def test_oracle_leaves_no_vllm_behind(vllm_mods):
    """Loading the oracle from its private folder leaves `import vllm` as it was."""
    if vllm_mods.origin == "installed vllm":
        pytest.skip("vLLM is installed normally here")
    assert "vllm" not in sys.modules
    assert not any(str(vo.oracle_dir()) in p for p in sys.path)


def _stand_in(name: str, *fields: str) -> type:
    """A class that is not kvhit's: only its name and attributes match."""

    def init(self, *args, tag=None, **kw):
        self.__dict__.update(zip(fields, args, strict=False), tag=tag, **kw)

    return type(name, (), {"__init__": init})


def test_oracle_is_duck_typed_on_stand_ins(vllm_mods):
    """The converter needs only attribute and class names (kvhit's or not)."""
    full = _stand_in("FullAttention", "block_size")
    swa = _stand_in("SlidingWindow", "block_size", "sliding_window")
    mamba = _stand_in("Mamba", "block_size")
    chunked = _stand_in("ChunkedLocal", "block_size", "attention_chunk_size")
    assert not isinstance(full(16), vo.FullAttention)
    lay = vo.LayoutParams(
        [
            vo.Group(full(16)),
            vo.Group(full(16, tag="mla")),
            vo.Group(swa(16, 32, extra_retained_tokens=16)),
            vo.Group(swa(16, 48)),
            vo.Group(mamba(16), prefix_cacheable=False),
            vo.Group(chunked(16, 64), eagle=False),
        ],
        16,
        16,
    )
    oracle = vo.VllmOracle(lay, vllm_mods)
    # Tags split equal specs; extra retained tokens widen the window so that
    # groups 2 and 3 merge; the scratch Mamba group takes no part in hits.
    merged = sorted(sorted(g.group_ids) for g in oracle.coord.attention_groups)
    assert merged == [[0], [1], [2, 3], [5]]


def test_kvhit_layouts_match_vllm_merging(vllm_mods, make_ref):
    """Merged SpecGroups and EAGLE group ids agree on random layouts."""
    rng = random.Random(7)
    compared = 0
    for _ in range(300):
        params = vo.random_layout(rng)
        try:
            oracle = vo.VllmOracle(params, vllm_mods)
            ref = make_ref(params)
        except (AssertionError, ValueError, TypeError):
            continue
        compared += 1
        ours = sorted(tuple(sg.group_ids) for sg in ref.layout.spec_groups)
        theirs = sorted(tuple(g.group_ids) for g in oracle.coord.attention_groups)
        assert ours == theirs, repr(params)
        assert ref.layout.eagle_group_ids == oracle.eagle_group_ids, repr(params)
        order_ours = [sg.group_ids[0] for sg in ref.layout.spec_groups]
        order_theirs = [g.group_ids[0] for g in oracle.coord.attention_groups]
        assert order_ours == order_theirs, repr(params)
    assert compared > 100


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**64 - 1))
def test_reference_matches_vllm(vllm_mods, make_ref, seed):
    # One seed per case: hypothesis drawing every choice (st.randoms) is ~10x
    # slower and shrinks poorly here; the failure message prints the whole
    # case, and `python -m kvhit.bench.vllm_oracle` replays seeds in bulk.
    case = vo.random_case(random.Random(seed))
    res = vo.run_case(case, make_ref, vllm_mods)
    _TALLY.update(res.tally)
    for k, v in res.examples.items():
        _EXAMPLES.setdefault(k, v)
    if res.mismatches:
        m = res.mismatches[0]
        pytest.fail(
            f"kvhit differs from vLLM 0.33.0 ({len(res.mismatches)} calls; replay: "
            f"python -m kvhit.bench.vllm_oracle --replay {seed}):\n" + m.describe(),
            pytrace=False,
        )
    if STRICT_TAIL_KEYS:
        bad = [k for k in res.tally if k.startswith("vLLM _tail_key_boundaries")]
        assert not bad, res.examples[bad[0]]
