"""A store whose library is not installed says which extra to install, as a ConfigError."""

import sys

import pytest

from prefixcache.errors import ConfigError


def test_mooncake_without_its_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if absent
    from prefixcache.store.mooncake import MooncakeBlockStore

    with pytest.raises(ConfigError, match=r"pip install 'prefixcache\[mooncake\]'.*libibverbs1"):
        MooncakeBlockStore("127.0.0.1:1", "http://127.0.0.1:1/metadata")


def test_lmdb_without_its_library_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lmdb", None)
    from prefixcache.store.lmdb import LMDBBlockStore

    with pytest.raises(ConfigError, match=r"pip install 'prefixcache\[store\]'"):
        LMDBBlockStore(tmp_path / "kv")


def test_a_bad_mooncake_url_is_a_config_error():
    from prefixcache.store.mooncake import MooncakeBlockStore

    for url in ("mooncake://h:1", "redis://h:1?metadata=x", "mooncake://h:1?metadata=x&segment=a"):
        with pytest.raises(ConfigError):
            MooncakeBlockStore.from_url(url)
