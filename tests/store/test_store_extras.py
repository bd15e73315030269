"""A store whose library is not installed says which extra to install, as a ConfigError; one
whose library is hidden by the backend module of the same name says that."""

import subprocess
import sys
from pathlib import Path

import pytest

import prefixcache.store
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


@pytest.mark.parametrize(
    ("library", "url"),
    [("lmdb", "lmdb:///{tmp}/kv"), ("mooncake", "mooncake://127.0.0.1:1?metadata=http://x/m")],
)
def test_a_backend_named_like_its_library_never_stands_in_for_it(library, url, tmp_path):
    """Python started inside prefixcache/store puts that folder on its path, where lmdb.py and
    mooncake.py would be found in place of the libraries: opening the store says so."""
    code = (
        "from prefixcache.errors import ConfigError\n"
        "from prefixcache.store.from_url import open_store\n"
        "try:\n"
        f"    open_store({url.format(tmp=tmp_path)!r})\n"
        "except ConfigError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    folder = Path(prefixcache.store.__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ConfigError the {library} library is hidden by "), done.stdout
    assert str(folder / f"{library}.py") in done.stdout and "another folder" in done.stdout
    assert not (tmp_path / "kv").exists()
