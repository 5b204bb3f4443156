"""The code stays in pieces a reader can hold: issue 18's limits, checked on every run.

No module of ``fsm_runner/`` over ~800 lines, no class over ~500, no function over ~80.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fsm_runner

PACKAGE = Path(fsm_runner.__file__).parent
LIMITS = {"module": 800, "class": 500, "function": 80}
MODULES = sorted(PACKAGE.rglob("*.py"))


def oversized(path: Path) -> list[str]:
    """Every piece of ``path`` over its limit, as ``kind name: lines``."""
    text = path.read_text()
    found = []
    if len(text.splitlines()) > LIMITS["module"]:
        found.append(f"module: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "function"
        else:
            continue
        lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
        if lines > LIMITS[kind]:
            found.append(f"{kind} {node.name}: {lines} lines")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.relative_to(PACKAGE).as_posix())
def test_no_piece_is_over_its_limit(path):
    assert oversized(path) == []


def test_the_check_sees_an_oversized_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMITS["function"]))
    path = tmp_path / "big.py"
    path.write_text(f"def big():\n{body}\n")
    assert oversized(path) == [f"function big: {LIMITS['function'] + 1} lines"]
