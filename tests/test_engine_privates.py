"""Tests use the engine through its public API and its public parts, never its privates.

The engine is a façade over parts (the step core, the drivers, the held runs, the lease keeper,
the worker); a test that needs one of them builds it from its module (``StepCore(...)``,
``LeaseKeeper(...)``) or observes the journal. A line that reads a private attribute of an
``engine`` must say why on the same line, with a ``# private: <reason>`` comment.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: An engine's private attribute, as a test would reach it (built so this file does not match).
PRIVATE = re.compile(r"\bengine" + r"\._")
JUSTIFIED = re.compile(r"#\s*private:\s*\S")


def unjustified(path: Path, root: Path = TESTS) -> list[str]:
    """Every line of ``path`` that reaches an engine's private attribute without a reason."""
    return [
        f"{path.relative_to(root).as_posix()}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line) and not JUSTIFIED.search(line)
    ]


def test_no_test_reaches_into_an_engines_private_attributes():
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in unjustified(path)]
    assert found == []


def test_the_check_sees_a_private_reach_and_accepts_a_reason(tmp_path):
    path = tmp_path / "test_probe.py"
    lines = [
        "engine" + "._leases.holds('r')",
        "engine" + "._core  # private: what this probe is about",
        "my_engine.journal",
    ]
    path.write_text("\n".join(lines) + "\n")
    assert unjustified(path, tmp_path) == [f"test_probe.py:1: {lines[0]}"]
