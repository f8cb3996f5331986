"""The LookupEngine's CPU kernel: every request's longest cache hit, compiled by numba.

The numba twin of :mod:`kvhit.kernels.scan` (the Triton kernel): one program
per request runs the whole scalar rule of vLLM 0.33.0's
``MooncakeStoreCoordinator.find_longest_cache_hit`` for that request (the
per-kind scans, the multi-SpecGroup convergence loop with ``eagle_verified``,
the EAGLE proof margin that Mamba never gets, the simple-hybrid early exit and
the final full-attention truncation), probing the KeyIndex table from inside
the program; :func:`lookup_hits` runs the store worker's whole ``lookup`` rule
(both searches) the same way. One compiled call answers a batch.

Why it looks like this (one compiled signature, scratch per request, probes
inlined and prefetched, threads by work): ARCHITECTURE.md, "The numba
scan's design".

Probes past a request's hashes are misses (the reference raises there). Each
rule that re-spells a rule of ``coordinator/reference.py`` names the reference
function it mirrors.

Importing this module imports numba (the numba backend imports it lazily).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numba
import numpy as np

from kvhit.kernels.checks import (
    check_host_requests,
    check_plan_rows,
    check_plan_shapes,
    check_size,
    table_capacity,
)
from kvhit.kernels.contract import (
    EMPTY,
    KIND_FULL,
    KIND_MAMBA,
    KIND_SWA,
    SG_BLOCK_SIZE,
    SG_KIND,
    SG_MARGIN,
    SG_MEMBERS,
    SG_N_MEMBERS,
    SG_NEED,
    SG_USE_EAGLE,
    PlanParams,
)
from kvhit.kernels.msgpack_numba import warm_up as msgpack_warm_up
from kvhit.kernels.numba_cache import lock_cache_saves
from kvhit.kernels.numba_entry import compiled_entry
from kvhit.kernels.probe_numba import (
    COUNT_COLS,
)
from kvhit.kernels.scan_numba_sg import (
    COUNTING_BIT,
    JIT,
    NEVER,
    PREFETCH_BIT,
    RUN_STRETCH,
    any_candidate,
    candidate_limits,
    jit_cdiv,
    prefetch_windows,
    scan_sg,
)

# Before anything here compiles: see kernels/numba_cache.py.
lock_cache_saves()

__all__ = [
    "FIND",
    "FIND_EAGLE",
    "LOOKUP",
    "PARALLEL_MIN_HASHES",
    "PARALLEL_MIN_REQUESTS",
    "PREFETCH_MIN_REQUESTS",
    "PREFETCH_MIN_TABLE_BYTES",
    "ScanPrep",
    "batch_hits",
    "count_probes",
    "find_hits",
    "lookup_hits",
    "one_entry",
    "prefetching",
    "prepare_scan",
    "run_side",
    "warm_up",
    "scan_prepared_hits",
    "scan_one",
    "scan_prepared",
    "threaded",
]


# From this many requests on, the launcher threads over requests (``prange``;
# ``KVHIT_NUMBA_PARALLEL_MIN`` overrides it). Measured on the 2-core CI machine
# (dsv4-flash lookups): when the machine is quiet two threads win from 64
# requests on (B = 64: 0.066 vs 0.100 ms, B = 1024: 0.80 vs 1.40 ms), but when
# other processes keep the cores busy each threaded call stalls 8-16 ms waiting
# for a descheduled worker, while the serial loop stays at 1.4 ms for 1024
# requests. Below 1024 requests the gain is at most tens of microseconds, so
# only large batches take that risk.
def _env_int(name: str, default: int) -> int:
    """``int(os.environ[name])`` (``default`` when unset); a value that is not
    a non-negative int is an error naming the variable."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {text!r}")
    return value


PARALLEL_MIN_REQUESTS = _env_int("KVHIT_NUMBA_PARALLEL_MIN", 1024)
# From this many hashes in a batch on (``KVHIT_NUMBA_PARALLEL_MIN_HASHES``
# overrides it), a batch of two requests or more runs on threads whatever its
# request count: the work to split is the hashes to scan, so 64 long-hit
# requests (150K hashes, ~0.2 ms on one core) are threaded while a step of
# 64 short ones (a few thousand) stays serial. ``_batch_parallel`` splits the
# batch by hashes too. The same caveat as above holds: on a host whose cores
# other processes keep busy a threaded call can stall for milliseconds
# (measured on the shared 2-core machine at B = 64 long-hit: from 4.9x faster
# than one thread to 3.5x slower, call to call); a value past any batch
# (``KVHIT_NUMBA_PARALLEL_MIN_HASHES=1000000000``, with the request bound) or
# ``NUMBA_NUM_THREADS=1`` keeps every batch serial.
PARALLEL_MIN_HASHES = _env_int("KVHIT_NUMBA_PARALLEL_MIN_HASHES", 65536)

# Scratch columns per SpecGroup of one request.
_ST_HIT = 0
_ST_LEN = 1
_ST_LO = 2
_ST_VERIFIED = 3
# The last scan's EAGLE drop, bound, and the least bound its answer holds for.
_ST_DROP = 4
_ST_BOUND = 5
_ST_KEEP = 6
_ST_COLS = 7


# From this many requests on (``KVHIT_NUMBA_PREFETCH_MIN`` overrides it), and
# on a table of at least PREFETCH_MIN_TABLE_BYTES, the scans prefetch a
# sliding window's blocks before probing them and a leading run's next
# RUN_STRETCH blocks (see prefetch_blocks). Measured on this 2-core box,
# one thread, thread CPU time, side by side with the scans without it:
# long-hit 1.1x at B = 2048 and 1.25-1.3x at B = 4096 (40 and 80 MB
# tables); but 0.8-0.95x at B = 64, where what a batch touches stays in
# cache. Stretches of 4 and 16 were no better than 8. On a table the
# last-level cache holds it depends on whether it is still there when the
# call comes: answering the same batch again (the table cached), skipping
# it was 1.2-1.3x on 5-20 MB tables (dsv4-flash, gemma3, qwen3-next at
# B = 1024, the trace's full attention); after 64 MB of other traffic it
# was 0.75x (long-hit B = 1024, 20 MB), 0.9x (trace, 8 MB), 0.96-1.07x
# (the others). Below a quarter of that cache (qwen3-next's 5 MB: 1.2x
# cached, 1.06x after the traffic) a table is taken to stay there.
# Below 128 requests it depends on whether the call's requests are new
# (``python -m kvhit.bench.ab_scan --pool 4096 [--fresh]``, 4096-request
# stores, prefetching from one request on against this default): requests
# drawn afresh for each call, as a scheduler's new arrivals, long-hit gains
# 1.28-1.6x at B = 1-64, the serving presets 0.9-1.08x; the same requests
# every call (how ``kvhit bench`` times a batch), long-hit 0.93-1.02x and
# the serving presets 0.8-0.95x. So the default stays, and a deployment of
# long hits on a large store sets KVHIT_NUMBA_PREFETCH_MIN=1.
PREFETCH_MIN_REQUESTS = _env_int("KVHIT_NUMBA_PREFETCH_MIN", 128)


def _l3_bytes() -> int:
    # The last-level cache of this machine (32 MB here), from sysfs.
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        shift = {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
        return int(text[:-1] if shift else text) << shift
    except (OSError, ValueError):
        return 32 << 20


# The least table size (bytes) that is prefetched: a quarter of the
# last-level cache (``KVHIT_NUMBA_PREFETCH_MIN_BYTES`` overrides it).
PREFETCH_MIN_TABLE_BYTES = _env_int("KVHIT_NUMBA_PREFETCH_MIN_BYTES", _l3_bytes() // 4)


def prefetching(n_req: int, table: np.ndarray) -> bool:
    """Whether a call of ``n_req`` requests on ``table`` prefetches (read at
    call time, so a change to the two thresholds applies to the next call)."""
    return n_req >= PREFETCH_MIN_REQUESTS and table.nbytes >= PREFETCH_MIN_TABLE_BYTES


# -- one request -------------------------------------------------------------------


@numba.njit(**JIT)
def _find_one(max_len, off, n_units, glim, has_tl, apply_eagle, rows, table,
              has_index, sg, cand, hbs, align, partial, simple_hybrid,
              st):  # fmt: skip
    """One request's hit; each SpecGroup's result in ``st`` (int64
    ``[S, _ST_COLS]``). Mirrors ``ReferenceCoordinator._find`` (a lone
    SpecGroup: one scan of ``max_length``, no proof margin)."""
    n_sg = sg.shape[0]
    multi = n_sg > 1
    for idx in range(n_sg):
        st[idx, _ST_VERIFIED] = 0
        st[idx, _ST_KEEP] = NEVER
    hit_length = max_len
    full_done = False
    while True:
        curr = hit_length
        for idx in range(n_sg):
            kind = sg[idx, SG_KIND]
            if kind == KIND_FULL and full_done:
                # Full attention is scanned once; later rounds only clip it.
                curr = min(curr, st[idx, _ST_HIT])
                continue
            drop = (
                apply_eagle
                and sg[idx, SG_USE_EAGLE] != 0
                and st[idx, _ST_VERIFIED] == 0
            )
            bound = curr
            # EAGLE may peek one proof margin past the hit and drop back;
            # never a Mamba group, whose state there would be unverified.
            if multi and drop and kind != KIND_MAMBA:
                bound = min(curr + sg[idx, SG_MARGIN], n_units * hbs)
            # Bounds only shrink as the loop goes on, so a confirming round
            # rescans only what can change (as TorchScanner's rescan cache).
            reuse = False
            if full_done and (kind == KIND_SWA or kind == KIND_MAMBA):
                keep = st[idx, _ST_KEEP]
                was_drop = st[idx, _ST_DROP] != 0
                below = bound <= st[idx, _ST_BOUND]
                reuse = below and drop == was_drop and bound >= keep
                # An EAGLE run ending at block j (hit j * bs), once verified:
                # the plain scan under a bound in [j * bs, (j + 1) * bs) finds
                # the run ending at j - 1 inside it, with the same hit and
                # (need >= 1) the same mask.
                bs = sg[idx, SG_BLOCK_SIZE]
                if (
                    not reuse
                    and below
                    and kind == KIND_SWA
                    and sg[idx, SG_NEED] >= 1
                    and not drop
                    and was_drop
                    and keep != NEVER
                    and keep - bs <= bound < keep
                ):
                    reuse = True
            if reuse:
                hit = st[idx, _ST_HIT]
            else:
                hit, length, lo, keep = scan_sg(idx, bound, drop, sg, off,
                                                 n_units, glim, has_tl, rows,
                                                 table, has_index, cand, partial,
                                                 hbs, align)  # fmt: skip
                st[idx, _ST_HIT] = hit
                st[idx, _ST_LEN] = length
                st[idx, _ST_LO] = lo
                st[idx, _ST_KEEP] = keep
                st[idx, _ST_DROP] = 1 if drop else 0
                st[idx, _ST_BOUND] = bound
                if kind == KIND_FULL and has_index & PREFETCH_BIT:
                    prefetch_windows(idx + 1, hit, apply_eagle, sg, off, n_units,
                                      rows, hbs)  # fmt: skip
            if drop:
                st[idx, _ST_VERIFIED] = 1
            elif hit < curr:
                for k in range(n_sg):
                    st[k, _ST_VERIFIED] = 0
            curr = hit
        full_done = True
        if not multi:
            # A lone SpecGroup's scan is the answer.
            return curr
        if curr >= hit_length:
            break
        hit_length = curr
        if simple_hybrid:
            break
    for idx in range(n_sg):
        if sg[idx, SG_KIND] == KIND_FULL:
            # Full attention keeps only the blocks of the common hit.
            st[idx, _ST_LEN] = min(
                st[idx, _ST_LEN], jit_cdiv(hit_length, sg[idx, SG_BLOCK_SIZE])
            )
    return hit_length


# Flags and sizes of one call (an int64 vector, so that every call has one
# signature and the dispatcher types few arguments).
_P_HAS_TL = 0
_P_HAS_INDEX = 1
_P_APPLY_EAGLE = 2
_P_LOOKUP = 3
_P_HBS = 4
_P_ALIGN = 5
_P_PARTIAL = 6
_P_SIMPLE_HYBRID = 7
_P_PREFETCH = 8
_P_COUNT = 9
_P_COLS = 10
# The header of ScanPrep.one (n_sg, sg width, groups, cand width, home slots).
_ONE_HEAD = 5


@numba.njit(**JIT)
def _request(r, rows, offsets, lengths, token_lengths, token_lens, table, sg, cand, prm,
             hit, mask_spans, scratch, gscr):  # fmt: skip
    """Request ``r``: its hit at ``max_length = token_lengths[r]`` (and its load-mask
    spans in ``mask_spans``), or, in lookup mode, the store worker's ``lookup`` of a
    ``token_lengths[r]``-token prompt (reference ``ReferenceCoordinator.lookup``):
    only the keys it asks about at the aligned prompt length count; a hit
    covering the whole prompt is re-derived at ``num_tokens - 1`` with the
    candidate restriction still at that length."""
    lookup = prm[_P_LOOKUP] != 0
    hbs = prm[_P_HBS]
    align = prm[_P_ALIGN]
    partial = prm[_P_PARTIAL] != 0
    simple_hybrid = prm[_P_SIMPLE_HYBRID] != 0
    off = offsets[r]
    n_units = lengths[r]
    st = scratch[r]
    max_len = token_lengths[r]
    glim = gscr[r]
    counting = prm[_P_COUNT] != 0
    if counting:
        # count_probes' counter columns start at zero, for a request that
        # asks about no key too.
        for c in range(cand.shape[0], glim.shape[0]):
            glim[c] = 0
    if lookup:
        n_tok = max_len
        token_len = n_tok // align * align
        has_tl = True
        # Bits: 1 probe the index, PREFETCH_BIT prefetch, COUNTING_BIT count.
        has_index = 1 + PREFETCH_BIT * (prm[_P_PREFETCH] != 0) + COUNTING_BIT * counting
        apply_eagle = True
        hit[r] = 0
        if n_units <= 0 or token_len <= 0:
            return
        candidate_limits(n_units, token_len, cand, partial, hbs, glim)
        if not any_candidate(glim, cand, partial):
            return
        max_len = token_len
    else:
        n_tok = 0
        has_tl = prm[_P_HAS_TL] != 0
        token_len = token_lens[r] if has_tl else 0
        has_index = prm[_P_HAS_INDEX] * (1 + PREFETCH_BIT * (prm[_P_PREFETCH] != 0))
        apply_eagle = prm[_P_APPLY_EAGLE] != 0
        if has_tl:
            candidate_limits(n_units, token_len, cand, partial, hbs, glim)
    h = 0
    for _ in range(2):
        h = _find_one(max_len, off, n_units, glim, has_tl, apply_eagle, rows,
                      table, has_index, sg, cand, hbs, align, partial,
                      simple_hybrid, st)  # fmt: skip
        if not lookup or h < n_tok:
            break
        max_len = (n_tok - 1) // align * align
        if max_len <= 0:
            h = 0
            break
    hit[r] = h
    if lookup:
        return
    for idx in range(sg.shape[0]):
        length = st[idx, _ST_LEN]
        for k in range(sg[idx, SG_N_MEMBERS]):
            gid = sg[idx, SG_MEMBERS + k]
            mask_spans[r, gid, 0] = length
            mask_spans[r, gid, 1] = st[idx, _ST_LO]
            mask_spans[r, gid, 2] = length


# -- batch loops: serial and threaded twins ---------------------------------------------


@numba.njit(**JIT)
def _batch_serial(rows, offsets, lengths, token_lengths, token_lens, table, sg, cand, prm,
                  hit, mask_spans, scratch, gscr):  # fmt: skip
    for r in range(offsets.shape[0]):
        _request(r, rows, offsets, lengths, token_lengths, token_lens, table, sg, cand,
                 prm, hit, mask_spans, scratch, gscr)  # fmt: skip


@numba.njit(inline="always", cache=True, nogil=True)
def _plan_views(plan, k, n, head):
    """``(sg, cand, prm, mask_spans, scratch, gscr, front)`` for ``n``
    requests from ``plan`` (``ScanPrep.one``) and ``k`` (which parameter
    vector: 2 * mode + prefetch): the plan's arrays as C views of it
    (unit-step slices of a C array, reshaped, stay C arrays: the one
    signature of _request and _batch_serial), and the requests' spans and
    scratch views of one NRT allocation, whose first ``head`` words are
    ``front``. The spans are written (find mode) but not returned."""
    n_sg, w_sg, n_groups, w_cand = plan[0], plan[1], plan[2], plan[3]
    at = _ONE_HEAD
    sg = plan[at : at + n_sg * w_sg].reshape((n_sg, w_sg))
    at += n_sg * w_sg
    cand = plan[at : at + n_groups * w_cand].reshape((n_groups, w_cand))
    at += n_groups * w_cand + k * _P_COLS
    prm = plan[at : at + _P_COLS]
    n_gscr = n_groups + plan[4] if prm[_P_PREFETCH] != 0 else n_groups
    n_st = n_sg * _ST_COLS
    buf = np.empty(head + n * (3 * n_groups + n_st + n_gscr), np.int64)
    at = head + n * 3 * n_groups
    mask_spans = buf[head:at].reshape((n, n_groups, 3))
    scratch = buf[at : at + n * n_st].reshape((n, n_sg, _ST_COLS))
    gscr = buf[at + n * n_st :].reshape((n, n_gscr))
    return sg, cand, prm, mask_spans, scratch, gscr, buf[:head]


# One request, the call a scheduler step of one makes: its arguments are the
# rows, the table, the plan packed in one array (ScanPrep.one) and the mode
# (the dispatcher or numba's entry unboxes each array, ~0.1 us apiece: three
# plan arrays cost two more than one; a launcher's np.empty costs ~0.15 us),
# its per-request arrays views of one NRT allocation made here, and its hit
# returned as an int (boxing an array costs ~0.4 us).
@numba.njit(cache=True, nogil=True)
def _batch_one(values, max_len, table, plan, k):  # fmt: skip
    # The rows ``[T, W]`` as a C view of their words ``values`` (a one-request
    # batch of 8-byte keys hands its int64 [T] values as they are, W = 1).
    w = table.shape[1] - 1
    rows = values.reshape((values.shape[0] // w, w))
    sg, cand, prm, mask_spans, scratch, gscr, front = _plan_views(plan, k, 1, 4)
    # Unit-step slices of a C array stay C arrays: _request's one signature.
    starts = front[0:1]
    starts[0] = 0
    lengths = front[1:2]
    lengths[0] = rows.shape[0]
    token_lengths = front[2:3]
    token_lengths[0] = max_len
    hit = front[3:4]
    # np.int64(0), not 0: a literal 0 is typed Literal[int](0), and numba would
    # compile _request a second time (~10 s on a fresh machine) for it.
    _request(np.int64(0), rows, starts, lengths, token_lengths, starts, table, sg, cand,
             prm, hit, mask_spans, scratch, gscr)  # fmt: skip
    return hit[0]


# A serial batch's hits alone (scan_prepared_hits): _batch_one's packed plan
# and one NRT allocation for the scratch, then one call of the serial loop
# (compiled without reference counts), so a call unboxes eight arguments,
# not thirteen, and Python makes only the hits array (boxing a returned one
# costs more): a step of two requests 2.76 -> 2.11 us, eight 3.78 -> 3.06.
@numba.njit(cache=True, nogil=True)
def batch_hits(rows, starts, lengths, token_lengths, table, plan, k, hit):  # fmt: skip
    """The serial batch's hits into ``hit`` (int64 ``[R]``): :func:`scan_prepared`'s
    contract (no checks), the plan ``ScanPrep.one`` and ``k`` = 2 * mode +
    prefetch, as :func:`scan_prepared_hits` hands them. Also called from
    other numba kernels (``scan_numba_lists``)."""
    n = starts.shape[0]
    sg, cand, prm, mask_spans, scratch, gscr, _ = _plan_views(plan, k, n, 0)
    # starts stands in for token_lens, which no mode of a prepared plan reads.
    _batch_serial(rows, starts, lengths, token_lengths, starts, table, sg, cand, prm,
                  hit, mask_spans, scratch, gscr)  # fmt: skip


# Runs of requests a threaded batch is cut into: four per thread numba
# starts with (a constant, so that the loop caches; a process that lowers its
# thread count later only gets more runs per thread).
_RUNS = 4 * numba.config.NUMBA_NUM_THREADS


@numba.njit(inline="always", cache=True, nogil=True)
def run_side(before, length, c, k, total):
    """Where a request lies against run ``c`` of ``k`` of a threaded batch:
    -1 before it, 0 in it, 1 past it. The request has ``length`` hashes and
    ``before`` work ahead of it in the batch (each request's work is its
    hashes plus one), ``total`` work in all; run ``c`` takes the requests
    whose work is centred in ``[c, c + 1) * total / k`` (doubled to stay in
    ints). Centres increase with the request, so each request is in exactly
    one run and, past a run, every later request is past it too."""
    at = (2 * before + length + 1) * k
    if at < 2 * c * total:
        return -1
    if at >= 2 * (c + 1) * total:
        return 1
    return 0


@numba.njit(parallel=True, cache=True, nogil=True)
def _batch_parallel(rows, offsets, lengths, token_lengths, token_lens, table, sg, cand,
                    prm, hit, mask_spans, scratch, gscr):  # fmt: skip
    # Threads take runs of requests of equal work (hashes), not equal request
    # counts: a batch of a few long prompts among short ones is spread evenly.
    # Four runs per thread let a thread that was descheduled fall behind
    # without the others waiting for its whole share.
    # A request's work is its hashes plus one (the fixed cost of a request
    # with none); run c takes the requests whose work is centred in its
    # share (run_side). By its start instead, each run would also take the
    # request across its end whole: at B = 64 long-hit the first thread then
    # got up to 5 % more than half the work (1.55x one thread; centred, the
    # halves are within 1 %). Each run finds its requests in one pass over
    # the lengths (O(B) adds, nothing allocated).
    n = offsets.shape[0]
    k = min(n, _RUNS)
    total = 0
    for r in range(n):
        total += lengths[r] + 1
    for c in numba.prange(k):
        before = 0
        for r in range(n):
            side = run_side(before, lengths[r], c, k, total)
            before += lengths[r] + 1
            if side < 0:
                continue
            if side > 0:
                break
            _request(r, rows, offsets, lengths, token_lengths, token_lens, table, sg,
                     cand, prm, hit, mask_spans, scratch, gscr)  # fmt: skip


# -- launchers -----------------------------------------------------------------------


_THREADS_AVAILABLE = numba.config.NUMBA_NUM_THREADS > 1


def _homes_cols(sg: np.ndarray) -> int:
    # Per request, room for the home slots of the longest stretch or window
    # prefetch_blocks hashes (a sliding window's need, EAGLE included), per
    # member; a longer one is not kept (its probes hash again).
    need = int(sg[:, SG_NEED].max()) + 1
    return max(RUN_STRETCH, need) * int(sg[:, SG_N_MEMBERS].max())


def threaded(n_req: int, n_hashes: int, parallel: bool | None) -> bool:
    """Whether a batch of ``n_req`` requests and ``n_hashes`` hashes runs on
    numba's threads: forced by ``parallel``, else by its work (see
    :data:`PARALLEL_MIN_HASHES`)."""
    if parallel is None:
        return (
            _THREADS_AVAILABLE
            and n_req >= 2
            and (n_hashes >= PARALLEL_MIN_HASHES or n_req >= PARALLEL_MIN_REQUESTS)
        )
    return bool(parallel)


def _c64(a: np.ndarray) -> np.ndarray:
    # One compiled specialisation: C-contiguous, writeable int64 everywhere
    # (numba types a read-only array apart and would compile again).
    if a.dtype == np.int64 and a.flags.c_contiguous and a.flags.writeable:
        return a
    return np.array(a, dtype=np.int64, order="C")


# The modes of :func:`scan_prepared`.
FIND = 0
FIND_EAGLE = 1
LOOKUP = 2


class ScanPrep:
    """What every call of one plan shares, checked once (:func:`prepare_scan`):
    the plan's rows, a parameter vector per mode and prefetch setting, the
    same packed in one int64 array for :func:`scan_one` (``one``), and the
    placeholders of the arguments a mode does not read. Never written: calls on
    several threads may share one (each call allocates its own outputs and
    scratch, since the kernels release the GIL)."""

    __slots__ = ("cand", "n_groups", "n_homes", "n_sg", "no_tl", "one", "prm", "sg",
                 "tri_empty", "tri_written")  # fmt: skip

    def __init__(self, sg: np.ndarray, cand: np.ndarray, prm: tuple,
                 tri_written: bool) -> None:  # fmt: skip
        self.sg, self.cand, self.prm = sg, cand, prm
        self.n_sg, self.n_groups = sg.shape[0], cand.shape[0]
        self.n_homes = _homes_cols(sg)
        # What scan_one hands _batch_one, and scan_prepared_hits
        # batch_hits: the header, the rows of sg and
        # cand, and the parameter vectors (prm[mode][pf] at 2 * mode + pf),
        # all in one int64 array: one array to unbox per call, not three.
        head = (self.n_sg, sg.shape[1], self.n_groups, cand.shape[1], self.n_homes)
        self.one = np.concatenate(
            [np.array(head, np.int64), sg.ravel(), cand.ravel()]
            + [v for by_pf in prm for v in by_pf]
        )
        self.no_tl = np.zeros(1, np.int64)
        # Lookup mode writes no spans: an empty array keeps the one signature.
        self.tri_empty = np.zeros((0, self.n_groups, 3), np.int64)
        self.tri_written = tri_written
        # Not marked read-only: numba types a read-only array apart, so each
        # would compile another specialisation of the batch loops.


def prepare_scan(
    sg_rows: np.ndarray,
    cand_rows: np.ndarray,
    params: PlanParams | None = None,
    *,
    hash_block_size: int | None = None,
    alignment: int | None = None,
    partial: bool | None = None,
    simple_hybrid: bool | None = None,
) -> ScanPrep:
    """Check a plan's rows once and build what :func:`scan_prepared` reads.

    Args:
        sg_rows: int64 ``[S, SG_MEMBERS + M]`` (``ScanPlan.as_rows()``).
        cand_rows: int64 ``[G, CAND_WIDTH]``, one row per group.
        params: the plan's scalar parameters (``ScanPlan.params``), the
            value type every scan family takes; or, without it, the four
            that this family reads as keywords:
        hash_block_size, alignment, partial, simple_hybrid: from the ScanPlan.

    Raises ValueError when a row array has the wrong shape or a value the
    kernels cannot read (``checks.check_plan_rows``), or a size is not an int
    >= 1 (TypeError when it is not an int).
    """
    if params is not None:
        hash_block_size, alignment = params.hash_block_size, params.alignment
        partial, simple_hybrid = params.partial, params.simple_hybrid
    sg = np.array(sg_rows, dtype=np.int64, order="C")  # a private copy
    cand = np.array(cand_rows, dtype=np.int64, order="C")
    check_plan_shapes(sg, cand)
    check_size("hash_block_size", hash_block_size)
    check_size("alignment", alignment)
    check_plan_rows(sg, cand, int(alignment))
    hbs, align = int(hash_block_size), int(alignment)
    part, simple = bool(partial), bool(simple_hybrid)
    prm = tuple(
        tuple(
            _params(False, True, mode == FIND_EAGLE or mode == LOOKUP,
                    mode == LOOKUP, hbs, align, part, simple, pf).copy()
            for pf in (False, True)
        )
        for mode in (FIND, FIND_EAGLE, LOOKUP)
    )  # fmt: skip
    # find mode writes every span of a group inside a SpecGroup; when every
    # group is inside one, the spans need no zeroing.
    members = {int(sg[i, SG_MEMBERS + k]) for i in range(sg.shape[0])
               for k in range(int(sg[i, SG_N_MEMBERS]))}  # fmt: skip
    return ScanPrep(sg, cand, prm, members == set(range(cand.shape[0])))


def scan_prepared(
    prep: ScanPrep,
    rows: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    token_lengths: np.ndarray,
    table: np.ndarray,
    mode: int,
    parallel: bool | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`find_hits` (``mode`` :data:`FIND` or :data:`FIND_EAGLE`, the
    EAGLE drop applied) or :func:`lookup_hits` (:data:`LOOKUP`) with **no
    checks**, for arrays kvhit built itself: every array C-contiguous int64,
    ``rows [T, W]``, ``offsets``, ``lengths`` and ``token_lengths`` (>= 0) ``[R]``,
    ``table [C, W + 1]`` (a KeyIndex table). Anything else gives wrong answers
    or reads out of bounds, not errors: the public functions check first.

    Returns ``(hit int64 [R], mask_spans int64 [R, G, 3])``, ``mask_spans`` None in lookup
    mode; both fresh arrays.
    """
    n = offsets.shape[0]
    if not token_lengths.flags.writeable:
        # A caller's read-only lengths (np.frombuffer, setflags): numba types
        # a read-only array apart and would compile the loops again (seconds,
        # on the first such call of a process).
        token_lengths = token_lengths.copy()
    if mode == LOOKUP:
        mask_spans = prep.tri_empty
    elif prep.tri_written:
        mask_spans = np.empty((n, prep.n_groups, 3), np.int64)
    else:
        mask_spans = np.zeros((n, prep.n_groups, 3), np.int64)
    # Every request's hit is written (lookup mode zeroes it first).
    hit = np.empty(n, np.int64)
    sg, cand = prep.sg, prep.cand
    fn = _batch_parallel if threaded(n, rows.shape[0], parallel) else _batch_serial
    # prefetching(), spelled out: a one-request call skips the table test.
    pf = n >= PREFETCH_MIN_REQUESTS and table.nbytes >= PREFETCH_MIN_TABLE_BYTES
    fn(rows, offsets, lengths, token_lengths, prep.no_tl, table, sg, cand,
       prep.prm[mode][pf], hit, mask_spans,
       np.empty((n, prep.n_sg, _ST_COLS), np.int64),
       np.empty((n, prep.n_groups + (prep.n_homes if pf else 0)), np.int64))  # fmt: skip
    return hit, (None if mode == LOOKUP else mask_spans)


#: ``_batch_one``'s and ``batch_hits``' compiled wrappers for their one
#: signature (C-contiguous int64 arrays, int64 scalars), each held once numba
#: has it (empty until then; see :func:`_entry`).
_ONE_ENTRY: list[Any] = []
_HITS_ENTRY: list[Any] = []


def _entry(held: list[Any], dispatcher: Any, *like: Any) -> Any:
    """What :func:`scan_one` (``_batch_one``) and :func:`scan_prepared_hits`
    (``batch_hits``) call: numba's compiled wrapper for the one signature
    of the example arguments ``like``, which skips the dispatcher's typing
    (~0.2 us of a ~2 us step of one request), or the dispatcher itself
    until that signature is compiled or loaded (or where a numba release
    keeps its overloads elsewhere); ``held`` keeps the wrapper once found.
    The skip is safe because the callers pass only kvhit's own arrays, of
    exactly that signature."""
    if held:
        return held[0]
    entry = compiled_entry(dispatcher, *like)
    if entry is not dispatcher:
        held.append(entry)
    return entry


def _one_entry() -> Any:
    a1, a2 = np.empty(1, np.int64), np.empty((1, 1), np.int64)
    return _entry(_ONE_ENTRY, _batch_one, a1, 0, a2, a1, 0)


def _hits_entry() -> Any:
    a1, a2 = np.empty(1, np.int64), np.empty((1, 1), np.int64)
    return _entry(_HITS_ENTRY, batch_hits, a2, a1, a1, a1, a2, a1, 0, a1)


def one_entry(prep: ScanPrep) -> Any:
    """The callable :func:`scan_one` hands its arguments to, for a caller
    that holds it: ``fn(values, max_len, table, prep.one, 2 * mode + pf)``
    (``values`` the rows' words, int64 ``[T * W]``, C-contiguous; ``pf``
    whether it prefetches, :func:`prefetching`), with the contract of
    :func:`scan_one` (no checks). Loads (or compiles) the program first
    if need be (a call of ``prep``'s on no hashes), so that the caller holds
    the compiled entry, not the dispatcher."""
    if not _ONE_ENTRY:
        table = np.zeros((2, 2), np.int64)
        table[:, 0] = EMPTY
        scan_one(prep, np.zeros((0, 1), np.int64), 0, table, FIND)
    return _one_entry()


def scan_one(
    prep: ScanPrep, rows: np.ndarray, max_len: int, table: np.ndarray, mode: int
) -> int:
    """:func:`scan_prepared` of one request that owns every row of ``rows``,
    at ``max_len`` (an int in ``[0, 2**63)``), with **no checks** (not even
    the dispatcher's typing): its hit (``mode`` :data:`FIND` or
    :data:`FIND_EAGLE`) or tokens to load (:data:`LOOKUP`), as an int.
    ``rows`` int64 ``[T, W]`` and ``table`` int64 ``[C, W + 1]``, both
    C-contiguous: anything else reads memory wrongly, not an error. The
    mask spans are not returned (:func:`scan_prepared` gives them)."""
    # prefetching(1, table), spelled out (the thresholds read at call time).
    pf = PREFETCH_MIN_REQUESTS <= 1 and table.nbytes >= PREFETCH_MIN_TABLE_BYTES
    fn = _ONE_ENTRY[0] if _ONE_ENTRY else _one_entry()
    return fn(rows.reshape(-1), max_len, table, prep.one, 2 * mode + pf)


def scan_prepared_hits(
    prep: ScanPrep,
    rows: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    token_lengths: np.ndarray,
    table: np.ndarray,
    mode: int,
    parallel: bool | None = None,
) -> np.ndarray:
    """:func:`scan_prepared`'s hits alone, int64 ``[R]`` (a fresh array),
    with its contract (**no checks**: kvhit's own C-contiguous int64 arrays,
    not even the dispatcher's typing): a serial batch in one compiled call
    that makes its scratch itself; a threaded one through
    :func:`scan_prepared`."""
    n = offsets.shape[0]
    if threaded(n, rows.shape[0], parallel):
        return scan_prepared(prep, rows, offsets, lengths, token_lengths, table,
                             mode, True)[0]  # fmt: skip
    # prefetching(), spelled out.
    pf = n >= PREFETCH_MIN_REQUESTS and table.nbytes >= PREFETCH_MIN_TABLE_BYTES
    fn = _HITS_ENTRY[0] if _HITS_ENTRY else _hits_entry()
    hit = np.empty(n, np.int64)
    fn(rows, offsets, lengths, token_lengths, table, prep.one, 2 * mode + pf, hit)
    return hit


def _run(rows, offsets, lengths, token_lengths, token_lens, table, sg_rows, cand_rows,
         prm, mask_spans, parallel, counters=0):  # fmt: skip
    n_req = offsets.shape[0]
    hit = np.zeros(n_req, dtype=np.int64)
    if n_req == 0:
        # count_probes answers a pair for an empty batch too.
        return (hit, np.zeros((0, counters), np.int64)) if counters else hit
    scratch = np.empty((n_req, sg_rows.shape[0], _ST_COLS), dtype=np.int64)
    # Per group one candidate limit, then count_probes' ``counters`` or the
    # prefetching scans' home slots.
    extra = counters or (_homes_cols(sg_rows) if prm[_P_PREFETCH] else 0)
    gscr = np.empty((n_req, cand_rows.shape[0] + extra), dtype=np.int64)
    fn = _batch_parallel if threaded(n_req, rows.shape[0], parallel) else _batch_serial
    fn(_c64(rows), _c64(offsets), _c64(lengths), _c64(token_lengths), token_lens, table,
       sg_rows, cand_rows, prm, hit, mask_spans, scratch, gscr)  # fmt: skip
    if counters:
        return hit, gscr[:, cand_rows.shape[0] :].copy()
    return hit


@functools.lru_cache(maxsize=256)
def _params(has_tl, has_index, apply_eagle, lookup, hbs, align, partial, simple,
            prefetch, count=False):  # fmt: skip
    # Cached: a steady stream of calls reuses one (read-only) vector.
    prm = np.zeros(_P_COLS, dtype=np.int64)
    prm[_P_HAS_TL] = has_tl
    prm[_P_HAS_INDEX] = has_index
    prm[_P_APPLY_EAGLE] = apply_eagle
    prm[_P_LOOKUP] = lookup
    prm[_P_HBS] = hbs
    prm[_P_ALIGN] = align
    prm[_P_PARTIAL] = partial
    prm[_P_SIMPLE_HYBRID] = simple
    prm[_P_PREFETCH] = prefetch
    prm[_P_COUNT] = count
    return prm


def find_hits(
    rows: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    max_lengths: np.ndarray,
    sg_rows: np.ndarray,
    cand_rows: np.ndarray,
    *,
    table: np.ndarray | None,
    token_lens: np.ndarray | None,
    params: PlanParams,
    apply_eagle: bool,
    parallel: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Longest cache hit and load-mask spans of every request, one call.

    Args:
        rows: int64 ``[T, W]``, every request's hash words.
        offsets: int64 ``[R]``, first row of each request.
        lengths: int64 ``[R]``, hash units of each request.
        max_lengths: int64 ``[R]`` (>= 0).
        sg_rows: int64 ``[S, SG_MEMBERS + M]`` (``ScanPlan.as_rows()``).
        cand_rows: int64 ``[G, CAND_WIDTH]``, one row per group.
        table: the KeyIndex table, int64 ``[C, W + 1]`` (``C`` a power of two),
            or None: every key present.
        token_lens: None, or int64 ``[R]``: only keys the store worker asks
            about at that lookup length count as present.
        params: the plan's scalar parameters (``ScanPlan.params``);
            ``num_groups`` is checked but not read (``cand_rows`` has G rows).
        apply_eagle: apply the EAGLE last-block drop.
        parallel: threads over requests (True), a serial loop (False), or by
            batch size (None: from :data:`PARALLEL_MIN_REQUESTS` requests).

    Returns:
        ``(hit int64 [R], mask_spans int64 [R, G, 3])``: per group the load mask as
        ``(length, lo, hi)`` (zeros for groups outside every SpecGroup).

    Raises TypeError for an argument of the wrong type or dtype, ValueError
    for a wrong shape, a size below 1 or a plan-row value the kernels cannot
    read (``checks.check_plan_rows``), each naming the argument.
    """
    sg_rows, cand_rows = _c64(sg_rows), _c64(cand_rows)
    check_plan_shapes(sg_rows, cand_rows)
    per_request = [("lengths", lengths), ("max_lengths", max_lengths)]
    if token_lens is not None:
        per_request.append(("token_lens", token_lens))
    params = check_host_requests(rows, offsets, per_request, params)
    check_plan_rows(sg_rows, cand_rows, params.alignment)
    n_req = offsets.shape[0]
    mask_spans = np.zeros((n_req, cand_rows.shape[0], 3), dtype=np.int64)
    has_index = table is not None
    tab = _c64(table) if has_index else np.zeros((1, rows.shape[1] + 1), np.int64)
    if has_index:
        table_capacity(tab.shape, rows.shape[1])
    has_tl = token_lens is not None
    token_lens64 = _c64(token_lens) if has_tl else np.zeros(1, np.int64)
    prm = _params(has_tl, has_index, bool(apply_eagle), False, *params[1:],
                  prefetching(n_req, tab))  # fmt: skip
    hit = _run(rows, offsets, lengths, max_lengths, token_lens64, tab, sg_rows, cand_rows,
               prm, mask_spans, parallel)  # fmt: skip
    return hit, mask_spans


def lookup_hits(
    rows: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    num_tokens: np.ndarray,
    sg_rows: np.ndarray,
    cand_rows: np.ndarray,
    *,
    table: np.ndarray,
    params: PlanParams,
    parallel: bool | None = None,
) -> np.ndarray:
    """The store worker's ``lookup`` for every request, one call: int64
    ``[R]`` tokens to load for prompts of ``num_tokens`` (int64 ``[R]``, >= 0)
    tokens. Arguments as :func:`find_hits` (``table`` is required)."""
    return _lookup(rows, offsets, lengths, num_tokens, sg_rows, cand_rows, table,
                   params, parallel, False)  # fmt: skip


def _lookup(rows, offsets, lengths, num_tokens, sg_rows, cand_rows, table,
            params, parallel, count):  # fmt: skip
    """:func:`lookup_hits`, or with ``count`` :func:`count_probes` (serial,
    the counter columns on)."""
    sg_rows, cand_rows = _c64(sg_rows), _c64(cand_rows)
    check_plan_shapes(sg_rows, cand_rows)
    params = check_host_requests(
        rows, offsets, [("lengths", lengths), ("num_tokens", num_tokens)], params
    )
    check_plan_rows(sg_rows, cand_rows, params.alignment)
    table = _c64(table)
    table_capacity(table.shape, rows.shape[1])
    prm = _params(True, True, True, True, *params[1:],
                  prefetching(offsets.shape[0], table), bool(count))  # fmt: skip
    # No spans in lookup mode: an empty array keeps the one signature.
    mask_spans = np.zeros((0, cand_rows.shape[0], 3), dtype=np.int64)
    counters = COUNT_COLS + sg_rows.shape[0] if count else 0
    return _run(rows, offsets, lengths, num_tokens, np.zeros(1, np.int64),
                table, sg_rows, cand_rows, prm, mask_spans,
                False if count else parallel, counters)  # fmt: skip


def count_probes(
    rows: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    num_tokens: np.ndarray,
    sg_rows: np.ndarray,
    cand_rows: np.ndarray,
    *,
    table: np.ndarray,
    params: PlanParams,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`lookup_hits` (serial), instrumented: ``(hit int64 [R], counts
    int64 [R, COUNT_COLS + S])``, per request the table probes, the probes
    that found their key, the slots visited and the 64-byte lines read
    (columns ``C_PROBES``, ``C_HITS``, ``C_SLOTS``, ``C_LINES`` of
    :mod:`kvhit.kernels.probe_numba`), then the probes of each of the ``S``
    SpecGroups (one per member per block). For measuring where the time
    goes."""
    return _lookup(rows, offsets, lengths, num_tokens, sg_rows, cand_rows, table,
                   params, False, True)  # fmt: skip


def warm_up(prep: ScanPrep) -> None:
    """Load (or compile, on a cold numba cache) the compiled batch programs
    :func:`scan_prepared` runs for ``prep``'s layout, serial and, where
    numba has threads, parallel, and those of :func:`scan_one` and
    :func:`scan_prepared_hits`, on a one-request batch with no hashes and an
    empty table (nothing is read past the arrays): a serving process's first
    lookup then costs what every later one does."""
    rows = np.zeros((1, 1), np.int64)
    zero = np.zeros(1, np.int64)
    table = np.zeros((2, 2), np.int64)
    table[:, 0] = EMPTY
    for parallel in (False, True) if _THREADS_AVAILABLE else (False,):
        for mode in (FIND, LOOKUP):
            scan_prepared(prep, rows, zero, zero, zero, table, mode, parallel)
    for mode in (FIND, LOOKUP):
        scan_one(prep, rows[:0], 0, table, mode)
        scan_prepared_hits(prep, rows, zero, zero, zero, table, mode, False)
    # from_ints' decoder of a batch of lists (coordinator/int_lists.py).
    msgpack_warm_up()
