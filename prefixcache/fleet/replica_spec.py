"""A replica as the fleet sees it: the namespace it serves, its block size and capacity, and the
LoRA adapters it serves besides its own; which requests it may take (``ReplicaSpec.serves``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from prefixcache.blocks.namespace import Namespace

ANY_ADAPTER = "*"  # in ReplicaSpec.adapters: every LoRA adapter (loaded at run time)


class ReplicaSpec(NamedTuple):
    """One replica as the router sees it: what it serves and how big its cache is."""

    name: str
    namespace: Namespace  # the namespace its KV events are hashed under
    block_size: int = 16
    capacity_blocks: int = 0  # 0: unknown (then free capacity never decides a route)
    adapters: tuple[str, ...] = ()  # LoRA adapters it serves besides its own (any version);
    # "*" (ANY_ADAPTER): every adapter, as an engine that loads adapters at run time
    kv_store: str | None = None  # the shared K/V store it loads from and writes to, if any

    def serves(self, namespace: Namespace) -> bool:
        """Whether a request in ``namespace`` may go to this replica: the same model; the
        replica's own adapter (and version, when it has one) or one of ``adapters``; any salt and
        extra keys unless the replica is configured with its own (then those). Salts and extra
        keys are per request in vLLM (``cache_salt``, multimodal hashes), so any replica of the
        model serves them."""
        own = self.namespace
        if namespace.model != own.model:
            return False
        if own.salt is not None and namespace.salt != own.salt:
            return False
        if own.extra and namespace.extra != own.extra:
            return False
        if namespace.adapter == own.adapter:
            return own.adapter_version is None or namespace.adapter_version == own.adapter_version
        adapters = self.adapters
        return namespace.adapter in adapters or (
            namespace.adapter is not None and ANY_ADAPTER in adapters
        )


def pinned_adapter_versions(namespaces: Iterable[Namespace]) -> dict[tuple[str, str], str]:
    """(model, adapter) -> the version a replica dedicated to that adapter pins (the first
    such namespace): the version the adapter has across the fleet, for the router's clients
    and for the ingest of replicas that serve it without pinning one."""
    versions: dict[tuple[str, str], str] = {}
    for ns in namespaces:
        if ns.adapter is not None and ns.adapter_version is not None:
            versions.setdefault((ns.model, ns.adapter), ns.adapter_version)
    return versions


def served_label(spec: ReplicaSpec) -> str:
    """What a replica serves, for error messages."""
    label = spec.namespace.label()
    return f"{label} (+ adapters {', '.join(spec.adapters)})" if spec.adapters else label
