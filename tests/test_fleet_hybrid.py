"""Hybrid layouts on the Triton fleet (``kernels/fleet_triton.hybrid_hits``)
under TRITON_INTERPRET=1: sliding window, Mamba, chunked local, several
SpecGroups, EAGLE and fine-grained hits, every (request, engine) pair in one
launch with no per-engine Python loop, checked exactly against the scalar
reference (``ReferenceCoordinator.find_longest_cache_hit`` / ``lookup`` per
engine) and the numba/CPU fleet (where numba imports: the GPU machine's twin
has none).

Patterns of ``tests/test_fleet_triton.py``: hypothesis over every kind and
store mode, forced slot collisions in the entry index, empty and single
requests and batches, all-hit and all-miss stores, non-power-of-two batches
and engine counts (past one 64-engine word), removed engines.
"""

from __future__ import annotations

import os
import random
import sys
from contextlib import contextmanager
from unittest import mock

import helpers
import pytest
import torch
from helpers import fleet_expected as expected
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import chained_hashes, edge_fleet_batch, fleet_case, saved_keys

from kvhit import (
    CacheLayout,
    FleetIndex,
    FullAttention,
    Group,
    HashBatch,
    LookupEngine,
    Mamba,
    SlidingWindow,
)
from kvhit.bench.workloads import make_layout
from kvhit.coordinator import fleet_index as fleet_mod
from kvhit.coordinator import fleet_scoring
from kvhit.kernels import contract, fleet_triton, fleet_triton_hybrid

EXAMPLES = max(int(os.environ.get("KVHIT_PARITY_EXAMPLES", "60")) // 4, 8)


@contextmanager
def on_triton(prune: bool = True):
    """FleetIndexes built inside are Triton ones (the CUDA rule, here
    interpreted); yields a dict counting the hybrid and joint launches. The
    per-engine path is refused inside: a hybrid layout must not reach it.
    ``prune=False``: hybrid_hits without its first stage (``first``), every
    live pair scanned."""
    calls = {"hybrid": 0, "full": 0}
    # The family's own (trusted) launchers, as a fleet call runs them.
    real_hybrid = fleet_triton.FleetOps.hybrid_hits
    real_full = fleet_triton.FleetOps.full_hits

    def hybrid(*a):
        calls["hybrid"] += 1
        assert len(a) == 13
        return real_hybrid(*a[:12], a[12] if prune else None)

    def full(self, *a):
        calls["full"] += 1
        return real_full(self, *a)

    def refuse(*a, **k):
        raise AssertionError("the per-engine path ran on the Triton fleet")

    with (
        mock.patch.object(fleet_mod, "auto_backend", lambda device: "triton"),
        mock.patch.object(fleet_triton.FleetOps, "hybrid_hits", staticmethod(hybrid)),
        mock.patch.object(fleet_triton.FleetOps, "full_hits", full),
        mock.patch.object(fleet_scoring, "_fleet_generic", refuse),
    ):
        yield calls


def numba_answers(layout, requests, stores_, lens, apply_eagle):
    """The numba/CPU fleet's (hits, lookups), or None without numba."""
    try:
        import numba  # noqa: F401
    except ImportError:  # the device twin has no numba
        return None
    fleet = helpers.make_fleet(stores_, backend="numba", num_engines=len(stores_))
    engine = LookupEngine(layout, backend="numba")
    batch = HashBatch.from_bytes(requests, 8)
    return (
        engine.fleet_hits(batch, lens, fleet, apply_eagle=apply_eagle).tolist(),
        engine.fleet_lookup(batch, lens, fleet).tolist(),
    )


def check(layout, requests, stores_, lens, apply_eagle=True, capacity=16,
          max_load=0.5, against_numba=True):  # fmt: skip
    """fleet_hits and fleet_lookup through the Triton fleet equal the
    reference per engine (and the numba fleet); returns the launch counts."""
    E = len(stores_)
    with on_triton() as calls:
        fleet = FleetIndex(E, 8, capacity=capacity, backend="triton",
                           max_load=max_load)  # fmt: skip
        for e, keys in enumerate(stores_):
            keys = sorted(keys)
            if keys:
                fleet.add(e, [g for g, _ in keys], [h for _, h in keys])
        engine = LookupEngine(layout, backend="torch")
        batch = HashBatch.from_bytes(requests, 8)
        hits = engine.fleet_hits(batch, lens, fleet, apply_eagle=apply_eagle)
        assert hits.dtype == torch.int64 and list(hits.shape) == [len(requests), E]
        looks = engine.fleet_lookup(batch, lens, fleet)
    want = expected(layout, requests, stores_, lens, apply_eagle)
    assert hits.tolist() == want
    want_lookup = expected(layout, requests, stores_, lens, lookup=True)
    assert looks.tolist() == want_lookup
    if against_numba:
        got = numba_answers(layout, requests, stores_, lens, apply_eagle)
        assert got is None or got == (want, want_lookup)
    return calls


def is_joint(layout) -> bool:
    """Whether fleet_find answers this layout by the joint full-attention
    scan (one non-fine full-attention SpecGroup) for both hits and lookups."""
    engine = LookupEngine(layout, backend="torch")
    plan = engine.plan
    return fleet_scoring._full_path(plan, False) and fleet_scoring._full_path(
        plan, True
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=fleet_case(), apply_eagle=st.booleans())
def test_random_parity_every_kind(data, apply_eagle):
    layout, requests, stores_, lens = data
    calls = check(layout, requests, stores_, lens, apply_eagle)
    # One launch per call: the hybrid kernel, or the joint full-attention one.
    kind = "full" if is_joint(layout) else "hybrid"
    assert calls[kind] == 2 and sum(calls.values()) == 2


def collide(gid: int, n: int, cap: int, seed: int) -> list[bytes]:
    """``n`` distinct 8-byte hashes whose key ``(gid, hash)`` has its home
    slot in {0, 1} of a ``cap``-slot table: one long probe chain."""
    rng = random.Random(seed)
    out: list[bytes] = []
    while len(out) < n:
        h = rng.getrandbits(64).to_bytes(8, "little")
        word = int.from_bytes(h, "little", signed=True)
        if contract.slot_hash(gid, [word]) & (cap - 1) <= 1 and h not in out:
            out.append(h)
    return out


@pytest.mark.parametrize("preset", ["gemma3", "qwen3-next"])
def test_forced_collisions(preset):
    # Every hash of the requests has its key (group 0, engine 0) homed at
    # slot 0 or 1 of the entry index (capacity fixed: no growth), so engine
    # 0's probes walk one chain past the other keys; the table near its
    # 0.95 load bound.
    layout = make_layout(preset)
    hbs, cap = layout.hash_block_size, 256
    f = layout.scheduler_block_size // hbs
    hs = collide(0, 6 * f, cap, seed=5)
    reqs = [hs, hs[: 3 * f], hs[f:]]
    stores_ = [saved_keys(layout, r, layout.align(len(r) * hbs)) for r in reqs]
    stores_ = [stores_[0], stores_[1], stores_[0] - {(0, hs[f])}]
    # No growth: the (engine, key) entries stay under the load bound.
    assert sum(len(s) for s in stores_) <= 0.95 * cap
    lens = [len(r) * hbs for r in reqs]
    calls = check(layout, reqs, stores_, lens, capacity=cap, max_load=0.95)
    assert calls["hybrid"] == 2


@pytest.mark.parametrize("hit", ["all", "none"])
def test_edge_batches(hit):
    # Empty batch (no launch), one request, an empty request, all-hit and
    # all-miss stores, a length 0 and one past the prompt (full attention
    # bounds the scans), a non-power-of-two batch and engine count.
    layout = make_layout("gemma3")
    reqs, stores_, lens = edge_fleet_batch(layout, (9, 0, 1, 5, 12), hit)
    assert check(layout, reqs[:1], stores_, lens[:1])["hybrid"] == 2
    assert check(layout, reqs, stores_, lens)["hybrid"] == 2
    # B = 0: fleet_find answers [0, E] without a launch.
    assert check(layout, [], stores_, []) == {"hybrid": 0, "full": 0}


def test_empty_batch_launches_nothing():
    table = torch.zeros((4, 2), dtype=torch.int64)
    z = torch.zeros(0, dtype=torch.int64)
    sg = torch.zeros((3, contract.SG_MEMBERS + 1), dtype=torch.int64)
    cand = torch.zeros((3, contract.CAND_WIDTH), dtype=torch.int64)
    with mock.patch.object(fleet_triton_hybrid, "hybrid_kernel", None):
        out = fleet_triton.hybrid_hits(
            table, torch.zeros((0, 1), dtype=torch.int64), z, z, z, None, sg,
            cand, cand[:1], torch.tensor([-1]), 3, (16, 16, 0, 0, 1, 0),
        )  # fmt: skip
    assert list(out.shape) == [0, 3]


def eagle_mamba_layout() -> CacheLayout:
    """Full attention 32 (EAGLE), SWA 16/w24 (EAGLE), Mamba 32: the EAGLE
    proof margin past the hit, a Mamba group that never takes it, and the
    convergence loop over three SpecGroups."""
    return CacheLayout(
        [
            Group(FullAttention(32), eagle=True),
            Group(SlidingWindow(16, 24), eagle=True),
            Group(Mamba(32)),
        ],
        32,
        16,
        use_eagle=True,
    )


@pytest.mark.parametrize(
    ("layout", "E"),
    [(make_layout("dsv4-flash"), 3), (eagle_mamba_layout(), 67)],
    ids=["dsv4", "eagle-mamba"],
)
def test_engine_words_and_removed_engines(layout, E):
    # Each engine holds a prefix of every group's keys cut at its own point
    # (Mamba states at every hash unit), some with a hole; a few engines
    # removed (dead engines read 0); 67 engines: two engine-set words, the
    # second partial. Both EAGLE settings.
    rng = random.Random(11)
    hbs = layout.hash_block_size
    f = layout.scheduler_block_size // hbs
    reqs = [chained_hashes(i % 2, rng.randint(f, 4 * f)) for i in range(2)]
    G = layout.num_groups
    stores_ = []
    for e in range(E):
        keys = set()
        if e % 5 != 1:
            for r in reqs:
                cut = rng.randint(0, len(r))
                keys |= {
                    (g, h) for g in range(G) for h in r[: cut + rng.randint(-f, f)]
                }
        if keys and e % 7 == 0:
            keys.discard(sorted(keys)[rng.randrange(len(keys))])
        stores_.append(keys)
    lens = [len(r) * hbs - rng.randint(0, hbs) for r in reqs]
    gone = (0, 64, 66) if E > 64 else (1,)
    # With the joint scan's first stage and without it.
    for apply_eagle, prune in ((True, True), (False, True), (True, False)):
        with on_triton(prune) as calls:
            fleet = helpers.make_fleet(stores_, backend="triton")
            for e in gone:
                fleet.remove_engine(e)
            engine = LookupEngine(layout, backend="torch")
            batch = HashBatch.from_bytes(reqs, 8)
            got = engine.fleet_hits(batch, lens, fleet, apply_eagle=apply_eagle)
        want = expected(layout, reqs, stores_, lens, apply_eagle)
        for row in want:
            for e in gone:
                row[e] = 0
        assert got.tolist() == want and calls["hybrid"] == 1
        assert max(max(row) for row in want) > 0


@pytest.mark.parametrize(
    ("layout", "E"),
    [(make_layout("dsv4-flash"), 13), (eagle_mamba_layout(), 70)],
    ids=["dsv4", "eagle-mamba"],
)
def test_engine_classes(layout, E):
    # From CLASS_MIN_ENGINES engines on, engines that must answer alike share
    # one program of the rule (fleet_triton_hybrid.class_kernel): engines
    # drawn from a few stores (classes of several engines, across both
    # engine-set words at E = 70), some of them with one key dropped inside
    # the rule's window or past it (a class split, or not), engines holding
    # nothing, removed engines. Every answer equals the reference's, with the
    # EAGLE drop and without, hits and lookups; the class kernel ran.
    from triton.runtime.interpreter import InterpretedFunction

    assert E >= fleet_triton.CLASS_MIN_ENGINES
    rng = random.Random(5)
    hbs = layout.hash_block_size
    f = layout.scheduler_block_size // hbs
    reqs = [chained_hashes(i % 2, rng.randint(2 * f, 3 * f)) for i in range(3)]
    G = layout.num_groups
    bases = []
    for _ in range(3):
        keys = set()
        for r in reqs:
            cut = rng.randint(len(r) // 2, len(r))
            keys |= {(g, h) for g in range(G) for h in r[:cut]}
        bases.append(keys)
    stores_ = []
    for e in range(E):
        keys = set(bases[e % 3]) if e % 11 != 4 else set()
        if keys and e % 6 == 5:
            keys.discard(sorted(keys)[rng.randrange(len(keys))])
        stores_.append(keys)
    lens = [len(r) * hbs - rng.randint(0, hbs) for r in reqs]
    gone = (2, 64, 69) if E > 64 else (2,)
    seen: list[str] = []
    real_run = InterpretedFunction.run

    def run(self, *a, **k):
        seen.append(self.fn.__name__)
        return real_run(self, *a, **k)

    # One fleet for the three calls (hits with and without the EAGLE drop,
    # lookups): the interpreter's class-kernel programs are this suite's
    # slowest, so nothing is built or run twice.
    with on_triton(), mock.patch.object(InterpretedFunction, "run", run):
        fleet = helpers.make_fleet(stores_, backend="triton")
        for e in gone:
            fleet.remove_engine(e)
        engine = LookupEngine(layout, backend="torch")
        batch = HashBatch.from_bytes(reqs, 8)
        got = {ae: engine.fleet_hits(batch, lens, fleet, apply_eagle=ae)
               for ae in (True, False)}  # fmt: skip
        looks = engine.fleet_lookup(batch, lens, fleet)
    for apply_eagle in (True, False):
        want = expected(layout, reqs, stores_, lens, apply_eagle)
        for row in want:
            for e in gone:
                row[e] = 0
        assert got[apply_eagle].tolist() == want
        assert max(max(row) for row in want) > 0
    want = expected(layout, reqs, stores_, lens, lookup=True)
    for row in want:
        for e in gone:
            row[e] = 0
    assert looks.tolist() == want
    assert "class_kernel" in seen


def test_launcher_refuses_bad_arguments():
    t = torch.zeros((4, 2), dtype=torch.int64)
    z = torch.zeros(1, dtype=torch.int64)
    rows = torch.zeros((1, 1), dtype=torch.int64)
    sg = torch.zeros((2, contract.SG_MEMBERS + 1), dtype=torch.int64)
    cand = torch.zeros((2, contract.CAND_WIDTH), dtype=torch.int64)
    live = torch.tensor([0])  # no live engine: the placeholder rows are never read
    good = dict(table=t, rows=rows, offsets=z, lengths=z, lens=z, token_lens=None,
                sg_rows=sg, cand_rows=cand, plan_cands=cand[:1], live=live,
                num_engines=2, params=(16, 16, 0, 0, 1, 0))  # fmt: skip
    bad = [
        ("table", torch.zeros((3, 2), dtype=torch.int64), ValueError),
        ("table", torch.zeros((4, 2), dtype=torch.int32), TypeError),
        ("rows", torch.zeros((1, 2), dtype=torch.int64), ValueError),
        ("lens", torch.zeros(2, dtype=torch.int64), ValueError),
        ("token_lens", torch.zeros(2, dtype=torch.int64), ValueError),
        (
            "sg_rows",
            torch.zeros((3, contract.SG_MEMBERS + 1), dtype=torch.int64),
            ValueError,
        ),
        ("cand_rows", cand[:1], ValueError),
        ("live", torch.tensor([0, 0]), ValueError),
        ("num_engines", 2.0, TypeError),
        ("params", (16, 16, 0, 0, 1), ValueError),
        ("params", (16, 0, 0, 0, 1, 0), ValueError),
    ]
    for name, value, err in bad:
        with pytest.raises(err, match=name if name != "params" else "params"):
            fleet_triton.hybrid_hits(**{**good, name: value})
    assert fleet_triton.hybrid_hits(**good).tolist() == [[0, 0]]


# -- registers: tests/test_scan_registers.py compiles the hybrid kernel's
# variants and the class kernel for sm_90 and sm_100 with every other kernel
# (.ci/check-triton-floor, newest Triton and 3.6.0).


@pytest.mark.parametrize(
    ("layout", "launches"),
    [
        (make_layout("gemma3"), ["_fleet_kernel", "hybrid_kernel"]),
        (
            CacheLayout([Group(Mamba(16)), Group(SlidingWindow(16, 32))], 16, 16),
            ["hybrid_kernel"],
        ),
    ],
    ids=["full-first", "no-full"],
)
def test_launches_per_call_and_no_host_copy(layout, launches):
    # fleet_find on a hybrid layout: the joint scan (when the first
    # SpecGroup is full attention) and the rule, nothing else launched, and
    # nothing copied between host and device once the plan's rows are cached
    # (the first call builds them): no .cpu(), .numpy(), .tolist(), .item()
    # in fleet_scoring or fleet_triton.
    from triton.runtime.interpreter import InterpretedFunction

    reqs = [chained_hashes(i, 6) for i in range(3)]
    keys = saved_keys(layout, reqs[0], 96) | {(1, h) for h in reqs[1]}
    seen: list[str] = []
    real_run = InterpretedFunction.run

    def run(self, *a, **k):
        seen.append(self.fn.__name__)
        return real_run(self, *a, **k)

    def copy(name):
        real = getattr(torch.Tensor, name)

        def refuse(self, *a, **k):
            # Only the fleet's own code counts (a CPU batch's view reads its
            # offsets through numpy, on the CPU only).
            caller = sys._getframe(1).f_code.co_filename
            assert not caller.endswith(
                ("fleet_scoring.py", "fleet_triton.py", "fleet_triton_hybrid.py")
            ), f"a host copy: Tensor.{name} in {caller}"
            return real(self, *a, **k)

        return refuse

    with on_triton():
        fleet = helpers.make_fleet([keys, set(), keys, keys], backend="triton")
        engine = LookupEngine(layout, backend="torch")
        batch = HashBatch.from_bytes(reqs, 8)
        lens = torch.tensor([96, 96, 0])
        for lookup in (False, True):
            fleet_scoring.fleet_find(engine, batch, lens, fleet, lookup=lookup)
            seen.clear()
            patches = [mock.patch.object(InterpretedFunction, "run", run)] + [
                mock.patch.object(torch.Tensor, n, copy(n))
                for n in ("cpu", "numpy", "tolist", "item")
            ]
            for p in patches:
                p.start()
            try:
                got = fleet_scoring.fleet_find(
                    engine, batch, lens, fleet, lookup=lookup
                )
            finally:
                for p in reversed(patches):
                    p.stop()
            assert seen == launches
            want = expected(layout, reqs, [keys, set(), keys, keys], lens.tolist(),
                            lookup=lookup)  # fmt: skip
            assert got.tolist() == want


def test_conftest_first_names_tests_that_exist():
    # make test's parallel pass splits out and starts first the tests that
    # tests/conftest.py's FIRST names (this file's slowest among them): a
    # renamed or moved test would silently fall back into its file's unit
    # and the pass would grow past its budget again.
    import ast
    from pathlib import Path

    import conftest

    root = Path(conftest.__file__).resolve().parent.parent
    for prefix in conftest.FIRST:
        path, _, name = prefix.partition("::")
        assert (root / path).is_file(), prefix
        if name:
            tree = ast.parse((root / path).read_text())
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert name in names, prefix
    # A test's own unit, its file's others one unit, anything else its file.
    assert conftest.work_unit("tests/test_scan_numba.py::test_x[a]") == (
        0,
        "tests/test_scan_numba.py",
    )
    split = "tests/test_fleet_hybrid.py::test_engine_classes[dsv4]"
    assert conftest.work_unit(split)[1] == split
    other = "tests/test_fleet_hybrid.py::test_engine_classes_x"
    assert conftest.work_unit(other) == (
        len(conftest.FIRST),
        "tests/test_fleet_hybrid.py",
    )


def test_conftest_groups_where_xdist_workers_collect(monkeypatch):
    # The order scheduled is the workers' collection, and xdist tells a
    # worker --dist loadgroup by option.loadgroup (its option.dist is "no"):
    # reading option.dist alone left the units in name order.
    from types import SimpleNamespace

    import conftest

    calls = []
    monkeypatch.setattr(conftest, "_order_for_workers", calls.append)
    for loadgroup, dist, grouped in (
        (True, "no", True),  # an xdist worker of make test's pass
        (False, "loadgroup", True),  # the controller
        (False, "no", False),  # plain pytest
        (False, "load", False),
    ):
        calls.clear()
        config = SimpleNamespace(
            option=SimpleNamespace(loadgroup=loadgroup),
            getoption=lambda name, default=None, dist=dist: dist,
        )
        conftest.pytest_collection_modifyitems(config, [])
        assert calls == ([[]] if grouped else []), (loadgroup, dist)


def test_conftest_scheduler_hands_out_work_units():
    # The controller's scheduler under --dist loadgroup splits by work_unit
    # (a FIRST test its own unit, else its file); other modes keep xdist's.
    from types import SimpleNamespace

    import conftest

    pytest.importorskip("xdist")
    config = SimpleNamespace(getvalue=lambda name: "load")
    assert conftest.pytest_xdist_make_scheduler(config, None) is None
    split = "tests/test_fleet_hybrid.py::test_engine_classes[dsv4]"
    units = {
        "tests/test_docs.py::test_a": "tests/test_docs.py",
        "tests/test_docs.py::test_b[x]": "tests/test_docs.py",
        split: split,
    }
    for nodeid, unit in units.items():
        assert conftest.work_unit(nodeid)[1] == unit
    sched_cls = type(
        conftest.pytest_xdist_make_scheduler(
            SimpleNamespace(
                getvalue=lambda name: "loadgroup",
                option=SimpleNamespace(loadscopereorder=False, maxschedchunk=None),
                getoption=lambda name, default=None: default,
            ),
            None,
        )
    )
    for nodeid, unit in units.items():
        assert sched_cls._split_scope(None, nodeid) == unit
