"""The code stays in pieces a reader can hold: issue 18's limits, checked on every run.

No module of ``fsm_runner/`` over ~800 lines, no class over ~500, no function over ~80. A class
is counted together with every base class it has in the package (issue 27): a reader of the
class reads its bases too, so splitting one class into base classes does not make it smaller.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import fsm_runner

PACKAGE = Path(fsm_runner.__file__).parent
LIMITS = {"module": 800, "class": 500, "function": 80}
MODULES = sorted(PACKAGE.rglob("*.py"))

#: A class found in the package: its module's dotted name and its definition.
Found = tuple[str, ast.ClassDef]


class Package:
    """The modules of one package, parsed, and the in-package base classes of their classes.

    A base is followed through the names a module imports (``from pkg.mod import Base``,
    ``from pkg import mod`` then ``mod.Base``, relative imports, re-exports), so a class
    counts the lines of every base it has in the package, however far up.
    """

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name

    def dotted(self, path: Path) -> str:
        """The module name of ``path`` (a file under the package's root)."""
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join([self.name, *parts])

    def path(self, dotted: str) -> Path | None:
        """The file of module ``dotted``, if it is one of the package's."""
        if dotted != self.name and not dotted.startswith(self.name + "."):
            return None
        base = self.root.joinpath(*dotted.split(".")[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    @functools.cache  # noqa: B019 - a Package lives as long as the test session, as its cache
    def tree(self, dotted: str) -> ast.Module | None:
        path = self.path(dotted)
        return None if path is None else ast.parse(path.read_text())

    @functools.cache  # noqa: B019 - see tree
    def names(self, dotted: str) -> dict[str, tuple[str, str | None]]:
        """What each name of a module's top level is: ``(module, name)``, or ``(module, None)``
        for a module bound to it; its own classes are ``(dotted, name)``."""
        tree = self.tree(dotted)
        found: dict[str, tuple[str, str | None]] = {}
        if tree is None:
            return found
        is_package = self.path(dotted).name == "__init__.py"  # type: ignore[union-attr]
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (dotted, node.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        found[alias.asname] = (alias.name, None)
                    else:
                        top = alias.name.split(".")[0]
                        found[top] = (top, None)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(dotted, node, is_package=is_package)
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    kind = (target, None) if self.path(target) else (source, alias.name)
                    found[alias.asname or alias.name] = kind
        return found

    def resolve(
        self, dotted: str, expr: ast.expr, seen: frozenset[str] = frozenset()
    ) -> Found | None:
        """The package's class that ``expr`` (a base, written in module ``dotted``) names."""
        if isinstance(expr, ast.Subscript):  # Generic[T], Base[int]
            return self.resolve(dotted, expr.value, seen)
        if isinstance(expr, ast.Name):
            return self._lookup(dotted, expr.id, seen)
        if isinstance(expr, ast.Attribute):
            module = self._module_of(dotted, expr.value)
            return None if module is None else self._lookup(module, expr.attr, seen)
        return None

    def _module_of(self, dotted: str, expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            module, name = self.names(dotted).get(expr.id, (None, None))
            return module if name is None else None
        if isinstance(expr, ast.Attribute):
            outer = self._module_of(dotted, expr.value)
            return None if outer is None else f"{outer}.{expr.attr}"
        return None

    def _lookup(self, dotted: str, name: str, seen: frozenset[str]) -> Found | None:
        key = f"{dotted}:{name}"
        if key in seen or self.tree(dotted) is None:
            return None
        module, original = self.names(dotted).get(name, (None, None))
        if module is None or original is None:
            return None
        if module == dotted:
            tree = self.tree(dotted)
            assert tree is not None
            for node in _top_level(tree):
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return dotted, node
            return None
        return self._lookup(module, original, seen | {key})  # imported, maybe re-exported

    def bases(self, dotted: str, node: ast.ClassDef) -> list[Found]:
        """Every in-package base class of ``node``, however far up, each once."""
        found: dict[tuple[str, str], Found] = {}
        todo = [(dotted, base) for base in node.bases]
        while todo:
            module, base = todo.pop()
            resolved = self.resolve(module, base)
            if resolved is None or (resolved[0], resolved[1].name) in found:
                continue
            found[resolved[0], resolved[1].name] = resolved
            todo += [(resolved[0], above) for above in resolved[1].bases]
        return list(found.values())


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """A module's statements, those inside its top-level ``if``/``try`` blocks included."""
    found: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        found.append(node)
        if isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse]
            if isinstance(node, ast.Try):
                todo += [*node.finalbody, *(s for h in node.handlers for s in h.body)]
    return found


def _absolute(dotted: str, node: ast.ImportFrom, *, is_package: bool) -> str:
    """The module an ``import from`` names, a relative one resolved against ``dotted``."""
    if not node.level:
        return node.module or ""
    parts = dotted.split(".")
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,operator]


def oversized(path: Path, package: Package | None = None) -> list[str]:
    """Every piece of ``path`` over its limit, as ``kind name: lines``.

    A class's lines are its own and those of its base classes in ``package`` (by default
    ``fsm_runner``).
    """
    package = package or _FSM_RUNNER
    text = path.read_text()
    found = []
    if len(text.splitlines()) > LIMITS["module"]:
        found.append(f"module: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            bases = package.bases(package.dotted(path), node)
            lines = _lines(node) + sum(_lines(base) for _, base in bases)
            if lines > LIMITS["class"]:
                with_bases = ", ".join(sorted(base.name for _, base in bases))
                found.append(
                    f"class {node.name}: {lines} lines"
                    + (f" (with its bases {with_bases})" if bases else "")
                )
        elif (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and _lines(node) > LIMITS["function"]
        ):
            found.append(f"function {node.name}: {_lines(node)} lines")
    return found


_FSM_RUNNER = Package(PACKAGE, "fsm_runner")


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.relative_to(PACKAGE).as_posix())
def test_no_piece_is_over_its_limit(path):
    assert oversized(path) == []


def test_the_check_sees_an_oversized_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMITS["function"]))
    path = tmp_path / "big.py"
    path.write_text(f"def big():\n{body}\n")
    assert oversized(path) == [f"function big: {LIMITS['function'] + 1} lines"]


def _methods(count: int) -> str:
    return "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(count))


def test_the_check_sees_a_class_split_over_base_classes(tmp_path):
    """Two bases of 200 lines each, in modules of their own, and a class of 101 over both."""
    root = tmp_path / "pkg"
    (root / "parts").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "parts" / "__init__.py").write_text("from pkg.parts.left import Left\n")
    (root / "parts" / "left.py").write_text(f"class Left:\n{_methods(66)}    x = 1\n")
    (root / "right.py").write_text(f"class Right:\n{_methods(66)}    x = 1\n")
    (root / "whole.py").write_text(
        "import pkg.right\nfrom . import parts\n\n\n"
        f"class Whole(parts.Left, pkg.right.Right):\n{_methods(33)}    x = 1\n"
    )
    package = Package(root, "pkg")
    for name in ("parts/left.py", "right.py"):
        assert oversized(root / name, package) == []
    assert oversized(root / "whole.py", package) == [
        "class Whole: 501 lines (with its bases Left, Right)"
    ]
