"""Stores opened from URLs: each accepted form opens its backend with the options it names, and
every URL that names no store is a StoreURLError (a ConfigError) saying what is wrong, with
nothing opened or created."""

from __future__ import annotations

import os

import pytest

from prefixcache.errors import ConfigError
from prefixcache.store.from_url import (
    LMDBLocation,
    MooncakeLocation,
    StoreURLError,
    check_store_url,
    open_store,
    parse_size,
)
from tests.store.mooncake_master import MooncakeMaster, client_error

MIB = 1 << 20


def test_an_lmdb_url_opens_the_one_host_store_in_its_directory(tmp_path):
    pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")
    from prefixcache.store.lmdb import LMDBBlockStore

    where = tmp_path / "a dir"  # a space, percent-escaped in the URL
    store = open_store(f"lmdb://{tmp_path}/a%20dir?capacity=16MiB")
    try:
        assert isinstance(store, LMDBBlockStore)
        assert store.path == where and store.capacity_bytes == 16 * MIB
        assert store.put_many([(bytes(16), b"x" * 100)]) == 1
    finally:
        store.close()
    again = open_store(f"lmdb://{where}")  # the same store, at the default capacity
    try:
        assert isinstance(again, LMDBBlockStore) and again.exists([bytes(16)]) == [True]
    finally:
        again.close()


def test_a_bare_path_is_the_lmdb_store_and_the_callers_default_capacity_yields_to_the_url(
    tmp_path, monkeypatch
):
    pytest.importorskip("lmdb", reason="the one-host store needs lmdb (pip install '.[store]')")
    from prefixcache.store.lmdb import LMDBBlockStore

    monkeypatch.chdir(tmp_path)
    store = open_store("kv", default_capacity_bytes=8 * MIB)  # relative to the working folder
    try:
        assert isinstance(store, LMDBBlockStore) and store.capacity_bytes == 8 * MIB
        assert (tmp_path / "kv" / "data.mdb").is_file()
    finally:
        store.close()
    store = open_store(f"lmdb://{tmp_path}/other?capacity=2MiB", default_capacity_bytes=8 * MIB)
    try:
        assert isinstance(store, LMDBBlockStore) and store.capacity_bytes == 2 * MIB
    finally:
        store.close()


def test_a_mooncake_url_names_every_client_setting():
    url = (
        "mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata&segment=512&buffer=32"
        "&local_hostname=10.0.0.7&metrics=http://10.0.0.1:9003/metrics"
    )
    assert check_store_url(url) == MooncakeLocation(
        "10.0.0.1:50051",
        "http://10.0.0.1:8080/metadata",
        "10.0.0.7",
        512 * MIB,
        32 * MIB,
        "http://10.0.0.1:9003/metrics",
    )
    assert check_store_url("mooncake://m:1?metadata=etcd") == MooncakeLocation(
        "m:1", "etcd", None, 256 * MIB, 64 * MIB, None
    )
    assert check_store_url("/dev/shm/kv") == LMDBLocation("/dev/shm/kv", None)
    assert check_store_url("lmdb:///dev/shm/kv?capacity=4GiB") == LMDBLocation(
        "/dev/shm/kv", 4 << 30
    )


@pytest.mark.skipif(client_error() is not None, reason=str(client_error()))
def test_a_mooncake_url_opens_a_client_of_its_master(tmp_path):
    from prefixcache.store.mooncake import MooncakeBlockStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    master = MooncakeMaster(tmp_path)
    master.start()
    try:
        store = open_store(master.url + "&local_hostname=127.0.0.1")
        try:
            assert isinstance(store, MooncakeBlockStore)
            assert store.master == f"127.0.0.1:{master.rpc}" and store.local_hostname == (
                "127.0.0.1"
            )
            assert store.metrics_url == f"http://127.0.0.1:{master.metrics}/metrics"
            assert store.put_many([(bytes(16), b"y" * 64)]) == 1
            assert store.exists([bytes(16)]) == [True]
        finally:
            store.close()
    finally:
        master.stop()


BAD = [
    ("", "a store URL is lmdb:///PATH"),
    ("   ", "a store URL is lmdb:///PATH"),
    ("redis://127.0.0.1:6379/0", "unknown store 'redis'"),
    ("lmdb://kv", "three slashes .* not the host 'kv'"),
    ("lmdb://dev/shm/kv", "not the host 'dev'"),
    ("lmdb:///", "needs a directory"),
    ("lmdb://{tmp}/kv?capacity=lots", "capacity in .*KiB/MiB/GiB"),
    ("lmdb://{tmp}/kv?capacity=512KiB", "below 1 MiB"),
    ("lmdb://{tmp}/kv?capcity=1GiB", "unknown option 'capcity'.*takes capacity"),
    ("lmdb://{tmp}/kv?capacity=1GiB&capacity=2GiB", "'capacity' given twice"),
    ("lmdb://{tmp}/kv?capacity=", "'capacity' has no value"),
    ("{tmp}/kv?capacity=1GiB", "a bare path takes no options"),
    ("mooncake://m:50051", "needs its metadata server"),
    ("mooncake://m?metadata=http://m:8080/metadata", "mooncake://HOST:PORT"),
    ("mooncake://m:port?metadata=http://m:8080/metadata", "mooncake://HOST:PORT"),
    ("mooncake://:50051?metadata=http://m:8080/metadata", "mooncake://HOST:PORT"),
    ("mooncake://u:p@m:50051?metadata=http://m:8080/metadata", "mooncake://HOST:PORT"),
    ("mooncake://m:50051/kv?metadata=http://m:8080/metadata", "no path, got '/kv'"),
    ("mooncake://m:50051?metadata=x&segment=a", "segment is a count of MiB.*'a'"),
    ("mooncake://m:50051?metadata=x&buffer=-1", "buffer is a count of MiB"),
    ("mooncake://m:50051?metadata=x&segments=1", "unknown option 'segments'"),
]


@pytest.mark.parametrize(("url", "says"), BAD)
def test_a_url_that_names_no_store_says_what_is_wrong_and_creates_nothing(
    url, says, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # where a relative path would be created
    url = url.format(tmp=tmp_path)
    with pytest.raises(StoreURLError, match=says) as checked:
        check_store_url(url)
    assert isinstance(checked.value, ConfigError)
    with pytest.raises(StoreURLError, match=says):
        open_store(url, default_capacity_bytes=8 * MIB)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", [None, 42, b"lmdb:///kv", ["lmdb:///kv"]])
def test_a_store_url_that_is_no_string_is_refused(url):
    with pytest.raises(StoreURLError, match="a store URL is"):
        check_store_url(url)


def test_sizes_read_with_binary_units():
    assert parse_size("1073741824") == 1 << 30
    assert parse_size("1GiB") == parse_size("1G") == parse_size("1 gib") == 1 << 30
    assert parse_size("512MiB") == 512 * MIB and parse_size(4096) == 4096
    for bad in ("lots", "1.5GiB", "-1", "1PB"):
        with pytest.raises(ConfigError, match="a size is"):
            parse_size(bad)
