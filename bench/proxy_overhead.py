"""What the proxy adds to a request's time to first token, against going straight to vLLM.

    python bench/proxy_overhead.py [--prompts 16] [--prompt-tokens 2000] [--repeats 10]
                                   [--kinds tokens,text,chat,grown,fresh] [--engine-cpu 0]
                                   [--service-cpu 1] [--forward-token-ids] [--baseline-root DIR]
                                   [--log-dir DIR]

One real vLLM server (vLLM's own virtualenv and the tiny word-level Llama of
``prefixcache.engines.vllm``; ``make vllm-env`` builds them) runs pinned to ``--engine-cpu``
(its processes' affinity and ``VLLM_CPU_OMP_THREADS_BIND``), and ``prefixcache serve --proxy`` in
front of it (its tokenizer and chat template, KV events bound by the service) pinned to
``--service-cpu``, where this script, the load generator, runs too. With ``--baseline-root`` a
second service from another checkout fronts the same server, so that a change is measured
against its baseline in one run; vLLM publishes its KV events to one endpoint only, which the
first service binds, so the baseline follows an endpoint nothing publishes on (its index stays
empty: its routes hash as many blocks and find none). With ``--forward-token-ids`` one more
service of this checkout (``proxy-ids``, following no events either) forwards text completions
as the token ids it computed (``proxy.forward_token_ids``), so vLLM does not tokenize them.

Each prompt is ``--prompt-tokens`` random words, sent once straight to vLLM first, so that every
measured request is a prefix-cache hit (the engine's part is short and steady, and what differs
between the paths is the hop). Then, ``--repeats`` times over the prompts and for each kind
(``tokens``: the prompt as token ids, ``text``: as text, which the service tokenizes, ``chat``: as
one user message, which the service renders with the chat template and tokenizes, ``grown``: as
text followed by ``GROWN_WORDS`` words drawn anew for each request, a prompt that continues one
seen before, as a conversation's next turn does; ``fresh``: as text never seen by the services,
a prompt of its own for each request, sent first straight to vLLM as token ids, unmeasured, so
that vLLM has it cached as it has the others), each one streamed and not, the same request goes
straight to vLLM and through each service, one at a time, in an order that alternates. The time to
first token is measured at the client, on one keep-alive connection per target: not streamed, until
the answer's first byte (``max_tokens`` 1); streamed, until the first event carrying a token.

It prints, per kind and mode, the samples, the p50 and p99 of each path, and what the proxy adds
(its p50 minus vLLM's, its p99 minus vLLM's; and the median of the paired differences).
Target: p50 <= 2 ms and p99 <= 10 ms added.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefixcache.engines.vllm import (  # noqa: E402
    VLLMFleet,
    VLLMServer,
    VLLMServerSpec,
    find_vllm,
    free_port,
)

MODEL = "tiny-llama"
BLOCK = 128  # vLLM's default on CPU
VOCAB = 32000
FIRST_WORD = 3  # the tiny tokenizer's word w{i} is the token id i + 3
KINDS = ("tokens", "text", "chat", "grown", "fresh")
GROWN_WORDS = 24  # the words a "grown" prompt adds to a prompt seen before


class Target(NamedTuple):
    """Where a request goes: vLLM itself or a service in front of it."""

    name: str
    host: str
    port: int


class Sample(NamedTuple):
    kind: str
    stream: bool
    target: str
    ttft_s: float
    pair: int  # the request's index: the same request on every target


def _words(n: int) -> list[int]:
    return [FIRST_WORD + secrets.randbelow(VOCAB - FIRST_WORD) for _ in range(n)]


def _body(kind: str, tokens: list[int], stream: bool) -> dict[str, Any]:
    if kind == "grown":  # a text that continues one seen before with words never seen
        tokens = tokens + _words(GROWN_WORDS)
    text = " ".join(f"w{t - FIRST_WORD}" for t in tokens)
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 2 if stream else 1}
    if kind == "tokens":
        body["prompt"] = tokens
    elif kind in ("text", "grown", "fresh"):
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    if stream:
        body["stream"] = True
    return body


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


class KeepAliveClient:
    """One HTTP/1.1 keep-alive connection to a target (the standard library's, the leanest
    client: what it costs is the same on every path)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.conn = http.client.HTTPConnection(target.host, target.port, timeout=300)

    def ttft(self, path: str, body: dict[str, Any]) -> float:
        """Seconds from sending ``body`` to the first byte (not streamed) or the first event
        carrying a token (streamed); the whole answer is read."""
        raw = json.dumps(body).encode()
        headers = {"content-type": "application/json", "content-length": str(len(raw))}
        start = time.perf_counter()
        self.conn.request("POST", path, raw, headers)
        answer = self.conn.getresponse()
        if answer.status != 200:
            raise RuntimeError(f"{self.target.name}: HTTP {answer.status}: {answer.read()[:300]!r}")
        if not body.get("stream"):
            first = time.perf_counter()
            answer.read()
            return first - start
        first = None
        while True:
            line = answer.readline()
            if not line:
                break
            if first is None and line.startswith(b"data: {") and _has_token(line[6:]):
                first = time.perf_counter()
        if first is None:
            raise RuntimeError(f"{self.target.name}: a stream without a token")
        return first - start

    def close(self) -> None:
        self.conn.close()


def _has_token(event: bytes) -> bool:
    chunk = json.loads(event)
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


@contextlib.contextmanager
def _service(
    root: Path, name: str, config: dict[str, Any], workdir: Path, cpu: int | None
) -> Iterator[Target]:
    """``prefixcache serve --proxy`` of the checkout at ``root`` on ``config``, pinned to
    ``cpu``; stopped at the end."""
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    log = open(folder / "serve.log", "wb")  # noqa: SIM115 (closed when the service stops)
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache", "serve", "--config", str(path), "--port", str(port),
         "--proxy", "--log-level", "warning"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {(folder / 'serve.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer in time")
            time.sleep(0.2)
        yield Target(name, "127.0.0.1", port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _config(
    server: VLLMServer, model: Path, events: bool = True, forward_token_ids: bool = False
) -> dict[str, Any]:
    """The service's config: the server as its one replica, its KV events bound by the service
    (``events``), else an endpoint nothing publishes on; text completions forwarded as token
    ids with ``forward_token_ids``."""
    followed = {"events": server.spec.events, "events_bind": True, "replay": server.replay}
    if not events:
        followed = {"events": f"tcp://127.0.0.1:{free_port()}"}
    proxy: dict[str, Any] = {"enabled": True}
    if forward_token_ids:
        proxy["forward_token_ids"] = True
    return {
        "index": "memory",
        "proxy": proxy,
        "tokenizer": str(model / "tokenizer.json"),
        "chat_template": str(model / "tokenizer_config.json"),
        "replicas": [
            {
                "name": server.name,
                "url": server.url,
                "model": MODEL,
                "block_size": server.spec.block_size,
                **followed,
            }
        ],
    }


def measure(
    targets: Sequence[Target], prompts: list[list[int]], kinds: Sequence[str], repeats: int
) -> list[Sample]:
    """Every (prompt, kind, mode) request on every target, in alternating orders (a ``fresh``
    prompt sent first to the first target, vLLM, as token ids, unmeasured)."""
    clients = [KeepAliveClient(t) for t in targets]
    samples: list[Sample] = []
    pair = 0
    try:
        for r in range(repeats):
            for i, tokens in enumerate(prompts):
                for kind in kinds:
                    for stream in (False, True):
                        if kind == "fresh":  # never seen by the services, cached by vLLM
                            tokens = _words(len(tokens))
                            clients[0].ttft("/v1/completions", _body("tokens", tokens, False))
                        body = _body(kind, tokens, stream)
                        shift = (r + i + pair) % len(clients)
                        for client in clients[shift:] + clients[:shift]:
                            t = client.ttft(_path(kind), body)
                            samples.append(Sample(kind, stream, client.target.name, t, pair))
                        pair += 1
    finally:
        for client in clients:
            client.close()
    return samples


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(samples: Sequence[Sample], targets: Sequence[Target]) -> str:
    """The table: per kind and mode, each path's p50 and p99 (ms) and what each service adds."""
    direct = targets[0].name
    lines = [
        f"{'kind':<7}{'mode':<8}{'n':>5}  {'target':<10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'+p50 ms':>10}{'+p99 ms':>10}{'paired med':>12}"
    ]
    for kind in dict.fromkeys(s.kind for s in samples):
        for stream in (False, True):
            rows = [s for s in samples if s.kind == kind and s.stream == stream]
            if not rows:
                continue
            base = {s.pair: s.ttft_s for s in rows if s.target == direct}
            b50, b99 = _pct(list(base.values()), 0.5), _pct(list(base.values()), 0.99)
            for target in targets:
                mine = [s for s in rows if s.target == target.name]
                t = [s.ttft_s for s in mine]
                p50, p99 = _pct(t, 0.5), _pct(t, 0.99)
                line = (
                    f"{kind:<7}{'stream' if stream else 'json':<8}{len(t):>5}  "
                    f"{target.name:<10}{p50 * 1e3:>9.2f}{p99 * 1e3:>9.2f}"
                )
                if target.name != direct:
                    paired = statistics.median(s.ttft_s - base[s.pair] for s in mine)
                    line += (
                        f"{(p50 - b50) * 1e3:>10.2f}{(p99 - b99) * 1e3:>10.2f}{paired * 1e3:>12.2f}"
                    )
                lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="words per prompt")
    parser.add_argument("--repeats", type=int, default=10, help="rounds over the prompts")
    parser.add_argument("--kinds", default="tokens,text", help=f"of {', '.join(KINDS)}")
    parser.add_argument("--engine-cpu", type=int, default=0, help="vLLM's core")
    parser.add_argument("--service-cpu", type=int, default=1, help="the services' and ours")
    parser.add_argument(
        "--forward-token-ids", action="store_true", help="also a service forwarding token ids"
    )
    parser.add_argument("--baseline-root", type=Path, help="a checkout to compare against")
    parser.add_argument("--log-dir", type=Path, help="keep the logs there")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--kinds: a comma list of {', '.join(KINDS)}")
    install = find_vllm()
    workdir = args.log_dir or Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {args.service_cpu})
    spec = VLLMServerSpec(
        "vllm-0",
        block_size=BLOCK,
        events=f"tcp://127.0.0.1:{free_port()}",
        cpu=args.engine_cpu,
        model_name=MODEL,
    )
    prompts = [_words(args.prompt_tokens) for _ in range(args.prompts)]
    print(
        f"vLLM on core {args.engine_cpu} (affinity and VLLM_CPU_OMP_THREADS_BIND), the services "
        f"and this client on core {args.service_cpu}; {args.prompts} prompts of "
        f"{args.prompt_tokens} words, each cached first; {args.repeats} rounds",
        flush=True,
    )
    with VLLMFleet([spec], log_dir=workdir / "vllm", install=install) as fleet:
        server = fleet["vllm-0"]
        config = _config(server, install.model)
        with contextlib.ExitStack() as stack:
            targets = [Target("vllm", "127.0.0.1", server.port)]
            targets.append(
                stack.enter_context(_service(ROOT, "proxy", config, workdir, args.service_cpu))
            )
            if args.forward_token_ids:
                ids = _config(server, install.model, events=False, forward_token_ids=True)
                service = _service(ROOT, "proxy-ids", ids, workdir, args.service_cpu)
                targets.append(stack.enter_context(service))
            if args.baseline_root is not None:
                unfollowed = _config(server, install.model, events=False)
                cpu = args.service_cpu
                base = _service(args.baseline_root, "baseline", unfollowed, workdir, cpu)
                targets.append(stack.enter_context(base))
            warm = KeepAliveClient(targets[0])
            for tokens in prompts:  # every measured request is a hit
                warm.ttft("/v1/completions", _body("tokens", tokens, False))
            warm.close()
            measure(targets, prompts[:2], kinds, 1)  # connections and code paths warm
            started = time.monotonic()
            samples = measure(targets, prompts, kinds, args.repeats)
            print(f"{len(samples)} requests in {time.monotonic() - started:.0f} s")
            print(report(samples, targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
