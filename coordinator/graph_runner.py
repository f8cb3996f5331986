"""CUDA graphs for a scheduler's lookups: :class:`GraphRunner`.

A scheduler calls :meth:`LookupEngine.lookup` once per step with a batch whose
size changes from step to step. On CUDA an eager call pays the host path
(Python, Triton's launch binding) every step; a CUDA graph replays the kernel
for a fraction of that (issue 31: 39 us replayed against 116-257 us eager at
one request on an H200). A graph has fixed shapes and addresses, so the runner
captures one graph per *size bucket*:

* requests are rounded up to a power of two (at least ``min_requests``, at
  most ``max_requests``); the bucket's padding requests have no hashes and
  length 0, so their programs end at once;
* the hashes go into one static buffer whose capacity is a power of two (at
  most ``max_hashes``), grown (and every graph captured again) when a batch
  needs more; the kernel never reads the hash count, so it needs no bucket
  of its own.

Each call copies the batch into the static buffers (its hashes, offsets, hash
counts and lengths: a few device copies, no host sync) and replays its
bucket's graph; the answer is a copy of the graph's output (the next replay
overwrites it). A batch past ``max_requests`` or ``max_hashes`` runs eagerly
(``engine.lookup``). The graphs read the index's table where it was at
capture: a table that moved (a rehash or a resize) is seen on the next call
and every graph is captured again.

On a device without CUDA graphs (the CPU under ``TRITON_INTERPRET=1``) the
runner runs the same static-buffer path eagerly, so its logic is tested
without a GPU; the answers equal :meth:`LookupEngine.lookup` either way.

A scheduler needs three lines::

    engine = LookupEngine(layout, device="cuda")
    runner = GraphRunner(engine, index)
    hits = runner.lookup(batch, num_tokens)  # each step

This module imports no triton (the engine's backend does, on its first call).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.key_index import KeyIndex
from kvhit.coordinator.packing import HashBatch, RaggedView
from kvhit.kernels.checks import check_bool, check_int

__all__ = ["GraphConfig", "GraphRunner"]

# The static request buffer's rows: offsets, hash counts, lengths.
_OFF, _UNITS, _LENS = 0, 1, 2


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class GraphConfig:
    """The runner's buckets.

    Attributes:
        max_requests: the largest request bucket (a larger batch runs eagerly).
        max_hashes: the most hash rows the static buffer may hold.
        min_requests: the smallest request bucket (fewer graphs for tiny
            batches; padding requests cost next to nothing).
        use_graphs: capture CUDA graphs; None: where the engine's device is
            CUDA. False runs the static-buffer path eagerly.
    """

    max_requests: int = 4096
    max_hashes: int = 1 << 22
    min_requests: int = 1
    use_graphs: bool | None = None

    def __post_init__(self) -> None:
        check_int(self.max_requests, "max_requests", 1)
        check_int(self.max_hashes, "max_hashes", 1)
        check_int(self.min_requests, "min_requests", 1, self.max_requests)
        if self.use_graphs is not None:
            check_bool(self.use_graphs, "use_graphs")


@dataclass
class _Bucket:
    """One request bucket: its view of the static buffers, the graph (None
    when eager) and the graph's output, int64 ``[requests]``."""

    requests: int
    view: RaggedView
    lens: torch.Tensor
    graph: Any
    out: torch.Tensor | None


class GraphRunner:
    """:meth:`LookupEngine.lookup` replayed from CUDA graphs, one per size
    bucket (see the module docstring).

    Args:
        engine: a triton-backend engine.
        index: the store's keys, on the engine's device.
        config: the buckets (:class:`GraphConfig`).

    Raises:
        TypeError / ValueError: naming the argument: not an engine, an
            engine on another backend than triton, an index on another
            device, graphs asked for on a device without them.
    """

    def __init__(
        self,
        engine: LookupEngine,
        index: KeyIndex,
        config: GraphConfig | None = None,
    ) -> None:
        if not isinstance(engine, LookupEngine):
            raise TypeError(
                f"engine must be a LookupEngine, got {type(engine).__name__}"
            )
        if engine.backend != "triton":
            raise ValueError(
                f"engine must use the triton backend, got {engine.backend!r}"
            )
        if not isinstance(index, KeyIndex):
            raise TypeError(f"index must be a KeyIndex, got {type(index).__name__}")
        if index.device != engine.device:
            raise ValueError(
                f"index is on {index.device}, the engine on {engine.device}"
            )
        config = GraphConfig() if config is None else config
        if not isinstance(config, GraphConfig):
            raise TypeError(
                f"config must be a GraphConfig, got {type(config).__name__}"
            )
        graphs = config.use_graphs
        if graphs is None:
            graphs = engine.device.type == "cuda"
        elif graphs and engine.device.type != "cuda":
            raise ValueError(
                f"config.use_graphs: CUDA graphs need a CUDA device, the engine "
                f"is on {engine.device}"
            )
        self.engine = engine
        self.index = index
        self.config = config
        self.use_graphs = graphs
        self.device = engine.device
        self._impl = engine.impl
        self._words = index.hash_bytes // 8
        # Rows 16-byte aligned (an even width): Triton specialises on it, and
        # the warm-up call and the capture must see the same variant.
        width = config.max_requests + config.max_requests % 2
        self._req = torch.zeros(3, width, dtype=torch.int64, device=self.device)
        self._hashes = torch.zeros(
            0, self._words, dtype=torch.int64, device=self.device
        )
        self._buckets: dict[int, _Bucket] = {}
        self._table_key: tuple | None = None
        self._pool = None
        self._lock = threading.Lock()

    # -- buckets ------------------------------------------------------------------

    def bucket(self, requests: int) -> int:
        """The request bucket of a batch of ``requests`` (0 for an empty
        batch, -1 past ``max_requests``: run eagerly)."""
        if requests > self.config.max_requests:
            return -1
        return max(self.config.min_requests, _pow2(requests)) if requests else 0

    def _table_moved(self) -> bool:
        table = self.index.table
        key = (table.data_ptr(), tuple(table.shape))
        if key == self._table_key:
            return False
        self._table_key = key
        return True

    def _grow(self, rows: int) -> None:
        """The static hash buffer with room for ``rows`` rows (a power of
        two); every graph read the old one, so all are dropped."""
        cap = _pow2(rows)
        self._hashes = torch.zeros(cap, self._words, dtype=torch.int64,
                                   device=self.device)  # fmt: skip
        self._buckets.clear()

    def _build(self, requests: int) -> _Bucket:
        """The bucket of ``requests`` requests, its graph captured."""
        req = self._req
        view = RaggedView(
            rows=self._hashes,
            offsets=req[_OFF, :requests],
            lengths=req[_UNITS, :requests],
        )
        lens = req[_LENS, :requests]
        bucket = _Bucket(requests, view, lens, None, None)
        if not self.use_graphs:
            return bucket
        index = self.index
        impl = self._impl
        # A warm-up call outside the capture compiles and loads the kernel,
        # on a side stream as torch.cuda.graphs asks.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            impl.lookup(view, lens, index)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = impl.lookup(view, lens, index)
        bucket.graph, bucket.out = graph, out
        return bucket

    # -- the call -------------------------------------------------------------------

    def lookup(self, batch: HashBatch, num_tokens: Any) -> torch.Tensor:
        """:meth:`LookupEngine.lookup` of ``batch`` (``B`` prompts) at
        ``num_tokens`` (``B`` lengths: an int64 tensor on the engine's
        device, or a list / tuple / numpy array of ints), from its bucket's
        graph: int64 ``[B]`` on the engine's device, equal to the eager
        call's. A negative length raises ValueError naming ``num_tokens``
        and the position, as the engine does.

        Raises:
            TypeError / ValueError: naming the argument: not a HashBatch, a
                batch on another device or of another hash width than the
                index, bad lengths.
        """
        if not isinstance(batch, HashBatch):
            raise TypeError(f"batch must be a HashBatch, got {type(batch).__name__}")
        if batch.device != self.device:
            raise ValueError(f"batch is on {batch.device}, the engine on {self.device}")
        if batch.hash_bytes != self.index.hash_bytes:
            raise ValueError(
                f"batch hash width ({batch.hash_bytes} bytes) differs from the "
                f"index's ({self.index.hash_bytes} bytes)"
            )
        n = len(batch)
        total = batch.total
        size = self.bucket(n)
        if size < 0 or total > self.config.max_hashes:
            return self.engine.lookup(batch, num_tokens, self.index)
        impl = self._impl
        lens = impl.lengths(num_tokens, "num_tokens", n)
        if not n:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        with self._lock:
            if self._table_moved():
                self._buckets.clear()
            if total > self._hashes.shape[0]:
                self._grow(total)
            bucket = self._buckets.get(size)
            req = self._req
            # The batch into the static buffers; the bucket's padding
            # requests get no hashes and length 0.
            offsets = batch.offsets
            if total:
                self._hashes[:total].copy_(batch.hashes)
            req[_OFF, :n].copy_(offsets[:-1])
            torch.sub(offsets[1:], offsets[:-1], out=req[_UNITS, :n])
            req[_LENS, :n].copy_(lens[0])
            if size > n:
                req[:, n:size].zero_()
            if bucket is None:
                bucket = self._buckets[size] = self._build(size)
            if bucket.graph is not None:
                bucket.graph.replay()
                out = bucket.out
            else:
                out = impl.lookup(bucket.view, bucket.lens, self.index)
            hit = out[:n].clone()
        impl.check_answer(hit, lens)
        return hit
