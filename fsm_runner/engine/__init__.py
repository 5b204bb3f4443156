"""The engine: drives runs through a machine, one journaled transition per step.

Per step the engine takes the run's row, calls the handler of its state, asks the compiled
machine where the handler's event leads (guards read the run), and commits the transition and
the new run row in one journal transaction. A crash anywhere leaves the run at its last
committed state; :meth:`Engine.resume` continues from there, so no completed phase runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import os
import signal
import socket
import threading
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from fsm_runner._group import GroupCommitter
from fsm_runner._json import dumps_json, error_info, storable_text
from fsm_runner.engine.decisions import (
    PhaseOutcome,
    PhaseStep,
    handled_error,
    json_size,
    phase_outcome,
    retry_wait,
)
from fsm_runner.engine.leases import LeaseKeeper, new_worker_id, unleased
from fsm_runner.engine.reducer import (
    StepKind,
    abort_records,
    advance_plain,
    artifact_rows,
    iteration_rows,
    take,
    writes_iterations,
)
from fsm_runner.events import RunEvent, event_name
from fsm_runner.exceptions import (
    FsmRunnerError,
    HandlerResultError,
    InvalidTransitionError,
    LeaseHeldError,
    PayloadError,
    PhaseError,
    PhaseTimeoutError,
    RunAbortedError,
    RunConflictError,
    RunTerminalError,
    SpecError,
    SpecMismatchError,
)
from fsm_runner.journal import Journal, SqliteJournal
from fsm_runner.journal.base import Commit
from fsm_runner.machine import Guard, compile_spec
from fsm_runner.phases import (
    PhaseContext,
    PhaseHandler,
    PhaseResult,
    split_handler,
)
from fsm_runner.records import (
    ArtifactRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    positional_builder,
    utc_now,
)
from fsm_runner.spec import RETURN, MachineSpec, RunOutcome

__all__ = ["Engine", "Listener", "abort_run", "fork_run", "interrupt_on_sigterm"]

#: Called with each transition after it is committed, and the run row it produced.
Listener = Callable[[TransitionRecord, RunRecord], None]

_log = logging.getLogger("fsm_runner.engine")
_SYSTEM_ERROR = RunEvent.SYSTEM_ERROR.value
_TIMEOUT = RunEvent.TIMEOUT.value
_USER_ABORTED = RunEvent.USER_ABORTED.value
_RETRIED = RunEvent.RETRIED.value
_INTERRUPTED = RunEvent.INTERRUPTED.value
_REWOUND = RunEvent.REWOUND.value
_DEAD_LETTERED = RunEvent.DEAD_LETTERED.value
_SPEC_CHANGED = RunEvent.SPEC_CHANGED.value
_MAX_ABORT_TRIES = 20
#: Seconds the short lease of an abort from outside any engine lasts.
_ABORT_LEASE_TTL = 30.0
# The hot path's record constructors: every field, positionally (see positional_builder).
_new_commit = positional_builder(Commit)
# What handlers return most; checked before the much slower inspect.isawaitable.
_PLAIN_RETURNS = (str, PhaseResult, enum.Enum)


def _error_info(exc: BaseException) -> dict[str, Any]:
    # storable whatever the exception: its __str__ may raise, its text hold a lone surrogate
    return error_info(exc)


class _HandlerTimeoutError(Exception):
    """Carries a ``TimeoutError`` the handler raised itself past ``asyncio.wait_for``."""

    def __init__(self, error: TimeoutError) -> None:
        self.error = error


async def _own_timeouts(awaitable: Awaitable[Any]) -> Any:
    try:
        return await awaitable
    except TimeoutError as exc:
        raise _HandlerTimeoutError(exc) from exc


#: A transition about to be committed: the transition, the run row it leads to, and the
#: iterations and artifacts written with it (a plain tuple: built on the hot path).
_Planned = tuple[TransitionRecord, RunRecord, Sequence[IterationRecord], Sequence[ArtifactRecord]]


class Engine:
    """Runs machines durably: start runs, step them, run them to the end, resume, abort.

    Args:
        spec: the machine every run of this engine follows.
        handlers: phase handlers by the names the spec's states give.
        journal: where runs are journaled, and the caller's to close. When not given, the
            engine opens its own :class:`SqliteJournal` at ``fsm-runner.db`` in the current
            directory (creating it; ``repr(engine)`` shows its absolute path) and closes it in
            :meth:`close`.
        guards: guard functions by name; each reads the run and returns a bool.
        services: the host's services, handed to every handler through ``ctx.services``.
        listeners: called with each transition after it is committed (errors are logged).
        clock: a monotonic clock in seconds, for deadlines and durations.
        sleep: how to wait between retries in sync runs.
        async_sleep: how to wait between retries in async runs.
        allow_spec_change: resume runs that started under another spec, as long as their
            current state exists in this one.
        worker_id: who this engine is when it holds leases (default: host, pid and a random
            part, unique per engine).
        lease_ttl: seconds a lease lasts unless renewed; a worker that dies holding one blocks
            its run for at most this long.
        heartbeat_interval: seconds between lease renewals while runs are held (default: a
            third of ``lease_ttl``). The heartbeat also picks up abort requests from elsewhere.
        max_recoveries: how often :meth:`recover` takes over a run whose worker was lost
            before parking it as ``dead_letter``.
        max_payload_bytes: the largest JSON payload (a run's input or context, a phase's
            output, context update, iteration update, artifacts or error), in UTF-8 bytes of
            its compact JSON, the engine journals; a larger one is refused before anything is
            written (a handler's: as a :class:`HandlerResultError`, journaled as
            ``SYSTEM_ERROR``), as is one that is not standard JSON (NaN or Infinity, nesting
            deeper than 255 levels, a lone surrogate).
        group_commit: in async runs (:meth:`arun`), commit the transitions of all runs whose
            phases ended in the same turn of the event loop in one journal transaction; each
            run still waits for its own transition to be durable before its next phase.

    Raises:
        SpecError: the spec is invalid, or names handlers or guards that are not given.
    """

    def __init__(
        self,
        spec: MachineSpec,
        /,
        *,
        handlers: Mapping[str, PhaseHandler],
        journal: Journal | None = None,
        guards: Mapping[str, Guard] | None = None,
        services: Mapping[str, Any] | None = None,
        listeners: Iterable[Listener] = (),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        allow_spec_change: bool = False,
        worker_id: str | None = None,
        lease_ttl: float = 30.0,
        heartbeat_interval: float | None = None,
        max_recoveries: int = 3,
        max_payload_bytes: int = 16 * 1024 * 1024,
        group_commit: bool = True,
    ) -> None:
        if lease_ttl <= 0:
            raise ValueError(f"lease_ttl must be positive, not {lease_ttl!r}")
        self.spec = spec
        self.handlers = dict(handlers)
        self.guards = dict(guards or {})
        spec.validate(handlers=self.handlers, guards=self.guards)
        try:
            self._handlers = {name: split_handler(h) for name, h in self.handlers.items()}
        except TypeError as exc:
            raise SpecError([str(exc)], machine=spec.name) from None
        self._machine = compile_spec(spec)
        # No journal given: the engine's own, at ./fsm-runner.db, which close() closes.
        self._owns_journal = journal is None
        self.journal: Journal = journal if journal is not None else SqliteJournal()
        self.services: Mapping[str, Any] = types.MappingProxyType(dict(services or {}))
        self.listeners = list(listeners)
        self.clock = clock
        self.sleep = sleep
        self.async_sleep = async_sleep
        self.allow_spec_change = allow_spec_change
        self._spec_json = spec.to_json()
        self._active: dict[str, PhaseContext] = {}  # runs whose phase runs in this process
        self._by_state = {
            state.name: self._handlers[state.handler] for state in spec.leaves if state.handler
        }
        self._states = {state.name: state for state in spec.leaves}
        # States whose handler is a plain callable with no validate() and no timeout: their
        # step takes the inlined hot path (_step_fast in sync runs, arun's loop in async ones).
        self._fast = {
            name: run_fn
            for name, (run_fn, validate_fn) in self._by_state.items()
            if validate_fn is None and self._states[name].timeout is None
        }
        self._plain_edges = self._machine.plain_edges
        self._returning = spec.returning_states
        self._logger_names = {
            state.name: f"fsm_runner.phase.{spec.name}.{state.name}" for state in spec.leaves
        }
        self._aborts: dict[str, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.worker_id = worker_id or new_worker_id()
        self.lease_ttl = lease_ttl
        self.heartbeat_interval = heartbeat_interval or lease_ttl / 3
        self.max_recoveries = max_recoveries
        self.max_payload_bytes = max_payload_bytes
        self.group_commit = group_commit
        self._committer: GroupCommitter | None = None
        self._leases = LeaseKeeper(self)
        # One lock for the leases held and for what the heartbeat shares with the steps.
        self._lock = self._leases.lock

    def __repr__(self) -> str:
        """``Engine('spec-name', journal=SqliteJournal('/abs/fsm-runner.db', ...))``.

        The journal is shown whether it was passed or is the engine's own default, so where
        runs go is never a guess.
        """
        return f"Engine({self.spec.name!r}, journal={self.journal!r})"

    def with_journal(self, journal: Journal) -> Engine:
        """Return an engine like this one that journals to ``journal``."""
        return Engine(
            self.spec,
            handlers=self.handlers,
            journal=journal,
            guards=self.guards,
            services=self.services,
            listeners=self.listeners,
            clock=self.clock,
            sleep=self.sleep,
            async_sleep=self.async_sleep,
            allow_spec_change=self.allow_spec_change,
            worker_id=self.worker_id,
            lease_ttl=self.lease_ttl,
            heartbeat_interval=self.heartbeat_interval,
            max_recoveries=self.max_recoveries,
            max_payload_bytes=self.max_payload_bytes,
            group_commit=self.group_commit,
        )

    def close(self) -> None:
        """Stop the heartbeat and close the event loop of async handlers in sync runs.

        A journal passed to the engine is the host's to close; the default one the engine
        opened itself (no ``journal`` given) is closed here, after everything else.
        """
        self._leases.stop()
        self._committer = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self._owns_journal:
            self.journal.close()

    # -- leases --------------------------------------------------------------------------------

    def _adopt_spec(self, run: RunRecord) -> RunRecord:
        """Move a run that started under another spec to this one (``allow_spec_change``).

        A ``SPEC_CHANGED`` self transition of the same visit records the switch, and the run
        row names the new spec from then on, so replay follows the run through both.
        """
        if run.spec_hash == self.spec.spec_hash:
            return run
        transition, after = _advance(
            self.spec,
            run,
            _SPEC_CHANGED,
            run.state,
            result={"output": {"from_spec": run.spec_hash, "to_spec": self.spec.spec_hash}},
            duration_ms=0.0,
            kind="spec_change",  # the row names the new spec from here on
        )
        self.journal.commit(after, transition, spec_json=self._spec_json)
        self._notify(transition, after)
        return after

    def work(
        self,
        *,
        max_runs: int | None = None,
        stop: threading.Event | None = None,
        idle_wait: float = 0.5,
        exit_when_idle: bool = False,
    ) -> int:
        """Be a worker: claim runnable runs of this machine one at a time and run each.

        Runnable runs are those waiting in a state with a handler and not held by a live
        lease: new runs, runs a clean stop left, and runs whose worker died (their lease
        expired; taking one over counts in its ``recoveries``, and past ``max_recoveries`` it
        is parked as ``dead_letter`` instead of run). Any number of workers, in threads or
        processes, may share one journal: claiming is one transaction, and fencing refuses a
        worker whose lease was taken over. A run whose phase raises an error the spec has no
        transition for keeps its lease until it expires, so it is retried after a back-off
        (and eventually parked), never in a hot loop.

        Args:
            max_runs: stop after this many runs.
            stop: stop when this event is set (checked between runs and while idle).
            idle_wait: seconds to wait when no run is runnable before looking again.
            exit_when_idle: return as soon as no run is runnable.

        Returns:
            How many runs this worker took.
        """
        return self._leases.work(
            max_runs=max_runs,
            stop=stop or threading.Event(),
            idle_wait=idle_wait,
            exit_when_idle=exit_when_idle,
        )

    def recover(self, *, limit: int | None = None) -> list[RunRecord]:
        """Take over this machine's runs whose lease expired (their worker is gone) and run them.

        Each takeover counts in the run's ``recoveries``; a run taken over more than
        ``max_recoveries`` times is not run again but parked with status ``dead_letter`` and
        the reason (a ``DEAD_LETTERED`` transition), so a run that kills its worker is not
        retried forever. Runs another worker claims first, and runs under another spec, are
        left alone.

        Args:
            limit: recover at most this many runs.

        Returns:
            The recovered runs as they ended up (parked ones included).
        """
        return self._leases.recover(limit=limit)

    def _park(self, run: RunRecord) -> RunRecord:
        message = (
            f"its worker was lost {run.recoveries} times (more than max_recoveries="
            f"{self.max_recoveries}); fork it to try again"
        )
        return self._write(self._plan_in_place(run, _DEAD_LETTERED, message, kind="park"))[1]

    # -- starting ------------------------------------------------------------------------------

    def start(
        self,
        input: Any = None,  # noqa: A002 - "input" is the name users know from the design
        *,
        run_id: str | None = None,
        context: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
    ) -> str:
        """Start a run in the initial state and journal its transition seq 0.

        Args:
            input: the run's JSON input, readable by every phase as ``ctx.input``.
            run_id: the run's id; a new random one when not given.
            context: the run's initial JSON context.
            parent_run_id: the run that starts this one, if any.

        Returns:
            The run's id.

        Raises:
            RunExistsError: a run with ``run_id`` exists.
            PayloadError: the run id is not text the journal can store, or the input or
                context is not standard JSON (not serialisable, NaN or Infinity, nested more
                than 255 levels, a lone surrogate) or is over ``max_payload_bytes``; nothing
                was written.
            JournalError: the journal failed; nothing was written.
        """
        initial = self.spec.state(self.spec.initial_leaf)
        run_id = run_id or uuid.uuid4().hex
        if not run_id.isascii():  # SQL journals store it as text: UTF-8 must hold it
            self._check_json(storable_text(run_id), "run id", run_id)
        now = utc_now()
        iteration = 1 if initial.starts_iteration else 0
        run = RunRecord(
            run_id=run_id,
            machine=self.spec.name,
            spec_hash=self.spec.spec_hash,
            state=initial.name,
            input=input,
            context=dict(context or {}),
            iteration=iteration,
            created_at=now,
            updated_at=now,
            parent_run_id=parent_run_id,
        )
        first = TransitionRecord(
            run_id=run_id,
            seq=0,
            from_state=None,
            event=RunEvent.STARTED.value,
            to_state=initial.name,
            iteration=iteration,
            at=now,
            # the journal alone reproduces the run row (invariant 8), initial context included
            result={"context": dict(run.context)} if run.context else None,
        )
        self._check_json(run_id, "input", input)
        self._check_json(run_id, "context", run.context)
        opened = (
            [IterationRecord(run_id, 1, state=initial.name, started_at=now)] if iteration else []
        )
        self.journal.create_run(run, first, spec_json=self._spec_json, iterations=opened)
        self._notify(first, run)
        return run_id

    # -- the sync loop -------------------------------------------------------------------------

    def step(self, run_id: str) -> TransitionRecord | None:
        """Run the current state's phase once and journal where it led.

        Returns:
            The committed transition, or ``None`` when the state has no handler (it waits for
            :meth:`send`).

        Raises:
            RunNotFoundError: no such run.
            RunTerminalError: the run has ended.
            SpecMismatchError: the run started under another spec (see ``allow_spec_change``).
            InvalidTransitionError: the handler's event is not allowed in the state; nothing
                was written and the phase runs again on resume.
            PhaseError: the phase failed and the spec has no transition for that failure.
            RunConflictError: another writer advanced the run while the phase ran.
        """
        run = self._leases.claim(run_id)
        try:
            try:
                return self._step(run)[0]
            except RunConflictError:
                run = self.journal.load(run_id)
                if run.ended or run.abort_reason is None:
                    raise
                # An abort was requested while the phase ran: the journal refused the phase's
                # outcome, and this step carries the abort out instead.
                return self._commit_abort(run, run.abort_reason)[0]
        finally:
            self._leases.let_go(run_id)

    def run(self, run_id: str, *, max_steps: int | None = None) -> RunRecord:
        """Step the run until it ends, waits for an event, or ``max_steps`` steps were taken.

        The engine holds the run's lease meanwhile (renewed by a heartbeat) and releases it
        when it returns, whatever the reason.

        Returns:
            The run as it stands at the end.

        Raises:
            LeaseHeldError: another worker holds the run's live lease; nothing was written.
            LeaseLostError: the lease expired and was taken over while a phase ran; this engine
                wrote nothing after that.
            The errors of :meth:`step`; when another writer ended the run meanwhile (an abort
            from another process), the ended run is returned instead.
        """
        if max_steps == 0:  # nothing to do: not even the lease is taken
            run = self.journal.load(run_id)
            self._check_runnable(run)
            return run
        run = self._leases.claim(run_id)
        try:
            run = self._drive(run, max_steps)
        finally:
            self._leases.let_go(run_id)
        return unleased(run)

    def _drive(self, run: RunRecord, max_steps: int | None) -> RunRecord:
        steps = 0
        while (max_steps is None or steps < max_steps) and not run.ended:
            try:
                transition, after = self._step(run)
            except RunConflictError:
                run = self.journal.load(run.run_id)
                if run.ended:
                    return run
                if run.abort_reason is None:
                    raise
                continue  # refused for an abort requested meanwhile: the next step carries it out
            if transition is None:
                break
            run = after
            steps += 1
        return run

    def resume(
        self, run_id: str, *, max_steps: int | None = None, from_state: str | None = None
    ) -> RunRecord:
        """Continue a run from its journaled state (the run row is read; history is not).

        Args:
            run_id: the run.
            max_steps: stop after this many steps.
            from_state: continue from this earlier state instead (see :meth:`rewind`).

        Raises:
            RunTerminalError: the run has ended; fork it instead.
            SpecMismatchError: the run started under another spec.
            InvalidTransitionError: ``from_state`` is not a state the run can be rewound to.
        """
        if from_state is not None:
            self.rewind(run_id, from_state)
        return self.run(run_id, max_steps=max_steps)

    def rewind(self, run_id: str, state: str) -> RunRecord:
        """Move an active run back to ``state``, a state it was in before: a ``REWOUND`` transition.

        The phase of ``state`` runs again on the next step, as a new visit (entering a
        ``starts_iteration`` state starts a new iteration). Nothing journaled is removed: the
        transition records where the run was rewound from.

        Args:
            run_id: the run.
            state: a non-terminal state the run has been in (a composite: its first sub-phase).

        Returns:
            The run after the rewind.

        Raises:
            RunTerminalError: the run has ended; fork it at an earlier seq instead.
            InvalidTransitionError: ``state`` is not in the spec, is terminal, or the run has
                never been in it; nothing was written.
        """
        self._rewind_target(self.journal.load(run_id), state)  # refused before the lease
        return self._commit_held(
            run_id,
            _REWOUND,
            "rewind",
            lambda run: self._rewind_target(run, state),
            lambda run: {"output": {"rewound_from": run.state}},
        )

    def _commit_held(
        self,
        run_id: str,
        event: str,
        kind: StepKind,
        dest: Callable[[RunRecord], str],
        result: Callable[[RunRecord], Mapping[str, Any] | None],
    ) -> RunRecord:
        """Claim the run, commit one transition decided on the claimed row, and release it."""
        run = self._leases.claim(run_id)
        try:
            planned = self._plan(
                run, event, dest(run), result=result(run), duration_ms=0.0, kind=kind
            )
            run = self._write(planned)[1]
        finally:
            self._leases.let_go(run_id)
        return unleased(run)

    def _rewind_target(self, run: RunRecord, state: str) -> str:
        """The leaf ``run`` can be rewound to for ``state``, or InvalidTransitionError."""
        run_id = run.run_id
        self._check_runnable(run)
        if not self.spec.has_state(state):
            reason = f"not possible: machine {self.spec.name!r} has no state {state!r},"
            raise InvalidTransitionError(
                run_id=run_id, state=run.state, event=_REWOUND, reason=reason
            )
        leaf = self.spec.entry_leaf(state) if self.spec.state(state).composite else state
        if self.spec.state(leaf).terminal:
            raise InvalidTransitionError(
                run_id=run_id,
                state=run.state,
                event=_REWOUND,
                reason=f"not possible: {state!r} is a terminal state,",
            )
        if not any(t.to_state == leaf for t in self.journal.transitions(run_id)):
            raise InvalidTransitionError(
                run_id=run_id,
                state=run.state,
                event=_REWOUND,
                reason=f"not possible: the run has never been in {leaf!r},",
            )
        return leaf

    def fork(
        self, run_id: str, *, at_seq: int | None = None, new_run_id: str | None = None
    ) -> RunRecord:
        """Fork a run: see :func:`fork_run`. The fork runs under this engine if its spec matches."""
        return fork_run(self.journal, run_id, at_seq=at_seq, new_run_id=new_run_id)

    def _step(self, run: RunRecord) -> tuple[TransitionRecord | None, RunRecord]:
        # The caller has checked the run is runnable: either loaded and checked, or the row
        # this engine just committed (same spec, not ended).
        run_id = run.run_id
        pending_abort = self._aborts.get(run_id) or run.abort_reason
        if pending_abort is not None:
            return self._commit_abort(run, pending_abort)
        fast = self._fast.get(run.state)
        if fast is not None:
            return self._step_fast(run, fast)
        step = self._prepare(run)
        if step is None:
            return None, run
        try:
            outcome = self._call_sync(step)
        except KeyboardInterrupt as exc:
            self._journal_interruption(run, exc)
            raise
        finally:
            self._finished(run_id)
        return self._settle(step, outcome)

    def _step_fast(
        self, run: RunRecord, handler: Callable[[PhaseContext], Any]
    ) -> tuple[TransitionRecord, RunRecord]:
        """The hot path: a plain sync handler in a state without timeout or validate().

        What :meth:`_prepare`, :meth:`_call_sync`, :meth:`_outcome` and :meth:`_finish` do,
        inlined for a handler returning a bare event outside iterations (~3 µs a step less);
        anything else continues on the general path with the value the handler returned.
        """
        run_id = run.run_id
        ctx = PhaseContext(
            run,
            self.services,
            self.clock,
            None,
            None,
            self._logger_names[run.state],
            self.journal,
            self._states[run.state],
        )
        self._active[run_id] = ctx
        started = self.clock()
        try:
            value = handler(ctx)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            self._finished(run_id)
            step = PhaseStep(run, self._states[run.state], ctx, started)
            return self._settle(step, self._outcome(step, None, exc))
        except KeyboardInterrupt as exc:
            self._finished(run_id)
            self._journal_interruption(run, exc)
            raise
        except BaseException:
            self._finished(run_id)  # SystemExit and the like: not journaled, but the phase is over
            raise
        if type(value) is str and not run.iteration:
            dest = self._plain_edges.get((run.state, value))
            if dest is not None:
                self._finished(run_id)
                return self._commit_plain(run, value, dest, (self.clock() - started) * 1000.0)
        step = PhaseStep(run, self._states[run.state], ctx, started)
        try:
            if not isinstance(value, _PLAIN_RETURNS):
                value = self._await_sync(value, step)
            outcome = self._outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            outcome = self._outcome(step, None, exc)
        finally:
            self._finished(run_id)
        return self._settle(step, outcome)

    def _journal_interruption(self, run: RunRecord, exc: BaseException) -> None:
        """Journal INTERRUPTED as a self transition; the run stays resumable.

        The phase that was interrupted runs again, as its next attempt, when the run resumes.
        """
        message = f"interrupted {_interruption_cause(exc)} in {run.state!r}"
        try:
            try:
                self._write(self._plan_in_place(run, _INTERRUPTED, message, kind="interruption"))
            except RunConflictError as refused:
                if refused.abort_reason is None:
                    raise
                # An abort was requested while the phase ran: it is carried out instead.
                self._commit_abort(self.journal.load(run.run_id), refused.abort_reason)
        except FsmRunnerError:
            # Journaling is best effort here: the run is still at its last committed state,
            # and resuming runs the phase again either way.
            _log.exception("could not journal the interruption of run %s", run.run_id)

    def _settle(self, step: PhaseStep, outcome: PhaseOutcome) -> tuple[TransitionRecord, RunRecord]:
        """Journal a phase's outcome, or a retry of it (then wait before the next attempt)."""
        wait = retry_wait(step, outcome)
        if wait is None:
            return self._finish(step, outcome)
        committed = self._commit_retry(step, outcome)
        self.sleep(wait)
        return committed

    def _call_sync(self, step: PhaseStep) -> PhaseOutcome:
        run_fn, validate_fn = self._by_state[step.state.name]
        try:
            value = None
            if validate_fn is not None:
                value = self._await_sync(validate_fn(step.ctx), step)
            if value is None:
                value = run_fn(step.ctx)
                if not isinstance(value, _PLAIN_RETURNS):
                    value = self._await_sync(value, step)
            return self._outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - every handler failure is journaled, not raised
            return self._outcome(step, None, exc)

    def _await_sync(self, value: Any, step: PhaseStep) -> Any:
        if isinstance(value, _PLAIN_RETURNS) or not inspect.isawaitable(value):
            return value
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self._with_deadline(value, step))

    # -- the async loop ------------------------------------------------------------------------

    async def astep(self, run_id: str) -> TransitionRecord | None:
        """Async :meth:`step`: async handlers are awaited (and cancelled at their deadline)."""
        run = self._leases.claim(run_id)
        try:
            try:
                return (await self._astep(run))[0]
            except RunConflictError:
                run = self.journal.load(run_id)
                if run.ended or run.abort_reason is None:
                    raise
                return (await self._awrite(self._plan_abort(run, run.abort_reason)))[0]
        finally:
            self._leases.let_go(run_id)

    async def arun(  # noqa: PLR0912, PLR0915 - the hot path is inlined (see below)
        self, run_id: str, *, max_steps: int | None = None
    ) -> RunRecord:
        """Async :meth:`run`.

        The hot path — a state in ``_fast`` (no timeout, no validate()) whose handler returns
        a bare event outside iterations — is written out in the loop, what :meth:`_step_fast`
        does for sync runs: a helper coroutine per step cost its creation, a level in every
        resumption and one more object for the garbage collector while the run waits for its
        group commit (~9 % of the Python per step). Any other outcome of such a handler is
        settled by :meth:`_afinish_fast`; other states take :meth:`_astep`.
        """
        run = await self._leases.aclaim(run_id)
        try:
            steps = 0
            fast_states = self._fast
            plain_edges = self._plain_edges
            aborts = self._aborts
            clock = self.clock
            committer = self._group_committer()
            transition: TransitionRecord | None
            while (max_steps is None or steps < max_steps) and not run.ended:
                try:
                    handler = fast_states.get(run.state)
                    if handler is None or run.abort_reason is not None or run_id in aborts:
                        transition, after = await self._astep(run)
                    else:
                        ctx = PhaseContext(
                            run,
                            self.services,
                            clock,
                            None,
                            None,
                            self._logger_names[run.state],
                            self.journal,
                            self._states[run.state],
                        )
                        self._active[run_id] = ctx
                        started = clock()
                        try:
                            value = handler(ctx)
                            if type(value) is types.CoroutineType or (
                                not isinstance(value, _PLAIN_RETURNS) and inspect.isawaitable(value)
                            ):
                                value = await value
                        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
                            self._finished(run_id)
                            transition, after = await self._afinish_fast(
                                run, ctx, started, None, exc
                            )
                        except (KeyboardInterrupt, asyncio.CancelledError) as exc:
                            self._finished(run_id)
                            self._journal_interruption(run, exc)
                            raise
                        except BaseException:
                            self._finished(run_id)
                            raise
                        else:
                            self._finished(run_id)
                            dest = None
                            if type(value) is str and not run.iteration:
                                dest = plain_edges.get((run.state, value))
                            if dest is None:
                                transition, after = await self._afinish_fast(
                                    run, ctx, started, value, None
                                )
                            else:
                                del ctx  # not kept alive (and tracked by the GC) while it waits
                                planned = self._plan_plain(
                                    run, value, dest, (clock() - started) * 1000.0
                                )
                                transition, after, iterations, _ = planned
                                if committer is None or iterations:
                                    transition, after = await self._awrite(planned)
                                else:
                                    commit = _new_commit(after, transition, (), (), None)
                                    await committer.submit(commit)
                                    transition, after = self._committed(transition, after)
                except RunConflictError:
                    run = self.journal.load(run_id)
                    if run.ended:
                        return run
                    if run.abort_reason is None:
                        raise
                    continue  # refused for an abort requested meanwhile: carried out next
                if transition is None:
                    break
                run = after
                steps += 1
        finally:
            self._leases.let_go(run_id)
        return unleased(run)

    async def aresume(
        self, run_id: str, *, max_steps: int | None = None, from_state: str | None = None
    ) -> RunRecord:
        """Async :meth:`resume`."""
        if from_state is not None:
            self.rewind(run_id, from_state)
        return await self.arun(run_id, max_steps=max_steps)

    async def _astep(self, run: RunRecord) -> tuple[TransitionRecord | None, RunRecord]:
        pending_abort = self._aborts.get(run.run_id) or run.abort_reason
        if pending_abort is not None:
            return await self._awrite(self._plan_abort(run, pending_abort))
        step = self._prepare(run)
        if step is None:
            return None, run
        try:
            outcome = await self._call_async(step)
        except (KeyboardInterrupt, asyncio.CancelledError) as exc:
            self._journal_interruption(run, exc)
            raise
        finally:
            self._release(run.run_id)
        return await self._asettle(step, outcome)

    async def _afinish_fast(
        self,
        run: RunRecord,
        ctx: PhaseContext,
        started: float,
        value: Any,
        error: Exception | None,
    ) -> tuple[TransitionRecord, RunRecord]:
        """Settle a phase of :meth:`arun`'s hot path that did not end in a bare event.

        ``value`` is what its handler returned, or ``error`` what it raised.
        """
        step = PhaseStep(run, self._states[run.state], ctx, started)
        try:
            outcome = self._outcome(step, value, error)
        except Exception as exc:  # noqa: BLE001 - journaled like any handler failure
            outcome = self._outcome(step, None, exc)
        return await self._asettle(step, outcome)

    async def _asettle(
        self, step: PhaseStep, outcome: PhaseOutcome
    ) -> tuple[TransitionRecord, RunRecord]:
        """Async :meth:`_settle`."""
        wait = retry_wait(step, outcome)
        if wait is None:
            return await self._awrite(self._decide(step, outcome))
        committed = await self._awrite(self._plan_retry(step, outcome))
        await self.async_sleep(wait)
        return committed

    async def _call_async(self, step: PhaseStep) -> PhaseOutcome:
        run_fn, validate_fn = self._by_state[step.state.name]
        try:
            value = None
            if validate_fn is not None:
                value = validate_fn(step.ctx)
                if inspect.isawaitable(value):
                    value = await self._with_deadline(value, step)
            if value is None:
                value = run_fn(step.ctx)
                if inspect.isawaitable(value):
                    value = await self._with_deadline(value, step)
            return self._outcome(step, value, None)
        except Exception as exc:  # noqa: BLE001 - every handler failure is journaled, not raised
            return self._outcome(step, None, exc)

    async def _with_deadline(self, awaitable: Awaitable[Any], step: PhaseStep) -> Any:
        remaining = step.ctx.remaining
        if remaining is None:
            return await awaitable
        try:
            return await asyncio.wait_for(_own_timeouts(awaitable), timeout=max(remaining, 0.0))
        except _HandlerTimeoutError as own:
            raise own.error from None  # the handler's own TimeoutError, not the deadline's
        except asyncio.TimeoutError:
            raise PhaseTimeoutError(state=step.state.name, timeout=step.state.timeout) from None

    # -- external events and abort -------------------------------------------------------------

    def send(self, run_id: str, event: Any, *, output: Any = None) -> RunRecord:
        """Journal an external event for the run (e.g. an approval for a waiting state).

        Raises:
            InvalidTransitionError: the run's state does not allow the event, or the event is
                not a str or a str enum; nothing changed.
            RunTerminalError: the run has ended.
            PayloadError: the output is not JSON the journal stores; nothing changed.
        """
        try:
            name = event_name(event)
        except TypeError:
            state = self.journal.load(run_id).state
            raise InvalidTransitionError(
                run_id=run_id,
                state=state,
                event=repr(event),
                reason=f"not a str or a str enum ({type(event).__name__})",
            ) from None
        self._check_json(run_id, "output", output)
        run = self.journal.load(run_id)
        self._check_runnable(run)
        # Refused before the lease is taken: a refused event changes nothing at all.
        self._machine.resolve(run.state, name, run, self.guards, run_id=run_id)
        return self._commit_held(
            run_id,
            name,
            "transition",
            lambda run: self._machine.resolve(run.state, name, run, self.guards, run_id=run_id),
            lambda _run: {"output": output} if output is not None else None,
        )

    def abort(self, run_id: str, reason: str) -> RunRecord:
        """Abort a run from any non-terminal state; nothing journaled is removed.

        A run this engine is advancing is told through ``ctx.cancelled`` and ends aborted in the
        state whose phase was running; a run another worker holds (a live lease) gets the
        request journaled, and that worker carries it out at its next step (the journal refuses
        any other transition of the run from then on; its heartbeat tells the phase in
        progress); a run nobody holds is moved at once.

        Returns:
            The run after the abort (or with the abort requested, if a worker holds it).

        Raises:
            RunTerminalError: the run has already ended.
        """
        reason = storable_text(reason)  # a lone surrogate (an argv byte that is not UTF-8)
        with self._lock:
            held = self._leases.holds(run_id)
            if held:
                self._aborts[run_id] = reason
                ctx = self._active.get(run_id)
                if ctx is not None:
                    ctx.request_cancel(reason)
        if held:
            return self.journal.request_abort(run_id, reason)
        return abort_run(
            self.journal,
            run_id,
            reason,
            spec=self.spec,
            guards=self.guards,
            owner=self.worker_id,
            _notify=self._notify,
        )

    def _commit_abort(self, run: RunRecord, reason: str) -> tuple[TransitionRecord, RunRecord]:
        return self._write(self._plan_abort(run, reason))

    def _plan_abort(self, run: RunRecord, reason: str) -> _Planned:
        transition, after = abort_records(self.spec, run, reason, self.guards, at=utc_now())
        return transition, after, (), ()

    # -- shared step machinery -----------------------------------------------------------------

    def _check_runnable(self, run: RunRecord, *, check_spec: bool = True) -> None:
        if run.ended:
            raise RunTerminalError(run_id=run.run_id, state=run.state, status=run.status.value)
        if check_spec and run.spec_hash != self.spec.spec_hash:
            if not self.allow_spec_change:
                raise SpecMismatchError(
                    run_id=run.run_id, expected=run.spec_hash, found=self.spec.spec_hash
                )
            if not self.spec.has_state(run.state):
                raise SpecMismatchError(
                    run_id=run.run_id,
                    expected=run.spec_hash,
                    found=self.spec.spec_hash,
                    detail=f" which has no state {run.state!r}",
                )

    def _prepare(self, run: RunRecord) -> PhaseStep | None:
        state = self.spec.state(run.state)
        if state.handler is None:
            return None
        started = self.clock()
        timeout = state.timeout
        ctx = PhaseContext(
            run,
            self.services,
            self.clock,
            None if timeout is None else started + timeout,
            timeout,
            self._logger_names[state.name],
            self.journal,
            state,
        )
        self._active[run.run_id] = ctx
        return PhaseStep(run, state, ctx, started)

    def _release(self, run_id: str) -> None:
        self._finished(run_id)

    def _finished(self, run_id: str) -> None:
        """The phase has returned: forget it, and refuse its effects from now on."""
        ctx = self._active.pop(run_id, None)
        if ctx is not None:
            ctx.close()

    def _outcome(self, step: PhaseStep, value: Any, error: BaseException | None) -> PhaseOutcome:
        return phase_outcome(
            self.spec,
            step,
            value,
            error,
            clock=self.clock,
            max_payload_bytes=self.max_payload_bytes,
        )

    def _commit_retry(
        self, step: PhaseStep, outcome: PhaseOutcome
    ) -> tuple[TransitionRecord, RunRecord]:
        return self._write(self._plan_retry(step, outcome))

    def _plan_retry(self, step: PhaseStep, outcome: PhaseOutcome) -> _Planned:
        assert outcome.error is not None
        error = _error_info(outcome.error)
        return self._plan(
            step.run,
            _RETRIED,
            step.state.name,
            result={"error": error},
            duration_ms=outcome.duration_ms,
            kind="retry",
        )

    def _finish(self, step: PhaseStep, outcome: PhaseOutcome) -> tuple[TransitionRecord, RunRecord]:
        return self._write(self._decide(step, outcome))

    def _decide(self, step: PhaseStep, outcome: PhaseOutcome) -> _Planned:
        """The transition a phase's outcome leads to, and what to write with it (not written)."""
        run = step.run
        if isinstance(outcome.error, RunAbortedError):
            return self._plan_abort(run, outcome.error.reason)
        if outcome.error is not None:
            error = _error_info(outcome.error)
            event = _TIMEOUT if isinstance(outcome.error, PhaseTimeoutError) else _SYSTEM_ERROR
            if event == _TIMEOUT and not self._machine.allows(run.state, _TIMEOUT):
                event = _SYSTEM_ERROR
            if not self._machine.allows(run.state, event):
                if isinstance(outcome.error, HandlerResultError):
                    raise outcome.error
                raise PhaseError(run_id=run.run_id, state=run.state, event=event, error=error)
            dest = self._machine.resolve(run.state, event, run, self.guards, run_id=run.run_id)
            return self._plan(
                run, event, dest, result={"error": error}, duration_ms=outcome.duration_ms
            )
        result = outcome.result
        assert result is not None
        guarded = run
        if result.context:
            guarded = attrs.evolve(run, context={**run.context, **result.context})
        dest, reason = self._machine.resolve_edge(
            run.state, result.event, guarded, self.guards, run_id=run.run_id
        )
        if (
            result.output is None
            and not result.context
            and result.error is None
            and not reason
            and not result.iteration
            and not result.artifacts
            and run.iteration == 0
            and dest != RETURN
        ):
            return self._plan_plain(run, result.event, dest, outcome.duration_ms)
        payload: dict[str, Any] = {}
        if result.output is not None:
            payload["output"] = result.output
        if result.context:
            payload["context"] = dict(result.context)
        if result.error is not None:
            payload["error"] = handled_error(result.event, result.error)
        if reason:  # the run's error too, where the phase gave none (the reducer's rule)
            payload["reason"] = reason
        return self._plan(
            run,
            result.event,
            dest,
            result=payload or None,
            duration_ms=outcome.duration_ms,
            iteration_updates=result.iteration,
            artifacts=result.artifacts,
        )

    def _write(self, planned: _Planned) -> tuple[TransitionRecord, RunRecord]:
        """Commit a planned transition, then tell the listeners."""
        transition, after, iterations, artifacts = planned
        if iterations or artifacts:
            self.journal.commit(after, transition, iterations=iterations, artifacts=artifacts)
        else:
            self.journal.commit(after, transition)
        return self._committed(transition, after)

    async def _awrite(self, planned: _Planned) -> tuple[TransitionRecord, RunRecord]:
        """Commit a planned transition with other runs' in one transaction (group commit).

        Returns once the transaction is durable, so the run's next phase cannot start before.
        """
        committer = self._group_committer()
        if committer is None:
            return self._write(planned)
        transition, after, iterations, artifacts = planned
        await committer.submit(_new_commit(after, transition, iterations, artifacts, None))
        return self._committed(transition, after)

    def _group_committer(self) -> GroupCommitter | None:
        """The running event loop's group committer, or ``None`` without group commit."""
        if not self.group_commit:
            return None
        loop = asyncio.get_running_loop()
        committer = self._committer
        if committer is None or committer.loop is not loop:
            committer = self._committer = GroupCommitter(self.journal, loop)
        return committer

    def _committed(
        self, transition: TransitionRecord, after: RunRecord
    ) -> tuple[TransitionRecord, RunRecord]:
        if after.status is not RunOutcome.ACTIVE or transition.event == _USER_ABORTED:
            with self._lock:
                self._aborts.pop(after.run_id, None)
        if self.listeners:
            self._notify(transition, after)
        return transition, after

    def _plan_in_place(
        self, run: RunRecord, event: str, message: str, *, kind: StepKind
    ) -> _Planned:
        """A self transition that records why (``event`` as the error's type) and no phase."""
        error = {"type": event, "message": message}
        return self._plan(
            run, event, run.state, result={"error": error}, duration_ms=0.0, kind=kind
        )

    def _plan(
        self,
        run: RunRecord,
        event: str,
        dest: str,
        *,
        result: Mapping[str, Any] | None,
        duration_ms: float,
        kind: StepKind = "transition",
        iteration_updates: Mapping[str, Any] | None = None,
        artifacts: Sequence[ArtifactRecord] = (),
    ) -> _Planned:
        """Build the transition, the run row it leads to and the rows written with it."""
        transition, after = _advance(
            self.spec, run, event, dest, result=result, duration_ms=duration_ms, kind=kind
        )
        iterations: Sequence[IterationRecord] = ()
        if writes_iterations(run, after, event, iteration_updates):
            current = (
                self.journal.iteration(run.run_id, run.iteration) if run.iteration > 0 else None
            )
            iterations = iteration_rows(run, after, transition, iteration_updates or {}, current)
        if artifacts:
            artifacts = artifact_rows(artifacts, transition, after)
        return transition, after, iterations, artifacts

    def _commit_plain(
        self, run: RunRecord, event: str, dest: str, duration_ms: float
    ) -> tuple[TransitionRecord, RunRecord]:
        """Commit a bare event outside iterations (the sync hot path)."""
        planned = self._plan_plain(run, event, dest, duration_ms)
        transition, after, iterations, _ = planned
        if iterations:
            return self._write(planned)
        self.journal.commit(after, transition)
        if after.status is not RunOutcome.ACTIVE:
            self._aborts.pop(after.run_id, None)
        if self.listeners:
            self._notify(transition, after)
        return transition, after

    def _plan_plain(self, run: RunRecord, event: str, dest: str, duration_ms: float) -> _Planned:
        """Plan a bare event outside iterations: the reducer's plain step where it applies.

        Positional calls only; keyword arguments cost on every step.
        """
        dest_state = self._states[dest]
        if (
            run.iteration
            or dest_state.starts_iteration
            or run.return_to is not None
            or dest in self._returning
        ):
            return self._plan(run, event, dest, result=None, duration_ms=duration_ms)
        transition, after = advance_plain(
            run, event, dest, dest_state.final_outcome, duration_ms, utc_now()
        )
        return transition, after, (), ()

    def _notify(self, transition: TransitionRecord, run: RunRecord) -> None:
        for listener in self.listeners:
            try:
                listener(transition, run)
            except Exception:  # noqa: BLE001, PERF203 - a listener must never undo a committed step
                _log.exception(
                    "listener %r failed on %s seq %s", listener, run.run_id, transition.seq
                )

    def _check_json(self, run_id: str, what: str, value: Any) -> None:
        if value is None:
            return
        try:
            size = json_size(dumps_json(value))
        except ValueError as exc:
            raise PayloadError(run_id=run_id, what=what, detail=str(exc)) from None
        if size > self.max_payload_bytes:
            raise PayloadError(
                run_id=run_id,
                what=what,
                detail=f"is {size:,} bytes as JSON, more than max_payload_bytes="
                f"{self.max_payload_bytes:,}",
            )


def _advance(
    spec: MachineSpec,
    run: RunRecord,
    event: str,
    dest: str,
    *,
    result: Mapping[str, Any] | None,
    duration_ms: float,
    kind: StepKind = "transition",
) -> tuple[TransitionRecord, RunRecord]:
    """The reducer's :func:`~fsm_runner.engine.reducer.take`, at the time it is now."""
    return take(
        spec, run, event, dest, result=result, duration_ms=duration_ms, at=utc_now(), kind=kind
    )


def abort_run(
    journal: Journal,
    run_id: str,
    reason: str,
    *,
    spec: MachineSpec | None = None,
    guards: Mapping[str, Guard] | None = None,
    owner: str | None = None,
    _notify: Listener | None = None,
) -> RunRecord:
    """Abort a run that no engine in this process is advancing (operators, the CLI).

    When no worker holds the run, it is moved at once under a short lease of ``owner``'s: it
    follows its spec's ``USER_ABORTED`` transition or, where its state has none, stops where it
    is with status ``aborted``. When a worker holds a live lease on it, the request is
    journaled (``abort_reason`` shows it meanwhile) and that worker carries it out at its next
    step: from then on the journal refuses every other transition of the run, so the phase in
    progress is told through ``ctx.cancelled`` (by the holder's heartbeat) and whatever it
    returns, the run ends aborted in the state that phase ran in. The spec is read from the
    journal unless ``spec`` is the one the run started with. Nothing journaled is removed.

    Returns:
        The run after the abort, or with the abort requested (and a holder, ``lease_owner``).

    Raises:
        RunNotFoundError: no such run.
        RunTerminalError: the run has already ended.
        RunConflictError: other writers kept advancing the run; try again.
    """
    owner = owner or f"abort:{socket.gethostname()}:{os.getpid()}"
    reason = storable_text(reason)  # a lone surrogate (an argv byte that is not UTF-8)
    for _ in range(_MAX_ABORT_TRIES):
        run = journal.load(run_id)
        if run.ended:
            raise RunTerminalError(run_id=run.run_id, state=run.state, status=run.status.value)
        try:
            run = journal.claim(run_id, owner, ttl=_ABORT_LEASE_TTL)
        except LeaseHeldError:
            requested = journal.request_abort(run_id, reason)  # its holder carries it out
            if requested.lease_owner is not None:
                return requested
            continue  # its holder let go meanwhile: nobody would carry it out, so move it here
        try:
            run_spec = spec
            if run_spec is None or run_spec.spec_hash != run.spec_hash:
                run_spec = MachineSpec.from_json(journal.spec_json(run.spec_hash))
            transition, after = abort_records(run_spec, run, reason, guards, at=utc_now())
            try:
                journal.commit(after, transition)
            except RunConflictError:
                continue  # another writer moved it meanwhile; look again
        finally:
            journal.release(run_id, owner, run.lease_token)
        if _notify is not None:
            _notify(transition, after)
        return unleased(after)
    raise RunConflictError(run_id=run_id, expected_seq=-1, path=journal.location)


def fork_run(
    journal: Journal, run_id: str, *, at_seq: int | None = None, new_run_id: str | None = None
) -> RunRecord:
    """Start a new run whose history is ``run_id``'s up to ``at_seq``; the original is untouched.

    The fork's row is the original's as it stood at ``at_seq`` (replayed from the journal, so
    no host app is needed), with ``forked_from`` set to ``"RUN@SEQ"``; its transitions
    0..``at_seq``, the iteration records up to its iteration, the artifacts committed by then
    and the effects of visits that had ended are copied. The phase of the state it stands in
    runs on its next step (resume it with the app's engine). A run that ended can be forked
    at any seq before its end.

    Args:
        journal: the journal holding the run.
        run_id: the run to fork.
        at_seq: the last seq to keep; the run's last seq when not given (an active run only).
        new_run_id: the fork's id; a new random one when not given.

    Returns:
        The fork's run row.

    Raises:
        RunNotFoundError: no such run.
        RunExistsError: a run with ``new_run_id`` exists.
        ValueError: there is no ``at_seq`` in the run, or the run had ended by then.
        ReplayMismatchError: the run's journal does not replay through its spec.
    """
    from fsm_runner.replay import journal_specs, state_at  # noqa: PLC0415

    source = journal.load(run_id)
    seq = source.seq if at_seq is None else at_seq
    if not 0 <= seq <= source.seq:
        raise ValueError(f"run {run_id} has seqs 0..{source.seq}; there is no seq {seq}")
    specs = journal_specs(journal)
    # The whole timeline: a spec change after ``at_seq`` tells which spec the run was under.
    timeline = journal.transitions(run_id)
    then = state_at(specs(source.spec_hash), source, timeline, seq, specs=specs)
    if then.ended:
        raise ValueError(
            f"run {run_id} had ended at seq {seq} (state {then.state!r}); fork it at an earlier seq"
        )
    fork = attrs.evolve(
        then,
        run_id=new_run_id or uuid.uuid4().hex,
        forked_from=f"{run_id}@{seq}",
        parent_run_id=None,
        abort_reason=None,
        lease_owner=None,
        lease_expires_at=None,
        lease_token=0,
        recoveries=0,
        created_at=utc_now(),
    )
    journal.fork_run(fork, source_run_id=run_id, at_seq=seq)
    return journal.load(fork.run_id)


def _interruption_cause(exc: BaseException) -> str:
    """``by SIGTERM`` for :func:`interrupt_on_sigterm`'s interruption, else ``(ExceptionType)``."""
    text = str(exc) if isinstance(exc, KeyboardInterrupt) else ""
    if text.startswith(_SIGNAL_PREFIX):
        return f"by {text.removeprefix(_SIGNAL_PREFIX)}"
    return f"({type(exc).__name__})"


#: How :func:`interrupt_on_sigterm`'s ``KeyboardInterrupt`` names the signal: ``signal SIGTERM``.
_SIGNAL_PREFIX = "signal "


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM interrupts like Ctrl-C (``KeyboardInterrupt``).

    So a run that is stopped by its supervisor (systemd, Kubernetes, a shell's ``kill``)
    journals ``INTERRUPTED`` and stays resumable, exactly as after Ctrl-C. Only in the main
    thread (where Python delivers signals); elsewhere the block changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"{_SIGNAL_PREFIX}{signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
