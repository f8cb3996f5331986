"""``kvhit`` command line: ``kvhit demo`` and ``kvhit bench``.

``demo`` builds one realistic workload (default: DeepSeek-V4-Flash layout, 1024
requests of up to 16K tokens), runs the batched lookup on the best backend
available, checks a sample of requests against the scalar reference and prints
a short table. ``bench`` sweeps presets, batch sizes and backends, asserting
parity before timing anything.

Exit codes: 0 success; 1 a backend disagreed with the reference; 2 usage
errors (argparse); 3 an optional dependency (matplotlib) is missing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from kvhit import __version__

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_MISSING_DEP = 3

BACKENDS = ("torch", "triton", "reference")


class MismatchError(Exception):
    """A backend's hits differ from the reference's."""


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def engine_available() -> str | None:
    """``None`` when LookupEngine, KeyIndex and HashBatch import, else why not."""
    try:
        import kvhit.coordinator.engine  # noqa: F401
        import kvhit.coordinator.key_index  # noqa: F401
        import kvhit.coordinator.packing  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_backend(device: str) -> str:
    """triton on CUDA, torch on CPU; the scalar reference while the engine is
    not importable."""
    if engine_available() is not None:
        return "reference"
    return "triton" if device.startswith("cuda") else "torch"


def available_backends(device: str) -> list[str]:
    """The backends that can run on ``device``, fastest first."""
    if engine_available() is not None:
        return ["reference"]
    out = []
    if device.startswith("cuda"):
        try:
            import triton  # noqa: F401

            out.append("triton")
        except ImportError:
            pass
    return [*out, "torch", "reference"]


@dataclass
class Runner:
    """One backend bound to one workload: ``run()`` resolves the whole batch
    (synchronised, so it can be timed) and returns the hits."""

    backend: str
    device: str
    label: str
    run: Callable[[], Sequence[int]]
    #: what is timed: the lookup alone, without the host copy of the result
    timed: Callable[[], Any] | None = None


def make_runner(workload: Any, backend: str, device: str) -> Runner:
    """Packs ``workload`` for ``backend`` on ``device`` (not timed) and returns
    the runner of its batched store-worker lookup."""
    why = engine_available()
    if backend == "reference" and why is not None:
        # The engine has not landed: the scalar loop, clearly labelled.
        ref = workload.reference()
        return Runner(
            "reference",
            "cpu",
            "reference (fallback: engine not importable)",
            lambda: workload.reference_lookup(ref=ref),
        )
    if why is not None:
        raise RuntimeError(f"backend {backend!r} needs the engine: {why}")
    import torch

    from kvhit.coordinator.engine import LookupEngine

    engine = LookupEngine(workload.layout, backend=backend, device=device)
    batch = workload.hash_batch(device)
    num_tokens = workload.num_tokens_tensor(device)
    index = workload.key_index(device)
    cuda = str(device).startswith("cuda")

    def run() -> list[int]:
        hits = engine.lookup(batch, num_tokens, index)
        if cuda:
            torch.cuda.synchronize()
        return hits

    def run_list() -> list[int]:
        return run().tolist()

    return Runner(backend, str(device), backend, run_list, timed=run)


def time_runs(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def check_parity(
    label: str, got: Sequence[int], want: dict[int, int], num_tokens: Sequence[int]
) -> None:
    """Raises :class:`MismatchError` naming the first few differing requests."""
    bad = [i for i, h in want.items() if int(got[i]) != h]
    if bad:
        shown = ", ".join(
            f"#{i} (num_tokens={num_tokens[i]}): {label}={int(got[i])} "
            f"reference={want[i]}"
            for i in bad[:5]
        )
        raise MismatchError(
            f"{label} disagrees with the reference on {len(bad)} of {len(want)} "
            f"checked requests: {shown}"
        )


# ---------------------------------------------------------------------------
# Progress and formatting
# ---------------------------------------------------------------------------


def progress_printer(stream: TextIO, quiet: bool = False) -> Callable[..., None]:
    """A ``progress(stage, done, total)`` callback drawing a bar on ``stream``
    (redrawn in place on a terminal, one line per stage otherwise)."""
    tty = stream.isatty()

    def progress(stage: str, done: int, total: int) -> None:
        if quiet:
            return
        if tty:
            frac = done / total if total else 1.0
            bar = "#" * int(frac * 30)
            stream.write(f"\r  {stage:<8} [{bar:<30}] {done}/{total}")
            if done >= total:
                stream.write("\n")
            stream.flush()
        elif done >= total:
            stream.write(f"  {stage}: {total} done\n")
            stream.flush()

    return progress


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_count(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f}{suffix}"
    return f"{x:.0f}"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def environment() -> dict[str, str]:
    """Machine, torch, triton and GPU, for reports."""
    from kvhit.bench.workloads import environment_info

    return environment_info()


# ---------------------------------------------------------------------------
# kvhit demo
# ---------------------------------------------------------------------------


def _traffic_config(args: argparse.Namespace, num_requests: int) -> Any:
    from kvhit.bench.workloads import TrafficConfig

    return TrafficConfig(
        num_requests=num_requests,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        hash_bytes=args.hash_bytes,
        history=args.history,
        seed=args.seed,
    )


def cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvhit.bench.workloads import PRESETS, generate

    t_start = time.perf_counter()
    device = args.device or default_device()
    backend = args.backend if args.backend != "auto" else auto_backend(device)
    err.write(
        f"kvhit demo: building {args.requests} requests ({args.preset}, "
        f"{args.min_tokens}..{args.max_tokens} tokens, seed {args.seed})\n"
    )
    wl = generate(
        args.preset,
        _traffic_config(args, args.requests),
        progress=progress_printer(err, args.quiet),
    )
    err.write(f"  packing the batch and the store for {backend} on {device}...\n")
    try:
        runner = make_runner(wl, backend, device)
    except (ImportError, RuntimeError, ValueError) as exc:
        if args.backend != "auto" or backend != "triton":
            raise
        # auto: a CUDA machine whose triton backend cannot start still has torch.
        err.write(f"  triton backend unavailable ({exc}); falling back to torch\n")
        runner = make_runner(wl, "torch", device)
        runner.label = "torch (fallback: triton unavailable)"
    timed = runner.timed or runner.run

    # Results first (one untimed run doubles as the warm-up), then timing.
    hits = [int(h) for h in runner.run()]
    rng = random.Random(args.seed)
    n = len(wl)
    sample = (
        list(range(n))
        if args.check_all
        else sorted(rng.sample(range(n), min(args.sample, n)))
    )
    ref = wl.reference()
    t0 = time.perf_counter()
    want = dict(zip(sample, wl.reference_lookup(sample, ref=ref), strict=True))
    ref_per_req = (time.perf_counter() - t0) / max(1, len(sample))
    try:
        check_parity(runner.label, hits, want, wl.num_tokens)
    except MismatchError as exc:
        err.write(f"kvhit demo: MISMATCH: {exc}\n")
        return EXIT_MISMATCH

    times = time_runs(timed, args.repeats, warmup=0)
    median = statistics.median(times)
    ref_batch = ref_per_req * n

    frac = sorted(h / t for h, t in zip(hits, wl.num_tokens, strict=True))
    zero = sum(1 for h in hits if h == 0) / max(1, n)
    served, total = sum(hits), sum(wl.num_tokens)
    est = "" if args.check_all else f", {len(sample)}-request sample x {n}"
    rows = [
        ("preset", f"{wl.preset}  ({PRESETS[wl.preset].description})"),
        ("backend", runner.label),
        ("device", runner.device),
        (
            "requests",
            f"{n}  ({args.min_tokens}..{args.max_tokens} tokens, "
            f"{fmt_count(wl.total_hashes)} hashes of {wl.hash_bytes} B, "
            f"{fmt_count(len(wl.store_keys))} store keys)",
        ),
        (
            "hit / num_tokens",
            f"p10 {percentile(frac, 10):.1%}  p50 {percentile(frac, 50):.1%}  "
            f"p90 {percentile(frac, 90):.1%}  zero-hit {zero:.1%}",
        ),
        (
            "served from store",
            f"{fmt_count(served)} of {fmt_count(total)} tokens "
            f"({served / max(1, total):.1%})",
        ),
        ("batch latency", f"{fmt_time(median)}  (median of {len(times)})"),
        ("lookups/s", fmt_count(n / median)),
        (
            "reference loop",
            f"{fmt_time(ref_batch)} per batch  ({fmt_time(ref_per_req)}/request{est})",
        ),
        ("speedup", f"{ref_batch / median:.1f}x over the reference loop"),
        ("parity", f"{len(sample)}/{len(sample)} checked requests match the reference"),
    ]
    width = max(len(k) for k, _ in rows)
    out.write(f"\nkvhit {__version__} demo\n")
    for k, v in rows:
        out.write(f"  {k:<{width}}  {v}\n")
    out.write(f"  {'total time':<{width}}  {time.perf_counter() - t_start:.1f} s\n")
    out.flush()
    return EXIT_OK


# ---------------------------------------------------------------------------
# kvhit bench
# ---------------------------------------------------------------------------


def _require_matplotlib(err: TextIO) -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        err.write(
            "kvhit bench: --plot needs matplotlib, which is not installed.\n"
            "  install it with:  pip install 'kvhit[plot]'   (or: pip install "
            "matplotlib)\n  or drop --plot (--json FILE keeps the figures).\n"
        )
        return False
    return True


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def cmd_bench(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from kvhit.bench.workloads import PRESETS, generate

    if args.plot and not _require_matplotlib(err):
        return EXIT_MISSING_DEP
    device = args.device or default_device()
    presets = list(PRESETS) if args.presets == ["all"] else args.presets
    for p in presets:
        if p not in PRESETS:
            err.write(f"kvhit bench: unknown preset {p!r} ({', '.join(PRESETS)})\n")
            return 2
    backends = (
        available_backends(device) if args.backends == ["auto"] else args.backends
    )
    engines = [b for b in backends if b != "reference"]
    sizes = sorted(set(args.batch_sizes))
    results: list[dict[str, Any]] = []
    key_probe: list[dict[str, Any]] = []
    progress = progress_printer(err, args.quiet)

    for preset in presets:
        err.write(f"kvhit bench: {preset}: generating {max(sizes)} requests\n")
        full = generate(preset, _traffic_config(args, max(sizes)), progress=progress)
        ref = full.reference()
        ref_per_req: float | None = None
        for b in sizes:
            wl = full.take(b)
            # Parity first: every request up to the reference cap, a sample above.
            rng = random.Random(args.seed + b)
            check = (
                list(range(b))
                if b <= args.reference_cap
                else sorted(rng.sample(range(b), min(args.sample, b)))
            )
            t0 = time.perf_counter()
            want = dict(zip(check, wl.reference_lookup(check, ref=ref), strict=True))
            if b > args.reference_cap and check:
                # Above the cap the parity sample (random requests of this very
                # batch) is what estimates the reference loop's cost.
                ref_per_req = (time.perf_counter() - t0) / len(check)
            row: dict[str, Any] = {}
            first_hits: list[int] | None = None
            for backend in engines:
                runner = make_runner(wl, backend, device)
                hits = [int(h) for h in runner.run()]
                try:
                    check_parity(
                        f"{backend} (B={b}, {preset})", hits, want, wl.num_tokens
                    )
                    if first_hits is not None and hits != first_hits:
                        raise MismatchError(
                            f"{backend} disagrees with {engines[0]} at B={b} ({preset})"
                        )
                except MismatchError as exc:
                    err.write(f"kvhit bench: MISMATCH: {exc}\n")
                    return EXIT_MISMATCH
                first_hits = first_hits or hits
                times = time_runs(runner.timed or runner.run, args.repeats)
                row[backend] = times
            if "reference" in backends:
                if b <= args.reference_cap:
                    reps = max(1, min(args.repeats, 3))
                    times = time_runs(
                        lambda wl=wl, ref=ref: wl.reference_lookup(ref=ref),
                        reps,
                        warmup=0,
                    )
                    row["reference"] = times
                    ref_per_req = statistics.median(times) / b
            ref_median = (
                statistics.median(row["reference"]) if "reference" in row else None
            )
            estimated = False
            if ref_median is None and ref_per_req is not None:
                ref_median, estimated = ref_per_req * b, True
            for backend, times in row.items():
                med = statistics.median(times)
                results.append(
                    {
                        "preset": preset,
                        "batch_size": b,
                        "backend": backend,
                        "device": "cpu" if backend == "reference" else device,
                        "median_s": med,
                        "times_s": times,
                        "lookups_per_s": b / med,
                        "speedup_vs_reference": (ref_median / med)
                        if ref_median
                        else None,
                        "reference_estimated": estimated,
                        "parity_checked": len(check),
                    }
                )
            if "reference" in backends and "reference" not in row and ref_median:
                results.append(
                    {
                        "preset": preset,
                        "batch_size": b,
                        "backend": "reference",
                        "device": "cpu",
                        "median_s": ref_median,
                        "times_s": [],
                        "lookups_per_s": b / ref_median,
                        "speedup_vs_reference": 1.0,
                        "reference_estimated": True,
                        "parity_checked": len(check),
                    }
                )
        if args.key_index and engines:
            key_probe.append(_probe_rate(full, device, args.repeats))

    env = environment()
    _print_bench_table(out, results, backends, env)
    for kp in key_probe:
        out.write(
            f"  KeyIndex.contains ({kp['preset']}, {kp['hash_bytes']} B keys): "
            f"{fmt_count(kp['probes'])} probes in {fmt_time(kp['median_s'])} = "
            f"{fmt_count(kp['probes_per_s'])} probes/s ({kp['hit_fraction']:.0%} hits)\n"
        )
    if args.json:
        payload = {
            "kvhit": __version__,
            "environment": env,
            "config": {
                "presets": presets,
                "batch_sizes": sizes,
                "backends": backends,
                "device": device,
                "min_tokens": args.min_tokens,
                "max_tokens": args.max_tokens,
                "hash_bytes": args.hash_bytes,
                "seed": args.seed,
                "repeats": args.repeats,
                "reference_cap": args.reference_cap,
            },
            "results": results,
            "key_index": key_probe,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        err.write(f"kvhit bench: wrote {args.json}\n")
    if args.plot:
        _plot(results, args.plot, env)
        err.write(f"kvhit bench: wrote {args.plot}\n")
    return EXIT_OK


def key_probe(wl: Any, device: str) -> tuple[Callable[[], Any], int]:
    """A timed ``KeyIndex.contains`` over every (group, batch hash) pair (the
    probe set of a naive lookup: a realistic mix of hits and misses) and the
    number of probes. Building the index and the probes is not timed."""
    import torch

    batch = wl.hash_batch(device)
    index = wl.key_index(device)
    groups = torch.tensor(
        [g for g, grp in enumerate(wl.layout.groups) if grp.prefix_cacheable],
        dtype=torch.int64,
        device=device,
    )
    n = batch.total
    gids = groups.repeat_interleave(n)
    hashes = batch.hashes.repeat(len(groups), 1)
    cuda = str(device).startswith("cuda")

    def probe() -> torch.Tensor:
        r = index.contains(gids, hashes)
        if cuda:
            torch.cuda.synchronize()
        return r

    return probe, int(gids.numel())


def _probe_rate(wl: Any, device: str, repeats: int) -> dict[str, Any]:
    probe, n = key_probe(wl, device)
    hit_fraction = float(probe().float().mean()) if n else 0.0
    times = time_runs(probe, repeats)
    med = statistics.median(times)
    return {
        "preset": wl.preset,
        "hash_bytes": wl.hash_bytes,
        "probes": n,
        "median_s": med,
        "probes_per_s": n / med,
        "hit_fraction": hit_fraction,
    }


def _print_bench_table(
    out: TextIO, results: list[dict[str, Any]], backends: list[str], env: dict[str, str]
) -> None:
    out.write(
        f"\nkvhit {__version__} bench  ({env.get('machine', '?')}; torch "
        f"{env.get('torch', '?')}, triton {env.get('triton', '?')}; "
        f"gpu {env.get('gpu', 'none')})\n"
    )
    cols = [b for b in BACKENDS if b in backends]
    head = f"  {'preset':<11} {'B':>5}"
    for b in cols:
        head += f"  {b + ' median':>17} {'lookups/s':>9} {'x ref':>7}"
    out.write(head + "\n")
    keyed = {(r["preset"], r["batch_size"], r["backend"]): r for r in results}
    for preset, b in dict.fromkeys((r["preset"], r["batch_size"]) for r in results):
        line = f"  {preset:<11} {b:>5}"
        for backend in cols:
            r = keyed.get((preset, b, backend))
            if r is None:
                line += f"  {'-':>17} {'-':>9} {'-':>7}"
                continue
            mark = "~" if r["reference_estimated"] else ""
            ratio = r["speedup_vs_reference"]
            # Only the reference's own time is estimated; engines are measured.
            tmark = mark if backend == "reference" else ""
            line += (
                f"  {tmark + fmt_time(r['median_s']):>17} "
                f"{fmt_count(r['lookups_per_s']):>9} "
                f"{(f'{mark}{ratio:.1f}x' if ratio else '-'):>7}"
            )
        out.write(line + "\n")
    if any(r["reference_estimated"] for r in results):
        out.write(
            "  ~ reference extrapolated: its per-request time on this batch's "
            "parity sample x B\n"
        )


def _plot(results: list[dict[str, Any]], path: str, env: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in results))
    fig, axes = plt.subplots(
        1, len(presets), figsize=(4.5 * len(presets), 4), squeeze=False
    )
    for ax, preset in zip(axes[0], presets, strict=True):
        for backend in BACKENDS:
            pts = sorted(
                (r["batch_size"], r["lookups_per_s"])
                for r in results
                if r["preset"] == preset and r["backend"] == backend
            )
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(preset)
        ax.set_xlabel("batch size (requests)")
        ax.set_ylabel("lookups/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"kvhit {__version__}: {env.get('gpu') or env.get('machine', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------


def _add_workload_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument(
        "--min-tokens", type=int, default=256, help="shortest prompt (default 256)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"longest prompt (default {max_tokens})",
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
        "--device", default=None, help="cpu or cuda[:N] (default: cuda if present)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    p.add_argument(
        "--sample",
        type=int,
        default=64,
        help="requests checked against the reference (default 64)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    from kvhit.bench.workloads import PRESETS

    presets_help = "; ".join(f"{p.name}: {p.description}" for p in PRESETS.values())
    parser = argparse.ArgumentParser(
        prog="kvhit",
        description="Batched external KV-cache hit lookup (vLLM 0.33.0 semantics).",
        epilog="Run 'kvhit demo' for a one-minute tour; 'kvhit bench --help' for sweeps.",
    )
    parser.add_argument("--version", action="version", version=f"kvhit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="look up one realistic batch, check it, print a table",
        description=(
            "Builds a synthetic serving workload (shared system prompts, "
            "multi-turn growth, an evicted store), resolves the whole batch with "
            "the batched engine, checks a sample against the scalar reference "
            "(exit 1 on any mismatch) and prints hit rates, latency and the "
            "speedup over the reference loop."
        ),
        epilog=f"presets: {presets_help}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--preset", choices=list(PRESETS), default="dsv4-flash", help="cache layout"
    )
    demo.add_argument(
        "--requests", type=int, default=1024, help="batch size (default 1024)"
    )
    demo.add_argument(
        "--backend",
        choices=("auto", *BACKENDS),
        default="auto",
        help="auto: triton on CUDA, torch on CPU",
    )
    demo.add_argument(
        "--check-all",
        action="store_true",
        help="check every request against the reference, not a sample",
    )
    _add_workload_args(demo, 16384)

    bench = sub.add_parser(
        "bench",
        help="sweep presets x batch sizes x backends; JSON and plot",
        description=(
            "For each preset and batch size, checks every backend against the "
            "reference (all requests up to --reference-cap, --sample above), "
            "then times each (median of --repeats) and reports medians and "
            "ratios to the reference loop side by side."
        ),
        epilog=f"presets: {presets_help}",
    )
    bench.add_argument(
        "--presets",
        type=_csv(str),
        default=["all"],
        help="comma-separated presets, or all (default)",
    )
    bench.add_argument(
        "--batch-sizes",
        type=_csv(int),
        default=[1, 64, 1024, 4096],
        help="comma-separated batch sizes (default 1,64,1024,4096)",
    )
    bench.add_argument(
        "--backends",
        type=_csv(str),
        default=["auto"],
        help="comma-separated of torch,triton,reference; auto = all available",
    )
    bench.add_argument(
        "--reference-cap",
        type=int,
        default=1024,
        help="largest batch the (slow) reference loop is timed (and fully "
        "checked) at; above it, --sample requests are checked and their "
        "per-request time extrapolated (default 1024)",
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
    _add_workload_args(bench, 16384)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvhit`` and ``python -m kvhit``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    if args.command == "bench":
        for b in args.backends:
            if b not in (*BACKENDS, "auto"):
                parser.error(
                    f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}"
                )
    try:
        if args.command == "demo":
            return cmd_demo(args, sys.stdout, sys.stderr)
        return cmd_bench(args, sys.stdout, sys.stderr)
    except (RuntimeError, ValueError) as exc:
        # Bad combinations argparse cannot see (backend without the engine,
        # min_tokens > max_tokens, ...): one line, no traceback.
        sys.stderr.write(f"kvhit {args.command}: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
