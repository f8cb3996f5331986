"""The fleet step of the GPU check: the Triton fleet kernel
(``kernels/fleet_triton.py``, a FleetIndex with ``backend="triton"`` on CUDA)
beside the numba fleet on the same machine's CPU, every answer compared.

For each preset (llama, dsv4-flash) and E = 1, 8, 64, 256 engines, one
workload of ``max(B)`` requests x ``blocks`` hash units of 32-byte keys: every
request shares a system prompt (its first quarter), and engine ``r % E``
holds a random prefix of request ``r`` in every group. The same keys go into
a Triton FleetIndex on the GPU and a numba FleetIndex on the CPU; for B = 64
and 1024 (the first B requests), ``fleet_lookup`` of both is compared in
full ([B, E], every request and engine) and then timed: the GPU's median by
CUDA events (the call as a scheduler makes it, with its tensors on the
device), numba's by wall clock, its thread count stated. A mismatch fails
the run (exit 1).

``--dry-run`` runs it on the CPU at tiny sizes, the Triton kernels under
``TRITON_INTERPRET=1`` (timings meaningless), so the script is tested in the
CPU suite. Run: ``python -m kvhit.bench.gpu_check_fleet [--dry-run]
[--out DIR] [--budget S]``; prints one ``result`` JSON line per row as it is
measured (and appends it to ``DIR/fleet.jsonl``), then a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from statistics import median

from kvhit.bench.gpu_common import config_changes, interpret, run_seconds

__all__ = ["Config", "main", "run"]


@dataclass(frozen=True)
class Config:
    """What the run measures."""

    presets: tuple[str, ...] = ("llama", "dsv4-flash")
    engines: tuple[int, ...] = (1, 8, 64, 256)
    batches: tuple[int, ...] = (64, 1024)
    # Hash units per request (llama: 2048 blocks of 16 tokens).
    blocks: int = 2048
    hash_bytes: int = 32
    repeats: int = 30
    # Seconds one timing may take at most (the repeats stop there).
    time_cap_s: float = 2.0
    seed: int = 0
    dry_run: bool = False
    # Seconds the run may take; a measurement that would start later is
    # skipped (the table says so).
    budget_s: float | None = None
    out_dir: str | None = None

    @staticmethod
    def dry() -> Config:
        # dsv4-flash hits from 64 hash units (one 256-token block).
        return Config(
            engines=(1, 65), batches=(2, 5), blocks=140, repeats=1, dry_run=True
        )


def say(msg: str) -> None:
    print(msg, flush=True)


def workload(cfg: Config, preset: str):
    """(layout, hash words int64 [max(B) * blocks, W], num_tokens int64
    [max(B)], the stored entries as (request, group ids, hash rows)), all on
    the CPU."""
    import torch

    from kvhit.bench.workloads import make_layout
    from kvhit.coordinator.packing import num_words

    layout = make_layout(preset)
    W = num_words(cfg.hash_bytes)
    B, units = max(cfg.batches), cfg.blocks
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (B, units, W), generator=gen)
    words[:, : units // 4] = words[0, : units // 4].clone()
    num_tokens = torch.full((B,), units * layout.hash_block_size, dtype=torch.int64)
    held = torch.randint(0, units + 1, (B,), generator=gen)
    req = torch.repeat_interleave(torch.arange(B), held)
    pos = torch.arange(req.shape[0]) - (torch.cumsum(held, 0) - held)[req]
    n_groups = len(layout.groups)
    # Every group holds the prefix (a store that saved all of it).
    req = req.repeat(n_groups)
    gids = torch.arange(n_groups).repeat_interleave(pos.shape[0])
    keys = words[req, pos.repeat(n_groups)]
    return layout, words.reshape(B * units, W), num_tokens, (req, gids, keys)


def first_requests(words, B: int, cfg: Config, device):
    """A HashBatch of the first ``B`` requests on ``device``."""
    import torch

    from kvhit.coordinator.packing import HashBatch

    offsets = torch.arange(B + 1, dtype=torch.int64) * cfg.blocks
    rows = words[: B * cfg.blocks].to(device)
    return HashBatch(rows, offsets.to(device), cfg.hash_bytes)


@contextlib.contextmanager
def triton_fleets_allowed(device):
    """On the CPU (``--dry-run``), FleetIndexes may take the Triton family
    (the CUDA rule of ``fleet_index.auto_backend``; the kernels interpreted)."""
    if device.type == "cuda":
        yield
        return
    from unittest import mock

    from kvhit.coordinator import fleet_index

    with mock.patch.object(fleet_index, "auto_backend", lambda d: "triton"):
        yield


def timed(fn, cfg: Config, device) -> tuple[float, int]:
    """(median seconds of ``fn()``, runs) after one warm-up: CUDA events on
    the GPU, wall clock on the CPU; at most ``cfg.repeats`` runs and about
    ``cfg.time_cap_s`` seconds."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times: list[float] = []
    t_end = time.perf_counter() + cfg.time_cap_s
    while len(times) < cfg.repeats and (not times or time.perf_counter() < t_end):
        times.append(run_seconds(fn, device))
    return median(times), len(times)


def numba_threads() -> int | None:
    try:
        import numba
    except ImportError:
        return None
    return int(numba.get_num_threads())


def run(cfg: Config, device) -> tuple[list[dict], bool]:
    """Every row (dicts, also printed as ``result`` lines) and whether all
    answers were equal."""
    import torch

    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.fleet_index import FleetIndex

    threads = numba_threads()
    cpu_backend = "numba" if threads is not None else "torch"
    start = time.perf_counter()
    rows, ok = [], True
    path = os.path.join(cfg.out_dir, "fleet.jsonl") if cfg.out_dir else None
    for preset in cfg.presets:
        layout, words, num_tokens, (req, gids, keys) = workload(cfg, preset)
        gpu_tokens = num_tokens.to(device)
        # The engine a scheduler on the GPU has (its own scans, for the
        # layouts the joint fleet scan does not answer, are Triton's too);
        # the dry run's is torch (the interpreter's scan is slow).
        engine_backend = "triton" if device.type == "cuda" else "torch"
        with triton_fleets_allowed(device):
            gpu_engine = LookupEngine(layout, backend=engine_backend, device=device)
        cpu_engine = LookupEngine(layout, backend=cpu_backend)
        for E in cfg.engines:
            if cfg.budget_s is not None and time.perf_counter() - start > cfg.budget_s:
                say(f"skip {preset} E = {E}: budget of {cfg.budget_s:.0f} s spent")
                continue
            cap = 4 * max(int(keys.shape[0]), 16)
            with triton_fleets_allowed(device):
                # A small add first: the timed one includes no compile.
                warm = FleetIndex(E, cfg.hash_bytes, capacity=64, device=device,
                                  backend="triton")  # fmt: skip
                warm.add((req[:16] % E).to(device), gids[:16].to(device),
                         keys[:16].to(device))  # fmt: skip
                gpu = FleetIndex(E, cfg.hash_bytes, capacity=cap, device=device,
                                 backend="triton")  # fmt: skip
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                gpu.add((req % E).to(device), gids.to(device), keys.to(device))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                add_s = time.perf_counter() - t0
            cpu = FleetIndex(E, cfg.hash_bytes, capacity=cap, backend=cpu_backend)
            cpu.add(req % E, gids, keys)
            for B in cfg.batches:
                sub = first_requests(words, B, cfg, torch.device("cpu"))
                sub_gpu = first_requests(words, B, cfg, device)
                gpu_call = functools.partial(
                    gpu_engine.fleet_lookup, sub_gpu, gpu_tokens[:B], gpu
                )
                cpu_call = functools.partial(
                    cpu_engine.fleet_lookup, sub, num_tokens[:B], cpu
                )
                with triton_fleets_allowed(device):
                    got, want = gpu_call(), cpu_call()
                    equal = torch.equal(got.cpu(), want)
                    ok &= equal
                    t_gpu, n_gpu = timed(gpu_call, cfg, device)
                t_cpu, n_cpu = timed(cpu_call, cfg, torch.device("cpu"))
                row = {
                    "kind": "fleet",
                    "preset": preset,
                    "engines": E,
                    "requests": B,
                    "hashes": B * cfg.blocks,
                    "triton_s": t_gpu,
                    "triton_runs": n_gpu,
                    f"{cpu_backend}_s": t_cpu,
                    f"{cpu_backend}_runs": n_cpu,
                    "numba_threads": threads,
                    "hits": int((want > 0).sum()),
                    "equal": equal,
                    "add_pairs_per_s": int(keys.shape[0]) / add_s
                    if B == cfg.batches[0]
                    else None,
                    "device": str(device),
                }
                rows.append(row)
                line = json.dumps(row)
                say(f"result {line}")
                if path:
                    with open(path, "a") as f:
                        f.write(line + "\n")
                if not equal:
                    say(f"MISMATCH: {preset} E = {E} B = {B}: fleet_lookup differs")
    return rows, ok


def fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def table(rows: list[dict], cfg: Config) -> str:
    """The Markdown table (by hand: the GPU machine has torch and triton
    only)."""
    cpu = "numba" if any("numba_s" in r for r in rows) else "torch"
    threads = next((r["numba_threads"] for r in rows if r["numba_threads"]), None)
    head = ["preset", "E", "B", "hashes", "triton", f"{cpu} ({threads} threads)",
            f"{cpu} / triton", "hits", "answers"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["preset"], r["engines"], r["requests"], r["hashes"],
                 fmt_s(r["triton_s"]), fmt_s(r[f"{cpu}_s"]),
                 f"{r[f'{cpu}_s'] / r['triton_s']:.2f}x", r["hits"],
                 "equal" if r["equal"] else "DIFFER"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    note = " (dry run: interpreted Triton, times meaningless)" if cfg.dry_run else ""
    return f"fleet_lookup, median per call{note}\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU")
    parser.add_argument("--presets", default=None, help="comma-separated presets")
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for fleet.jsonl")
    parser.add_argument("--budget", type=float, default=None, help="seconds")
    args = parser.parse_args(argv)
    cfg = Config.dry() if args.dry_run else Config()
    changes = config_changes(args, blocks="blocks", out="out_dir", budget="budget_s")
    cfg = replace(cfg, **changes)
    import torch

    if torch.cuda.is_available() and not cfg.dry_run:
        device = torch.device("cuda")
    elif not cfg.dry_run:
        say("SKIP: no CUDA GPU (--dry-run runs the step on the CPU)")
        return 0
    else:
        device = torch.device("cpu")
        if (error := interpret()) is not None:
            say(error)
            return 1
    rows, ok = run(cfg, device)
    print()
    print(table(rows, cfg), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
