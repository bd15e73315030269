"""The engines' interfaces prefixcache implements, read from their published wheels: a test fails
when vLLM 0.33.0 or SGLang 0.5.23 changes a method the project's connector or backend
implements, drops one it calls, or renames a field it reads.

Nothing is imported from the engines (they need their own environments): their source files are
read out of the wheels (tests/engine_wheels.py, downloaded by CI) and compared, as syntax trees,
with the project's own source. A method's interface is its parameters in order, each with its
kind (positional, ``*args``, keyword-only, ``**kwargs``) and whether it has a default.
"""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest
from engine_wheels import SGLANG, VLLM, missing, wheel

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = ROOT / "prefixcache/engines/vllm/connector.py"
STATS = ROOT / "prefixcache/engines/vllm/connector_stats.py"
PLAN = ROOT / "prefixcache/engines/vllm/connector_plan.py"
HICACHE = ROOT / "prefixcache/engines/sglang/hicache_store.py"


class Param(NamedTuple):
    name: str
    kind: str  # "positional", "*", "keyword", "**"
    has_default: bool


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[Param, ...]:
    """A function's parameters as its callers see them (``self`` / ``cls`` left out)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [Param(p.arg, "positional", d) for p, d in zip(positional, defaults, strict=True)]
    if a.vararg is not None:
        out.append(Param(a.vararg.arg, "*", False))
    for p, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(Param(p.arg, "keyword", default is not None))
    if a.kwarg is not None:
        out.append(Param(a.kwarg.arg, "**", False))
    if out and out[0].name in ("self", "cls"):
        out = out[1:]
    return tuple(out)


def shown(ps: tuple[Param, ...]) -> str:
    marks = {"positional": "", "*": "*", "keyword": "kw:", "**": "**"}
    return (
        "(" + ", ".join(f"{marks[p.kind]}{p.name}{'=' if p.has_default else ''}" for p in ps) + ")"
    )


def classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def abstract(cls: ast.ClassDef) -> set[str]:
    """The methods a class marks ``@abstractmethod``."""
    return {
        name
        for name, fn in methods(cls).items()
        if any(ast.unparse(d).endswith("abstractmethod") for d in fn.decorator_list)
    }


def fields(cls: ast.ClassDef) -> set[str]:
    """Names a class declares (annotated fields) or assigns on ``self`` in its methods."""
    found = {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                found.add(t.attr)
    found |= set(methods(cls))  # properties
    return found


def engine_file(engine: tuple[str, str], member: str) -> str:
    reason = missing(engine)
    if reason is not None:
        pytest.skip(reason)
    path = wheel(engine)
    assert path is not None
    with zipfile.ZipFile(path) as zf:
        return zf.read(member).decode()


def overridden_changes(ours: ast.ClassDef, theirs: ast.ClassDef) -> list[str]:
    """Each method of ``ours`` that ``theirs`` also defines, with another interface."""
    problems = []
    base = methods(theirs)
    for name, fn in methods(ours).items():
        if name.startswith("__") and name != "__init__":
            continue
        if name in base and params(fn) != params(base[name]):
            problems.append(
                f"{ours.name}.{name}{shown(params(fn))} but {theirs.name}.{name}"
                f"{shown(params(base[name]))}"
            )
    return problems


# ---- vLLM -------------------------------------------------------------------------------
VLLM_BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
VLLM_METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"


def test_the_connector_implements_vllms_kv_connector_as_published():
    base = classes(engine_file(VLLM, VLLM_BASE))["KVConnectorBase_V1"]
    ours = classes(CONNECTOR.read_text())["PrefixcacheStoreConnector"]
    assert overridden_changes(ours, base) == []
    unimplemented = abstract(base) - set(methods(ours))
    assert not unimplemented, f"vLLM's abstract methods not implemented: {sorted(unimplemented)}"
    # the calls the connector makes on its base (bound metadata, the bound cache manager)
    for name in ("has_connector_metadata", "_get_connector_metadata", "bind_connector_metadata"):
        assert name in methods(base), f"KVConnectorBase_V1.{name} is gone"
    assert {"_kv_transfer_config", "_kv_cache_manager"} <= fields(base)


def test_the_connectors_stats_and_metadata_match_vllms_classes():
    published = classes(engine_file(VLLM, VLLM_METRICS))
    ours = classes(STATS.read_text())
    assert overridden_changes(ours["StoreConnectorStats"], published["KVConnectorStats"]) == []
    assert overridden_changes(ours["StorePromMetrics"], published["KVConnectorPromMetrics"]) == []
    base = classes(engine_file(VLLM, VLLM_BASE))
    plan = classes(PLAN.read_text())
    assert overridden_changes(plan["StoreWorkerReport"], base["KVConnectorWorkerMetadata"]) == []


def test_what_the_connector_reads_of_vllms_requests_and_scheduler_output_is_there():
    request = classes(engine_file(VLLM, "vllm/v1/request.py"))["Request"]
    read = {
        "request_id", "prompt_token_ids", "prompt_embeds", "mm_features", "lora_request",
        "cache_salt", "block_hashes", "num_tokens",
    }  # fmt: skip
    assert read <= fields(request), sorted(read - fields(request))
    output = classes(engine_file(VLLM, "vllm/v1/core/sched/output.py"))
    wanted = {
        "SchedulerOutput": {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens"},
        "NewRequestData": {"req_id", "num_computed_tokens", "block_ids"},
        "CachedRequestData": {"req_ids", "num_computed_tokens"},
    }
    for name, names in wanted.items():
        assert names <= fields(output[name]), (name, sorted(names - fields(output[name])))
    events = classes(engine_file(VLLM, "vllm/distributed/kv_events.py"))
    stored = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}
    assert stored | {"lora_name"} <= fields(events["BlockStored"])
    assert {"block_hashes", "medium"} <= fields(events["BlockRemoved"])
    kv_output = classes(engine_file(VLLM, "vllm/v1/outputs.py"))["KVConnectorOutput"]
    assert "kv_connector_worker_meta" in fields(kv_output)
    transfer = classes(engine_file(VLLM, "vllm/config/kv_transfer.py"))["KVTransferConfig"]
    assert {"kv_connector_extra_config", "kv_load_failure_policy"} <= fields(transfer)


# ---- SGLang -----------------------------------------------------------------------------
SGLANG_STORAGE = "sglang/srt/mem_cache/hicache_storage.py"


def test_the_hicache_backend_implements_sglangs_storage_as_published():
    published = classes(engine_file(SGLANG, SGLANG_STORAGE))
    base = published["HiCacheStorage"]
    ours = classes(HICACHE.read_text())["PrefixcacheHiCacheStorage"]
    assert overridden_changes(ours, base) == []
    unimplemented = abstract(base) - set(methods(ours))
    assert not unimplemented, f"SGLang's abstract methods not implemented: {sorted(unimplemented)}"
    config = published["HiCacheStorageConfig"]
    read = {"tp_rank", "tp_size", "is_mla_model", "model_name", "extra_config"}
    assert read <= fields(config), sorted(read - fields(config))


def test_sglang_builds_a_dynamic_backend_as_the_backend_expects():
    factory = engine_file(SGLANG, "sglang/srt/mem_cache/storage/backend_factory.py")
    # a dynamic backend is built as Cls(storage_config, kwargs), then given the host pool
    assert "backend_class(storage_config, kwargs)" in factory
    for key in ('"backend_name"', '"module_path"', '"class_name"'):
        assert key in factory
    controller = engine_file(SGLANG, "sglang/srt/managers/cache_controller.py")
    assert "register_mem_pool_host(self.storage_host_pool)" in controller
    assert 'extra_config.get("interface_v1"' in controller
