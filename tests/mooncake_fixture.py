"""A real, local Mooncake store for tests and benchmarks.

Starts ``mooncake_master`` (from the PyPI package
``mooncake-transfer-engine-non-cuda``) on 127.0.0.1 with free ports, its
embedded HTTP metadata server on, and connects an in-process
``MooncakeDistributedStore`` client over TCP with small segments (a few MiB),
so a test starts in about a second on a 2-core machine.

Only a missing/unimportable package is a reason to skip
(:func:`mooncake_unavailable`); a master that does not come up, or a client
that cannot connect, is a failure. Every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


def mooncake_unavailable() -> str | None:
    """Why a real store cannot be used here (``None`` when it can)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # ImportError, or a missing shared library
        return (
            "Mooncake is not importable ("
            f"{type(exc).__name__}: {exc}); install it with .ci/install-mooncake"
        )
    if master_binary() is None:
        return "the mooncake_master executable is not installed"
    return None


def master_binary() -> str | None:
    """``mooncake_master``: next to this Python first (the venv), then PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        return str(here)
    return shutil.which("mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _accepting(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=0.2).close()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class MasterAddress:
    """Where a started master listens."""

    rpc_port: int
    http_port: int
    metrics_port: int

    @property
    def master_server_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"


class MooncakeMaster:
    """A ``mooncake_master`` subprocess on 127.0.0.1; use as a context manager."""

    def __init__(self, start_timeout: float = 20.0) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master is not installed")
        self.binary = binary
        self.start_timeout = start_timeout
        self.address = MasterAddress(free_port(), free_port(), free_port())
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(
            prefix="mooncake_master_", suffix=".log", delete=False
        )
        self.startup_seconds = 0.0

    def start(self) -> MooncakeMaster:
        a = self.address
        cmd = [
            self.binary,
            f"--rpc_port={a.rpc_port}",
            f"--rpc_address={HOST}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={a.http_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={a.metrics_port}",
            "--rpc_thread_num=2",
            # Short leases, so a test may remove what it just wrote.
            "--default_kv_lease_ttl=50",
        ]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = t0 + self.start_timeout
        while not (_accepting(a.rpc_port) and _accepting(a.http_port)):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            if time.perf_counter() > deadline:
                self.stop()
                raise RuntimeError(
                    f"mooncake_master did not listen within {self.start_timeout}s:\n"
                    + self.log_tail()
                )
            time.sleep(0.05)
        self.startup_seconds = time.perf_counter() - t0
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the master (SIGTERM, then SIGKILL after ``timeout``)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


def connect_client(
    master: MooncakeMaster,
    global_segment_size: int = 32 << 20,
    local_buffer_size: int = 16 << 20,
) -> Any:
    """A ``MooncakeDistributedStore`` set up against ``master`` over TCP,
    advertising 127.0.0.1 (so its transfer traffic stays on loopback)."""
    # The transfer engine otherwise advertises the first active interface's
    # address; read at setup time.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    a = master.address
    rc = store.setup(
        HOST,
        a.metadata_server,
        global_segment_size,
        local_buffer_size,
        "tcp",
        "",
        a.master_server_address,
    )
    if rc != 0:
        raise RuntimeError(
            f"MooncakeDistributedStore.setup returned {rc}:\n" + master.log_tail()
        )
    return store
