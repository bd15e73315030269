"""Public docstrings stay at the manager's level: in the packages below, every module and every
public class, function and method has a docstring.

Public means a name without a leading underscore, at module level or in a public class (at any
depth of classes); dunder methods are left out (a class's docstring covers ``__init__``), and so
are functions nested in functions. The files are read with ``ast``, never imported, so the check
needs none of the optional dependencies (matplotlib, jinja2, tokenizers).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PACKAGES = (
    "prefixcache/manager",
    "prefixcache/replay/workload",
    "prefixcache/report/render",
    "prefixcache/text",
)

# Members still without a docstring, as "path:Qualified.name"; document one, then remove it here
# (an entry that has gained a docstring fails the test, so the list only shrinks).
KNOWN_GAPS: frozenset[str] = frozenset()  # definitions allowed no docstring yet

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _public(body: list[ast.stmt], prefix: str = "") -> list[tuple[str, Definition]]:
    """The public definitions of a module or class body, by qualified name, classes walked."""
    found: list[tuple[str, Definition]] = []
    for node in body:
        if not isinstance(node, Definition) or node.name.startswith("_"):
            continue
        name = f"{prefix}{node.name}"
        found.append((name, node))
        if isinstance(node, ast.ClassDef):
            found += _public(node.body, f"{name}.")
    return found


def undocumented(package: str) -> list[str]:
    """``path`` (the module) or ``path:Qualified.name`` of each public definition in
    ``package`` that has no docstring, paths relative to the checkout."""
    missing = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        if not ast.get_docstring(tree):
            missing.append(rel)
        missing += [
            f"{rel}:{name}" for name, node in _public(tree.body) if not ast.get_docstring(node)
        ]
    return missing


@pytest.mark.parametrize("package", PACKAGES)
def test_public_definitions_have_docstrings(package: str) -> None:
    assert sorted((ROOT / package).glob("*.py")), f"{package} has no modules (renamed?)"
    missing = [m for m in undocumented(package) if m not in KNOWN_GAPS]
    assert not missing, "public definitions without a docstring:\n  " + "\n  ".join(missing)


def test_known_gaps_are_still_gaps() -> None:
    missing = {m for package in PACKAGES for m in undocumented(package)}
    documented = sorted(KNOWN_GAPS - missing)
    assert not documented, "documented now, remove from KNOWN_GAPS:\n  " + "\n  ".join(documented)


def test_the_walk_finds_what_it_should() -> None:
    tree = ast.parse(
        '"""m"""\n'
        "def f(): pass\n"
        "def _g(): pass\n"
        "class C:\n"
        '    """c"""\n'
        "    def __init__(self): pass\n"
        "    def m(self): pass\n"
        "    @property\n"
        "    def p(self): pass\n"
        "    class D:\n"
        "        def n(self): pass\n"
        "class _P:\n"
        "    def q(self): pass\n"
    )
    names = [name for name, node in _public(tree.body) if not ast.get_docstring(node)]
    assert names == ["f", "C.m", "C.p", "C.D", "C.D.n"]
