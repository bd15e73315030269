"""The service's YAML file: replicas, routing policy, tokenizer, index and limits, validated once.

Every mistake raises ConfigError naming the file, the place (``replicas[2].block_size``) and what
is expected; unknown keys are mistakes too, so a misspelt option never passes silently. See
``examples/fleet/fleet.yaml`` for a complete file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prefixcache.blocks.hashing import HASH_FUNCTIONS
from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import ConfigError, PrefixCacheError
from prefixcache.fleet.delivery_check import DeliveryConfig
from prefixcache.fleet.events.engine_keys import EngineHashSpec, parse_engine_hash
from prefixcache.fleet.events.replay_client import (
    DEFAULT_MAX_REPLAY_FRAMES,
    DEFAULT_REPLAY_DEADLINE_S,
)
from prefixcache.fleet.index.url_checks import (
    IN_PROCESS,
    check_index_prefix,
    check_index_url,
    is_cluster_url,
    split_prefix,
)
from prefixcache.fleet.policies import DEFAULT_POLICY, POLICIES, RoutingParams, check_params
from prefixcache.fleet.replica_spec import ReplicaSpec
from prefixcache.fleet.service.configuration.access_config import (
    AccessConfig,
    ServerConfig,
    parse_access,
    parse_server,
)
from prefixcache.fleet.service.configuration.config_reader import ConfigReader
from prefixcache.fleet.whatif.live_curves import WhatIfConfig
from prefixcache.fleet.whatif.trace_recorder import TraceRecordConfig
from prefixcache.text.chat_template import ChatTemplate

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class ReplicaConfig:
    """One engine replica: where to reach it and what its cache holds."""

    name: str
    url: str | None  # OpenAI-compatible base URL, for proxy mode
    events: str | None  # ZMQ endpoint of its KV events (e.g. vLLM's --kv-events-config)
    replay: str | None  # ZMQ endpoint that replays missed events, if the engine has one
    namespace: Namespace  # model, adapter, salt and extra keys its blocks are hashed under
    block_size: int
    capacity_blocks: int  # 0: unknown
    adapters: tuple[str, ...] = ()  # LoRA adapters it serves besides its own (--lora-modules);
    # "*": any adapter (an engine that loads adapters at run time)
    engine_hash: EngineHashSpec | None = None  # its engine's block hashes, when reproducible
    kv_store: str | None = None  # the shared K/V store it is attached to (a name)
    events_bind: bool = False  # the service binds ``events`` and the engine connects to it

    def spec(self) -> ReplicaSpec:
        """The router's view of this replica."""
        return ReplicaSpec(
            self.name,
            self.namespace,
            self.block_size,
            self.capacity_blocks,
            self.adapters,
            self.kv_store,
        )


@dataclass(frozen=True)
class RoutingConfig:
    """Policy name and thresholds (see ``prefixcache.fleet.policies``)."""

    policy: str = DEFAULT_POLICY
    params: RoutingParams = field(default_factory=RoutingParams)
    in_flight_timeout_s: float | None = 600.0  # a routed request's load ends then (None: never)
    # tenant -> GPU blocks per replica: a tenant's prompts prefer replicas where it has room
    tenant_shares: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request and the fleet may be."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_prompt_tokens: int = 262_144
    max_replicas: int = 256
    # a KV event message (any frame of it) larger than this is dropped by ZMQ (ZMQ_MAXMSGSIZE)
    max_event_message_bytes: int = 64 * 1024 * 1024
    # one replay of missed KV events ends by then, or after that many frames (an unfilled gap)
    replay_deadline_s: float = DEFAULT_REPLAY_DEADLINE_S
    max_replay_frames: int = DEFAULT_MAX_REPLAY_FRAMES
    # a read of a shared (Redis) index slower than this is answered from the local view
    redis_read_timeout_s: float = 0.5
    ingest_workers: int = 4  # threads applying KV events (each replica's in order on one)


@dataclass(frozen=True)
class ProxyConfig:
    """Forwarding of OpenAI-compatible requests to the chosen replica."""

    enabled: bool = False
    timeout_s: float = 600.0
    # other replicas a request goes to when its replica refuses the connection (nothing sent)
    connect_retries: int = 2
    # a text completion forwarded as the token ids the service computed (the engine's tokenizer)
    forward_token_ids: bool = False


@dataclass(frozen=True)
class HealthConfig:
    """When a replica stops taking routes, and how it comes back."""

    probe_interval_s: float | None = 5.0  # GET url + probe_path this often; None: never
    probe_timeout_s: float = 2.0
    probe_path: str = "/health"  # vLLM's and SGLang's health endpoint
    down_s: float = 10.0  # a failed probe or request takes the replica out for this long
    attach_probe: bool = True  # probe a replica's hashing and reports when it first answers


@dataclass(frozen=True)
class ServiceConfig:
    """A validated service configuration."""

    replicas: tuple[ReplicaConfig, ...]
    routing: RoutingConfig = RoutingConfig()
    limits: Limits = Limits()
    proxy: ProxyConfig = ProxyConfig()
    tokenizer: str | None = None  # Hugging Face tokenizer.json; None: UTF-8 bytes
    # "memory", "memory+compact", "redis://host:port/db" or "redis+cluster://host:port"
    index: str = "memory"
    hash_algo: str = "xxh3_128"
    source: str = "<config>"
    chat_template: str | None = None  # .jinja or tokenizer_config.json; None: neutral rendering
    health: HealthConfig = HealthConfig()
    # Redis key prefix of the index (None: the URL's ?prefix=, else "prefixcache:fleet", or
    # "{prefixcache:fleet}" on a cluster); deployments sharing one Redis each need their own
    index_prefix: str | None = None
    access: AccessConfig = field(default_factory=AccessConfig)  # API keys, per-key limits
    # predicted against delivered cached tokens: when a replica counts as degraded
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    whatif: WhatIfConfig = field(default_factory=WhatIfConfig)  # live what-if curves
    record_trace: TraceRecordConfig = field(default_factory=TraceRecordConfig)  # routed requests
    server: ServerConfig = field(default_factory=ServerConfig)  # connection and read limits, TLS

    def replica(self, name: str) -> ReplicaConfig | None:
        """The replica called ``name``, or None."""
        return next((r for r in self.replicas if r.name == name), None)


# ---- parsing ------------------------------------------------------------------------------------

_TOP = (
    "replicas", "routing", "limits", "proxy", "health", "tokenizer", "chat_template", "index",
    "index_prefix", "hash_algo", "auth", "server", "tls", "delivery", "whatif", "record_trace",
)  # fmt: skip
_RECORD_TRACE = ("path", "rate", "max_mib", "keep")
_WHATIF = ("enabled", "rate", "max_memory_mib", "counterfactual_rate")
_DELIVERY = ("enabled", "window", "min_requests", "tolerance")
_HEALTH = ("probe_interval_s", "probe_timeout_s", "probe_path", "down_s", "attach_probe")
_REPLICA = (
    "name", "url", "events", "replay", "model", "adapter", "adapter_version", "salt", "extra",
    "block_size", "capacity_blocks", "adapters", "engine_hash", "kv_store", "events_bind",
)  # fmt: skip
_ROUTING = (
    "policy", "balance_abs_threshold", "balance_rel_threshold", "cache_threshold",
    "prefill_weight", "in_flight_timeout_s", "tenant_shares",
)  # fmt: skip
_LIMITS = (
    "max_body_bytes",
    "max_prompt_tokens",
    "max_replicas",
    "max_event_message_bytes",
    "replay_deadline_s",
    "max_replay_frames",
    "redis_read_timeout_s",
    "ingest_workers",
)
MAX_EVENT_MESSAGE_BYTES = 1 << 40  # ZMQ_MAXMSGSIZE is an int64; beyond this is no limit at all
_PROXY = ("enabled", "timeout_s", "connect_retries", "forward_token_ids")


def _replica(r: ConfigReader, raw: Any, where: str) -> ReplicaConfig:
    m = r.mapping(raw, where, _REPLICA)
    name = r.string(m.get("name"), f"{where}.name", optional=False)
    assert name is not None
    if not _NAME.fullmatch(name):
        raise r.fail(
            f"{where}.name",
            f"{name!r} is not a valid name (letters, digits, '.', '_', ':', '-'; 128 at most)",
        )
    model = r.string(m.get("model"), f"{where}.model", optional=False)
    extra = m.get("extra") or []
    if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
        raise r.fail(f"{where}.extra", f"expected a list of strings, got {extra!r}")
    adapters = m.get("adapters") or []
    if not isinstance(adapters, list) or not all(isinstance(x, str) and x for x in adapters):
        raise r.fail(f"{where}.adapters", f"expected a list of adapter names, got {adapters!r}")
    adapter = r.string(m.get("adapter"), f"{where}.adapter")
    adapter_version = r.string(m.get("adapter_version"), f"{where}.adapter_version")
    salt = r.string(m.get("salt"), f"{where}.salt")
    with r.at(where, PrefixCacheError):
        namespace = Namespace(model or "", adapter, adapter_version, salt, tuple(extra))
    with r.at(""):
        engine_hash = parse_engine_hash(m.get("engine_hash"), f"{where}.engine_hash")
    events_bind = r.flag(m.get("events_bind", False), f"{where}.events_bind")
    if events_bind and m.get("events") is None:
        raise r.fail(f"{where}.events_bind", "needs an events endpoint to bind")
    return ReplicaConfig(
        name=name,
        url=r.url(m.get("url"), f"{where}.url"),
        events=r.endpoint(m.get("events"), f"{where}.events", bind=events_bind),
        replay=r.endpoint(m.get("replay"), f"{where}.replay"),
        namespace=namespace,
        block_size=r.integer(m.get("block_size", 16), f"{where}.block_size", 1),
        capacity_blocks=r.integer(m.get("capacity_blocks", 0), f"{where}.capacity_blocks", 0),
        adapters=tuple(adapters),
        engine_hash=engine_hash,
        kv_store=_store_name(r, m.get("kv_store"), f"{where}.kv_store"),
        events_bind=events_bind,
    )


def _store_name(r: ConfigReader, value: Any, where: str) -> str | None:
    """A shared store's name, as replicas attached to the same store give it."""
    name = r.string(value, where)
    if name is not None and not _NAME.fullmatch(name):
        raise r.fail(where, f"{name!r} is not a valid store name (as replica names)")
    return name


def parse_config(
    data: Any, source: str = "<config>", base_dir: Path | None = None
) -> ServiceConfig:
    """A ServiceConfig from parsed YAML (one reader of each section below); relative tokenizer
    and chat template paths are taken from ``base_dir``. ConfigError names the first mistake."""
    r = ConfigReader(source)
    top = r.mapping(data, "", _TOP)
    if data is None:
        raise r.fail("", "the file is empty; it needs at least a 'replicas' list")
    limits = _limits(r, top.get("limits"))  # the sections in order: the first mistake is said
    replicas = _replicas(r, top.get("replicas"), limits.max_replicas)
    routing = _routing(r, top.get("routing"))
    proxy = _proxy(r, top.get("proxy"))
    health = _health(r, top.get("health"))
    tokenizer = _tokenizer(r, top.get("tokenizer"), base_dir)
    chat_template = _chat_template(r, top.get("chat_template"), base_dir)
    index, index_prefix = _index(r, top.get("index", "memory"), top.get("index_prefix"))
    hash_algo = _hash_algo(r, top.get("hash_algo", "xxh3_128"))
    delivery = _delivery(r, top.get("delivery"))
    whatif = _whatif(r, top.get("whatif"))
    record_trace = _record_trace(r, top.get("record_trace"), base_dir)
    return ServiceConfig(
        replicas,
        routing,
        limits,
        proxy,
        tokenizer,
        index,
        hash_algo,
        source,
        chat_template,
        health,
        index_prefix,
        access=parse_access(r, top.get("auth"), base_dir),
        server=parse_server(r, top.get("server"), top.get("tls"), base_dir),
        delivery=delivery,
        whatif=whatif,
        record_trace=record_trace,
    )


def _limits(r: ConfigReader, raw: Any) -> Limits:
    """``limits``: sizes and deadlines, each with its floor."""
    lim = r.mapping(raw, "limits", _LIMITS)
    d = Limits()
    limits = Limits(
        r.integer(lim.get("max_body_bytes", d.max_body_bytes), "limits.max_body_bytes", 1024),
        r.integer(lim.get("max_prompt_tokens", d.max_prompt_tokens), "limits.max_prompt_tokens", 1),
        r.integer(lim.get("max_replicas", d.max_replicas), "limits.max_replicas", 1),
        r.integer(
            lim.get("max_event_message_bytes", d.max_event_message_bytes),
            "limits.max_event_message_bytes",
            1024,
        ),
        r.number(lim.get("replay_deadline_s", d.replay_deadline_s), "limits.replay_deadline_s"),
        r.integer(lim.get("max_replay_frames", d.max_replay_frames), "limits.max_replay_frames", 2),
        r.number(
            lim.get("redis_read_timeout_s", d.redis_read_timeout_s), "limits.redis_read_timeout_s"
        ),
        r.integer(lim.get("ingest_workers", d.ingest_workers), "limits.ingest_workers", 1),
    )
    if limits.max_event_message_bytes > MAX_EVENT_MESSAGE_BYTES:
        raise r.fail(
            "limits.max_event_message_bytes",
            f"expected at most {MAX_EVENT_MESSAGE_BYTES}, got {limits.max_event_message_bytes}",
        )
    return limits


def _replicas(r: ConfigReader, raw: Any, max_replicas: int) -> tuple[ReplicaConfig, ...]:
    """``replicas``: a non-empty list of at most ``max_replicas``, names unique."""
    if not isinstance(raw, list) or not raw:
        raise r.fail("replicas", "expected a non-empty list of replicas")
    if len(raw) > max_replicas:
        raise r.fail(
            "replicas", f"{len(raw)} replicas, more than limits.max_replicas ({max_replicas})"
        )
    replicas = tuple(_replica(r, entry, f"replicas[{i}]") for i, entry in enumerate(raw))
    seen: set[str] = set()
    for i, rep in enumerate(replicas):
        if rep.name in seen:
            raise r.fail(f"replicas[{i}].name", f"duplicate replica name {rep.name!r}")
        seen.add(rep.name)
    return replicas


def _routing(r: ConfigReader, raw: Any) -> RoutingConfig:
    """``routing``: the policy, its parameters and how long an unreleased route counts."""
    rt = r.mapping(raw, "routing", _ROUTING)
    policy = rt.get("policy", DEFAULT_POLICY)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise r.fail(
            "routing.policy",
            f"unknown policy {policy!r}; choose one of {', '.join(sorted(POLICIES))}",
        )
    d = RoutingParams()
    with r.at("routing"):
        params = check_params(
            RoutingParams(
                rt.get("balance_abs_threshold", d.balance_abs_threshold),
                rt.get("balance_rel_threshold", d.balance_rel_threshold),
                rt.get("cache_threshold", d.cache_threshold),
                rt.get("prefill_weight", d.prefill_weight),
            )
        )
    timeout = rt.get("in_flight_timeout_s", RoutingConfig.in_flight_timeout_s)
    if timeout is not None:  # null: loads end only when released
        timeout = r.number(timeout, "routing.in_flight_timeout_s")
    shares = rt.get("tenant_shares", {})
    if not isinstance(shares, dict):
        raise r.fail(
            "routing.tenant_shares", f"expected a mapping of tenant to blocks, got {shares!r}"
        )
    for tenant, blocks in shares.items():
        if not isinstance(tenant, str) or not tenant or ":" in tenant:
            raise r.fail("routing.tenant_shares", f"expected a tenant name, got {tenant!r}")
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise r.fail(
                f"routing.tenant_shares.{tenant}",
                f"expected a positive number of GPU blocks per replica, got {blocks!r}",
            )
    return RoutingConfig(policy, params, timeout, dict(shares))


def _proxy(r: ConfigReader, raw: Any) -> ProxyConfig:
    """``proxy``: whether the OpenAI-compatible endpoints forward, their timeout, how many
    other replicas a request whose replica refused the connection goes to, and whether a text
    completion goes on as token ids."""
    px = r.mapping(raw, "proxy", _PROXY)
    enabled = r.flag(px.get("enabled", False), "proxy.enabled")
    forward_token_ids = r.flag(px.get("forward_token_ids", False), "proxy.forward_token_ids")
    return ProxyConfig(
        enabled,
        r.number(px.get("timeout_s", 600.0), "proxy.timeout_s"),
        r.integer(px.get("connect_retries", 2), "proxy.connect_retries", 0),
        forward_token_ids,
    )


def _health(r: ConfigReader, raw: Any) -> HealthConfig:
    """``health``: the replicas' probes and how long a failed replica stays down."""
    hc = r.mapping(raw, "health", _HEALTH)
    hd = HealthConfig()
    interval = hc.get("probe_interval_s", hd.probe_interval_s)
    if interval is not None:  # null: no probes (failed requests still take a replica out)
        interval = r.number(interval, "health.probe_interval_s")
    probe_path = hc.get("probe_path", hd.probe_path)
    if not isinstance(probe_path, str) or not probe_path.startswith("/"):
        raise r.fail("health.probe_path", f"expected a path starting with '/', got {probe_path!r}")
    attach_probe = r.flag(hc.get("attach_probe", hd.attach_probe), "health.attach_probe")
    return HealthConfig(
        interval,
        r.number(hc.get("probe_timeout_s", hd.probe_timeout_s), "health.probe_timeout_s"),
        probe_path,
        r.number(hc.get("down_s", hd.down_s), "health.down_s"),
        attach_probe,
    )


def _delivery(r: ConfigReader, raw: Any) -> DeliveryConfig:
    """``delivery``: how many engine reports a replica's verdict reads, and how far off."""
    dc = r.mapping(raw, "delivery", _DELIVERY)
    d = DeliveryConfig()
    enabled = r.flag(dc.get("enabled", True), "delivery.enabled")
    window = r.integer(dc.get("window", d.window), "delivery.window", 1)
    min_requests = r.integer(dc.get("min_requests", d.min_requests), "delivery.min_requests", 1)
    if min_requests > window:
        raise r.fail("delivery.min_requests", f"must be at most the window ({window})")
    tolerance = r.share(dc.get("tolerance", d.tolerance), "delivery.tolerance")
    return DeliveryConfig(enabled, window, min_requests, tolerance)


def _whatif(r: ConfigReader, raw: Any) -> WhatIfConfig:
    """``whatif``: the live curves' sampling rate and memory bound."""
    wc = r.mapping(raw, "whatif", _WHATIF)
    if wc.get("counterfactual_rate", 0) != 0:  # once the shadow fleets' rate; 0 was off
        raise r.fail(
            "whatif.counterfactual_rate",
            "no longer a setting: counterfactual fleets come from a replay of the recorded "
            "trace (record_trace.path, then POST /v1/whatif/counterfactuals; docs/service.md)",
        )
    w = WhatIfConfig()
    enabled = r.flag(wc.get("enabled", w.enabled), "whatif.enabled")
    rate = r.share(wc.get("rate", w.rate), "whatif.rate")
    memory = r.number(wc.get("max_memory_mib", w.max_memory_mib), "whatif.max_memory_mib")
    return WhatIfConfig(enabled, rate, memory)


def _record_trace(r: ConfigReader, raw: Any, base_dir: Path | None) -> TraceRecordConfig:
    """``record_trace``: where the routed requests are written (relative to the config's
    folder), which share of them, and the rotation."""
    rc = r.mapping(raw, "record_trace", _RECORD_TRACE)
    d = TraceRecordConfig()
    path = r.string(rc.get("path"), "record_trace.path")
    if path is not None and base_dir is not None and not Path(path).is_absolute():
        path = str(base_dir / path)
    rate = r.share(rc.get("rate", d.rate), "record_trace.rate")
    max_mib = r.number(rc.get("max_mib", d.max_mib), "record_trace.max_mib")
    keep = r.integer(rc.get("keep", d.keep), "record_trace.keep", 0)
    return TraceRecordConfig(path, rate, max_mib, keep)


def _tokenizer(r: ConfigReader, raw: Any, base_dir: Path | None) -> str | None:
    """``tokenizer``: a tokenizer.json file, or None for ``bytes`` (UTF-8 bytes as ids)."""
    tokenizer = r.string(raw, "tokenizer")
    if tokenizer is None or tokenizer == "bytes":
        return None
    return str(r.existing_file(tokenizer, "tokenizer", base_dir))


def _chat_template(r: ConfigReader, raw: Any, base_dir: Path | None) -> str | None:
    """``chat_template``: a template file that compiles and names a template."""
    chat_template = r.string(raw, "chat_template")
    if chat_template is None:
        return None
    path = r.existing_file(chat_template, "chat_template", base_dir)
    with r.at("chat_template"):
        ChatTemplate.load(path)
    return str(path)


def _index(r: ConfigReader, raw: Any, raw_prefix: Any) -> tuple[str, str | None]:
    """``index`` (memory, or a Redis URL) and ``index_prefix``, which must agree with a prefix
    the URL names."""
    with r.at(""):
        index = check_index_url(raw)
    if raw_prefix is None:
        return index, None
    with r.at(""):
        check_index_prefix(raw_prefix, "index_prefix", cluster=is_cluster_url(index))
    in_url = split_prefix(index)[1] if index not in IN_PROCESS else None
    if in_url is not None and in_url != raw_prefix:
        raise r.fail(
            "index_prefix",
            f"{raw_prefix!r}, but the index URL names the prefix {in_url!r}; give one",
        )
    return index, raw_prefix


def _hash_algo(r: ConfigReader, raw: Any) -> str:
    """``hash_algo``: one of prefixcache's block hash functions."""
    if not isinstance(raw, str) or raw not in HASH_FUNCTIONS:
        raise r.fail(
            "hash_algo", f"unknown hash {raw!r}; choose one of {', '.join(HASH_FUNCTIONS)}"
        )
    return raw


def load_config(path: str | Path) -> ServiceConfig:
    """Read and validate a service YAML file; ConfigError saying what is wrong otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    return parse_config(data, str(path), path.parent)
