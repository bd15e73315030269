"""Exit non-zero unless this interpreter runs from the given virtualenv, one made without the
system's site-packages: what CI installs must be all the tests can import."""

from __future__ import annotations

import site
import sys
from pathlib import Path


def main(venv: str) -> int:
    expected = Path(venv).resolve()
    problems = []
    if Path(sys.prefix).resolve() != expected:
        problems.append(f"python runs from {sys.prefix}, not from the virtualenv {expected}")
    if sys.prefix == sys.base_prefix:
        problems.append("python is not running in a virtualenv")
    config = expected / "pyvenv.cfg"
    text = config.read_text() if config.is_file() else ""
    if "include-system-site-packages = false" not in text:
        problems.append(f"{config} does not exclude the system site-packages")
    leaked = [p for p in site.getsitepackages() if not Path(p).resolve().is_relative_to(expected)]
    if leaked:
        problems.append(f"site-packages outside the virtualenv: {', '.join(leaked)}")
    for problem in problems:
        print(f"check_venv: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_venv: {sys.executable} ({sys.version.split()[0]}), isolated")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".venv"))
