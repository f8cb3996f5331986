"""Registers and spills of the scan kernel's main variants on sm_90, without a GPU.

Triton compiles the kernel outside the interpreter for ``GPUTarget("cuda", 90,
32)``, and the PTX is assembled again with ``ptxas -v`` (the ptxas Triton
itself uses for sm_90) to read the register count and the spill bytes. The
variants are the engine's: ``find`` with and without an index and with and
without the store worker's restriction (``token_lens``), ``find`` without
EAGLE, and the worker ``lookup`` (``LOOKUP``), for a dsv4-flash-like layout
(W = 4 words, 4 SpecGroups, 2 members at most).

Run as a script (``python tests/test_scan_registers.py``, TRITON_INTERPRET
unset) to print the table.

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
"""

from __future__ import annotations

import json
import sys

from conftest import compile_outside_interpreter

# The lookup variant's register budget: 128 per thread keeps 16 one-warp
# programs resident per SM partition budget (65536 / 128 / 32).
LOOKUP_MAX_REGS = 128

_SCRIPT = r"""
import json, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from kvhit.kernels import scan

kernel = scan._scan_kernel
consts = ["W", "HAS_INDEX", "HAS_TL", "APPLY_EAGLE", "LOOKUP", "BLOCK", "S_PAD",
          "SG_W"]
sig = {}
for name in kernel.arg_names:
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
for name, (has_index, has_tl, eagle, lookup) in variants.items():
    cx = dict(W=4, HAS_INDEX=bool(has_index), HAS_TL=bool(has_tl),
              APPLY_EAGLE=bool(eagle), LOOKUP=bool(lookup),
              BLOCK=scan.BLOCK, S_PAD=4, SG_W=12)
    out = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=cx),
                         target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": scan.NUM_WARPS,
                                  "maxnreg": scan.MAXNREG})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(out.asm["ptx"])
        f.flush()
        res = subprocess.run([get_ptxas(90).path, "-v", "-lineinfo",
                              "--regAllocOptLevel=2", "--gpu-name", "sm_90a",
                              f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    st, ld = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                       res.stderr).groups()
    print(json.dumps(dict(variant=name, regs=regs, spill_stores=int(st),
                          spill_loads=int(ld))))
"""


def measure() -> list[dict]:
    """Registers and spill bytes of every variant (one dict per variant)."""
    out = compile_outside_interpreter(_SCRIPT)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_scan_variants_fit_registers_without_spills():
    rows = measure()
    assert len(rows) == 7
    for row in rows:
        print(row)
    spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, spilling
    (lookup,) = [r for r in rows if r["variant"] == "lookup"]
    assert lookup["regs"] <= LOOKUP_MAX_REGS, lookup


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    for row in measure():
        print(
            f"{row['variant']:<24} {row['regs']:>4} regs  "
            f"{row['spill_stores']:>4} B spill stores  {row['spill_loads']:>4} B loads"
        )
