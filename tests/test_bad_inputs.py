"""The input-validation contract (CONTRIBUTING.md), held case by case.

Every public entry point validates all of its input before it changes
anything; a bad input raises TypeError/ValueError (or StoreError,
MalformedPayload) whose message names the argument (and the position); the
object is then exactly as before. Each case below names the call, the error
type, a pattern the message must match, and the object whose state is
compared before and after.

Cases marked ``xfail(strict=True, reason="fixed by <area> branch")`` fail on
this branch because another branch owns the fix (issue 12); remove the mark
when that branch is merged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers import block_stored

from kvhit import (
    CacheLayout,
    ChunkedLocal,
    FleetIndex,
    FullAttention,
    Group,
    HashBatch,
    KeyIndex,
    LookupEngine,
    Mamba,
    SlidingWindow,
)
from kvhit.coordinator.fleet_index import state_checksum
from kvhit.coordinator.packing import pack_hashes

H16 = [bytes([i]) * 16 for i in range(8)]
NO_CUDA = not torch.cuda.is_available()


def _layout(**kw: Any) -> CacheLayout:
    args: dict[str, Any] = {
        "groups": [Group(FullAttention(block_size=16)), Group(Mamba(block_size=16))],
        "scheduler_block_size": 16,
        "hash_block_size": 16,
        "use_eagle": True,
    }
    args.update(kw)
    return CacheLayout(**args)


def _index() -> KeyIndex:
    index = KeyIndex(hash_bytes=16, capacity=64)
    index.add([0, 0, 1], H16[:3])
    return index


def _batch() -> HashBatch:
    return HashBatch.from_bytes([H16[:3], H16[3:4]], 16)


# --- state snapshots: what "the object is exactly as before" compares


def _snap(obj: Any) -> Any:
    if obj is None or isinstance(obj, int | str | bytes | float):
        return obj
    if isinstance(obj, torch.Tensor):
        return (
            str(obj.device),
            obj.dtype,
            tuple(obj.shape),
            obj.cpu().numpy().tobytes(),
        )
    if isinstance(obj, KeyIndex):
        return ("KeyIndex", len(obj), obj.capacity, obj.tombstones, _snap(obj.table))
    if isinstance(obj, FleetIndex):
        return ("FleetIndex", state_checksum(obj.state_dict()), obj.version)
    if isinstance(obj, HashBatch):
        return ("HashBatch", obj.hash_bytes, _snap(obj.hashes), _snap(obj.offsets))
    if isinstance(obj, CacheLayout):
        return ("CacheLayout", hash(obj), repr(obj), obj.spec_groups)
    if isinstance(obj, tuple | list):
        return tuple(_snap(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _snap(v) for k, v in obj.items()}
    if hasattr(obj, "counters"):  # EventFollower
        return ("follower", _snap(obj.counters()), _snap(obj.index))
    if hasattr(obj, "index") and isinstance(obj.index, KeyIndex):  # store bindings
        return (type(obj).__name__, _snap(obj.index))
    if isinstance(obj, LookupEngine):
        return ("LookupEngine", obj.backend, str(obj.device), hash(obj.layout))
    return repr(obj)


@dataclass
class Case:
    """``call(state)`` must raise ``exc`` matching ``match``; ``state()``
    builds what it acts on (compared before and after)."""

    name: str
    call: Callable[[Any], Any]
    exc: type[BaseException] | tuple[type[BaseException], ...]
    match: str
    state: Callable[[], Any] = lambda: None
    owner: str | None = None  # the branch that fixes it, while it fails here
    skip: str | None = None


def _params(cases: list[Case]) -> list[Any]:
    out = []
    for c in cases:
        marks = []
        if c.owner is not None:
            marks.append(
                pytest.mark.xfail(strict=True, reason=f"fixed by {c.owner} branch")
            )
        if c.skip is not None:
            marks.append(pytest.mark.skip(reason=c.skip))
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


def _run(case: Case) -> None:
    state = case.state()
    before = _snap(state)
    with pytest.raises(case.exc, match=case.match):
        case.call(state)
    assert _snap(state) == before, "a bad input changed the object"


# --- KeyIndex


def _flipped_state() -> dict[str, Any]:
    state = _index().state_dict()
    table = state["table"].clone()
    live = int((table[:, 0] >= 0).nonzero()[0, 0])
    table[live, 1] ^= 1  # a key that was never stored becomes "present"
    return {**state, "table": table}


KEY_INDEX = [
    Case(
        "KeyIndex-hash_bytes-0",
        lambda _: KeyIndex(hash_bytes=0),
        ValueError,
        "hash_bytes",
    ),
    Case(
        "KeyIndex-hash_bytes-str",
        lambda _: KeyIndex(hash_bytes="32"),
        TypeError,
        "hash_bytes",
    ),
    Case(
        "KeyIndex-capacity-0",
        lambda _: KeyIndex(16, capacity=0),
        ValueError,
        "capacity",
    ),
    Case(
        "KeyIndex-capacity-float",
        lambda _: KeyIndex(16, capacity=1.5),
        TypeError,
        "capacity",
    ),
    Case(
        "KeyIndex-max_load-1",
        lambda _: KeyIndex(16, max_load=1.0),
        ValueError,
        "max_load",
    ),
    Case(
        "KeyIndex-max_load-tiny",  # tried to allocate 43 GB on the first add
        lambda _: KeyIndex(16, max_load=1e-9),
        ValueError,
        "max_load",
    ),
    Case(
        "KeyIndex-backend",
        lambda _: KeyIndex(16, backend="fast"),
        ValueError,
        "backend",
    ),
    Case(
        "KeyIndex-device-meta",
        lambda _: KeyIndex(16, device="meta"),
        ValueError,
        "device",
    ),
    Case(
        "KeyIndex-device-cuda-absent",  # was an AssertionError
        lambda _: KeyIndex(16, device="cuda"),
        ValueError,
        "device",
        skip=None if NO_CUDA else "CUDA is present",
    ),
    Case(
        "add-group-negative",
        lambda i: i.add(-1, [H16[5]]),
        ValueError,
        "group_ids",
        _index,
    ),
    Case(
        "add-group-2**63",
        lambda i: i.add(2**63, [H16[5]]),
        ValueError,
        "group_ids",
        _index,
    ),
    Case(
        "add-group-list-2**63",
        lambda i: i.add([0, 2**63], H16[5:7]),
        ValueError,
        "group_ids",
        _index,
    ),
    Case(
        "add-group-bool",
        lambda i: i.add(True, [H16[5]]),
        TypeError,
        "group_ids",
        _index,
    ),
    Case(
        "add-group-None",
        lambda i: i.add(None, [H16[5]]),
        TypeError,
        "group_ids",
        _index,
    ),
    Case(
        "add-group-count",
        lambda i: i.add([0, 1], [H16[5]]),
        ValueError,
        "group_ids",
        _index,
    ),
    Case(
        "add-hash-width",
        lambda i: i.add(0, [H16[5], b"x" * 15]),
        ValueError,
        "position 1",
        _index,
    ),
    Case("add-hashes-None", lambda i: i.add(0, None), TypeError, "hashes", _index),
    Case(
        "add-hashes-numpy-words-shape",  # [N, W] words may be accepted; W=3 not
        lambda i: i.add(0, np.zeros((2, 3), np.int64)),
        (TypeError, ValueError),
        "hashes",
        _index,
    ),
    Case(
        "add-hash-numpy-item",
        lambda i: i.add(0, [np.zeros(2, np.int64)]),
        TypeError,
        "position 0",
        _index,
    ),
    Case(
        "add-hashes-int32",
        lambda i: i.add(0, torch.zeros(1, 2, dtype=torch.int32)),
        TypeError,
        "hashes",
        _index,
    ),
    Case(
        "add-hashes-shape",
        lambda i: i.add(0, torch.zeros(1, 3, dtype=torch.int64)),
        ValueError,
        "hashes",
        _index,
    ),
    Case(
        "add-hashes-meta",
        lambda i: i.add(0, torch.zeros(1, 2, dtype=torch.int64, device="meta")),
        ValueError,
        "hashes",
        _index,
    ),
    Case(
        "add-HashBatch-width",
        lambda i: i.add(0, HashBatch.from_bytes([[b"a" * 8]], 8)),
        ValueError,
        "hash_bytes",
        _index,
    ),
    Case(
        "remove-hash-width",
        lambda i: i.remove(0, [b"x"]),
        ValueError,
        "position 0",
        _index,
    ),
    Case(
        "contains-group-str",
        lambda i: i.contains("0", [H16[0]]),
        TypeError,
        "group_ids",
        _index,
    ),
    Case(
        "from_state_dict-missing",
        lambda _: KeyIndex.from_state_dict({"version": 1}),
        ValueError,
        "state",
    ),
    Case(
        "from_state_dict-flipped-bit",  # a key that was never stored
        lambda s: KeyIndex.from_state_dict(s),
        ValueError,
        "state",
        _flipped_state,
    ),
    Case(
        "from_state_dict-meta-table",
        lambda s: KeyIndex.from_state_dict({**s, "table": s["table"].to("meta")}),
        ValueError,
        "table",
        lambda: _index().state_dict(),
    ),
]

# --- HashBatch / packing

HASH_BATCH = [
    Case(
        "from_bytes-None",
        lambda _: HashBatch.from_bytes(None, 16),
        TypeError,
        "requests",
    ),
    Case(
        "from_bytes-request-None",
        lambda _: HashBatch.from_bytes([H16[:1], None], 16),
        TypeError,
        r"requests\[1\]",
    ),
    Case(
        "from_bytes-numpy-words",  # was "cannot reshape array of size 32"
        lambda _: HashBatch.from_bytes([[np.arange(4, dtype=np.int64)]], 4),
        TypeError,
        "request 0, position 0",
    ),
    Case(
        "from_bytes-width",
        lambda _: HashBatch.from_bytes([H16[:2], [H16[0], b"y" * 15]], 16),
        ValueError,
        "request 1, position 1",
    ),
    Case(
        "from_bytes-str-item",
        lambda _: HashBatch.from_bytes([["s" * 16]], 16),
        TypeError,
        "request 0, position 0",
    ),
    Case(
        "from_bytes-hash_bytes",
        lambda _: HashBatch.from_bytes([], 0),
        ValueError,
        "hash_bytes",
    ),
    Case(
        "from_bytes-device-meta",
        lambda _: HashBatch.from_bytes([H16[:1]], 16, device="meta"),
        ValueError,
        "device",
    ),
    Case(
        "from_bytes-device-cuda-absent",
        lambda _: HashBatch.from_bytes([H16[:1]], 16, device="cuda"),
        ValueError,
        "device",
        skip=None if NO_CUDA else "CUDA is present",
    ),
    Case(
        "HashBatch-meta",
        lambda _: HashBatch(
            torch.zeros(1, 2, dtype=torch.int64, device="meta"),
            torch.tensor([0, 1], device="meta"),
            16,
        ),
        ValueError,
        "hashes",
    ),
    Case(
        "HashBatch-offsets",
        lambda _: HashBatch(pack_hashes(H16[:2], 16), torch.tensor([0, 2, 1, 2]), 16),
        ValueError,
        "offsets",
    ),
    Case(
        "HashBatch-int32",
        lambda _: HashBatch(
            torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1]), 16
        ),
        TypeError,
        "hashes",
    ),
    Case("pack_hashes-None", lambda _: pack_hashes(None, 16), TypeError, "hashes"),
    Case("HashBatch.to-meta", lambda b: b.to("meta"), ValueError, "device", _batch),
    Case(
        "HashBatch.request-str",
        lambda b: b.request("0"),
        TypeError,
        "request index",
        _batch,
    ),
]

# --- LookupEngine


def _engine_state() -> tuple[LookupEngine, HashBatch, KeyIndex]:
    return LookupEngine(_layout(), backend="torch"), _batch(), _index()


def _lists_state() -> tuple[LookupEngine, None, KeyIndex]:
    """A numba engine holding the lists runner of an 8-byte index."""
    engine = LookupEngine(_layout(), backend="numba")
    index = KeyIndex(hash_bytes=8, capacity=64)
    index.add([0, 1], HashBatch.from_ints([[1, 1]]))
    want = engine.find_longest_cache_hit(HashBatch.from_ints([[1, 2]]), [32], index)
    assert engine.find_hit_list([[1, 2]], [32], index) == want.hit_list()
    assert engine.impl.lists_runner(index) is not None
    return engine, None, index


def _fleet_state(backend: str) -> tuple[LookupEngine, None, FleetIndex]:
    """An engine and an 8-byte fleet of two engines (numba: primed, the
    lists kernel answering; torch: the general path)."""
    layout = CacheLayout([Group(FullAttention(16))], 16, 16)
    engine = LookupEngine(layout, backend=backend)
    fleet = FleetIndex(2, 8, capacity=64, backend=backend)
    fleet.add(1, [0, 1], [(1).to_bytes(8, "little")] * 2)
    assert engine.fleet_hit_array([[1, 2]], [32], fleet).tolist() == [[0, 16]]
    if backend == "numba":
        assert fleet.router_lists(engine, [[1, 2]], [32], True, 1) is not None
    return engine, None, fleet


# Refusals of a router's one-call step (find_hit_list, fleet_hit_array):
# (name, requests, lengths, arguments after the index, error, match).
_STEP_REFUSALS = (
    ("bool", [[1, True]], [16], (), TypeError, r"request 0, position 1"),
    ("past-int64", [[1 << 63]], [16], (), ValueError, r"request 0, position 0"),
    ("past-uint64", [[1 << 64]], [16], (), ValueError, r"request 0, position 0"),
    ("set", [[1], {1, 2}], [16, 16], (), TypeError, r"requests\[1\]"),
    ("negative-length", [[1]], [-1], (), ValueError, r"max_lengths\[0\]"),
    ("lengths-count", [[1]], [16, 16], (), ValueError, "max_lengths"),
    ("bool-length", [[1]], [True], (), TypeError, r"max_lengths\[0\]"),
    ("block_size", [[1]], [16], (True, 0), ValueError, "block_size"),
)


def _step_call(method: str, reqs: Any, lens: Any, extra: tuple) -> Callable[[Any], Any]:
    """``state[0].<method>(reqs, lens, state[2], *extra)``."""
    return lambda s: getattr(s[0], method)(reqs, lens, s[2], *extra)


ENGINE = [
    Case("LookupEngine-layout", lambda _: LookupEngine("layout"), TypeError, "layout"),
    Case(
        "LookupEngine-backend",
        lambda _: LookupEngine(_layout(), backend="gpu"),
        ValueError,
        "backend",
    ),
    Case(
        "LookupEngine-device-meta",
        lambda _: LookupEngine(_layout(), device="meta"),
        ValueError,
        "device",
    ),
    Case(
        "LookupEngine-cpu_threads",
        lambda _: LookupEngine(_layout(), cpu_threads=0),
        ValueError,
        "cpu_threads",
    ),
    Case(
        "lookup-num_tokens-2**63",  # was "Overflow when unpacking long long"
        lambda s: s[0].lookup(s[1], [2**63, 16], s[2]),
        ValueError,
        "num_tokens",
        _engine_state,
    ),
    Case(
        "lookup-num_tokens-None",
        lambda s: s[0].lookup(s[1], None, s[2]),
        TypeError,
        "num_tokens",
        _engine_state,
    ),
    Case(
        "lookup-num_tokens-count",
        lambda s: s[0].lookup(s[1], [16], s[2]),
        ValueError,
        "num_tokens",
        _engine_state,
    ),
    Case(
        "lookup-num_tokens-negative",
        lambda s: s[0].lookup(s[1], [16, -1], s[2]),
        ValueError,
        "num_tokens",
        _engine_state,
    ),
    Case(
        "lookup-batch",
        lambda s: s[0].lookup("batch", [16], s[2]),
        TypeError,
        "batch",
        _engine_state,
    ),
    Case(
        "lookup-index",
        lambda s: s[0].lookup(s[1], [16, 16], None),
        TypeError,
        "index",
        _engine_state,
    ),
    Case(
        "lookup-width",
        lambda s: s[0].lookup(HashBatch.from_bytes([[b"a" * 8]], 8), [16], s[2]),
        ValueError,
        "hash width",
        _engine_state,
    ),
    Case(
        "store_masks-int",  # was "object of type 'int' has no len()"
        lambda s: s[0].store_masks(4),
        TypeError,
        "aligned_lens",
        _engine_state,
    ),
    Case(
        "find_longest_cache_hit-max_lengths-float",
        lambda s: s[0].find_longest_cache_hit(s[1], [1.5, 16], s[2]),
        TypeError,
        "max_lengths",
        _engine_state,
    ),
    # A router's one-call steps, each on its general path (find_hit_list: a
    # 16-byte index, the torch backend; fleet_hit_array: a torch fleet) and
    # on numba's lists fast path (primed), which hands every refusal to the
    # general path.
    *[
        Case(
            f"{method}-{name}-{where}",
            _step_call(method, reqs, lens, extra),
            exc,
            match,
            state,
        )
        for method, states in (
            ("find_hit_list", (("general", _engine_state), ("lists", _lists_state))),
            (
                "fleet_hit_array",
                (
                    ("torch", lambda: _fleet_state("torch")),
                    ("numba", lambda: _fleet_state("numba")),
                ),
            ),
        )
        for where, state in states
        for name, reqs, lens, extra, exc, match in _STEP_REFUSALS
    ],
    *[
        Case(
            f"find_hit_list-index-{where}",
            lambda s: s[0].find_hit_list([[1, "x"]], [16], None),
            TypeError,
            "index",
            state,
        )
        for where, state in (("general", _engine_state), ("lists", _lists_state))
    ],
    *[
        Case(
            f"fleet_hit_array-fleet-{backend}",
            lambda s: s[0].fleet_hit_array([[1, "x"]], [16], KeyIndex(8)),
            TypeError,
            "fleet",
            lambda b=backend: _fleet_state(b),
        )
        for backend in ("torch", "numba")
    ],
]

# --- layouts


def _set_attr(layout: CacheLayout) -> None:
    layout.use_eagle = False


LAYOUT = [
    Case("CacheLayout-no-groups", lambda _: _layout(groups=[]), ValueError, "group"),
    Case(
        "CacheLayout-hash_block_size",
        lambda _: _layout(hash_block_size=0),
        ValueError,
        "hash_block_size",
    ),
    Case(
        "CacheLayout-scheduler_block_size",
        lambda _: _layout(scheduler_block_size=24),
        ValueError,
        "scheduler_block_size",
    ),
    Case(
        "CacheLayout-group-type",
        lambda _: _layout(groups=["x"]),
        TypeError,
        r"groups\[0\]",
    ),
    Case(
        "CacheLayout-retention_interval",
        lambda _: _layout(retention_interval=5),
        ValueError,
        "retention_interval",
    ),
    Case(
        "CacheLayout-sliding_window",
        lambda _: _layout(
            groups=[Group(SlidingWindow(block_size=16, sliding_window=0))]
        ),
        ValueError,
        "sliding_window",
    ),
    Case(
        "CacheLayout-block_size",
        lambda _: _layout(groups=[Group(FullAttention(block_size=-16))]),
        ValueError,
        "block_size",
    ),
    Case(
        "CacheLayout-chunked-eagle",
        lambda _: _layout(
            groups=[
                Group(ChunkedLocal(block_size=16, attention_chunk_size=64), eagle=True)
            ]
        ),
        ValueError,
        "chunked local",
    ),
    Case(
        "CacheLayout-setattr",  # was mutable, yet a cache key
        _set_attr,
        dataclasses.FrozenInstanceError,
        "use_eagle",
        _layout,
    ),
]

# --- KV-cache events


def _ev():
    return pytest.importorskip("kvhit.bindings.events", exc_type=ImportError)


def _removed(hashes: list[Any], gid: Any = 0) -> Any:
    return _ev().BlockRemoved(block_hashes=hashes, medium="cpu", group_idx=gid)


def _follower(**kw: Any) -> Any:
    pytest.importorskip("zmq", exc_type=ImportError)
    args = {"endpoint": "tcp://127.0.0.1:1", "replay_endpoint": None, "index": _index()}
    args.update(kw)
    return _ev().EventFollower(**args)


EVENTS = [
    Case(
        "apply-half-batch-2**63",  # removed the first keys, then OverflowError
        lambda i: _ev().apply(
            i, [_removed([H16[0]]), block_stored([H16[5]], gid=2**63)]
        ),
        ValueError,
        r"event 1 .*group_idx",
        _index,
    ),
    Case(
        "apply-event-medium",
        lambda i: _ev().apply(
            i, [_removed([H16[0]]), block_stored([H16[5]], medium=5)]
        ),
        TypeError,
        r"event 1 .*medium",
        _index,
    ),
    Case(
        "apply-hash-width",
        lambda i: _ev().apply(i, [_removed([H16[0]]), block_stored([H16[5], b"x"])]),
        ValueError,
        r"event 1 .*block_hashes\[1\]",
        _index,
    ),
    Case(
        "apply-int-hash-wide-index",
        lambda i: _ev().apply(i, [_removed([H16[0]]), block_stored([5])]),
        ValueError,
        r"block_hashes\[0\].*VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",
        _index,
    ),
    Case(
        "apply-medium-arg",
        lambda i: _ev().apply(i, [], medium=5),
        TypeError,
        "medium",
        _index,
    ),
    Case(
        "apply-events-None", lambda i: _ev().apply(i, None), TypeError, "events", _index
    ),
    Case(
        "apply-default_group_id",
        lambda i: _ev().apply(i, [_removed([H16[0]], gid=None)], default_group_id=-1),
        ValueError,
        "default_group_id",
        _index,
    ),
    Case(
        "decode_batch-junk",
        lambda _: _ev().decode_batch(b"junk"),
        ValueError,  # MalformedPayload
        "KVEventBatch",
    ),
    Case(
        "hash_to_bytes-str",
        lambda _: _ev().hash_to_bytes("x", 8),
        TypeError,
        "block hash",
    ),
    Case(
        "EventFollower-max_drain-0",
        lambda _: _follower(max_drain=0),
        ValueError,
        "max_drain",
    ),
    Case(
        "EventFollower-poll_ms--1",
        lambda _: _follower(poll_ms=-1),
        ValueError,
        "poll_ms",
    ),
    Case(
        "EventFollower-start_seq--1",
        lambda _: _follower(start_seq=-1),
        ValueError,
        "start_seq",
    ),
    Case(
        "EventFollower-default_group_id--1",
        lambda _: _follower(default_group_id=-1),
        ValueError,
        "default_group_id",
    ),
    Case("EventFollower-topic-5", lambda _: _follower(topic=5), TypeError, "topic"),
    Case("EventFollower-medium-5", lambda _: _follower(medium=5), TypeError, "medium"),
    Case(
        "EventFollower-rcvhwm--5", lambda _: _follower(rcvhwm=-5), ValueError, "rcvhwm"
    ),
    Case(
        "EventFollower.wait_for_seq-str",
        lambda f: f.wait_for_seq("1", 0.1),
        TypeError,
        "seq",
        _follower,
    ),
]

# --- Mooncake bindings


class _Store:
    """A store whose batch_is_exist answers ``answer(n)``."""

    def __init__(self, answer: Callable[[int], list[Any]]) -> None:
        self.answer = answer

    def batch_is_exist(self, keys: list[str]) -> list[Any]:
        return self.answer(len(keys))


def _sync(answer: Callable[[int], list[Any]]) -> Any:
    mc = pytest.importorskip("kvhit.bindings.store_sync", exc_type=ImportError)
    layout = _layout()
    keys = mc.MooncakeKeys("m", rank_namespaces=[[(0, 0, 0, 0)], [(0, 0, 0, 0)]])
    return mc.StoreSync(_Store(answer), keys, KeyIndex(16, capacity=64), layout)


def _refresh(sync: Any) -> Any:
    return sync.refresh(HashBatch.from_bytes([H16[:2]], 16), [32])


def _store_error() -> type[BaseException]:
    mc = pytest.importorskip("kvhit.bindings.store_sync", exc_type=ImportError)
    return mc.StoreError


def _mc() -> Any:
    return pytest.importorskip("kvhit.bindings.store_sync", exc_type=ImportError)


MOONCAKE = [
    Case(
        "MooncakeKeys-model_name",
        lambda _: _mc().MooncakeKeys(5, [[]]),
        TypeError,
        "model_name",
    ),
    Case(
        "MooncakeKeys-rank_namespaces",
        lambda _: _mc().MooncakeKeys("m", None),
        TypeError,
        "rank_namespaces",
    ),
    Case(
        "StoreSync-store",
        lambda s: _mc().StoreSync(object(), s.keys, s.index, s.layout),
        TypeError,
        "store",
        lambda: _sync(lambda n: [1] * n),
    ),
    Case(
        "refresh-answer-1.5",  # truncated to 1: the index gained a key
        _refresh,
        (ValueError, RuntimeError),  # StoreError is a RuntimeError
        "batch_is_exist|answer",
        lambda: _sync(lambda n: [1.5] * n),
    ),
    Case(
        "refresh-answer-0.9",
        _refresh,
        (ValueError, RuntimeError),
        "batch_is_exist|answer",
        lambda: _sync(lambda n: [0.9] * n),
    ),
    Case(
        "refresh-answer-count",
        _refresh,
        (ValueError, RuntimeError),
        "answer|keys",
        lambda: _sync(lambda n: [1] * (n + 1)),
    ),
    Case(
        "refresh-num_tokens-None",
        lambda s: s.refresh(HashBatch.from_bytes([H16[:2]], 16), None),
        TypeError,
        "num_tokens",
        lambda: _sync(lambda n: [1] * n),
    ),
    Case(
        "refresh-batch",
        lambda s: s.refresh("batch", [32]),
        TypeError,
        "batch",
        lambda: _sync(lambda n: [1] * n),
    ),
    Case(
        "StoreSync-timeout_s",
        lambda s: _mc().StoreSync(s.store, s.keys, s.index, s.layout, timeout_s=-1),
        ValueError,
        "timeout_s",
        lambda: _sync(lambda n: [1] * n),
    ),
]

# --- torch custom ops


def _ops() -> Any:
    return pytest.importorskip("kvhit.bindings.torch_ops", exc_type=ImportError)


TORCH_OPS = [
    Case(
        "probe-index", lambda _: _ops().probe("index", 0, H16[:1]), TypeError, "index"
    ),
    Case(
        "probe-group_ids",
        lambda i: _ops().probe(i, -1, H16[:1]),
        ValueError,
        "group_ids",
        _index,
    ),
    Case(
        "probe-hashes-meta",
        lambda i: _ops().probe(
            i, 0, torch.zeros(1, 2, dtype=torch.int64, device="meta")
        ),
        ValueError,
        "hashes",
        _index,
    ),
    Case(
        "lookup-op-num_tokens-list",
        lambda s: _ops().lookup(_layout(), s[1], [16, 16], s[2]),
        TypeError,
        "num_tokens",
        _engine_state,
    ),
    Case(
        "lookup-op-batch",
        lambda s: _ops().lookup(_layout(), "batch", torch.tensor([16]), s[2]),
        TypeError,
        "batch",
        _engine_state,
    ),
    Case(
        "lookup-op-num_tokens-int32",
        lambda s: _ops().lookup(
            _layout(), s[1], torch.tensor([16, 16], dtype=torch.int32), s[2]
        ),
        TypeError,
        "num_tokens",
        _engine_state,
    ),
]


def _state_dict(**changes: Any) -> dict[str, Any]:
    state = dict(_index().state_dict())
    state.update(changes)
    return state


def _bumped(field: str, by: int) -> dict[str, Any]:
    state = _index().state_dict()
    return _state_dict(**{field: state[field] + by})


def _flipped_table() -> dict[str, Any]:
    state = _index().state_dict()
    table = state["table"].clone()
    live = int((table[:, 0] >= 0).nonzero()[0])
    table[live, 1] ^= 1
    return _state_dict(table=table)


# Issue 22, item 4: the coordinator's leftovers of the bad-input contract.
LEFTOVERS = [
    Case(
        "from_state_dict-version-unknown",
        lambda _: KeyIndex.from_state_dict(_state_dict(version=3)),
        ValueError,
        "unknown version 3",
    ),
    Case(
        "from_state_dict-version-float",
        lambda _: KeyIndex.from_state_dict(_state_dict(version=2.0)),
        ValueError,
        "unknown version 2.0",
    ),
    Case(
        "from_state_dict-checksum-size",
        lambda _: KeyIndex.from_state_dict(_bumped("size", 1)),
        ValueError,
        r"checksum mismatch: state\['size'\] \(4; the table holds 3\)",
    ),
    Case(
        "from_state_dict-checksum-tombstones",
        lambda _: KeyIndex.from_state_dict(_bumped("tombstones", 2)),
        ValueError,
        r"checksum mismatch: state\['tombstones'\] \(2; the table holds 0\)",
    ),
    Case(
        "from_state_dict-checksum-table",
        lambda _: KeyIndex.from_state_dict(_flipped_table()),
        ValueError,
        r"checksum mismatch: state\['table'\] \(its bytes, shape or hash_bytes\)",
    ),
    Case(
        "from_state_dict-checksum-itself",
        lambda _: KeyIndex.from_state_dict(_state_dict(checksum="0" * 32)),
        ValueError,
        r"checksum mismatch: state\['table'\] .* or state\['checksum'\] was",
    ),
    Case(
        "CacheLayout-groups-None",
        lambda _: CacheLayout(groups=None, scheduler_block_size=16, hash_block_size=16),
        TypeError,
        "groups must be a sequence of Group, got NoneType",
    ),
    Case(
        "store_masks-aligned_lens-huge",
        lambda s: s[0].store_masks([16, 1 << 40]),
        ValueError,
        "aligned_lens: .* MAX_MASK_ENTRIES",
        _engine_state,
    ),
    Case(
        "lookup_masks-aligned_lens-huge",
        lambda s: s[0].lookup_masks([1 << 33] * 64),
        ValueError,
        "aligned_lens: .* MAX_MASK_ENTRIES",
        _engine_state,
    ),
    Case(
        "KeyIndex-device-cuda-absent",
        lambda _: KeyIndex(16, device="cuda"),
        ValueError,
        "device 'cuda' is not available here",
        skip=None if NO_CUDA else "CUDA is available",
    ),
]


@pytest.mark.parametrize(
    "case",
    _params(
        KEY_INDEX
        + HASH_BATCH
        + ENGINE
        + LAYOUT
        + EVENTS
        + MOONCAKE
        + TORCH_OPS
        + LEFTOVERS
    ),
)
def test_bad_input_is_refused_and_changes_nothing(case: Case) -> None:
    _run(case)


# --- the CLI: a bad argument is a usage error (exit 2) naming it, found
# before any work is done.


@dataclass
class CliCase:
    name: str
    argv: list[str]
    match: str
    owner: str | None = None


CLI = [
    CliCase("bench-backend", ["bench", "--backends", "nope"], "backend"),
    CliCase(
        "bench-batch-sizes-0",  # ended in a ZeroDivisionError traceback
        ["bench", "--presets", "llama", "--batch-sizes", "0", "--repeats", "1"],
        "batch-sizes",
    ),
    CliCase(
        "bench-json-unwritable",  # ran the whole sweep, then failed
        [
            "bench",
            "--presets",
            "llama",
            "--batch-sizes",
            "1",
            "--repeats",
            "1",
            "--json",
            "/nonexistent/x.json",
        ],
        "json",
    ),
    CliCase(
        "demo-requests-0",  # exited 0 with an empty report
        ["demo", "--requests", "0"],
        "requests",
    ),
    CliCase("demo-preset", ["demo", "--preset", "nope"], "preset"),
]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            c,
            id=c.name,
            marks=[pytest.mark.xfail(strict=True, reason=f"fixed by {c.owner} branch")]
            if c.owner
            else [],
        )
        for c in CLI
    ],
)
def test_cli_bad_argument_is_a_usage_error(
    case: CliCase, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvhit.cli import main

    try:
        code = main(case.argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}: {err[-500:]}"
    assert case.match in err and "Traceback" not in err


def test_mask_bound_admits_a_large_real_batch() -> None:
    """MAX_MASK_ENTRIES leaves room for real batches: 64 requests of 128K
    tokens at block size 16 (2**19 entries) give masks as before."""
    from kvhit.kernels.checks import MAX_MASK_ENTRIES

    engine = LookupEngine(_layout(), backend="torch")
    masks = engine.lookup_masks([1 << 17] * 64)
    assert masks.lengths[0].tolist() == [(1 << 17) // 16] * 64
    assert 64 * (1 << 17) // 16 <= MAX_MASK_ENTRIES


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")
def test_cuda_absent_is_the_same_error_for_index_and_engine() -> None:
    errors = []
    for build in (
        lambda: KeyIndex(16, device="cuda"),
        lambda: LookupEngine(_layout(), device="cuda"),
    ):
        with pytest.raises(ValueError) as info:
            build()
        errors.append(str(info.value))
    assert errors[0] == errors[1]
