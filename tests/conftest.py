"""Shared test set-up.

Triton kernels run under the numpy interpreter when no CUDA device is present;
the variable must be set before triton decorates any kernel, hence here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

    # The interpreter's per-helper re-patching skipped and the fleet's
    # bitwise reductions run in numpy (see the function).
    from kvhit.bench.gpu_common import speed_up_interpreter

    speed_up_interpreter()

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
# HYPOTHESIS_PROFILE=random: the CI settings with fresh random examples each
# run (for large parity runs with KVHIT_PARITY_EXAMPLES).
settings.register_profile("random", settings.get_profile("ci"), derandomize=False)
settings.register_profile("dev", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def compile_outside_interpreter(script: str) -> str:
    """Run ``script`` in a fresh Python without ``TRITON_INTERPRET``, so Triton
    really compiles (for sm_90, with its bundled ptxas; no GPU needed); fail
    on a non-zero exit and return its stdout. Skips where triton has no NVIDIA
    backend. Catches what the interpreter does not check (loop-carried type
    changes, memory-ordering lowering)."""
    from helpers import run_python

    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return run_python(script, env=env)


@pytest.fixture(scope="session")
def device() -> str:
    """The device the backend under test runs on: CUDA when present, else CPU."""
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A test module that imports numba (directly or through a kvhit module)
    is skipped, not an error, where numba does not import: the GPU machine's
    twin in CI (.ci/device-twin) has none, and the machine's may fail."""
    outcome = yield
    report = outcome.get_result()
    text = str(report.longrepr)
    if (
        report.failed
        and isinstance(collector, pytest.Module)
        and "ImportError" in text  # ModuleNotFoundError's message says it too
        and ("No module named 'numba'" in text or "numba/" in text)
    ):
        # Absent, or installed but failing to import (the GPU machine's numba
        # beside a numpy newer than it supports).
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, "Skipped: numba does not import")


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        # The marker, not item.keywords: keywords include path parts (a
        # checkout under a folder named "gpu" would skip every test).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# -- vLLM 0.33.0's real code (the oracle install) ------------------------------


@pytest.fixture(scope="module")
def vllm_env():
    """vLLM's modules importable for a test module (the oracle install,
    ``.ci/install-vllm-oracle``); the module's tests skip, with the reason,
    where it is absent."""
    from kvhit.bench import vllm_oracle as vo

    mods, reason = vo.load_vllm()
    if mods is None:
        pytest.skip(reason)
    with vo.vllm_importable() as m:
        yield m


@contextlib.contextmanager
def short_ipc_dir() -> Iterator[Path]:
    """A fresh directory for IPC sockets with a short path, removed after.

    A Unix socket's path holds at most 107 bytes, and vLLM's lookup socket
    name (``lookup_rpc_port_<port>_<host>_dp_rank0_kvhit``) takes ~45 of
    them: under a pytest-xdist worker (``.../popen-gw1/<test name>0/``) a
    test's tmp_path leaves too few."""
    # /tmp, not $TMPDIR: a long TMPDIR would bring the limit back.
    path = Path(
        tempfile.mkdtemp(prefix="kvhit-", dir="/tmp" if os.path.isdir("/tmp") else None)
    )
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sched_harness(vllm_env, monkeypatch):
    """``tests/vllm_sched_harness`` (vLLM's real Scheduler, stock or with
    kvhit's connector) with vLLM's IPC sockets in a directory of this test's
    own (:func:`short_ipc_dir`)."""
    with short_ipc_dir() as base:
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(base))
        import vllm_sched_harness

        yield vllm_sched_harness


# -- the parallel pass's work units (make test: --dist loadgroup) -------------

#: The work units make test's parallel pass hands out first, in this order
#: (longest first, so the last units to start are short): a test function
#: (node-id prefix ``file::name``) is split out of its file, every
#: parametrized case a unit of its own; a file is the rest of it, whole.
#: Costs measured on a cold numba cache (-n 2). With a file to a unit and
#: xdist's order (most tests first), the slowest files held one worker for
#: minutes after the other had finished (tests/test_fleet_hybrid.py, a few
#: tests of ~240 s in all, started last). The first unit (numba compiling the
#: scan kernels, which later numba units load from the on-disk cache) goes to
#: one worker and the Triton interpreter's slowest tests to the other, which
#: takes a new one-test unit whenever it has at most two left, so the two do
#: not compile the same kernels at once.
FIRST = (
    "tests/test_scan_numba.py",
    "tests/test_fleet_hybrid.py::test_engine_classes",
    "tests/test_scan_triton.py::test_random_parity",
    "tests/test_fleet_hybrid.py::test_engine_words_and_removed_engines",
    "tests/test_fleet_hybrid.py::test_random_parity_every_kind",
    "tests/test_fleet.py::test_fleet_parity_every_layout",
    # Then the slowest files whole, slowest first.
    "tests/test_fleet_triton.py",
    "tests/test_scan_triton.py",
    "tests/test_engine.py",
    "tests/test_gpu_model_fleet.py",
    "tests/test_fleet.py",
    "tests/test_gpu_parity.py",
    "tests/test_reference.py",
    "tests/test_cli.py",
    "tests/test_key_index.py",
    "tests/test_from_ints.py",
)


def work_unit(nodeid: str) -> tuple[int, str]:
    """An item's rank (its place in :data:`FIRST`, or past them) and work
    unit: its own node id for a split test, else its file."""
    for rank, prefix in enumerate(FIRST):
        if nodeid == prefix or nodeid.startswith((prefix + "[", prefix + "::")):
            return rank, nodeid if "::" in prefix else prefix
    return len(FIRST), nodeid.split("::", 1)[0]


def _order_for_workers(items: list[pytest.Item]) -> None:
    """Orders the items by work unit (:func:`work_unit`): :data:`FIRST`'s
    units first, in its order, then each file whole, files of more tests
    first (as xdist's --dist loadfile orders them). The workers' collection
    order is the order their units are handed out in (--no-loadscope-reorder)."""
    units: dict[str, list[pytest.Item]] = {}
    ranks: dict[str, int] = {}
    for item in items:
        rank, unit = work_unit(item.nodeid)
        units.setdefault(unit, []).append(item)
        ranks[unit] = min(rank, ranks.get(unit, rank))
    order = sorted(units, key=lambda u: (ranks[u], -len(units[u])))
    items[:] = [item for unit in order for item in units[unit]]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests(items)
    # make test's parallel pass (--dist loadgroup): its units' order; any
    # other run's order stays as it was. The workers collect (and their order
    # is the one scheduled): xdist sets their option.dist to "no" and
    # option.loadgroup to True, so that is what they are told by.
    if getattr(config.option, "loadgroup", False) or (
        config.getoption("dist", "no") == "loadgroup"
    ):
        _order_for_workers(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """make test's --dist loadgroup: units of :func:`work_unit`, handed out
    in the workers' collection order. Not xdist's own LoadGroupScheduling:
    it reads a unit from an ``@group`` suffix that xdist 3.8 writes into
    ``item._nodeid``, which pytest 9's ``nodeid`` no longer reads, so every
    test went out as a unit of its own (both workers compiled the scan at
    once, and the slowest files' tests were spread at random)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)[1]

    return WorkUnits(config, log)


@pytest.fixture(params=["struct", "decoder"])
def list_path(request, monkeypatch) -> str:
    """from_ints' two paths for a batch of lists: struct (no numba kernel
    loaded, as in a process that runs only the Triton path) and msgspec plus
    the numba decoder (coordinator/int_lists.py). Each must convert, refuse
    and name exactly the same items."""
    from kvhit.coordinator import int_lists

    if request.param == "struct":
        monkeypatch.setattr(int_lists, "_unpack", None)
        monkeypatch.setattr(int_lists, "_loaded", lambda: None)
        assert not int_lists.decoder_ready()
    else:
        pytest.importorskip("numba")
        from kvhit.kernels.msgpack_numba import warm_up

        warm_up()
        assert int_lists.decoder_ready()
    return request.param
