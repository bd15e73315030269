"""What a replica's ``engine_hash`` names: ``vllm`` alone is vLLM's default hashing (its
``--prefix-caching-hash-algo`` default, read here from vLLM 0.33.0's wheel), the other algorithms
are named explicitly, and a config spelling out what it means keeps meaning it."""

from __future__ import annotations

import ast
import zipfile
from typing import Any

import pytest

from prefixcache.errors import ConfigError
from prefixcache.fleet.events.engine_keys import EngineHashSpec, parse_engine_hash
from prefixcache.fleet.service.configuration.config_file import parse_config
from tests.engine_wheels import VLLM, missing, wheel


def _vllm_default_hash_algo() -> str:
    """``CacheConfig.prefix_caching_hash_algo``'s default in vLLM's own source."""
    path = wheel(VLLM)
    assert path is not None
    with zipfile.ZipFile(path) as zf:
        tree = ast.parse(zf.read("vllm/config/cache.py"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "prefix_caching_hash_algo"
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    raise AssertionError("no prefix_caching_hash_algo default in vLLM's CacheConfig")


@pytest.mark.skipif(missing(VLLM) is not None, reason=str(missing(VLLM)))
def test_vllm_alone_is_vllms_default_hash_algorithm() -> None:
    default = _vllm_default_hash_algo()
    assert default == "sha256"
    assert parse_engine_hash("vllm") == EngineHashSpec("vllm", default)
    assert parse_engine_hash({"engine": "vllm"}) == EngineHashSpec("vllm", default)
    assert parse_engine_hash({"engine": "vllm", "seed": 0}) == EngineHashSpec("vllm", default, "0")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_every_algorithm_is_named_explicitly_and_keeps_its_meaning(algo: str) -> None:
    seed: dict[str, Any] = {"seed": "1"} if algo.startswith("xxhash") else {}
    spec = EngineHashSpec("vllm", algo, seed.get("seed"))
    assert parse_engine_hash({"engine": "vllm", "algo": algo, **seed}) == spec
    if not seed:
        assert parse_engine_hash(f"vllm-{algo}") == spec
    assert spec.label() == f"vllm-{algo}"


def test_a_config_names_the_replica_when_its_engine_hash_is_wrong() -> None:
    def replica(engine_hash: Any) -> dict[str, Any]:
        return {"replicas": [{"name": "a", "model": "m", "engine_hash": engine_hash}]}

    assert parse_config(replica("vllm")).replicas[0].engine_hash == EngineHashSpec("vllm")
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.engine_hash.*vllm-sha256_cbor"):
        parse_config(replica("vllm-sha512"))
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.engine_hash"):
        parse_config(replica("vllm-xxhash"))  # no seed: not reproducible
