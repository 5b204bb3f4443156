"""What every step shares: the engine's state, planning a transition, and committing it.

:class:`StepWriter` is the base of the engine's two drivers (:mod:`.sync_driver`,
:mod:`.async_driver`) and of the :class:`~fsm_runner.engine.Engine` façade. It turns a phase's
outcome into the transition it leads to (:meth:`StepWriter._decide`, with the pure reducer
and decisions), plans the rows written with it (``_plan*``: not written yet), and commits
them, alone (:meth:`StepWriter._write`) or with other async runs' in one transaction
(:meth:`StepWriter._awrite`, the group committer), then tells the listeners.

The drivers are mixins over this one object rather than objects of their own: their hot paths
read the engine's state with one attribute lookup on ``self``, exactly as before the split, and
settings users change on a live engine (``journal``, ``max_payload_bytes``, ``group_commit``)
apply at once.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from fsm_runner._group import GroupCommitter
from fsm_runner._json import dumps_json, error_info
from fsm_runner._lazy import LazyModule
from fsm_runner.engine.classify import StepKind
from fsm_runner.engine.decisions import (
    PhaseOutcome,
    PhaseStep,
    handled_error,
    json_size,
    phase_outcome,
)
from fsm_runner.engine.interruption import interruption_cause
from fsm_runner.engine.leases import LeaseKeeper, unleased
from fsm_runner.engine.reducer import ACTIVE as _ACTIVE
from fsm_runner.engine.reducer import (
    abort_records,
    advance_plain,
    artifact_rows,
    iteration_rows,
    take,
    writes_iterations,
)
from fsm_runner.events import (
    DEAD_LETTERED,
    INTERRUPTED,
    RETRIED,
    REWOUND,
    SPEC_CHANGED,
    SYSTEM_ERROR,
    TIMEOUT,
    USER_ABORTED,
)
from fsm_runner.exceptions import (
    FsmRunnerError,
    HandlerResultError,
    InvalidTransitionError,
    PayloadError,
    PhaseError,
    PhaseTimeoutError,
    RunAbortedError,
    RunConflictError,
    RunTerminalError,
    SpecMismatchError,
)
from fsm_runner.journal import Journal
from fsm_runner.journal.base import Commit
from fsm_runner.machine import CompiledMachine, Guard
from fsm_runner.phases import PhaseContext, PhaseHandler, PhaseResult
from fsm_runner.records import (
    ArtifactRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    positional_builder,
    utc_now,
)
from fsm_runner.spec import RETURN, MachineSpec, RunOutcome, State

if TYPE_CHECKING:
    import asyncio
else:  # imported on first use: a sync run never needs it (see _lazy)
    asyncio = LazyModule("asyncio", globals())

__all__ = ["PLAIN_RETURNS", "Listener", "Planned", "StepWriter", "new_commit", "take_now"]

#: Called with each transition after it is committed, and the run row it produced.
Listener = Callable[[TransitionRecord, RunRecord], None]
#: A phase handler split into its ``run`` and its optional ``validate`` (see ``split_handler``).
HandlerParts = tuple[Callable[[PhaseContext], Any], Callable[[PhaseContext], Any] | None]

_log = logging.getLogger("fsm_runner.engine")
# The hot path's record constructors: every field, positionally (see positional_builder).
new_commit = positional_builder(Commit)
#: What handlers return most; checked before the much slower inspect.isawaitable.
PLAIN_RETURNS = (str, PhaseResult, enum.Enum)

#: A transition about to be committed: the transition, the run row it leads to, and the
#: iterations and artifacts written with it (a plain tuple: built on the hot path).
Planned = tuple[TransitionRecord, RunRecord, Sequence[IterationRecord], Sequence[ArtifactRecord]]


def _error_info(exc: BaseException) -> dict[str, Any]:
    # storable whatever the exception: its __str__ may raise, its text hold a lone surrogate
    return error_info(exc)


class StepWriter:
    """The engine's state, and how a step's transition is planned and committed.

    Set up by :class:`~fsm_runner.engine.Engine`'s constructor; the attributes are declared
    here for the drivers that share them.
    """

    spec: MachineSpec
    handlers: dict[str, PhaseHandler]
    guards: dict[str, Guard]
    journal: Journal
    services: Mapping[str, Any]
    listeners: list[Listener]
    clock: Callable[[], float]
    allow_spec_change: bool
    worker_id: str
    max_recoveries: int
    max_payload_bytes: int
    group_commit: bool
    _machine: CompiledMachine
    _spec_json: str
    #: the phases running in this process, by run id
    _active: dict[str, PhaseContext]
    #: run and validate of each state with a handler
    _by_state: dict[str, HandlerParts]
    _states: dict[str, State]
    #: states whose step takes a driver's fast path: the handler's plain callable
    _fast: dict[str, Callable[[PhaseContext], Any]]
    _plain_edges: Mapping[tuple[str, str], str]
    _returning: frozenset[str]
    _logger_names: dict[str, str]
    #: aborts to carry out at a run's next step (requested here, or seen by the heartbeat)
    _aborts: dict[str, str]
    _lock: threading.Lock
    _leases: LeaseKeeper
    _committer: GroupCommitter | None

    def _adopt_spec(self, run: RunRecord) -> RunRecord:
        """Move a run that started under another spec to this one (``allow_spec_change``).

        A ``SPEC_CHANGED`` self transition of the same visit records the switch, and the run
        row names the new spec from then on, so replay follows the run through both.
        """
        if run.spec_hash == self.spec.spec_hash:
            return run
        transition, after = take_now(
            self.spec,
            run,
            SPEC_CHANGED,
            run.state,
            result={"output": {"from_spec": run.spec_hash, "to_spec": self.spec.spec_hash}},
            duration_ms=0.0,
            kind="spec_change",  # the row names the new spec from here on
        )
        self.journal.commit(after, transition, spec_json=self._spec_json)
        self._notify(transition, after)
        return after

    def _park(self, run: RunRecord) -> RunRecord:
        message = (
            f"its worker was lost {run.recoveries} times (more than max_recoveries="
            f"{self.max_recoveries}); fork it to try again"
        )
        return self._write(self._plan_in_place(run, DEAD_LETTERED, message, kind="park"))[1]

    def _commit_held(
        self,
        run_id: str,
        event: str,
        kind: StepKind,
        dest: Callable[[RunRecord], str],
        result: Callable[[RunRecord], Mapping[str, Any] | None],
    ) -> RunRecord:
        """Claim the run, commit one transition decided on the claimed row, and let go of it."""
        run = self._leases.claim(run_id)
        try:
            planned = self._plan(
                run, event, dest(run), result=result(run), duration_ms=0.0, kind=kind
            )
            run = self._write(planned)[1]
        finally:
            self._leases.let_go(run_id)
        return unleased(run)

    def _after_refusal(self, run_id: str, refused: RunConflictError) -> RunRecord:
        """The run after the journal refused a step; raises ``refused`` unless an abort is why.

        A run another writer ended (an abort from elsewhere) is returned as it ended; a run
        with an abort requested is returned for its next step to carry the abort out.
        """
        run = self.journal.load(run_id)
        if not run.ended and run.abort_reason is None:
            raise refused
        return run

    def _rewind_target(self, run: RunRecord, state: str) -> str:
        """The leaf ``run`` can be rewound to for ``state``, or InvalidTransitionError."""
        run_id = run.run_id
        self._check_runnable(run)
        if not self.spec.has_state(state):
            reason = f"not possible: machine {self.spec.name!r} has no state {state!r},"
            raise InvalidTransitionError(
                run_id=run_id, state=run.state, event=REWOUND, reason=reason
            )
        leaf = self.spec.entry_leaf(state) if self.spec.state(state).composite else state
        if self.spec.state(leaf).terminal:
            raise InvalidTransitionError(
                run_id=run_id,
                state=run.state,
                event=REWOUND,
                reason=f"not possible: {state!r} is a terminal state,",
            )
        if not any(t.to_state == leaf for t in self.journal.transitions(run_id)):
            raise InvalidTransitionError(
                run_id=run_id,
                state=run.state,
                event=REWOUND,
                reason=f"not possible: the run has never been in {leaf!r},",
            )
        return leaf

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

    def _close_phase(self, run_id: str) -> None:
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

    def _journal_interruption(self, run: RunRecord, exc: BaseException) -> None:
        """Journal INTERRUPTED as a self transition; the run stays resumable.

        The phase that was interrupted runs again, as its next attempt, when the run resumes.
        """
        message = f"interrupted {interruption_cause(exc)} in {run.state!r}"
        try:
            try:
                self._write(self._plan_in_place(run, INTERRUPTED, message, kind="interruption"))
            except RunConflictError as refused:
                if refused.abort_reason is None:
                    raise
                # An abort was requested while the phase ran: it is carried out instead.
                self._commit_abort(self.journal.load(run.run_id), refused.abort_reason)
        except FsmRunnerError:
            # Journaling is best effort here: the run is still at its last committed state,
            # and resuming runs the phase again either way.
            _log.exception("could not journal the interruption of run %s", run.run_id)

    def _commit_abort(self, run: RunRecord, reason: str) -> tuple[TransitionRecord, RunRecord]:
        return self._write(self._plan_abort(run, reason))

    def _plan_abort(self, run: RunRecord, reason: str) -> Planned:
        transition, after = abort_records(self.spec, run, reason, self.guards, at=utc_now())
        return transition, after, (), ()

    def _plan_retry(self, step: PhaseStep, outcome: PhaseOutcome) -> Planned:
        assert outcome.error is not None
        error = _error_info(outcome.error)
        return self._plan(
            step.run,
            RETRIED,
            step.state.name,
            result={"error": error},
            duration_ms=outcome.duration_ms,
            kind="retry",
        )

    def _decide(self, step: PhaseStep, outcome: PhaseOutcome) -> Planned:
        """The transition a phase's outcome leads to, and what to write with it (not written)."""
        run = step.run
        if isinstance(outcome.error, RunAbortedError):
            return self._plan_abort(run, outcome.error.reason)
        if outcome.error is not None:
            error = _error_info(outcome.error)
            event = TIMEOUT if isinstance(outcome.error, PhaseTimeoutError) else SYSTEM_ERROR
            if event == TIMEOUT and not self._machine.allows(run.state, TIMEOUT):
                event = SYSTEM_ERROR
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

    def _write(self, planned: Planned) -> tuple[TransitionRecord, RunRecord]:
        """Commit a planned transition, then tell the listeners."""
        transition, after, iterations, artifacts = planned
        if iterations or artifacts:
            self.journal.commit(after, transition, iterations=iterations, artifacts=artifacts)
        else:
            self.journal.commit(after, transition)
        return self._committed(transition, after)

    async def _awrite(self, planned: Planned) -> tuple[TransitionRecord, RunRecord]:
        """Commit a planned transition with other runs' in one transaction (group commit).

        Returns once the transaction is durable, so the run's next phase cannot start before.
        """
        committer = self._group_committer()
        if committer is None:
            return self._write(planned)
        transition, after, iterations, artifacts = planned
        await committer.submit(new_commit(after, transition, iterations, artifacts, None))
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
        if after.status is not _ACTIVE or transition.event == USER_ABORTED:
            with self._lock:
                self._aborts.pop(after.run_id, None)
        if self.listeners:
            self._notify(transition, after)
        return transition, after

    def _plan_in_place(
        self, run: RunRecord, event: str, message: str, *, kind: StepKind
    ) -> Planned:
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
    ) -> Planned:
        """Build the transition, the run row it leads to and the rows written with it."""
        transition, after = take_now(
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

    @functools.cached_property
    def _plain_outcomes(self) -> dict[str, RunOutcome]:
        """The states a plain step may enter, each with the run's status there.

        A plain step (:func:`~fsm_runner.engine.reducer.advance_plain`) enters neither a state
        that starts an iteration nor one with a RETURN exit. One lookup a step instead of
        reading both (and the final outcome) off the state.
        """
        return {
            name: state.final_outcome
            for name, state in self._states.items()
            if not state.starts_iteration and name not in self._returning
        }

    def _plan_plain(self, run: RunRecord, event: str, dest: str, duration_ms: float) -> Planned:
        """Plan a bare event outside iterations: the reducer's plain step where it applies.

        Positional calls only; keyword arguments cost on every step.
        """
        status = self._plain_outcomes.get(dest)
        if status is None or run.iteration or run.return_to is not None:
            return self._plan(run, event, dest, result=None, duration_ms=duration_ms)
        transition, after = advance_plain(run, event, dest, status, duration_ms, utc_now())
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


def take_now(
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
