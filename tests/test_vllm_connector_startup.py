"""The connector at start-up: one INFO line saying it is active (issue 35.4),
and a clear refusal on any vLLM but 0.33.0.

The line goes to the ``vllm.kvhit`` logger, under vLLM's own logger tree, so
vLLM's handler prints it; these tests attach a handler of their own to it
(vLLM's ``vllm`` logger may not propagate to the root, where caplog sits).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest

READY = re.compile(
    r"kvhit: KvhitMooncakeStoreConnector ready on (the scheduler|worker rank 0) "
    r"\(vLLM 0\.33\.0\): "
)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def ready(self) -> list[str]:
        return [r.getMessage() for r in self.records if READY.match(r.getMessage())]


@pytest.fixture
def startup_log() -> Iterator[Records]:
    log = logging.getLogger("vllm.kvhit")
    handler = Records()
    old = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def test_scheduler_logs_one_ready_line(sched_harness, startup_log):
    h = sched_harness
    side = h.build_side("kvhit", h.LAYOUTS[0], h.CountingStore(), {})
    try:
        lines = startup_log.ready()
        assert lines == [
            "kvhit: KvhitMooncakeStoreConnector ready on the scheduler "
            "(vLLM 0.33.0): batched lookup, up to 4096 requests per message to "
            "worker rank 0, timeout 1 s"
        ]
        assert all(r.levelno == logging.INFO for r in startup_log.records)
        assert all(r.name == "vllm.kvhit" for r in startup_log.records)
    finally:
        side.close()


def test_worker_rank_0_logs_backend_device_and_store(
    sched_harness, startup_log, monkeypatch
):
    """The worker role of the real connector class, its vLLM parent replaced
    by one that hands it the harness's worker (the real worker role needs a
    Mooncake master: tests/test_vllm_worker_role.py)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector,
    )

    from kvhit.bindings.vllm_connector import KvhitMooncakeStoreConnector

    h = sched_harness
    case = h.LAYOUTS[1]
    extra = {"lookup_rpc_port": h.next_port(), "kvhit_store_timeout_s": 0.25}
    vc = h.vllm_config("KvhitMooncakeStoreConnector", case, extra,
                       module_path=h.KVHIT_MODULE)  # fmt: skip
    worker = h.fake_worker(vc, h.kv_cache_config(case, 64), h.CountingStore())
    worker.lookup_server = object()  # vLLM's, on worker rank 0

    def parent_init(self, vllm_config, role, kv_cache_config=None):
        self.connector_scheduler = None
        self.connector_worker = worker

    monkeypatch.setattr(MooncakeStoreConnector, "__init__", parent_init)
    conn = KvhitMooncakeStoreConnector(vc, KVConnectorRole.WORKER)
    try:
        assert conn.kvhit_server is not None
        backend = conn.kvhit_server.backend
        lines = startup_log.ready()
        assert len(lines) == 1, lines
        engine = conn.kvhit_server._lookups[32].engine
        assert lines[0] == (
            "kvhit: KvhitMooncakeStoreConnector ready on worker rank 0 (vLLM "
            f"0.33.0): batched lookup, backend {engine.backend} on cpu, store "
            "CountingStore (one batch_is_exist per step, timeout 0.25 s, at most 3 in "
            "flight)"
        )
        assert backend == "auto" and engine.backend in ("numba", "torch")
        st = conn.kvhit_store_stats()
        assert (st.size, st.in_flight, st.calls, st.busy) == (3, 0, 0, 0)
    finally:
        conn.connector_worker = None  # the harness's worker has no threads to stop
        conn.shutdown()
        assert conn.kvhit_server is None


def test_worker_fallback_is_named_in_the_ready_line(sched_harness):
    h = sched_harness
    side = h.build_side("kvhit", h.LAYOUTS[0], h.CountingStore(), {})
    server = side.servers[-1]
    try:
        assert server.describe().startswith("batched lookup, backend ")
        server.fallback_reason = "the worker is capacity-only (no lookups)"
        assert server.describe() == (
            "vLLM's per-request lookup (the worker is capacity-only (no lookups))"
        )
    finally:
        side.close()


@pytest.mark.parametrize("version", ["0.34.0", "0.32.1", "0.33.0rc1", "0.33.1"])
def test_other_vllm_version_is_refused_before_anything_is_built(
    sched_harness, monkeypatch, version
):
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector,
    )

    from kvhit.bindings.vllm_connector import KvhitMooncakeStoreConnector

    h = sched_harness
    built = []
    monkeypatch.setattr(
        MooncakeStoreConnector, "__init__", lambda *a, **k: built.append(a)
    )
    monkeypatch.setattr(vllm, "__version__", version)
    vc = h.vllm_config("KvhitMooncakeStoreConnector", h.LAYOUTS[0],
                       {"lookup_rpc_port": h.next_port()}, module_path=h.KVHIT_MODULE)  # fmt: skip
    with pytest.raises(RuntimeError) as err:
        KvhitMooncakeStoreConnector(vc, KVConnectorRole.SCHEDULER)
    assert str(err.value) == (
        "KvhitMooncakeStoreConnector supports vLLM 0.33.0 only (its lookup "
        "reproduces that release's MooncakeStoreWorker.lookup bit for bit); "
        f"this is vLLM {version}. Install vllm==0.33.0, or use vLLM's own "
        'connector: "kv_connector": "MooncakeStoreConnector".'
    )
    assert built == []


def test_local_build_tag_of_0_33_0_is_accepted(vllm_env):
    from kvhit.bindings.vllm_connector import check_vllm_version

    assert check_vllm_version() == "0.33.0"
    assert check_vllm_version("0.33.0+cu128") == "0.33.0+cu128"
    with pytest.raises(RuntimeError, match="this is vLLM 0.33.0.post1"):
        check_vllm_version("0.33.0.post1")


def test_documented_kv_transfer_config_is_valid_json(vllm_env):
    """The module's ``--kv-transfer-config`` example parses and builds vLLM's
    ``KVTransferConfig`` naming this connector."""
    import json

    from vllm.config import KVTransferConfig

    import kvhit.bindings.vllm_connector as vcm

    doc = vcm.__doc__ or ""
    text = doc.split("--kv-transfer-config '", 1)[1].split("'", 1)[0]
    cfg = KVTransferConfig(**json.loads(text))
    assert cfg.kv_connector == vcm.CONNECTOR_NAME
    assert cfg.kv_connector_module_path == vcm.__name__
    extra = cfg.kv_connector_extra_config
    assert {"load_async", "lookup_async", "kvhit_store_timeout_s"} <= set(extra)
