"""The names the command line and the harness share, importable without torch.

``kvhit --help`` prints every choice below; importing this module (and the
presets of ``bench/workloads.py``, numpy only) is all it costs, so help answers
well under half a second. The engine's own list of backends lives in
``kvhit.coordinator.engine.BACKEND_CLASSES`` (it imports torch);
``tests/test_cli.py`` checks that :data:`ENGINE_BACKENDS` names each of them.
"""

from __future__ import annotations

__all__ = [
    "BACKENDS",
    "DEFAULT_BATCH_SIZES",
    "ENGINE_BACKENDS",
    "PEER_BLOCK_SIZE",
    "PEER_ORDERS",
    "QUICK_BATCH_SIZES",
    "QUICK_REPEATS",
    "REFERENCE",
    "REFERENCE_REQUESTS",
    "ROUTERS",
    "ROUTE_LIMIT",
    "VLLM",
    "MismatchError",
]

#: The reference loop: the baseline every ratio is taken against.
REFERENCE = "reference"
#: The engine's backends a sweep tries, in this order (one whose engine cannot
#: be built is skipped with the reason).
ENGINE_BACKENDS = ("numba", "triton", "torch")
#: The backend names a sweep knows: the reference loop, then the engine's.
BACKENDS = (REFERENCE, *ENGINE_BACKENDS)
#: vLLM's own per-request worker lookup (only with the vLLM oracle).
VLLM = "vllm"
DEFAULT_BATCH_SIZES = (1, 8, 64, 1024, 4096)
#: ``kvhit bench --quick``: the batch sizes and repeats of a short sweep.
QUICK_BATCH_SIZES = (1, 64, 1024)
QUICK_REPEATS = 3

#: The peer comparison's layout: one full-attention group whose block is the
#: trace's 512 tokens, so every trace block is one key, as Dynamo sees it.
PEER_BLOCK_SIZE = 512
#: The orders the peer sweep replays in: ``separate`` (kvhit's whole replay,
#: then the peer's, each a pass of its own) or ``alternate`` (step by step,
#: kvhit then the peer).
PEER_ORDERS = ("separate", "alternate")

#: About how many requests ``kvhit replay``'s reference loop answers by
#: default (whole steps, spread over the run): ~10-50 ms per long hybrid prompt.
REFERENCE_REQUESTS = 128

#: The routers ``kvhit route`` compares.
ROUTERS = ("round-robin", "kvhit", "full-attention-only")
#: ``kvhit route``'s default ``--limit``: the trace requests README's table
#: was measured on.
ROUTE_LIMIT = 3000


class MismatchError(Exception):
    """A backend's hits differ from the reference loop's (``kvhit`` exits 1)."""
