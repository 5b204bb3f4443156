"""fsm_runner: run long, multi-phase jobs as explicit, durable finite-state machines.

Declare a :class:`MachineSpec`, attach phase handlers, and let an :class:`Engine` drive runs
through it; every transition is journaled (SQLite by default), so a run that crashed, was killed
or was stopped resumes from its last state without repeating a completed phase.
"""

from __future__ import annotations

import importlib
import typing

# What type checkers see: one import a name, ``X as X`` so that it is re-exported (a type checker
# cannot read the ``__all__`` built below). At run time nothing here is imported: the names load
# on first use from _EXPORTS, which lists them with the same modules (a test checks they agree).
if typing.TYPE_CHECKING:
    from fsm_runner.engine import Engine as Engine
    from fsm_runner.engine import Listener as Listener
    from fsm_runner.engine import interrupt_on_sigterm as interrupt_on_sigterm
    from fsm_runner.events import PhaseStatus as PhaseStatus
    from fsm_runner.events import RunEvent as RunEvent
    from fsm_runner.exceptions import AmbiguousRunIdError as AmbiguousRunIdError
    from fsm_runner.exceptions import CapabilityError as CapabilityError
    from fsm_runner.exceptions import DiagramError as DiagramError
    from fsm_runner.exceptions import EffectFailedError as EffectFailedError
    from fsm_runner.exceptions import EffectMismatchError as EffectMismatchError
    from fsm_runner.exceptions import EffectOutcomeUnknownError as EffectOutcomeUnknownError
    from fsm_runner.exceptions import FsmRunnerError as FsmRunnerError
    from fsm_runner.exceptions import HandlerResultError as HandlerResultError
    from fsm_runner.exceptions import InvalidRunIdError as InvalidRunIdError
    from fsm_runner.exceptions import InvalidTransitionError as InvalidTransitionError
    from fsm_runner.exceptions import JournalError as JournalError
    from fsm_runner.exceptions import JournalNotFoundError as JournalNotFoundError
    from fsm_runner.exceptions import LeaseError as LeaseError
    from fsm_runner.exceptions import LeaseHeldError as LeaseHeldError
    from fsm_runner.exceptions import LeaseLostError as LeaseLostError
    from fsm_runner.exceptions import PayloadError as PayloadError
    from fsm_runner.exceptions import PhaseError as PhaseError
    from fsm_runner.exceptions import PhaseTimeoutError as PhaseTimeoutError
    from fsm_runner.exceptions import ReplayMismatchError as ReplayMismatchError
    from fsm_runner.exceptions import RunAbortedError as RunAbortedError
    from fsm_runner.exceptions import RunConflictError as RunConflictError
    from fsm_runner.exceptions import RunExistsError as RunExistsError
    from fsm_runner.exceptions import RunNotFoundError as RunNotFoundError
    from fsm_runner.exceptions import RunTerminalError as RunTerminalError
    from fsm_runner.exceptions import SchemaVersionError as SchemaVersionError
    from fsm_runner.exceptions import SpecError as SpecError
    from fsm_runner.exceptions import SpecMismatchError as SpecMismatchError
    from fsm_runner.exceptions import SupervisorError as SupervisorError
    from fsm_runner.exceptions import WaitTimeoutError as WaitTimeoutError
    from fsm_runner.journal import Journal as Journal
    from fsm_runner.journal import MemoryJournal as MemoryJournal
    from fsm_runner.journal import PostgresJournal as PostgresJournal
    from fsm_runner.journal import PruneReport as PruneReport
    from fsm_runner.journal import SqliteJournal as SqliteJournal
    from fsm_runner.journal import open_journal as open_journal
    from fsm_runner.phases import PhaseContext as PhaseContext
    from fsm_runner.phases import PhaseHandler as PhaseHandler
    from fsm_runner.phases import PhaseResult as PhaseResult
    from fsm_runner.records import ArtifactRecord as ArtifactRecord
    from fsm_runner.records import EffectRecord as EffectRecord
    from fsm_runner.records import EffectStatus as EffectStatus
    from fsm_runner.records import ErrorType as ErrorType
    from fsm_runner.records import IterationRecord as IterationRecord
    from fsm_runner.records import RunRecord as RunRecord
    from fsm_runner.records import SignalRecord as SignalRecord
    from fsm_runner.records import SignalStatus as SignalStatus
    from fsm_runner.records import TransitionRecord as TransitionRecord
    from fsm_runner.records import structure as structure
    from fsm_runner.records import unstructure as unstructure
    from fsm_runner.run_ids import check_run_id as check_run_id
    from fsm_runner.spec import RETURN as RETURN
    from fsm_runner.spec import WILDCARD as WILDCARD
    from fsm_runner.spec import MachineSpec as MachineSpec
    from fsm_runner.spec import RetryPolicy as RetryPolicy
    from fsm_runner.spec import RunLifecycle as RunLifecycle
    from fsm_runner.spec import State as State
    from fsm_runner.spec import Transition as Transition
    from fsm_runner.spec import Wait as Wait

__version__ = "0.1.0"

#: The one export list: every public name and the module it lives in, sorted as ruff sorts an
#: ``__all__``. ``__all__`` is made from it, and :func:`__getattr__` imports a name's module the
#: first time the name is used, so importing ``fsm_runner`` (as the CLI does) stays cheap and the
#: sync resume path imports no asyncio, sqlite-utils, psycopg or click. Every public exception
#: of :mod:`fsm_runner.exceptions` is here.
_EXPORTS: dict[str, str] = {
    "RETURN": "fsm_runner.spec",
    "WILDCARD": "fsm_runner.spec",
    "AmbiguousRunIdError": "fsm_runner.exceptions",
    "ArtifactRecord": "fsm_runner.records",
    "CapabilityError": "fsm_runner.exceptions",
    "DiagramError": "fsm_runner.exceptions",
    "EffectFailedError": "fsm_runner.exceptions",
    "EffectMismatchError": "fsm_runner.exceptions",
    "EffectOutcomeUnknownError": "fsm_runner.exceptions",
    "EffectRecord": "fsm_runner.records",
    "EffectStatus": "fsm_runner.records",
    "Engine": "fsm_runner.engine",
    "ErrorType": "fsm_runner.records",
    "FsmRunnerError": "fsm_runner.exceptions",
    "HandlerResultError": "fsm_runner.exceptions",
    "InvalidRunIdError": "fsm_runner.exceptions",
    "InvalidTransitionError": "fsm_runner.exceptions",
    "IterationRecord": "fsm_runner.records",
    "Journal": "fsm_runner.journal",
    "JournalError": "fsm_runner.exceptions",
    "JournalNotFoundError": "fsm_runner.exceptions",
    "LeaseError": "fsm_runner.exceptions",
    "LeaseHeldError": "fsm_runner.exceptions",
    "LeaseLostError": "fsm_runner.exceptions",
    "Listener": "fsm_runner.engine",
    "MachineSpec": "fsm_runner.spec",
    "MemoryJournal": "fsm_runner.journal",
    "PayloadError": "fsm_runner.exceptions",
    "PhaseContext": "fsm_runner.phases",
    "PhaseError": "fsm_runner.exceptions",
    "PhaseHandler": "fsm_runner.phases",
    "PhaseResult": "fsm_runner.phases",
    "PhaseStatus": "fsm_runner.events",
    "PhaseTimeoutError": "fsm_runner.exceptions",
    "PostgresJournal": "fsm_runner.journal",
    "PruneReport": "fsm_runner.journal",
    "ReplayMismatchError": "fsm_runner.exceptions",
    "RetryPolicy": "fsm_runner.spec",
    "RunAbortedError": "fsm_runner.exceptions",
    "RunConflictError": "fsm_runner.exceptions",
    "RunEvent": "fsm_runner.events",
    "RunExistsError": "fsm_runner.exceptions",
    "RunLifecycle": "fsm_runner.spec",
    "RunNotFoundError": "fsm_runner.exceptions",
    "RunRecord": "fsm_runner.records",
    "RunTerminalError": "fsm_runner.exceptions",
    "SchemaVersionError": "fsm_runner.exceptions",
    "SignalRecord": "fsm_runner.records",
    "SignalStatus": "fsm_runner.records",
    "SpecError": "fsm_runner.exceptions",
    "SpecMismatchError": "fsm_runner.exceptions",
    "SqliteJournal": "fsm_runner.journal",
    "State": "fsm_runner.spec",
    "SupervisorError": "fsm_runner.exceptions",
    "Transition": "fsm_runner.spec",
    "TransitionRecord": "fsm_runner.records",
    "Wait": "fsm_runner.spec",
    "WaitTimeoutError": "fsm_runner.exceptions",
    "check_run_id": "fsm_runner.run_ids",
    "interrupt_on_sigterm": "fsm_runner.engine",
    "open_journal": "fsm_runner.journal",
    "structure": "fsm_runner.records",
    "unstructure": "fsm_runner.records",
}

#: Public names left out of ``__all__`` because they need an optional extra: ``from fsm_runner
#: import *`` must work on a default install. ``from fsm_runner import PostgresJournal`` works
#: wherever ``fsm-runner[postgres]`` is installed.
_OPTIONAL = frozenset({"PostgresJournal"})

__all__ = [name for name in _EXPORTS if name not in _OPTIONAL]

#: Old names kept working for a while: ``Outcome`` and then ``RunOutcome`` named a run's
#: lifecycle status (``active``, how it ended, ``dead_letter``) as if it were only its end (now
#: :class:`RunLifecycle`), and ``RunStatus`` was a phase's result, not a run's (now
#: :class:`PhaseStatus`). Using one warns (DeprecationWarning) and gives the new class itself.
_DEPRECATED: dict[str, str] = {
    "Outcome": "RunLifecycle",
    "RunOutcome": "RunLifecycle",
    "RunStatus": "PhaseStatus",
}


def __getattr__(name: str) -> typing.Any:
    if name in _DEPRECATED:
        from fsm_runner._deprecation import deprecated  # noqa: PLC0415 - only when used

        return deprecated(__name__, name, _DEPRECATED[name], __getattr__(_DEPRECATED[name]))
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsm_runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
