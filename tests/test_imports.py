"""Dependencies point one way: no import cycle among ``fsm_runner``'s modules.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` of a
module, at module level, under ``if TYPE_CHECKING:`` and inside functions alike (a lazy import
is still a dependency; it only moves when the cost is paid). Relative imports are resolved, and
``from pkg import name`` where ``name`` is a submodule is an edge to that submodule. Importing a
module is not counted as importing its parent packages (every module would then depend on
``fsm_runner/__init__.py``, which re-exports the library).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import fsm_runner

PACKAGE = Path(fsm_runner.__file__).parent


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``), by its dotted name."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterable[str]:
    """The dotted names an import statement of ``module`` may refer to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself.
    return [f"{source}.{alias.name}" for alias in node.names] + [source]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Which of ``package``'s modules each of its modules imports (anywhere in its code)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = list(_imported(node, name, is_package))
            submodules = (
                [n for n in names[:-1] if n in modules] if isinstance(node, ast.ImportFrom) else []
            )
            targets = submodules or [_nearest(n, modules) for n in names]
            graph[name].update(t for t in targets if t and t != name)
    return graph


def _nearest(name: str, modules: Mapping[str, Path]) -> str:
    """``name`` if it is a module, else the longest module prefix of it ('' if none)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def cycles(graph: Mapping[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _describe(component: tuple[str, ...], graph: Mapping[str, set[str]]) -> str:
    members = set(component)
    edges = [f"  {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "\n".join([" <-> ".join(component), *edges])


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """fsm_runner's own import graph (read once, by the worker that runs these tests: parsing
    every module costs a second of CPU, which each worker paid at collection as a constant)."""
    return import_graph(PACKAGE.parent, "fsm_runner")


class TestNoCycles:
    """No import cycle among fsm_runner's modules."""

    def test_no_import_cycle(self, graph):
        found = cycles(graph)
        assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)

    def test_the_graph_sees_the_package(self, graph):
        # A checker that found no module would find no cycle.
        assert "fsm_runner.cli" in graph["fsm_runner.__main__"]
        assert "fsm_runner.journal" in graph["fsm_runner.ui.app"]


class TestTheChecker:
    """The checker finds cycles through every kind of import."""

    @staticmethod
    def _package(tmp_path: Path, files: Mapping[str, str]) -> dict[str, set[str]]:
        for name, text in files.items():
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return import_graph(tmp_path, "pkg")

    def test_a_cycle_through_a_function_level_import(self, tmp_path):
        graph = self._package(
            tmp_path,
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "from pkg.b import thing\n",
                "pkg/b.py": "def thing():\n    from pkg import a\n    return a\n",
                "pkg/c.py": "import pkg.a\n",
            },
        )
        assert cycles(graph) == [("pkg.a", "pkg.b")]

    def test_relative_imports_and_type_checking_blocks(self, tmp_path):
        graph = self._package(
            tmp_path,
            {
                "pkg/__init__.py": "",
                "pkg/sub/__init__.py": "from .low import X\n",
                "pkg/sub/low.py": (
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..top import Y\n"
                ),
                "pkg/top.py": "from .sub import low\n",
                "pkg/alone.py": "from . import top\nimport os\n",
            },
        )
        assert graph["pkg.sub"] == {"pkg.sub.low"}
        assert graph["pkg.alone"] == {"pkg.top"}
        assert cycles(graph) == [("pkg.sub.low", "pkg.top")]

    def test_no_cycle_in_a_chain(self, tmp_path):
        graph = self._package(
            tmp_path,
            {"pkg/__init__.py": "from pkg import a\n", "pkg/a.py": "import json\n"},
        )
        assert cycles(graph) == []


#: What the pure step logic must not import: drivers, leases, journal implementations.
FORBIDDEN_BELOW_RULES = (
    "fsm_runner.engine",
    "fsm_runner.journal.sqlite",
    "fsm_runner.journal.postgres",
    "fsm_runner.journal.memory",
    "fsm_runner.journal._",
)


def forbidden_paths(graph: Mapping[str, set[str]], start: Iterable[str]) -> list[str]:
    """Each forbidden module reached from ``start``, as the chain of imports that reaches it.

    Directly or through anything in between: importing ``fsm_runner.journal`` (the package,
    which loads the SQLite journal) counts as importing what it imports.
    """
    parent: dict[str, str | None] = dict.fromkeys(start)
    todo = list(parent)
    found = []
    while todo:
        module = todo.pop(0)
        for target in sorted(graph.get(module, ())):
            if target in parent:
                continue
            parent[target] = module
            if _forbidden(target):
                chain = [target]
                while (step := parent[chain[-1]]) is not None:
                    chain.append(step)
                found.append(" -> ".join(reversed(chain)))
            else:
                todo.append(target)
    return found


def _forbidden(module: str) -> bool:
    return any(
        module == prefix or module.startswith(prefix if prefix.endswith("_") else prefix + ".")
        for prefix in FORBIDDEN_BELOW_RULES
    )


class TestPureStepLogic:
    """The pure step logic (fsm_runner.rules) imports no driver, lease or journal."""

    def test_rules_import_no_engine_or_journal_implementation(self, graph):
        rules = [m for m in graph if m == "fsm_runner.rules" or m.startswith("fsm_runner.rules.")]
        assert rules, "the checker found no module of fsm_runner.rules"
        assert forbidden_paths(graph, rules) == []

    def test_the_check_follows_imports_through_other_modules(self):
        graph = {
            "fsm_runner.rules": {"fsm_runner.rules.reducer"},
            "fsm_runner.rules.reducer": {"fsm_runner.records", "fsm_runner.journal"},
            "fsm_runner.records": set(),
            "fsm_runner.journal": {"fsm_runner.journal.base", "fsm_runner.journal.sqlite"},
            "fsm_runner.journal.base": set(),
        }
        assert forbidden_paths(graph, ["fsm_runner.rules"]) == [
            "fsm_runner.rules -> fsm_runner.rules.reducer -> fsm_runner.journal"
            " -> fsm_runner.journal.sqlite"
        ]

    def test_the_forbidden_prefixes(self):
        assert _forbidden("fsm_runner.engine.leases")
        assert _forbidden("fsm_runner.journal._sql")
        assert _forbidden("fsm_runner.journal.sqlite")
        assert not _forbidden("fsm_runner.journal")
        assert not _forbidden("fsm_runner.journal.base")
        assert not _forbidden("fsm_runner.engineering")
