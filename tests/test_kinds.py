"""The spec-kind registry (coordinator/kinds.py): it covers every spec type once,
everything that needs a kind looks it up there, and the plan rows the kernels
read stay exactly as they were."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
from strategies import ALL_KINDS

from kvhit.bench.workloads import PRESETS
from kvhit.bindings.vllm import UNMODELLED_VLLM_SPECS, layout_from_vllm, spec_kind
from kvhit.coordinator import kinds as K
from kvhit.coordinator import managers, specs
from kvhit.coordinator.plan import ScanPlan
from kvhit.kernels import contract

ROOT = Path(__file__).resolve().parent.parent
SPEC_TYPES = typing.get_args(specs.Spec)


def _spec(cls):
    sizes = {
        specs.FullAttention: {},
        specs.SlidingWindow: {"sliding_window": 8},
        specs.Mamba: {},
        specs.ChunkedLocal: {"attention_chunk_size": 16},
    }[cls]
    return cls(block_size=4, **sizes)


def test_registry_covers_every_spec_type_once():
    assert len(K.KINDS) == len(SPEC_TYPES) == len(ALL_KINDS)
    assert {k.spec_type for k in K.KINDS} == set(SPEC_TYPES)
    assert [k.name for k in K.KINDS] == list(ALL_KINDS)
    assert dict(K.KINDS_BY_NAME) == {k.name: k for k in K.KINDS}
    for cls in SPEC_TYPES:
        spec = _spec(cls)
        kind = K.kind_of(spec)
        assert kind.spec_type is cls
        assert spec.kind == kind.name


def test_codes_are_the_kernel_contract_codes():
    by_name = {k.name: k.code for k in K.KINDS}
    assert by_name == {
        "full": contract.KIND_FULL,
        "sliding_window": contract.KIND_SWA,
        "mamba": contract.KIND_MAMBA,
        "chunked_local": contract.KIND_CHUNKED,
    }
    assert sorted(by_name.values()) == list(range(len(K.KINDS)))


def test_kind_of_subclass_and_refusal():
    @dataclasses.dataclass(frozen=True)
    class MyWindow(specs.SlidingWindow):
        pass

    assert K.kind_of(MyWindow(4, 8)).name == "sliding_window"
    with pytest.raises(TypeError, match="FullAttention, SlidingWindow.*got int"):
        K.kind_of(3)


def test_kind_is_not_a_spec_field():
    """``kind`` is a registry lookup, not stored: equality, hashing, repr and
    ``replace`` see only the spec's own fields."""
    for cls in SPEC_TYPES:
        names = {f.name for f in dataclasses.fields(cls)}
        assert "kind" not in names
        assert K.kind_of(_spec(cls)).spec_fields == names - {"tag"}
    s = specs.SlidingWindow(4, 8, extra_retained_tokens=4)
    assert specs.coverage_spec(s).kind == "sliding_window"
    assert "kind" not in repr(s)


def test_flags_match_vllm_managers():
    by = K.KINDS_BY_NAME
    assert [n for n, k in by.items() if k.fine_grained] == ["full", "mamba"]
    assert [n for n, k in by.items() if k.is_full_attention] == ["full"]
    assert [n for n, k in by.items() if not k.takes_proof_margin] == ["mamba"]
    assert by["mamba"].store_mask is managers.no_block_stored


def test_scan_and_mask_functions_share_one_signature():
    scans = {tuple(inspect.signature(k.scan).parameters) for k in K.KINDS}
    assert scans == {
        (
            "raw",
            "max_length",
            "group_ids",
            "pool",
            "spec",
            "hash_block_size",
            "drop_eagle",
            "hit_alignment",
        )
    }
    mask_fns = [f for k in K.KINDS for f in (k.reachable_mask, k.store_mask)]
    assert {tuple(inspect.signature(f).parameters) for f in mask_fns} == {
        (
            "spec",
            "start_block",
            "end_block",
            "scheduler_block_size",
            "use_eagle",
            "retention_interval",
            "boundaries",
        )
    }
    for f in [k.scan for k in K.KINDS] + mask_fns:
        assert f.__module__ == managers.__name__, f


def test_vllm_names_map_to_their_kind():
    for kind in K.KINDS:
        for name in kind.vllm_names:
            stand_in = type(name, (), {})()
            assert spec_kind(stand_in) == kind.name
    for name in UNMODELLED_VLLM_SPECS:
        assert spec_kind(type(name, (), {})()) is None
    modelled = {n for k in K.KINDS for n in k.vllm_names}
    assert not modelled & set(UNMODELLED_VLLM_SPECS)


def test_vllm_stand_in_builds_the_registered_spec_type():
    """The binding builds each kind's spec from its spec_fields, by name."""

    @dataclasses.dataclass
    class ChunkedLocalAttentionSpec:
        block_size: int
        attention_chunk_size: int
        num_kv_heads: int = 1

    @dataclasses.dataclass
    class Grp:
        kv_cache_spec: object
        layer_names: tuple = ("l0",)

    layout = layout_from_vllm([Grp(ChunkedLocalAttentionSpec(16, 64))], 16, 16)
    spec = layout.groups[0].spec
    assert type(spec) is specs.ChunkedLocal
    assert (spec.block_size, spec.attention_chunk_size) == (16, 64)
    assert ("num_kv_heads", 1) in spec.tag[1]


# -- no branching on spec types outside the registry ----------------------------

_NO_SPEC_BRANCHES = (
    "coordinator/reference.py",
    "coordinator/managers.py",
    "coordinator/plan.py",
    "bindings/vllm.py",
)


@pytest.mark.parametrize("path", _NO_SPEC_BRANCHES)
def test_no_isinstance_over_spec_types(path):
    names = {cls.__name__ for cls in SPEC_TYPES}
    tree = ast.parse((ROOT / path).read_text())
    bad = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
        ):
            used = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if used & names:
                bad.append(node.lineno)
    assert not bad, f"{path}: isinstance over spec types at lines {bad}"


@pytest.mark.parametrize("path", _NO_SPEC_BRANCHES + ("coordinator/specs.py",))
def test_no_kind_strings_compared(path):
    """Kinds are compared through the registry's flags, not their names."""
    tree = ast.parse((ROOT / path).read_text())
    kind_names = set(ALL_KINDS)
    bad = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(
            isinstance(c, ast.Constant) and c.value in kind_names
            for c in [node.left, *node.comparators]
        )
    ]
    assert not bad, f"{path}: kind names compared at lines {bad}"


# -- the rows the kernels read --------------------------------------------------

# ScanPlan.as_rows() and the candidate rows of the bench presets, as the code
# before the registry produced them. Kernels index these columns: they must not
# move.
PINNED_ROWS = {
    "dsv4-flash": (
        [
            [0, 256, 64, 0, 0, 0, 1, 0, 0, 1, 0, -1],
            [1, 64, 16, 1, 64, 2, 4, 0, 0, 2, 1, 2],
            [1, 4, 1, 0, 0, 2, 64, 0, 0, 1, 3, -1],
            [1, 8, 2, 0, 0, 16, 32, 0, 0, 1, 4, -1],
        ],
        [
            [1, 256, 64, 0, 0, 0, 0, 0],
            [1, 64, 16, 1, 4, 3, 1, 1],
            [1, 64, 16, 1, 4, 3, 1, 2],
            [1, 4, 1, 1, 64, 2, 0, 3],
            [1, 8, 2, 1, 32, 16, 0, 4],
        ],
    ),
    "qwen3-next": (
        [[0, 64, 4, 0, 0, 0, 1, 1, 0, 1, 0], [2, 64, 4, 0, 0, 0, 1, 1, 0, 1, 1]],
        [[1, 64, 4, 0, 0, 0, 0, 0], [1, 64, 4, 0, 0, 0, 0, 1]],
    ),
    "gemma3": (
        [[0, 16, 1, 0, 0, 0, 1, 0, 0, 1, 0], [1, 16, 1, 0, 0, 64, 1, 0, 0, 1, 1]],
        [[1, 16, 1, 0, 0, 0, 0, 0], [1, 16, 1, 0, 1, 64, 0, 1]],
    ),
    "llama": ([[0, 16, 1, 0, 0, 0, 1, 0, 0, 1, 0]], [[1, 16, 1, 0, 0, 0, 0, 0]]),
}


@pytest.mark.parametrize("preset", sorted(PINNED_ROWS))
def test_plan_rows_are_pinned(preset):
    plan = ScanPlan.from_layout(PRESETS[preset].layout())
    sg_rows, cand_rows = PINNED_ROWS[preset]
    assert plan.as_rows() == sg_rows
    assert plan.candidates_as_rows() == cand_rows
    assert all(len(r) == contract.CAND_WIDTH for r in cand_rows)
    for row, sg in zip(sg_rows, plan.spec_groups, strict=True):
        assert row[contract.SG_PERIOD] == sg.period
        assert row[contract.SG_NEED] == sg.need


def test_chunked_local_row_carries_its_chunk():
    layout = specs.CacheLayout(
        [
            specs.Group(specs.FullAttention(8)),
            specs.Group(specs.ChunkedLocal(8, attention_chunk_size=32)),
            specs.Group(specs.Mamba(8), prefix_cacheable=False),
        ],
        scheduler_block_size=8,
        hash_block_size=4,
        partial_hash_hits=False,
    )
    plan = ScanPlan.from_layout(layout)
    assert plan.as_rows() == [
        [0, 8, 2, 0, 0, 0, 1, 0, 0, 1, 0],
        [3, 8, 2, 0, 0, 0, 1, 0, 32, 1, 1],
    ]
    assert plan.candidates_as_rows() == [
        [1, 8, 2, 0, 0, 0, 0, 0],
        [1, 8, 2, 0, 0, 0, 0, 1],
        [0, 8, 2, 0, 0, 0, 0, 2],
    ]
