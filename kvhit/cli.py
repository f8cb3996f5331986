"""``kvhit`` command line: ``demo``, ``bench``, ``replay`` and ``route``.

This module parses and checks arguments with the standard library alone (and
``kvhit/bench/names.py``, which imports nothing): ``kvhit --help`` and every
subcommand's ``--help`` answer without importing torch. The work is in
``kvhit/commands.py``, imported once the arguments have passed.

Every check has one form: an argparse ``type`` for a value on its own
(numbers: finite, in range; lists; choices) and, for what needs more than one
value or a look at the machine (``--min-tokens`` above ``--max-tokens``, a
file, a device, a backend), a function that raises
:class:`~kvhit.errors.ArgumentError`. Either way ``kvhit`` prints the usage
and ``argument NAME: message`` and exits 2, before any work. A trace is also
an argument: one that turns out corrupt, truncated, malformed or empty when
it is read exits 2 the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvhit import __version__, errors
from kvhit.bench.names import (
    BACKENDS,
    DEFAULT_BATCH_SIZES,
    PEER_ORDERS,
    PEERS,
    PRESET_DESCRIPTIONS,
    QUICK_BATCH_SIZES,
    QUICK_REPEATS,
    REFERENCE_REQUESTS,
    ROUTE_LIMIT,
    ROUTERS,
    SHIPPED_TRACE,
    TRACE_BLOCK_SIZE,
    MismatchError,
)
from kvhit.errors import (
    EXIT_CODES,
    EXIT_INTERNAL,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_USAGE,
    ArgumentError,
)

# The exit codes and ArgumentError are kvhit.errors' (re-exported as its list).
__all__ = [
    *errors.__all__,
    "QUICK_BATCH_SIZES",
    "QUICK_REPEATS",
    "build_parser",
    "main",
]

_DEFAULTS = argparse.ArgumentDefaultsHelpFormatter


class _Formatter(argparse.RawDescriptionHelpFormatter, _DEFAULTS):
    """Descriptions kept as written; every option's default in its help
    (but for flags and options whose help says what their absence means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


# ---------------------------------------------------------------------------
# Values on their own (argparse types)
# ---------------------------------------------------------------------------


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _float_above(low: float, *, inclusive: bool) -> Callable[[str], float]:
    """A finite float ``> low`` (``>= low`` when ``inclusive``): NaN and the
    infinities are refused, as is anything below."""
    sign = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        ok = value >= low if inclusive else value > low
        if not math.isfinite(value) or not ok:
            raise argparse.ArgumentTypeError(
                f"must be a finite number {sign} {low:g}, got {text}"
            )
        return value

    return parse


_positive_float = _float_above(0.0, inclusive=False)
_non_negative_float = _float_above(0.0, inclusive=True)


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r} (choose from {', '.join(choices)})"
            )
        return text

    return parse


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list, got {text!r}"
            )
        return items

    return parse


# ---------------------------------------------------------------------------
# Checks across values, files and the machine (raise ArgumentError)
# ---------------------------------------------------------------------------


def _check_output(flag: str, path: str | None) -> None:
    """Fails now, not after the work, when ``path`` cannot be written."""
    if not path:
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ArgumentError(flag, f"{path} is a directory")
    if not folder.is_dir():
        raise ArgumentError(flag, f"directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        raise ArgumentError(flag, f"{path} is not writable")


def _check_plot(path: str | None) -> None:
    _check_output("--plot", path)
    if path and importlib.util.find_spec("matplotlib") is None:
        raise ArgumentError(
            "--plot",
            "needs matplotlib, which is not installed; pip install 'kvhit[plot]' "
            "(or matplotlib), or drop --plot (--json FILE keeps the figures)",
        )


def _check_trace(args: argparse.Namespace) -> None:
    trace = Path(args.trace)
    if not trace.is_file():
        raise ArgumentError("TRACE", f"{args.trace} is not a file")


def _device_of(args: argparse.Namespace) -> str:
    """``--device``, checked against this machine (torch is imported here,
    after parsing: help never gets this far), or the default device."""
    from kvhit.bench.harness import default_device
    from kvhit.kernels.checks import check_device

    if args.device is None:
        return default_device()
    try:
        return str(check_device(args.device, "device"))
    except (TypeError, ValueError) as exc:
        raise ArgumentError("--device", str(exc)) from None


def _check_backends(flag: str, backends: Sequence[str], device: str) -> None:
    """Refuses a backend this machine cannot run on ``device``: triton off
    CUDA (on the CPU it runs only under ``TRITON_INTERPRET=1``, a test tool)
    or without triton installed, numba without numba installed."""
    on_cuda = device.split(":", 1)[0] == "cuda"
    for b in backends:
        if b == "triton":
            if importlib.util.find_spec("triton") is None:
                raise ArgumentError(
                    flag, "triton is not installed here (pip install 'kvhit[cuda]')"
                )
            if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise ArgumentError(
                    flag,
                    f"triton needs a CUDA device, and the device is {device} "
                    "(on the CPU triton runs only under TRITON_INTERPRET=1, "
                    "a test tool); choose numba or torch, or leave it to auto",
                )
        if b == "numba" and importlib.util.find_spec("numba") is None:
            raise ArgumentError(flag, "numba is not installed here")


def _check_workload_args(args: argparse.Namespace) -> None:
    if args.min_tokens > args.max_tokens:
        raise ArgumentError(
            "--min-tokens",
            f"{args.min_tokens} is above --max-tokens ({args.max_tokens})",
        )


def _check_demo_args(args: argparse.Namespace) -> None:
    _check_workload_args(args)
    device = _device_of(args)
    if args.backend != "auto":
        _check_backends("--backend", [args.backend], device)


def _check_bench_args(args: argparse.Namespace) -> None:
    _check_workload_args(args)
    _check_output("--json", args.json)
    _check_plot(args.plot)
    device = _device_of(args)
    if args.backends != ["auto"]:
        _check_backends("--backends", args.backends, device)


def _check_replay_args(args: argparse.Namespace) -> None:
    _check_trace(args)
    _check_output("--json", args.json)
    _check_plot(args.plot)


def _check_route_args(args: argparse.Namespace) -> None:
    if args.trace_option is not None:
        if args.trace is not None:
            raise ArgumentError("--trace", "give the trace once, as TRACE")
        warnings.warn(
            "kvhit route --trace is deprecated; pass the trace as TRACE",
            FutureWarning,
            stacklevel=1,
        )
        args.trace = args.trace_option
    if args.trace is None:
        args.trace = str(SHIPPED_TRACE)
    _check_trace(args)
    _check_output("--json", args.json)
    _check_plot(args.plot)


# ---------------------------------------------------------------------------
# The parsers
# ---------------------------------------------------------------------------


def _add_workload_args(p: argparse.ArgumentParser, repeats_default: int | None) -> None:
    p.add_argument(
        "--min-tokens", type=_int_at_least(1), default=256, help="shortest prompt"
    )
    p.add_argument(
        "--max-tokens", type=_int_at_least(1), default=16384, help="longest prompt"
    )
    p.add_argument(
        "--hash-bytes",
        type=int,
        choices=(8, 16, 32),
        default=32,
        help="block hash width in bytes (32: sha256)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--history",
        type=_non_negative_float,
        default=1.0,
        help="requests served (stored) before the batch, as a multiple of the "
        "batch size (lower it for huge prompts)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda[:N], ... (default: the accelerator if present, else cpu)",
    )
    p.add_argument(
        "--repeats",
        type=_int_at_least(1),
        default=repeats_default,
        help="timed runs"
        + ("" if repeats_default else f" (default 5, {QUICK_REPEATS} with --quick)"),
    )
    p.add_argument(
        "--sample",
        type=_int_at_least(1),
        default=64,
        help="requests sampled for the check against the reference loop where "
        "not every request is checked",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _add_output_args(p: argparse.ArgumentParser, plot_help: str) -> None:
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help=f"{plot_help} (needs matplotlib)")


def _add_preset(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        choices=list(PRESET_DESCRIPTIONS),
        default="dsv4-flash",
        help="cache layout",
    )


def _add_trace(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "trace",
        metavar="TRACE",
        nargs="?",
        default=default,
        help="trace file (default: the shipped Mooncake conversation trace)",
    )


def _subparser(
    sub: Any, name: str, help: str, description: str, presets_help: str
) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(description),
        epilog=f"presets:{presets_help}\n\n{EXIT_CODES}",
        formatter_class=_Formatter,
    )


def _add_demo(sub: Any, presets_help: str) -> None:
    demo = _subparser(
        sub,
        "demo",
        "look up one realistic batch, check it, print a table",
        "Builds a synthetic serving workload (shared system prompts, "
        "multi-turn growth, an evicted store), resolves the whole batch with "
        "LookupEngine (backend auto: triton on CUDA, numba on the CPU), "
        "checks a sample against the reference loop and prints hit rates, "
        "the first call (compilation or the kernel cache), a first call in "
        "a fresh process, the steady-state latency and the speedup over the "
        "reference loop.",
        presets_help,
    )
    _add_preset(demo)
    demo.add_argument(
        "--requests", type=_int_at_least(1), default=1024, help="batch size"
    )
    demo.add_argument(
        "--backend",
        choices=("auto", *BACKENDS),
        default="auto",
        help="auto: what LookupEngine picks, triton on CUDA, numba on the CPU",
    )
    demo.add_argument(
        "--check-all",
        action="store_true",
        help="check every request against the reference, not a sample",
    )
    demo.add_argument(
        "--no-fresh-process",
        action="store_true",
        help="skip the first-call measurement in a fresh process (saves ~3 s)",
    )
    _add_workload_args(demo, 5)
    demo.set_defaults(check=_check_demo_args, command_parser=demo)


def _add_bench(sub: Any, presets_help: str) -> None:
    bench = _subparser(
        sub,
        "bench",
        "sweep presets x batch sizes x backends; JSON and plot",
        "For each preset and batch size, checks every backend against the "
        "reference loop (all requests up to --reference-cap, --sample "
        "above), then times each end to end through LookupEngine.lookup on "
        "a packed batch (median of --repeats) and reports medians, the "
        "ratios to the reference loop (and to vLLM's own worker lookup with "
        "--vllm) and the packing cost per request, side by side. A backend "
        "whose engine cannot be built is skipped with the reason.",
        presets_help,
    )
    bench.add_argument(
        "--presets",
        type=_csv(_choice(["all", *PRESET_DESCRIPTIONS])),
        default=["all"],
        help="comma-separated presets, or all",
    )
    sizes = ",".join(map(str, DEFAULT_BATCH_SIZES))
    quick = ",".join(map(str, QUICK_BATCH_SIZES))
    bench.add_argument(
        "--batch-sizes",
        type=_csv(_int_at_least(1)),
        default=None,
        help=f"comma-separated batch sizes (default {sizes}; {quick} with --quick)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help=f"a short sweep: batch sizes {quick}, {QUICK_REPEATS} repeats",
    )
    bench.add_argument(
        "--backends",
        type=_csv(_choice(["auto", *BACKENDS])),
        default=["auto"],
        help=f"comma-separated of {','.join(BACKENDS)}; auto = all of them "
        "(triton only off the CPU)",
    )
    bench.add_argument(
        "--vllm",
        action="store_true",
        help="add vLLM 0.33.0's own per-request MooncakeStoreWorker.lookup (store "
        "answered from memory); needs the vLLM oracle (.ci/install-vllm-oracle: "
        "<venv>/kvhit-vllm-oracle or $KVHIT_VLLM_ORACLE_DIR)",
    )
    bench.add_argument(
        "--reference-cap",
        type=_int_at_least(0),
        default=1024,
        help="largest batch the (slow) per-request loops are timed and fully "
        "checked at; above it, --sample requests are checked and their "
        "per-request time extrapolated",
    )
    bench.add_argument(
        "--peer",
        choices=list(PEERS),
        default=None,
        help="also run a peer index beside kvhit on the shipped conversation "
        "trace (one FullAttention(512) group, steps of each batch size, answers "
        "asserted equal: a mismatch exits 1): dynamo, from the 'peers' extra "
        "(ai-dynamo-runtime); skipped with the reason when absent",
    )
    bench.add_argument(
        "--peer-limit",
        type=_int_at_least(1),
        default=None,
        help="replay only the first N trace requests for --peer (default: all)",
    )
    bench.add_argument(
        "--peer-host-load",
        type=_csv(_int_at_least(0)),
        default=[0],
        metavar="N[,N...]",
        help="run --peer once per N with N CPU-bound processes spinning beside "
        "it (a busy serving host; Dynamo answers on its own thread, kvhit on "
        "the caller's); 0: a quiet host",
    )
    bench.add_argument(
        "--peer-order",
        type=_csv(_choice(PEER_ORDERS)),
        default=["separate", "alternate"],
        metavar="ORDER[,ORDER]",
        help="how --peer replays the two indexes: separate (kvhit's replay, "
        "then the peer's, each a pass of its own) and/or alternate (step "
        "by step, side by side: each pays for the cache state the other leaves "
        "behind); default: both, side by side in one table",
    )
    bench.add_argument(
        "--key-index",
        action="store_true",
        help="also measure KeyIndex.contains probes/s",
    )
    _add_output_args(bench, "draw lookups/s vs batch size per backend")
    _add_workload_args(bench, None)
    bench.set_defaults(check=_check_bench_args, command_parser=bench)


def _add_replay(sub: Any, presets_help: str) -> None:
    replay = _subparser(
        sub,
        "replay",
        "replay a request trace with the exact hybrid rules; hit rates",
        "Replays a Mooncake-format request trace (JSONL, plain or .gz; the "
        "shipped FAST'25 conversation trace by default) in scheduler steps: "
        "each trace block is expanded into the preset's hash blocks, every "
        "step is looked up with vLLM's exact store-worker rule "
        "(LookupEngine on a KeyIndex) and what vLLM's saving worker keeps "
        "for each served prompt is stored. Prints the hit rate (tokens "
        "served from the store / prompt tokens) beside what a "
        "full-attention-only index (Dynamo's, llm-d's view) would claim on "
        "the same store, and the per-step lookup time beside the reference "
        "loop's (on a sample of steps, answers checked).",
        presets_help,
    )
    _add_trace(replay, str(SHIPPED_TRACE))
    _add_preset(replay)
    replay.add_argument(
        "--trace-block-size",
        type=_int_at_least(1),
        default=TRACE_BLOCK_SIZE,
        help="tokens per trace hash_ids entry",
    )
    replay.add_argument(
        "--step-ms",
        type=_positive_float,
        default=100.0,
        help="scheduler step window in ms of replay time",
    )
    replay.add_argument(
        "--speedup",
        type=_positive_float,
        default=1.0,
        help="trace time runs this many times faster",
    )
    replay.add_argument(
        "--batch",
        type=_int_at_least(1),
        default=None,
        help="fixed steps of this many requests in trace order (instead of "
        "--step-ms windows)",
    )
    replay.add_argument(
        "--store-blocks",
        type=_int_at_least(1),
        default=None,
        help="keep at most this many keys in the store, LRU (a hit refreshes "
        "the keys it loads); default: unbounded",
    )
    replay.add_argument(
        "--limit",
        type=_int_at_least(1),
        default=None,
        help="replay only the first N requests (default: all)",
    )
    replay.add_argument(
        "--reference-requests",
        type=_int_at_least(0),
        default=REFERENCE_REQUESTS,
        help="about how many requests (whole steps spread over the run) the "
        "reference loop checks and is timed on (0: none)",
    )
    replay.add_argument(
        "--peer",
        choices=list(PEERS),
        default=None,
        help="run a peer index beside kvhit: dynamo (the 'peers' extra, "
        "ai-dynamo-runtime); skipped with the reason when absent",
    )
    _add_output_args(replay, "hit rate over time (claimed vs exact) and step latency")
    replay.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    replay.set_defaults(check=_check_replay_args, command_parser=replay)


def _add_route(sub: Any, presets_help: str) -> None:
    route = _subparser(
        sub,
        "route",
        "replay a trace across E engines: hit rate per router (exact rules)",
        "Replays a Mooncake-format request trace across E simulated engines, "
        "each with its own store, under several routers (round-robin; kvhit, "
        "on the exact hits of every engine; full-attention-only, on what an "
        "index of full-attention blocks believes), and scores every placement "
        "under vLLM's exact hit rules. Loads are the in-flight decode blocks. "
        "The defaults reproduce README's table.",
        presets_help,
    )
    _add_trace(route, None)
    route.add_argument(
        "--trace",
        dest="trace_option",
        default=None,
        help="deprecated: give the trace as TRACE",
    )
    _add_preset(route)
    route.add_argument(
        "--engines", type=_int_at_least(1), default=8, help="simulated engines E"
    )
    route.add_argument(
        "--router",
        action="append",
        choices=ROUTERS,
        help="router to run (repeatable; default: all of them)",
    )
    route.add_argument(
        "--limit",
        type=_int_at_least(1),
        default=ROUTE_LIMIT,
        help="route the first N trace requests",
    )
    route.add_argument(
        "--batch", type=_int_at_least(1), default=8, help="requests routed per call"
    )
    route.add_argument(
        "--tpot-ms",
        type=_non_negative_float,
        default=20.0,
        help="decode ms per output token (how long a request stays in flight)",
    )
    route.add_argument(
        "--overlap-weight",
        type=_non_negative_float,
        default=1.0,
        help="the routers' prefill weight",
    )
    route.add_argument(
        "--check-every",
        type=_int_at_least(0),
        default=50,
        help="check every N-th batch against per-engine lookups (0: never)",
    )
    _add_output_args(route, "hit rate and the router's own estimate per router")
    route.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    route.set_defaults(check=_check_route_args, command_parser=route)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvhit`` argument parser (``demo``, ``bench``, ``replay``,
    ``route``)."""
    presets_help = "".join(
        textwrap.fill(
            f"{name}: {description}",
            79,
            initial_indent="\n  ",
            subsequent_indent="    ",
        )
        for name, description in PRESET_DESCRIPTIONS.items()
    )
    parser = argparse.ArgumentParser(
        prog="kvhit",
        description="Batched external KV-cache hit lookup (vLLM 0.33.0 semantics).",
        epilog="Run 'kvhit demo' for a short tour; 'kvhit bench --help' for "
        f"sweeps.\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvhit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub, presets_help)
    _add_bench(sub, presets_help)
    _add_replay(sub, presets_help)
    _add_route(sub, presets_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvhit`` and ``python -m kvhit``; returns the exit code
    (bad arguments raise ``SystemExit(2)``, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    command: argparse.ArgumentParser = args.command_parser
    try:
        args.check(args)
        from kvhit import commands  # the harness, numpy, torch: after the checks

        handler = getattr(commands, f"cmd_{args.command}")
        return handler(args, sys.stdout, sys.stderr)
    except ArgumentError as exc:
        command.error(str(exc))
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except MismatchError as exc:
        sys.stderr.write(f"kvhit {args.command}: MISMATCH: {exc}\n")
        return EXIT_MISMATCH
    except Exception:
        sys.stderr.write(f"kvhit {args.command}: internal error:\n")
        traceback.print_exc(file=sys.stderr)
        return EXIT_INTERNAL
    return EXIT_USAGE  # pragma: no cover - command.error raised SystemExit
