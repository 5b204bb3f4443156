"""The README's own rules: its Quick start (what CI runs) and its embedding example.

Every Python block and `$` command of the README and of docs/ is checked by ``test_docs.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_the_embedding_example():
    assert python_blocks(), "the README lost its ```python example"


def test_readme_python_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert (tmp_path / "release.db").exists()


def test_readme_quick_start_has_exactly_two_commands():
    text = README.read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quick_start, flags=re.DOTALL)
    assert len(commands) == 2
    assert "fsm-runner demo" in commands[0]
    assert "pytest" in commands[1]
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert commands[1].strip() in ci


def test_readme_quick_start_says_how_to_get_fsm_runner_on_path():
    quick_start = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first = re.findall(r"```bash\n(.*?)```", quick_start, flags=re.DOTALL)[0]
    assert "source .venv/bin/activate" in first  # every later bare `fsm-runner` needs it
    assert ".venv/bin/fsm-runner" in quick_start
    assert "python -m fsm_runner" in quick_start


def test_python_m_fsm_runner_is_the_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "fsm_runner", "--journal", str(tmp_path / "none.db"), "runs"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 3
    assert result.stderr.startswith("Error: no journal at ")
    shown = subprocess.run(
        [sys.executable, "-m", "fsm_runner", "--help"], capture_output=True, text=True, check=True
    )
    assert shown.stdout.startswith("Usage: fsm-runner ")


def test_readme_stays_short():
    """A newcomer's page: what it is, install, a quick start, an example, links (the rest: docs/)."""
    assert len(README.read_text().splitlines()) <= 250
