"""The service's one composition root: ``build_service`` builds, from a ``ServiceConfig``, every
part the service runs with, then the ``FleetService`` over them and the FastAPI app over that.

In order: the fleet index (``config.index``, unless a ready one is given: ``open_config_index``);
the router over it (``build_router``); the KV-event subscriber of the replicas with an event
endpoint (``build_subscriber``, unless an ingest source or None is given), whose unplaced
blocks and tenant tallies the router consults; the tokenizer and chat template; the metrics, the
per-key limits, the delivery check, the route observers (live what-if curves, trace recorder,
counterfactual replay; ``route_observers``) and the replicas' HTTP client; the ``FleetService``
holding them; the app (``app.serving_app``), whose lifespan starts and stops what runs.

``prefixcache serve`` (``startup.open_service``, in each ``--workers`` process too), the tests
and the benchmarks all build the service with this one call; no part builds another.
"""

from __future__ import annotations

import enum
from typing import Literal

from fastapi import FastAPI

from prefixcache.errors import ConfigError
from prefixcache.fleet.delivery_check import DeliveryCheck
from prefixcache.fleet.events.ingest import IngestSource, IngestStats
from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
from prefixcache.fleet.events.unplaced_lookup import UnplacedLookup
from prefixcache.fleet.index.from_url import open_index
from prefixcache.fleet.index.interface import FleetIndex
from prefixcache.fleet.index.url_checks import IN_PROCESS
from prefixcache.fleet.router import Router
from prefixcache.fleet.service.app import serving_app
from prefixcache.fleet.service.configuration.config_file import ServiceConfig
from prefixcache.fleet.service.dispatch import FleetService
from prefixcache.fleet.service.guards.key_limits import KeyLimits
from prefixcache.fleet.service.metrics import ServiceMetrics
from prefixcache.fleet.service.openai_proxy.replica_client import ReplicaClient
from prefixcache.fleet.service.route_observers import RouteObservers
from prefixcache.fleet.whatif.counterfactual_replay import CounterfactualReplay
from prefixcache.fleet.whatif.live_curves import LiveCurves
from prefixcache.fleet.whatif.trace_recorder import TraceRecorder
from prefixcache.text.chat_template import ChatTemplate
from prefixcache.text.prefix_tokenizer import PrefixTokenizer
from prefixcache.text.tokenizers import HFTokenizer, Tokenizer, load_tokenizer


class IngestChoice(enum.Enum):
    """Where the service's ingest comes from when none is given."""

    FROM_CONFIG = "from the config"  # a KVEventSubscriber of the config's replicas


def open_config_index(config: ServiceConfig) -> FleetIndex:
    """The index ``config.index`` names, under ``config.index_prefix`` (a shared one with the
    config's read timeout). Raises PrefixCacheError or OSError for an unusable index."""
    if config.index in IN_PROCESS:
        return open_index(config.index, prefix=config.index_prefix)
    read_timeout = config.limits.redis_read_timeout_s
    return open_index(config.index, prefix=config.index_prefix, read_timeout=read_timeout)


def build_router(config: ServiceConfig, index: FleetIndex) -> Router:
    """The router ``config`` describes (replicas, policy, limits, timeout), over ``index``."""
    return Router(
        index,
        [r.spec() for r in config.replicas],
        config.routing.policy,
        config.routing.params,
        hash_algo=config.hash_algo,
        max_prompt_tokens=config.limits.max_prompt_tokens,
        in_flight_timeout=config.routing.in_flight_timeout_s,
    )


def build_subscriber(config: ServiceConfig, index: FleetIndex) -> KVEventSubscriber:
    """The KV-event subscriber feeding ``index`` from every replica of ``config`` with an event
    endpoint, within the config's limits (started and stopped with the app)."""
    return KVEventSubscriber(
        index,
        [
            ReplicaEndpoint(
                r.name,
                r.events,
                r.replay,
                r.namespace,
                r.block_size,
                hash_algo=config.hash_algo,
                engine_hash=r.engine_hash,
                kv_store=r.kv_store,
                bind=r.events_bind,
            )
            for r in config.replicas
            if r.events is not None
        ],
        max_replicas=config.limits.max_replicas,
        max_message_bytes=config.limits.max_event_message_bytes,
        replay_deadline=config.limits.replay_deadline_s,
        max_replay_frames=config.limits.max_replay_frames,
        ingest_workers=config.limits.ingest_workers,
    )


def build_route_observers(config: ServiceConfig, router: Router) -> RouteObservers:
    """The live curves, the trace recorder (when ``record_trace.path`` is set; its file opened
    now) and the counterfactual replay over that trace, behind one ``RouteObservers``."""
    curves = LiveCurves(config.whatif, router.replicas)
    recorder = None
    if config.record_trace.path is not None:
        recorder = TraceRecorder(config.record_trace, [r.block_size for r in config.replicas])
    return RouteObservers(
        curves, recorder, CounterfactualReplay(recorder, router.replicas, router.policy)
    )


def _tokenizer(config: ServiceConfig) -> Tokenizer:
    """The tokenizer of ``config`` (UTF-8 bytes without one); a Hugging Face one tokenizes a
    text's leading segments once, as prompts share their beginnings."""
    tokenizer = load_tokenizer(config.tokenizer)
    return PrefixTokenizer(tokenizer) if isinstance(tokenizer, HFTokenizer) else tokenizer


def build_service(
    config: ServiceConfig,
    *,
    index: FleetIndex | None = None,
    ingest: IngestSource | Literal[IngestChoice.FROM_CONFIG] | None = IngestChoice.FROM_CONFIG,
) -> FastAPI:
    """The service ``config`` describes, as its FastAPI app (the ``FleetService`` is
    ``app.state.service``). ``index``: a ready index (default: ``open_config_index``).
    ``ingest``: started when the app starts and stopped when it stops, its counters exported
    when it implements ``IngestStats`` (default: ``build_subscriber``; None: no ingest). Raises
    ConfigError for an unusable config, PrefixCacheError or OSError for an unusable index."""
    if config.proxy.enabled:
        missing = [r.name for r in config.replicas if r.url is None]
        if missing:
            raise ConfigError(f"proxy mode needs a url for every replica; missing: {missing}")
    if index is None:
        index = open_config_index(config)
    router = build_router(config, index)
    if ingest is IngestChoice.FROM_CONFIG:
        ingest = build_subscriber(config, index)
    if isinstance(ingest, KVEventSubscriber) and config.routing.tenant_shares:
        # room per tenant, from the replicas' events
        router.attach_tenant_shares(config.routing.tenant_shares, ingest.tenant_gpu_blocks)
    held = getattr(ingest, "unplaced", None)  # a KV-event subscriber's unplaced blocks
    if isinstance(held, UnplacedLookup):
        held.use_engine_hashes({r.name: r.engine_hash for r in config.replicas if r.engine_hash})
        router.attach_held(held)
    tokenizer = _tokenizer(config)
    metrics = ServiceMetrics(router, ingest if isinstance(ingest, IngestStats) else None)
    chat_template = None
    if config.chat_template is not None:
        chat_template = ChatTemplate.load(config.chat_template)
    delivery = DeliveryCheck(config.delivery)
    metrics.watch_delivery(delivery, router)
    observers = build_route_observers(config, router)
    metrics.watch_whatif(observers.curves)
    if observers.watching:
        router.attach_observer(observers.observe)
    timeout = config.proxy.timeout_s
    service = FleetService(
        config,
        router,
        tokenizer=tokenizer,
        chat_template=chat_template,
        metrics=metrics,
        limits=KeyLimits(config.access, metrics, router.in_flight_among),
        delivery=delivery,
        observers=observers,
        http_client=ReplicaClient(timeout, min(10.0, timeout)),
        ingest=ingest,
    )
    return serving_app(service)
