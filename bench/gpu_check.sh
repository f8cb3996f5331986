#!/usr/bin/env bash
# kvhit GPU check: one self-contained run for a CUDA machine with torch and
# triton preinstalled and no network (numba, pytest, hypothesis optional).
# Run from the repository root:
#
#     bash bench/gpu_check.sh            # the real thing (needs a CUDA GPU)
#     bash bench/gpu_check.sh --dry-run  # every step, tiny sizes, on the CPU
#
# Steps (under 6 minutes on an H200, most of it measuring):
#   1. the GPU tests (pytest -m gpu), when pytest and hypothesis are there,
#      else SKIP;
#   2. python -m kvhit.bench.gpu_check (bench/gpu_check.py): preflight (GPU,
#      driver, CUDA, torch, triton, commit, a ptxas the driver accepts), per
#      preset the 4096 x 128K-token workload built once on the GPU, triton
#      parity against the reference (and numba when importable), the lookup
#      eagerly and under CUDA-graph replay, KeyIndex inserts/s and probes/s,
#      and the summary table (Markdown, for bench/RESULTS.md) last.
#
# Nothing is installed: if `kvhit` is not importable, a throw-away directory of
# symlinks mirrors pyproject's package mapping onto PYTHONPATH.
#
# Exit codes: 0 every step passed or skipped, or no GPU was found (SKIP);
#             1 a step failed or timed out; 2 the environment is broken.
# Logs go to $OUT if set, else ./gpu_check_out.
set -u -o pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PY=.venv/bin/python
else
    PY="$(command -v python3 || command -v python)"
fi
OUTDIR="${OUT:-gpu_check_out}"
mkdir -p "$OUTDIR"
say() { printf 'gpu_check: %s\n' "$*"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
    say "FAIL: torch is not importable with $PY"
    exit 2
fi
if [ "$DRY" = "1" ]; then
    # Before anything imports triton: the kernels run in its interpreter.
    "$PY" -c "import torch, sys; sys.exit(torch.cuda.is_available())" && export TRITON_INTERPRET=1
elif [ "$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')" != "1" ]; then
    say "SKIP: no CUDA GPU found; bash bench/gpu_check.sh --dry-run runs the steps on the CPU"
    exit 0
fi
if ! "$PY" -c "import kvhit.bench.gpu_check" 2>/dev/null; then
    SHIM=$(mktemp -d)
    trap 'rm -rf "$SHIM"' EXIT
    mkdir "$SHIM/kvhit"
    for f in kvhit/*.py; do ln -s "$PWD/$f" "$SHIM/kvhit/"; done
    for d in kernels coordinator bindings bench; do ln -s "$PWD/$d" "$SHIM/kvhit/$d"; done
    export PYTHONPATH="$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if ! "$PY" -c "import kvhit.bench.gpu_check"; then
        say "FAIL: kvhit is not importable (even through the PYTHONPATH shim)"
        exit 2
    fi
fi

FAILED=0
if [ "$DRY" = "1" ]; then
    say "== gpu tests: SKIP (dry run: the CPU suite runs them as skipped)"
elif "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
    say "== gpu tests (at most 90 s)"
    timeout --kill-after=10 90 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests \
        2>&1 | tee "$OUTDIR/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    case $rc in 0 | 5) ;; *) say "gpu tests: FAIL (rc $rc)"; FAILED=1 ;; esac
else
    say "== gpu tests: SKIP (pytest or hypothesis not installed)"
fi

ARGS=()
[ "$DRY" = "1" ] && ARGS+=(--dry-run)
[ -n "${KVHIT_GPU_CHECK_PRESETS:-}" ] && ARGS+=(--presets "$KVHIT_GPU_CHECK_PRESETS")
timeout --kill-after=10 "${KVHIT_GPU_CHECK_BUDGET:-270}" "$PY" -m kvhit.bench.gpu_check \
    "${ARGS[@]}" 2>&1 | tee "$OUTDIR/gpu_check.log"
rc=${PIPESTATUS[0]}
case $rc in
    0) ;;
    124 | 137) say "TIMEOUT"; FAILED=1 ;;
    *) FAILED=1 ;;
esac
if [ "$FAILED" = "1" ]; then
    say "FAILED (logs in $OUTDIR)"
    exit 1
fi
exit 0
