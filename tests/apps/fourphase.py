"""A four-phase app for the crash test: fetching -> building -> testing -> publishing -> published.

Each phase appends ``"<phase> <run_id>"`` to the file named by ``FSM_TEST_LOG``. When
``FSM_TEST_BLOCK_FILE`` is set, the third phase (``testing``) appends its line, then touches that
marker file and sleeps for a long time, so a test can kill the process inside phase 3.

Usage (from the repository root)::

    FSM_TEST_JOURNAL=j.db FSM_TEST_LOG=log.txt python -m tests.apps.fourphase start
    FSM_TEST_JOURNAL=j.db FSM_TEST_LOG=log.txt python -m tests.apps.fourphase resume RUN_ID

Both print the run id on the first line (flushed at once) and the final state on the second.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fsm_runner import Engine, MachineSpec, PhaseContext, RunEvent, SqliteJournal, State, Transition

PHASES = ("fetching", "building", "testing", "publishing")
DONE = "PHASE_DONE"

SPEC = MachineSpec(
    "fourphase",
    [
        *(State(phase, handler=phase) for phase in PHASES),
        State("published", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    [
        *(
            Transition(phase, DONE, dest)
            for phase, dest in zip(PHASES, [*PHASES[1:], "published"], strict=True)
        ),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
    ],
)


def _log(ctx: PhaseContext) -> None:
    with open(os.environ["FSM_TEST_LOG"], "a", encoding="utf-8") as log:
        log.write(f"{ctx.state} {ctx.run_id}\n")


def _phase(ctx: PhaseContext) -> str:
    _log(ctx)
    return DONE


def _testing(ctx: PhaseContext) -> str:
    _log(ctx)
    block = os.environ.get("FSM_TEST_BLOCK_FILE")
    if block:
        Path(block).touch()
        time.sleep(600)  # killed here by the test
    return DONE


def make_engine() -> Engine:
    """The app's engine, journaling to the SQLite file named by ``FSM_TEST_JOURNAL``."""
    handlers = dict.fromkeys(PHASES, _phase)
    handlers["testing"] = _testing
    return Engine(SPEC, handlers=handlers, journal=SqliteJournal(os.environ["FSM_TEST_JOURNAL"]))


def main(argv: list[str]) -> int:
    """``start`` a run and run it, or ``resume RUN_ID``; print the run id and final state."""
    engine = make_engine()
    try:
        if argv[:1] == ["start"] and len(argv) == 1:
            run_id = engine.start()
        elif argv[:1] == ["resume"] and len(argv) == 2:
            run_id = argv[1]
        else:
            print("usage: python -m tests.apps.fourphase start | resume RUN_ID", file=sys.stderr)
            return 2
        print(run_id, flush=True)
        run = engine.resume(run_id)
        print(run.state, flush=True)
    finally:
        engine.journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
