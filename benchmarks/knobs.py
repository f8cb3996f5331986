"""The benchmark suites' knobs, from the environment (``benchmarks/conftest.py``
lists them). Imported by name (``from knobs import ...``): pyproject's pytest
``pythonpath`` puts ``benchmarks/`` on ``sys.path``; nothing here is shipped."""

from __future__ import annotations

import os

from kvhit.bench.harness import default_device
from kvhit.bench.names import DEFAULT_BATCH_SIZES, PRESET_DESCRIPTIONS

__all__ = [
    "BATCH_SIZES",
    "DEVICE",
    "HISTORY",
    "MAX_TOKENS",
    "PARITY_SAMPLE",
    "PRESET_NAMES",
    "REF_CAP",
]

DEVICE = default_device()


def _csv_env(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name, "")
    return [x.strip() for x in raw.split(",") if x.strip()] or default


MAX_TOKENS = int(
    os.environ.get("KVHIT_BENCH_MAX_TOKENS", 16384 if DEVICE == "cpu" else 131072)
)
BATCH_SIZES = [
    int(b)
    for b in _csv_env("KVHIT_BENCH_BATCH_SIZES", [str(b) for b in DEFAULT_BATCH_SIZES])
]
PRESET_NAMES = _csv_env("KVHIT_BENCH_PRESETS", list(PRESET_DESCRIPTIONS))
REF_CAP = int(os.environ.get("KVHIT_BENCH_REF_CAP", 1024))
HISTORY = float(os.environ.get("KVHIT_BENCH_HISTORY", 1.0))
#: above REF_CAP, parity is checked on this many sampled requests
PARITY_SAMPLE = 256
