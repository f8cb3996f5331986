"""Warm start: LookupEngine, KeyIndex and FleetIndex load their kernels at
construction unless built with ``warm=False``; every backend class has
``warm_up`` (the BatchBackend protocol)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from helpers import merged_swa_eagle_layout

from kvhit.coordinator.backend import BatchBackend
from kvhit.coordinator.engine import BACKEND_CLASSES, LookupEngine, backend_class
from kvhit.coordinator.fleet_index import FleetIndex
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import HashBatch
from kvhit.coordinator.plan import ScanPlan


@pytest.mark.parametrize("name", sorted(BACKEND_CLASSES))
def test_every_backend_class_has_warm_up(name):
    cls = backend_class(name)
    assert callable(getattr(cls, "warm_up", None))
    if name != "triton":
        impl = cls(ScanPlan.from_layout(merged_swa_eagle_layout()), torch.device("cpu"))
        assert isinstance(impl, BatchBackend)
        assert impl.warm_up() is None


@pytest.mark.parametrize("warm", [True, False])
def test_engine_warms_its_backend_unless_asked_not_to(warm):
    cls = backend_class("numba")
    with mock.patch.object(cls, "warm_up", autospec=True) as warm_up:
        engine = LookupEngine(merged_swa_eagle_layout(), backend="numba", warm=warm)
    assert warm_up.call_count == int(warm)
    assert engine.impl.plan is not None


@pytest.mark.parametrize(
    "build",
    [
        lambda w: LookupEngine(merged_swa_eagle_layout(), warm=w),
        lambda w: KeyIndex(32, warm=w),
        lambda w: FleetIndex(2, 32, warm=w),
    ],
)
@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_warm_must_be_a_bool(build, bad):
    with pytest.raises(TypeError, match="warm"):
        build(bad)


def test_a_warm_engine_answers_as_a_cold_one():
    layout = merged_swa_eagle_layout()
    batch = HashBatch.from_ints([list(range(1, 40)), list(range(7, 20)), []])
    index = KeyIndex(batch.hash_bytes, warm=False)
    index.add(0, batch.hashes[:30])
    index.add([1, 2] * 5, batch.hashes[:10])
    lens = [39 * 16, 13 * 16, 0]
    got = [
        LookupEngine(layout, warm=w).find_longest_cache_hit(batch, lens, index)
        for w in (True, False)
    ]
    assert torch.equal(got[0].hit_lengths, got[1].hit_lengths)


def _modules_after(code: str) -> set[str]:
    """The kvhit kernel modules a fresh process has imported after ``code``."""
    script = textwrap.dedent(code) + textwrap.dedent(
        """
        import sys
        print(",".join(m for m in sys.modules if m.startswith("kvhit.kernels")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return set(out.stdout.strip().split(","))


def test_cold_construction_defers_the_kernels():
    cold = _modules_after(
        """
        from kvhit.coordinator.key_index import KeyIndex
        KeyIndex(32, warm=False)
        """
    )
    assert "kvhit.kernels.hash_index_numba" not in cold
    assert "kvhit.kernels.msgpack_numba" not in cold
    warm = _modules_after(
        """
        import sys
        from kvhit.coordinator.int_lists import decoder_ready
        from kvhit.coordinator.key_index import KeyIndex
        from kvhit.kernels import hash_index_numba
        assert not decoder_ready() and "msgspec" not in sys.modules
        KeyIndex(32)
        # from_ints' decoder of a batch of lists loaded with the index's
        # kernels, its encoder's import too (5-8 ms on a first step).
        assert "msgspec" in sys.modules
        assert hash_index_numba._warm and decoder_ready()
        """
    )
    assert "kvhit.kernels.hash_index_numba" in warm


def test_a_warm_numba_engine_loads_the_decoder_of_lists():
    _modules_after(
        """
        import sys
        from kvhit.coordinator.engine import LookupEngine
        from kvhit.coordinator.int_lists import decoder_ready
        from kvhit import CacheLayout, FullAttention, Group
        assert not decoder_ready() and "msgspec" not in sys.modules
        LookupEngine(CacheLayout([Group(FullAttention(16))], 16, 16), backend="numba")
        assert "msgspec" in sys.modules and decoder_ready()
        """
    )


def test_warm_fleet_loads_its_store_and_router_kernels():
    modules = _modules_after(
        """
        import sys
        from kvhit.coordinator.fleet_index import FleetIndex
        from kvhit.kernels import fleet_numba, hash_index_numba
        assert "msgspec" not in sys.modules
        FleetIndex(3, 32)
        assert fleet_numba._warm and hash_index_numba._warm
        assert "msgspec" in sys.modules
        for f in (
            fleet_numba._add_entries,
            fleet_numba.full_hits_checked,
            fleet_numba.full_lists_hits,
        ):
            assert f.signatures, f
        """
    )
    assert "kvhit.kernels.fleet_numba" in modules


def test_the_lists_runner_loads_with_a_warm_engine_and_waits_in_a_cold_one():
    # A warm numba engine loads find_hit_list's program with its own; a
    # cold one loads it at its first find_hit_list, not at a first lookup.
    _modules_after(
        """
        import sys
        from kvhit import CacheLayout, FullAttention, Group, HashBatch, KeyIndex
        from kvhit.coordinator.engine import LookupEngine
        layout = CacheLayout([Group(FullAttention(16))], 16, 16)
        index = KeyIndex(8, warm=False)
        cold = LookupEngine(layout, backend="numba", warm=False)
        cold.lookup(HashBatch.from_ints([[1, 2]]), [32], index)
        assert "kvhit.kernels.scan_numba_lists" not in sys.modules
        assert cold.find_hit_list([[1, 2]], [32], index) == [0]
        from kvhit.kernels import scan_numba_lists
        assert scan_numba_lists.lists_hits.signatures
        """
    )
    warm = _modules_after(
        """
        from kvhit import CacheLayout, FullAttention, Group
        from kvhit.coordinator.engine import LookupEngine
        LookupEngine(CacheLayout([Group(FullAttention(16))], 16, 16), backend="numba")
        from kvhit.kernels import scan_numba_lists
        assert scan_numba_lists.lists_hits.signatures
        """
    )
    assert "kvhit.kernels.scan_numba_lists" in warm


def test_a_cold_fleet_loads_its_lists_kernel_at_its_first_lists_step():
    # Nothing warm in the process: the first fleet_hit_array loads the
    # fleet's kernels and the decoder, and the kernel answers from then on.
    _modules_after(
        """
        import sys
        from kvhit import CacheLayout, FullAttention, Group, FleetIndex
        from kvhit.coordinator.engine import LookupEngine
        layout = CacheLayout([Group(FullAttention(16))], 16, 16)
        engine = LookupEngine(layout, backend="numba", warm=False)
        fleet = FleetIndex(2, 8, warm=False)
        fleet.add(1, [0, 0], [(5).to_bytes(8, "little"), (6).to_bytes(8, "little")])
        assert "kvhit.kernels.msgpack_numba" not in sys.modules or not (
            sys.modules["kvhit.kernels.msgpack_numba"].loaded())
        assert engine.fleet_hit_array([[5, 6, 9]], [48], fleet, True, 16).tolist() == [[0, 2]]
        from kvhit.kernels import fleet_numba
        assert fleet_numba.full_lists_hits.signatures
        assert fleet.router_lists(engine, [[5, 6]], [48], True, 16).tolist() == [[0, 2]]
        """
    )
