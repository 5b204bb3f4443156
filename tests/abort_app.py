"""A two-phase app for the abort tests with real processes (tests/test_abort.py).

    working -DONE-> finishing -DONE-> done        (USER_ABORTED from anywhere -> canceled)

``working`` tells the test it is inside its phase (a byte on the pipe end named by
``FSM_ABORT_ENTERED_FD``), then waits until the test lets it go (end-of-file on
``FSM_ABORT_HOLD_FD``) and returns ``DONE`` whatever happened meanwhile: a phase that ignores
``ctx.cancelled``, the worst case for an abort. ``finishing`` appends ``finishing RUN`` to the
file named by ``FSM_ABORT_LOG``. The lease lasts 600 s and the heartbeat beats every 200 s, so
an abort reaches the holder only through the journal's refusal of its next commit, never through
its heartbeat within a test. ``FSM_ABORT_ASYNC`` makes ``working`` a coroutine (async runs).

Usage (from the repository root)::

    fsm-runner --journal J worker --app tests.abort_app:make_engine --max-runs 1
    python -m tests.abort_app run|arun JOURNAL RUN_ID

The second prints one JSON line with the run's state and status once the engine returns.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from fsm_runner import (
    Engine,
    MachineSpec,
    MemoryJournal,
    PhaseContext,
    RunEvent,
    State,
    Transition,
    open_journal,
)

DONE = "DONE"
SPEC = MachineSpec(
    "abort-app",
    [
        State("working", handler="working"),
        State("finishing", handler="finishing"),
        State("done", terminal=True),
        State("canceled", terminal=True, outcome="aborted"),
    ],
    [
        Transition("working", DONE, "finishing"),
        Transition("finishing", DONE, "done"),
        Transition("*", RunEvent.USER_ABORTED, "canceled"),
    ],
)


def _hold() -> None:
    os.write(int(os.environ["FSM_ABORT_ENTERED_FD"]), b".")
    hold = int(os.environ["FSM_ABORT_HOLD_FD"])
    while os.read(hold, 1):  # end-of-file: the test closed its end
        pass


def working(ctx: PhaseContext) -> str:
    """Signal, hold until the test lets go, then report DONE (ignoring any abort)."""
    _hold()
    return DONE


async def working_async(ctx: PhaseContext) -> str:
    """:func:`working` as a coroutine (the hold runs in a thread)."""
    await asyncio.get_running_loop().run_in_executor(None, _hold)
    return DONE


def finishing(ctx: PhaseContext) -> str:
    """Log and move on."""
    with open(os.environ["FSM_ABORT_LOG"], "a", encoding="utf-8") as log:
        log.write(f"finishing {ctx.run_id}\n")
    return DONE


def make_engine() -> Engine:
    """The app's engine (in memory; the CLI and :func:`main` give it their journal)."""
    run_working = working_async if os.environ.get("FSM_ABORT_ASYNC") else working
    return Engine(
        SPEC,
        handlers={"working": run_working, "finishing": finishing},
        journal=MemoryJournal(),
        lease_ttl=600.0,
        heartbeat_interval=200.0,
    )


def main(argv: list[str]) -> int:
    """``run|arun JOURNAL RUN_ID``: run the run to its end and print how it ended."""
    if len(argv) != 3 or argv[0] not in ("run", "arun"):
        print("usage: python -m tests.abort_app run|arun JOURNAL RUN_ID", file=sys.stderr)
        return 2
    how, location, run_id = argv
    journal = open_journal(location)
    engine = make_engine().with_journal(journal)
    try:
        run = engine.run(run_id) if how == "run" else asyncio.run(engine.arun(run_id))
    finally:
        engine.close()
        journal.close()
    print(json.dumps({"state": run.state, "status": run.status.value}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
