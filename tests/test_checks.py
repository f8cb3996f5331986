"""The shared argument checks (coordinator/checks.py, kernels/checks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from strategies import layouts

from kvhit.kernels import contract as kc
from kvhit.kernels.checks import (
    check_device,
    check_int64,
    check_keys,
    check_plan_rows,
    check_table,
    check_tensor,
)

CPU = torch.device("cpu")
# Metadata without data: on the wrong device for every check below.
META64 = torch.zeros(2, dtype=torch.int64, device="meta")


def test_check_device_canonical_and_refusals() -> None:
    assert check_device("cpu:0") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(TypeError, match="where must be a torch.device or str"):
        check_device(3, "where")
    with pytest.raises(ValueError, match="where='nowhere' is not a device"):
        check_device("nowhere", "where")
    with pytest.raises(ValueError, match="where 'meta' holds no data.*where=meta"):
        check_device("meta", "where")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available here"):
            check_device("cuda")


def test_check_tensor_order_and_messages() -> None:
    t = torch.zeros(2, 3, dtype=torch.int64)
    assert check_tensor(t, "x", dim=2, device=torch.device("cpu")) is t
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor([1], "x")
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="x is a meta tensor"):
        check_tensor(meta, "x")
    with pytest.raises(TypeError, match="x must be int64, got torch.int32"):
        check_tensor(meta, "x", holds_data=False)
    with pytest.raises(TypeError, match="x must be int32, got torch.int64"):
        check_tensor(t, "x", dtype=torch.int32)
    with pytest.raises(ValueError, match=r"x must have 1 dimensions, got \[2, 3\]"):
        check_tensor(t, "x", dim=1)
    with pytest.raises(ValueError, match="x is on meta, the engine is on cpu"):
        check_tensor(META64, "x", device=CPU, device_of="the engine", holds_data=False)


def test_kernel_checks() -> None:
    table = torch.zeros(8, 3, dtype=torch.int64)
    assert check_table(table, 2) == 8
    with pytest.raises(ValueError, match="W must be a positive int"):
        check_table(table, True)
    with pytest.raises(ValueError, match="capacity must be a power of two"):
        check_table(torch.zeros(6, 3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"table must have shape \[capacity, 3\]"):
        check_table(torch.zeros(8, 2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="t must be contiguous"):
        check_int64(torch.zeros(4, 4, dtype=torch.int64).t(), "t")
    with pytest.raises(ValueError, match="t is on meta but hashes is on cpu"):
        check_int64(META64, "t", device=CPU, device_of="hashes")
    g = torch.zeros(3, dtype=torch.int64)
    h = torch.zeros(3, 2, dtype=torch.int64)
    assert check_keys(g, h, 2, table.device) == 3
    with pytest.raises(ValueError, match="group_ids has 2 entries but hashes has 3"):
        check_keys(g[:2], h, 2, table.device)
    with pytest.raises(ValueError, match=r"hashes must have shape \[N, 3\]"):
        check_keys(g, h, 3, table.device)
    with pytest.raises(TypeError, match="group_ids must be int64"):
        check_keys(g.int(), h, 2, table.device)


# -- a plan's rows (check_plan_rows) ------------------------------------------------


def _plan_rows(preset: str = "dsv4-flash"):
    from kvhit.bench.workloads import make_layout
    from kvhit.coordinator.plan import ScanPlan, plan_tensors

    plan = ScanPlan.from_layout(make_layout(preset))
    sg, cand = plan_tensors(plan, CPU)
    return sg.numpy().copy(), cand.numpy().copy(), plan.alignment


@settings(max_examples=60, deadline=None)
@given(layout=layouts())
def test_every_plan_kvhit_builds_passes_check_plan_rows(layout) -> None:
    from kvhit.coordinator.plan import ScanPlan, plan_tensors

    plan = ScanPlan.from_layout(layout)
    sg, cand = plan_tensors(plan, CPU)
    check_plan_rows(sg.numpy(), cand.numpy(), plan.alignment)


@pytest.mark.parametrize("preset", ["dsv4-flash", "qwen3-next", "gemma3", "llama"])
def test_every_preset_plan_passes_check_plan_rows(preset: str) -> None:
    check_plan_rows(*_plan_rows(preset))


@pytest.mark.parametrize(
    "table, row, col, value, match",
    [
        (
            "sg",
            0,
            kc.SG_KIND,
            9,
            r"sg_rows\[0, kind\] must be one of \[0, 1, 2, 3\], got 9",
        ),
        ("sg", 1, kc.SG_PERIOD, 0, r"sg_rows\[1, period\] must be >= 1, got 0"),
        ("sg", 1, kc.SG_SCALE, 0, r"sg_rows\[1, scale\] must be >= 1, got 0"),
        ("sg", 0, kc.SG_BLOCK_SIZE, -4, r"sg_rows\[0, block_size\] must be >= 1"),
        ("sg", 1, kc.SG_NEED, -1, r"sg_rows\[1, need\] must be >= 0, got -1"),
        ("sg", 1, kc.SG_MARGIN, -64, r"sg_rows\[1, margin\] must be >= 0"),
        ("sg", 0, kc.SG_CHUNK, -1, r"sg_rows\[0, chunk\] must be >= 0"),
        ("sg", 0, kc.SG_USE_EAGLE, 2, r"sg_rows\[0, use_eagle\] must be 0 or 1, got 2"),
        ("sg", 0, kc.SG_FINE, -1, r"sg_rows\[0, fine\] must be 0 or 1"),
        ("sg", 0, kc.SG_N_MEMBERS, 0, r"sg_rows\[0, n_members\] must be in \[1, 2\]"),
        ("sg", 0, kc.SG_N_MEMBERS, 3, r"sg_rows\[0, n_members\] must be in \[1, 2\]"),
        (
            "sg",
            1,
            kc.SG_MEMBERS,
            5,
            r"sg_rows\[1, member 0\] must be a group id in \[0, 5\)",
        ),
        ("sg", 1, kc.SG_MEMBERS + 1, -1, r"sg_rows\[1, member 1\] .* got -1"),
        ("cand", 2, kc.CAND_SCALE, 0, r"cand_rows\[2, scale\] must be >= 1, got 0"),
        ("cand", 0, kc.CAND_BLOCK_SIZE, 0, r"cand_rows\[0, block_size\] must be >= 1"),
        ("cand", 1, kc.CAND_SPARSE, 3, r"cand_rows\[1, sparse\] must be 0 or 1"),
        ("cand", 0, kc.CAND_CACHEABLE, -1, r"cand_rows\[0, cacheable\] must be 0 or 1"),
        ("cand", 4, kc.CAND_NEED, -2, r"cand_rows\[4, need\] must be >= 0"),
        ("cand", 4, kc.CAND_SHIFT, -1, r"cand_rows\[4, shift\] must be >= 0"),
        (
            "cand",
            3,
            kc.CAND_GROUP_ID,
            0,
            r"cand_rows\[3, group_id\] must be its row number 3",
        ),
    ],
)
def test_check_plan_rows_names_the_bad_value(table, row, col, value, match) -> None:
    sg, cand, align = _plan_rows()
    check_plan_rows(sg, cand, align)  # the good rows pass
    (sg if table == "sg" else cand)[row, col] = value
    with pytest.raises(ValueError, match=match):
        check_plan_rows(sg, cand, align)


def test_check_plan_rows_sparse_needs_a_segment_and_fine_needs_room() -> None:
    sg, cand, align = _plan_rows()
    sparse = int(np.flatnonzero(cand[:, kc.CAND_SPARSE])[0])
    cand[sparse, kc.CAND_PER_SEGMENT] = 0
    with pytest.raises(
        ValueError, match=rf"cand_rows\[{sparse}, per_segment\] .* sparse"
    ):
        check_plan_rows(sg, cand, align)
    sg, cand, align = _plan_rows()
    # A fine-grained scan steps block_size // alignment hash units: zero here.
    sg[0, kc.SG_FINE] = 1
    sg[0, kc.SG_BLOCK_SIZE] = align // 2
    with pytest.raises(
        ValueError, match=r"sg_rows\[0, fine\] must be 0 where block_size"
    ):
        check_plan_rows(sg, cand, align)
