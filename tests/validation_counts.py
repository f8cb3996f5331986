"""How many validation calls one warm lookup makes (issue 36: one pass per
argument), per backend and on the connector's path.

A validation call is a call of a kvhit function whose name says it checks
(``check_*``, ``_check_*``, ``*_validate``) or that validates lengths
(``host_lengths``, ``host_lengths_or_int``, ``check_lengths``, the engine's
former ``_lengths`` and ``_host_lengths``). A *pass* is such a call made while no other one runs:
the checks one public entry point makes of one argument, however they are
split into helpers.

Run as a script (``PYTHONSAFEPATH=1 .venv/bin/python tests/validation_counts.py
[--root DIR]``) to print the counts; ``--root`` loads kvhit from another
checkout (e.g. an older commit, for the before/after figures).
``tests/test_validation_counts.py`` asserts them.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CHECK = re.compile(
    r"^_?check_|^_?validate|_validate$|^_check[A-Z_]|^host_lengths(_or_int)?$"
    r"|^check_lengths$"
    r"|^_lengths$|^_host_lengths$|^_normalize_|^normalize_keys$|^resolve_device$"
    r"|^_resolve_device$"
)
_FOLDERS = ("kernels", "coordinator", "bindings")


def count(fn: Callable[[], Any], root: str) -> tuple[collections.Counter, int]:
    """``(calls by function name, passes)`` of validation functions of the
    kvhit checkout at ``root`` while ``fn()`` runs."""
    dirs = tuple(os.path.join(root, f) + os.sep for f in _FOLDERS)
    calls: collections.Counter = collections.Counter()
    depth = 0
    passes = 0
    stack: list[bool] = []

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal depth, passes
        if event == "call":
            code = frame.f_code
            is_check = code.co_filename.startswith(dirs) and bool(
                _CHECK.search(code.co_name)
            )
            stack.append(is_check)
            if is_check:
                calls[f"{Path(code.co_filename).stem}.{code.co_name}"] += 1
                if depth == 0:
                    passes += 1
                depth += 1
        elif event == "return" and stack:
            if stack.pop():
                depth -= 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, passes


def scenarios(root: str) -> dict[str, Callable[[], Any]]:
    """Warm lookups (each run once before it is counted), by name."""
    import numpy as np
    import torch

    from kvhit.bench.workloads import make_layout
    from kvhit.coordinator.engine import LookupEngine
    from kvhit.coordinator.key_index import KeyIndex
    from kvhit.coordinator.packing import HashBatch

    layout = make_layout("dsv4-flash")
    hb = 16
    reqs = [[bytes([r, i]) * 8 for i in range(40)] for r in range(4)]
    ntok = [len(r) * layout.hash_block_size for r in reqs]
    out: dict[str, Callable[[], Any]] = {}
    for backend in ("numba", "torch", "triton"):
        if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        index = KeyIndex(hb, backend="torch" if backend == "triton" else backend)
        for g in range(layout.num_groups):
            index.add(g, [h for r in reqs[:2] for h in r[:24]])
        engine = LookupEngine(layout, backend=backend)
        batch = HashBatch.from_bytes(reqs, hb)
        forms = {
            "list": ntok,
            "numpy": np.array(ntok, dtype=np.int64),
            "tensor": torch.tensor(ntok),
        }
        for form, lens in forms.items():

            def lookup(engine=engine, batch=batch, index=index, lens=lens) -> Any:
                return engine.lookup(batch, lens, index)

            lookup()
            out[f"lookup[{backend}, {form} num_tokens]"] = lookup

        # A step of one request (the numba backend's one-request path).
        one = HashBatch.from_bytes(reqs[:1], hb)
        n_one = ntok[0]
        one_forms = {
            "list": [n_one],
            "numpy": np.array([n_one], dtype=np.int64),
            "tensor": torch.tensor([n_one]),
        }
        for form, lens in one_forms.items():

            def find(engine=engine, one=one, index=index, lens=lens) -> Any:
                return engine.find_longest_cache_hit(one, lens, index)

            find()
            out[f"find[{backend}, one request, {form} max_lengths]"] = find

    from kvhit.bindings.mooncake_store import MooncakeKeys
    from kvhit.bindings.store_sync import BatchedLookup

    class EveryKey:
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            return [1] * len(keys)

    keys = MooncakeKeys("m", [[(0, 0, 0, 0)]] * layout.num_groups)
    bl = BatchedLookup(layout, EveryKey(), keys, hash_bytes=hb)
    words = HashBatch.from_bytes(reqs, hb)
    # As KvhitLookupServer.resolve_packed hands a checked socket batch on.
    trusted = HashBatch.from_trusted(words.hashes, words.offsets, hb)
    nt = torch.from_numpy(np.array(ntok, dtype=np.int64))

    def connector() -> Any:
        return bl.lookup_with_tail_keys_unchecked(trusted, nt)

    connector()
    out["connector lookup_with_tail_keys_unchecked"] = connector

    def connector_checked() -> Any:
        return bl.lookup_with_tail_keys(words, ntok)

    connector_checked()
    out["connector lookup_with_tail_keys"] = connector_checked
    return out


def _use_root(root: str) -> None:
    """Load kvhit's packages from ``root`` (the editable install's map)."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("__editable__") and hasattr(mod, "MAPPING"):
            mapping = mod.MAPPING
            for pkg, folder in list(mapping.items()):
                mapping[pkg] = os.path.join(root, os.path.basename(folder))
    for name in [n for n in sys.modules if n == "kvhit" or n.startswith("kvhit.")]:
        del sys.modules[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = str(Path(__file__).resolve().parent.parent)
    parser.add_argument("--root", default=here, help="the kvhit checkout to load")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    if root != here:
        _use_root(root)
    for name, fn in scenarios(root).items():
        calls, passes = count(fn, root)
        print(f"{name}: {sum(calls.values())} calls, {passes} passes")
        for f, n in sorted(calls.items()):
            print(f"    {n:3d}  {f}")


if __name__ == "__main__":
    main()
