"""Pure decisions about a phase: what its handler's return came to, and whether to retry it.

No journal and no I/O: the engine hands in the step, the value the handler returned (or the
error it raised), its clock and its payload limit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import attrs

from fsm_runner._json import dumps_json, printable
from fsm_runner.events import PhaseStatus
from fsm_runner.exceptions import HandlerResultError, PhaseTimeoutError, RunAbortedError
from fsm_runner.phases import PhaseContext, PhaseResult, StatusEvent, to_phase_result
from fsm_runner.records import ITERATION_FIELDS, RunRecord, unstructure
from fsm_runner.spec import MachineSpec, State

__all__ = [
    "PhaseOutcome",
    "PhaseStep",
    "handled_error",
    "json_size",
    "payload_problem",
    "phase_outcome",
    "retry_wait",
]


class PhaseOutcome(NamedTuple):
    """What calling a handler came to: a result, or the error it raised."""

    result: PhaseResult | None
    error: BaseException | None
    duration_ms: float


class PhaseStep(NamedTuple):
    """One phase about to run (plain tuples: built once per step on the hot path)."""

    run: RunRecord
    state: State
    ctx: PhaseContext
    started: float


def handled_error(event: str, error: object) -> dict[str, Any]:
    """What is journaled of a failure a phase handled itself (``PhaseResult.error``)."""
    if isinstance(error, Mapping):
        return dict(error)
    # a str is the handler's own payload (checked like its output); anything else, such as the
    # exception it caught, is described as printably as it can be
    message = error if isinstance(error, str) else printable(error)
    return {"type": event, "message": message}


def json_size(text: str) -> int:
    """Bytes of ``text`` as UTF-8 (what the journal stores)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def phase_outcome(
    spec: MachineSpec,
    step: PhaseStep,
    value: Any,
    error: BaseException | None,
    *,
    clock: Callable[[], float],
    max_payload_bytes: int,
) -> PhaseOutcome:
    """What a handler's return ``value`` (or the ``error`` it raised) comes to.

    A status is mapped to the event the spec gives it; a value that is not a result, a payload
    the journal would refuse (see :func:`payload_problem`) or a return past the state's deadline
    is an error of the phase.
    """
    duration_ms = (clock() - step.started) * 1000.0
    if error is not None:
        return PhaseOutcome(None, error, duration_ms)
    if isinstance(value, PhaseStatus):  # the spec says which event each status reports
        result: PhaseResult | None = PhaseResult(spec.status_event(value))
    else:
        result = to_phase_result(value)
        if result is not None and isinstance(result.event, StatusEvent):
            mapped = spec.status_event(result.event.status)
            result = attrs.evolve(result, event=mapped)
    if result is None:
        detail = (
            f"returned {type(value).__name__} {value!r:.80}; expected a PhaseResult, an event"
            " (str or str enum) or a PhaseStatus"
        )
        return PhaseOutcome(
            None,
            HandlerResultError(run_id=step.run.run_id, state=step.state.name, detail=detail),
            duration_ms,
        )
    if (
        result.output is not None
        or result.context
        or result.iteration
        or result.artifacts
        or result.error is not None
    ):
        problem = payload_problem(step, result, max_payload_bytes)
        if problem is not None:
            return PhaseOutcome(None, problem, duration_ms)
    deadline = step.ctx.deadline
    if deadline is not None and clock() > deadline:
        timeout = PhaseTimeoutError(state=step.state.name, timeout=step.state.timeout)
        return PhaseOutcome(None, timeout, duration_ms)
    return PhaseOutcome(result, None, duration_ms)


def payload_problem(
    step: PhaseStep, result: PhaseResult, max_payload_bytes: int
) -> HandlerResultError | None:
    """Why the journal would refuse ``result``'s payload, or ``None`` if it would not.

    Unknown iteration fields, iteration updates outside iterations, a payload that is not
    standard JSON or is over ``max_payload_bytes``.
    """
    unknown = set(result.iteration) - ITERATION_FIELDS
    if unknown:
        detail = f"returned unknown iteration fields {sorted(unknown)}"
        return HandlerResultError(run_id=step.run.run_id, state=step.state.name, detail=detail)
    if result.iteration and step.run.iteration == 0 and not step.state.starts_iteration:
        detail = "returned iteration updates, but the run has no iteration yet"
        return HandlerResultError(run_id=step.run.run_id, state=step.state.name, detail=detail)
    for what, payload in (
        ("output", result.output),
        ("context", dict(result.context)),
        ("iteration", dict(result.iteration)),
        ("artifacts", [unstructure(artifact) for artifact in result.artifacts]),
        ("error", None if result.error is None else handled_error(result.event, result.error)),
    ):
        try:  # the journals' own encoder: refused here, nothing half-written there
            size = json_size(dumps_json(payload))
        except ValueError as exc:
            detail = f"returned {what} that {exc}"
            return HandlerResultError(run_id=step.run.run_id, state=step.state.name, detail=detail)
        if size > max_payload_bytes:
            detail = (
                f"returned {what} of {size:,} bytes as JSON, more than max_payload_bytes="
                f"{max_payload_bytes:,}"
            )
            return HandlerResultError(run_id=step.run.run_id, state=step.state.name, detail=detail)
    return None


def retry_wait(step: PhaseStep, outcome: PhaseOutcome) -> float | None:
    """Seconds to wait before retrying a failed phase, or ``None`` to not retry it."""
    policy = step.state.retry
    if (
        policy is None
        or outcome.error is None
        or isinstance(outcome.error, (PhaseTimeoutError, RunAbortedError, HandlerResultError))
        or step.run.attempt >= policy.max_attempts
    ):
        return None
    return policy.wait(step.run.attempt)
