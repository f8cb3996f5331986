"""What a sweep prints and draws: the bench table and the peer table (through
tabulate, columns as wide as their widest cell), the time and count formats
every command shares, and the lookups/s plot. The measuring is
``bench/harness.py`` and ``bench/peer_steps.py``; nothing here times anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tabulate import tabulate

from kvhit.bench.names import PEER_BLOCK_SIZE, VLLM

if TYPE_CHECKING:  # pragma: no cover - only for annotations
    from kvhit.bench.harness import SweepResult
    from kvhit.bench.peer_steps import PeerRow

__all__ = [
    "fmt_count",
    "fmt_time",
    "format_peer_table",
    "format_rows",
    "format_table",
    "plot",
]


def format_rows(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """``title``, then one indented ``name  value`` line per row, the values
    aligned (the summary of ``kvhit demo`` and ``kvhit replay``)."""
    table = tabulate(rows, tablefmt="plain", disable_numparse=True)
    return f"{title}\n" + "".join(f"  {line}\n" for line in table.splitlines())


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
    head = [
        f"kvhit {__version__} bench  ({env.get('machine', '?')}; torch "
        f"{env.get('torch', '?')}, triton {env.get('triton', '?')}, numba "
        f"{env.get('numba', '?')} (NUMBA_NUM_THREADS {env.get('numba_threads', '?')}); "
        f"gpu {env.get('gpu', 'none')})",
        f"  dependent loads (bench/machine.py): {env.get('dependent_load_start', '?')} "
        f"at the start; {env.get('dependent_load_end', '?')} at the end",
    ]
    # A ratio to vLLM is marked when vLLM's own time is extrapolated.
    vllm_est = {
        (r.preset, r.batch_size)
        for r in result.rows
        if r.backend == VLLM and r.estimated
    }
    headers = ["preset", "B", "backend", "median", "lookups/s", "x ref"]
    headers += ["x vLLM"] if vllm else []
    headers += ["pack/req"]
    rows = []
    for r in result.rows:
        row = [
            r.preset,
            r.batch_size,
            r.backend,
            ("~" if r.estimated else "") + fmt_time(r.median_s),
            fmt_count(r.lookups_per_s),
            _ratio(r.speedup_vs_reference, r.reference_estimated),
        ]
        if vllm:
            row.append(_ratio(r.speedup_vs_vllm, (r.preset, r.batch_size) in vllm_est))
        row.append(fmt_time(r.pack_s_per_request) if r.pack_s_per_request else "-")
        rows.append(row)
    align = ("left", "right", "left", *["right"] * (len(headers) - 3))
    table = tabulate(
        rows, headers, tablefmt="simple", colalign=align, disable_numparse=True
    )
    lines = head + [f"  {line}" for line in table.splitlines()]
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


def format_peer_table(rows: Sequence[PeerRow]) -> str:
    """The peer rows as text (the issue's table layout)."""
    if not rows:
        return ""
    peer = rows[0].peer
    title = (
        f"kvhit vs {peer} on the conversation trace ({rows[0].requests} requests in "
        f"order, steps of B; FullAttention({PEER_BLOCK_SIZE}), 8-byte keys, one "
        "numba thread; kvhit includes from_ints packing; per request: median "
        "over steps, mean in brackets)"
    )
    headers = ["order", "host", "B", "kvhit/req", "(pack)", f"{peer}/req", "ratio",
               "store kvhit", f"store {peer}"]  # fmt: skip
    body = [
        [
            r.order,
            "quiet" if r.host_load == 0 else f"busy{r.host_load}",
            r.batch_size,
            f"{fmt_time(r.kvhit_lookup_s)} ({fmt_time(r.kvhit_mean_s)})",
            fmt_time(r.kvhit_pack_s),
            f"{fmt_time(r.peer_lookup_s)} ({fmt_time(r.peer_mean_s)})",
            f"{r.lookup_ratio:.1f}x",
            fmt_count(r.kvhit_store_bps) + " b/s",
            fmt_count(r.peer_store_bps) + " b/s",
        ]
        for r in rows
    ]
    table = tabulate(
        body, headers, tablefmt="simple", colalign=["right"] * 9, disable_numparse=True
    )
    lines = [title, *(f"  {line}" for line in table.splitlines())]
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
