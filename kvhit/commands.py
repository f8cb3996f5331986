"""The work behind ``kvhit``'s subcommands: ``demo``, ``bench``, ``replay``
and ``route``.

``kvhit/cli.py`` parses and checks the arguments (standard library only, so
``--help`` never imports torch) and then calls ``cmd_<command>`` here, which
imports the harness and the engine. A trace that turns out unreadable when
it is first read raises :class:`~kvhit.errors.ArgumentError` (exit 2) before
any other work.

``demo`` builds one realistic workload (default: DeepSeek-V4-Flash layout, 1024
requests of up to 16K tokens), resolves it with ``LookupEngine(backend="auto")``
(triton on CUDA, numba on the CPU), checks a sample against the reference loop
and prints hit rates, the first-call and steady-state latency and the speedup.
``bench`` sweeps presets x batch sizes x backends, checking parity before
timing anything. ``replay`` replays a public request trace (the Mooncake
conversation trace by default) in scheduler steps against the exact rules
(``kvhit.bench.replay``). ``route`` replays it across simulated engines under
several routers (``kvhit.bench.route``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any, TextIO, TypeVar

import numpy as np

from kvhit import __version__
from kvhit.bench import harness, report
from kvhit.bench import replay as replay_mod
from kvhit.bench import route as route_mod
from kvhit.bench.harness import (
    DEFAULT_BATCH_SIZES,
    PRESETS,
    REFERENCE,
    MismatchError,
    Runner,
    TrafficConfig,
    Workload,
)
from kvhit.bench.names import QUICK_BATCH_SIZES, QUICK_REPEATS, Skip
from kvhit.bench.report import fmt_count, fmt_time
from kvhit.bench.traces import SHIPPED_TRACE, TraceRequest, load_trace
from kvhit.errors import EXIT_OK, ArgumentError

__all__ = [
    "MismatchError",
    "cmd_bench",
    "cmd_demo",
    "cmd_replay",
    "cmd_route",
    "config_from",
    "read_trace",
    "route_config",
    "sweep_config",
    "traffic_config",
]

_C = TypeVar("_C")


def read_trace(
    path: str | Path, limit: int | None, trace_block_size: int
) -> list[TraceRequest]:
    """The requests of the trace argument, or :class:`ArgumentError` naming
    ``TRACE`` when it is missing, corrupt, truncated, malformed or empty."""
    try:
        return load_trace(path, limit, trace_block_size)
    except (ValueError, OSError) as exc:
        raise ArgumentError(
            "TRACE", f"{exc} (read with --trace-block-size {trace_block_size})"
        ) from None


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


def _read_announced(
    command: str, config: Any, trace_block_size: int, err: TextIO, more: str = ""
) -> list[TraceRequest]:
    """The requests of ``config``'s trace (:func:`read_trace`, up to its
    ``limit``), announced on ``err`` with the preset (and ``more``)."""
    requests = read_trace(config.trace, config.limit, trace_block_size)
    err.write(
        f"kvhit {command}: {len(requests)} requests of {config.trace.name} on "
        f"{config.preset}{more}\n"
    )
    return requests


@contextlib.contextmanager
def _progress_bar(quiet: bool, total: int, **kwargs: Any) -> Iterator[Any]:
    """A tqdm bar of ``total`` requests (``kwargs`` to tqdm), closed on exit;
    None when ``quiet`` (tqdm is then never imported: it is optional)."""
    if quiet:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", leave=False, **kwargs)
    try:
        yield bar
    finally:
        bar.close()


def _dump_json(doc: Any, path: str) -> None:
    """Write ``doc`` to ``path`` as the commands' JSON (indent 1)."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _write_outputs(
    command: str,
    args: argparse.Namespace,
    err: TextIO,
    write_json: Callable[[str], None],
    plot: Callable[[str], None],
) -> None:
    """The ``--json`` and ``--plot`` files a command was asked for, each
    written by its callable (given the path) and announced on ``err``."""
    for path, write in ((args.json, write_json), (args.plot, plot)):
        if path:
            write(path)
            err.write(f"kvhit {command}: wrote {path}\n")


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
    out.write("\n" + report.format_rows(title, rows))
    out.flush()


# ---------------------------------------------------------------------------
# kvhit bench
# ---------------------------------------------------------------------------


def sweep_config(
    args: argparse.Namespace,
) -> tuple[harness.SweepConfig, list[Skip]]:
    """The harness's sweep configuration of ``kvhit bench``'s arguments, and
    the backends left out before it starts (with the reason)."""
    device = args.device or harness.default_device()
    presets = tuple(PRESETS) if args.presets == ["all"] else tuple(args.presets)
    skipped: list[Skip] = []
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
    out.write("\n" + report.format_table(result))
    if result.peers:
        out.write("\n" + report.format_peer_table(result.peers))
    out.flush()
    _write_outputs(
        "bench",
        args,
        err,
        lambda path: harness.write_json(path, result),
        lambda path: report.plot(result, path),
    )
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
    requests = _read_announced("replay", config, config.trace_block_size, err)
    with _progress_bar(args.quiet, len(requests), desc="  replay") as bar:

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.update(done - bar.n)

        result = replay_mod.replay(config, progress=progress, requests=requests)
    out.write("\n" + replay_mod.format_report(result))
    out.flush()
    _write_outputs(
        "replay",
        args,
        err,
        lambda path: _dump_json(result.to_json(), path),
        lambda path: replay_mod.plot_replay(result, path),
    )
    return EXIT_OK


# ---------------------------------------------------------------------------
# kvhit route
# ---------------------------------------------------------------------------


def route_config(args: argparse.Namespace) -> route_mod.RouteConfig:
    """The route replay's configuration of ``kvhit route``'s arguments."""
    routers = tuple(dict.fromkeys(args.router)) if args.router else route_mod.ROUTERS
    return config_from(
        route_mod.RouteConfig,
        args,
        routers=routers,
        trace=Path(args.trace or SHIPPED_TRACE),
    )


def cmd_route(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``kvhit route``: the trace routed across E engines, one row per router."""
    config = route_config(args)
    requests = _read_announced(
        "route", config, replay_mod.TRACE_BLOCK_SIZE, err, f", E = {config.engines}"
    )
    with _progress_bar(args.quiet, len(requests) * len(config.routers)) as bar:

        def progress(router: str, done: int, total: int) -> None:
            if bar is not None:
                bar.set_description(f"  {router}", refresh=False)
                bar.update(config.routers.index(router) * total + done - bar.n)

        results = route_mod.replay(config, progress, requests=requests)
    out.write(route_mod.format_table(results, config) + "\n")
    out.flush()
    _write_outputs(
        "route",
        args,
        err,
        lambda path: _dump_json(route_mod.to_json(results, config), path),
        lambda path: route_mod.plot(results, config, path),
    )
    return EXIT_OK
