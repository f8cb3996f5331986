"""What every Triton launcher of kvhit shares: the device guard, the features
the kernels need, and a fix for Triton 3.6's interpreter.

Triton 3.6.0 is the oldest Triton kvhit supports (``pyproject.toml``): it is
what the GPU machine this project is lent has installed, with no way to
upgrade it. :data:`FEATURES` names what the kernels use that an older Triton
may lack, :func:`missing_features` checks them (``bench/gpu_check.py`` stops
on a missing one), and ``.ci/device-twin`` compiles and runs every kernel
under 3.6.0 in CI.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FEATURES",
    "DirectLauncher",
    "device_guard",
    "fix_interpreter",
    "int_key",
    "missing_features",
    "stream_getter",
    "stream_getter_torch",
]

#: What the kernels need from Triton beyond its core, and where:
#: ``atomic_cas`` / ``atomic_xchg(sem=)`` the insert's claim and publish,
#: ``atomic_min(sem=)`` the erase, ``atomic_or(sem=)`` the acquire read of
#: ``find_slots(ACQUIRE=True)`` (Triton 3.6 has no ``atomic_load``),
#: ``debug_barrier`` the insert's words-before-group-id order,
#: ``static_range`` every unrolled word loop, and the ``maxnreg`` launch
#: option the scan kernel's register budget (``kernels/scan.py``).
FEATURES = (
    "atomic_cas",
    "atomic_xchg(sem)",
    "atomic_min(sem)",
    "atomic_or(sem)",
    "debug_barrier",
    "static_range",
    "maxnreg",
)


def _has_sem(fn: object) -> bool:
    try:
        return "sem" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _has_maxnreg() -> bool:
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return any(f.name == "maxnreg" for f in dataclasses.fields(CUDAOptions))


def feature_table() -> dict[str, bool]:
    """Each name of :data:`FEATURES` -> whether the installed Triton has it.
    Imports triton."""
    import triton.language as tl

    table = {}
    for name in FEATURES:
        if name == "maxnreg":
            table[name] = _has_maxnreg()
        elif name.endswith("(sem)"):
            fn = getattr(tl, name[: -len("(sem)")], None)
            table[name] = fn is not None and _has_sem(fn)
        else:
            table[name] = hasattr(tl, name)
    return table


def missing_features() -> list[str]:
    """The names of :data:`FEATURES` the installed Triton lacks (empty when it
    can build every kvhit kernel)."""
    return [name for name, ok in feature_table().items() if not ok]


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current device of its kind while a kernel launches.

    Triton launches on the current device's current stream, not on the
    device of its tensor arguments: a table on ``cuda:1`` launched while
    ``cuda:0`` is current would be read through device 0's context (illegal
    addresses). A no-op for the CPU (the interpreter) and for a device
    without an index; device-agnostic (``torch.get_device_module``).
    """
    if device.type == "cpu" or device.index is None:
        return contextlib.nullcontext()
    return torch.get_device_module(device.type).device(device.index)


def _version(v: str) -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", v)[:2])
    return major, minor


def interpreting() -> bool:
    """Whether Triton runs under its interpreter (``TRITON_INTERPRET=1``:
    kernels run on the CPU, CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_interpreter_fixed = False


def fix_interpreter() -> None:
    """Let Triton 3.6's interpreter run ``for i in range(n)`` over a runtime
    scalar ``n``; a no-op unless ``TRITON_INTERPRET=1`` and Triton < 3.8.

    The 3.6 interpreter holds every scalar as a one-element 1-d numpy array
    and converts it for ``range`` with ``int(array)``, which numpy 2 refuses
    (``TypeError: only 0-dimensional arrays can be converted to Python
    scalars``); 3.8 squeezes first. The scan kernel loops over SpecGroups,
    members and groups with such ranges, compiled fine by every Triton, so
    the fix belongs to the interpreter: its per-launch patch of
    ``tl.tensor`` is wrapped to convert with ``.item()`` instead. Idempotent.
    """
    global _interpreter_fixed
    if _interpreter_fixed or not interpreting():
        return
    import triton
    from triton.runtime import interpreter

    _interpreter_fixed = True
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or _version(triton.__version__) >= (3, 8):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


def int_key(values: tuple[int, ...]) -> tuple[tuple[bool, bool, bool], ...]:
    """What Triton's binder specialises a kernel's plain int arguments on,
    per value: equal to 1 (a constexpr), divisible by 16, and 64 bits wide.
    Part of a :class:`DirectLauncher` key for a kernel that does not list
    them in ``do_not_specialize``."""
    return tuple((v == 1, v % 16 == 0, not -(2**31) <= v < 2**31) for v in values)


def stream_getter_torch(index: int) -> int:
    """The raw handle of CUDA device ``index``'s current stream, through
    torch's public API."""
    return torch.cuda.current_stream(index).cuda_stream


def _knobs() -> object:
    """``triton.knobs`` (Triton >= 3.4; ImportError before)."""
    from triton import knobs

    return knobs


class DirectLauncher:
    """Launch a ``@triton.jit`` kernel's compiled variants without Triton's
    per-call Python binding (issue 31: ~25 us a call on Triton 3.6).

    The first call of a variant goes through ``kernel[grid](...)``, which
    compiles or loads it and returns the ``CompiledKernel``; later calls of
    the same variant call its launcher directly, as ``JITFunction.run`` does
    after its binder: ``compiled.run(grid, stream, function, metadata, ...,
    *every argument in signature order)`` (Triton 3.6 to 3.9). The variant
    key is the caller's (its constexprs and argument types) plus the 16-byte
    alignment of every tensor argument, which Triton specialises on.

    Launch hooks (``triton.knobs.runtime.launch_enter_hook``, a profiler's)
    are called as the binder path calls them. The binder path is kept: under
    the interpreter, when ``KVHIT_TRITON_DIRECT=0``, and for good once a
    direct launch raises TypeError or AttributeError (a Triton whose
    launcher takes other arguments: the error comes before anything is
    launched).

    One launcher per kernel; the kernel itself is passed on every call (read
    where it is defined, so a test's wrapper of it is seen).
    """

    def __init__(self) -> None:
        self.enabled = (
            not interpreting() and os.environ.get("KVHIT_TRITON_DIRECT", "1") != "0"
        )
        self._compiled: dict[tuple, object] = {}
        self.direct_launches = 0
        # Read when the first variant is compiled (triton imported by then).
        self._hooks: Any = None
        self._get_stream: Callable[[int], int] = stream_getter_torch

    def launch(
        self,
        kernel: object,
        grid: int | tuple[int, ...],
        key: tuple,
        args: tuple,
        constexprs: dict,
        options: dict,
        device: torch.device,
    ) -> None:
        """``kernel[grid](*args, **constexprs, **options)`` on ``device``'s
        current stream (``grid``: an int, the programs of a 1-D grid, or a
        tuple of up to 3). ``args``: the runtime arguments in signature
        order, then ``constexprs`` in signature order (the kernel's last
        parameters); ``key``: what else the variant depends on (every
        specialised int's class: see :func:`int_key`)."""
        grid = (grid,) if type(grid) is int else tuple(grid)
        if self.enabled:
            tensor = torch.Tensor
            align = tuple([a.data_ptr() % 16 == 0 for a in args
                           if isinstance(a, tensor)])  # fmt: skip
            full = (device.index, key, align)
            compiled = self._compiled.get(full)
            if compiled is not None and self.run(
                compiled, grid, (*args, *constexprs.values()), device
            ):
                return
        compiled = kernel[grid](*args, **constexprs, **options)
        if self.enabled and all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")
        ):
            if self._hooks is None:
                self._hooks = _knobs().runtime
                self._get_stream = stream_getter()
            self._compiled[full] = compiled

    def compiled(self, device: torch.device, key: tuple, args: tuple) -> Any:
        """The compiled variant a :meth:`launch` of ``key`` with ``args`` on
        ``device`` launches directly, for a caller that keeps it and calls
        :meth:`run` itself (the scan's ``LookupLaunch``); None while direct
        launches are off or before the variant's first launch."""
        if not self.enabled:
            return None
        align = tuple([a.data_ptr() % 16 == 0 for a in args
                       if isinstance(a, torch.Tensor)])  # fmt: skip
        return self._compiled.get((device.index, key, align))

    def run(self, compiled: Any, grid: tuple[int, ...], every: tuple,
            device: torch.device) -> bool:  # fmt: skip
        """Launch ``compiled`` (from :meth:`compiled`, or cached here) on
        ``device``'s current stream, past the binder: ``grid`` a tuple of up
        to 3, ``every`` the runtime arguments then the constexprs, in
        signature order. False, launching nothing, when the launcher refuses
        the arguments (TypeError, AttributeError: another Triton's launcher):
        direct launches are then off for good and the caller goes through
        :meth:`launch`."""
        try:
            stream = self._stream(device)
            # What JITFunction.run does once its binder is done, launch
            # hooks (a profiler's) included.
            hooks = self._hooks
            meta = compiled.launch_metadata(grid, stream, *every)
            g0, g1, g2 = (*grid, 1, 1)[:3]
            compiled.run(g0, g1, g2, stream, compiled.function,
                         compiled.packed_metadata, meta,
                         hooks.launch_enter_hook, hooks.launch_exit_hook,
                         *every)  # fmt: skip
        except (TypeError, AttributeError, ImportError):
            self.enabled = False
            self._compiled.clear()
            return False
        self.direct_launches += 1
        return True

    def _stream(self, device: torch.device) -> int:
        """The raw current stream of ``device`` (Triton's own getter, read
        once: ``torch.cuda.current_stream`` builds a Stream object a call)."""
        if device.index is None:
            return torch.cuda.current_stream(device).cuda_stream
        return self._get_stream(device.index)


def stream_getter() -> Callable[[int], int]:
    """A function of a CUDA device index -> its current stream's raw handle:
    Triton's driver's (what ``JITFunction.run`` calls), or torch's public
    one where the driver has none."""
    try:
        from triton.runtime import driver

        get = driver.active.get_current_stream
    except Exception:  # no driver here (no GPU): torch's getter
        get = None
    if get is None:
        return stream_getter_torch
    return get
