"""Triton kernels for the KeyIndex open-addressing hash table.

The table layout, sentinels, slot hash and probe sequence are specified in
``kvhit.coordinator.key_index`` (module docstring); this file implements them
for Triton and must stay bit-identical with the torch implementation there
(``tests/test_key_index.py`` checks it). This module imports nothing from
coordinator/; the sentinels and slot-hash constants come from
``kvhit.kernels.contract`` (one definition for every kernel family).

Summary of the contract:

* ``table``: int64 ``[capacity, W + 1]``, contiguous, ``capacity`` a power of
  two. Column 0 is the group id (>= 0) of a live key, or ``EMPTY`` (-1),
  ``TOMBSTONE`` (-2, erased; probes continue past it) or ``BUSY`` (-3, being
  written by an insert; probes continue past it). Columns 1..W are the hash
  words. Words of EMPTY slots are 0.
* slot of key ``(gid, w[0..W-1])``: ``hash_finish(fold(hash_mix,
  hash_init(gid), w)) & (capacity - 1)``; probe ``slot, slot + 1, ...``
  (mod capacity) until the key or an EMPTY slot.

Device functions for other kernels (e.g. the LookupEngine):

* ``hash_init(gid)``, ``hash_mix(h, w)``, ``hash_finish(h)``: the slot hash in
  three steps, for keys already held in registers; int64 tensors of any shape.
* ``slot_hash(gids, key_ptr, rows, mask, W)``: the full 64-bit hash of keys
  read from a row-major int64 ``[*, W]`` tensor.
* ``probe_keys(table_ptr, cap_mask, gids, key_ptr, rows, mask, W) -> int1``:
  membership of a block of keys (vectorised; a block of 1 is the scalar case).
* ``find_slots(...) -> int64``: like ``probe_keys`` but returns the slot (or -1).

Launchers (``probe``, ``find``, ``insert``, ``erase``) take torch tensors and validate
shape, dtype, contiguity and device, naming the offending argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvhit.kernels import contract
from kvhit.kernels.checks import check_int, check_probe_args
from kvhit.kernels.contract import BUSY, EMPTY, TOMBSTONE
from kvhit.kernels.launch import device_guard, interpreting

__all__ = [
    "BUSY",
    "EMPTY",
    "TOMBSTONE",
    "BUSY_WAIT_LIMIT",
    "INSERT_FULL",
    "INSERT_WAIT",
    "InsertError",
    "erase",
    "find",
    "find_slots",
    "hash_finish",
    "hash_init",
    "hash_mix",
    "insert",
    "insert_gave_up",
    "probe",
    "probe_keys",
    "program_lanes",
    "rehash",
    "slot_hash",
]

# The numbers are defined once, in kernels/contract.py; Triton code reads them
# as compile-time constants.
_SEED: tl.constexpr = tl.constexpr(contract.SEED)
_M1: tl.constexpr = tl.constexpr(contract.M1)
_M2: tl.constexpr = tl.constexpr(contract.M2)
_M3: tl.constexpr = tl.constexpr(contract.M3)
_LOW33: tl.constexpr = tl.constexpr(contract.LOW33)
_LOW35: tl.constexpr = tl.constexpr(contract.LOW35)
_EMPTY: tl.constexpr = tl.constexpr(EMPTY)
_TOMBSTONE: tl.constexpr = tl.constexpr(TOMBSTONE)
_BUSY: tl.constexpr = tl.constexpr(BUSY)
# A compare value no slot ever holds: a CAS against it is a pure atomic read.
_NEVER_C: tl.constexpr = tl.constexpr(contract.NEVER)

#: Codes of :func:`insert_gave_up` (and of the insert kernel's output).
INSERT_FULL = -1
INSERT_WAIT = -2
_FULL_C: tl.constexpr = tl.constexpr(INSERT_FULL)
_WAIT_C: tl.constexpr = tl.constexpr(INSERT_WAIT)

# What a launch of _probe_kernel writes per key (its MODE): membership
# (int8), the slot (int64, -1 when absent), or the key erased (int8, 1
# where this lane removed it).
_PROBE, _FIND, _ERASE = 0, 1, 2
_PROBE_C: tl.constexpr = tl.constexpr(_PROBE)
_ERASE_C: tl.constexpr = tl.constexpr(_ERASE)

#: Rounds an insert lane may wait on BUSY slots in all before it gives up.
#: A running inserter publishes its slot a few instructions after claiming
#: it, but its warp may be descheduled meanwhile (another CTA, a preempted
#: context), so a lane that gives up is not proof of a dead writer: the
#: launcher launches the lanes that gave up again, after the kernel ended,
#: when every slot the batch claimed is published. Only a slot still BUSY
#: then (a crashed or concurrent writer) makes ``insert`` raise, and it must
#: not make the kernel spin forever.
BUSY_WAIT_LIMIT = 1024


@triton.jit
def hash_init(gid):
    """Start the slot hash from group ids (int64 tensor, any shape)."""
    return (gid ^ _SEED) * _M1


@triton.jit
def hash_mix(h, w):
    """Fold one int64 hash word ``w`` into the running hash ``h`` (int64)."""
    x = (h ^ w) * _M2
    return x ^ ((x >> 31) & _LOW33)


@triton.jit
def hash_finish(h):
    """Final avalanche; the slot is ``hash_finish(h) & cap_mask``."""
    x = h ^ ((h >> 29) & _LOW35)
    x = x * _M3
    return x ^ ((x >> 31) & _LOW33)


@triton.jit
def slot_hash(gids, key_ptr, rows, mask, W: tl.constexpr):
    """64-bit slot hash of a block of keys.

    gids: int64 [BLOCK] group ids; key_ptr: pointer to a row-major int64
    ``[*, W]`` tensor; rows: int64 [BLOCK] row indices into it; mask: int1
    [BLOCK] (masked lanes hash word 0). Returns int64 [BLOCK].
    """
    h = hash_init(gids)
    for j in tl.static_range(W):
        w = tl.load(key_ptr + rows * W + j, mask=mask, other=0)
        h = hash_mix(h, w)
    return hash_finish(h)


@triton.jit
def find_slots(
    table_ptr,
    cap_mask,
    gids,
    key_ptr,
    rows,
    mask,
    W: tl.constexpr,
    ACQUIRE: tl.constexpr = True,
):
    """Slot holding each key of a block, or -1 when absent.

    table_ptr: the KeyIndex table (int64 ``[cap_mask + 1, W + 1]``, contiguous);
    cap_mask: capacity - 1 (int); gids: int64 [BLOCK]; key_ptr/rows: keys as in
    :func:`slot_hash`; mask: int1 [BLOCK], lanes to look up; ACQUIRE
    (constexpr): how column 0 is read, see below. Returns int64 [BLOCK] (-1
    for masked lanes).

    Memory order of the column-0 read (Triton 3.6 has no ``atomic_load``):

    * ``ACQUIRE=True`` (the default, for a kernel that may run while an
      insert writes the table, e.g. on another stream): an
      ``atomic_or(ptr, 0, sem="acquire")``, a read-modify-write that changes
      nothing, pairing with the inserter's release-publish of the group id,
      so a lane that sees a group id also sees that slot's words.
    * ``ACQUIRE=False``: a plain load, for kernels stream-ordered after every
      insert they must see (the launchers below: ``KeyIndex`` launches them on
      the stream its inserts ran on, and a kernel boundary orders all of one
      kernel's writes before the next kernel's reads). Cheaper on the
      latency-bound probe chain, and no write to the table.

    BUSY slots are passed over: the key being written there is not in the
    table yet, and no other key can sit behind a slot that was EMPTY until
    that insert claimed it.
    """
    pos = slot_hash(gids, key_ptr, rows, mask, W) & cap_mask
    slot = tl.zeros_like(gids) - 1
    active = mask
    # A vector, not a scalar: the interpreter mistypes scalar-vs-vector masks.
    steps = tl.zeros_like(gids)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        row = table_ptr + pos * (W + 1)
        if ACQUIRE:
            g = tl.atomic_or(row, tl.zeros_like(gids), mask=active, sem="acquire")
        else:
            g = tl.load(row, mask=active, other=_EMPTY)
        hit = active & (g == gids)
        for j in tl.static_range(W):
            t = tl.load(row + 1 + j, mask=hit, other=0)
            k = tl.load(key_ptr + rows * W + j, mask=hit, other=0)
            hit = hit & (t == k)
        slot = tl.where(hit, pos, slot)
        steps += 1
        # The step bound only matters for a corrupt table with no EMPTY slot.
        active = active & ~hit & (g != _EMPTY) & (steps <= cap_mask)
        pos = (pos + 1) & cap_mask
    return slot


@triton.jit
def probe_keys(
    table_ptr,
    cap_mask,
    gids,
    key_ptr,
    rows,
    mask,
    W: tl.constexpr,
    ACQUIRE: tl.constexpr = True,
):
    """Membership of a block of keys: int1 [BLOCK]. Arguments as find_slots."""
    return find_slots(table_ptr, cap_mask, gids, key_ptr, rows, mask, W, ACQUIRE) >= 0


@triton.jit
def program_lanes(gid_ptr, n, BLOCK: tl.constexpr):
    """This program's lanes in a launch of one lane per key over ``n`` keys:
    ``(rows, valid, gids)``, ``rows`` int64 [BLOCK] its key indices, ``valid``
    int1 [BLOCK] ``rows < n``, ``gids`` int64 [BLOCK] the keys' group ids from
    ``gid_ptr`` (0 past ``n``). Exported, as ``probe_keys`` is, for kernels
    built on the index's device functions."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n
    return rows, valid, tl.load(gid_ptr + rows, mask=valid, other=0)


@triton.jit
def _probe_kernel(
    table_ptr,
    cap_mask,
    gid_ptr,
    key_ptr,
    out_ptr,
    n,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    ACQUIRE: tl.constexpr,
    MODE: tl.constexpr,
):
    # One kernel for the launchers that look keys up (probe, find, erase):
    # out_ptr int8 [n] (_PROBE, _ERASE) or int64 [n] (_FIND), see MODE above.
    rows, valid, gids = program_lanes(gid_ptr, n, BLOCK)
    # ACQUIRE=False: plain loads, stream-ordered after the inserts; True:
    # acquire reads, an insert may be running on another stream (find_slots).
    # Erasing lanes only race each other, and the atomic_min below decides
    # that race.
    slot = find_slots(table_ptr, cap_mask, gids, key_ptr, rows, valid, W, ACQUIRE)
    if MODE == _PROBE_C:
        tl.store(out_ptr + rows, (slot >= 0).to(tl.int8), mask=valid)
    elif MODE == _ERASE_C:
        found = slot >= 0
        # group id -> TOMBSTONE as an atomic min, masked to the found lanes (a
        # CAS cannot be masked: not-found lanes would all hit one slot). A
        # found slot holds our group id (>= 0 > TOMBSTONE) or, if another lane
        # erased the same key first, TOMBSTONE already: only the lane that saw
        # the group id counts it, so the count of removed keys is exact.
        ptr = table_ptr + tl.where(found, slot, 0) * (W + 1)
        tomb = tl.full([BLOCK], _TOMBSTONE, tl.int64)
        old = tl.atomic_min(ptr, tomb, mask=found, sem="acq_rel")
        removed = found & (old == gids)
        tl.store(out_ptr + rows, removed.to(tl.int8), mask=valid)
    else:
        tl.store(out_ptr + rows, slot, mask=valid)


@triton.jit
def insert_gave_up(visited, waited, cap_mask, WAITS: tl.constexpr):
    """Why insert lanes stop without a slot: int8 [BLOCK], 0 (not given up),
    :data:`INSERT_FULL` after stepping past every slot (``visited``, int64
    [BLOCK], > ``cap_mask``: no EMPTY slot on the probe path, a full or
    corrupt table) or :data:`INSERT_WAIT` after ``waited`` (int32 [BLOCK])
    rounds waiting on BUSY slots exceed ``WAITS``.

    The two bounds are compared apart, never summed: ``cap_mask`` arrives as
    an i32 argument up to 2**31 - 1 (Triton types a launch int by its value),
    and ``cap_mask + WAITS`` in i32 wraps negative for a table of 2**31
    slots (an 80 GiB table fits one H200), which failed every lane at once.
    ``visited`` is int64, so ``visited > cap_mask`` compares in int64.
    """
    full = visited > cap_mask
    code = tl.where(full, _FULL_C, 0)
    code = tl.where(~full & (waited > WAITS), _WAIT_C, code)
    return code.to(tl.int8)


@triton.jit
def _insert_kernel(
    table_ptr,
    cap_mask,
    gid_ptr,
    key_ptr,
    out_ptr,
    n,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    WAITS: tl.constexpr,
):
    # out: 1 = inserted here, 0 = already present, INSERT_FULL = no free slot
    # (corrupt or over-full table), INSERT_WAIT = gave up waiting on a BUSY
    # slot (the launcher retries those lanes).
    rows, valid, gids = program_lanes(gid_ptr, n, BLOCK)
    pos = slot_hash(gids, key_ptr, rows, valid, W) & cap_mask
    empty_v = tl.full([BLOCK], _EMPTY, tl.int64)
    never_v = tl.full([BLOCK], _NEVER_C, tl.int64)
    busy_v = tl.full([BLOCK], _BUSY, tl.int64)
    active = valid
    inserted = rows < 0
    code = tl.zeros([BLOCK], tl.int8)
    # Slots stepped past (int64: see insert_gave_up) and rounds spent waiting
    # on BUSY slots, bounded apart: a slot left BUSY ends the lane (reported,
    # retried by the launcher) instead of spinning forever.
    visited = tl.zeros([BLOCK], tl.int64)
    waited = tl.zeros([BLOCK], tl.int32)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        row = table_ptr + pos * (W + 1)
        # One CAS per step is both the read (acquire) and the claim; lanes that
        # must not claim compare against a value no slot holds. Only EMPTY
        # slots are claimed, never tombstones: a tombstone may sit in front of
        # this very key, so reusing it could store the key twice.
        old = tl.atomic_cas(row, tl.where(active, empty_v, never_v), busy_v)
        claimed = active & (old == _EMPTY)
        for j in tl.static_range(W):
            k = tl.load(key_ptr + rows * W + j, mask=claimed, other=0)
            tl.store(row + 1 + j, k, mask=claimed)
        # Words first, group id last: a reader that sees the group id (acquire)
        # sees the words; before that it sees BUSY and passes over the slot.
        tl.debug_barrier()
        tl.atomic_xchg(row, gids, mask=claimed, sem="release")
        # Re-check keys we pass: the same key may have been published here by
        # another program (or lane) since our hash was computed.
        same = active & (old == gids)
        for j in tl.static_range(W):
            t = tl.load(row + 1 + j, mask=same, other=0)
            k = tl.load(key_ptr + rows * W + j, mask=same, other=0)
            same = same & (t == k)
        # A BUSY slot may be receiving this very key: wait on it (retry the
        # same slot) instead of passing over it, or the key could land twice.
        wait = active & (old == _BUSY)
        done = claimed | same
        inserted = inserted | claimed
        advance = active & ~done & ~wait
        visited = tl.where(advance, visited + 1, visited)
        waited = tl.where(wait, waited + 1, waited)
        pos = tl.where(advance, (pos + 1) & cap_mask, pos)
        why = insert_gave_up(visited, waited, cap_mask, WAITS)
        failed = active & ~done & (why != 0)
        code = tl.where(failed, why, code)
        active = active & ~done & ~failed
    code = tl.where(inserted, 1, code)
    tl.store(out_ptr + rows, code.to(tl.int8), mask=valid)


def _block() -> int:
    # The interpreter runs each program as numpy code: fewer, wider programs
    # amortise its per-op overhead.
    return 1024 if interpreting() else 128


def _cap_mask(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
    trusted: bool,
) -> int:
    """capacity - 1 of ``table``, its arguments checked unless ``trusted``
    (a KeyIndex's own table and normalized keys)."""
    if trusted:
        return table.shape[0] - 1
    cap = check_probe_args(table, W, group_ids, hashes)
    if table.device.type == "cpu" and not interpreting():
        raise ValueError(
            "table is on the CPU: the Triton kernels need a GPU, or "
            "TRITON_INTERPRET=1 set before triton is imported"
        )
    return cap - 1


def _launch(
    kernel, table, W, group_ids, hashes, dtype=torch.int8, trusted=False, **meta
) -> torch.Tensor:
    cap_mask = _cap_mask(table, W, group_ids, hashes, trusted)
    n = group_ids.shape[0]
    out = torch.zeros(n, dtype=dtype, device=table.device)
    if n:
        block = _block()
        grid = (triton.cdiv(n, block),)
        with device_guard(table.device):
            kernel[grid](
                table, cap_mask, group_ids, hashes, out, n, W=W, BLOCK=block, **meta
            )
    return out


def find(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
    trusted: bool = False,
) -> torch.Tensor:
    """Slot of each key, or -1 where absent: int64 [N]. Arguments as
    :func:`probe`."""
    return _launch(_probe_kernel, table, W, group_ids, hashes, dtype=torch.int64,
                   ACQUIRE=False, MODE=_FIND, trusted=trusted)  # fmt: skip


def probe(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
    concurrent: bool = False,
    trusted: bool = False,
) -> torch.Tensor:
    """Membership of keys: bool [N].

    table: int64 [capacity, W + 1]; group_ids: int64 [N]; hashes: int64 [N, W];
    all contiguous, on one device. ``concurrent``: an insert into ``table``
    may run meanwhile (another stream): read the group ids with acquire
    atomics (``find_slots(ACQUIRE=True)``, a read-modify-write per step)
    instead of plain loads, which are right when every insert to see was
    launched before on the current stream. ``trusted``: the caller built
    the arguments so (a KeyIndex): nothing is checked.
    """
    return _launch(
        _probe_kernel, table, W, group_ids, hashes, ACQUIRE=bool(concurrent),
        MODE=_PROBE, trusted=trusted,
    ).bool()  # fmt: skip


class InsertError(RuntimeError):
    """An insert that could not store every key of its batch.

    Attributes: ``table_full``, the number of keys that found no EMPTY slot
    on their probe path (the table is full or corrupt); ``wait_ran_out``, the
    number that gave up on a slot still BUSY after every retry (left by a
    crashed or concurrent writer). The other keys of the batch were stored:
    a caller that keeps counts (``KeyIndex``) must count the table again.
    """

    def __init__(self, table_full: int, wait_ran_out: int, busy_wait_limit: int):
        self.table_full = table_full
        self.wait_ran_out = wait_ran_out
        why = []
        if table_full:
            why.append(
                f"{table_full} keys found no free slot: the table is full (or "
                "corrupt): no EMPTY slot on their probe path"
            )
        if wait_ran_out:
            why.append(
                f"{wait_ran_out} keys found no free slot: a wait ran out, on a "
                f"slot left BUSY for {busy_wait_limit} rounds through a retry "
                "(a crashed or concurrent writer)"
            )
        super().__init__(
            "insert: " + "; ".join(why) + "; the batch's other keys were stored"
        )


def insert(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
    busy_wait_limit: int = BUSY_WAIT_LIMIT,
    trusted: bool = False,
) -> torch.Tensor:
    """Insert keys into ``table`` in place; returns bool [N], True where the key
    was new and this lane stored it.

    Keys already present and repeats inside the batch are not stored again (a
    key ends in exactly one slot, even from concurrent lanes), so the number of
    new keys is ``result.sum()``. The caller must leave room: the table needs
    an EMPTY slot on every probe path (KeyIndex keeps load <= max_load < 1).
    Arguments as :func:`probe`; ``busy_wait_limit``: rounds a key may wait on
    BUSY slots per launch (a compile-time constant of the kernel). Keys that
    gave up waiting are launched again, as long as each launch stores or
    finds at least one of them (the slot they waited on was published when
    the previous launch ended). Raises :class:`InsertError` (a RuntimeError)
    when keys found no free slot or a slot stayed BUSY through a launch that
    made no progress; the batch's other keys are then stored.
    """
    if not trusted:
        check_int(busy_wait_limit, "busy_wait_limit", 1)
    out = _launch(_insert_kernel, table, W, group_ids, hashes,
                  WAITS=busy_wait_limit, trusted=trusted)  # fmt: skip
    if not out.numel() or not bool((out < 0).any()):
        return out > 0
    idx = (out == INSERT_WAIT).nonzero().squeeze(1)
    while idx.numel():
        again = _launch(
            _insert_kernel,
            table,
            W,
            group_ids[idx].contiguous(),
            hashes[idx].contiguous(),
            WAITS=busy_wait_limit,
            trusted=True,
        )
        out[idx] = again
        stuck = again == INSERT_WAIT
        if int(stuck.sum()) == idx.numel():
            break  # no progress: the slot is BUSY for good
        idx = idx[stuck]
    full = int((out == INSERT_FULL).sum())
    wait = int((out == INSERT_WAIT).sum())
    if full or wait:
        raise InsertError(full, wait, busy_wait_limit)
    return out > 0


def erase(
    table: torch.Tensor,
    W: int,
    group_ids: torch.Tensor,
    hashes: torch.Tensor,
    trusted: bool = False,
) -> torch.Tensor:
    """Replace keys by tombstones; returns bool [N], True where this lane removed
    the key (absent keys and repeats are False). Arguments as :func:`probe`.
    """
    out = _launch(_probe_kernel, table, W, group_ids, hashes, ACQUIRE=False,
                  MODE=_ERASE, trusted=trusted)  # fmt: skip
    return out > 0


def rehash(table: torch.Tensor, W: int, new: torch.Tensor) -> int:
    """Copy every live key of ``table`` into ``new`` in place; returns the
    number copied (the launcher every hash-index kernel family has).

    table: a valid KeyIndex table, int64 ``[C, W + 1]``; new: an empty table
    on the same device with room for every key. Tombstones are dropped.
    """
    live = table[table[:, 0] >= 0]
    stored = insert(new, W, live[:, 0].contiguous(), live[:, 1:].contiguous())
    return int(stored.sum().item())
