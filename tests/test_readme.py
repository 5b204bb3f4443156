"""The README's Python example runs as written."""

from __future__ import annotations

import re
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
