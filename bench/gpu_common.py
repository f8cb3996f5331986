"""What the GPU checks (``bench/gpu_check.py``, ``bench/gpu_check_fleet.py``)
share, and the GPU tests with them: their command-line overrides, timing and
CUDA-graph capture.

torch is imported inside the functions: the checks' ``--help`` and
``--env-line`` run before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

__all__ = ["capture_graph", "config_changes", "run_seconds"]


def config_changes(args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """The ``Config`` fields a check's command line sets: ``--presets``
    (comma-separated) as a tuple, and each argument named in ``fields``
    (argument -> field) that was given (not None, not 0)."""
    changes: dict[str, Any] = {}
    if args.presets:
        changes["presets"] = tuple(p for p in args.presets.split(",") if p)
    for arg, name in fields.items():
        if getattr(args, arg):
            changes[name] = getattr(args, arg)
    return changes


def run_seconds(fn: Callable[[], Any], device: Any) -> float:
    """Seconds one call of ``fn()`` takes: CUDA events around it on a CUDA
    ``device`` (a ``torch.device``; the kernels' time, the launch included),
    the wall clock elsewhere."""
    if device.type == "cuda":
        import torch

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def capture_graph(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn`` (already warm) captured in a CUDA graph: ``(graph, out)``, where
    ``out`` is what the captured call returned, refreshed by each
    ``graph.replay()``. One call runs first on a side stream, as
    ``torch.cuda.graph`` requires; the graph is replayed once and synchronized
    before it is returned."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out
