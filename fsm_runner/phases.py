"""Phase handlers: what runs on entry to a state, what it is given, and what it returns.

A handler is thin glue between the machine and the host's services. It is either a plain
callable ``handler(ctx)`` or an object with ``run(ctx)`` (and optionally ``validate(ctx)``),
sync or ``async``. It returns a :class:`PhaseResult`, or for short just the event (a string or a
str enum) or a :class:`fsm_runner.PhaseStatus`. Raising is fine: the engine journals
``SYSTEM_ERROR`` with the exception's type, message and traceback, and follows the spec.
"""

from __future__ import annotations

import datetime as dt
import enum
import inspect
import logging
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from fsm_runner.effects import perform
from fsm_runner.events import WAITING, WOKEN, PhaseStatus, event_name
from fsm_runner.exceptions import PhaseTimeoutError, RunAbortedError, WaitTimeoutError
from fsm_runner.records import ArtifactRecord, RunRecord, SignalRecord, utc_now

if TYPE_CHECKING:
    from fsm_runner.journal.base import Journal
    from fsm_runner.spec import State

__all__ = [
    "HandlerReturn",
    "PhaseContext",
    "PhaseHandler",
    "PhaseHandlerObject",
    "PhaseResult",
    "PhaseWaits",
    "to_phase_result",
]


class StatusEvent(str):
    """The event of a :class:`PhaseStatus` given to :class:`PhaseResult`, still to be mapped.

    It reads as the status's standard event; the engine replaces it with the event the spec's
    ``status_events`` names for that status before anything is journaled.
    """

    __slots__ = ("status",)
    status: PhaseStatus

    def __new__(cls, status: PhaseStatus) -> StatusEvent:
        event = super().__new__(cls, status.event.value)
        event.status = status
        return event


def _event_or_status(value: str | enum.Enum) -> str:
    if isinstance(value, PhaseStatus):
        return StatusEvent(value)
    return event_name(value)


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(value or {}))


def _artifact_tuple(value: Iterable[ArtifactRecord]) -> tuple[ArtifactRecord, ...]:
    return tuple(value)


@attrs.frozen
class PhaseResult:
    """What a phase reports back to the engine.

    Args:
        event: what happened (``BUILD_FAILED``, ``VERIFY_PASSED``, a host event …), or a
            :class:`PhaseStatus` (reported as the event the spec maps it to); the spec decides
            where it leads.
        output: JSON-serialisable output of the phase, journaled with the transition (checked
            at write time: anything else — NaN or Infinity, nesting deeper than 255 levels, a
            lone surrogate included — is refused with a clear error).
        context: updates merged into the run's context (JSON-serialisable, likewise).
        error: a description of a failure the phase handled itself (a string or a JSON object).
        iteration: updates to the current iteration's record (fields of
            :class:`fsm_runner.records.IterationRecord`: tokens, cost, levels run …), written in
            the same transaction as the transition.
        artifacts: artifacts to journal with the transition (see
            :class:`fsm_runner.records.ArtifactRecord`).
    """

    event: str = attrs.field(converter=_event_or_status)
    output: Any = None
    context: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    error: str | Mapping[str, Any] | None = None
    iteration: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)
    artifacts: tuple[ArtifactRecord, ...] = attrs.field(default=(), converter=_artifact_tuple)


#: What a handler may return.
HandlerReturn = PhaseResult | str | enum.Enum | PhaseStatus


class PhaseWaits(Exception):  # noqa: N818 - not an error: how a phase asks to be parked
    """Raised by ``ctx.wait_for``/``ctx.sleep_until`` to end the phase and park the run.

    The engine journals a ``WAITING`` self transition and lets go of the run; the phase runs
    again once the signal (or the time) comes. Do not catch it in a handler: a handler that
    swallows it goes on as if the wait had been answered.

    Attributes:
        signal: the signal waited for, or ``None`` for a sleep.
        until: when the wait ends without one (UTC), or ``None`` for never.
    """

    def __init__(self, signal: str | None, until: dt.datetime | None) -> None:
        self.signal = signal
        self.until = until
        super().__init__(f"waiting for {signal or 'a time'}")


class PhaseContext:
    """Everything a phase handler may look at; it cannot change the run except by returning.

    Built by the engine for each phase (cheaply: it sits on the hot path).

    Attributes:
        run: a read-only snapshot of the run as journaled before this phase.
        services: the host's services, injected into the engine (read-only mapping).
        deadline: the clock time by which the phase must end, or ``None``.
        timeout: the state's timeout in seconds, or ``None``.
    """

    __slots__ = (
        "_abort_reason",
        "_clock",
        "_closed",
        "_effect_names",
        "_journal",
        "_logger",
        "_logger_name",
        "_state",
        "deadline",
        "run",
        "services",
        "timeout",
    )

    def __init__(  # noqa: PLR0917 - the engine builds one per step, positionally
        self,
        run: RunRecord,
        services: Mapping[str, Any],
        clock: Callable[[], float],
        deadline: float | None = None,
        timeout: float | None = None,
        logger_name: str = "fsm_runner.phase",
        journal: Journal | None = None,
        state: State | None = None,
    ) -> None:
        self.run = run
        self.services = services
        self.deadline = deadline
        self.timeout = timeout
        self._clock = clock
        self._logger_name = logger_name
        self._logger: logging.LoggerAdapter[logging.Logger] | None = None
        self._abort_reason: str | None = None
        self._journal = journal
        self._state = state
        self._closed = False
        self._effect_names: dict[str, str] | None = None

    @property
    def closed(self) -> bool:
        """Whether the phase has returned (effects are refused from then on)."""
        return self._closed

    def close(self) -> None:
        """Mark the phase as over (the engine calls this when the handler returns)."""
        self._closed = True

    @property
    def effect_names(self) -> dict[str, str]:
        """The effects this phase has called so far, name → kind."""
        if self._effect_names is None:
            self._effect_names = {}
        return self._effect_names

    def effect(
        self,
        name: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        kind: str = "read",
        idempotency_key: str | None = None,
        idempotent: bool = False,
        retry_failed: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Perform an external side effect through the journal's effects ledger.

        Recorded ``in_flight`` (committed) before ``fn(*args, **kwargs)`` is called, then with
        its result or error. On resume a done effect returns its recorded result without calling
        ``fn``; see :mod:`fsm_runner.effects` for failed and in-flight ones.

        Args:
            name: unique within this visit of the state.
            fn: what performs the effect; given ``idempotency_key=`` if it accepts it.
            *args: ``fn``'s positional arguments (recorded as the effect's parameters).
            **kwargs: ``fn``'s keyword arguments (recorded too).
            kind: the operation kind, checked against the state's ``allows``.
            idempotency_key: the key to record (derived from run, visit, name and parameters
                when not given).
            idempotent: it may be called again after a crash caught it in flight.
            retry_failed: call it again even though it is recorded as failed.

        Raises:
            CapabilityError: the state does not allow it, or the phase is over.
            EffectOutcomeUnknownError: caught in flight by a crash, and not idempotent.
            EffectFailedError: recorded as failed, and ``retry_failed`` not set.
            EffectMismatchError: the name is reused, or recorded with other parameters.
        """
        return perform(
            self,
            self._journal,
            self._state,
            name,
            fn,
            args,
            kwargs,
            kind=kind,
            idempotency_key=idempotency_key,
            idempotent=idempotent,
            retry_failed=retry_failed,
        )

    def output_of(self, state: str) -> Any:
        """The output of the last phase of ``state`` in this run, read from the journal.

        How a later phase reads an earlier one's result (the prepare result, the mutation
        result …) — never from globals. ``None`` if that state has not produced one.
        """
        if self._journal is None:
            return None
        for transition in reversed(self._journal.transitions(self.run.run_id)):
            if transition.from_state == state and transition.output is not None:
                return transition.output
        return None

    def _visit_transitions(self) -> list[Any]:
        if self._journal is None:
            return []
        run = self.run
        return list(self._journal.transitions(run.run_id, from_seq=run.visit_seq))

    def wait_for(self, name: str, *, timeout: float | None = None) -> Any:
        """Wait for the signal ``name`` from inside the phase; return its payload.

        The first time, the phase ends here (:class:`PhaseWaits`: do not catch it) and the
        run is parked where it is, holding no lease, until the signal comes
        (``Engine.signal``; one sent earlier is in the run's mailbox already) or ``timeout``
        seconds have passed; then the phase runs again from its start, and this call returns
        the signal's payload at once. Effects recorded before the wait are not repeated (the
        visit goes on). The state must declare the signal (``State(signals=...)``).

        Raises:
            WaitTimeoutError: the wait timed out with no signal (a ``PhaseTimeoutError``: the
                engine journals ``TIMEOUT`` unless the handler catches it).
            ValueError: the state does not declare the signal.
        """
        state = self._state
        if state is None or name not in state.signals:
            where = "this phase" if state is None else f"state {state.name!r}"
            raise ValueError(f"{where} does not declare signal {name!r} (State(signals=...))")
        until: dt.datetime | None = None
        for transition in reversed(self._visit_transitions()):
            result = transition.result if isinstance(transition.result, Mapping) else {}
            if transition.event == WOKEN and result.get("for") == name:
                if result.get("timed_out"):
                    raise WaitTimeoutError(state=state.name, signal=name, timeout=timeout)
                return result.get("output")
            error = result.get("error")
            if (
                transition.event == WAITING
                and isinstance(error, Mapping)
                and error.get("for") == name
                and isinstance(error.get("until"), str)
            ):
                until = dt.datetime.fromisoformat(error["until"])  # the first wait's deadline
        if until is None and timeout is not None:
            until = utc_now() + dt.timedelta(seconds=timeout)
        raise PhaseWaits(name, until)

    def sleep_until(self, when: dt.datetime) -> None:
        """Return once ``when`` (an aware datetime) has come; until then the run is parked.

        The phase ends here (:class:`PhaseWaits`) and the run is parked, holding no lease and
        no process, until ``when``, across restarts; then the phase runs again from its start
        and this call returns. Effects recorded before it are not repeated.
        """
        if when.tzinfo is None:
            raise ValueError("sleep_until needs an aware datetime (UTC)")
        if utc_now() >= when:
            return
        raise PhaseWaits(None, when.astimezone(dt.timezone.utc))

    @property
    def signal(self) -> SignalRecord | None:
        """The signal whose consumption began this visit of the state, if one did.

        A state entered on a signal (an approval, say) reads its name and payload here.
        """
        if self._journal is None:
            return None
        run = self.run
        visit = run.visit_seq
        (entered,) = self._journal.transitions(run.run_id, from_seq=visit, to_seq=visit)
        number = entered.result.get("signal") if isinstance(entered.result, Mapping) else None
        if not isinstance(number, int):
            return None
        signals = getattr(self._journal, "signals", None)
        if signals is None:
            return None
        return next((s for s in signals(run.run_id) if s.number == number), None)

    @property
    def previous_state(self) -> str | None:
        """The state the run was in before this one (``None`` at its start)."""
        if self._journal is None or self.run.visit_seq == 0:
            return None
        visit = self.run.visit_seq  # the transition that began this visit, not a retry's
        (entered,) = self._journal.transitions(self.run.run_id, from_seq=visit, to_seq=visit)
        return entered.from_state

    def __repr__(self) -> str:
        return f"PhaseContext(run_id={self.run.run_id!r}, state={self.run.state!r})"

    @property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger for the phase, named after the machine and state, carrying the run id."""
        if self._logger is None:
            self._logger = logging.LoggerAdapter(
                logging.getLogger(self._logger_name),
                {"run_id": self.run.run_id, "state": self.run.state},
            )
        return self._logger

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.run.run_id

    @property
    def state(self) -> str:
        """The state whose phase is running."""
        return self.run.state

    @property
    def iteration(self) -> int:
        """The run's current iteration."""
        return self.run.iteration

    @property
    def attempt(self) -> int:
        """Which attempt of this visit this is (1-based): escalate on later attempts."""
        return self.run.attempt

    @property
    def input(self) -> Any:
        """The JSON input the run was started with."""
        return self.run.input

    @property
    def context(self) -> Mapping[str, Any]:
        """A read-only view of the run's context."""
        return types.MappingProxyType(dict(self.run.context))

    @property
    def cancelled(self) -> bool:
        """Whether an abort of the run was requested while this phase runs."""
        return self._abort_reason is not None

    @property
    def remaining(self) -> float | None:
        """Seconds left before the deadline (may be negative), or ``None`` without one."""
        if self.deadline is None:
            return None
        return self.deadline - self._clock()

    def check(self) -> None:
        """Raise if the phase should stop now; call it between units of work.

        Raises:
            RunAbortedError: an abort of the run was requested.
            PhaseTimeoutError: the phase is past its deadline.
        """
        if self._abort_reason is not None:
            raise RunAbortedError(run_id=self.run_id, reason=self._abort_reason)
        if self.deadline is not None and self._clock() >= self.deadline:
            raise PhaseTimeoutError(state=self.state, timeout=self.timeout)

    def request_cancel(self, reason: str) -> None:
        """Tell the phase an abort was requested (the engine calls this; handlers need not)."""
        self._abort_reason = reason


@runtime_checkable
class PhaseHandlerObject(Protocol):
    """A handler as an object: ``run(ctx)`` does the work, ``validate(ctx)`` is optional.

    If the object also has ``validate(ctx)``, it is called first; when it returns a result
    (not ``None``), that result is used and ``run`` is not called (e.g. a precondition failed).
    Either method may be ``async``.
    """

    def run(self, ctx: PhaseContext) -> HandlerReturn | Awaitable[HandlerReturn]:
        """Do the phase's work and say what happened."""


#: A phase handler: a callable taking the context, or an object with ``run(ctx)``.
PhaseHandler = (
    Callable[[PhaseContext], HandlerReturn | Awaitable[HandlerReturn]] | PhaseHandlerObject
)


def split_handler(
    handler: PhaseHandler,
) -> tuple[Callable[[PhaseContext], Any], Callable[[PhaseContext], Any] | None]:
    """Return the handler's ``run`` and ``validate`` callables.

    Raises:
        TypeError: if ``handler`` is neither callable nor has a callable ``run``.
    """
    run = getattr(handler, "run", None)
    if callable(run) and not inspect.isfunction(handler) and not inspect.ismethod(handler):
        validate = getattr(handler, "validate", None)
        return run, validate if callable(validate) else None
    if callable(handler):
        return handler, None
    raise TypeError(f"a phase handler must be callable or have run(ctx), not {handler!r}")


_PLAIN: dict[str, PhaseResult] = {}


def to_phase_result(value: object) -> PhaseResult | None:
    """Read a handler's return value as a :class:`PhaseResult`; ``None`` if it is not one."""
    if type(value) is str:
        # The hot path: a bare event. Results are frozen, so one per event can be shared.
        result = _PLAIN.get(value)
        if result is None and value:
            result = PhaseResult(value)
            if len(_PLAIN) < 1024:
                _PLAIN[value] = result
        return result
    if isinstance(value, PhaseResult):
        return value
    if isinstance(value, PhaseStatus):
        return PhaseResult(value.event)
    if isinstance(value, (str, enum.Enum)):
        try:
            return PhaseResult(value) if event_name(value) else None
        except TypeError:
            return None
    return None
