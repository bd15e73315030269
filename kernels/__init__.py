"""Attention kernels over paged K/V.

Lives in the top-level ``kernels/`` folder; ``prefixcache/kernels`` links to it, so it is imported,
type-checked and installed as ``prefixcache.kernels``.

``paged_attention`` and ``store_kv`` run the Triton kernels on CUDA (or through the Triton
interpreter when TRITON_INTERPRET=1) and the torch reference otherwise; triton is optional.
"""

from prefixcache.errors import (
    KernelDTypeError,
    KernelInputError,
    TritonUnavailableError,
    UnsupportedConfigError,
)
from prefixcache.kernels.attention import paged_attention, plan_shared_prefix, workspace_size
from prefixcache.kernels.backend import (
    Backend,
    interpreter_enabled,
    resolve_backend,
    triton_available,
)
from prefixcache.kernels.batch import PagedBatch
from prefixcache.kernels.cascade import (
    CascadePlan,
    PrefixGroup,
    find_prefix_groups,
    group_shared_prefixes,
)
from prefixcache.kernels.config import AttentionConfig, choose_config
from prefixcache.kernels.reference import (
    gather_kv,
    reference_attention,
    reference_paged_attention,
    reference_store_kv,
)
from prefixcache.kernels.store import store_kv

__all__ = [
    "AttentionConfig",
    "Backend",
    "CascadePlan",
    "KernelDTypeError",
    "KernelInputError",
    "PagedBatch",
    "PrefixGroup",
    "TritonUnavailableError",
    "UnsupportedConfigError",
    "choose_config",
    "find_prefix_groups",
    "gather_kv",
    "group_shared_prefixes",
    "interpreter_enabled",
    "paged_attention",
    "plan_shared_prefix",
    "reference_attention",
    "reference_paged_attention",
    "reference_store_kv",
    "resolve_backend",
    "store_kv",
    "triton_available",
    "workspace_size",
]
