"""Type-check the package with mypy, the folders that pyproject maps by package-dir included.

mypy names a module after the folders it sits in, so it sees ``kernels/attention.py`` as
``kernels.attention``, never as the ``prefixcache.kernels.attention`` that setuptools installs
(``[tool.setuptools] package-dir``); and it cannot follow an editable install's import hook.
This runs mypy with the ``[tool.mypy]`` settings of pyproject.toml and hands it every file of a
mapped folder under its installed module name, so the mapped modules are checked and every
import of them resolves to them. Arguments go to mypy as on its command line.

Run from anywhere: ``python .ci/typecheck.py`` (``make typecheck``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy itself depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]  # the checkout: .ci/ sits at its top


def mapped_sources(root: Path) -> list[BuildSource]:
    """Every ``.py`` file of each folder that ``package-dir`` maps to a package whose name is not
    its path, named as installed (``kernels/attention.py`` -> ``prefixcache.kernels.attention``)."""
    settings = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    sources = []
    for package, folder in settings.get("package-dir", {}).items():
        if not package or Path(folder).parts == tuple(package.split(".")):
            continue  # mypy finds these by their path
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            module = ".".join((package, *parts)).removesuffix(".__init__")
            sources.append(BuildSource(str(path.relative_to(root)), module))
    return sources


def main(argv: list[str]) -> int:
    """Run mypy on its configured targets plus the mapped folders; mypy's exit status."""
    os.chdir(ROOT)  # where pyproject.toml is, and what its relative paths start from
    sources, options = process_options(argv)
    mapped = mapped_sources(ROOT)
    names = {source.module for source in mapped}
    # a target that already holds a mapped module (a link to its folder, say) is left out
    sources = [s for s in sources if s.module not in names] + mapped
    messages: list[str] = []

    def flush_errors(filename: str | None, new_messages: list[str], serious: bool) -> None:
        messages.extend(new_messages)
        out = sys.stderr if serious else sys.stdout
        for message in new_messages:
            print(message, file=out)
        out.flush()

    try:
        result = build.build(sources, options, flush_errors=flush_errors)
    except CompileError:  # a blocking error, already printed by flush_errors
        return 2
    result.manager.metastore.close()  # the incremental cache, written out
    errors = [m for m in messages if ": error:" in m]
    files = {m.split(":", 1)[0] for m in errors}
    if errors:
        print(
            f"Found {len(errors)} error{'s' * (len(errors) != 1)} in {len(files)} "
            f"file{'s' * (len(files) != 1)} (checked {len(sources)} source files)"
        )
        return 1
    print(f"Success: no issues found in {len(sources)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
