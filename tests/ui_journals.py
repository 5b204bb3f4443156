"""Real runs for the run inspector's tests, journaled where the first argument says.

Usage (from the repository root)::

    python -m tests.ui_journals JOURNAL WORKDIR

``JOURNAL`` is a SQLite path or a PostgreSQL URL. Everything is real: the demo's agent loop
(its scripted agent and pytest verification as subprocesses, snapshots in a git project), a
coordinator session whose tasks are child runs (scripted agents, real ``git apply``), the
sub-phases preset beside its real helper server, which is SIGKILLed in ``1b`` and restarted
by the supervisor, a run whose handler raises with ``<script>`` in its message, and one run
started and left waiting in its first state (for the abort action). Prints one JSON object:
the run ids by name.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from fsm_runner import Engine, MachineSpec, RetryPolicy, RunEvent, State, Transition
from fsm_runner.journal import Journal, open_journal
from fsm_runner.presets.agent_commands import create_demo_project, demo_input, make_engine
from fsm_runner.presets.coordinator import Coordinator, Task, TaskGraph
from fsm_runner.presets.coordinator_services import GitWorkspace, ScriptedAgents, file_diff
from fsm_runner.presets.subphases import Harness
from tests.test_coordinator import make_repo
from tests.test_subphases import Background, log_counts, started_pid, wait_for

#: What the failing run's handler raises, and what its input holds: HTML the pages must escape.
SCRIPT = "<script>alert('pwned')</script>"

XSS_SPEC = MachineSpec(
    "xss",
    states=[
        State("parsing", handler="parse"),
        State("parsed", terminal=True),
        State("failed", terminal=True, outcome="failed"),
        State("canceled", terminal=True, outcome="aborted"),
    ],
    transitions=[
        Transition("parsing", "PARSED", "parsed"),
        Transition("parsing", RunEvent.SYSTEM_ERROR, "failed"),
        Transition("parsing", RunEvent.USER_ABORTED, "canceled"),
    ],
)


def _parse(ctx: object) -> str:
    raise ValueError(f"cannot parse {SCRIPT}")


def agent_loop(journal: Journal, workdir: Path) -> str:
    """The demo's agent loop (``fsm-runner demo``): a wrong fix, feedback, the right fix."""
    engine = make_engine(journal)
    run_id = engine.start(demo_input(create_demo_project(workdir)))
    engine.run(run_id)
    return run_id


def coordinator_session(journal: Journal, workdir: Path) -> str:
    """A coordinator session over a git repo: three tasks (a, then b and c), each a child run."""
    repo = make_repo(workdir / "repo")
    graph = TaskGraph(
        [Task("a", "write a"), Task("b", "write b", ["a"]), Task("c", "write c", ["a"])],
        verify={"files": "test -f a.txt && test -f b.txt && test -f c.txt"},
    )
    script = {name: file_diff(f"{name}.txt", None, f"{name}\n") for name in "abc"}
    coordinator = Coordinator(journal, workspace=GitWorkspace(repo), agents=ScriptedAgents(script))
    try:
        session = coordinator.start(graph, idea="three files")
        coordinator.submit_plan(session, "the plan")
        coordinator.approve_plan(session)
        coordinator.run_until_done(session)
    finally:
        coordinator.close()
    return session


def subphases_with_restart(journal: Journal, workdir: Path) -> str:
    """The sub-phases preset; its helper server SIGKILLed in ``1b``, restarted, ``1b`` re-entered."""
    with Harness(
        journal, workdir=workdir / "subphases", backoff=RetryPolicy(wait_initial=0.01)
    ) as harness:
        run_id = harness.start({"delays": {"1b": 30.0}})
        background = Background(harness, run_id)
        wait_for(lambda: log_counts(harness.log_path, "start")["1b"] == 1, "'start 1b'")
        os.kill(started_pid(harness.log_path, "1b"), signal.SIGKILL)
        background.join()
    return run_id


def failing_and_waiting(journal: Journal) -> tuple[str, str]:
    """A run whose handler raises with HTML in its message; a run left in its first state."""
    engine = Engine(XSS_SPEC, handlers={"parse": _parse}, journal=journal)
    failed = engine.start({"document": SCRIPT})
    engine.run(failed)
    waiting = engine.start({"document": "later"})
    return failed, waiting


def main(argv: list[str]) -> int:
    """Make every run in the journal ``argv[0]``, working in directory ``argv[1]``."""
    location, workdir = argv[0], Path(argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    with open_journal(location) as journal:
        ids = {"agent_loop": agent_loop(journal, workdir)}
        ids["session"] = coordinator_session(journal, workdir)
        ids["subphases"] = subphases_with_restart(journal, workdir)
        ids["failed"], ids["waiting"] = failing_and_waiting(journal)
    print(json.dumps(ids), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
