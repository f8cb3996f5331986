"""The engine-set updates of a Triton FleetIndex (``kernels/fleet_triton.py``'s
``FleetOps``): setting and clearing engines' bits of key slots, clearing an
engine, and probing keys' engine sets, one launch each (two for a clear,
which tombstones the slots left with no engine), as the torch family's
:mod:`kvhit.kernels.fleet_torch` computes them. Also the check of a
FleetIndex's device tables that this module's launchers and the fleet's
scans share (:func:`check_tables`).

Each launcher checks its arguments (``kernels/checks.py``) and names the bad
one; the FleetIndex calls them with its own tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvhit.kernels.checks import check_int64
from kvhit.kernels.contract import TOMBSTONE
from kvhit.kernels.hash_index import find_slots
from kvhit.kernels.launch import device_guard, fix_interpreter, interpreting

__all__ = ["check_tables", "clear_bits", "clear_engine", "probe_bits", "set_bits"]

# Triton 3.6's interpreter cannot range() over a runtime scalar (launch.py);
# once at import, as kernels/scan.py.
fix_interpreter()

# Lanes of the engine-set update kernels.
_UPDATE_BLOCK = 128
_TOMBSTONE_C: tl.constexpr = tl.constexpr(TOMBSTONE)


def check_tables(keys: object, bits: object) -> tuple[int, int, torch.device]:
    """(W, NW, device) of a FleetIndex's device tables (``keys`` int64 ``[C, W +
    1]``, ``bits`` int64 ``[C, NW]``); ValueError/TypeError naming them."""
    keys = check_int64(keys, "keys", dim=2)
    dev = keys.device
    bits = check_int64(bits, "bits", dim=2, device=dev, device_of="keys")
    cap, w1 = keys.shape
    if cap < 1 or cap & (cap - 1) or w1 < 2:
        raise ValueError(
            f"keys must have shape [capacity, W + 1], capacity a power of two, "
            f"W >= 1, got {list(keys.shape)}"
        )
    if bits.shape[0] != cap or bits.shape[1] < 1:
        raise ValueError(
            f"bits must have shape [{cap}, NW >= 1], got {list(bits.shape)}"
        )
    if dev.type == "cpu" and not interpreting():
        raise ValueError(
            "keys is on the CPU: the Triton kernels need a GPU, or "
            "TRITON_INTERPRET=1 set before triton is imported"
        )
    return w1 - 1, bits.shape[1], dev


@triton.jit
def _set_bits_kernel(bits_ptr, slot_ptr, eng_ptr, new_ptr, n, nw,
                     BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    s = tl.load(slot_ptr + i, mask=ok, other=0)
    e = tl.load(eng_ptr + i, mask=ok, other=0)
    b = tl.full([BLOCK], 1, tl.int64) << (e & 63)
    # One atomic read-modify-write per lane: of repeats of one (slot, engine)
    # in the batch exactly one lane sees the bit unset, so it counts once.
    old = tl.atomic_or(bits_ptr + s * nw + (e >> 6), b, mask=ok, sem="relaxed")
    tl.store(new_ptr + i, ((old & b) == 0).to(tl.int8), mask=ok)


@triton.jit
def _clear_bits_kernel(bits_ptr, slot_ptr, eng_ptr, gone_ptr, n, nw,
                       BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(slot_ptr + i, mask=i < n, other=-1)
    ok = (i < n) & (s >= 0)
    e = tl.load(eng_ptr + i, mask=ok, other=0)
    b = tl.full([BLOCK], 1, tl.int64) << (e & 63)
    old = tl.atomic_and(bits_ptr + tl.where(ok, s, 0) * nw + (e >> 6), ~b, mask=ok,
                        sem="relaxed")  # fmt: skip
    tl.store(gone_ptr + i, (ok & ((old & b) != 0)).to(tl.int8), mask=i < n)


@triton.jit
def _tombstone_kernel(keys_ptr, bits_ptr, slot_ptr, gone_ptr, freed_ptr, n, nw,
                      W: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # After _clear_bits_kernel (a kernel boundary orders its writes before
    # these reads): a slot left with no engine becomes a TOMBSTONE, as
    # KeyIndex's erase. Lanes that cleared a bit of one slot all see its final
    # bits; the exchange returns the group id to exactly one of them.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = tl.load(gone_ptr + i, mask=i < n, other=0) != 0
    s = tl.load(slot_ptr + i, mask=ok, other=0)
    empty = ok
    for k in range(nw):
        empty = empty & (tl.load(bits_ptr + s * nw + k, mask=empty, other=0) == 0)
    tomb = tl.full([BLOCK], _TOMBSTONE_C, tl.int64)
    old = tl.atomic_xchg(keys_ptr + s * (W + 1), tomb, mask=empty, sem="relaxed")
    tl.store(freed_ptr + i, (empty & (old >= 0)).to(tl.int8), mask=i < n)


@triton.jit
def _clear_engine_kernel(keys_ptr, bits_ptr, count_ptr, cap, nw, w, b,
                         W: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # One lane per slot: engine (w, b)'s bit of a live slot is cleared (one
    # engine per launch, one lane per slot: plain stores, no race); a slot
    # left with no engine becomes a TOMBSTONE. count[0] += bits cleared,
    # count[1] += slots tombstoned (one atomic per program).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < cap
    live = tl.load(keys_ptr + i * (W + 1), mask=ok, other=-1) >= 0
    word = tl.load(bits_ptr + i * nw + w, mask=live, other=0)
    has = live & (((word >> b) & 1) == 1)
    word = word & ~(tl.full([BLOCK], 1, tl.int64) << b)
    tl.store(bits_ptr + i * nw + w, word, mask=has)
    empty = has & (word == 0)
    # Word w reads back as stored above (the same lane's store).
    for k in range(nw):
        empty = empty & (tl.load(bits_ptr + i * nw + k, mask=empty, other=0) == 0)
    tl.store(keys_ptr + i * (W + 1), tl.full([BLOCK], _TOMBSTONE_C, tl.int64),
             mask=empty)  # fmt: skip
    tl.atomic_add(count_ptr, tl.sum(has.to(tl.int64), axis=0), sem="relaxed")
    tl.atomic_add(count_ptr + 1, tl.sum(empty.to(tl.int64), axis=0), sem="relaxed")


@triton.jit
def _probe_bits_kernel(keys_ptr, cap_mask, bits_ptr, gid_ptr, rows_ptr, out_ptr,
                       n_rows, n, nw, W: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    # Lane i: key (gids[i // n_rows], rows[i % n_rows]); its engine set goes
    # to out[i, :] (zeros where absent).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(gid_ptr + i // n_rows, mask=ok, other=0)
    # Plain reads (ACQUIRE=False): stream-ordered after the mutations.
    slot = find_slots(keys_ptr, cap_mask, g, rows_ptr, i % n_rows, ok, W, False)
    for k in range(nw):
        w = tl.load(bits_ptr + tl.where(slot >= 0, slot, 0) * nw + k,
                    mask=slot >= 0, other=0)  # fmt: skip
        tl.store(out_ptr + i * nw + k, w, mask=ok)


def _check_update(bits: object, slots: object, engines: object,
                  num_engines: object) -> tuple[int, int]:  # fmt: skip
    """(N, NW) of an engine-set update; errors name the argument."""
    bits = check_int64(bits, "bits", dim=2)
    dev = bits.device
    n = check_int64(slots, "slots", dim=1, device=dev, device_of="bits").shape[0]
    check_int64(engines, "engines", dim=1, device=dev, device_of="bits")
    if engines.shape[0] != n:
        raise ValueError(f"engines must have shape [{n}], got {list(engines.shape)}")
    if isinstance(num_engines, bool) or not isinstance(num_engines, int):
        raise TypeError(f"num_engines must be an int, got {num_engines!r}")
    if not 0 < num_engines <= bits.shape[1] * 64:
        raise ValueError(
            f"num_engines must be in [1, {bits.shape[1] * 64}], got {num_engines}"
        )
    if dev.type == "cpu" and not interpreting():
        raise ValueError(
            "bits is on the CPU: the Triton kernels need a GPU, or "
            "TRITON_INTERPRET=1 set before triton is imported"
        )
    return n, bits.shape[1]


def set_bits(
    bits: torch.Tensor, slots: torch.Tensor, engines: torch.Tensor, num_engines: int
) -> torch.Tensor:
    """Set engine ``engines[r]``'s bit of slot ``slots[r]`` (``bits`` int64
    ``[C, NW]``; ``slots``, ``engines`` int64 ``[N]``, every slot a live
    key's, every engine below ``num_engines``): one launch. Returns int64
    ``[E]`` (CPU): the bits newly set per engine (a repeat in the batch
    counts once), as :func:`kvhit.kernels.fleet_torch.set_bits`."""
    n, nw = _check_update(bits, slots, engines, num_engines)
    new = torch.zeros(n, dtype=torch.int8, device=bits.device)
    if n:
        with device_guard(bits.device):
            _set_bits_kernel[(triton.cdiv(n, _UPDATE_BLOCK),)](
                bits, slots, engines, new, n, nw, BLOCK=_UPDATE_BLOCK
            )
    # Counted on the device, one copy back (no boolean indexing: its size
    # would be a host sync of its own).
    per_engine = torch.zeros(num_engines, dtype=torch.int64, device=bits.device)
    return per_engine.index_add_(0, engines, new.to(torch.int64)).cpu()


def clear_bits(
    keys: torch.Tensor,
    bits: torch.Tensor,
    slots: torch.Tensor,
    engines: torch.Tensor,
    num_engines: int,
) -> tuple[torch.Tensor, int]:
    """Clear engine ``engines[r]``'s bit of slot ``slots[r]`` (-1: an absent
    key, skipped); a slot left with no engine becomes a TOMBSTONE (``keys``
    int64 ``[C, W + 1]``). Two launches. Returns (int64 ``[E]`` (CPU), the
    bits cleared per engine; the number of slots tombstoned), as
    :func:`kvhit.kernels.fleet_torch.clear_bits`."""
    W, _, _ = check_tables(keys, bits)
    n, nw = _check_update(bits, slots, engines, num_engines)
    gone = torch.zeros(n, dtype=torch.int8, device=bits.device)
    freed = torch.zeros(n, dtype=torch.int8, device=bits.device)
    if n:
        grid = (triton.cdiv(n, _UPDATE_BLOCK),)
        with device_guard(bits.device):
            _clear_bits_kernel[grid](bits, slots, engines, gone, n, nw,
                                     BLOCK=_UPDATE_BLOCK)  # fmt: skip
            _tombstone_kernel[grid](keys, bits, slots, gone, freed, n, nw, W=W,
                                    BLOCK=_UPDATE_BLOCK)  # fmt: skip
    # The counts per engine and the slots freed, one copy back.
    counts = torch.zeros(num_engines + 1, dtype=torch.int64, device=bits.device)
    counts[:num_engines].index_add_(0, engines, gone.to(torch.int64))
    counts[num_engines] = freed.sum()
    counts = counts.cpu()
    return counts[:num_engines], int(counts[num_engines])


def clear_engine(
    keys: torch.Tensor, bits: torch.Tensor, engine: int
) -> tuple[int, int]:
    """Drop every key of ``engine`` (``keys`` int64 ``[C, W + 1]``, ``bits``
    int64 ``[C, NW]``, a FleetIndex's tables): its bit of every live slot is
    cleared, and a slot left with no engine becomes a TOMBSTONE. One launch
    over the table and one copy of the two counts back: (bits cleared, slots
    tombstoned), as :func:`kvhit.kernels.fleet_torch.clear_engine`."""
    W, NW, dev = check_tables(keys, bits)
    if isinstance(engine, bool) or not isinstance(engine, int):
        raise TypeError(f"engine must be an int, got {engine!r}")
    if not 0 <= engine < NW * 64:
        raise ValueError(f"engine must be in [0, {NW * 64}), got {engine}")
    count = torch.zeros(2, dtype=torch.int64, device=dev)
    cap = keys.shape[0]
    with device_guard(dev):
        _clear_engine_kernel[(triton.cdiv(cap, _UPDATE_BLOCK),)](
            keys, bits, count, cap, NW, engine >> 6, engine & 63, W=W,
            BLOCK=_UPDATE_BLOCK,
        )  # fmt: skip
    cleared, freed = count.tolist()
    return cleared, freed


def probe_bits(
    keys: torch.Tensor, bits: torch.Tensor, gids: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The engine set of every key ``(gids[i], rows[t])``: int64 ``[G, T,
    NW]`` on the tables' device (zero where no engine holds it), one launch
    (:func:`kvhit.kernels.fleet_torch.probe_bits`). ``gids`` int64 ``[G]``,
    ``rows`` int64 ``[T, W]``, contiguous, on the tables' device."""
    W, NW, dev = check_tables(keys, bits)
    G = check_int64(gids, "gids", dim=1, device=dev, device_of="keys").shape[0]
    rows = check_int64(rows, "rows", dim=2, device=dev, device_of="keys")
    if rows.shape[1] != W:
        raise ValueError(f"rows must have shape [T, {W}], got {list(rows.shape)}")
    T = rows.shape[0]
    out = torch.empty((G, T, NW), dtype=torch.int64, device=dev)
    n = G * T
    if n:
        with device_guard(dev):
            _probe_bits_kernel[(triton.cdiv(n, _UPDATE_BLOCK),)](
                keys, keys.shape[0] - 1, bits, gids, rows, out, T, n, NW, W=W,
                BLOCK=_UPDATE_BLOCK,
            )  # fmt: skip
    return out
