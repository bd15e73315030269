"""Builds the compiled core: the modules in prefixcache/native.py, compiled with mypyc, and the C
helpers listed there.

Everything else about the package is in pyproject.toml. ``PREFIXCACHE_COMPILE=0`` installs the
Python sources alone (the same code, slower); without mypyc the build does the same and says so.
The digest of the sources is written only once the compiled files are, so a failed or partial
build (no C compiler, say) leaves the package on its Python sources instead of failing.
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
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


class BuildCompiledCore(build_ext):
    """build_ext, then the digest of the sources the compiled files were made from."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, CompileError, ExecError, LinkError, PlatformError) as exc:
            print(
                f"prefixcache: compiling the core failed ({exc}); installing the Python sources "
                "(the same code, slower; with a working C compiler, install again to compile)",
                file=sys.stderr,
            )
            return  # no digest: the sources run
        if not self.extensions:
            return
        # an editable install reads the tree, a wheel carries its own copy; the tree's digest
        # vouches only for compiled files built into the tree
        target = ROOT / DIGEST if self.inplace else Path(self.build_lib) / DIGEST
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(native["sources_digest"](ROOT / "prefixcache") + "\n")


def compiled_core() -> list:
    if not BUILDS.intersection(sys.argv[1:]):  # metadata only: nothing to compile
        return []
    (ROOT / DIGEST).unlink(missing_ok=True)  # the sources run until the build completes
    if os.environ.get("PREFIXCACHE_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print(
            "prefixcache: mypyc not found; installing the Python sources only "
            "(pip install mypy, then install again to compile)",
            file=sys.stderr,
        )
        return []

    def source(module: str) -> str:
        return str(native["source_path"](module, Path("prefixcache")))

    compiled = mypycify(
        [
            "--config-file",
            "pyproject.toml",
            "--ignore-missing-imports",
            *map(source, native["COMPILED_MODULES"]),
        ],
        group_name=native["GROUP_NAME"],
        opt_level="3",
    )
    helpers = [Extension(m, [source(m)], extra_compile_args=["-O2"]) for m in native["C_HELPERS"]]
    return [*compiled, *helpers]


setup(ext_modules=compiled_core(), cmdclass={"build_ext": BuildCompiledCore})
