"""Run one benchmark script against two checkouts, alternating processes, and print the ratios.

    python bench/ab_checkouts.py --base main~3 [--runs 5] -- bench/manager_loop.py --repeats 3

The base is a git revision (checked out into a temporary worktree) or a folder holding another
checkout. Each run starts a fresh process, base and current in turn (B A B A ...), so drift of
a noisy machine falls on both sides alike. Each side runs its own copy of the script with its own
package first on ``sys.path`` (the base's ``kernels/`` folder is linked in as
``prefixcache.kernels``, as an install maps it).

Every line the script prints that holds numbers is matched with the same line of the other side
(the line with its numbers masked); the table gives, for each number, the median of the runs on
both sides and the ratio current / base. Whether higher is better depends on the figure.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?")


@contextmanager
def checkout(base: str) -> Iterator[Path]:
    """A folder holding the base: the folder itself, or a temporary worktree of a revision."""
    if Path(base).is_dir():
        yield Path(base).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="ab-base-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(HERE), "worktree", "add", "--detach", "-q", str(tree), base],
            check=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)], check=False
            )


def link_kernels(tree: Path) -> None:
    """Make the base tree's ``kernels/`` importable as ``prefixcache.kernels`` from its folder."""
    kernels = tree / "prefixcache" / "kernels"
    if (tree / "kernels").is_dir() and not kernels.exists():
        kernels.symlink_to(tree / "kernels", target_is_directory=True)


def run(tree: Path, script: list[str]) -> str:
    """One process of the script from ``tree``, with that tree's package imported first."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / script[0]), *script[1:]]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def figures(output: str) -> dict[str, list[float]]:
    """Each printed line with numbers, keyed by the line with its numbers masked."""
    out: dict[str, list[float]] = {}
    for line in output.splitlines():
        values = [float(v.replace(",", "")) for v in NUMBER.findall(line)]
        if values:
            # numbers masked and spacing folded: a wider number shifts the columns
            out.setdefault(" ".join(NUMBER.sub("#", line).split()), values)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision or folder of the base")
    parser.add_argument("--runs", type=int, default=5, help="processes per side (default 5)")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args()
    script = [s for s in args.script if s != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("name the benchmark script after --")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    sides: dict[str, list[dict[str, list[float]]]] = {"base": [], "current": []}
    with checkout(args.base) as base_tree:
        if base_tree != HERE:
            link_kernels(base_tree)
        for i in range(args.runs):
            for side, tree in (("base", base_tree), ("current", HERE)):
                sides[side].append(figures(run(tree, script)))
                print(f"run {i + 1}/{args.runs} {side} done", file=sys.stderr)
    keys = [k for k in sides["current"][0] if all(k in r for r in sides["base"] + sides["current"])]
    print(f"{' '.join(script)}: medians of {args.runs} alternating runs per side")
    print(f"{'figure':60} {'base':>12} {'current':>12} {'ratio':>7}")
    for key in keys:
        width = min(len(r[key]) for r in sides["base"] + sides["current"])
        for j in range(width):
            base = statistics.median(r[key][j] for r in sides["base"])
            cur = statistics.median(r[key][j] for r in sides["current"])
            ratio = f"{cur / base:7.3f}" if base else "    n/a"
            label = key if width == 1 else f"{key} [{j + 1}]"
            print(f"{label[:60]:60} {base:12.4g} {cur:12.4g} {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
