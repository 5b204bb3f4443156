"""fsm_runner: run long, multi-phase jobs as explicit, durable finite-state machines.

Declare a :class:`MachineSpec`, attach phase handlers, and let an :class:`Engine` drive runs
through it; every transition is journaled (SQLite by default), so a run that crashed, was killed
or was stopped resumes from its last state without repeating a completed phase.
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:  # the names, for type checkers; at run time they load on first use
    from fsm_runner.engine import Engine, Listener, interrupt_on_sigterm
    from fsm_runner.events import PhaseStatus, RunEvent
    from fsm_runner.exceptions import (
        FsmRunnerError,
        InvalidTransitionError,
        JournalError,
        RunNotFoundError,
        RunTerminalError,
        SpecError,
    )
    from fsm_runner.journal import (
        Journal,
        MemoryJournal,
        PruneReport,
        SqliteJournal,
        open_journal,
    )
    from fsm_runner.journal.postgres import (
        PostgresJournal as PostgresJournal,  # optional: not in __all__ (see _OPTIONAL)
    )
    from fsm_runner.phases import PhaseContext, PhaseHandler, PhaseResult
    from fsm_runner.records import (
        ArtifactRecord,
        EffectRecord,
        EffectStatus,
        ErrorType,
        IterationRecord,
        RunRecord,
        TransitionRecord,
        structure,
        unstructure,
    )
    from fsm_runner.spec import (
        RETURN,
        WILDCARD,
        MachineSpec,
        RetryPolicy,
        RunOutcome,
        State,
        Transition,
    )

__all__ = [
    "RETURN",
    "WILDCARD",
    "ArtifactRecord",
    "EffectRecord",
    "EffectStatus",
    "Engine",
    "ErrorType",
    "FsmRunnerError",
    "InvalidTransitionError",
    "IterationRecord",
    "Journal",
    "JournalError",
    "Listener",
    "MachineSpec",
    "MemoryJournal",
    "PhaseContext",
    "PhaseHandler",
    "PhaseResult",
    "PhaseStatus",
    "PruneReport",
    "RetryPolicy",
    "RunEvent",
    "RunNotFoundError",
    "RunOutcome",
    "RunRecord",
    "RunTerminalError",
    "SpecError",
    "SqliteJournal",
    "State",
    "Transition",
    "TransitionRecord",
    "interrupt_on_sigterm",
    "open_journal",
    "structure",
    "unstructure",
]

__version__ = "0.1.0"

#: Public names left out of ``__all__`` because they need an optional extra: ``from fsm_runner
#: import *`` must work on a default install. ``from fsm_runner import PostgresJournal`` works
#: wherever ``fsm-runner[postgres]`` is installed.
_OPTIONAL = frozenset({"PostgresJournal"})

#: Where each public name lives: importing ``fsm_runner`` (as the CLI does) stays cheap, and a
#: name's module is imported the first time the name is used.
_EXPORTS: dict[str, str] = {
    "ArtifactRecord": "fsm_runner.records",
    "EffectRecord": "fsm_runner.records",
    "EffectStatus": "fsm_runner.records",
    "ErrorType": "fsm_runner.records",
    "Engine": "fsm_runner.engine",
    "FsmRunnerError": "fsm_runner.exceptions",
    "InvalidTransitionError": "fsm_runner.exceptions",
    "IterationRecord": "fsm_runner.records",
    "Journal": "fsm_runner.journal",
    "JournalError": "fsm_runner.exceptions",
    "Listener": "fsm_runner.engine",
    "MachineSpec": "fsm_runner.spec",
    "MemoryJournal": "fsm_runner.journal",
    "RunOutcome": "fsm_runner.spec",
    "PhaseContext": "fsm_runner.phases",
    "PhaseHandler": "fsm_runner.phases",
    "PhaseResult": "fsm_runner.phases",
    "PostgresJournal": "fsm_runner.journal",
    "PruneReport": "fsm_runner.journal",
    "RETURN": "fsm_runner.spec",
    "RetryPolicy": "fsm_runner.spec",
    "RunEvent": "fsm_runner.events",
    "RunNotFoundError": "fsm_runner.exceptions",
    "RunRecord": "fsm_runner.records",
    "PhaseStatus": "fsm_runner.events",
    "RunTerminalError": "fsm_runner.exceptions",
    "SpecError": "fsm_runner.exceptions",
    "SqliteJournal": "fsm_runner.journal",
    "State": "fsm_runner.spec",
    "Transition": "fsm_runner.spec",
    "TransitionRecord": "fsm_runner.records",
    "WILDCARD": "fsm_runner.spec",
    "interrupt_on_sigterm": "fsm_runner.engine",
    "open_journal": "fsm_runner.journal",
    "structure": "fsm_runner.records",
    "unstructure": "fsm_runner.records",
}


#: Old names kept working for a while: ``Outcome`` said nothing of whose outcome (a run's end,
#: now :class:`RunOutcome`), and ``RunStatus`` was a phase's result, not a run's (now
#: :class:`PhaseStatus`). Using one warns (DeprecationWarning) and gives the new class itself.
_DEPRECATED: dict[str, str] = {"Outcome": "RunOutcome", "RunStatus": "PhaseStatus"}


def __getattr__(name: str) -> typing.Any:
    if name in _DEPRECATED:
        return _deprecated(__name__, name, _DEPRECATED[name], __getattr__(_DEPRECATED[name]))
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsm_runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def _deprecated(module: str, old: str, new: str, value: typing.Any) -> typing.Any:
    import warnings  # noqa: PLC0415 - only on the deprecated path

    warnings.warn(
        f"{module}.{old} is deprecated; use {new} (the same class)",
        DeprecationWarning,
        stacklevel=3,
    )
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
