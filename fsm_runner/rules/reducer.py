"""The reducer: the run row a transition leads to, derived in one place (invariant 8).

A run's row is a projection of its transitions. The engine builds each row here from the
transition it is about to commit, and :mod:`fsm_runner.replay` rebuilds each row here from the
transition the journal holds, so the two agree by construction. Everything is pure: no journal,
no clock (the caller passes the time), no I/O; what a step needs is passed in.

How a transition is read (its :data:`StepKind`) decides the derivation: a ``retry`` or an
``interruption`` continues the visit as its next attempt; a ``stop`` (``USER_ABORTED`` where the
state has no exit for it) and a ``park`` (``DEAD_LETTERED``) end the run where it stands; a
``spec_change`` continues the visit under another spec; a ``return`` goes back to the state the
run came from, as the next attempt of that visit; a ``transition`` or a ``rewind`` begins a new
visit.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from fsm_runner.events import SYSTEM_ERROR, TIMEOUT, USER_ABORTED
from fsm_runner.exceptions import InvalidTransitionError, SpecError
from fsm_runner.machine import Guard, compile_spec
from fsm_runner.records import (
    ArtifactRecord,
    ErrorType,
    IterationRecord,
    RunRecord,
    TransitionRecord,
    positional_builder,
)
from fsm_runner.rules.classify import StepKind, abort_stops, leaf
from fsm_runner.spec import RETURN, MachineSpec, RunLifecycle, State

__all__ = [
    "ACTIVE",
    "StepKind",
    "abort_records",
    "advance",
    "advance_plain",
    "advance_read",
    "artifact_rows",
    "begin",
    "begin_fields",
    "iteration_rows",
    "take",
    "writes_iterations",
]

#: Kinds that continue the visit the run is on (no new visit, no new iteration).
_SAME_VISIT: frozenset[str] = frozenset(
    {"retry", "interruption", "stop", "park", "spec_change", "wait"}
)
#: Kinds that are the next attempt of the visit.
_NEXT_ATTEMPT: frozenset[str] = frozenset({"retry", "interruption"})
#: Kinds whose transition is the spec's: a guard's reason becomes the run's error.
_SPEC_KINDS: frozenset[str] = frozenset({"transition", "return"})
_EMPTY: Mapping[str, Any] = {}
# The plain step's record constructors: every field, positionally (see positional_builder).
_new_run = positional_builder(RunRecord)
_new_transition = positional_builder(TransitionRecord)
#: Read once: an enum member looked up on its class costs ~70 ns (Python 3.11), once a step
#: (the drivers and the commit planner read it from here too).
ACTIVE = RunLifecycle.ACTIVE


def begin(spec: MachineSpec, run: RunRecord, transition: TransitionRecord) -> RunRecord:
    """The run row right after its seq-0 transition (``STARTED`` into the initial leaf).

    Args:
        spec: the spec the run started under.
        run: a row giving what the transitions do not say (id, machine, spec hash, input,
            ``created_at``, parent, fork origin, lease, recoveries).
        transition: the run's transition seq 0; its ``result["context"]`` is the initial context.

    Returns:
        The derived row.
    """
    return begin_fields(
        spec,
        transition,
        run.run_id,
        run.machine,
        run.spec_hash,
        run.input,
        run.created_at,
        run.parent_run_id,
        run.lease_owner,
        run.lease_expires_at,
        run.lease_token,
        run.forked_from,
        run.abort_reason,
        run.recoveries,
    )


def begin_fields(  # noqa: PLR0917 - positional on purpose: every start calls it
    spec: MachineSpec,
    transition: TransitionRecord,
    run_id: str,
    machine: str,
    spec_hash: str,
    input: Any,  # noqa: A002 - the run's field
    created_at: dt.datetime,
    parent_run_id: str | None,
    lease_owner: str | None,
    lease_expires_at: dt.datetime | None,
    lease_token: int,
    forked_from: str | None = None,
    abort_reason: str | None = None,
    recoveries: int = 0,
) -> RunRecord:
    """:func:`begin` given the fields of the row it reads, not the row (no row built to be read).

    Every other field is derived from the seq-0 ``transition``, as :func:`begin` derives it.
    """
    entered = leaf(spec, transition.to_state)
    result = transition.result if isinstance(transition.result, Mapping) else _EMPTY
    context = result.get("context")
    seq = transition.seq
    # attrs.evolve(run, ...) with these fields, built positionally (every start builds one)
    return _new_run(
        run_id,
        machine,
        spec_hash,
        transition.to_state,
        ACTIVE if entered is None else entered.final_outcome,
        seq,
        1 if entered is not None and entered.starts_iteration else 0,
        1,
        input,
        dict(context) if isinstance(context, Mapping) else {},
        None,
        created_at,
        transition.at,
        parent_run_id,
        forked_from,
        abort_reason,
        lease_owner,
        lease_expires_at,
        lease_token,
        None,
        0,
        seq,
        0,
        recoveries,
    )


def _iteration(run: RunRecord, entered: State | None, kind: StepKind) -> int:
    """The iteration after entering ``entered``: a new one where a new visit of a starter begins."""
    starts = entered is not None and entered.starts_iteration and kind != "return"
    return run.iteration + (starts and kind not in _SAME_VISIT)


def advance(
    spec: MachineSpec, run: RunRecord, transition: TransitionRecord, kind: StepKind
) -> RunRecord:
    """The run row ``transition`` leads ``run`` to, read as ``kind``.

    Derived: state, status, seq, iteration, attempt, visit and return target, context (a
    phase's ``result["context"]`` merged in), error (the phase's ``result["error"]``, or the
    spec transition's ``reason``), ``updated_at``, the spec hash after a ``spec_change``, the
    abort request (cleared by ``USER_ABORTED``) and the lease holder (none once the run has
    ended: the commit that ends a run ends its lease). Everything else is carried over from
    ``run``.

    Args:
        spec: the spec the run is under.
        run: the row before the transition.
        transition: the transition (its ``to_state`` already resolved: never RETURN).
        kind: how the transition is read (see :data:`StepKind`).

    Returns:
        The row after the transition.
    """
    dest, seq = transition.to_state, transition.seq
    entered = leaf(spec, dest)
    attempt, visit_seq, return_to, return_attempt, return_visit = _visit(spec, run, dest, seq, kind)
    result = transition.result
    if isinstance(result, Mapping) and result:
        spec_hash, context, error = _from_result(run, result, transition.event, kind)
    else:
        spec_hash, context, error = run.spec_hash, run.context, None
    status = _status(entered, kind)
    held = status is ACTIVE  # a run that ends lets go of its lease
    # The constructor, not attrs.evolve: this runs once per step and evolve costs ~3x more.
    return RunRecord(
        run.run_id,
        run.machine,
        spec_hash,
        dest,
        status,
        seq,
        _iteration(run, entered, kind),
        attempt,
        run.input,
        context,
        error,
        run.created_at,
        transition.at,
        run.parent_run_id,
        run.forked_from,
        None if transition.event == USER_ABORTED else run.abort_reason,
        run.lease_owner if held else None,
        run.lease_expires_at if held else None,
        transition.lease_token,
        return_to,
        return_attempt,
        visit_seq,
        return_visit,
        run.recoveries,
    )


def advance_read(  # noqa: PLR0917 - positional on purpose: a replay's hot path
    run: RunRecord,
    transition: TransitionRecord,
    status: RunLifecycle,
    starts_iteration: bool,
    returning: bool,
    spec_hash: str,
    abort_reason: str | None,
    lease_owner: str | None,
    lease_expires_at: dt.datetime | None,
    lease_token: int,
) -> RunRecord:
    """:func:`advance` of a ``transition`` read from a journal as a plain spec step.

    A replay's hot path: ``transition`` has no result and follows a spec edge into a leaf
    (:func:`~fsm_runner.rules.classify.plain_reads` gives ``status``, whether the leaf starts an
    iteration and whether it has a RETURN exit); the row is the one :func:`advance` derives for
    it as a ``transition``, but for what the transitions do not say, which the caller gives
    (replay: the run row's at its last seq, else the spec it was under and no abort request or
    lease holder), so no second row is built to carry them.
    """
    dest, seq = transition.to_state, transition.seq
    if dest == run.state:  # as _visit: a self transition keeps where to return to
        back = run.return_to, run.return_attempt, run.return_visit
    elif returning:  # remember where to come back to
        back = run.state, run.attempt, run.visit_seq
    else:
        back = None, 0, 0
    return _new_run(
        run.run_id,
        run.machine,
        spec_hash,
        dest,
        status,
        seq,
        run.iteration + starts_iteration,
        1,
        run.input,
        run.context,
        None,
        run.created_at,
        transition.at,
        run.parent_run_id,
        run.forked_from,
        abort_reason,
        lease_owner,
        lease_expires_at,
        lease_token,
        back[0],
        back[1],
        seq,
        back[2],
        run.recoveries,
    )


def _visit(
    spec: MachineSpec, run: RunRecord, dest: str, seq: int, kind: StepKind
) -> tuple[int, int, str | None, int, int]:
    """The attempt, visit seq and return target (state, attempt, visit) after the step.

    A ``return`` is the next attempt of the visit it returns to; a kind that continues the
    visit keeps it (a retry or an interruption as its next attempt, a spec change as the same
    one); anything else begins a new visit at ``seq`` (a spec's own self transition too),
    remembering where to come back to when ``dest`` has a RETURN exit.
    """
    if kind == "return":
        return run.return_attempt + 1, run.return_visit, None, 0, 0
    if kind in _SAME_VISIT:
        if kind in _NEXT_ATTEMPT:
            attempt = run.attempt + 1
        else:
            attempt = run.attempt if kind in ("spec_change", "wait") else 1
        return attempt, run.visit_seq, run.return_to, run.return_attempt, run.return_visit
    if dest == run.state:  # a self transition keeps where to return to
        return 1, seq, run.return_to, run.return_attempt, run.return_visit
    if dest in spec.returning_states:  # remember where to come back to
        return 1, seq, run.state, run.attempt, run.visit_seq
    return 1, seq, None, 0, 0


def _status(entered: State | None, kind: StepKind) -> RunLifecycle:
    """The run's status after the step: a stop or a park ends it where it stands."""
    if kind == "stop":
        return RunLifecycle.ABORTED
    if kind == "park":
        return RunLifecycle.DEAD_LETTER
    return RunLifecycle.ACTIVE if entered is None else entered.final_outcome


def _from_result(
    run: RunRecord, result: Mapping[str, Any], event: str, kind: StepKind
) -> tuple[str, Mapping[str, Any], Any]:
    """The spec hash, context and error after a step whose transition has a result.

    A ``spec_change`` names its new spec (``result["output"]["to_spec"]``); the phase's
    ``result["context"]`` is merged into the run's; the error is the phase's
    ``result["error"]``, or else a spec transition's ``reason``.
    """
    spec_hash = run.spec_hash
    if kind == "spec_change":
        output = result.get("output")
        new = output.get("to_spec") if isinstance(output, Mapping) else None
        if isinstance(new, str):
            spec_hash = new
    context = run.context
    update = result.get("context")
    if isinstance(update, Mapping) and update:
        context = {**context, **update}
    error = result.get("error")
    if error is None and kind in _SPEC_KINDS:
        reason = result.get("reason")
        if reason:
            error = {"type": event, "message": reason}
    return spec_hash, context, error


def take(
    spec: MachineSpec,
    run: RunRecord,
    event: str,
    dest: str,
    *,
    result: Mapping[str, Any] | None,
    duration_ms: float,
    at: dt.datetime,
    kind: StepKind = "transition",
) -> tuple[TransitionRecord, RunRecord]:
    """Build the transition ``run`` takes on ``event`` to ``dest``, and the row it leads to.

    ``dest`` may be :data:`RETURN`: the state the run came from into the one it is in, entered
    again as the next attempt of that visit (read as a ``return``, and journaled with
    ``result["returned"]``).

    Args:
        spec: the spec the run is under.
        run: the row before the transition.
        event: the event.
        dest: the destination, or RETURN.
        result: the transition's result (output, context, error, reason).
        duration_ms: how long the phase took.
        at: when the transition happens (UTC).
        kind: how the transition is to be read (see :data:`StepKind`).

    Returns:
        The transition and the run row after it.

    Raises:
        InvalidTransitionError: ``dest`` is RETURN but the run came from nowhere to return to.
    """
    if dest == RETURN:
        if run.return_to is None:
            raise InvalidTransitionError(
                run_id=run.run_id,
                state=run.state,
                event=event,
                reason="a RETURN transition, but the run came from nowhere to return to,",
            )
        dest, kind = run.return_to, "return"
        # The journal says it was a return: a spec may also lead to the same state directly
        # on the same event (behind a guard), and replay must tell the two apart.
        result = {**(result or {}), "returned": True}
    transition = TransitionRecord(
        run.run_id,
        run.seq + 1,
        run.state,
        event,
        dest,
        _iteration(run, leaf(spec, dest), kind),
        run.attempt,
        at,
        duration_ms,
        result,
        run.lease_token,
    )
    return transition, advance(spec, run, transition, kind)


def advance_plain(  # noqa: PLR0917 - positional on purpose: the hot path
    run: RunRecord,
    event: str,
    dest: str,
    status: RunLifecycle,
    duration_ms: float,
    at: dt.datetime,
) -> tuple[TransitionRecord, RunRecord]:
    """:func:`take` for a plain step, the hot path: positional calls, no checks.

    A plain step is a spec ``transition`` with no result, outside iterations, from a run with
    nowhere to return to into a state that is neither a starter of iterations nor one with a
    RETURN exit (the caller checks); ``status`` is ``dest``'s ``final_outcome``. It gives what
    :func:`take` gives for it, with the fields that are constant written out.
    """
    seq = run.seq + 1
    run_id = run.run_id
    held = status is ACTIVE  # a run that ends lets go of its lease (see advance)
    transition = _new_transition(
        run_id, seq, run.state, event, dest, 0, run.attempt, at, duration_ms, None,
        run.lease_token,
    )  # fmt: skip
    after = _new_run(
        run_id,
        run.machine,
        run.spec_hash,
        dest,
        status,
        seq,
        0,
        1,
        run.input,
        run.context,
        None,
        run.created_at,
        at,
        run.parent_run_id,
        run.forked_from,
        run.abort_reason,
        run.lease_owner if held else None,
        run.lease_expires_at if held else None,
        run.lease_token,
        None,
        0,
        seq,  # a new visit: a plain step is never a retry or an interruption
        0,
        run.recoveries,
    )
    return transition, after


def writes_iterations(
    run: RunRecord, after: RunRecord, event: str, updates: Mapping[str, Any] | None
) -> bool:
    """Whether a transition from ``run`` to ``after`` writes iteration records."""
    return (after.iteration > 0 or run.iteration > 0) and bool(
        updates
        or after.iteration != run.iteration
        or after.ended
        or event in (SYSTEM_ERROR, TIMEOUT)
    )


def _touch(record: IterationRecord, state: str, now: dt.datetime) -> IterationRecord:
    started = record.started_at or now
    return attrs.evolve(
        record,
        state=state,
        started_at=started,
        completed_at=now,
        duration_ms=(now - started).total_seconds() * 1000.0,
    )


def iteration_rows(
    run: RunRecord,
    after: RunRecord,
    transition: TransitionRecord,
    updates: Mapping[str, Any],
    current: IterationRecord | None,
) -> list[IterationRecord]:
    """The iteration records a transition writes.

    A phase's updates go to the iteration it ran in; a transition into a ``starts_iteration``
    state also opens the next iteration's record.

    Args:
        run: the row before the transition.
        after: the row after it.
        transition: the transition.
        updates: the phase's iteration updates.
        current: the journal's record of ``run``'s iteration, if it has one.

    Returns:
        The records to write with the transition.
    """
    now = transition.at
    rows: list[IterationRecord] = []
    starts_next = after.iteration != run.iteration
    if run.iteration > 0:
        if current is None:
            current = IterationRecord(run.run_id, run.iteration, started_at=run.updated_at)
        changes = dict(updates)
        if transition.event in (SYSTEM_ERROR, TIMEOUT) and "error_type" not in changes:
            error = transition.result.get("error") if transition.result else None
            error = error if isinstance(error, Mapping) else {}
            changes["error_type"] = (
                ErrorType.TIMEOUT if transition.event == TIMEOUT else ErrorType.SYSTEM_ERROR
            )
            changes["error_message"] = f"{error.get('type')}: {error.get('message')}"
        if changes:
            current = attrs.evolve(current, **changes)
        rows.append(_touch(current, run.state if starts_next else after.state, now))
    if starts_next:
        opened = IterationRecord(after.run_id, after.iteration, started_at=now)
        rows.append(_touch(opened, after.state, now))
    return rows


def artifact_rows(
    artifacts: Sequence[ArtifactRecord], transition: TransitionRecord, after: RunRecord
) -> list[ArtifactRecord]:
    """A phase's artifacts as written with its transition (run, seq, iteration and time set)."""
    return [
        attrs.evolve(
            artifact,
            run_id=after.run_id,
            seq=transition.seq,
            iteration=after.iteration,
            created_at=transition.at,
        )
        for artifact in artifacts
    ]


def abort_records(
    spec: MachineSpec,
    run: RunRecord,
    reason: str,
    guards: Mapping[str, Guard] | None,
    *,
    at: dt.datetime,
) -> tuple[TransitionRecord, RunRecord]:
    """The ``USER_ABORTED`` transition of ``run`` and the row it leads to.

    The run follows its state's ``USER_ABORTED`` exit (guards read the run) or, where the state
    has none, stops where it is with status ``aborted``.

    Raises:
        SpecError: the exit needs a guard that ``guards`` lacks.
    """
    machine = compile_spec(spec)
    error = {"type": USER_ABORTED, "message": reason}
    kind: StepKind = "transition"
    if not abort_stops(spec, run.state):
        try:
            dest = machine.resolve(run.state, USER_ABORTED, run, guards or {}, run_id=run.run_id)
        except KeyError as exc:
            raise SpecError(
                [
                    f"the USER_ABORTED transition from {run.state!r} needs guard {exc.args[0]!r}; "
                    "abort through an engine (or `fsm-runner abort --app`) that has it"
                ],
                machine=spec.name,
            ) from None
    else:
        dest, kind = run.state, "stop"  # no abort exit: the run stops where it is
    return take(
        spec, run, USER_ABORTED, dest, result={"error": error}, duration_ms=0.0, at=at, kind=kind
    )
