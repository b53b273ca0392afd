"""The package's shape limits (docs/design.md, "Code shape"), read from the source with ``ast``:

    python scripts/code_shape.py          # every function over 60 lines, every class over 25 methods

- no function or method of ``eprt/`` over MAX_LINES lines (its ``def`` line to its last line,
  docstring and decorators' lines excluded from neither);
- no class of ``eprt/engine/`` or ``eprt/comm/`` with over MAX_METHODS methods, counting those it
  inherits from the package's own classes (a method overridden counts once).
``tests/test_code_shape.py`` asserts both. Exit status 1 when a limit is broken.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 60
MAX_METHODS = 25
CLASS_PACKAGES = ("eprt/engine/", "eprt/comm/")


def modules() -> dict[str, ast.Module]:
    """Every module of the package by its dotted name."""
    out = {}
    for path in sorted((ROOT / "eprt").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return out


def long_functions(trees: dict) -> list[tuple[int, str]]:
    """(lines, 'module:line name') of every function over MAX_LINES lines."""
    out = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    out.append((lines, f"{name}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def _classes(trees: dict) -> dict[tuple[str, str], ast.ClassDef]:
    return {(m, n.name): n for m, tree in trees.items() for n in tree.body if isinstance(n, ast.ClassDef)}


def _resolve(trees: dict, module: str, base: ast.expr) -> tuple[str, str] | None:
    """The package class a base expression names (defined in ``module`` or imported into it)."""
    if not isinstance(base, ast.Name):
        return None
    for node in trees[module].body:
        if isinstance(node, ast.ClassDef) and node.name == base.id:
            return module, base.id
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eprt"):
            for alias in node.names:
                if (alias.asname or alias.name) == base.id:
                    return node.module, alias.name
    return None


def methods(trees: dict, key: tuple[str, str], classes: dict) -> set[str]:
    """The method names of a class and of its package bases."""
    node = classes.get(key)
    if node is None:
        return set()
    own = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for base in node.bases:
        target = _resolve(trees, key[0], base)
        if target is not None:
            own |= methods(trees, target, classes)
    return own


def big_classes(trees: dict) -> list[tuple[int, str]]:
    """(methods, 'module.Class') of every engine/comm class over MAX_METHODS methods."""
    classes = _classes(trees)
    out = []
    for (module, name), node in classes.items():
        if not module.replace(".", "/").startswith(tuple(p.rstrip("/") for p in CLASS_PACKAGES)):
            continue
        n = len(methods(trees, (module, name), classes))
        if n > MAX_METHODS:
            out.append((n, f"{module}.{name}:{node.lineno}"))
    return sorted(out, reverse=True)


def main() -> int:
    trees = modules()
    functions, classes = long_functions(trees), big_classes(trees)
    for lines, where in functions:
        print(f"function of {lines} lines (max {MAX_LINES}): {where}")
    for n, where in classes:
        print(f"class of {n} methods (max {MAX_METHODS}): {where}")
    largest = max(
        (len(methods(trees, k, _classes(trees))), f"{k[0]}.{k[1]}")
        for k in _classes(trees)
        if k[0].startswith(("eprt.engine", "eprt.comm"))
    )
    longest = max(
        (n.end_lineno - n.lineno + 1, f"{m}.{n.name}")
        for m, t in trees.items()
        for n in ast.walk(t)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    )
    print(f"largest engine/comm class: {largest[1]} ({largest[0]} methods)")
    print(f"longest function: {longest[1]} ({longest[0]} lines)")
    return 1 if functions or classes else 0


if __name__ == "__main__":
    sys.exit(main())
