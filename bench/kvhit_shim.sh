# Sourced by bench/gpu_check.sh and .ci/device-twin: make `import kvhit` work
# from a bare checkout (no install, no network).
#
#     . bench/kvhit_shim.sh && kvhit_shim "$PY"
#
# If kvhit is not importable, a throw-away directory of symlinks mirrors
# pyproject's package mapping (kvhit=kvhit/, kvhit.kernels=kernels/, ...) and
# goes first on PYTHONPATH. PYTHONSAFEPATH=1 is exported first: `python -c`,
# `python -m` and pytest's `python -m` would otherwise put the checkout itself
# first on sys.path, whose kvhit/ folder (no subpackages) shadows the shim.
# Sets KVHIT_SHIM to the directory (empty when none was needed); the caller
# removes it. Returns 1 when kvhit cannot be found even then (finding, not
# importing: the caller's first import of kvhit tells what is missing).
export PYTHONSAFEPATH=1
kvhit_shim() {
    local py=$1 root f d
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    KVHIT_SHIM=""
    # find_spec imports nothing (no torch): an installed kvhit is used as is.
    if "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('kvhit') is None)"; then
        return 0
    fi
    KVHIT_SHIM=$(mktemp -d)
    mkdir "$KVHIT_SHIM/kvhit"
    for f in "$root"/kvhit/*.py; do ln -s "$f" "$KVHIT_SHIM/kvhit/"; done
    for d in kernels coordinator bindings bench; do
        ln -s "$root/$d" "$KVHIT_SHIM/kvhit/$d"
    done
    export PYTHONPATH="$KVHIT_SHIM${PYTHONPATH:+:$PYTHONPATH}"
    "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('kvhit.bench') is None)"
}
