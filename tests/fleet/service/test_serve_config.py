"""The service config: the shipped example loads; every mistake is a ConfigError saying where."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prefixcache.blocks.namespace import Namespace
from prefixcache.errors import ConfigError
from prefixcache.fleet.index.from_url import check_index_url, open_index
from prefixcache.fleet.policies import RoutingParams
from prefixcache.fleet.service.configuration.config_file import (
    HealthConfig,
    load_config,
    parse_config,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "fleet" / "fleet.yaml"


def test_example_config_loads() -> None:
    config = load_config(EXAMPLE)
    assert [r.name for r in config.replicas] == ["replica-0", "replica-1"]
    assert config.routing.policy == "prefix_cost"
    assert config.routing.params == RoutingParams(64, 1.5, 0.3, 8.0)
    assert config.routing.in_flight_timeout_s == 600.0
    assert config.health == HealthConfig(5.0, 2.0, "/health", 10.0)
    assert config.index == "memory" and config.tokenizer is None and not config.proxy.enabled
    first = config.replicas[0]
    assert first.namespace == Namespace("meta-llama/Llama-3.1-8B-Instruct")
    assert first.url == "http://127.0.0.1:8100" and first.events == "tcp://127.0.0.1:5557"
    assert first.spec() == ("replica-0", first.namespace, 16, 32768, (), None)


def test_full_replica_fields_and_relative_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_text("{}")
    data = {
        "tokenizer": "tok.json",
        "index": "redis://127.0.0.1:6379/2",
        "replicas": [
            {"name": "r", "model": "m", "adapter": "sql", "adapter_version": "3", "salt": "t",
             "extra": ["img"], "block_size": 32, "capacity_blocks": 10, "replay": "ipc:///tmp/r",
             "kv_store": "pool-a"}
        ],
    }  # fmt: skip
    config = parse_config(data, "f.yaml", tmp_path)
    assert config.tokenizer == str(tmp_path / "tok.json")
    assert config.replicas[0].namespace == Namespace("m", "sql", "3", "t", ("img",))
    assert config.index == "redis://127.0.0.1:6379/2"
    assert config.replicas[0].spec().kv_store == "pool-a"


BASE = {"replicas": [{"name": "a", "model": "m"}]}
TWO = [{"name": "a", "model": "m"}, {"name": "b", "model": "m"}]


def rep(**fields: object) -> dict[str, object]:
    return {"replicas": [{"name": "a", "model": "m", **fields}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (rep(blocksize=16), "replicas[0]: unknown key 'blocksize'"),
        ({"replicas": [{"name": "a"}]}, "replicas[0].model: expected a non-empty string"),
        ({"replicas": [{"name": "a b", "model": "m"}]}, "not a valid name"),
        ({"replicas": [{"name": "a", "model": "m"}] * 2}, "duplicate replica name 'a'"),
        ({"replicas": [{"name": "a", "model": "m", "block_size": True}]}, "replicas[0].block_size"),
        ({"replicas": [{"name": "a", "model": "m", "url": "ftp://x"}]}, "http(s)://host:port"),
        ({"replicas": [{"name": "a", "model": "m", "url": "http://h:99999"}]}, "bad port"),
        ({"replicas": [{"name": "a", "model": "m", "events": "tcp://h"}]}, "ZMQ endpoint"),
        ({"replicas": [{"name": "a", "model": "m", "extra": "x"}]}, "list of strings"),
        ({"replicas": "a"}, "non-empty list"),
        ({"limits": {"max_replicas": 0}}, "limits.max_replicas"),
        ({"limits": {"max_replicas": 1}, "replicas": TWO}, "more than limits.max_replicas"),
        ({"routing": {"policy": "random"}}, "routing.policy: unknown policy 'random'"),
        ({"routing": {"balance_rel_threshold": 0.5}}, "balance_rel_threshold must be a finite"),
        ({"routing": {"cache_threshold": 2}}, "cache_threshold"),
        ({"routing": {"prefill_weight": -1}}, "prefill_weight must be a finite number >= 0"),
        ({"routing": {"prefill_weight": "high"}}, "prefill_weight must be a finite number >= 0"),
        ({"routing": {"prefill_weight": float("inf")}}, "prefill_weight must be a finite"),
        ({"routing": {"balance_rel_threshold": float("inf")}}, "balance_rel_threshold must be a"),
        (
            {"replicas": [{"name": "a", "model": "m", "events": "tcp://*:5557"}]},
            "is a bind address (the engine's); give the engine's host, e.g. 'tcp://127.0.0.1:5557'",
        ),
        ({"routing": {"in_flight_timeout_s": 0}}, "routing.in_flight_timeout_s: expected a pos"),
        ({"routing": {"in_flight_timeout_s": float("inf")}}, "positive finite number"),
        ({"routing": {"in_flight_timeout_s": "1m"}}, "routing.in_flight_timeout_s"),
        ({"proxy": {"enabled": "yes"}}, "proxy.enabled: expected true or false"),
        ({"index": "redis://h:6379/x"}, "expected 'memory', 'redis://host:port/db'"),
        ({"tokenizer": "missing.json"}, "tokenizer: file"),
        ({"hash_algo": "md5"}, "unknown hash 'md5'"),
        ({"hash_algo": ["x"]}, "hash_algo: unknown hash ['x']"),
        ({"routing": {"policy": ["x"]}}, "routing.policy: unknown policy ['x']"),
        ({"replicas": [{"name": "a", "model": "m", "events": "tcp://h:99999"}]}, "not in 1..65535"),
        ({"replicas": [{"name": "a", "model": "m", "adapters": "sql"}]}, "replicas[0].adapters"),
        ({"replicas": [{"name": "a", "model": "m", "salt": 5}]}, "fleet.yaml: replicas[0].salt: "),
        (rep(kv_store="a pool"), "replicas[0].kv_store: 'a pool' is not a valid store name"),
        (rep(kv_store=3), "replicas[0].kv_store: expected a non-empty string"),
        ({"chat_template": "missing.jinja"}, "chat_template: file"),
        ({"health": {"probe_interval_s": 0}}, "health.probe_interval_s"),
        ({"health": {"down_s": -1}}, "health.down_s"),
        ({"health": {"probe_path": "health"}}, "starting with '/'"),
        ({"health": {"retries": 3}}, "unknown key 'retries'"),
        ({"chat_template": "broken.jinja"}, "chat_template: broken.jinja: chat template line 1"),
        ({"colour": 1}, "unknown key 'colour'"),
    ],
)  # fmt: skip
def test_config_errors_say_what_and_where(change: dict, message: str, tmp_path: Path) -> None:
    (tmp_path / "broken.jinja").write_text("{% if messages %}")
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **change}, "fleet.yaml", tmp_path)
    assert str(info.value).startswith("fleet.yaml: ") and message in str(info.value)
    assert str(info.value).count("fleet.yaml") == 1  # said once


def test_chat_template_path_is_taken_from_the_config_dir(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].role }}"}')
    config = parse_config({**BASE, "chat_template": "tokenizer_config.json"}, "f.yaml", tmp_path)
    assert config.chat_template == str(tmp_path / "tokenizer_config.json")
    assert load_config(EXAMPLE).chat_template is None


def test_in_flight_timeout_can_be_switched_off(tmp_path: Path) -> None:
    config = parse_config({**BASE, "routing": {"in_flight_timeout_s": None}}, "f.yaml", tmp_path)
    assert config.routing.in_flight_timeout_s is None
    config = parse_config({**BASE, "routing": {"in_flight_timeout_s": 5}}, "f.yaml", tmp_path)
    assert config.routing.in_flight_timeout_s == 5.0


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("replicas: [\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(tmp_path / "empty.yaml")
    assert yaml.safe_load(EXAMPLE.read_text())["replicas"]


def test_open_index_rejects_bad_urls() -> None:
    with pytest.raises(ConfigError, match="expected 'memory'"):
        open_index("postgres://x")
    for bad in ("redis+cluster://h:7000/1", "redis+cluster://:7000", "redis://h:6379/x"):
        with pytest.raises(ConfigError, match="redis\\+cluster://host:port"):
            check_index_url(bad)
    for good in (
        "redis://h",
        "rediss://h:6380/2",
        "redis+cluster://h:7000",
        "rediss+cluster://h/0",
    ):
        assert check_index_url(good) == good


def test_the_event_message_size_limit_is_configurable_and_checked(tmp_path: Path) -> None:
    assert parse_config(BASE, "f.yaml", tmp_path).limits.max_event_message_bytes == 64 << 20
    config = parse_config(
        {**BASE, "limits": {"max_event_message_bytes": 1 << 20}}, "f.yaml", tmp_path
    )
    assert config.limits.max_event_message_bytes == 1 << 20
    for bad in (0, 512, "64MiB", True, 1 << 41):
        with pytest.raises(ConfigError, match=r"limits\.max_event_message_bytes"):
            parse_config({**BASE, "limits": {"max_event_message_bytes": bad}}, "f.yaml", tmp_path)


def test_the_replay_bounds_are_configurable_and_checked(tmp_path: Path) -> None:
    limits = parse_config(BASE, "f.yaml", tmp_path).limits
    assert (limits.replay_deadline_s, limits.max_replay_frames) == (2.0, 20_001)
    raw = {"replay_deadline_s": 0.5, "max_replay_frames": 100}
    limits = parse_config({**BASE, "limits": raw}, "f.yaml", tmp_path).limits
    assert (limits.replay_deadline_s, limits.max_replay_frames) == (0.5, 100)
    for key, bad in (
        ("replay_deadline_s", 0),
        ("replay_deadline_s", "2s"),
        ("max_replay_frames", 1),
    ):
        with pytest.raises(ConfigError, match=rf"limits\.{key}"):
            parse_config({**BASE, "limits": {key: bad}}, "f.yaml", tmp_path)
