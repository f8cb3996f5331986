"""A cost model of the GPU fleet lookup that runs without a GPU.

``python -m kvhit.bench.gpu_model_fleet`` runs the real Triton fleet kernels
of ``kernels/fleet_triton.py`` (and, for hybrid layouts,
``kernels/fleet_triton_hybrid.py``) under ``TRITON_INTERPRET=1``, traced by
:class:`kvhit.bench.gpu_model.Tracer` (the scan's model: a load is one
global-memory round trip deeper than its address, mask and the control
depth; see that module's docstring), on the workload of
``bench/gpu_check_fleet.py`` (B requests x 2048 blocks of 32-byte keys, a
shared system prompt, engine ``r % E`` holding a random prefix of request
``r``), and prints:

* per request: the dependent round trips on its critical path (the most of
  its programs: a request's tiles are dealt to several programs that run at
  once), its loads by kind (hash rows, table slots, engine words, output
  row) and bytes;
* per call of ``LookupEngine.fleet_lookup`` (a scheduler's call: the batch,
  the lengths and the fleet on the device): Triton launches, other kernel
  launches, host syncs and torch ops, counted on the emulated path
  (:func:`kvhit.bench.gpu_model.count_call`);
* a time model of one eager call as the H200 measured it (CUDA events around
  the call, so the host's Python is inside): ``host + sum over launches of
  (launch + makespan(round trips) x round trip) + bytes / bandwidth``.

The device constants are the scan's, fitted to the H200's scan rows
(:class:`kvhit.bench.gpu_model.GpuTimes`: launch 2.0 us, round trip 0.553 us,
3 TB/s). The host part is ``T_PY`` (the Python of one call, fitted here to
the H200's three fleet rows, :data:`H200_FLEET`) plus what each counted item
costs on the host (:class:`FleetTimes`: a launch through Triton's binder 25
us, issue 31's measurement, a direct launch 9 us and a torch op 5 us, as
``gpu_common.HostTimes`` prices them for the scan; a sync: an estimate).
Each traced launch is priced by its kernel: past the binder where
``fleet_triton.DIRECT_KERNELS`` names it (:func:`direct_kernels`).
Every figure it prints is **modelled**.

The kernel the H200 ran (commit a094dd7: one warp per request, 32 blocks a
step) was traced with this module on that commit's tree
(``--old-tree DIR``, a ``git archive`` of a094dd7); its figures are
:data:`H200_FLEET_KERNEL`, and the calibration table sets them beside the
measured times.

Run: ``python -m kvhit.bench.gpu_model_fleet [--quick] [--json PATH]``;
``--quick`` runs the small workloads of ``tests/test_gpu_model_fleet.py``
only (seconds). ``--router``: llama B = 64, E = 64 eager by path, the
general ``fleet_lookup`` against a CUDA router path that is **not built**
(:func:`router_call` sketches it: ``fleet_full_host`` answers the numba
family only; :func:`router_report`, each path's Python measured here).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvhit.bench.gpu_common import HostTimes, best_thread_times, interpret

__all__ = [
    "H200_FLEET",
    "H200_FLEET_KERNEL",
    "RECORDED",
    "FleetCase",
    "FleetTraced",
    "FleetTimes",
    "ROUTER_ITEMS",
    "build_case",
    "call_counts",
    "host_python",
    "main",
    "model_call",
    "router_call",
    "router_report",
    "trace_fleet",
]

#: The H200's eager ``fleet_lookup`` (CUDA events around the call; seconds),
#: llama, B = 64 requests x 2048 blocks, 32-byte keys, by E
#: (shared/measurements/h200-2026-12-04.md, commit a094dd7).
H200_FLEET: dict[int, float] = {1: 376e-6, 64: 423e-6, 256: 395e-6}

#: The recorded figures tests/test_gpu_model_fleet.py holds the fleet to
#: (they may fall, never rise): the quick workloads' most round trips of a
#: request, their bytes per request (hash rows, slots, engine words, the
#: output row), and per call of fleet_lookup (warm, the triton family, the
#: CPU path; ``cuda_items`` maps it to CUDA): Triton launches, other kernel
#: launches, syncs. Round trips at a094dd7 (one warp a request, 32 blocks a
#: step): 87 and 88 (dsv4-flash took the per-engine torch path); at 6e15dd4 (tiles of
#: 128 blocks dealt to up to 16 programs a request): 18, 20 and 33; a tile's
#: hash words loaded once and held, a slot's group id and words together,
#: two slots a later probe step, the lanes above a block known absent
#: stopped, an engine word loaded once for both halves: 6, 6 and 28.
#: dsv4-flash's bytes rose once, 21,168 -> 21,211 (+0.2 %), when the scan's
#: one-warp programs and half-wide first tile (issue 31, which lowered the
#: scan's own bytes) were merged beside this: its hybrid kernel runs the
#: scan's SpecGroup code. dsv4-flash at E = 13 takes the engine classes'
#: path (fleet_triton.CLASS_MIN_ENGINES): its request's critical path is
#: three launches (joint scan, classes, the rule once a class), 45 round
#: trips; its own launch counts (3 Triton, 3 other: the class rows' fill).
#: At B = 64, E = 64 (not quick) the classes took the call's critical round
#: trips 64 -> 57 and its bytes 33.1 -> 25.0 MB; at E = 256, 73 -> 66 and
#: 33.3 -> 31.1 MB (76 before a pair with a run of 0 skipped its class row).
RECORDED: dict[str, int] = {
    "llama_B=4_E=1_max_rt": 6,
    "llama_B=4_E=1_bytes": 36750,
    "llama_B=4_E=65_max_rt": 6,
    "llama_B=4_E=65_bytes": 39468,
    "dsv4-flash_B=3_E=8_max_rt": 28,
    "dsv4-flash_B=3_E=8_bytes": 21211,
    "dsv4-flash_B=3_E=13_max_rt": 45,
    "dsv4-flash_B=3_E=13_bytes": 52168,
    "dsv4-flash_B=3_E=13_triton_launches": 3,
    "dsv4-flash_B=3_E=13_other_launches": 3,
    "dsv4-flash_B=3_E=13_syncs": 2,
    "llama_triton_launches": 2,
    "llama_other_launches": 1,
    "llama_syncs": 2,
    "dsv4-flash_triton_launches": 2,
    "dsv4-flash_other_launches": 2,
    "dsv4-flash_syncs": 2,
}


@dataclass(frozen=True)
class FleetTimes:
    """The fleet model's constants (seconds, bytes).

    Host, per item of one eager call, priced as the scan's model prices them
    (``host``, :class:`kvhit.bench.gpu_common.HostTimes`, one source for
    both models): ``t_binder`` a Triton launch through ``JITFunction.run``'s
    binder (issue 31's measurement on 3.6, 25 us), ``t_direct`` a launch
    past it (``launch.DirectLauncher``: 9 us, 5 of its Python measured),
    ``t_op`` a torch op that launches a kernel (5 us, estimated). The
    fleet's own: ``t_sync`` a blocking ``bool()`` beyond the device time
    (estimated); ``t_py`` the rest of the call's Python (the checks of
    batch, fleet and lengths, the view, the wrappers: issue 31's measured
    ~65 us of a lookup's Python less its binder, taken for the fleet's call
    as well).

    Device: ``t_rt_l2`` one dependent round trip when the call's tables and
    hash rows fit in L2 (``l2_bytes``; the H200's B = 64 fleet: ~30 MB),
    fitted to :data:`H200_FLEET` by :func:`fit`; past L2 the scan's
    ``GpuTimes.t_rt`` (fitted to the scan's H200 rows, mostly HBM)."""

    t_sync: float = 10e-6
    t_py: float = 65e-6
    t_rt_l2: float = 0.3e-6
    l2_bytes: float = 60e6
    host: HostTimes = field(default_factory=HostTimes)

    @property
    def t_binder(self) -> float:
        """A launch through Triton's binder (``host.t_binder``)."""
        return self.host.t_binder

    @property
    def t_direct(self) -> float:
        """A launch past the binder (``host.t_direct``)."""
        return self.host.t_direct

    @property
    def t_op(self) -> float:
        """A torch op that launches a kernel (``host.t_op``)."""
        return self.host.t_op


#: SMs of the modelled GPU (the H200): the launcher's programs per request
#: (fleet_triton.split_for) are chosen for it.
SMS = 132


# -- workloads -----------------------------------------------------------------------


@dataclass
class FleetCase:
    """One modelled call: ``fleet_lookup`` of ``batch`` against ``fleet``."""

    name: str
    preset: str
    requests: int
    engines: int
    blocks: int
    layout: object
    batch: object
    num_tokens: object
    fleet: object
    hits: object  # int64 [B, E], the torch family's answer


def _fleet_index_class():
    try:
        return importlib.import_module("kvhit.coordinator.fleet_index").FleetIndex
    except ImportError:  # the a094dd7 tree (--old-tree)
        return importlib.import_module("kvhit.coordinator.fleet").FleetIndex


def build_case(preset: str, requests: int, engines: int, blocks: int = 2048,
               seed: int = 0) -> FleetCase:  # fmt: skip
    """The workload of ``bench/gpu_check_fleet.py`` on the CPU: ``requests``
    requests x ``blocks`` hash units, its keys added to a FleetIndex of the
    torch family (fast on the CPU), whose tables the Triton family then
    drives (the same layout: ``fleet_triton.FleetOps`` subclasses torch's)."""
    import torch

    from kvhit.bench import gpu_check_fleet as gcf
    from kvhit.coordinator.engine import LookupEngine

    cfg = gcf.Config(batches=(requests,), blocks=blocks, seed=seed)
    layout, words, num_tokens, (req, gids, keys) = gcf.workload(cfg, preset)
    FleetIndex = _fleet_index_class()
    cap = 4 * max(int(keys.shape[0]), 16)
    batch = gcf.first_requests(words, requests, cfg, torch.device("cpu"))
    # The answer of every request, from the numba family where it imports
    # (compiled: B = 1024 x 256 engines in seconds), dropped before the
    # traced tables are built (a large case holds GBs).
    ref = "numba" if gcf.numba_threads() is not None else "torch"
    fleet = FleetIndex(engines, cfg.hash_bytes, capacity=cap, backend=ref)
    fleet.add(req % engines, gids, keys)
    want = LookupEngine(layout, backend=ref).fleet_lookup(batch, num_tokens, fleet)
    del fleet
    fleet = FleetIndex(engines, cfg.hash_bytes, capacity=cap, backend="torch")
    fleet.add(req % engines, gids, keys)
    _drive_with_triton(fleet)
    name = f"{preset} B={requests} E={engines}"
    return FleetCase(name, preset, requests, engines, blocks, layout, batch,
                     num_tokens, fleet, want)  # fmt: skip


def _drive_with_triton(fleet) -> None:
    """Swap ``fleet``'s torch-family table operations for the Triton
    family's (the same tables)."""
    if hasattr(fleet, "ops"):
        fleet.ops = importlib.import_module("kvhit.kernels.fleet_triton").FleetOps()
        return
    # The a094dd7 tree (--old-tree): the ops were private to coordinator/fleet.
    old = importlib.import_module("kvhit.coordinator.fleet")
    fleet._ops = old._TritonOps()  # noqa: SLF001 - that tree had no public hook
    fleet._backend = "triton"  # noqa: SLF001


# -- tracing -------------------------------------------------------------------------


@dataclass
class FleetTraced:
    """The tracer's figures for one case (``traced`` requests of ``requests``)."""

    name: str
    requests: int
    engines: int
    traced: list[int]
    # Per Triton launch of the call: (kernel name, per traced request: its
    # programs' round trips in program order).
    launches: list[tuple[str, dict[int, list[int]]]]
    loads: Counter  # load instructions by kind, all traced requests
    bytes_by_kind: Counter
    bytes_traced: int
    extent: list[int]  # every request's scan extent (blocks, the most run)
    seconds: float
    per_request_rt: dict[int, int] = field(default_factory=dict)
    per_request_bytes: dict[int, int] = field(default_factory=dict)


def _split_for(requests: int) -> int:
    """Programs per request the launcher gives ``requests`` requests on the
    modelled GPU (1 where the kernel has no split: the a094dd7 tree)."""
    ft = importlib.import_module("kvhit.kernels.fleet_triton")
    fn = getattr(ft, "split_for", None)
    return 1 if fn is None else fn(requests, SMS)


@contextlib.contextmanager
def _modelled_split(requests: int):
    """The launcher deals tiles as it would for ``requests`` requests on the
    modelled GPU, whatever the batch traced (a sample of them)."""
    ft = importlib.import_module("kvhit.kernels.fleet_triton")
    ctx = getattr(ft, "fixed_split", None)
    if ctx is not None:
        with ctx(_split_for(requests)):
            yield
    elif hasattr(ft, "MAX_SPLIT"):
        # A tree between bf49536 and fixed_split (--old-tree): the same rule.
        from unittest import mock

        want = -(-SMS * 4 // max(requests, 1))
        split = min(1 << max(want - 1, 0).bit_length(), ft.MAX_SPLIT)
        with mock.patch.object(ft, "_split", lambda batch, device: split):
            yield
    else:
        yield


def _sub_batch(batch, rows: list[int]):
    import torch

    from kvhit.coordinator.packing import HashBatch

    offs = batch.offsets.tolist()
    parts = [batch.hashes[offs[r] : offs[r + 1]] for r in rows]
    lens = [len(p) for p in parts]
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    hashes = torch.cat(parts) if parts else batch.hashes[:0]
    return HashBatch(hashes, offsets, batch.hash_bytes)


def trace_fleet(case: FleetCase, sample: int, seed: int = 0) -> FleetTraced:
    """Trace ``fleet_lookup`` of ``sample`` requests of ``case`` (the longest
    scans and a random rest), the launcher dealing tiles as for the whole
    batch; checks the answer against the torch family's."""
    from kvhit.bench.gpu_model import count_call
    from kvhit.coordinator.engine import LookupEngine

    t0 = time.perf_counter()
    B, E = case.requests, case.engines
    hits = case.hits
    # A request's scan runs until its last engine's first miss: its extent.
    bs = case.layout.hash_block_size
    extent = [int(x) for x in (hits.max(dim=1).values // bs).tolist()]
    order = sorted(range(B), key=lambda r: -extent[r])
    chosen = {0, *order[: max(1, sample // 2)]}
    rest = [r for r in range(B) if r not in chosen]
    chosen.update(
        random.Random(seed).sample(rest, min(len(rest), sample - len(chosen)))
    )
    traced = sorted(chosen)
    sub = _sub_batch(case.batch, traced)
    nt = case.num_tokens[traced]
    engine = LookupEngine(case.layout, backend="torch", device="cpu")
    with _modelled_split(B):
        got, _counts, tracer = count_call(
            lambda: engine.fleet_lookup(sub, nt, case.fleet)
        )
    if not bool((got == hits[traced]).all()):
        raise AssertionError(f"{case.name}: the traced triton fleet_lookup differs")
    launches = []
    loads: Counter = Counter()
    by_kind: Counter = Counter()
    by_request: Counter = Counter()
    n = len(traced)
    for launch in tracer.launches:
        grid = tuple(launch.grid) + (1, 1)
        gx, gy = grid[0], grid[1]
        per: dict[int, list[int]] = {r: [] for r in traced}
        for i, p in enumerate(launch.programs):
            x = i // gy
            # Grids of (B, split) or (B * E,): program x's request; any other
            # grid (a probe over the batch's keys) is the whole call's, -1.
            r = traced[x // (gx // n)] if gx % n == 0 and gx >= n else -1
            per.setdefault(r, []).append(p.round_trips)
            by_request[r] += sum(p.bytes.values())
            loads.update({f"{launch.name}:{k}": v for k, v in p.loads.items()})
            by_kind.update({f"{launch.name}:{k}": v for k, v in p.bytes.items()})
        launches.append((launch.name, per))
    rt = {r: sum(max(per[r], default=0) for _, per in launches if r in per)
          for r in traced}  # fmt: skip
    return FleetTraced(case.name, B, E, traced, launches, loads, by_kind,
                       sum(by_kind.values()), extent, time.perf_counter() - t0,
                       rt, dict(by_request))  # fmt: skip


# -- the time model --------------------------------------------------------------------

#: Registers of the fleet scan kernel of trees without
#: ``fleet_triton.SCAN_REGISTERS`` (--old-tree), by warps per program (their
#: AOT tables, Triton 3.6 sm_90, the lookup variant): a094dd7's one warp 96,
#: 6e15dd4's four warps 80.
REGISTERS: dict[int, int] = {1: 96, 4: 80}


def _kernel_slots(name: str) -> int:
    """Programs of kernel ``name`` resident on the modelled GPU."""
    from kvhit.bench.gpu_model import GpuTimes, resident

    ft = importlib.import_module("kvhit.kernels.fleet_triton")
    g = GpuTimes()
    if name == "hybrid_kernel":
        scan = importlib.import_module("kvhit.kernels.scan")
        return resident(scan.NUM_WARPS, scan.MAXNREG, g)
    if name == "class_kernel":
        return resident(ft.NUM_WARPS, ft.CLASS_REGISTERS, g)
    if name == "_fleet_kernel":
        regs = getattr(ft, "SCAN_REGISTERS", None) or REGISTERS[ft.NUM_WARPS]
        return resident(ft.NUM_WARPS, regs, g)
    return resident(1, 64, g)


def _nearest(traced: list[int], extent: list[int], r: int) -> int:
    return min(traced, key=lambda t: (abs(extent[t] - extent[r]), t))


def device_parts(t: FleetTraced) -> tuple[int, int, float]:
    """(launches, critical round trips, bytes) of the call's kernels on the
    modelled GPU: a request not traced takes the round trips of the traced
    request whose scan extent is nearest; programs start in CUDA's order (x
    fastest); each launch's critical path is its makespan over its resident
    programs, and the launches run one after another. Bytes likewise."""
    from kvhit.bench.gpu_model import makespan

    B = t.requests
    near = [_nearest(t.traced, t.extent, r) for r in range(B)]
    total_rt = 0
    for name, per in t.launches:
        width = max(len(v) for v in per.values())
        if -1 in per:
            # A launch over the call's keys, not per request: as traced.
            rts = per[-1]
        elif name == "hybrid_kernel":
            rts = [rt for r in range(B) for rt in per[near[r]]]
        else:
            # CUDA starts blocks x fastest: (0, s), (1, s), ... for s in order.
            rts = [per[near[r]][s] for s in range(width) for r in range(B)
                   if s < len(per[near[r]])]  # fmt: skip
        total_rt += makespan(rts, _kernel_slots(name))
    # Bytes as the round trips: each request the nearest traced one's (the
    # sample holds the longest scans, so its mean would overstate them).
    shared = t.per_request_bytes.get(-1, 0)
    total_bytes = shared + sum(t.per_request_bytes.get(near[r], 0) for r in range(B))
    return len(t.launches), total_rt, float(total_bytes)


def cuda_items(counts) -> tuple[int, int, int]:
    """(Triton launches, other kernel launches, host syncs) of the same call
    on CUDA, from the CPU path's counts. On the CPU the engine reads the
    batch's offsets (``HashBatch.view``) and checks the lengths through
    numpy: two ``.numpy()`` syncs. On CUDA the view is one subtraction
    kernel and no sync, and a device tensor of lengths is checked there
    (``checks.check_lengths``: a compare, an ``any`` and one blocking
    ``bool()``)."""
    numpy_syncs = counts.sync_calls.get("numpy", 0)
    if numpy_syncs != 2:
        raise ValueError(
            f"the call's CPU path made {numpy_syncs} .numpy() syncs, not the view's "
            "and the lengths' two: cuda_items needs updating"
        )
    return counts.triton_launches, counts.other_launches + 3, counts.syncs - 2 + 1


def footprint(case: FleetCase) -> int:
    """Bytes of what the call's probes read: the fleet's tables and the
    batch's hash rows."""
    f = case.fleet
    return int((f.keys.numel() + f.bits.numel() + case.batch.hashes.numel()) * 8)


def model_call(launches: int, rt: int, nbytes: float, items: tuple[int, int, int],
               direct: bool | int, in_l2: bool, ft: FleetTimes) -> dict:  # fmt: skip
    """The modelled eager call (seconds): the host's part from the CUDA items
    (``cuda_items``), the device's from the launches, the critical round
    trips and the bytes; ``graph_s`` the device's alone (a CUDA-graph
    replay, no host). ``direct``: how many of the Triton launches go past
    the binder (True: all, False: none)."""
    from kvhit.bench.gpu_model import GpuTimes

    g = GpuTimes()
    triton, other, syncs = items
    if isinstance(direct, bool):
        direct = triton if direct else 0
    direct = min(direct, triton)
    host = (ft.t_py + direct * ft.t_direct + (triton - direct) * ft.t_binder
            + other * ft.t_op + syncs * ft.t_sync)  # fmt: skip
    t_rt = ft.t_rt_l2 if in_l2 else g.t_rt
    dev = launches * g.t_launch + rt * t_rt + nbytes / g.bw
    return {"host_s": host, "device_s": dev, "total_s": host + dev, "graph_s": dev,
            "critical_rt": rt, "bytes": nbytes, "in_l2": in_l2}  # fmt: skip


#: The a094dd7 kernel (the H200's) under this model, per E of
#: :data:`H200_FLEET`: (launches, critical round trips, bytes, CUDA items:
#: Triton launches through the binder, other launches, syncs). From
#: ``--old-tree`` on ``git archive a094dd7`` (every request traced); its
#: tables and hash rows fit in L2.
H200_FLEET_KERNEL: dict[int, tuple[int, int, float, tuple[int, int, int]]] = {
    1: (1, 903, 8.09e6, (1, 4, 1)),
    64: (1, 903, 9.25e6, (1, 4, 1)),
    256: (1, 1030, 12.90e6, (1, 4, 1)),
}


def fit(ft: FleetTimes, points: dict[int, tuple] | None = None) -> FleetTimes:
    """``t_rt_l2`` by least squares through the H200's fleet rows, the host
    part (binder launches, the other items, ``t_py``) held at ``ft``'s."""
    points = H200_FLEET_KERNEL if points is None else points
    num = den = 0.0
    for E, meas in H200_FLEET.items():
        launches, rt, nbytes, items = points[E]
        base = model_call(launches, 0, nbytes, items, False, True, ft)["total_s"]
        num += (meas - base) * rt
        den += rt * rt
    return replace(ft, t_rt_l2=num / den) if den else ft


# -- per call counts ---------------------------------------------------------------------


def call_counts(case: FleetCase):
    """Per call counts of ``fleet_lookup`` (warm: the second call) on
    ``case``'s first two requests."""
    from kvhit.bench.gpu_model import count_call
    from kvhit.coordinator.engine import LookupEngine

    rows = list(range(min(2, case.requests)))
    sub = _sub_batch(case.batch, rows)
    nt = case.num_tokens[rows]
    engine = LookupEngine(case.layout, backend="torch", device="cpu")

    def call():
        return engine.fleet_lookup(sub, nt, case.fleet)

    call()
    return count_call(call)[1]


#: A CUDA router path (issue 32; not built: ``fleet_full_host`` answers the
#: numba family only) as a call would run it, per call on CUDA: Triton launches (direct),
#: other kernel launches (the view's subtraction and the lengths' copy
#: through a pinned buffer: a router's list of lengths is checked on the
#: host), syncs.
ROUTER_ITEMS: tuple[int, int, int] = (2, 2, 0)


def router_call(engine: Any, batch: Any, num_tokens: list[int], fleet: Any,
                members: Any, params: tuple[int, ...]) -> Any:  # fmt: skip
    """What a CUDA router call of ``fleet_lookup`` would run on the host (a
    sketch of a path not built, for the model: members and params built once
    per plan and handed in, as ``fleet_scoring._router_args`` does for the
    numba kernel): the type tests
    of ``fleet_full_host``, the list of lengths checked on the host (then
    copied: not on the CPU), the batch's view, the Triton launcher with the
    members on the device. ``members`` int64 ``[M]``, ``params`` the
    launcher's six ints. Returns int64 ``[B, E]`` (a torch tensor)."""
    import torch

    from kvhit.coordinator.packing import HashBatch
    from kvhit.kernels.checks import host_lengths

    if type(batch) is not HashBatch or batch.hash_bytes != fleet.hash_bytes:
        raise TypeError("router_call takes a HashBatch of the fleet's width")
    lens = torch.from_numpy(host_lengths(num_tokens, "num_tokens", len(batch)))
    view = batch.view()
    return fleet.ops.full_hits(
        fleet.table, fleet.keys, fleet.bits, view.rows, view.offsets, view.lengths,
        lens, members, fleet.live, fleet.active_mask, params, fleet.num_engines,
    )  # fmt: skip


def host_python(case: FleetCase, rounds: int = 5, n: int = 200) -> dict[str, float]:
    """Seconds of Python per call (thread time, best of ``rounds`` of ``n``
    calls), the Triton launches stubbed (the answer stays zero), of
    ``fleet_lookup`` on ``case`` (lengths as a tensor: the general path,
    what the model's ``t_py`` stands for) and of :func:`router_call` (a
    list of lengths: the CUDA router path). Both answers are checked
    against the case's (unstubbed)."""
    from unittest import mock

    import torch

    from kvhit.coordinator.engine import LookupEngine
    from kvhit.kernels import launch

    engine = LookupEngine(case.layout, backend="torch", device="cpu")
    plan = engine.plan
    sg = plan.spec_groups[0]
    members = torch.tensor(sg.group_ids, dtype=torch.int64)
    lookup_drop = bool(sg.use_eagle)
    params = (case.fleet.NW, sg.scale, sg.block_size, plan.alignment,
              int(lookup_drop), 1)  # fmt: skip
    tokens = case.num_tokens.tolist()

    def general():
        return engine.fleet_lookup(case.batch, case.num_tokens, case.fleet)

    def router():
        return router_call(engine, case.batch, tokens, case.fleet, members, params)

    calls = {"fleet_lookup": general, "router (CUDA path)": router}
    for name, fn in calls.items():
        if not bool((fn() == case.hits).all()):
            raise AssertionError(f"{case.name}: {name} differs from the reference")

    def stub(*args, **kwargs) -> None:
        # The answer stays the launcher's zeroed output.
        return None

    with mock.patch.object(launch.DirectLauncher, "launch", stub):
        return best_thread_times(calls, rounds, n)


def direct_kernels() -> frozenset[str]:
    """The fleet kernels whose launches go past Triton's binder on a GPU
    (``fleet_triton.DIRECT_KERNELS``; before it, the joint scan's two
    kernels where ``DirectLauncher`` was imported: the hybrid path's went
    through the binder)."""
    ft = importlib.import_module("kvhit.kernels.fleet_triton")
    named = getattr(ft, "DIRECT_KERNELS", None)
    if named is not None:
        return frozenset(named)
    if hasattr(ft, "DirectLauncher"):
        return frozenset({"_fleet_kernel", "_finish_kernel"})
    return frozenset()


def uses_direct_launch() -> bool:
    """Whether any fleet launch goes past Triton's binder on a GPU."""
    return bool(direct_kernels())


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} us"


#: Requests traced per hybrid-layout row: the interpreter runs the hybrid
#: kernel's program of every (request, engine) pair, about 2 s each here.
HYBRID_SAMPLE = 2


def workloads(which: str) -> list[tuple[str, int, int, int]]:
    """(preset, B, E, blocks) of ``which``: "quick" (the test's), "h200" (the
    H200's three rows) or "all" (issue 32's table: llama at B = 64 and 1024
    and E = 1, 8, 64, 256; dsv4-flash at B = 64 and E = 1, 8, 64, its rows
    at E = 256 and B = 1024 left out, the interpreter taking hours on their
    hybrid kernel's (request, engine) programs)."""
    if which == "quick":
        # dsv4-flash at E = 13: the engine classes' path (from
        # fleet_triton.CLASS_MIN_ENGINES engines on).
        return [("llama", 4, E, 256) for E in (1, 65)] + [
            ("dsv4-flash", 3, E, 256) for E in (8, 13)
        ]
    if which == "h200":
        return [("llama", 64, E, 2048) for E in H200_FLEET]
    llama = [("llama", B, E, 2048) for B in (64, 1024) for E in (1, 8, 64, 256)]
    return llama + [("dsv4-flash", 64, E, 2048) for E in (1, 8, 64)]


def trace_rows(which: str, sample: int) -> dict[str, dict]:
    """Trace every workload of ``which``: per row the traced figures and the
    call's counts (no times)."""
    out = {}
    for preset, B, E, blocks in workloads(which):
        case = build_case(preset, B, E, blocks)
        n = sample if preset == "llama" else min(sample, HYBRID_SAMPLE)
        t = trace_fleet(case, B if which == "quick" else n)
        counts = call_counts(case)
        launches, rt, nbytes = device_parts(t)
        n = len(t.traced)
        kinds: Counter = Counter()
        for k, v in t.loads.items():
            kinds[k.split(":")[1].removesuffix("_ptr")] += v
        names = [name for name, _ in t.launches]
        direct = direct_kernels()
        # The joint scan's kernel is direct in the hybrid path only where the
        # hybrid kernel is (main at e8dfd46: _scan direct, hybrid_hits not).
        hybrid = "hybrid_kernel" in names
        n_direct = sum(1 for x in names if x in direct and
                       (not hybrid or "hybrid_kernel" in direct))  # fmt: skip
        out[f"{preset} B={B} E={E}"] = {
            "preset": preset, "B": B, "E": E, "traced": n,
            "kernels": names, "direct_launches": n_direct,
            "max_rt": max(t.per_request_rt.values()),
            "loads": {k: round(v / n, 1) for k, v in sorted(kinds.items())},
            "bytes_per_request": round(t.bytes_traced / n),
            "launches": launches, "critical_rt": rt, "bytes": nbytes,
            "counted": [counts.triton_launches, counts.other_launches, counts.syncs,
                        counts.torch_ops],
            "cuda_items": list(cuda_items(counts)),
            "in_l2": footprint(case) <= FleetTimes().l2_bytes,
            "trace_s": round(t.seconds, 1),
        }  # fmt: skip
        # Each row as it is traced (a full run takes tens of minutes).
        print(f"row {json.dumps(out[f'{preset} B={B} E={E}'])}", file=sys.stderr,
              flush=True)  # fmt: skip
    return out


def report(which: str, json_path: str | None = None, sample: int = 8) -> dict:
    """Everything the module prints, as a dict (and printed)."""
    from kvhit.bench.gpu_model import tabulate

    ft = fit(FleetTimes()) if H200_FLEET_KERNEL else FleetTimes()
    direct = uses_direct_launch()
    rows = trace_rows(which, sample)
    table = []
    for r in rows.values():
        m = model_call(r["launches"], r["critical_rt"], r["bytes"],
                       tuple(r["cuda_items"]), r["direct_launches"], r["in_l2"],
                       ft)  # fmt: skip
        r["model"] = m
        table.append([
            r["preset"], r["B"], r["E"], f"{r['traced']}/{r['B']}", r["max_rt"],
            ", ".join(f"{k} {v:g}" for k, v in r["loads"].items()),
            f"{r['bytes_per_request'] / 1e3:.1f} KB",
            "/".join(str(x) for x in r["counted"]),
            "/".join(str(x) for x in r["cuda_items"]),
            r["critical_rt"], _us(m["device_s"]), _us(m["host_s"]), _us(m["total_s"]),
        ])  # fmt: skip
    print(tabulate(table, headers=[
        "preset", "B", "E", "traced", "max rt/request", "loads/request by kind",
        "bytes/request", "counted: triton/other/syncs/ops",
        "on CUDA: triton/other/syncs", "critical rt (call)",
        "device = graph (modelled)", "host (modelled)", "eager call (modelled)",
    ]), flush=True)  # fmt: skip
    out: dict = {"rows": rows, "times": asdict(ft), "direct_launch": direct}
    if H200_FLEET_KERNEL:
        cal = []
        for E, meas in H200_FLEET.items():
            launches, rt, nbytes, items = H200_FLEET_KERNEL[E]
            m = model_call(launches, rt, nbytes, items, False, True, ft)
            cal.append([E, _us(meas), _us(m["total_s"]), f"{m['total_s'] / meas:.2f}",
                        rt, _us(m["host_s"]), _us(m["device_s"])])  # fmt: skip
        print(
            f"\nfitted to the H200's fleet rows (a094dd7): round trip in L2 "
            f"{ft.t_rt_l2 * 1e6:.3f} us (host held: Python {ft.t_py * 1e6:.0f} us, "
            f"binder {ft.t_binder * 1e6:.0f} us, direct {ft.t_direct * 1e6:.0f} us, "
            f"op {ft.t_op * 1e6:.0f} us, sync {ft.t_sync * 1e6:.0f} us)"
        )
        print(tabulate(cal, headers=[
            "llama B = 64, E", "measured (a094dd7)", "modelled (a094dd7)",
            "model/measured", "critical rt", "host", "device",
        ]), flush=True)  # fmt: skip
        out["calibration"] = cal
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


def router_report(preset: str = "llama", requests: int = 64, engines: int = 64,
                  ft: FleetTimes | None = None) -> dict:  # fmt: skip
    """The eager call of ``fleet_lookup`` on CUDA by the general path and by
    the CUDA router path (:func:`router_call`), modelled with each path's
    Python **measured** here (:func:`host_python`) in place of ``t_py``, the
    items counted (general: :func:`cuda_items`; router:
    :data:`ROUTER_ITEMS`), the device part traced. Printed and returned."""
    from kvhit.bench.gpu_model import tabulate

    ft = fit(FleetTimes()) if ft is None else ft
    case = build_case(preset, requests, engines)
    py = host_python(case)
    t = trace_fleet(case, 8)
    launches, rt, nbytes = device_parts(t)
    general = cuda_items(call_counts(case))
    in_l2 = footprint(case) <= ft.l2_bytes
    rows, out = [], {}
    for name, items in (
        ("fleet_lookup", general),
        ("router (CUDA path)", ROUTER_ITEMS),
    ):
        m = model_call(launches, rt, nbytes, items, True, in_l2,
                       replace(ft, t_py=py[name]))  # fmt: skip
        out[name] = {"python_s": py[name], "items": list(items), **m}
        rows.append([name, _us(py[name]), "/".join(str(x) for x in items),
                     _us(m["host_s"]), _us(m["device_s"]), _us(m["total_s"])])  # fmt: skip
    print(f"\n{case.name}: the eager call by path (Python measured here, the launch "
          "stubbed; the rest modelled)")  # fmt: skip
    print(tabulate(rows, headers=["path", "Python (measured)", "triton/other/syncs",
                                  "host", "device = graph", "eager call"]),
          flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads only")
    parser.add_argument("--h200", action="store_true", help="the H200's rows only")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument(
        "--router",
        action="store_true",
        help="the eager call by path only (llama, B = 64, E = 64)",
    )
    parser.add_argument("--sample", type=int, default=8, help="requests traced")
    args = parser.parse_args(argv)
    if (error := interpret()) is not None:
        print(f"gpu_model_fleet: {error}", flush=True)
        return 1
    if args.router:
        router_report()
        return 0
    which = "quick" if args.quick else "h200" if args.h200 else "all"
    report(which, args.json, args.sample)
    return 0


if __name__ == "__main__":
    sys.exit(main())
