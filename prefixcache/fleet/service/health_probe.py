"""Health probes of the replicas that have a ``url`` (``health.probe_interval_s`` set; proxy and
route-API mode alike): a replica that fails a probe takes no routes for a while, one that answers
takes routes again. A replica that answers for the first time gets the attach probe
(``attach_probe``, with ``health.attach_probe``).

A replica that answers again after being down (a failed probe, or a forwarded request that could
not connect) may have restarted with an empty cache while the index still holds its old blocks:
before it takes routes again, the KV-event subscriber checks its stream (``recovered``: the
engine's replay endpoint still has the last batch applied, or the replica is cleared), and a
restarted replica gets the attach probe again.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress

from prefixcache.errors import UnknownReplicaError
from prefixcache.fleet.service.dispatch import FleetService

log = logging.getLogger("prefixcache.fleet")


async def probe_replicas(service: FleetService) -> None:
    """Every ``health.probe_interval_s``, GET each replica's URL + ``health.probe_path``: a
    failure (no answer in time, or not a 2xx) takes it out of routing for ``health.down_s`` (at
    least until the next probe), a success brings it back, after the restart check when it was
    down. Runs until cancelled."""
    health = service.config.health
    interval = health.probe_interval_s
    assert interval is not None
    # down at least until the next probe has had its time to answer
    down_s = max(health.down_s, interval + health.probe_timeout_s)
    router = service.router
    attached: set[str] = set()
    probing: set[asyncio.Task[object]] = set()  # held until done
    suspects: set[str] = set()  # went down since they last answered
    times_down: dict[str, int] = {}
    client = service.http_client
    while True:
        targets = [
            (spec.name, f"{url}{health.probe_path}")
            for spec in router.replicas()
            if (url := service.urls.get(spec.name))
        ]
        for state in router.health():  # marked down since the last round (a request)
            if state.marked_down != times_down.get(state.name, 0):
                times_down[state.name] = state.marked_down
                suspects.add(state.name)
        answers = await asyncio.gather(
            *(client.get(url, health.probe_timeout_s) for _, url in targets),
            return_exceptions=True,
        )
        back, answered = [], []
        for (name, _), answer in zip(targets, answers, strict=True):
            with suppress(UnknownReplicaError):  # removed from the fleet meanwhile
                if isinstance(answer, BaseException):
                    kind = getattr(answer, "kind", type(answer).__name__)
                    reason = f"health probe failed: {kind}"
                    router.mark_down(name, down_s, reason)
                    suspects.add(name)
                elif not 200 <= answer < 300:
                    reason = f"health probe answered HTTP {answer}"
                    router.mark_down(name, down_s, reason)
                    suspects.add(name)
                elif name in suspects:
                    back.append(name)  # up once its stream is checked
                else:
                    router.mark_up(name)
                    answered.append(name)
        restarted = await asyncio.gather(*(_recovered(service, name) for name in back))
        for name, fresh in zip(back, restarted, strict=True):
            suspects.discard(name)
            with suppress(UnknownReplicaError):
                router.mark_up(name)
                answered.append(name)
                if fresh:
                    log.warning(
                        "replica %s restarted: its blocks are out of the index; probing it again",
                        name,
                    )
                    attached.discard(name)
        for name in answered:
            if health.attach_probe and name not in attached:
                attached.add(name)
                task = asyncio.create_task(_attach(service, name))
                probing.add(task)
                task.add_done_callback(probing.discard)
        for state in router.health():
            times_down[state.name] = state.marked_down
        await asyncio.sleep(interval)


async def _recovered(service: FleetService, name: str) -> bool:
    """Whether replica ``name``, answering again after being down, restarted (the subscriber
    then cleared it); True when nothing can tell (no KV-event subscriber)."""
    check = getattr(service.ingest, "recovered", None)
    if not callable(check):
        return True
    return bool(await asyncio.to_thread(check, name))


async def _attach(service: FleetService, name: str) -> object:
    """The attach probe of a replica that answered for the first time (or restarted); its
    failures are findings, logged, never raised."""
    from prefixcache.fleet.service.attach_probe import probe_replica

    with suppress(UnknownReplicaError):
        return await probe_replica(service, name)
    return None
