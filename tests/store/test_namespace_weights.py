"""A namespace names the exact weights (a revision or a fingerprint of them): runtimes that serve
one model name with other weights never load each other's blocks, and a namespace without
weights hashes exactly as before (every existing digest, report and golden file holds)."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")

from prefixcache import CacheManager, Namespace
from prefixcache.blocks.hashing import BlockHasher
from prefixcache.errors import InvalidArgumentError
from prefixcache.store.block_record import namespace_fingerprint
from prefixcache.store.connector import KVStoreConnector
from prefixcache.store.lmdb import LMDBBlockStore
from prefixcache.store.weights_fingerprint import weights_fingerprint

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_runtime.py"
MIB = 1 << 20


def test_a_namespace_without_weights_encodes_as_before():
    ns = Namespace(model="m", adapter="a", adapter_version="1", salt="s", extra=("x",))
    assert ns.canonical_bytes() == (
        b"\x01\x01\x00\x00\x00m"
        b"\x01\x01\x00\x00\x00a"
        b"\x01\x01\x00\x00\x001"
        b"\x01\x01\x00\x00\x00s"
        b"\x01\x00\x00\x00"
        b"\x01\x01\x00\x00\x00x"
    )
    assert Namespace(model="m", weights=None) == Namespace(model="m")


def test_weights_change_the_seed_and_never_collide():
    hasher = BlockHasher(16)
    names = [
        Namespace(model="m"),
        Namespace(model="m", weights="rev-a"),
        Namespace(model="m", weights="rev-b"),
        Namespace(model="m", weights=""),
        Namespace(model="m", extra=("rev-a",)),
        Namespace(model="m", salt="rev-a"),
    ]
    assert len({hasher.seed(ns) for ns in names}) == len(names)
    assert len({ns.canonical_bytes() for ns in names}) == len(names)
    assert len({ns.label() for ns in names}) == len(names)
    assert len({namespace_fingerprint(ns) for ns in names}) == len(names)
    ns = Namespace(model="m", salt="t", weights="sha:0a1b")
    assert pickle.loads(pickle.dumps(ns)) == ns and "weights=sha:0a1b" in ns.label()
    with pytest.raises(InvalidArgumentError, match="weights"):
        Namespace(model="m", weights=7)  # type: ignore[arg-type]


def test_the_weights_fingerprint_follows_every_byte_name_and_shape():
    gen = torch.Generator().manual_seed(0)
    state = {"embed": torch.randn(8, 4, generator=gen), "w": torch.randn(4, 4, generator=gen)}
    same = {k: v.clone() for k, v in state.items()}
    assert weights_fingerprint(state) == weights_fingerprint(same)
    flipped = {k: v.clone() for k, v in state.items()}
    flipped["w"][2, 3] += 1e-6
    renamed = {"embed": state["embed"], "w2": state["w"]}
    reshaped = {"embed": state["embed"].reshape(4, 8), "w": state["w"]}
    retyped = {"embed": state["embed"].half(), "w": state["w"]}
    prints = {weights_fingerprint(s) for s in (state, flipped, renamed, reshaped, retyped)}
    assert len(prints) == 5
    assert weights_fingerprint(state).startswith("xxh3:")


@pytest.fixture(scope="module")
def runtime() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_runtime_weights", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _serve(runtime: ModuleType, store: LMDBBlockStore, seed: int, weights: str | None):
    """A runtime of the tiny model with weights ``seed``, named ``weights``, through ``store``:
    its run, its store counters, and the same prompts without caching."""
    cfg = runtime.ModelConfig()
    model = runtime.TinyDecoder(cfg, seed=seed)
    prompts = runtime.rotating_prompt_batch(8, 2, 64, cfg.vocab)
    _, kv = runtime.new_cache(cfg, num_blocks=64, stepped=True)
    connector = KVStoreConnector(store, kv, owns_backend=False)
    mgr = CacheManager(64, 16, stepped=True, store=connector)
    ns = Namespace(model="tiny-random", weights=weights)
    run = runtime.run_requests(model, mgr, kv, ns, prompts, max_new_tokens=4, store=connector)
    connector.flush()
    counters = connector.counters()
    connector.close()
    plain = runtime.generate(model, prompts, max_new_tokens=4, caching=False)
    diff = max(
        float((a - b).abs().max())
        for rid in prompts
        for a, b in zip(run.logits[rid], plain.logits[rid], strict=True)
    )
    return run, counters, run.tokens == plain.tokens and diff <= runtime.LOGIT_TOL


def _fingerprint(runtime: ModuleType, seed: int) -> str:
    model = runtime.TinyDecoder(runtime.ModelConfig(), seed=seed)
    state = {"embed": model.embed}
    for i, layer in enumerate(model.layers):
        state.update({f"layers.{i}.{j}": w for j, w in enumerate(layer)})
    return weights_fingerprint(state)


@pytest.mark.parametrize("naming", ["revision", "fingerprint"])
def test_other_weights_under_one_model_name_never_load_each_others_blocks(
    runtime, tmp_path, naming
):
    store = LMDBBlockStore(tmp_path / "kv", 64 * MIB)
    try:
        if naming == "revision":
            weights_a, weights_b = "rev-a", "rev-b"
        else:
            weights_a, weights_b = _fingerprint(runtime, 0), _fingerprint(runtime, 1)
        _, first, ok = _serve(runtime, store, 0, weights_a)
        assert ok and first.written_blocks > 0
        _, other, ok = _serve(runtime, store, 1, weights_b)  # same model name, other weights
        assert ok, "the other weights' runtime served wrong tokens or logits"
        assert other.loaded_blocks == 0 and other.refused == {} and other.written_blocks > 0
        _, again, ok = _serve(runtime, store, 0, weights_a)  # the first weights share still
        assert ok and again.loaded_blocks > 0
    finally:
        store.close()
