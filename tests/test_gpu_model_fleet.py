"""bench/gpu_model_fleet.py: the fleet kernels' round trips per request,
bytes per request and launches/syncs per call do not rise above the recorded
figures (``gpu_model_fleet.RECORDED``), and the model reproduces the H200's
fleet rows within 30 %. Runs the real kernels under the interpreter at small
sizes (about 15 s here)."""

from __future__ import annotations

import pytest
import torch

from kvhit.bench import gpu_model_fleet as gmf
from kvhit.kernels import fleet_triton

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the tracer runs the Triton interpreter"
)


@pytest.fixture(scope="module")
def quick_rows():
    return gmf.trace_rows("quick", sample=0)


def test_round_trips_and_bytes_do_not_rise(quick_rows):
    for key, row in quick_rows.items():
        name = key.replace(" ", "_")
        assert row["max_rt"] <= gmf.RECORDED[f"{name}_max_rt"], key
        assert row["bytes_per_request"] <= gmf.RECORDED[f"{name}_bytes"], key


def test_launches_and_syncs_per_call_do_not_rise(quick_rows):
    # A row's own record where it has one (the class path's third launch),
    # else its preset's.
    for key, row in quick_rows.items():
        name, preset = key.replace(" ", "_"), key.split(" ")[0]
        triton, other, syncs, _ops = row["counted"]
        for what, got in (("triton_launches", triton), ("other_launches", other),
                          ("syncs", syncs)):  # fmt: skip
            bound = gmf.RECORDED.get(f"{name}_{what}")
            if bound is None:
                bound = gmf.RECORDED[f"{preset}_{what}"]
            assert got <= bound, (key, what)


def test_direct_launches_cover_the_hybrid_path():
    # Every fleet kernel of a lookup goes past Triton's binder on a GPU (the
    # model prices a binder launch 25 us of host time, a direct one 9).
    assert {"_fleet_kernel", "_finish_kernel", "class_kernel",
            "hybrid_kernel"} <= gmf.direct_kernels()  # fmt: skip


def test_the_fleet_prices_host_items_as_the_scan():
    # One source for a launch's and a torch op's host time: the scan's model
    # (gpu_common.HostTimes); the fleet keeps its own Python, sync and L2.
    from kvhit.bench.gpu_common import HostTimes

    ft, h = gmf.FleetTimes(), HostTimes()
    assert (ft.t_binder, ft.t_direct, ft.t_op) == (h.t_binder, h.t_direct, h.t_op)
    items = (2, 4, 1)  # llama on CUDA: 2 direct launches, 4 ops, 1 sync
    m = gmf.model_call(2, 0, 0.0, items, True, True, ft)
    assert m["host_s"] == pytest.approx(ft.t_py + 2 * h.t_direct + 4 * h.t_op
                                        + ft.t_sync)  # fmt: skip


def test_the_model_reproduces_the_h200_fleet_rows():
    ft = gmf.fit(gmf.FleetTimes())
    assert 0.1e-6 < ft.t_rt_l2 < gmf.FleetTimes().t_rt_l2 * 3
    for E, measured in gmf.H200_FLEET.items():
        launches, rt, nbytes, items = gmf.H200_FLEET_KERNEL[E]
        m = gmf.model_call(launches, rt, nbytes, items, False, True, ft)
        assert abs(m["total_s"] / measured - 1) <= 0.30, (E, m, measured)


def test_split_for_and_fixed_split():
    # 132 SMs, 4 programs an SM: B = 64 -> 9 a request, rounded up to 16
    # (at most MAX_SPLIT); B = 1024 -> 1.
    assert fleet_triton.split_for(64, 132) == 16
    assert fleet_triton.split_for(1024, 132) == 1
    assert fleet_triton.split_for(0, 132) == fleet_triton.MAX_SPLIT
    cpu = torch.device("cpu")
    with fleet_triton.fixed_split(5):
        assert fleet_triton._split(3, cpu) == 5
    assert fleet_triton._split(3, cpu) == 2
    with pytest.raises((TypeError, ValueError), match="split"):
        with fleet_triton.fixed_split(0):
            pass
