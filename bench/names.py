"""The names the command line and the harness share, importable without torch.

``kvhit --help`` prints every choice below; importing this module (and the
presets of ``bench/workloads.py``, numpy only) is all it costs, so help answers
well under half a second. The engine's own list of backends lives in
``kvhit.coordinator.engine.BACKEND_CLASSES`` (it imports torch);
``tests/test_cli.py`` checks that :data:`ENGINE_BACKENDS` names each of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PEERS",
    "PRESET_DESCRIPTIONS",
    "SHIPPED_TRACE",
    "SYNTHETIC_TRACE",
    "TRACES",
    "TRACE_BLOCK_SIZE",
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
    "Skip",
]

#: The presets of ``bench/workloads.py`` (its ``PRESETS`` builds each layout),
#: by name, with what ``--help`` says of each.
PRESET_DESCRIPTIONS: dict[str, str] = {
    "dsv4-flash": "DeepSeek-V4-Flash: Full 256 + SWA 64/w128 x2 (one EAGLE) + "
    "SWA 4/w8 + SWA 8/w128; hash 4, scheduler 256, use_eagle",
    "qwen3-next": "Qwen3-Next-like: Full 64 + Mamba 64; hash 16, scheduler 64, "
    "partial hash hits",
    "gemma3": "Gemma-3-like: Full 16 + SWA 16/w1024; hash 16, scheduler 16",
    "llama": "plain full attention: Full 16; hash 16",
    "dsv4-longhit": "dsv4-flash's layout under long-hit traffic: 16 max-tokens "
    "system prompts (Zipf 1), prompts max/8..max uniform sharing 25/50/90/100 % "
    "of a system prompt, half of them stored, 2 % evicted",
}

#: The peer indexes ``--peer`` names (``bench/peers.py`` runs them;
#: ``tests/test_cli.py`` checks the two lists agree).
PEERS = ("dynamo",)

#: The Mooncake FAST'25 conversation trace shipped with kvhit.
SHIPPED_TRACE = (
    Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
)
#: The Mooncake FAST'25 synthetic trace (public datasets, Poisson arrivals),
#: shipped as a second, held-out trace for the peer comparison.
SYNTHETIC_TRACE = (
    Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"
)
#: The shipped traces by name (``peer_targets --trace``).
TRACES = {"conversation": SHIPPED_TRACE, "synthetic": SYNTHETIC_TRACE}
#: Tokens per ``hash_ids`` entry in the Mooncake traces.
TRACE_BLOCK_SIZE = 512

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
#: the side going first switching every step).
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


@dataclass(frozen=True)
class Skip:
    """A backend left out of a run, and why."""

    backend: str
    reason: str
