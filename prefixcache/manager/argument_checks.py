"""Checks of the arguments a runtime passes to the cache manager, raising typed errors.

Each check runs before a call changes anything, so a rejected call leaves the cache as it was.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from prefixcache.blocks.eviction import POLICIES
from prefixcache.blocks.hashing import DIGEST_SIZE
from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import ConfigError, InvalidArgumentError, UnknownRequestError
from prefixcache.manager.lower_tiers.transfers import TransferModel
from prefixcache.manager.state import RequestState

UNHASHABLE = "request ids must be hashable (a str, an int, a tuple of them), got {}"


def unhashable_error(request_id: Any) -> InvalidArgumentError:
    """The error for a request id that cannot key a dict."""
    return InvalidArgumentError(UNHASHABLE.format(type(request_id).__name__))


def live_request(states: Mapping[Hashable, RequestState], request_id: Hashable) -> RequestState:
    """The state of a live request; UnknownRequestError when it is not admitted."""
    try:
        state = states.get(request_id)
    except TypeError:
        raise unhashable_error(request_id) from None
    if state is None:
        raise UnknownRequestError(f"request {request_id!r} is not admitted (or was released)")
    return state


def is_live(states: Mapping[Hashable, RequestState], request_id: Hashable) -> bool:
    """Whether ``request_id`` is admitted now (InvalidArgumentError when it is unhashable)."""
    try:
        return request_id in states
    except TypeError:
        raise unhashable_error(request_id) from None


def check_namespace(namespace: Any) -> None:
    """A namespace is a ``prefixcache.Namespace``."""
    if not isinstance(namespace, Namespace):
        raise InvalidArgumentError(
            f"namespace must be a prefixcache.Namespace, got {type(namespace).__name__}; "
            "build one with Namespace(model=..., adapter=..., salt=...)"
        )


def check_prompt_digests(digests: Any, num_full: int) -> list[bytes]:
    """A prompt's full-block digests as ``admit`` takes them: ``num_full`` digests of
    ``DIGEST_SIZE`` bytes, as ``hasher.hash_prompt(tokens, namespace)`` returns them."""
    how = "pass mgr.hasher.hash_prompt(tokens, namespace), or no digests to have them computed"
    if isinstance(digests, str | bytes) or not hasattr(digests, "__len__"):
        raise InvalidArgumentError(
            f"digests must be a list of {DIGEST_SIZE}-byte digests, got "
            f"{type(digests).__name__}: {how}"
        )
    out = list(digests)
    if len(out) != num_full:
        raise InvalidArgumentError(
            f"the prompt has {num_full} full blocks but {len(out)} digests were given: {how}"
        )
    for d in out:
        if type(d) is not bytes or len(d) != DIGEST_SIZE:
            raise InvalidArgumentError(
                f"digests must be {DIGEST_SIZE}-byte bytes, got {d!r:.60}: {how}"
            )
    return out


def check_priority(priority: Any, retention: Any) -> tuple[int, float | None]:
    """A priority is an int (a numpy integer too); a retention is None or a number of clock
    units >= 0. Returns them as a plain int and float, which is what the compiled code takes."""
    if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
        raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
    if retention is None:
        return int(priority), None
    if isinstance(retention, bool) or not isinstance(retention, int | float | np.number):
        raise InvalidArgumentError(
            f"retention must be a number of clock units or None, got {retention!r}"
        )
    if math.isnan(retention) or retention < 0:
        raise InvalidArgumentError(f"retention must be >= 0, got {retention!r}")
    return int(priority), float(retention)


def check_policy(policy: Any) -> None:
    """An eviction policy is one of ``POLICIES`` by name, or a key function ``(node, now)``."""
    if callable(policy):
        return
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)} or pass a "
            "key function (node, now) -> sortable key"
        )


def check_settings(
    hash_algo: Any, partial_copy: Any, enable_caching: Any, stepped: Any, clock: Any
) -> None:
    """The manager's settings have their types: the compiled code would refuse any other with
    a bare TypeError, so the manager names the setting first."""
    if not isinstance(hash_algo, str):
        raise ConfigError(f"hash_algo must be the name of a hash algorithm, got {hash_algo!r}")
    for name, value in (
        ("partial_copy", partial_copy),
        ("enable_caching", enable_caching),
        ("stepped", stepped),
    ):
        if not isinstance(value, bool | np.bool_):
            raise ConfigError(f"{name} must be True or False, got {value!r}")
    if clock is not None and not callable(clock):
        raise ConfigError(f"clock must be None or a callable returning the time, got {clock!r}")


def check_pad(pad: Any) -> None:
    """A block-table pad is an int32 value."""
    if (
        isinstance(pad, bool)
        or not isinstance(pad, int | np.integer)
        or not -(2**31) <= pad < 2**31
    ):
        raise InvalidArgumentError(f"pad must be an int32 block id or marker, got {pad!r}")


def request_id_list(request_ids: Any) -> list[Hashable]:
    """The ids of a batch as a list; a str, bytes or non-iterable is one id, not a batch."""
    if isinstance(request_ids, str | bytes):
        raise InvalidArgumentError(
            f"request_ids is an iterable of request ids, got one id {request_ids!r}; "
            f"pass [{request_ids!r}]"
        )
    try:
        return list(request_ids)
    except TypeError:
        raise InvalidArgumentError(
            f"request_ids is an iterable of request ids, got {type(request_ids).__name__}"
        ) from None


def torch_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` that exists here (CPU, or a visible CUDA device)."""
    import torch

    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        raise InvalidArgumentError(f"device is a torch device, str or int, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"device {device!r} is not a torch device ({exc})") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidArgumentError(f"device {device!r}: block tables go to the CPU or CUDA")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (dev.index or 0) >= count:
        raise InvalidArgumentError(
            f"device {device!r} is not available here ({count} CUDA devices)"
        )
    return dev


def check_force(force: Any) -> None:
    """``reset(force=...)`` takes a bool: a forced reset drops every request, so no other value
    (a string, a number) may ask for one by being truthy."""
    if type(force) is not bool:
        raise InvalidArgumentError(f"force must be True or False, got {force!r}")


def check_transfer_model(model: Any) -> None:
    """A transfer model is a TransferModel of finite figures: block bytes, bandwidth and FLOP
    rate above 0, the per-token and per-pair FLOPs >= 0 and not both 0."""
    if not isinstance(model, TransferModel):
        raise ConfigError(f"transfer_model must be a TransferModel or None, got {model!r}")
    for name in model._fields:
        value = getattr(model, name)
        at_least = "a number >= 0" if name in ("flops_per_token", "flops_per_pair") else None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
            or (value == 0 and at_least is None)
        ):
            raise ConfigError(
                f"transfer_model.{name} must be {at_least or 'a positive number'}, got {value!r}"
            )
    if model.flops_per_token == model.flops_per_pair == 0:
        raise ConfigError("transfer_model needs flops_per_token or flops_per_pair above 0")


def check_store(store: Any, model: Any, stepped: Any, enable_caching: Any) -> None:
    """A store is something with ``leading_present(digests)``, on a stepped manager that
    caches; its transfer model, if any, is a valid TransferModel."""
    if not callable(getattr(store, "leading_present", None)):
        raise ConfigError(
            f"store must have a leading_present(digests) method (a store connector), got {store!r}"
        )
    if not stepped:
        raise ConfigError(
            "a store needs stepped=True: its loads and write-throughs follow the step protocol"
        )
    if not enable_caching:
        raise ConfigError("a store needs enable_caching=True")
    if model is not None:
        check_transfer_model(model)
