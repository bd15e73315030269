"""Builds the compiled core: the modules in prefixcache/native.py, compiled with mypyc, and the C
helpers listed there.

Everything else about the package is in pyproject.toml. ``PREFIXCACHE_COMPILE=0`` installs the
Python sources alone (the same code, slower); without mypyc the build does the same and says so.
The digest of the sources is written only once the compiled files are, so a failed or partial
build (no C compiler, a type error mypyc refuses) leaves the package on its Python sources
instead of failing, with a one-line note beside them that ``prefixcache --version`` repeats.

mypyc type-checks what it compiles with the packages the build declares (pyproject.toml's
``[build-system] requires``: mypy and numpy); the modules it only follows (the service's, say,
which need its optional extras) are checked by the project's own type check, not by the build,
so what the build machine happens to have installed cannot stop it.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

ROOT = Path(__file__).resolve().parent
native = runpy.run_path(str(ROOT / "prefixcache" / "native.py"))
DIGEST = Path("prefixcache") / native["DIGEST_FILE"]
NOTE = Path("prefixcache") / native["BUILD_NOTE_FILE"]
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


class BuildCompiledCore(build_ext):
    """build_ext, then the digest of the sources the compiled files were made from."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, CompileError, ExecError, LinkError, PlatformError) as exc:
            why = f"the C compiler failed ({exc})".replace("\n", " ")
            fall_back(why, None if self.inplace else self.build_lib)
            return  # no digest: the sources run
        if not self.extensions:
            return
        # an editable install reads the tree, a wheel carries its own copy; the tree's digest
        # vouches only for compiled files built into the tree
        target = ROOT / DIGEST if self.inplace else Path(self.build_lib) / DIGEST
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(native["sources_digest"](ROOT / "prefixcache") + "\n")


def fall_back(why: str, build_lib: str | None = None) -> None:
    """Say in one line why the core is not compiled, and leave that line for --version: in the
    tree (package data, which an editable install reads and a wheel copies) and, once the
    package has been copied for a wheel, in that copy too."""
    print(f"prefixcache: {why}; installing the Python sources (slower)", file=sys.stderr)
    for target in [ROOT / NOTE] + ([Path(build_lib) / NOTE] if build_lib else []):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(why + "\n")


def compiled_core() -> list:
    if not BUILDS.intersection(sys.argv[1:]):  # metadata only: nothing to compile
        return []
    (ROOT / DIGEST).unlink(missing_ok=True)  # the sources run until the build completes
    (ROOT / NOTE).unlink(missing_ok=True)
    if os.environ.get("PREFIXCACHE_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        fall_back("mypyc was not found (pip install mypy, then install again to compile)")
        return []

    def source(module: str) -> str:
        return str(native["source_path"](module, Path("prefixcache")))

    try:  # mypyc prints mypy's errors, then exits
        compiled = mypycify(
            [
                "--config-file",
                "pyproject.toml",
                "--ignore-missing-imports",
                "--follow-imports=silent",  # errors in the compiled modules only
                *map(source, native["COMPILED_MODULES"]),
            ],
            group_name=native["GROUP_NAME"],
            opt_level="3",
        )
    except SystemExit as exc:
        fall_back(f"mypyc refused the compiled modules (exit status {exc.code}; errors above)")
        return []
    helpers = [Extension(m, [source(m)], extra_compile_args=["-O2"]) for m in native["C_HELPERS"]]
    return [*compiled, *helpers]


setup(ext_modules=compiled_core(), cmdclass={"build_ext": BuildCompiledCore})
