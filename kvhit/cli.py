"""``kvhit`` command line: ``kvhit demo``, ``kvhit bench`` and ``kvhit replay``.

A thin layer over the benchmark harness (``kvhit.bench.harness``, the file
``bench/harness.py``): this module parses and checks arguments, calls the
harness and prints what it measured.

``demo`` builds one realistic workload (default: DeepSeek-V4-Flash layout, 1024
requests of up to 16K tokens), resolves it with ``LookupEngine(backend="auto")``
(triton on CUDA, numba on the CPU), checks a sample against the reference loop
and prints hit rates, the first-call and steady-state latency and the speedup.
``bench`` sweeps presets x batch sizes x backends, checking parity before
timing anything. ``replay`` replays a public request trace (the Mooncake
conversation trace by default) in scheduler steps against the exact rules
(``kvhit.bench.replay``).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TextIO, TypeVar

import numpy as np

from kvhit import __version__
from kvhit.bench import harness
from kvhit.bench import replay as replay_mod
from kvhit.bench.harness import (
    BACKENDS,
    DEFAULT_BATCH_SIZES,
    PRESETS,
    REFERENCE,
    MismatchError,
    Runner,
    TrafficConfig,
    Workload,
    fmt_count,
    fmt_time,
)

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

EXIT_CODES = """\
exit codes:
  0  success
  1  a backend disagreed with the reference loop (the requests are printed)
  2  bad arguments (the message names the argument)
  3  an internal error (its traceback is printed)"""

#: ``kvhit bench --quick``: the batch sizes and repeats of a short sweep.
QUICK_BATCH_SIZES = (1, 64, 1024)
QUICK_REPEATS = 3
_C = TypeVar("_C")


# ---------------------------------------------------------------------------
# kvhit demo
# ---------------------------------------------------------------------------


def config_from(cls: type[_C], args: argparse.Namespace, **given: Any) -> _C:
    """A configuration dataclass ``cls`` from ``given`` plus, for each field
    not given, the argument of the same name (fields with neither keep their
    default). Each subcommand's options are named after the fields they set,
    so one rule maps them all."""
    values = dict(given)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in values and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**values)


def traffic_config(args: argparse.Namespace, num_requests: int) -> TrafficConfig:
    """The workload knobs of ``args`` for a batch of ``num_requests``."""
    return config_from(TrafficConfig, args, num_requests=num_requests)


def cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``kvhit demo``: one batch, checked, timed and summarised."""
    t_start = time.perf_counter()
    device = args.device or harness.default_device()
    err.write(
        f"kvhit demo: building {args.requests} requests ({args.preset}, "
        f"{args.min_tokens}..{args.max_tokens} tokens, seed {args.seed})\n"
    )
    wl = harness.generate(
        args.preset,
        traffic_config(args, args.requests),
        progress=harness.TqdmProgress(disable=args.quiet),
    )
    err.write(f"  packing the batch and the store for {args.backend} on {device}\n")
    runner = harness.make_runner(wl, args.backend, device)

    t0 = time.perf_counter()
    hits = runner.hits()
    first_s = time.perf_counter() - t0
    checked, ref_per_request = _check_sample(wl, hits, runner.backend, args)
    steady = harness.time_calls(runner.run, args.repeats, warmup=0)
    fresh_s = _fresh_first_call(args, runner, err)

    rows = [
        *_workload_rows(wl, hits, runner, args),
        *_latency_rows(first_s, fresh_s, steady, len(wl)),
        *_reference_rows(ref_per_request, float(np.median(steady)), wl, checked, args),
    ]
    rows.append(("total time", f"{time.perf_counter() - t_start:.1f} s"))
    _print_rows(out, f"kvhit {__version__} demo", rows)
    return EXIT_OK


def _check_sample(
    wl: Workload, hits: list[int], backend: str, args: argparse.Namespace
) -> tuple[int, float]:
    """Checks ``hits`` against the reference loop on a sample (every request
    with ``--check-all``); returns the number checked and the loop's seconds
    per request."""
    check = harness.parity_indices(
        len(wl), len(wl) if args.check_all else 0, args.sample, args.seed
    )
    t0 = time.perf_counter()
    want = harness.reference_runner(wl, check).hits()
    per_request = (time.perf_counter() - t0) / max(1, len(check))
    harness.check_parity(
        backend, hits, dict(zip(check, want, strict=True)), wl.num_tokens
    )
    return len(check), per_request


def _fresh_first_call(
    args: argparse.Namespace, runner: Runner, err: TextIO
) -> float | None:
    if args.no_fresh_process or runner.backend == REFERENCE:
        return None
    err.write("  timing a first call in a fresh process\n")
    return harness.fresh_process_first_call(args.preset, runner.backend, runner.device)


def _workload_rows(
    wl: Workload, hits: list[int], runner: Runner, args: argparse.Namespace
) -> list[tuple[str, str]]:
    n = len(wl)
    frac = np.array(hits, dtype=np.float64) / np.maximum(1, np.array(wl.num_tokens))
    p10, p50, p90 = np.percentile(frac, [10, 50, 90]) if n else (0.0, 0.0, 0.0)
    served, total = sum(hits), sum(wl.num_tokens)
    chosen = " (auto)" if args.backend == "auto" else ""
    return [
        ("preset", f"{wl.preset}  ({PRESETS[wl.preset].description})"),
        ("backend", f"{runner.backend}{chosen}"),
        ("device", runner.device),
        (
            "requests",
            f"{n}  ({args.min_tokens}..{args.max_tokens} tokens, "
            f"{fmt_count(wl.total_hashes)} hashes of {wl.hash_bytes} B, "
            f"{fmt_count(len(wl.store_keys))} store keys)",
        ),
        (
            "hit / num_tokens",
            f"p10 {p10:.1%}  p50 {p50:.1%}  p90 {p90:.1%}  "
            f"zero-hit {float(np.mean(np.array(hits) == 0)) if n else 0.0:.1%}",
        ),
        (
            "served from store",
            f"{fmt_count(served)} of {fmt_count(total)} tokens "
            f"({served / max(1, total):.1%})",
        ),
    ]


def _latency_rows(
    first_s: float, fresh_s: float | None, steady: np.ndarray, n: int
) -> list[tuple[str, str]]:
    median = float(np.median(steady))
    rows = [
        (
            "first call",
            f"{fmt_time(first_s)}  (this process's first lookup: one-time costs "
            "included, e.g. compiling kernels or loading them from a disk cache)",
        )
    ]
    if fresh_s is not None:
        rows.append(
            (
                "first call, new process",
                f"{fmt_time(fresh_s)}  (16 requests, a fresh process started "
                "after this one: compiled kernels come from the disk cache)",
            )
        )
    rows += [
        ("steady state", f"{fmt_time(median)} per batch  (median of {len(steady)})"),
        ("lookups/s", fmt_count(n / median)),
    ]
    return rows


def _reference_rows(
    ref_per_request: float,
    median: float,
    wl: Workload,
    checked: int,
    args: argparse.Namespace,
) -> list[tuple[str, str]]:
    n = len(wl)
    ref_batch = ref_per_request * n
    est = "" if args.check_all else f", {checked}-request sample x {n}"
    return [
        (
            "reference loop",
            f"{fmt_time(ref_batch)} per batch  "
            f"({fmt_time(ref_per_request)}/request{est})",
        ),
        ("speedup", f"{ref_batch / median:.1f}x over the reference loop"),
        ("parity", f"{checked}/{checked} checked requests match the reference"),
    ]


def _print_rows(out: TextIO, title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    out.write(f"\n{title}\n")
    for k, v in rows:
        out.write(f"  {k:<{width}}  {v}\n")
    out.flush()


# ---------------------------------------------------------------------------
# kvhit bench
# ---------------------------------------------------------------------------


def sweep_config(
    args: argparse.Namespace,
) -> tuple[harness.SweepConfig, list[harness.Skip]]:
    """The harness's sweep configuration of ``kvhit bench``'s arguments, and
    the backends left out before it starts (with the reason)."""
    device = args.device or harness.default_device()
    presets = tuple(PRESETS) if args.presets == ["all"] else tuple(args.presets)
    skipped: list[harness.Skip] = []
    if args.backends == ["auto"]:
        backends, skips = harness.default_backends(device)
        skipped.extend(skips)
    else:
        backends = tuple(dict.fromkeys(args.backends))
    sizes = args.batch_sizes or (
        QUICK_BATCH_SIZES if args.quick else DEFAULT_BATCH_SIZES
    )
    repeats = args.repeats or (QUICK_REPEATS if args.quick else 5)
    config = config_from(
        harness.SweepConfig,
        args,
        presets=presets,
        batch_sizes=tuple(sorted(set(sizes))),
        backends=backends,
        device=device,
        traffic=traffic_config(args, max(sizes)),
        repeats=repeats,
        peer_host_load=tuple(args.peer_host_load),
        peer_order=tuple(dict.fromkeys(args.peer_order)),
    )
    return config, skipped


def cmd_bench(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``kvhit bench``: the harness's sweep, printed, and written out."""
    config, skipped = sweep_config(args)
    result = harness.sweep(config, quiet=args.quiet, skipped=skipped)
    out.write("\n" + harness.format_table(result))
    if result.peers:
        out.write("\n" + harness.format_peer_table(result.peers))
    out.flush()
    if args.json:
        harness.write_json(args.json, result)
        err.write(f"kvhit bench: wrote {args.json}\n")
    if args.plot:
        harness.plot(result, args.plot)
        err.write(f"kvhit bench: wrote {args.plot}\n")
    return EXIT_OK


# ---------------------------------------------------------------------------
# kvhit replay
# ---------------------------------------------------------------------------


def replay_config(args: argparse.Namespace) -> replay_mod.ReplayConfig:
    """The replay configuration of ``kvhit replay``'s arguments."""
    return config_from(replay_mod.ReplayConfig, args, trace=Path(args.trace))


def cmd_replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``kvhit replay``: the trace replayed, checked, timed and summarised."""
    config = replay_config(args)
    try:
        requests = replay_mod.load_trace(
            config.trace, config.limit, config.trace_block_size
        )
    except (ValueError, OSError) as exc:  # the trace is an argument: exit 2
        err.write(
            f"kvhit replay: error: argument TRACE (read with --trace-block-size "
            f"{config.trace_block_size}): {exc}\n"
        )
        return EXIT_USAGE
    err.write(
        f"kvhit replay: {len(requests)} requests of {config.trace.name} on "
        f"{config.preset}\n"
    )
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="  replay", unit="req", leave=False)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.update(done - bar.n)

    try:
        result = replay_mod.replay(config, progress=progress, requests=requests)
    finally:
        if bar is not None:
            bar.close()
    out.write("\n" + replay_mod.format_report(result))
    out.flush()
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
        err.write(f"kvhit replay: wrote {args.json}\n")
    if args.plot:
        replay_mod.plot_replay(result, args.plot)
        err.write(f"kvhit replay: wrote {args.plot}\n")
    return EXIT_OK


# ---------------------------------------------------------------------------
# Arguments
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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _check_plot(parser: argparse.ArgumentParser, path: str | None) -> None:
    _check_output(parser, "--plot", path)
    if path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(
                "argument --plot: needs matplotlib, which is not installed; "
                "pip install 'kvhit[plot]' (or matplotlib), or drop --plot "
                "(--json FILE keeps the figures)"
            )


def _check_replay_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    trace = Path(args.trace)
    if not trace.is_file():
        parser.error(f"argument TRACE: {args.trace} is not a file")
    _check_output(parser, "--json", args.json)
    _check_plot(parser, args.plot)


def _check_workload_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    if args.min_tokens > args.max_tokens:
        parser.error(
            f"argument --min-tokens: {args.min_tokens} is above --max-tokens "
            f"({args.max_tokens})"
        )
    if args.history < 0:
        parser.error(f"argument --history: must be >= 0, got {args.history}")
    try:
        traffic_config(args, 1)
    except ValueError as exc:  # a rule of TrafficConfig's not checked above
        parser.error(str(exc))


def _check_output(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """Fails now, not after the sweep, when ``path`` cannot be written."""
    if not path:
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        parser.error(f"argument {flag}: {path} is a directory")
    if not folder.is_dir():
        parser.error(f"argument {flag}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        parser.error(f"argument {flag}: {path} is not writable")


def _check_bench_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> None:
    _check_workload_args(parser, args)
    for p in args.presets:
        if p != "all" and p not in PRESETS:
            parser.error(
                f"argument --presets: unknown preset {p!r} (choose from all, "
                f"{', '.join(PRESETS)})"
            )
    for b in args.backends:
        if b != "auto" and b not in BACKENDS:
            parser.error(
                f"argument --backends: unknown backend {b!r} (choose from auto, "
                f"{', '.join(BACKENDS)})"
            )
    _check_output(parser, "--json", args.json)
    _check_plot(parser, args.plot)


def _add_workload_args(p: argparse.ArgumentParser, repeats_default: int | None) -> None:
    p.add_argument(
        "--min-tokens",
        type=_int_at_least(1),
        default=256,
        help="shortest prompt (default 256)",
    )
    p.add_argument(
        "--max-tokens",
        type=_int_at_least(1),
        default=16384,
        help="longest prompt (default 16384)",
    )
    p.add_argument(
        "--hash-bytes",
        type=int,
        choices=(8, 16, 32),
        default=32,
        help="block hash width in bytes (default 32, as sha256)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--history",
        type=float,
        default=1.0,
        help="requests served (stored) before the batch, as a multiple of the "
        "batch size (default 1.0; lower it for huge prompts)",
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
        help=f"timed runs (default {repeats_default or f'5, {QUICK_REPEATS} with --quick'})",
    )
    p.add_argument(
        "--sample",
        type=_int_at_least(1),
        default=64,
        help="requests sampled for the check against the reference loop where "
        "not every request is checked (default 64)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _add_demo(sub: Any, presets_help: str) -> None:
    demo = sub.add_parser(
        "demo",
        help="look up one realistic batch, check it, print a table",
        description=textwrap.fill(
            "Builds a synthetic serving workload (shared system prompts, "
            "multi-turn growth, an evicted store), resolves the whole batch with "
            "LookupEngine (backend auto: triton on CUDA, numba on the CPU), "
            "checks a sample against the reference loop and prints hit rates, "
            "the first call (compilation or the kernel cache), a first call in "
            "a fresh process, the steady-state latency and the speedup over the "
            "reference loop."
        ),
        epilog=f"presets:{presets_help}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--preset", choices=list(PRESETS), default="dsv4-flash", help="cache layout"
    )
    demo.add_argument(
        "--requests",
        type=_int_at_least(1),
        default=1024,
        help="batch size (default 1024)",
    )
    demo.add_argument(
        "--backend",
        choices=("auto", *BACKENDS),
        default="auto",
        help="auto (default): what LookupEngine picks, triton on CUDA, numba on the CPU",
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
    demo.set_defaults(handler=cmd_demo, check=_check_workload_args, command_parser=demo)


def _add_bench(sub: Any, presets_help: str) -> None:
    bench = sub.add_parser(
        "bench",
        help="sweep presets x batch sizes x backends; JSON and plot",
        description=textwrap.fill(
            "For each preset and batch size, checks every backend against the "
            "reference loop (all requests up to --reference-cap, --sample "
            "above), then times each end to end through LookupEngine.lookup on "
            "a packed batch (median of --repeats) and reports medians, the "
            "ratios to the reference loop (and to vLLM's own worker lookup with "
            "--vllm) and the packing cost per request, side by side. A backend "
            "whose engine cannot be built is skipped with the reason."
        ),
        epilog=f"presets:{presets_help}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--presets",
        type=_csv(str),
        default=["all"],
        help="comma-separated presets, or all (default)",
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
        type=_csv(str),
        default=["auto"],
        help=f"comma-separated of {','.join(BACKENDS)}; auto (default) = all of "
        "them (triton only off the CPU)",
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
        "per-request time extrapolated (default 1024)",
    )
    bench.add_argument(
        "--peer",
        choices=list(harness.PEERS),
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
        help="replay only the first N trace requests for --peer (default all)",
    )
    bench.add_argument(
        "--peer-host-load",
        type=_csv(_int_at_least(0)),
        default=[0],
        metavar="N[,N...]",
        help="run --peer once per N with N CPU-bound processes spinning beside "
        "it (a busy serving host; Dynamo answers on its own thread, kvhit on "
        "the caller's); default 0, a quiet host",
    )
    bench.add_argument(
        "--peer-order",
        type=_csv(_choice(harness.PEER_ORDERS)),
        default=["separate"],
        metavar="ORDER[,ORDER]",
        help="how --peer replays the two indexes: separate (kvhit's replay, "
        "then the peer's, each a pass of its own; default) or alternate (step "
        "by step, side by side: each pays for the cache state the other leaves "
        "behind); both: separate,alternate",
    )
    bench.add_argument(
        "--key-index",
        action="store_true",
        help="also measure KeyIndex.contains probes/s",
    )
    bench.add_argument("--json", metavar="FILE", help="write results as JSON")
    bench.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw lookups/s vs batch size per backend (needs matplotlib)",
    )
    _add_workload_args(bench, None)
    bench.set_defaults(handler=cmd_bench, check=_check_bench_args, command_parser=bench)


def _add_replay(sub: Any, presets_help: str) -> None:
    replay = sub.add_parser(
        "replay",
        help="replay a request trace with the exact hybrid rules; hit rates",
        description=textwrap.fill(
            "Replays a Mooncake-format request trace (JSONL, plain or .gz; the "
            "shipped FAST'25 conversation trace by default) in scheduler steps: "
            "each trace block is expanded into the preset's hash blocks, every "
            "step is looked up with vLLM's exact store-worker rule "
            "(LookupEngine on a KeyIndex) and what vLLM's saving worker keeps "
            "for each served prompt is stored. Prints the hit rate (tokens "
            "served from the store / prompt tokens) beside what a "
            "full-attention-only index (Dynamo's, llm-d's view) would claim on "
            "the same store, and the per-step lookup time beside the reference "
            "loop's (on a sample of steps, answers checked)."
        ),
        epilog=f"presets:{presets_help}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument(
        "trace",
        metavar="TRACE",
        nargs="?",
        default=str(replay_mod.SHIPPED_TRACE),
        help="trace file (default: the shipped Mooncake conversation trace)",
    )
    replay.add_argument(
        "--preset", choices=list(PRESETS), default="dsv4-flash", help="cache layout"
    )
    replay.add_argument(
        "--trace-block-size",
        type=_int_at_least(1),
        default=replay_mod.TRACE_BLOCK_SIZE,
        help="tokens per trace hash_ids entry (default 512)",
    )
    replay.add_argument(
        "--step-ms",
        type=_positive_float,
        default=100.0,
        help="scheduler step window in ms of replay time (default 100)",
    )
    replay.add_argument(
        "--speedup",
        type=_positive_float,
        default=1.0,
        help="trace time runs this many times faster (default 1)",
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
        "the keys it loads); default unbounded",
    )
    replay.add_argument(
        "--limit",
        type=_int_at_least(1),
        default=None,
        help="replay only the first N requests",
    )
    replay.add_argument(
        "--reference-requests",
        type=_int_at_least(0),
        default=replay_mod.REFERENCE_REQUESTS,
        help="about how many requests (whole steps spread over the run) the "
        f"reference loop checks and is timed on (default "
        f"{replay_mod.REFERENCE_REQUESTS}; 0: none)",
    )
    replay.add_argument(
        "--peer",
        choices=list(replay_mod.PEERS),
        default=None,
        help="run a peer index beside kvhit: dynamo (the 'peers' extra, "
        "ai-dynamo-runtime); skipped with the reason when absent",
    )
    replay.add_argument("--json", metavar="FILE", help="write results as JSON")
    replay.add_argument(
        "--plot",
        metavar="FILE.png",
        help="hit rate over time (claimed vs exact) and step latency (needs "
        "matplotlib)",
    )
    replay.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    replay.set_defaults(
        handler=cmd_replay, check=_check_replay_args, command_parser=replay
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvhit`` argument parser (``demo``, ``bench`` and ``replay``)."""
    presets_help = "".join(
        textwrap.fill(
            f"{p.name}: {p.description}",
            79,
            initial_indent="\n  ",
            subsequent_indent="    ",
        )
        for p in PRESETS.values()
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
    from kvhit.bench.route import add_route_parser  # `kvhit route` (issue 19)

    add_route_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvhit`` and ``python -m kvhit``; returns the exit code
    (bad arguments raise ``SystemExit(2)``, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    args.check(args.command_parser, args)
    try:
        return args.handler(args, sys.stdout, sys.stderr)
    except MismatchError as exc:
        sys.stderr.write(f"kvhit {args.command}: MISMATCH: {exc}\n")
        return EXIT_MISMATCH
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except Exception:
        sys.stderr.write(f"kvhit {args.command}: internal error:\n")
        traceback.print_exc(file=sys.stderr)
        return EXIT_INTERNAL
