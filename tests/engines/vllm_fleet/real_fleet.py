"""Real vLLM servers behind a real ``prefixcache serve``: what the real-engine tests share.

The servers come from ``prefixcache.engines.vllm`` (vLLM's own virtualenv, the tiny word-level
Llama); the service runs as ``prefixcache serve`` in a subprocess, binding each replica's event
port (vLLM connects to it). A test asks the engines themselves what they hold: a prompt sent
straight to a server answers ``usage.prompt_tokens_details.cached_tokens``, the truth the index
is checked against.

The service binds each server's event port; vLLM's socket connects to it within 100 ms and loses
what it sends before (PUB/SUB), so ``serving`` returns once a batch of each server has arrived
(``connect_events``). ``barrier`` makes the checks exact: a marker prompt of two blocks is sent
straight to one server, and the check waits until the index holds it there. A replica's events
are applied in order, so by then the index has applied everything that server did before the
marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from tokenizers import Tokenizer, processors

from prefixcache.engines.vllm import VLLMFleet, VLLMServer, free_port

MODEL = "tiny-llama"
BLOCK = 32
VOCAB = 32000
FIRST_WORD = 3  # the word w{i} is the token id i + 3
SERVICE_DEADLINE_S = 120.0
INDEX_DEADLINE_S = 30.0
HTTP_TIMEOUT_S = 120.0
OPERATOR = "sk-operator-real-engines-000000"
ACME = "sk-acme-real-engines-0000000000"
GLOBEX = "sk-globex-real-engines-000000000"
KEYS_YAML = f"""
{OPERATOR}: {{role: operator, name: ops}}
{ACME}: acme
{GLOBEX}: globex
"""


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


def random_tokens(n: int) -> list[int]:
    """``n`` token ids of words, drawn at random (a prompt nothing else shares)."""
    return [FIRST_WORD + secrets.randbelow(VOCAB - FIRST_WORD) for _ in range(n)]


def as_text(tokens: Sequence[int]) -> str:
    """The text the word-level tokenizer turns into ``tokens``."""
    return " ".join(f"w{t - FIRST_WORD}" for t in tokens)


def full_blocks(tokens: Sequence[int]) -> int:
    """The cached tokens an engine can report for a prompt held whole: its full blocks, the
    last token always computed."""
    return (len(tokens) - 1) // BLOCK * BLOCK


def wait_for(check: Callable[[], Any], what: str, timeout: float = INDEX_DEADLINE_S) -> Any:
    """Poll ``check()`` until it returns something true; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def complete(
    url: str,
    prompt: Sequence[int] | str,
    *,
    salt: str | None = None,
    max_tokens: int = 1,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """``POST url/v1/completions`` (a server's or the service's), greedy."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if salt is not None:
        body["cache_salt"] = salt
    answer = httpx.post(
        f"{url}/v1/completions", json=body, headers=headers or {}, timeout=HTTP_TIMEOUT_S
    )
    return answer


def cached_tokens(answer: httpx.Response) -> int:
    """The engine's ``usage.prompt_tokens_details.cached_tokens`` of a JSON answer."""
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def engine_cached(server: VLLMServer, tokens: Sequence[int], salt: str | None = None) -> int:
    """What ``server`` serves of ``tokens`` from its cache now (it then caches the prompt)."""
    return cached_tokens(complete(server.url, tokens, salt=salt))


class Service:
    """``prefixcache serve --proxy`` on a config file, in a subprocess, until ``stop``."""

    def __init__(
        self,
        workdir: Path,
        config: dict[str, Any],
        *,
        keys: bool = False,
        args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        if keys:
            (workdir / "keys.yaml").write_text(KEYS_YAML)
            config = {**config, "auth": {"keys_file": "keys.yaml", **config.get("auth", {})}}
        self.config = config
        self.keys = keys
        self.config_path = workdir / "fleet.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.log_path = workdir / "serve.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.operator = bearer(OPERATOR if keys else None)

    def start(self) -> Service:
        """Start it and wait for ``/healthz``."""
        cmd = [
            sys.executable, "-m", "prefixcache", "serve", "--config", str(self.config_path),
            "--port", str(self.port), "--proxy", "--log-level", "info", *self.args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT
            )

        def up() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(
                    f"prefixcache serve exited with {self.process.returncode}:\n{self.log()}"
                )
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200
            return False

        wait_for(up, "prefixcache serve to answer /healthz", SERVICE_DEADLINE_S)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        """SIGTERM, as an operator stops it (Ctrl-C's twin), then SIGKILL past 20 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what the service answers ---------------------------------------------------------
    def get(self, path: str, key: str | None = None) -> Any:
        headers = bearer(key) if key else self.operator
        answer = httpx.get(f"{self.url}{path}", headers=headers, timeout=HTTP_TIMEOUT_S)
        assert answer.status_code == 200, f"GET {path}: {answer.status_code} {answer.text}"
        return answer.json()

    def replicas(self) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in self.get("/v1/replicas")["replicas"]}

    def lookup(
        self, tokens: Sequence[int], key: str | None = None, salt: str | None = None
    ) -> dict[str, int]:
        """Cached prompt tokens per replica, as the index holds them."""
        body: dict[str, Any] = {"model": MODEL, "tokens": list(tokens)}
        if salt is not None:
            body["salt"] = salt
        headers = bearer(key) if key else self.operator
        answer = httpx.post(
            f"{self.url}/v1/lookup", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
        )
        assert answer.status_code == 200, answer.text
        return {s["name"]: int(s["cached_tokens"]) for s in answer.json()["replicas"]}

    def lookup_messages(self, messages: list[dict[str, str]]) -> dict[str, int]:
        """Cached prompt tokens per replica of a chat, rendered as the engine renders it."""
        body = {"model": MODEL, "messages": messages}
        answer = httpx.post(
            f"{self.url}/v1/lookup", json=body, headers=self.operator, timeout=HTTP_TIMEOUT_S
        )
        assert answer.status_code == 200, answer.text
        return {s["name"]: int(s["cached_tokens"]) for s in answer.json()["replicas"]}

    def ingested(self, name: str) -> int:
        """KV event messages the service has received from replica ``name``."""
        text = httpx.get(f"{self.url}/metrics", headers=self.operator, timeout=30).text
        found = re.search(
            rf'^prefixcache_ingest_events_total{{replica="{name}"}} (\S+)', text, re.M
        )
        return int(float(found.group(1))) if found else 0

    def connect_events(self, server: VLLMServer) -> None:
        """Return once the service receives ``server``'s KV events. vLLM's PUB socket connects to
        the port the service binds, retrying every 100 ms, and what it publishes before the
        connection and the subscription are up is lost (PUB/SUB): a prompt of one new block (of
        the server's size) is sent straight to it until a batch arrives."""
        before = self.ingested(server.name)
        deadline = time.monotonic() + INDEX_DEADLINE_S
        while time.monotonic() < deadline:
            fresh = random_tokens(server.spec.block_size + 1)  # a full block: an event
            complete(server.url, fresh).raise_for_status()
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                if self.ingested(server.name) > before:
                    return
                time.sleep(0.05)
        raise AssertionError(f"no KV events from {server.name} reached the service")

    def probe(self, name: str) -> dict[str, Any]:
        """Run the attach probe of replica ``name`` now; its findings by check."""
        answer = httpx.post(
            f"{self.url}/v1/replicas/{name}/probe", headers=self.operator, timeout=HTTP_TIMEOUT_S
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        return {"ok": body["ok"], **{f["check"]: f for f in body["findings"]}}

    def wait_probed(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Wait until every named replica is up and its attach probe has run; its rows."""

        def probed() -> dict[str, dict[str, Any]] | None:
            rows = self.replicas()
            if all(rows[n]["up"] and rows[n]["probe"] is not None for n in names):
                return rows
            return None

        got: dict[str, dict[str, Any]] = wait_for(
            probed, f"the attach probes of {', '.join(names)}", SERVICE_DEADLINE_S
        )
        return got

    def barrier(self, server: VLLMServer) -> None:
        """Return once the index has applied every event ``server`` published before now: a
        two-block marker prompt sent straight to it, waited for in the index."""
        marker = random_tokens(2 * BLOCK + 1)
        complete(server.url, marker).raise_for_status()
        wait_for(
            lambda: self.lookup(marker).get(server.name) == 2 * BLOCK,
            f"the index to apply {server.name}'s events",
        )

    def wait_held(self, server: VLLMServer, tokens: Sequence[int], salt: str | None = None) -> None:
        """Wait until the index holds every full block of ``tokens`` (just sent to ``server``)
        there: its events up to that request are applied."""
        want = len(tokens) // BLOCK * BLOCK
        wait_for(
            lambda: self.lookup(tokens, salt=salt).get(server.name, 0) >= want,
            f"the index to hold the prompt just sent to {server.name}",
        )

    def check_index(self, servers: Sequence[VLLMServer], prompts: Sequence[Sequence[int]]) -> int:
        """For every server and prompt: what the index predicts there equals what the engine
        serves from its cache when sent the prompt straight; the number of prompt blocks the
        engines served."""
        served = 0
        for server in servers:
            self.barrier(server)
            for i, tokens in enumerate(prompts):
                predicted = min(self.lookup(tokens)[server.name], full_blocks(tokens))
                delivered = engine_cached(server, tokens)
                assert delivered == predicted, (
                    f"prompt {i} on {server.name}: the index predicted {predicted} cached "
                    f"tokens, vLLM served {delivered}"
                )
                served += delivered // BLOCK
                self.wait_held(server, tokens)
        return served

    def proxied(
        self,
        prompt: Sequence[int] | str,
        key: str | None = None,
        *,
        salt: str | None = None,
        max_tokens: int = 1,
    ) -> tuple[str, int]:
        """A completion through the service's proxy: the replica it went to and the cached
        tokens its engine reported."""
        headers = bearer(key) if key else {}
        answer = complete(self.url, prompt, salt=salt, max_tokens=max_tokens, headers=headers)
        return answer.headers["x-prefixcache-replica"], cached_tokens(answer)


@contextlib.contextmanager
def serving(
    workdir: Path,
    servers: Sequence[VLLMServer],
    model: Path,
    *,
    keys: bool = False,
    args: Sequence[str] = (),
    replica_overrides: dict[str, dict[str, Any]] | None = None,
    **sections: Any,
) -> Iterator[Service]:
    """``prefixcache serve`` in front of ``servers`` (their events bound by it), tokenizing as
    they do (``model``'s tokenizer and chat template), with the config's other ``sections``;
    stopped at the end."""
    overrides = replica_overrides or {}
    config: dict[str, Any] = {
        "index": "memory",
        "proxy": {"enabled": True},
        "tokenizer": str(model / "tokenizer.json"),
        "chat_template": str(model / "tokenizer_config.json"),
        "health": {"probe_interval_s": 0.5, "probe_timeout_s": 2.0, "down_s": 1.0},
        "replicas": [s.replica_entry(**overrides.get(s.name, {})) for s in servers],
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    service = Service(workdir, config, keys=keys, args=args)
    try:
        service.start()
        for server in servers:
            if service.config["replicas"][servers.index(server)].get("events") and server.events:
                service.connect_events(server)
        yield service
    finally:
        service.stop()


def bos_tokenizer(model: Path, folder: Path) -> Path:
    """The model's tokenizer, adding ``<s>`` to every prompt; its chat template opens with the
    BOS."""
    folder.mkdir(parents=True)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])  # ids 0-2 already: now matched as such
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
    )
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, chat_template="{{ bos_token }}" + config["chat_template"])
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    for name in ("special_tokens_map.json",):
        (folder / name).write_text((model / name).read_text())
    return folder


def reset_caches(fleet: VLLMFleet) -> None:
    """Empty every server's prefix cache (vLLM's dev route; announced as AllBlocksCleared)."""
    for server in fleet:
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=HTTP_TIMEOUT_S).raise_for_status()


def pinned_cpus(n: int) -> list[int | None]:
    """One core each, round robin over the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i % len(cores)] for i in range(n)]
