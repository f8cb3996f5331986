"""The one benchmark harness: ``kvhit bench``, ``kvhit demo`` and the
pytest-benchmark suites in ``bench/`` all measure through it.

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
* the parity check: every answer equal to the reference loop's on a sample
  (exact; :class:`MismatchError` otherwise);
* timing: medians (numpy) after a warm-up call;
* the sweep over presets x batch sizes x backends, giving one
  :class:`ResultRow` per measurement, written to JSON once and plotted;
* the peer column (``--peer dynamo``, :func:`peer_sweep`): Dynamo's KV-router
  indexer beside kvhit on the shipped conversation trace, answers asserted
  equal, lookup time per request and store throughput from one run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhit.bench.machine import memory_state
from kvhit.bench.names import (
    BACKENDS,
    DEFAULT_BATCH_SIZES,
    PEER_BLOCK_SIZE,
    PEER_ORDERS,
    REFERENCE,
    VLLM,
    MismatchError,
)
from kvhit.bench.peers import (
    DYNAMO,
    PEERS,
    DynamoIndex,
    as_u64,
    busy_host,
    load_dynamo,
)
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


@dataclass(frozen=True)
class Skip:
    """A backend left out of a run, and why."""

    backend: str
    reason: str


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
# Parity and timing
# ---------------------------------------------------------------------------


def parity_indices(batch_size: int, cap: int, sample: int, seed: int) -> list[int]:
    """Requests to check: all of them up to ``cap``, a random ``sample`` above."""
    if batch_size <= cap:
        return list(range(batch_size))
    rng = random.Random(seed)
    return sorted(rng.sample(range(batch_size), min(sample, batch_size)))


def check_parity(
    label: str,
    got: Sequence[int],
    want: Mapping[int, int],
    num_tokens: Sequence[int],
) -> None:
    """Raises :class:`MismatchError` naming the first few requests ``i`` with
    ``got[i] != want[i]``."""
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
    peer_order: tuple[str, ...] = ("separate",)

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
            rows_at, skip = peer_sweep(
                config.peer,
                config.batch_sizes,
                limit=config.peer_limit,
                quiet=quiet,
                host_load=load,
                order=order,
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
# The peer column: Dynamo's indexer beside kvhit on the shipped trace
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerRow:
    """kvhit and a peer on the trace replayed in steps of ``batch_size``.

    Attributes:
        peer: the peer's name (``"dynamo"``).
        batch_size: requests per step (the last step may be shorter).
        requests: requests replayed (each checked: ``mismatches`` is 0, or
            the sweep raised :class:`MismatchError`).
        kvhit_lookup_s: kvhit's seconds per request, the median over the
            steps of a step's time / its requests: ``HashBatch.from_ints``
            from Python int lists plus ``find_longest_cache_hit``.
        kvhit_pack_s: the ``from_ints`` part of it (median likewise).
        peer_lookup_s: the peer's seconds per request (one call each; median
            likewise).
        lookup_ratio: ``peer_lookup_s / kvhit_lookup_s``.
        kvhit_mean_s, peer_mean_s: the means (total time / requests).
        kvhit_store_bps, peer_store_bps: blocks stored per second (each
            request's blocks past its hit, as a worker emits them).
        blocks_stored: blocks each stored over the run.
        hit_blocks: blocks both found (equal by construction of the check).
        host_load: CPU-bound processes spinning beside the run
            (:func:`~kvhit.bench.peers.busy_host`; 0: a quiet host).
        order: ``"separate"`` (each index replayed in a pass of its own) or
            ``"alternate"`` (step by step, side by side); see
            :data:`PEER_ORDERS`.
    """

    peer: str
    batch_size: int
    requests: int
    kvhit_lookup_s: float
    kvhit_pack_s: float
    peer_lookup_s: float
    lookup_ratio: float
    kvhit_store_bps: float
    peer_store_bps: float
    blocks_stored: int
    hit_blocks: int
    kvhit_mean_s: float = 0.0
    peer_mean_s: float = 0.0
    mismatches: int = 0
    host_load: int = 0
    order: str = "separate"


def peer_sweep(
    peer: str,
    batch_sizes: Sequence[int],
    limit: int | None = None,
    quiet: bool = True,
    trace: str | os.PathLike[str] | None = None,
    host_load: int = 0,
    order: str = "separate",
) -> tuple[list[PeerRow], Skip | None]:
    """kvhit against ``peer`` on the conversation trace (or ``trace``).

    For each batch size ``B`` the trace is replayed in order in steps of
    ``B`` requests on a fresh store: each step is looked up against what
    earlier steps stored (kvhit: ``HashBatch.from_ints`` of the requests'
    Python int lists and ``LookupEngine.find_longest_cache_hit``, one numba
    thread, 8-byte keys; the peer: one call per request), the answers are
    compared (:class:`MismatchError` on any difference), then each request's
    blocks past its hit are stored in both (kvhit: one ``KeyIndex.add`` per
    step; the peer: one event per request, then a wait for its thread to apply
    them). Layout: one FullAttention group of :data:`PEER_BLOCK_SIZE` tokens.
    ``order`` (:data:`PEER_ORDERS`): ``"separate"`` replays kvhit, then the
    peer, each in a pass of its own; ``"alternate"`` interleaves them step by
    step. ``host_load`` CPU-bound processes spin during the run
    (:func:`~kvhit.bench.peers.busy_host`). Returns the rows, or
    ``([], Skip)`` when the peer cannot be imported.
    """
    import torch

    from kvhit.bench.traces import SHIPPED_TRACE, hash_block_ids, hash_words, load_trace
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch
    from kvhit.coordinator.specs import CacheLayout, FullAttention, Group

    if peer != DYNAMO:
        raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")
    if order not in PEER_ORDERS:
        raise ValueError(f"order must be one of {PEER_ORDERS}, got {order!r}")
    tree_cls, why = load_dynamo()
    if tree_cls is None:
        return [], Skip(peer, why)
    bs = PEER_BLOCK_SIZE
    layout = CacheLayout(
        groups=[Group(FullAttention(block_size=bs))],
        scheduler_block_size=bs,
        hash_block_size=bs,
    )
    requests = load_trace(trace or SHIPPED_TRACE, limit)
    words = [hash_words(*hash_block_ids(r, bs), 1)[:, 0] for r in requests]
    ints = [w.tolist() for w in words]  # what a caller holds: Python ints
    chains = [as_u64(w) for w in words]
    max_lengths = [len(c) * bs for c in ints]
    rows = []
    bar = _peer_bar(len(batch_sizes) * len(requests), quiet)
    with _numba_threads(1), busy_host(host_load):
        engine = LookupEngine(layout, backend="numba", device="cpu")
        for b in sorted(set(batch_sizes)):
            row = _peer_run(
                peer, b, engine, KeyIndex(8, 1 << 20), DynamoIndex(tree_cls),
                ints, chains, max_lengths, HashBatch, torch, bar, order,
            )  # fmt: skip
            rows.append(replace(row, host_load=host_load))
    if bar is not None:
        bar.close()
    return rows, None


def _peer_bar(total: int, quiet: bool) -> Any:
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="  peer", unit="req", leave=False)


class _numba_threads:
    """numba's thread count set for a block (restored after)."""

    def __init__(self, n: int) -> None:
        self.n, self.old = n, None

    def __enter__(self) -> None:
        import numba

        self.old = numba.get_num_threads()
        numba.set_num_threads(min(self.n, numba.config.NUMBA_NUM_THREADS))

    def __exit__(self, *exc: object) -> None:
        import numba

        numba.set_num_threads(self.old)


def _peer_run(peer, b, engine, index, tree, ints, chains, max_lengths, HashBatch,
              torch, bar, order) -> PeerRow:  # fmt: skip
    """One batch size of :func:`peer_sweep`: both replays, in ``order``.

    ``separate`` times each index on its own: the peer's work does not run
    inside kvhit's timed steps or the other way round. (Dynamo's
    ``RadixTree`` hands each call to its indexer thread and blocks until it
    answers; measured here, a kvhit step that starts right after such a call
    ran 2-3x slower than in its own pass, and ~0.2 ms of busy work in between
    undid most of that: the CPU's state after the hand-off, not kvhit's
    work.)
    ``alternate`` interleaves them step by step, each step looked up by kvhit,
    then by the peer, compared, then stored in both: what a host running the
    two side by side sees."""
    n = len(ints)
    # Warm-up, untimed: compiled kernels loaded, both paths exercised once.
    warm = HashBatch.from_ints([ints[0]])
    engine.find_longest_cache_hit(warm, [max_lengths[0]], index, apply_eagle=False)
    tree.find([chains[0]])
    steps = [(lo, min(n, lo + b)) for lo in range(0, n, b)]
    mine_at: list[list[int]] = []
    kv = _KvhitReplay(engine, index, ints, max_lengths, HashBatch, torch)
    them = _PeerReplay(peer, b, tree, chains)
    if order == "alternate":
        for lo, hi in steps:
            mine = kv.step(lo, hi)
            them.step(lo, hi, mine)
            if bar is not None:
                bar.update(hi - lo)
    else:
        for lo, hi in steps:
            mine_at.append(kv.step(lo, hi))
            if bar is not None:
                bar.update((hi - lo) // 2)
        for (lo, hi), mine in zip(steps, mine_at, strict=True):
            them.step(lo, hi, mine)
            if bar is not None:
                bar.update(hi - lo - (hi - lo) // 2)
    steps_len = [hi - lo for lo, hi in steps]
    look, peer_look = np.median(kv.look), np.median(them.look)
    return PeerRow(
        peer=peer,
        batch_size=b,
        requests=n,
        kvhit_lookup_s=float(look),
        kvhit_pack_s=float(np.median(kv.pack)),
        peer_lookup_s=float(peer_look),
        lookup_ratio=float(peer_look / max(look, 1e-12)),
        kvhit_store_bps=kv.stored / max(kv.t_store, 1e-12),
        peer_store_bps=kv.stored / max(them.t_store, 1e-12),
        blocks_stored=kv.stored,
        hit_blocks=kv.hit_blocks,
        kvhit_mean_s=float(np.dot(kv.look, steps_len)) / n,
        peer_mean_s=float(np.dot(them.look, steps_len)) / n,
        order=order,
    )


class _KvhitReplay:
    """kvhit's side of :func:`_peer_run`, one step at a time: pack the step's
    Python int lists, look them up, store each request's blocks past its hit
    (a worker's new blocks). Per step, seconds per request: medians resist the
    load spikes of a shared machine better than totals."""

    def __init__(self, engine, index, ints, max_lengths, HashBatch, torch) -> None:
        self.engine, self.index, self.ints = engine, index, ints
        self.max_lengths, self.HashBatch, self.torch = max_lengths, HashBatch, torch
        self.look: list[float] = []
        self.pack: list[float] = []
        self.t_store = 0.0
        self.stored = self.hit_blocks = 0

    def step(self, lo: int, hi: int) -> list[int]:
        perf, torch = time.perf_counter, self.torch
        reqs, mls = self.ints[lo:hi], self.max_lengths[lo:hi]
        t0 = perf()
        batch = self.HashBatch.from_ints(reqs)
        t1 = perf()
        hits = self.engine.find_longest_cache_hit(
            batch, mls, self.index, apply_eagle=False
        )
        t2 = perf()
        self.pack.append((t1 - t0) / (hi - lo))
        self.look.append((t2 - t0) / (hi - lo))
        mine = (hits.hit_lengths // PEER_BLOCK_SIZE).tolist()
        self.hit_blocks += sum(mine)
        t0 = perf()
        rows, offs, lens = batch.host_arrays()
        take = peer_rows_past(offs, lens, np.array(mine, dtype=np.int64))
        if take.size:
            self.index.add(
                torch.zeros(take.size, dtype=torch.int64),
                torch.from_numpy(rows[take]),
            )
        self.t_store += perf() - t0
        self.stored += int(take.size)
        return mine


class _PeerReplay:
    """The peer's side of :func:`_peer_run`: one call per request, its answers
    checked against kvhit's for the same step (:class:`MismatchError`), then
    one stored event per request. Its store time includes the wait for its
    indexer thread to apply the step's events (a lookup of one block after
    them), since ``apply_event`` returns before the event is applied: without
    the wait, that work would land in the next step's lookup."""

    def __init__(self, peer: str, b: int, tree: DynamoIndex, chains) -> None:
        self.peer, self.b, self.tree, self.chains = peer, b, tree, chains
        self.look: list[float] = []
        self.t_store = 0.0

    def step(self, lo: int, hi: int, mine: list[int]) -> None:
        perf, tree, chs = time.perf_counter, self.tree, self.chains[lo:hi]
        t0 = perf()
        theirs = tree.find(chs)
        self.look.append((perf() - t0) / (hi - lo))
        if mine != theirs:
            bad = [i for i in range(hi - lo) if mine[i] != theirs[i]][:5]
            raise MismatchError(
                f"{self.peer} disagrees with kvhit at B={self.b}: "
                + ", ".join(
                    f"request {lo + i}: {self.peer}={theirs[i]} kvhit={mine[i]} blocks"
                    for i in bad
                )
            )
        t0 = perf()
        for ch, m in zip(chs, mine, strict=True):
            if m < len(ch):
                tree.store_after(ch[m - 1] if m else None, ch[m:])
        tree.sync()
        self.t_store += perf() - t0


def peer_rows_past(
    starts: np.ndarray, lengths: np.ndarray, skip: np.ndarray
) -> np.ndarray:
    """Rows ``starts[i] + skip[i] .. starts[i] + lengths[i] - 1`` of every
    request ``i``, concatenated (int64), without a Python loop."""
    counts = np.maximum(lengths - skip, 0)
    total = int(counts.sum())
    first = starts + skip
    # Each run's first row, minus where the run starts in the output.
    base = np.repeat(first - (np.cumsum(counts) - counts), counts)
    return base + np.arange(total, dtype=np.int64)


def format_peer_table(rows: Sequence[PeerRow]) -> str:
    """The peer rows as text (the issue's table layout)."""
    if not rows:
        return ""
    peer = rows[0].peer
    lines = [
        f"kvhit vs {peer} on the conversation trace ({rows[0].requests} requests in "
        f"order, steps of B; FullAttention({PEER_BLOCK_SIZE}), 8-byte keys, one "
        "numba thread; kvhit includes from_ints packing; per request: median "
        "over steps, mean in brackets)",
        f"  {'order':>9} {'host':>6} {'B':>5} {'kvhit/req':>20} {'(pack)':>9} "
        f"{peer + '/req':>21} {'ratio':>7} {'store kvhit':>12} "
        f"{'store ' + peer:>13}",
    ]
    for r in rows:
        kv = f"{fmt_time(r.kvhit_lookup_s)} ({fmt_time(r.kvhit_mean_s)})"
        them = f"{fmt_time(r.peer_lookup_s)} ({fmt_time(r.peer_mean_s)})"
        host = "quiet" if r.host_load == 0 else f"busy{r.host_load}"
        lines.append(
            f"  {r.order:>9} {host:>6} {r.batch_size:>5} {kv:>20} "
            f"{fmt_time(r.kvhit_pack_s):>9} "
            f"{them:>21} {r.lookup_ratio:>6.1f}x "
            f"{fmt_count(r.kvhit_store_bps) + ' b/s':>12} "
            f"{fmt_count(r.peer_store_bps) + ' b/s':>13}"
        )
    lines.append(
        f"  answers: {peer} == kvhit on every request at every B (0 mismatches; "
        f"{rows[0].hit_blocks} blocks hit at B={rows[0].batch_size})"
    )
    lines.append(
        "  order: separate = kvhit's replay, then the peer's, each a pass of its "
        "own; alternate = step by step, side by side (--peer-order)"
    )
    if any(r.host_load for r in rows):
        lines.append(
            "  host: quiet = nothing else started; busyN = N CPU-bound processes "
            "spinning beside the run (--peer-host-load)"
        )
    return "\n".join(lines) + "\n"


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
# First calls (compilation) and reports
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


def fmt_time(seconds: float) -> str:
    """``12.3 us``, ``4.56 ms`` or ``1.23 s``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_count(x: float) -> str:
    """``1.23k``, ``4.56M``, ..."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f}{suffix}"
    return f"{x:.0f}"


def _ratio(x: float | None, estimated: bool) -> str:
    if x is None:
        return "-"
    return ("~" if estimated else "") + (f"{x:.1f}x" if x < 100 else f"{x:.0f}x")


def format_table(result: SweepResult) -> str:
    """The sweep as a text table, one line per row, grouped by (preset, B)."""
    from kvhit import __version__

    env = result.environment
    vllm = any(r.speedup_vs_vllm is not None for r in result.rows)
    lines = [
        f"kvhit {__version__} bench  ({env.get('machine', '?')}; torch "
        f"{env.get('torch', '?')}, triton {env.get('triton', '?')}, numba "
        f"{env.get('numba', '?')} (NUMBA_NUM_THREADS {env.get('numba_threads', '?')}); "
        f"gpu {env.get('gpu', 'none')})",
        f"  dependent loads (bench/machine.py): {env.get('dependent_load_start', '?')} "
        f"at the start; {env.get('dependent_load_end', '?')} at the end",
        f"  {'preset':<11} {'B':>5}  {'backend':<9} {'median':>10} {'lookups/s':>9} "
        f"{'x ref':>7}" + (f" {'x vLLM':>7}" if vllm else "") + f" {'pack/req':>9}",
    ]
    # A ratio to vLLM is marked when vLLM's own time is extrapolated.
    vllm_est = {
        (r.preset, r.batch_size)
        for r in result.rows
        if r.backend == VLLM and r.estimated
    }
    for r in result.rows:
        t = ("~" if r.estimated else "") + fmt_time(r.median_s)
        pack = fmt_time(r.pack_s_per_request) if r.pack_s_per_request else "-"
        line = (
            f"  {r.preset:<11} {r.batch_size:>5}  {r.backend:<9} {t:>10} "
            f"{fmt_count(r.lookups_per_s):>9} "
            f"{_ratio(r.speedup_vs_reference, r.reference_estimated):>7}"
        )
        if vllm:
            est = (r.preset, r.batch_size) in vllm_est
            line += f" {_ratio(r.speedup_vs_vllm, est):>7}"
        lines.append(f"{line} {pack:>9}")
    if any(r.estimated or r.reference_estimated for r in result.rows):
        lines.append(
            "  ~ extrapolated: the loop's per-request time on this batch's parity "
            "sample x B"
        )
    lines.append(
        "  pack/req: HashBatch.from_bytes per request, not included in the median"
    )
    for s in result.skipped:
        lines.append(f"  skipped {s.backend}: {s.reason}")
    for p in result.probes:
        lines.append(
            f"  KeyIndex.contains ({p.preset}, {p.hash_bytes} B keys): "
            f"{fmt_count(p.probes)} probes in {fmt_time(p.median_s)} = "
            f"{fmt_count(p.probes_per_s)} probes/s ({p.hit_fraction:.0%} hits)"
        )
    return "\n".join(lines) + "\n"


def plot(result: SweepResult, path: str | os.PathLike[str]) -> None:
    """Lookups/s vs batch size, one panel per preset, one line per backend, as
    a PNG at ``path``. Needs matplotlib (``pip install 'kvhit[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    from kvhit import __version__

    rows = result.rows
    presets = list(dict.fromkeys(r.preset for r in rows))
    fig, axes = plt.subplots(
        1, len(presets), figsize=(4.5 * len(presets), 4), squeeze=False
    )
    for ax, preset in zip(axes[0], presets, strict=True):
        for backend in dict.fromkeys(r.backend for r in rows):
            pts = sorted(
                (r.batch_size, r.lookups_per_s)
                for r in rows
                if r.preset == preset and r.backend == backend
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
    env = result.environment
    fig.suptitle(f"kvhit {__version__}: {env.get('gpu') or env.get('machine', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
