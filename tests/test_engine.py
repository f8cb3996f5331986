"""LookupEngine parity with the reference, and its input contract.

Every batched backend must equal :class:`ReferenceCoordinator` exactly: hit
lengths, per-group load masks, the store worker's lookup, store/lookup masks
and the worker's candidate keys. The triton backend has its own parity file
(``test_scan_triton.py``); here the torch and reference backends are checked.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from helpers import full_mamba_eagle_layout, key_index, merged_swa_eagle_layout
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    case,
    chained_hashes,
    layouts,
    saved_keys,
    store_from_masks,
)

from kvhit import (
    CacheLayout,
    FullAttention,
    Group,
    HashBatch,
    KeyIndex,
    LookupEngine,
    ReferenceCoordinator,
)
from kvhit.bench.workloads import make_layout

# "numba" runs with threads over requests forced off, "numba-threads" forced
# on (the engine picks by batch size, and test batches are small).
BACKENDS = ["numba", "numba-threads", "torch", "reference"]
BATCHED = ["numba", "numba-threads", "torch"]

# KVHIT_PARITY_EXAMPLES=N runs N examples per parity test (a large random run).
EXAMPLES = int(os.environ.get("KVHIT_PARITY_EXAMPLES", "150"))


def make_engine(layout, backend: str, device: str = "cpu") -> LookupEngine:
    """An engine for a test backend name (see BACKENDS)."""
    if backend.startswith("numba"):
        engine = LookupEngine(layout, backend="numba", device=device)
        engine.impl.parallel = backend == "numba-threads"
        return engine
    return LookupEngine(layout, backend=backend, device=device)


def _against_reference(layout, requests, backend):
    """``(reference, engine, batch)`` for a parity case: the scalar reference
    of ``layout``, the test backend's engine and the 8-byte CPU batch."""
    ref = ReferenceCoordinator(layout)
    return ref, make_engine(layout, backend), HashBatch.from_bytes(requests, 8, "cpu")


def _check_find(layout, requests, exists, lens, backend, apply_eagle):
    ref, engine, batch = _against_reference(layout, requests, backend)
    res = engine.find_longest_cache_hit(
        batch, lens, key_index(exists), apply_eagle=apply_eagle, with_masks=True
    )
    got_masks = res.mask_lists()
    for b, (hl, n) in enumerate(zip(requests, lens, strict=True)):
        masks, hit = ref.find_longest_cache_hit(hl, n, exists, apply_eagle)
        assert int(res.hit_lengths[b]) == hit, (b, n, layout)
        assert list(got_masks[b]) == list(masks), (b, n, layout)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=EXAMPLES)
@given(data=case(), apply_eagle=st.booleans())
def test_find_parity(backend, data, apply_eagle):
    layout, requests, exists, lens = data
    _check_find(layout, requests, exists, lens, backend, apply_eagle)


#: One request's length in every form a router holds it.
ONE_LENGTH_FORMS = {
    "list": lambda n: [n],
    "tuple": lambda n: (n,),
    "int64": lambda n: np.array([n], dtype=np.int64),
    "int32": lambda n: np.array([n], dtype=np.int32),
    "uint64": lambda n: np.array([n], dtype=np.uint64),
    "tensor": lambda n: torch.tensor([n]),
}


@pytest.mark.parametrize("backend", BATCHED)
@settings(max_examples=EXAMPLES)
@given(
    data=case(),
    apply_eagle=st.booleans(),
    form=st.sampled_from(sorted(ONE_LENGTH_FORMS)),
)
def test_one_request_steps_parity(backend, data, apply_eagle, form):
    # A scheduler step of one request (the numba backend's one-request path,
    # its hit an int until hit_lengths is read): each request of the case
    # alone, packed from bytes and from ints, with no masks asked for, equals
    # the reference and the same request inside the batch.
    layout, requests, exists, lens = data
    ref, engine, batch = _against_reference(layout, requests, backend)
    index = key_index(exists)
    in_batch = engine.find_longest_cache_hit(batch, lens, index, apply_eagle)
    for b, (hl, n) in enumerate(zip(requests, lens, strict=True)):
        want = ref.find_longest_cache_hit(hl, n, exists, apply_eagle)[1]
        ints = [int.from_bytes(h, "little", signed=True) for h in hl]
        for one in (HashBatch.from_bytes([hl], 8), HashBatch.from_ints([ints])):
            res = engine.find_longest_cache_hit(
                one, ONE_LENGTH_FORMS[form](n), index, apply_eagle
            )
            assert res.hit_list() == [want], (b, n, form)
            assert res.hit_array().tolist() == [want]
            assert res.hit_lengths.dtype == torch.int64
            assert res.hit_lengths.tolist() == [want]
            assert int(in_batch.hit_lengths[b]) == want
            got = engine.lookup(one, ONE_LENGTH_FORMS[form](n), index).tolist()
            assert got == [ref.lookup(n, hl, exists)], (b, n, form)


@pytest.mark.parametrize("backend", BATCHED)
@settings(max_examples=EXAMPLES)
@given(data=case())
def test_lookup_parity(backend, data):
    layout, requests, exists, lens = data
    ref, engine, batch = _against_reference(layout, requests, backend)
    got = engine.lookup(batch, lens, key_index(exists)).tolist()
    want = [ref.lookup(n, hl, exists) for hl, n in zip(requests, lens, strict=True)]
    assert got == want


@pytest.mark.parametrize("backend", BATCHED)
@settings(max_examples=max(EXAMPLES * 2 // 3, 1))
@given(data=case())
def test_load_masks_and_candidates_parity(backend, data):
    layout, requests, _, lens = data
    ref, engine, batch = _against_reference(layout, requests, backend)
    res = engine.load_masks(batch, lens)
    got = res.mask_lists()
    for b, (hl, n) in enumerate(zip(requests, lens, strict=True)):
        assert list(got[b]) == list(ref.load_mask(hl, n))
    via_ref = LookupEngine(layout, backend="reference").load_masks(batch, lens)
    assert via_ref.hit_lengths.tolist() == res.hit_lengths.tolist()
    gids, rows = engine.lookup_candidates(batch, lens)
    flat = [h for hl in requests for h in hl]
    got_keys = sorted(zip(gids.tolist(), (flat[r] for r in rows.tolist()), strict=True))
    want_keys = sorted(
        k
        for hl, n in zip(requests, lens, strict=True)
        for k in ref.lookup_candidates(n, hl)
    )
    assert got_keys == want_keys


@settings(max_examples=EXAMPLES)
@given(layout=layouts(), data=st.data())
def test_store_and_lookup_masks_parity(layout, data):
    ref = ReferenceCoordinator(layout)
    engine = LookupEngine(layout)
    n = data.draw(st.integers(0, 4))
    units = st.integers(0, 12)
    aligned = [data.draw(units) * layout.alignment for _ in range(n)]
    starts = [data.draw(st.integers(0, a + 3)) for a in aligned]
    prompts = [a + data.draw(st.integers(-min(a, 2), 40)) for a in aligned]
    if n and all(p > 0 for p in prompts):
        got = engine.store_masks(aligned, starts, prompts).mask_lists()
        assert got == [
            ref.store_mask(a, s, p)
            for a, s, p in zip(aligned, starts, prompts, strict=True)
        ]
    got = engine.store_masks(aligned, starts).mask_lists()
    assert got == [ref.store_mask(a, s) for a, s in zip(aligned, starts, strict=True)]
    got = engine.lookup_masks(aligned).mask_lists()
    assert got == [ref.lookup_mask(a) for a in aligned]


# -- the seed regressions of ARCHITECTURE.md, through every backend ------------

SEED_BACKENDS = ["numba", "numba-threads", "torch", "reference", "triton"]


def _dsv4() -> CacheLayout:
    return make_layout("dsv4-flash")


def _engine(layout: CacheLayout, backend: str, device: str) -> LookupEngine:
    # The triton backend runs on CUDA, or under the interpreter on the CPU.
    dev = device if backend == "triton" else "cpu"
    return make_engine(layout, backend, dev)


def _dev_index(keys, engine: LookupEngine) -> KeyIndex:
    return key_index(keys).to(engine.device)


def _saved_prompt(engine: LookupEngine, hashes, aligned: int, masks):
    """One prompt saved through the store ``masks`` up to ``aligned`` tokens:
    ``(exists, batch, index)``, the batch and index on the engine's device."""
    exists = store_from_masks(engine.layout, hashes, aligned, masks)
    batch = HashBatch.from_bytes([hashes], 8, engine.device)
    return exists, batch, _dev_index(exists, engine)


@pytest.mark.parametrize("backend", SEED_BACKENDS)
def test_seed_full_mamba_eagle(backend, device):
    layout = full_mamba_eagle_layout()
    hashes = chained_hashes(1, 4)
    exists = {(g, h) for g in (0, 1) for h in hashes}
    engine = _engine(layout, backend, device)
    batch = HashBatch.from_bytes([hashes], 8, engine.device)
    res = engine.find_longest_cache_hit(
        batch, [64], _dev_index(exists, engine), with_masks=True
    )
    assert res.hit_lengths.tolist() == [48]
    assert res.mask_lists() == [([True] * 3, [False, False, True])]


@pytest.mark.parametrize("backend", SEED_BACKENDS)
def test_seed_merged_swa_eagle(backend, device):
    layout = merged_swa_eagle_layout()
    assert layout.eagle_group_ids == {1, 2}
    engine = _engine(layout, backend, device)
    masks = engine.store_masks([128], num_prompt_tokens=[130]).mask_lists()[0]
    assert masks[1] == masks[2]
    hashes = chained_hashes(2, 130 // 16)
    exists, batch, index = _saved_prompt(engine, hashes, 128, masks)
    res = engine.find_longest_cache_hit(batch, [128], index)
    assert res.hit_lengths.tolist() == [64]
    assert engine.lookup(batch, [128], index).tolist() == [64]


@pytest.mark.parametrize("backend", SEED_BACKENDS)
def test_seed_dsv4_flash(backend, device):
    layout = _dsv4()
    engine = _engine(layout, backend, device)
    masks = engine.store_masks([768]).mask_lists()[0]
    hashes = chained_hashes(3, 768 // 4)
    exists, batch, index = _saved_prompt(engine, hashes, 768, masks)
    res = engine.find_longest_cache_hit(batch, [768], index)
    assert res.hit_lengths.tolist() == [512]
    want = ReferenceCoordinator(layout).lookup(768, hashes, exists)
    assert engine.lookup(batch, [768], index).tolist() == [want]


# -- batches -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BATCHED)
def test_mixed_batch_and_order_independence(backend):
    """Empty, tiny and long requests in one batch; a permuted batch gives the
    permuted answers."""
    layout = _dsv4()
    ref = ReferenceCoordinator(layout)
    rng = random.Random(7)
    requests = [[], chained_hashes(10, 1), chained_hashes(11, 3)]
    exists: set = set()
    for seed, n in [(12, 600), (13, 257), (14, 1100), (15, 64)]:
        hl = chained_hashes(seed, n)
        requests.append(hl)
        exists |= saved_keys(layout, hl, n * 4)
    # Extensions of stored prompts, and eviction holes.
    requests.append(requests[3] + chained_hashes(16, 300, prefix=requests[3])[600:])
    for key in rng.sample(sorted(exists), 3):
        exists.discard(key)
    num_tokens = [len(h) * 4 + rng.choice([0, 1, 3]) for h in requests]
    engine = make_engine(layout, backend)
    index = key_index(exists)
    batch = HashBatch.from_bytes(requests, 8, "cpu")
    got = engine.lookup(batch, num_tokens, index).tolist()
    want = [
        ref.lookup(n, hl, exists) for hl, n in zip(requests, num_tokens, strict=True)
    ]
    assert got == want
    assert any(w > 0 for w in want) and got[0] == 0
    perm = list(range(len(requests)))
    rng.shuffle(perm)
    batch_p = HashBatch.from_bytes([requests[i] for i in perm], 8, "cpu")
    got_p = engine.lookup(batch_p, [num_tokens[i] for i in perm], index).tolist()
    assert got_p == [got[i] for i in perm]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_zero_lengths(backend):
    engine = make_engine(_dsv4(), backend)
    index = key_index({(0, b"\x01" * 8)})
    empty = HashBatch.from_bytes([], 8, "cpu")
    assert engine.lookup(empty, [], index).shape == (0,)
    assert engine.find_longest_cache_hit(empty, [], index).hit_lengths.shape == (0,)
    batch = HashBatch.from_bytes([[], [b"\x01" * 8]], 8, "cpu")
    assert engine.lookup(batch, [0, 0], index).tolist() == [0, 0]
    out = engine.find_longest_cache_hit(batch, torch.tensor([0, 0]), index)
    assert out.hit_lengths.dtype == torch.int64
    assert out.hit_lengths.tolist() == [0, 0]


@pytest.mark.parametrize("backend", BATCHED)
def test_all_hit_and_all_miss_stores(backend):
    layout = _dsv4()
    hashes = chained_hashes(20, 300)
    everything = {(g, h) for g in range(5) for h in hashes}
    batch = HashBatch.from_bytes([hashes], 8, "cpu")
    engine = make_engine(layout, backend)
    ref = ReferenceCoordinator(layout)
    assert (
        engine.lookup(batch, [1200], key_index(everything)).tolist()
        == [ref.lookup(1200, hashes, everything)]
        != [0]
    )
    other = {(g, h) for g in range(5) for h in chained_hashes(21, 300)}
    assert engine.lookup(batch, [1200], key_index(other)).tolist() == [0]


# -- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_name_the_argument(backend):
    layout = _dsv4()
    engine = make_engine(layout, backend)
    index = key_index({(0, b"\x01" * 8)})
    batch = HashBatch.from_bytes([[b"\x01" * 8], []], 8, "cpu")
    with pytest.raises(ValueError, match="max_lengths"):
        engine.find_longest_cache_hit(batch, [1], index)
    with pytest.raises(TypeError, match="max_lengths"):
        engine.find_longest_cache_hit(batch, torch.tensor([1.0, 2.0]), index)
    with pytest.raises(ValueError, match="max_lengths"):
        engine.find_longest_cache_hit(batch, torch.tensor([[1, 2]]), index)
    with pytest.raises(ValueError, match="num_tokens"):
        engine.lookup(batch, [5, -1], index)
    with pytest.raises(TypeError, match="num_tokens"):
        engine.lookup(batch, 5, index)
    with pytest.raises(TypeError, match="num_tokens"):
        engine.lookup(batch, np.array([4.0, 4.0]), index)
    assert engine.lookup(batch, np.array([4, 4]), index).tolist() == [0, 0]
    wide = KeyIndex(16, capacity=16)
    with pytest.raises(ValueError, match="hash width"):
        engine.lookup(batch, [4, 4], wide)
    with pytest.raises(TypeError, match="index"):
        engine.lookup(batch, [4, 4], {(0, b"\x01" * 8)})
    with pytest.raises(TypeError, match="batch"):
        engine.lookup([[b"\x01" * 8]], [4], index)
    with pytest.raises(ValueError, match="aligned_lens"):
        engine.store_masks([100])
    with pytest.raises(ValueError, match="backend"):
        LookupEngine(layout, backend="cuda-magic")


@pytest.mark.parametrize("backend", ["auto", "numba", "torch", "reference"])
def test_meta_device_is_refused(backend):
    """A meta tensor holds no data: no backend can answer on it."""
    with pytest.raises(ValueError, match="device"):
        LookupEngine(_dsv4(), backend=backend, device="meta")


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_past_int64_name_argument_and_position(backend):
    engine = make_engine(_dsv4(), backend)
    index = key_index({(0, b"\x01" * 8)})
    batch = HashBatch.from_bytes([[b"\x01" * 8], []], 8, "cpu")
    for bad in (2**63, 2**64 + 5, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"num_tokens\[1\]"):
            engine.lookup(batch, [4, bad], index)
        with pytest.raises(ValueError, match=r"max_lengths\[0\]"):
            engine.find_longest_cache_hit(batch, [bad, 4], index)
    with pytest.raises(ValueError, match=r"num_tokens\[1\]"):
        engine.lookup(batch, np.array([4, 2**63], dtype=np.uint64), index)
    with pytest.raises(ValueError, match=r"aligned_lens\[0\]"):
        engine.store_masks([2**63])
    with pytest.raises(ValueError, match=r"num_tokens\[1\]"):
        engine.lookup(batch, [4, -1], index)
    # The largest int64 is a valid length (a full-attention scan stops at the
    # hashes).
    big = (2**63 - 1) // 256 * 256
    assert engine.lookup(batch, np.array([4, 0], dtype=np.uint64), index).tolist() == [
        0,
        0,
    ]
    assert (
        engine.find_longest_cache_hit(batch, [big, 0], index).hit_lengths.tolist()[1]
        == 0
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_and_scalars_where_sequences_belong(backend):
    engine = make_engine(_dsv4(), backend)
    index = key_index({(0, b"\x01" * 8)})
    batch = HashBatch.from_bytes([[b"\x01" * 8]], 8, "cpu")
    with pytest.raises(TypeError, match="num_tokens"):
        engine.lookup(batch, None, index)
    with pytest.raises(TypeError, match="max_lengths"):
        engine.find_longest_cache_hit(batch, None, index)
    with pytest.raises(TypeError, match="token_lens"):
        engine.load_masks(batch, None)
    with pytest.raises(TypeError, match="aligned_lens"):
        engine.store_masks(None)
    with pytest.raises(TypeError, match="aligned_lens"):
        engine.store_masks(4)
    with pytest.raises(TypeError, match="aligned_lens"):
        engine.lookup_masks(256)
    with pytest.raises(TypeError, match="start_tokens"):
        engine.store_masks([256], start_tokens=3)
    with pytest.raises(TypeError, match=r"num_tokens\[0\]"):
        engine.lookup(batch, [True], index)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookup_unchecked_runs_the_engines_backend(backend, monkeypatch):
    """lookup_unchecked answers on the engine's own backend (it once ran the
    torch scanner for backend="reference")."""
    layout = _dsv4()
    engine = make_engine(layout, backend)
    hashes = chained_hashes(30, 200)
    exists = saved_keys(layout, hashes, 800)
    batch = HashBatch.from_bytes([hashes], 8, "cpu")
    index = key_index(exists)
    calls = []
    real = engine.impl.lookup

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(engine.impl, "lookup", spy)
    got = engine.lookup_unchecked(batch, torch.tensor([800]), index).tolist()
    assert calls and got == [ReferenceCoordinator(layout).lookup(800, hashes, exists)]


def test_auto_picks_numba_on_the_cpu():
    engine = LookupEngine(_dsv4())
    assert engine.backend == "numba" and engine.impl.name == "numba"
    assert LookupEngine(_dsv4(), backend="auto", device="cpu:0").backend == "numba"


def test_devices_compare_as_tensors_report_them():
    """An engine made with "cpu:0" (or "cuda") serves tensors made on that
    device, which report "cpu" (or "cuda:0")."""
    layout = CacheLayout([Group(FullAttention(16))], 16, 16)
    engine = LookupEngine(layout, device="cpu:0")
    hashes = chained_hashes(5, 2)
    index = KeyIndex(8, capacity=16, device="cpu:0")
    index.add(0, hashes)
    batch = HashBatch.from_bytes([hashes], 8, "cpu:0")
    assert engine.find_longest_cache_hit(batch, [32], index).hit_lengths.tolist() == [
        32
    ]
    with pytest.raises(TypeError, match="index"):
        engine.find_longest_cache_hit(batch, [32], None)
    with pytest.raises(ValueError, match="device"):
        LookupEngine(layout, device="no-such-device")


@pytest.mark.parametrize("n_requests", [1, 3])
def test_host_hits_are_one_answer_in_every_form_and_never_aliased(n_requests):
    # The numba backend hands the engine host hits (an int for one request,
    # numpy for more): hit_lengths is made on first read, hit_list() and
    # hit_array() read the same hits, and no later call overwrites an answer.
    import copy
    import pickle

    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=16))],
        scheduler_block_size=16,
        hash_block_size=16,
    )
    engine = LookupEngine(layout, backend="numba")
    reqs = [list(range(10 * b + 1, 10 * b + 9)) for b in range(n_requests)]
    index = KeyIndex(8)
    index.add(0, HashBatch.from_ints([r[:4] for r in reqs]).hashes)
    lens = [8 * 16] * n_requests
    first = engine.find_longest_cache_hit(HashBatch.from_ints(reqs), lens, index)
    assert "hit_lengths" not in first.__dict__  # not made yet
    want = [4 * 16] * n_requests
    assert first.hit_list() == want
    arr = first.hit_array()
    assert arr.dtype == np.int64 and arr.tolist() == want
    arr[:] = -1  # a copy: the result is unchanged
    assert first.hit_list() == want
    for other in (
        copy.copy(first),
        copy.deepcopy(first),
        pickle.loads(pickle.dumps(first)),
    ):
        assert other.hit_list() == want and other.hit_lengths.tolist() == want
    hits = first.hit_lengths
    assert hits.dtype == torch.int64 and hits.tolist() == want
    assert first.hit_lengths is hits  # made once
    # A later call answers in its own memory.
    index.add(0, HashBatch.from_ints([r[4:] for r in reqs]).hashes)
    second = engine.find_longest_cache_hit(HashBatch.from_ints(reqs), lens, index)
    assert second.hit_list() == [8 * 16] * n_requests
    assert hits.tolist() == want and first.hit_list() == want
    # Once made, hit_lengths is what every form reads (a caller may edit it).
    hits[0] = 7
    assert first.hit_list()[0] == 7 and first.hit_array()[0] == 7
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        first.nope  # noqa: B018
    # Results built from tensors (every other backend) answer alike.
    torch_res = make_engine(layout, "torch").find_longest_cache_hit(
        HashBatch.from_ints(reqs), lens, index
    )
    assert torch_res.hit_list() == [8 * 16] * n_requests
    assert torch_res.hit_array().tolist() == [8 * 16] * n_requests


@pytest.mark.parametrize("n_requests", [1, 3, 40])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_hit_list_in_blocks_is_each_hit_divided(n_requests, backend):
    # hit_list(block_size): one request's int, a few hits divided one by
    # one, many in numpy, a tensor: each hit // block_size, rounding down
    # (a hit of 40 tokens is 2 blocks of 16, 0 of 64).
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=8))],
        scheduler_block_size=8,
        hash_block_size=8,
    )
    engine = make_engine(layout, backend)
    reqs = [list(range(10 * b + 2, 10 * b + 9)) for b in range(n_requests)]
    index = KeyIndex(8)
    index.add(
        0, HashBatch.from_ints([r[: 1 + b % 6] for b, r in enumerate(reqs)]).hashes
    )
    res = engine.find_longest_cache_hit(
        HashBatch.from_ints(reqs), [56] * n_requests, index, apply_eagle=False
    )
    tokens = res.hit_list()
    assert tokens == [8 * (1 + b % 6) for b in range(n_requests)]
    for bs in (1, 8, 16, 3, 64, 2**62):
        assert res.hit_list(bs) == [h // bs for h in tokens], bs
        assert res.hit_list(block_size=bs) == res.hit_list(bs)
    # Past int64 a tensor's or numpy's division would wrap or overflow.
    assert res.hit_list(2**63 - 1) == [0] * n_requests
    for bad, error in ((0, ValueError), (-8, ValueError), (True, TypeError),
                       (8.0, TypeError), ("8", TypeError), (None, TypeError),
                       (2**63, ValueError), (2**64, ValueError)):  # fmt: skip
        with pytest.raises(error, match="block_size"):
            res.hit_list(bad)
        assert res.hit_list() == tokens  # a bad call changed nothing
    assert res.hit_list(np.int64(16)) == [h // 16 for h in tokens]


@pytest.mark.parametrize("n_requests", [1, 2])
def test_a_trusted_batch_of_strided_tensors_reads_its_values(n_requests):
    # The numba backend's compiled entries read host_arrays() with no type
    # test: a from_trusted batch of a strided hashes tensor (outside its
    # contract, but no caller should get wrong answers from a view) is read
    # through a C-contiguous copy.
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=16))],
        scheduler_block_size=16,
        hash_block_size=16,
    )
    engine = LookupEngine(layout, backend="numba")
    reqs = [list(range(100, 110)), list(range(200, 205))][:n_requests]
    plain = HashBatch.from_ints(reqs)
    index = KeyIndex(8)
    index.add(0, plain.hashes)
    wide = torch.full((plain.hashes.shape[0], 2), -7, dtype=torch.int64)
    wide[:, 0] = plain.hashes[:, 0]
    strided = HashBatch.from_trusted(wide[:, :1], plain.offsets, 8)
    assert not strided.hashes.is_contiguous()
    lens = [1000] * n_requests
    want = engine.find_longest_cache_hit(plain, lens, index).hit_list()
    assert want == [160, 80][:n_requests]
    assert engine.find_longest_cache_hit(strided, lens, index).hit_list() == want
    assert engine.lookup(strided, lens, index).tolist() == want


# -- a step of one request: from_ints' batch answered by the backend's runner


# Every form a caller may hold lengths in, made from a list of ints.
_LENGTH_FORMS = (
    list,
    tuple,
    lambda v: np.array(v, np.int64),
    lambda v: np.array(v, np.int32),
    lambda v: np.array(v, np.uint32),
    lambda v: np.array(v, np.uint64),
    lambda v: torch.tensor(v, dtype=torch.int64),
)
_RUNNER_LAYOUTS = [
    full_mamba_eagle_layout,
    merged_swa_eagle_layout,
    lambda: make_layout("gemma3"),
]


def _runner_steps_equal_the_general_path(layout_fn, data, requests) -> None:
    """The same requests (drawn from ``requests``) as from_ints' batch (a
    runner's path: one list the one-request runner, more the batch runner)
    and as from_bytes (the general path), lengths in every form, EAGLE on
    and off, the index growing in between: the same hits, and the same
    tokens to load, every time."""
    layout = layout_fn()
    bs = layout.hash_block_size
    engine = LookupEngine(layout, backend="numba")
    index = KeyIndex(8, capacity=4)  # grows (a new table) as keys come
    stored = data.draw(st.lists(st.integers(0, 40), min_size=0, max_size=30))
    for step in range(3):
        reqs = data.draw(requests)
        lens = [data.draw(st.integers(0, bs * (len(r) + 2))) for r in reqs]
        eagle = data.draw(st.booleans())
        fast = HashBatch.from_ints(reqs)
        if len(reqs) == 1:
            assert fast.one_values is not None
        else:
            assert "_host" in fast.__dict__
        slow = HashBatch.from_bytes(
            [[v.to_bytes(8, "little", signed=True) for v in r] for r in reqs], 8
        )
        want = engine.find_longest_cache_hit(slow, lens, index, eagle).hit_list()
        load = engine.lookup(slow, lens, index).tolist()
        for form in _LENGTH_FORMS:
            got = engine.find_longest_cache_hit(fast, form(lens), index, eagle)
            assert got.hit_list() == want
            assert got.hit_lengths.tolist() == want
            # The worker's lookup through the same runner, its own mode.
            loaded = engine.lookup(fast, form(lens), index)
            assert loaded.dtype == torch.int64 and loaded.tolist() == load
        if len(reqs) != 1:
            # The general path's batch, its host arrays now held: the batch
            # runner too.
            assert "_host" in slow.__dict__ or len(reqs) < 2
            hits = engine.find_longest_cache_hit(slow, lens, index, eagle)
            assert hits.hit_list() == want
        masks = engine.find_longest_cache_hit(fast, lens, index, eagle, True)
        assert masks.hit_list() == want and masks.masks is not None
        for g in range(layout.num_groups):
            index.add(g, HashBatch.from_ints([stored[: 10 * (step + 1)]]))


@pytest.mark.parametrize("layout_fn", _RUNNER_LAYOUTS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_one_request_steps_equal_the_general_path(layout_fn, data) -> None:
    ids = st.lists(st.integers(0, 40), min_size=0, max_size=40)
    _runner_steps_equal_the_general_path(layout_fn, data, st.tuples(ids).map(list))


def _refusal_engine_and_index() -> tuple[LookupEngine, KeyIndex]:
    """The runner refusal tests' engine (a full + Mamba EAGLE layout, numba)
    and an index holding keys 1, 2, 3 in both groups."""
    engine = LookupEngine(full_mamba_eagle_layout(), backend="numba")
    index = KeyIndex(8, capacity=64)
    index.add(0, HashBatch.from_ints([[1, 2, 3]]))
    index.add(1, HashBatch.from_ints([[1, 2, 3]]))
    return engine, index


def test_one_request_step_refuses_what_the_general_path_refuses() -> None:
    engine, index = _refusal_engine_and_index()
    one = HashBatch.from_ints([[1, 2, 3, 4]])
    assert engine.find_longest_cache_hit(one, [64], index).hit_list() == [32]
    for bad, exc in [
        ([-1], ValueError),
        ([1 << 63], ValueError),
        ([True], TypeError),
        ([1.0], TypeError),
        ([1, 2], ValueError),
        ([], ValueError),
        (np.array([-1]), ValueError),
        (np.array([1.0]), TypeError),
        (torch.tensor([-1]), ValueError),
        (torch.tensor([1.0]), TypeError),
        (torch.tensor(64), ValueError),
        (torch.tensor([[64]]), ValueError),
        (torch.tensor([64]).to_sparse(), (TypeError, ValueError)),
        (None, TypeError),
    ]:
        with pytest.raises(exc, match="max_lengths"):
            engine.find_longest_cache_hit(one, bad, index)
        with pytest.raises(exc, match="num_tokens"):
            engine.lookup(one, bad, index)
    # Another index, a KeyIndex of another width, a non-index: checked.
    wide = KeyIndex(16, capacity=16)
    with pytest.raises(ValueError, match="hash width"):
        engine.find_longest_cache_hit(one, [64], wide)
    with pytest.raises(TypeError, match="index"):
        engine.find_longest_cache_hit(one, [64], {1, 2})
    other = KeyIndex(8, capacity=16)
    assert engine.find_longest_cache_hit(one, [64], other).hit_list() == [0]
    assert engine.find_longest_cache_hit(one, [64], index).hit_list() == [32]


# -- a step of several requests: a batch holding its host arrays, answered by
# the backend's batch runner


@pytest.mark.parametrize("layout_fn", _RUNNER_LAYOUTS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_batch_steps_equal_the_general_path(layout_fn, data) -> None:
    requests = st.lists(
        st.lists(st.integers(0, 40), max_size=30), min_size=0, max_size=6
    )
    _runner_steps_equal_the_general_path(layout_fn, data, requests)


def test_batch_step_refuses_what_the_general_path_refuses() -> None:
    engine, index = _refusal_engine_and_index()
    two = HashBatch.from_ints([[1, 2, 3, 4], [1, 2]])
    assert "_host" in two.__dict__
    assert engine.find_longest_cache_hit(two, [64, 64], index).hit_list() == [32, 16]
    for bad, exc in [
        ([64, -1], ValueError),
        ([64, 1 << 63], ValueError),
        ([64, True], TypeError),
        ([1.0, 64], TypeError),
        ([64], ValueError),
        ([64, 64, 64], ValueError),
        (np.array([64, -1]), ValueError),
        (np.array([1.0, 2.0]), TypeError),
        (torch.tensor([64, -1]), ValueError),
        (torch.tensor([[64, 64]]), ValueError),
        (None, TypeError),
        (64, TypeError),
    ]:
        with pytest.raises(exc, match="max_lengths"):
            engine.find_longest_cache_hit(two, bad, index)
        with pytest.raises(exc, match="num_tokens"):
            engine.lookup(two, bad, index)
    # A batch of another width against this index, another index, a
    # non-index: each checked by the general path.
    wide = HashBatch.from_ints([[1, 2], [3]], 16)
    wide.host_arrays()
    with pytest.raises(ValueError, match="hash width"):
        engine.find_longest_cache_hit(wide, [64, 64], index)
    with pytest.raises(TypeError, match="index"):
        engine.find_longest_cache_hit(two, [64, 64], {1, 2})
    other = KeyIndex(8, capacity=16)
    assert engine.find_longest_cache_hit(two, [64, 64], other).hit_list() == [0, 0]
    assert engine.find_longest_cache_hit(two, [64, 64], index).hit_list() == [32, 16]
