"""The effects ledger and per-state capabilities: side effects recorded before they happen.

A phase performs each external side effect through ``ctx.effect(name, fn, *args, kind=...)``:

1. the state's capabilities are checked — an operation kind the state does not allow, or a
   mutation past its ``max_mutations``, raises :class:`CapabilityError` and records nothing;
2. the effect is committed to the journal as ``in_flight`` (kind, parameters, idempotency key);
3. ``fn`` is called (given ``idempotency_key=...`` if it takes that argument);
4. its result (or its error) is committed.

When a run resumes, the same call finds the record of its visit: an effect recorded **done**
returns its recorded result without calling ``fn`` (exactly once for recorded effects); one
recorded **failed** raises :class:`EffectFailedError` again unless the handler passes
``retry_failed=True``; one found **in flight** — the process died during the call — raises
:class:`EffectOutcomeUnknownError`, unless the effect was declared ``idempotent``, in which case
it is called again with the same idempotency key.

An effect caught in flight that is not idempotent waits for an operator, who finds out whether
it happened and records the answer (:func:`settled`, ``fsm-runner settle``): **done** with its
result (a resumed run then returns that result without calling ``fn``) or **failed** with a
reason (a resumed run raises :class:`EffectFailedError`, as for an effect that failed). Who
settled it and why are kept in the record's ``error`` (``settled_by``, ``reason``), beside the
``type`` and ``message`` a failure carries.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fsm_runner._json import dumps_json, exception_message
from fsm_runner._shown import shown
from fsm_runner.exceptions import (
    CapabilityError,
    EffectFailedError,
    EffectMismatchError,
    EffectOutcomeUnknownError,
    LeaseHeldError,
    PayloadError,
)
from fsm_runner.records import EffectRecord, EffectStatus, RunRecord, format_utc, utc_now
from fsm_runner.telemetry import current as current_telemetry

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from fsm_runner.journal.base import Journal
    from fsm_runner.spec import State

__all__ = [
    "MUTATE",
    "PEEK",
    "PUBLISH",
    "READ",
    "SETTLED",
    "EffectCaller",
    "SettleRefusedError",
    "perform",
    "settle_effect",
    "settled",
]

#: The standard operation kinds; hosts may use their own strings.
READ = "read"
MUTATE = "mutate"
PEEK = "topic_peek"
PUBLISH = "topic_publish"


class EffectCaller(Protocol):
    """What the ledger reads of the phase an effect is called from (a ``PhaseContext``).

    A protocol, so that this module sits below :mod:`fsm_runner.phases`, which calls it.
    """

    @property
    def run(self) -> RunRecord:
        """The run as journaled before the phase."""

    @property
    def closed(self) -> bool:
        """Whether the phase has returned."""

    @property
    def effect_names(self) -> dict[str, str]:
        """The effects the phase has called so far, name → kind."""


def _takes_key(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "idempotency_key" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def _canonical(value: Any, *, run_id: str, what: str) -> str:
    try:  # the journals' own encoder: what it refuses could not be recorded
        text = dumps_json(value, sort_keys=True)
    except ValueError as exc:
        raise PayloadError(run_id=run_id, what=what, detail=str(exc)) from None
    if not text.isascii():  # the text idempotency keys have always been derived from
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text


def perform(  # noqa: PLR0917 - ctx.effect's arguments
    ctx: EffectCaller,
    journal: Journal | None,
    state: State | None,
    name: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    kind: str,
    idempotency_key: str | None,
    idempotent: bool,
    retry_failed: bool,
) -> Any:
    """Carry out one ``ctx.effect`` call; see the module docstring.

    Raises:
        CapabilityError: outside a running phase, a kind the state does not allow, or a
            mutation past the state's limit; nothing is recorded.
        EffectMismatchError: the name was used twice in the visit, or the record found for it
            has another kind or other parameters.
        EffectOutcomeUnknownError: the effect was caught in flight and is not idempotent.
        EffectFailedError: the effect is recorded as failed (and ``retry_failed`` is not set).
        PayloadError: the parameters or the result are not JSON-serialisable.
    """
    run = ctx.run
    if journal is None or state is None or ctx.closed:
        raise CapabilityError(state=None, operation=kind, detail=f" (effect {name!r})")
    _check_capability(ctx, state, name, kind)
    params = {"args": list(args), "kwargs": kwargs}
    canonical = _canonical(params, run_id=run.run_id, what=f"effect {name!r} parameters")
    visit = run.visit_seq
    key = (
        idempotency_key
        or hashlib.sha256(f"{run.run_id}\0{visit}\0{name}\0{canonical}".encode()).hexdigest()[:32]
    )
    ctx.effect_names[name] = kind
    call = (fn, args, kwargs)
    telemetry = current_telemetry()
    if telemetry is None:
        return _recorded_or_carried_out(
            ctx, journal, state, name, kind, canonical, key, call, idempotent, retry_failed
        )
    with telemetry.effect(run, name, kind, key, state.name) as span:
        try:
            result = _recorded_or_carried_out(
                ctx, journal, state, name, kind, canonical, key, call, idempotent, retry_failed,
                span,
            )  # fmt: skip
        except EffectOutcomeUnknownError:
            span.set_attribute("fsm_runner.effect.status", "unknown")
            raise
        except Exception:
            span.set_attribute("fsm_runner.effect.status", EffectStatus.FAILED.value)
            raise
        span.set_attribute("fsm_runner.effect.status", EffectStatus.DONE.value)
        return result


def _recorded_or_carried_out(  # noqa: PLR0917 - perform's, passed on
    ctx: EffectCaller,
    journal: Journal,
    state: State,
    name: str,
    kind: str,
    canonical: str,
    key: str,
    call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
    idempotent: bool,
    retry_failed: bool,
    span: Span | None = None,
) -> Any:
    """The effect's recorded result if it is done; else recorded in flight and carried out.

    ``span``: its telemetry span, if on (told whether the result was recorded before).
    """
    run = ctx.run
    visit = run.visit_seq
    found = journal.effect(run.run_id, visit, name)
    if span is not None:
        span.set_attribute("fsm_runner.effect.recorded", found is not None)
    if found is not None:
        _check_recorded(
            found, ctx, state, kind, canonical, idempotent=idempotent, retry_failed=retry_failed
        )
        if found.status is EffectStatus.DONE:
            return found.result  # exactly once: never called again
        key = found.idempotency_key
    fn, args, kwargs = call
    record = EffectRecord(
        run_id=run.run_id,
        visit_seq=visit,
        name=name,
        state=state.name,
        kind=kind,
        params={"args": list(args), "kwargs": kwargs},
        idempotency_key=key,
        idempotent=idempotent,
        started_at=utc_now(),
    )
    return _carry_out(ctx, journal, record, fn, args, kwargs, span)


def _check_capability(ctx: EffectCaller, state: State, name: str, kind: str) -> None:
    """Refuse an effect the state may not perform, or a name already used in the visit.

    Raises:
        CapabilityError: a kind the state does not allow, or a mutation past its limit.
        EffectMismatchError: the name was used before in this visit.
    """
    if state.allows is not None and kind not in state.allows:
        allowed = ", ".join(state.allows) or "nothing"
        raise CapabilityError(
            state=state.name, operation=kind, detail=f" (effect {name!r}; it allows {allowed})"
        )
    if name in ctx.effect_names:
        raise EffectMismatchError(
            run_id=ctx.run.run_id,
            state=state.name,
            effect=name,
            detail="is used twice in one visit",
        )
    if kind == MUTATE and state.max_mutations is not None:
        done = sum(1 for k in ctx.effect_names.values() if k == MUTATE)
        if done >= state.max_mutations:
            raise CapabilityError(
                state=state.name,
                operation=kind,
                detail=f" more than {state.max_mutations} time(s) per visit (effect {name!r})",
            )


def _check_recorded(
    found: EffectRecord,
    ctx: EffectCaller,
    state: State,
    kind: str,
    canonical: str,
    *,
    idempotent: bool,
    retry_failed: bool,
) -> None:
    """Refuse to go on from the visit's record of the effect where the ledger says not to.

    A record that is done is fine (its result is returned); a failed one is fine with
    ``retry_failed``, and one in flight when the effect is idempotent (called again).

    Raises:
        EffectMismatchError: the record has another kind or other parameters.
        EffectFailedError: it failed (and ``retry_failed`` is not set).
        EffectOutcomeUnknownError: it was caught in flight and is not idempotent.
    """
    run_id, name = ctx.run.run_id, found.name
    if found.kind != kind or _canonical(found.params, run_id=run_id, what="") != canonical:
        raise EffectMismatchError(
            run_id=run_id,
            state=state.name,
            effect=name,
            detail="was recorded with another kind or other parameters in this visit",
        )
    if found.status is EffectStatus.FAILED and not retry_failed:
        error = found.error or {}
        raise EffectFailedError(
            run_id=run_id,
            effect=name,
            error_type=str(error.get("type")),
            message=str(error.get("message")),
        )
    if found.status is EffectStatus.IN_FLIGHT and not (idempotent or found.idempotent):
        raise EffectOutcomeUnknownError(run_id=run_id, state=state.name, effect=name)


def _carry_out(  # noqa: PLR0917 - the record, and the call to make
    ctx: EffectCaller,
    journal: Journal,
    record: EffectRecord,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    span: Span | None = None,
) -> Any:
    """Record the effect in flight, call ``fn``, and record how it ended; return its result."""
    run = ctx.run
    # Committed before the effect happens, and only while this worker still holds the lease.
    journal.put_effect(record, run_seq=run.seq, lease_token=run.lease_token)
    if span is not None:
        span.add_event("fsm_runner.effect.in_flight")
    call_kwargs = dict(kwargs)
    if _takes_key(fn) and "idempotency_key" not in call_kwargs:
        call_kwargs["idempotency_key"] = record.idempotency_key
    try:
        result = fn(*args, **call_kwargs)
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": exception_message(exc)}
        failed = _ended(record, EffectStatus.FAILED, error=error)
        journal.put_effect(failed, run_seq=run.seq, lease_token=run.lease_token)
        raise
    try:
        _canonical(result, run_id=run.run_id, what=f"effect {record.name!r} result")
    except PayloadError as exc:
        # It happened, but its result cannot be kept: record that plainly, not "unknown".
        error = {"type": "PayloadError", "message": str(exc)}
        unreadable = _ended(record, EffectStatus.FAILED, error=error)
        journal.put_effect(unreadable, run_seq=run.seq, lease_token=run.lease_token)
        raise
    done = _ended(record, EffectStatus.DONE, result=result)
    journal.put_effect(done, run_seq=run.seq, lease_token=run.lease_token)
    return result


def _ended(record: EffectRecord, status: EffectStatus, **outcome: Any) -> EffectRecord:
    """The in-flight ``record`` as it ended: ``status``, now, and its result or error."""
    return EffectRecord(
        **{**_fields(record), "status": status, "completed_at": utc_now()}, **outcome
    )


def _fields(record: EffectRecord) -> dict[str, Any]:
    return {
        "run_id": record.run_id,
        "visit_seq": record.visit_seq,
        "name": record.name,
        "state": record.state,
        "kind": record.kind,
        "params": record.params,
        "idempotency_key": record.idempotency_key,
        "idempotent": record.idempotent,
        "started_at": record.started_at,
    }


#: The error ``type`` of an effect an operator settled as failed.
SETTLED = "SettledByOperator"


def settled(
    record: EffectRecord, *, done: bool, result: Any = None, reason: str, by: str
) -> EffectRecord:
    """``record`` (caught in flight) as an operator settled it: done with ``result``, or failed.

    ``by`` and ``reason`` are kept in its ``error`` (``settled_by``, ``reason``); a failed one's
    ``type`` is :data:`SETTLED` and its ``message`` the reason, which a resumed run raises as
    :class:`EffectFailedError`.
    """
    who = {"settled_by": by, "reason": reason}
    if done:
        return _ended(record, EffectStatus.DONE, result=result, error=who)
    return _ended(record, EffectStatus.FAILED, error={"type": SETTLED, "message": reason, **who})


class SettleRefusedError(ValueError):
    """:func:`settle_effect` refused: ``reason`` is ``not_found``, ``conflict`` or ``usage``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def settle_effect(
    journal: Journal,
    run_id: str,
    name: str,
    *,
    done: bool,
    result: Any = None,
    reason: str,
    by: str,
    visit_seq: int | None = None,
) -> EffectRecord:
    """Record an operator's answer for the run's effect ``name`` caught in flight (:func:`settled`).

    Written through ``put_effect`` at the run's current seq (no lease token: nobody may hold
    the run). ``visit_seq`` picks the visit when several have the effect in flight.

    Raises:
        RunNotFoundError: no such run.
        LeaseHeldError: a live lease holds the run (a worker may be calling the effect now).
        SettleRefusedError: no such effect (``not_found``), none in flight (``conflict``), or
            in flight in several visits and no ``visit_seq`` (``usage``).
    """
    run = journal.load(run_id)
    named = [e for e in journal.effects(run_id) if e.name == name]
    if visit_seq is not None:
        named = [e for e in named if e.visit_seq == visit_seq]
    waiting = [e for e in named if e.status is EffectStatus.IN_FLIGHT]
    if not named:
        raise SettleRefusedError(f"run {shown(run_id)} has no effect {name!r}", "not_found")
    if not waiting:
        raise SettleRefusedError(
            f"effect {name!r} of run {shown(run_id)} is not in flight", "conflict"
        )
    if len(waiting) > 1:
        visits = ", ".join(str(e.visit_seq) for e in waiting)
        raise SettleRefusedError(
            f"effect {name!r} is in flight in visits {visits}: name one", "usage"
        )
    expires = run.lease_expires_at
    if run.lease_owner is not None and expires is not None and expires > utc_now():
        raise LeaseHeldError(run_id, owner=run.lease_owner, expires_at=format_utc(expires))
    record = settled(waiting[0], done=done, result=result, reason=reason, by=by)
    journal.put_effect(record, run_seq=run.seq)
    return record
