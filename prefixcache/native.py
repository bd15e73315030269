"""Which build of the core runs: the compiled one (mypyc) or the Python sources.

The block and manager modules listed in ``COMPILED_MODULES`` are plain, type-checked Python. An
install compiles them with mypyc when it can (``setup.py``; set ``PREFIXCACHE_COMPILE=0`` to
skip it), and leaves the sources beside the compiled files. ``choose_build`` runs once, when
``prefixcache`` is imported, before any of those modules is, and keeps the sources in charge
when:

- ``PREFIXCACHE_PURE_PYTHON=1`` is set (the tests run both builds this way), or
- the sources changed since the build (an editable checkout after an edit or a ``git
  checkout``): the digest of the sources taken at build time no longer matches, so stale
  compiled code never runs; ``make install`` compiles again.

All compiled modules share one library (``prefixcache/_core__mypyc.*.so``, inside the package, so
an editable checkout and a wheel find it alike) and use each other's classes directly, so the
choice is all or nothing: a library that is missing or fails to load leaves the sources in
charge, and ``reason`` says why. A build that could not compile (no C compiler, a type error
in the compiled modules) leaves a note (``BUILD_NOTE_FILE``) that ``reason`` repeats.

The choice covers the C helpers in ``C_HELPERS`` too: small extension modules written in C (no
Python source) whose callers fall back to Python code when they cannot be imported; while the
sources are in charge, importing them fails. Only the standard library is used here:
``setup.py`` loads this file on its own.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

COMPILED_MODULES = (
    "prefixcache.blocks.eviction",
    "prefixcache.blocks.hashing",
    "prefixcache.blocks.host_tier",
    "prefixcache.blocks.pool",
    "prefixcache.blocks.radix",
    "prefixcache.blocks.tokens",
    "prefixcache.fleet.index.mask_loops",
    "prefixcache.fleet.whatif.group_regression",
    "prefixcache.fleet.whatif.shards",
    "prefixcache.manager.admission_planning",
    "prefixcache.manager.argument_checks",
    "prefixcache.manager.block_indexing",
    "prefixcache.manager.block_supply",
    "prefixcache.manager.listeners",
    "prefixcache.manager.lower_tiers.host_offload",
    "prefixcache.manager.request_blocks",
    "prefixcache.manager.results",
    "prefixcache.manager.state",
    "prefixcache.manager.stats",
    "prefixcache.manager.step_ledger",
    "prefixcache.manager.tenant_shares",
    "prefixcache.replay.sim.accounting",
    "prefixcache.replay.sim.fleet.index_feed",
    "prefixcache.replay.sim.fleet.replica_trees",
    "prefixcache.replay.sim.keyset",
    "prefixcache.replay.sim.live_requests",
    "prefixcache.replay.sim.replica_batch",
    "prefixcache.replay.sim.request_rows",
    "prefixcache.replay.sim.roofline",
    "prefixcache.replay.sim.sequential",
    "prefixcache.replay.sim.serving",
    "prefixcache.replay.sim.step_tally",
    "prefixcache.replay.sim.uncached_blocks",
)
# C extension modules built with them: a C source each, callers import them or fall back
C_HELPERS = ("prefixcache.blocks._token_pack",)
GROUP_NAME = "prefixcache._core"  # the shared library: prefixcache/_core__mypyc.*.so
SHARED_LIBRARY = GROUP_NAME + "__mypyc"
DIGEST_FILE = "native_sources.sha256"  # written by setup.py next to this file
BUILD_NOTE_FILE = "native_build_failed.txt"  # written by setup.py when compiling failed
PURE_ENV = "PREFIXCACHE_PURE_PYTHON"

_PACKAGE = Path(__file__).resolve().parent


class CoreBuild(NamedTuple):
    """What runs: ``compiled`` is True when the mypyc build is in charge; ``reason`` says why
    it is or is not (shown by ``prefixcache --version``)."""

    compiled: bool
    reason: str


def source_path(module: str, package_dir: Path = _PACKAGE) -> Path:
    """The source of one of ``COMPILED_MODULES`` (``.py``) or ``C_HELPERS`` (``.c``) under the
    package folder."""
    parts = module.split(".")[1:]
    suffix = ".c" if module in C_HELPERS else ".py"
    return package_dir.joinpath(*parts[:-1], parts[-1] + suffix)


def sources_digest(package_dir: Path = _PACKAGE) -> str:
    """SHA-256 over the compiled modules' and C helpers' names and sources (what the build was
    made from)."""
    digest = hashlib.sha256()
    for module in COMPILED_MODULES + C_HELPERS:
        digest.update(module.encode() + b"\0")
        digest.update(source_path(module, package_dir).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def compiled_build_installed() -> bool:
    """Whether the shared library and every one of ``COMPILED_MODULES`` and ``C_HELPERS`` have a
    compiled file beside their sources."""
    for module in (SHARED_LIBRARY, *COMPILED_MODULES, *C_HELPERS):
        spec = importlib.machinery.PathFinder.find_spec(module, [str(source_path(module).parent)])
        if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            return False
    return True


class _SourcesFirst(importlib.abc.MetaPathFinder):
    """Loads each of ``COMPILED_MODULES`` from its ``.py`` file even where a compiled file sits
    beside it (an extension module would otherwise win), and refuses the ``C_HELPERS``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in C_HELPERS:
            raise ModuleNotFoundError(
                f"{fullname} belongs to the compiled build, which is not in charge", name=fullname
            )
        if fullname not in COMPILED_MODULES:
            return None
        source = source_path(fullname)
        if not source.is_file():  # a zip, a sourceless or frozen install: the usual importers
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def build_failure(package_dir: Path = _PACKAGE) -> str:
    """What stopped the last install from compiling (one line), or "" when nothing did."""
    try:
        return (package_dir / BUILD_NOTE_FILE).read_text().strip().splitlines()[0]
    except (OSError, IndexError):
        return ""


def choose_build() -> CoreBuild:
    """Decide once which build runs, installing the sources-first finder when the compiled one
    must not. Call before importing any of ``COMPILED_MODULES``."""
    if not compiled_build_installed():  # none, or part of one (a build that stopped midway)
        failure = build_failure()
        why = (
            f"Python sources (the compiled build failed at install: {failure})"
            if failure
            else "Python sources (no compiled build is installed)"
        )
    elif os.environ.get(PURE_ENV, "") not in ("", "0"):
        why = f"Python sources ({PURE_ENV} is set; a compiled build is installed)"
    else:
        try:
            built = (_PACKAGE / DIGEST_FILE).read_text().strip()
        except OSError:
            built = ""
        if built != sources_digest():
            why = (
                "Python sources (the compiled files were not built from these sources; "
                "make install)"
            )
        else:
            try:  # the library every compiled module loads: a wrong ABI or a torn file fails here
                importlib.import_module(SHARED_LIBRARY)
            except (ImportError, OSError) as exc:
                why = f"Python sources (the compiled library could not be loaded: {exc})"
            else:
                return CoreBuild(
                    True,
                    f"compiled with mypyc ({len(COMPILED_MODULES)} modules) and C "
                    f"({', '.join(m.rsplit('.', 1)[1] for m in C_HELPERS)})",
                )
    if not any(isinstance(f, _SourcesFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst())
    return CoreBuild(False, why)


# decided when the package imports this module, first of all (setup.py only reads the lists)
CORE_BUILD = choose_build() if __name__ == "prefixcache.native" else CoreBuild(False, "not loaded")
