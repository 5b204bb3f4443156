"""A two-phase app for the multi-process lease tests (tests/test_race.py).

    working -DONE-> finishing -DONE-> done        (SYSTEM_ERROR from anywhere -> failed)

``working`` appends ``working RUN PID TOKEN`` to the file named by ``FSM_RACE_LOG``, performs one
effect through the ledger (``charge``: appends ``charge RUN PID`` when it really runs), then tells
the test it is inside its phase and waits until the test lets it go; ``finishing`` logs itself.
The test steers the processes through inherited pipe ends, named by file descriptor in the
environment (all optional):

- ``FSM_RACE_READY_FD``: a byte is written here once the engine is built, before the barrier;
- ``FSM_RACE_GO_FD``: the barrier; read until end-of-file (the test closes the other end);
- ``FSM_RACE_ENTERED_FD``: ``working`` writes a byte here once its effect is done;
- ``FSM_RACE_HOLD_FD``: ``working`` reads here until end-of-file before it returns;
- ``FSM_RACE_FINISHING_FD``: ``finishing`` writes a byte here once it is logged, then reads
  ``FSM_RACE_FINISHING_HOLD_FD`` until end-of-file (the test may SIGKILL it meanwhile).

``FSM_RACE_LEASE_TTL`` and ``FSM_RACE_HEARTBEAT`` set the engine's lease; with
``FSM_RACE_LATE_EFFECT`` set, ``working`` tries a second effect (``late``) after the hold.
``FSM_RACE_JOURNAL`` is the journal of ``make_engine``'s engine (the CLI gives its own).

Usage (from the repository root)::

    python -m tests.race_app resume RUN_ID
    fsm-runner --journal J.db resume RUN_ID --app tests.race_app:make_engine

The first prints one JSON line: ``{"outcome": "ran", ...}`` (exit 0) or the lease error it got
(``LeaseHeldError`` with owner and expiry, ``LeaseLostError`` with token; exit 4).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from fsm_runner import (
    Engine,
    MachineSpec,
    MemoryJournal,
    PhaseContext,
    PhaseResult,
    RunEvent,
    SqliteJournal,
    State,
    Transition,
)
from fsm_runner.effects import MUTATE
from fsm_runner.exceptions import LeaseHeldError, LeaseLostError

DONE = "DONE"
SPEC = MachineSpec(
    "race",
    [
        State("working", handler="working"),
        State("finishing", handler="finishing"),
        State("done", terminal=True),
        State("failed", terminal=True, outcome="failed"),
    ],
    [
        Transition("working", DONE, "finishing"),
        Transition("finishing", DONE, "done"),
        Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
    ],
)


def _log(*words: object) -> None:
    # One short O_APPEND write per line: lines from concurrent processes never interleave.
    with open(os.environ["FSM_RACE_LOG"], "a", encoding="utf-8") as log:
        log.write(" ".join(str(word) for word in words) + "\n")


def _signal(name: str) -> None:
    fd = os.environ.get(name)
    if fd is not None:
        os.write(int(fd), b".")


def _wait(name: str) -> None:
    fd = os.environ.get(name)
    if fd is not None:
        while os.read(int(fd), 1):  # end-of-file: the test closed its end
            pass


def _charge(run_id: str) -> dict[str, int]:
    _log("charge", run_id, os.getpid())
    return {"pid": os.getpid()}


def _late(run_id: str) -> None:
    _log("late", run_id, os.getpid())


def working(ctx: PhaseContext) -> PhaseResult:
    """Log, charge once (through the effects ledger), then hold until the test lets go."""
    _log("working", ctx.run_id, os.getpid(), ctx.run.lease_token)
    charged = ctx.effect("charge", _charge, ctx.run_id, kind=MUTATE)
    _signal("FSM_RACE_ENTERED_FD")
    _wait("FSM_RACE_HOLD_FD")
    if os.environ.get("FSM_RACE_LATE_EFFECT"):
        try:
            ctx.effect("late", _late, ctx.run_id, kind=MUTATE)
        except LeaseLostError:
            _log("late-refused", ctx.run_id, os.getpid(), ctx.run.lease_token)
            raise
    return PhaseResult(DONE, output={"charged_by": charged["pid"], "ran_in": os.getpid()})


def finishing(ctx: PhaseContext) -> str:
    """Log, tell the test it is inside (if asked to), hold (if asked to), and move on."""
    _log("finishing", ctx.run_id, os.getpid(), ctx.run.lease_token)
    _signal("FSM_RACE_FINISHING_FD")
    _wait("FSM_RACE_FINISHING_HOLD_FD")
    return DONE


HANDLERS = {"working": working, "finishing": finishing}


def make_engine() -> Engine:
    """The app's engine; waits at the barrier (if one is given) before it is handed out."""
    path = os.environ.get("FSM_RACE_JOURNAL")
    options: dict[str, Any] = {}
    if "FSM_RACE_LEASE_TTL" in os.environ:
        options["lease_ttl"] = float(os.environ["FSM_RACE_LEASE_TTL"])
    if "FSM_RACE_HEARTBEAT" in os.environ:
        options["heartbeat_interval"] = float(os.environ["FSM_RACE_HEARTBEAT"])
    engine = Engine(
        SPEC,
        handlers=HANDLERS,
        journal=SqliteJournal(path) if path else MemoryJournal(),
        **options,
    )
    _signal("FSM_RACE_READY_FD")
    _wait("FSM_RACE_GO_FD")
    return engine


def main(argv: list[str]) -> int:
    """``resume RUN_ID``: resume the run and print one JSON line saying how it went."""
    if len(argv) != 2 or argv[0] != "resume":
        print("usage: python -m tests.race_app resume RUN_ID", file=sys.stderr)
        return 2
    engine = make_engine()
    report: dict[str, Any] = {"worker": engine.worker_id, "pid": os.getpid()}
    code = 0
    try:
        run = engine.resume(argv[1])
        report.update(outcome="ran", state=run.state, seq=run.seq)
    except LeaseHeldError as exc:
        report.update(
            outcome="LeaseHeldError", owner=exc.owner, expires_at=exc.expires_at, message=str(exc)
        )
        code = 4
    except LeaseLostError as exc:
        report.update(outcome="LeaseLostError", token=exc.token, message=str(exc))
        code = 4
    finally:
        engine.close()
        engine.journal.close()
    print(json.dumps(report), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
