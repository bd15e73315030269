import pytest
import torch

from prefixcache import CacheManager, ConfigError, Namespace, PagedKVCache
from prefixcache.kernels.reference import reference_attention


def test_write_gather_roundtrip_and_skip_slot():
    kv = PagedKVCache(2, 6, 4, 2, 8, dtype=torch.float32, fill=float("nan"))
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    kv.write(1, k, v, [5, -1, 20])
    assert torch.equal(kv.k[1][1, 1], k[0]) and torch.equal(kv.v[1][5, 0], v[2])
    assert torch.isnan(kv.k[0]).all()  # other layers untouched
    gk, _gv = kv.gather(1, [1], 2)
    assert torch.equal(gk[1], k[0])


def test_copies_run_on_every_layer():
    kv = PagedKVCache(2, 4, 4, 1, 8, dtype=torch.float32)
    for layer in range(2):
        kv.k[layer][0].normal_()
        kv.v[layer][0].normal_()
    kv.apply_copies([(0, 3, 2)])
    for layer in range(2):
        assert torch.equal(kv.k[layer][3, :2], kv.k[layer][0, :2])
        assert torch.equal(kv.k[layer][3, 2:], torch.zeros(2, 1, 8))


def test_bad_shapes_and_config_are_rejected():
    with pytest.raises(ConfigError):
        PagedKVCache(1, 0, 4, 1, 8)
    kv = PagedKVCache(1, 2, 4, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="match the slots"):
        kv.write(0, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), [0])
    with pytest.raises(ValueError, match="outside the cache"):
        kv.write(0, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), [8])


def test_bad_ids_and_layers_are_typed_errors_and_copy_nothing():
    import numpy as np

    from prefixcache import InvalidArgumentError

    with pytest.raises(ConfigError, match="num_blocks"):
        PagedKVCache(1, True, 4, 1, 8)
    assert PagedKVCache(np.int64(2), np.int64(4), 4, 1, 8).num_blocks == 4  # numpy sizes work
    kv = PagedKVCache(2, 4, 4, 1, 8, dtype=torch.float32)
    kv.k[0][0].normal_()
    before = [t.clone() for t in (*kv.k, *kv.v)]
    for copies, layer in (
        ([(0, 1, 2), (-1, 2, 2)], None),  # a negative id read the last block
        ([(0, 1, 2), (0, 4, 2)], None),
        ([(0, 1, 5)], None),
        ([(0, 1)], None),
        ([(0, 1, 2)], 2),
        ([(0, 1, 2)], -1),  # the last layer, silently
    ):
        with pytest.raises(InvalidArgumentError):
            kv.apply_copies(copies, layer)
        assert all(torch.equal(a, b) for a, b in zip(before, (*kv.k, *kv.v), strict=True))
    with pytest.raises(InvalidArgumentError, match="copies must be an iterable"):
        kv.apply_copies(5, 0)  # type: ignore[arg-type]
    for bad in (2, -1, True):
        with pytest.raises(InvalidArgumentError, match="layer"):
            kv.write(bad, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), [0])
        with pytest.raises(InvalidArgumentError, match="layer"):
            kv.gather(bad, [0], 1)
    # a float id was truncated (1.9 read block 1); a 2-D table gave a 4-D result
    for table in ([1.9], [[0], [1]], [True], torch.tensor([0.0])):
        with pytest.raises(InvalidArgumentError, match="block_table"):
            kv.gather(0, table, 1)
    assert kv.gather(0, [], 0)[0].shape == (0, 1, 8)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -1.0, "1", True, None])
def test_fp8_scales_are_finite_positive_numbers(scale):
    # inf was accepted (K read back as NaN); "1" raised a bare TypeError
    with pytest.raises(ConfigError, match="k_scale"):
        PagedKVCache(1, 2, 2, 1, 2, dtype=torch.float32, kv_dtype="fp8", k_scale=scale)
    assert PagedKVCache(1, 2, 2, 1, 2, kv_dtype="fp8", k_scale=torch.tensor(0.5)).k_scale == [0.5]


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (4, 1)])
def test_paged_attention_through_manager_equals_contiguous(hq, hkv):
    """Shared prefix, a fork that diverges (copy-on-write), shuffled physical blocks."""
    torch.manual_seed(0)
    p, d, n = 4, 16, 32
    mgr = CacheManager(n, p)
    mgr.pool._free.reverse()  # hand out blocks from the far end: tables are not 0, 1, 2, ...
    kv = PagedKVCache(1, n, p, hkv, d, dtype=torch.float32, fill=float("nan"))
    ns = Namespace(model="m")
    kv_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # token id -> its K/V (by position)

    def kv_for(tokens):
        # K/V depend on the whole prefix: derive them from (position, prefix) deterministically
        ks, vs = [], []
        for i in range(len(tokens)):
            key = hash(tuple(tokens[: i + 1]))
            if key not in kv_of:
                kv_of[key] = (torch.randn(hkv, d), torch.randn(hkv, d))
            ks.append(kv_of[key][0])
            vs.append(kv_of[key][1])
        return torch.stack(ks), torch.stack(vs)

    seqs = {"a": list(range(10)), "b": list(range(8)) + [90, 91, 92]}
    for rid, tokens in seqs.items():
        adm = mgr.admit(rid, tokens, ns)
        kv.apply_copies(adm.copies)
        k, v = kv_for(tokens)
        kv.write(0, k[adm.cached_len :], v[adm.cached_len :], adm.slot_mapping())
    mgr.fork("b", "c")
    seqs["c"] = list(seqs["b"])
    for rid, new in (("c", [5, 6, 7]), ("b", [1])):
        res = mgr.append(rid, new)
        seqs[rid] += new
        kv.apply_copies(res.copies)
        k, v = kv_for(seqs[rid])
        kv.write(0, k[-len(new) :], v[-len(new) :], res.slots)
    assert mgr.stats.cow_copies == 1 and mgr.stats.hit_tokens == 8
    for rid, tokens in seqs.items():
        q = torch.randn(2, hq, d)
        k, v = kv_for(tokens)
        pk, pv = kv.gather(0, mgr.block_table(rid), len(tokens))
        torch.testing.assert_close(pk, k)
        torch.testing.assert_close(reference_attention(q, pk, pv), reference_attention(q, k, v))
    mgr.check_integrity()


def test_host_transfers_move_kv_out_and_back():
    from prefixcache import InvalidArgumentError

    mgr = CacheManager(4, 4, stepped=True, host_blocks=4)
    kv = PagedKVCache(2, 4, 4, 1, 8, dtype=torch.float32, host_blocks=4)
    ns = Namespace(model="m")
    a, b = list(range(9)), list(range(100, 109))
    adm = mgr.admit("a", a, ns)
    for layer in range(2):
        kv.write(layer, torch.randn(9, 1, 8), torch.randn(9, 1, 8), adm.slot_mapping())
    want = [kv.k[layer][adm.block_table[:2]].clone() for layer in range(2)]
    mgr.end_step()
    mgr.release("a")
    adm_b = mgr.admit("b", b, ns)  # evicts a's two full blocks into the host tier
    kv.start_transfers(mgr.take_transfers())
    for layer in range(2):
        kv.wait_transfers(layer)
        kv.write(layer, torch.zeros(9, 1, 8), torch.zeros(9, 1, 8), adm_b.slot_mapping())
    mgr.end_step()
    mgr.release("b")
    adm = mgr.admit("a2", a, ns)
    assert (adm.hit_blocks, adm.host_blocks) == (1, 1)  # a's last full block was offloaded
    transfers = mgr.take_transfers()
    assert len(transfers.loads) == 1
    kv.start_transfers(transfers)
    for layer in range(2):
        kv.wait_transfers(layer)
        assert torch.equal(kv.k[layer][adm.block_table[:2]], want[layer])
    with pytest.raises(InvalidArgumentError):
        kv.start_transfers(([(0, 4)], []))  # host slot outside the tier
    with pytest.raises(InvalidArgumentError):
        kv.start_transfers(([], [(0, 9)]))  # block outside the cache
    with pytest.raises(InvalidArgumentError):
        kv.start_transfers(([(0.5, 1)], []))
    with pytest.raises(InvalidArgumentError):
        kv.wait_transfers(2)
    with pytest.raises(ConfigError):
        PagedKVCache(1, 2, 4, 1, 8, host_blocks=-1)
