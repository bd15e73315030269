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


def _copy_package(target: Path) -> Path:
    """The installed package folder copied to ``target`` (compiled files and all)."""
    package = target / "prefixcache"
    shutil.copytree(
        Path(prefixcache.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__")
    )
    return package


def _build_of_copy(root: Path) -> str:
    """``CORE_BUILD`` as a fresh interpreter sees it, importing the package from ``root`` alone
    (the project not installed there: no path but the folder and the standard library)."""
    code = (
        f"import sys; sys.path[:0] = [{str(root)!r}, *{_deps()!r}]\n"
        "import prefixcache; b = prefixcache.CORE_BUILD; print(b.compiled, b.reason)"
    )
    env = {k: v for k, v in os.environ.items() if k not in (native.PURE_ENV, "PYTHONPATH")}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _deps() -> list[str]:
    """Where numpy and xxhash come from (the copy needs them, not the project's install)."""
    import numpy
    import xxhash

    return sorted({str(Path(m.__file__).parents[1]) for m in (numpy, xxhash)})


def test_the_compiled_library_lives_inside_the_package() -> None:
    found = [p.name for p in Path(prefixcache.__file__).parent.glob("_core__mypyc*")]
    if not native.compiled_build_installed():
        pytest.skip("no compiled build installed (PREFIXCACHE_COMPILE=0 or no mypyc)")
    assert found, "the shared library of the compiled modules is not in the package folder"
    assert not list(ROOT.glob("prefixcache_core__mypyc*")), "a library outside the package"


def test_the_package_folder_alone_loads_the_compiled_build(tmp_path: Path) -> None:
    # any Python that imports the package folder (a copy, the project not installed) finds it
    if not prefixcache.CORE_BUILD.compiled:
        pytest.skip(f"the compiled build is not in charge: {prefixcache.CORE_BUILD.reason}")
    _copy_package(tmp_path)
    assert _build_of_copy(tmp_path).startswith("True compiled with mypyc")


def test_a_library_that_cannot_load_leaves_the_sources_in_charge(tmp_path: Path) -> None:
    if not prefixcache.CORE_BUILD.compiled:
        pytest.skip(f"the compiled build is not in charge: {prefixcache.CORE_BUILD.reason}")
    package = _copy_package(tmp_path)
    (library,) = package.glob("_core__mypyc*")
    library.write_bytes(b"not a shared library")  # a torn copy, another ABI's file
    build = _build_of_copy(tmp_path)
    assert build.startswith("False Python sources (the compiled library could not be loaded"), build


def test_a_failed_build_says_why(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / native.BUILD_NOTE_FILE).write_text("the C compiler failed (gcc: not found)\n")
    assert native.build_failure(tmp_path) == "the C compiler failed (gcc: not found)"
    assert native.build_failure(tmp_path / "elsewhere") == ""
    monkeypatch.setattr(
        sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, native._SourcesFirst)]
    )
    monkeypatch.setattr(native, "compiled_build_installed", lambda: False)
    monkeypatch.setattr(native, "build_failure", lambda: "mypyc refused the compiled modules")
    build = native.choose_build()
    assert not build.compiled
    assert build.reason == (
        "Python sources (the compiled build failed at install: mypyc refused the compiled modules)"
    )


def test_an_install_without_mypyc_says_so_and_runs_the_sources(tmp_path: Path) -> None:
    # setup.py as pip runs it, on a copy of the project, with mypyc not importable: the build
    # goes on with the sources, says why in one line, and --version repeats it
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, tmp_path / name)
    shutil.copytree(
        ROOT / "prefixcache",
        tmp_path / "prefixcache",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", native.DIGEST_FILE),
    )
    code = (
        "import sys; sys.modules['mypyc'] = sys.modules['mypyc.build'] = None\n"
        "sys.argv = ['setup.py', 'build_ext', '--inplace']\n"
        "import runpy; runpy.run_path('setup.py', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (native.PURE_ENV, "PYTHONPATH")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("prefixcache:")]
    assert said == [
        "prefixcache: mypyc was not found (pip install mypy, then install again to compile); "
        "installing the Python sources (slower)"
    ]
    assert not (tmp_path / "prefixcache" / native.DIGEST_FILE).exists()
    assert native.build_failure(tmp_path / "prefixcache").startswith("mypyc was not found")
    build = _build_of_copy(tmp_path)
    assert build.startswith(
        "False Python sources (the compiled build failed at install: mypyc was not found"
    ), build


def test_every_package_is_in_the_wheel() -> None:
    """Every folder of the package with an ``__init__.py`` is listed in pyproject.toml's
    ``packages``, or a wheel (and a user's install) goes without it."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "prefixcache").rglob("__init__.py")
    }
    assert found - declared == set(), "packages missing from pyproject.toml"
