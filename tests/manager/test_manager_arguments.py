"""Every public argument of the manager is checked before the compiled code sees it: a wrong
one raises the library's typed error (never a bare TypeError from compiled code) and changes
nothing; numpy integers are taken wherever ints are."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache import CacheManager, ConfigError, InvalidArgumentError
from prefixcache.manager.cache_manager import ManagerInternals


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"policy": 3}, "unknown eviction policy 3"),
        ({"policy": None}, "unknown eviction policy None"),
        ({"policy": "fifo"}, "unknown eviction policy 'fifo'"),
        ({"hash_algo": 3}, "hash_algo must be the name of a hash algorithm"),
        ({"partial_copy": 1}, "partial_copy must be True or False"),
        ({"enable_caching": "yes"}, "enable_caching must be True or False"),
        ({"stepped": 0}, "stepped must be True or False"),
        ({"clock": 5.0}, "clock must be None or a callable"),
    ],
)
def test_wrong_settings_raise_config_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        CacheManager(8, 4, **kwargs)


def test_numpy_values_are_taken_where_plain_ones_are() -> None:
    mgr = CacheManager(np.int64(8), np.int32(4), stepped=np.bool_(True), policy="priority")
    adm = mgr.admit("a", list(range(10)), priority=np.int64(3), retention=np.float32(5))
    assert adm.num_tokens == 10 and mgr.internals.states["a"].claim == (3, 6.0)
    mgr.admit("b", list(range(6)), priority=np.int16(-1))
    assert mgr.internals.states["b"].claim is not None
    assert mgr.internals.states["b"].claim[0] == -1
    mgr.end_step()
    assert mgr.evict(np.int64(3)) == 0  # nothing evictable: both requests hold their blocks
    mgr.check_integrity()


@pytest.mark.parametrize("priority", [1.5, "3", True, None])
def test_a_wrong_priority_is_typed_and_changes_nothing(priority: object) -> None:
    mgr = CacheManager(8, 4)
    with pytest.raises(InvalidArgumentError, match="priority must be an int"):
        mgr.admit("a", list(range(10)), priority=priority)  # type: ignore[arg-type]
    assert mgr.requests == [] and mgr.block_counts().free == 8
    mgr.check_integrity()


def test_introspection_goes_through_internals() -> None:
    mgr = CacheManager(8, 4, stepped=True)
    mgr.admit("a", list(range(10)))
    inside = mgr.internals
    assert isinstance(inside, ManagerInternals)
    assert list(inside.states) == ["a"] and inside.radix_index is mgr.index
    assert inside.pending_blocks == frozenset(mgr.block_table("a")[:2])
    assert inside.step_holds == ([], []) and inside.listener_errors == 0
    assert inside.clock_ticks > 0 and dict(inside.pins) == {}
    for name in ("states", "pins", "pending_blocks", "step_holds", "clock_ticks"):
        assert not hasattr(mgr, name)  # read through internals alone


def test_internals_taken_before_a_reset_read_the_state_after_it() -> None:
    mgr = CacheManager(8, 4, stepped=True, host_blocks=4)
    inside = mgr.internals
    mgr.admit("a", list(range(10)))
    mgr.pin(list(range(8)))
    mgr.reset(force=True)
    assert dict(inside.states) == {} and dict(inside.pins) == {}
    assert inside.radix_index is mgr.index and inside.pending_blocks == frozenset()


def test_reset_builds_a_new_state_and_keeps_what_outlives_it() -> None:
    mgr = CacheManager(8, 4, host_blocks=4)
    mgr.admit("a", list(range(12)))
    mgr.release("a")
    index, stats = mgr.index, mgr.stats
    handle, _ = mgr.pin(list(range(8)))
    mgr.reset(force=True)
    assert mgr.index is not index and mgr.index.num_blocks == 0
    assert mgr.stats is stats and stats.requests == 1  # counters survive
    assert mgr.host is not None and mgr.host.index is mgr.index
    handle2, _ = mgr.pin(list(range(8)))
    assert handle2 == 0  # nothing cached any more
    mgr.admit("b", list(range(12)))
    mgr.release("b")
    handle3, pinned = mgr.pin(list(range(8)))
    assert handle3 > handle and pinned == 8  # handles are never reused across a reset
    mgr.check_integrity()
