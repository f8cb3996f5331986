"""Scoring: every request of a batch against every engine of a fleet, in one
call (``LookupEngine.fleet_hits`` / ``fleet_lookup``, through the fleet's
``router_hits`` and ``hits_unchecked``; the tables are
``coordinator/fleet_index.py``'s).

COST OF A LOOKUP
================

* Full attention (a layout whose only SpecGroup is full attention, not
  fine-grained; numba): one probe per block and member group, the engine sets
  ANDed block by block until no engine is left, then vLLM's closed-form
  full-attention hit per engine, all in one kernel call
  (``kernels/fleet_numba.full_hits_checked``: blocks loaded in tiles, hashes
  then a tight prefetch loop then the run logic on cached rows; the next
  request's first tile during this one's logic). The cost grows with the
  blocks scanned, not with E x blocks (E only adds ``ceil(E / 64)`` words per
  block and the ``[B, E]`` output). A router's call (a ``from_ints`` batch;
  lengths as a list, a tuple, numpy or a CPU tensor) is checked and answered
  by :func:`fleet_full_host` at the cost of one kernel dispatch; a
  router's Python lists (``LookupEngine.fleet_hit_array``) by
  :func:`fleet_lists_host`, one encode and one kernel call, no batch made.
* Every other layout (sliding window, Mamba, chunked local, several
  SpecGroups, fine-grained hits; numba): the single-engine numba scan of
  ``kernels/scan_numba.py`` (vLLM's whole rule) per (request, engine) pair
  that may hit, reading ``entries`` with the plan's group ids renamed ``g *
  E + e``. With a full-attention first SpecGroup only the engines holding a
  request's first block (any hash unit of it, fine-grained) may hit it, found
  with one joint probe per request; other pairs are 0. And there, for a
  request that at least :data:`CLASS_MIN_ENGINES` engines may hit, engines
  that must answer alike share one scan
  (``kernels/fleet_numba.engine_classes``): a scan reads keys only below the
  block ending the first SpecGroup's run (plus, under EAGLE, one proof
  margin: a later SpecGroup is scanned that far past the hit it is given),
  so engines are grouped by that run, then split by
  each key below it that some but not all of them hold, one probe per key
  for all engines. The cost is then the keys below the runs plus one scan
  per class: on the Mooncake trace, where engines share the prompts' first
  blocks and one engine holds a conversation's earlier turn, a handful of
  classes a request whatever E. Without a full-attention first SpecGroup
  every active engine is scanned (E x the single-engine scan).

Backends: what differs is a method of the fleet's kernel family
(``fleet.ops``, a ``FleetOps`` of ``kernels/fleet_*.py``), and whether that
family reads its table on the host (``fleet.host_table``: numba). numba runs
the compiled kernels above. With ``backend="torch"`` (any device) the joint
full-attention scan is torch ops (every block below the bound probed once,
no early stop, then ``[B, blocks, E]`` boolean ops), and other layouts probe
each (group, hash) of the batch once for all engines, then run the
LookupEngine's own backend (triton on CUDA) per engine over a small table of
the batch's keys that engine holds. On CUDA (``backend.auto_backend``'s
rule; the ``"triton"`` backend) the same tables are driven by Triton
kernels: keys inserted and found by ``kernels/hash_index.py``, engine sets
updated, and the joint full-attention scan (runs and hits in one launch)
and ``routing.prefix_blocks``' runs by ``kernels/fleet_triton.py``. Hybrid
layouts there take ``fleet_triton.hybrid_hits`` (the family's
``hybrid_hits``): one program per (request, engine) runs the LookupEngine's
own Triton rule over the entry index with the plan's groups renamed ``g * E
+ e`` (:func:`_fleet_plan_tensors`), after, for a full-attention first
SpecGroup, one joint scan that leaves only the pairs whose engine holds the
request's first block to scan: two launches a call, no host round trip, no
per-engine loop (the torch family's per-engine path stays for
``backend="torch"``).

This module reads a fleet through :class:`FleetTables` and imports no fleet
module (``fleet_index`` imports it).
"""

from __future__ import annotations

import functools
from array import array
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from kvhit.coordinator.int_lists import decoder_ready, encode_step
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import HashBatch
from kvhit.coordinator.plan import ScanPlan
from kvhit.kernels.checks import host_lengths
from kvhit.kernels.contract import KIND_FULL
from kvhit.kernels.fleet_torch import unpack_engines
from kvhit.kernels.hash_index_torch import new_table

if TYPE_CHECKING:
    from kvhit.coordinator.engine import LookupEngine

__all__ = [
    "CLASS_MIN_ENGINES",
    "FleetTables",
    "fleet_find",
    "fleet_full_host",
    "fleet_lists_host",
]


class FleetTables(Protocol):
    """What the scans read of a fleet (``fleet_index.FleetIndex``'s
    attributes, documented there); they never write it."""

    num_engines: int
    hash_bytes: int
    W: int
    NW: int
    table: torch.Tensor
    keys: torch.Tensor
    bits: torch.Tensor
    host_table: np.ndarray | None
    host_kernel: Any
    live: np.ndarray
    active_mask: torch.Tensor
    entries: KeyIndex
    ops: Any

    @property
    def device(self) -> torch.device: ...


def _full_path(plan: ScanPlan, lookup: bool) -> bool:
    """Whether the joint full-attention scan answers this layout exactly: one
    SpecGroup, full attention, not fine-grained (for the worker's lookup,
    every member group prefix-cacheable, so every probed key is one the
    worker asks about)."""
    if len(plan.spec_groups) != 1:
        return False
    sg = plan.spec_groups[0]
    if sg.kind != KIND_FULL or sg.fine:
        return False
    return not lookup or all(plan.candidates[g].cacheable for g in sg.group_ids)


class _HostPlan:
    """What the joint full-attention kernels need of one engine's plan, built once per
    plan: whether the joint full-attention scan answers it (``full`` for
    ``fleet_hits``, ``full_lookup`` for ``fleet_lookup``; see
    :func:`_full_path`), its member group ids (int64 ``[M]``) and the kernel's
    ``params`` for E engines and each (EAGLE drop, lookup) pair."""

    __slots__ = ("full", "full_lookup", "members", "use_eagle", "_params", "_base")

    def __init__(self, engine: LookupEngine) -> None:
        plan = engine.plan
        self.full = _full_path(plan, False)
        self.full_lookup = _full_path(plan, True)
        sg = plan.spec_groups[0]
        self.use_eagle = bool(sg.use_eagle)
        self.members = np.array(sg.group_ids, dtype=np.int64)
        self.members.flags.writeable = False
        self._base = (sg.scale, sg.block_size, plan.alignment)
        # (NW, E, drop, lookup) -> params int64 [7] (read-only)
        self._params: dict[tuple[int, int, bool, bool], np.ndarray] = {}

    def params(self, nw: int, num_engines: int, drop: bool, lookup: bool) -> np.ndarray:
        """``kernels/fleet_numba.full_hits_checked``'s params: (NW, scale,
        block size, alignment, EAGLE drop, lookup, E), int64 ``[7]``."""
        key = (nw, num_engines, drop, lookup)
        got = self._params.get(key)
        if got is None:
            got = np.array([nw, *self._base, drop, lookup, num_engines], dtype=np.int64)
            got.flags.writeable = False
            if len(self._params) >= 64:
                self._params.clear()
            self._params[key] = got
        return got


# id(plan) -> (plan, _HostPlan): keyed by identity (an engine keeps its plan),
# since hashing a ScanPlan costs more than a cold lookup; the plan held keeps
# its id from being reused.
_HOST_PLANS: dict[int, tuple[ScanPlan, _HostPlan]] = {}


def _host_plan(engine: LookupEngine) -> _HostPlan:
    plan = engine.plan
    got = _HOST_PLANS.get(id(plan))
    if got is not None and got[0] is plan:
        return got[1]
    if len(_HOST_PLANS) >= 64:
        _HOST_PLANS.clear()
    host = _HostPlan(engine)
    _HOST_PLANS[id(plan)] = (plan, host)
    return host


_INT64 = np.dtype(np.int64)

# (id(plan), NW, E, apply_eagle, lookup) -> (plan, engine device, member
# group ids, kernel params), or members None where the joint scan does not
# answer the layout or the engine is off the CPU: the router call's
# per-plan arguments in one dict lookup (the plan and device held keep
# their ids valid; a different engine device is looked up again).
_ROUTER_ARGS: dict[tuple, tuple] = {}


def _router_args(engine: LookupEngine, nw: int, num_engines: int, apply_eagle: bool,
                 lookup: bool) -> tuple:  # fmt: skip
    """:data:`_ROUTER_ARGS`' entry for this call, looked up (one dict
    lookup and two identity tests on the router's path) or built and
    remembered: ``(plan, engine device, members, params)``: the numba
    kernel's members (int64 numpy ``[M]``) and params (int64 numpy ``[7]``),
    or both None where the joint scan does not answer the layout or the
    engine is off the CPU (the host kernel must refuse the call: the general
    path takes it)."""
    plan = engine.plan
    got = _ROUTER_ARGS.get((id(plan), nw, num_engines, apply_eagle, lookup))
    if got is not None and got[0] is plan and got[1] is engine.device:
        return got
    host = _host_plan(engine)
    members = params = None
    if engine.device.type == "cpu" and (host.full_lookup if lookup else host.full):
        drop = host.use_eagle and (apply_eagle or lookup)
        params = host.params(nw, num_engines, drop, lookup)
        members = host.members
    if len(_ROUTER_ARGS) >= 256:
        _ROUTER_ARGS.clear()
    got = (engine.plan, engine.device, members, params)
    _ROUTER_ARGS[(id(engine.plan), nw, num_engines, apply_eagle, lookup)] = got
    return got


# (router kernel, lens an array('q'); None for the lists kernel) -> what
# fleet_full_host and fleet_lists_host call: the
# kernel's compiled wrapper for the types of the arguments it passes (the
# family's ``compiled_entry``; kvhit's own arrays, so every later call's are
# alike), remembered once the kernel has compiled or loaded them.
_KERNEL_CALLS: dict[tuple[Any, bool | None], Any] = {}


def _kernel_call(fleet: FleetTables, kernel: Any, q: bool | None, args: tuple) -> Any:
    """:data:`_KERNEL_CALLS`' entry for ``(kernel, q)`` (the kernel itself
    until then, or where the family has no compiled wrappers)."""
    entry = getattr(fleet.ops, "compiled_entry", None)
    call = kernel if entry is None else entry(kernel, *args)
    if call is not kernel:
        if len(_KERNEL_CALLS) >= 64:
            _KERNEL_CALLS.clear()
        _KERNEL_CALLS[(kernel, q)] = call
    return call


def fleet_full_host(
    fleet: FleetTables,
    engine: LookupEngine,
    batch: Any,
    lens: Any,
    apply_eagle: bool,
    lookup: bool,
) -> torch.Tensor | None:
    """``LookupEngine.fleet_hits`` / ``fleet_lookup`` (``lookup``) on the
    router's common path, checked and answered at the cost of one kernel
    dispatch (``FleetIndex.router_hits`` is this function): a CPU ``batch``
    (a :class:`HashBatch` whose host arrays exist, as
    :meth:`HashBatch.from_ints` builds them), a ``fleet`` of the batch's hash
    width whose family reads its table on the host (numba: a
    ``host_kernel``), a full-attention layout, and ``lens`` an int64 numpy
    array ``[B]``, a CPU int64 tensor, or a list or tuple of ints (handed to
    the kernel as an ``array('q')``, which its check reads). Returns int64
    ``[B, E]``, or None when any of that does not hold or an array's
    ``lens`` holds a negative value: the caller then takes the general path,
    which validates everything and raises naming the bad argument. A list
    or tuple that ``array('q')`` refuses, or with a length below 2 (a bool
    passes ``array('q')`` as 0 or 1), is checked again by
    ``kernels/checks.host_lengths``, the general path's own check, which
    raises here (the batch and fleet passed theirs) or gives the array the
    kernel then reads. Nothing is modified either way.

    A router scores each batch once, with caches cold: each further Python
    or torch call there costs ~10-40 us, as much as scanning a request. So
    every check here is a type or attribute test on objects kvhit built
    (the batch's host arrays, the fleet's table, the plan's parameters,
    cached per plan), and an array's values are checked inside the kernel.
    """
    kernel = fleet.host_kernel
    if (
        kernel is None
        or type(batch) is not HashBatch
        or batch.hash_bytes != fleet.hash_bytes
    ):
        return None
    got = _router_args(engine, fleet.NW, fleet.num_engines, apply_eagle, lookup)
    members, params = got[2], got[3]
    if members is None:
        return None
    try:
        # Cached on the batch (from_ints builds them); raises off the CPU.
        rows, offsets, lengths = batch.host_arrays()
    except ValueError:
        return None
    tl = type(lens)
    if tl is list or tl is tuple:
        # A router's lengths as it holds them. array('q') takes exactly the
        # ints in int64 (and bools, as 0 and 1), in one C pass; the kernel
        # takes it as it is and refuses any length below 2 before it reads
        # anything. Cold, this is a third of a numpy array's cost.
        if len(lens) == offsets.shape[0]:
            try:
                buf = array("q", lens)
            except (TypeError, OverflowError):
                buf = None
            if buf is not None:
                args = (fleet.host_table, rows, offsets, lengths, buf, members,
                        fleet.live, params)  # fmt: skip
                call = _KERNEL_CALLS.get((kernel, True))
                bad, out = (call or _kernel_call(fleet, kernel, True, args))(*args)
                if bad < 0:
                    return torch.from_numpy(out)
        # A length below 2 (a bool?), a non-int, a wrong count: the general
        # path's own check (the batch and the fleet are known good here, so
        # its error is the one the general path would raise), into a new
        # C-contiguous int64 array.
        lens = host_lengths(lens, "num_tokens" if lookup else "max_lengths",
                            offsets.shape[0])  # fmt: skip
    else:
        if tl is torch.Tensor:
            if (
                lens.dtype is not torch.int64
                or lens.layout is not torch.strided
                or lens.requires_grad
                or lens.is_cuda
            ):
                return None
            lens = lens.numpy() if lens.device.type == "cpu" else None
            if lens is None:
                return None
        elif tl is not np.ndarray or lens.dtype is not _INT64:
            return None
        if lens.ndim != 1 or lens.shape[0] != offsets.shape[0]:
            return None
        if not (lens.flags.c_contiguous and lens.flags.writeable):
            # numba compiles a kernel per array layout and write flag (~15 s
            # each on a fresh machine): a strided or read-only lens is copied
            # to the one form the kernel is compiled for (B ints; never
            # written).
            lens = lens.copy()
    args = (fleet.host_table, rows, offsets, lengths, lens, members, fleet.live,
            params)  # fmt: skip
    call = _KERNEL_CALLS.get((kernel, False))
    bad, out = (call or _kernel_call(fleet, kernel, False, args))(*args)
    return None if bad >= 0 else torch.from_numpy(out)


def fleet_lists_host(
    fleet: FleetTables,
    engine: LookupEngine,
    requests: list[Any],
    lens: Any,
    apply_eagle: bool,
    block_size: int,
) -> np.ndarray | None:
    """``LookupEngine.fleet_hit_array`` on the router's lists, in one encode
    and one kernel call (``FleetIndex.router_lists`` is this function):
    where :func:`fleet_full_host` would answer the batch ``from_ints`` makes
    of ``requests`` (a family with a lists kernel, numba's
    ``full_lists_hits``; 8-byte keys; a layout whose one SpecGroup is full
    attention, not fine-grained; a CPU engine), ``requests`` a list of
    lists and ``lens`` a list of ints or an integer numpy array
    (``int_lists.encode_step``), the step is written as msgpack and read,
    scanned and divided by ``block_size`` (an int >= 1) by the kernel, no
    HashBatch, tensor or lengths array made.
    ``block_size`` is trusted (``fleet_hit_array`` checked it). Returns
    int64 ``[B, E]`` hits in blocks, or None when any of that does not hold
    or the kernel refuses an item (not an int in int64, a negative length,
    a wrong count): the caller then takes the general path, which names the
    bad argument. Nothing is modified either way.

    Cold, as a router meets a step (caches evicted; B = 64 raw trace ids,
    one thread, both calls in one process), the call costs about half of
    ``fleet_hits(HashBatch.from_ints(...))``: the batch's packing (~170 us)
    and the answer's ``torch.from_numpy`` (~80 us) replaced by one encode
    (~65 us) of the lists the kernel reads."""
    kernel = getattr(fleet.ops, "lists_kernel", None)
    if kernel is None or fleet.hash_bytes != 8:
        # One int a key: from_ints' other widths check or widen each value.
        return None
    got = _router_args(engine, fleet.NW, fleet.num_engines, apply_eagle, False)
    members, params = got[2], got[3]
    if members is None:
        return None
    msg = encode_step(requests, lens)
    if msg is None:
        # A fleet built with warm=False beside an engine that loaded no
        # decoder: its kernels and the decoder loaded now (once), as a warm
        # fleet's construction loads them.
        warm_up = getattr(fleet.ops, "warm_up", None)
        if decoder_ready() or warm_up is None:
            return None
        warm_up()
        msg = encode_step(requests, lens)
        if msg is None:
            return None
    args = (msg, fleet.host_table, members, fleet.live, params, block_size)
    call = _KERNEL_CALLS.get((kernel, None))
    b, out = (call or _kernel_call(fleet, kernel, None, args))(*args)
    return None if b < 0 else out


def _engine_table(fleet: FleetTables, g: torch.Tensor, h: torch.Tensor) -> KeyIndex:
    """A read-only KeyIndex over a new table holding exactly keys (g, h)."""
    # The power of two above 2 * len(g): at most half full.
    table = new_table(1 << (2 * g.shape[0]).bit_length(), fleet.W, fleet.device)
    if g.shape[0]:
        fleet.ops.insert(table, fleet.W, g, h)
    return KeyIndex.from_table(table, fleet.hash_bytes)


def _fleet_generic(engine, view, lens, fleet, apply_eagle, lookup) -> torch.Tensor:
    B, E = len(view), fleet.num_engines
    dev = fleet.device
    rows = view.rows
    G = engine.plan.num_groups
    gids = torch.arange(G, dtype=torch.int64, device=dev)
    pb = fleet.ops.probe_bits(fleet.keys, fleet.bits, gids, rows)  # [G, T, NW]
    held = unpack_engines(pb, E).numpy()  # [G, T, E]
    held &= fleet.active_mask.numpy()[None, None, :]
    offs = view.offsets.cpu().numpy()
    lengths = view.lengths.cpu().numpy()
    # Row t -> request (rows may be shared by requests: a view of a batch
    # holds each request's rows once, in order).
    row_any = held.any(axis=0)  # [T, E]
    touches = np.zeros((B, E), dtype=bool)
    for r in range(B):
        if lengths[r]:
            touches[r] = row_any[offs[r] : offs[r] + lengths[r]].any(axis=0)

    def run(sub, sub_lens, index):
        if lookup:
            return engine.impl.lookup(sub, sub_lens, index)
        return engine.impl.find(sub, sub_lens, index, apply_eagle)[0]

    empty = _engine_table(fleet, gids[:0], rows[:0])
    base = run(view, lens, empty).cpu()
    out = base[:, None].repeat(1, E)
    out[:, ~fleet.active_mask] = 0
    e_idx, g_idx, t_idx = (
        np.ascontiguousarray(a) for a in np.nonzero(held.transpose(2, 0, 1))
    )
    bounds = np.searchsorted(e_idx, np.arange(E + 1))
    for e in np.flatnonzero(touches.any(axis=0)):
        lo, hi = bounds[e], bounds[e + 1]
        g = torch.from_numpy(g_idx[lo:hi]).to(dev)
        t = torch.from_numpy(t_idx[lo:hi]).to(dev)
        index = _engine_table(fleet, g, rows.index_select(0, t).contiguous())
        reqs = torch.from_numpy(np.flatnonzero(touches[:, e])).to(view.offsets.device)
        out[reqs.cpu(), int(e)] = run(view.select(reqs), lens[reqs], index).cpu()
    return out


@functools.lru_cache(maxsize=32)
def _engine_plans(plan: ScanPlan, E: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The plan rows that make the numba scan read engine ``e``'s entries:
    candidate rows for every virtual group ``v = g * E + e`` (row ``v`` is
    group ``v // E``'s) and, per engine, SpecGroup rows whose members are
    ``g * E + e``."""
    from kvhit.kernels.contract import CAND_GROUP_ID, SG_MEMBERS

    sg = np.array(plan.as_rows(), dtype=np.int64)
    cand = np.repeat(np.array(plan.candidates_as_rows(), dtype=np.int64), E, axis=0)
    cand[:, CAND_GROUP_ID] = np.arange(cand.shape[0])
    per_engine = []
    members = sg[:, SG_MEMBERS:]
    for e in range(E):
        rows = sg.copy()
        rows[:, SG_MEMBERS:] = np.where(members >= 0, members * E + e, members)
        per_engine.append(rows)
    return cand, per_engine


# (id(plan), E, device) -> (plan, its fleet rows on the device): keyed by
# identity as _HOST_PLANS (the plan held keeps its id from being reused).
_FLEET_PLAN_TENSORS: dict[tuple[int, int, torch.device], tuple[ScanPlan, tuple]] = {}


def _fleet_plan_tensors(
    plan: ScanPlan, E: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan as ``kernels/fleet_triton.hybrid_hits`` reads it for E
    engines, on ``device``, built once per (plan, E, device): ``sg_rows``
    int64 ``[E * S, SG_W]`` (:func:`_engine_plans`' per-engine rows, engine
    ``e``'s at row ``e * S``), ``cand_rows`` int64 ``[G * E, CAND_WIDTH]``
    (its candidate rows) and the plan's own candidate rows, int64 ``[G,
    CAND_WIDTH]`` (``plan.plan_tensors``'). A steady stream of calls copies
    nothing to the device."""
    key = (id(plan), E, torch.device(device))
    got = _FLEET_PLAN_TENSORS.get(key)
    if got is not None and got[0] is plan:
        return got[1]
    cand, per_engine = _engine_plans(plan, E)
    out = (
        torch.from_numpy(np.concatenate(per_engine)).to(device),
        torch.from_numpy(cand).to(device),
        torch.tensor(plan.candidates_as_rows(), dtype=torch.int64, device=device),
    )
    if len(_FLEET_PLAN_TENSORS) >= 64:
        _FLEET_PLAN_TENSORS.clear()
    _FLEET_PLAN_TENSORS[key] = (plan, out)
    return out


def _first_block_holders(plan, view, fleet) -> np.ndarray | None:
    """bool ``[B, E]``: engines that may hit each request at all, or None when
    the layout gives no such bound. With a full-attention first SpecGroup a
    hit needs the engine to hold (in every member group) block 0's key or,
    fine-grained, one hash unit of block 0: its scan is a leading run from
    block 0 (and the fine tail inside block 0), and the convergence loop
    never lets a later SpecGroup raise the hit above it
    (``reference.full_attention_hit``, ``ReferenceCoordinator._find``)."""
    sg = plan.spec_groups[0]
    if sg.kind != KIND_FULL:
        return None
    fscale = sg.block_size // plan.alignment if sg.fine else sg.scale
    first = 0 if sg.fine else fscale - 1
    offs = view.offsets.numpy()
    n_units = view.lengths.numpy()
    reqs, units = [], []
    for u in range(first, fscale):
        r = np.flatnonzero(n_units > u)
        reqs.append(r)
        units.append(offs[r] + u)
    req = np.concatenate(reqs)
    rows = view.rows[torch.from_numpy(np.concatenate(units))].contiguous()
    members = torch.tensor(sg.group_ids, dtype=torch.int64)
    pb = fleet.ops.probe_bits(fleet.keys, fleet.bits, members, rows)  # [M, R, NW]
    held = np.bitwise_and.reduce(pb, axis=0)
    words = np.zeros((len(view), fleet.NW), dtype=np.int64)
    np.bitwise_or.at(words, req, held)
    return unpack_engines(words, fleet.num_engines).numpy()


def _fleet_entries(engine, view, lens, fleet, apply_eagle, lookup) -> np.ndarray:
    """Every (request, engine) pair that may hit, by the engine's own numba
    scan over the entry index with the plan's groups renamed ``g * E + e``:
    vLLM's whole rule, exactly, at the cost of one single-engine scan per
    pair."""
    from kvhit.kernels import scan_numba

    plan = engine.plan
    B, E = len(view), fleet.num_engines
    cand, sg_rows = _engine_plans(plan, E)
    active = fleet.active_mask.numpy()
    sg = plan.spec_groups[0]
    runs = None
    if sg.kind == KIND_FULL and not sg.fine:
        # The first block held (in every member) is a leading run of >= 1.
        runs = _first_runs(plan, view, fleet)
        may = (runs > 0) & active
    else:
        may = _first_block_holders(plan, view, fleet)
        may = np.broadcast_to(active, (B, E)) if may is None else may & active
    out = np.zeros((B, E), dtype=np.int64)
    rows = view.rows.numpy()
    offs, lengths, lens_np = view.offsets.numpy(), view.lengths.numpy(), lens.numpy()
    table = fleet.entries.table.numpy()
    kw = dict(params=plan.params, parallel=False)
    rep = None
    if sg.kind == KIND_FULL and (may.sum(axis=1) >= CLASS_MIN_ENGINES).any():
        # Scan one engine per class of engines that must answer alike.
        if runs is None:
            runs = _first_runs(plan, view, fleet)
        rep = _engine_classes(plan, view, fleet, may, runs)
        may = rep == np.arange(E)[None, :]
    for e in np.flatnonzero(may.any(axis=0)):
        r = np.flatnonzero(may[:, e])
        args = (rows, offs[r], lengths[r], lens_np[r], sg_rows[e], cand)
        if lookup:
            out[r, e] = scan_numba.lookup_hits(*args, table=table, **kw)
        else:
            out[r, e] = scan_numba.find_hits(
                *args, table=table, token_lens=None, apply_eagle=apply_eagle, **kw
            )[0]
    if rep is not None:
        hit = rep >= 0
        out[hit] = np.take_along_axis(out, np.maximum(rep, 0), axis=1)[hit]
    return out


@functools.lru_cache(maxsize=32)
def _class_groups(plan: ScanPlan) -> tuple[np.ndarray, np.ndarray, int]:
    """Every group id of the plan and the step of the rows a scan may probe
    it at (its SpecGroup's scale; 1 when fine-grained): int64 ``[G]`` each;
    and how many hash units past the start of the first SpecGroup's run
    (full attention) a later SpecGroup's scan may read: the units of the
    first's hit past it (fine-grained: up to ``scale - 1``; else none),
    plus the largest EAGLE proof margin (a later SpecGroup under EAGLE is
    scanned that far past the hit it is given: ``ReferenceCoordinator._round``;
    ``fleet_numba.engine_classes``' ``reach_rows``)."""
    gids, steps = [], []
    for sg in plan.spec_groups:
        for g in sg.group_ids:
            gids.append(g)
            steps.append(1 if sg.fine else sg.scale)
    hbs = plan.hash_block_size
    first = plan.spec_groups[0]
    reach = max(-(-sg.margin // hbs) for sg in plan.spec_groups)
    reach += first.scale - 1 if first.fine else 0
    return np.array(gids, dtype=np.int64), np.array(steps, dtype=np.int64), reach


#: Hybrid layouts: a request that fewer engines than this may hit scans
#: every one of them; from this many on, engines that must answer alike
#: share one scan (``kernels/fleet_numba.engine_classes``). Below it the
#: classes (a probe per key a scan might read) cost more than the scans they
#: save (B = 64, Mooncake trace: they lose at E = 8, win from E = 16).
CLASS_MIN_ENGINES = 12


def _first_runs(plan, view, fleet) -> np.ndarray:
    """The first SpecGroup's (full attention) leading run of blocks per
    request and engine, unbounded: int64 ``[B, E]`` (one joint scan)."""
    from kvhit.kernels import fleet_numba

    sg = plan.spec_groups[0]
    lengths = view.lengths.numpy()
    return fleet_numba.full_runs(
        fleet.host_table, fleet.NW, view.rows.numpy(), view.offsets.numpy(), lengths,
        lengths // sg.scale, sg.scale, np.array(sg.group_ids, dtype=np.int64),
        fleet.live, fleet.num_engines,
    )  # fmt: skip


def _engine_classes(plan, view, fleet, may, runs) -> np.ndarray:
    """``kernels/fleet_numba.engine_classes`` for a plan whose first
    SpecGroup is full attention (``runs`` its :func:`_first_runs`): rep int64
    ``[B, E]``, the engine whose scan answers for ``(r, e)``, -1 where
    ``may`` is False."""
    from kvhit.kernels import fleet_numba

    gids, steps, reach = _class_groups(plan)
    return fleet_numba.engine_classes(
        fleet.host_table, fleet.NW, view.rows.numpy(), view.offsets.numpy(),
        view.lengths.numpy(), runs, np.ascontiguousarray(may),
        plan.spec_groups[0].scale, reach, gids, steps, CLASS_MIN_ENGINES,
    )  # fmt: skip


def fleet_find(
    engine: LookupEngine,
    batch: HashBatch,
    lens: torch.Tensor,
    fleet: FleetTables,
    apply_eagle: bool = True,
    lookup: bool = False,
) -> torch.Tensor:
    """Every request against every engine of ``fleet``: int64 ``[B, E]`` on
    the engine's device. Entry ``[b, e]`` is what ``engine`` answers for
    request ``b`` against engine ``e``'s keys alone: its
    ``find_longest_cache_hit(...).hit_lengths`` at ``max_length = lens[b]``
    or, with ``lookup``, its ``lookup`` of a ``lens[b]``-token prompt (the
    store worker's rule). Inactive engines' columns are 0.

    Inputs are trusted (``LookupEngine.fleet_hits`` / ``fleet_lookup`` check
    them): ``batch`` on the engine's device, ``lens`` int64 ``[B]`` >= 0
    there, ``fleet`` as ``fleet_index.check_fleet`` requires.
    """
    B, E = len(batch), fleet.num_engines
    if B == 0:
        return torch.zeros((0, E), dtype=torch.int64, device=engine.device)
    view = batch.view()
    if _full_path(engine.plan, lookup):
        # The joint scan and vLLM's hits, by the fleet's kernel family.
        host = _host_plan(engine)
        drop = host.use_eagle and (apply_eagle or lookup)
        params = host.params(fleet.NW, E, drop, lookup)
        return fleet.ops.full_hits(
            fleet.table, fleet.keys, fleet.bits, view.rows, view.offsets,
            view.lengths, lens, host.members, fleet.live, fleet.active_mask, params,
            E,
        ).to(engine.device)  # fmt: skip
    if fleet.host_table is not None:
        # A family that reads its tables on the host (numba): the numba scan
        # of each pair over the entry index, as a numba KeyIndex.
        return torch.from_numpy(
            _fleet_entries(engine, view, lens, fleet, apply_eagle, lookup)
        )
    hybrid = getattr(fleet.ops, "hybrid_hits", None)
    if hybrid is not None:
        # A family with a kernel for the whole rule (Triton): every (request,
        # engine) pair in one launch over the entry index, no host sync.
        plan = engine.plan
        sg_rows, cand_rows, plan_cands = _fleet_plan_tensors(plan, E, fleet.device)
        drop = bool(apply_eagle) and not lookup
        params = (plan.hash_block_size, plan.alignment, int(plan.partial),
                  int(plan.simple_hybrid), int(drop), int(lookup))  # fmt: skip
        sg = plan.spec_groups[0]
        first = None
        if sg.kind == KIND_FULL and not sg.fine:
            # Only engines holding a request's first block may hit it
            # (_first_block_holders): the joint scan's runs say which.
            first = (fleet.keys, fleet.bits, _host_plan(engine).members, sg.scale)
        return hybrid(
            fleet.entries.table, view.rows, view.offsets, view.lengths, lens,
            None if lookup else view.token_lens, sg_rows, cand_rows, plan_cands,
            fleet.live, E, params, first,
        ).to(engine.device)  # fmt: skip
    out = _fleet_generic(engine, view, lens, fleet, apply_eagle, lookup)
    return out.to(engine.device)
