"""The GPU check: everything ``bench/gpu_check.sh`` measures, as one process.

Written for a CUDA machine with only torch and triton installed and no
network (numba, pytest, hypothesis are optional): each step that needs
something absent prints ``SKIP`` and the run goes on. ``--dry-run`` runs every
step on the CPU at tiny sizes, the Triton kernels under ``TRITON_INTERPRET=1``
(timings meaningless), so the script itself is tested in the CPU suite
(``tests/test_gpu_check.py``).

Steps, in order: preflight (GPU, driver, CUDA, torch, triton, numba, commit,
the Triton features the kernels need, a ptxas the driver accepts); KeyIndex
inserts/s and probes/s for 32-byte keys at load 0.5; the long-hit dsv4 table
(issue 31: B = 1, 8, 64, 1024, 4096 prompts of up to 16K tokens, the
validated eager lookup, its CUDA-graph replay, GraphRunner.lookup (the
scheduler's path: static buffers, a graph per bucket) and numba on 1 thread and on
all cores, every request compared to numba); per preset, smallest
first, the workload built once, directly as tensors on the
device (random hash words with shared prefixes, a store holding the keys the
worker asks about up to a random stored length, with eviction holes), the
lookup timed eagerly (its first call, compile included, apart) and under
CUDA-graph replay, then parity of the triton lookup against the scalar
reference on a sample and against the numba backend (when it imports) on
every request; a summary
table last,
ready to paste into ``bench/RESULTS.md``.

Nothing measured is lost to a timeout: every step prints its time when it
ends, every result row is printed and appended to ``results.jsonl`` in
``--out`` as soon as it exists, and with ``--budget`` a step that would start
past the budget is SKIPped so the summary still prints.

Run: ``python -m kvhit.bench.gpu_check [--dry-run] [--presets a,b] [--out DIR]
[--budget S]``; ``--env-line`` prints the one-line environment (and exits 2
when a Triton feature the kernels need is missing). Exit code 0 when every
step passed or skipped, 1 on a parity mismatch or a failed step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from statistics import median

from kvhit.bench.gpu_common import (
    capture_graph,
    config_changes,
    interpret,
    run_seconds,
)

__all__ = ["Config", "main", "run"]


@dataclass(frozen=True)
class Config:
    """Sizes of one run. The defaults are the GPU target (ARCHITECTURE.md)."""

    # Smallest first (run() sorts by size anyway): a timeout costs the largest.
    presets: tuple[str, ...] = ("llama", "gemma3", "qwen3-next", "dsv4-flash")
    requests: int = 4096
    max_tokens: int = 131072
    hash_bytes: int = 32
    sample: int = 16
    repeats: int = 50
    key_index_keys: int = 1 << 23
    # The long-hit dsv4 table (issue 31): batch sizes and prompt length.
    longhit_batches: tuple[int, ...] = (1, 8, 64, 1024, 4096)
    longhit_tokens: int = 16384
    dry_run: bool = False
    seed: int = 0
    # Seconds the run may take; a step that would start later is SKIPped.
    budget_s: float | None = None
    # Folder for results.jsonl (one line per result row, written at once).
    out_dir: str | None = None

    @staticmethod
    def dry(presets: tuple[str, ...] = ("llama", "dsv4-flash")) -> Config:
        return Config(
            presets=presets,
            requests=4,
            max_tokens=1024,
            sample=4,
            repeats=1,
            key_index_keys=256,
            longhit_batches=(1, 3),
            longhit_tokens=512,
            dry_run=True,
        )


@dataclass
class Report:
    """What the run found, printed as the summary table."""

    env: dict[str, str] = field(default_factory=dict)
    steps: list[tuple[str, str, float]] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    key_index: list[dict] = field(default_factory=list)
    fleet: list[dict] = field(default_factory=list)
    longhit: list[dict] = field(default_factory=list)
    failed: bool = False
    start: float = field(default_factory=time.perf_counter)
    results_path: str | None = None

    def emit(self, kind: str, **fields) -> None:
        """Print one result row and append it to ``results.jsonl`` now, so a
        timeout later loses nothing measured."""
        row = {"kind": kind, **fields}
        line = json.dumps(row, default=str)
        say(f"result {line}")
        if self.results_path:
            with open(self.results_path, "a") as f:
                f.write(line + "\n")


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


# -- preflight -------------------------------------------------------------------


def _driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the installed driver supports (libcuda)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
        return v.value // 1000, v.value % 1000 // 10
    except OSError:
        return None


def _ptxas_version(path: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _pick_ptxas(env: dict[str, str]) -> None:
    """Triton compiles with the ptxas it bundles (CUDA 12.8 in 3.6, 13.x in
    3.9), whose cubins a driver older than that CUDA refuses: then point
    Triton at a system ptxas the driver accepts, if there is one."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        bundled = get_ptxas(90).path
    except Exception as exc:  # noqa: BLE001 - report, do not stop
        env["ptxas"] = f"unknown ({exc.__class__.__name__})"
        return
    have = _ptxas_version(bundled)
    drv = _driver_cuda_version()
    env["ptxas"] = f"{bundled} (CUDA {have})"
    if drv is None or have is None or have <= drv:
        return
    candidates = [shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"]
    for cand in candidates:
        if cand and os.path.exists(cand):
            v = _ptxas_version(cand)
            if v is not None and v <= drv:
                os.environ["TRITON_PTXAS_PATH"] = cand
                os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = cand
                env["ptxas"] = f"{cand} (CUDA {v}; the bundled {have} > driver {drv})"
                return
    env["ptxas"] = (
        f"{bundled} (CUDA {have}) is newer than the driver (CUDA {drv}) and no "
        "system ptxas fits: kernels may fail to load"
    )


def numba_status() -> str:
    """numba's version, "absent", or "broken (...)" when it is installed but
    does not import (e.g. beside a numpy newer than it supports)."""
    import importlib.util

    if importlib.util.find_spec("numba") is None:
        return "absent"
    try:
        import numba
    except Exception as exc:  # noqa: BLE001 - any import failure means "broken"
        return f"broken ({exc.__class__.__name__}: {str(exc)[:80]})"
    return numba.__version__


def preflight(cfg: Config) -> dict[str, str]:
    """Python, GPU, driver, CUDA, torch, triton, numba, commit, the Triton
    features the kernels need; picks the ptxas."""
    import torch

    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    env["python"] = platform.python_version()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        drv = _driver_cuda_version()
        env["driver"] = _nvidia_smi_driver() or "unknown"
        env["driver cuda"] = f"{drv[0]}.{drv[1]}" if drv else "unknown"
    else:
        env["gpu"] = "none (CPU dry run: Triton interpreter)" if cfg.dry_run else "none"
    env["cuda"] = str(torch.version.cuda)
    env["torch"] = torch.__version__
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "missing"
        env["triton features"] = "missing: triton"
    else:
        from kvhit.kernels.launch import missing_features

        missing = missing_features()
        env["triton features"] = (
            "missing: " + ", ".join(missing) if missing else "all present"
        )
    env["numba"] = numba_status()
    env["commit"] = _commit()
    if torch.cuda.is_available():
        _pick_ptxas(env)
    return env


def env_line(env: dict[str, str]) -> str:
    """The environment in one line (the first line gpu_check.sh prints)."""
    return (
        f"python {env.get('python')} | torch {env.get('torch')} | triton "
        f"{env.get('triton')} | numba {env.get('numba')} | CUDA {env.get('cuda')} "
        f"| driver {env.get('driver', '-')} (CUDA {env.get('driver cuda', '-')}) "
        f"| GPU {env.get('gpu')} | commit {env.get('commit')} | triton features: "
        f"{env.get('triton features')}"
    )


def _nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = out.stdout.strip()
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


# -- the workload, as tensors on the device --------------------------------------------


@dataclass
class Workload:
    """One preset's batch, prompt lengths and store, on the device."""

    preset: str
    layout: object
    batch: object
    num_tokens: object
    index: object


def build_workload(preset: str, cfg: Config, device) -> Workload:
    """``cfg.requests`` prompts of up to ``cfg.max_tokens`` tokens.

    Random hash words (as distinct as sha256's), where prompts share
    prefixes: each request starts with a prefix of one of 16 system prompts
    (picked Zipf-like) for a random part of its length. The store holds the
    keys the worker asks about up to a random stored length of each prompt,
    5% of them evicted. Built with torch ops on ``device``; no Python loop
    over requests or hashes.
    """
    import torch

    from kvhit.bench.workloads import make_layout

    layout = make_layout(preset)
    hbs = layout.hash_block_size
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    B, max_units = cfg.requests, max(cfg.max_tokens // hbs, 1)

    def rand(*shape, lo=0, hi=None):
        return torch.randint(lo, hi, shape, generator=gen).to(device)

    units = rand(B, lo=max_units // 8, hi=max_units + 1)
    zipf = 1.0 / torch.arange(1, _SYSTEM_PROMPTS + 1, dtype=torch.float64)
    sys_id = torch.multinomial(zipf, B, replacement=True, generator=gen).to(device)
    shared = (units.to(torch.float64) * rand(B, hi=1001) / 1000).to(torch.int64)
    batch = _prefix_batch(units, shared, sys_id, max_units, cfg, gen, device)
    num_tokens = units * hbs - rand(B, hi=hbs)  # some not block-aligned
    stored = (num_tokens.to(torch.float64) * rand(B, lo=300, hi=1001) / 1000).to(
        torch.int64
    )
    index = _stored_index(layout, batch, stored, 0.05, gen, device)
    return Workload(preset, layout, batch, num_tokens, index)


# System prompts the workloads' prompts share prefixes of (picked Zipf-like).
_SYSTEM_PROMPTS = 16


def _prefix_batch(units, shared, sys_id, pool_units: int, cfg: Config, gen, device):
    """A HashBatch of random words (as distinct as sha256's) for prompts of
    ``units`` (int64 [B]) hash units, where the first ``shared[b]`` units of
    prompt ``b`` are those of system prompt ``sys_id[b]`` (both int64 [B];
    each system prompt ``pool_units`` random units long); drawn from ``gen``
    with torch ops on ``device``."""
    import torch

    from kvhit.coordinator.packing import HashBatch, num_words

    B, W = units.shape[0], num_words(cfg.hash_bytes)
    offsets = torch.zeros(B + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(units, 0)
    total = int(offsets[-1])
    owner = torch.repeat_interleave(torch.arange(B, device=device), units)
    pos = torch.arange(total, device=device) - offsets[:-1][owner]
    words = torch.randint(
        -(1 << 63), (1 << 63) - 1, (total, W), generator=gen, dtype=torch.int64
    ).to(device)
    pool = torch.randint(
        -(1 << 63),
        (1 << 63) - 1,
        (_SYSTEM_PROMPTS, pool_units, W),
        generator=gen,
        dtype=torch.int64,
    ).to(device)
    rows = (pos < shared[owner]).nonzero().squeeze(1)
    words[rows] = pool[sys_id[owner[rows]], pos[rows]]
    return HashBatch(words, offsets, cfg.hash_bytes)


def _stored_index(layout, batch, stored, evicted: float, gen, device):
    """A triton KeyIndex on ``device`` holding the keys the store worker asks
    for of ``batch`` at ``stored`` tokens (int64 [B]), each evicted with
    probability ``evicted`` (drawn from ``gen``)."""
    import torch

    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex

    engine = LookupEngine(layout, backend="torch", device=device)
    gids, cand_rows = engine.lookup_candidates(batch, stored)
    keep = torch.rand(gids.shape[0], generator=gen).to(device) >= evicted
    gids, cand_rows = gids[keep], cand_rows[keep]
    # Room for every key at load <= 0.5: the table never grows (or moves),
    # which a captured CUDA graph needs. The triton backend on the CPU too
    # (the dry run's interpreter): this checks the Triton kernels.
    index = KeyIndex(
        batch.hash_bytes,
        capacity=max(4 * gids.shape[0], 64),
        device=device,
        backend="triton",
    )
    index.add(gids, batch.hashes[cand_rows])
    return index


# -- steps -----------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, repeats: int, device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    _sync(device)
    return median(run_seconds(fn, device) for _ in range(repeats))


def check_parity(
    w: Workload, got, cfg: Config, numba: bool = True
) -> tuple[str, float]:
    """The triton lookup ``got`` (int64 [B]) against the scalar reference on
    ``cfg.sample`` requests spread over the batch, and every request against
    the numba backend when ``numba`` and numba imports. Returns
    ``(verdict, reference seconds per request)``; raises AssertionError on a
    mismatch."""
    import torch

    from kvhit.coordinator.packing import pack_hashes, unpack_hashes
    from kvhit.coordinator.reference import ReferenceCoordinator

    ref = ReferenceCoordinator(w.layout)
    B = len(w.batch)
    sample = list(range(0, B, max(B // cfg.sample, 1)))[: cfg.sample]
    offs = w.batch.offsets.cpu().tolist()
    got_l = got.cpu().tolist()
    ntok = w.num_tokens.cpu().tolist()
    dev = w.index.device
    bad, spent = [], 0.0
    for r in sample:
        rows = w.batch.hashes[offs[r] : offs[r + 1]].cpu()
        hashes = unpack_hashes(rows, w.batch.hash_bytes)
        # The worker only learns about the keys it asks: look those up.
        asked = ref.lookup_candidates(ntok[r], hashes)
        present: set = set()
        if asked:
            gids = torch.tensor([g for g, _ in asked], dtype=torch.int64)
            keys = pack_hashes([h for _, h in asked], w.batch.hash_bytes)
            hit = w.index.contains(gids.to(dev), keys.to(dev)).cpu().tolist()
            present = {k for k, h in zip(asked, hit, strict=True) if h}
        t0 = time.perf_counter()
        want = ref.lookup(ntok[r], hashes, present)
        spent += time.perf_counter() - t0
        if want != got_l[r]:
            bad.append((r, got_l[r], want))
    verdict = f"ref {len(sample) - len(bad)}/{len(sample)}"
    if not numba or not numba_status()[:1].isdigit():
        verdict += ", numba SKIP"
    else:
        # Every request against numba (the sample only against the reference).
        nb, _ = numba_lookup(w.layout, w.batch, w.num_tokens, w.index)
        same = int((nb == got.cpu()).sum())
        verdict += f", numba {same}/{B}"
        if same != B:
            bad.append(("numba", B - same))
    if bad:
        raise AssertionError(f"parity mismatch ({verdict}): {bad[:5]}")
    return verdict, spent / max(len(sample), 1)


def time_lookup(w: Workload, cfg: Config) -> dict:
    """The triton backend's lookup: eager median, and under CUDA-graph
    replay (GPU only), with the graph's answer checked against eager."""

    from kvhit.coordinator.plan import ScanPlan
    from kvhit.coordinator.triton_backend import TritonBackend

    device = w.batch.device
    backend = TritonBackend(ScanPlan.from_layout(w.layout), device)
    view = w.batch.view()
    out = {}
    t0 = time.perf_counter()
    eager = backend.lookup(view, w.num_tokens, w.index)
    _sync(device)
    # The first call compiles the kernel variant (or loads it from cache).
    out["first_call_s"] = time.perf_counter() - t0
    out["result"] = eager
    out["eager_s"] = _timed(
        lambda: backend.lookup(view, w.num_tokens, w.index), cfg.repeats, device
    )
    # Through LookupEngine.lookup_unchecked: the backend plus the engine's
    # own host-side work (inference mode, its output copy).
    from kvhit.coordinator.engine import LookupEngine

    engine = LookupEngine(w.layout, backend="triton", device=device)
    out["engine_s"] = _timed(
        lambda: engine.lookup_unchecked(w.batch, w.num_tokens, w.index),
        cfg.repeats,
        device,
    )
    if device.type == "cuda":
        out["graph_s"] = _graph_time(backend, view, w.num_tokens, w.index, eager, cfg)
    return out


def time_key_index(cfg: Config, device) -> dict:
    """Inserts/s and probes/s of 32-byte keys at load 0.5 (half the probes
    present)."""
    import torch

    from kvhit.coordinator.key_index import KeyIndex

    n = cfg.key_index_keys
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (2 * n, 4), generator=gen)
    words = words.to(device)
    gids = torch.zeros(2 * n, dtype=torch.int64, device=device)

    def insert():
        index = KeyIndex(32, capacity=2 * n, device=device, backend="triton")
        _sync(device)
        t0 = time.perf_counter()
        index.add(gids[:n], words[:n])
        _sync(device)
        return index, time.perf_counter() - t0

    index, _ = insert()
    ins = median(insert()[1] for _ in range(max(cfg.repeats // 10, 1)))
    probe_ids = torch.randperm(2 * n, generator=gen).to(device)
    pg, pw = gids[probe_ids], words[probe_ids]
    found = index.contains(pg, pw)
    if int(found.sum()) != int((probe_ids < n).sum()):
        raise AssertionError("KeyIndex.contains disagrees with what was added")
    probe = _timed(lambda: index.contains(pg, pw), cfg.repeats, device)
    out = {
        "keys": n,
        "load": round(len(index) / index.table.shape[0], 2),
        "inserts_per_s": n / ins,
        "probes_per_s": 2 * n / probe,
    }
    if device.type == "cuda":
        # The probe kernel alone, without contains()' argument checks.
        from kvhit.kernels import hash_index

        pw = pw.contiguous()
        kernel = _timed(
            lambda: hash_index.probe(index.table, index.W, pg, pw), cfg.repeats, device
        )
        out["kernel_probes_per_s"] = 2 * n / kernel
    return out


# -- long-hit dsv4 (issue 31's table) ------------------------------------------------


def build_longhit(cfg: Config, device) -> Workload:
    """``max(cfg.longhit_batches)`` long-hit dsv4-flash prompts of
    ``cfg.longhit_tokens // 8`` to ``cfg.longhit_tokens`` tokens, built with
    torch ops on ``device`` in the shape of ``workloads.generate_long_hit``
    (preset ``dsv4-longhit``): each prompt shares 25/50/90/100 % of one of
    16 system prompts (Zipf 1); the store holds the keys the worker asks for
    half of the prompts (whole), 2 % of them evicted. Random words stand for
    sha256 (the Python generator would take minutes at 4096 x 16K)."""
    import torch

    from kvhit.bench.workloads import make_layout

    layout = make_layout("dsv4-flash")
    hbs = layout.hash_block_size
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 2)
    B = max(cfg.longhit_batches)
    hi = max(cfg.longhit_tokens // hbs, 1)

    def rand(*shape, lo=0, hi=None):
        return torch.randint(lo, hi, shape, generator=gen).to(device)

    units = rand(B, lo=max(hi // 8, 1), hi=hi + 1)
    zipf = 1.0 / torch.arange(1, _SYSTEM_PROMPTS + 1, dtype=torch.float64)
    sys_id = torch.multinomial(zipf, B, replacement=True, generator=gen).to(device)
    fracs = torch.tensor([0.25, 0.5, 0.9, 1.0], dtype=torch.float64, device=device)
    shared = (units.to(torch.float64) * fracs[rand(B, hi=4)]).to(torch.int64)
    batch = _prefix_batch(units, shared, sys_id, hi, cfg, gen, device)
    num_tokens = units * hbs
    stored = torch.where(rand(B, hi=2) == 1, num_tokens, torch.zeros_like(num_tokens))
    index = _stored_index(layout, batch, stored, 0.02, gen, device)
    return Workload("dsv4-longhit", layout, batch, num_tokens, index)


def _head(w: Workload, n: int) -> tuple[object, object]:
    """The first ``n`` requests of ``w``: ``(HashBatch, num_tokens)``."""
    from kvhit.coordinator.packing import HashBatch

    offs = w.batch.offsets[: n + 1]
    end = int(offs[-1])
    return HashBatch(w.batch.hashes[:end], offs, w.batch.hash_bytes), w.num_tokens[:n]


def numba_threads() -> int:
    """The threads numba runs on (all the machine's cores unless
    NUMBA_NUM_THREADS says otherwise)."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


def numba_lookup(layout, batch, num_tokens, index, threads: int | None = None):
    """``LookupEngine.lookup`` on the numba backend on the host, on a host copy
    of ``index``'s table (the device's stays where it is); ``threads`` numba
    threads (default: all). Returns ``(hits int64 [B] on the CPU, engine,
    host batch, host num_tokens, host index)`` for timing again."""
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch

    engine = LookupEngine(layout, backend="numba", device="cpu")
    host = KeyIndex.from_table(
        index.table.cpu(), index.hash_bytes, read_only=True, backend="torch"
    )
    hb = HashBatch(batch.hashes.cpu(), batch.offsets.cpu(), batch.hash_bytes)
    nt = num_tokens.cpu()
    return engine.lookup(hb, nt, host), (engine, hb, nt, host)


def time_longhit(w: Workload, cfg: Config, report: Report) -> list[dict]:
    """Per batch size of ``cfg.longhit_batches``: the validated eager
    ``LookupEngine.lookup`` (triton), its CUDA-graph replay (GPU only), numba
    on 1 thread and on all of them, every request of the triton answer
    compared to numba's. One row per batch size, emitted as it is measured."""
    import numba
    import torch

    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.graph_runner import GraphRunner
    from kvhit.coordinator.plan import ScanPlan
    from kvhit.coordinator.triton_backend import TritonBackend

    device = w.batch.device
    engine = LookupEngine(w.layout, backend="triton", device=device)
    backend = TritonBackend(ScanPlan.from_layout(w.layout), device)
    runner = GraphRunner(engine, w.index)
    cores = numba_threads()
    rows = []
    for b in cfg.longhit_batches:
        batch, nt = _head(w, b)
        got = engine.lookup(batch, nt, w.index)
        row = {"B": b, "hashes": batch.total, "numba_threads": cores}
        row["eager_s"] = _timed(
            lambda b=batch, n=nt: engine.lookup(b, n, w.index), cfg.repeats, device
        )
        if device.type == "cuda":
            row["graph_s"] = _graph_time(backend, batch.view(), nt, w.index, got, cfg)
        # The scheduler's path (coordinator/graph_runner.py): validated,
        # copied into its bucket's static buffers, replayed (eager on the CPU).
        if not torch.equal(runner.lookup(batch, nt), got):
            raise AssertionError(f"long-hit B = {b}: GraphRunner differs from eager")
        row["runner_s"] = _timed(
            lambda b=batch, n=nt: runner.lookup(b, n), cfg.repeats, device
        )
        want, (ne, hb, hnt, host) = numba_lookup(w.layout, batch, nt, w.index)
        old = numba.get_num_threads()
        try:
            for label, n in (("numba_1_s", 1), ("numba_all_s", cores)):
                numba.set_num_threads(n)
                row[label] = _timed(
                    lambda e=ne, a=(hb, hnt, host): e.lookup(*a),
                    cfg.repeats,
                    torch_cpu(),
                )
        finally:
            numba.set_num_threads(old)
        same = int((got.cpu() == want).sum())
        row["parity"] = f"numba {same}/{b}"
        report.emit("longhit", **row)
        rows.append(row)
        if same != b:
            raise AssertionError(
                f"long-hit B = {b}: {b - same} requests differ from numba"
            )
    return rows


def torch_cpu():
    import torch

    return torch.device("cpu")


def _graph_time(backend, view, num_tokens, index, eager, cfg: Config) -> float:
    """Median seconds of a CUDA-graph replay of ``backend.lookup``, its answer
    checked against ``eager``."""
    import torch

    graph, static = capture_graph(lambda: backend.lookup(view, num_tokens, index))
    if not torch.equal(static, eager):
        raise AssertionError("CUDA-graph replay differs from the eager lookup")
    return _timed(graph.replay, cfg.repeats, view.rows.device)


def time_fleet(cfg: Config, device) -> list[dict]:
    """``LookupEngine.fleet_lookup`` of B = 64 requests (``cfg.requests`` if
    fewer) of the llama layout against E = 1, 8, 64, 256 engines (on CUDA
    the Triton fleet kernel, ``kernels/fleet_triton.py``): every request
    shares a system prompt (its first quarter) and engine ``r % E`` holds a
    random prefix of request ``r``. Each E is checked first against the same
    keys in a CPU fleet (torch ops), then timed (median per batch)."""
    import torch

    from kvhit.bench.workloads import make_layout
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.fleet_index import FleetIndex
    from kvhit.coordinator.packing import HashBatch, num_words

    layout = make_layout("llama")
    hbs = layout.hash_block_size
    W = num_words(cfg.hash_bytes)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 2)
    B, units = min(64, cfg.requests), min(max(cfg.max_tokens // hbs, 1), 2048)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (B, units, W), generator=gen)
    words[:, : units // 4] = words[0, : units // 4]
    offsets = torch.arange(B + 1, dtype=torch.int64) * units
    host = HashBatch(words.reshape(B * units, W), offsets, cfg.hash_bytes)
    batch = HashBatch(host.hashes.to(device), offsets.to(device), cfg.hash_bytes)
    num_tokens = torch.full((B,), units * hbs, dtype=torch.int64)
    held = torch.randint(0, units + 1, (B,), generator=gen)
    req = torch.repeat_interleave(torch.arange(B), held)
    pos = torch.arange(req.shape[0]) - (torch.cumsum(held, 0) - held)[req]
    keys = words[req, pos]
    gids = torch.zeros_like(req)
    engine = LookupEngine(layout, backend="auto", device=device)
    cpu_engine = LookupEngine(layout, backend="torch")
    n_tok = num_tokens.to(device)
    out = []
    for E in (1, 8, 64, 256):
        fleets = []
        for dev in (device, torch.device("cpu")):
            fleet = FleetIndex(E, cfg.hash_bytes, capacity=4 * max(len(keys), 16),
                               device=dev, backend="torch")  # fmt: skip
            fleet.add((req % E).to(dev), gids.to(dev), keys.to(dev))
            fleets.append(fleet)
        want = cpu_engine.fleet_lookup(host, num_tokens, fleets[1])
        got = engine.fleet_lookup(batch, n_tok, fleets[0])
        if not torch.equal(got.cpu(), want):
            raise AssertionError(f"fleet_lookup differs from the CPU fleet at E = {E}")
        t = _timed(lambda f=fleets[0]: engine.fleet_lookup(batch, n_tok, f),
                   cfg.repeats, device)  # fmt: skip
        out.append({"engines": E, "requests": B, "hashes": B * units,
                    "batch_s": t, "hits": int((want > 0).sum())})  # fmt: skip
    return out


# -- the run ---------------------------------------------------------------------


def _step(report: Report, name: str, fn, cfg: Config | None = None):
    """Run one step; record PASS / FAIL / SKIP and its time, never raise. A
    step that would start past ``cfg.budget_s`` is SKIPped."""
    elapsed = time.perf_counter() - report.start
    if cfg is not None and cfg.budget_s is not None and elapsed > cfg.budget_s:
        say(f"== {name}: SKIP (budget of {cfg.budget_s:.0f} s spent)")
        report.steps.append((name, "SKIP", 0.0))
        return None
    t0 = time.perf_counter()
    say(f"== {name}")
    try:
        out = fn()
    except Exception:  # noqa: BLE001 - one failed step must not hide the rest
        traceback.print_exc()
        status = "FAIL"
        report.failed = True
        out = None
    else:
        status = "PASS"
    secs = time.perf_counter() - t0
    report.steps.append((name, status, secs))
    say(
        f"== {name}: {status} in {secs:.1f} s "
        f"({time.perf_counter() - report.start:.1f} s so far)"
    )
    return out


def preset_size(preset: str, cfg: Config) -> int:
    """Keys a preset's workload holds, roughly (hash units times groups): the
    run goes smallest first."""
    from kvhit.bench.workloads import make_layout

    layout = make_layout(preset)
    return cfg.max_tokens // layout.hash_block_size * (len(layout.groups) + 1)


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def summary(report: Report, cfg: Config) -> str:
    """The Markdown table for bench/RESULTS.md."""
    env = report.env
    lines = [
        f"### GPU check, {env.get('date')} (commit {env.get('commit')})",
        "",
        f"{env.get('gpu')}, driver {env.get('driver', '-')} (CUDA "
        f"{env.get('driver cuda', '-')}), torch {env.get('torch')} (CUDA "
        f"{env.get('cuda')}), triton {env.get('triton')}; ptxas "
        f"{env.get('ptxas', '-')}",
        "",
        f"B = {cfg.requests} requests, prompts up to {cfg.max_tokens} tokens, "
        f"{cfg.hash_bytes}-byte hashes; medians of {cfg.repeats} runs"
        + (" (DRY RUN on the CPU: timings meaningless)" if cfg.dry_run else ""),
        "",
        "| preset | hashes | keys | first call (compile) | lookup eager "
        "| engine eager | lookup graph | ref/request | x ref (graph or eager) "
        "| parity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        t = r.get("graph_s") or r.get("eager_s")
        x = r["ref_per_req"] * cfg.requests / t if t and r.get("ref_per_req") else 0
        lines.append(
            f"| {r['preset']} | {r['hashes']} | {r['keys']} | "
            f"{_fmt_s(r.get('first_call_s'))} | {_fmt_s(r.get('eager_s'))} | {_fmt_s(r.get('engine_s'))} | "
            f"{_fmt_s(r.get('graph_s'))} | "
            f"{_fmt_s(r.get('ref_per_req'))} | {x:.0f}x | {r.get('parity', '-')} |"
        )
    if report.longhit:
        lines += [
            "",
            f"Long-hit dsv4-flash, prompts up to {cfg.longhit_tokens} tokens "
            f"(numba on {report.longhit[0]['numba_threads']} threads = all cores):",
            "",
            "| B | lookup (validated, eager) | graph | GraphRunner.lookup "
            "| numba, 1 thread | numba, all cores | parity |",
            "|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in report.longhit:
            lines.append(
                f"| {r['B']} | {_fmt_s(r.get('eager_s'))} | {_fmt_s(r.get('graph_s'))} "
                f"| {_fmt_s(r.get('runner_s'))} "
                f"| {_fmt_s(r.get('numba_1_s'))} | {_fmt_s(r.get('numba_all_s'))} "
                f"| {r['parity']} |"
            )
    for k in report.key_index:
        lines.append("")
        lines.append(
            f"KeyIndex, 32-byte keys, {k['keys']} keys at load {k['load']}: "
            f"{k['inserts_per_s'] / 1e9:.3f} G inserts/s, "
            f"{k['probes_per_s'] / 1e9:.3f} G probes/s (contains)"
            + (
                f", {k['kernel_probes_per_s'] / 1e9:.3f} G probes/s (probe kernel)"
                if "kernel_probes_per_s" in k
                else ""
            )
        )
    if report.fleet:
        f0 = report.fleet[0]
        lines.append("")
        lines.append(
            f"fleet_lookup, llama, B = {f0['requests']}, {f0['hashes']} hashes: "
            + ", ".join(
                f"E = {f['engines']}: {_fmt_s(f['batch_s'])}" for f in report.fleet
            )
        )
    lines.append("")
    lines.append("| step | status | seconds |")
    lines.append("|---|---|---|")
    for name, status, secs in report.steps:
        lines.append(f"| {name} | {status} | {secs:.1f} |")
    return "\n".join(lines)


def run(cfg: Config) -> Report:
    """Every step of the check; the report holds what the summary prints."""
    import torch

    report = Report()
    if cfg.out_dir:
        os.makedirs(cfg.out_dir, exist_ok=True)
        report.results_path = os.path.join(cfg.out_dir, "results.jsonl")
    report.env = preflight(cfg)
    for k, v in report.env.items():
        say(f"  {k:12} {v}")
    report.emit("env", **report.env)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # KeyIndex first: seconds, and a DESIGN.md target a timeout must not cost.
    ki = _step(report, "KeyIndex", lambda: time_key_index(cfg, device), cfg)
    if ki is not None:
        report.key_index.append(ki)
        report.emit("key_index", **ki)
    if cfg.longhit_batches and numba_status()[:1].isdigit():
        lh = _step(report, "long-hit: build", lambda: build_longhit(cfg, device), cfg)
        if lh is not None:
            rows = _step(
                report, "long-hit: lookup", lambda: time_longhit(lh, cfg, report), cfg
            )
            report.longhit.extend(rows or ())
        del lh
    elif cfg.longhit_batches:
        say("== long-hit: SKIP (numba does not import)")
        report.steps.append(("long-hit", "SKIP", 0.0))
    presets = sorted(cfg.presets, key=lambda p: preset_size(p, cfg))
    for preset in presets:
        w = _step(
            report,
            f"{preset}: build",
            lambda p=preset: build_workload(p, cfg, device),
            cfg,
        )
        if w is None:
            continue
        row = {
            "preset": preset,
            "hashes": w.batch.total,
            "keys": len(w.index),
        }
        report.rows.append(row)
        timing = _step(
            report, f"{preset}: lookup timing", lambda w=w: time_lookup(w, cfg), cfg
        )
        if timing is None:
            continue
        row.update({k: v for k, v in timing.items() if k != "result"})
        report.emit("lookup", **row)
        par = _step(
            report,
            f"{preset}: parity",
            lambda w=w, t=timing: check_parity(w, t["result"], cfg),
            cfg,
        )
        if par is not None:
            row["parity"], row["ref_per_req"] = par
            report.emit("parity", preset=preset, parity=par[0], ref_per_req=par[1])
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fleet = _step(report, "fleet", lambda: time_fleet(cfg, device), cfg)
    for row in fleet or ():
        report.fleet.append(row)
        report.emit("fleet", **row)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU")
    parser.add_argument("--presets", default=None, help="comma-separated presets")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for results.jsonl")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds; later steps SKIP"
    )
    parser.add_argument(
        "--env-line",
        action="store_true",
        help="print the environment in one line; exit 2 if a Triton feature "
        "the kernels need is missing",
    )
    args = parser.parse_args(argv)
    if args.env_line:
        env = preflight(Config())
        print(env_line(env), flush=True)
        if env.get("triton features") != "all present":
            say(
                f"FAIL: triton {env.get('triton')} lacks what the kernels need "
                f"({env.get('triton features')}; kvhit needs triton >= 3.6, "
                "see kernels/launch.py FEATURES)"
            )
            return 2
        return 0
    cfg = Config.dry() if args.dry_run else Config()
    changes = config_changes(
        args, requests="requests", max_tokens="max_tokens", out="out_dir",
        budget="budget_s",
    )  # fmt: skip
    if changes:
        cfg = Config(**{**cfg.__dict__, **changes})
    import torch

    if not torch.cuda.is_available():
        if not cfg.dry_run:
            say("SKIP: no CUDA GPU (--dry-run runs every step on the CPU)")
            return 0
        if (error := interpret()) is not None:
            say(error)
            return 1
    report = run(cfg)
    print()
    text = summary(report, cfg)
    print(text, flush=True)
    if cfg.out_dir:
        with open(os.path.join(cfg.out_dir, "summary.md"), "w") as f:
            f.write(text + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
