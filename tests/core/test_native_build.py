"""The two builds of the core: compiled (mypyc) when installed so, the Python sources on demand
(``PREFIXCACHE_PURE_PYTHON=1``) and whenever the sources changed since the build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prefixcache
from prefixcache import native

ROOT = Path(__file__).resolve().parents[2]
PURE = os.environ.get(native.PURE_ENV, "") not in ("", "0")


def _loaded_from(env: dict[str, str]) -> list[str]:
    """The file each compiled module is loaded from in a fresh interpreter."""
    code = (
        "import importlib, prefixcache, prefixcache.native as n\n"
        "print(prefixcache.CORE_BUILD.compiled)\n"
        "for m in n.COMPILED_MODULES: print(importlib.import_module(m).__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out


def test_every_compiled_module_exists_and_the_list_is_sorted() -> None:
    for module in native.COMPILED_MODULES + native.C_HELPERS:
        assert native.source_path(module).is_file(), module
    assert list(native.COMPILED_MODULES) == sorted(native.COMPILED_MODULES)


def test_the_public_facade_stays_python() -> None:
    # CacheManager checks its own arguments and raises the package's typed errors; compiled
    # code would reject a wrongly typed argument with a bare TypeError before those checks run
    assert "prefixcache.manager.cache_manager" not in native.COMPILED_MODULES
    assert "prefixcache.blocks.namespace" not in native.COMPILED_MODULES


def test_the_build_in_charge_is_the_one_loaded() -> None:
    build = prefixcache.CORE_BUILD
    for module in native.COMPILED_MODULES:
        path = sys.modules[module].__file__ if module in sys.modules else None
        if path is None:
            continue
        assert path.endswith(".py") != build.compiled, (module, path, build)
    if PURE:
        assert not build.compiled and native.PURE_ENV in build.reason


def test_pure_python_switch_loads_the_sources() -> None:
    env = {**os.environ, native.PURE_ENV: "1"}
    compiled, *files = _loaded_from(env)
    assert compiled == "False"
    assert all(f.endswith(".py") for f in files), files


@pytest.mark.skipif(PURE, reason="the pure-Python run checks the sources only")
def test_an_installed_compiled_build_is_in_charge() -> None:
    if not native.compiled_build_installed():
        pytest.skip("no compiled build installed (PREFIXCACHE_COMPILE=0 or no mypyc)")
    env = {k: v for k, v in os.environ.items() if k != native.PURE_ENV}
    compiled, *files = _loaded_from(env)
    assert compiled == "True", prefixcache.CORE_BUILD
    assert not any(f.endswith(".py") for f in files), files


def test_a_changed_source_no_longer_matches_the_build(tmp_path: Path) -> None:
    package = tmp_path / "prefixcache"
    for module in native.COMPILED_MODULES + native.C_HELPERS:
        target = native.source_path(module, package)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(native.source_path(module), target)
    before = native.sources_digest(package)
    assert before == native.sources_digest()
    radix = native.source_path("prefixcache.blocks.radix", package)
    radix.write_text(radix.read_text() + "\n# edited\n")
    assert native.sources_digest(package) != before
    edited = native.sources_digest(package)
    helper = native.source_path("prefixcache.blocks._token_pack", package)
    assert helper.suffix == ".c"
    helper.write_text(helper.read_text() + "\n/* edited */\n")
    assert native.sources_digest(package) != edited


def test_part_of_a_build_still_leaves_the_sources_in_charge(monkeypatch) -> None:
    # a build that stopped midway leaves some compiled files: they must not load beside sources
    monkeypatch.setattr(
        sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, native._SourcesFirst)]
    )
    monkeypatch.setattr(native, "compiled_build_installed", lambda: False)
    build = native.choose_build()
    assert not build.compiled and "no compiled build" in build.reason
    assert any(isinstance(f, native._SourcesFirst) for f in sys.meta_path)


def test_without_source_files_the_usual_importers_load_the_package(monkeypatch, tmp_path) -> None:
    # a zip, sourceless (.pyc only) or frozen install has no .py files to load instead
    monkeypatch.setattr(native, "source_path", lambda module, package_dir=None: tmp_path / "no.py")
    assert native._SourcesFirst().find_spec("prefixcache.blocks.radix", None) is None
