"""Check a built wheel: the compiled core (every compiled module, their shared library and the C
helpers), the sources digest that puts it in charge, py.typed, the report schema, the model
table and the kernels; and no note of a failed build. Prints the wheel's size."""

from __future__ import annotations

import runpy
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
native = runpy.run_path(str(ROOT / "prefixcache" / "native.py"))


def problems(wheel: Path) -> list[str]:
    names = zipfile.ZipFile(wheel).namelist()

    def has(stem: str, suffix: str) -> bool:
        return any(n.startswith(stem) and n.endswith(suffix) for n in names)

    missing = [
        f"{module} (compiled)"
        for module in (native["SHARED_LIBRARY"], *native["COMPILED_MODULES"], *native["C_HELPERS"])
        if not has(module.replace(".", "/") + ".", ".so")
    ]
    required = [
        "prefixcache/" + native["DIGEST_FILE"],
        "prefixcache/py.typed",
        "prefixcache/report/schema.json",
        "prefixcache/data/models.json",
        "prefixcache/kernels/__init__.py",
        "prefixcache/kernels/triton_attention.py",
    ]
    missing += [name for name in required if name not in names]
    found = [f"{n} (a failed build's note)" for n in names if n.endswith(native["BUILD_NOTE_FILE"])]
    outside = [f"{n} (outside the package)" for n in names if n.endswith(".so") and "/" not in n]
    return [f"missing: {m}" for m in missing] + [f"unexpected: {u}" for u in found + outside]


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: wheel_contents.py WHEEL...", file=sys.stderr)
        return 2
    failed = False
    for path in map(Path, paths):
        found = problems(path)
        for problem in found:
            print(f"{path.name}: {problem}", file=sys.stderr)
        failed |= bool(found)
        if not found:
            print(f"{path.name}: {path.stat().st_size / 2**20:.2f} MiB, compiled core complete")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
