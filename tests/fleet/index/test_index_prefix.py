"""Key prefixes, credentials and TLS of the Redis fleet index: two deployments share one Redis
under different prefixes; the URL's user, password and scheme reach the client."""

from __future__ import annotations

import pytest
import redis

from prefixcache.errors import ConfigError
from prefixcache.fleet.index.from_url import check_index_prefix, check_index_url, open_index
from prefixcache.fleet.index.memory import MemoryFleetIndex
from prefixcache.fleet.index.redis.connect import DEFAULT_PREFIX, open_client
from prefixcache.fleet.index.redis.shared_index import RedisFleetIndex
from prefixcache.fleet.service.configuration.config_file import parse_config
from tests.fleet_support import RedisServer, served_configs

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16
REPLICA = {"name": "replica-0", "model": "m"}


def test_two_deployments_with_their_own_prefix_share_one_redis(redis_server) -> None:
    team_a = open_index(redis_server.url + "?prefix=team-a")
    team_b = open_index(redis_server.url, prefix="team-b")
    try:
        assert isinstance(team_a, RedisFleetIndex) and isinstance(team_b, RedisFleetIndex)
        assert (team_a.prefix, team_b.prefix) == ("team-a", "team-b")
        team_a.store("replica-0", [A, B])
        team_b.store("replica-0", [C])
        assert team_a.flush() and team_b.flush()
        keys = {k.decode() for k in redis.Redis.from_url(redis_server.url).keys("team-*")}
        assert keys and all(k.startswith(("team-a:", "team-b:")) for k in keys)
        # fresh routers read Redis only: each sees its own deployment's blocks
        fresh_a = open_index(redis_server.url, prefix="team-a")
        fresh_b = open_index(redis_server.url + "?prefix=team-b")
        try:
            assert fresh_a.holdings("replica-0").keys() == {A, B}
            assert fresh_b.holdings("replica-0").keys() == {C}
            assert [(m.replica, m.blocks) for m in fresh_a.match([A, B])] == [("replica-0", 2)]
            assert [(m.replica, m.blocks) for m in fresh_a.match([C])] == [("replica-0", 0)]
            assert [(m.replica, m.blocks) for m in fresh_b.match([A])] == [("replica-0", 0)]
        finally:
            fresh_a.close()
            fresh_b.close()
        team_a.clear("replica-0")
        assert team_a.flush()
        team_b.store("replica-1", [A])
        team_b.drop_replica("replica-1")
        assert team_b.flush()
        fresh_a = open_index(redis_server.url, prefix="team-a")
        fresh_b = open_index(redis_server.url, prefix="team-b")
        try:
            assert fresh_a.num_blocks("replica-0") == 0
            assert fresh_b.holdings("replica-0").keys() == {C}
            team_a.drop_replica("replica-0")
            assert team_a.flush()
            assert "replica-0" not in fresh_a.replicas()
            assert fresh_b.replicas() == ["replica-0"]
            assert fresh_b.num_blocks("replica-0") == 1
        finally:
            fresh_a.close()
            fresh_b.close()
    finally:
        team_a.close()
        team_b.close()


def test_the_default_prefix_is_unchanged(redis_server) -> None:
    index = open_index(redis_server.url)
    try:
        assert isinstance(index, RedisFleetIndex) and index.prefix == DEFAULT_PREFIX
    finally:
        index.close()


def test_a_prefix_in_the_url_and_another_given_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="prefix"):
        open_index("redis://127.0.0.1:1/0?prefix=a", prefix="b")
    with pytest.raises(ConfigError, match="hash tag"):
        check_index_url("redis+cluster://127.0.0.1:1?prefix=team-a")
    assert check_index_url("redis+cluster://127.0.0.1:1?prefix={team-a}")
    assert isinstance(open_index("memory", prefix="team-a"), MemoryFleetIndex)


@pytest.mark.parametrize("bad", ["", "team a", "a\tb", "x" * 129, "a\nb", 7, None])
def test_bad_prefixes_are_config_errors(bad) -> None:
    with pytest.raises(ConfigError, match="prefix"):
        check_index_prefix(bad)


def test_the_config_takes_a_prefix() -> None:
    config = parse_config({"replicas": [REPLICA], "index": "redis://h:6379/0"})
    assert config.index_prefix is None
    config = parse_config(
        {"replicas": [REPLICA], "index": "redis://h:6379/0", "index_prefix": "team-a"}
    )
    assert config.index_prefix == "team-a"
    with pytest.raises(ConfigError, match="index_prefix"):
        parse_config({"replicas": [REPLICA], "index": "redis://h:6379/0", "index_prefix": "a b"})
    with pytest.raises(ConfigError, match=r"index_prefix.*hash tag"):
        parse_config(
            {"replicas": [REPLICA], "index": "redis+cluster://h:6379", "index_prefix": "team-a"}
        )
    with pytest.raises(ConfigError, match="index_prefix"):
        parse_config(
            {"replicas": [REPLICA], "index": "redis://h:6379/0?prefix=x", "index_prefix": "y"}
        )
    config = parse_config(
        {"replicas": [REPLICA], "index": "redis+cluster://h:6379", "index_prefix": "{team-a}"}
    )
    assert config.index_prefix == "{team-a}"


def test_user_and_password_in_the_url_reach_the_client() -> None:
    index = open_index("redis://router:s3cret@127.0.0.1:1/3?prefix=team-a", retry_interval=60.0)
    try:
        assert isinstance(index, RedisFleetIndex) and index.prefix == "team-a"
        kwargs = index.client.connection_pool.connection_kwargs
        assert kwargs["username"] == "router" and kwargs["password"] == "s3cret"
        assert kwargs["db"] == 3 and "prefix" not in kwargs
    finally:
        index.close()


def test_a_password_alone_reaches_the_client() -> None:
    index = open_index("redis://:s3cret@127.0.0.1:1/0", retry_interval=60.0)
    try:
        kwargs = index.client.connection_pool.connection_kwargs
        assert kwargs.get("username") is None and kwargs["password"] == "s3cret"
    finally:
        index.close()


def test_rediss_gives_a_tls_connection() -> None:
    url = "rediss://u:p@127.0.0.1:1/0?prefix=team-a&ssl_ca_certs=/etc/ca%26.pem"
    url += "&ssl_cert_reqs=required"
    index = open_index(url, retry_interval=60.0)
    try:
        pool = index.client.connection_pool
        assert issubclass(pool.connection_class, redis.SSLConnection)
        kwargs = pool.connection_kwargs
        assert kwargs["username"] == "u" and kwargs["password"] == "p" and "prefix" not in kwargs
        assert (kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"]) == ("/etc/ca&.pem", "required")
    finally:
        index.close()


def test_a_password_never_shows_in_an_error() -> None:
    with pytest.raises(ConfigError) as bad_url:
        check_index_url("redis://router:s3cret@h:6379/x")
    with pytest.raises(ConfigError) as bad_client:
        open_client("http://router:s3cret@h:6379/0")
    for exc in (bad_url.value, bad_client.value):
        assert "s3cret" not in str(exc) and "router:***@h:6379" in str(exc)


def test_serve_opens_the_index_under_the_configured_prefix(
    tmp_path, redis_server, monkeypatch
) -> None:

    from prefixcache.cli import main

    served = served_configs(monkeypatch)
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f"replicas: [{{name: replica-0, model: m}}]\n"
        f"index: {redis_server.url}\nindex_prefix: team-a\n"
    )
    assert main(["serve", "--config", str(path)]) == 0
    (app,) = (config.app for config in served)
    index = app.state.service.router.index  # type: ignore[attr-defined]
    try:
        assert isinstance(index, RedisFleetIndex) and index.prefix == "team-a"
    finally:
        index.close()


def test_a_password_reaches_a_server_that_asks_for_it(tmp_path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        redis.Redis(port=server.port).config_set("requirepass", "p@ss:w/rd")
        good = f"redis://:p%40ss%3Aw%2Frd@127.0.0.1:{server.port}/0?prefix=team-a"
        index = open_index(good)
        try:
            index.store("replica-0", [A])
            assert index.flush() and index.stats().errors == 0
        finally:
            index.close()
        client = redis.Redis(port=server.port, password="p@ss:w/rd")
        assert client.keys("team-a:*") and client.keys("prefixcache:*") == []
        client.close()
        cluster = f"redis+cluster://:p%40ss%3Aw%2Frd@127.0.0.1:{server.port}?prefix={{team-a}}"
        with pytest.raises(ConfigError, match="not a cluster") as refused:
            open_index(cluster)
        assert "p%40ss" not in str(refused.value) and ":***@127.0.0.1" in str(refused.value)
    finally:
        server.kill()
