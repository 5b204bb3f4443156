"""The worker app of the durable-waits process tests (``tests/test_waits_processes.py``).

    preparing -PREPARED-> awaiting -APPROVE-> applying -APPLIED-> done
                             |  -REJECT-> preparing
                             '-TIMEOUT-> expiring -EXPIRED-> expired

``awaiting`` is a waiting state: its wait's timeout is ``FSM_WAITS_TIMEOUT`` seconds (``none``:
it waits for a signal for ever), its ``on_timeout`` the ``TIMEOUT`` event. Each phase handler
appends ``PHASE RUN PID TOKEN`` to the file ``FSM_WAITS_LOG`` (one short ``O_APPEND`` write a
line: lines of concurrent processes never interleave) when it starts, so the test counts the
executions of each phase of each run, by process and lease token.

A worker is ``python -m tests.waits_app work JOURNAL`` (a SQLite file, or a PostgreSQL URL with
``?schema=``): it logs ``up PID``, then ``Engine.work(idle_wait=FSM_WAITS_IDLE)`` until SIGTERM.
``FSM_WAITS_LEASE_TTL`` and ``FSM_WAITS_HEARTBEAT`` set its lease (seconds). The CLI's worker
runs it too: ``fsm-runner --journal JOURNAL worker --app tests.waits_app:make_engine`` (without
the ``waking`` hold below, which needs the journal this module opens).

``FSM_WAITS_HOLD`` makes the FIRST of all the workers (whichever creates the marker file
``FSM_WAITS_DIR/held``, ``O_EXCL``) stop for the test, which then SIGKILLs it or lets it go:

- ``waking``: the worker that has claimed a due run and is about to journal its ``TIMEOUT``
  logs ``waking RUN PID TOKEN`` and hangs inside the journal's ``commit``, before writing;
- ``expiring``: the first ``expiring`` phase (after the ``TIMEOUT``) logs, then hangs;
- ``preparing``: the first ``preparing`` phase logs, then waits until the file
  ``FSM_WAITS_DIR/open`` exists (signals sent meanwhile find the run held, not yet waiting).

A hang lasts at most ``HANG_FOR`` seconds (then the phase raises: a test that forgot to let go
fails instead of hanging).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fsm_runner import (
    Engine,
    MachineSpec,
    PhaseContext,
    RunEvent,
    SqliteJournal,
    State,
    Transition,
    Wait,
)
from fsm_runner.records import RunRecord, TransitionRecord

MACHINE = "waits-proc"
#: Seconds a held worker hangs before giving up.
HANG_FOR = 120.0


def spec(timeout: float | None) -> MachineSpec:
    """The app's machine, its wait timing out after ``timeout`` seconds (``None``: never)."""
    return MachineSpec(
        MACHINE,
        [
            State("preparing", handler="preparing"),
            State("awaiting", wait=Wait(timeout=timeout, prompt="apply it?")),
            State("applying", handler="applying"),
            State("expiring", handler="expiring"),
            State("done", terminal=True),
            State("expired", terminal=True, outcome="aborted"),
            State("failed", terminal=True, outcome="failed"),
        ],
        [
            Transition("preparing", "PREPARED", "awaiting"),
            Transition("awaiting", "APPROVE", "applying"),
            Transition("awaiting", "REJECT", "preparing"),
            Transition("awaiting", "TIMEOUT", "expiring"),
            Transition("applying", "APPLIED", "done"),
            Transition("expiring", "EXPIRED", "expired"),
            Transition("*", RunEvent.SYSTEM_ERROR, "failed"),
        ],
    )


def timeout_from_env() -> float | None:
    """``FSM_WAITS_TIMEOUT``: seconds, or ``none``."""
    text = os.environ.get("FSM_WAITS_TIMEOUT", "none")
    return None if text == "none" else float(text)


def log(*words: object) -> None:
    """Append one line to ``FSM_WAITS_LOG`` (one ``O_APPEND`` write)."""
    line = (" ".join(str(word) for word in words) + "\n").encode()
    fd = os.open(os.environ["FSM_WAITS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _first_to_hold(where: str) -> bool:
    """Whether this is the hold ``where`` asked for, first of all processes (``O_EXCL``)."""
    if os.environ.get("FSM_WAITS_HOLD") != where:
        return False
    try:
        os.close(os.open(Path(os.environ["FSM_WAITS_DIR"], "held"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def _hang(until: Path | None = None) -> None:
    """Wait until ``until`` exists (never, without one), or give up after ``HANG_FOR``."""
    deadline = time.monotonic() + HANG_FOR
    while until is None or not until.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the test never let this worker go")
        time.sleep(0.02)


def _phase(ctx: PhaseContext) -> None:
    log(ctx.run.state, ctx.run_id, os.getpid(), ctx.run.lease_token)


def preparing(ctx: PhaseContext) -> str:
    """Log; the first one held (``FSM_WAITS_HOLD=preparing``) waits for the test's go."""
    _phase(ctx)
    if _first_to_hold("preparing"):
        log("held", ctx.run_id, os.getpid(), ctx.run.lease_token)
        _hang(Path(os.environ["FSM_WAITS_DIR"], "open"))
    return "PREPARED"


def applying(ctx: PhaseContext) -> str:
    """Log and move on."""
    _phase(ctx)
    return "APPLIED"


def expiring(ctx: PhaseContext) -> str:
    """Log; the first one held (``FSM_WAITS_HOLD=expiring``) hangs until it is killed."""
    _phase(ctx)
    if _first_to_hold("expiring"):
        log("held", ctx.run_id, os.getpid(), ctx.run.lease_token)
        _hang()
    return "EXPIRED"


HANDLERS = {"preparing": preparing, "applying": applying, "expiring": expiring}


def _holding(journal_class: type[Any]) -> type[Any]:
    """``journal_class`` whose first ``TIMEOUT`` commit hangs (``FSM_WAITS_HOLD=waking``)."""

    class Holding(journal_class):  # type: ignore[misc,valid-type]
        def commit(self, run: RunRecord, transition: TransitionRecord, *args: Any, **kw: Any):
            if transition.event == "TIMEOUT" and _first_to_hold("waking"):
                log("waking", run.run_id, os.getpid(), run.lease_token)
                _hang()
            return super().commit(run, transition, *args, **kw)

    return Holding


def open_worker_journal(location: str) -> Any:
    """The journal at ``location`` (a SQLite path or a PostgreSQL URL), able to hold."""
    if location.startswith(("postgresql://", "postgres://")):
        from fsm_runner.journal.postgres import PostgresJournal

        return _holding(PostgresJournal)(location)
    return _holding(SqliteJournal)(location)


def make_engine(journal: Any) -> Engine:
    """The app's engine on ``journal``, leased as the environment says; logs ``up PID``."""
    options: dict[str, Any] = {}
    if "FSM_WAITS_LEASE_TTL" in os.environ:
        options["lease_ttl"] = float(os.environ["FSM_WAITS_LEASE_TTL"])
    if "FSM_WAITS_HEARTBEAT" in os.environ:
        options["heartbeat_interval"] = float(os.environ["FSM_WAITS_HEARTBEAT"])
    engine = Engine(spec(timeout_from_env()), handlers=HANDLERS, journal=journal, **options)
    log("up", os.getpid())
    return engine


def work(location: str) -> int:
    """Be a worker on the journal at ``location`` until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    journal = open_worker_journal(location)
    engine = make_engine(journal)
    try:
        engine.work(stop=stop, idle_wait=float(os.environ.get("FSM_WAITS_IDLE", "0.2")))
    finally:
        engine.close()
        journal.close()
    return 0


def main(argv: list[str]) -> int:
    """``work JOURNAL``."""
    if len(argv) != 2 or argv[0] != "work":
        print("usage: python -m tests.waits_app work JOURNAL", file=sys.stderr)
        return 2
    return work(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
