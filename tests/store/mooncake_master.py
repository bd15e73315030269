"""A real ``mooncake_master`` on free loopback ports, for the Mooncake Store tests."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


def client_error() -> str | None:
    """Why Mooncake Store's client cannot be used here (None: it can)."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        return (
            "Mooncake Store's client is not installed (pip install '.[mooncake]' and apt-get "
            f"install -y libibverbs1 librdmacm1 libnuma1): {exc}"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
    """``mooncake_master`` with its HTTP metadata server, started and stopped by a test."""

    def __init__(self, log_dir: Path, lease_ms: int = 500) -> None:
        import mooncake

        self.binary = str(Path(mooncake.__file__).parent / "mooncake_master")
        self.log_dir = log_dir
        self.lease_ms = lease_ms
        self.rpc, self.http, self.metrics = _free_port(), _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The store URL a runtime is given."""
        return (
            f"mooncake://127.0.0.1:{self.rpc}?metadata=http://127.0.0.1:{self.http}/metadata"
            f"&metrics=http://127.0.0.1:{self.metrics}/metrics&segment=64&buffer=16"
        )

    def start(self) -> None:
        args = [
            self.binary,
            f"--rpc_port={self.rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics}",
            f"--default_kv_lease_ttl={self.lease_ms}",
            "--client_ttl=5",
            "--logtostderr",
        ]
        log = open(self.log_dir / f"master-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.rpc), 0.2).close()
                socket.create_connection(("127.0.0.1", self.http), 0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("mooncake_master did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None


def client_env() -> dict[str, str]:
    """The environment of a runtime process on loopback, quiet."""
    return {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
