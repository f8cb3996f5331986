"""The shared argument checks (coordinator/checks.py, kernels/checks.py)."""

from __future__ import annotations

import pytest
import torch

from kvhit.coordinator.checks import check_device, check_tensor
from kvhit.kernels.checks import check_int64, check_keys, check_table

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
