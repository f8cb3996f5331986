"""Registers and spills of every Triton kernel, compiled ahead of time without a GPU.

Triton compiles each kernel outside the interpreter for ``GPUTarget("cuda",
arch, 32)`` into a cubin, exactly as it would on that GPU (its own ptxas and
flags, a fresh cache so ptxas really runs), and ptxas's ``-v`` log (Triton's
``dump_ptxas_log``) gives the register count and the spill bytes. The scan
kernel's variants are the engine's: ``find`` with and without an index and
with and without the store worker's restriction (``token_lens``), ``find``
without EAGLE, and the worker ``lookup`` (``LOOKUP``), for a dsv4-flash-like
layout (W = 4 words, 4 SpecGroups, 2 members at most); then the KeyIndex
kernels of ``kernels/hash_index.py`` (probe with plain and acquire reads,
find, insert, erase; 32-byte keys); then the fleet kernels of
``kernels/fleet_triton.py`` (the joint full-attention scan: runs, find hits,
worker lookup, lookup over a merged SpecGroup of two groups; the engine-set
updates and probe).

Then the fleet's hybrid kernel (``kernels/fleet_triton_hybrid.py``) in
every variant ``fleet_triton.hybrid_hits`` launches, and its class kernel.

Run as a script (``python tests/test_scan_registers.py [--arch 90,100]``,
TRITON_INTERPRET unset) to print the table and exit 1 on a spill or a
variant over its register budget (:func:`problems`): ``.ci/check-triton-floor``
(``make aot``) does so for sm_90 and sm_100 with the newest Triton, and
``.ci/device-twin`` with 3.6.0, both before ``make test``. The pytest test
(sm_90, marked ``aot``) is the same check; ``make test`` leaves it out, since
CI has run it twice by then.

Measured on Triton 3.9 (its ptxas 13.4, with Triton's ptxas flags), sm_90,
registers per thread and spill-store bytes, before issue 13's restructuring
and after it (lookup was two launches of the "find index token_lens" variant):

=======================  ===============  ==============
variant                  before           after
=======================  ===============  ==============
find index               72 r, 152 B      97 r, 0
find index no-eagle      64 r, 160 B      90 r, 0
find                     80 r, 0          78 r, 0
load masks               72 r, 0          70 r, 0
find index token_lens    168 r, 16 B      118 r, 0
find token_lens          168 r, 0         120 r, 0
lookup                   168 r, 16 B x2   120 r, 0
=======================  ===============  ==============

The spills before were not register pressure: 64-bit ``//`` and ``%`` are
subroutine CALLs in SASS, whose calling convention saves live registers to
local memory, and ptxas aims one-warp CTAs at 64 registers. The kernel now
divides in 32 bits and declares ``.maxnreg 128`` (``kernels/scan.py``,
``MAXNREG``); the lookup variant got under 128 by keeping no mask state and
recomputing a SpecGroup's derived numbers after its probe loops.

Issue 17 (Triton 3.6.0, the GPU machine's: ptxas 12.8, 12.9 for sm_100), registers
per thread, no spills anywhere; sm_90 / sm_100:

=======================  ===========  ===========
variant                  3.9.0        3.6.0
=======================  ===========  ===========
find index               97 / 97      106 / 98
find index no-eagle      90 / 90      96 / 90
find                     78 / 78      80 / 80
load masks               70 / 70      72 / 72
find index token_lens    118 / 118    118 / 118
find token_lens          120 / 120    118 / 118
lookup                   120 / 120    120 / 120
KeyIndex probe           26 / 26      27 / 27
KeyIndex probe acquire   26 / 26      27 / 27
KeyIndex find            26 / 26      28 / 28
KeyIndex insert          32 / 32      32 / 32
KeyIndex erase           26 / 26      27 / 27
=======================  ===========  ===========

The fleet kernels (issue 32: 128-block tiles on four warps, engine-word
halves in 32-bit lanes; four warps for the updates), no spills anywhere;
sm_90 / sm_100 (2026-12-06):

=======================  ===========  ===========
variant                  3.9.0        3.6.0
=======================  ===========  ===========
fleet runs               94 / 94      96 / 96
fleet find               94 / 94      96 / 96
fleet lookup             94 / 94      96 / 96
fleet lookup merged      95 / 95      124 / 124
fleet set bits           18 / 18      18 / 18
fleet clear bits         18 / 18      18 / 18
fleet tombstone          16 / 14      16 / 14
fleet probe bits         26 / 26      28 / 28
=======================  ===========  ===========

Issue 31 (Triton 3.9.0, sm_90; sm_100 within 2): the leading run in 128-block tiles over two
warps (NUM_WARPS 2, LEAD_FACTOR 4), a probe step's loads issued at once, the
next tile's home slots held: find index 110, find index no-eagle 110, find
90, load masks 80, find index token_lens 116, find token_lens 118, lookup
121 registers, no spills. One warp spilled (find index token_lens 92 B);
four warps fit (lookup 120) but hold 4 programs per SM.

Issue 31, a probe's key words loaded once and held, later probe steps two
slots at once, chains above a search's first miss stopped (sm_90,
registers, no spills; 3.9.0 / 3.6.0): find index 120 / 116, find index
no-eagle 121 / 126, find 90 / 90, load masks 80 / 80, find index
token_lens 108 / 122, find token_lens 120 / 122, lookup 105 / 122. Loading the next tile's words ahead as well (one round trip less a
tile step) compiles under 3.6 only in a ``for`` loop, and there spills
(lookup 128 registers, 128-144 B of spill stores): not done.

Issue 31, one warp per program (16 resident per SM, not 8), the wide tile
then 4 lanes a thread: holding its words through the probe chain spilled
on 3.6 (find index token_lens 64 B, lookup 52 B); reloading them with each
chain step's slots fits (sm_90 registers, no spills; 3.9.0 / 3.6.0): find
index 116 / 116, find index no-eagle 110 / 111, find 96 / 96, load masks
92 / 96, find index token_lens 114 / 126, find token_lens 116 / 128, lookup
110 / 128. The fleet's hybrid kernel (the same warps): 106-112 / 108-116.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

# As a script under PYTHONSAFEPATH=1 (.ci/device-twin) the script's folder is
# not on sys.path by itself.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import compile_outside_interpreter  # noqa: E402

# The lookup variant's register budget: 128 per thread keeps 16 one-warp
# programs resident per SM partition budget (65536 / 128 / 32).
LOOKUP_MAX_REGS = 128

_SCRIPT = r"""
import contextlib, io, json, os, re, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # ptxas must really run
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvhit.kernels import fleet_triton, fleet_triton_bits, fleet_triton_hybrid, hash_index, scan

triton.knobs.nvidia.dump_ptxas_log = True
ARCHS = [int(a) for a in sys.argv[1].split(",")]


def compile_one(kernel, sig, cx, arch, options):
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        out = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=cx),
                             target=GPUTarget("cuda", arch, 32), options=options)
    assert out.asm["cubin"], kernel.__name__
    text = log.getvalue()
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    st, ld = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                       text).groups()
    return dict(regs=regs, spill_stores=int(st), spill_loads=int(ld))


consts = ["W", "HAS_INDEX", "HAS_TL", "APPLY_EAGLE", "LOOKUP", "BLOCK",
          "LEAD", "S_PAD", "SG_W"]
sig = {}
for name in scan._scan_kernel.arg_names:
    if name in consts:
        sig[name] = "constexpr"
    elif name.endswith("_ptr"):
        sig[name] = "*i64"
    elif name == "cap_mask":
        sig[name] = "i64"
    else:
        sig[name] = "i32"
variants = {
    "find index": (1, 0, 1, 0),
    "find index no-eagle": (1, 0, 0, 0),
    "find": (0, 0, 1, 0),
    "load masks": (0, 0, 0, 0),
    "find index token_lens": (1, 1, 1, 0),
    "find token_lens": (0, 1, 1, 0),
    "lookup": (1, 1, 1, 1),
}
for arch in ARCHS:
    for name, (has_index, has_tl, eagle, lookup) in variants.items():
        cx = dict(W=4, HAS_INDEX=bool(has_index), HAS_TL=bool(has_tl),
                  APPLY_EAGLE=bool(eagle), LOOKUP=bool(lookup),
                  BLOCK=scan.BLOCK,
                  LEAD=scan.BLOCK * scan.LEAD_FACTOR, S_PAD=4, SG_W=12)
        row = compile_one(scan._scan_kernel, sig, cx, arch,
                          {"num_warps": scan.NUM_WARPS, "maxnreg": scan.MAXNREG})
        print(json.dumps(dict(kernel="scan", variant=name, arch=arch, **row)))
    # The KeyIndex kernels as their launcher builds them (_launch: BLOCK 128,
    # Triton's default 4 warps; a cap_mask past 2**31 - 1 arrives as i64).
    # "probe acquire": find_slots' concurrent-reader read (atomic_or acquire).
    for name, kernel, extra in (
        ("probe", hash_index._probe_kernel,
         {"ACQUIRE": False, "MODE": hash_index._PROBE}),
        ("probe acquire", hash_index._probe_kernel,
         {"ACQUIRE": True, "MODE": hash_index._PROBE}),
        ("find", hash_index._probe_kernel,
         {"ACQUIRE": False, "MODE": hash_index._FIND}),
        ("insert", hash_index._insert_kernel,
         {"WAITS": hash_index.BUSY_WAIT_LIMIT}),
        ("erase", hash_index._probe_kernel,
         {"ACQUIRE": False, "MODE": hash_index._ERASE}),
    ):
        ksig = {n: "*i64" for n in ("table_ptr", "gid_ptr", "key_ptr")}
        ksig.update(out_ptr="*i64" if name == "find" else "*i8",
                    cap_mask="i64", n="i32", W="constexpr", BLOCK="constexpr")
        cx = dict(W=4, BLOCK=128, **extra)
        ksig.update(dict.fromkeys(extra, "constexpr"))
        row = compile_one(kernel, ksig, cx, arch, {"num_warps": 4})
        print(json.dumps(dict(kernel="key_index", variant=name, arch=arch, **row)))
    # The fleet kernels of kernels/fleet_triton.py as its launchers build
    # them: the joint full-attention scan (runs, find hits, worker lookup; a
    # merged SpecGroup of two groups: MP 2) and the engine-set updates.
    fsig = {}
    for name in fleet_triton._fleet_kernel.arg_names:
        if name in ("W", "MODE", "DROP", "MP", "BLOCK"):
            fsig[name] = "constexpr"
        elif name.endswith("_ptr"):
            fsig[name] = "*i64"
        else:
            fsig[name] = "i64" if name == "cap_mask" else "i32"
    for name, (mode, mp) in (("runs", (0, 1)), ("find", (1, 1)),
                             ("lookup", (2, 1)), ("lookup merged", (2, 2))):
        cx = dict(W=4, MODE=mode, DROP=True, MP=mp, BLOCK=fleet_triton.BLOCK)
        row = compile_one(fleet_triton._fleet_kernel, fsig, cx, arch,
                          {"num_warps": fleet_triton.NUM_WARPS})
        print(json.dumps(dict(kernel="fleet", variant=name, arch=arch, **row)))
    for name, kernel in (("set bits", fleet_triton_bits._set_bits_kernel),
                         ("clear bits", fleet_triton_bits._clear_bits_kernel),
                         ("tombstone", fleet_triton_bits._tombstone_kernel),
                         ("probe bits", fleet_triton_bits._probe_bits_kernel)):
        ksig = {n: ("*i8" if n in ("new_ptr", "gone_ptr", "freed_ptr") else "*i64")
                for n in kernel.arg_names if n.endswith("_ptr")}
        ksig.update(n="i32", nw="i32", BLOCK="constexpr")
        if "cap_mask" in kernel.arg_names:
            ksig.update(cap_mask="i64", n_rows="i32")
        cx = dict(BLOCK=128)
        if "W" in kernel.arg_names:
            ksig["W"] = "constexpr"
            cx["W"] = 4
        row = compile_one(kernel, ksig, cx, arch, {"num_warps": 4})
        print(json.dumps(dict(kernel="fleet", variant=name, arch=arch, **row)))
    # The fleet's hybrid kernel (kernels/fleet_triton_hybrid.py) in every
    # variant fleet_triton.hybrid_hits launches, with the scan's warps and
    # register ceiling, for the same dsv4-flash-like layout. HAS_RUNS: after
    # the joint scan (a full-attention first SpecGroup); HAS_CLASS: and the
    # engine classes (class_kernel).
    hsig = {}
    hconsts = ("W", "HAS_RUNS", "HAS_CLASS", "HAS_TL", "APPLY_EAGLE", "LOOKUP",
               "BLOCK", "LEAD", "S_PAD", "SG_W")
    for name in fleet_triton_hybrid.hybrid_kernel.arg_names:
        if name in hconsts:
            hsig[name] = "constexpr"
        elif name.endswith("_ptr"):
            hsig[name] = "*i64"
        else:
            hsig[name] = "i64" if name == "cap_mask" else "i32"
    for name, (runs, cls, has_tl, eagle, lookup) in {
        "find": (1, 0, 0, 1, 0), "find no-eagle": (1, 0, 0, 0, 0),
        "find token_lens": (1, 0, 1, 1, 0), "lookup": (1, 0, 1, 1, 1),
        "find all pairs": (0, 0, 0, 1, 0), "lookup all pairs": (0, 0, 1, 1, 1),
        "find classes": (1, 1, 0, 1, 0), "lookup classes": (1, 1, 1, 1, 1),
    }.items():
        cx = dict(W=4, HAS_RUNS=bool(runs), HAS_CLASS=bool(cls), HAS_TL=bool(has_tl),
                  APPLY_EAGLE=bool(eagle), LOOKUP=bool(lookup), BLOCK=scan.BLOCK,
                  LEAD=scan.BLOCK * scan.LEAD_FACTOR, S_PAD=4, SG_W=12)
        row = compile_one(fleet_triton_hybrid.hybrid_kernel, hsig, cx, arch,
                          {"num_warps": scan.NUM_WARPS, "maxnreg": scan.MAXNREG})
        print(json.dumps(dict(kernel="hybrid", variant=name, arch=arch, **row)))
    # The class kernel, as fleet_triton.hybrid_hits launches it.
    csig = {}
    for name in fleet_triton_hybrid.class_kernel.arg_names:
        if name in ("W", "SG_W", "BLOCK"):
            csig[name] = "constexpr"
        elif name.endswith("_ptr"):
            csig[name] = "*i64"
        else:
            csig[name] = "i64" if name == "cap_mask" else "i32"
    row = compile_one(fleet_triton_hybrid.class_kernel, csig,
                      dict(W=4, SG_W=12, BLOCK=fleet_triton._CLASS_BLOCK), arch,
                      {"num_warps": fleet_triton.NUM_WARPS})
    print(json.dumps(dict(kernel="hybrid", variant="class kernel", arch=arch, **row)))
"""


def measure(archs: tuple[int, ...] = (90,)) -> list[dict]:
    """Registers and spill bytes of every kernel (one dict per kernel variant
    and arch: kernel, variant, arch, regs, spill_stores, spill_loads)."""
    arg = ",".join(str(a) for a in archs)
    out = compile_outside_interpreter(_SCRIPT.replace("sys.argv[1]", repr(arg)))
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def problems(rows: list[dict]) -> list[str]:
    """What the rows break: a spill anywhere, the lookup over its budget, a
    hybrid kernel variant over the scan's ceiling, the class kernel over the
    budget the fleet's cost model counts its resident programs with
    (``fleet_triton.CLASS_REGISTERS``)."""
    from kvhit.kernels.fleet_triton import CLASS_REGISTERS

    bad = []
    for r in rows:
        where = f"{r['kernel']} {r['variant']} sm_{r['arch']}"
        if r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{where}: spills {r['spill_stores']} B / {r['spill_loads']} B")
        budget = None
        if r["kernel"] == "hybrid":
            budget = (
                CLASS_REGISTERS if r["variant"] == "class kernel" else LOOKUP_MAX_REGS
            )
        elif r["variant"] == "lookup":
            budget = LOOKUP_MAX_REGS
        if budget is not None and r["regs"] > budget:
            bad.append(f"{where}: {r['regs']} registers > {budget}")
    return bad


@pytest.mark.aot
def test_kernels_fit_registers_without_spills():
    rows = measure((90,))
    assert len(rows) == 7 + 5 + 8 + 9
    for row in rows:
        print(row)
    assert not problems(rows), problems(rows)
    assert {r["variant"] for r in rows} >= {"lookup", "insert", "find"}


if __name__ == "__main__":
    archs = (90,)
    if "--arch" in sys.argv:
        archs = tuple(int(a) for a in sys.argv[sys.argv.index("--arch") + 1].split(","))
    import triton

    print(f"triton {triton.__version__}: registers and spills per kernel")
    rows = measure(archs)
    for row in rows:
        print(
            f"sm_{row['arch']:<4} {row['kernel']:<10} {row['variant']:<24} "
            f"{row['regs']:>4} regs  {row['spill_stores']:>4} B spill stores  "
            f"{row['spill_loads']:>4} B loads"
        )
    bad = problems(rows)
    for b in bad:
        print(f"FAIL: {b}")
    sys.exit(1 if bad else 0)
