"""Health probes of the replicas that have a ``url`` (``health.probe_interval_s`` set; proxy and
route-API mode alike): a replica that fails a probe takes no routes for a while, one that answers
takes routes again. A replica that answers for the first time gets the attach probe
(``attach_probe``, with ``health.attach_probe``)."""

from __future__ import annotations

import asyncio
from contextlib import suppress

from prefixcache.errors import UnknownReplicaError
from prefixcache.fleet.service.dispatch import FleetService


async def probe_replicas(service: FleetService) -> None:
    """Every ``health.probe_interval_s``, GET each replica's URL + ``health.probe_path``: a
    failure (no answer in time, or not a 2xx) takes it out of routing for ``health.down_s`` (at
    least until the next probe), a success brings it back. Runs until cancelled."""
    import httpx

    health = service.config.health
    interval = health.probe_interval_s
    assert interval is not None
    # down at least until the next probe has had its time to answer
    down_s = max(health.down_s, interval + health.probe_timeout_s)
    router = service.router
    attached: set[str] = set()
    probing: set[asyncio.Task[object]] = set()  # held until done
    async with httpx.AsyncClient(timeout=health.probe_timeout_s) as client:
        while True:
            targets = [
                (spec.name, f"{url}{health.probe_path}")
                for spec in router.replicas()
                if (url := service.urls.get(spec.name))
            ]
            answers = await asyncio.gather(
                *(client.get(url) for _, url in targets), return_exceptions=True
            )
            for (name, _), answer in zip(targets, answers, strict=True):
                with suppress(UnknownReplicaError):  # removed from the fleet meanwhile
                    if isinstance(answer, BaseException):
                        reason = f"health probe failed: {type(answer).__name__}"
                        router.mark_down(name, down_s, reason)
                    elif not answer.is_success:
                        reason = f"health probe answered HTTP {answer.status_code}"
                        router.mark_down(name, down_s, reason)
                    else:
                        router.mark_up(name)
                        if health.attach_probe and name not in attached:
                            attached.add(name)
                            task = asyncio.create_task(_attach(service, name))
                            probing.add(task)
                            task.add_done_callback(probing.discard)
            await asyncio.sleep(interval)


async def _attach(service: FleetService, name: str) -> object:
    """The attach probe of a replica that answered for the first time; its failures are
    findings, logged, never raised."""
    from prefixcache.fleet.service.attach_probe import probe_replica

    with suppress(UnknownReplicaError):
        return await probe_replica(service, name)
    return None
