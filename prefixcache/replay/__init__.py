"""Workload replay: scenarios and traces driven through the real CacheManager.

from prefixcache.replay import ReplayConfig, replay_path, write_run

result = replay_path("scenarios/rag.yaml", ReplayConfig(capacity_blocks=4096))
print(result.to_report_dict()["token_hit_rate"])
write_run(result, "runs/rag")
"""

from prefixcache.replay.model_specs import ModelConfig, get_model, parse_size
from prefixcache.replay.run_config import ReplayConfig
from prefixcache.replay.run_result import ReplayResult, write_run
from prefixcache.replay.runner import replay_path, replay_requests, replay_source, replay_sweep
from prefixcache.replay.workload.input_errors import ScenarioError, TraceFormatError
from prefixcache.replay.workload.request import Request
from prefixcache.replay.workload.scenario import Scenario, load_scenario
from prefixcache.replay.workload.scenario_requests import Workload
from prefixcache.replay.workload.sources import Source, open_source
from prefixcache.replay.workload.traces import TraceOptions, read_trace

__all__ = [
    "ModelConfig",
    "ReplayConfig",
    "ReplayResult",
    "Request",
    "Scenario",
    "ScenarioError",
    "Source",
    "TraceFormatError",
    "TraceOptions",
    "Workload",
    "get_model",
    "load_scenario",
    "open_source",
    "parse_size",
    "read_trace",
    "replay_path",
    "replay_requests",
    "replay_source",
    "replay_sweep",
    "write_run",
]
