"""The kernel contract: every number both kernel families (Triton on CUDA,
numba on the CPU) and the Python side that feeds them agree on.

This module imports neither triton nor numba (nor torch), so the coordinator,
the bindings and the tests read it freely, and a kernel module reads named
constants from it instead of spelling numbers out (``row + SG_NEED``, never
``row + 5``).

What lives here:

* the KeyIndex table layout: the column-0 sentinels (``EMPTY``, ``TOMBSTONE``,
  ``BUSY``) and the slot-hash constants (``SEED``, ``M1``..``M3``, the shift
  masks); ``coordinator/key_index.py`` documents the layout and the probe
  sequence in words, :func:`slot_hash` is the hash in plain Python (the
  definition every implementation is tested against);
* the spec-kind codes (``KIND_*``);
* the columns of a SpecGroup row (``SG_*``, then the member group ids from
  ``SG_MEMBERS``) and of a per-group candidate row (``CAND_*``), as
  ``coordinator/plan.py`` builds them: the one candidate layout the Triton
  scan, the numba scan and ``kernels/candidates_numba.py`` read; the two
  rows as records, :class:`SpecGroupRow` and :class:`CandRow` (the plan's
  ``SpecGroupPlan`` and ``CandidatePlan`` are them, the torch kernels decode
  rows into them);
* :func:`key_op`, the launcher signature the hash-index families share
  (``find``, ``probe``, ``insert``, ``erase``);
* :class:`PlanParams`, a plan's scalar parameters, the one value type every
  scan family (numba, Triton, torch) takes beside the rows;
* :func:`cdiv`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUSY",
    "CAND_BLOCK_SIZE",
    "CAND_CACHEABLE",
    "CAND_COLS",
    "CAND_GROUP_ID",
    "CAND_NEED",
    "CAND_PER_SEGMENT",
    "CAND_SCALE",
    "CAND_SHIFT",
    "CAND_SPARSE",
    "CAND_WIDTH",
    "CandRow",
    "EMPTY",
    "HASH_CONSTANTS",
    "KIND_CHUNKED",
    "KIND_FULL",
    "KIND_MAMBA",
    "KIND_SWA",
    "LOW33",
    "LOW35",
    "M1",
    "M2",
    "M3",
    "NEVER",
    "PlanParams",
    "SEED",
    "SG_BLOCK_SIZE",
    "SG_CHUNK",
    "SG_COLS",
    "SG_FINE",
    "SG_KIND",
    "SG_MARGIN",
    "SG_MEMBERS",
    "SG_NEED",
    "SG_N_MEMBERS",
    "SG_PERIOD",
    "SG_SCALE",
    "SG_USE_EAGLE",
    "SpecGroupRow",
    "TOMBSTONE",
    "KeyOp",
    "cdiv",
    "key_op",
    "slot_hash",
]

# -- KeyIndex table ----------------------------------------------------------
# Column 0 of a slot: a group id (>= 0) of a live key, or one of these.
EMPTY = -1  # never used since the last clear/rehash; ends a probe chain
TOMBSTONE = -2  # a removed key; probes pass over it, inserts never reuse it
BUSY = -3  # an insert has claimed the slot and is writing the words
# A compare value no slot ever holds: a CAS against it is a pure atomic read.
NEVER = -4

# Slot hash (splitmix64 / golden-ratio multipliers), as signed int64.
SEED = 0x2545F4914F6CDD1D
M1 = 0x9E3779B97F4A7C15 - (1 << 64)
M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
M3 = 0x94D049BB133111EB - (1 << 64)
# Masks applied after ``>>`` turn the arithmetic shift of int64 into a logical
# one. Wider than 32 bits, so Triton types them int64 (0xFFFFFFFF is uint32).
LOW33 = (1 << 33) - 1
LOW35 = (1 << 35) - 1
HASH_CONSTANTS = {
    "SEED": SEED,
    "M1": M1,
    "M2": M2,
    "M3": M3,
    "LOW33": LOW33,
    "LOW35": LOW35,
}

_MASK64 = (1 << 64) - 1


def _wrap(x: int) -> int:
    """``x`` wrapped to a signed int64, as the kernels' arithmetic wraps."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def slot_hash(group_id: int, words: tuple[int, ...] | list[int]) -> int:
    """The 64-bit slot hash of key ``(group_id, words)`` (signed int64 words).

    ``hash_init``: ``(gid ^ SEED) * M1``; ``hash_mix`` per word ``w``:
    ``x = (h ^ w) * M2; x ^ (x >>> 31)``; ``hash_finish``:
    ``x = h ^ (h >>> 29); x *= M3; x ^ (x >>> 31)`` (``>>>`` logical). The slot
    is ``slot_hash(...) & (capacity - 1)``. Plain Python, the definition the
    torch, Triton and numba implementations are tested against.
    """
    h = _wrap((group_id ^ SEED) * M1)
    for w in words:
        x = _wrap((h ^ w) * M2)
        h = x ^ ((x >> 31) & LOW33)
    x = h ^ ((h >> 29) & LOW35)
    x = _wrap(x * M3)
    return x ^ ((x >> 31) & LOW33)


# -- spec kinds -----------------------------------------------------------------
KIND_FULL = 0
KIND_SWA = 1
KIND_MAMBA = 2
KIND_CHUNKED = 3

# -- a SpecGroup row (ScanPlan.as_rows()) -------------------------------------------


class SpecGroupRow(NamedTuple):
    """One SpecGroup as numbers, its fields in row order (:data:`SG_COLS`),
    its member group ids last, as a tuple. ``coordinator/plan.py``'s
    ``SpecGroupPlan`` (which documents the fields) is one; the torch scan
    decodes rows into them (:meth:`from_row`)."""

    kind: int
    block_size: int
    scale: int
    use_eagle: bool
    margin: int
    need: int
    period: int
    fine: bool
    chunk: int
    group_ids: tuple[int, ...]

    def as_row(self, width: int) -> list[int]:
        """The row kernels read: the fields, ``n_members``, then the members
        padded with -1 to ``width`` (the widest SpecGroup's count)."""
        members = list(self.group_ids) + [-1] * (width - len(self.group_ids))
        return [*(int(v) for v in self[:-1]), len(self.group_ids), *members]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> SpecGroupRow:
        """A row of :meth:`as_row` (ints) decoded."""
        n = row[SG_N_MEMBERS]
        return cls(
            *(ty(v) for ty, v in zip(_SG_TYPES, row[:SG_N_MEMBERS], strict=True)),
            tuple(row[SG_MEMBERS : SG_MEMBERS + n]),
        )


#: Every field but the members, then their count.
SG_COLS = (*SpecGroupRow._fields[:-1], "n_members")
_SG_TYPES = tuple(bool if f in ("use_eagle", "fine") else int for f in SG_COLS[:-1])
SG_KIND = 0
SG_BLOCK_SIZE = 1
SG_SCALE = 2
SG_USE_EAGLE = 3
SG_MARGIN = 4
SG_NEED = 5
SG_PERIOD = 6
SG_FINE = 7
SG_CHUNK = 8
SG_N_MEMBERS = 9
# Member group ids start here, padded with -1 to the widest SpecGroup.
SG_MEMBERS = len(SG_COLS)

# -- a per-group candidate row (ScanPlan.candidates, in group order) ----------------


class CandRow(NamedTuple):
    """One group's candidate row, its fields in row order (:data:`CAND_COLS`).
    ``coordinator/plan.py``'s ``CandidatePlan`` (which documents the fields)
    is one; the torch kernels decode rows into them (:meth:`from_row`)."""

    cacheable: bool
    block_size: int
    scale: int
    sparse: bool
    per_segment: int
    need: int
    shift: int
    group_id: int

    def as_row(self) -> list[int]:
        """The row kernels read, in ``CAND_COLS`` order."""
        return [int(v) for v in self]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> CandRow:
        """A row of :meth:`as_row` (ints) decoded."""
        return cls(
            *(ty(v) for ty, v in zip(_CAND_TYPES, row[:CAND_WIDTH], strict=True))
        )


CAND_COLS = CandRow._fields
_CAND_TYPES = tuple(bool if f in ("cacheable", "sparse") else int for f in CAND_COLS)
CAND_CACHEABLE = 0
CAND_BLOCK_SIZE = 1
CAND_SCALE = 2
CAND_SPARSE = 3
CAND_PER_SEGMENT = 4
CAND_NEED = 5
CAND_SHIFT = 6
CAND_GROUP_ID = 7
CAND_WIDTH = len(CAND_COLS)

for _i, _name in enumerate(SG_COLS):
    assert globals()["SG_" + _name.upper()] == _i, _name
for _i, _name in enumerate(CAND_COLS):
    assert globals()["CAND_" + _name.upper()] == _i, _name
del _i, _name


def cdiv(a: int, b: int) -> int:
    """Ceiling division (``b > 0``), as vLLM's ``cdiv``; works on ints and on
    integer tensors alike (``//`` floors on both)."""
    return -(a // -b)


class PlanParams(NamedTuple):
    """A scan plan's scalar parameters, beside its rows (``SG_*`` and
    ``CAND_*``): what every scan family reads besides them
    (``coordinator/plan.py``'s ``ScanPlan.params``).

    Attributes:
        num_groups: KV-cache groups (rows of ``cand_rows``).
        hash_block_size: tokens per block hash.
        alignment: the hit alignment in tokens.
        partial: partial hash hits (the worker walks hash units).
        simple_hybrid: one pass of the hybrid convergence loop suffices.
    """

    num_groups: int
    hash_block_size: int
    alignment: int
    partial: bool
    simple_hybrid: bool


#: A family's launcher: ``op(table, W, group_ids, hashes, trusted=...)``,
#: table int64 ``[capacity, W + 1]`` (a KeyIndex table), group_ids int64
#: ``[N]``, hashes int64 ``[N, W]``, all contiguous on one device; returns a
#: tensor ``[N]``, one entry per key (see each launcher).
KeyOp = Callable[..., "torch.Tensor"]


def key_op(
    name: str, doc: str, work: KeyOp, *, trusted_by_default: bool = False
) -> KeyOp:
    """The launcher ``name`` of a hash-index family (``kernels/hash_index.py``
    for Triton, ``hash_index_numba.py``, ``hash_index_torch.py``; documented
    by ``doc``): the signature they share, so that a KeyIndex calls the family
    its backend names without knowing which, calling ``work(table, W,
    group_ids, hashes, trusted)``.

    ``trusted`` (default ``trusted_by_default``): the caller built the
    arguments so (a KeyIndex's own table and normalized keys), and nothing
    is checked. The launcher reports ``work``'s module as its own."""

    def op(
        table: torch.Tensor,
        W: int,
        group_ids: torch.Tensor,
        hashes: torch.Tensor,
        trusted: bool = trusted_by_default,
    ) -> torch.Tensor:
        return work(table, W, group_ids, hashes, trusted)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    # A functools.partial of the family's function names no module itself.
    op.__module__ = getattr(work, "func", work).__module__
    return op
