"""Tenant shares as a replay takes them: ``--shares "acme=25%,globex=512:1024"``.

Each entry is ``TENANT=GUARANTEE[:CAP]``, the tenant a cache salt as the workload's
namespaces carry it (a scenario's ``tenants``, a trace's ``salt``), each size a block count or
a percentage of one replica's GPU cache. ``none`` plans without any share but still reports per
tenant. The sizes become blocks once the cache is sized (``resolve_shares``), and the manager
checks them (guarantees that fit, a cap at least the guarantee).
"""

from __future__ import annotations

from typing import NamedTuple

from prefixcache.blocks.pool import UNBOUNDED
from prefixcache.errors import ConfigError
from prefixcache.manager.tenant_shares import TenantShare, check_shares


class ShareSpec(NamedTuple):
    """One tenant's share as written: sizes in blocks (int) or parts of the cache (float)."""

    tenant: str
    guaranteed: int | float
    cap: int | float | None


def parse_shares(text: str) -> tuple[ShareSpec, ...]:
    """``TENANT=GUARANTEE[:CAP],...`` (or ``none``) into specs; ConfigError saying what is
    wrong with which entry."""
    text = text.strip()
    if text.lower() == "none":
        return ()
    specs: list[ShareSpec] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        tenant, eq, sizes = entry.partition("=")
        tenant = tenant.strip()
        if not eq or not tenant:
            raise ConfigError(
                f"a share is TENANT=GUARANTEE[:CAP] (blocks or a percentage), got {entry!r}"
            )
        guaranteed_text, colon, cap_text = sizes.partition(":")
        guaranteed = _size(guaranteed_text, tenant, "guarantee")
        cap = _size(cap_text, tenant, "cap") if colon else None
        if any(s.tenant == tenant for s in specs):
            raise ConfigError(f"tenant {tenant!r} has two shares")
        specs.append(ShareSpec(tenant, guaranteed, cap))
    if not specs:
        raise ConfigError("--shares names no tenant (write 'none' for per-tenant figures only)")
    return tuple(specs)


def _size(text: str, tenant: str, what: str) -> int | float:
    text = text.strip()
    try:
        if text.endswith("%"):
            value = float(text[:-1]) / 100
            if not 0 <= value <= 1:
                raise ValueError
            return value
        blocks = int(text)
        if blocks < 0:
            raise ValueError
        return blocks
    except ValueError:
        raise ConfigError(
            f"tenant {tenant!r}: the {what} is a block count or a percentage of the cache "
            f"(e.g. 512 or 25%), got {text!r}"
        ) from None


def resolve_shares(specs: tuple[ShareSpec, ...], capacity_blocks: int) -> dict[str, TenantShare]:
    """The shares in blocks of a cache of ``capacity_blocks`` (percentages round down),
    checked as the manager checks them."""
    shares: dict[str, TenantShare] = {}
    for tenant, guaranteed, cap in specs:
        shares[tenant] = TenantShare(
            _blocks(guaranteed, capacity_blocks, tenant) or 0, _blocks(cap, capacity_blocks, tenant)
        )
    return check_shares(shares, capacity_blocks)


def _blocks(size: int | float | None, capacity_blocks: int, tenant: str) -> int | None:
    if size is None or isinstance(size, int):
        return size
    if capacity_blocks >= UNBOUNDED:
        raise ConfigError(
            f"tenant {tenant!r}: a share in percent needs a bounded cache (--blocks N)"
        )
    return int(size * capacity_blocks)


def shares_text(specs: tuple[ShareSpec, ...]) -> str:
    """The specs written back as ``--shares`` takes them."""
    if not specs:
        return "none"

    def show(size: int | float) -> str:
        return f"{size * 100:g}%" if isinstance(size, float) else str(size)

    return ",".join(
        f"{s.tenant}={show(s.guaranteed)}" + (f":{show(s.cap)}" if s.cap is not None else "")
        for s in specs
    )
