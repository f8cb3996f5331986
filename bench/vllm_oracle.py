"""The vLLM oracle: vLLM 0.33.0's real external-store hit code, run on the CPU.

Part of the package (``kvhit.bench.vllm_oracle``) so that ``kvhit bench
--vllm`` works from an installed kvhit; the differential tests import it from
here too. It imports vLLM only inside :func:`load_vllm`, never at import time.

kvhit's reference (``kvhit.coordinator.reference``) reimplements the cache-hit
semantics of vLLM 0.33.0's Mooncake store connector. This module runs the
*real* vLLM code on the same inputs so that a differential test can compare the
two over thousands of random cases:

- ``MooncakeStoreCoordinator`` (``.../mooncake/store/coordinator.py``) with its
  ``find_longest_cache_hit`` / ``load_mask`` / ``store_mask`` / ``lookup_mask`` /
  ``align_lookup_length``, which call the managers' classmethods in
  ``vllm/v1/core/single_type_kv_cache_manager.py``;
- ``MooncakeStoreWorker.lookup`` (``.../mooncake/store/worker.py``), called as
  the unbound function on a small fake ``self`` whose store answers
  ``batch_is_exist`` from a ``(group_id, hash)`` set, and which calls the real
  ``_tail_key_boundaries`` too.

Loading vLLM (the oracle's folder, ``.ci/install-vllm-oracle``) and building
vLLM's group specs from a kvhit layout are ``bench/vllm_real.py``; its public
names are re-exported here.

Command line::

    python -m kvhit.bench.vllm_oracle --check       # import + seed regressions
    python -m kvhit.bench.vllm_oracle --cases 5000  # random differential cases
        [--seed S] [--show-tally]

The layout the oracle takes is duck-typed on kvhit's ``CacheLayout``: an object
with ``groups`` (items with ``spec``, ``eagle``, ``prefix_cacheable``),
``scheduler_block_size``, ``hash_block_size``, ``use_eagle``,
``retention_interval`` and ``partial_hash_hits``; specs are recognised by class
name (``FullAttention``, ``SlidingWindow``, ``Mamba``, ``ChunkedLocal``) and
read by attribute (``block_size``, ``sliding_window``, ``extra_retained_tokens``,
``attention_chunk_size``, ``tag``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvhit.bench.vllm_real import (
    INSTALL_HINT,
    ORACLE_DIR_ENV,
    VLLM_VERSION,
    VllmModules,
    load_vllm,
    oracle_dir,
    require_vllm,
    vllm_groups,
    vllm_importable,
    vllm_spec,
)
from kvhit.coordinator.spec_types import (
    ChunkedLocal,
    FullAttention,
    Mamba,
    SlidingWindow,
)

# vllm_real's names are re-exported: the tests and bench scripts reach them
# as vllm_oracle.<name>.
__all__ = [
    "INSTALL_HINT",
    "ORACLE_DIR_ENV",
    "VLLM_VERSION",
    "Case",
    "CaseResult",
    "ChunkedLocal",
    "FullAttention",
    "Group",
    "LayoutParams",
    "Mamba",
    "Mismatch",
    "Outcome",
    "SlidingWindow",
    "VllmModules",
    "VllmOracle",
    "kvhit_factory",
    "kvhit_layout",
    "load_vllm",
    "main",
    "oracle_dir",
    "random_case",
    "random_hashes",
    "random_layout",
    "require_vllm",
    "run_case",
    "seed_checks",
    "store_keys_from_masks",
    "vllm_groups",
    "vllm_importable",
    "vllm_spec",
]

# ---------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------


class _FakeStore:
    """``MooncakeDistributedStore.batch_is_exist`` over a ``(group, hash)`` set."""

    def __init__(self, exists: Collection[tuple[int, bytes]] | None) -> None:
        self.exists = exists
        self.asked: list[tuple[int, bytes]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        out = []
        for key in keys:
            prefix, _, hex_hash = key.rpartition("@")
            gid = int(prefix.rsplit("g", 1)[1])
            h = bytes.fromhex(hex_hash)
            self.asked.append((gid, h))
            out.append(1 if self.exists is None or (gid, h) in self.exists else 0)
        return out


class VllmOracle:
    """vLLM 0.33.0 on a kvhit layout, with the ``ReferenceCoordinator`` API.

    Construction raises ``AssertionError`` where vLLM's coordinator asserts.
    Every method lets vLLM's ``AssertionError`` / ``IndexError`` through.
    """

    def __init__(self, layout: Any, mods: VllmModules | None = None) -> None:
        self.mods = mods = mods or require_vllm()
        self.layout = layout
        self.kv_cache_groups = vllm_groups(mods, layout)
        ri = layout.retention_interval
        self.coord = mods.MooncakeStoreCoordinator(
            self.kv_cache_groups,
            layout.scheduler_block_size,
            layout.hash_block_size,
            use_eagle=bool(layout.use_eagle),
            retention_interval=ri,
            enable_partial_hash_hits=bool(layout.partial_hash_hits),
        )
        self.hash_block_size = layout.hash_block_size
        # Filled by lookup(): the keys the worker asked the store about, and the
        # AssertionError (if any) of the real _tail_key_boundaries.
        self.last_asked: list[tuple[int, bytes]] = []
        self.last_tail_key_error: AssertionError | None = None
        self.last_tail_key_boundaries: tuple = ()
        self.strict_tail_keys = False

    # -- coordinator -------------------------------------------------------

    @property
    def eagle_group_ids(self) -> frozenset[int]:
        return frozenset(self.coord.eagle_group_ids)

    def _pool(self, exists: Collection[tuple[int, bytes]] | None):
        return self.mods.ExternalCachedBlockPool(
            self.hash_block_size, None if exists is None else set(exists)
        )

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[bytes],
        max_length: int,
        exists: Collection[tuple[int, bytes]] | None,
        apply_eagle: bool = True,
    ) -> tuple[tuple[list[bool], ...], int]:
        masks, hit = self.coord.find_longest_cache_hit(
            list(block_hashes), max_length, self._pool(exists), apply_eagle=apply_eagle
        )
        return tuple(list(m) for m in masks), hit

    def load_mask(self, block_hashes: Sequence[bytes], token_len: int):
        return tuple(
            list(m) for m in self.coord.load_mask(list(block_hashes), token_len)
        )

    def store_mask(
        self,
        aligned_len: int,
        start_token: int = 0,
        num_prompt_tokens: int | None = None,
    ):
        masks = self.coord.store_mask(aligned_len, start_token, num_prompt_tokens)
        return tuple(None if m is None else list(m) for m in masks)

    def lookup_mask(self, aligned_len: int):
        masks = self.coord.lookup_mask(aligned_len)
        return tuple(None if m is None else list(m) for m in masks)

    def align_lookup_length(self, n: int) -> int:
        return self.coord.align_lookup_length(n)

    # -- the store worker --------------------------------------------------

    def _fake_worker(self, store: _FakeStore) -> types.SimpleNamespace:
        worker_cls = self.mods.MooncakeStoreWorker
        fake = types.SimpleNamespace(
            coord=self.coord,
            _capacity_only=False,
            hash_block_size=self.hash_block_size,
            _kv_cache_groups=self.coord.kv_cache_groups,
            token_dbs=[
                types.SimpleNamespace(block_size=g.kv_cache_spec.block_size)
                for g in self.coord.kv_cache_groups
            ],
            # One key namespace per group: "g<id>@<hash hex>".
            _lookup_key_prefixes=tuple(
                (f"g{i}",) for i in range(len(self.coord.kv_cache_groups))
            ),
            store=store,
            _record_kv_connector_operation=lambda *a, **k: None,
        )
        real_tail = types.MethodType(worker_cls._tail_key_boundaries, fake)

        def tail_key_boundaries(block_hashes, hit_length, cached_block_pool):
            try:
                out = real_tail(block_hashes, hit_length, cached_block_pool)
            except AssertionError as exc:
                self.last_tail_key_error = exc
                if self.strict_tail_keys:
                    raise
                return ()
            self.last_tail_key_boundaries = out
            return out

        fake._tail_key_boundaries = tail_key_boundaries
        return fake

    def lookup(
        self,
        num_tokens: int,
        block_hashes: Sequence[bytes],
        exists: Collection[tuple[int, bytes]] | None,
    ) -> int:
        """``MooncakeStoreWorker.lookup`` (the real function) -> hit length.

        An ``AssertionError`` of the real ``_tail_key_boundaries`` (run after
        the hit is known) is kept in ``last_tail_key_error`` rather than raised,
        unless ``strict_tail_keys``.
        """
        store = _FakeStore(None if exists is None else set(exists))
        self.last_tail_key_error = None
        self.last_tail_key_boundaries = ()
        fake = self._fake_worker(store)
        try:
            result = self.mods.MooncakeStoreWorker.lookup(
                fake, num_tokens, list(block_hashes)
            )
        finally:
            self.last_asked = store.asked
        return result.hit_length

    def lookup_candidates(
        self, num_tokens: int, block_hashes: Sequence[bytes]
    ) -> list[tuple[int, bytes]]:
        """The keys the real worker asks the store about (in order).

        Only the asking matters here: a failure of the hit search that follows
        (e.g. ``IndexError`` past the hashes) is ignored once the store was
        asked; one raised before (or no store call at all) is not.
        """
        store = _FakeStore(None)
        fake = self._fake_worker(store)
        try:
            self.mods.MooncakeStoreWorker.lookup(fake, num_tokens, list(block_hashes))
        except (AssertionError, IndexError):
            if not store.asked:
                raise
        return list(store.asked)


# ---------------------------------------------------------------------------
# Random cases (shared by the pytest differential test and --cases)
# ---------------------------------------------------------------------------


# The spec classes are kvhit's own (plain data, no rule: spec_types imports
# nothing of kvhit's); the group and layout are stand-ins with kvhit's
# attribute names, used to describe generated layouts (kvhit may refuse them).
@dataclass(frozen=True)
class Group:
    spec: Any
    eagle: bool = False
    prefix_cacheable: bool = True
    name: str | None = None


@dataclass
class LayoutParams:
    """A layout as plain data (kvhit may refuse to build it)."""

    groups: list[Group]
    scheduler_block_size: int
    hash_block_size: int
    use_eagle: bool = False
    retention_interval: int | None = None
    partial_hash_hits: bool = False

    def kwargs(self) -> dict[str, Any]:
        """``CacheLayout``'s keyword arguments besides the groups: every other
        field, by name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "groups"
        }

    def __repr__(self) -> str:
        gs = ", ".join(_group_repr(g) for g in self.groups)
        rest = "".join(f", {k}={v}" for k, v in self.kwargs().items())
        return f"CacheLayout(groups=[{gs}]{rest})"


def _group_repr(g: Group) -> str:
    extra = ""
    if g.eagle:
        extra += ", eagle=True"
    if not g.prefix_cacheable:
        extra += ", prefix_cacheable=False"
    return f"Group({g.spec!r}{extra})"


def kvhit_layout(params: LayoutParams):
    """Build kvhit's ``CacheLayout`` from ``params`` with kvhit's own classes."""
    from kvhit.coordinator import specs as S

    groups = [
        S.Group(
            g.spec,
            eagle=g.eagle,
            prefix_cacheable=g.prefix_cacheable,
            name=g.name,
        )
        for g in params.groups
    ]
    return S.CacheLayout(groups=groups, **params.kwargs())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def random_layout(rng: random.Random) -> LayoutParams:
    """1-5 groups of all four kinds; mostly valid, sometimes not (so refusals
    are compared too): block sizes multiples of hash_block_size dividing the
    scheduler block, merged equal specs, tags, eagle flags, extra retained
    tokens, scratch (non prefix-cacheable) groups, retention intervals."""
    hbs = rng.choice([1, 2, 4, 4, 8, 16])
    factor = rng.choice([1, 2, 3, 4, 4, 6, 8, 12, 16])
    sbs = hbs * factor
    partial = rng.random() < 0.3
    alignment = hbs if partial else sbs
    n = rng.choice([1, 1, 2, 2, 2, 3, 3, 4, 5])
    groups: list[Group] = []
    for _ in range(n):
        if groups and rng.random() < 0.25:
            # A twin of an earlier spec (merges in both), maybe another eagle bit.
            twin = rng.choice(groups)
            groups.append(Group(twin.spec, eagle=rng.random() < 0.3))
            continue
        kind = rng.choice(["full", "full", "swa", "swa", "mamba", "chunked"])
        bs = hbs * rng.choice(_divisors(factor))
        if rng.random() < 0.04:  # invalid for a prefix-cacheable group
            bs = rng.choice([max(1, hbs // 2), sbs * 2, hbs * factor + hbs, 3])
        tag = rng.choice([None, None, None, "mla"])
        if kind == "full":
            spec: Any = FullAttention(bs, tag=tag)
        elif kind == "mamba":
            spec = Mamba(bs, tag=tag)
        elif kind == "swa":
            window = rng.choice(
                [1, 2, bs, bs + 1, 2 * bs, 3 * bs - 1, rng.randint(1, 4 * sbs)]
            )
            ert = rng.choice([0, 0, 0, 1, hbs, bs, rng.randint(0, 2 * sbs)])
            spec = SlidingWindow(bs, window, ert, tag=tag)
        else:
            if rng.random() < 0.85:
                bs = alignment  # the only block size vLLM serves
            chunk = rng.choice([bs, 2 * bs, 4 * bs, rng.randint(1, 4 * sbs)])
            spec = ChunkedLocal(bs, chunk, tag=tag)
        cacheable = rng.random() >= 0.1
        if not cacheable and rng.random() < 0.5:
            # Scratch groups need not fit the hash/scheduler block sizes.
            spec = dataclasses.replace(spec, block_size=rng.randint(1, 2 * sbs))
        groups.append(Group(spec, eagle=rng.random() < 0.2, prefix_cacheable=cacheable))
    ri_choice = rng.random()
    if ri_choice < 0.5:
        ri = None
    elif ri_choice < 0.65:
        ri = 0
    elif ri_choice < 0.97:
        ri = sbs * rng.choice([1, 2, 3, 4, 8])
    else:
        ri = sbs + max(1, hbs)  # not a multiple of the scheduler block
    return LayoutParams(
        groups=groups,
        scheduler_block_size=sbs,
        hash_block_size=hbs,
        use_eagle=rng.random() < 0.4,
        retention_interval=ri,
        partial_hash_hits=partial,
    )


def random_hashes(
    rng: random.Random, n: int, prefix: Sequence[bytes] = (), width: int = 8
) -> list[bytes]:
    """``n`` hashes, the first ones copied from ``prefix``; about one in eight
    repeats an earlier value (a collision across positions)."""
    out: list[bytes] = []
    for i in range(n):
        if i < len(prefix):
            out.append(prefix[i])
        elif out and rng.random() < 0.12:
            out.append(rng.choice(out))
        else:
            out.append(rng.randbytes(width))
    return out


def store_keys_from_masks(
    params: LayoutParams,
    block_hashes: Sequence[bytes],
    aligned_len: int,
    masks: Sequence[list[bool] | None],
    start_token: int = 0,
) -> set[tuple[int, bytes]]:
    """The keys a saving worker writes for ``store_mask`` output: chunk ``i`` of
    group ``g`` under the hash of its last hash unit."""
    hbs = params.hash_block_size
    keys: set[tuple[int, bytes]] = set()
    for g, (grp, mask) in enumerate(zip(params.groups, masks, strict=True)):
        if not grp.prefix_cacheable:
            continue
        bs = grp.spec.block_size
        end = aligned_len // bs
        start = min(end, max(0, -(-start_token // bs)))
        for i in range(start, end):
            if mask is None or mask[i - start]:
                idx = (i + 1) * bs // hbs - 1
                if 0 <= idx < len(block_hashes):
                    keys.add((g, block_hashes[idx]))
    return keys


def _aligned(n: int, a: int) -> int:
    return n // a * a


def _length(rng: random.Random, params: LayoutParams, n_hashes: int) -> int:
    hbs, sbs = params.hash_block_size, params.scheduler_block_size
    full = n_hashes * hbs
    return rng.choice(
        [
            0,
            rng.randint(0, full + 2 * hbs),
            _aligned(rng.randint(0, full + sbs), sbs),
            _aligned(full, sbs),
            full,
            max(0, full - 1),
            full + 1,
            full + sbs + rng.randint(0, 3 * sbs),  # past the hashes
            rng.randint(0, full),
        ]
    )


@dataclass
class Case:
    params: LayoutParams
    requests: list[list[bytes]]
    stores: list[set[tuple[int, bytes]] | None]
    ops: list[tuple[str, tuple]] = field(default_factory=list)


def random_case(rng: random.Random, n_ops: int = 12) -> Case:
    """A layout, two requests sharing a prefix, a few store contents and a list
    of method calls ``(name, args)`` to run on both coordinators."""
    params = random_layout(rng)
    hbs, sbs = params.hash_block_size, params.scheduler_block_size
    alignment = hbs if params.partial_hash_hits else sbs
    max_units = max(1, min(48, (4 * sbs * 3) // hbs))
    n1 = rng.choice([0, rng.randint(0, max_units), rng.randint(1, max_units)])
    req1 = random_hashes(rng, n1)
    n2 = rng.randint(0, max_units)
    req2 = random_hashes(rng, n2, prefix=req1[: rng.randint(0, n1)])
    requests = [req1, req2]

    universe = [
        (g, h) for g in range(len(params.groups)) for req in requests for h in req
    ]
    stores: list[set[tuple[int, bytes]] | None] = [None, set(universe)]
    for _ in range(2):  # random subsets
        p = rng.random()
        stores.append({k for k in universe if rng.random() < p})
    # What store_mask of one request keeps (the real save path), then evictions.
    oracle_masks: list[tuple] = []
    for req in requests:
        aligned = _aligned(len(req) * hbs, alignment)
        prompt = rng.choice(
            [None, len(req) * hbs, len(req) * hbs + rng.randint(0, sbs)]
        )
        oracle_masks.append((req, aligned, prompt))
    case = Case(params, requests, stores)
    case.ops = []
    # The saved-store recipes are resolved by run_case (they need store_mask);
    # encode them as pseudo-ops.
    for req_i, (_req, aligned, prompt) in enumerate(oracle_masks):
        evict = rng.choice([0.0, 0.0, 0.1, 0.3])
        extra = rng.random() < 0.5  # plus some random keys (Mamba states, tails)
        case.ops.append(("_save", (req_i, aligned, prompt, evict, extra, rng.random())))

    n_stores = len(stores) + len(oracle_masks)
    for _ in range(n_ops):
        op = rng.choice(
            ["find", "find", "find", "lookup", "lookup", "lookup", "load_mask",
             "store_mask", "lookup_mask", "align", "candidates"]
        )  # fmt: skip
        req_i = rng.randrange(len(requests))
        req = requests[req_i]
        store_i = rng.randrange(n_stores)
        if op == "find":
            ln = _length(rng, params, len(req))
            case.ops.append(
                ("find_longest_cache_hit", (req_i, ln, store_i, rng.random() < 0.8))
            )
        elif op == "lookup":
            case.ops.append(
                ("lookup", (_length(rng, params, len(req)), req_i, store_i))
            )
        elif op == "candidates":
            case.ops.append(
                ("lookup_candidates", (_length(rng, params, len(req)), req_i))
            )
        elif op == "load_mask":
            case.ops.append(("load_mask", (req_i, _length(rng, params, len(req)))))
        elif op in ("store_mask", "lookup_mask"):
            aligned = _aligned(_length(rng, params, len(req)), alignment)
            if rng.random() < 0.05:
                aligned += max(1, hbs // 2)  # unaligned: both must refuse
            if op == "lookup_mask":
                case.ops.append(("lookup_mask", (aligned,)))
            else:
                start = rng.choice([0, 0, rng.randint(0, aligned + sbs)])
                prompt = rng.choice(
                    [
                        None,
                        None,
                        rng.randint(1, aligned + 2 * sbs),
                        aligned,
                        aligned + 1,
                    ]
                )
                case.ops.append(("store_mask", (aligned, start, prompt)))
        else:
            case.ops.append(("align_lookup_length", (rng.randint(0, 4 * sbs),)))
    return case


# ---------------------------------------------------------------------------
# Running a case on both sides
# ---------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # "ok", "refused" or "error"
    value: Any = None
    detail: str = ""

    def same(self, other: Outcome) -> bool:
        if self.kind != other.kind:
            return False
        return self.kind != "ok" or self.value == other.value

    def __repr__(self) -> str:
        if self.kind == "ok":
            return repr(self.value)
        return f"<{self.kind}: {self.detail}>"


def _vllm_outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        return Outcome("ok", fn())
    except (AssertionError, IndexError) as exc:
        return Outcome("refused", detail=f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        return Outcome("error", detail=f"{type(exc).__name__}: {exc}")


def _kvhit_outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        return Outcome("ok", fn())
    except ValueError as exc:
        return Outcome("refused", detail=f"ValueError: {exc}")
    except Exception as exc:
        return Outcome("error", detail=f"{type(exc).__name__}: {exc}")


@dataclass
class Mismatch:
    params: LayoutParams
    op: str
    args: tuple
    vllm: Outcome
    kvhit: Outcome
    inputs: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [
            f"layout: {self.params!r}",
            f"call:   {self.op}{self.args!r}",
        ]
        for k, v in self.inputs.items():
            lines.append(f"  {k} = {v!r}")
        lines.append(f"vLLM:   {self.vllm!r}")
        lines.append(f"kvhit:  {self.kvhit!r}")
        return "\n".join(lines)


@dataclass
class CaseResult:
    mismatches: list[Mismatch] = field(default_factory=list)
    tally: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    ops: int = 0

    def note(self, key: str, example: str = "") -> None:
        self.tally[key] += 1
        if example and key not in self.examples:
            self.examples[key] = example


def _first_line(s: str, n: int = 110) -> str:
    s = s.splitlines()[0] if s else s
    return s[:n]


def _resolve_call(
    op: str,
    args: tuple,
    requests: list[list[bytes]],
    stores: list[set[tuple[int, bytes]] | None],
) -> tuple[tuple, tuple, dict[str, Any]]:
    """``(call args, args as shown, inputs to show)`` of one encoded call."""
    if op == "find_longest_cache_hit":
        req_i, ln, store_i, apply_eagle = args
        hashes, exists = requests[req_i], stores[store_i]
        return (
            (hashes, ln, exists, apply_eagle),
            (f"<req{req_i}>", ln, f"<store{store_i}>", apply_eagle),
            {"block_hashes": hashes, "exists": _fmt_exists(exists)},
        )
    if op == "lookup":
        num_tokens, req_i, store_i = args
        hashes, exists = requests[req_i], stores[store_i]
        return (
            (num_tokens, hashes, exists),
            (num_tokens, f"<req{req_i}>", f"<store{store_i}>"),
            {"block_hashes": hashes, "exists": _fmt_exists(exists)},
        )
    if op == "lookup_candidates":
        num_tokens, req_i = args
        hashes = requests[req_i]
        return (
            (num_tokens, hashes),
            (num_tokens, f"<req{req_i}>"),
            {"block_hashes": hashes},
        )
    if op == "load_mask":
        req_i, ln = args
        hashes = requests[req_i]
        return (hashes, ln), (f"<req{req_i}>", ln), {"block_hashes": hashes}
    return args, args, {}


def run_case(
    case: Case,
    make_kvhit: Callable[[LayoutParams], Any] | None,
    mods: VllmModules | None = None,
) -> CaseResult:
    """Run ``case`` on vLLM and (if ``make_kvhit``) on kvhit; compare every call.

    ``make_kvhit(params)`` builds kvhit's coordinator (raising ``ValueError`` or
    ``TypeError`` where kvhit refuses the layout).
    """
    mods = mods or require_vllm()
    res = CaseResult()
    params = case.params
    v_ctor = _vllm_outcome(lambda: VllmOracle(params, mods))
    k_ctor = (
        _kvhit_outcome(lambda: make_kvhit(params))
        if make_kvhit is not None
        else Outcome("error", detail="kvhit not available")
    )
    if k_ctor.kind == "error" and "TypeError" in k_ctor.detail:
        k_ctor = Outcome("refused", detail=k_ctor.detail)
    oracle = v_ctor.value if v_ctor.kind == "ok" else None
    ref = k_ctor.value if k_ctor.kind == "ok" else None

    if v_ctor.kind == "error":
        res.mismatches.append(Mismatch(params, "<construct>", (), v_ctor, k_ctor))
        return res
    if oracle is None and ref is None:
        res.note(
            f"layout refused by both (vLLM: {_first_line(v_ctor.detail, 70)})",
            repr(params),
        )
        return res
    if oracle is None:
        # vLLM asserts at construction on a layout kvhit builds.
        res.mismatches.append(Mismatch(params, "<construct>", (), v_ctor, k_ctor))
        return res

    # Materialise the saved stores (vLLM's store_mask decides what is written).
    stores = list(case.stores)
    save_rng = random.Random()
    for op, args in case.ops:
        if op != "_save":
            continue
        req_i, aligned, prompt, evict, extra, seed = args
        save_rng.seed(seed)
        req = case.requests[req_i]
        try:
            masks = oracle.store_mask(aligned, 0, prompt)
        except (AssertionError, IndexError):
            stores.append(set())
            continue
        keys = store_keys_from_masks(params, req, aligned, masks)
        keys = {k for k in sorted(keys) if save_rng.random() >= evict}
        if extra and req:
            for g in range(len(params.groups)):
                for _ in range(save_rng.randint(0, 3)):
                    idx = save_rng.randrange(len(req))
                    keys.add((g, req[idx]))
        stores.append(keys)

    kvhit_refused_layout = ref is None
    vllm_layout_asserts: list[str] = []
    for op, args in case.ops:
        if op == "_save":
            continue
        res.ops += 1
        real_args, shown, inputs = _resolve_call(op, args, case.requests, stores)
        method = getattr(oracle, op)
        v = _vllm_outcome(functools.partial(method, *real_args))
        if op == "lookup" and oracle.last_tail_key_error is not None:
            res.note(
                "vLLM _tail_key_boundaries AssertionError (lookup still returns)",
                f"{params!r}\n  lookup{shown} -> {v!r}: "
                f"{oracle.last_tail_key_error}\n  hashes={case.requests[args[1]]!r}"
                f"\n  exists={_fmt_exists(stores[args[2]])}",
            )
        if kvhit_refused_layout:
            if v.kind == "refused":
                vllm_layout_asserts.append(f"{op}: {_first_line(v.detail, 80)}")
            continue
        if op == "lookup_candidates" and not hasattr(ref, "lookup_candidates"):
            continue
        k = _kvhit_outcome(functools.partial(getattr(ref, op), *real_args))
        if not v.same(k):
            res.mismatches.append(Mismatch(params, op, shown, v, k, inputs))
        elif v.kind == "refused":
            res.note(f"{op}: both refuse ({_first_line(v.detail, 60)})")
        else:
            res.note(f"{op}: equal")

    if kvhit_refused_layout:
        why = _first_line(k_ctor.detail.split(": ", 1)[-1], 90)
        if vllm_layout_asserts:
            res.note(
                f"kvhit refuses layout; vLLM asserts at lookup time ({vllm_layout_asserts[0][:70]})",
                f"{params!r}\n  kvhit: {why}",
            )
        else:
            res.note(
                f"kvhit refuses layout vLLM served in every call: {why[:60]}",
                f"{params!r}\n  kvhit: {why}",
            )
    return res


def _fmt_exists(exists: set | None) -> str:
    if exists is None:
        return "None (every key)"
    return "{" + ", ".join(f"({g}, {h.hex()})" for g, h in sorted(exists)) + "}"


def kvhit_factory() -> tuple[Callable[[LayoutParams], Any] | None, str]:
    """``params -> ReferenceCoordinator(CacheLayout(...))`` or ``(None, why)``."""
    try:
        from kvhit.coordinator.reference import ReferenceCoordinator
        from kvhit.coordinator.specs import CacheLayout  # noqa: F401
    except Exception as exc:
        return None, f"kvhit reference not importable: {type(exc).__name__}: {exc}"

    def make(params: LayoutParams):
        return ReferenceCoordinator(kvhit_layout(params))

    return make, ""


# ---------------------------------------------------------------------------
# The seed regressions (ARCHITECTURE.md), through vLLM itself
# ---------------------------------------------------------------------------


def seed_checks(mods: VllmModules) -> list[tuple[str, Any, Any]]:
    """``(name, got, want)`` for the three seed regressions (ARCHITECTURE.md,
    "Seed regressions"), on vLLM."""
    out = []
    hs = [bytes([i]) * 8 for i in range(1, 5)]
    lay1 = LayoutParams([Group(FullAttention(16)), Group(Mamba(16))], 16, 16, True)
    o1 = VllmOracle(lay1, mods)
    exists1 = {(g, h) for g in (0, 1) for h in hs}
    out.append(("seed1 hit", o1.find_longest_cache_hit(hs, 64, exists1)[1], 48))

    lay2 = LayoutParams(
        [
            Group(FullAttention(64)),
            Group(SlidingWindow(16, 32)),
            Group(SlidingWindow(16, 32), eagle=True),
        ],
        64,
        16,
        use_eagle=True,
    )
    o2 = VllmOracle(lay2, mods)
    out.append(("seed2 eagle_group_ids", o2.eagle_group_ids, frozenset({1, 2})))
    hs2 = [bytes([i]) * 8 for i in range(1, 9)]
    masks = o2.store_mask(128, num_prompt_tokens=130)
    out.append(("seed2 masks[1] == masks[2]", masks[1] == masks[2], True))
    keys = store_keys_from_masks(lay2, hs2, 128, masks)
    out.append(("seed2 hit", o2.find_longest_cache_hit(hs2, 128, keys)[1], 64))
    out.append(("seed2 lookup(128)", o2.lookup(128, hs2, keys), 64))

    lay3 = LayoutParams(
        [
            Group(FullAttention(256)),
            Group(SlidingWindow(64, 128)),
            Group(SlidingWindow(64, 128), eagle=True),
            Group(SlidingWindow(4, 8)),
            Group(SlidingWindow(8, 128)),
        ],
        256,
        4,
        use_eagle=True,
    )
    o3 = VllmOracle(lay3, mods)
    hs3 = [i.to_bytes(8, "little") for i in range(1, 193)]
    keys3 = store_keys_from_masks(lay3, hs3, 768, o3.store_mask(768))
    out.append(("seed3 hit", o3.find_longest_cache_hit(hs3, 768, keys3)[1], 512))
    return out


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="import vLLM, run seed cases")
    ap.add_argument("--cases", type=int, default=0, help="random differential cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", type=int, default=12, help="calls per case")
    ap.add_argument("--show-tally", action="store_true")
    ap.add_argument("--max-show", type=int, default=1, help="mismatches to print")
    ap.add_argument(
        "--replay", help="run the case of one seed (as the pytest test draws it)"
    )
    args = ap.parse_args(argv)

    mods, reason = load_vllm()
    if mods is None:
        print(f"vLLM oracle unavailable: {reason}")
        return 2
    print(
        f"vLLM {mods.version} from {mods.origin} "
        f"(imported in {mods.import_seconds:.1f} s)"
    )
    if "vllm" in sys.modules and mods.origin != "installed vllm":
        print("warning: vllm left in sys.modules after loading", file=sys.stderr)
    if args.check or (not args.cases and args.replay is None):
        bad = 0
        for name, got, want in seed_checks(mods):
            ok = got == want
            bad += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {name}: {got!r} (want {want!r})")
        if bad:
            return 1
    if not args.cases and args.replay is None:
        return 0

    make, why = kvhit_factory()
    if make is None:
        print(f"cannot compare: {why}")
        return 2
    if args.replay is not None:
        seed: int | str = int(args.replay) if args.replay.isdigit() else args.replay
        r = run_case(random_case(random.Random(seed), args.ops), make, mods)
        for m in r.mismatches:
            print(f"\nMISMATCH:\n{m.describe()}")
        print(f"{r.ops} calls, {len(r.mismatches)} mismatches")
        return 1 if r.mismatches else 0
    t0 = time.perf_counter()
    total = Counter()
    examples: dict[str, str] = {}
    n_mis = n_ops = n_bad_cases = 0
    shown = 0
    for i in range(args.cases):
        rng = random.Random(f"{args.seed}:{i}")
        case = random_case(rng, args.ops)
        r = run_case(case, make, mods)
        n_ops += r.ops
        total.update(r.tally)
        for k, v in r.examples.items():
            examples.setdefault(k, v)
        if r.mismatches:
            n_bad_cases += 1
            n_mis += len(r.mismatches)
            for m in r.mismatches:
                if shown < args.max_show:
                    shown += 1
                    print(f"\nMISMATCH (case {i}, seed {args.seed}:{i}):")
                    print(m.describe())
    dt = time.perf_counter() - t0
    print(
        f"\n{args.cases} cases, {n_ops} calls compared, {n_mis} mismatches "
        f"in {n_bad_cases} cases ({dt:.1f} s)"
    )
    if args.show_tally:
        for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"  {v:7d}  {k}")
        for k, v in examples.items():
            if not k.endswith("equal") and "both refuse" not in k:
                print(f"\nexample of: {k}\n  {v}")
    return 1 if n_mis else 0


if __name__ == "__main__":
    sys.exit(main())
