"""FleetIndex kernels on CUDA, in Triton: the joint full-attention scan of
:mod:`kvhit.kernels.fleet_numba` (runs and vLLM's hits of every request
against every engine, one launch), vLLM's whole rule for hybrid layouts
(every (request, engine) pair, one launch after the joint scan), and the
FleetIndex's ``FleetOps`` (the engine-set updates are
:mod:`kvhit.kernels.fleet_triton_bits`).

The tables are the FleetIndex's on a non-CPU device
(``coordinator/fleet_index.py``, STORAGE), two contiguous tensors:

* ``keys``: int64 ``[C, W + 1]``, a KeyIndex table (``coordinator/key_index.py``)
  of every key some engine holds, probed with
  :func:`kvhit.kernels.hash_index.find_slots` (plain reads: a lookup is
  stream-ordered after the mutations it must see);
* ``bits``: int64 ``[C, NW]``, ``NW = ceil(E / 64)``, the set of engines
  holding each slot's key (engine ``e`` is bit ``e % 64`` of word ``e // 64``).

The keys themselves are inserted, found and erased by the KeyIndex kernels of
:mod:`kvhit.kernels.hash_index` (the same layout), not by copies of them.

Design of the scan (:func:`full_hits`, :func:`full_runs`):

* **One program per request, one probe per block and member group for every
  engine.** A step probes ``BLOCK`` consecutive blocks of the request at once
  (for a merged SpecGroup, ``BLOCK`` lanes per member group in the same
  vector: ``MP * BLOCK`` lanes), then, for each 64-engine word of the engine
  set, ANDs the members' words of each block and finds, for each of the 64
  engines, its first block without the key (a ``[BLOCK, 64]`` bit matrix and a
  min over the blocks). The probes are shared by every word: E only adds
  words, not probes.
* **The runs live in the output row.** A request's state per engine is its
  run so far; an engine is still running iff its run equals the blocks
  scanned so far (and it is live), so no other state is kept, whatever E. The
  row is read back by the next step after a barrier (a CTA's threads may hold
  different elements). A word whose engines have all stopped is skipped, and
  the scan stops when no engine runs.
* **Hits in place.** After the scan the program turns its runs into vLLM's
  hits (``kernels/fleet_torch.hits_of_runs`` and the store worker's
  ``num_tokens - 1`` rule), as ``fleet_numba._full_hits`` does.
* **Integer division.** Triton's ``//`` and ``%`` truncate on a GPU and floor
  under the interpreter: every operand here is non-negative.

Hybrid layouts (:func:`hybrid_hits`: sliding window, Mamba, chunked local,
several SpecGroups, EAGLE, fine-grained hits) run one program per (request,
engine) with the engine's own rule, after the joint scan above when the
first SpecGroup is full attention, and from :data:`CLASS_MIN_ENGINES`
engines on one program per class of engines that must answer alike (the
classes found by one more launch, engines across lanes):
:mod:`kvhit.kernels.fleet_triton_hybrid` holds those kernels and their
design; :func:`hybrid_hits` here launches them, past Triton's binder
(:data:`DIRECT_KERNELS`).

Launchers take tensors on the tables' device and check their metadata (type,
dtype, shape, contiguity, device); the FleetIndex has checked the values.
:class:`FleetOps` is the FleetIndex's adapter (the same calls as the numba and
torch families').
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kvhit.kernels import fleet_torch, hash_index
from kvhit.kernels import scan as scan_rules
from kvhit.kernels.checks import check_int64, check_size
from kvhit.kernels.contract import CAND_WIDTH, SG_MEMBERS
from kvhit.kernels.fleet_probe import bit_and, probe_slots
from kvhit.kernels.fleet_triton_bits import (
    check_tables,
    clear_bits,
    clear_engine,
    probe_bits,
    set_bits,
)
from kvhit.kernels.fleet_triton_hybrid import class_kernel, hybrid_kernel
from kvhit.kernels.launch import (
    DirectLauncher,
    device_guard,
    fix_interpreter,
    int_key,
    interpreting,
)

__all__ = [
    "BLOCK",
    "CLASS_MIN_ENGINES",
    "CLASS_REGISTERS",
    "DIRECT_KERNELS",
    "NUM_WARPS",
    "SCAN_REGISTERS",
    "FleetOps",
    "clear_bits",
    "clear_engine",
    "fixed_split",
    "full_hits",
    "full_runs",
    "hybrid_hits",
    "probe_bits",
    "set_bits",
    "split_for",
]

# Triton 3.6's interpreter cannot range() over a runtime scalar (launch.py);
# once at import, as kernels/scan.py.
fix_interpreter()

# Blocks probed at once by one program (a tile): the lanes of a NUM_WARPS-warp
# program probe a tile's blocks together (their probe chains overlap), and
# the first miss of each engine in the tile is one min-reduction of a
# [BLOCK, 32] bit matrix per half engine word. 128 blocks over 4 warps: one
# lane per block, as the scan's wide tiles (issue 31); a merged SpecGroup of
# two probes 256 lanes. No spills on sm_90 (a whole word's [BLOCK, 64]
# matrix took 135 registers; tests/test_scan_registers.py).
BLOCK = 128
NUM_WARPS = 4
#: Registers of the scan's lookup variant (sm_90; Triton 3.9.0 / 3.6.0: 94 /
#: 96; merged SpecGroup 95 / 124): the tile's hash words and two slots' words
#: a probe step are held (80 before they were). 5 programs fit an SM.
#: ``bench/gpu_model_fleet.py`` counts resident programs with it.
SCAN_REGISTERS = 96
# Programs per request at most (SPLIT): a request's tiles are dealt to its
# programs in turn (program s of the request takes tiles s, s + SPLIT, ...),
# so a few long requests still fill every SM; see _split.
MAX_SPLIT = 16
# Programs the launcher aims at per SM when it picks SPLIT (resident 4-warp
# programs to hide the probe latency with).
_PROGRAMS_PER_SM = 4
#: Hybrid layouts after the joint scan: from this many engines on, engines
#: that must answer alike share one program of the rule
#: (``fleet_triton_hybrid.class_kernel``, a third launch); below it every
#: pair runs its own (``fleet_scoring.CLASS_MIN_ENGINES``' figure for the
#: numba fleet). ``bench/gpu_model_fleet.py``: dsv4-flash, B = 64, E = 64.
CLASS_MIN_ENGINES = 12
# Keys a class kernel's tile probes (a group's, at once), one a lane of 4
# warps. Its engines are taken one at a time (a [tile, 32] agreement matrix
# per half word took 255 registers and spilled).
_CLASS_BLOCK = 128
#: Registers of the class kernel, sm_90, no spills: 72 on Triton 3.6.0 (the
#: H200 machine's; 48 on 3.9.0, 64 at 64-key tiles there): 7 programs an SM.
#: ``bench/gpu_model_fleet.py`` counts resident programs with it, so it holds
#: the H200's compiler's figure, the larger one.
CLASS_REGISTERS = 72

_MODE_RUNS: tl.constexpr = tl.constexpr(0)
_MODE_FIND: tl.constexpr = tl.constexpr(1)
_MODE_LOOKUP: tl.constexpr = tl.constexpr(2)
# Slots a tile's later probe steps visit at once (the first step visits the
# home slot alone; kernels/fleet_probe.probe_slots), as the scan's table_has
# (kernels/scan_sg.py).
SPAN = 2
_SPAN: tl.constexpr = tl.constexpr(SPAN)


@triton.jit
def _block_words(bits_ptr, nw, t, slots, member, n_mem, MP: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """Word ``t`` of each block's engine set, ANDed over the member groups:
    int64 [BLOCK]. ``slots`` int64 [MP * BLOCK]: lane ``m * BLOCK + i`` is
    block ``i``'s slot in member ``m`` (-1: absent, or a block past the end);
    lanes of members ``>= n_mem`` are padding."""
    w = tl.load(bits_ptr + tl.where(slots >= 0, slots, 0) * nw + t, mask=slots >= 0,
                other=0)  # fmt: skip
    if MP == 1:
        return w
    # Padding members hold every engine (the AND's identity).
    w = tl.where(member < n_mem, w, -1)
    return tl.reduce(tl.reshape(w, (MP, BLOCK)), 0, bit_and)


@triton.jit
def _hit_of_run(run, bs, align, DROP: tl.constexpr):
    """``kernels/fleet_torch.hits_of_runs`` for runs (vLLM's
    full-attention hit, ``reference.full_attention_hit`` without the
    fine-grained tail; ``fleet_numba._hit_of_run``): ``run * bs``, less
    ``min(align, bs)`` under the EAGLE drop, aligned down. ``run >= 0``."""
    hit = run * bs
    if DROP:
        hit = tl.where(hit > 0, hit - tl.minimum(align, bs), 0)
    return hit - hit % align


@triton.jit
def _end_of(off_ptr, len_ptr, lens_ptr, r, scale, bs, align, MODE: tl.constexpr):
    """(offset, units, tokens, end) of request ``r``: ``end`` the blocks a run
    may reach (fleet_numba._full_hits' ``ends``)."""
    off = tl.load(off_ptr + r)
    n_units = tl.load(len_ptr + r)
    n_tok = tl.load(lens_ptr + r)
    if MODE == _MODE_RUNS:
        end = n_tok
    elif MODE == _MODE_LOOKUP:
        end = n_tok // align * align // bs
    else:
        end = n_tok // bs
    return off, n_units, n_tok, tl.minimum(end, n_units // scale)


@triton.jit(do_not_specialize=["split"])
def _fleet_kernel(
    keys_ptr,
    cap_mask,
    bits_ptr,
    rows_ptr,
    off_ptr,
    len_ptr,
    lens_ptr,
    mem_ptr,
    n_mem,
    live_ptr,
    out_ptr,
    n_eng,
    nw,
    scale,
    bs,
    align,
    split,
    W: tl.constexpr,
    MODE: tl.constexpr,
    DROP: tl.constexpr,
    MP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (r, s): tiles s, s + split, ... of request r. Each engine's
    first missing block found so far is kept in the output row as ``end -
    block`` (0: none yet, what the zeroed row says), lowered across programs
    with an atomic max, so the run is ``end - out`` whatever order the
    programs run in (``_finish_kernel``). A program reads the row back
    (volatile: other programs' misses too) and stops once no live engine can
    have its first miss at or past its next tile."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    off, n_units, n_tok, end = _end_of(off_ptr, len_ptr, lens_ptr, r, scale, bs,
                                       align, MODE)  # fmt: skip
    out_row = out_ptr + r * n_eng
    lane = tl.arange(0, 32)
    j = tl.arange(0, MP * BLOCK)
    blk_of = (j % BLOCK).to(tl.int64)
    member = j // BLOCK
    gids = tl.load(mem_ptr + member, mask=member < n_mem, other=0)
    step = tl.arange(0, BLOCK)[:, None]
    i0 = s * BLOCK
    going = i0 < end
    while going:
        blk = i0 + blk_of
        probe = (blk < end) & (member < n_mem)
        units = off + (blk + 1) * scale - 1
        slots = probe_slots(keys_ptr, cap_mask, gids, rows_ptr, units, probe, blk_of,
                            W, _SPAN, BLOCK, True)  # fmt: skip
        alive = (i0 * 0).to(tl.int32)
        for t in range(nw):
            # The word's engine sets of the tile's blocks, loaded once for
            # both halves, whatever engines still run (no branch on the
            # output row: its load would come before the words' on the
            # critical path).
            words = _block_words(bits_ptr, nw, t, slots, member, n_mem, MP, BLOCK)
            live_w = tl.load(live_ptr + t)
            # Half a word (32 engines) at a time, in 32-bit lanes: the
            # [BLOCK, 32] bit matrix keeps a 4-warp program under 128
            # registers (a whole word's: 135).
            for hq in tl.static_range(2):
                half = (words >> (hq * 32)).to(tl.int32)
                sh = lane + hq * 32
                e = t * 64 + sh
                em = e < n_eng
                # The first miss known so far (stale reads only cost work).
                known = end - tl.load(out_row + e, mask=em, other=0, volatile=True)
                # Engines whose first miss may still lie in this tile or past it.
                want = em & (known > i0) & (((live_w >> sh) & 1) == 1)
                held = ((half[:, None] >> lane[None, :]) & 1) != 0
                # Blocks past the end read no slot: a "miss" at ``end``, which
                # lowers nothing (end - end = 0).
                first = tl.min(tl.where(held, BLOCK, step), axis=0)
                tl.atomic_max(out_row + e, end - (i0 + first), mask=want & (first < BLOCK),
                              sem="relaxed")  # fmt: skip
                alive += tl.sum((want & (first == BLOCK)).to(tl.int32), axis=0)
        i0 += split * BLOCK
        going = (alive > 0) & (i0 < end)


@triton.jit
def _finish_kernel(
    off_ptr,
    len_ptr,
    lens_ptr,
    live_ptr,
    out_ptr,
    n_eng,
    nw,
    scale,
    bs,
    align,
    MODE: tl.constexpr,
    DROP: tl.constexpr,
):
    """Program r, after every ``_fleet_kernel`` program (a kernel boundary
    orders their atomics before these reads): the row's ``end - first miss``
    -> runs (dead engines 0) -> vLLM's hits, in place
    (fleet_numba._full_hits)."""
    r = tl.program_id(0).to(tl.int64)
    _, n_units, n_tok, end = _end_of(off_ptr, len_ptr, lens_ptr, r, scale, bs, align,
                                     MODE)  # fmt: skip
    out_row = out_ptr + r * n_eng
    lane = tl.arange(0, 64)
    # The store worker's rule (LOOKUP): a hit covering the whole prompt is
    # re-derived at num_tokens - 1 (``again``, aligned: the run clipped to
    # it), and a prompt whose aligned length is 0 hits nothing.
    again = tl.maximum(n_tok - 1, 0) // align * align
    asks = (n_units > 0) & (n_tok // align * align > 0)
    for t in range(nw):
        e = t * 64 + lane
        em = e < n_eng
        live = (tl.load(live_ptr + t) >> lane) & 1
        run = end - tl.load(out_row + e, mask=em, other=0)
        run = tl.where(live == 1, run, 0)
        if MODE == _MODE_RUNS:
            hit = run
        else:
            hit = _hit_of_run(run, bs, align, DROP)
        if MODE == _MODE_LOOKUP:
            hit2 = _hit_of_run(tl.minimum(run, again // bs), bs, align, DROP)
            hit = tl.where(hit >= n_tok, tl.where(again > 0, hit2, 0), hit)
            hit = tl.where(asks, hit, 0)
        tl.store(out_row + e, hit, mask=em)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Streaming multiprocessors per CUDA device (one query each).
_SM_COUNT: dict[torch.device, int] = {}
# Programs per request forced by fixed_split (the cost model), or None.
_FIXED_SPLIT: list[int] = []


def split_for(batch: int, sms: int) -> int:
    """Programs per request for ``batch`` requests on a GPU of ``sms`` SMs:
    enough for ``_PROGRAMS_PER_SM`` per SM over the batch, at most MAX_SPLIT
    (a power of two). Depends on B only, never on the lengths: no host
    sync."""
    want = -(-sms * _PROGRAMS_PER_SM // max(batch, 1))
    return min(_pow2(want), MAX_SPLIT)


@contextlib.contextmanager
def fixed_split(split: int) -> Iterator[None]:
    """Launch ``split`` programs per request while active, whatever the
    device (``bench/gpu_model_fleet.py`` traces a sample of a batch under
    the interpreter as the GPU would run the whole batch)."""
    _FIXED_SPLIT.append(check_size("split", split))
    try:
        yield
    finally:
        _FIXED_SPLIT.pop()


def _split(batch: int, device: torch.device) -> int:
    """:func:`split_for` on ``device`` (2 under the interpreter, so that the
    tests deal tiles to several programs; :func:`fixed_split` overrides)."""
    if _FIXED_SPLIT:
        return _FIXED_SPLIT[-1]
    if device.type != "cuda":
        return 2
    sms = _SM_COUNT.get(device)
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        _SM_COUNT[device] = sms
    return split_for(batch, sms)


# Device copies of the small constant arrays a launch takes as numpy (a
# SpecGroup's members, the live engine set), by value: a copy to the device
# is a synchronous host round trip, and the same few values recur on every
# call of a router.
_DEVICE_CONSTS: dict[tuple[bytes, torch.device], torch.Tensor] = {}


def _on_device(x: object, device: torch.device) -> object:
    """``x`` itself unless it is a numpy array: then an int64 tensor on
    ``device`` holding it (cached by value; read only)."""
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype != np.int64:
        raise TypeError(f"numpy arguments must be int64, got {x.dtype}")
    key = (x.tobytes() + bytes([x.ndim]), device)
    t = _DEVICE_CONSTS.get(key)
    if t is None:
        if len(_DEVICE_CONSTS) >= 256:
            _DEVICE_CONSTS.clear()
        t = torch.tensor(x, device=device)
        _DEVICE_CONSTS[key] = t
    return t


_DIRECT_FLEET = DirectLauncher()
_DIRECT_FINISH = DirectLauncher()


def _scan(mode: int, keys: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor,
          offsets: torch.Tensor, lengths: torch.Tensor, lens: torch.Tensor,
          members: torch.Tensor | np.ndarray, live: torch.Tensor | np.ndarray,
          num_engines: int, scale: int, block_size: int, alignment: int, drop: bool,
          lens_name: str) -> torch.Tensor:  # fmt: skip
    W, NW, dev = check_tables(keys, bits)
    rows = check_int64(rows, "rows", dim=2, device=dev, device_of="keys")
    if rows.shape[1] != W:
        raise ValueError(f"rows must have shape [T, {W}], got {list(rows.shape)}")
    B = check_int64(offsets, "offsets", dim=1, device=dev, device_of="keys").shape[0]
    for name, t in (("lengths", lengths), (lens_name, lens)):
        check_int64(t, name, dim=1, device=dev, device_of="keys")
        if t.shape[0] != B:
            raise ValueError(f"{name} must have shape [{B}], got {list(t.shape)}")
    members, live = _on_device(members, dev), _on_device(live, dev)
    M = check_int64(members, "members", dim=1, device=dev, device_of="keys").shape[0]
    if M < 1:
        raise ValueError("members must name at least one group")
    check_int64(live, "live", dim=1, device=dev, device_of="keys")
    if live.shape[0] != NW:
        raise ValueError(f"live must have shape [{NW}], got {list(live.shape)}")
    if isinstance(num_engines, bool) or not isinstance(num_engines, int):
        raise TypeError(f"num_engines must be an int, got {num_engines!r}")
    if not 0 < num_engines <= NW * 64 or num_engines <= (NW - 1) * 64:
        raise ValueError(f"num_engines must need exactly {NW} words, got {num_engines}")
    # Plain ints for the launch (numpy integers pass the check).
    return _launch_scan(mode, keys, bits, rows, offsets, lengths, lens, members,
                        live, num_engines, check_size("scale", scale),
                        check_size("block_size", block_size),
                        check_size("alignment", alignment), drop)  # fmt: skip


def _launch_scan(mode: int, keys: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor,
                 offsets: torch.Tensor, lengths: torch.Tensor, lens: torch.Tensor,
                 members: torch.Tensor | np.ndarray, live: torch.Tensor | np.ndarray,
                 num_engines: int, scale: int, block_size: int, alignment: int,
                 drop: bool) -> torch.Tensor:  # fmt: skip
    """:func:`_scan`'s launches, its arguments as it checks them, or as a
    FleetIndex and a batch's view built them: ``FleetOps`` (no validation,
    as every family's) skips the checks, 15-16 us of a ``fleet_lookup``'s
    Python (issue 32). The ints are plain ints."""
    dev, W, NW, B = keys.device, keys.shape[1] - 1, bits.shape[1], offsets.shape[0]
    members, live = _on_device(members, dev), _on_device(live, dev)
    M = members.shape[0]
    out = torch.zeros((B, num_engines), dtype=torch.int64, device=dev)
    if B == 0:
        return out
    split = _split(B, dev)
    # Past Triton's per-call binder (issue 32: the host path of a fleet
    # lookup): runtime arguments in signature order, then the constexprs;
    # the key is every specialised int's class (split is not specialised).
    ints = (keys.shape[0] - 1, M, num_engines, NW, scale, block_size, alignment)
    fleet_args = (keys, ints[0], bits, rows, offsets, lengths, lens, members, M,
                  live, out, num_engines, NW, scale, block_size, alignment, split)  # fmt: skip
    fleet_cx = {"W": W, "MODE": mode, "DROP": bool(drop), "MP": _pow2(M),
                "BLOCK": BLOCK}  # fmt: skip
    finish_args = (offsets, lengths, lens, live, out, num_engines, NW, scale,
                   block_size, alignment)  # fmt: skip
    finish_cx = {"MODE": mode, "DROP": bool(drop)}
    key = (tuple(fleet_cx.values()), int_key(ints))
    with device_guard(dev):
        _DIRECT_FLEET.launch(_fleet_kernel, (B, split), key, fleet_args, fleet_cx,
                             {"num_warps": NUM_WARPS}, dev)  # fmt: skip
        _DIRECT_FINISH.launch(_finish_kernel, B, key, finish_args, finish_cx,
                              {"num_warps": 1}, dev)  # fmt: skip
    return out


def full_hits(
    keys: torch.Tensor,
    bits: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    lens: torch.Tensor,
    members: torch.Tensor | np.ndarray,
    live: torch.Tensor | np.ndarray,
    params: Sequence[int],
    num_engines: int,
) -> torch.Tensor:
    """vLLM's full-attention hit of every request against every engine, one
    launch (:func:`kvhit.kernels.fleet_numba.full_hits` on the device
    tables): int64 ``[B, E]`` on the tables' device.

    ``keys`` int64 ``[C, W + 1]`` and ``bits`` int64 ``[C, NW]`` a
    FleetIndex's tables; ``rows`` int64 ``[T, W]``, ``offsets`` and
    ``lengths`` int64 ``[B]`` a batch's RaggedView; ``lens`` int64 ``[B]``,
    >= 0, the max lengths (or, ``lookup``, the prompt lengths); ``members``
    int64 ``[M]`` the SpecGroup's group ids; ``live`` int64 ``[NW]`` the
    active engines as an engine set; ``params``: (NW, scale, block size,
    alignment, EAGLE drop, lookup), as the numba launcher's. Every tensor
    contiguous, on the tables' device; ``members`` and ``live`` may be int64
    numpy arrays instead (copied to the device once per value, cached).
    """
    if len(params) != 6:
        raise ValueError(f"params must hold 6 ints, got {len(params)}")
    nw, scale, bs, align, drop, lookup = (int(p) for p in params)
    if nw != bits.shape[1]:
        raise ValueError(f"params[0] (NW) is {nw} but bits has {bits.shape[1]} words")
    mode = 2 if lookup else 1
    return _scan(mode, keys, bits, rows, offsets, lengths, lens, members, live,
                 num_engines, scale, bs, align, bool(drop), "lens")  # fmt: skip


def full_runs(
    keys: torch.Tensor,
    bits: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    ends: torch.Tensor,
    scale: int,
    members: torch.Tensor | np.ndarray,
    live: torch.Tensor | np.ndarray,
    num_engines: int,
) -> torch.Tensor:
    """Per request and engine, the leading run of blocks the engine holds in
    every member group (:func:`kvhit.kernels.fleet_numba.full_runs` on the
    device tables): int64 ``[B, E]``. Block ``i`` of request ``r`` is keyed
    by hash row ``offsets[r] + (i + 1) * scale - 1``; runs stop at
    ``min(ends[r], lengths[r] // scale)`` blocks (``ends`` int64 ``[B]``, >=
    0). Other arguments as :func:`full_hits`."""
    return _scan(0, keys, bits, rows, offsets, lengths, ends, members, live,
                 num_engines, scale, 1, 1, False, "ends")  # fmt: skip


# -- hybrid layouts: vLLM's whole rule per (request, engine), one launch ----------------


def hybrid_hits(
    table: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    lens: torch.Tensor,
    token_lens: torch.Tensor | None,
    sg_rows: torch.Tensor,
    cand_rows: torch.Tensor,
    plan_cands: torch.Tensor,
    live: torch.Tensor | np.ndarray,
    num_engines: int,
    params: Sequence[int],
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor | np.ndarray, int]
    | None = None,
) -> torch.Tensor:
    """vLLM's whole rule (any layout: sliding window, Mamba, chunked local,
    several SpecGroups, EAGLE, fine-grained hits) of every request against
    every engine, one launch, no host sync: int64 ``[B, E]`` on the table's
    device, 0 for dead engines. Entry ``[r, e]`` is what the engine's own
    scan (:func:`kvhit.kernels.scan.scan_hits`, or with ``lookup``
    :func:`kvhit.kernels.scan.worker_lookup`) answers for request ``r``
    against engine ``e``'s keys alone.

    ``table`` int64 ``[C, W + 1]``: the FleetIndex's entry index, a KeyIndex
    table of ``(g * E + e, hash)``; ``rows`` int64 ``[T, W]``, ``offsets``
    and ``lengths`` int64 ``[B]`` a batch's RaggedView; ``lens`` int64
    ``[B]``, >= 0: the max lengths (or, ``lookup``, the prompt lengths);
    ``token_lens`` int64 ``[B]`` or None: the view's worker restriction
    (find only); ``sg_rows`` int64 ``[E * S, SG_W]``: the plan's SpecGroup
    rows once per engine, members renamed ``g * E + e``; ``cand_rows`` int64
    ``[G * E, CAND_WIDTH]``: row ``v`` is group ``v // E``'s candidate row;
    ``plan_cands`` int64 ``[G, CAND_WIDTH]`` the plan's own; ``live`` int64
    ``[NW]`` the active engines as an engine set (or an int64 numpy array,
    copied once per value); ``params``: (hash block size, alignment,
    partial, simple hybrid, EAGLE drop, lookup). Every tensor contiguous, on
    the table's device; the plan rows are kvhit's (``coordinator/plan.py``),
    trusted.

    ``first``: None, or when the plan's first SpecGroup is full attention and
    not fine-grained, ``(keys, bits, members, scale)``: the FleetIndex's
    tables (as :func:`full_runs`') and that SpecGroup's group ids (int64
    ``[M]``) and scale. Then one launch of the joint scan first (its leading
    runs, engines across lanes, every probe shared by all engines) and the
    rule only for pairs whose run is not 0: two launches, still no host sync.
    With ``first`` and at least :data:`CLASS_MIN_ENGINES` engines, a third
    launch between them splits each request's engines into classes that must
    answer alike, and the rule runs once a class.
    """
    table = check_int64(table, "table", dim=2)
    dev = table.device
    cap, w1 = table.shape
    if cap < 1 or cap & (cap - 1) or w1 < 2:
        raise ValueError(
            f"table must have shape [capacity, W + 1], capacity a power of two, "
            f"W >= 1, got {list(table.shape)}"
        )
    W = w1 - 1
    rows = check_int64(rows, "rows", dim=2, device=dev, device_of="table")
    if rows.shape[1] != W:
        raise ValueError(f"rows must have shape [T, {W}], got {list(rows.shape)}")
    B = check_int64(offsets, "offsets", dim=1, device=dev, device_of="table").shape[0]
    for name, t in (("lengths", lengths), ("lens", lens), ("token_lens", token_lens)):
        if t is None and name == "token_lens":
            continue
        check_int64(t, name, dim=1, device=dev, device_of="table")
        if t.shape[0] != B:
            raise ValueError(f"{name} must have shape [{B}], got {list(t.shape)}")
    if isinstance(num_engines, bool) or not isinstance(num_engines, int):
        raise TypeError(f"num_engines must be an int, got {num_engines!r}")
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    nw = -(-num_engines // 64)
    live = check_int64(_on_device(live, dev), "live", dim=1, device=dev,
                       device_of="table")  # fmt: skip
    if live.shape[0] != nw:
        raise ValueError(f"live must have shape [{nw}], got {list(live.shape)}")
    n_sg, sg_w = check_int64(sg_rows, "sg_rows", dim=2, device=dev,
                             device_of="table").shape  # fmt: skip
    if n_sg < num_engines or n_sg % num_engines or sg_w <= SG_MEMBERS:
        raise ValueError(
            f"sg_rows must have shape [E * S, > {SG_MEMBERS}] (E = {num_engines}), "
            f"got {list(sg_rows.shape)}"
        )
    G = check_int64(plan_cands, "plan_cands", dim=2, device=dev,
                    device_of="table").shape[0]  # fmt: skip
    if G < 1 or plan_cands.shape[1] != CAND_WIDTH:
        raise ValueError(
            f"plan_cands must have shape [G >= 1, {CAND_WIDTH}], "
            f"got {list(plan_cands.shape)}"
        )
    check_int64(cand_rows, "cand_rows", dim=2, device=dev, device_of="table")
    if list(cand_rows.shape) != [G * num_engines, CAND_WIDTH]:
        raise ValueError(
            f"cand_rows must have shape [{G * num_engines}, {CAND_WIDTH}], "
            f"got {list(cand_rows.shape)}"
        )
    if len(params) != 6:
        raise ValueError(f"params must hold 6 ints, got {len(params)}")
    params = (check_size("params[0] (hash block size)", params[0]),
              check_size("params[1] (alignment)", params[1]),
              *(int(x) for x in params[2:]))  # fmt: skip
    if dev.type == "cpu" and not interpreting():
        raise ValueError(
            "table is on the CPU: the Triton kernels need a GPU, or "
            "TRITON_INTERPRET=1 set before triton is imported"
        )
    if first is not None:
        keys, bits, members, first_scale = first
        fw, fnw, fdev = check_tables(keys, bits)
        if fdev != dev or fw != W or fnw != nw:
            raise ValueError(
                f"first's tables must be a FleetIndex's on {dev} with W = {W} and "
                f"{nw} engine words, got W = {fw}, {fnw} words on {fdev}"
            )
        first_scale = check_size("first's scale", first_scale)
        members = check_int64(_on_device(members, dev), "first's members", dim=1,
                              device=dev, device_of="table")  # fmt: skip
        if members.shape[0] < 1:
            raise ValueError("first's members must name at least one group")
        first = (keys, bits, members, first_scale)
    return _launch_hybrid(table, rows, offsets, lengths, lens, token_lens, sg_rows,
                          cand_rows, plan_cands, live, num_engines, params, first)  # fmt: skip


def _launch_hybrid(table: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                   lengths: torch.Tensor, lens: torch.Tensor,
                   token_lens: torch.Tensor | None, sg_rows: torch.Tensor,
                   cand_rows: torch.Tensor, plan_cands: torch.Tensor,
                   live: torch.Tensor | np.ndarray, num_engines: int,
                   params: Sequence[int], first: tuple | None) -> torch.Tensor:  # fmt: skip
    """:func:`hybrid_hits`' launches, its arguments as it checks them, or as
    a FleetIndex, a batch's view and ``coordinator/plan.py`` built them:
    ``FleetOps`` (no validation, as every family's) skips the checks."""
    dev, B, W = table.device, offsets.shape[0], table.shape[1] - 1
    cap, nw = table.shape[0], -(-num_engines // 64)
    n_sg, sg_w, G = sg_rows.shape[0], sg_rows.shape[1], plan_cands.shape[0]
    live = _on_device(live, dev)
    hbs, align = int(params[0]), int(params[1])
    partial, simple, drop, lookup = (bool(int(x)) for x in params[2:])
    runs, first_scale = None, 1
    if first is not None:
        keys, bits, members, first_scale = first
        members, first_scale = _on_device(members, dev), int(first_scale)
    out = torch.zeros((B, num_engines), dtype=torch.int64, device=dev)
    if B == 0:
        return out
    S = n_sg // num_engines
    split = _split(B, dev)
    classes = first is not None and num_engines >= CLASS_MIN_ENGINES
    cls = out
    with device_guard(dev):
        if first is not None:
            # The joint scan's rows, left as ``end - first miss``
            # (_fleet_kernel: the runs unfinished, read by the rule's programs).
            runs = torch.zeros((B, num_engines), dtype=torch.int64, device=dev)
            M = members.shape[0]
            ints = (keys.shape[0] - 1, M, num_engines, nw, first_scale, 1, 1)
            cx = {"W": W, "MODE": 0, "DROP": False, "MP": _pow2(M), "BLOCK": BLOCK}
            _DIRECT_RUNS.launch(
                _fleet_kernel, (B, split), (tuple(cx.values()), int_key(ints)),
                (keys, ints[0], bits, rows, offsets, lengths, lengths, members, M,
                 live, runs, num_engines, nw, first_scale, 1, 1, split),
                cx, {"num_warps": NUM_WARPS}, dev,
            )  # fmt: skip
        if classes:
            # Every engine's class row starts as every engine (all ones).
            cls = torch.full((B, num_engines), -1, dtype=torch.int64, device=dev)
            ints = (keys.shape[0] - 1, num_engines, nw, S, first_scale, hbs)
            cx = {"W": W, "SG_W": sg_w, "BLOCK": _CLASS_BLOCK}
            _DIRECT_CLASS.launch(
                class_kernel, (B, split), (tuple(cx.values()), int_key(ints)),
                (keys, ints[0], bits, rows, offsets, lengths, runs, live, sg_rows,
                 cls, num_engines, nw, S, first_scale, hbs, split),
                cx, {"num_warps": NUM_WARPS}, dev,
            )  # fmt: skip
        ints = (cap - 1, first_scale, num_engines, S, G, hbs, align, int(partial),
                int(simple))  # fmt: skip
        cx = {"W": W, "HAS_RUNS": runs is not None, "HAS_CLASS": classes,
              "HAS_TL": lookup or token_lens is not None,
              "APPLY_EAGLE": drop or lookup, "LOOKUP": lookup,
              "BLOCK": scan_rules.BLOCK,
              "LEAD": scan_rules.BLOCK * scan_rules.LEAD_FACTOR, "S_PAD": _pow2(S),
              "SG_W": sg_w}  # fmt: skip
        _DIRECT_HYBRID.launch(
            hybrid_kernel, B * num_engines, (tuple(cx.values()), int_key(ints)),
            (rows, offsets, lengths, lens,
             token_lens if token_lens is not None else lengths,
             table, ints[0], sg_rows, cand_rows, plan_cands, live,
             runs if runs is not None else out, cls, first_scale, out, num_engines,
             S, G, hbs, align, ints[7], ints[8]),
            cx, {"num_warps": scan_rules.NUM_WARPS, "maxnreg": scan_rules.MAXNREG},
            dev,
        )  # fmt: skip
    return out


#: The kernels launched past Triton's binder on a GPU (``DirectLauncher``:
#: ~6 us a launch on the host instead of ~25); ``bench/gpu_model_fleet.py``
#: prices a call's launches by it.
DIRECT_KERNELS = ("_fleet_kernel", "_finish_kernel", "class_kernel", "hybrid_kernel")
# The hybrid path's launches past Triton's binder (as _scan's).
_DIRECT_RUNS = DirectLauncher()
_DIRECT_CLASS = DirectLauncher()
_DIRECT_HYBRID = DirectLauncher()


# -- the FleetIndex's table operations -----------------------------------------------


class FleetOps(fleet_torch.FleetOps):
    """The torch family's tables on CUDA (``auto_backend``'s rule), driven by
    Triton kernels: the KeyIndex kernels of :mod:`kvhit.kernels.hash_index`
    for the keys, this module's for the engine sets (adds, removes, clearing
    an engine) and the joint scans. Allocating stays torch ops, and the
    fleet's entry index is a torch KeyIndex (its few updates per call)."""

    find_kernel = staticmethod(hash_index.find)
    insert_kernel = staticmethod(hash_index.insert)
    set_bits_kernel = staticmethod(set_bits)
    clear_bits_kernel = staticmethod(clear_bits)
    probe_bits_kernel = staticmethod(probe_bits)
    # Every other layout (fleet_scoring.fleet_find): one launch over the
    # entry index, every (request, engine) pair (no validation: the
    # arguments are the FleetIndex's, its plan's and a batch's view).
    hybrid_hits = staticmethod(_launch_hybrid)

    @staticmethod
    def clear_engine(
        keys: torch.Tensor, bits: torch.Tensor, engine: int
    ) -> tuple[int, int]:
        """:func:`clear_engine`, one launch: (bits cleared, slots tombstoned)."""
        return clear_engine(keys, bits, engine)

    def full_runs(self, table: torch.Tensor, keys: torch.Tensor, bits: torch.Tensor,
                  rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                  ends: np.ndarray, scale: int, members: np.ndarray, live: np.ndarray,
                  active: torch.Tensor, num_engines: int) -> torch.Tensor:  # fmt: skip
        """:func:`full_runs` of a FleetIndex's tables and a batch's view
        (trusted): int64 ``[B, E]`` on the device."""
        return _launch_scan(0, keys, bits, rows, offsets, lengths,
                            torch.tensor(ends, device=keys.device), members, live,
                            num_engines, int(scale), 1, 1, False)  # fmt: skip

    def full_hits(self, table: torch.Tensor, keys: torch.Tensor, bits: torch.Tensor,
                  rows: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                  lens: torch.Tensor, members: np.ndarray, live: np.ndarray,
                  active: torch.Tensor, params: np.ndarray,
                  num_engines: int) -> torch.Tensor:  # fmt: skip
        """:func:`full_hits` of a FleetIndex's tables and a batch's view
        (trusted; ``params`` int64 ``[7]``, as ``fleet_numba.full_hits_checked``'s,
        the launcher takes E apart): int64 ``[B, E]`` on the device."""
        _, scale, bs, align, drop, lookup = (int(p) for p in params[:6])
        return _launch_scan(2 if lookup else 1, keys, bits, rows, offsets, lengths,
                            lens, members, live, num_engines, scale, bs, align,
                            bool(drop))  # fmt: skip
