"""The agent loop driven entirely by commands: what ``fsm-runner agent-loop`` and ``demo`` run.

A run's input carries everything its services need — the agent command, the verification
levels, the limits — and names :func:`make_engine` as its app, so ``fsm-runner resume RUN``
continues it with no Python to write::

    {"task": "...", "workspace": "/path/to/repo", "max_iterations": 3, "max_seconds": null,
     "agent": {"command": "my-agent --json", "timeout": 600},
     "verify": {"L0": ["python -m compileall -q ."], "L1": ["python -m pytest -q"]},
     "app": "fsm_runner.presets.agent_loop.commands:make_engine"}

The demo (:func:`create_demo_project`, :func:`demo_input`) makes a small git project with a
failing test, and a scripted agent — a real subprocess, ``python -m
fsm_runner.presets.agent_loop.commands agent`` — that edits files: a wrong attempt first, then
the fix.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsm_runner import Engine, Journal, MemoryJournal
from fsm_runner.presets.agent_loop import AgentRequest, AgentResult, agent_loop_engine
from fsm_runner.presets.agent_loop.services import (
    CommandAgentDriver,
    CommandVerifier,
    GitSnapshotter,
    TemplateFeedbackGenerator,
)

__all__ = [
    "APP",
    "APPROVAL_APP",
    "create_demo_project",
    "demo_input",
    "loop_input",
    "main",
    "make_approval_engine",
    "make_engine",
]

#: The import path of :func:`make_engine`, recorded in every run's input.
APP = "fsm_runner.presets.agent_loop.commands:make_engine"
#: The import path of :func:`make_approval_engine`, recorded in the input of gated runs.
APPROVAL_APP = "fsm_runner.presets.agent_loop.commands:make_approval_engine"


class _OptionsAgent:
    """A command agent configured by the run's input (``agent.command``, ``agent.timeout``)."""

    def run(self, request: AgentRequest) -> AgentResult:
        """Run the command the run's input names."""
        options = request.options
        timeout = options.get("timeout")
        driver = CommandAgentDriver(timeout=float(timeout) if timeout else None)
        return driver.run(request)


def make_engine(journal: Journal | None = None, *, approval: bool = False) -> Engine:
    """The agent-loop engine whose services take their commands from each run's input.

    The CLI rebinds it to its own journal; without one it journals in memory. With
    ``approval``, its machine has the approval gate (:func:`make_approval_engine`).
    """
    return agent_loop_engine(
        journal=journal if journal is not None else MemoryJournal(),
        agent=_OptionsAgent(),
        snapshotter=GitSnapshotter(),
        verifier=CommandVerifier(),
        feedback=TemplateFeedbackGenerator(),
        approval=approval,
    )


def make_approval_engine(journal: Journal | None = None) -> Engine:
    """:func:`make_engine` with the approval gate: the app of ``demo --ask`` runs."""
    return make_engine(journal, approval=True)


def loop_input(
    *,
    task: str,
    workspace: str | os.PathLike[str],
    agent: str,
    verify: Mapping[str, Sequence[str] | str],
    max_iterations: int = 3,
    timeout: float | None = None,
    approval: bool = False,
) -> dict[str, Any]:
    """The input of a command-driven agent-loop run.

    Args:
        task: the task prompt given to the agent.
        workspace: the git repository the agent works in.
        agent: the agent command (run by the shell in the workspace).
        verify: verification levels, e.g. ``{"L0": "cmd", "L1": ["cmd", "cmd"]}``.
        max_iterations: builds at most.
        timeout: the run's wall-clock limit in seconds; each agent run gets at most this too.
        approval: the run waits for a person's approval once verification passes (its app
            is then :data:`APPROVAL_APP`).
    """
    levels = {name: [cmd] if isinstance(cmd, str) else list(cmd) for name, cmd in verify.items()}
    return {
        "task": task,
        "workspace": str(Path(workspace).absolute()),
        "max_iterations": max_iterations,
        "max_seconds": timeout,
        "agent": {"command": agent, "timeout": timeout},
        "verify": levels,
        "app": APPROVAL_APP if approval else APP,
    }


_BUGGY = "def add(a, b):\n    return a - b\n"
_WRONG = "def add(a, b):\n    return a + b + 1\n"
_FIXED = "def add(a, b):\n    return a + b\n"
_TEST = """from calc import add


def test_add():
    assert add(2, 3) == 5


def test_add_negative():
    assert add(-1, 1) == 0
"""


def create_demo_project(parent: str | os.PathLike[str] | None = None) -> Path:
    """Create a small git project whose test fails (``calc.add`` subtracts); return its path."""
    root = Path(tempfile.mkdtemp(prefix="fsm-runner-demo-", dir=parent))
    (root / "calc.py").write_text(_BUGGY)
    (root / "test_calc.py").write_text(_TEST)
    git = ["git", "-c", "user.name=fsm-runner", "-c", "user.email=fsm-runner@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "a project with a bug"]):
        subprocess.run([*git, *args], cwd=root, check=True, capture_output=True)  # noqa: S603
    return root


def demo_input(workspace: Path, *, approval: bool = False) -> dict[str, Any]:
    """The demo run's input: the scripted agent, L0 a compile check, L1 pytest.

    With ``approval``, the run waits for a person's approval once verification passes, and
    has no wall-clock limit (a person's answer may take hours; each agent run still has 120 s).
    """
    python = shlex.quote(sys.executable)
    run_input = loop_input(
        task="Make the tests in test_calc.py pass: calc.add must add its arguments.",
        workspace=workspace,
        agent=f"{python} -m fsm_runner.presets.agent_loop.commands agent",
        verify={
            "L0": f"{python} -m compileall -q calc.py test_calc.py",
            "L1": f"{python} -m pytest -q -p no:cacheprovider test_calc.py",
        },
        max_iterations=3,
        timeout=120,
        approval=approval,
    )
    if approval:
        run_input["max_seconds"] = None
    return run_input


def _scripted_agent() -> int:
    """The demo's agent: reads its request, edits calc.py, prints a JSON result line."""
    request = json.loads(sys.stdin.read() or "{}")
    iteration = int(request.get("iteration") or os.environ.get("FSM_ITERATION") or 1)
    feedback = request.get("feedback") or ""
    # First attempt: a plausible but wrong fix; once there is feedback, the right one (and
    # after a reviewer's rejection, the right one with the reviewer's words as its docstring).
    source = _FIXED if feedback else _WRONG
    if "reviewer rejected it: " in feedback:
        comment = feedback.split("reviewer rejected it: ", 1)[1].strip().splitlines()[0]
        source = source.replace(":\n", f":\n    {json.dumps(comment)}\n", 1)
    Path("calc.py").write_text(source)
    prompt = f"{request.get('task', '')}\n{feedback}"
    tokens_in = len(prompt.split()) * 4 + 200
    tokens_out = len(source.split()) * 4 + 50
    print(f"scripted agent, attempt {iteration}: wrote calc.py")
    result = {
        "session_id": request.get("session_id") or "demo-session",
        "model": "scripted-demo",
        "tokens_input": tokens_in,
        "tokens_output": tokens_out,
        "cost_usd": round((tokens_in * 3 + tokens_out * 15) / 1_000_000, 6),
    }
    print(json.dumps(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsm_runner.presets.agent_loop.commands agent``: the demo's scripted agent."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["agent"]:
        print("usage: python -m fsm_runner.presets.agent_loop.commands agent", file=sys.stderr)
        return 2
    return _scripted_agent()


if __name__ == "__main__":
    raise SystemExit(main())
