"""The service's own endpoints: ``POST /v1/lookup``, ``POST /v1/route``,
``POST /v1/release``, ``GET /v1/replicas``, ``POST /v1/replicas/{name}/probe``,
``GET /v1/models``, ``GET /v1/stats``, ``GET /v1/whatif``, ``POST`` and
``GET /v1/whatif/counterfactuals``, ``GET /dashboard``, ``GET /healthz``, ``GET /health`` and
``GET /metrics`` (``API_ROUTES``; proxy mode adds ``POST /v1/completions`` and
``POST /v1/chat/completions``, ``proxy.py``), module functions that ``add_api_routes`` registers
on the app's own router as plain Starlette routes: each takes the ``Request`` and answers a
``Response`` itself, so FastAPI's parameter and dependency machinery (and an included router's
extra hop) is not paid per request. Each handler finds the ``FleetService`` in
``request.app.state.service``.

A request has passed the ``access`` gate when keys are configured (``/v1/replicas`` and
``/metrics`` then only with an operator key); lookups and routes count against the caller's rate
limit and see only the caller's tenant. Bodies are read within the size and time limits and
decoded strictly before the router is called, and the router validates before it records
anything, so bad input changes nothing. Work that may block (tokenizing, a long prompt's hashing,
a remote index) runs off the event loop (``FleetService.runs_inline``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.routing import Route

from prefixcache.fleet.delivery_check import DeliveryState
from prefixcache.fleet.index.interface import GPU
from prefixcache.fleet.policies import ReplicaScore
from prefixcache.fleet.replica_health import ReplicaHealth
from prefixcache.fleet.replica_spec import ANY_ADAPTER
from prefixcache.fleet.service.bodies import PromptBody, ReleaseBody, RouteBody, decode_body
from prefixcache.fleet.service.dashboard import dashboard
from prefixcache.fleet.service.dispatch import FleetService
from prefixcache.fleet.service.guards.access import caller_of
from prefixcache.fleet.service.metrics import CONTENT_TYPE
from prefixcache.fleet.whatif.counterfactual_replay import CounterfactualBody


def _json(data: Any) -> Response:
    return Response(msgspec.json.encode(data), media_type="application/json")


def _score(score: ReplicaScore) -> dict[str, Any]:
    return score._asdict()


def _health(health: ReplicaHealth | None) -> dict[str, Any]:
    if health is None:  # removed while the listing was built
        return {"up": False, "down_for_s": 0.0, "down_reason": "", "marked_down": 0}
    return {
        "up": health.up,
        "down_for_s": round(health.down_for_s, 3),
        "down_reason": health.reason,
        "marked_down": health.marked_down,
    }


def _delivery(state: DeliveryState) -> dict[str, Any]:
    return {
        "degraded": state.degraded,
        "degraded_reason": state.reason,
        "delivery": {
            "requests": state.requests,
            "predicted_hits": state.predicted_hits,
            "under_delivered": state.under,
            "over_delivered": state.over,
            "mean_predicted_tokens": round(state.mean_predicted, 1),
            "mean_delivered_tokens": round(state.mean_delivered, 1),
            "degraded_times": state.degraded_times,
        },
    }


async def lookup(request: Request) -> Response:
    """Cached prompt tokens per replica serving the prompt's namespace (within the caller's
    tenant)."""
    service: FleetService = request.app.state.service
    caller = caller_of(request)
    service.limits.take(caller)
    body = decode_body(await service.read_body(request, caller), PromptBody)
    result = await service.lookup(body, caller)
    return _json(
        {
            "namespace": result.namespace.label(),
            "prompt_tokens": result.prompt_tokens,
            "replicas": [_score(s) for s in result.scores],
        }
    )


async def route(request: Request) -> Response:
    """Choose a replica for the prompt; with a request_id, count it as load. ``cache_salt`` is
    the salt to send the engine with the request (the caller's tenant salt), so that its blocks
    are indexed where the caller's later routes find them."""
    service: FleetService = request.app.state.service
    caller = caller_of(request)
    service.limits.take(caller)
    body = decode_body(await service.read_body(request, caller), RouteBody)
    decision = await service.route(body, caller)
    return _json(
        {
            "replica": decision.replica,
            "url": service.urls.get(decision.replica),
            "policy": decision.policy,
            "rule": decision.rule,
            "request_id": body.request_id,
            "cache_salt": caller.salt(body.salt),
            "prompt_tokens": decision.prompt_tokens,
            "cached_tokens": decision.cached_tokens,
            "gpu_cached_tokens": decision.gpu_cached_tokens,
            "scores": [_score(s) for s in decision.scores],
        }
    )


async def release(request: Request) -> Response:
    """End a routed request's load (the caller's own request of that id)."""
    service: FleetService = request.app.state.service
    caller = caller_of(request)
    body = decode_body(await service.read_body(request, caller), ReleaseBody)
    released = await service.release(body.request_id, caller, body.cached_tokens)
    return _json(released._asdict())


def replica_rows(service: FleetService) -> list[dict[str, Any]]:
    """One row per replica: its config, load and health, and the blocks the index holds for
    it (one round trip each on a shared index)."""
    router, config = service.router, service.config
    loads = {load.name: load for load in router.loads()}
    health = {h.name: h for h in router.health()}
    specs = router.replicas()
    names = [spec.name for spec in specs]
    held = router.index.num_blocks_many(names)
    on_gpu = router.index.num_blocks_many(names, GPU)
    out = []
    for spec in specs:
        rc = config.replica(spec.name)
        load = loads.get(spec.name)
        ns = spec.namespace
        out.append(
            {
                "name": spec.name,
                "url": rc.url if rc else None,
                "events": rc.events if rc else None,
                "replay": rc.replay if rc else None,
                "model": ns.model,
                "adapter": ns.adapter,
                "adapter_version": ns.adapter_version,
                "salt": ns.salt,
                "extra": list(ns.extra),
                "namespace": ns.label(),
                "block_size": spec.block_size,
                "capacity_blocks": spec.capacity_blocks,
                "in_flight": load.in_flight if load else 0,
                "in_flight_tokens": load.in_flight_tokens if load else 0,
                "index_blocks": held[spec.name],
                "index_gpu_blocks": on_gpu[spec.name],
                **_health(health.get(spec.name)),
                **_delivery(service.delivery.state(spec.name)),
                "probe": last.as_dict() if (last := service.probes.get(spec.name)) else None,
            }
        )
    return out


async def replicas(request: Request) -> Response:
    """Every replica: config, load and the blocks the index holds for it."""
    service: FleetService = request.app.state.service
    rows = await run_in_threadpool(replica_rows, service)  # the index may be remote (Redis)
    return _json({"policy": service.router.policy, "replicas": rows})


async def healthz(request: Request) -> Response:
    """Liveness: the service answers and knows its replicas."""
    service: FleetService = request.app.state.service
    router = service.router
    return _json(
        {
            "status": "ok",
            "replicas": len(router.replicas()),
            "replicas_up": sum(h.up for h in router.health()),
            "replicas_degraded": len(service.delivery.degraded()),
            "policy": router.policy,
            "proxy": service.proxying,
            "ingest": service.ingest is not None,
        }
    )


def served_models(service: FleetService) -> list[str]:
    """The model names the replicas serve, as OpenAI requests name them: the base model of a
    replica without an adapter of its own, and each LoRA adapter a replica has as its own or
    lists (``*`` lists none), in the order of the configuration."""
    names: dict[str, None] = {}
    for spec in service.router.replicas():
        own = spec.namespace
        names[own.model if own.adapter is None else own.adapter] = None
        names.update((a, None) for a in spec.adapters if a != ANY_ADAPTER)
    return list(names)


async def probe(request: Request) -> Response:
    """Run the attach probe of one replica now (operator keys only) and answer its findings."""
    from prefixcache.fleet.service.attach_probe import probe_replica

    service: FleetService = request.app.state.service
    result = await probe_replica(service, request.path_params["name"])
    return _json({"replica": result.replica, **result.as_dict()})


async def whatif(request: Request) -> Response:
    """The live what-if curves (operator keys only): per replica and for the fleet as one
    cache, the estimated hit rate with more or less KV memory."""
    service: FleetService = request.app.state.service
    return _json(await run_in_threadpool(service.observers.report))


async def start_counterfactuals(request: Request) -> Response:
    """Start replaying the recorded trace for N-1, N+1, 2N replicas and each other policy (or
    the body's ``scenarios``), operator keys only: 202 with the job's state, 409 when one runs
    already or no trace can answer."""
    service: FleetService = request.app.state.service
    raw = await service.read_body(request, caller_of(request))
    body = decode_body(raw, CounterfactualBody) if raw.strip() else CounterfactualBody()
    limit = service.config.limits.max_replicas
    state = await run_in_threadpool(service.observers.counterfactuals.start, body, limit)
    return Response(msgspec.json.encode(state), 202, media_type="application/json")


async def counterfactuals(request: Request) -> Response:
    """The last counterfactual job's state and answers (operator keys only)."""
    service: FleetService = request.app.state.service
    return _json(service.observers.counterfactuals.report())


async def models(request: Request) -> Response:
    """The served models in OpenAI's list format, as vLLM's ``GET /v1/models`` answers."""
    service: FleetService = request.app.state.service
    created = int(service.started_at)
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "prefixcache"}
        for name in served_models(service)
    ]
    return _json({"object": "list", "data": data})


async def health(request: Request) -> Response:
    """200 while the service is up, with an empty body, as vLLM's ``GET /health``; the replicas
    whose engines deliver off the predictions are counted in ``x-prefixcache-degraded`` (named,
    with the reasons, in the operator's ``/v1/replicas``)."""
    degraded = request.app.state.service.delivery.degraded()
    headers = {"x-prefixcache-degraded": str(len(degraded))} if degraded else None
    return Response(status_code=200, headers=headers)


async def stats(request: Request) -> Response:
    """Where reuse went, per tenant and model, over the requests whose engine reported its
    cached tokens: the best any replica held (available), what the chosen one held (captured)
    and what the engine served (delivered). A tenant key sees its own tenant's rows."""
    service: FleetService = request.app.state.service
    caller = caller_of(request)
    rows = []
    for (tenant, model), a in sorted(service.delivery.attribution().items()):
        if caller.tenant is not None and tenant != caller.tenant:
            continue
        rows.append({"tenant": tenant or None, "model": model, **a._asdict()})
    body: dict[str, Any] = {"attribution": rows}
    if caller.operator:
        body["unreported_requests"] = service.delivery.unreported
        body["degraded"] = service.delivery.degraded()
    return _json(body)


async def metrics(request: Request) -> Response:
    """Prometheus exposition of the service's own registry."""
    service: FleetService = request.app.state.service
    # off the event loop: the index may be remote, and ingest counters are read in a thread
    body = await run_in_threadpool(service.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)


API_ROUTES = (  # (path, handler, method): every endpoint of the service's own
    ("/v1/lookup", lookup, "POST"),
    ("/v1/route", route, "POST"),
    ("/v1/release", release, "POST"),
    ("/v1/replicas", replicas, "GET"),
    ("/v1/replicas/{name}/probe", probe, "POST"),
    ("/v1/models", models, "GET"),
    ("/v1/stats", stats, "GET"),
    ("/v1/whatif", whatif, "GET"),
    ("/v1/whatif/counterfactuals", start_counterfactuals, "POST"),
    ("/v1/whatif/counterfactuals", counterfactuals, "GET"),
    ("/dashboard", dashboard, "GET"),
    ("/healthz", healthz, "GET"),
    ("/health", health, "GET"),
    ("/metrics", metrics, "GET"),
)


def add_api_routes(app: FastAPI) -> None:
    """Register the service's own endpoints (``API_ROUTES``) on ``app``."""
    for path, endpoint, method in API_ROUTES:
        app.router.routes.append(Route(path, endpoint, methods=[method]))
