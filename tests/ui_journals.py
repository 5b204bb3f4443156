"""Real runs for the run inspector's tests, journaled where the first argument says.

Usage (from the repository root)::

    python -m tests.ui_journals JOURNAL WORKDIR

``JOURNAL`` is a SQLite path or a PostgreSQL URL. Everything is real: the demo's agent loop
(its scripted agent and pytest verification as subprocesses, snapshots in a git project), a
coordinator session whose tasks are child runs (scripted agents, real ``git apply``), the
sub-phases preset beside its real helper server, which is SIGKILLed in ``1b`` and restarted
by the supervisor, a run whose process died inside a side effect (caught in flight), a run
whose handler raises with ``<script>`` in its message, and one run
started and left waiting in its first state (for the abort action). Prints one JSON object:
the run ids by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fsm_runner import Engine, MachineSpec, RetryPolicy, RunEvent, State, Transition, Wait
from fsm_runner.journal import Journal, open_journal
from fsm_runner.presets.agent_loop.commands import create_demo_project, demo_input, make_engine
from fsm_runner.presets.coordinator import Coordinator, Task, TaskGraph
from fsm_runner.presets.coordinator.services import GitWorkspace, ScriptedAgents, file_diff
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


EFFECTS_SPEC = MachineSpec(
    "publish",
    states=[
        State("pushing", handler="push", allows=["notify", "mutate"]),
        State("pushed", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    transitions=[
        Transition("pushing", "PUSHED", "pushed"),
        Transition("pushing", RunEvent.SYSTEM_ERROR, "failed"),
    ],
)


class Crash(BaseException):
    """The process dies while an effect runs (as test_effects.py simulates a kill)."""


def _push(ctx: Any) -> str:
    ctx.effect("notify", lambda: {"sent": True}, kind="notify")
    ctx.effect("upload", _die, {"key": "release-1.2"}, kind="mutate")
    return "PUSHED"


def _die(params: object) -> None:
    raise Crash


#: What the approval machine's waiting state asks, and the payload it expects.
APPROVAL_PROMPT = "Apply the proposed change?"
APPROVAL_SCHEMA = {"type": "object", "properties": {"note": {"type": "string"}}}


def approval_spec(
    name: str = "approval", prompt: str = APPROVAL_PROMPT, schema: Any = APPROVAL_SCHEMA
) -> MachineSpec:
    """A small machine that waits: propose, wait a day for APPROVE or REJECT, then apply."""
    return MachineSpec(
        name,
        states=[
            State("proposing", handler="propose"),
            State("awaiting", wait=Wait(timeout=86_400, prompt=prompt, schema=schema)),
            State("applying", handler="apply"),
            State("applied", terminal=True),
            State("expired", terminal=True, outcome="failed"),
            State("failed", terminal=True, outcome="failed"),
        ],
        transitions=[
            Transition("proposing", "PROPOSED", "awaiting"),
            Transition("awaiting", "APPROVE", "applying"),
            Transition("awaiting", "REJECT", "proposing"),
            Transition("awaiting", "TIMEOUT", "expired"),
            Transition("applying", "APPLIED", "applied"),
            Transition("proposing", RunEvent.SYSTEM_ERROR, "failed"),
            Transition("applying", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )


def _propose(ctx: Any) -> str:
    return "PROPOSED"


def _apply(ctx: Any) -> str:
    """Apply: as slowly as the run's input says (``delay`` seconds), for a page to watch it."""
    time.sleep(float((ctx.input or {}).get("delay", 0)))
    return "APPLIED"


#: The approval machine's handlers.
APPROVAL_HANDLERS = {"propose": _propose, "apply": _apply}


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


def effect_in_flight(journal: Journal) -> str:
    """A run whose process died inside an effect: one effect done, one caught in flight."""
    engine = Engine(EFFECTS_SPEC, handlers={"push": _push}, journal=journal)
    run_id = engine.start({"release": "1.2"})
    with contextlib.suppress(Crash):
        engine.run(run_id)
    engine.close()
    return run_id


def main(argv: list[str]) -> int:
    """Make every run in the journal ``argv[0]``, working in directory ``argv[1]``."""
    location, workdir = argv[0], Path(argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    ids: dict[str, str] = {}

    def demo() -> None:  # mostly waits on its agent and pytest: beside the others, in a thread
        with open_journal(location) as own:
            ids["agent_loop"] = agent_loop(own, workdir)

    with open_journal(location) as journal:
        thread = threading.Thread(target=demo)
        thread.start()
        ids["session"] = coordinator_session(journal, workdir)
        ids["subphases"] = subphases_with_restart(journal, workdir)
        thread.join()
        if "agent_loop" not in ids:
            return 1
        ids["effects"] = effect_in_flight(journal)
        ids["failed"], ids["waiting"] = failing_and_waiting(journal)
    print(json.dumps(ids), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
