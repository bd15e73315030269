"""The package's imports run one way: a test walks every module's imports, at any depth in the
file (lazy imports inside functions included), and fails on any import against the layering.

- core (the top-level modules, ``blocks/``, ``manager/``, ``kernels`` and ``store/``) imports
  nothing from ``text/``, ``replay/``, ``report/``, ``fleet/`` or ``engines/``;
- ``text/`` imports only core;
- ``report/`` reads run directories: nothing from ``replay/`` or ``fleet/``;
- ``fleet/`` nothing from ``replay/``, ``report/`` or ``engines/``;
- ``engines/`` (real engines beside the service) nothing from ``replay/``, ``report/`` or
  ``fleet/``, and nothing below it imports it;
- ``replay/``, a layer above, drives the fleet's router, index and wire format and prints reports;
- ``cli`` sits on top and names its command modules;
- and no two modules import each other, directly or through others.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# layer -> the layers it must not import
FORBIDDEN = {
    "core": {"text", "replay", "report", "fleet", "engines"},
    "text": {"replay", "report", "fleet", "engines"},
    "report": {"replay", "fleet", "engines"},
    "fleet": {"replay", "report", "engines"},
    "engines": {"replay", "report", "fleet"},
    "replay": set(),
    "cli": set(),
}


def module_files() -> dict[str, Path]:
    """Every module of the package by its import name; a linked folder is walked as the imports
    see it (``kernels/`` is linked in as ``prefixcache/kernels``)."""
    files = {}
    for here, dirs, names in os.walk(ROOT / "prefixcache", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if name.endswith(".py"):
                parts = Path(here, name).relative_to(ROOT).with_suffix("").parts
                files[".".join(parts).removesuffix(".__init__")] = Path(here, name)
    return dict(sorted(files.items()))


def layer(module: str) -> str:
    parts = module.split(".")
    if module == "prefixcache.cli":
        return "cli"
    if len(parts) > 1 and parts[1] in ("text", "replay", "report", "fleet", "engines"):
        return parts[1]
    return "core"


def _type_only(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:``: imports for annotations, never run."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return inside


def imports(module: str, path: Path, known: set[str], *, runtime: bool = False) -> set[str]:
    """The package modules that ``module`` imports (``from a.b import c`` names a.b, and a.b.c
    when that is a module), including ``importlib.import_module("...")`` with a literal. With
    ``runtime``, imports for type checking only are left out."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            # a module and every package above it that is loaded with it
            while name:
                if name in known and name != module:
                    found.add(name)
                name = name.rpartition(".")[0]
    return found


def graph(*, runtime: bool = False) -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {m: imports(m, p, known, runtime=runtime) for m, p in files.items()}


def test_every_import_follows_the_layers() -> None:
    wrong = sorted(
        f"{a} ({layer(a)}) imports {b} ({layer(b)})"
        for a, targets in graph().items()
        for b in targets
        if layer(b) in FORBIDDEN[layer(a)]
    )
    assert not wrong, "\n".join(wrong)


def circles(*, runtime: bool, within: str = "prefixcache") -> list[str]:
    """The import circles between the modules under ``within`` (a package's ``__init__``
    re-exporting its own modules is not one); ``runtime``: imports for annotations left out."""
    edges = {
        a: {
            b
            for b in targets
            if b.startswith(within) and not a.startswith(b + ".") and not b.startswith(a + ".")
        }
        for a, targets in graph(runtime=runtime).items()
        if a.startswith(within)
    }
    found = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                found.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_circles() -> None:
    """Between modules, as they run: an import for annotations only does not count here."""
    found = circles(runtime=True)
    assert not found, "\n".join(found)


def test_the_manager_has_no_import_circle_even_for_annotations() -> None:
    """The manager's state builds its parts and its helpers and tiers import it, never the
    other way round; the invariant check reads the state, not the manager."""
    found = circles(runtime=False, within="prefixcache.manager")
    assert not found, "\n".join(found)


def test_the_layering_test_sees_a_violation(tmp_path: Path) -> None:
    """The walker itself: a lazy import inside a function is found."""
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from prefixcache.replay.runner import replay_path\n")
    found = imports(
        "prefixcache.report.mod", path, {"prefixcache.replay.runner", "prefixcache.replay"}
    )
    assert found == {"prefixcache.replay.runner", "prefixcache.replay"}
    assert layer("prefixcache.replay.runner") in FORBIDDEN[layer("prefixcache.report.mod")]
