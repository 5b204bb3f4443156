"""A coordinator host app for the crash tests: one session over a git repo, from a JSON config.

The config file holds ``journal`` (a path), ``workspace`` (a git work tree), ``graph`` (a
:class:`TaskGraph` as data), ``script`` (``{"TASK": diff}`` or ``{"TASK#ATTEMPT": diff}``) and
``agent_log`` (a file each agent call is appended to). When ``FSM_TEST_BLOCK_FILE`` is set, the
workspace touches that file right after ``git apply`` has applied the diff of the task named by
``FSM_TEST_BLOCK_TASK`` — before the engine journals it — and sleeps, so a test can kill the
process between applying a task's diff and verifying it.

Usage (from the repository root)::

    python -m tests.apps.coordinator_app CONFIG start
    python -m tests.apps.coordinator_app CONFIG resume SESSION_ID

Both print the session id on the first line (flushed at once) and its final state on the second.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from fsm_runner import SqliteJournal
from fsm_runner.presets.coordinator import Coordinator, PatchResult, TaskGraph
from fsm_runner.presets.coordinator.services import GitWorkspace, ScriptedAgents


class BlockingWorkspace:
    """A git workspace that stops dead right after applying one diff (to be killed there)."""

    def __init__(self, inner: GitWorkspace, diff: str, marker: Path) -> None:
        self.inner = inner
        self.diff = diff
        self.marker = marker

    @property
    def path(self) -> str:
        return self.inner.path

    def apply(self, diff: str, *, key: str | None = None) -> PatchResult:
        result = self.inner.apply(diff, key=key)
        if diff == self.diff:
            self.marker.touch()
            time.sleep(600)  # killed here by the test
        return result

    def revert(self, diff: str, *, key: str | None = None) -> PatchResult:
        return self.inner.revert(diff, key=key)

    def commit(self, message: str) -> str | None:
        return self.inner.commit(message)


def _script(data: dict[str, str]) -> dict[Any, str]:
    script: dict[Any, str] = {}
    for key, diff in data.items():
        task, _, attempt = key.partition("#")
        script[(task, int(attempt)) if attempt else task] = diff
    return script


def main(argv: list[str]) -> int:
    """``CONFIG start`` a session and run it, or ``CONFIG resume SESSION``."""
    if (
        len(argv) < 2
        or argv[1] not in ("start", "resume")
        or len(argv) != 2 + (argv[1] == "resume")
    ):
        print(__doc__, file=sys.stderr)
        return 2
    config = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    script = _script(config["script"])
    workspace: Any = GitWorkspace(config["workspace"])
    block = os.environ.get("FSM_TEST_BLOCK_FILE")
    if block:
        workspace = BlockingWorkspace(
            workspace, script[os.environ["FSM_TEST_BLOCK_TASK"]], Path(block)
        )
    agents = ScriptedAgents(script, log=Path(config["agent_log"]))
    with SqliteJournal(config["journal"]) as journal:
        coordinator = Coordinator(journal, workspace=workspace, agents=agents)
        if argv[1] == "start":
            session_id = coordinator.start(TaskGraph.from_dict(config["graph"]), idea="crash test")
            print(session_id, flush=True)
            coordinator.submit_plan(session_id, "run every task")
            coordinator.approve_plan(session_id)
            run = coordinator.run_until_done(session_id)
        else:
            session_id = argv[2]
            print(session_id, flush=True)
            run = coordinator.resume(session_id)
        print(run.state, flush=True)
        coordinator.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
