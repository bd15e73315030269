"""The attach probe: a short prompt sent to a replica twice, and what came back checked against
what the service computes for the same tokens, so that a replica whose engine hashes, sizes or
reports differently is named at once, not after a window of degraded routes.

The prompt is ``PROBE_BLOCKS`` full blocks of random token ids below 256 and one more token
(never cached before, valid in any vocabulary). Checks, each a ``ProbeFinding``:

- **cache report**: the answers carry ``usage.prompt_tokens_details.cached_tokens`` (vLLM's
  ``--enable-prompt-tokens-details``, SGLang's ``--enable-cache-report``);
- **prefix hit**: the second answer hit every full block (the engine computes the last token);
  a shortfall that another block size explains names that block size;
- **events**: the replica's KV events brought the probe's blocks into the index; if not, why:
  no batch came (the events endpoint), an event was skipped (its reason, as a block size the
  config does not name), or the blocks sit under a namespace the config does not name;
- **engine hash** (where ``engine_hash`` is configured): the engine hashes the events announced
  equal those computed here; if not, the engine, algorithm, seed or hash form that would
  reproduce them is named.
- **cache salt** (with tenants configured, for a replica without a salt of its own): the prompt
  is sent under a probe ``cache_salt`` (as a tenant's requests are), and once more under
  another one, which must hit nothing: an engine that ignores ``cache_salt`` serves the second
  from the first's blocks (tenants would share blocks the index keeps apart), and its events
  name the blocks without the salt, which is named too.

It runs when a replica first answers its health probe (``health.attach_probe``) and on demand
(``POST /v1/replicas/{name}/probe``, operator keys only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import Any, NamedTuple

import msgspec

from prefixcache.blocks.hashing import BlockHasher
from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import UnknownReplicaError
from prefixcache.fleet.delivery_check import engine_cap
from prefixcache.fleet.events.engine_keys import (
    VLLM_ALGOS,
    BlockKey,
    EngineHasher,
    EngineHashSpec,
)
from prefixcache.fleet.events.replica_stream import StreamView
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.service.dispatch import FleetService
from prefixcache.fleet.service.openai_proxy.replica_client import UpstreamError
from prefixcache.fleet.service.openai_proxy.usage_reader import cached_tokens_of

log = logging.getLogger("prefixcache.fleet")

PROBE_BLOCKS = 5
EVENTS_DEADLINE_S = 5.0  # for the probe's blocks to reach the index
CATCH_UP_AFTER_S = 0.5  # with no batch by then, the replay endpoint is asked for them
# the probe's own salts: no tenant's ("tenant:<name>..."), never one a request is keyed under
PROBE_SALT = "prefixcache-probe:"
_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256, 512)


class ProbeFinding(NamedTuple):
    """One check of the probe."""

    check: str  # "cache report", "prefix hit", "cache salt", "events", "engine hash", "request"
    ok: bool
    detail: str


class ProbeResult(NamedTuple):
    """What the probe of one replica found."""

    replica: str
    ok: bool  # every check passed (or did not apply)
    at: float  # wall-clock time it ended
    findings: tuple[ProbeFinding, ...]

    def as_dict(self) -> dict[str, Any]:
        """For ``/v1/replicas`` and the probe endpoint."""
        return {
            "ok": self.ok,
            "at": round(self.at, 3),
            "findings": [f._asdict() for f in self.findings],
        }


async def probe_replica(service: FleetService, name: str) -> ProbeResult:
    """Probe replica ``name`` now, keep the result (``service.probes``) and log it.
    UnknownReplicaError when it is not in the fleet."""
    spec = next((s for s in service.router.replicas() if s.name == name), None)
    if spec is None:
        raise UnknownReplicaError(f"replica {name!r} is not in the fleet")
    url = service.urls.get(name)
    findings = await _run(service, spec, url) if url else []
    if not url:
        findings.append(ProbeFinding("request", False, "the replica has no url to probe"))
    result = ProbeResult(name, all(f.ok for f in findings), time.time(), tuple(findings))
    service.probes[name] = result
    if result.ok:
        log.info("replica %s: attach probe agrees (%d checks)", name, len(findings))
    else:
        bad = "; ".join(f"{f.check}: {f.detail}" for f in findings if not f.ok)
        log.warning("replica %s: attach probe found: %s", name, bad)
    return result


async def _run(service: FleetService, spec: ReplicaSpec, url: str) -> list[ProbeFinding]:
    name, ns, p = spec.name, spec.namespace, spec.block_size
    rc = service.config.replica(name)
    # with tenants, requests carry a salt: so does the probe, and a second one checks it
    salted = ns.salt is None and any(k.tenant is not None for k in service.config.access.keys)
    if salted:
        ns = dataclasses.replace(ns, salt=PROBE_SALT + secrets.token_hex(8))
    tokens = [secrets.randbelow(255) + 1 for _ in range(PROBE_BLOCKS * p + 1)]
    body: dict[str, Any] = {
        "model": ns.adapter or ns.model,
        "prompt": tokens,
        "max_tokens": 1,
    }
    if ns.salt is not None:
        body["cache_salt"] = ns.salt
    bodies = [body, body]
    if salted:  # the same prompt under another salt: nothing of it is cached there
        bodies.append({**body, "cache_salt": PROBE_SALT + secrets.token_hex(8)})
    view_before = _view(service, name)
    findings: list[ProbeFinding] = []
    try:
        figures = []
        for sent in bodies:
            status, data = await service.http_client.post_json(f"{url}/v1/completions", sent)
            if not 200 <= status < 300:
                detail = f"POST {url}/v1/completions answered HTTP {status}"
                text = data[:200].decode("utf-8", "replace")
                return [ProbeFinding("request", False, f"{detail}: {text}")]
            figures.append(cached_tokens_of(msgspec.json.decode(data)))
    except UpstreamError as exc:
        return [ProbeFinding("request", False, f"POST {url}/v1/completions failed: {exc}")]
    except msgspec.DecodeError as exc:
        return [ProbeFinding("request", False, f"the answer is not JSON: {exc}")]
    findings += _hit_findings(figures[1], len(tokens), p)
    if salted and figures[2] is not None:
        findings.append(_salt_finding(figures[2], len(tokens)))
    if view_before is None:
        findings.append(ProbeFinding("events", True, "not followed (no events endpoint): skipped"))
        return findings
    held = await _wait_held(service, spec, ns, tokens, view_before.counters.batches)
    view = _view(service, name)
    assert view is not None
    unsalted = False
    if not held and ns.salt is not None:  # filed without the salt: the engine ignores it
        plain = dataclasses.replace(ns, salt=None)
        unsalted = await _holds(service, spec, plain, tokens)
    findings.append(_events_finding(held, PROBE_BLOCKS * p, view_before, view, unsalted))
    engine = rc.engine_hash if rc is not None else None
    if engine is not None and held:
        digests = BlockHasher(p, service.config.hash_algo).hash_prompt(tokens, ns)
        announced = [view.announced.get(d) for d in digests[:PROBE_BLOCKS]]
        findings.append(_hash_finding(engine, p, tokens, ns.salt, announced))
    return findings


def _view(service: FleetService, name: str) -> StreamView | None:
    read = getattr(service.ingest, "stream_view", None)
    return read(name) if callable(read) else None


def _hit_findings(cached: int | None, n: int, p: int) -> list[ProbeFinding]:
    if cached is None:
        return [
            ProbeFinding(
                "cache report",
                False,
                "the answers carry no usage.prompt_tokens_details.cached_tokens: start vLLM "
                "with --enable-prompt-tokens-details (SGLang: --enable-cache-report); without "
                "it the delivery check cannot run for this replica",
            )
        ]
    out = [ProbeFinding("cache report", True, "cached tokens reported")]
    expected = engine_cap(n, n, p)
    if cached >= expected:
        out.append(ProbeFinding("prefix hit", True, f"the repeat hit {cached} of {n} tokens"))
        return out
    sizes = [b for b in _BLOCK_SIZES if b != p and engine_cap(n, n, b) == cached]
    why = (
        f"the engine's block size looks like {' or '.join(map(str, sizes))}, the config says {p}"
        if sizes and cached
        else "is prefix caching on (vLLM: --enable-prefix-caching; SGLang: no "
        "--disable-radix-cache)?"
    )
    detail = f"the repeat of a {n}-token prompt hit {cached} tokens, {expected} expected: {why}"
    out.append(ProbeFinding("prefix hit", False, detail))
    return out


def _salt_finding(cached: int, n: int) -> ProbeFinding:
    if cached == 0:
        return ProbeFinding(
            "cache salt", True, "a prompt cached under one cache_salt hit nothing under another"
        )
    return ProbeFinding(
        "cache salt",
        False,
        f"the engine served {cached} of {n} tokens of a prompt from the blocks another "
        "cache_salt cached: it ignores cache_salt, so tenants share its blocks while the "
        "index keeps them apart (the engine delivers more than routing predicts, across "
        "tenants); serve tenants from an engine that keys its prefix cache by cache_salt "
        "(vLLM's and SGLang's OpenAI servers do)",
    )


async def _holds(
    service: FleetService, spec: ReplicaSpec, ns: Namespace, tokens: list[int]
) -> bool:
    """Whether the index holds every full block of the probe for ``spec``'s replica under
    ``ns`` now."""
    want = PROBE_BLOCKS * spec.block_size
    scores = await asyncio.to_thread(service.router.lookup, ns, tokens)
    return any(s.name == spec.name and s.cached_tokens >= want for s in scores.scores)


async def _wait_held(
    service: FleetService, spec: ReplicaSpec, ns: Namespace, tokens: list[int], batches: int
) -> bool:
    """Whether the index holds every full block of the probe for ``spec``'s replica under
    ``ns`` within the deadline. When no batch came past ``batches`` (the count before the
    probe) after ``CATCH_UP_AFTER_S``, the replica's replay endpoint is asked for what the
    stream missed: a replica that restarted on its ports may answer the probe before the
    subscriber's SUB socket is connected again, and the batches published meanwhile are lost
    to it, with no later batch to show the gap."""
    now = time.monotonic()
    deadline, catch_up_at = now + EVENTS_DEADLINE_S, now + CATCH_UP_AFTER_S
    while True:
        if await _holds(service, spec, ns, tokens):
            return True
        now = time.monotonic()
        if now > deadline:
            return False
        if now > catch_up_at:
            catch_up_at = deadline + 1.0  # once
            view = _view(service, spec.name)
            catch_up = getattr(service.ingest, "catch_up", None)
            if view is not None and view.counters.batches == batches and callable(catch_up):
                await asyncio.to_thread(catch_up, spec.name)
        await asyncio.sleep(0.05)


def _events_finding(
    held: bool, tokens: int, before: StreamView, after: StreamView, unsalted: bool = False
) -> ProbeFinding:
    if held:
        return ProbeFinding("events", True, f"the index holds the probe's {tokens} tokens")
    b, a = before.counters, after.counters
    if unsalted:
        detail = (
            "its events name the probe's blocks without the request's cache_salt: the engine "
            "ignores cache_salt"
        )
    elif a.batches == b.batches:
        detail = (
            "no KV event batch came from the replica during the probe: check its events and "
            "replay endpoints (vLLM: --kv-events-config with enable_kv_cache_events)"
        )
    elif a.malformed > b.malformed:
        detail = f"its events were skipped: {after.last_problem}"
    elif a.unplaced > b.unplaced:
        detail = "its events name parents the service never saw (the blocks are kept unplaced)"
    else:
        detail = (
            "its events came but the index does not hold the probe's blocks under the "
            "replica's namespace: check model, adapter, salt and extra keys against the engine's"
        )
    return ProbeFinding("events", False, detail)


def _hash_finding(
    engine: EngineHashSpec,
    p: int,
    tokens: list[int],
    salt: str | None,
    announced: list[BlockKey | None],
) -> ProbeFinding:
    if any(a is None for a in announced):
        return ProbeFinding("engine hash", False, "the events did not name every probe block")
    mine = EngineHasher(engine, p).block_hashes(tokens, salt=salt, limit=len(announced))
    if mine == announced:
        return ProbeFinding("engine hash", True, f"the events' hashes are {engine.label()}'s")
    for other in _variants(engine):
        theirs = EngineHasher(other, p).block_hashes(tokens, salt=salt, limit=len(announced))
        if theirs == announced:
            diff = [
                f"{f} {getattr(other, f)!r} (configured: {getattr(engine, f)!r})"
                for f in ("engine", "algo", "seed", "int_hashes", "eagle")
                if getattr(other, f) != getattr(engine, f)
            ]
            return ProbeFinding("engine hash", False, "the engine hashes with " + ", ".join(diff))
    return ProbeFinding(
        "engine hash",
        False,
        f"the events' hashes are not {engine.label()}'s, nor any known algorithm's with the "
        "configured or the default seed: is the engine's PYTHONHASHSEED another?",
    )


def _variants(engine: EngineHashSpec) -> list[EngineHashSpec]:
    """Other ways an engine could hash: vLLM's algorithms, seeds (configured, unset, "0") and
    hash forms; SGLang with and without EAGLE."""
    out = []
    for algo in VLLM_ALGOS:
        for seed in dict.fromkeys((engine.seed, None, "0")):
            for int_hashes in (True, False):
                out.append(EngineHashSpec("vllm", algo, seed, int_hashes, dict(engine.lora_paths)))
    out += [EngineHashSpec("sglang", "sha256"), EngineHashSpec("sglang", "sha256", eagle=True)]
    return [v for v in out if dataclasses.astuple(v) != dataclasses.astuple(engine)]
