"""The fingerprint state machine with its K/V in a real PagedKVCache: every step's offloads and
loads go through ``start_transfers`` (each transfer mode), store loads through
``write_block_rows`` and the write-through through ``read_block_rows``, and every layer's K and V,
on the GPU and on host, must agree with the fingerprints after each step's transfers
(``tests/kv_fingerprint.py``). Small pools over a host tier churn: blocks go out and come back
in the same steps, runs of consecutive slots and scattered ones."""

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.kv_fingerprint import FingerprintRuntime, fingerprint_cache
from tests.manager.test_stateful import HostTierMachine, StoreMachine

EXAMPLES = int(os.environ.get("PREFIXCACHE_STATEFUL_EXAMPLES", "150"))


def machine_with_cache(base: type, mode: str, num_blocks: int, host_blocks: int, store: bool):
    class Machine(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.mgr.remove_listener(self.rt._on_event)  # the runtime below replaces it
            kv = fingerprint_cache(self.mgr, num_layers=2)
            kv.transfer_mode = mode
            self.rt = FingerprintRuntime(self.mgr, kv_store=self.kv_store, kv=kv)

    attrs = {
        "num_blocks": num_blocks,
        "host_blocks": host_blocks,
        "with_store": store,
        "steps": [0],
        "tier": [0, 0, 0],
        "store_counts": [0, 0, 0],
    }
    return type(f"CacheMachine_{mode}_{num_blocks}_{host_blocks}_{store}", (Machine,), attrs)


@pytest.mark.parametrize("mode", ["auto", "runs", "staged", "blocks"])
@pytest.mark.parametrize(
    "num_blocks, host_blocks, store", [(6, 8, False), (6, 8, True), (12, 0, True)]
)
def test_transfers_through_the_cache_keep_every_fingerprint(mode, num_blocks, host_blocks, store):
    base = StoreMachine if store else HostTierMachine
    machine = machine_with_cache(base, mode, num_blocks, host_blocks, store)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    offloaded, loaded, _ = machine.tier
    store_loaded, _, written = machine.store_counts
    counts = f"host {machine.tier}, store {machine.store_counts}"
    print(f"{machine.__name__}: {machine.steps[0]} steps, {counts}")
    if host_blocks:
        assert offloaded > 0 and (loaded > 0 or store), machine.tier
    if store:
        assert store_loaded > 0 and written > 0, machine.store_counts
