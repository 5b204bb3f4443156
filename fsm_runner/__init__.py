"""fsm_runner: run long, multi-phase jobs as explicit, durable finite-state machines.

Declare a :class:`MachineSpec`, attach phase handlers, and let an :class:`Engine` drive runs
through it; every transition is journaled (SQLite by default), so a run that crashed, was killed
or was stopped resumes from its last state without repeating a completed phase.
"""

from __future__ import annotations

from fsm_runner.engine import Engine, Listener, interrupt_on_sigterm
from fsm_runner.events import RunEvent, RunStatus
from fsm_runner.exceptions import (
    FsmRunnerError,
    InvalidTransitionError,
    JournalError,
    RunNotFoundError,
    RunTerminalError,
    SpecError,
)
from fsm_runner.journal import Journal, MemoryJournal, SqliteJournal, open_journal
from fsm_runner.phases import PhaseContext, PhaseHandler, PhaseResult
from fsm_runner.records import RunRecord, TransitionRecord
from fsm_runner.spec import (
    RETURN,
    WILDCARD,
    MachineSpec,
    Outcome,
    RetryPolicy,
    State,
    Transition,
)

__all__ = [
    "RETURN",
    "WILDCARD",
    "Engine",
    "FsmRunnerError",
    "InvalidTransitionError",
    "Journal",
    "JournalError",
    "Listener",
    "MachineSpec",
    "MemoryJournal",
    "Outcome",
    "PhaseContext",
    "PhaseHandler",
    "PhaseResult",
    "RetryPolicy",
    "RunEvent",
    "RunNotFoundError",
    "RunRecord",
    "RunStatus",
    "RunTerminalError",
    "SpecError",
    "SqliteJournal",
    "State",
    "Transition",
    "TransitionRecord",
    "interrupt_on_sigterm",
    "open_journal",
]

__version__ = "0.1.0"
