"""vLLM's and SGLang's own modules, loaded from their published wheels for the tests that check
prefixcache against them.

The wheels are looked for in ``$PREFIXCACHE_ENGINE_WHEELS`` (default
``~/.cache/prefixcache/engine-wheels``; ``.ci/run`` downloads them there with
``pip download --no-deps vllm==0.33.0 sglang==0.5.23``). Only the modules a test names are
taken out of a wheel and run as they are; the packages above them are not imported (they
would pull in torch extensions, CUDA and the engines' servers): each imported name a module
needs from elsewhere in its engine is given here, either as the small function it is (a
logger, a socket address helper) or as an inert placeholder where the module only names it
in annotations or in code the test does not run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

WHEELS = Path(
    os.environ.get("PREFIXCACHE_ENGINE_WHEELS", Path.home() / ".cache/prefixcache/engine-wheels")
)
VLLM = ("vllm", "0.33.0")
SGLANG = ("sglang", "0.5.23")


def wheel(engine: tuple[str, str]) -> Path | None:
    """The engine's wheel, if downloaded."""
    name, version = engine
    found = sorted(WHEELS.glob(f"{name}-{version}-*.whl"))
    return found[0] if found else None


def missing(engine: tuple[str, str]) -> str | None:
    """Why the engine's code cannot be run here (None: it can)."""
    if wheel(engine) is not None:
        return None
    name, version = engine
    return (
        f"{name} {version}'s wheel is not in {WHEELS} (pip download --no-deps "
        f"{name}=={version} -d {WHEELS}, or set PREFIXCACHE_ENGINE_WHEELS)"
    )


class _Placeholder(ModuleType):
    """A module of the engine the test does not run: every name in it is an inert class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        made = type(name, (), {"__module__": self.__name__})
        setattr(self, name, made)
        return made


@contextmanager
def engine_modules(
    engine: tuple[str, str],
    wanted: list[str],
    given: Mapping[str, Mapping[str, Any]],
    placeholders: list[str],
    root: Path,
    files: tuple[str, ...] = (),
) -> Iterator[dict[str, ModuleType]]:
    """Run the modules ``wanted`` (dotted names) from the engine's wheel, extracted under
    ``root`` with the other ``files`` they read (paths in the wheel); ``given`` modules are
    made of the names mapped, ``placeholders`` of inert ones. Everything put in
    ``sys.modules`` is taken out again afterwards."""
    path = wheel(engine)
    assert path is not None
    package = engine[0]
    before = set(sys.modules)
    with zipfile.ZipFile(path) as zf:
        for name in wanted:
            zf.extract(name.replace(".", "/") + ".py", root)
        for member in files:
            zf.extract(member, root)
    try:
        for name in {n.rsplit(".", k)[0] for n in wanted for k in range(1, n.count(".") + 1)}:
            pkg = _Placeholder(name)  # the packages above, without their __init__
            pkg.__path__ = [str(root / name.replace(".", "/"))]
            sys.modules.setdefault(name, pkg)
        for name in placeholders:
            sys.modules[name] = _Placeholder(name)
        for name, attrs in given.items():
            module = _Placeholder(name)  # the names given; any other is inert
            module.__dict__.update(attrs)
            sys.modules[name] = module
        for name in list(sys.modules):  # a parent package names its submodule too
            if name.startswith(package + ".") and name in set(sys.modules) - before:
                parent, _, child = name.rpartition(".")
                if parent in sys.modules:
                    setattr(sys.modules[parent], child, sys.modules[name])
        loaded = {}
        for name in wanted:
            if name in sys.modules:  # imported already by one loaded before
                loaded[name] = sys.modules[name]
                continue
            spec = importlib.util.spec_from_file_location(
                name, root / (name.replace(".", "/") + ".py")
            )
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
        yield loaded
    finally:
        for name in set(sys.modules) - before:
            del sys.modules[name]
