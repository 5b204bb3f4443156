"""The step core: a machine's spec, handlers and journal, and how a step's transition is written.

:class:`StepCore` is what both drivers (:mod:`.sync_driver`, :mod:`.async_driver`) hold: the
spec and its compiled machine, the handlers, the journal and the settings a step reads. Per
step it turns a phase's outcome into the transition it leads to (:meth:`StepCore.decide`,
with the pure rules of :mod:`fsm_runner.rules`), plans the rows written with it (``plan*``:
not written yet) and commits them (:meth:`StepCore.write`), then tells the listeners. It also
writes the engine's own transitions that no phase decides: a run's start (planned by
:meth:`StepCore.new_run`), a spec change, a park, an abort, an interruption.

It knows no lease and no event loop: the drivers claim runs through the lease keeper, call the
handlers, and hand the outcome here.
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
import os
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from fsm_runner._convert import format_utc
from fsm_runner._json import dumps_json, error_info
from fsm_runner.engine import waits
from fsm_runner.engine.held import HeldRuns
from fsm_runner.engine.interruption import interruption_cause
from fsm_runner.events import (
    DEAD_LETTERED,
    INTERRUPTED,
    RETRIED,
    REWOUND,
    SPEC_CHANGED,
    STARTED,
    SYSTEM_ERROR,
    TIMEOUT,
    USER_ABORTED,
    WAITING,
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
    SpecError,
    SpecMismatchError,
)
from fsm_runner.journal import Journal, SqliteJournal
from fsm_runner.journal.base import Commit
from fsm_runner.machine import Guard, compile_spec
from fsm_runner.phases import PhaseContext, PhaseHandler, PhaseResult, PhaseWaits, split_handler
from fsm_runner.records import (
    ArtifactRecord,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    positional_builder,
    utc_now,
)
from fsm_runner.rules.classify import StepKind
from fsm_runner.rules.decisions import (
    PhaseOutcome,
    PhaseStep,
    handled_error,
    json_size,
    phase_outcome,
)
from fsm_runner.rules.reducer import ACTIVE as _ACTIVE
from fsm_runner.rules.reducer import (
    abort_records,
    advance_plain,
    artifact_rows,
    begin_fields,
    iteration_rows,
    take,
    writes_iterations,
)
from fsm_runner.run_ids import check_run_id
from fsm_runner.spec import RETURN, MachineSpec, RunLifecycle
from fsm_runner.telemetry import Telemetry

__all__ = [
    "PLAIN_RETURNS",
    "Listener",
    "Planned",
    "StepCore",
    "new_commit",
    "random_ids",
    "take_now",
]

#: Called with each transition after it is committed, and the run row it produced.
Listener = Callable[[TransitionRecord, RunRecord], None]
#: A phase handler split into its ``run`` and its optional ``validate`` (see ``split_handler``).
HandlerParts = tuple[Callable[[PhaseContext], Any], Callable[[PhaseContext], Any] | None]

_log = logging.getLogger("fsm_runner.engine")
# The hot path's record constructors: every field, positionally (see positional_builder).
new_commit = positional_builder(Commit)
_new_transition = positional_builder(TransitionRecord)
#: What handlers return most; checked before the much slower inspect.isawaitable.
PLAIN_RETURNS = (str, PhaseResult, enum.Enum)

#: A transition about to be committed: the transition, the run row it leads to, and the
#: iterations and artifacts written with it (a plain tuple: built on the hot path).
Planned = tuple[TransitionRecord, RunRecord, Sequence[IterationRecord], Sequence[ArtifactRecord]]

#: uuid4's bits: the version (4) and the variant (RFC 4122), as ``uuid.UUID`` sets them.
_UUID4_KEEP = ~(0xF000 << 64) & ~(0xC000 << 48)
_UUID4_SET = (4 << 76) | (0x8000 << 48)


def random_ids(count: int) -> list[str]:
    """``count`` new run ids, each what ``uuid.uuid4().hex`` gives, from one ``os.urandom``."""
    data = os.urandom(16 * count)
    return [
        f"{int.from_bytes(data[at : at + 16], 'big') & _UUID4_KEEP | _UUID4_SET:032x}"
        for at in range(0, 16 * count, 16)
    ]


class StepCore:
    """A machine's spec, handlers and journal, and how each step's transition is written.

    The settings are plain attributes, read at each use: a changed ``journal`` or
    ``max_payload_bytes`` applies from the next step. The tables built from the spec
    (``states``, ``fast``, ``plain_edges``, ``plain_outcomes``...) are the drivers' to read.

    Args:
        spec: the machine every run follows.
        handlers: phase handlers by the names the spec's states give.
        journal: where runs are journaled; a :class:`SqliteJournal` at ``fsm-runner.db`` in
            the current directory when not given (opened once the spec is known valid).
        held: the runs the process holds (its phases, its aborts); a new one when not given.
        The others: as :class:`~fsm_runner.engine.Engine` takes them.

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
        held: HeldRuns | None = None,
        guards: Mapping[str, Guard] | None = None,
        services: Mapping[str, Any] | None = None,
        listeners: Iterable[Listener] = (),
        clock: Callable[[], float] = time.monotonic,
        allow_spec_change: bool = False,
        max_recoveries: int = 3,
        max_payload_bytes: int = 16 * 1024 * 1024,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.spec = spec
        self.handlers = dict(handlers)
        self.guards = dict(guards or {})
        spec.validate(handlers=self.handlers, guards=self.guards)
        try:
            parts = {name: split_handler(h) for name, h in self.handlers.items()}
        except TypeError as exc:
            raise SpecError([str(exc)], machine=spec.name) from None
        self.machine = compile_spec(spec)
        self.journal: Journal = journal if journal is not None else SqliteJournal()
        self.held = held or HeldRuns()
        self.services: Mapping[str, Any] = types.MappingProxyType(dict(services or {}))
        self.listeners = list(listeners)
        self.clock = clock
        self.allow_spec_change = allow_spec_change
        self.max_recoveries = max_recoveries
        self.max_payload_bytes = max_payload_bytes
        self.spec_json = spec.to_json()
        self.initial = spec.state(spec.initial_leaf)
        #: run and validate of each state with a handler
        self.by_state: dict[str, HandlerParts] = {
            state.name: parts[state.handler] for state in spec.leaves if state.handler
        }
        self.states = {state.name: state for state in spec.leaves}
        self.telemetry = telemetry  # OpenTelemetry's spans and instruments, if on
        #: States whose handler is a plain callable with no validate() and no timeout: their
        #: step takes a driver's inlined hot path (none with telemetry: it has the spans).
        self.fast = {
            name: run_fn
            for name, (run_fn, validate_fn) in self.by_state.items()
            if validate_fn is None and self.states[name].timeout is None and telemetry is None
        }
        self.plain_edges = self.machine.plain_edges
        self.logger_names = {
            state.name: f"fsm_runner.phase.{spec.name}.{state.name}" for state in spec.leaves
        }
        #: The states a plain step (:func:`~fsm_runner.rules.reducer.advance_plain`) may
        #: enter, each with the run's status there: neither a state that starts an iteration
        #: nor one with a RETURN exit. One lookup a step instead of reading both off the state.
        self.plain_outcomes: dict[str, RunLifecycle] = {
            name: state.final_outcome
            for name, state in self.states.items()
            if not state.starts_iteration and name not in spec.returning_states
        }

    # -- a run's start and the checks before a step ----------------------------------------------

    def new_run(
        self,
        input: Any,  # noqa: A002 - as in Engine.start()
        run_id: str | None,
        context: Mapping[str, Any] | None,
        parent_run_id: str | None,
        lease: tuple[str, dt.timedelta] | None,
    ) -> tuple[RunRecord, TransitionRecord, list[IterationRecord]]:
        """A new run's row, its transition seq 0 and its opened iteration, checked for storage.

        ``lease``: the worker id and lease duration the run is stored holding, or ``None``.
        Nothing is written.
        """
        initial = self.initial
        # The rule of run ids refuses a lone surrogate too (not printable): UTF-8 holds the id.
        run_id = random_ids(1)[0] if run_id is None else check_run_id(run_id)
        now = utc_now()
        iteration = 1 if initial.starts_iteration else 0
        # the journal alone reproduces the run row (invariant 8), initial context included
        seeded: dict[str, Any] | None = {"context": dict(context)} if context else None
        if self.telemetry is not None:  # its drives continue the trace its start is in
            trace = self.telemetry.start_carrier(run_id, self.spec.name)
            seeded = {**(seeded or {}), "trace": trace}
        first = _new_transition(
            run_id, 0, None, STARTED, initial.name, iteration, 1, now, 0.0, seeded, 0
        )
        # What the transition does not say; the reducer derives the rest from seq 0.
        if lease is not None and not initial.terminal:  # as a claim would leave it
            owner, expires, token = lease[0], now + lease[1], 1
        else:
            owner, expires, token = None, None, 0
        spec = self.spec
        run = begin_fields(
            spec, first, run_id, spec.name, spec.spec_hash, input, now, parent_run_id,
            owner, expires, token,
        )  # fmt: skip
        self.check_json(run_id, "input", input)
        if run.context:
            self.check_json(run_id, "context", run.context)
        opened = (
            [IterationRecord(run_id, 1, state=initial.name, started_at=now)] if iteration else []
        )
        return run, first, opened

    def check_runnable(self, run: RunRecord, *, check_spec: bool = True) -> None:
        """Raise unless the run may take a step under this spec."""
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

    def adopt_spec(self, run: RunRecord) -> RunRecord:
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
        self.journal.commit(after, transition, spec_json=self.spec_json)
        self.notify(transition, after)
        return after

    def rewind_target(self, run: RunRecord, state: str) -> str:
        """The leaf ``run`` can be rewound to for ``state``, or InvalidTransitionError."""
        run_id = run.run_id
        self.check_runnable(run)
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

    def after_refusal(self, run_id: str, refused: RunConflictError) -> RunRecord:
        """The run after the journal refused a step; raises ``refused`` unless an abort is why.

        A run another writer ended (an abort from elsewhere) is returned as it ended; a run
        with an abort requested is returned for its next step to carry the abort out.
        """
        run = self.journal.load(run_id)
        if self.telemetry is not None:
            self.telemetry.fenced(run.machine)
        if not run.ended and run.abort_reason is None:
            raise refused
        return run

    # -- a phase -------------------------------------------------------------------------------

    def prepare(self, run: RunRecord) -> PhaseStep | None:
        """The phase of the run's state, about to run (its context held active).

        ``None`` when the state has no handler (it waits for an event).
        """
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
            self.logger_names[state.name],
            self.journal,
            state,
        )
        self.held.active[run.run_id] = ctx
        return PhaseStep(run, state, ctx, started)

    def wait_move(self, run: RunRecord) -> tuple[TransitionRecord | None, RunRecord]:
        """A run held where it waits: consume a signal, or time out (``None``: it waits on).

        See :mod:`fsm_runner.engine.waits`: in a waiting state, the oldest pending signal the
        state accepts, else the wait's ``on_timeout`` once its deadline has passed; for a run
        its phase parked, ``WOKEN`` by the signal it waits for or its time. Committed with the
        signal it consumes in one transaction, then the listeners are told. A run that waits
        on is marked parked here (its let-go parks it).
        """
        if waits.parked_phase(run) is not None:
            move = waits.phase_move(self.journal, self.spec, run)
        elif self.spec.wait_of(run.state) is not None:
            move = waits.next_move(self.journal, self.spec, run, self.guards)
        else:
            return None, run
        if move is None:
            with self.held.lock:
                self.held.parked.add(run.run_id)
            return None, run
        waits.write_move(self.journal, move)
        return self.committed(move[0], move[1])

    def park_phase(
        self, step: PhaseStep, waits_for: PhaseWaits
    ) -> tuple[TransitionRecord, RunRecord]:
        """A phase asked to wait (``ctx.wait_for``/``sleep_until``): journal ``WAITING``.

        A self transition of the same visit whose result's error says what the run waits
        for and until when (the run row carries it, so whoever holds the run next knows); the
        run is marked parked, so its let-go parks it (see :mod:`fsm_runner.engine.waits`).
        """
        run = step.run
        until = waits_for.until
        what = f"signal {waits_for.signal!r}" if waits_for.signal is not None else "a time"
        error = {
            "type": WAITING,
            "message": f"waiting for {what}" + (f" until {format_utc(until)}" if until else ""),
            "for": waits_for.signal,
            "until": None if until is None else format_utc(until),
        }
        planned = self.plan(
            run,
            WAITING,
            run.state,
            result={"error": error},
            duration_ms=(self.clock() - step.started) * 1000.0,
            kind="wait",
        )
        committed = self.write(planned)
        with self.held.lock:
            self.held.parked.add(run.run_id)
        return committed

    def close_phase(self, run_id: str) -> None:
        """The phase has returned: forget it, and refuse its effects from now on."""
        ctx = self.held.active.pop(run_id, None)
        if ctx is not None:
            ctx.close()

    def outcome(self, step: PhaseStep, value: Any, error: BaseException | None) -> PhaseOutcome:
        """What the handler's return ``value`` (or ``error``) came to (the pure decision)."""
        return phase_outcome(
            self.spec,
            step,
            value,
            error,
            clock=self.clock,
            max_payload_bytes=self.max_payload_bytes,
        )

    def journal_interruption(self, run: RunRecord, exc: BaseException) -> None:
        """Journal INTERRUPTED as a self transition; the run stays resumable.

        The phase that was interrupted runs again, as its next attempt, when the run resumes.
        """
        message = f"interrupted {interruption_cause(exc)} in {run.state!r}"
        try:
            try:
                self.write(self.plan_in_place(run, INTERRUPTED, message, kind="interruption"))
            except RunConflictError as refused:
                if refused.abort_reason is None:
                    raise
                # An abort was requested while the phase ran: it is carried out instead.
                self.write(self.plan_abort(self.journal.load(run.run_id), refused.abort_reason))
        except FsmRunnerError:
            # Journaling is best effort here: the run is still at its last committed state,
            # and resuming runs the phase again either way.
            _log.exception("could not journal the interruption of run %s", run.run_id)

    # -- planning a transition (nothing written) ---------------------------------------------------

    def decide(self, step: PhaseStep, outcome: PhaseOutcome) -> Planned:
        """The transition a phase's outcome leads to, and what to write with it (not written)."""
        run = step.run
        if isinstance(outcome.error, RunAbortedError):
            return self.plan_abort(run, outcome.error.reason)
        if outcome.error is not None:
            error = error_info(outcome.error)  # storable whatever the exception
            event = TIMEOUT if isinstance(outcome.error, PhaseTimeoutError) else SYSTEM_ERROR
            if event == TIMEOUT and not self.machine.allows(run.state, TIMEOUT):
                event = SYSTEM_ERROR
            if not self.machine.allows(run.state, event):
                if isinstance(outcome.error, HandlerResultError):
                    raise outcome.error
                raise PhaseError(run_id=run.run_id, state=run.state, event=event, error=error)
            dest = self.machine.resolve(run.state, event, run, self.guards, run_id=run.run_id)
            return self.plan(
                run, event, dest, result={"error": error}, duration_ms=outcome.duration_ms
            )
        result = outcome.result
        assert result is not None
        guarded = run
        if result.context:
            guarded = attrs.evolve(run, context={**run.context, **result.context})
        dest, reason = self.machine.resolve_edge(
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
            return self.plan_plain(run, result.event, dest, outcome.duration_ms)
        payload: dict[str, Any] = {}
        if result.output is not None:
            payload["output"] = result.output
        if result.context:
            payload["context"] = dict(result.context)
        if result.error is not None:
            payload["error"] = handled_error(result.event, result.error)
        if reason:  # the run's error too, where the phase gave none (the reducer's rule)
            payload["reason"] = reason
        return self.plan(
            run,
            result.event,
            dest,
            result=payload or None,
            duration_ms=outcome.duration_ms,
            iteration_updates=result.iteration,
            artifacts=result.artifacts,
        )

    def plan_abort(self, run: RunRecord, reason: str) -> Planned:
        """The abort of a run: its ``USER_ABORTED`` transition, or a stop where it stands."""
        transition, after = abort_records(self.spec, run, reason, self.guards, at=utc_now())
        return transition, after, (), ()

    def plan_retry(self, step: PhaseStep, outcome: PhaseOutcome) -> Planned:
        """A ``RETRIED`` self transition: the failed attempt, recorded; the next one follows."""
        assert outcome.error is not None
        return self.plan(
            step.run,
            RETRIED,
            step.state.name,
            result={"error": error_info(outcome.error)},
            duration_ms=outcome.duration_ms,
            kind="retry",
        )

    def plan_park(self, run: RunRecord) -> Planned:
        """Park a run its workers kept losing (``DEAD_LETTERED``), saying why."""
        message = (
            f"its worker was lost {run.recoveries} times (more than max_recoveries="
            f"{self.max_recoveries}); fork it to try again"
        )
        return self.plan_in_place(run, DEAD_LETTERED, message, kind="park")

    def plan_in_place(self, run: RunRecord, event: str, message: str, *, kind: StepKind) -> Planned:
        """A self transition that records why (``event`` as the error's type) and no phase."""
        error = {"type": event, "message": message}
        return self.plan(run, event, run.state, result={"error": error}, duration_ms=0.0, kind=kind)

    def plan(
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

    def plan_plain(self, run: RunRecord, event: str, dest: str, duration_ms: float) -> Planned:
        """Plan a bare event outside iterations: the reducer's plain step where it applies.

        Positional calls only; keyword arguments cost on every step.
        """
        status = self.plain_outcomes.get(dest)
        if status is None or run.iteration or run.return_to is not None:
            return self.plan(run, event, dest, result=None, duration_ms=duration_ms)
        transition, after = advance_plain(run, event, dest, status, duration_ms, utc_now())
        return transition, after, (), ()

    # -- writing it ------------------------------------------------------------------------------

    def write(self, planned: Planned) -> tuple[TransitionRecord, RunRecord]:
        """Commit a planned transition, then tell the listeners."""
        transition, after, iterations, artifacts = planned
        telemetry = self.telemetry
        began = time.perf_counter() if telemetry is not None else 0.0
        if iterations or artifacts:
            self.journal.commit(after, transition, iterations=iterations, artifacts=artifacts)
        else:
            self.journal.commit(after, transition)
        if telemetry is not None:
            telemetry.commit_took(after.machine, time.perf_counter() - began, grouped=False)
        return self.committed(transition, after)

    def committed(
        self, transition: TransitionRecord, after: RunRecord
    ) -> tuple[TransitionRecord, RunRecord]:
        """After a commit: an abort it carried out is done; the listeners are told."""
        if after.status is not _ACTIVE or transition.event == USER_ABORTED:
            held = self.held
            with held.lock:
                held.aborts.pop(after.run_id, None)
        if self.listeners or self.telemetry is not None:
            self.notify(transition, after)
        return transition, after

    def notify(self, transition: TransitionRecord, run: RunRecord) -> None:
        """Count it (telemetry), call every listener; one that fails is logged."""
        if self.telemetry is not None:
            self.telemetry.committed(transition, run)
        for listener in self.listeners:
            try:
                listener(transition, run)
            except Exception:  # noqa: BLE001, PERF203 - a listener must never undo a committed step
                _log.exception(
                    "listener %r failed on %s seq %s", listener, run.run_id, transition.seq
                )

    def check_json(self, run_id: str, what: str, value: Any) -> None:
        """Raise PayloadError unless ``value`` is standard JSON within ``max_payload_bytes``."""
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
    """The reducer's :func:`~fsm_runner.rules.reducer.take`, at the time it is now."""
    return take(
        spec, run, event, dest, result=result, duration_ms=duration_ms, at=utc_now(), kind=kind
    )
