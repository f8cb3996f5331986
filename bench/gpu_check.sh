#!/usr/bin/env bash
# kvhit GPU check: one self-contained run for a CUDA machine with torch and
# triton (>= 3.6) preinstalled and no network (numba, pytest, hypothesis
# optional). Works from a bare checkout: nothing is installed.
#
#     bash bench/gpu_check.sh            # the real thing (needs a CUDA GPU)
#     bash bench/gpu_check.sh --dry-run  # every step, tiny sizes, on the CPU
#
# First line: Python, torch, triton, numba (or "absent"), CUDA, driver, GPU,
# commit, and whether the Triton features the kernels need are present (it
# stops there, exit 2, when one is missing). Then, in a budget of
# KVHIT_GPU_CHECK_BUDGET seconds in all (default 285, compile included; under
# 5 minutes on an H200), each step printing its time when it ends:
#   1. the GPU tests (pytest -m gpu, at most 60 s), when pytest and hypothesis
#      are there, else SKIP;
#   (--dry-run: the cost model, python -m kvhit.bench.gpu_model --quick,
#   round trips per request and launches/syncs per call under the interpreter)
#   2. python -m kvhit.bench.gpu_check (bench/gpu_check.py): per preset,
#      smallest first, the 4096 x 128K-token workload built once on the GPU,
#      the triton lookup eagerly (first call with its compile apart) and
#      under CUDA-graph replay, parity against the reference (and numba when
#      it imports: every request), then KeyIndex inserts/s and probes/s, the
#      long-hit dsv4 table (B = 1 .. 4096: validated eager, graph, numba on
#      1 thread and on all cores, the thread count stated), and the summary
#      table (Markdown, for bench/RESULTS.md) last. Every result row is
#      printed and appended to $OUT/results.jsonl as soon as it exists, so a
#      timeout loses nothing measured; steps that would start past the budget
#      are SKIPped so the summary still prints.
#   3. python -m kvhit.bench.gpu_check_fleet: the Triton fleet kernel beside
#      numba at E = 1, 8, 64, 256 and B = 64, 1024 (llama, dsv4-flash), every
#      answer compared, in the last KVHIT_GPU_CHECK_FLEET_S seconds (75).
#
# The import shim (bench/kvhit_shim.sh) mirrors pyproject's package mapping
# onto PYTHONPATH when kvhit is not installed; PYTHONSAFEPATH=1 keeps the
# checkout's own kvhit/ folder from shadowing it.
#
# Exit codes: 0 every step passed or skipped, or no GPU was found (SKIP);
#             1 a step failed or timed out; 2 the environment is broken.
# Logs and results go to $OUT if set, else ./gpu_check_out.
set -u -o pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
T0=$(date +%s)
BUDGET=${KVHIT_GPU_CHECK_BUDGET:-285}
OUTDIR="${OUT:-gpu_check_out}"
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PY=.venv/bin/python
else
    PY="$(command -v python3 || command -v python)"
fi
say() { printf 'gpu_check: %s\n' "$*"; }
elapsed() { echo $(($(date +%s) - T0)); }

if ! CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null); then
    say "FAIL: torch is not importable with $PY"
    exit 2
fi
if [ "$DRY" = "1" ] && [ "$CUDA" != "1" ]; then
    # Before anything imports triton: the kernels run in its interpreter.
    export TRITON_INTERPRET=1
fi
# shellcheck source=bench/kvhit_shim.sh
. bench/kvhit_shim.sh
if ! kvhit_shim "$PY"; then
    say "FAIL: kvhit is not importable (even through the PYTHONPATH shim)"
    exit 2
fi
[ -n "$KVHIT_SHIM" ] && trap 'rm -rf "$KVHIT_SHIM"' EXIT

# The first line: what this machine has. Exit 2 on a missing Triton feature.
"$PY" -m kvhit.bench.gpu_check --env-line 2>&1 | tee "$OUTDIR/env.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" = "2" ]; then
    say "FAIL: this Triton cannot build the kernels (see above)"
    exit 2
elif [ "$rc" != "0" ]; then
    say "FAIL: kvhit does not import with $PY (see above)"
    exit 2
fi
if [ "$DRY" != "1" ] && [ "$CUDA" != "1" ]; then
    say "SKIP: no CUDA GPU found; bash bench/gpu_check.sh --dry-run runs the steps on the CPU"
    exit 0
fi

# run_step MODULE LIMIT RESULTS WHEN ARGS...: python -m kvhit.bench.MODULE
# ARGS under a hard limit of LIMIT s, logged to $OUTDIR/MODULE.log; then its
# status line (a timeout keeps what it wrote to $OUTDIR/RESULTS; WHEN: "so
# far" or "in all" after the elapsed seconds). A failure sets FAILED=1.
run_step() {
    local module=$1 limit=$2 results=$3 when=$4 t rc st
    shift 4
    t=$(date +%s)
    timeout --kill-after=5 "$limit" "$PY" -m "kvhit.bench.$module" "$@" 2>&1 |
        tee "$OUTDIR/$module.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) st=PASS ;;
        124 | 137) st="TIMEOUT (results so far: $OUTDIR/$results)"; FAILED=1 ;;
        *) st="FAIL (rc $rc)"; FAILED=1 ;;
    esac
    say "== $module.py: $st in $(($(date +%s) - t)) s ($(elapsed) s $when)"
}

FAILED=0
t=$(date +%s)
if [ "$DRY" = "1" ]; then
    say "== gpu tests: SKIP (dry run: the CPU suite runs them as skipped)"
elif "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
    say "== gpu tests (at most 60 s)"
    timeout --kill-after=5 60 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests \
        2>&1 | tee "$OUTDIR/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    case $rc in 0 | 5) st=PASS ;; *) st="FAIL (rc $rc)"; FAILED=1 ;; esac
    say "== gpu tests: $st in $(($(date +%s) - t)) s ($(elapsed) s so far)"
else
    say "== gpu tests: SKIP (pytest or hypothesis not installed)"
fi

if [ "$DRY" = "1" ]; then
    # The cost model (bench/gpu_model.py): round trips per request, launches
    # and syncs per call, under the interpreter; small sizes only here.
    t=$(date +%s)
    say "== cost model (python -m kvhit.bench.gpu_model --quick)"
    "$PY" -m kvhit.bench.gpu_model --quick 2>&1 | tee "$OUTDIR/gpu_model.log"
    rc=${PIPESTATUS[0]}
    case $rc in 0) st=PASS ;; *) st="FAIL (rc $rc)"; FAILED=1 ;; esac
    say "== cost model: $st in $(($(date +%s) - t)) s ($(elapsed) s so far)"
fi
# A dry run's steps run the interpreter on a CPU whose load we do not choose
# (the device twin at load 14 took 266 s for the model alone, then was killed
# at the 60 s floor): their budgets stay the GPU run's, so they do as much
# work, but their hard kill comes SLACK seconds later.
SLACK=0
[ "$DRY" = "1" ] && SLACK=${KVHIT_GPU_CHECK_DRY_SLACK:-600}

# What is left of the budget: the hard limit; steps stop starting 45 s before.
# The fleet step (3.) keeps FLEET_S of it (KVHIT_GPU_CHECK_FLEET_S, default 75).
FLEET_S=${KVHIT_GPU_CHECK_FLEET_S:-75}
left=$((BUDGET - FLEET_S - $(elapsed)))
[ "$left" -lt 60 ] && left=60
ARGS=(--out "$OUTDIR" --budget "$((left - 45))")
[ "$DRY" = "1" ] && ARGS+=(--dry-run)
[ -n "${KVHIT_GPU_CHECK_PRESETS:-}" ] && ARGS+=(--presets "$KVHIT_GPU_CHECK_PRESETS")
run_step gpu_check "$((left + SLACK))" results.jsonl "so far" "${ARGS[@]}"

# 3. The Triton fleet (bench/gpu_check_fleet.py) beside numba, every answer
# compared: E = 1, 8, 64, 256 x B = 64, 1024, llama and dsv4-flash.
left=$((BUDGET - $(elapsed)))
[ "$left" -lt 30 ] && left=30
FARGS=(--out "$OUTDIR" --budget "$((left - 15))")
[ "$DRY" = "1" ] && FARGS+=(--dry-run)
run_step gpu_check_fleet "$((left + SLACK))" fleet.jsonl "in all" "${FARGS[@]}"
if [ "$FAILED" = "1" ]; then
    say "FAILED (logs in $OUTDIR)"
    exit 1
fi
exit 0
