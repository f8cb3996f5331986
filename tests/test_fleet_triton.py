"""The Triton fleet kernels (``kernels/fleet_triton.py``) under
TRITON_INTERPRET=1 at small sizes: the joint full-attention scan (runs, vLLM's
hits, the store worker's rule) and the engine-set updates, checked exactly
against the per-engine reference loop and a plain-Python model of the runs,
and the FleetIndex on CUDA's rule (``auto_backend``: Triton) end to end.

No numba is needed (the GPU machine's twin runs this module); the comparison
with the numba kernel skips without it.
"""

from __future__ import annotations

import contextlib
import os
import random
from contextlib import contextmanager
from unittest import mock

import helpers
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers import fleet_expected as expected
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    chained_hashes,
    edge_fleet_batch,
    full_fleet_case,
    merged_group_case,
    preset_requests,
    saved_keys,
)

from kvhit import (
    CacheLayout,
    FleetIndex,
    FullAttention,
    Group,
    HashBatch,
    LookupEngine,
)
from kvhit.bench.workloads import make_layout
from kvhit.coordinator import fleet_index as fleet_mod
from kvhit.kernels import fleet_triton
from kvhit.kernels.contract import BUSY, EMPTY, TOMBSTONE
from kvhit.kernels.hash_index_torch import find, insert, new_table

EXAMPLES = max(int(os.environ.get("KVHIT_PARITY_EXAMPLES", "60")) // 4, 8)
W = 1  # 8-byte hashes


@contextmanager
def on_triton():
    """FleetIndexes built inside take the CUDA rule (``auto_backend`` says
    triton): their tables are driven by the Triton kernels, here interpreted;
    yields the list of the family's full_hits calls, to prove the kernel ran."""
    calls = []
    real = fleet_triton.FleetOps.full_hits
    with (
        mock.patch.object(fleet_mod, "auto_backend", lambda device: "triton"),
        mock.patch.object(
            fleet_triton.FleetOps,
            "full_hits",
            lambda self, *a: calls.append(1) or real(self, *a),
        ),
    ):
        yield calls


def make_fleet(stores_, num_engines=None, capacity=16):
    # Inside on_triton() the CUDA rule holds, so the fleet is a Triton one;
    # outside, the torch fleet it is compared with.
    triton = fleet_mod.auto_backend(torch.device("cpu")) == "triton"
    return helpers.make_fleet(
        stores_,
        backend="triton" if triton else "torch",
        capacity=capacity,
        num_engines=num_engines,
    )


def check(layout, requests, stores_, lens, apply_eagle=True, num_engines=None):
    """fleet_hits and fleet_lookup through the Triton fleet equal the
    reference loop; returns how many times the joint kernel ran."""
    E = num_engines or len(stores_)
    stores_ = list(stores_) + [set()] * (E - len(stores_))
    with on_triton() as calls:
        fleet = make_fleet(stores_, E)
        engine = LookupEngine(layout, backend="torch")
        batch = HashBatch.from_bytes(requests, 8)
        got = engine.fleet_hits(batch, lens, fleet, apply_eagle=apply_eagle)
        assert got.dtype == torch.int64 and list(got.shape) == [len(requests), E]
        assert got.tolist() == expected(layout, requests, stores_, lens, apply_eagle)
        got = engine.fleet_lookup(batch, lens, fleet)
        assert got.tolist() == expected(layout, requests, stores_, lens, lookup=True)
    return len(calls)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=full_fleet_case(), apply_eagle=st.booleans())
def test_random_parity(data, apply_eagle):
    # Random full-attention layouts (the joint kernel where the layout is one
    # non-fine SpecGroup, the per-engine path with the Triton table
    # operations otherwise), stores none/all/random/prefix/saved/mixed,
    # repeated hashes inside a request.
    layout, requests, stores_, lens = data
    check(layout, requests, stores_, lens, apply_eagle)


@pytest.mark.parametrize("preset", ["llama", "dsv4-flash"])
def test_presets_past_64_engines(preset):
    # 70 engines: two engine-set words (the second one partial); every
    # engine's store a different cut of the saved prefix, engine 69 too.
    layout, rng, reqs = preset_requests(preset, 3, 5, 40)
    hbs = layout.hash_block_size
    stores_ = []
    for e in range(70):
        keys = set()
        if e % 4:
            for r in reqs:
                keys |= saved_keys(
                    layout, r, layout.align(rng.randint(0, len(r)) * hbs)
                )
        stores_.append(keys)
    lens = [len(r) * hbs for r in reqs]
    runs = check(layout, reqs, stores_, lens)
    assert runs == (2 if preset == "llama" else 0)


def test_merged_groups_past_64_engines():
    # Two equal full-attention groups merge: a block needs its key in both
    # (MP = 2 probe lanes per block); 70 engines take two words.
    layout, reqs, stores_, lens = merged_group_case(5)
    assert len(layout.spec_groups) == 1
    assert check(layout, reqs, stores_, lens) == 2


@pytest.mark.parametrize("hit", ["all", "none"])
def test_edge_batches(hit):
    # Empty batch, one request, an empty request, all-hit and all-miss, a
    # length 0 and a length past the prompt, a non-power-of-two batch; an
    # EAGLE layout (the drop) and a plain one.
    for layout in (
        make_layout("llama"),
        CacheLayout([Group(FullAttention(16))], 16, 16, use_eagle=True),
    ):
        reqs, stores_, lens = edge_fleet_batch(layout, (33, 0, 1, 7, 40), hit)
        assert check(layout, reqs[:1], stores_, lens[:1]) == 2
        assert check(layout, reqs, stores_, lens) == 2
        assert check(layout, [], stores_, []) == 0  # B = 0 never launches


def test_removed_engines_read_zero():
    layout = make_layout("llama")
    reqs = [chained_hashes(0, 12), chained_hashes(1, 12)]
    keys = saved_keys(layout, reqs[0], 12 * 16)
    with on_triton() as calls:
        fleet = make_fleet([keys] * 67)
        for e in (0, 64, 66):
            fleet.remove_engine(e)
        engine = LookupEngine(layout, backend="torch")
        got = engine.fleet_hits(HashBatch.from_bytes(reqs, 8), [192, 192], fleet)
    want = expected(layout, reqs, [keys] * 67, [192, 192])
    for e in (0, 64, 66):
        for row in want:
            row[e] = 0
    assert got.tolist() == want and want[0][1] > 0 and calls


# -- the kernel itself, against a plain-Python model ------------------------------


def model_runs(present, rows, offsets, lengths, ends, scale, members, live, E):
    """The leading run of every (request, engine): ``present[(g, row)]`` the
    engine set (a Python int) of hash row ``row`` in group ``g``."""
    out = []
    for off, n, end in zip(offsets, lengths, ends, strict=True):
        row = []
        for e in range(E):
            run = 0
            if live >> e & 1:
                while run < min(end, n // scale):
                    u = off + (run + 1) * scale - 1
                    if not all(present.get((g, rows[u]), 0) >> e & 1 for g in members):
                        break
                    run += 1
            row.append(run)
        out.append(row)
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    E=st.sampled_from([1, 5, 64, 65, 130]),
    M=st.integers(1, 3),
    scale=st.integers(1, 3),
    B=st.integers(0, 5),
)
def test_runs_against_a_model_in_a_nearly_full_table(seed, E, M, scale, B):
    # Every key of the batch in a table with one slot to spare, so home slots
    # collide and probe chains wrap around the table; hash rows repeat (the
    # same key at several positions); engine sets random, long runs likely;
    # ends below and past the requests' blocks; dead engines.
    check_runs(seed, E, M, scale, B, [0, 1, 2, 5, 9, 40, 70])


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    E=st.sampled_from([1, 65]),
    M=st.integers(1, 3),
    B=st.integers(1, 4),
)
def test_runs_past_tombstones_and_busy_slots(seed, E, M, B):
    # The tile probe (fleet_probe.probe_slots) passes over TOMBSTONE and
    # BUSY slots, and with no EMPTY slot left ends after `capacity` visits;
    # absent keys in the middle of a run stop the lanes above them (their
    # chains are long here), and the runs below stay exact.
    check_runs(seed, E, M, 1, B, [1, 5, 40, 70, 200], holes=True)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    E=st.sampled_from([1, 64, 65]),
    M=st.integers(1, 2),
    B=st.integers(1, 4),
    block=st.sampled_from([16, 32]),
    split=st.sampled_from([1, 2, 3, 5, 16]),
    reverse=st.booleans(),
)
def test_tiles_dealt_to_several_programs(seed, E, M, B, block, split, reverse):
    # Small tiles and several programs per request (the GPU's SPLIT, any
    # count, not only powers of two): runs cross many tiles, and programs
    # stop on other programs' misses. ``reverse``: the interpreter runs a
    # request's programs last tile first (a GPU may run them in any order),
    # so a later tile's miss is recorded before an earlier one's and must
    # not win. Every answer the model's.
    with (
        mock.patch.object(fleet_triton, "BLOCK", block),
        mock.patch.object(fleet_triton, "_split", lambda batch, device: split),
        reversed_programs() if reverse else contextlib.nullcontext(),
    ):
        want = check_runs(seed, E, M, 1, B,
                          [0, 1, block - 1, block, 3 * block + 1, 150], dense=True)  # fmt: skip
    LONGEST.append(max(max(row, default=0) for row in want) if want else 0)


# The longest run of each example of the test above (see the test below).
LONGEST: list[int] = []


def test_runs_crossed_tiles():
    # The examples above had runs crossing several 32-block tiles (at least
    # two past one tile: the twin's 30 examples gave 2 of them, the default
    # count more).
    if not LONGEST:
        pytest.skip("test_tiles_dealt_to_several_programs did not run first")
    assert max(LONGEST) > 3 * 32 and sum(n > 32 for n in LONGEST) >= 2


@contextmanager
def reversed_programs():
    """Triton's interpreter runs grid axis 1 backwards (program ``s`` is given
    ``n - 1 - s``; ``grid_dim`` is set by each launch, before its programs
    run); the interpreter runs the grid in order otherwise."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    real = getattr(builder, "set_grid_idx", None)
    if real is None or not hasattr(builder, "set_grid_dim"):  # in order
        yield
        return

    def backwards(x, y, z):
        real(x, builder.grid_dim[1] - 1 - y, z)

    with mock.patch.object(builder, "set_grid_idx", backwards):
        yield


@triton.jit
def _order_kernel(out_ptr, n_ptr):
    # Each program appends its id to out (n counts the programs run so far).
    k = tl.atomic_add(n_ptr, 1)
    tl.store(out_ptr + k, tl.program_id(1))


def test_reversed_programs_run_axis_1_backwards():
    # The hook the test above relies on (where this Triton has it).
    from triton.runtime import interpreter

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("compiled kernels: the GPU picks the order")

    out, n = torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with reversed_programs():
        _order_kernel[(1, 4)](out, n)
    if hasattr(interpreter.interpreter_builder, "set_grid_dim"):
        assert out.tolist() == [3, 2, 1, 0]
    else:
        assert out.tolist() == [0, 1, 2, 3]


def check_runs(seed, E, M, scale, B, length_choices, dense=False, holes=False):
    """full_runs on a random nearly full table equals model_runs (and the
    numba kernel's, where numba imports); returns the runs. ``dense``: keys
    nearly all present and held by every engine, ends mostly past the
    requests (long runs). ``holes``: EMPTY slots turned into TOMBSTONE and
    BUSY ones (probes pass over both), sometimes every one of them (probes
    then end after ``capacity`` visits)."""
    rng = random.Random(seed)
    NW = (E + 63) // 64
    lengths = [rng.choice(length_choices) for _ in range(B)]
    offsets = [sum(lengths[:i]) for i in range(B)]
    T = sum(lengths)
    rows: list[int] = []
    for _ in range(T):
        fresh = not rows or rng.random() < 0.8
        rows.append(rng.randrange(1 << 63) if fresh else rng.choice(rows))
    members = rng.sample(range(4), M)
    everyone = (1 << E) - 1
    # Dense stores too, so that runs cross steps of BLOCK blocks.
    p_key, p_all = rng.choice([(0.9, 0.7), (0.999, 0.99)] + [(0.999, 0.99)] * 3 * dense)
    present = {}
    for g in members:
        for h in rows:
            if rng.random() < p_key:
                present[(g, h)] = (
                    everyone if rng.random() < p_all else rng.getrandbits(E)
                )
    keys = [k for k, v in present.items() if v]
    cap = 1 << max(1, len(keys)).bit_length()  # the next power of two > len(keys)
    table = new_table(cap, W, "cpu")
    bits = torch.zeros((cap, NW), dtype=torch.int64)
    if keys:
        g = torch.tensor([k[0] for k in keys], dtype=torch.int64)
        h = torch.tensor([[k[1]] for k in keys], dtype=torch.int64)
        assert int(insert(table, W, g, h).sum()) == len(keys)
        slots = find(table, W, g, h)
        words = [[(present[k] >> (64 * w)) & ((1 << 64) - 1) for w in range(NW)]
                 for k in keys]  # fmt: skip
        words = torch.tensor(words, dtype=torch.uint64).view(torch.int64)
        bits[slots] = words
    if holes:
        empty = (table[:, 0] == EMPTY).nonzero().flatten().tolist()
        keep = rng.choice([0, 1, len(empty) // 2])
        for i in empty[keep:]:
            table[i, 0] = rng.choice([TOMBSTONE, BUSY])
    live_int = everyone if rng.random() < 0.5 else rng.getrandbits(E)
    live = torch.tensor([(live_int >> (64 * w)) & ((1 << 64) - 1) for w in range(NW)],
                        dtype=torch.uint64).view(torch.int64)  # fmt: skip
    ends = [rng.choice([0, 1, 3, 33] + [10**6] * (1 + 8 * dense)) for _ in range(B)]

    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    rows_t = torch.tensor(rows, dtype=torch.int64).reshape(T, W)
    # members and live as tensors, or as numpy arrays (copied once, cached).
    consts = (t(members), live) if seed % 2 else (t(members).numpy(), live.numpy())
    got = fleet_triton.full_runs(table, bits, rows_t, t(offsets), t(lengths), t(ends),
                                 scale, *consts, E)  # fmt: skip
    want = model_runs(present, rows, offsets, lengths, ends, scale, members,
                      live_int, E)  # fmt: skip
    assert got.tolist() == want
    try:
        from kvhit.kernels import fleet_numba
    except ImportError:  # the device twin has no numba
        return want
    # The numba kernel's runs on one [C, W + 1 + NW] table.
    joint = torch.cat([table, bits], dim=1).numpy()
    runs = fleet_numba.full_runs(
        joint, NW, rows_t.numpy(), t(offsets).numpy(), t(lengths).numpy(),
        t(ends).numpy(), scale, t(members).numpy(), live.numpy(), E,
    )  # fmt: skip
    assert runs.tolist() == want
    return want


# -- engine-set updates ---------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data(), E=st.sampled_from([1, 3, 64, 70, 129]))
def test_updates_against_a_model(data, E):
    # Random adds and removes (repeats in a batch, absent keys, every engine
    # of a slot dropped at once) through the Triton set/clear kernels and the
    # Triton KeyIndex find/insert: the counts and the engine sets equal a
    # dict model's, and a slot left with no engine is a tombstone.
    hashes = [bytes([i]) * 8 for i in range(12)]
    with on_triton():
        fleet = FleetIndex(E, 8, capacity=4, backend="triton")
    model: dict[tuple[int, bytes], set[int]] = {}
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(0, 12))
        eng = [data.draw(st.integers(0, E - 1)) for _ in range(n)]
        grp = [data.draw(st.integers(0, 1)) for _ in range(n)]
        hs = [data.draw(st.sampled_from(hashes)) for _ in range(n)]
        if data.draw(st.booleans()):
            new = {(e, g, h) for e, g, h in zip(eng, grp, hs, strict=True)
                   if e not in model.get((g, h), set())}  # fmt: skip
            assert fleet.add(eng, grp, hs) == len(new)
            for e, g, h in new:
                model.setdefault((g, h), set()).add(e)
        else:
            gone = {(e, g, h) for e, g, h in zip(eng, grp, hs, strict=True)
                    if e in model.get((g, h), set())}  # fmt: skip
            assert fleet.remove(eng, grp, hs) == len(gone)
            for e, g, h in gone:
                model[(g, h)].discard(e)
        model = {k: v for k, v in model.items() if v}
        assert len(fleet) == len(model)
        sizes = [sum(e in v for v in model.values()) for e in range(E)]
        assert fleet.engine_sizes().tolist() == sizes
        keys = sorted(model)
        if keys:
            held = fleet.holders([g for g, _ in keys], [h for _, h in keys])
            assert [set(row.nonzero().flatten().tolist()) for row in held] == [
                model[k] for k in keys
            ]
        live = fleet.keys[:, 0] >= 0
        assert not bool(fleet.bits[~live].any())
        assert int((fleet.keys[:, 0] == TOMBSTONE).sum()) == fleet.tombstones


def test_set_bits_counts_repeats_once_and_bit_63():
    bits = torch.zeros((4, 2), dtype=torch.int64)
    slots = torch.tensor([1, 1, 1, 3, 3], dtype=torch.int64)
    engines = torch.tensor([63, 63, 64, 0, 127], dtype=torch.int64)
    new = fleet_triton.set_bits(bits, slots, engines, 128)
    assert new.tolist() == [1] + [0] * 62 + [1, 1] + [0] * 62 + [1]
    assert bits[1].tolist() == [-(1 << 63), 1] and bits[3].tolist() == [1, -(1 << 63)]
    keys = new_table(4, W, "cpu")
    keys[:, 0] = 0
    gone, freed = fleet_triton.clear_bits(
        keys, bits, torch.tensor([1, 1, 3, -1], dtype=torch.int64),
        torch.tensor([63, 63, 0, 5], dtype=torch.int64), 128,
    )  # fmt: skip
    assert gone.sum() == 2 and gone[63] == 1 and gone[0] == 1 and freed == 0
    gone, freed = fleet_triton.clear_bits(
        keys, bits, torch.tensor([1, 3, 3], dtype=torch.int64),
        torch.tensor([64, 127, 127], dtype=torch.int64), 128,
    )  # fmt: skip
    assert gone.sum() == 2 and freed == 2
    assert keys[:, 0].tolist() == [0, TOMBSTONE, 0, TOMBSTONE]


def test_probe_bits_equal_the_torch_ops():
    # Every (group, row) pair's engine set, absent keys and groups included,
    # 130 engines (three words), rows repeated; B = 0 rows too.
    from kvhit.kernels import fleet_torch

    rng = random.Random(2)
    reqs = [chained_hashes(i, 9) for i in range(3)]
    stores_ = [{(rng.randint(0, 2), h) for r in reqs for h in r if rng.random() < 0.5}
               for _ in range(130)]  # fmt: skip
    fleet = make_fleet(stores_)
    rows = HashBatch.from_bytes(reqs + [reqs[0][:4]], 8).view().rows
    held = 0
    for gids in ([0, 1, 2, 3], [2], []):
        g = torch.tensor(gids, dtype=torch.int64)
        for r in (rows, rows[:0]):
            want = fleet_torch.probe_bits(fleet.keys, fleet.bits, g, r)
            got = fleet_triton.probe_bits(fleet.keys, fleet.bits, g, r)
            assert list(got.shape) == [len(gids), r.shape[0], 3]
            assert torch.equal(got, want)
            held += int(want.count_nonzero())
    assert held > 20


def test_launchers_refuse_bad_arguments():
    keys, bits = new_table(8, W, "cpu"), torch.zeros((8, 1), dtype=torch.int64)
    rows = torch.zeros((3, W), dtype=torch.int64)
    one = torch.zeros(1, dtype=torch.int64)
    args = (rows, one, one, one, one, one)
    with pytest.raises(ValueError, match="keys"):
        fleet_triton.full_runs(keys[:6], bits, *args[:4], 1, *args[4:], 1)
    with pytest.raises(ValueError, match="bits"):
        fleet_triton.full_runs(keys, bits[:4], *args[:4], 1, *args[4:], 1)
    with pytest.raises(TypeError, match="rows"):
        fleet_triton.full_runs(keys, bits, rows.int(), *args[1:4], 1, *args[4:], 1)
    with pytest.raises(ValueError, match="ends"):
        fleet_triton.full_runs(keys, bits, rows, one, one, one.repeat(2), 1, one,
                               one, 1)  # fmt: skip
    with pytest.raises(ValueError, match="num_engines"):
        fleet_triton.full_runs(keys, bits, *args[:4], 1, *args[4:], 65)
    with pytest.raises(TypeError, match="int64"):
        fleet_triton.full_runs(keys, bits, *args[:4], 1, np.zeros(1, np.int32), one, 1)
    with pytest.raises(ValueError, match="params"):
        fleet_triton.full_hits(keys, bits, *args, (1, 1, 16, 16, 0), 1)
    with pytest.raises(ValueError, match="NW"):
        fleet_triton.full_hits(keys, bits, *args, (2, 1, 16, 16, 0, 0), 1)
    with pytest.raises(ValueError, match="engines"):
        fleet_triton.set_bits(bits, one, one.repeat(2), 1)
    # Sizes: a wrong type is a TypeError, a size below 1 a ValueError (the
    # numba and scan launchers' rule, kernels/checks.check_size).
    with pytest.raises(ValueError, match="scale must be an int >= 1, got 0"):
        fleet_triton.full_runs(keys, bits, *args[:4], 0, *args[4:], 1)
    with pytest.raises(TypeError, match="scale must be an int >= 1, got float"):
        fleet_triton.full_runs(keys, bits, *args[:4], 1.0, *args[4:], 1)
    with pytest.raises(ValueError, match="alignment must be an int >= 1, got 0"):
        fleet_triton.full_hits(keys, bits, *args, (1, 1, 16, 0, 0, 0), 1)


def test_prefix_blocks_equal_the_torch_fleet():
    # The overlap score of a full-attention-only router (prefix_blocks): the
    # Triton runs equal the torch fleet's, 70 engines, two groups counted,
    # with and without a cap on the blocks counted.
    from kvhit.coordinator.routing import prefix_blocks

    rng = random.Random(5)
    reqs = [chained_hashes(i % 3, rng.randint(0, 45)) for i in range(5)]
    stores_ = []
    for e in range(70):
        keys = set()
        for r in reqs:
            cut = rng.randint(0, len(r)) if e % 3 else len(r)
            keys |= {(g, h) for g in (0, 1) for h in r[:cut]}
            keys |= {(1, h) for h in r[cut : cut + 2]}
        stores_.append(keys)
    batch = HashBatch.from_bytes(reqs, 8)
    torch_fleet = make_fleet(stores_)
    torch_fleet.remove_engine(2)
    with on_triton():
        fleet = make_fleet(stores_)
        fleet.remove_engine(2)
        for cap in (None, [0, 3, 100, 40, 2]):
            want = prefix_blocks(batch, torch_fleet, [0, 1], 1, cap)
            got = prefix_blocks(batch, fleet, [0, 1], 1, cap)
            assert got.tolist() == want.tolist()
            assert int(want.max()) > 32 and not bool(want[:, 2].any())


def fleet_answers(device, layout, reqs, adds, gone, lens, E, backend="torch"):
    """A FleetIndex on ``device`` after ``adds`` (engine, group, hash lists)
    and the removal of the entries ``gone`` and of one engine, and its
    answers for ``reqs``: (fleet, [hits, lookups, prefix runs])."""
    from kvhit.coordinator.routing import prefix_blocks

    eng, grp, hs = adds
    fleet = FleetIndex(E, 8, capacity=64, device=device, backend=backend)
    assert fleet.add(eng, grp, hs) > 0
    fleet.remove([eng[i] for i in gone], [grp[i] for i in gone],
                 [hs[i] for i in gone])  # fmt: skip
    fleet.remove_engine(min(5, E - 1))
    engine = LookupEngine(layout, backend="torch", device=device)
    batch = HashBatch.from_bytes(reqs, 8).to(device)
    groups = list(range(len(layout.groups)))
    return fleet, [
        engine.fleet_hits(batch, lens, fleet).cpu(),
        engine.fleet_lookup(batch, lens, fleet).cpu(),
        prefix_blocks(batch, fleet, groups, 1).cpu(),
    ]


def compare_fleets(device, n_req, max_blocks, num_engines, seed):
    """A fleet on ``device`` driven by the Triton kernels equals a CPU fleet
    of torch ops after the same adds and removes (repeats, keys held by many
    engines at once, an engine removed): engine sizes, counts, hits, lookups
    and prefix runs, for llama and a merged SpecGroup of two groups (a key
    sometimes missing from the second). Returns the CPU fleet's answers."""
    rng = random.Random(seed)
    E = num_engines
    merged = CacheLayout([Group(FullAttention(16)), Group(FullAttention(16))], 16, 16)
    out = []
    for layout in (make_layout("llama"), merged):
        n_groups = len(layout.groups)
        reqs = [chained_hashes(i % 5, rng.randint(0, max_blocks)) for i in range(n_req)]
        reqs.append([])  # an empty request (its max length is 0, not negative)
        eng, grp, hs = [], [], []
        for i, r in enumerate(reqs):
            for e in {i % E, (7 * i) % E, E - 1}:
                for h in r[: rng.randint(0, len(r))]:
                    for g in range(n_groups if rng.random() < 0.97 else 1):
                        eng.append(e), grp.append(g), hs.append(h)
        # Max lengths up to 20 tokens short of the prompt, never negative (an
        # empty request's is 0: the engine rightly refuses a negative one).
        lens = [max(len(r) * 16 - rng.randint(0, 20), 0) for r in reqs]
        case = (reqs, (eng, grp, hs), rng.sample(range(len(hs)), len(hs) // 200),
                lens, E)  # fmt: skip
        with on_triton() as calls:
            fleet, got = fleet_answers(device, layout, *case, backend="triton")
        assert len(calls) == 2 and fleet.backend == "triton"
        cpu, want = fleet_answers("cpu", layout, *case)
        assert fleet.engine_sizes().tolist() == cpu.engine_sizes().tolist()
        assert len(fleet) == len(cpu) and fleet.tombstones == cpu.tombstones
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        out.append(want)
    return out


def test_triton_fleet_equals_the_torch_fleet():
    # compare_fleets at an interpreter's size (what the GPU test below runs
    # at scale on CUDA).
    answers = compare_fleets("cpu", 8, 60, 70, seed=1)
    assert max(int(runs.max()) for _, _, runs in answers) > 32
    assert min(int(hits.count_nonzero()) for hits, _, _ in answers) > 20


@pytest.mark.gpu
def test_cuda_fleet_equals_the_cpu_fleet():
    # On a GPU (compiled kernels, real concurrency in the updates: every
    # lane of a batch on few slots), 300 engines, B = 96 requests of up to
    # 300 blocks (runs cross many steps of BLOCK blocks).
    answers = compare_fleets("cuda", 96, 300, 300, seed=7)
    assert max(int(runs.max()) for _, _, runs in answers) > 100
    assert min(int(hits.count_nonzero()) for hits, _, _ in answers) > 200


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    NW=st.integers(1, 3),
    cap=st.sampled_from([1, 8, 256, 512]),
    data=st.data(),
)
def test_clear_engine_equals_the_torch_ops(seed, NW, cap, data):
    # One launch over the table (slots past a program's block, bit 63, dead
    # and tombstoned slots holding stale bits, a slot whose only engine is
    # cleared, engines in every word) against fleet_torch.clear_engine.
    from kvhit.kernels import fleet_torch

    engine = data.draw(st.integers(0, NW * 64 - 1) | st.sampled_from([63, NW * 64 - 1]))
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 5, (cap, W + 1), generator=gen)
    state = torch.randint(0, 4, (cap,), generator=gen)
    keys[state == 0, 0] = -1  # EMPTY
    keys[state == 1, 0] = TOMBSTONE
    bits = torch.randint(-(1 << 63), (1 << 63) - 1, (cap, NW), generator=gen)
    sparse = torch.rand((cap, NW), generator=gen) < 0.5
    bits[sparse] = 0
    only = torch.rand(cap, generator=gen) < 0.3
    bits[only] = 0
    bits[only, engine >> 6] = 1 << (engine & 63) if engine & 63 != 63 else -(1 << 63)
    want_k, want_b = keys.clone(), bits.clone()
    want = fleet_torch.clear_engine(want_k, want_b, engine)
    got = fleet_triton.clear_engine(keys, bits, engine)
    assert got == want and torch.equal(keys, want_k) and torch.equal(bits, want_b)
    assert (want[0] > 0 and want[1] > 0) or cap <= 8


def test_clear_engine_refuses_bad_arguments():
    keys, bits = new_table(8, W, "cpu"), torch.zeros((8, 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="engine must be in"):
        fleet_triton.clear_engine(keys, bits, 64)
    with pytest.raises(TypeError, match="engine must be an int"):
        fleet_triton.clear_engine(keys, bits, 1.0)
    with pytest.raises(ValueError, match="bits"):
        fleet_triton.clear_engine(keys, bits[:4], 0)


# -- the router path's per-plan arguments (fleet_scoring._router_args) -------------------


def _router_entry(engine, nw, E, apply_eagle, lookup):
    from kvhit.coordinator import fleet_scoring

    return fleet_scoring._router_args(engine, nw, E, apply_eagle, lookup)


@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("apply_eagle", [False, True])
def test_router_args_on_and_off_the_cpu(lookup, apply_eagle):
    # On the CPU the numba kernel's members and params; off it (a meta device
    # stands in for CUDA) none, so the host kernel refuses the call and the
    # general path takes it.
    from types import SimpleNamespace

    layout = CacheLayout([Group(FullAttention(16)), Group(FullAttention(16))], 16, 16)
    engine = LookupEngine(layout, backend="torch", device="cpu")
    plan, dev, members, params = _router_entry(engine, 2, 70, apply_eagle, lookup)
    assert plan is engine.plan and dev == engine.device
    assert members.tolist() == [0, 1] and len(params) == 7
    assert params[6] == 70 and params[5] == int(lookup)
    off = SimpleNamespace(plan=engine.plan, device=torch.device("meta"))
    assert _router_entry(off, 2, 70, apply_eagle, lookup)[2:] == (None, None)
    # Not the joint scan's layout (a sliding window): nothing on the CPU either.
    hybrid = LookupEngine(make_layout("gemma3"), backend="torch", device="cpu")
    assert _router_entry(hybrid, 2, 70, apply_eagle, lookup)[2:] == (None, None)
