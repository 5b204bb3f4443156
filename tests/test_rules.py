"""The pure step logic (``fsm_runner.rules``) stands on its own floor.

Importing the reducer, the decisions or the classifier loads no driver, no lease keeper, no
journal implementation, no asyncio and no group commit: replay and any tool that only reads
runs pay for none of them, and the rules cannot come to depend on them unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULES = ["fsm_runner.rules.reducer", "fsm_runner.rules.decisions", "fsm_runner.rules.classify"]
#: What no rule module may load (a prefix: the module and everything under it).
FORBIDDEN = [
    "fsm_runner.engine",
    "fsm_runner.journal.sqlite",
    "fsm_runner.journal.postgres",
    "fsm_runner.journal.memory",
    "fsm_runner.journal._sql",
    "fsm_runner.replay",
    "fsm_runner.cli",
    "fsm_runner.ui",
    "asyncio",
    "sqlite3",
]


def _loaded_by(module: str) -> list[str]:
    """Every module a fresh interpreter has loaded once it imported ``module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    loaded: list[str] = json.loads(done.stdout)
    return loaded


@pytest.mark.parametrize("module", RULES)
def test_a_rule_module_loads_no_driver_lease_journal_or_asyncio(module):
    loaded = _loaded_by(module)
    assert module in loaded
    found = [
        name
        for name in loaded
        for prefix in FORBIDDEN
        if name == prefix or name.startswith(prefix + ".")
    ]
    assert found == []


def test_the_check_sees_a_forbidden_import():
    found = [name for name in _loaded_by("fsm_runner.engine.core") if name == "fsm_runner.engine"]
    assert found == ["fsm_runner.engine"]
