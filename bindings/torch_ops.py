"""kvhit as torch custom ops: key probes and batched lookups inside compiled code.

Importing this module registers two operators in the ``kvhit`` namespace
(``torch.library.custom_op``, with fake implementations for tracing)::

    kvhit::probe(Tensor table, Tensor group_ids, Tensor hashes) -> Tensor
    kvhit::lookup(Tensor hashes, Tensor offsets, Tensor num_tokens,
                  Tensor table, int hash_bytes, str layout_key) -> Tensor

Both are functional (they mutate no input and return a fresh tensor), so
``torch.compile`` (``fullgraph=True``) treats them as opaque nodes with known
output shapes, and they run under any backend (``aot_eager``, ``inductor``).

* ``probe``: membership of keys in a :class:`KeyIndex` table, bool ``[N]``.
  The kernel family is the one ``backend="auto"`` picks for the table's
  device (:func:`~kvhit.coordinator.backend.auto_backend`): Triton on CUDA,
  numba on the CPU, torch elsewhere. The CUDA path has no host
  synchronisation, so it can be captured in a CUDA graph.
* ``lookup``: :meth:`LookupEngine.lookup` (the store worker's rule), int64
  ``[B]``. Custom ops take only tensors and primitives, so the layout travels
  as a string key naming an engine registered beforehand with
  :func:`register_layout`. With a Triton engine the op runs the worker rule in
  one kernel launch with no host sync, so it can be captured in a CUDA graph;
  with the numba backend (the CPU default) or the torch backend it cannot:
  numba runs on host arrays, torch sizes its rounds with ``nonzero``/``.item()``.

The ops trust their inputs' values (a CSR ``offsets`` that really is one,
hashes with zero padding bits, a table honouring the KeyIndex contract):
validating values costs host syncs. Shapes, dtypes and devices are checked.
The Python wrappers :func:`probe` and :func:`lookup` take kvhit objects
(:class:`KeyIndex`, :class:`HashBatch`, :class:`LookupEngine`) and do the full
validation once, outside the op.

A rehash (``KeyIndex.add`` growing the table) replaces ``index.table``: code
that captured the old tensor (a CUDA graph, a compiled graph's guard on the
tensor) must read ``index.table`` again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvhit.coordinator.backend import auto_backend
from kvhit.coordinator.engine import LookupEngine
from kvhit.coordinator.key_index import KeyIndex, hash_kernels
from kvhit.coordinator.packing import HashBatch, num_words
from kvhit.coordinator.specs import CacheLayout
from kvhit.kernels.checks import check_tensor

__all__ = [
    "layout_engine",
    "lookup",
    "probe",
    "register_layout",
    "registered_layouts",
    "unregister_layout",
]


# --------------------------------------------------------------------------
# Layout registry: the string a lookup op carries -> LookupEngines.
# --------------------------------------------------------------------------


@dataclass
class _Entry:
    layout: CacheLayout
    # The backend asked for ("auto", "torch", "triton", "reference"); engines
    # for new devices are built with it.
    backend: str
    engines: dict[torch.device, LookupEngine] = field(default_factory=dict)


_REGISTRY: dict[str, _Entry] = {}
# Ops may run from several threads (a scheduler thread and a compile worker).
_LOCK = threading.Lock()


def _canonical(layout: CacheLayout) -> bytes:
    """The layout as bytes equal across processes: every field of every group
    and spec, by name, as JSON. Spec tags must be None, str, int or bool (a
    ``repr`` of another object may hold its address, which changes between
    processes).

    Raises:
        ValueError: naming the group whose spec tag is of another type.
    """
    groups = []
    for gid, group in enumerate(layout.groups):
        spec = group.spec
        tag = spec.tag
        if tag is not None and not isinstance(tag, str | int):
            label = f"group {gid}" + (f" ({group.name!r})" if group.name else "")
            raise ValueError(
                f"{label}: spec tag {type(tag).__name__} has no stable key across "
                "processes; use a str, int or None tag, or pass key= to "
                "register_layout"
            )
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        groups.append(
            {
                "spec": type(spec).__name__,
                **fields,
                "tag": [type(tag).__name__, tag],
                "eagle": group.eagle,
                "prefix_cacheable": group.prefix_cacheable,
                "name": group.name,
            }
        )
    doc = {
        "groups": groups,
        "scheduler_block_size": layout.scheduler_block_size,
        "hash_block_size": layout.hash_block_size,
        "use_eagle": layout.use_eagle,
        "retention_interval": layout.retention_interval,
        "partial_hash_hits": layout.partial_hash_hits,
    }
    return json.dumps(doc, sort_keys=True).encode()


def _default_key(layout: CacheLayout, backend: str) -> str:
    # Deterministic across processes (a canonical serialisation, never id()
    # or an object's repr), so a compiled graph that baked the key in finds
    # the same layout after a restart that registered it again.
    digest = hashlib.sha256(_canonical(layout)).hexdigest()[:16]
    return f"layout-{digest}" if backend == "auto" else f"layout-{digest}-{backend}"


def register_layout(
    layout: CacheLayout | LookupEngine,
    key: str | None = None,
    *,
    backend: str | None = None,
) -> str:
    """Make a layout callable by ``kvhit::lookup``; returns its key.

    Args:
        layout: a :class:`CacheLayout`, or a :class:`LookupEngine` (then that
            very engine serves lookups on its device, and its backend is used
            for engines built for other devices).
        key: the name to register under; by default one derived from the
            layout (and the backend, unless "auto"), equal across processes.
        backend: the LookupEngine backend; default ``"auto"`` for a layout,
            the engine's own for an engine.

    Registering an equal layout with an equal backend under the same key again
    is a no-op (an engine passed then replaces the one for its device).

    Raises:
        TypeError: ``layout`` is neither a CacheLayout nor a LookupEngine.
        ValueError: ``key`` is taken by a different layout or backend; or,
            without ``key``, a spec tag is not None, str, int or bool (no
            stable default key; the error names the group).
    """
    engine: LookupEngine | None = None
    if isinstance(layout, LookupEngine):
        engine = layout
        layout = engine.layout
        if backend is None:
            backend = engine.backend
        elif backend not in ("auto", engine.backend):
            raise ValueError(
                f"backend={backend!r} differs from the engine's ({engine.backend!r})"
            )
    elif not isinstance(layout, CacheLayout):
        raise TypeError(
            f"layout must be a CacheLayout or a LookupEngine, got "
            f"{type(layout).__name__}"
        )
    backend = "auto" if backend is None else backend
    if key is None:
        key = _default_key(layout, backend)
    elif not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty str, got {key!r}")
    with _LOCK:
        entry = _REGISTRY.get(key)
        if entry is None:
            entry = _Entry(layout, backend)
            _REGISTRY[key] = entry
        elif entry.layout != layout or entry.backend != backend:
            raise ValueError(
                f"layout key {key!r} is already registered for another layout or "
                f"backend ({entry.backend!r})"
            )
        if engine is not None:
            entry.engines[engine.device] = engine
    return key


def unregister_layout(key: str) -> None:
    """Forget ``key`` (a missing key is ignored)."""
    with _LOCK:
        _REGISTRY.pop(key, None)


def registered_layouts() -> dict[str, CacheLayout]:
    """The registered keys and their layouts (a copy)."""
    with _LOCK:
        return {k: e.layout for k, e in _REGISTRY.items()}


def layout_engine(key: str, device: torch.device | str) -> LookupEngine:
    """The engine serving ``key`` on ``device`` (built on first use).

    Raises:
        KeyError: ``key`` was not registered.
    """
    device = torch.device(device)
    with _LOCK:
        entry = _REGISTRY.get(key)
        if entry is None:
            raise KeyError(
                f"layout key {key!r} is not registered: call "
                "kvhit.bindings.torch_ops.register_layout(layout) first"
            )
        engine = entry.engines.get(device)
        if engine is None:
            engine = LookupEngine(entry.layout, backend=entry.backend, device=device)
            entry.engines[device] = engine
        return engine


# --------------------------------------------------------------------------
# Argument checks inside the ops (no host syncs: metadata only).
# --------------------------------------------------------------------------


def _check_tensor(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    # Fake implementations run these checks too, on tensors without data.
    check_tensor(
        t, name, dim=dim, device=device, device_of="the table", holds_data=False
    )


def _check_probe(table: torch.Tensor, group_ids: torch.Tensor, hashes: torch.Tensor):
    dev = table.device
    _check_tensor("table", table, 2, dev)
    _check_tensor("group_ids", group_ids, 1, dev)
    _check_tensor("hashes", hashes, 2, dev)
    W = hashes.shape[1]
    if table.shape[1] != W + 1:
        raise ValueError(
            f"table must have shape [capacity, {W + 1}] for hashes of {W} words, "
            f"got {list(table.shape)}"
        )
    if group_ids.shape[0] != hashes.shape[0]:
        raise ValueError(
            f"group_ids has {group_ids.shape[0]} entries but hashes has "
            f"{hashes.shape[0]} rows"
        )


def _check_lookup(
    hashes: torch.Tensor,
    offsets: torch.Tensor,
    num_tokens: torch.Tensor,
    table: torch.Tensor,
    hash_bytes: int,
) -> None:
    dev = table.device
    _check_tensor("table", table, 2, dev)
    _check_tensor("hashes", hashes, 2, dev)
    _check_tensor("offsets", offsets, 1, dev)
    _check_tensor("num_tokens", num_tokens, 1, dev)
    W = num_words(hash_bytes)
    if hashes.shape[1] != W or table.shape[1] != W + 1:
        raise ValueError(
            f"hash_bytes={hash_bytes} needs hashes [total, {W}] and table "
            f"[capacity, {W + 1}], got {list(hashes.shape)} and {list(table.shape)}"
        )
    if offsets.shape[0] != num_tokens.shape[0] + 1:
        raise ValueError(
            f"offsets must have shape [B + 1] for num_tokens [B], got "
            f"{list(offsets.shape)} and {list(num_tokens.shape)}"
        )


# --------------------------------------------------------------------------
# kvhit::probe
# --------------------------------------------------------------------------


@torch.library.custom_op("kvhit::probe", mutates_args=())
def _probe_op(
    table: torch.Tensor, group_ids: torch.Tensor, hashes: torch.Tensor
) -> torch.Tensor:
    """Membership of keys: bool ``[N]``.

    table: int64 ``[capacity, W + 1]`` (a KeyIndex table); group_ids: int64
    ``[N]`` (>= 0); hashes: int64 ``[N, W]``; all on one device.
    """
    _check_probe(table, group_ids, hashes)
    W = hashes.shape[1]
    group_ids = group_ids.contiguous()
    hashes = hashes.contiguous()
    # The one "auto" rule (coordinator.backend.auto_backend) picks the kernel
    # family, as for a KeyIndex; its module is imported on first use.
    kernels = hash_kernels(auto_backend(table.device))
    return kernels.probe(table.contiguous(), W, group_ids, hashes)


@_probe_op.register_fake
def _probe_fake(
    table: torch.Tensor, group_ids: torch.Tensor, hashes: torch.Tensor
) -> torch.Tensor:
    _check_probe(table, group_ids, hashes)
    return group_ids.new_empty(group_ids.shape[0], dtype=torch.bool)


# --------------------------------------------------------------------------
# kvhit::lookup
# --------------------------------------------------------------------------


@torch.library.custom_op("kvhit::lookup", mutates_args=())
def _lookup_op(
    hashes: torch.Tensor,
    offsets: torch.Tensor,
    num_tokens: torch.Tensor,
    table: torch.Tensor,
    hash_bytes: int,
    layout_key: str,
) -> torch.Tensor:
    """Tokens of each prompt the store worker would load: int64 ``[B]``.

    hashes: int64 ``[total, W]``, offsets: int64 ``[B + 1]`` (a HashBatch);
    num_tokens: int64 ``[B]``; table: int64 ``[capacity, W + 1]`` (a KeyIndex
    table); hash_bytes: the hash width; layout_key: from
    :func:`register_layout`. Equal to ``LookupEngine.lookup``.
    """
    _check_lookup(hashes, offsets, num_tokens, table, hash_bytes)
    engine = layout_engine(layout_key, table.device)
    batch = HashBatch.from_trusted(
        hashes.contiguous(), offsets.contiguous(), hash_bytes
    )
    table = table.contiguous()
    # Read-only, metadata checks only: no host sync inside the op.
    view = KeyIndex.from_table(table, hash_bytes)
    if engine.backend == "triton":
        # No validation or host sync inside the op (capturable in a graph).
        return engine.lookup_unchecked(batch, num_tokens.contiguous(), view)
    out = engine.lookup(batch, num_tokens, view)
    # The op contract forbids returning an input (the engine never does, but
    # an alias would silently break functionalization).
    return out.clone() if out is num_tokens else out


@_lookup_op.register_fake
def _lookup_fake(*args: Any) -> torch.Tensor:
    # The op's arguments, in its schema's order (see _lookup_op), checked alike.
    hashes, offsets, num_tokens, table, hash_bytes, _ = args
    _check_lookup(hashes, offsets, num_tokens, table, hash_bytes)
    return num_tokens.new_empty(num_tokens.shape[0])


# --------------------------------------------------------------------------
# Python wrappers taking kvhit objects
# --------------------------------------------------------------------------


def probe(index: KeyIndex, group_ids: Any, hashes: Any) -> torch.Tensor:
    """``index.contains(group_ids, hashes)`` through ``kvhit::probe``.

    Arguments as :meth:`KeyIndex.contains` (validated the same way); returns
    bool ``[N]`` on the index's device.
    """
    if not isinstance(index, KeyIndex):
        raise TypeError(f"index must be a KeyIndex, got {type(index).__name__}")
    g, h = index.normalize_keys(group_ids, hashes)
    return torch.ops.kvhit.probe(index.table, g, h)


def lookup(
    engine_or_key: LookupEngine | CacheLayout | str,
    batch: HashBatch,
    num_tokens: torch.Tensor,
    index: KeyIndex,
) -> torch.Tensor:
    """``LookupEngine.lookup(batch, num_tokens, index)`` through ``kvhit::lookup``.

    Args:
        engine_or_key: a registered key, or a LookupEngine / CacheLayout
            (registered here under its default key).
        batch: ``B`` prompts' block hashes.
        num_tokens: int64 ``[B]``, on the batch's device.
        index: the store's keys, on the batch's device.

    Returns:
        int64 ``[B]``.
    """
    if isinstance(engine_or_key, str):
        key = engine_or_key
    else:
        key = register_layout(engine_or_key)
    if not isinstance(batch, HashBatch):
        raise TypeError(f"batch must be a HashBatch, got {type(batch).__name__}")
    if not isinstance(index, KeyIndex):
        raise TypeError(f"index must be a KeyIndex, got {type(index).__name__}")
    if not isinstance(num_tokens, torch.Tensor):
        raise TypeError(
            f"num_tokens must be an int64 tensor, got {type(num_tokens).__name__}"
        )
    if index.hash_bytes != batch.hash_bytes:
        raise ValueError(
            f"batch hash width ({batch.hash_bytes} bytes) differs from the "
            f"index's ({index.hash_bytes} bytes)"
        )
    if batch.device != index.device:
        raise ValueError(f"batch is on {batch.device}, the index on {index.device}")
    return torch.ops.kvhit.lookup(
        batch.hashes, batch.offsets, num_tokens, index.table, batch.hash_bytes, key
    )
