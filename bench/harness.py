"""The one benchmark harness: ``kvhit bench``, ``kvhit demo`` and the
pytest-benchmark suites in ``benchmarks/`` all measure through it. It times;
its neighbours hold the rest: ``names.py`` (the names the CLI shares, no
heavy import), ``parity.py`` (the check against the reference loop),
``peer_steps.py`` (the peer column) and ``report.py`` (tables and plots).

What it holds, in the order a sweep uses it:

* runners: one whole-batch lookup bound to a packed batch and a store, one per
  backend name. ``"reference"`` is the reference loop
  (``ReferenceCoordinator.lookup`` per request over the store as a Python
  set), the baseline every ratio is taken against; any other name is a
  ``LookupEngine(layout, backend=name, device=...)``, timed end to end through
  ``LookupEngine.lookup`` on an already packed batch. A backend whose engine
  cannot be built (unknown name, wrong device) is skipped with the reason.
  ``"vllm"`` is vLLM 0.33.0's own per-request ``MooncakeStoreWorker.lookup``
  through the vLLM oracle (:mod:`kvhit.bench.vllm_oracle`, imported only
  when asked for);
* the parity check (:mod:`kvhit.bench.parity`): every answer equal to the
  reference loop's on a sample (exact; :class:`MismatchError` otherwise);
* timing: medians (numpy) after a warm-up call;
* the sweep over presets x batch sizes x backends, giving one
  :class:`ResultRow` per measurement, written to JSON once (and drawn by
  :mod:`kvhit.bench.report`);
* the peer column (``--peer dynamo``, :mod:`kvhit.bench.peer_steps`): Dynamo's KV-router
  indexer beside kvhit on the shipped conversation trace, answers asserted
  equal, lookup time per request and store throughput from one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhit.bench.machine import memory_state
from kvhit.bench.names import (
    BACKENDS,
    DEFAULT_BATCH_SIZES,
    PEER_ORDERS,
    REFERENCE,
    VLLM,
    Skip,
)

# Re-exported: callers of the harness (bench_fleet, the tests) know them here.
from kvhit.bench.names import MismatchError as MismatchError
from kvhit.bench.parity import check_parity, parity_indices
from kvhit.bench.peer_steps import PeerRow
from kvhit.bench.peers import PEERS
from kvhit.bench.workloads import (
    PRESETS,
    TrafficConfig,
    Workload,
    environment_info,
    generate,
)

if TYPE_CHECKING:  # pragma: no cover - only for annotations
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.reference import ReferenceCoordinator


# ---------------------------------------------------------------------------
# Devices and backends
# ---------------------------------------------------------------------------


def default_device() -> str:
    """The current accelerator's device type (``"cuda"``, ...), else ``"cpu"``."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return str(acc.current_accelerator().type)
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backends(device: str) -> tuple[tuple[str, ...], tuple[Skip, ...]]:
    """Every backend name worth timing on ``device`` and the ones left out.

    All engine backends are tried (those whose engine cannot be built are
    skipped later, with the engine's reason) except triton on the CPU: there
    it runs only under ``TRITON_INTERPRET=1``, a test tool, not a backend to
    time (ask for it by name to run it anyway).
    """
    if _device_type(device) == "cpu":
        why = "triton runs on the CPU only under TRITON_INTERPRET (tests); not timed"
        names = tuple(b for b in BACKENDS if b != "triton")
        return names, (Skip("triton", why),)
    return BACKENDS, ()


def _device_type(device: str) -> str:
    return str(device).split(":", 1)[0]


def synchronize(device: str) -> None:
    """Waits for the queued work of an accelerator (no-op on the CPU)."""
    if _device_type(device) == "cpu":
        return
    import torch

    if hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()
    else:  # torch < 2.6
        torch.cuda.synchronize()


def backend_name(engine: LookupEngine) -> str:
    """What ``engine``'s ``backend="auto"`` (or a name) resolved to."""
    b = engine.backend
    return b if isinstance(b, str) else str(b.name)


# ---------------------------------------------------------------------------
# Runners
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Runner:
    """One backend bound to one batch and store.

    Attributes:
        backend: the backend that runs (``engine.backend`` once ``"auto"`` is
            resolved), or ``"reference"`` / ``"vllm"``.
        device: where it runs.
        run: one whole-batch lookup, finished before it returns (what is
            timed); returns the hits (int64 tensor ``[B]`` or a list).
    """

    backend: str
    device: str
    run: Callable[[], Any] = field(repr=False)

    def hits(self) -> list[int]:
        """One run's hits as Python ints, ``[B]``."""
        out = self.run()
        return [int(h) for h in (out.tolist() if hasattr(out, "tolist") else out)]


def reference_runner(
    workload: Workload,
    indices: Sequence[int] | None = None,
    ref: ReferenceCoordinator | None = None,
) -> Runner:
    """The reference loop over ``indices`` (default: every request)."""
    ref = ref or workload.reference()
    return Runner(REFERENCE, "cpu", lambda: workload.reference_lookup(indices, ref=ref))


def build_engine(workload: Workload, backend: str, device: str) -> LookupEngine:
    """``LookupEngine(workload.layout, backend=backend, device=device)``;
    raises whatever the engine raises for a backend it cannot build."""
    from kvhit.coordinator.engine import LookupEngine

    return LookupEngine(workload.layout, backend=backend, device=device)


def engine_runner(
    engine: LookupEngine, workload: Workload, index: KeyIndex | None = None
) -> Runner:
    """``engine.lookup`` on ``workload``'s batch, packed here (not timed), and
    on ``index`` (default: a new one holding the workload's store)."""
    device = str(engine.device)
    index = index if index is not None else workload.key_index(device)
    batch = workload.hash_batch(device)
    num_tokens = workload.num_tokens_tensor(device)

    def run() -> Any:
        hits = engine.lookup(batch, num_tokens, index)
        synchronize(device)
        return hits

    return Runner(backend_name(engine), device, run)


def make_runner(
    workload: Workload,
    backend: str,
    device: str,
    index: KeyIndex | None = None,
) -> Runner:
    """The runner of ``backend`` (a name of :data:`BACKENDS` or ``"auto"``)."""
    if backend == REFERENCE:
        return reference_runner(workload)
    return engine_runner(build_engine(workload, backend, device), workload, index)


# -- vLLM ---------------------------------------------------------------------


def load_vllm_oracle() -> tuple[ModuleType | None, str]:
    """:mod:`kvhit.bench.vllm_oracle` with vLLM 0.33.0 imported, or
    ``(None, why)``; only when a run asks for the vLLM column (importing vLLM
    takes several seconds)."""
    from kvhit.bench import vllm_oracle as mod

    mods, why = mod.load_vllm()
    return (mod, "") if mods is not None else (None, why)


def vllm_runner(
    oracle: ModuleType, workload: Workload, indices: Sequence[int] | None = None
) -> Runner:
    """vLLM's ``MooncakeStoreWorker.lookup`` per request over ``indices``.

    The store answers from memory (no RPC): each request gets the store keys of
    its own hashes, gathered here (not timed), since the worker asks only about
    those; the oracle copies the set it is given on every call.
    """
    vllm = oracle.VllmOracle(workload.layout)
    idx = list(range(len(workload)) if indices is None else indices)
    store, groups = workload.store_keys, range(workload.layout.num_groups)
    calls = [
        (
            workload.num_tokens[i],
            workload.hash_lists[i],
            {(g, h) for h in workload.hash_lists[i] for g in groups if (g, h) in store},
        )
        for i in idx
    ]
    return Runner(VLLM, "cpu", lambda: [vllm.lookup(*call) for call in calls])


# ---------------------------------------------------------------------------
# Timing (the parity check is kvhit.bench.parity)
# ---------------------------------------------------------------------------


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> np.ndarray:
    """Wall-clock seconds of ``repeats`` calls of ``fn`` after ``warmup``
    untimed ones: float64 ``[repeats]``."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = np.empty(repeats)
    for k in range(repeats):
        t0 = time.perf_counter()
        fn()
        times[k] = time.perf_counter() - t0
    return times


def pack_seconds(workload: Workload, device: str, repeats: int) -> float:
    """Median seconds of ``HashBatch.from_bytes`` over the whole batch."""
    return float(np.median(time_calls(lambda: workload.hash_batch(device), repeats)))


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ResultRow:
    """One backend on one (preset, batch size), measured in one run.

    Attributes:
        preset, batch_size, backend, device: what ran.
        median_s: median seconds per whole-batch lookup (extrapolated from a
            sample when ``estimated``).
        times_s: every timed run (empty when ``estimated``).
        lookups_per_s: ``batch_size / median_s``.
        estimated: this row's time is its per-request time on the parity
            sample times ``batch_size`` (the slow loops above the cap).
        speedup_vs_reference: reference loop median / ``median_s``.
        reference_estimated: that reference median is extrapolated.
        speedup_vs_vllm: vLLM's per-request worker median / ``median_s``
            (``None`` without the vLLM column).
        pack_s_per_request: ``HashBatch.from_bytes`` seconds per request for
            this batch, not included in ``median_s`` (engine rows only).
        parity_checked: requests checked against the reference loop.
    """

    preset: str
    batch_size: int
    backend: str
    device: str
    median_s: float
    times_s: tuple[float, ...]
    lookups_per_s: float
    estimated: bool
    speedup_vs_reference: float | None
    reference_estimated: bool
    speedup_vs_vllm: float | None
    pack_s_per_request: float | None
    parity_checked: int


@dataclass(frozen=True)
class ProbeRow:
    """``KeyIndex.contains`` over every (group, hash) pair of a batch."""

    preset: str
    hash_bytes: int
    probes: int
    median_s: float
    probes_per_s: float
    hit_fraction: float


@dataclass(frozen=True)
class SweepConfig:
    """What a sweep runs. ``traffic.num_requests`` is replaced by the largest
    batch size (smaller batches are its first requests, same store)."""

    presets: tuple[str, ...]
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    backends: tuple[str, ...] = BACKENDS
    device: str = "cpu"
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    repeats: int = 5
    reference_cap: int = 1024
    sample: int = 64
    vllm: bool = False
    key_index: bool = False
    peer: str | None = None
    peer_limit: int | None = None
    peer_host_load: tuple[int, ...] = (0,)
    peer_order: tuple[str, ...] = PEER_ORDERS

    def __post_init__(self) -> None:
        if self.peer is not None and self.peer not in PEERS:
            raise ValueError(f"unknown peer {self.peer!r}; choose from {PEERS}")
        if not self.peer_order or not set(self.peer_order) <= set(PEER_ORDERS):
            raise ValueError(
                f"peer_order must name some of {PEER_ORDERS}, got {self.peer_order}"
            )
        if not self.peer_host_load or min(self.peer_host_load) < 0:
            raise ValueError(
                f"peer_host_load must be >= 0 busy processes, got {self.peer_host_load}"
            )
        if not self.presets:
            raise ValueError("presets must not be empty")
        for p in self.presets:
            if p not in PRESETS:
                raise ValueError(
                    f"unknown preset {p!r}; choose from {', '.join(PRESETS)}"
                )
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be >= 1, got {self.batch_sizes}")
        for b in self.backends:
            if b not in BACKENDS:
                raise ValueError(
                    f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}"
                )
        for name in ("repeats", "sample"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.reference_cap < 0:
            raise ValueError(f"reference_cap must be >= 0, got {self.reference_cap}")


@dataclass(frozen=True)
class SweepResult:
    """Everything one sweep measured."""

    config: SweepConfig
    rows: tuple[ResultRow, ...]
    skipped: tuple[Skip, ...]
    probes: tuple[ProbeRow, ...]
    environment: dict[str, str]
    peers: tuple[PeerRow, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The JSON document :func:`write_json` writes."""
        from kvhit import __version__

        cfg = self.config
        return {
            "kvhit": __version__,
            "environment": self.environment,
            "config": {
                "presets": list(cfg.presets),
                "batch_sizes": list(cfg.batch_sizes),
                "backends": list(cfg.backends),
                "device": cfg.device,
                "min_tokens": cfg.traffic.min_tokens,
                "max_tokens": cfg.traffic.max_tokens,
                "hash_bytes": cfg.traffic.hash_bytes,
                "history": cfg.traffic.history,
                "seed": cfg.traffic.seed,
                "repeats": cfg.repeats,
                "reference_cap": cfg.reference_cap,
                "sample": cfg.sample,
                "vllm": cfg.vllm,
                "peer": cfg.peer,
            },
            "results": [asdict(r) for r in self.rows],
            "skipped": [asdict(s) for s in self.skipped],
            "key_index": [asdict(p) for p in self.probes],
            "peers": [asdict(p) for p in self.peers],
        }


def write_json(path: str | os.PathLike[str], result: SweepResult) -> None:
    """Writes ``result.to_json()`` to ``path``."""
    with open(path, "w") as fh:
        json.dump(result.to_json(), fh, indent=2)


# ---------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------


class TqdmProgress:
    """A ``progress(stage, done, total)`` callback (as :func:`generate` takes)
    drawing one tqdm bar per stage. tqdm is imported only when a bar is
    drawn, so a quiet run (and importing this module) works without it, as
    on a GPU machine running from a source tree with only torch and triton."""

    def __init__(self, disable: bool = False, leave: bool = False) -> None:
        self.disable, self.leave = disable, leave
        self.bars: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.disable:
            return
        bar = self.bars.get(stage)
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(
                total=total,
                desc=f"  {stage}",
                unit="req",
                leave=self.leave,
            )
            self.bars[stage] = bar
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
            del self.bars[stage]


@dataclass
class _PresetContext:
    """What every batch size of one preset shares."""

    full: Workload
    ref: ReferenceCoordinator
    engines: dict[str, LookupEngine]
    index: KeyIndex | None
    oracle: ModuleType | None


def sweep(
    config: SweepConfig,
    quiet: bool = False,
    skipped: Iterable[Skip] = (),
) -> SweepResult:
    """Runs ``config``: for each preset and batch size, checks every backend
    against the reference loop, then times each. Raises
    :class:`MismatchError` on the first disagreement."""
    skips = list(skipped)
    oracle = _vllm_for(config, skips, quiet)
    steps = [(p, b) for p in config.presets for b in sorted(set(config.batch_sizes))]
    rows: list[ResultRow] = []
    probes: list[ProbeRow] = []
    # The memory system's state at both ends of the run (bench/machine.py):
    # ratios to the Python loops move with it on a shared machine.
    load_start = memory_state()
    bar = _steps_bar(steps, quiet)
    ctx: _PresetContext | None = None
    for preset, b in bar:
        if ctx is None or ctx.full.preset != preset:
            bar.set_postfix_str(f"{preset}: generating")
            ctx = _preset_context(config, preset, oracle, skips, quiet)
            if config.key_index and ctx.index is not None:
                probes.append(probe_rate(ctx.full, ctx.index, config.repeats))
        bar.set_postfix_str(f"{preset} B={b}")
        rows.extend(_measure_batch(config, ctx, b))
    peers: list[PeerRow] = []
    if config.peer is not None:
        runs = [(o, load) for o in config.peer_order for load in config.peer_host_load]
        for order, load in runs:
            from kvhit.bench import peer_steps  # raw trace ids, Python lists

            rows_at, skip = peer_steps.peer_sweep(
                config.peer,
                config.batch_sizes,
                limit=config.peer_limit,
                quiet=quiet,
                host_load=load,
                order=order,
                mismatch=MismatchError,
            )
            peers.extend(rows_at)
            if skip is not None:
                skips.append(skip)
                break
    env = environment_info()
    env["dependent_load_start"] = load_start
    env["dependent_load_end"] = memory_state()
    return SweepResult(
        config,
        tuple(rows),
        tuple(_unique(skips)),
        tuple(probes),
        env,
        tuple(peers),
    )


class _NoBar(list):
    """What a quiet sweep iterates over instead of a tqdm bar."""

    def set_postfix_str(self, text: str) -> None:
        pass


def _steps_bar(steps: list[tuple[str, int]], quiet: bool) -> Any:
    if quiet:
        return _NoBar(steps)
    from tqdm import tqdm

    return tqdm(steps, desc="kvhit bench", unit="step", leave=False)


def _vllm_for(config: SweepConfig, skips: list[Skip], quiet: bool) -> ModuleType | None:
    if not config.vllm:
        return None
    if not quiet:
        sys.stderr.write(
            "kvhit bench: importing vLLM 0.33.0 (kvhit.bench.vllm_oracle)\n"
        )
    oracle, why = load_vllm_oracle()
    if oracle is None:
        skips.append(Skip(VLLM, why))
    return oracle


def _unique(skips: list[Skip]) -> list[Skip]:
    return list(dict.fromkeys(skips))


def _preset_context(
    config: SweepConfig,
    preset: str,
    oracle: ModuleType | None,
    skips: list[Skip],
    quiet: bool,
) -> _PresetContext:
    traffic = replace(config.traffic, num_requests=max(config.batch_sizes))
    full = generate(preset, traffic, progress=TqdmProgress(disable=quiet))
    engines: dict[str, LookupEngine] = {}
    for name in config.backends:
        if name == REFERENCE:
            continue
        try:
            engines[name] = build_engine(full, name, config.device)
        except Exception as exc:  # the engine's own reason is the report
            skips.append(Skip(name, f"{type(exc).__name__}: {exc}"))
    index = full.key_index(config.device) if engines or config.key_index else None
    return _PresetContext(full, full.reference(), engines, index, oracle)


@dataclass(frozen=True)
class _Timed:
    """One backend's median, runs, and whether the median is extrapolated."""

    median_s: float
    times_s: tuple[float, ...]
    estimated: bool


def _measure_batch(
    config: SweepConfig, ctx: _PresetContext, batch_size: int
) -> list[ResultRow]:
    """Every row of one (preset, batch size): parity first, then timing."""
    wl = ctx.full.take(batch_size)
    check = parity_indices(
        batch_size,
        config.reference_cap,
        config.sample,
        config.traffic.seed + batch_size,
    )
    ref_timed, want = _time_loop(
        reference_runner(wl, check, ctx.ref), wl, check, config
    )
    timed: dict[str, _Timed] = {}
    if REFERENCE in config.backends:
        timed[REFERENCE] = ref_timed
    if ctx.oracle is not None:
        vllm_timed, vllm_hits = _time_loop(
            vllm_runner(ctx.oracle, wl, check), wl, check, config
        )
        check_parity(_label(VLLM, wl), vllm_hits, want, wl.num_tokens)
        timed[VLLM] = vllm_timed
    for name, engine in ctx.engines.items():
        runner = engine_runner(engine, wl, ctx.index)
        check_parity(_label(runner.backend, wl), runner.hits(), want, wl.num_tokens)
        times = time_calls(runner.run, config.repeats)
        timed[name] = _Timed(float(np.median(times)), tuple(times.tolist()), False)
    pack = pack_seconds(wl, config.device, config.repeats) if ctx.engines else None
    return _rows(config, ctx, wl, timed, ref_timed, pack, len(check))


def _label(backend: str, wl: Workload) -> str:
    return f"{backend} (B={len(wl)}, {wl.preset})"


def _time_loop(
    runner: Runner, wl: Workload, check: list[int], config: SweepConfig
) -> tuple[_Timed, dict[int, int]]:
    """A per-request loop (reference or vLLM) over ``check``: its answers, and
    its batch time, measured when ``check`` is the whole batch (at most 3
    runs: these loops are slow) and extrapolated from the sample otherwise."""
    t0 = time.perf_counter()
    answers = dict(zip(check, runner.hits(), strict=True))
    first = time.perf_counter() - t0
    b = len(wl)
    if len(check) < b:
        per_request = first / max(1, len(check))
        return _Timed(per_request * b, (), True), answers
    times = [first]
    if config.repeats > 1:
        times += time_calls(runner.run, min(config.repeats, 3) - 1, warmup=0).tolist()
    return _Timed(float(np.median(times)), tuple(times), False), answers


def _rows(
    config: SweepConfig,
    ctx: _PresetContext,
    wl: Workload,
    timed: dict[str, _Timed],
    ref: _Timed,
    pack_s: float | None,
    checked: int,
) -> list[ResultRow]:
    b = len(wl)
    vllm = timed.get(VLLM)
    rows = []
    for name, t in timed.items():
        engine = ctx.engines.get(name)
        rows.append(
            ResultRow(
                preset=wl.preset,
                batch_size=b,
                backend=backend_name(engine) if engine is not None else name,
                device=config.device if engine is not None else "cpu",
                median_s=t.median_s,
                times_s=t.times_s,
                lookups_per_s=b / t.median_s,
                estimated=t.estimated,
                speedup_vs_reference=ref.median_s / t.median_s,
                reference_estimated=ref.estimated,
                speedup_vs_vllm=vllm.median_s / t.median_s if vllm else None,
                pack_s_per_request=pack_s / b
                if engine is not None and pack_s
                else None,
                parity_checked=checked,
            )
        )
    return rows


# ---------------------------------------------------------------------------
# KeyIndex probes
# ---------------------------------------------------------------------------


#: At most this many probes per ``KeyIndex.contains`` measurement: enough to
#: fill a GPU, few enough that a 4096-request DeepSeek batch (20 M pairs) does
#: not take minutes on a CPU.
MAX_PROBES = 1 << 22


def key_probe(
    workload: Workload, index: KeyIndex, device: str, max_probes: int = MAX_PROBES
) -> tuple[Callable[[], Any], int]:
    """A ``KeyIndex.contains`` call over the (prefix-cacheable group, batch
    hash) pairs, the probe set of a naive lookup (a realistic mix of hits and
    misses; every group over the batch's first ``max_probes // groups``
    hashes), and the number of probes.
    Building the probes is not timed."""
    import torch

    batch = workload.hash_batch(device)
    groups = torch.tensor(
        [g for g, grp in enumerate(workload.layout.groups) if grp.prefix_cacheable],
        dtype=torch.int64,
        device=device,
    )
    rows = batch.hashes[: max(1, max_probes // max(1, len(groups)))]
    gids = groups.repeat_interleave(len(rows))
    hashes = rows.repeat(len(groups), 1)

    def probe() -> Any:
        found = index.contains(gids, hashes)
        synchronize(device)
        return found

    return probe, int(gids.numel())


def probe_rate(workload: Workload, index: KeyIndex, repeats: int) -> ProbeRow:
    """Measures :func:`key_probe` (median of ``repeats``, at most 3)."""
    probe, n = key_probe(workload, index, str(index.device))
    hit_fraction = float(probe().float().mean()) if n else 0.0
    med = float(np.median(time_calls(probe, min(repeats, 3))))
    return ProbeRow(workload.preset, workload.hash_bytes, n, med, n / med, hit_fraction)


# ---------------------------------------------------------------------------
# First calls (compilation); tables and plots are kvhit.bench.report
# ---------------------------------------------------------------------------


def first_call_seconds(preset: str, backend: str, device: str, seed: int = 0) -> float:
    """Seconds of the first ``LookupEngine.lookup`` of this process on a small
    batch (16 requests): what a process pays once, e.g. numba loading its
    compiled kernels from the on-disk cache (or compiling them when it is
    cold). Building the workload and the index is not counted."""
    wl = generate(preset, TrafficConfig(num_requests=16, max_tokens=2048, seed=seed))
    runner = engine_runner(build_engine(wl, backend, device), wl)
    t0 = time.perf_counter()
    runner.run()
    return time.perf_counter() - t0


def fresh_process_first_call(
    preset: str, backend: str, device: str, timeout_s: float = 120.0
) -> float:
    """:func:`first_call_seconds` in a new Python process (so nothing compiled
    in this one helps it; numba's on-disk cache does)."""
    code = (
        "import sys; from kvhit.bench.harness import first_call_seconds as f; "
        "print(f(*sys.argv[1:4]))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, preset, backend, device],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"the fresh-process first call failed (exit {res.returncode}):\n{res.stderr}"
        )
    return float(res.stdout.strip().splitlines()[-1])
