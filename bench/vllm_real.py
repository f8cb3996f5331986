"""Loading vLLM 0.33.0's real code for the oracle (``bench/vllm_oracle.py``),
and turning a kvhit layout into vLLM's ``KVCacheGroupSpec`` objects.

Nothing here imports vLLM at import time: :func:`load_vllm` does, once.

Installing: ``.ci/install-vllm-oracle`` extracts vLLM's Python sources (no
compiled ``vllm/_C*.so`` is needed) and the third-party modules its import
chain touches into ``<venv>/kvhit-vllm-oracle`` (or ``$KVHIT_VLLM_ORACLE_DIR``).
:func:`load_vllm` puts that folder on ``sys.path`` only while it imports vLLM,
then removes the folder and every module imported from it from ``sys.path`` /
``sys.modules`` again (the oracle keeps its references), so ``import vllm``
elsewhere in the process behaves as if the oracle were not there. A vLLM 0.33.0
that is normally importable (a full install) is used as is.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import time
import types
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
ORACLE_DIR_ENV = "KVHIT_VLLM_ORACLE_DIR"
INSTALL_HINT = "run .ci/install-vllm-oracle"

_COORD_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator"
_WORKER_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"
_IFACE_MOD = "vllm.v1.kv_cache_interface"


# ---------------------------------------------------------------------------
# Loading vLLM
# ---------------------------------------------------------------------------


@dataclass
class VllmModules:
    """What the oracle uses from vLLM."""

    version: str
    origin: str
    import_seconds: float
    coordinator: types.ModuleType
    worker: types.ModuleType
    kv_cache_interface: types.ModuleType
    MooncakeStoreCoordinator: type
    ExternalCachedBlockPool: type
    MooncakeStoreWorker: type
    KVCacheGroupSpec: type
    FullAttentionSpec: type
    SlidingWindowSpec: type
    MambaSpec: type
    ChunkedLocalAttentionSpec: type
    torch: types.ModuleType


_LOADED: tuple[VllmModules | None, str] | None = None
# Modules the oracle took off sys.modules after importing them from its folder;
# vllm_importable() puts them back, so one process holds one copy of vLLM.
_STASH: dict[str, types.ModuleType] = {}


def oracle_dir() -> Path:
    """Where ``.ci/install-vllm-oracle`` puts vLLM's sources and deps."""
    env = os.environ.get(ORACLE_DIR_ENV)
    if env:
        return Path(env)
    return Path(sys.prefix) / "kvhit-vllm-oracle"


def load_vllm() -> tuple[VllmModules | None, str]:
    """Import vLLM 0.33.0's coordinator, worker and spec classes.

    Returns ``(modules, "")`` or ``(None, reason)``. Cached: vLLM's import chain
    takes ~10 s, paid once per process.
    """
    global _LOADED
    if _LOADED is None:
        try:
            _LOADED = _load()
        except Exception as exc:  # pragma: no cover - depends on the machine
            _LOADED = (None, f"importing vLLM failed: {type(exc).__name__}: {exc}")
    return _LOADED


def _installed_vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return None


def _load() -> tuple[VllmModules | None, str]:
    t0 = time.perf_counter()
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        # A normal vLLM installation: use it as it is.
        ver = _installed_vllm_version()
        if ver is not None and not ver.startswith(VLLM_VERSION):
            return None, f"vLLM {ver} is installed; the oracle needs {VLLM_VERSION}"
        mods = _import_all()
        _ensure_registered(mods)
        return _finish(mods, "installed vllm", t0), ""

    root = oracle_dir()
    src, deps = root / "src", root / "deps"
    if not (src / "vllm" / "__init__.py").is_file():
        return None, (
            f"vLLM {VLLM_VERSION} oracle is not installed (no {src}/vllm); "
            f"{INSTALL_HINT}"
        )
    import torch  # noqa: F401  - the venv's torch, imported before vLLM's path

    saved_path = list(sys.path)
    saved_env = dict(os.environ)
    before = set(sys.modules)
    sys.path.insert(0, str(src))
    if deps.is_dir():
        sys.path.append(str(deps))  # the venv's packages win
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    importlib.invalidate_caches()
    try:
        mods = _import_all()
        # The spec -> manager registry fills itself lazily (and imports more of
        # vLLM when it does): do it now, while vLLM is importable.
        _ensure_registered(mods)
    finally:
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        prefixes = (str(src), str(deps))
        doomed = []
        for name in set(sys.modules) - before:
            if name == "vllm" or name.startswith("vllm."):
                doomed.append(name)
                continue
            # Through __dict__: lazy modules (transformers) import on getattr.
            attrs = getattr(sys.modules.get(name), "__dict__", None) or {}
            where = [attrs.get("__file__") or ""]
            try:
                where += [str(p) for p in (attrs.get("__path__") or [])]
            except Exception:  # a namespace path whose parent is gone
                pass
            if any(w.startswith(prefixes) for w in where):
                doomed.append(name)
        for name in doomed:
            mod = sys.modules.pop(name, None)
            if mod is not None:
                _STASH[name] = mod
        importlib.invalidate_caches()
    return _finish(mods, str(root), t0), ""


def _in_process_model_inspection() -> None:
    """vLLM inspects a model's architecture in a subprocess (so that CUDA is
    never initialised in the engine); that subprocess could not import the
    oracle's vLLM. On a CPU the inspection is safe in process."""
    registry = importlib.import_module("vllm.model_executor.models.registry")
    registry._run_in_subprocess = lambda fn: fn()


@contextlib.contextmanager
def vllm_importable(
    keep: Sequence[str] = (
        "kvhit.bindings.vllm_connector",
        "kvhit.bindings.vllm_lookup_server",
        "kvhit.bindings.vllm_wire",
    ),
) -> Iterator[VllmModules]:
    """Make ``import vllm`` work inside the block (the oracle's copy), for
    tests that run vLLM's own Scheduler and connectors; afterwards
    ``sys.path``, the environment and ``sys.modules`` are as before. Modules
    imported inside (vLLM's, its dependencies', and the names in ``keep``,
    which import vLLM) are stashed and come back on the next entry.

    Raises:
        RuntimeError: the oracle is not installed (the reason).
    """
    mods = require_vllm()
    if mods.origin == "installed vllm":
        yield mods
        return
    root = oracle_dir()
    src, deps = root / "src", root / "deps"
    saved_path = list(sys.path)
    saved_env = dict(os.environ)
    before = set(sys.modules)
    for name, mod in _STASH.items():
        sys.modules.setdefault(name, mod)
    sys.path.insert(0, str(src))
    if deps.is_dir():
        sys.path.append(str(deps))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    importlib.invalidate_caches()
    try:
        _in_process_model_inspection()
        yield mods
    finally:
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        prefixes = (str(src), str(deps))
        for name in set(sys.modules) - before:
            mod = sys.modules[name]
            attrs = getattr(mod, "__dict__", None) or {}
            where = str(attrs.get("__file__") or "")
            if (
                name in _STASH
                or name == "vllm"
                or name.startswith("vllm.")
                or where.startswith(prefixes)
                or any(name == k or name.startswith(k + ".") for k in keep)
            ):
                _STASH[name] = sys.modules.pop(name)
        importlib.invalidate_caches()


def _import_all() -> dict[str, types.ModuleType]:
    return {
        "coordinator": importlib.import_module(_COORD_MOD),
        "worker": importlib.import_module(_WORKER_MOD),
        "iface": importlib.import_module(_IFACE_MOD),
        "registry": importlib.import_module("vllm.v1.kv_cache_spec_registry"),
        "vllm": importlib.import_module("vllm"),
    }


def _ensure_registered(mods: dict[str, types.ModuleType]) -> None:
    iface = mods["iface"]
    spec = iface.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=_torch().float16
    )
    assert mods["registry"].KVCacheSpecRegistry.get_manager_class(spec) is not None


def _torch() -> types.ModuleType:
    import torch

    return torch


def _finish(mods: dict[str, types.ModuleType], origin: str, t0: float) -> VllmModules:
    c, w, i = mods["coordinator"], mods["worker"], mods["iface"]
    version = getattr(mods["vllm"], "__version__", "?")
    return VllmModules(
        version=version,
        origin=origin,
        import_seconds=time.perf_counter() - t0,
        coordinator=c,
        worker=w,
        kv_cache_interface=i,
        MooncakeStoreCoordinator=c.MooncakeStoreCoordinator,
        ExternalCachedBlockPool=c.ExternalCachedBlockPool,
        MooncakeStoreWorker=w.MooncakeStoreWorker,
        KVCacheGroupSpec=i.KVCacheGroupSpec,
        FullAttentionSpec=i.FullAttentionSpec,
        SlidingWindowSpec=i.SlidingWindowSpec,
        MambaSpec=i.MambaSpec,
        ChunkedLocalAttentionSpec=i.ChunkedLocalAttentionSpec,
        torch=_torch(),
    )


def require_vllm() -> VllmModules:
    mods, reason = load_vllm()
    if mods is None:
        raise RuntimeError(reason)
    return mods


# ---------------------------------------------------------------------------
# kvhit layout -> vLLM KVCacheGroupSpecs
# ---------------------------------------------------------------------------

_SCRATCH_CLASSES: dict[type, type] = {}


def _scratch_class(base: type) -> type:
    """``base`` with ``prefix_cacheable`` False (vLLM's scratch groups, e.g.
    GLM-5.3-Flash's kpool tail). The registry walks the MRO, so the group keeps
    its spec's manager (and its store/lookup mask, which vLLM still computes
    for scratch groups); dataclass equality needs the same class, so a scratch
    spec never equals a normal one."""
    cls = _SCRATCH_CLASSES.get(base)
    if cls is None:
        cls = type(
            f"NonPrefixCacheable{base.__name__}",
            (base,),
            {
                "__module__": __name__,
                "prefix_cacheable": property(lambda self: False),
            },
        )
        _SCRATCH_CLASSES[base] = cls
    return cls


class _TagCodes:
    """Distinct tags -> distinct small ints (``None`` -> 0), so otherwise equal
    specs with different tags differ in a harmless field in vLLM too."""

    def __init__(self) -> None:
        self._codes: dict[Hashable, int] = {None: 0}

    def __call__(self, tag: Hashable) -> int:
        if tag not in self._codes:
            self._codes[tag] = len(self._codes)
        return self._codes[tag]


def vllm_spec(mods: VllmModules, spec: Any, prefix_cacheable: bool, tags: _TagCodes):
    """One kvhit spec as a vLLM ``KVCacheSpec``. The tag becomes the attention
    ``head_size`` (64 + code) or the Mamba state shape ``((1 + code,),)``."""
    kind = type(spec).__name__
    code = tags(getattr(spec, "tag", None))
    f16 = mods.torch.float16
    attn = dict(
        block_size=spec.block_size, num_kv_heads=1, head_size=64 + code, dtype=f16
    )
    if kind == "FullAttention":
        cls, kw = mods.FullAttentionSpec, attn
    elif kind == "SlidingWindow":
        cls = mods.SlidingWindowSpec
        kw = dict(
            attn,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0),
        )
    elif kind == "Mamba":
        cls = mods.MambaSpec
        kw = dict(
            block_size=spec.block_size,
            shapes=((1 + code,),),
            dtypes=(f16,),
            mamba_cache_mode="align",
        )
    elif kind == "ChunkedLocal":
        cls = mods.ChunkedLocalAttentionSpec
        kw = dict(attn, attention_chunk_size=spec.attention_chunk_size)
    else:
        raise TypeError(f"unknown kvhit spec class {kind}")
    if not prefix_cacheable:
        cls = _scratch_class(cls)
    return cls(**kw)


def vllm_groups(mods: VllmModules, layout: Any) -> list:
    tags = _TagCodes()
    return [
        mods.KVCacheGroupSpec(
            layer_names=[f"model.layers.{i}"],
            kv_cache_spec=vllm_spec(
                mods, g.spec, bool(getattr(g, "prefix_cacheable", True)), tags
            ),
            is_eagle_group=bool(getattr(g, "eagle", False)),
        )
        for i, g in enumerate(layout.groups)
    ]
