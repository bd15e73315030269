"""The host-memory tier: offload on eviction, loads on admission, its LRU, closure and events."""

from __future__ import annotations

import pytest

from prefixcache import (
    CacheManager,
    ConfigError,
    InvalidArgumentError,
    Namespace,
    OutOfBlocksError,
)
from prefixcache.fleet.events.publisher import to_wire
from prefixcache.manager.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.manager.integrity import IntegrityError
from prefixcache.manager.lower_tiers.transfers import Load, Offload, TransferModel
from tests.kv_fingerprint import FingerprintRuntime
from tests.snapshot import snapshot

P = 4
NS = Namespace(model="m")
A = list(range(100, 113))  # 3 full blocks and one token
B = list(range(200, 213))
C = list(range(300, 305))
FAST = TransferModel(bytes_per_block=1e3, host_bandwidth=1e9, flops_per_token=1e9, flops=1e12)
SLOW = TransferModel(bytes_per_block=1e9, host_bandwidth=1e6, flops_per_token=1e3, flops=1e15)


def manager(gpu: int = 4, host: int = 8, **kw) -> tuple[CacheManager, FingerprintRuntime]:
    mgr = CacheManager(gpu, P, stepped=kw.pop("stepped", True), host_blocks=host, **kw)
    return mgr, FingerprintRuntime(mgr)


def run(rt: FingerprintRuntime, rid: str, tokens: list[int]) -> int:
    """Admit, run the step (transfers, stores, reads), release."""
    cached = rt.admit(rid, tokens, NS)
    rt.step()
    rt.release(rid)
    rt.mgr.check_integrity()
    rt.check_cached()
    return cached


def digests(mgr: CacheManager, tokens: list[int]) -> list[bytes]:
    return mgr.hasher.hash_prompt(tokens, NS)


def test_offload_on_eviction_then_a_hit_loads_from_host() -> None:
    mgr, rt = manager()
    events: list = []
    mgr.add_listener(events.append)
    assert run(rt, "a", A) == 0
    a_blocks = {b for node in mgr.index.iter_nodes() for b in node.blocks}
    assert run(rt, "b", B) == 0  # evicts a's three indexed blocks into the host tier
    assert set(mgr.host.entries) == set(digests(mgr, A))
    assert mgr.stats.offloaded_blocks == 3
    stored_cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [e.block_hashes for e in stored_cpu] == [digests(mgr, A)]
    assert stored_cpu[0].parent_block_hash is None  # a chain's first block, as on the GPU
    assert stored_cpu[0].token_ids == A[:12]
    removed_gpu = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert removed_gpu[0].block_hashes == digests(mgr, A)
    assert {o.gpu_block for o in rt.last_transfers[0]} == a_blocks

    ahead = mgr.lookup(A, NS)
    assert ahead == (12, 0, 3) and mgr.can_admit(A, NS)
    events.clear()
    adm = mgr.admit("a2", A, NS)
    assert (adm.cached_len, adm.hit_blocks, adm.host_blocks) == (12, 0, 3)
    offloads, loads, _ = mgr.take_transfers()
    assert [ld.gpu_block for ld in loads] == adm.block_table[:3]
    assert all(isinstance(o, Offload) for o in offloads) and all(isinstance(x, Load) for x in loads)
    assert not set(mgr.host.entries) & set(digests(mgr, A))  # exclusive: they left the host
    kinds = [(type(e).__name__, e.medium) for e in events]
    assert kinds.index(("BlockRemoved", "CPU")) < kinds.index(("BlockStored", "GPU"))
    assert mgr.stats.loaded_blocks == mgr.stats.host_hit_blocks == 3
    assert mgr.stats.hit_blocks == 3
    mgr.abort("a2")
    mgr.end_step()
    mgr.check_integrity()


def test_loaded_blocks_and_new_ones_after_them_are_indexed_under_their_chain() -> None:
    mgr, rt = manager(gpu=5)
    run(rt, "a", A)
    run(rt, "b", B)  # evicts a's last two indexed blocks into the host tier; its first stays
    longer = [*A[:12], 400, 401, 402, 403, 7]  # a's blocks, then a new full block and a token
    assert set(mgr.host.entries) == set(digests(mgr, A)[1:])
    events: list = []
    mgr.add_listener(events.append)
    assert rt.admit("c", longer, NS) == 12  # one block hit on the GPU, two loaded from host
    assert (mgr.stats.loaded_blocks, mgr.stats.hit_blocks) == (2, 3)
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert [d for e in stored for d in e.block_hashes] == digests(mgr, longer)[1:]
    mgr.check_integrity()  # every stored digest continues the chain
    rt.step()
    rt.release("c")
    rt.check_cached()
    assert run(rt, "c2", longer) == 16


def test_loaded_kv_is_read_back_exactly() -> None:
    mgr, rt = manager()
    run(rt, "a", A)
    run(rt, "b", B)
    assert run(rt, "a2", A) == 12  # the fingerprint runtime checks every token read
    assert run(rt, "b2", B) == 12
    assert rt.transfers > 0 and mgr.stats.loaded_blocks == 6


def test_host_lru_evicts_leaves_only() -> None:
    mgr, rt = manager(gpu=4, host=3)
    run(rt, "a", A)
    run(rt, "b", B)  # a0 a1 a2 on host: the tier is full
    a0, a1, a2 = digests(mgr, A)
    assert mgr.host.is_leaf(a2) and not mgr.host.is_leaf(a0)
    run(rt, "c", C)  # evicts b's last block: the host evicts its only leaf, a2 (not a0, older)
    b2 = digests(mgr, B)[2]
    assert set(mgr.host.entries) == {a0, a1, b2}
    assert mgr.stats.host_evicted_blocks == 1


def test_a_run_without_room_is_dropped_and_the_host_stays_prefix_closed() -> None:
    mgr, rt = manager(gpu=4, host=1)
    events: list = []
    mgr.add_listener(events.append)
    run(rt, "a", A)
    run(rt, "b", B)  # a0 fits; a1 would need a0's slot (its parent): a1 and a2 are dropped
    assert list(mgr.host.entries) == [digests(mgr, A)[0]]
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [e.block_hashes for e in stored] == [digests(mgr, A)[:1]]
    run(rt, "c", C)  # b's last block evicted; a0 is a leaf and goes
    assert list(mgr.host.entries) == [digests(mgr, B)[2]]
    mgr.check_integrity()


def test_abort_drops_the_host_blocks_below_its_blocks() -> None:
    mgr, rt = manager(gpu=8, host=8, transfer_model=SLOW)
    run(rt, "a", A)
    assert mgr.evict(3) == 3  # a0 a1 a2 on host
    a2 = digests(mgr, A)[2]
    rt.admit("r", A[:9], NS)  # recomputes a0 a1 (slow host): their GPU copies replace the host's
    assert mgr.stats.host_hit_blocks == 2 and mgr.stats.loaded_blocks == 0
    assert set(mgr.host.entries) == {a2}
    mgr.check_integrity()
    assert rt.abort("r") == ["r"]  # a1 leaves the GPU index: a2 below it leaves the host
    assert not mgr.host.entries
    mgr.check_integrity()
    rt.step()


def test_loads_free_their_slots_at_the_end_of_the_step() -> None:
    mgr, rt = manager(gpu=4, host=3)
    run(rt, "a", A)
    run(rt, "b", B)  # host: a0 a1 a2
    slots = sorted(e.slot for e in mgr.host.entries.values())
    rt.admit("a2", A, NS)  # loads a's three blocks and evicts b's, in one step
    assert sorted(mgr.host.deferred) == slots and mgr.host.num_free == 0
    assert not mgr.host.entries  # b's blocks found no room: dropped
    rt.step()
    offloads, loads = rt.last_transfers
    assert sorted(ld.host_slot for ld in loads) == slots
    assert not offloads  # no offload overwrites a slot a load of the step reads
    assert sorted(mgr.host.free_slots()) == slots and not mgr.host.deferred
    mgr.check_integrity()


def test_without_steps_a_call_frees_its_loads_slots_when_it_returns() -> None:
    mgr, rt = manager(gpu=4, host=3, stepped=False)
    run(rt, "a", A)
    run(rt, "b", B)
    rt.admit("a2", A, NS)
    assert not mgr.host.deferred
    mgr.check_integrity()
    rt.step()


def test_load_or_recompute_follows_the_transfer_model() -> None:
    for model, loaded in ((FAST, 3), (SLOW, 0), (None, 3)):
        mgr, rt = manager(transfer_model=model)
        run(rt, "a", A)
        run(rt, "b", B)
        assert mgr.lookup(A, NS).host_blocks == loaded
        cached = run(rt, "a2", A)
        assert cached == 4 * loaded
        assert mgr.stats.host_hit_blocks == 3 and mgr.stats.loaded_blocks == loaded
    assert FAST.should_load(5, P) and not SLOW.should_load(5, P)


def test_recomputing_deep_in_a_sequence_costs_its_attention_too() -> None:
    """Recomputing a run also attends over the context before it: the same two host blocks are
    recomputed at the start of a sequence and loaded after a cached block. (Attention only here:
    copying costs 25 a block, recomputing 1 per query-key pair.)"""
    attention = TransferModel(bytes_per_block=25, host_bandwidth=1, flops_per_token=0, flops=1,
                              flops_per_pair=1)  # fmt: skip
    assert not attention.should_load(2, P, 0)  # 8 new tokens: 36 pairs < 50
    assert attention.should_load(2, P, 1)  # after 4 cached ones: 68 pairs > 50
    shallow, rt = manager(gpu=6, transfer_model=attention)
    run(rt, "a", A[:9])
    assert shallow.evict(2) == 2  # both full blocks on host
    run(rt, "a2", A[:9])
    assert shallow.stats.host_hit_blocks == 2 and shallow.stats.loaded_blocks == 0
    deep, rt = manager(gpu=6, transfer_model=attention)
    run(rt, "a", A)
    assert deep.evict(2) == 2  # a1 a2 on host after a0 on the GPU
    assert run(rt, "a2", A) == 12 and deep.stats.loaded_blocks == 2


def test_a_prompt_cached_on_host_in_full_computes_one_block() -> None:
    mgr, rt = manager()
    prompt = A[:12]  # three full blocks, all on host after the next call
    run(rt, "a", prompt)
    run(rt, "b", B)
    assert len(mgr.host.entries) == 3
    adm_cached = run(rt, "a2", prompt)
    assert adm_cached == 8  # two loaded; the last block is computed (no copy of a host block)
    assert mgr.stats.loaded_blocks == 2
    assert digests(mgr, prompt)[2] not in mgr.host.entries  # computed again: off the host
    mgr.check_integrity()


def test_a_host_block_can_follow_a_gpu_match_mid_node() -> None:
    mgr, rt = manager(gpu=6, host=8)
    run(rt, "a", A)
    assert mgr.evict(2) == 2  # a1 a2 on host, a0 on the GPU
    run(rt, "x", A[:4] + [9, 9, 9, 9, 9])  # a0 plus a sibling of a1
    cached = run(rt, "a2", A)
    assert cached == 12 and mgr.stats.loaded_blocks == 2


@pytest.mark.parametrize("branches", [2, 4, 5, 12])
def test_host_continuations_are_told_apart_by_their_tokens(branches: int) -> None:
    """Branches after one shared block, all on host: each prompt loads its own branch (its
    tokens and position, not a sibling's), with few children compared and many looked up."""
    mgr, rt = manager(gpu=4, host=2 * branches + 4)
    shared = A[:4]
    prompts = [shared + [500 + b] * 4 + [600 + b] * 4 + [7] for b in range(branches)]
    for b, prompt in enumerate(prompts):
        assert run(rt, f"w{b}", prompt) == (4 if b else 0)
    mgr.evict(mgr.block_counts().cached)  # everything on host, the shared block too
    for b, prompt in reversed(list(enumerate(prompts))):
        before = mgr.stats.loaded_blocks
        assert run(rt, f"r{b}", prompt) == 12  # the shared block and the branch's two
        assert mgr.stats.loaded_blocks - before == 3
        mgr.evict(mgr.block_counts().cached)
    # a prompt that shares a branch's first block but not its second loads one block only
    before = mgr.stats.loaded_blocks
    assert run(rt, "x", shared + [500] * 4 + [9] * 4 + [7]) == 8
    assert mgr.stats.loaded_blocks - before == 2


def test_capacity_is_exact_with_loads() -> None:
    mgr, rt = manager(gpu=4, host=8)
    run(rt, "a", A)
    run(rt, "b", B)  # a0 a1 a2 on host; b's three blocks cached on the GPU
    rt.admit("hold", B[:8] + [1, 2, 3, 4, 5], NS)  # holds two of b's blocks, takes two more
    rt.step()
    assert mgr.block_counts().free + mgr.block_counts().cached == 0
    before = snapshot(mgr)
    assert not mgr.can_admit(A, NS)
    with pytest.raises(OutOfBlocksError):
        mgr.admit("a2", A, NS)
    assert snapshot(mgr) == before
    rt.release("hold")
    counts = mgr.block_counts()
    assert counts.free + counts.cached == 4 and mgr.can_admit(A, NS)  # exactly what A needs
    assert run(rt, "a2", A) == 12


def test_reset_clears_the_host_tier() -> None:
    mgr, rt = manager()
    events: list = []
    mgr.add_listener(events.append)
    run(rt, "a", A)
    run(rt, "b", B)
    mgr.reset()
    assert not mgr.host.entries and mgr.host.num_free == 8
    assert isinstance(events[-1], AllBlocksCleared)
    assert mgr.take_transfers() == ([], [], [])
    mgr.check_integrity()


def test_wire_events_carry_the_medium() -> None:
    event = BlockStored([b"x" * 16], None, [1, 2, 3, 4], 4, NS, "CPU")
    assert to_wire(event).medium == "CPU"
    assert to_wire(BlockRemoved([b"x" * 16], NS, "CPU")).medium == "CPU"
    assert to_wire(BlockRemoved([b"x" * 16], NS)).medium == "GPU"


def test_integrity_sees_a_broken_host_tier() -> None:
    mgr, rt = manager()
    run(rt, "a", A)
    run(rt, "b", B)
    node = mgr.host.nodes()[0]
    other = next(e.slot for e in mgr.host.entries.values() if e.slot != node.blocks[0])
    node.blocks[0] = other  # two host blocks claim one slot
    with pytest.raises(IntegrityError):
        mgr.check_integrity()


def test_configuration_is_validated() -> None:
    with pytest.raises(InvalidArgumentError):
        CacheManager(4, P, host_blocks=-1)
    with pytest.raises(ConfigError):
        CacheManager(4, P, host_blocks=4, enable_caching=False)
    with pytest.raises(ConfigError):
        CacheManager(4, P, host_blocks=4, transfer_model=(1, 2, 3, 4))
    with pytest.raises(ConfigError):
        CacheManager(4, P, host_blocks=4, transfer_model=TransferModel(1, 0, 1, 1))
    with pytest.raises(ConfigError, match="flops_per_pair must be a number >= 0"):
        CacheManager(4, P, host_blocks=4, transfer_model=TransferModel(1, 1, 1, 1, -1))
    with pytest.raises(ConfigError, match="flops_per_token or flops_per_pair above 0"):
        CacheManager(4, P, host_blocks=4, transfer_model=TransferModel(1, 1, 0, 1))
    mgr = CacheManager(4, P)
    assert mgr.host is None and mgr.take_transfers() == ([], [], [])


def test_offload_events_feed_a_fleet_index_without_unknown_parents() -> None:
    """The CPU events of offloaded blocks go through the wire into a subscriber: every block is
    indexed on CPU after its GPU copy went, none is skipped for an unknown parent."""
    from prefixcache.fleet.events import wire as kv_wire
    from prefixcache.fleet.events.subscriber import KVEventSubscriber, ReplicaEndpoint
    from prefixcache.fleet.index.memory import MemoryFleetIndex

    mgr, rt = manager()
    wire: list = []
    mgr.add_listener(lambda event: wire.append(to_wire(event)))
    index = MemoryFleetIndex()
    sub = KVEventSubscriber(index, [ReplicaEndpoint("pod", namespace=NS, block_size=P)])
    run(rt, "a", A)
    run(rt, "b", B)  # a's blocks: stored on GPU, then offloaded when b evicts them
    sub.ingest("pod", 0, kv_wire.encode_batch(kv_wire.KVEventBatch(0.0, wire)))
    assert sub.counters()["pod"].malformed == 0
    match = {m.replica: m for m in index.match(digests(mgr, A))}["pod"]
    assert (match.blocks, match.gpu_blocks) == (3, 0)  # on CPU, all three


def test_offloaded_blocks_stay_in_the_tree_as_host_nodes() -> None:
    """An offload splits a GPU node's tail off as a host node, or the whole node changes
    residence; a load takes host nodes out, and what hung below a loaded block on host hangs
    below the GPU node that ends with it."""
    mgr, rt = manager(gpu=8, host=8)
    run(rt, "a", A)
    root = mgr.index.roots[NS]
    (node,) = root.children.values()
    a0, a1, a2 = digests(mgr, A)
    assert mgr.evict(1) == 1  # the tail block splits off
    (tail,) = node.host_children.values()
    assert len(node.blocks) == 2 and not node.on_host
    assert tail.on_host and tail.parent is node and tail.digest(0) == a2
    assert mgr.evict(2) == 2  # the rest goes whole: the same node, now on host
    assert not root.children and root.host_children == {a0: node}
    assert node.on_host and node.host_children == {a2: tail} and len(node.blocks) == 2
    assert mgr.block_counts().cached == 0 and len(mgr.host) == 3
    mgr.check_integrity()
    assert run(rt, "b", A[:9] + [7, 7, 7, 7]) == 8  # loads a0 a1; a2 hangs below them now
    (loaded,) = mgr.index.roots[NS].children.values()
    assert [loaded.digest(0), loaded.digest(1)] == [a0, a1] and not loaded.on_host
    assert loaded.host_children == {a2: tail} and tail.parent is loaded
    assert run(rt, "c", A) == 12  # and a2 is loaded below them
    assert not mgr.host.entries
